"""The GPU check: what a real run costs on one GPU, as one command, at most 7 minutes (BUDGET_S), nothing downloaded,
everything it writes under the folder given (--out; its work folder below it, removed at the end).

    python tests/gpu_check.py --out DIR                       # every part -> DIR/gpu.json, DIR/gpu_check.log
    python tests/gpu_check.py --out DIR --parts processor,generation

On a machine without CUDA it prepares (on the CPU), says so in one line, writes only its log and exits 0
(tests/test_gpu_check.py). It needs nothing the device's image lacks: every run uses the rule labeler (no f1chexbert).
It first prepares what the parts read (studies of one 2544 x 3056 view each, MIMIC-CXR's size; a tiny random
Qwen2.5-VL and the folders of Qwen2.5-VL-3B and -7B, config and processor as the hub publishes them, no weights),
then runs each part in a process of its own under a time limit, so that one failing leaves the others' figures:

    processor     a 2544 x 3056 view through the published processor layout at --max-pixels 512 x 512: 320 tokens
    generation    Qwen2.5-VL-3B: tokens/s at 8, 32 and 64 rows, 128 new tokens; decode ms per token against the bound
                  of reading every weight once per token from HBM
    step:orapo    one step of orapo.py's own main() on Qwen2.5-VL-3B's full shape (random weights made on the GPU),
                  full fine-tuning against a frozen copy, OraPO's per-GPU batch (4 studies x G 8 over 4 GPUs: 1 x 8)
    step:deer     deer.py rl, DiTPO with rule weights, all of the 3B trains, DEER's per-GPU batch (64 studies x G 8 over
                  8 GPUs: 8 x 8) in 4 micro-batches (--grad-accum 4)
    step:mrg_r1   mrg_r1.py on Qwen2.5-VL-7B's shape (HuatuoGPT-Vision-7B's), LoRA r 128, one GPU: 4 studies x G 4
    rl_core       the GRPO and DPO losses and gradients under bf16 autocast, CUDA against the CPU

A step part runs 3 steps and keeps the last: per phase (generate, reference pass, forward + backward, optimizer step)
its seconds and peak memory, the update's model FLOP utilisation, decode ms per token, and the memory formula of
tests/MACHINES.md beside the peak.
"""

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import common
import sandbox

BUDGET_S = 420  # the whole check, preparation included
PREPARE_S = 40  # preparation's share (15 s on 2 shared CPU cores); the parts' limits fill the rest, no more
# in the order they run: the 7B part early (the last is the one a slow preparation cuts), generation last (the step
# parts measure decoding too)
LIMITS_S = {"processor": 20, "rl_core": 25, "step:mrg_r1": 100, "step:orapo": 85, "step:deer": 95, "generation": 55}
GB = 1e9
DEVICE = "cuda"  # the parts' device (a CPU run of a part checks the part itself: tests/test_gpu_check.py)
MIMIC_VIEW = (2544, 3056)  # width, height
TOKENS_AT_512 = 320  # image tokens of one such view at --max-pixels 512 x 512 (20 x 16 after the 2 x 2 merge)
STEPS = 3  # a step part's steps: the first two warm kernels and the allocator, the last is kept
# NVIDIA's data sheets, per card: dense bf16 tensor FLOP/s (half the sheets' "with sparsity" figure) and HBM bytes/s.
# The first row whose words all occur in torch.cuda.get_device_name() (upper case) gives the peaks; no row: none known,
# no utilisation printed (a MIG slice too: a part of the SMs, the name of the whole card).
PEAKS = (
    (("H200", "NVL"), 835e12, 4.8e12),  # NVIDIA H200 NVL
    (("H200",), 989e12, 4.8e12),  # NVIDIA H200 (SXM)
    (("H100", "NVL"), 835e12, 3.9e12),  # NVIDIA H100 NVL (94 GB)
    (("H100", "PCIE"), 756e12, 2.0e12),  # NVIDIA H100 PCIe (80 GB HBM2e)
    (("H100", "HBM3"), 989e12, 3.35e12),  # NVIDIA H100 80GB HBM3: the SXM5 card
    (("H100", "SXM"), 989e12, 3.35e12),
    (("A100", "SXM4-80GB"), 312e12, 2.039e12),
    (("A100", "SXM4-40GB"), 312e12, 1.555e12),
    (("A100", "80GB", "PCIE"), 312e12, 1.935e12),  # NVIDIA A100 80GB PCIe
    (("A100", "PCIE-40GB"), 312e12, 1.555e12),  # NVIDIA A100-PCIE-40GB
)
# each step part: (model folder, its flags, the paper's batch it stands for)
STEP_SHAPES = {
    "orapo": ("qwen3b", ["--prompts-per-step", "1", "--group-size", "8"], "4 studies x G 8 over 4 GPUs"),
    "deer": ("qwen3b", ["--prompts-per-step", "8", "--group-size", "8", "--grad-accum", "4"], "64 x G 8 over 8 GPUs"),
    "mrg_r1": ("qwen7b", ["--prompts-per-step", "4", "--group-size", "4"], "4 studies x G 4 on one GPU"),
}


