"""A CPU benchmark of one RL step on the Hugging Face path (not a test: it times): MRG-R1 and OraPO on the tiny random
Qwen2.5-VL saved as Qwen2.5-VL-3B-Instruct is published, one 2544 x 3056 view a study (MIMIC-CXR's size), 8 studies
x G 4 a step, 16 new tokens, --grad-accum 4; in one process and in two (torchrun, gloo). Per script: image tokens per
view, patches through the vision tower in the step (a study's view is 1,280), generate() calls in the step, the step's
seconds (one process), collectives in the step (two processes).

    python tests/bench_update.py --out bench.json                  # this tree
    python tests/bench_update.py --out before.json --root OLD_TREE  # another checkout's scripts and common.py

tests/MACHINES.md ("The update on the CPU") holds its figures before and after issue "Real checkpoints, real cost".
"""

import argparse
import collections
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FLAGS = ["--steps", "1", "--sft-steps", "0", "--prompts-per-step", "8", "--group-size", "4", "--max-new-tokens", "16"]


def prepare(folder: Path):
    """MIMIC-size studies (gpu_check's) and the tiny Qwen2.5-VL in the hub's layout."""
    sys.path.insert(0, str(TESTS))
    import gpu_check
    from hub_layout import build_tiny_qwen

    if not (folder / "data" / "annotation.json").is_file():
        gpu_check.mimic_views(folder / "data", n_train=8)
    texts = ["The heart is normal in size.", "No pleural effusion.", "Describe."] * 20
    if not (folder / "qwen" / "config.json").is_file():
        build_tiny_qwen(folder / "qwen", texts)
    if not (folder / "qwen_saved" / "config.json").is_file():  # save_pretrained's layout, bounded at 512 x 512
        build_tiny_qwen(folder / "qwen_saved", texts, image_pixels=512 * 512, hub_layout=False)


def one_step(root: Path, script: str, folder: Path, rank_file: Path):
    """The script's main() for one RL step (evaluations skipped), counting image tokens per view, generate() calls
    and (under torchrun) collectives in the step -> rank_file."""
    sys.path.insert(0, str(root))
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Vision

    import common

    module = __import__(script)
    counts = {"image_tokens": set(), "patches": 0, "generate": 0, "collectives": collections.Counter()}
    real_vision, real_generate, real_steps = Vision.forward, common.HFPolicy.generate, common.Run.steps

    @functools.wraps(real_vision)
    def vision(self, hidden_states, grid_thw, **kw):
        counts["image_tokens"] |= set((grid_thw.prod(-1) // 4).tolist())
        counts["patches"] += hidden_states.shape[0]  # through the vision tower this step (a patch a row)
        return real_vision(self, hidden_states, grid_thw, **kw)

    def generate(self, *a, **kw):
        counts["generate"] += 1
        return real_generate(self, *a, **kw)

    def steps(self, *a, **kw):  # the collectives of the training steps alone (under torchrun)
        if "RANK" not in os.environ:
            yield from real_steps(self, *a, **kw)
            return
        with torch.profiler.profile() as prof:
            yield from real_steps(self, *a, **kw)
        counts["collectives"].update(e.name for e in prof.events() if e.name.startswith("gloo:"))

    Vision.forward, common.HFPolicy.generate, common.Run.steps = vision, generate, steps

    def evaluate(self, *args, **kwargs):  # skipped: the step is measured (conftest.fake_eval's numbers, all 0)
        ce = dict.fromkeys(("micro_f1", "macro_precision", "macro_recall", "macro_f1", "example_f1"), 0.0)
        degenerate = common.degenerate_output(["a"], ["a"])
        return dict(
            headline="micro_f1",
            uncertain_as=0,
            ce=ce,
            nlg={"BLEU-4": 0.0},
            degenerate=degenerate,
            reward=0.0,
            facts_reward=0.0,
        )

    common.Run.evaluate = evaluate
    model = folder / os.environ.get("BENCH_MODEL", "qwen")
    flags = ["--data", str(folder / "data" / "annotation.json"), "--model", str(model), "--labeler", "rule"]
    accum = ["--grad-accum", "4"] if "grad_accum" in module.Args.__dataclass_fields__ else []  # OraPO had none
    out = folder / f"run_{script}_{'torchrun' if 'RANK' in os.environ else 'single'}"  # main() empties it first
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
    p.add_argument("--out", help="the JSON of the figures (required but for --one)")
    p.add_argument("--root", default=str(TESTS.parent), help="the checkout whose scripts and common.py run")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "rrg_bench_update"))
    p.add_argument(
        "--two-saved",
        action="store_true",
        help="two processes on the model in save_pretrained's layout (a tree that "
        "ignores --max-pixels on the hub's takes minutes a step there; the collectives are the same)",
    )
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
        for mode in ("single", "torchrun"):
            shutil.rmtree(work / f"run_{script}_{mode}", ignore_errors=True)
        files = str(work / f"{script}_{{rank}}.json")  # {rank}: "single" in one process, the rank under torchrun
        subprocess.run([sys.executable, *me, "--one", script, files], env=env, check=True)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
        env_two = dict(env, BENCH_MODEL="qwen_saved") if args.two_saved else env
        subprocess.run([*torchrun, *me, "--one", script, files], env=env_two, check=True)
        one, two = (json.loads(Path(files.format(rank=r)).read_text()) for r in ("single", "0"))
        results[script] = dict(
            one_process=one, two_processes_rank0=two, two_on="qwen_saved" if args.two_saved else "qwen"
        )
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
