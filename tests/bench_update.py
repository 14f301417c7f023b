"""A CPU benchmark of one RL step on the Hugging Face path (not a test: it times): MRG-R1 and OraPO on the tiny random
Qwen2.5-VL saved as Qwen2.5-VL-3B-Instruct is published, one 2544 x 3056 view a study (MIMIC-CXR's size), 8 studies
x G 2 a step, 16 new tokens, --grad-accum 4; in one process and in two (torchrun, gloo). Per script: image tokens per
view, generate() calls in the step, the step's seconds (one process), collectives in the step (two processes).

    python tests/bench_update.py --out bench.json                  # this tree
    python tests/bench_update.py --out before.json --root OLD_TREE  # another checkout's scripts and common.py

tests/MACHINES.md ("The update on the CPU") holds its figures before and after issue "Real checkpoints, real cost".
"""

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FLAGS = ["--steps", "1", "--sft-steps", "0", "--prompts-per-step", "8", "--group-size", "2", "--max-new-tokens", "16"]


def prepare(folder: Path):
    """MIMIC-size studies (gpu_check's) and the tiny Qwen2.5-VL in the hub's layout."""
    sys.path.insert(0, str(TESTS))
    import gpu_check
    from conftest import build_tiny_qwen

    if not (folder / "data" / "annotation.json").is_file():
        gpu_check.mimic_views(folder / "data", n_train=8)
    if not (folder / "qwen" / "config.json").is_file():
        build_tiny_qwen(folder / "qwen", ["The heart is normal in size.", "No pleural effusion.", "Describe."] * 20)


def one_step(root: Path, script: str, folder: Path, rank_file: Path):
    """The script's main() for one RL step (evaluations skipped), counting image tokens per view, generate() calls
    and (under torchrun) collectives in the step -> rank_file."""
    sys.path.insert(0, str(root))
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Vision

    import common

    module = __import__(script)
    counts = {"image_tokens": set(), "generate": 0, "collectives": collections.Counter()}
    real_vision, real_generate, real_steps = Vision.forward, common.HFPolicy.generate, common.Run.steps

    @functools.wraps(real_vision)
    def vision(self, hidden_states, grid_thw, **kw):
        counts["image_tokens"] |= set((grid_thw.prod(-1) // 4).tolist())
        return real_vision(self, hidden_states, grid_thw, **kw)

    def generate(self, *a, **kw):
        counts["generate"] += 1
        return real_generate(self, *a, **kw)

    def steps(self, *a, **kw):  # the collectives of the training steps alone
        with torch.profiler.profile() as prof:
            yield from real_steps(self, *a, **kw)
        counts["collectives"].update(e.name for e in prof.events() if e.name.startswith("gloo:"))

    Vision.forward, common.HFPolicy.generate, common.Run.steps = vision, generate, steps
    common.Run.evaluate = lambda self, *a, **k: {"ce": {"micro_f1": 0.0, "macro_f1": 0.0}, "nlg": {}, "headline": "x"}
    flags = ["--data", str(folder / "data" / "annotation.json"), "--model", str(folder / "qwen"), "--labeler", "rule"]
    accum = ["--grad-accum", "4"] if "grad_accum" in module.Args.__dataclass_fields__ else []  # OraPO had none
    out = folder / f"run_{script}_{os.environ.get('RANK', 'single')}_{root.name}"
    real_end = common.end_process

    def end_process(*a, **kw):  # under torchrun the script ends the process itself (os._exit): write first
        lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
        step = json.loads(lines[0]) if lines else {}
        record = dict(counts, image_tokens=sorted(counts["image_tokens"]), step_s=step.get("time"), accum=accum)
        Path(str(rank_file).format(rank=os.environ.get("RANK", "single"))).write_text(json.dumps(record))
        return real_end(*a, **kw)

    common.end_process = end_process
    module.main([*flags, *FLAGS, *accum, "--out", str(out)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--root", default=str(TESTS.parent), help="the checkout whose scripts and common.py run")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "rrg_bench_update"))
    p.add_argument("--one", nargs=2, metavar=("SCRIPT", "FILE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    root, work = Path(args.root).resolve(), Path(args.work)
    if args.one:
        return one_step(root, args.one[0], work, Path(args.one[1]))
    prepare(work)
    env = dict(os.environ, OMP_NUM_THREADS="1", RRG_METEOR="0", RRG_FIGURES="0", RRG_CACHE=str(work / "cache"))
    me = [str(Path(__file__).resolve()), "--root", str(root), "--work", str(work)]
    results = {}
    for script in ("mrg_r1", "orapo"):
        files = str(work / f"{script}_{{rank}}.json")  # {rank}: "single" in one process, the rank under torchrun
        subprocess.run([sys.executable, *me, "--one", script, files], env=env, check=True)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
        subprocess.run([*torchrun, *me, "--one", script, files], env=env, check=True)
        one, two = (json.loads(Path(files.format(rank=r)).read_text()) for r in ("single", "0"))
        results[script] = dict(one_process=one, two_processes_rank0=two)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