# Preparation (CPU) ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def output_to(log):
    """File descriptors 1 and 2 to the log (the tokenizer trainer's progress is written by Rust, not by Python)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def mimic_views(folder: Path, n_train: int, size=MIMIC_VIEW):
    """An annotation of studies with one view each at `size`, drawn from the synthetic set's 64 px images (each a
    finding's sign, its report): what a real run reads, at MIMIC-CXR's size, as JPEG (MIMIC-CXR-JPG's format, the one
    R2Gen's MIMIC-CXR uses; a 2544 x 3056 PNG takes ten times as long to write)."""
    small = folder / "small"
    sandbox.make_synthetic(small, n_train=n_train, n_val=2, n_test=2, size=64, seed=0)
    data = json.loads((small / "annotation.json").read_text())
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for records in data.values():
        for r in records:
            png = r["image_path"][0]
            r["image_path"] = [str(Path(png).with_suffix(".jpg"))]
            with Image.open(small / "images" / png) as im:
                im.resize(size).save(folder / "images" / r["image_path"][0], quality=95)
    (folder / "annotation.json").write_text(json.dumps(data))
    shutil.rmtree(small)


def published_folder(out: Path, text: dict, vision: dict, texts: list[str]):
    """A Qwen2.5-VL folder as the hub publishes it: its config (these widths) and processor files, no weights (a part
    builds them on the GPU)."""
    from hub_layout import QWEN3B_IDS, build_tiny_qwen, qwen_config

    build_tiny_qwen(out, texts)  # the processor files in the hub's layout, a byte-level BPE of the reports
    tok = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tok}
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    config = qwen_config(text, vision, ids={k: ids[n] for k, n in zip(QWEN3B_IDS, names)})[0]
    config.text_config.update(dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]))
    (out / "model.safetensors").unlink()
    config.save_pretrained(out)


def prepare(work: Path):
    from hub_layout import QWEN3B_TEXT, QWEN3B_VISION, QWEN7B_TEXT, QWEN7B_VISION, build_tiny_qwen

    if not (work / "data" / "annotation.json").is_file():
        mimic_views(work / "data", n_train=32)
    reports = [r.report for r in common.load_annotation(work / "data" / "annotation.json")["train"]]
    texts = reports + ["You are a radiologist. Describe the chest X-ray.", "<think> </think> <report> </report>"]
    if not (work / "qwen_tiny" / "config.json").is_file():
        build_tiny_qwen(work / "qwen_tiny", texts)
    for name, text, vision in (("qwen3b", QWEN3B_TEXT, QWEN3B_VISION), ("qwen7b", QWEN7B_TEXT, QWEN7B_VISION)):
        if not (work / name / "config.json").is_file():
            published_folder(work / name, text, vision, texts)


