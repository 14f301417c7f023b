"""Test-only: one of the project's scripts run as a user runs it, with a few of its constants shortened and, when
asked, what tests/test_distributed.py checks inside the run noted as it goes.

    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/spy_run.py \
        [--set MODULE.NAME=JSON]... [--notes DIR] [--stop-after K] SCRIPT ARGS...

runs SCRIPT's main() with ARGS, as `python SCRIPT ARGS` would run it, after:
- --set: MODULE.NAME = the JSON value, e.g. orapo.N_EVAL=5 or deer.DD_CHUNK=8 (SCRIPT is imported by its name, so
  that its own constants can be set before main() runs);
- --notes DIR: each rank keeps DIR/rank<RANK>.json up to date as the run goes (a run under torchrun ends in
  os._exit): "steps", at each optimiser step, the gradient buckets DistributedDataParallel all-reduced since the step
  before (a communication hook that notes the bucket, then all-reduces as DDP's own: the mean, divided by the ranks
  before the sum) and a digest of the gradients the step applies; "read_last", whether the rank read a last.pt
  outside warm_start/ (a resume's); "reference", the reference's parameters after common.for_training (whether all
  are DTensors, their local and full sizes); "rollouts", the policy's after each rollout, the same;
- --stop-after K: Ctrl-C (SIGINT, every rank) during step K of a stage other than the warm start: the run saves that
  step's checkpoint and stops as a user's Ctrl-C stops it (exit 130)."""

import argparse
import hashlib
import importlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # the project's folder first


def sizes(params) -> list:
    """[whether every parameter is a DTensor (sharded), this rank's elements, all ranks' elements]."""
    params = list(params)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return [all(isinstance(p, DTensor) for p in params), local, sum(p.numel() for p in params)]


class Notes(dict):
    """What a rank noted, written whole to DIR/rank<RANK>.json at each change."""

    def __init__(self, folder):
        super().__init__(steps=[], read_last=False, reference=None, rollouts=[])
        self.path, self.buckets = Path(folder) / f"rank{os.environ.get('RANK', '0')}.json", []

    def write(self):
        self.path.write_text(json.dumps(self))

    def spy(self):
        """Wrap what the run calls (common's functions and torch.load) to note what they did."""
        data_parallel, adamw, for_training, rollout, load = (
            common.data_parallel,
            common.adamw,
            common.for_training,
            common.rollout,
            torch.load,
        )

        def counted(state, bucket):  # DDP's communication hook
            self.buckets.append(bucket.index())
            return allreduce_hook(state, bucket)

        def data_parallel_counted(module, world_size):
            wrapped = data_parallel(module, world_size)
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                wrapped.register_comm_hook(None, counted)
            return wrapped

        def stepping(optimizer, args, kwargs):  # the optimiser's step pre-hook
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            digest = hashlib.sha256(b"".join(g.detach().numpy().tobytes() for g in local)).hexdigest()
            self["steps"].append([sorted(self.buckets), digest])
            self.buckets.clear()
            self.write()

        def adamw_noted(*args, **kwargs):
            optimizer, scheduler = adamw(*args, **kwargs)
            optimizer.register_step_pre_hook(stepping)
            return optimizer, scheduler

        def for_training_noted(*args, **kwargs):
            policy, ref = for_training(*args, **kwargs)
            self["reference"] = sizes(ref.model.parameters()) if isinstance(ref, common.Policy) else None
            self.write()
            return policy, ref

        def rollout_noted(policy, *args, **kwargs):
            roll = rollout(policy, *args, **kwargs)
            self["rollouts"].append(sizes(policy.model.parameters()))
            self.write()
            return roll

        def load_noted(path, *args, **kwargs):
            if isinstance(path, str | os.PathLike) and Path(path).name == "last.pt" and "warm_start" not in str(path):
                self["read_last"] = True
                self.write()
            return load(path, *args, **kwargs)

        common.data_parallel, common.adamw, common.for_training = data_parallel_counted, adamw_noted, for_training_noted
        common.rollout, torch.load = rollout_noted, load_noted
        self.write()


def stop_after(k: int):
    """A Ctrl-C on this rank while step k (1-based) of a stage other than warm_start runs: the run's own handler
    notes it, and that step's checkpoint() saves and stops."""
    checkpoint = common.Run.checkpoint

    def checkpoint_stopping(run, step):
        if step + 1 == k and run.out.name != "warm_start":
            signal.raise_signal(signal.SIGINT)
        return checkpoint(run, step)

    common.Run.checkpoint = checkpoint_stopping


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=JSON")
    parser.add_argument("--notes", type=Path)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    spy = parser.parse_args()
    script = importlib.import_module(spy.script.stem)
    for setting in spy.set:
        name, value = setting.split("=", 1)
        module, attribute = name.rsplit(".", 1)
        setattr(importlib.import_module(module), attribute, json.loads(value))
    if spy.notes:
        Notes(spy.notes).spy()
    if spy.stop_after:
        stop_after(spy.stop_after)
    sys.argv = [str(spy.script), *spy.args]
    script.main()


if __name__ == "__main__":
    main()
