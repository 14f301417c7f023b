"""The GPU check (issue 36): one command, at most 8 minutes on one H100 or H200, nothing downloaded.

    python tests/gpu_check.py                          # every part -> tests/results/gpu.json and a summary
    python tests/gpu_check.py --parts rl_core,chexbert # some parts (names below); --out FILE, --work DIR

It first prepares on the CPU what the parts read (a small synthetic set at 64 px and one at 512 px, a tiny random
Qwen2.5-VL, Qwen2.5-VL-3B's config and processor, a word-piece vocabulary), then runs each part in its own process
under its own time limit, so that one failing or hanging leaves the others' figures. Without CUDA it says so in one
line and exits 0 after the preparation (tests/test_gpu_check.py runs that path). The parts, measured ones first:

    qwen3b:mrg_r1    Qwen2.5-VL-3B at full depth (36 decoder layers, its 32-block vision tower), random weights built
    qwen3b:orapo     on the GPU: one step of mrg_r1.main (LoRA r 128, 2 studies x G 4) and of orapo.main (full
                     fine-tuning against a frozen copy, 1 study x G 8), the papers' per-GPU batches, 256 new tokens:
                     step time, generation tokens/s, peak torch.cuda.max_memory_allocated against the formula
    chexbert         CheXbert's shape (bert-base, 14 heads), random weights: labels per second at batch 64, and
                     DiTPO's gradient token weights (deer.gradient_weights) per completion
    scripts:NAME     each of the five scripts a few steps with the tiny model, and (mrg_r1, deer, orapo, rrgcl) with
                     the tiny random Qwen2.5-VL, --dtype auto, stopped after its first checkpoint and resumed
    rl_core          GRPO and DPO losses and gradients under bf16 autocast on CUDA against the CPU, same inputs
    torchrun_nccl    orapo.py --fsdp under `torchrun --nproc_per_node 1` (NCCL), stopped after step 1 and resumed
"""

import argparse
import contextlib
import importlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import common
import sandbox

BUDGET_S = 480  # the whole check
LIMITS_S = {  # each part's own limit, in the order they run; the scripts run side by side at the end
    "qwen3b:mrg_r1": 200,
    "qwen3b:orapo": 200,
    "chexbert": 90,
    "rl_core": 60,
    "torchrun_nccl": 200,
    **{f"scripts:{name}": 240 for name in ("mrg_r1", "deer", "orapo", "rrgcl", "dcrrg")},
}
ALONE = ("qwen3b:mrg_r1", "qwen3b:orapo", "chexbert")  # timed: one at a time, nothing else on the GPU
GB = 1e9
CHEXBERT_REPORTS = 1000  # labelled for the throughput
DEVICE = "cuda"  # the parts' device (a CPU run of a part, to check the part itself: tests/test_gpu_check.py)


# Preparation (CPU) ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 to stderr: the tokenizer trainer's progress (Rust writes it there) leaves stdout to the
    summary."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def prepare(work: Path):
    """What the parts read, in `work`: data (40 / 8 / 48 studies at 64 px; 8 / 2 / 2 at 512 px, about Qwen's 320 image
    tokens of a MIMIC-CXR view under --max-pixels), the tiny Qwen2.5-VL, the 3B's folder (config and processor, no
    weights: a part builds them on the GPU) and bert_vocab.txt (every word and character of the reports)."""
    from conftest import build_tiny_qwen
    from test_real_arch import qwen_config

    if not (work / "data" / "annotation.json").is_file():
        sandbox.make_synthetic(work / "data", n_train=40, n_val=8, n_test=48, size=64, seed=0)
        sandbox.make_synthetic(work / "data512", n_train=8, n_val=2, n_test=2, size=512, seed=0)
    reports = [r.report for r in common.load_annotation(work / "data" / "annotation.json")["train"]]
    prompts = ["You are a radiologist. Describe the chest X-ray.", "<think> </think> <report> </report>"]
    if not (work / "qwen_tiny" / "config.json").is_file():
        build_tiny_qwen(work / "qwen_tiny", reports + prompts)
    if not (work / "qwen3b" / "config.json").is_file():
        build_tiny_qwen(work / "qwen3b", reports + prompts, image_pixels=512 * 512)  # its processor, then the 3B's
        tok = json.loads((work / "qwen3b" / "tokenizer.json").read_text())["added_tokens"]
        ids = {t["content"]: t["id"] for t in tok}
        vision = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        config = qwen_config(ids={k: ids[n] for k, n in zip(vision, names)})[0]
        config.text_config.update(dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]))
        (work / "qwen3b" / "model.safetensors").unlink()
        config.save_pretrained(work / "qwen3b")
    words = sorted({w for r in reports for w in r.lower().replace(".", " . ").replace(",", " , ").split()})
    letters = sorted({c for r in reports for c in r.lower() if not c.isspace()})
    (work / "bert_vocab.txt").write_text("\n".join(sandbox.SPECIAL_PIECES + words + letters) + "\n")


