"""The run scaffold (common.py section 7): LoRA, torchrun on one machine and across two "nodes"
(gloo on CPU), seeding, the run folder (refusals, config, metrics), checkpoints with an exact
resume, Ctrl-C, and the flags built from an Args dataclass."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import docstring_parser
import numpy as np
import pytest
import torch

import common
import sandbox
from common import LoRALinear, apply_lora, group_advantages, grpo_loss, lora_disabled, seed_everything
from conftest import TORCHRUN_ENV, Crash

ROOT = Path(__file__).resolve().parents[1]


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


# --- LoRA ------------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _randomize_lora(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0, 0.1)


def test_lora_starts_equal_trains_only_adapters_and_disables_to_base():
    model = _mlp()
    base = copy.deepcopy(model)
    x = torch.randn(5, 6)
    assert apply_lora(model, ["0", "2"], r=2, alpha=4) == ["0", "2"] and isinstance(model[0], LoRALinear)
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)  # B = 0 at init
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(x).pow(2).sum().backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {"0.lora_B", "2.lora_B"} <= changed <= trainable  # B moves first (A's gradient is 0 while B = 0)
    assert not torch.allclose(model(x), base(x))
    with lora_disabled(model):
        torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    assert all(m.enabled for m in model.modules() if isinstance(m, LoRALinear))  # restored


def test_lora_update_by_hand_and_merge():
    model = _mlp()
    apply_lora(model, ["0"], r=2, alpha=8, dropout=0.1)
    _randomize_lora(model)
    model.eval()  # dropout off: the merged weight is the expectation of the LoRA path
    x = torch.randn(5, 6)
    layer = model[0]
    # h = W0 x + b + (alpha / r) B A x, alpha / r = 4
    expected = x @ (layer.base.weight + 4.0 * layer.lora_B @ layer.lora_A).T + layer.base.bias
    torch.testing.assert_close(layer(x), expected)
    merged = _mlp()  # plain layers with the merged weights
    merged.load_state_dict(common.lora_merged_state_dict(model))
    torch.testing.assert_close(merged(x), model(x), rtol=0, atol=1e-6)


def test_lora_a_starts_as_peft_and_dropout_reaches_the_adapter_alone():
    """A: nn.Linear's (and PEFT's) init, kaiming_uniform_(a=sqrt(5)), U(-1/sqrt(in), 1/sqrt(in)); B: 0. In training,
    h = W0 x + b + (alpha / r) B A dropout(x): the base sees x itself (PEFT's LoRA dropout)."""
    base = torch.nn.Linear(256, 64)
    torch.manual_seed(1)
    layer = LoRALinear(base, r=16, alpha=32, dropout=0.5)
    torch.manual_seed(1)
    expected_a = torch.nn.init.kaiming_uniform_(torch.empty(16, 256), a=math.sqrt(5))
    assert torch.equal(layer.lora_A, expected_a) and layer.lora_A.abs().max() <= 1 / 16 and not layer.lora_B.any()
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(5, 256)
    torch.manual_seed(2)
    h = layer.train()(x)
    torch.manual_seed(2)
    dropped = torch.nn.functional.dropout(x, 0.5, training=True)
    torch.testing.assert_close(h, base(x) + 2.0 * dropped @ layer.lora_A.T @ layer.lora_B.T)


def test_lora_names_a_target_that_does_not_exist():
    with pytest.raises(ValueError, match=r"no nn.Linear layer name ends with one of the LoRA targets \['q_proj'\]"):
        apply_lora(_mlp(), ["q_proj"])


# --- torchrun: one machine, and two "nodes" through the c10d rendezvous -------------------------
# Fixed GRPO batch: 4 prompts x G=2 sequences of T+1 = 7 tokens; groups contiguous, so rank r
# takes prompts 2r, 2r+1 (rows 4r .. 4r+3) and every group stays on one rank.
G, T = 2, 6


def _grpo_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (8, T + 1), generator=g)  # (N, T+1) token 0 plays the prompt
    lengths = torch.tensor([6, 3, 5, 2, 4, 6, 1, 5])  # completion lengths: "grpo" means per sequence
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (N, T)
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.5, 0.2, 1.0])  # (N,) group 3 ties: A = 0
    return ids, mask, rewards


def _grpo_gradient(model, ids, mask, rewards, scale=1.0):
    logits = model(ids).logits[:, :-1]  # (N, T, V) position t predicts token t+1
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)  # (N, T)
    loss, _ = grpo_loss(logp, None, group_advantages(rewards, G), mask, loss_type="grpo")
    (loss * scale).backward()


