"""Each paper's configuration measured per GPU at its real shapes, on the CPU, with no GPU and no weights: PyTorch's own
MemTracker counts every tensor one step of the project's code makes, on a model built from the published config with
fake tensors (FakeTensorMode: shapes and bytes, no memory touched) and a fake process group of the paper's size.

    python tests/memory_check.py                          # every setting -> tests/results/memory.json, the table
    python tests/memory_check.py orapo_a10 --layers 2     # one setting, cut to 2 layers (a quick look)
    python tests/memory_check.py --root OLD_TREE --out before.json   # another checkout's code (before a change)

What runs is the project's own: common.for_training (LoRA, the frozen reference, fp32 master weights, FSDP2's
shard), common.rollout and micro_batches, the reference's pass, each script's step (orapo_step, grpo_step, ditpo_step,
sft_loss) and backward, clip, AdamW's step. Two things stand in: the policy's inputs (ShapePolicy: prompts, images
and completions of the setting's shapes, no processor) and generate() (data-dependent: it samples and stops at EOS),
which here prefills the prompts (HFPolicy.prefilled: once a study, the cache repeated to the G rows) and decodes the
completion's tokens in one chunk into the cache, under the same common.gathered, so that its peak holds the KV cache
at full length. Two steps run; the second is kept (the first step's optimizer allocates its states; fake tensors also
count a transient there that real ones do not).

Phases and what each peak holds, per GPU (rank 0; every rank holds the same under FSDP2 and DDP):
    load         the policy and reference as training starts them (for_training), from weights read in bf16
    rollout      generate: the KV cache at full length, the weights FSDP2 gathers for it (common.gathered)
    reference    the frozen reference's log-probs, each micro-batch (no graph)
    update       each micro-batch's forward and backward (the script's step), gradients accumulating
    optimizer    clip and AdamW's step
Checkpoint save and resume move host memory, not GPU memory (tests/MACHINES.md counts them from the sizes).

The fake tensors' index math (image grids, positions, token ids) runs for real: IndexMode computes integer tensors
made from Python numbers and everything derived from them alone (the vision tower's windows, the rope positions), so
the model's data-dependent bookkeeping works; every float tensor stays fake.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from hub_layout import QWEN3B_IDS, QWEN3B_TEXT, QWEN3B_VISION, QWEN7B_TEXT, QWEN7B_VISION, qwen_config

GiB = 2**30
aten = torch.ops.aten
# the tests' tiny shape: the 3B's vocabulary and special ids, small widths (real tensors fit on a CPU in seconds)
TINY_TEXT = dict(QWEN3B_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY_TEXT |= dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
TINY_VISION = dict(QWEN3B_VISION, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
TINY_VISION |= dict(fullatt_block_indexes=[1])
MODELS = {"3b": (QWEN3B_TEXT, QWEN3B_VISION), "7b": (QWEN7B_TEXT, QWEN7B_VISION), "tiny": (TINY_TEXT, TINY_VISION)}
PROMPT_TEXT = 60  # the chat template's text tokens around the image (system turn, instruction, generation prompt)
PHASES = ("load", "rollout", "reference", "update", "optimizer")


@dataclass
class Setting:
    """One paper's run as a GPU sees it: per rank, the studies a step, G completions each, in `micro` micro-batches."""

    paper: str  # where the paper ran it
    script: str  # orapo, mrg_r1, deer (RL) or sft (common.sft_stage's step: deer's SFT, rrgcl's training)
    model: str  # 3b or 7b (Qwen2.5-VL-3B-Instruct; HuatuoGPT-Vision-7B-Qwen2.5VL's shape)
    world: int  # processes (GPUs)
    gpus: tuple  # the cards it is judged on (GPU_GIB's names)
    studies: int  # per rank per step
    G: int = 1
    micro: int = 1  # --grad-accum
    fsdp: bool = False
    lora: dict | None = None
    reference: bool = True  # a frozen copy (LoRA: the adapters off, no copy)
    trainable: str = "all"  # all, or "vision" (DEER's SFT: the tower and merger, the LM frozen)
    new_tokens: int = 256  # generated (RL), max_new_tokens
    target_tokens: int = 160  # an SFT target or OraPO's chosen (ground-truth) report, EOS included
    flags: str = ""  # the command line it stands for
    grid: tuple = (1, 32, 40)  # a view's patches (t, h, w): a MIMIC-CXR view (2544 x 3056) at --max-pixels 512 x 512


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_128 = dict(r=128, alpha=256, dropout=0.05, targets=LORA_TARGETS)  # mrg_r1.LORA
# GiB a card holds (nvidia-smi's total): A10 23,028 MiB, A6000 49,140, V100 32 GB 32,510, A100 80 GB 81,920, H100 SXM
# 81,559; a peak fits when it leaves common.GPU_RESERVE_GIB free (the CUDA context, NCCL's buffers, the allocator)
GPU_GIB = {"A10 24 GB": 22.49, "V100 32 GB": 31.75, "A6000 48 GB": 47.99, "A100 80 GB": 80.0, "H100 80 GB": 79.65}
SETTINGS = {
    "orapo_a10": Setting(
        "OraPO: 4 x A10, Qwen2.5-VL-3B full fine-tuning",
        "orapo",
        "3b",
        4,
        ("A10 24 GB",),
        studies=1,
        G=8,
        fsdp=True,
        flags="torchrun --nproc_per_node=4 orapo.py --fsdp (4 studies x G 8 a step)",
    ),
    "orapo_h100": Setting(
        "OraPO's defaults on one 80 GB GPU",
        "orapo",
        "3b",
        1,
        ("H100 80 GB",),
        studies=4,
        G=8,
        flags="python orapo.py",
    ),
    "mrg_r1_2gpu": Setting(
        "MRG-R1: 2 GPUs, 7B with LoRA r 128 (the paper: 2 x A100)",
        "mrg_r1",
        "7b",
        2,
        ("A10 24 GB", "V100 32 GB", "A100 80 GB"),
        studies=2,
        G=4,
        lora=LORA_128,
        reference=False,
        flags="torchrun --nproc_per_node=2 mrg_r1.py (4 studies x G 4 a step)",
    ),
    "deer_rl_8x80": Setting(
        "DEER RL: 8 x 80 GB, 3B full fine-tuning",
        "deer",
        "3b",
        8,
        ("H100 80 GB",),
        studies=8,
        G=8,
        micro=4,
        fsdp=True,
        reference=False,
        flags="torchrun --nproc_per_node=8 deer.py rl --fsdp --grad-accum 4 (64 x G 8 a step)",
    ),
    "deer_sft_8x80": Setting(
        "DEER SFT: 8 x 80 GB, the vision tower and merger",
        "sft",
        "3b",
        8,
        ("H100 80 GB",),
        studies=8,
        reference=False,
        trainable="vision",
        flags="torchrun --nproc_per_node=8 deer.py sft (64 studies a step)",
    ),
    "rrgcl_a6000": Setting(
        "RRGCL: one A6000, 3B with LoRA r 16",
        "sft",
        "3b",
        1,
        ("A6000 48 GB",),
        studies=32,
        reference=False,
        lora=dict(r=16, alpha=32, dropout=0.05, targets=LORA_TARGETS),
        flags="python rrgcl.py (32 studies a step)",
    ),
    # tests/gpu_check.py's step parts on one GPU: the measured peaks there are checked against these
    "gpu_orapo": Setting(
        "gpu_check step:orapo, one GPU",
        "orapo",
        "3b",
        1,
        ("H100 80 GB",),
        studies=1,
        G=8,
        flags="gpu_check.py: orapo.py, 1 study x G 8",
    ),
    "gpu_deer": Setting(
        "gpu_check step:deer, one GPU",
        "deer",
        "3b",
        1,
        ("H100 80 GB",),
        studies=8,
        G=8,
        micro=4,
        reference=False,
        flags="gpu_check.py: deer.py rl, 8 studies x G 8, --grad-accum 4",
    ),
    "gpu_mrg_r1": Setting(
        "gpu_check step:mrg_r1, one GPU",
        "mrg_r1",
        "7b",
        1,
        ("H100 80 GB",),
        studies=4,
        G=4,
        lora=LORA_128,
        reference=False,
        flags="gpu_check.py: mrg_r1.py, 4 studies x G 4",
    ),
}


