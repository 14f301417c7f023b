"""Each script under torchrun with two processes (CPU, gloo), checked against one process where their steps must
agree. The seven runs share one launch (tests/torchrun_cases.py runs them in turn in each worker), so the suite pays
the workers' imports once; one test then checks each script's folders in turn. One test, not one per script:
pytest-xdist would hand separate tests to both of its workers, and each would launch (its --dist loadgroup, meant to
keep marked tests together, leaves them apart under pytest 9.2). Two "nodes" through the c10d rendezvous, and an
error on one rank, are launches of their own (test_running.py)."""

import json
import shutil

import numpy as np
import pytest
import torch

import common
import dcrrg
import deer
import orapo
import rrgcl
from conftest import ROOT, metrics_rows, torchrun_cases, update_relative_difference
from test_dcrrg import FAST as DCRRG_FAST
from test_dcrrg import FAST_CONSTANTS as DCRRG_CONSTANTS
from test_rrgcl import FAST_MEASURE as RRGCL_MEASURE

# orapo.main under torchrun with the warm start shortened (as `fast`), a checkpoint every step and, with STOP=k, Ctrl-C
# right after RL's step-k checkpoint (not the warm start stage's; rank 0 keeps a copy of that last.pt as
# stopped_last.pt); an odd number of val studies checked after step 1 (rank 1 pads its share: under FSDP every rank
# makes as many generate() calls); each rank notes in DIR whether it read RL's last.pt, the sharded reference's
# parameters (local and full sizes), and after each rollout the policy's (whether all are DTensors, local, full sizes)
ORAPO_UNDER_TORCHRUN = """
import os, shutil, sys, torch
import common, orapo
from torch.distributed.tensor import DTensor
orapo.WARM_START = dict(lr=3e-3, batch_size=4)
orapo.N_EVAL, orapo.EVAL_EVERY = 5, 1
common.CHECKPOINT_EVERY = 1
save, load, build, notes = common.Run.checkpoint, torch.load, common.for_training, sys.argv.pop(1)
rank = os.environ["RANK"]

def sizes(params):
    params = list(params)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return all(isinstance(p, DTensor) for p in params), local, sum(p.numel() for p in params)

def stop(run, step):
    save(run, step)
    if step + 1 == int(os.environ.get("STOP", -1)) and run.out.name != "warm_start":  # step: 0-based
        if rank == "0":
            shutil.copy(run.out / "last.pt", f"{notes}/stopped_last.pt")
        raise KeyboardInterrupt

def reading(path, *args, **kwargs):
    if str(path).endswith("last.pt") and "warm_start" not in str(path):
        open(f"{notes}/rank{rank}_read_last.pt", "w").close()
    return load(path, *args, **kwargs)

def noting_the_reference(run, *args, **kwargs):
    policy, ref = build(run, *args, **kwargs)
    dtensors, local, full = sizes(ref.model.parameters())
    torch.save(dict(dtensors=dtensors, local=local, full=full), f"{notes}/rank{rank}_reference.pt")
    return policy, ref

def noting_the_rollout(policy, *args, **kwargs):
    roll = rollout(policy, *args, **kwargs)
    path = f"{notes}/rank{rank}_rollouts.pt"
    torch.save([*(torch.load(path) if os.path.exists(path) else []), sizes(policy.model.parameters())], path)
    return roll

rollout = common.rollout
common.Run.checkpoint, torch.load, common.for_training = stop, reading, noting_the_reference
common.rollout = noting_the_rollout
orapo.main()
"""
ORAPO_FLAGS = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12"]
ORAPO_FLAGS += ["--sft-steps", "2", "--grad-accum", "2"]  # 2 studies a rank, one a micro-batch

# `python REDUCTIONS SCRIPT DIR ARGS...`: SCRIPT with ARGS, each rank noting in DIR, at each optimiser step, the
# gradient buckets that DistributedDataParallel all-reduced since the step before (a communication hook that counts,
# then all-reduces as DDP's own does: the mean, divided by the ranks before the sum, exact for 2) and a digest of the
# gradients the step applies
REDUCTIONS = """
import hashlib, os, runpy, sys, torch
import common
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
target, notes = sys.argv.pop(1), sys.argv.pop(1)
sys.argv[0] = target
data_parallel, adamw, reduced, steps = common.data_parallel, common.adamw, [], []

def counted(state, bucket):
    reduced.append(bucket.index())
    return allreduce_hook(state, bucket)

def data_parallel_counted(module, world_size):
    wrapped = data_parallel(module, world_size)
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        wrapped.register_comm_hook(None, counted)
    return wrapped

def noted(optimizer, args, kwargs):
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    steps.append((sorted(reduced), hashlib.sha256(b"".join(g.numpy().tobytes() for g in grads)).hexdigest()))
    reduced.clear()
    torch.save(steps, f"{notes}/reduced_rank{os.environ['RANK']}.pt")

def adamw_noted(*args, **kwargs):
    optimizer, scheduler = adamw(*args, **kwargs)
    optimizer.register_step_pre_hook(noted)
    return optimizer, scheduler

common.data_parallel, common.adamw = data_parallel_counted, adamw_noted
runpy.run_path(target, run_name="__main__")
"""