def _check_two_ranks(tmp_path):
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["mean"] == r1["mean"] == 0.5 and r1["dict_mean"] == {"a": 0.5, "b": 2.0}
    assert r1["bcast"] == {"from": 0}
    assert r0["step"] == r1["step"] == 1 and r1["extra"] == {"rank0_only": 0}  # rank 0 wrote the checkpoint
    assert r0["files"] == r1["files"] == ["config.json", "last.pt"]  # and nothing else was written twice
    for r in (r0, r1):
        torch.testing.assert_close(r["redraws"], r["draws"], rtol=0, atol=0)  # each rank's own stream back
    assert not torch.equal(r0["draws"], r1["draws"])  # seed + rank
    # "grpo" is a mean over sequences and the all-reduce averages over ranks: with 4 sequences on each
    # rank, the mean of the two rank means is the mean over all 8, the single-process loss. In float64, so the two
    # differ only by sums in another order: <= n 2^-53 sum|terms|, ~1e-13 for n <= 100 terms summing to <= 10 (seen
    # 6e-17), on any CPU kernel (checked under ATEN_CPU_CAPABILITY=default and avx2); a gradient not averaged is 2x.
    model = tiny_gpt2(seed=0).double()
    _grpo_gradient(model, *_grpo_batch())
    for n, p in model.named_parameters():
        for r in (r0, r1):  # DDP's average; and accumulated over two micro-batches, averaged in the second
            torch.testing.assert_close(r["grads"][n], p.grad, rtol=0, atol=1e-12, msg=n)
            torch.testing.assert_close(r["accumulated"][n], p.grad, rtol=0, atol=1e-12, msg=n)
    # collectives: DDP's buckets (one, for 0.1 M parameters), not one all-reduce per parameter tensor (28); once a
    # step under accumulation; FSDP2's generate() gathers each of its 3 sharded modules once, whatever the tokens
    # (4 new tokens: 9 gathers without gathered(), 12: 25)
    counts = r0["counts"]
    assert counts["step"] == counts["accumulated"] == 1 and counts["parameters"] == 28
    # DDP (common.data_parallel) leaves each rank its own BatchNorm statistics, those of its own batches
    for r in (r0, r1):
        assert set(r["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
        assert all(torch.equal(mine, alone) for mine, alone in r["buffers"].values())
    assert not torch.allclose(r0["buffers"]["1.running_mean"][0], r1["buffers"]["1.running_mean"][0])
    assert counts["gathers"] == {"False 4": 9, "False 12": 25, "True 4": 3, "True 12": 3}
    assert counts["sharded modules"] == 3 and r1["counts"] == counts
    return r0, r1


def _launch(tmp_path, *torchrun_flags):
    """tests/two_ranks.py under `python -m torch.distributed.run torchrun_flags`, writing to tmp_path."""
    env = dict(os.environ, **TORCHRUN_ENV)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *torchrun_flags,
            str(ROOT / "tests" / "two_ranks.py"),
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_nodes_through_the_c10d_rendezvous_equal_one_process(tmp_path):
    """The README's multi-node command on one machine: two one-process "nodes" meet at a c10d endpoint. The gradient
    of two ranks equals one process's, and the collectives, checkpoints, RNG streams and each rank's BatchNorm
    statistics behave (two processes of one node, `--standalone`, run in each script's own torchrun test)."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=rrg-test",
    ]
    nodes = [_launch(tmp_path, *flags, f"--node-rank={k}") for k in (0, 1)]
    try:
        for proc in nodes:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
    finally:  # a node left waiting at the rendezvous must not outlive the test
        for proc in nodes:
            proc.kill()
    r0, r1 = _check_two_ranks(tmp_path)
    # global ranks 0 and 1, each the first (LOCAL_RANK 0) process of its node
    assert sorted([r0["env"], r1["env"]]) == [[0, 2, 0, "cpu"], [1, 2, 0, "cpu"]]


def test_each_node_takes_the_gpu_of_its_local_rank(monkeypatch):
    # global rank 5 of 8, the second process of its node: cuda:1, whatever the node
    picked = []
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setattr(common, "_distributed", lambda: True)  # as if the group were joined
    rank, world, device = common.setup_distributed()
    assert (rank, world, device, picked) == (5, 8, torch.device("cuda", 1), [torch.device("cuda", 1)])


def test_one_process_without_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.setup_distributed() == (0, 1, torch.device("cpu"))


def test_seed_everything_offsets_by_rank():
    def draw():
        return random.random(), np.random.rand(), torch.rand(1).item()

    seed_everything(5, rank=2)
    a = draw()
    seed_everything(7)
    assert draw() == a
    seed_everything(5)
    assert draw() != a


# --- the run folder, checkpoints and resume ------------------------------------------------------
@dataclass
class ToyArgs(common.RunArgs):
    out: str = "runs/toy"
    labeler: str = "rule"
    """a toy run labels nothing: the rules cost nothing to build"""
    steps: Annotated[int, "[0, inf)"] = 6
    """steps of the toy run"""
    lr: Annotated[float, "[0, 1]"] = 1e-2
    """its lr"""


def toy_train(args, interrupt_at=None):
    """The shape of a method script's train() on a dropout MLP: each step's data comes from the python,
    numpy and torch RNGs, so an inexact RNG restore shows in the weights."""
    run = common.start_run(args)
    common.seed_everything(args.seed)  # the same initial weights on every rank, as a script
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer, scheduler = common.adamw(model.parameters(), args.lr, args.steps, "cosine", warmup=0.2)
    state = {"seen": 0}
    common.seed_everything(args.seed, run.rank)
    run.restore(model, optimizer, scheduler, state)
    for step, _ in run.steps(args.steps, lambda start: iter(int, 1)):
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()  # (8, 4)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        run.log(loss=loss.item(), grad_norm=common.clip_gradients(model.parameters(), None))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["seen"] += 8
        if step + 1 == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the step ends, is saved, and the run stops
        run.log_step(step)
        run.checkpoint(step)
    return run.finish({"seen": state["seen"]}), model


@pytest.fixture
def toy_args(small_synthetic, tmp_path):
    return lambda **kw: ToyArgs(**{"data": str(small_synthetic), "out": str(tmp_path / "toy"), **kw})


def _same_weights(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_start_run_leaves_the_seed_to_the_script(toy_args):
    """Issue 70: each script seeds in its train(), in view; start_run neither seeds nor draws (a seed there would
    set the RNGs to --seed's state, not the one the caller left)."""
    seed_everything(12345)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    common.start_run(toy_args(seed=3))
    assert random.getstate() == before[0]
    assert (np.random.get_state()[1] == before[1]).all() and torch.equal(torch.get_rng_state(), before[2])


def test_crashed_run_resumes_exactly(toy_args, tmp_path, monkeypatch, crash_after_checkpoint):
    """Bit for bit: conftest.crash_after_checkpoint says why that holds on any CPU."""
    straight, model = toy_train(toy_args(out=str(tmp_path / "straight")))
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 2)
    crash_after_checkpoint(4)
    with pytest.raises(Crash):
        toy_train(toy_args())
    crash_after_checkpoint(None)
    out = Path(toy_args().out)
    with open(out / "metrics.jsonl", "a") as f:  # a line written after the checkpoint, before the crash
        f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n")
    resumed, again = toy_train(toy_args(resume=True))
    assert resumed == straight == {"seen": 48}  # 4 x 8 before the crash came back from the checkpoint
    _same_weights(model, again)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[4]["loss"] != 0.0
    assert rows[0]["lr"] == pytest.approx(1e-2 / 1)  # warm-up over int(0.2 * 6) = 1 step: (0 + 1) / 1
    assert json.loads((out / "eval.json").read_text()) == {"seen": 48}


def test_ctrl_c_saves_and_the_same_command_with_resume_continues(toy_args, tmp_path):
    """Bit for bit: conftest.crash_after_checkpoint says why that holds on any CPU."""
    _, model = toy_train(toy_args(out=str(tmp_path / "straight")))
    with pytest.raises(
        KeyboardInterrupt,
        match=r"stopped after step 3, with .*last.pt saved: the same command "
        r"with --resume continues",
    ):
        toy_train(toy_args(), interrupt_at=3)
    assert torch.load(Path(toy_args().out) / "last.pt", weights_only=True)["step"] == 3
    _, again = toy_train(toy_args(resume=True))
    _same_weights(model, again)


def test_run_folder_refusals(toy_args, tmp_path):
    out = Path(toy_args().out)
    with pytest.raises(ValueError, match="--resume: .*config.json not found"):
        toy_train(toy_args(resume=True))
    toy_train(toy_args())
    config = (out / "config.json").read_text()
    with pytest.raises(
        ValueError, match=f"{out} already holds a run: pass --resume to continue it, or give another --out"
    ):
        toy_train(toy_args())
    with pytest.raises(
        ValueError,
        match=r"--resume with flags that differ from .*config.json: --steps 6 in the run, "
        r"8 now; --lr 0.01 in the run, 0.02 now",
    ):
        toy_train(toy_args(resume=True, lr=0.02, steps=8))
    # bad input is refused before anything is written: the finished run's files stay as they were
    with pytest.raises(FileNotFoundError, match="annotation file not found"):
        toy_train(ToyArgs(data=str(tmp_path / "nope.json"), out=str(out), resume=True))
    assert (out / "config.json").read_text() == config


def test_checkpoint_of_the_trainable_part_and_clear_errors(tmp_path):
    model = tiny_gpt2()
    model.transformer.h[0].requires_grad_(False)  # a frozen part: only what trains is saved
    run = common.Run(common.RunArgs(out=str(tmp_path / "run")), 0, 1, torch.device("cpu"), None, None)
    run.restore(model)
    run.save_checkpoint(5)
    saved = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    assert saved and not any(k.startswith("transformer.h.0.") for k in saved)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "last.pt"]  # no temporary file left
    fresh = tiny_gpt2(seed=1)
    fresh.transformer.h[0].requires_grad_(False)
    assert common.load_checkpoint(tmp_path / "run" / "last.pt", fresh) == (5, {})
    for n, p in fresh.named_parameters():
        if not n.startswith("transformer.h.0."):
            torch.testing.assert_close(p, dict(model.named_parameters())[n], rtol=0, atol=0)
    other = tiny_gpt2()  # everything trains here: the file lacks h.0's weights
    with pytest.raises(ValueError, match="holds the trainable weights of another set-up"):
        common.load_checkpoint(tmp_path / "run" / "last.pt", other)
    data = (tmp_path / "run" / "last.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.pt is not a readable checkpoint"):
        common.load_checkpoint(tmp_path / "cut.pt", model)


def test_a_checkpoint_of_a_partly_frozen_model_keeps_its_buffers(tmp_path):
    """The BatchNorm statistics a run's forwards moved are in last.pt and come back on --resume, the frozen BatchNorm's
    (its weight and bias frozen, as DCRRG's P-Tuning keeps a ResNet's) as much as the trained one's; the frozen weights
    are not saved. The fresh model's statistics differ from the saved ones, so a checkpoint without buffers shows."""

    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
        m.append(torch.nn.BatchNorm1d(3))
        m[:2].requires_grad_(False)  # the first Linear and BatchNorm frozen: the second pair trains
        return m

    trained = model(0)
    for k in range(3):  # train mode: each forward moves both BatchNorms' running statistics
        trained(torch.randn(8, 4) * (k + 2) + k)
    run = common.Run(common.RunArgs(out=str(tmp_path / "run")), 0, 1, torch.device("cpu"), None, None)
    run.restore(trained)
    run.save_checkpoint(3)
    saved = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    buffers = {"running_mean", "running_var", "num_batches_tracked"}
    assert set(saved) == {f"{i}.{b}" for i in (1, 3) for b in buffers} | {
        f"{i}.{p}" for i in (2, 3) for p in ("weight", "bias")
    }
    fresh = model(1)
    assert all(not torch.equal(b, dict(trained.named_buffers())[n]) for n, b in fresh.named_buffers())
    assert common.load_checkpoint(tmp_path / "run" / "last.pt", fresh) == (3, {})
    for (n, b), (_, b_fresh) in zip(trained.named_buffers(), fresh.named_buffers()):
        assert torch.equal(b, b_fresh), n
    assert torch.equal(fresh[2].weight, trained[2].weight) and not torch.equal(fresh[0].weight, trained[0].weight)


# --- flags ---------------------------------------------------------------------------------------
def test_flags_from_the_args_dataclass(capsys):
    args = common.parse_args(ToyArgs, ["--lr", "0.5", "--no-resume", "--dtype", "bf16"])
    assert (args.lr, args.resume, args.dtype, args.steps) == (0.5, False, "bf16", 6)
    with pytest.raises(SystemExit):
        common.parse_args(ToyArgs, ["--dtype", "fp16"])  # Literal fields are choices: a typo fails at once
    assert "invalid choice: 'fp16' (choose from 'auto', 'fp32', 'bf16')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        common.parse_args(ToyArgs, ["--help"])
    assert "its lr (default: 0.01; in [0, 1])" in capsys.readouterr().out  # the help is the comment after the field
    assert common.exact_div(16, 4, "x") == 4
    with pytest.raises(ValueError, match="--prompts-per-step: 6 is not divisible by 4"):
        common.exact_div(6, 4, "--prompts-per-step")


SCRIPTS = ("mrg_r1", "deer", "orapo", "rrgcl", "dcrrg")


def number_flags(args_class) -> dict:
    """{field: (int or float, the range Annotated beside it, or None)} of each number field."""
    numbers = {}
    for name, hint in typing.get_type_hints(args_class, include_extras=True).items():
        kind, *interval = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint,)
        kind = typing.get_args(kind)[0] if type(None) in typing.get_args(kind) else kind  # int | None -> int
        if kind in (int, float):
            numbers[name] = (kind, interval[0] if interval else None)
    return numbers