# The parts (each in its own process: python tests/gpu_check.py --run-part NAME --work DIR) -----------------------
class Figures(dict):
    """A part's figures, written to its JSON file at every change: what a part recorded survives its time limit."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value):
        self.update({key: value})

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.path.write_text(json.dumps(self, indent=1, default=str))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / GB if DEVICE == "cuda" else 0.0


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def image_tokens(policy, image) -> int:
    prompts = policy.prompt_batch([[image]], "Describe the chest X-ray.")
    return int((prompts["input_ids"] == policy.model.config.image_token_id).sum())


def part_processor(work: Path, figures: Figures):
    """A 2544 x 3056 view through the hub's processor layout (top-level min/max_pixels, no size) at the scripts'
    --max-pixels 512 x 512, and with no bound (the hub's 12.8 M px): 320 and 9,919 tokens."""
    image = Image.new("L", MIMIC_VIEW, 100)
    bounded = common.HFPolicy(str(work / "qwen_tiny"), device="cpu", max_pixels=512 * 512)
    unbounded = common.HFPolicy(str(work / "qwen_tiny"), device="cpu", max_pixels=None)
    figures.update(tokens_at_512=image_tokens(bounded, image), tokens_unbounded=image_tokens(unbounded, image))
    layout = json.loads((work / "qwen3b" / "preprocessor_config.json").read_text())
    figures["published_layout"] = {k: layout.get(k) for k in ("min_pixels", "max_pixels", "size")}
    if figures["tokens_at_512"] != TOKENS_AT_512:
        raise AssertionError(f"{figures['tokens_at_512']} image tokens for a 2544 x 3056 view, not {TOKENS_AT_512}")


def build_on_the_device():
    """AutoModelForImageTextToText.from_pretrained on a folder without weights: the model from its config, random,
    made on the device in --dtype (no file of 8 or 16 GB to write and read)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    def build(path, dtype=None, **kwargs):
        with torch.device(DEVICE):
            return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), dtype=dtype)

    AutoModelForImageTextToText.from_pretrained = build


def device_name() -> str:
    return torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"


def device_peaks(name: str) -> tuple:
    """The card's dense bf16 FLOP/s and HBM bytes/s, from its exact name (PEAKS) -> (None, None) if not known."""
    name = name.upper()
    if "MIG" in name.split():
        return None, None
    return next(((flops, hbm) for words, flops, hbm in PEAKS if all(w in name for w in words)), (None, None))


def part_generation(work: Path, figures: Figures, model: str = "qwen3b", new_tokens: int = 128, rows=(8, 32, 64)):
    """Qwen2.5-VL-3B (random, bf16) writing `new_tokens` tokens after one view's prompt, for each count of `rows`:
    seconds, tokens/s, ms per decode step, and the bound: every weight read once per step at HBM's bandwidth."""
    build_on_the_device()
    policy = common.HFPolicy(str(work / model), device=DEVICE, dtype=torch.bfloat16, max_pixels=512 * 512)
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    _, bandwidth = device_peaks(device_name())
    bound_ms = 1000 * weights / bandwidth if bandwidth else None
    figures.update(weights_gb=round(weights / GB, 2), hbm_bound_ms_per_step=bound_ms and round(bound_ms, 3))
    image = Image.open(min((work / "data" / "images").iterdir()))
    prompt = policy.prompt_batch([[image]], "Describe the chest X-ray.")
    length = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    sweep = {}
    for n in (rows[0], *rows):  # the first: warm-up
        inputs = {k: v for k, v in policy.repeat(prompt, n).items() if k in policy.MODEL_KEYS}
        sync()
        start = time.perf_counter()
        with torch.no_grad(), common.autocast(policy.device, policy.dtype):
            policy.model.generate(**inputs, **length)
        sync()
        seconds = time.perf_counter() - start
        ms = 1000 * seconds / new_tokens
        share = bound_ms / ms if bound_ms else None
        sweep[n] = dict(seconds=round(seconds, 2), tokens_per_s=round(n * new_tokens / seconds, 1))
        sweep[n] |= dict(ms_per_step=round(ms, 2), share_of_hbm_bound=share and round(share, 3))
    figures["rows"] = sweep


class Phases:
    """Each step's phases, in seconds and peak memory (GB): generate (the rollout and its rewards), reference (pi_ref's
    pass), forward + backward (the rest: log-probs, losses, backward), optimizer (clip, step, schedule, zero_grad)."""

    def __init__(self):
        self.steps, self.current, self.start = [], None, None

    def mark(self, phase: str | None):
        """End the running phase; start `phase` (None: the step is over)."""
        sync()
        now = time.perf_counter()
        if self.current is not None:
            step = self.steps[-1]
            seconds, peak = step.get(self.current, (0.0, 0.0))
            step[self.current] = (seconds + now - self.start, max(peak, peak_gb()))
        elif phase is not None:
            self.steps.append({})
        reset_peak()
        self.current, self.start = phase, now


def instrument(phases: Phases, counts: dict):
    """The hooks at the phases' edges; counts: generate() calls, new tokens and rows, the tokens of passes with grad."""

    def around(owner, name, before, after):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            phases.mark(before)
            out = real(*args, **kwargs)
            phases.mark(after)
            return out

        setattr(owner, name, wrapped)

    around(common, "rollout", "generate", "forward + backward")
    around(common, "reference_logprobs", "reference", "forward + backward")
    real_clip, real_log_step = common.clip_gradients, common.Run.log_step
    real_generate, real_logprobs = common.HFPolicy.generate, common.HFPolicy.completion_logprobs

    def clip(params, max_norm):
        phases.mark("optimizer")
        return real_clip(params, max_norm)

    def log_step(self, step):
        phases.mark(None)
        return real_log_step(self, step)

    def generate(self, prompts, *args, **kwargs):
        sync()
        start = time.perf_counter()
        ids, mask = real_generate(self, prompts, *args, **kwargs)[:2]
        sync()
        counts["generate"].append((ids.shape[0], ids.shape[1], time.perf_counter() - start))
        return ids, mask

    def completion_logprobs(self, prompts, ids, *args, **kwargs):
        if torch.is_grad_enabled():  # the update's passes: prompt and completion, every row
            counts["tokens"][-1] += ids.shape[0] * (prompts["input_ids"].shape[1] + ids.shape[1])
        return real_logprobs(self, prompts, ids, *args, **kwargs)

    common.clip_gradients, common.Run.log_step = clip, log_step
    common.HFPolicy.generate, common.HFPolicy.completion_logprobs = generate, completion_logprobs


def update_flops(model, tokens: int) -> float:
    """The update's model FLOPs (matrix products; attention's own left out): a token costs 2 N forward, 2 N backward
    to the inputs, 2 N recomputed under activation checkpointing, and 2 N for the gradients of the N that train."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return tokens * (6 * total + 2 * trained)


def part_step(script: str, work: Path, figures: Figures, model: str | None = None, new_tokens: int = 256):
    """STEPS steps of the script's own main() on its paper's shape (random weights made on the device; no evaluation,
    checkpoint or final model: 15-45 GB files), the last one measured."""
    folder, flags, stands_for = STEP_SHAPES[script]
    folder = work / (model or folder)
    build_on_the_device()
    phases, counts = Phases(), {"generate": [], "tokens": [0]}
    instrument(phases, counts)
    common.Run.evaluate, common.Run.checkpoint, common.HFPolicy.save = no_evaluation, lambda *a: None, lambda *a: None
    real_log_step = common.Run.log_step

    def new_step_counter(self, step):
        counts["tokens"].append(0)
        return real_log_step(self, step)

    common.Run.log_step = new_step_counter
    module = importlib.import_module(script)
    out = work / "runs" / script
    shutil.rmtree(out, ignore_errors=True)
    data = str(work / "data" / "annotation.json")
    base = ["--data", data, "--model", str(folder), "--labeler", "rule", "--out", str(out), "--steps", str(STEPS)]
    base += ["--max-new-tokens", str(new_tokens), *flags]
    if script == "deer":  # the RL stage from an "SFT model": the 3B folder itself, no SFT run
        shutil.copytree(folder, out / "sft" / "final")
        base = ["rl", *base, "--subset", "all", "--weighting", "rule"]
    else:
        base += ["--sft-steps", "0"]
    figures.update(stands_for=stands_for, flags=base)
    try:
        module.main(base)
    except torch.cuda.OutOfMemoryError as e:
        figures["out_of_memory"] = str(e).splitlines()[0][:300]
    if len(phases.steps) < STEPS:
        return figures.update(steps_done=len(phases.steps))
    last = phases.steps[-1]
    figures["phases"] = {k: dict(seconds=round(s, 3), peak_gb=round(p, 2)) for k, (s, p) in last.items()}
    rows, new, seconds = counts["generate"][-1]
    figures.update(completions=rows, new_tokens=new, decode_ms_per_token=round(1000 * seconds / new, 2))
    policy_model = module_policy_model()
    flop_s, bandwidth = device_peaks(device_name())
    trained_s = last["forward + backward"][0]
    flops = update_flops(policy_model, counts["tokens"][-2])
    figures.update(update_tokens=counts["tokens"][-2], update_tflops=round(flops / 1e12, 1))
    figures["update_mfu"] = flop_s and round(flops / (trained_s * flop_s), 3)
    weights = sum(p.numel() * 2 for p in policy_model.parameters())  # bf16 reads per decode step
    figures["decode_share_of_hbm_bound"] = bandwidth and round(1000 * weights / bandwidth / (1000 * seconds / new), 3)
    figures["formula_gb"] = round(formula_gb(script, rows), 1)
    figures["peak_gb"] = round(max(p for _, p in last.values()), 2)


def no_evaluation(*args, **kwargs) -> dict:
    """What Run.evaluate returns, all zeros: a step part evaluates nothing (tests/conftest.py's fake_eval, which this
    script cannot import: conftest imports pytest, which the device's image lacks)."""
    ce = {k: 0.0 for k in ("micro_f1", "macro_precision", "macro_recall", "macro_f1", "example_f1")}
    return {
        "headline": (kwargs.get("ce") or {}).get("headline", "micro_f1"),
        "uncertain_as": 0,
        "ce": ce,
        "nlg": {"BLEU-4": 0.0},
        "degenerate": common.degenerate_output(["a"], ["a"]),
        "reward": 0.0,
        "facts_reward": 0.0,
    }


_POLICIES = []  # the policies the step part built (for_training's), the last one the trained


def module_policy_model():
    return _POLICIES[-1].model


def keep_policies():
    real = common.for_training

    def for_training(*args, **kwargs):
        policy, ref = real(*args, **kwargs)
        _POLICIES.append(policy)
        return policy, ref

    common.for_training = for_training


def part_rl_core(work: Path, figures: Figures):
    """GRPO (dr_grpo, k3 KL 0.04) and LN-DPO (beta 2) on log-probs from a bf16 LM head (autocast), loss and the
    gradients of the head and its input, CUDA against the CPU on the same inputs. Bound: the two devices round the same
    bf16 operands and accumulate in fp32, so the logits differ by at most one bf16 step (2^-8 relative) where rounding
    lands apart; log-probs then by 2 x 2^-8 of the largest |logit| and the gradients, through bf16 matmuls once more,
    by a few 2^-8 of their largest element: within 2^-5 relative, norm-wise. Without autocast (fp32) ~1e-6."""
    import orapo

    N, T, H, V, G = 16, 48, 256, 8192, 4
    g = torch.Generator().manual_seed(0)
    hidden, W = torch.randn(N, T, H, generator=g), torch.randn(V, H, generator=g) * H**-0.5
    ids = torch.randint(V, (N, T), generator=g)
    mask = (torch.arange(T)[None] < torch.randint(4, T + 1, (N, 1), generator=g)).float()  # (N, T)
    rewards, ref_logp = torch.rand(N, generator=g), -torch.rand(N, T, generator=g) * 10

    def losses(device, autocast):
        h, w = (x.to(device, copy=True).requires_grad_(True) for x in (hidden, W))  # leaves of their own
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = h @ w.T  # (N, T, V)
        m = mask.to(device)
        logp = common.token_logprobs(logits, ids.to(device)) * m
        A = common.group_advantages(rewards.to(device), G, scale="none")
        ref = ref_logp.to(device)
        grpo, _ = common.grpo_loss(logp, ref, A, m, beta=0.04, loss_type="dr_grpo", max_completion_length=T)
        dpo, _ = orapo.dpo_loss(logp[0::2], logp[1::2], ref[0::2], ref[1::2], 2.0, True, m[0::2], m[1::2])
        (grpo + dpo).backward()
        return dict(grpo=grpo.detach().cpu(), dpo=dpo.detach().cpu(), d_hidden=h.grad.cpu(), d_head=w.grad.cpu())

    for autocast in (True, False):
        cpu, device = losses("cpu", autocast), losses(DEVICE, autocast)
        rel = {k: float((device[k] - cpu[k]).norm() / cpu[k].norm().clamp_min(1e-30)) for k in cpu}
        key = "bf16" if autocast else "fp32"
        figures[key] = dict(relative_difference=rel, bound=2**-5 if autocast else 1e-4)
        figures[f"{key}_within_bound"] = all(v <= figures[key]["bound"] for v in rel.values())


# Qwen2.5-VL-3B and -7B: the formula of tests/MACHINES.md ("Real architectures and GPU memory") --------------------
QWEN3B_PARAMS = 3_754_622_976
QWEN7B_PARAMS = 8_292_166_656
EMBEDDING_PARAMS = 151936 * 2048  # tied to the LM head
LORA_R128_PARAMS = 36 * 128 * (2 * (2048 + 2048) + 2 * (2048 + 256) + 3 * (2048 + 11008))  # 239,468,544 (3B)
LORA_R128_PARAMS_7B = 28 * 128 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))  # 7B's
PER_COMPLETION = 0.82 * GB  # activations of one completion of P 380 + T 256 tokens, 3B, checkpointed (MACHINES.md)