# The parts (each runs in its own process: python tests/gpu_check.py --run-part NAME --work DIR) ----------
class Figures(dict):
    """A part's figures, written to its JSON file at every change: what a part recorded survives its timeout."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value):
        self.update({key: value})

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.path.write_text(json.dumps(self, indent=1, default=str))


def stop_after_first_checkpoint():
    """Checkpoints every step, and Ctrl-C's path right after the first one saved (the first stage's; RL's after a
    warm start); the returned function re-arms it. The same command with --resume then goes on from last.pt."""
    save, armed = common.Run.checkpoint, [True]
    common.CHECKPOINT_EVERY = 1

    def checkpoint_then_stop(self, step):
        save(self, step)
        if armed[0] and self.out.name != "warm_start":
            armed[0] = False
            raise KeyboardInterrupt("gpu_check stopped the run after its first checkpoint")

    def rearm():
        armed[0] = True

    common.Run.checkpoint = checkpoint_then_stop
    return rearm


def script_runs(name: str, work: Path) -> dict:
    """Each script's command lines (without --out): the tiny model, and the tiny Qwen2.5-VL where it takes one."""
    data, qwen = str(work / "data" / "annotation.json"), str(work / "qwen_tiny")
    hf = ["--model", qwen, "--labeler", "rule", "--max-pixels", str(56 * 56)]
    short = ["--data", data, "--steps", "2", "--max-new-tokens", "8"]
    steps = [flag for k in "1234" for flag in (f"--step{k}-steps", "2")]
    runs = {
        "mrg_r1": {"tiny": [*short, "--sft-steps", "2", "--prompts-per-step", "2"]},
        "orapo": {"tiny": [*short, "--sft-steps", "2", "--prompts-per-step", "2", "--group-size", "4"]},
        "deer": {"tiny": ["all", *short, "--sft-steps", "2", "--prompts-per-step", "2", "--group-size", "4"]},
        "rrgcl": {"tiny": ["--data", data, "--epochs", "1", "--steps", "2", "--batch-size", "8"]},
        "dcrrg": {"tiny": ["all", "--data", data, "--n-test", "48", *steps]},  # Step 2's retrieval on the GPU
    }
    for script in ("mrg_r1", "orapo", "deer"):
        runs[script]["qwen"] = [*runs[script]["tiny"], *hf, "--group-size", "2"]
    difficulty = str(work / "runs" / "rrgcl_tiny" / "difficulty.json")  # the tiny run's measurer, read again
    rrgcl_hf = ["--batch-size", "2", *hf[:4], "--difficulty", difficulty]  # rrgcl has no --max-pixels
    runs["rrgcl"]["qwen"] = [*runs["rrgcl"]["tiny"][:-2], *rrgcl_hf]
    return runs[name]


def part_script(name: str, work: Path, figures: Figures):
    """A few steps of the script on CUDA, stopped after its first checkpoint and resumed: the steps logged, the dtype
    --dtype auto chose, the evaluation's headline, seconds per run."""
    module = importlib.import_module(name)
    if name == "deer":  # SFT's batch of 64 studies (HF models), from 40 here
        module.SFT = dict(module.SFT, batch_hf=8)
    rearm = stop_after_first_checkpoint()
    for model, flags in script_runs(name, work).items():
        out = work / "runs" / f"{name}_{model}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.time()
        try:
            module.main([*flags, "--out", str(out)])
            raise RuntimeError("the run was not stopped after its first checkpoint")
        except SystemExit as e:
            if e.code != 130:  # Ctrl-C's exit: stopped after the checkpoint
                raise
        module.main([*flags, "--out", str(out), "--resume"])
        steps = {}
        for log in sorted(out.glob("**/metrics.jsonl")):
            steps[str(log.parent.relative_to(out))] = [json.loads(x)["step"] for x in log.read_text().splitlines()]
        config = json.loads(next(p for p in sorted(out.glob("**/config.json")) if "final" not in p.parts).read_text())
        headlines = {}  # each stage's evaluation: its headline CE number
        for path in sorted(out.glob("**/eval.json")):
            for key, r in json.loads(path.read_text()).items():
                if isinstance(r, dict) and "ce" in r:
                    headlines[f"{path.parent.relative_to(out)}/{key}"] = r["ce"].get(r.get("headline", "micro_f1"))
        seconds = round(time.time() - start, 1)
        figures[model] = dict(seconds=seconds, dtype=config["dtype"], steps=steps, headline_ce=headlines)
        rearm()