@pytest.mark.parametrize("name", ("common", *SCRIPTS))
def test_every_number_flag_has_a_range_checked_when_parsed(name, monkeypatch):
    """Each int and float field of every Args declares its range beside it; parse_args takes both ends where they are
    in it and refuses a value past each end with one line naming the flag and the range."""
    monkeypatch.setattr(docstring_parser, "parse_from_object", functools.cache(docstring_parser.parse_from_object))
    args_class = common.RunArgs if name == "common" else importlib.import_module(name).Args
    numbers = number_flags(args_class)
    assert numbers and [k for k, (_, interval) in numbers.items() if interval is None] == []  # declared beside it
    for key, (cast, interval) in numbers.items():
        flag = "--" + key.replace("_", "-")
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        closed = interval[0] == "[", interval[-1] == "]"
        for value, inside in ((lo, closed[0]), (lo - 1, False), (hi, closed[1]), (hi + 1, False)):
            if not math.isfinite(value):
                continue
            if inside:
                assert getattr(common.parse_args(args_class, [flag, str(cast(value))]), key) == cast(value)
            else:
                with pytest.raises(
                    SystemExit, match=rf"^error: {flag} \S+: out of range, it must lie in {re.escape(interval)}$"
                ):
                    common.parse_args(args_class, [flag, str(cast(value))])


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("orapo", ["--steps", "-1"], "--steps -1: out of range, it must lie in [0, inf)"),
        ("orapo", ["--lr", "2"], "--lr 2.0: out of range, it must lie in [0, 1]"),
        ("mrg_r1", ["--group-size", "1"], "--group-size 1: out of range, it must lie in [2, inf)"),
        ("deer", ["rl", "--fraction", "0"], "--fraction 0.0: out of range, it must lie in (0, 1]"),
        ("rrgcl", ["--epochs", "0"], "--epochs 0: out of range, it must lie in [1, inf)"),
        ("dcrrg", ["step1", "--batch-size", "0"], "--batch-size 0: out of range, it must lie in [1, inf)"),
    ],
)
def test_a_bad_number_is_one_line_and_writes_nothing(tmp_path, script, flags, message):
    """The issue's `--steps -1` ran a 300-step warm start, exited 0 and left a half-written folder."""
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(script).main([*flags, "--out", str(tmp_path / "run")])
    assert str(stop.value) == f"error: {message}"
    assert not (tmp_path / "run").exists()


