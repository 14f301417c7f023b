"""Each script under torchrun with two processes (CPU, gloo), checked against one process where their steps must
agree: one plain `torchrun` launch a run (conftest.torchrun). Where a check needs to see inside the run (DDP's gradient
reductions at each step, FSDP2's shards, a Ctrl-C after step 1), the launch runs the script through tests/spy_run.py,
which notes them in a folder as the run goes; the rest is read from what the run writes. Two "nodes" through the c10d
rendezvous, and an error on one rank, are launches of their own (test_running.py)."""

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
from conftest import ROOT, metrics_rows, torchrun, update_relative_difference
from test_dcrrg import FAST as DCRRG_FAST
from test_dcrrg import FAST_CONSTANTS as DCRRG_CONSTANTS
from test_rrgcl import FAST_MEASURE as RRGCL_MEASURE

TEST_IDS = [f"test_{k:05d}" for k in range(12)]  # the small synthetic set's test studies, in order


def spy_run(*flags, ok: bool = True, constants: dict | None = None):
    """`torchrun tests/spy_run.py [--set NAME=VALUE for each of constants] FLAGS`: FLAGS are spy_run's own (--notes,
    --stop-after), then the script (a file name in the project's folder) and its flags."""
    sets = [x for name, value in (constants or {}).items() for x in ("--set", f"{name}={json.dumps(value)}")]
    return torchrun("tests/spy_run.py", *sets, *(str(ROOT / f if str(f).endswith(".py") else f) for f in flags), ok=ok)


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def notes(folder) -> tuple[dict, dict]:
    """Rank 0's and rank 1's notes (tests/spy_run.py --notes folder)."""
    return tuple(json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1))


def reduced_once_a_step(folder, steps: int):
    """Every optimiser step of a DDP run (spy_run's notes in `folder`) all-reduced each of DDP's gradient buckets once,
    on both ranks: under --grad-accum 2 in the last micro-batch's backward alone (no_sync before it), as
    common.gradient_sync and tests/MACHINES.md say, so both ranks step with the same gradients (the average of their
    sums, to the bit: one all-reduce of 2 ranks adds a + b on both). A loop that syncs every micro-batch reduces each
    bucket twice, one that never syncs none, and one that syncs an earlier micro-batch leaves the ranks' gradients
    apart."""
    r0, r1 = (n["steps"] for n in notes(folder))
    assert len(r0) == len(r1) == steps and r0 == r1, (r0, r1)
    assert all(buckets and buckets == list(range(len(buckets))) for buckets, _ in r0), r0


# --- OraPO: two processes, then FSDP2 stopped after step 1 and resumed ------------------------------------------
# orapo.py with the warm start shortened (as test_orapo.py's `fast`), and an odd number of val studies checked after
# step 1 (rank 1 pads its share: under FSDP every rank makes as many generate() calls)
ORAPO_CONSTANTS = {"orapo.WARM_START": dict(lr=3e-3, batch_size=4), "orapo.N_EVAL": 5, "orapo.EVAL_EVERY": 1}
ORAPO_FLAGS = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12"]
ORAPO_FLAGS += ["--sft-steps", "2", "--grad-accum", "2"]  # 2 studies a rank, one a micro-batch


def orapo_two_processes(data, out, notes_folder, *spy: str, ok: bool = True, more: tuple = ()):
    """orapo.py's run in `out` under two processes, with `more` flags; spy_run's notes in notes_folder (`spy`: its
    other flags)."""
    notes_folder.mkdir(parents=True)
    run = ["orapo.py", "--data", data, *ORAPO_FLAGS, "--out", out, *more]
    return spy_run("--notes", notes_folder, *spy, *run, ok=ok, constants=ORAPO_CONSTANTS)


@pytest.fixture(scope="module")
def orapo_ddp(tmp_path_factory, small_synthetic):
    """OraPO's run under two processes (DDP): a folder holding the run's (run/) and spy_run's notes (notes/)."""
    folder = tmp_path_factory.mktemp("orapo_ddp")
    orapo_two_processes(small_synthetic, folder / "run", folder / "notes")
    return folder


def test_orapo_under_two_processes(orapo_ddp):
    """--prompts-per-step counts studies over all ranks; last.pt holds both ranks' prompts and each rank's RNG state;
    both ranks' test reports, in order; no rank read RL's last.pt back; the warm start's 2 steps and RL's 2 under
    --grad-accum 2 each reduce every gradient bucket once."""
    out = orapo_ddp / "run"
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    last = torch.load(out / "last.pt", weights_only=True)
    assert len(last["extra"]) == 2 * 4 + 1  # 2 steps x 4 studies (2 per rank): both ranks' prompts in one state
    torch_rng = [state["torch"] for state in last["rng"]]  # each rank's, seeded with seed + rank: apart
    assert len(torch_rng) == 2 and not torch.equal(*torch_rng)
    gens = read_jsonl(out / "generations_test_after.jsonl")
    assert [g["id"] for g in gens] == TEST_IDS  # both ranks' shares, in order
    assert not any(n["read_last"] for n in notes(orapo_ddp / "notes"))
    reduced_once_a_step(orapo_ddp / "notes", 2 + 2)  # the warm start's steps, then RL's under --grad-accum 2