def part_rl_core(work: Path, figures: Figures):
    """GRPO (dr_grpo, k3 KL 0.04) and LN-DPO (beta 2) on log-probs from a bf16 LM head (autocast), loss and the
    gradients of the head and its input, CUDA against the CPU on the same inputs. Bound: the two devices round the same
    bf16 operands and accumulate in fp32, so the logits differ by at most one bf16 step (2^-8 relative) where rounding
    lands apart; log-probs then by 2 x 2^-8 of the largest |logit| and the gradients, through bf16 matmuls once more,
    by a few 2^-8 of their largest element: within 2^-5 relative, norm-wise. Without autocast (fp32) ~1e-6."""
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
        grpo, _ = common.grpo_loss(logp, None, ref, A, m, beta=0.04, loss_type="dr_grpo", max_completion_length=T)
        dpo, _ = common.dpo_loss(logp[0::2], logp[1::2], ref[0::2], ref[1::2], 2.0, True, m[0::2], m[1::2])
        (grpo + dpo).backward()
        return dict(grpo=grpo.detach().cpu(), dpo=dpo.detach().cpu(), d_hidden=h.grad.cpu(), d_head=w.grad.cpu())

    for autocast in (True, False):
        cpu, cuda = losses("cpu", autocast), losses(DEVICE, autocast)
        rel = {k: float((cuda[k] - cpu[k]).norm() / cpu[k].norm().clamp_min(1e-30)) for k in cpu}
        key = "bf16" if autocast else "fp32"
        figures[key] = dict(relative_difference=rel, bound=2**-5 if autocast else 1e-4)
        figures[f"{key}_within_bound"] = all(v <= figures[key]["bound"] for v in rel.values())


# Qwen2.5-VL-3B: the formula of tests/MACHINES.md ("Real architectures and GPU memory") --------------------------
QWEN3B_PARAMS = 3_754_622_976
EMBEDDING_PARAMS = 151936 * 2048  # tied to the LM head
LORA_R128_PARAMS = 36 * 128 * (2 * (2048 + 2048) + 2 * (2048 + 256) + 3 * (2048 + 11008))  # 239,468,544
PER_COMPLETION = 0.82 * GB  # activations of one completion of P 380 + T 256 tokens, checkpointed (tests/MACHINES.md)


def formula_gb(script: str, completions: int) -> float:
    """M = S + n x 0.82 GB: S = 18 B a trained parameter (fp32 master, gradient, AdamW, bf16 copy), 2 B a frozen one
    (the LoRA base, the reference; 4 B its embedding)."""
    if script == "mrg_r1":
        states = 2 * QWEN3B_PARAMS + 18 * LORA_R128_PARAMS
    else:  # the reference's embedding in fp32, as the policy's (common.frozen_reference)
        states = (18 + 2) * QWEN3B_PARAMS + 2 * EMBEDDING_PARAMS
    return (states + completions * PER_COMPLETION) / GB