# Fake tensors with real index math --------------------------------------------------------------------------------
fake_tensor.CONSTANT_NUMEL_LIMIT = 1 << 22  # integer tensors up to 4 M entries keep their values ("constants")
ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
FILL = {aten.full.default, aten.ones.default, aten.zeros.default}


class IndexMode(FakeTensorMode):
    """FakeTensorMode in which integer tensors made from Python numbers (arange, full, ones, zeros, torch.tensor) are
    real, and so is everything computed from them alone (FakeTensorMode propagates such "constants"): the image grid,
    windows and positions the model derives with data-dependent operations. `.item()` of a fake float (a logged loss)
    is 0.0: its value moves no memory."""

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        integral = dtype is not None and not dtype.is_floating_point and not dtype.is_complex
        small = func in FILL and integral and math.prod(args[0]) <= fake_tensor.CONSTANT_NUMEL_LIMIT
        if (func in ARANGE and (dtype is None or integral)) or small:
            with unset_fake_temporarily():
                real = func(*args, **{**kwargs, "device": "cpu"})
            if not real.is_floating_point():
                return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)
        if func is aten._local_scalar_dense.default and args[0].constant is None and args[0].is_floating_point():
            return 0.0
        return super().dispatch(func, types, args, kwargs)

    def constant(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor as a fake one that keeps its values."""
        return self.fake_tensor_converter.from_real_tensor(self, t, make_constant=True)

    def __deepcopy__(self, memo):  # frozen_reference deep-copies the policy: the copy's tensors stay in this mode
        return self


class RealMode(contextlib.nullcontext):
    """IndexMode's interface on real tensors (the check that fake and real steps hold the same bytes)."""

    def constant(self, t):
        return t


class PhaseTracker(MemTracker):
    """MemTracker's totals and peaks without its per-module statistics, which allow a root module one call a step
    (a step here calls the model in generate, the reference's pass and the loss)."""

    def _pre_fw_hook(self, module, inputs):
        pass

    def _post_fw_hook(self, module, inputs, outputs):
        pass

    def _pre_bw_hook(self, module, args):
        pass

    def _post_bw_hook(self, module, args):
        pass

    def total(self, kind: str = "current") -> int:
        return sum(snap["Total"] for snap in self.get_tracker_snapshot(kind).values())

    def restart_peak(self):
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}