def test_the_default_folder_names_the_script_and_the_data(tmp_path):
    """runs/<script>-<data name>: the quick start and a user's own data never share a folder."""
    import orapo

    iu = tmp_path / "iu_xray"
    for data, out in (
        ("synthetic", "runs/orapo-synthetic"),
        (str(iu / "annotation.json"), "runs/orapo-iu_xray"),
        (str(iu), "runs/orapo-iu_xray"),
        (str(iu / "mimic_small.json"), "runs/orapo-mimic_small"),
    ):
        assert common.parse_args(orapo.Args, ["--data", data]).out == out
        assert common.parse_args(orapo.Args, ["--data", data, "--out", "mine"]).out == "mine"
    assert common.parse_args(ToyArgs, ["--data", str(iu)]).out == "runs/toy"  # a default of its own


def test_resume_takes_the_runs_flags_from_its_config(toy_args, tmp_path):
    """`--out DIR --resume` alone continues with the run's flags; one given again that differs names both values;
    a run of stages continues with its newest stage's flags."""
    out = Path(toy_args().out)
    toy_train(toy_args(steps=3, lr=0.02, seed=5), interrupt_at=None)
    args = common.parse_args(ToyArgs, ["--out", str(out), "--resume"])
    assert (args.steps, args.lr, args.seed, args.data, args.resume) == (3, 0.02, 5, toy_args().data, True)
    with pytest.raises(ValueError, match=r"--steps 3 in the run, 4 now"):
        toy_train(common.parse_args(ToyArgs, ["--out", str(out), "--resume", "--steps", "4"]))
    assert toy_train(common.parse_args(ToyArgs, ["--out", str(out), "--resume"]))[0] == {"seen": 24}
    staged = tmp_path / "staged"
    for stage, seed in (("first", 1), ("second", 2)):
        (staged / stage).mkdir(parents=True)
        (staged / stage / "config.json").write_text(json.dumps({"seed": seed, "out": str(staged / stage)}))
        time.sleep(0.01)  # distinct modification times
    args = common.parse_args(ToyArgs, ["--out", str(staged), "--resume"])
    assert (args.seed, args.out) == (2, str(staged))
    assert common.parse_args(ToyArgs, ["--out", str(staged), "--resume", "--seed", "7"]).seed == 7  # given: wins