def part_qwen3b(script: str, work: Path, figures: Figures):
    """One step of the script's main() on Qwen2.5-VL-3B's full shape, random weights made on the GPU (from_pretrained
    builds from the config there: 8 GB of bf16, no file), no evaluation and no checkpoint (45 GB for OraPO)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from conftest import fake_eval

    def build_on_the_gpu(path, dtype=None, **kwargs):
        with torch.device(DEVICE):
            return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), dtype=dtype)

    generation = []

    def timed_generate(self, *args, **kwargs):
        torch.cuda.synchronize()
        start = time.time()
        out = generate(self, *args, **kwargs)
        torch.cuda.synchronize()
        generation.append((out[0].numel(), float(out[1].sum()), time.time() - start))
        return out

    def nothing(*args, **kwargs):
        """Run.checkpoint and HFPolicy.save: no 15-45 GB file."""

    generate = common.HFPolicy.generate
    AutoModelForImageTextToText.from_pretrained = build_on_the_gpu
    common.HFPolicy.generate = timed_generate
    common.Run.evaluate, common.Run.checkpoint, common.HFPolicy.save = fake_eval, nothing, nothing
    module = importlib.import_module(script)
    batch = ["--prompts-per-step", "2"] if script == "mrg_r1" else ["--prompts-per-step", "1"]  # G 4 / G 8
    completions = 8
    out = work / "runs" / f"qwen3b_{script}"
    shutil.rmtree(out, ignore_errors=True)
    data, model = str(work / "data512" / "annotation.json"), str(work / "qwen3b")
    flags = ["--data", data, "--model", model, "--labeler", "rule", "--steps", "1", "--out", str(out), *batch]
    total = torch.cuda.get_device_properties(0).total_memory
    figures.update(completions=completions, formula_gb=round(formula_gb(script, completions), 1))
    figures["device_memory_gb"] = round(total / GB, 1)
    try:
        module.main(flags)
    except torch.cuda.OutOfMemoryError as e:
        figures["out_of_memory"] = str(e).splitlines()[0][:300]
    figures["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / GB, 2)
    figures["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / GB, 2)
    if (out / "metrics.jsonl").is_file():
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        figures.update(step_s=row["time"], loss=row["loss"], grad_norm=row["grad_norm"])
    if generation:
        steps, tokens, seconds = generation[0]
        figures.update(generate_s=round(seconds, 2), tokens_per_s=round(steps / seconds, 1))
        figures["completion_tokens"] = int(tokens)


def part_chexbert(work: Path, figures: Figures):
    """CheXbertLabeler on bert-base with random weights (f1chexbert's model, 14 heads) at batch 64 over the synthetic
    reports, and deer.gradient_weights (Eq. 9-12: a forward and backward through bert-base per target set) for 64
    completions in 8 groups of 8, spans word by word: seconds per completion."""
    from transformers import BertConfig, BertTokenizerFast

    import deer

    torch.manual_seed(0)
    tok = BertTokenizerFast(vocab_file=str(work / "bert_vocab.txt"))
    model = common.chexbert_model(BertConfig())
    labeler = common.CheXbertLabeler(model=model, tokenizer=tok, device=DEVICE, batch_size=64)
    records = common.load_annotation(work / "data" / "annotation.json")["train"]
    reports = [records[k % len(records)].report for k in range(CHEXBERT_REPORTS)]
    labeler(reports[:64])  # warm-up
    torch.cuda.synchronize()
    start = time.time()
    labeler(reports)
    torch.cuda.synchronize()
    seconds = time.time() - start
    pieces = float(np.mean([len(tok(r)["input_ids"]) for r in reports[:40]]))
    figures.update(reports=len(reports), word_pieces_mean=round(pieces, 1), labels_per_s=round(len(reports) / seconds))
    texts = [records[k % len(records)].report for k in range(64)]  # 8 groups of G 8 "completions"
    spans = [[(m.start(), m.end()) for m in re.finditer(r"\S+", t)] for t in texts]
    T = max(map(len, spans))
    mask = torch.tensor([[1.0] * len(s) + [0.0] * (T - len(s)) for s in spans], device=DEVICE)  # (64, T)
    targets = [deer.reference_targets(r.labels[None])[0] or ["Cardiomegaly"] for r in records[:8] for _ in range(8)]
    deer.gradient_weights(labeler, texts[:8], spans[:8], mask[:8], targets[:8], beta=1.0)  # warm-up
    torch.cuda.synchronize()
    start = time.time()
    w = deer.gradient_weights(labeler, texts, spans, mask, targets, beta=1.0)
    torch.cuda.synchronize()
    figures.update(ditpo_weights_ms_per_completion=round(1000 * (time.time() - start) / len(texts), 2))
    figures["ditpo_weight_mean"] = float(w[mask.bool()].mean())


TORCHRUN_ORAPO = """import os, sys
sys.path.insert(0, {root!r})
import torch, common, orapo
common.CHECKPOINT_EVERY, save = 1, common.Run.checkpoint
def stop(run, step):
    save(run, step)
    open({note!r}, "w").write(torch.distributed.get_backend())
    if step + 1 == int(os.environ.get("STOP", -1)) and run.out.name != "warm_start":  # step: 0-based
        raise KeyboardInterrupt
common.Run.checkpoint = stop
orapo.main()
"""


def part_torchrun(work: Path, figures: Figures):
    """orapo.py --fsdp (FSDP2 with NCCL, one process): stopped after step 1, resumed (rank 0 reads last.pt and
    broadcasts it), to the end. Each checkpoint notes the process group's backend."""
    script, out = work / "torchrun_orapo.py", work / "runs" / "torchrun_orapo"
    shutil.rmtree(out, ignore_errors=True)
    script.write_text(TORCHRUN_ORAPO.format(root=str(ROOT), note=str(work / "backend.txt")))
    flags = ["--data", str(work / "data" / "annotation.json"), "--steps", "2", "--sft-steps", "2", "--fsdp"]
    flags += ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8", "--out", str(out)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone", str(script)]
    for stop, extra in (("1", []), ("-1", ["--resume"])):
        env = dict(os.environ, STOP=stop)
        proc = subprocess.run([*command, *flags, *extra], env=env, capture_output=True, text=True, check=False)
        figures["stopped" if stop == "1" else "resumed"] = dict(returncode=proc.returncode, stderr=proc.stderr[-600:])
    figures["steps"] = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    figures["eval"] = (out / "eval.json").is_file()
    figures.update(dtype=json.loads((out / "config.json").read_text())["dtype"])
    figures["backend"] = (work / "backend.txt").read_text()