# The policy at a setting's shapes ------------------------------------------------------------------------------------
def shape_policy(common, mode, model, setting: Setting, dtype):
    """An HFPolicy (the project's own methods) whose inputs are the setting's shapes: B studies of one MIMIC-size view,
    a P-token prompt, T-token completions and targets; generate() fills the KV cache to P + T (module docstring)."""
    cfg = model.config
    grid, image_tokens = setting.grid, math.prod(setting.grid) // 4  # 2 x 2 patches merged into a token
    P = image_tokens + PROMPT_TEXT

    class ShapePolicy(common.HFPolicy):
        def __init__(self):
            self.model, self.forward_module, self.device, self.dtype = model, model, torch.device("cpu"), dtype
            self.eos_token_id = self.pad_token_id = 0
            self.eos_token_ids = [0]
            self.suppressed = [
                cfg.image_token_id,
                cfg.video_token_id,
                cfg.vision_start_token_id,
                cfg.vision_end_token_id,
            ]
            self.tokenizer = types.SimpleNamespace(batch_decode=lambda rows, **k: ["a report"] * len(rows))

        def prompt_batch(self, images, text=None) -> dict:
            n = len(images)
            with unset_fake_temporarily():
                ids = torch.full((n, P), 100)
                ids[:, 4], ids[:, 5 : 5 + image_tokens] = cfg.vision_start_token_id, cfg.image_token_id
                ids[:, 5 + image_tokens] = cfg.vision_end_token_id
                fixed = dict(
                    input_ids=ids, attention_mask=torch.ones_like(ids), image_grid_thw=torch.tensor([grid] * n)
                )
                fixed["n_images"] = torch.ones(n, dtype=torch.long)
                prompts = {k: mode.constant(v) for k, v in fixed.items()}
            with mode:
                prompts["pixel_values"] = torch.randn(n * math.prod(grid), 3 * 2 * 14 * 14, dtype=torch.float32)
            return prompts

        def encode_targets(self, texts):
            with unset_fake_temporarily():
                ids, mask = (
                    torch.full((len(texts), setting.target_tokens), 101),
                    torch.ones(len(texts), setting.target_tokens),
                )
                return mode.constant(ids), mode.constant(mask)

        def generate(self, prompts, max_new_tokens=256, temperature=1.0, n=1, **kwargs):
            prefill_once = hasattr(self, "prefilled")  # each prompt prefilled once, the cache repeated (issue 69, 2)
            share = None if prefill_once else getattr(self, "views_once", None)  # n rows a study (before: repeated)
            rows = share(prompts, n) if share else contextlib.nullcontext(prompts)
            was_training = self.model.training
            self.model.eval()
            once = (
                {"once": self.vision_and_language()[0]}
                if "once" in inspect.signature(common.gathered).parameters
                else {}
            )
            gathered = common.gathered(self.model, **once)  # (before: the vision tower gathered for the whole rollout)
            with rows as inputs, torch.no_grad(), gathered, common.autocast(self.device, dtype):
                inputs = {k: v for k, v in inputs.items() if k in self.MODEL_KEYS}
                N = inputs["input_ids"].shape[0] * (n if prefill_once else 1)
                with unset_fake_temporarily():
                    ids = mode.constant(torch.full((N, max_new_tokens), 102))
                    ones = mode.constant(torch.ones(N, max_new_tokens, dtype=torch.long))
                    mask = mode.constant(torch.ones(N, max_new_tokens))
                    no_offset = mode.constant(torch.zeros(len(prompts["input_ids"]), 1, dtype=torch.long))
                if prefill_once:  # no mm_token_type_ids here (no get_rope_index on fake tensors): no rope_deltas set
                    self.model.model.rope_deltas = no_offset  # for prefilled() to repeat; text positions, as before
                    inputs = out = self.prefilled(prompts, n)  # the cache holds P - 1 tokens: the last decodes too
                    self.model.model.rope_deltas = None  # the decode below: positions from the cache length
                    ids_in = torch.cat([inputs["input_ids"][:, -1:], ids], 1)
                else:  # the prompts' prefill on the N rows
                    out, ids_in = self.model(**inputs, use_cache=True, logits_to_keep=1), ids
                key = "cache" if "cache" in out else "past_key_values"  # transformers 5.x renamed it (as prefilled)
                attention = torch.cat([inputs["attention_mask"], ones], 1)
                self.model(input_ids=ids_in, attention_mask=attention, **{key: out[key]}, logits_to_keep=1)
            self.model.train(was_training)
            return ids, mask

    return ShapePolicy()


