"""bf16 on a CPU, where the GPU path's mixed precision can be checked without a GPU: the rollout and the loss in
separate autocast blocks (mrg_r1, orapo), full fine-tuning and LoRA moving the language model's weights under
--dtype bf16, the frozen reference computing as the policy at step 0, LoRA merges rounding once, CheXbert on the GPU
where there is one."""

import contextlib
import json
import math

import numpy as np
import pytest
import torch

import common
import mrg_r1
import orapo
import reports
from conftest import fake_eval, qwen_flags


# --------------------------------------------------------------------------- autocast blocks
@pytest.fixture
def autocast_blocks(monkeypatch):
    """Numbers each Run.autocast block; records (block, what) for every generate() and every completion_logprobs()
    with grad of the policies: "generate" or "grad forward". A block of None: outside any."""
    calls, current, count = [], [None], [0]
    real_autocast = common.Run.autocast

    @contextlib.contextmanager
    def numbered(self):
        count[0] += 1
        outer, current[0] = current[0], count[0]
        try:
            with real_autocast(self):
                yield
        finally:
            current[0] = outer

    def recording(method, what):
        def wrapper(*args, **kwargs):
            if what == "generate" or torch.is_grad_enabled():
                calls.append((current[0], what))
            return method(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(common.Run, "autocast", numbered)
    for cls in (common.TinyPolicy, common.HFPolicy):
        monkeypatch.setattr(cls, "generate", recording(cls.generate, "generate"))
        monkeypatch.setattr(cls, "completion_logprobs", recording(cls.completion_logprobs, "grad forward"))
    return calls


def assert_apart(calls):
    """generate() and a forward with grad never share an autocast block (each block's bf16 weight casts are cached:
    torch <= 2.9 reuses the no_grad ones in the grad forward, pytorch#112583), and both happened inside blocks."""
    blocks = {what: {b for b, w in calls if w == what} for what in ("generate", "grad forward")}
    assert blocks["generate"] - {None} and blocks["grad forward"] - {None}, calls
    assert not (blocks["generate"] & blocks["grad forward"]) - {None}, calls


def test_mrg_r1_rollout_and_loss_in_separate_autocast_blocks(tmp_path, small_synthetic, autocast_blocks, monkeypatch):
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)  # not under test
    flags = ["--data", str(small_synthetic), "--out", str(tmp_path / "run"), "--steps", "2", "--sft-steps", "0"]
    mrg_r1.main(flags + ["--prompts-per-step", "2", "--max-new-tokens", "8", "--grad-accum", "2"])
    assert_apart(autocast_blocks)