# DEER's stages shortened, under --grad-accum 2 (RL: 2 studies a rank, one a micro-batch); DDSampling in chunks of 8:
# 5 chunks of the 40 studies, rank 0 scoring 0, 2, 4 and rank 1 1, 3
DEER_FLAGS = ["--max-new-tokens", "8", "--sft-steps", "2", "--steps", "2", "--prompts-per-step", "4"]
DEER_FLAGS += ["--grad-accum", "2"]
DEER_CHUNK = 8

# DCRRG's steps and texts shortened as test_dcrrg.py's FAST and `fast` (no dropout: a step can be recomputed); RRGCL's
# measurement as test_rrgcl.py's fast_measure, its training one epoch of 6 steps
RRGCL_FLAGS = ["--epochs", "1", "--batch-size", "8", "--steps", "6"]


def launch(folder, small_synthetic) -> dict:
    """Every script's two-process run in one launch: a folder per run under `folder`; each run's exit status (the same
    on both ranks)."""
    data = ["--data", str(small_synthetic)]
    with pytest.MonkeyPatch.context() as mp:  # RRGCL's difficulty file, measured here in one process
        for name, value in RRGCL_MEASURE.items():
            mp.setattr(rrgcl, name, value)
        rrgcl.main(
            [*data, "--out", str(folder / "measure"), "--measure-only", "--difficulty", str(folder / "dif.json")]
        )
    (folder / "orapo_under_torchrun.py").write_text(ORAPO_UNDER_TORCHRUN)
    (folder / "reductions.py").write_text(REDUCTIONS)
    (folder / "deer_small_chunks.py").write_text(f"import deer\ndeer.DD_CHUNK = {DEER_CHUNK}\ndeer.main()\n")
    (folder / "dcrrg_fast.py").write_text(
        f"import dcrrg\nfor k, v in {DCRRG_CONSTANTS!r}.items():\n    setattr(dcrrg, k, v)\ndcrrg.main()\n"
    )
    for notes in ("notes_ddp", "notes_fsdp", "notes_mrg_r1", "notes_deer"):
        (folder / notes).mkdir()
    orapo_script, fsdp = folder / "orapo_under_torchrun.py", ["--out", folder / "orapo_fsdp", "--fsdp"]
    mrg_r1_flags = ["--steps", "2", "--sft-steps", "2", "--prompts-per-step", "4", "--max-new-tokens", "8"]
    mrg_r1_flags += ["--grad-accum", "2"]
    reductions, deer_script = folder / "reductions.py", folder / "deer_small_chunks.py"
    notes_ddp, notes_mrg_r1, notes_deer = (folder / f"notes_{x}" for x in ("ddp", "mrg_r1", "deer"))
    cases = [
        case("orapo", reductions, orapo_script, notes_ddp, notes_ddp, *data, *ORAPO_FLAGS, "--out", folder / "orapo"),
        case("orapo_fsdp_stopped", orapo_script, folder / "notes_fsdp", *data, *ORAPO_FLAGS, *fsdp, STOP="1"),
        case("orapo_fsdp_resumed", orapo_script, folder / "notes_fsdp", *data, *ORAPO_FLAGS, *fsdp, "--resume"),
        case("mrg_r1", reductions, ROOT / "mrg_r1.py", notes_mrg_r1, *data, *mrg_r1_flags, "--out", folder / "mrg_r1"),
        case("deer", reductions, deer_script, notes_deer, "all", *data, *DEER_FLAGS, "--out", folder / "deer"),
        case("dcrrg", folder / "dcrrg_fast.py", "all", *data, *DCRRG_FAST, "--out", folder / "dcrrg"),
        case(
            "rrgcl",
            ROOT / "rrgcl.py",
            *data,
            "--difficulty",
            folder / "dif.json",
            *RRGCL_FLAGS,
            "--out",
            folder / "rrgcl",
        ),
    ]
    return torchrun_cases(folder, cases)


def case(name: str, script, *argv, **env) -> dict:
    return dict(name=name, script=str(script), argv=[str(a) for a in argv], env=env)