def test_the_bar_shows_four_numbers_and_the_file_keeps_all(tmp_path, capsys):
    """A progress bar with a method's 18 statistics flooded a log: at most 4 (the script's choice), all in
    metrics.jsonl."""
    run = _run(tmp_path)
    names = [f"stat_{k}" for k in range(18)]
    for step, _ in run.steps(2, lambda start: iter(range(start, 2)), "toy", start=0, bar=names[::-1]):
        run.log(**{name: k for k, name in enumerate(names)})
        run.log_step(step)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.endswith("stat_17=17, stat_16=16, stat_15=15, stat_14=14]")
    assert bar.count("=") == 4
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r.keys() - {"step", "time"}) for r in rows] == [sorted(names)] * 2


def test_the_end_names_the_run_folder_and_its_main_files(tmp_path):
    """After a run: its folder, then a line each for results and test generations, stages' too."""
    names = ["eval.json", "generations_test_before.jsonl"]
    others = ["generations_val_step100.jsonl", "generations_test_before.scores.json"]  # a validation's; evaluate's
    for name in names + others:
        (tmp_path / "sft" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sft" / name).write_text("")
        time.sleep(0.01)
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "eval.json").write_text("")
    assert common.end_block(tmp_path).splitlines() == [
        f"run folder  {tmp_path}",
        "results     sft/eval.json, rl/eval.json",
        "generations sft/generations_test_before.jsonl",
    ]


def test_a_finished_run_names_its_learning_curve_at_the_end(small_synthetic, tmp_path, monkeypatch, capsys):
    """The quick start's picture: a run draws figures/training.png (matplotlib is a requirement) and its end block
    names it beside its results (RRG_FIGURES=0, as the tests set it, draws none)."""
    monkeypatch.setenv("RRG_FIGURES", "1")
    out = tmp_path / "toy"
    common.run_main(toy_train, ToyArgs, ["--data", str(small_synthetic), "--out", str(out), "--steps", "2"])
    end = capsys.readouterr().out.splitlines()[-3:]
    assert end == [f"run folder  {out}", "results     eval.json", "figures     figures/training.png"]
    assert (out / "figures" / "training.png").stat().st_size > 0


# --- the optimiser step and the schedule --------------------------------------------------------------
def _run(tmp_path, rank=0, world_size=1, labeler=None):
    return common.Run(common.RunArgs(out=str(tmp_path / "run")), rank, world_size, torch.device("cpu"), None, labeler)


def test_the_first_update_uses_the_schedules_step_0_lr():
    """AdamW's first step moves each weight by lr x factor(0) (m_hat / sqrt(v_hat) = g / |g| = 1 up to eps): with a
    warm-up over 5 of 10 steps, 0.1 x 1/5 = 0.02, then 0.1 x 2/5 = 0.04 under a constant gradient. A scheduler stepped
    before the optimiser would move 0.04 first; one never stepped, 0.02 twice."""
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer, scheduler = common.adamw([p], 0.1, 10, "linear", warmup=0.5, weight_decay=0.0)
    moves = []
    for _ in range(2):
        before = p.detach().clone()
        p.grad = torch.tensor([2.0, -0.5, 1e-3])
        optimizer.step()  # as each script's loop: the step, then the schedule
        scheduler.step()
        moves.append((p.detach() - before).tolist())
    np.testing.assert_allclose(moves, [[-0.02, 0.02, -0.02], [-0.04, 0.04, -0.04]], rtol=1e-4)


