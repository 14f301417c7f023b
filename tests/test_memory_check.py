"""The memory the project says a GPU holds (issue "The papers' own hardware"): tests/memory_check.py's MemTracker
count under fake tensors against the same step on real tensors, common.memory_estimate (the line a run prints before
its weights load) against that count, and the refusal that follows when a run cannot fit. At tiny widths with the
3B's vocabulary (tests/memory_check.py's "tiny"), a view of 4 x 4 patches."""

import contextlib
import dataclasses
import json

import numpy as np
import pytest

import common
import memory_check as mc
from conftest import qwen_flags

TINY = dict(model="tiny", gpus=("A10 24 GB",), grid=(1, 4, 4), new_tokens=16, target_tokens=12)
LORA = dict(r=8, alpha=16, dropout=0.0, targets=mc.LORA_TARGETS)
SETTINGS = {  # OraPO (reference copy, the ground truth in the pass), MRG-R1 (LoRA), OraPO sharded over 2 ranks
    "orapo": mc.Setting("tiny OraPO", "orapo", world=1, studies=1, G=3, **TINY),
    "mrg_r1": mc.Setting("tiny MRG-R1", "mrg_r1", world=1, studies=2, G=4, lora=LORA, reference=False, **TINY),
    "fsdp": mc.Setting("tiny OraPO, FSDP2 x 2", "orapo", world=2, studies=1, G=4, fsdp=True, **TINY),
}


MEASURED = {}  # each setting's fake-tensor count, once (a few CPU-seconds each)


def measured(name):
    if name not in MEASURED:
        MEASURED[name] = mc.measure(SETTINGS[name])["peak"]
    return MEASURED[name]


def test_fake_tensors_count_the_bytes_real_ones_hold():
    """MemTracker's peak of each phase under FakeTensorMode (IndexMode: real index math) equals the same two steps on
    real tensors, to 1e-4 (the rollout's prefill masks: a few KB of 180 MB): the full-size table is the tracker's
    count of what the code allocates, not a guess."""
    real, fake = mc.measure(SETTINGS["orapo"], fake=False)["peak"], measured("orapo")
    assert real.keys() == fake.keys() and all(real[k] == pytest.approx(fake[k], rel=1e-4) for k in real)
    assert min(real.values()) > 0


@pytest.mark.parametrize(
    "name", ["orapo", pytest.param("mrg_r1", marks=pytest.mark.slow), pytest.param("fsdp", marks=pytest.mark.slow)]
)
def test_the_estimate_a_run_prints_follows_the_tracker(name):
    """common.memory_estimate: the states (weights, gradients, AdamW, the reference copy, FSDP2's shards) within 5 %
    of the optimizer phase the tracker measured, every phase within 30 % and the peak within 20 % (the activation
    terms are per-token rules, checked at full size in tests/MACHINES.md). A slip in the states (AdamW's 8 B, the
    reference, the sharding) moves the first by 10 % or more."""
    estimate = {k: v * 2**30 for k, v in mc.estimate(SETTINGS[name]).items()}
    got = measured(name)
    assert estimate["optimizer"] == pytest.approx(got["optimizer"], rel=0.05)
    for phase, value in estimate.items():
        assert value == pytest.approx(got[phase], rel=0.3) if value else got[phase] == 0 or phase == "rollout"
    assert max(estimate.values()) == pytest.approx(max(got.values()), rel=0.2)


def test_the_estimate_shards_and_drops_what_a_setting_lacks(tmp_path):
    """Hand-checkable relations of the estimate: FSDP2 over 4 divides the states by 4 (less the embedding FSDP2's root
    keeps gathered); no reference copy saves 2 B a linear weight and 4 B the embedding; LoRA trains r (in + out) a
    targeted linear; micro-batches shrink the update's activations and leave the states."""
    mc.qwen_config(mc.TINY_TEXT, mc.TINY_VISION, mc.QWEN3B_IDS)[0].save_pretrained(tmp_path)
    base = common.StepShape(8, 4, 16, reference=True)
    one = common.memory_estimate(str(tmp_path), base, 1)
    four = common.memory_estimate(str(tmp_path), dataclasses.replace(base, fsdp=True), 4)
    embed = 151936 * 64 * 2 / 2**30  # bf16, gathered on every rank
    states = one["optimizer"] - 8 * 151936 * 64 / 2**30  # less AdamW's temporaries of the largest tensor
    assert four["optimizer"] - embed - 8 * 151936 * 64 / 4 / 2**30 == pytest.approx(states / 4)
    plain = common.memory_estimate(str(tmp_path), dataclasses.replace(base, reference=False), 1)
    n = sum(p.numel() for p in mc.build_model(SETTINGS["orapo"], contextlib.nullcontext(), None).parameters())
    assert (one["optimizer"] - plain["optimizer"]) * 2**30 == 2 * (n - 151936 * 64) + 4 * 151936 * 64
    micro = common.memory_estimate(str(tmp_path), dataclasses.replace(base, grad_accum=4), 1)
    assert micro["update"] < one["update"] and micro["optimizer"] == one["optimizer"]


def test_a_run_that_cannot_fit_stops_before_it_loads_naming_what_would(
    tmp_path, small_synthetic, tiny_qwen_dir, caplog
):
    """--gpu-memory states the card: too small for the step but not for its micro-batches, the run ends with one error
    line naming --grad-accum 2, before the weights load and having written nothing; large enough, it prints its peak
    beside the card and goes on."""
    import orapo

    views = np.mean([len(r.image_paths) for r in common.load_annotation(small_synthetic)["train"]])
    step = common.StepShape(4, 9, 4, reference=True)  # orapo.py's: 4 studies x (G 8 + the ground truth)

    def need(**change):
        return max(common.memory_estimate(str(tiny_qwen_dir), dataclasses.replace(step, **change), 1, views).values())

    assert need(grad_accum=2) < need()
    card = common.GPU_RESERVE_GIB + (need() + need(grad_accum=2)) / 2
    out = tmp_path / "run"
    flags = qwen_flags(small_synthetic, tiny_qwen_dir, out, "--steps", "0", "--max-new-tokens", "4")
    with pytest.raises(SystemExit) as stop:
        orapo.main([*flags, "--gpu-memory", str(card)])
    line = str(stop.value)
    assert line.startswith(f"error: --model {tiny_qwen_dir}: ~") and "\n" not in line
    assert "would fit: --grad-accum 2" in line, line
    assert not out.exists() or not any(out.iterdir())
    caplog.set_level("INFO", logger="rrg")
    orapo.main([*flags, "--gpu-memory", "64"])
    assert "GiB per GPU at the step's peak, of 64.0" in caplog.text
    assert json.loads((out / "config.json").read_text())["gpu_memory"] == 64