def formula_gb(script: str, completions: int) -> float:
    """M = S + n x 0.82 GB: S = 18 B a trained parameter (fp32 master, gradient, AdamW's two moments, autocast's bf16
    copy; the fused AdamW holds no fp32 temporary, the foreach one 4 B more at the step), 2 B a frozen one (the LoRA
    base, the reference; 4 B its embedding). MRG-R1: the 7B."""
    if script == "mrg_r1":
        states = 2 * QWEN7B_PARAMS + 18 * LORA_R128_PARAMS_7B
    else:  # the reference's embedding in fp32, as the policy's (common.frozen_reference)
        states = (18 + 2) * QWEN3B_PARAMS + 2 * EMBEDDING_PARAMS
    return (states + completions * PER_COMPLETION) / GB


def run_part(name: str, work: Path):
    figures = Figures(work / "parts" / f"{name.replace(':', '_')}.json")
    kind, _, arg = name.partition(":")
    os.environ.update(RRG_CACHE=str(work / "cache"), RRG_METEOR="0", RRG_FIGURES="0", TOKENIZERS_PARALLELISM="false")
    try:
        if kind == "step":
            keep_policies()
            part_step(arg, work, figures)
        else:
            parts = {"processor": part_processor, "generation": part_generation, "rl_core": part_rl_core}
            parts[kind](work, figures)
    except BaseException as e:  # the figures so far and the error, whatever it was
        figures["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        figures["traceback"] = traceback.format_exc()[-3000:]
        raise


# The driver -------------------------------------------------------------------------------------------------
def launch(name: str, work: Path, log) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "--run-part", name, "--work", str(work)]
    log.write(f"\n==== {name}\n")
    log.flush()
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, limit: float) -> str:
    """The process to its end or its limit (then its process group is killed) -> its status."""
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timed out after {limit:.0f} s"
    return "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"