@pytest.mark.slow  # two launches more (~28 CPU-s): the default suite would near 3 minutes on 2 cores
def test_orapo_fsdp_stopped_and_resumed_equals_two_processes(tmp_path, orapo_ddp, small_synthetic):
    """test_orapo_under_two_processes's run again with --fsdp, stopped by Ctrl-C after step 1 and resumed: the same
    steps (each rank samples as before). Sharded and unsharded runs compute each rank's gradient alike and average two
    ranks' gradients exactly either way ((a + b) / 2 = a / 2 + b / 2 in floats), so they differ only where a sum runs
    in another order: the gradient norm (over shards, then ranks; torch's cascade sums keep that within ~log2(n) 2^-24
    ~ 1e-6 relative, seen 3e-7), through clipping when it acts a gradient scale that Adam's update ignores up to eps
    (< 1e-5 x lr per step). Hence metrics within rel 1e-4 and weights within 1e-5 (seen exactly equal), on any CPU
    kernel (checked under ATEN_CPU_CAPABILITY=default and avx2). The checkpoint and final/ hold the gathered weights,
    which load without torchrun. The resume restores the schedule (lr), the ZRR state and AdamW's (the metrics and
    weights after it) from last.pt read by rank 0 alone; the reference is sharded (each rank holds half of it) and
    scores as the unsharded one (KL and DPO in the metrics); the evaluation of 5 val studies (3 on rank 0, 2 and one
    padding on rank 1) writes what one process generates from the same weights."""
    out, fsdp = orapo_ddp / "run", tmp_path / "fsdp"
    stopped = orapo_two_processes(
        small_synthetic, fsdp, tmp_path / "notes_stopped", "--stop-after", "1", ok=False, more=("--fsdp",)
    )
    assert "interrupted: stopped after step 1" in stopped.stderr, stopped.stderr[-4000:]
    assert "exitcode  : 130" in stopped.stderr, stopped.stderr[-4000:]  # torchrun's report: Ctrl-C's status
    after_step_1 = torch.load(fsdp / "last.pt", weights_only=True)
    assert after_step_1["step"] == 1  # one step of two: the resume takes step 2 from what last.pt restores
    orapo_two_processes(small_synthetic, fsdp, tmp_path / "notes_resumed", more=("--fsdp", "--resume"))
    before, after = notes(tmp_path / "notes_stopped"), notes(tmp_path / "notes_resumed")
    assert [n["read_last"] for n in before + after] == [False, False, True, False]  # the resume's rank 0 alone
    for a, b in zip(metrics_rows(out / "metrics.jsonl"), metrics_rows(fsdp / "metrics.jsonl"), strict=True):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a), (a, b)
    ddp, sharded = (common.load_policy(d / "final").model.state_dict() for d in (out, fsdp))
    assert all(torch.allclose(ddp[k], sharded[k], atol=1e-5) for k in ddp)
    ckpt, ddp_ckpt = (torch.load(d / "last.pt", weights_only=True) for d in (fsdp, out))
    assert all(torch.equal(ckpt["model"][k], sharded[k]) for k in sharded)  # full, not shards: the gathered weights
    assert set(ckpt["optimizer"]["state"]) == {k for k, _ in common.load_policy(out / "final").model.named_parameters()}
    assert ckpt["scheduler"] == ddp_ckpt["scheduler"] and ckpt["extra"] == pytest.approx(ddp_ckpt["extra"], rel=1e-6)
    for rank_notes in before + after:  # each rank holds half of the reference (one unit per block, the rest another)
        dtensors, local, full = rank_notes["reference"]
        assert dtensors and local == pytest.approx(full / 2, rel=0.01)
        # and after each rollout (step 1's, stopped, then the resumed step 2's), half of the policy again: the modules
        # generate() gathered (common.gathered) are resharded, every parameter a DTensor of this rank's shard
        rollouts = rank_notes["rollouts"]
        assert len(rollouts) == 1 and all(d and n == pytest.approx(full / 2, rel=0.01) for d, n, full in rollouts)
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