def test_clip_gradients_clips_and_returns_the_norm_before_clipping():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])  # norm 5
    assert common.clip_gradients([p], 1.0) == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]))  # scaled to norm 1
    p.grad = torch.tensor([0.3, 0.4])  # norm 0.5 < 1: untouched
    assert common.clip_gradients([p], 1.0) == pytest.approx(0.5)
    torch.testing.assert_close(p.grad, torch.tensor([0.3, 0.4]))
    p.grad = torch.tensor([30.0, 40.0])
    assert common.clip_gradients([p], None) == pytest.approx(50.0) and p.grad[1] == 40.0  # None: the norm alone


@pytest.mark.parametrize(
    "schedule, warmup, expected",
    [
        # total 10, w = int(warmup x 10): (s + 1) / w during the warm-up, then
        ("linear", 0.2, [0.5, 1.0] + [(10 - s) / 8 for s in range(2, 10)]),  # (T - s) / (T - w)
        ("cosine", 0.2, [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)]),
        ("cosine", 0.0, [0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)]),
        ("constant", 0.3, [1 / 3, 2 / 3] + [1.0] * 8),
    ],
)
def test_lr_schedule_by_hand(schedule, warmup, expected):
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = common.adamw([p], 2.0, 10, schedule, warmup)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])  # what step s trains with
        optimizer.step()
        scheduler.step()
    np.testing.assert_allclose(lrs, [2.0 * f for f in expected], rtol=1e-12)


# --- gathers, with the other ranks simulated in one process ------------------------------------------------
def test_gather_strided_puts_every_ranks_share_back_in_order(monkeypatch):
    records = [f"r{k}" for k in range(7)]
    shares = [records[r::3] for r in range(3)]  # 3 ranks: r0 r3 r6 | r1 r4 | r2 r5
    monkeypatch.setattr(common, "all_gather_objects", lambda mine: shares)
    assert common.gather_strided(shares[1], 3) == records
    monkeypatch.setattr(common, "all_gather_objects", lambda mine: [mine])
    assert common.gather_strided(records, 1) == records


class ImageEcho:
    """A stand-in policy whose greedy "report" names the pixels it was shown: each record's text is known beforehand.
    It counts the studies it generated for (with any padding)."""

    def __init__(self):
        self.generated, self.calls = 0, []  # studies generated for; studies per generate() call

    def prompt_batch(self, images, text):
        return {"texts": [hashlib.md5(views[0].tobytes()).hexdigest() for views in images]}

    def generate(self, prompts, max_new_tokens, do_sample=True):
        assert not do_sample
        self.generated += len(prompts["texts"])
        self.calls.append(len(prompts["texts"]))
        return prompts["texts"], None

    def decode(self, ids, mask):
        return list(ids)


def test_evaluation_pairs_each_report_with_its_own_reference_under_two_ranks(tmp_path, small_synthetic, monkeypatch):
    """Run.evaluate with 2 ranks, each in turn (the gather simulated): rank 1 pads its share to rank 0's length and
    drops the padding; rank 0 writes one row per record, in order, each generated report (report(completion)) next
    to its own id, reference and completion."""
    records = common.load_annotation(small_synthetic)["test"][:5]  # odd: rank 1 holds 2, pads to 3
    expected = {r.id: hashlib.md5(common.load_image(r.image_paths[0]).tobytes()).hexdigest() for r in records}
    sent = []
    monkeypatch.setattr(common, "all_gather_objects", lambda mine: sent.append(mine) or [mine, mine])
    echo = ImageEcho()
    _run(tmp_path, rank=1, world_size=2).evaluate(echo, records, "test", "", 8)
    assert echo.generated == 3  # padded to rank 0's 3: under FSDP every rank makes as many generate() calls
    assert sent[0] == [expected[r.id] for r in records[1::2]]  # rank 1's share without its padding
    monkeypatch.setattr(common, "all_gather_objects", lambda mine: [mine, sent[0]])
    _run(tmp_path, rank=0, world_size=2, labeler=common.RuleLabeler()).evaluate(
        ImageEcho(), records, "test", "", 8, report=str.upper
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "generations_test.jsonl").read_text().splitlines()]
    assert [(row["id"], row["reference"], row["completion"], row["generated"]) for row in rows] == [
        (r.id, r.report, expected[r.id], expected[r.id].upper()) for r in records
    ]


@pytest.mark.parametrize("error", ["ValueError", "RuntimeError"])
def test_an_error_on_one_rank_ends_the_job_at_once(tmp_path, error):
    """Rank 1 fails (bad input: one error line; a bug: its traceback) while rank 0 waits in a collective: the rank that
    failed exits at once, torchrun stops the other, and the job ends non-zero in seconds, not after
    $RRG_DIST_TIMEOUT_MIN (set to 10 here; the test allows 120 s). Waiting for the other ranks first hung there."""
    script = ROOT / "tests" / "one_rank_fails.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", RRG_DIST_TIMEOUT_MIN="10")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(script), error]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # torchrun and its workers, had they hung
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    line = "error: rank 1 alone cannot read its input" if error == "ValueError" else f"{error}: rank 1 alone"
    assert line in err, err[-3000:]


