"""Test-only: what test_running.py's two-"node" test checks, run on each rank (`python -m torch.distributed.run ...
tests/two_ranks.py OUT`): a GRPO gradient under DDP, whole and in two micro-batches (common.gradient_sync); the
all-reduces each made; a BatchNorm's buffers under DDP; the all-gathers of FSDP2's generate() with and without
common.gathered; a checkpoint's round trip of the RNG streams; common's collectives. Each rank saves what it saw to
OUT/rank<RANK>.pt (test_running._check_two_ranks reads them)."""

import contextlib
import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # the project's folder first
from test_running import _grpo_batch, _grpo_gradient, tiny_gpt2


def collectives(prof, kind: str) -> int:
    return sum(e.name == "gloo:" + kind for e in prof.events())


def main(out: str):
    torch.set_num_threads(1)
    rank, world, device = common.setup_distributed()
    args = common.RunArgs(out=out + "/run")
    run = common.Run(args, rank, world, device, data=None, labeler=None)
    model = tiny_gpt2(seed=rank).double()  # different inits on purpose: rank 0's must reach every rank
    ddp = common.data_parallel(model, world)  # PyTorch's DDP: it starts from rank 0's weights
    ids, mask, rewards = _grpo_batch()
    rows = slice(4 * rank, 4 * rank + 4)  # 2 prompts x G=2

    with torch.profiler.profile() as prof:
        _grpo_gradient(ddp, ids[rows], mask[rows], rewards[rows])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # --grad-accum 2: the same rows in two micro-batches, ranks averaging in the second's backward alone
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile() as accum_prof:
        for k, part in enumerate((slice(4 * rank, 4 * rank + 2), slice(4 * rank + 2, 4 * rank + 4))):
            with common.gradient_sync(ddp, last=k == 1):
                _grpo_gradient(ddp, ids[part], mask[part], rewards[part], scale=0.5)
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    # DDP keeps each rank's buffers: a BatchNorm's running statistics of its own rank's batches, as the same module
    # computes them outside DDP (a broadcast of rank 0's before each forward would carry rank 0's into rank 1's)
    torch.manual_seed(0)
    norm = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    alone = copy.deepcopy(norm)
    norm_ddp = common.data_parallel(norm, world)
    for k in range(3):
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(10 * rank + k), dtype=torch.float64) * (1 + rank)
        norm_ddp(x + rank).sum().backward()
        alone(x + rank)
    buffers = {n: (b.clone(), dict(alone.named_buffers())[n]) for n, b in norm.named_buffers()}
    # FSDP2: generate() gathers each sharded module once (gathered), not once per new token
    gathers = {}
    for gather in (False, True):
        for n in (4, 12):
            sharded = tiny_gpt2(seed=0)
            common.shard(sharded)
            length = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            gathering = common.gathered(sharded) if gather else contextlib.nullcontext()
            with torch.profiler.profile() as gen_prof, torch.no_grad(), gathering:
                sharded.generate(torch.tensor([[5, 6, 7]]), **length)
            gathers[f"{gather} {n}"] = collectives(gen_prof, "all_gather")
    counts = {
        "step": collectives(prof, "all_reduce"),
        "accumulated": collectives(accum_prof, "all_reduce"),
        "parameters": len(list(model.parameters())),
        "gathers": gathers,
        "sharded modules": sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in sharded.modules()),
    }
    # each rank's RNG stream survives a checkpoint round trip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common.seed_everything(0, rank)  # as a script does before restore: ranks draw apart
    run.restore(model, opt, state={"rank0_only": rank})
    run.save_checkpoint(1)
    draws = torch.rand(3)
    step, extra = common.load_checkpoint(run.out / "last.pt", model, opt)
    redraws = torch.rand(3)
    run.log(rank=rank)
    seen = {
        "env": [rank, world, int(os.environ["LOCAL_RANK"]), str(device)],
        "grads": grads,
        "accumulated": accumulated,
        "counts": counts,
        "buffers": buffers,
        "mean": common.all_reduce_mean(float(rank)),
        "dict_mean": common.all_reduce_mean({"a": rank, "b": 2}),
        "bcast": common.broadcast_object({"from": rank}),
        "draws": draws,
        "redraws": redraws,
        "step": step,
        "extra": extra,
        "files": sorted(p.name for p in run.out.iterdir()),
    }
    torch.save(seen, out + f"/rank{rank}.pt")
    common.end_process()


if __name__ == "__main__":
    main(sys.argv[1])
