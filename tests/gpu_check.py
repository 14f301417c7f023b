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
    rl_core       the GRPO and DPO losses and gradients under bf16 autocast, CUDA against the CPU
    step:mrg_r1   mrg_r1.py on Qwen2.5-VL-7B's shape (HuatuoGPT-Vision-7B's), LoRA r 128, one GPU: 4 studies x G 4
    step:orapo    orapo.py's own main() on Qwen2.5-VL-3B's full shape (random weights made on the GPU), full
                  fine-tuning against a frozen copy, OraPO's per-GPU batch (4 studies x G 8 over 4 GPUs: 1 x 8)
    step:deer     deer.py rl, DiTPO with rule weights, all of the 3B trains, no reference, DEER's per-GPU batch (64
                  studies x G 8 over 8 GPUs: 8 x 8) in 4 micro-batches (--grad-accum 4)
    generation    Qwen2.5-VL-3B: tokens/s at 8, 32 and 64 rows, 128 new tokens; the prefill timed apart, decode ms per
                  step against its HBM bound

in that order (LIMITS_S: the 7B part early, where a slow preparation cannot cut it; the limits and PREPARE_S add to
BUDGET_S). A step part runs 3 steps and keeps the last. Per phase (Phases: load, rollout, reference, update,
optimizer) its seconds, torch.cuda.max_memory_allocated and max_memory_reserved, and beside them the peak
tests/memory_check.py predicts for the setting gpu_<script> in tests/results/memory.json with the difference (each
script's own states and a micro-batch's activations, DEER without a reference; no such file or setting: "no
prediction", nulls); the hand formula this replaced counted DEER's 64 completions and a reference it has not. The
update's and the reference pass's model FLOP utilisation (pass_flops: model FLOPs only, nothing recomputed, each
group of parameters on the tokens it acts on) at the exact card's data-sheet peak (PEAKS; an unknown card: none);
decode ms per step, the prefill apart, against the HBM bound (decode_bytes: weights and KV cache reads).
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


def memory_peaks() -> tuple[int, int]:
    """torch.cuda.max_memory_allocated and max_memory_reserved (bytes) since the last reset_peak(); 0, 0 on the CPU."""
    if DEVICE != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


# Model FLOPs and HBM bytes of Qwen2.5-VL ---------------------------------------------------------------------------
GROUPS = ("vision", "merger", "lm", "head")  # the way a token's activations go (its gradients: the other way)


def parameter_groups(model) -> dict:
    """Qwen2.5-VL's parameters by the tokens they act on: "vision" the tower's patch embedding and blocks (each patch
    of 14 x 14 px), "merger" its 2 x 2 merger (each image token), "lm" the decoder layers (each token of the sequence,
    image tokens included), "head" the LM head (each token predicted; the 3B ties it to the input embedding). The
    input embedding apart from the head multiplies nothing (a lookup): in no group."""
    core = model.model
    merger, head = list(core.visual.merger.parameters()), list(model.lm_head.parameters())
    skip = {id(p) for p in (*merger, *head, *core.language_model.embed_tokens.parameters())}
    return {
        "vision": [p for p in core.visual.parameters() if id(p) not in skip],
        "merger": merger,
        "lm": [p for p in core.language_model.parameters() if id(p) not in skip],
        "head": head,
    }


def pass_tokens(prompts: dict, completion_mask, image_token_id: int) -> dict:
    """The tokens a log-prob pass (HFPolicy.completion_logprobs) puts through each group, padding left out: the
    patches and image tokens of each study once (views_once), the prompts' tokens once a row and the completions'
    tokens, the completions' (each predicted once)."""
    completion, rows = int(completion_mask.sum()), len(completion_mask) // len(prompts["input_ids"])
    return {
        "vision": int(prompts["pixel_values"].shape[0]),  # a row of pixel_values is a patch
        "merger": int((prompts["input_ids"] == image_token_id).sum()),
        "lm": rows * int(prompts["attention_mask"].sum()) + completion,
        "head": completion,
    }


def pass_flops(groups: dict, tokens: dict, grad: bool) -> int:
    """A pass's model FLOPs: products with the weights only (attention's between tokens left out), nothing recomputed
    (activation checkpointing's second forward is not the model's). Per token, each parameter of a group it passes
    costs 2 forward; with grad a trained one 4 more (its input's gradient and its own: 6), a frozen one 2 more where
    the gradient goes through it to a trained one before it (LoRA's base layers, the head; 4) and none before every
    trained one (a frozen vision tower under LoRA; 2). tokens: per group (pass_tokens)."""
    flops, trained_before = 0, False
    for name in GROUPS:
        trained = sum(p.numel() for p in groups[name] if p.requires_grad) if grad else 0
        frozen = sum(p.numel() for p in groups[name]) - trained
        trained_before = trained_before or trained > 0
        flops += tokens[name] * (6 * trained + (4 if trained_before else 2) * frozen)
    return flops


def kv_bytes_per_token(config, element_bytes: int = 2) -> int:
    """The KV cache's bytes for one token of one row: keys and values of every layer, bf16 (36 KB on the 3B)."""
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * element_bytes


def decode_weight_bytes(model, element_bytes: int = 2) -> int:
    """The weights a decode step reads: the LM's and its head's, bf16 (autocast's copies of fp32 master weights); the
    vision tower and merger work in the prefill only."""
    groups = parameter_groups(model)
    return element_bytes * sum(p.numel() for p in groups["lm"] + groups["head"])


def decode_bytes(weights: int, kv_per_token: int, rows: int, prompt: int, steps: int) -> int:
    """The HBM bytes `steps` decode steps read at the least: every weight once a step, and each row's keys and values:
    step s (1 .. steps) attends over the `prompt` positions of the prefill (padding included: it is in the cache) and
    the s tokens written since."""
    return steps * weights + kv_per_token * rows * (steps * prompt + steps * (steps + 1) // 2)


class PrefillClock:
    """generate()'s first forward (the prefill: vision tower, merger and prompt) timed apart from the forwards after
    it (the decode steps), by hooks on the model: decode seconds run from the prefill's end to generate()'s."""

    def __init__(self, model):
        self.model, self.forwards = model, 0

    def __enter__(self):
        sync()
        self.begun = time.perf_counter()
        self.hooks = [self.model.register_forward_pre_hook(self.before), self.model.register_forward_hook(self.after)]
        return self

    def before(self, *_):
        if self.forwards == 0:
            sync()
            self.prefill_begun = time.perf_counter()

    def after(self, *_):
        if self.forwards == 0:
            sync()
            self.prefill_ended = time.perf_counter()
        self.forwards += 1

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        sync()
        self.ended = time.perf_counter()

    def figures(self, rows: int, prompt: int, prefill_writes: bool = True) -> dict:
        """`prefill_writes`: the first forward wrote the first token (model.generate's), or not (HFPolicy.prefilled
        runs the prompt but its last token; generate's first step feeds that token, a decode step, and writes it)."""
        return dict(
            rows=rows,
            prompt=prompt,
            seconds=self.ended - self.begun,
            prefill_s=self.prefill_ended - self.prefill_begun,
            decode_s=self.ended - self.prefill_ended,
            decode_steps=self.forwards - 1,
            new_tokens=self.forwards - 1 + prefill_writes,
        )


def decode_figures(calls: list[dict], weights: int, kv_per_token: int, bandwidth) -> dict:
    """generate() calls (PrefillClock.figures) -> their seconds, tokens/s, prefill seconds, ms per decode step, the
    HBM bound's ms per decode step (decode_bytes at `bandwidth`; None if not known) and the share of it reached."""
    seconds, prefill = sum(c["seconds"] for c in calls), sum(c["prefill_s"] for c in calls)
    decode_s, steps = sum(c["decode_s"] for c in calls), max(1, sum(c["decode_steps"] for c in calls))
    tokens = sum(c["rows"] * c["new_tokens"] for c in calls)
    read = sum(decode_bytes(weights, kv_per_token, c["rows"], c["prompt"], c["decode_steps"]) for c in calls)
    bound_s = bandwidth and read / bandwidth
    return dict(
        seconds=round(seconds, 3),
        tokens_per_s=round(tokens / seconds, 1),
        prefill_s=round(prefill, 3),
        decode_ms_per_step=round(1000 * decode_s / steps, 3),
        hbm_bound_ms_per_step=bound_s and round(1000 * bound_s / steps, 3),
        decode_share_of_hbm_bound=bound_s and round(bound_s / decode_s, 3),
    )


# Memory: tests/memory_check.py's prediction beside the peaks measured ------------------------------------------------
MEMORY_JSON = ROOT / "tests" / "results" / "memory.json"  # {setting: {"setting", "counts", "peak": {phase: bytes}}}


def predicted_peaks(setting: str) -> dict | None:
    """MEMORY_JSON's entry for `setting` (gpu_orapo, gpu_deer, gpu_mrg_r1: the step parts' shapes), or None: no file
    or no such setting."""
    path = MEMORY_JSON
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(setting)


def phase_figures(measured: dict, predicted: dict | None) -> dict:
    """Per phase: (seconds, max allocated, max reserved bytes) and the predicted peak bytes -> figures in GB, with the
    difference measured allocated - predicted (None where nothing was predicted)."""
    out = {}
    for phase, (seconds, allocated, reserved) in measured.items():
        bytes_ = (predicted or {}).get(phase)
        out[phase] = dict(
            seconds=round(seconds, 3),
            allocated_gb=round(allocated / GB, 3),
            reserved_gb=round(reserved / GB, 3),
            predicted_gb=None if bytes_ is None else round(bytes_ / GB, 3),
            allocated_minus_predicted_gb=None if bytes_ is None else round((allocated - bytes_) / GB, 3),
        )
    return out


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
    seconds, tokens/s, the prefill timed apart, ms per decode step against the HBM bound of one (decode_bytes: the LM's
    weights and the rows' KV cache read once)."""
    build_on_the_device()
    policy = common.HFPolicy(str(work / model), device=DEVICE, dtype=torch.bfloat16, max_pixels=512 * 512)
    weights, kv = decode_weight_bytes(policy.model), kv_bytes_per_token(policy.model.config)
    _, bandwidth = device_peaks(device_name())
    figures.update(decode_weights_gb=round(weights / GB, 3), kv_cache_bytes_per_token=kv)
    image = Image.open(min((work / "data" / "images").iterdir()))
    prompt = policy.prompt_batch([[image]], "Describe the chest X-ray.")
    length = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    sweep = {}
    for n in (rows[0], *rows):  # the first: warm-up
        shared = policy.views_once(prompt, n)  # n rows of the study, its view encoded once
        with (
            torch.no_grad(),
            common.autocast(policy.device, policy.dtype),
            shared as inputs,
            PrefillClock(policy.model) as clock,
        ):
            policy.model.generate(**inputs, **length)
        call = clock.figures(n, inputs["input_ids"].shape[1])
        sweep[n] = dict(prompt=call["prompt"], decode_steps=call["decode_steps"])
        sweep[n] |= decode_figures([call], weights, kv, bandwidth)
    figures["rows"] = sweep


class Phases:
    """A step part's clock and memory by phase: "load" (from main()'s start to the first rollout: the model, its
    reference, the optimizer) and in each step tests/results/memory.json's phases: "rollout" (generate() and the
    rewards), "reference" (pi_ref's passes), "update" (the rest: log-probs with grad, losses, backward), "optimizer"
    (clip, step, schedule, zero_grad). Each phase: its seconds and torch.cuda.max_memory_allocated and
    max_memory_reserved (reset as it starts; a phase entered again: the larger); each step also keeps what the hooks
    record in it (generate() calls, log-prob passes), with the phase they ran in."""

    def __init__(self):
        self.load, self.steps, self.current, self.start = {}, [], None, None

    def begin(self):
        """Before main(): the load phase starts."""
        sync()
        reset_peak()
        self.current, self.start = "load", time.perf_counter()

    def mark(self, phase: str | None):
        """End the running phase; start `phase` (None: the step is over)."""
        sync()
        now = time.perf_counter()
        if self.current is not None:
            into = self.load if self.current == "load" else self.steps[-1]["phases"]
            seconds, allocated, reserved = into.get(self.current, (0.0, 0, 0))
            now_allocated, now_reserved = memory_peaks()
            into[self.current] = (
                seconds + now - self.start,
                max(allocated, now_allocated),
                max(reserved, now_reserved),
            )
        if phase is not None and self.current in (None, "load"):
            self.steps.append({"phases": {}, "generate": [], "passes": []})
        reset_peak()
        self.current, self.start = phase, now

    def record(self, kind: str, item):
        if self.steps and self.current not in (None, "load"):
            self.steps[-1][kind].append((self.current, item))


def instrument(phases: Phases):
    """The hooks at the phases' edges, and what they record: each generate() call (PrefillClock), each log-prob pass
    (its tokens per parameter group, whether with grad)."""

    def around(owner, name, before, after):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            phases.mark(before)
            out = real(*args, **kwargs)
            phases.mark(after)
            return out

        setattr(owner, name, wrapped)

    around(common, "rollout", "rollout", "update")
    around(common, "reference_logprobs", "reference", "update")
    real_clip, real_log_step = common.clip_gradients, common.Run.log_step
    real_generate, real_logprobs = common.HFPolicy.generate, common.HFPolicy.completion_logprobs

    def clip(params, max_norm):
        phases.mark("optimizer")
        return real_clip(params, max_norm)

    def log_step(self, step):
        phases.mark(None)
        return real_log_step(self, step)

    def generate(self, prompts, *args, **kwargs):
        with PrefillClock(self.model) as clock:
            out = real_generate(self, prompts, *args, **kwargs)
        rows, prompt = len(out[0]), prompts["input_ids"].shape[1]  # rows: n a study
        phases.record("generate", clock.figures(rows, prompt, prefill_writes=False))  # HFPolicy.prefilled's first
        return out

    def completion_logprobs(self, prompts, ids, mask, *args, **kwargs):
        tokens = pass_tokens(prompts, mask, self.model.config.image_token_id)
        phases.record("passes", (tokens, torch.is_grad_enabled()))
        return real_logprobs(self, prompts, ids, mask, *args, **kwargs)

    common.clip_gradients, common.Run.log_step = clip, log_step
    common.HFPolicy.generate, common.HFPolicy.completion_logprobs = generate, completion_logprobs


def part_step(script: str, work: Path, figures: Figures, model: str | None = None, new_tokens: int = 256):
    """STEPS steps of the script's own main() on its paper's shape (random weights made on the device; no evaluation,
    checkpoint or final model: 15-45 GB files), the last one measured: per phase (Phases) seconds, max allocated and
    reserved memory beside tests/memory_check.py's prediction for the setting gpu_<script> (memory.json); the update's
    and the reference pass's model FLOP utilisation (pass_flops; under LoRA the reference pass counts the adapters it
    switches off: 4 % high on the 7B); decode ms per step against the HBM bound."""
    folder, flags, stands_for = STEP_SHAPES[script]
    folder = work / (model or folder)
    build_on_the_device()
    phases = Phases()
    instrument(phases)
    common.Run.evaluate, common.Run.checkpoint, common.HFPolicy.save = no_evaluation, lambda *a: None, lambda *a: None
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
    setting = f"gpu_{script}"
    predicted = predicted_peaks(setting)
    where = f"{os.path.relpath(MEMORY_JSON, ROOT)}: {setting}"
    figures.update(
        stands_for=stands_for, flags=base, memory_prediction=where if predicted else f"no prediction ({where})"
    )
    figures["predicted_for"] = predicted and predicted.get("setting")
    phases.begin()
    try:
        module.main(base)
    except torch.cuda.OutOfMemoryError as e:
        figures["out_of_memory"] = str(e).splitlines()[0][:300]
    if phases.current is not None:  # the phase an error ended: its peak so far
        phases.mark(None)
    peaks = predicted and predicted["peak"]
    if len(phases.steps) < STEPS:  # what ran: the load, the last step begun
        last = phases.steps[-1]["phases"] if phases.steps else {}
        return figures.update(steps_done=len(phases.steps), phases=phase_figures({**phases.load, **last}, peaks))
    last = phases.steps[-1]
    measured = {**phases.load, **last["phases"]}
    figures["phases"] = phase_figures(measured, peaks)
    figures["peak"] = dict(
        allocated_gb=round(max(a for _, a, _ in measured.values()) / GB, 3),
        reserved_gb=round(max(r for _, _, r in measured.values()) / GB, 3),
    )
    policy_model = module_policy_model()
    groups = parameter_groups(policy_model)
    figures["parameters"] = {k: sum(p.numel() for p in v) for k, v in groups.items()}
    figures["trained_parameters"] = {k: sum(p.numel() for p in v if p.requires_grad) for k, v in groups.items()}
    flop_s, bandwidth = device_peaks(device_name())
    for phase in ("update", "reference"):
        passes = [item for p, item in last["passes"] if p == phase]
        if not passes:  # DEER: no reference
            continue
        flops = sum(pass_flops(groups, tokens, grad) for tokens, grad in passes)
        seconds = last["phases"].get(phase, (0.0,))[0]
        tokens = {k: sum(t[k] for t, _ in passes) for k in GROUPS}
        figures[phase] = dict(passes=len(passes), tokens=tokens, model_flops=flops)
        figures[phase]["mfu"] = flop_s and seconds and round(flops / seconds / flop_s, 3)
    calls = [c for _, c in last["generate"]]
    weights, kv = decode_weight_bytes(policy_model), kv_bytes_per_token(policy_model.config)
    figures.update(completions=sum(c["rows"] for c in calls), new_tokens=max(c["new_tokens"] for c in calls))
    figures["decode"] = decode_figures(calls, weights, kv, bandwidth)


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


def part_environment(work: Path):
    """A part's settings: the scripts' cache in the work folder, no METEOR (Java), no figures."""
    os.environ.update(RRG_CACHE=str(work / "cache"), RRG_METEOR="0", RRG_FIGURES="0", TOKENIZERS_PARALLELISM="false")


def run_part(name: str, work: Path):
    figures = Figures(work / "parts" / f"{name.replace(':', '_')}.json")
    kind, _, arg = name.partition(":")
    part_environment(work)
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
    skip = ("traceback", "error", "flags", "stands_for", "predicted_for", "parameters", "trained_parameters")
    figures = {k: v for k, v in part["figures"].items() if k not in skip}
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