def test_each_script_under_torchrun(tmp_path, small_synthetic, starting_weights, monkeypatch):
    status = launch(tmp_path, small_synthetic)
    assert status == dict(orapo=0, orapo_fsdp_stopped=130, orapo_fsdp_resumed=0, mrg_r1=0, deer=0, dcrrg=0, rrgcl=0)
    orapo_two_processes_and_fsdp(tmp_path, small_synthetic)
    mrg_r1_two_processes(tmp_path)
    deer_two_processes(tmp_path, small_synthetic, monkeypatch)
    starting_weights.clear()  # each check's one-process runs: the weights their steps start from, in order
    dcrrg_equals_one_process(tmp_path, small_synthetic, starting_weights, monkeypatch)
    starting_weights.clear()
    rrgcl_equals_one_process(tmp_path, small_synthetic, starting_weights)


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def orapo_two_processes_and_fsdp(folder, small_synthetic):
    """Two processes, then the same with --fsdp, stopped after step 1 and resumed. Sharded and unsharded runs compute
    each rank's gradient alike and average two ranks' gradients exactly either way ((a + b) / 2 = a / 2 + b / 2 in
    floats), so they differ only where a sum runs in another order: the gradient norm (over shards, then ranks; torch's
    cascade sums keep that within ~log2(n) 2^-24 ~ 1e-6 relative, seen 3e-7), through clipping when it acts a gradient
    scale that Adam's update ignores up to eps (< 1e-5 x lr per step). Hence metrics within rel 1e-4 and weights within
    1e-5 (seen exactly equal), on any CPU kernel (checked under ATEN_CPU_CAPABILITY=default and avx2). Under FSDP:
    the resume restores the schedule (lr), the ZRR state and AdamW's (the metrics and weights after it) from last.pt
    read by rank 0 alone; the reference is sharded (each rank holds half of it) and scores as the unsharded one (KL
    and DPO in the metrics); the evaluation of 5 val studies (3 on rank 0, 2 and one padding on rank 1) writes what
    one process generates from the same weights."""
    out, fsdp = folder / "orapo", folder / "orapo_fsdp"
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    last = torch.load(out / "last.pt", weights_only=True)
    assert len(last["extra"]) == 2 * 4 + 1  # 2 steps x 4 studies (2 per rank): both ranks' prompts in one state
    torch_rng = [state["torch"] for state in last["rng"]]  # each rank's, seeded with seed + rank: apart
    assert len(torch_rng) == 2 and not torch.equal(*torch_rng)
    gens = read_jsonl(out / "generations_test_after.jsonl")
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shares, in order
    assert not list((folder / "notes_ddp").glob("*read_last.pt"))
    # FSDP2: the same two processes with the policy and reference sharded take the same steps (each rank samples
    # as before); the checkpoint and final/ hold the gathered weights, which load without torchrun. Stopped after step
    # 1 and resumed: the sharded weights and AdamW states come back
    notes = folder / "notes_fsdp"
    after_step_1 = torch.load(notes / "stopped_last.pt", weights_only=True)
    assert after_step_1["step"] == 1  # one step of two: the resume takes step 2 from what last.pt restores
    assert sorted(p.name for p in notes.glob("*read_last.pt")) == ["rank0_read_last.pt"]
    for a, b in zip(metrics_rows(out / "metrics.jsonl"), metrics_rows(fsdp / "metrics.jsonl"), strict=True):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a), (a, b)
    ddp, sharded = (common.load_policy(d / "final").model.state_dict() for d in (out, fsdp))
    assert all(torch.allclose(ddp[k], sharded[k], atol=1e-5) for k in ddp)
    ckpt, ddp_ckpt = (torch.load(d / "last.pt", weights_only=True) for d in (fsdp, out))
    assert all(torch.equal(ckpt["model"][k], sharded[k]) for k in sharded)  # full, not shards: the gathered weights
    assert set(ckpt["optimizer"]["state"]) == {k for k, _ in common.load_policy(out / "final").model.named_parameters()}
    assert ckpt["scheduler"] == ddp_ckpt["scheduler"] and ckpt["extra"] == pytest.approx(ddp_ckpt["extra"], rel=1e-6)
    for rank in (0, 1):  # each rank holds half of the reference (one unit per block, the rest another)
        ref = torch.load(notes / f"rank{rank}_reference.pt", weights_only=True)
        assert ref["dtensors"] and ref["local"] == pytest.approx(ref["full"] / 2, rel=0.01)
        # and after each rollout (step 1's, stopped, then the resumed step 2's), half of the policy again: the modules
        # generate() gathered (common.gathered) are resharded, every parameter a DTensor of this rank's shard
        rollouts = torch.load(notes / f"rank{rank}_rollouts.pt", weights_only=True)
        assert len(rollouts) == 2 and all(d and n == pytest.approx(full / 2, rel=0.01) for d, n, full in rollouts)
    reduced_once_a_step(folder / "notes_ddp", 2 + 2)  # the warm start's steps, then RL's under --grad-accum 2
    # the val check after step 1, against one process generating from the step-1 weights in each rank's batch: rank 0
    # studies 0, 2, 4, rank 1 studies 1, 3 and study 0 as padding (the same batches, so the same padding and kernels)
    policy = common.load_policy(fsdp / "warm_start" / "final")
    policy.model.load_state_dict(after_step_1["model"])
    val = common.load_annotation(small_synthetic)["val"][:5]
    expected = [None] * 5
    for rank, share in ((0, [0, 2, 4]), (1, [1, 3, 0])):
        studies = [[common.load_image(p) for p in val[k].image_paths] for k in share]
        with torch.no_grad():
            texts = policy.decode(*policy.generate(policy.prompt_batch(studies, orapo.PROMPT), 12, do_sample=False))
        expected[rank::2] = texts[: len(expected[rank::2])]
    rows = read_jsonl(fsdp / "generations_val_step1.jsonl")
    assert [r["id"] for r in rows] == [r.id for r in val] and [r["generated"] for r in rows] == expected