def test_shard_gathers_in_dtype_and_averages_gradients_in_fp32(monkeypatch):
    """common.shard: each block (transformers' _no_split_modules), then the rest, one FSDP2 unit, gathered in --dtype
    with gradients reduced in fp32 (without reduce_dtype FSDP2 averages bf16 gradients in bf16)."""
    from torch.distributed import fsdp

    units, methods = [], []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mp_policy: units.append((module, mp_policy)))
    monkeypatch.setattr(fsdp, "register_fsdp_forward_method", lambda module, name: methods.append(name))
    model = tiny_gpt2()
    common.shard(model, torch.bfloat16)
    assert [type(m).__name__ for m, _ in units] == ["GPT2Block", "GPT2Block", "GPT2LMHeadModel"]
    assert all(p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32 for _, p in units)
    assert methods == ["generate"]


# --- friction a new user met (issue 43), each fixed ---------------------------------------------
def test_a_failed_start_leaves_nothing_that_blocks_the_next(tmp_path, small_synthetic):
    """No training studies (every image missing, --drop-invalid): one line, and the folder stays usable; a folder
    holding only config.json files (a stage's included) is not a run."""
    import mrg_r1

    broken = json.loads(small_synthetic.read_text())
    for split in broken.values():
        for record in split:
            record["image_path"] = ["missing.png"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "annotation.json").write_text(json.dumps(broken))
    out = tmp_path / "run"
    flags = ["--labeler", "rule", "--out", str(out), "--sft-steps", "1", "--steps", "1", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit, match="no train or test studies left by --drop-invalid"):
        mrg_r1.main(["--data", str(tmp_path / "data"), "--drop-invalid", *flags])
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]
    (out / "warm_start").mkdir(parents=True)
    (out / "warm_start" / "config.json").write_text("{}")  # what an older start left
    mrg_r1.main(["--data", str(small_synthetic), *flags])  # the same folder, now a run
    assert (out / "eval.json").is_file()


def test_config_holds_the_resolved_values_and_the_warm_start_says_why_it_stopped(tmp_path, small_synthetic, caplog):
    import mrg_r1

    caplog.set_level("INFO", logger="rrg")
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mrg_r1, "CONVERGE", dict(every=2, patience=2, min_gain=10.0, max_steps=20))  # never a gain
        mp.setattr(mrg_r1, "N_VAL", 4)
        mrg_r1.main(["--data", str(small_synthetic), "--labeler", "rule", "--out", str(out), "--steps", "1"])
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["lr"] == 1e-4 and resolved["steps"] == 1 and resolved["max_new_tokens"] == 128
    assert resolved["sft_steps"].startswith("until validation stops improving")
    assert json.loads((out / "config.json").read_text())["lr"] is None  # the flag as given: --resume compares these
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("warm_start:"))
    assert line == "warm_start: stopped after 6 steps (2 validations without a gain of 10); kept step 2's weights " + (
        f"(validation {json.loads((out / 'warm_start' / 'eval_val_step2.json').read_text())['ce']['micro_f1']:.4f})"
    )
    rows = [json.loads(x) for x in (out / "warm_start" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["patience_left"]) for r in rows if "patience_left" in r] == [(2, 2), (4, 1), (6, 0)]


def test_argument_errors_are_one_line_with_the_closest_flag_and_help_has_groups(capsys):
    import orapo

    for argv, line in (
        (["--stpes", "5"], "error: unrecognized arguments: --stpes 5 (did you mean --steps?)"),
        (["--lr", "abc"], "error: argument --lr: invalid float value: 'abc' (--help lists every flag)"),
        (["--ste", "5"], "error: unrecognized arguments: --ste 5 (did you mean --steps?)"),  # no abbreviations
    ):
        with pytest.raises(SystemExit) as stop:
            common.parse_args(orapo.Args, argv)
        assert stop.value.code == 2 and capsys.readouterr().err == line + "\n"
    with pytest.raises(SystemExit):
        common.parse_args(orapo.Args, ["--help"])
    text = capsys.readouterr().out
    assert "balanced training studies (Sec. 4.1); None:" in text  # each flag's help names its source
    paper, run = text.index("the paper's settings"), text.index("the run, its data and model")
    usage = text.index("\n\n")  # the usage block lists every flag first
    assert usage < paper < text.index("  --lambda-min", usage) < run < text.index("  --tiny-start {", usage)


def test_ctrl_c_exits_130_and_a_stopped_sandbox_training_leaves_no_folder(tmp_path, monkeypatch, small_synthetic):
    def stopped(*a, **k):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stop:
        common.run_main(stopped, ToyArgs, ["--out", str(tmp_path / "toy")])
    assert stop.value.code == 130
    data = tmp_path / "set"
    shutil.copytree(small_synthetic.parent, data, ignore=shutil.ignore_patterns("chexbert-*", "foundation-*", ".*"))
    monkeypatch.setattr(sandbox.subprocess, "run", stopped)  # Ctrl-C while the subprocess trains it
    for build in (sandbox.synthetic_chexbert, sandbox.synthetic_foundation):
        with pytest.raises(KeyboardInterrupt):
            build(data / "annotation.json", {"epochs": 1})
    assert not list(data.glob(".tmp-*"))