def build_model(setting: Setting, mode, layers: int | tuple | None):
    """Qwen2.5-VL from its published config, in bf16 as from_pretrained(dtype=bf16) reads it, checkpointed as
    make_policy sets it; cut to `layers` decoder layers and vision blocks for a quick look, or (decoder layers,
    windowed vision blocks, full-attention ones)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    text, vision = MODELS[setting.model]
    cut = {}
    if layers:
        text_layers, windowed, full = layers if isinstance(layers, tuple) else (layers, layers - 1, 1)
        fullatt = list(range(windowed, windowed + full))
        cut = dict(num_hidden_layers=text_layers, depth=windowed + full, fullatt_block_indexes=fullatt)
    cfg = qwen_config(text, vision, QWEN3B_IDS, **cut)[0]
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with mode:
            model = Qwen2_5_VLForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # as HFPolicy
    enable({"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


# One setting, measured ------------------------------------------------------------------------------------------------
def measure(setting: Setting, layers: int | None = None, root: Path = ROOT, fake: bool = True, steps: int = 2) -> dict:
    """Peak bytes per phase on rank 0 (the second step's; `load` from the start), and the parameter counts."""
    common = import_tree(root)
    mode = IndexMode() if fake else RealMode()
    dist = torch.distributed
    if setting.world > 1 and setting.fsdp:  # DDP's own bytes are its buckets (ddp_buckets): one process runs the rest
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setting.world)
    try:
        with mode:
            return run_setting(common, mode, setting, layers, steps)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_setting(common, mode, setting: Setting, layers, steps) -> dict:
    dtype = torch.bfloat16
    model = build_model(setting, mode, layers)
    counts = dict(parameters=sum(p.numel() for p in model.parameters()))
    counts["vision"] = sum(p.numel() for p in model.model.visual.parameters())
    policy = shape_policy(common, mode, model, setting, dtype)
    world = setting.world if setting.fsdp else 1  # DDP: one process, its buckets added below
    run = types.SimpleNamespace(dtype=dtype, world_size=world, device=torch.device("cpu"))
    peaks = dict.fromkeys(PHASES, 0)
    tracker = PhaseTracker()
    host = setting.fsdp and setting.world > 1 and "host" in inspect.signature(common.HFPolicy.__init__).parameters
    if not host:  # the weights were read onto the GPU (host: they stay in host memory, shard() moves each part)
        tracker.track_external(policy.model)
    with tracker:
        if setting.trainable == "vision":
            policy.model.requires_grad_(False)
            policy.vision_and_language()[0].requires_grad_(True)
            common.fp32_trainable(policy.model)
            policy.forward_module = common.data_parallel(policy.model, world)
            ref = None
        else:
            lora = setting.lora
            policy, ref = common.for_training(run, policy, lora=lora, reference=setting.reference, fsdp=setting.fsdp)
        peaks["load"] = tracker.total("peak")
    if host:  # the copies made on the host freed, this rank's shards stay; fully_shard moved each unit whole first
        peaks["load"] = tracker.total("current") + largest_unit(policy.model)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    counts["trained"] = sum(p.numel() for p in params)
    optimizer, scheduler = common.adamw(params, 1e-6, 10, foreach=False)  # as the fused kernel: no temporaries
    tracker = PhaseTracker()
    tracker.track_external(policy.model, optimizer, *([ref.model] if isinstance(ref, common.Policy) else []))
    with tracker:
        for step in range(steps):
            kept = step == steps - 1
            one_step(
                common, mode, setting, policy, ref, optimizer, scheduler, peak_marks(tracker, peaks if kept else {})
            )
    if setting.world > 1 and not setting.fsdp:
        for name in ("update", "optimizer"):
            peaks[name] += ddp_buckets(common, counts["trained"])
    return {"setting": asdict(setting), "layers": layers, "counts": counts, "peak": peaks}