# --- MRG-R1, DEER: two processes under --grad-accum 2 -------------------------------------------------------------
def test_mrg_r1_under_two_processes(tmp_path, small_synthetic):
    """--prompts-per-step counts studies over all ranks: 2 per rank, 8 completions each; both ranks' test reports. The
    warm start's 2 steps and RL's 2 under --grad-accum 2 each reduce every gradient bucket once."""
    out, flags = tmp_path / "mrg_r1", ["--steps", "2", "--sft-steps", "2", "--prompts-per-step", "4"]
    flags += ["--max-new-tokens", "8", "--grad-accum", "2"]
    (tmp_path / "notes").mkdir()
    spy_run("--notes", tmp_path / "notes", "mrg_r1.py", "--data", small_synthetic, *flags, "--out", out)
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    reduced_once_a_step(tmp_path / "notes", 2 + 2)
    gens = read_jsonl(out / "generations_test_after.jsonl")
    assert [g["id"] for g in gens] == TEST_IDS  # both ranks' shares, in order


# DEER's stages shortened, under --grad-accum 2 (RL: 2 studies a rank, one a micro-batch); DDSampling in chunks of 8:
# 5 chunks of the 40 studies, rank 0 scoring 0, 2, 4 and rank 1 1, 3
DEER_FLAGS = ["--max-new-tokens", "8", "--sft-steps", "2", "--steps", "2", "--prompts-per-step", "4"]
DEER_FLAGS += ["--grad-accum", "2"]
DEER_CHUNK = 8