def test_one_process_trains_a_sandbox_model_while_another_waits(tmp_path, small_synthetic, monkeypatch):
    """Two runs start together on a fresh cache: the foundation trains once; the second finds it done."""
    import threading

    data = tmp_path / "set"
    shutil.copytree(small_synthetic.parent, data, ignore=shutil.ignore_patterns("chexbert-*", "foundation-*", ".*"))
    trained = []

    def fake_training(command, **kwargs):
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        out = Path(command[command.index("--out") + 1])
        (out / "foundation.json").write_text("{}")
        trained.append(out)

    monkeypatch.setattr(sandbox.subprocess, "run", fake_training)
    found = []
    threads = [
        threading.Thread(target=lambda: found.append(sandbox.synthetic_foundation(data / "annotation.json", {"x": 1})))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(trained) == 1 and found[0] == found[1] == data / f"foundation-v{sandbox.FOUNDATION_VERSION}"


def test_resume_of_a_finished_run_says_it_is_finished(toy_args, caplog):
    caplog.set_level("INFO", logger="rrg")
    toy_train(toy_args())
    toy_train(toy_args(resume=True))
    start = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run folder")]
    assert "(a new run)" in start[0] and "(finished: --resume has nothing to train" in start[1]


# --- --report-to: a run watched live --------------------------------------------------------------
def test_report_to_tensorboard_mirrors_every_metrics_line(toy_args):
    """--report-to tensorboard (installed by the user): out/tensorboard's events hold each metrics.jsonl number at
    its step, read back with TensorBoard's own reader."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = toy_args(report_to="tensorboard")
    toy_train(args)
    events = EventAccumulator(str(Path(args.out) / "tensorboard"))
    events.Reload()
    lines = [json.loads(x) for x in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(x["step"], pytest.approx(x["loss"], rel=1e-6)) for x in lines] and len(loss) == 6
    assert {"lr", "grad_norm", "time"} <= set(events.Tags()["scalars"])


def test_report_to_wandb_logs_each_line_and_each_evaluation(tmp_path, small_synthetic, monkeypatch):
    """--report-to wandb: one run (project rrg-from-scratch, the run's flags as its config), each metrics line at its
    step, an evaluation's headline CE number and NLG columns at the step it follows; finished at the end. (A stand-in
    wandb module records the calls: no account, no network.) Without the package: one error naming it."""
    import types
    from importlib.machinery import ModuleSpec

    calls = []

    class FakeRun:
        def log(self, numbers, step):
            calls.append(("log", step, numbers))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = common.RunArgs(out=str(tmp_path / "run"), report_to="wandb")
    run = common.Run(args, 0, 1, torch.device("cpu"), None, common.RuleLabeler())
    assert calls[0][0] == "init" and calls[0][1]["project"] == "rrg-from-scratch"
    assert calls[0][1]["config"]["report_to"] == "wandb"
    for step, _ in run.steps(2, lambda start: iter(range(start, 2)), "toy", start=0):
        run.log(loss=1.0 / (step + 1))
        run.log_step(step)
    records = common.load_annotation(small_synthetic)["test"][:2]
    results = run.evaluate(ImageEcho(), records, "test", "", 8)
    run.finish({})
    logs = [c for c in calls if c[0] == "log"]
    assert [(c[1], c[2]["loss"]) for c in logs[:2]] == [(1, 1.0), (2, 0.5)]
    assert logs[2][1] == 2 and logs[2][2]["test/micro_f1"] == results["ce"]["micro_f1"]
    assert logs[2][2]["test/BLEU-4"] == results["nlg"]["BLEU-4"] and calls[-1] == ("finish",)
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)  # not installed
    with pytest.raises(ValueError, match="pip install wandb"):
        common.Run(
            common.RunArgs(out=str(tmp_path / "other"), report_to="wandb"), 0, 1, torch.device("cpu"), None, None
        )


def test_evaluation_generates_eval_batch_size_studies_a_call(tmp_path, small_synthetic):
    """--eval-batch-size: the studies of each generate() call when evaluating (the last call the rest)."""
    records = common.load_annotation(small_synthetic)["test"][:7]
    args = common.RunArgs(out=str(tmp_path / "run"), eval_batch_size=3)
    policy = ImageEcho()
    common.Run(args, 0, 1, torch.device("cpu"), None, common.RuleLabeler()).evaluate(policy, records, "test", "", 8)
    assert policy.calls == [3, 3, 1]


def test_under_fsdp_a_hugging_face_model_is_read_into_host_memory(tiny_qwen_dir, monkeypatch):
    """initial_policy(fsdp=True) under several processes reads a Hugging Face model's weights into host memory (shard()
    then moves each rank's part to its GPU, block by block); without --fsdp, or alone, straight onto the device."""
    seen = []
    real = common.HFPolicy.__init__

    def init(self, *args, host=False, **kwargs):
        seen.append(host)
        real(self, *args, host=host, **kwargs)

    monkeypatch.setattr(common.HFPolicy, "__init__", init)
    for world, fsdp in ((2, True), (2, False), (1, True)):
        run = SimpleNamespace(world_size=world, args=SimpleNamespace(model=str(tiny_qwen_dir)), foundation=None)
        run.device, run.dtype = torch.device("cpu"), torch.float32
        common.initial_policy(run, [], 4, fsdp=fsdp)
    assert seen == [True, False, False]


def test_ddp_keeps_gradients_in_its_buckets(tmp_path, monkeypatch):
    """common.data_parallel: DistributedDataParallel with gradient_as_bucket_view, so the gradients are views into
    its buckets (one storage for the parameters of a bucket), not a second gradient-sized copy."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as free:  # a free port
        free.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(free.getsockname()[1]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        ddp = common.data_parallel(model, 2)  # as under torchrun with two processes
        ddp(torch.randn(3, 4)).sum().backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and len(storages) == 1
    finally:
        torch.distributed.destroy_process_group()