def reduced_once_a_step(notes, steps: int):
    """Every optimiser step of a DDP run (`notes`: REDUCTIONS) all-reduced each of DDP's gradient buckets once, on
    both ranks: under --grad-accum 2 in the last micro-batch's backward alone (no_sync before it), as
    common.gradient_sync and tests/MACHINES.md say, so both ranks step with the same gradients (the average of their
    sums, to the bit: one all-reduce of 2 ranks adds a + b on both). A loop that syncs every micro-batch reduces each
    bucket twice, one that never syncs none, and one that syncs an earlier micro-batch leaves the ranks' gradients
    apart."""
    r0, r1 = (torch.load(notes / f"reduced_rank{rank}.pt", weights_only=True) for rank in (0, 1))
    assert len(r0) == len(r1) == steps and r0 == r1, (r0, r1)
    assert all(buckets and buckets == list(range(len(buckets))) for buckets, _ in r0), r0


def mrg_r1_two_processes(folder):
    """--prompts-per-step counts studies over all ranks: 2 per rank, 8 completions each; both ranks' test reports. The
    warm start's 2 steps and RL's 2 under --grad-accum 2 each reduce every gradient bucket once."""
    out = folder / "mrg_r1"
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    reduced_once_a_step(folder / "notes_mrg_r1", 2 + 2)
    gens = read_jsonl(out / "generations_test_after.jsonl")
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shares, in order


def deer_two_processes(folder, small_synthetic, monkeypatch):
    """All three stages under two processes, --grad-accum 2: global batches split over the ranks, DDSampling's chunks
    shared, every gradient bucket reduced once a step (reduced_once_a_step). Each chunk's samples are seeded by the
    chunk: the two processes' scores (5 chunks, 2 or 3 a rank, so that a seed by rank or by step would differ from it)
    equal, to the bit, those of one process scoring the same 5 chunks from the same SFT model (the same shapes, the
    same kernels). (test_deer.py's test_torchrun_fsdp_equals_unsharded, slow, shards the RL stage against this
    unsharded run.)"""
    out = folder / "deer"
    assert [x["step"] for x in read_jsonl(out / "sft" / "metrics.jsonl")] == [1, 2]
    reduced_once_a_step(folder / "notes_deer", 2 + 2)  # SFT's 2 steps and RL's 2, both under --grad-accum 2
    assert len(read_jsonl(out / "ddsampling" / "metrics.jsonl")) == 3  # chunks 0-1, 2-3, 4 (rank 1 idle)
    sel = json.loads((out / "ddsampling" / "selection.json").read_text())
    assert sel["n_pool"] == 40 and len(sel["ranked"]) == 40 and len(sel["ids"]) == 8
    shutil.copytree(out / "sft", folder / "deer_one" / "sft")
    monkeypatch.setattr(deer, "DD_CHUNK", DEER_CHUNK)
    deer.main(["sample", "--data", str(small_synthetic), *DEER_FLAGS, "--out", str(folder / "deer_one")])
    one = json.loads((folder / "deer_one" / "ddsampling" / "selection.json").read_text())
    assert one["ranked"] == sel["ranked"] and one["ids"] == sel["ids"] and len({x["D"] for x in one["ranked"]}) > 1
    assert [x["step"] for x in read_jsonl(out / "rl_rule" / "metrics.jsonl")] == [1, 2]
    gens = read_jsonl(out / "rl_rule" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]