def test_deer_under_two_processes(tmp_path, small_synthetic, monkeypatch):
    """All three stages under two processes, --grad-accum 2: global batches split over the ranks, DDSampling's chunks
    shared, every gradient bucket reduced once a step (reduced_once_a_step). Each chunk's samples are seeded by the
    chunk: the two processes' scores (5 chunks, 2 or 3 a rank, so that a seed by rank or by step would differ from it)
    equal, to the bit, those of one process scoring the same 5 chunks from the same SFT model (the same shapes, the
    same kernels). (test_deer.py's test_torchrun_fsdp_equals_unsharded, slow, shards the RL stage against this
    unsharded run.)"""
    out, data = tmp_path / "deer", ["--data", str(small_synthetic)]
    (tmp_path / "notes").mkdir()
    run = ["deer.py", "all", *data, *DEER_FLAGS, "--out", out]
    spy_run("--notes", tmp_path / "notes", *run, constants={"deer.DD_CHUNK": DEER_CHUNK})
    assert [x["step"] for x in read_jsonl(out / "sft" / "metrics.jsonl")] == [1, 2]
    reduced_once_a_step(tmp_path / "notes", 2 + 2)  # SFT's 2 steps and RL's 2, both under --grad-accum 2
    assert len(read_jsonl(out / "ddsampling" / "metrics.jsonl")) == 3  # chunks 0-1, 2-3, 4 (rank 1 idle)
    sel = json.loads((out / "ddsampling" / "selection.json").read_text())
    assert sel["n_pool"] == 40 and len(sel["ranked"]) == 40 and len(sel["ids"]) == 8
    shutil.copytree(out / "sft", tmp_path / "deer_one" / "sft")
    monkeypatch.setattr(deer, "DD_CHUNK", DEER_CHUNK)
    deer.main(["sample", *data, *DEER_FLAGS, "--out", str(tmp_path / "deer_one")])
    one = json.loads((tmp_path / "deer_one" / "ddsampling" / "selection.json").read_text())
    assert one["ranked"] == sel["ranked"] and one["ids"] == sel["ids"] and len({x["D"] for x in one["ranked"]}) > 1
    assert [x["step"] for x in read_jsonl(out / "rl_rule" / "metrics.jsonl")] == [1, 2]
    gens = read_jsonl(out / "rl_rule" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == TEST_IDS


# --- DCRRG, RRGCL: two processes equal one ----------------------------------------------------------------------
def test_dcrrg_two_processes_equal_one(tmp_path, small_synthetic, starting_weights, monkeypatch):
    """Batch sizes are global and Step 2 contrasts the gathered global batch: two ranks of 4 take the steps of one
    process with batch 8; Steps 3-4 run and gather the ranks' generations in order. DCRRG's steps and texts shortened
    as test_dcrrg.py's FAST and `fast` (no dropout: a step can be recomputed). Each step is compared from the same
    weights (the one-process Step 2 starts from the two processes' Step 1), with measures rounding cannot flip:
    - step 1's logged losses and gradient norm: the same weights and batch, float32 sums of positive terms in another
      order and split (relative error <= n 2^-24 = 1.3e-5 for the n <= 8 x 14 x 2 terms; 1e-7 seen): rtol 1e-4. A rank
      contrasting only its half, or a gathered batch whose gradient is not scaled by the ranks (halved), is far off;
    - the weights after each step's run, as the total difference over the total update (update_relative_difference,
      which explains why not element by element: Step 1's largest element difference was 4e-4 against an lr of 1e-3):
      under 1e-3, seen 2.6e-5 (Step 1) and 6e-6 (Step 2); 0.47 when each rank contrasts only its own half.
    Checked under ATEN_CPU_CAPABILITY=default and avx2 (no avx512 on the machine it was written on)."""
    ddp, flags = tmp_path / "dcrrg", ["--data", str(small_synthetic), *DCRRG_FAST]
    constants = {f"dcrrg.{name}": value for name, value in DCRRG_CONSTANTS.items()}
    spy_run("dcrrg.py", "all", *flags, "--out", ddp, constants=constants)
    for name, value in DCRRG_CONSTANTS.items():
        monkeypatch.setattr(dcrrg, name, value)
    # rank 0 alone writes
    assert [x["step"] for x in metrics_rows(ddp / "step4" / "metrics.jsonl")] == [1, 2, 3]
    gens = read_jsonl(ddp / "step4" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == TEST_IDS  # both ranks' shares, in order
    dcrrg.main(["step1", "--out", str(tmp_path / "dcrrg_one")] + flags)
    (tmp_path / "dcrrg_one2" / "step1").mkdir(parents=True)  # Step 2 in one process from the two processes' Step 1
    for f in ("model.pt", "config.json"):  # a step reads the weights and the data of the step before
        shutil.copy(ddp / "step1" / f, tmp_path / "dcrrg_one2" / "step1" / f)
    dcrrg.main(["step2", "--out", str(tmp_path / "dcrrg_one2")] + flags)
    for step, one, start in (("step1", "dcrrg_one", 0), ("step2", "dcrrg_one2", 1)):
        a, b = (metrics_rows(d / step / "metrics.jsonl")[0] for d in (ddp, tmp_path / one))
        for k in ("loss", "grad_norm") + (("image_loss", "text_loss") if step == "step1" else ()):
            assert a[k] == pytest.approx(b[k], rel=1e-4), (step, k, a[k], b[k])
        states = [
            torch.load(d / step / "model.pt", map_location="cpu", weights_only=True) for d in (ddp, tmp_path / one)
        ]
        assert update_relative_difference(*states, starting_weights[start]) < 1e-3, step


# RRGCL's measurement as test_rrgcl.py's fast_measure, its training one epoch of 6 steps
RRGCL_FLAGS = ["--epochs", "1", "--batch-size", "8", "--steps", "6"]


def test_rrgcl_two_processes_equal_one(tmp_path, small_synthetic, starting_weights, monkeypatch):
    """2 ranks x 4 studies against 1 process x 8: the same studies every step and the same token-mean losses; both
    ranks' test reports, in order. Step 1's loss (the same weights, float32 sums of positive terms in another order and
    split: relative error <= n 2^-24 = 5e-5 for the n <= 8 x 96 tokens) within rtol 1e-4; later steps' within 1e-3 (the
    weights then differ as below; seen 2e-7 at every step). The weights, as the total difference over the total update
    (conftest's update_relative_difference; not element by element: Adam moves an element whose gradient is rounding
    noise by its full lr either way): under 1e-3, seen 1e-6. Token weights that ignore the ranks (rrgcl.sft_step) halve
    the loss.
    Checked under ATEN_CPU_CAPABILITY=default and avx2."""
    for name, value in RRGCL_MEASURE.items():  # the difficulty file, measured here in one process
        monkeypatch.setattr(rrgcl, name, value)
    data = ["--data", str(small_synthetic), "--difficulty", str(tmp_path / "dif.json")]
    rrgcl.main([*data, "--out", str(tmp_path / "measure"), "--measure-only"])
    torchrun("rrgcl.py", *data, *RRGCL_FLAGS, "--out", str(tmp_path / "rrgcl"))
    starting_weights.clear()  # the one-process run's: the weights its steps start from
    rrgcl.main([*data, *RRGCL_FLAGS, "--out", str(tmp_path / "rrgcl_one")])
    ddp, one = read_jsonl(tmp_path / "rrgcl" / "metrics.jsonl"), read_jsonl(tmp_path / "rrgcl_one" / "metrics.jsonl")
    assert ddp[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-4)
    np.testing.assert_allclose([x["loss"] for x in ddp], [x["loss"] for x in one], rtol=1e-3)
    a, b = (
        torch.load(d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"]
        for d in (tmp_path / "rrgcl", tmp_path / "rrgcl_one")
    )
    assert update_relative_difference(a, b, starting_weights[0]) < 1e-3
    gens = read_jsonl(tmp_path / "rrgcl" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == TEST_IDS
