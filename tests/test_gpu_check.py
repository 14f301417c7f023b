"""tests/gpu_check.py without a GPU: the preparation, then one line, every file under --out, exit 0; the memory
formula it compares with; its parts run on the CPU with the tiny Qwen2.5-VL, to check the parts themselves."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import gpu_check
from conftest import run_python


def without_pytest(folder: Path) -> dict:
    """The environment of a process that cannot import pytest (the device's image has none): `pytest` and `_pytest`
    first on PYTHONPATH, each raising ModuleNotFoundError, as an absent module does; the processes it starts too."""
    for name in ("pytest.py", "_pytest.py"):
        (folder / name).write_text("raise ModuleNotFoundError('no pytest on the device: gpu_check must not need it')\n")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """`python tests/gpu_check.py --out DIR` with no CUDA device (CUDA_VISIBLE_DEVICES="") and pytest unimportable:
    the process and DIR."""
    out, blocked = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("no_pytest")
    proc = run_python(ROOT / "tests" / "gpu_check.py", "--out", str(out), env=without_pytest(blocked))
    return proc, out


def test_without_cuda_it_prepares_says_so_in_one_line_and_exits_0(prepared):
    """Without pytest, the CPU-side preparation runs (MIMIC-size views, the tiny Qwen2.5-VL, the 3B's and 7B's
    published folders without weights), stdout is one line, the exit status 0, every file under --out, no gpu.json."""
    proc, out = prepared
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and "no CUDA device" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "work"] and not (out / "gpu.json").exists()
    work = out / "work"
    for name, (layers, width) in {"qwen3b": (36, 2048), "qwen7b": (28, 3584)}.items():
        config = json.loads((work / name / "config.json").read_text())["text_config"]
        assert (config["num_hidden_layers"], config["hidden_size"]) == (layers, width)
        assert not list((work / name).glob("*.safetensors"))  # built on the GPU by a part
        pre = json.loads((work / name / "preprocessor_config.json").read_text())
        assert pre["max_pixels"] == 12845056 and "size" not in pre  # the hub's layout
    annotation = json.loads((work / "data" / "annotation.json").read_text())
    views = [r["image_path"] for r in annotation["train"]]
    assert len(views) == 32 and all(len(v) == 1 for v in views)
    from PIL import Image

    with Image.open(work / "data" / "images" / views[0][0]) as im:
        assert im.size == (2544, 3056)


def toy_vl(tied: bool = True, adapter: bool = False) -> torch.nn.Module:
    """Qwen2.5-VL's module names on a few parameters: vision 16 (blocks 3 -> 4), merger 25 (4 -> 5), decoder 30
    (5 -> 5), head 50 (5 -> 10, tied to the input embedding or not); adapter: all frozen but 5 in the decoder (LoRA)."""
    model, core, visual, lm = (torch.nn.Module() for _ in range(4))
    model.model, core.visual, core.language_model = core, visual, lm
    visual.blocks, visual.merger = torch.nn.Linear(3, 4), torch.nn.Linear(4, 5)
    lm.embed_tokens, lm.layers = torch.nn.Embedding(10, 5), torch.nn.Linear(5, 5)
    model.lm_head = torch.nn.Linear(5, 10, bias=False)
    if tied:
        model.lm_head.weight = lm.embed_tokens.weight
    if adapter:
        model.requires_grad_(False)
        lm.adapter = torch.nn.Linear(5, 1, bias=False)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_by_hand(tied):
    """8 patches, 2 image tokens, 7 tokens in the decoder, 3 predicted: the vision tower's parameters count on the
    patches, the merger's on image tokens, the decoder's on every token, the head's on the predicted ones, the input
    embedding (a lookup) nowhere, nothing recomputed. Full fine-tuning: 6 a parameter and token, 6 (16 x 8 + 25 x 2 +
    30 x 7 + 50 x 3) = 3228; without grad (the reference) 2 x 538 = 1076. LoRA: the frozen vision tower and merger
    (before every trained parameter) 2 x (128 + 50) = 356, the adapter 6 x 5 x 7 = 210, the frozen decoder and head
    4 (forward and their input's gradient): 4 x (30 x 7 + 50 x 3) = 1440: 2006."""
    tokens = {"vision": 8, "merger": 2, "lm": 7, "head": 3}
    groups = gpu_check.parameter_groups(toy_vl(tied))
    assert {k: sum(p.numel() for p in v) for k, v in groups.items()} == {
        "vision": 16,
        "merger": 25,
        "lm": 30,
        "head": 50,
    }
    assert gpu_check.pass_flops(groups, tokens, grad=True) == 3228
    assert gpu_check.pass_flops(groups, tokens, grad=False) == 1076
    lora = gpu_check.parameter_groups(toy_vl(tied, adapter=True))
    assert gpu_check.pass_flops(lora, tokens, grad=True) == 356 + 210 + 1440
    assert gpu_check.pass_flops(lora, tokens, grad=False) == 2 * (538 + 5 * 7)


def test_decode_bound_by_hand():
    """The HBM bound of decoding counts the KV cache's reads: 2 rows after a 5-token prompt, 3 decode steps attending
    over 6, 7 and 8 positions, 10 B of cache a token and 1000 B of weights: 3 x 1000 + 10 x 2 x 21 = 3420 B; at 11.4
    kB/s 0.3 s, half the 0.6 s decoding took (the prefill's 0.4 s apart). The weights a step reads: the decoder's and
    the head's in bf16 (vision works in the prefill, the embedding is a lookup): 2 x 80 B. The cache of a token on
    Qwen2.5-VL-3B: 36 layers x (K, V) x 2 heads x 128 x 2 B = 36 KB; on the 7B 28 x 2 x 4 x 128 x 2 = 56 KB."""
    from hub_layout import QWEN7B_TEXT, QWEN7B_VISION, qwen_config

    assert gpu_check.decode_bytes(1000, 10, rows=2, prompt=5, steps=3) == 3420
    call = dict(rows=2, prompt=5, seconds=1.0, prefill_s=0.4, decode_s=0.6, decode_steps=3, new_tokens=4)
    figures = gpu_check.decode_figures([call], 1000, 10, bandwidth=3420 / 0.3)
    assert figures["decode_ms_per_step"] == 200 and figures["hbm_bound_ms_per_step"] == pytest.approx(100)
    assert figures["decode_share_of_hbm_bound"] == 0.5 and figures["tokens_per_s"] == 8  # 2 rows x 4 tokens
    assert gpu_check.decode_figures([call], 1000, 10, bandwidth=None)["hbm_bound_ms_per_step"] is None
    assert gpu_check.decode_weight_bytes(toy_vl(True)) == gpu_check.decode_weight_bytes(toy_vl(False)) == 160
    assert gpu_check.kv_bytes_per_token(qwen_config()[0]) == 36 * 2 * 2 * 128 * 2 == 36864
    assert gpu_check.kv_bytes_per_token(qwen_config(QWEN7B_TEXT, QWEN7B_VISION)[0]) == 57344


def test_no_prediction_without_memory_json(tmp_path, monkeypatch):
    """Without tests/results/memory.json, or without the part's setting in it: no prediction, each phase's predicted
    and difference null beside what was measured."""
    monkeypatch.setattr(gpu_check, "MEMORY_JSON", tmp_path / "memory.json")
    assert gpu_check.predicted_peaks("gpu_deer") is None
    (tmp_path / "memory.json").write_text(json.dumps({"gpu_orapo": {"setting": {}, "counts": {}, "peak": {}}}))
    assert gpu_check.predicted_peaks("gpu_deer") is None and gpu_check.predicted_peaks("gpu_orapo") is not None
    measured = {"update": (1.5, 3e9, 4e9)}  # seconds, max allocated, max reserved
    figures = gpu_check.phase_figures(measured, None)["update"]
    assert figures == dict(
        seconds=1.5, allocated_gb=3.0, reserved_gb=4.0, predicted_gb=None, allocated_minus_predicted_gb=None
    )
    figures = gpu_check.phase_figures(measured, {"update": 2.5e9})["update"]
    assert figures["predicted_gb"] == 2.5 and figures["allocated_minus_predicted_gb"] == 0.5


def test_the_limits_fit_the_budget_and_the_7b_part_is_not_last():
    """Preparation's share and the parts' limits add to at most the whole check's budget (no part is cut by the
    budget while preparation keeps to its share); the parts run in LIMITS_S's order, the 7B part (mrg_r1, the one
    on qwen7b) not last."""
    assert gpu_check.PREPARE_S + sum(gpu_check.LIMITS_S.values()) <= gpu_check.BUDGET_S
    assert gpu_check.STEP_SHAPES["mrg_r1"][0] == "qwen7b" and list(gpu_check.LIMITS_S)[-1] != "step:mrg_r1"
    assert [k for k, (model, *_) in gpu_check.STEP_SHAPES.items() if model == "qwen7b"] == ["mrg_r1"]


@pytest.mark.parametrize(
    "name, peaks",
    [
        ("NVIDIA H100 80GB HBM3", (989e12, 3.35e12)),  # SXM5
        ("NVIDIA H100 PCIe", (756e12, 2.0e12)),
        ("NVIDIA H100 NVL", (835e12, 3.9e12)),
        ("NVIDIA H200", (989e12, 4.8e12)),
        ("NVIDIA H200 NVL", (835e12, 4.8e12)),
        ("NVIDIA A100-SXM4-80GB", (312e12, 2.039e12)),
        ("NVIDIA A100-PCIE-40GB", (312e12, 1.555e12)),
        ("NVIDIA A100 80GB PCIe", (312e12, 1.935e12)),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", (None, None)),  # a slice: not the card's peaks
        ("NVIDIA H100", (None, None)),  # which H100: not said
        ("NVIDIA L40S", (None, None)),
        ("cpu", (None, None)),
    ],
)
def test_device_peaks_are_the_exact_cards(name, peaks):
    """The data sheet's dense bf16 rate and HBM bandwidth of the card the name says: a PCIe or NVL H100 does not get
    the SXM's; an unknown card, a MIG slice or a bare "H100" none (no utilisation printed)."""
    assert gpu_check.device_peaks(name) == peaks


def test_unknown_part_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="error: --parts: unknown gpu"):
        gpu_check.main(["--parts", "gpu", "--out", str(tmp_path)])


def test_parts_run_on_the_cpu_without_pytest(prepared, tmp_path):
    """The parts with the CPU as their device (a CPU run of the CUDA check checks the check) in a process that cannot
    import pytest, the tiny Qwen2.5-VL in place of the 3B: the processor's 320 tokens; the RL core's CPU-against-CPU
    differences 0; the generation sweep (2 and 3 rows), 3 decode steps after the prefill; OraPO's step part: 3 steps,
    the last one's phases named as memory.json's, each beside a prediction (a memory.json of made-up bytes) and the
    difference (the CPU counts no CUDA memory: 0 - prediction); the update's and reference's model FLOPs as
    pass_flops counts them from the tokens recorded (full fine-tuning: 6 per parameter and token with grad, 2
    without); no utilisation or HBM bound (no GPU's peaks)."""
    _, out = prepared
    work = out / "work"
    peak = {"load": 1e9, "rollout": 2e9, "reference": 3e9, "update": 4e9, "optimizer": 5e9}
    memory = {"gpu_orapo": {"setting": {"script": "orapo"}, "counts": {}, "peak": peak}}
    (tmp_path / "memory.json").write_text(json.dumps(memory))
    args = (str(ROOT), str(work), str(tmp_path / "memory.json"))
    proc = run_python(ROOT / "tests" / "cpu_parts.py", *args, env=without_pytest(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = ("processor", "rl_core", "generation", "step")
    figures = {n: json.loads((work / "parts" / f"cpu_{n}.json").read_text()) for n in parts}
    assert figures["processor"]["tokens_at_512"] == 320 and figures["processor"]["tokens_unbounded"] == 9919
    assert figures["rl_core"]["bf16_within_bound"] and set(
        figures["rl_core"]["bf16"]["relative_difference"].values()
    ) == {0.0}
    sweep = figures["generation"]["rows"]
    assert set(sweep) == {"2", "3"}  # the GPU's 8, 32, 64 rows, fewer on the CPU
    assert all(
        r["decode_steps"] == 3 and r["prefill_s"] > 0 and r["hbm_bound_ms_per_step"] is None for r in sweep.values()
    )
    step = figures["step"]
    assert step["memory_prediction"].endswith("memory.json: gpu_orapo")
    assert step["predicted_for"] == {"script": "orapo"}
    assert set(step["phases"]) == set(peak)
    for phase, figure in step["phases"].items():
        assert figure["allocated_gb"] == figure["reserved_gb"] == 0.0  # the CPU: no CUDA memory counted
        assert figure["predicted_gb"] == peak[phase] / 1e9 == -figure["allocated_minus_predicted_gb"]
    assert step["completions"] == 8 and step["new_tokens"] == 6 and step["decode"]["hbm_bound_ms_per_step"] is None
    params, trained = step["parameters"], step["trained_parameters"]
    assert trained == params  # OraPO: full fine-tuning
    for phase, per_token in (("update", 6), ("reference", 2)):
        tokens = step[phase]["tokens"]
        assert step[phase]["model_flops"] == per_token * sum(tokens[g] * params[g] for g in gpu_check.GROUPS)
        assert step[phase]["mfu"] is None
    assert step["update"]["passes"] == 1  # the completions and the ground truth (DPO) in one pass (with_chosen)
    tokens = step["update"]["tokens"]
    assert tokens["lm"] > 8 * 6 and tokens["vision"] == 4 * tokens["merger"] > 0  # 2 x 2 patches an image token
    lines = [json.loads(x) for x in (work / "runs" / "orapo" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