def estimate(setting: Setting, layers=None, root: Path = ROOT) -> dict:
    """common.memory_estimate's GiB per phase for the setting: what a run prints before it loads weights."""
    import tempfile

    common = import_tree(root)
    text, vision = MODELS[setting.model]
    cut = {}
    if layers:
        cut = dict(num_hidden_layers=layers, depth=layers, fullatt_block_indexes=[layers - 1])
    rows = 1 if setting.script == "sft" else setting.G + (setting.script == "orapo")  # OraPO: + the ground truth
    tokens = setting.target_tokens if setting.script == "sft" else setting.new_tokens
    trained = "lora" if setting.lora else setting.trainable
    shape = common.StepShape(setting.studies * setting.world, rows, tokens, setting.micro, setting.script != "sft")
    shape = dataclasses.replace(shape, reference=setting.reference and not setting.lora, lora=setting.lora)
    shape = dataclasses.replace(shape, trained=trained, fsdp=setting.fsdp)
    with tempfile.TemporaryDirectory() as folder:
        qwen_config(text, vision, QWEN3B_IDS, **cut)[0].save_pretrained(folder)
        pixels = setting.grid[1] * setting.grid[2] * 14**2
        return common.memory_estimate(folder, shape, setting.world, max_pixels=pixels)


def ddp_buckets(common, trained: int) -> int:
    """DistributedDataParallel's gradient buckets: the gradients themselves with gradient_as_bucket_view (common's
    data_parallel), else a second fp32 copy of them."""
    return 0 if "gradient_as_bucket_view=True" in inspect.getsource(common.data_parallel) else 4 * trained