def summary_line(name: str, part: dict) -> str:
    figures = {k: v for k, v in part["figures"].items() if k not in ("traceback", "error", "flags")}
    shown = json.dumps(figures, default=str)
    shown = shown if len(shown) < 500 else shown[:500] + "..."
    error = f"  {part['figures']['error']}" if "error" in part["figures"] else ""
    return f"{name:12} {part['status']:20} {part['seconds']:6.0f} s  {shown}{error}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder it writes: gpu.json, gpu_check.log (work/: removed)")
    parser.add_argument("--parts", default=",".join(LIMITS_S), help="comma-separated, from: " + ", ".join(LIMITS_S))
    parser.add_argument("--keep-work", action="store_true", help="keep DIR/work (data, model folders, part files)")
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--run-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_part:
        return run_part(args.run_part, Path(args.work))
    parts = [p for p in LIMITS_S if p in args.parts.split(",")]
    unknown = set(args.parts.split(",")) - set(LIMITS_S)
    if unknown:
        raise SystemExit(f"error: --parts: unknown {', '.join(sorted(unknown))}; use {', '.join(LIMITS_S)}")
    out = Path(args.out)
    work = out / "work"
    (work / "parts").mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(out / "gpu_check.log", "a") as log, output_to(log):
        prepare(work)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}): prepared {work}, measured nothing")
        return 0
    flop_s, hbm = device_peaks(device_name())
    result = {
        "device": device_name(),
        "peak_dense_bf16_tflop_s": flop_s and flop_s / 1e12,  # None: not a card PEAKS knows
        "peak_hbm_tb_s": hbm and hbm / 1e12,
        "device_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / GB, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": importlib.import_module("transformers").__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "prepared_s": round(time.time() - start, 1),
        "parts": {},
    }
    with open(out / "gpu_check.log", "a") as log:
        for p in parts:
            left = BUDGET_S - (time.time() - start)  # a part never runs past the budget
            begun = time.time()
            status = wait(launch(p, work, log), min(LIMITS_S[p], left)) if left >= 10 else "skipped: no time left"
            path = work / "parts" / f"{p.replace(':', '_')}.json"
            figures = json.loads(path.read_text()) if path.is_file() else {}
            result["parts"][p] = dict(status=status, seconds=round(time.time() - begun, 1), figures=figures)
            (out / "gpu.json").write_text(json.dumps(result | {"seconds": round(time.time() - start, 1)}, indent=1))
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_check on {result['device']} (torch {result['torch']}, CUDA {result['cuda']})")
    for name, part in result["parts"].items():
        print(summary_line(name, part))
    print(f"wrote {out / 'gpu.json'}; the parts' output: {out / 'gpu_check.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