def run_part(name: str, work: Path):
    figures = Figures(work / "parts" / f"{name.replace(':', '_')}.json")
    kind, _, arg = name.partition(":")
    os.environ.update(RRG_CACHE=str(work / "cache"), RRG_METEOR="0", TOKENIZERS_PARALLELISM="false")
    try:
        if kind == "scripts":
            part_script(arg, work, figures)
        elif kind == "qwen3b":
            part_qwen3b(arg, work, figures)
        else:
            {"rl_core": part_rl_core, "chexbert": part_chexbert, "torchrun_nccl": part_torchrun}[kind](work, figures)
    except BaseException as e:  # the figures so far and the error, whatever it was
        figures["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        figures["traceback"] = traceback.format_exc()[-3000:]
        raise


# The driver -------------------------------------------------------------------------------------------------
def launch(name: str, work: Path) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "--run-part", name, "--work", str(work)]
    with open(work / "parts" / f"{name.replace(':', '_')}.log", "w") as log:  # the child keeps its own handle
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(procs: dict, limits: dict, work: Path) -> dict:
    """Each process to its end or its limit (then its process group is killed) -> {name: status}."""
    status, start = {}, time.time()
    while procs:
        for name, proc in list(procs.items()):
            if proc.poll() is not None:
                status[name] = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            elif time.time() - start > limits[name]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status[name] = f"timed out after {limits[name]} s"
            else:
                continue
            del procs[name]
        time.sleep(1)
    return status


def summary_line(name: str, part: dict) -> str:
    figures = {k: v for k, v in part["figures"].items() if k not in ("traceback", "error")}
    shown = json.dumps(figures, default=str)
    shown = shown if len(shown) < 400 else shown[:400] + "..."
    error = f"  {part['figures']['error']}" if "error" in part["figures"] else ""
    return f"{name:16} {part['status']:20} {part['seconds']:6.0f} s  {shown}{error}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "tests" / "results" / "gpu.json"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "rrg_gpu_check"))
    parser.add_argument("--parts", default=",".join(LIMITS_S), help="comma-separated, from: " + ", ".join(LIMITS_S))
    parser.add_argument("--run-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.run_part:
        return run_part(args.run_part, work)
    parts = [p for p in LIMITS_S if p in args.parts.split(",")]
    unknown = set(args.parts.split(",")) - set(LIMITS_S)
    if unknown:
        raise SystemExit(f"error: --parts: unknown {', '.join(sorted(unknown))}; use {', '.join(LIMITS_S)}")
    start = time.time()
    (work / "parts").mkdir(parents=True, exist_ok=True)
    with stdout_to_stderr():
        prepare(work)
    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}): prepared {work}, measured nothing, wrote nothing"
        )
        return 0
    result = {
        "device": torch.cuda.get_device_name(0),
        "device_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / GB, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": importlib.import_module("transformers").__version__,
        "python": platform.python_version(),
        "bf16": torch.cuda.is_bf16_supported(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "parts": {},
    }
    for shard in [[p] for p in parts if p in ALONE] + [[p for p in parts if p not in ALONE]]:
        if not shard:
            continue
        left = BUDGET_S - (time.time() - start)
        limits = {p: max(30, min(LIMITS_S[p], left)) for p in shard}
        begun = time.time()
        status = wait({p: launch(p, work) for p in shard}, limits, work)
        for p in shard:
            path = work / "parts" / f"{p.replace(':', '_')}.json"
            figures = json.loads(path.read_text()) if path.is_file() else {}
            result["parts"][p] = dict(status=status[p], seconds=round(time.time() - begun, 1), figures=figures)
    result["seconds"] = round(time.time() - start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"gpu_check on {result['device']} (torch {result['torch']}, CUDA {result['cuda']}): {result['seconds']} s")
    for name, part in result["parts"].items():
        print(summary_line(name, part))
    print(f"wrote {args.out}; each part's log in {work / 'parts'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
