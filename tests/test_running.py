"""Running plumbing: hand-written LoRA, torchrun (gloo on CPU), seeding, dtype, RunLog,
atomic checkpoints with an exact resume."""
import argparse
import copy
import json
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from common import (LoRALinear, RunLog, apply_lora, autocast, group_advantages, grpo_loss, load_checkpoint,
                    lora_disabled, merge_lora, resolve_dtype, save_checkpoint, save_config, seed_everything,
                    setup_distributed)

ROOT = Path(__file__).resolve().parents[1]


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=32, bos_token_id=1, eos_token_id=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


# --- LoRA ------------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_lora_starts_equal_trains_only_adapters_and_disables_to_base():
    model = _mlp()
    base = copy.deepcopy(model)
    x = torch.randn(5, 6)
    names = apply_lora(model, ["0", "2"], r=2, alpha=4, dropout=0.0)
    assert names == ["0", "2"] and isinstance(model[0], LoRALinear)
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)  # B = 0 at init
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(x).pow(2).sum().backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    # B moves first (A's gradient is B^T ... = 0 while B = 0)
    assert {"0.lora_B", "2.lora_B"} <= changed <= trainable
    assert not torch.allclose(model(x), base(x))
    with lora_disabled(model):
        torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    assert all(m.enabled for m in model.modules() if isinstance(m, LoRALinear))  # restored


def _randomize_lora(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0, 0.1)


def test_merge_lora_linear():
    model = _mlp()
    apply_lora(model, ["0", "2"], r=2, alpha=8, dropout=0.1)
    _randomize_lora(model)
    model.eval()  # dropout off: the merged weight is the expectation of the LoRA path
    x = torch.randn(5, 6)
    y = model(x)
    assert merge_lora(model) == ["0", "2"]
    assert type(model[0]) is torch.nn.Linear and type(model[2]) is torch.nn.Linear
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-6)


def test_lora_gpt2_conv1d_merge_and_disable():
    from transformers.pytorch_utils import Conv1D
    model = tiny_gpt2().eval()
    base = copy.deepcopy(model)
    ids = torch.randint(0, 50, (2, 7))
    names = apply_lora(model, ["c_attn"], r=4, alpha=8)
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    _randomize_lora(model)
    y = model(ids).logits
    assert not torch.allclose(y, base(ids).logits)
    with lora_disabled(model):
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    merge_lora(model)
    assert type(model.transformer.h[0].attn.c_attn) is Conv1D
    assert set(model.state_dict()) == set(base.state_dict())  # loads without LoRA code
    torch.testing.assert_close(model(ids).logits, y, rtol=0, atol=1e-5)


def test_apply_lora_bad_targets():
    with pytest.raises(ValueError, match="q_proj"):
        apply_lora(_mlp(), ["q_proj"])
    with pytest.raises(ValueError, match="GPT2Attention"):
        apply_lora(tiny_gpt2(), ["attn"])  # a block, not a projection
    model = _mlp()
    apply_lora(model, ["0"])
    with pytest.raises(ValueError, match="twice"):
        apply_lora(model, ["0"])


# --- torchrun ----------------------------------------------------------------------------------
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


def _grpo_gradient(model, ids, mask, rewards):
    logits = model(ids).logits[:, :-1]  # (N, T, V) position t predicts token t+1
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)  # (N, T)
    A = group_advantages(rewards, G)  # (N,)
    loss, _ = grpo_loss(logp, None, None, A, mask, loss_type="grpo")
    loss.backward()


TORCHRUN_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_running import (_grpo_batch, _grpo_gradient, tiny_gpt2, setup_distributed, seed_everything,
                          save_checkpoint, load_checkpoint)
from common import (all_reduce_gradients, all_reduce_mean, broadcast_object, broadcast_parameters,
                    cleanup_distributed)

out = sys.argv[1]
dist = setup_distributed("cpu")
model = tiny_gpt2(seed=dist.rank)  # different inits on purpose: rank 0's must reach every rank
broadcast_parameters(model)
ids, mask, rewards = _grpo_batch()
rows = slice(4 * dist.rank, 4 * dist.rank + 4)  # 2 prompts x G=2
_grpo_gradient(model, ids[rows], mask[rows], rewards[rows])
all_reduce_gradients(model.parameters(), dist.world_size, bucket_numel=5000)  # several buckets