def peak_marks(tracker, peaks: dict):
    """one_step's `phase`: each phase's peak into `peaks` (the largest over micro-batches)."""

    def phase(name):
        if name in peaks:
            peaks[name] = max(peaks[name], tracker.total("peak"))
        tracker.restart_peak()

    tracker.restart_peak()
    return phase


def one_step(common, mode, setting, policy, ref, optimizer, scheduler, phase):
    """One step as the script's loop takes it; phase(name) is called as each phase ends."""
    images = [[None]] * setting.studies
    studies = {"id": list(range(setting.studies)), "images": images, "report": ["a report"] * setting.studies}
    if setting.script == "sft":
        for micro in common.split_batch(studies, setting.micro):
            with common.gradient_sync(policy.forward_module, last=True), common.autocast(policy.device, policy.dtype):
                loss = policy.sft_loss(policy.prompt_batch(micro["images"], "x"), micro["report"])
            (loss / setting.micro).backward()
            phase("update")
    else:
        G, T = setting.G, setting.new_tokens
        rollout = inspect.signature(common.rollout).parameters
        if "reward_fn" in rollout:
            roll = common.rollout(policy, images, "x", G, lambda texts, owners: [0.0] * len(texts), T)
        else:
            roll = common.rollout(policy, images, "x", G, T)
            with unset_fake_temporarily():  # as the scripts' rewards: real numbers (advantages index by them)
                roll.rewards = mode.constant(torch.zeros(len(roll.texts)))
        phase("rollout")
        micros = common.micro_batches(policy, roll, setting.micro, G)
        parts = common.split_batch(studies, setting.micro)
        for k, (micro, mine) in enumerate(zip(micros, parts)):
            with common.gradient_sync(policy.forward_module, last=k == len(micros) - 1):
                if setting.script == "orapo" and hasattr(importlib.import_module("orapo"), "with_chosen"):
                    micro = importlib.import_module("orapo").with_chosen(policy, micro, mine["report"], G)
                with common.autocast(policy.device, policy.dtype):
                    ref_logp = common.reference_logprobs(ref, micro, 1.0)
                phase("reference")
                with common.autocast(policy.device, policy.dtype):
                    loss = script_loss(mode, setting, policy, ref, micro, ref_logp, mine)
                (loss / setting.micro).backward()
            phase("update")
    common.clip_gradients([p for p in policy.model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    phase("optimizer")


def count_flops(common, mode, setting: Setting, layers) -> dict:
    """FLOPs of one step per phase (torch.utils.flop_counter: matrix products and attention, forward and backward,
    activation checkpointing's recomputation included) on this rank, the model cut to `layers`."""
    from torch.utils.flop_counter import FlopCounterMode

    dtype = torch.bfloat16
    policy = shape_policy(common, mode, build_model(setting, mode, layers), setting, dtype)
    world = setting.world if setting.fsdp else 1
    run = types.SimpleNamespace(dtype=dtype, world_size=world, device=torch.device("cpu"))
    if setting.trainable == "vision":
        policy.model.requires_grad_(False)
        policy.vision_and_language()[0].requires_grad_(True)
        ref = None
    else:
        policy, ref = common.for_training(
            run, policy, lora=setting.lora, reference=setting.reference, fsdp=setting.fsdp
        )
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer, scheduler = common.adamw(params, 1e-6, 10, foreach=False)
    flops, counter = dict.fromkeys(PHASES[1:], 0), FlopCounterMode(display=False)
    done = [0]

    def phase(name):
        total = counter.get_total_flops()
        flops[name] += total - done[0]
        done[0] = total

    with counter:
        one_step(common, mode, setting, policy, ref, optimizer, scheduler, phase)
    return flops


def flops_at_full_depth(setting: Setting, root: Path = ROOT) -> dict:
    """A step's FLOPs per phase at the published depth, exactly: every decoder layer does the same work, and so does
    every windowed vision block and every full-attention one, so FLOPs = base + L a + W b + F c. Counted at four cut
    depths (decoder layers, windowed blocks, full blocks) = (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2) and solved,
    then taken at the config's (36, 28, 4) for the 3B (28, 28, 4 for the 7B)."""
    common = import_tree(root)
    mode = IndexMode()
    dist = torch.distributed
    if setting.world > 1 and setting.fsdp:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setting.world)
    try:
        with mode:
            cuts = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
            a, text, windowed, full = (count_flops(common, mode, setting, cut) for cut in cuts)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    t, v = MODELS[setting.model]
    n_full = len(v["fullatt_block_indexes"])
    depth = dict(text=t["num_hidden_layers"], windowed=v["depth"] - n_full, full=n_full)
    out = {}
    for k in a:
        per = {"text": text[k] - a[k], "windowed": windowed[k] - a[k], "full": full[k] - a[k]}
        base = a[k] - sum(per.values())
        out[k] = base + sum(depth[x] * per[x] for x in per)
    return out


def script_loss(mode, setting, policy, ref, micro, ref_logp, studies):
    """The script's own step function on one micro-batch."""
    G, T, B = setting.G, setting.new_tokens, len(studies["report"])
    if setting.script == "orapo":
        orapo = importlib.import_module("orapo")
        lam, z = np.full(B, 0.1), np.zeros(B)
        settings = dict(beta=0.04, loss_type="dr_grpo", max_len=T, dpo_beta=2.0)
        if "ref" in inspect.signature(orapo.orapo_step).parameters:  # before issue 69: the chosen in a second pass
            return orapo.orapo_step(policy, ref, micro, ref_logp, studies, lam, z, G, True, **settings)[0]
        return orapo.orapo_step(policy, micro, ref_logp, lam, z, G, True, **settings)[0]
    if setting.script == "mrg_r1":
        mrg_r1 = importlib.import_module("mrg_r1")
        return mrg_r1.grpo_step(policy, micro, ref_logp, G, 0.04, "dr_grpo", T)[0]
    deer = importlib.import_module("deer")
    with mode:
        w = torch.ones(micro.completion_ids.shape)  # DiTPO's token weights
    return deer.ditpo_step(policy, micro, w, G)[0]


def largest_unit(model) -> int:
    """Bytes of the largest unit fully_shard moves to the GPU whole before splitting it (a block, or the root's own
    parameters: the embedding), at their dtype now (fp32 master weights)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def own(m):
        inner = {id(p) for u in units if u is not m and any(u is q for q in m.modules()) for p in u.parameters()}
        return [p for p in m.parameters() if id(p) not in inner]

    return max(sum(p.numel() * p.element_size() for p in own(m)) for m in units)


def import_tree(root: Path):
    """common (and the scripts) from `root`'s checkout."""
    if str(root) != sys.path[0]:
        sys.path.insert(0, str(root))
    common = importlib.import_module("common")
    assert Path(common.__file__).resolve().parent == Path(root).resolve(), f"{common.__file__} is not under {root}"
    return common


def verdict(setting: Setting, peak: int) -> str:
    """'fits' or 'does not fit' on each of the setting's cards, leaving common.GPU_RESERVE_GIB free."""
    from common import GPU_RESERVE_GIB

    return "; ".join(
        f"{'fits' if peak / GiB <= GPU_GIB[card] - GPU_RESERVE_GIB else 'does not fit'} ({card})"
        for card in setting.gpus
    )


def table(results: dict) -> list[str]:
    """tests/MACHINES.md's table: GiB per GPU in each phase, the peak, the verdict, and common.memory_estimate's."""
    lines = [
        "| setting | per GPU | " + " | ".join(PHASES) + " | peak | estimate (preflight) | verdict |",
        "|---" * (len(PHASES) + 5) + "|",
    ]
    for name, r in results.items():
        if "peak" not in r:
            continue
        s = SETTINGS.get(name) or Setting(**r["setting"])
        shape = f"{s.studies} x G {s.G}" if s.script != "sft" else f"{s.studies} studies"
        shape += f", {s.micro} micro-batches" if s.micro > 1 else ""
        peak = max(r["peak"].values())
        cells = [f"{r['peak'][p] / GiB:.1f}" for p in PHASES]
        estimate = max(globals()["estimate"](s).values()) if name in SETTINGS else math.nan  # what a run prints
        row = f"| {name}: {s.paper} | {shape} | " + " | ".join(cells) + f" | **{peak / GiB:.1f}** | {estimate:.1f} |"
        lines.append(row + f" {verdict(s, peak)} |")
    return lines


def compared(after: dict, before: dict, key: str, unit: float, phases) -> list[str]:
    """A table of `key` (peak bytes or FLOPs) per phase, before and after, for the settings measured both ways."""
    lines = ["| setting | | " + " | ".join(phases) + " |", "|---" * (len(phases) + 2) + "|"]
    for name in [n for n in after if key in after[n] and key in before.get(n, {})]:
        for label, r in (("before", before[name]), ("after", after[name])):
            lines.append(f"| {name} | {label} | " + " | ".join(f"{r[key].get(p, 0) / unit:.1f}" for p in phases) + " |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="*", default=list(SETTINGS), help=f"default: all ({', '.join(SETTINGS)})")
    p.add_argument("--layers", type=int, help="cut the model to this many layers and blocks (a quick look)")
    p.add_argument("--root", default=str(ROOT), help="the checkout whose code runs (default: this one)")
    p.add_argument("--out", default=str(ROOT / "tests" / "results" / "memory.json"))
    p.add_argument("--flops", action="store_true", help="count a step's FLOPs per phase instead (at full depth)")
    p.add_argument("--report", metavar="BEFORE_JSON", help="print the tables only: --out's, and beside BEFORE_JSON's")
    args = p.parse_args(argv)
    if args.report:
        after, before = json.loads(Path(args.out).read_text()), json.loads(Path(args.report).read_text())
        print("\n".join(table(after)), "", sep="\n")
        print("\n".join(compared(after, before, "peak", GiB, PHASES)), "", sep="\n")
        return print("\n".join(compared(after, before, "flops", 1e12, PHASES[1:4])))
    torch.set_num_threads(1)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    for name in args.settings:
        start = time.time()
        if args.flops:
            results.setdefault(name, {})["flops"] = flops_at_full_depth(SETTINGS[name], Path(args.root))
            print(f"{name}: { ({k: f'{v / 1e12:.1f} TFLOP' for k, v in results[name]['flops'].items()}) }", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1) + "\n")
            continue
        results[name] = results.get(name, {}) | measure(SETTINGS[name], args.layers, Path(args.root))
        results[name]["seconds"] = round(time.time() - start, 1)
        print(
            f"{name}: peak {max(results[name]['peak'].values()) / GiB:.1f} GiB ({results[name]['seconds']} s)",
            flush=True,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    if not args.flops:
        print("\n".join(table(results)))


if __name__ == "__main__":
    main()