def test_orapo_rollout_and_loss_in_separate_autocast_blocks(tmp_path, small_synthetic, autocast_blocks, monkeypatch):
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    flags = ["--data", str(small_synthetic), "--out", str(tmp_path / "run"), "--steps", "2", "--sft-steps", "0"]
    orapo.main(flags + ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8"])
    assert_apart(autocast_blocks)


# --------------------------------------------------------------------------- bf16 end to end, tiny random Qwen2.5-VL
def bf16_flags(small_synthetic, tiny_qwen_dir, out):
    """One bf16 step of the tiny Qwen2.5-VL."""
    short = ["--dtype", "bf16", "--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "6", "--lr", "1e-4"]
    return qwen_flags(small_synthetic, tiny_qwen_dir, out, *short, "--max-pixels", str(56 * 56))


def language_projections(names) -> list[str]:
    """The language model's linear weights (q, k, v, o, gate, up, down of every decoder layer)."""
    return [n for n in names if ".language_model.layers." in n and n.endswith("proj.weight")]


def alternating_rewards(completions, references, labeler, reward, margin, cider_df=None):
    """0, 1, 0, 1, ... whatever the texts: every group has advantages that are not 0 (a random model earns none)."""
    return np.arange(len(completions)) % 2.0, {}


def test_mrg_r1_lora_bf16_moves_every_language_adapter(tmp_path, small_synthetic, tiny_qwen_dir, monkeypatch):
    """--dtype bf16 on a CPU, LoRA (MRG-R1's): after one step every adapter of the language model has moved (B starts at
    0). On torch 2.9 with the rollout and the loss in one autocast block this step failed in backward()."""
    monkeypatch.setattr(mrg_r1, "LORA", dict(mrg_r1.LORA, r=4, alpha=8))
    monkeypatch.setattr(mrg_r1, "total_reward", alternating_rewards)
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    out = tmp_path / "run"
    mrg_r1.main(bf16_flags(small_synthetic, tiny_qwen_dir, out))
    adapters = torch.load(out / "last.pt", weights_only=True)["model"]
    lora_b = [k for k in adapters if k.endswith("lora_B")]
    assert len(lora_b) == 2 * 7 and all(".language_model." in k for k in lora_b)  # 2 layers x 7 projections
    assert all(adapters[k].abs().max() > 0 for k in lora_b), [k for k in lora_b if not adapters[k].any()]


def test_orapo_full_fine_tuning_bf16_moves_every_language_weight(
    tmp_path, small_synthetic, tiny_qwen_dir, monkeypatch, starting_weights
):
    """--dtype bf16, full fine-tuning (OraPO's): every linear weight of the language model moves in the first step (its
    DPO term has a gradient at step 0). With the autocast weight cache's bug (torch 2.9, rollout and loss in one block)
    only embeddings and norms moved."""
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    out = tmp_path / "run"
    orapo.main(bf16_flags(small_synthetic, tiny_qwen_dir, out) + ["--group-size", "2"])
    start, end = starting_weights[0], torch.load(out / "last.pt", weights_only=True)["model"]
    names = language_projections(end)
    assert len(names) == 2 * 7 and all(end[k].dtype == torch.float32 for k in names)  # fp32 master weights
    moved = {k: (end[k] != start[k]).float().mean().item() for k in names}
    assert min(moved.values()) > 0.5, moved  # Adam moves every element with a gradient by ~lr


def test_reference_equals_the_policy_at_step_0_in_bf16(tmp_path, small_synthetic, tiny_qwen_dir, monkeypatch):
    """OraPO's frozen reference under --dtype bf16: at step 0 it is the policy, so the KL and every DPO margin are
    exactly 0 (the policy's trained embeddings and norms are fp32; a reference left all bf16 gave a bf16 residual
    stream: KL 3e-7, DPO margin 2e-4)."""
    seen, real = [], common.grpo_loss
    monkeypatch.setattr(common, "grpo_loss", lambda *a, **k: seen.append(a) or real(*a, **k))
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    out = tmp_path / "run"
    orapo.main(bf16_flags(small_synthetic, tiny_qwen_dir, out) + ["--group-size", "2"])
    for logp, ref_logp, *_ in seen:
        torch.testing.assert_close(ref_logp, logp.detach(), rtol=0, atol=0)
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert line["kl"] == 0 and line["dpo_margin"] == 0 and line["dpo_loss"] == pytest.approx(math.log(2), abs=1e-7)


def test_frozen_reference_keeps_linear_weights_in_bf16_and_the_rest_as_the_policy(tiny_qwen_dir):
    """What the reference costs: linear and conv weights stay bf16 (2 bytes a parameter), the embedding and the norms
    the policy trains turn fp32 as fp32_trainable turns the policy's."""
    policy = common.make_policy(str(tiny_qwen_dir), [], "cpu", dtype=torch.bfloat16, max_pixels=56 * 56)
    ref = common.frozen_reference(policy)
    common.fp32_trainable(policy.model)
    dtypes = {n: p.dtype for n, p in ref.model.named_parameters()}
    assert not any(p.requires_grad for p in ref.model.parameters()) and not ref.model.training
    assert dtypes["model.language_model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.input_layernorm.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.visual.patch_embed.proj.weight"] == torch.bfloat16  # a Conv3d


# --------------------------------------------------------------------------- LoRA merges, CheXbert's device
def test_lora_merge_adds_in_fp32_and_rounds_once():
    """A bf16 weight 1.0 (its step 2^-7) and a delta a little over half a step (2^-8 + 2^-16): rounded once, 1 + 2^-7;
    rounded as a bf16 delta first (2^-8, a tie) and then summed, the tie goes to the even 1.0 and the delta is lost.
    The merge into a saved state dict rounds once."""
    base = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(base.weight)
    model = torch.nn.Sequential(common.LoRALinear(base, r=1, alpha=1.0))
    with torch.no_grad():
        model[0].lora_A.fill_(1.0)
        model[0].lora_B.fill_(2**-8 + 2**-16)
    merged = common.lora_merged_state_dict(model)["0.weight"]
    assert merged.dtype == torch.bfloat16 and merged.item() == 1 + 2**-7


def test_chexbert_goes_to_the_gpu_where_there_is_one(tmp_path, monkeypatch):
    """`python tests/reports.py evaluate --labeler chexbert` (and rrgcl's q1, through make_labeler's default) put
    CheXbert on the GPU when torch sees one; a run passes its own device (each rank its GPU)."""
    devices = []

    class Recorder:
        def __init__(self, weights=None, device="cpu", **kwargs):
            devices.append(str(device))

        def __call__(self, reports):
            return np.full((len(reports), 14), np.nan)

    monkeypatch.setattr(common, "CheXbertLabeler", Recorder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    generations = tmp_path / "g.jsonl"
    generations.write_text(json.dumps({"reference": "No effusion.", "generated": "Small effusion."}) + "\n")
    reports.main(["evaluate", "--generations", str(generations), "--labeler", "chexbert", "--no-meteor"])
    assert devices == ["cuda"]
    common.make_labeler("chexbert", device=torch.device("cuda", 1))
    assert devices[-1] == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    common.make_labeler("chexbert")
    assert devices[-1] == "cpu"