# per-rank RNG streams survive a checkpoint round trip
seed_everything(0, dist.rank)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
save_checkpoint(out + "/ckpt.pt", model, opt, None, step=1, extra={{"rank0_only": dist.rank}})
draws = torch.rand(3)
step, extra = load_checkpoint(out + "/ckpt.pt", model, opt)
redraws = torch.rand(3)
torch.save({{"dist": [dist.rank, dist.world_size, dist.local_rank, str(dist.device), dist.is_main, dist.backend],
            "grads": {{n: p.grad for n, p in model.named_parameters()}},
            "mean": all_reduce_mean(float(dist.rank)), "dict_mean": all_reduce_mean({{"a": dist.rank, "b": 2}}),
            "bcast": broadcast_object({{"from": dist.rank}}), "draws": draws, "redraws": redraws,
            "step": step, "extra": extra}}, out + f"/rank{{dist.rank}}.pt")
cleanup_distributed()
"""


def test_torchrun_grpo_gradient_equals_single_process(tmp_path):
    script = tmp_path / "torchrun_grpo.py"
    script.write_text(TORCHRUN_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["dist"] == [0, 2, 0, "cpu", True, "gloo"] and r1["dist"] == [1, 2, 1, "cpu", False, "gloo"]
    assert r0["mean"] == r1["mean"] == 0.5 and r1["dict_mean"] == {"a": 0.5, "b": 2.0}
    assert r1["bcast"] == {"from": 0}
    assert r0["step"] == r1["step"] == 1 and r1["extra"] == {"rank0_only": 0}  # rank 0 wrote it
    torch.testing.assert_close(r0["redraws"], r0["draws"], rtol=0, atol=0)  # each rank's own stream back
    torch.testing.assert_close(r1["redraws"], r1["draws"], rtol=0, atol=0)
    assert not torch.equal(r0["draws"], r1["draws"])  # seed offset per rank

    # "grpo" is a mean over sequences and the all-reduce averages over ranks: with 4 sequences on each
    # rank, mean of the two rank means = mean over all 8 = the single-process loss.
    model = tiny_gpt2(seed=0)
    _grpo_gradient(model, *_grpo_batch())
    for n, p in model.named_parameters():
        torch.testing.assert_close(r0["grads"][n], p.grad, rtol=0, atol=1e-6, msg=n)
        torch.testing.assert_close(r1["grads"][n], p.grad, rtol=0, atol=1e-6, msg=n)


def test_setup_distributed_single_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    d = setup_distributed("cpu")
    assert (d.rank, d.world_size, d.is_main, d.backend, d.device.type) == (0, 1, True, None, "cpu")


# --- seeding and dtype -----------------------------------------------------------------------
def test_seed_everything_offsets_by_rank():
    def draw():
        return random.random(), np.random.rand(), torch.rand(1).item()

    assert seed_everything(5, rank=2) == 7
    a = draw()
    seed_everything(7)
    assert draw() == a
    seed_everything(5, rank=0)
    assert draw() != a


def test_resolve_dtype_and_autocast():
    assert resolve_dtype("fp32", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="CUDA"):
        resolve_dtype("fp16", "cpu")
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("fp8", "cpu")
    x = torch.randn(4, 4)
    with autocast("cpu", "fp32"):
        assert (x @ x).dtype == torch.float32
    with autocast(torch.device("cpu"), "bf16"):
        assert (x @ x).dtype == torch.bfloat16


# --- checkpoints -----------------------------------------------------------------------------
def _train(steps, ckpt=None, resume=None, start_seed=0):
    """Adam + warm-up LambdaLR on a dropout MLP; each step's data comes from the torch, numpy
    and python RNGs, so an inexact RNG restore shows in the weights."""
    seed_everything(start_seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    step, extra = 0, {"seen": 0}
    if resume is not None:
        step, extra = load_checkpoint(resume, model, opt, sched)
    while step < steps:
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()  # (8, 4)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        extra["seen"] += 8
    if ckpt is not None:
        save_checkpoint(ckpt, model, opt, sched, step, extra, config={"steps": steps, "out": Path("x")})
    return model, extra


def test_resume_is_exact(tmp_path):
    straight, _ = _train(6)
    _train(3, ckpt=tmp_path / "last.pt")
    # a fresh start from another seed: everything must come from the checkpoint
    resumed, extra = _train(6, resume=tmp_path, start_seed=123)
    assert extra == {"seen": 48}
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ck = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ck["step"] == 3 and ck["config"] == {"steps": 3, "out": "x"}


def test_checkpoint_atomic_and_clear_errors(tmp_path):
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "last.pt", model, step=1)
    save_checkpoint(tmp_path / "last.pt", model, step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp file left
    with pytest.raises(Exception):  # a lambda cannot be pickled: the save fails mid-way
        save_checkpoint(tmp_path / "last.pt", model, step=3, extra={"f": lambda: 0})
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert load_checkpoint(tmp_path / "last.pt", model) == (2, {})  # the old one is intact

    with pytest.raises(FileNotFoundError, match="--resume") as e:
        load_checkpoint(tmp_path / "missing" / "last.pt", model)
    assert "missing" in str(e.value)
    data = (tmp_path / "last.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.pt is not a readable checkpoint"):
        load_checkpoint(tmp_path / "cut.pt", model)


# --- logging ---------------------------------------------------------------------------------
def test_runlog_and_config(tmp_path):
    with RunLog(tmp_path, total_steps=4) as run:
        run.log(1, loss=torch.tensor(0.5), reward=np.float32(0.25))
        run.log(2, loss=0.4)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == 0.5 and rows[0]["reward"] == 0.25
    assert all(r["time"] >= 0 for r in rows)

    quiet = tmp_path / "rank1"
    run = RunLog(quiet, total_steps=4, is_main=False)
    run.log(1, loss=0.5)
    run.close()
    assert not quiet.exists()

    @dataclass
    class Args:
        lr: float = 1e-3
        out: Path = Path("runs/x")

    assert json.loads(save_config(tmp_path, Args()).read_text()) == {"lr": 1e-3, "out": "runs/x"}
    ns = argparse.Namespace(seed=3)
    assert json.loads(save_config(tmp_path / "ns", ns).read_text()) == {"seed": 3}


def test_trainable_only_checkpoint_holds_adapters_and_restores_them(tmp_path):
    model = tiny_gpt2()
    apply_lora(model, ["c_attn"], r=2, alpha=4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_()
    save_checkpoint(tmp_path / "last.pt", model, step=5, trainable_only=True)
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["model"]
    assert saved and all("lora_" in k for k in saved)  # no frozen base weight in the file
    fresh = tiny_gpt2()
    apply_lora(fresh, ["c_attn"], r=2, alpha=4)
    assert load_checkpoint(tmp_path / "last.pt", fresh)[0] == 5
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other = tiny_gpt2()
    apply_lora(other, ["c_proj"], r=2, alpha=4)  # another LoRA set-up: a clear error, not a silent partial load
    with pytest.raises(ValueError, match="another model set-up"):
        load_checkpoint(tmp_path / "last.pt", other)


def test_check_resume_config_names_changed_flags(tmp_path):
    import common

    @dataclass
    class Args:
        lr: float = 1e-3
        steps: int = 10
        resume: bool = False

    save_config(tmp_path, Args())
    common.check_resume_config(tmp_path, Args(steps=20, resume=True))  # a longer run: fine
    with pytest.raises(ValueError, match=r"--lr 0.001 in the run, 0.01 now"):
        common.check_resume_config(tmp_path, Args(lr=1e-2, resume=True))
    with pytest.raises(FileNotFoundError, match="config.json"):
        common.check_resume_config(tmp_path / "nothing", Args())
    assert common.exact_div(16, 4, "x") == 4
    with pytest.raises(ValueError, match="--prompts-per-step: 6 is not divisible by 4"):
        common.exact_div(6, 4, "--prompts-per-step")