def dcrrg_equals_one_process(folder, small_synthetic, starting_weights, monkeypatch):
    """Batch sizes are global and Step 2 contrasts the gathered global batch: two ranks of 4 take the steps of one
    process with batch 8; Steps 3-4 run and gather the ranks' generations in order. Each step is compared from the same
    weights (the one-process Step 2 starts from the two processes' Step 1), with measures rounding cannot flip:
    - step 1's logged losses and gradient norm: the same weights and batch, float32 sums of positive terms in another
      order and split (relative error <= n 2^-24 = 1.3e-5 for the n <= 8 x 14 x 2 terms; 1e-7 seen): rtol 1e-4. A rank
      contrasting only its half, or a gathered batch whose gradient is not scaled by the ranks (halved), is far off;
    - the weights after each step's run, as the total difference over the total update (update_relative_difference,
      which explains why not element by element: Step 1's largest element difference was 4e-4 against an lr of 1e-3):
      under 1e-3, seen 2.6e-5 (Step 1) and 6e-6 (Step 2); 0.47 when each rank contrasts only its own half.
    Checked under ATEN_CPU_CAPABILITY=default and avx2 (no avx512 on the machine it was written on)."""
    ddp = folder / "dcrrg"
    for name, value in DCRRG_CONSTANTS.items():
        monkeypatch.setattr(dcrrg, name, value)
    flags = ["--data", str(small_synthetic)] + DCRRG_FAST
    # rank 0 alone writes
    assert [x["step"] for x in metrics_rows(ddp / "step4" / "metrics.jsonl")] == [1, 2, 3]
    gens = read_jsonl(ddp / "step4" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shares, in order
    dcrrg.main(["step1", "--out", str(folder / "dcrrg_one")] + flags)
    (folder / "dcrrg_one2" / "step1").mkdir(parents=True)  # Step 2 in one process from the two processes' Step 1
    for f in ("model.pt", "config.json"):  # a step reads the weights and the data of the step before
        shutil.copy(ddp / "step1" / f, folder / "dcrrg_one2" / "step1" / f)
    dcrrg.main(["step2", "--out", str(folder / "dcrrg_one2")] + flags)
    for step, one, start in (("step1", "dcrrg_one", 0), ("step2", "dcrrg_one2", 1)):
        a, b = (metrics_rows(d / step / "metrics.jsonl")[0] for d in (ddp, folder / one))
        for k in ("loss", "grad_norm") + (("image_loss", "text_loss") if step == "step1" else ()):
            assert a[k] == pytest.approx(b[k], rel=1e-4), (step, k, a[k], b[k])
        states = [torch.load(d / step / "model.pt", map_location="cpu", weights_only=True) for d in (ddp, folder / one)]
        assert update_relative_difference(*states, starting_weights[start]) < 1e-3, step


def rrgcl_equals_one_process(folder, small_synthetic, starting_weights):
    """2 ranks x 4 studies against 1 process x 8: the same studies every step and the same token-mean losses; both
    ranks' test reports, in order. Step 1's loss (the same weights, float32 sums of positive terms in another order and
    split: relative error <= n 2^-24 = 5e-5 for the n <= 8 x 96 tokens) within rtol 1e-4; later steps' within 1e-3 (the
    weights then differ as below; seen 2e-7 at every step). The weights, as the total difference over the total update
    (conftest's update_relative_difference; not element by element: Adam moves an element whose gradient is rounding
    noise by its full lr either way): under 1e-3, seen 1e-6. Token weights that ignore the ranks (rrgcl.sft_step) halve
    the loss.
    Checked under ATEN_CPU_CAPABILITY=default and avx2."""
    flags = ["--data", str(small_synthetic), "--difficulty", str(folder / "dif.json"), *RRGCL_FLAGS]
    rrgcl.main(flags + ["--out", str(folder / "rrgcl_one")])
    ddp, one = read_jsonl(folder / "rrgcl" / "metrics.jsonl"), read_jsonl(folder / "rrgcl_one" / "metrics.jsonl")
    assert ddp[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-4)
    np.testing.assert_allclose([x["loss"] for x in ddp], [x["loss"] for x in one], rtol=1e-3)
    a, b = (
        torch.load(d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"]
        for d in (folder / "rrgcl", folder / "rrgcl_one")
    )
    assert update_relative_difference(a, b, starting_weights[0]) < 1e-3
    gens = read_jsonl(folder / "rrgcl" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]
