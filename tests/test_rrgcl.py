"""RRGCL: Eq. 10-13 and Algorithm 1 worked out by hand, the Table 2 schedulers, the step budget, VNS-Gap in row
blocks against the naive N x N formula, MINE on Gaussians with a known mutual information and its cross-fitted
ITAS, Q1, and end-to-end runs: the difficulty file (--measure-only, --difficulty), what one training step feeds the
loss, resume, torchrun against one process, the Hugging Face path.
    python -m pytest -q tests/test_rrgcl.py -m slow -s  # VNS-Gap benchmarks: 20,000 x 512 on CPU, 270,000 on a GPU"""

import itertools
import json
import math
import os
import time
import types

import numpy as np
import pytest
import torch

import common
import rrgcl
from conftest import Crash, assert_applied, fake_eval, metrics_rows, qwen_flags
from rrgcl import (
    class_difficulty,
    class_members,
    dv_bound,
    pacing,
    rrgcl_lambda,
    rrgcl_subset,
    sample_difficulty,
    scheduling_exponents,
    vns_gap,
)

L = common.LABEL_INDEX


def label_rows(*rows):
    """(N, 14) labels from dicts {name: value}; unlisted = blank."""
    out = np.full((len(rows), 14), np.nan)
    for i, row in enumerate(rows):
        for name, v in row.items():
            out[i, L[name]] = v
    return out


# Eq. 10 ---------------------------------------------------------------------------------------------
def test_eq10_by_hand_and_the_itas_sign():
    dif1, dif2 = np.array([1.0, 2.0, 3.0]), np.array([3.0, 1.0, 2.0])
    s = math.sqrt(1.5)  # z of (1, 2, 3) with the population std sqrt(2/3): (-1, 0, 1) * sqrt(3/2)
    z1, z2 = np.array([-s, 0, s]), np.array([s, -s, 0])
    np.testing.assert_allclose(sample_difficulty(dif1, dif2, 0.6, -1), 0.6 * z1 - 0.4 * z2)  # [-1.2247, 0.4899, 0.7348]
    np.testing.assert_allclose(sample_difficulty(dif1, dif2, 0.6, +1), [-0.2449, -0.4899, 0.7348], atol=1e-4)
    np.testing.assert_allclose(sample_difficulty(dif1, dif2, 1.0), z1)  # Table 2 (a): --alpha 1, VNS-Gap alone
    np.testing.assert_allclose(sample_difficulty(dif1, dif2, 0.0), -z2)  # (b): --alpha 0, ITAS alone


def test_alpha_weighs_vns_gap_and_1_minus_alpha_itas():
    """alpha 0.8 is Eq. 10 with alpha 0.8, beta 0.2: z(dif1) = (-3, -1, 1, 3) / sqrt 5, z(dif2) = (3, -3, -1, 1) /
    sqrt 5, dif = 0.8 z1 - 0.2 z2 = (-3, -0.2, 1, 2.2) / sqrt 5: easy to hard 0, 1, 2, 3 (alpha and beta swapped: 0,
    3, 2, 1)."""
    dif = sample_difficulty(np.array([0.0, 1.0, 2.0, 3.0]), np.array([3.0, 0.0, 1.0, 2.0]), 0.8)
    np.testing.assert_allclose(dif, np.array([-3, -0.2, 1, 2.2]) / math.sqrt(5), atol=1e-12)
    plan = rrgcl.curriculum_plan(dif, label_rows(*[{"Edema": 1}] * 4))
    assert plan["order"].tolist() == [0, 1, 2, 3] and plan["class_orders"][0].tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(plan["table"][0]["difficulty"], np.mean([-3, -0.2, 1, 2.2]) / math.sqrt(5), atol=1e-12)


# Classes, class difficulty, Eq. 11-13 ----------------------------------------------------------------
def test_classes_are_13_keywords_multilabel_and_other():
    assert len(rrgcl.CLASSES) == 13 and "Support Devices" not in rrgcl.CLASSES and "No Finding" in rrgcl.CLASSES
    labels = label_rows(
        {"Edema": 1, "Cardiomegaly": 1},  # 0: two classes
        {"Edema": 1, "Pneumonia": -1},  # 1: uncertain does not count
        {"Support Devices": 1, "No Finding": 1},  # 2: devices only -> No Finding (CheXpert rule)
        {"Atelectasis": -1, "Edema": 0},  # 3: only uncertain -> no keyword -> "Other"
        {"No Finding": 1},
    )  # 4
    names, members = class_members(labels)
    assert names == ["Cardiomegaly", "Edema", "No Finding", "Other"]  # empty classes dropped, CLASSES order
    assert [m.tolist() for m in members] == [[0], [0, 1], [2, 4], [3]]


def test_class_difficulty_is_the_class_mean_min_max_normalised():
    dif = np.array([0.0, 1.0, 2.0, 4.0, -1.0])
    raw, norm = class_difficulty(dif, [np.array([0, 1]), np.array([1, 2, 3]), np.array([4])])
    np.testing.assert_allclose(raw, [0.5, 7 / 3, -1.0])
    np.testing.assert_allclose(norm, [1.5 / (10 / 3), 1.0, 0.0])  # (raw - min) / (max - min)


def test_eq12_eq13_eq11_by_hand():
    gamma, lambda0 = scheduling_exponents(np.array([0.0, 0.5, 1.0]))  # c = 3: easiest, middle, hardest
    np.testing.assert_allclose(gamma, [4.0, 2.5, 1.0])  # Eq. 12: 1 + (1 - d) * 3
    np.testing.assert_allclose(lambda0, [4 / 7.5, 2.5 / 7.5, 1 / 7.5])  # Eq. 13
    T = 10

    def lam(t):
        return rrgcl_lambda(t, T, gamma, lambda0)

    np.testing.assert_allclose(lam(0), lambda0)  # the curve starts at lambda_n(0)
    np.testing.assert_allclose(lam(T), [1, 1, 1])  # lambda_n(T) = 1: every study in at the last epoch
    # t = T / 2. Hardest (gamma 1): linear, 1/7.5 + (6.5/7.5) / 2 = 0.56667.
    # Easiest: ((8/15)^4 + (1 - (8/15)^4) / 2)^(1/4) = (0.0809086 + 0.4595457)^0.25 = 0.54045^0.25 = 0.857412.
    # Middle: ((1/3)^2.5 + (1 - (1/3)^2.5) / 2)^(1/2.5) = (0.0641500 + 0.4679250)^0.4 = 0.532075^0.4 = 0.776943.
    np.testing.assert_allclose(lam(5), [0.857412, 0.776943, 0.566667], atol=1e-6)
    curves = np.stack([lam(t) for t in range(T + 1)])  # (T + 1, 3)
    assert (np.diff(curves, axis=0) >= 0).all()  # non-decreasing in t
    assert (curves[:, 0] >= curves[:, 1]).all() and (curves[:, 1] >= curves[:, 2]).all()  # simpler classes faster
    assert (curves[1:-1, 0] > curves[1:-1, 2]).all()


@pytest.mark.parametrize("c", [1, 2, 13, 14])
def test_gamma_spans_1_to_c_plus_1(c):
    rng = np.random.default_rng(c)
    _, norm = class_difficulty(rng.normal(size=50), [rng.choice(50, 5, replace=False) for _ in range(c)])
    gamma, lambda0 = scheduling_exponents(norm)
    assert gamma.min() >= 1 and gamma.max() <= c + 1 and lambda0.sum() == pytest.approx(1)
    if c > 1:
        assert gamma.min() == pytest.approx(1) and gamma.max() == pytest.approx(c + 1)


# Algorithm 1 -------------------------------------------------------------------------------------------
def plan_for(dif, labels):
    plan = rrgcl.curriculum_plan(dif, labels)
    return plan, plan["classes"]


def test_algorithm1_by_hand():
    # class A (Edema): studies 0, 1, 2, 3 with difficulty 0.3, 0.1, 0.4, 0.2 -> easy-to-hard order 1, 3, 0, 2
    # class B (Cardiomegaly): studies 3, 4 (3 is in both classes); study 5 only uncertain -> "Other"
    dif = np.array([0.3, 0.1, 0.4, 0.2, 0.9, 0.8])
    labels = label_rows(
        {"Edema": 1},
        {"Edema": 1},
        {"Edema": 1},
        {"Edema": 1, "Cardiomegaly": 1},
        {"Cardiomegaly": 1},
        {"Lung Opacity": -1},
    )
    plan, names = plan_for(dif, labels)
    assert names == ["Cardiomegaly", "Edema", "Other"]
    assert [o.tolist() for o in plan["class_orders"]] == [[3, 4], [1, 3, 0, 2], [5]]
    # class means: B (0.2 + 0.9) / 2 = 0.55, A 0.25, Other 0.8 -> normalised 0.5455, 0, 1 -> gamma 2.3636, 4, 1
    np.testing.assert_allclose(plan["gamma"], [1 + (1 - 0.3 / 0.55) * 3, 4.0, 1.0])
    # fractions 0.5 / 0.5 / 1: B's easiest 1 (study 3), A's easiest 2 (1, 3), Other's 1: study 3 counted once
    assert rrgcl_subset(plan["class_orders"], [0.5, 0.5, 1.0]).tolist() == [1, 3, 5]
    assert rrgcl_subset(plan["class_orders"], [0.01, 0.01, 0.01]).tolist() == [1, 3, 5]  # ceil: >= 1 per class
    assert rrgcl_subset(plan["class_orders"], [1.0, 0.75, 1.0]).tolist() == [0, 1, 3, 4, 5]


def test_algorithm1_subsets_grow_from_lambda0_and_reach_all_at_T():
    rng = np.random.default_rng(0)
    N, T = 300, 8
    labels = np.where(rng.random((N, 14)) < 0.15, 1.0, np.nan)
    labels[rng.random(N) < 0.1] = np.nan  # some studies in no class
    labels[:5, :] = -1.0  # and some with only uncertain findings
    plan, _ = plan_for(rng.normal(size=N), labels)
    subsets = [rrgcl.epoch_subset("rrgcl", t, T, plan) for t in range(T + 1)]  # t = 0..T (Algorithm 1 line 6)
    for o, l0 in zip(plan["class_orders"], plan["lambda0"]):  # t = 0: the easiest ceil(lambda_n(0) |D_n|) of each class
        assert set(o[: math.ceil(l0 * len(o))]) <= set(subsets[0])
    assert len(subsets[0]) < len(subsets[1])
    for a, b in itertools.pairwise(subsets):
        assert set(a) <= set(b) and len(a) < len(b)  # grows monotonically (strictly here)
    assert subsets[-1].tolist() == list(range(N))  # all studies at t = T, none twice
    assert all(len(np.unique(s)) == len(s) for s in subsets)


# Table 2 schedulers ---------------------------------------------------------------------------------------
def test_ablation_schedulers_shapes():
    T, c0, K = 10, 0.01, 5

    def hi(name):
        return [pacing(name, t, T, c0, K)[1] for t in range(1, T + 1)]

    np.testing.assert_allclose(hi("linear"), [0.01 + 0.99 * t / 10 for t in range(1, 11)])
    np.testing.assert_allclose(hi("root")[0], math.sqrt(0.1 * (1 - 1e-4) + 1e-4))  # 0.31623
    np.testing.assert_allclose(hi("geom")[4], 0.1)  # 0.01^(1 - 5/10)
    assert hi("baby_step") == [0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8, 0.8, 1.0, 1.0]  # staircase, one bucket per 2 epochs
    for name in ("linear", "root", "geom", "baby_step"):
        h = hi(name)
        assert h[-1] == pytest.approx(1.0) and all(a <= b for a, b in itertools.pairwise(h))
        assert all(pacing(name, t, T)[0] == 0 for t in range(1, T + 1))  # always from the easiest
    assert hi("root")[0] > hi("linear")[0] > hi("geom")[0]  # root fastest early, geometric slowest
    one = [pacing("one_pass", t, T, c0, K) for t in range(1, T + 1)]
    assert one == [((s - 1) / 5, s / 5) for s in (1, 1, 2, 2, 3, 3, 4, 4, 5, 5)]  # each bucket alone, in order
    assert pacing("none", 1, T) == (0.0, 1.0)


def test_global_subsets_follow_the_easy_to_hard_order():
    N, T = 100, 10
    dif = np.random.default_rng(1).normal(size=N)
    plan = {"order": np.argsort(dif)}

    def sub(name, t):
        return rrgcl.epoch_subset(name, t, T, plan)

    def easiest(k):
        return set(np.argsort(dif)[:k])

    assert set(sub("root", 1)) == easiest(32)  # ceil(0.31623 * 100)
    assert set(sub("geom", 5)) == easiest(10) and len(sub("linear", 10)) == N
    buckets = [set(sub("one_pass", t)) for t in (1, 3, 5, 7, 9)]
    assert all(len(b) == 20 for b in buckets) and set().union(*buckets) == set(range(N))  # disjoint, covering
    assert len(sub("none", 1)) == N


class FakeRun:
    """What epoch_batches reads of a common.Run: --batch-size and --seed, the training studies, the rank."""

    def __init__(self, records, batch_size=4, seed=0, rank=0, world_size=1):
        self.args = types.SimpleNamespace(batch_size=batch_size, seed=seed)
        self.data = {"train": records}
        self.rank = rank
        self.world_size = world_size

    def per_rank(self, batch_size, flag):
        return batch_size // self.world_size


def test_epoch_batches_pass_over_the_subset_and_resume_mid_epoch(small_synthetic):
    records = common.load_annotation(small_synthetic)["train"]

    def ids(run, d_sub, first, end, start=None, e=0):
        batches = rrgcl.epoch_batches(run, np.array(d_sub), first, end, e)
        return [b["id"] for b in batches(first if start is None else start)]

    one = ids(FakeRun(records), range(20), 6, 11)  # 5 steps x 4 = one pass over 20 studies
    assert sorted(i for b in one for i in b) == sorted(records[k].id for k in range(20))
    eight = [
        i for b in ids(FakeRun(records), [3, 5, 7, 11, 13], 0, 2) for i in b
    ]  # 8 draws from 5: a pass, then 3 again
    assert set(eight) == {records[k].id for k in (3, 5, 7, 11, 13)} and len(set(eight[:5])) == 5
    assert ids(FakeRun(records), range(20), 6, 11, start=8) == one[2:]  # a resumed run goes on with the same draw
    assert (
        ids(FakeRun(records, seed=1), range(20), 6, 11) != one and ids(FakeRun(records), range(20), 6, 11, e=1) != one
    )
    halves = [ids(FakeRun(records, rank=r, world_size=2), range(20), 6, 11) for r in (0, 1)]  # each rank half a step
    assert [a + b for a, b in zip(*halves)] == one


# Eq. 1-4: VNS-Gap ---------------------------------------------------------------------------------------
def naive_vns_gap(v, t):
    Sv = (v @ v.T) / (v.norm(dim=1)[:, None] * v.norm(dim=1)[None])  # Eq. 1 (N, N)
    St = (t @ t.T) / (t.norm(dim=1)[:, None] * t.norm(dim=1)[None])  # Eq. 2
    return (Sv - St).abs().sum(1)  # Eq. 3-4


def naive_rows(v, t, rows):
    """Eq. 1-4 for some rows only, in float64: sum_j |cos(v_i, v_j) - cos(t_i, t_j)|."""
    v, t = torch.nn.functional.normalize(v.double(), dim=1), torch.nn.functional.normalize(t.double(), dim=1)
    return (v[rows] @ v.T - t[rows] @ t.T).abs().sum(1)


@pytest.mark.parametrize("block", [1, 8, 37, 100])
def test_vns_gap_blocked_equals_naive(block):
    g = torch.Generator().manual_seed(0)
    v, t = torch.randn(37, 5, generator=g, dtype=torch.float64), torch.randn(37, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(vns_gap(v, t, block), naive_vns_gap(v, t), rtol=1e-12, atol=1e-12)
    got32 = vns_gap(v.float(), t.float(), block)  # float32 matmuls, float64 sums
    torch.testing.assert_close(got32, naive_vns_gap(v, t), rtol=1e-5, atol=1e-5)


def test_vns_gap_meaning():
    # studies 0 and 1 look alike and read alike; study 2 looks like them but reads differently
    v = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, 0.05]])
    t = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0]])
    dif1 = vns_gap(v, t)
    assert dif1.argmax() == 2 and dif1[2] > 1.5 * max(dif1[0], dif1[1])  # 1.90 vs 1.00 and 0.90


@pytest.mark.slow
def test_vns_gap_benchmark_20000_x_512():
    """Benchmark (tests/MACHINES.md): VNS-Gap on CPU, N = 20,000, 512-dim features.
    python -m pytest -q tests/test_rrgcl.py -m slow -s"""
    torch.set_num_threads(int(os.environ.get("RRG_BENCH_THREADS", "2")))
    g = torch.Generator().manual_seed(0)
    v, t = torch.randn(20_000, 512, generator=g), torch.randn(20_000, 512, generator=g)
    start = time.perf_counter()
    dif1 = vns_gap(v, t, block=2048)
    wall = time.perf_counter() - start
    print(f"\nVNS-Gap N = 20,000 x 512 on CPU ({torch.get_num_threads()} threads): {wall:.1f} s")
    assert dif1.shape == (20_000,) and torch.isfinite(dif1).all()
    rows = [0, 2047, 2048, 4095, 4096, 19_999]  # both sides of block boundaries, the first and the last row
    torch.testing.assert_close(dif1[rows], naive_rows(v, t, rows), rtol=1e-5, atol=1e-3)
    assert wall < 30


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vns_gap_benchmark_mimic_size_on_gpu():
    """Benchmark: VNS-Gap at MIMIC-CXR's training size, N = 270,000, ResNet-101 (2048) and
    Clinical BERT (768) features, on the GPU: under a minute."""
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(270_000, 2048, generator=g, device="cuda")
    t = torch.randn(270_000, 768, generator=g, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    dif1 = vns_gap(v, t, block=4096, device="cuda")
    wall = time.perf_counter() - start
    print(
        f"\nVNS-Gap N = 270,000 (2048 + 768 dims) on {torch.cuda.get_device_name()}: {wall:.1f} s, "
        f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    rows = [0, 4095, 4096, 269_999]
    torch.testing.assert_close(dif1[rows], naive_rows(v, t, rows).cpu(), rtol=1e-5, atol=1e-2)
    assert dif1.shape == (270_000,) and torch.isfinite(dif1).all() and wall < 60


# Eq. 5-9: MINE ------------------------------------------------------------------------------------------
def test_dv_bound_by_hand():
    # E[T_joint] = 1.5; log E[e^T_marg] = log((1 + 3) / 2) = log 2
    assert dv_bound(torch.tensor([1.0, 2.0]), torch.tensor([0.0, math.log(3.0)])).item() == pytest.approx(
        1.5 - math.log(2)
    )


def mine_estimate(T, image, text, seed=0):
    """The DV bound over a whole held-out set: an honest lower bound on the mutual information."""
    with torch.no_grad():
        j = torch.randperm(len(image), generator=torch.Generator().manual_seed(seed))
        return dv_bound(T(image, text), T(image, text[j])).item()


def gaussian_pairs(n, d, rho, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, rho * x + math.sqrt(1 - rho**2) * torch.randn(n, d, generator=g)


def test_mine_approaches_known_mutual_information_from_below():
    d, rho = 2, 0.8
    true_mi = -d / 2 * math.log(1 - rho**2)  # 1.0217 nats for 2 dims with correlation 0.8
    x, y = gaussian_pairs(4000, d, rho, 0)
    x_test, y_test = gaussian_pairs(20000, d, rho, 1)  # held out: the DV value is then a lower bound
    estimates = []
    for steps in (15, 200):  # validated every 5 steps, never stopped early
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rrgcl, "MINE_CONVERGE", dict(every=5, patience=10**6, min_gain=0.0, max_steps=steps))
            T, _ = rrgcl.train_mine(x, y, batch_size=128, lr=1e-3, held_out=0.2, shuffles=1, seed=0)
        estimates.append(mine_estimate(T, x_test, y_test))
    assert estimates[0] < estimates[1] <= true_mi + 0.03  # rises towards the true value, not past it
    assert estimates[1] > 0.85 * true_mi
    with torch.no_grad():  # T scores aligned pairs above shuffled ones
        assert T(x_test[:500], y_test[:500]).mean() > T(x_test[:500], y_test[500:1000]).mean()


def test_mine_trains_until_its_held_out_bound_stops_rising(monkeypatch):
    """MINE_CONVERGE: validated on the held-out pairs every `every` steps; no gain of min_gain (here: never) for
    `patience` validations stops it, and T is the best validation's: its bound on those pairs is the one returned."""
    monkeypatch.setattr(rrgcl, "MINE_CONVERGE", dict(every=10, patience=2, min_gain=100.0, max_steps=1000))
    x, y = gaussian_pairs(1000, 2, 0.8, 0)
    calls = []
    real = rrgcl.dv_bound

    def counting(t_joint, t_marginal):
        calls.append(len(t_joint))
        return real(t_joint, t_marginal)

    monkeypatch.setattr(rrgcl, "dv_bound", counting)
    T, best = rrgcl.train_mine(x, y, batch_size=64, lr=1e-3, held_out=0.2, shuffles=3, seed=0)
    assert calls.count(200) == 3 and len(calls) == 30 + 3  # 30 training batches, 3 validations on the 200 held out
    g = torch.Generator().manual_seed(0)
    held = torch.randperm(1000, generator=g)[:200]
    unpaired = torch.cat([held[torch.randperm(200, generator=g)] for _ in range(3)])  # 3 shuffles of their reports
    with torch.no_grad():
        assert real(T(x[held], y[held]), T(x[held.repeat(3)], y[unpaired])).item() == pytest.approx(best)  # step 10's


def test_itas_scores_every_pair_with_the_network_that_never_saw_it(monkeypatch):
    """Eq. 9 cross-fitted: two networks, each fitted on one half of the pairs; a pair's dif2 is the other
    network's T on it, standardised within its half (DV leaves T free up to a constant)."""
    monkeypatch.setattr(rrgcl, "MINE", dict(batch_size=128, lr=1e-3, held_out=0.2, shuffles=2))
    monkeypatch.setattr(rrgcl, "MINE_CONVERGE", dict(every=50, patience=10**6, min_gain=0.0, max_steps=150))
    x, y = gaussian_pairs(600, 2, 0.8, 0)
    fits, real = [], rrgcl.train_mine
    monkeypatch.setattr(
        rrgcl,
        "train_mine",
        lambda image, text, **kw: fits.append((image, text, real(image, text, **kw)[0])) or (fits[-1][2], 0.0),
    )
    dif2, stats = rrgcl.itas(x, y, seed=0)
    xs, ys = (x - x.mean(0)) / x.std(0), (y - y.mean(0)) / y.std(0)  # the standardised features MINE sees

    def key(rows):
        return {tuple(r) for r in np.round(rows.numpy(), 5).tolist()}

    fitted = [key(f[0]) for f in fits]
    assert not fitted[0] & fitted[1] and len(fitted[0] | fitted[1]) == 600  # two disjoint halves
    for (_, _, T), seen in zip(fits, fitted):
        held = np.array([k for k, r in enumerate(np.round(xs.numpy(), 5).tolist()) if tuple(r) not in seen])
        with torch.no_grad():
            t = T(xs[held], ys[held]).double().numpy()
        np.testing.assert_allclose(dif2[held], (t - t.mean()) / t.std(), atol=1e-5)
    assert len(stats["dv_held_out"]) == 2 and min(stats["dv_held_out"]) > 0.3  # true MI: 1.02 nats


# Q1 analysis ------------------------------------------------------------------------------------------------
def test_q1_per_class_bleu_and_spearman():
    ref = "the heart is enlarged and there is a small left pleural effusion with basilar atelectasis"
    rows, labels = [], []
    for name, gen in (
        ("Edema", ref),
        ("Cardiomegaly", "the heart is enlarged and there is a small right pleural effusion with mild atelectasis"),
        ("Fracture", "no acute findings seen today"),
    ):
        for _ in range(3):
            rows.append({"reference": ref, "generated": gen})
            labels.append([1.0 if n == name else np.nan for n in common.CHEXPERT_LABELS])
    classes = [
        {"name": "Edema", "size": 30, "difficulty": -0.5},
        {"name": "Cardiomegaly", "size": 20, "difficulty": 0.1},
        {"name": "Fracture", "size": 10, "difficulty": 0.4},
        {"name": "Other", "size": 5, "difficulty": 0.0},
        {"name": "Lung Lesion", "size": 4, "difficulty": 0.0},
    ]  # Other is no keyword; Lung Lesion has no test study
    out = rrgcl.q1_analysis(rows, np.array(labels), classes)
    bleu = {c["name"]: c["bleu4"] for c in out["per_class"]}
    assert list(bleu) == ["Edema", "Cardiomegaly", "Fracture"] and bleu["Edema"] == pytest.approx(1.0)
    assert 0.05 < bleu["Cardiomegaly"] < 0.9 and bleu["Fracture"] < 1e-3
    assert out["spearman_bleu4_vs_size"]["rho"] == pytest.approx(1.0)
    assert out["spearman_bleu4_vs_difficulty"]["rho"] == pytest.approx(-1.0)


def test_the_measurer_and_q1_read_findings_and_impression():
    r = common.Record("s1", [], "The heart is enlarged.", "train", meta={"impression": " Mild pulmonary edema. "})
    assert (
        rrgcl.measure_text(r) == "The heart is enlarged. Mild pulmonary edema."
    )  # Sec. 4.1: the two sections stitched
    assert (
        rrgcl.measure_text(common.Record("s2", [], "No effusion.", "train", meta={"impression": ""})) == "No effusion."
    )
    labels = rrgcl.class_labels([r, common.Record("s3", [], "x", "test", labels=np.ones(14))], common.RuleLabeler())
    assert labels[0, L["Edema"]] == 1 and labels[0, L["Cardiomegaly"]] == 1 and (labels[1] == 1).all()  # the data's own


# End to end -----------------------------------------------------------------------------------------------
FAST_MEASURE = dict(
    ENCODER_CONVERGE=dict(rrgcl.ENCODER_CONVERGE, max_steps=1),
    MINE=dict(batch_size=16, lr=1e-3, held_out=0.2, shuffles=2),
    MINE_CONVERGE=dict(every=20, patience=10**6, min_gain=0.0, max_steps=40),
)


@pytest.fixture(scope="module")
def fast_measure():
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FAST_MEASURE.items():
            mp.setattr(rrgcl, name, value)
        yield


@pytest.fixture(scope="module")
def difficulty_file(tmp_path_factory, small_synthetic, fast_measure):
    """--measure-only on the small synthetic set, once."""
    tmp = tmp_path_factory.mktemp("difficulty")
    rrgcl.main(
        [
            "--data",
            str(small_synthetic),
            "--out",
            str(tmp / "m"),
            "--measure-only",
            "--difficulty",
            str(tmp / "dif.json"),
        ]
    )
    return tmp / "dif.json"


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_mine_line_says_what_a_negative_bound_means(small_synthetic, fast_measure, caplog):
    """MINE's Donsker-Varadhan numbers, printed bare ("[-3.33, -3.98] nats"), left a reader to guess what a negative
    lower bound on a mutual information (>= 0) means: the line says it, beside the measured numbers."""
    caplog.set_level("INFO", logger="rrg")
    records = common.load_annotation(small_synthetic)["train"]
    mine = rrgcl.measure(rrgcl.Args(data=str(small_synthetic)), records, common.RuleLabeler(), "cpu")["mine"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("MINE"))
    assert "lower bound on the image-report mutual information (>= 0; below 0, T found no link" in line
    assert "that holds on unseen pairs and ITAS is noise)" in line
    for k in ("dv_train", "dv_held_out"):
        assert ", ".join(f"{x:.2f}" for x in mine[k]) in line


def test_measure_only_writes_the_file_and_training_reads_it(
    tmp_path, small_synthetic, difficulty_file, monkeypatch, capsys, applied_updates
):
    """--measure-only writes the difficulty file, training reads it (a wrong or absent one is refused) and follows
    Algorithm 1's epochs; each optimiser step of the run applied the tiny model's constant lr 1e-3 and gradients
    clipped to MAX_GRAD_NORM (1.0)."""
    m = json.loads(difficulty_file.read_text())
    assert (
        len(m["ids"]) == len(m["dif1"]) == len(m["dif2"]) == len(m["labels"]) == 40
        and len(m["mine"]["dv_held_out"]) == 2
    )
    base = ["--data", str(small_synthetic), "--epochs", "2", "--batch-size", "8"]
    with pytest.raises(SystemExit, match="exists; delete it to measure again"):
        rrgcl.main(base + ["--out", str(tmp_path / "a"), "--measure-only", "--difficulty", str(difficulty_file)])
    with pytest.raises(SystemExit, match="no such file"):
        rrgcl.main(base + ["--out", str(tmp_path / "b"), "--difficulty", str(tmp_path / "absent.json")])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**m, "ids": m["ids"][::-1]}))
    with pytest.raises(SystemExit, match="other training studies"):
        rrgcl.main(base + ["--out", str(tmp_path / "c"), "--difficulty", str(other)])
    with pytest.raises(SystemExit):
        rrgcl.main(base + ["--out", str(tmp_path / "d"), "--itas-sign", "0"])
    assert "--itas-sign: invalid choice" in capsys.readouterr().err

    monkeypatch.setattr(rrgcl, "measure", lambda *a: pytest.fail("measured again: the file must be read"))
    out = tmp_path / "run"
    rrgcl.main(base + ["--out", str(out), "--difficulty", str(difficulty_file)])
    (trained,) = applied_updates  # the generator's optimiser (the measurer's networks have their own)
    schedule = json.loads((out / "schedule.json").read_text())
    epochs = [x for x in read_jsonl(out / "metrics.jsonl") if "epoch" in x]
    assert [x["epoch"] for x in epochs] == schedule["t"] == [0, 1, 2]  # t = 0..T: the lambda_n(0) subset trains
    assert [x["subset"] for x in epochs] == schedule["subset_sizes"] and epochs[0]["subset"] < epochs[-1][
        "subset"
    ] == 40
    steps = [max(1, s // 8) for s in schedule["subset_sizes"]]  # one pass over each D_sub(t)
    assert [x["step"] for x in epochs] == (
        1 + np.cumsum([0] + steps[:-1])
    ).tolist()  # logged at each epoch's first step
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == sum(steps)
    assert_applied(trained, [1e-3] * sum(steps), clip=1.0)
    assert all(
        c["lambda"][0] == pytest.approx(c["lambda0"]) and c["lambda"][-1] == pytest.approx(1)
        for c in schedule["classes"]
    )
    for x in epochs:  # Fig. 3 from the run: every class's lambda_n(t) of the epoch
        assert [x[f"lambda/{c['name']}"] for c in schedule["classes"]] == pytest.approx(
            [c["lambda"][int(x["epoch"])] for c in schedule["classes"]]
        )
    results = json.loads((out / "eval.json").read_text())
    assert "BLEU-4" in results["test"]["nlg"] and results["test"]["q1"]["per_class"]

    rrgcl.main(["q1", "--data", str(small_synthetic), "--out", str(out), "--difficulty", str(difficulty_file)])
    assert json.loads((out / "q1.json").read_text()) == results["test"]["q1"]  # Fig. 1 on the run's generations

    rrgcl.main(
        base
        + [
            "--out",
            str(tmp_path / "t1"),
            "--difficulty",
            str(difficulty_file),
            "--no-t0",
            "--steps",
            "7",
            "--scheduler",
            "one_pass",
        ]
    )
    rows = read_jsonl(tmp_path / "t1" / "metrics.jsonl")
    epochs = [
        x for x in rows if "epoch" in x
    ]  # One Pass: two disjoint halves of 20; 7 steps shared 20 : 20 -> round(3.5) = 4, 3
    assert [x["epoch"] for x in epochs] == [1, 2] and [x["step"] for x in epochs] == [1, 5] and rows[-1]["step"] == 7
    assert sum(x["subset"] for x in epochs) == 40 and not any(k.startswith("lambda/") for k in epochs[0])


def independent_subset_t0(m):
    """Eq. 10-13 and Algorithm 1 lines 1-8 at t = 0, written out from the paper: the studies lambda_n(0) takes."""
    labels = np.array(m["labels"], dtype=float)

    def z(x):
        return (np.array(x) - np.mean(x)) / np.std(x)

    dif = 0.6 * z(m["dif1"]) - 0.4 * z(m["dif2"])  # Eq. 10, ITAS subtracted
    pos = labels[:, [L[n] for n in rrgcl.CLASSES]] == 1
    classes = [np.flatnonzero(pos[:, k]) for k in range(13) if pos[:, k].any()] + [np.flatnonzero(~pos.any(1))]
    classes = [c for c in classes if len(c)]
    mean = np.array([dif[c].mean() for c in classes])
    gamma = 1 + (1 - (mean - mean.min()) / (mean.max() - mean.min())) * len(classes)  # Eq. 12
    lam0 = gamma / gamma.sum()  # Eq. 13 = Eq. 11 at t = 0
    return {
        m["ids"][i] for c, l in zip(classes, lam0) for i in sorted(c, key=lambda i: dif[i])[: math.ceil(l * len(c))]
    }


def test_measuring_under_torchrun_is_an_error_naming_the_two_commands(tmp_path, small_synthetic, difficulty_file):
    """Under torchrun with 2 processes rank 0 would measure (VNS-Gap: hours at MIMIC-CXR's size) while rank 1 waits in a
    collective past NCCL's timeout: an error on every rank instead, before anything is measured, naming the
    one-process --measure-only run and --difficulty; a file to read (or a resumed run's own) is fine."""
    data = common.load_annotation(small_synthetic)

    def run(world_size, resuming=False):
        return types.SimpleNamespace(world_size=world_size, is_main=True, resuming=resuming, out=tmp_path, data=data)

    for args in (rrgcl.Args(), rrgcl.Args(measure_only=True, difficulty=str(tmp_path / "new.json"))):
        with pytest.raises(ValueError, match=r"torchrun: first `python rrgcl.py --measure-only --difficulty FILE`"):
            rrgcl.difficulty_scores(run(2), args)
    assert not (tmp_path / "difficulty.json").exists() and not (tmp_path / "new.json").exists()
    m, path = rrgcl.difficulty_scores(run(2), rrgcl.Args(difficulty=str(difficulty_file)))
    assert path == difficulty_file and len(m["dif1"]) == len(data["train"])
    (tmp_path / "difficulty.json").write_text(difficulty_file.read_text())  # a resumed run reads its own file
    assert rrgcl.difficulty_scores(run(2, resuming=True), rrgcl.Args())[1] == tmp_path / "difficulty.json"


def test_one_step_feeds_the_loss_the_lambda0_studies_and_their_token_mean(
    tmp_path, small_synthetic, difficulty_file, monkeypatch
):
    """What reaches the loss in the first epoch (t = 0): only studies of the lambda_n(0) subset worked out here from
    the difficulty file, each at most once; the loss is the token mean of their reports' NLL, recomputed from the
    policy's per-token log-probs at that moment, and it is what metrics.jsonl logs."""
    seen, real_step = [], rrgcl.sft_step

    def sft_loss(self, prompts, texts):
        ids, mask = self.encode_targets(texts)
        logp = self.completion_logprobs(prompts, ids, mask)  # (B, T)
        seen[-1]["expected"] = (-(logp * mask).sum() / mask.sum()).item()
        return real_loss(self, prompts, texts)

    real_loss = common.TinyPolicy.sft_loss
    monkeypatch.setattr(common.TinyPolicy, "sft_loss", sft_loss)
    monkeypatch.setattr(
        rrgcl, "sft_step", lambda policy, batch, run: seen.append({"ids": batch["id"]}) or real_step(policy, batch, run)
    )
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    out = tmp_path / "run"
    rrgcl.main(
        [
            "--data",
            str(small_synthetic),
            "--out",
            str(out),
            "--difficulty",
            str(difficulty_file),
            "--epochs",
            "1",
            "--batch-size",
            "2",
        ]
    )
    subset0 = independent_subset_t0(json.loads(difficulty_file.read_text()))
    n0 = len(subset0) // 2
    first = [i for s in seen[:n0] for i in s["ids"]]
    assert set(first) <= subset0 and len(first) == len(set(first)) == 2 * n0  # lambda_n(0) studies, none twice
    assert len(seen) == n0 + 20  # then t = 1 = T: one pass over all 40 studies
    assert {i for s in seen[n0:] for i in s["ids"]} == set(json.loads(difficulty_file.read_text())["ids"])
    logged = [x["loss"] for x in read_jsonl(out / "metrics.jsonl")]
    np.testing.assert_allclose(logged, [s["expected"] for s in seen], rtol=1e-6)


def test_resume_matches_an_uninterrupted_run_on_real_format_iu_xray(
    tmp_path, iu_xray, fast_measure, monkeypatch, crash_after_checkpoint
):
    """IU X-Ray as users have it (R2GenGPT layout, 1-5 views per study): the measurer reads R2Gen's two views of every
    study, the run cleans as R2Gen does IU X-Ray and scores every test study. Stopped after the step-4 checkpoint and
    resumed, a run ends with the weights and log of one never stopped; the resumed run reads its own difficulty.json
    instead of measuring again, and refuses a changed flag.
    Bit for bit: conftest.crash_after_checkpoint says why that holds on any CPU."""
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 4)
    views, forward = [], common.ViewMean.forward  # the measurer's image encoders see (B, V, C, H, W)
    monkeypatch.setattr(common.ViewMean, "forward", lambda self, x: views.append(x.shape[1]) or forward(self, x))
    flags = ["--data", str(iu_xray), "--epochs", "1", "--batch-size", "8", "--steps", "9"]
    crash_after_checkpoint(4)
    with pytest.raises(Crash):
        rrgcl.main(flags + ["--out", str(tmp_path / "part")])  # measures into part/difficulty.json
    assert set(views) == {2} and {len(r.image_paths) for r in common.load_annotation(iu_xray)["train"]} == {
        1,
        2,
        3,
        4,
        5,
    }
    crash_after_checkpoint(None)
    rrgcl.main(flags + ["--out", str(tmp_path / "full"), "--difficulty", str(tmp_path / "part" / "difficulty.json")])
    with pytest.raises(SystemExit, match="--alpha 0.6 in the run, 0.5 now"):
        rrgcl.main(flags + ["--out", str(tmp_path / "part"), "--resume", "--alpha", "0.5"])
    monkeypatch.setattr(rrgcl, "measure", lambda *a: pytest.fail("measured again on resume"))
    rrgcl.main(flags + ["--out", str(tmp_path / "part"), "--resume"])
    full, part = (
        torch.load(tmp_path / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"] for d in ("full", "part")
    )
    assert all(torch.equal(full[k], part[k]) for k in full)

    def rows(d):
        return metrics_rows(tmp_path / d / "metrics.jsonl")

    assert rows("full") == rows("part") and len(rows("part")) == 9
    config, result = (json.loads((tmp_path / "part" / f).read_text()) for f in ("config.json", "eval.json"))
    assert (
        config["clean"] == result["test"]["clean"] == "iu_xray" and result["test"]["n"] == 12 and result["steps"] == 9
    )


def test_every_measurement_seed_shares_the_pre_trained_encoders(small_synthetic, monkeypatch):
    """The paper's encoders are pre-trained once; the stand-ins train with ENCODER["seed"] whatever --seed: two
    measurement seeds get the same features (so the same VNS-Gap); only MINE's T varies with --seed."""
    monkeypatch.setattr(rrgcl, "ENCODER_CONVERGE", dict(rrgcl.ENCODER_CONVERGE, max_steps=2))
    records = common.r2gen_views(common.load_annotation(small_synthetic))["train"]
    labels = rrgcl.class_labels(records, common.RuleLabeler())
    a, b = (rrgcl.features(rrgcl.Args(seed=s), records, labels, "cpu") for s in (0, 1))
    for k in ("vns_image", "text"):
        assert torch.equal(a[k], b[k]), k


def test_itas_encoder_is_a_pre_trained_resnet18_from_a_state_dict(tmp_path, iu_xray, monkeypatch):
    """--itas-encoder FILE: ITAS's image features are the torchvision ResNet-18 of the state dict (here random,
    written by the test in a DDP checkpoint's layout), used as it is on R2Gen's two views (mean over them), phi
    staying the small CNN; the run's notes drop the ITAS line; a file that is no ResNet-18 is one error naming the
    flag."""
    import torchvision

    monkeypatch.setattr(rrgcl, "ENCODER", dict(rrgcl.ENCODER, resnet_size=32))  # Sec. 4.1's 256 px: slow here
    monkeypatch.setattr(rrgcl, "ENCODER_CONVERGE", dict(rrgcl.ENCODER_CONVERGE, max_steps=1))
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, tmp_path / "r18.pt")
    records = common.r2gen_views(common.load_annotation(iu_xray))["train"][:5]
    args = rrgcl.Args(itas_encoder=str(tmp_path / "r18.pt"))
    feats = rrgcl.features(args, records, rrgcl.class_labels(records, common.RuleLabeler()), "cpu")
    net.fc, transform = torch.nn.Identity(), common.default_transform(32)
    with torch.no_grad():
        expected = torch.stack(
            [net.eval()(torch.stack([transform(common.load_image(p)) for p in r.image_paths])).mean(0) for r in records]
        )  # (5, 512)
    torch.testing.assert_close(feats["itas_image"], expected, rtol=1e-4, atol=1e-5)
    assert feats["vns_image"].shape == (5, 128)
    notes = rrgcl.measurer_notes(args)
    assert len(notes) == 2 and not any("ITAS" in n for n in notes) and len(rrgcl.measurer_notes(rrgcl.Args())) == 3
    assert rrgcl.measurer_notes(rrgcl.Args(difficulty="dif.json")) == []  # a run that reads the scores measures nothing
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="--itas-encoder .*other.pt: not a torchvision ResNet-18 state dict"):
        rrgcl.features(rrgcl.Args(itas_encoder=str(tmp_path / "other.pt")), records, np.zeros((5, 14)), "cpu")


def test_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir, difficulty_file, monkeypatch):
    monkeypatch.setattr(rrgcl, "LORA", dict(rrgcl.LORA, r=4, alpha=8))
    out = tmp_path / "hf"
    short = ["--epochs", "1", "--steps", "2", "--batch-size", "2"]
    rrgcl.main(qwen_flags(small_synthetic, tiny_qwen_dir, out, *short, "--difficulty", str(difficulty_file)))
    lines = read_jsonl(out / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2] and all(math.isfinite(x["loss"]) for x in lines)
    ck = torch.load(out / "last.pt", weights_only=True)  # LoRA: the adapters only, on the language model
    assert ck["partial"] and ck["model"] and all("lora_" in k for k in ck["model"] if k in dict(ck["model"]))
    assert (out / "final" / "config.json").is_file()


def test_after_the_schedule_training_goes_on_until_validation_stops_improving(
    tmp_path, small_synthetic, difficulty_file, monkeypatch, crash_after_checkpoint
):
    """--converge yes (the sandbox's rule for every table's model): validation every `every` steps from the start;
    after t = T every study until `patience` validations bring no gain, stopping no earlier than the schedule's end;
    the best validated weights are the ones tested. The rule's state travels in the checkpoint: stopped after step 4
    and resumed, the run stops where, and keeps what, the run never stopped does."""
    monkeypatch.setattr(rrgcl, "CONVERGE", dict(every=2, patience=2, min_gain=10.0, max_steps=40))  # never a gain
    monkeypatch.setattr(rrgcl, "N_VAL", 4)
    kept = {}
    real_update = common.Convergence.update

    def update(self, score, step, model):
        shown = real_update(self, score, step, model)
        kept[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return shown

    monkeypatch.setattr(common.Convergence, "update", update)
    flags = ["--data", str(small_synthetic), "--epochs", "2", "--batch-size", "8", "--steps", "3"]
    flags += ["--difficulty", str(difficulty_file)]
    converging = [*flags, "--converge", "yes"]
    out = tmp_path / "run"
    rrgcl.main([*converging, "--out", str(out)])
    rows = read_jsonl(out / "metrics.jsonl")
    validated = [x["step"] for x in rows if "validation" in x]
    # the schedule's 3 steps; the rule: best at step 2 (the first), 2 validations without a gain: steps 4 and 6
    assert validated == [2, 4, 6] and rows[-1]["step"] == 6
    epochs = [x["epoch"] for x in rows if "epoch" in x]  # --steps 3 over t = 0..2 by subset size, then T + 1
    assert epochs[-1] == 3 and epochs == sorted(epochs) and set(epochs) < {0, 1, 2, 3}
    assert next(x for x in rows if x.get("epoch") == 3)["subset"] == 40
    results = json.loads((out / "eval.json").read_text())
    assert results["steps"] == 6 and results["converge"]["best_step"] == 2
    tested = common.load_policy(out / "final").model.state_dict()
    assert all(torch.equal(tested[k], kept[2][k]) for k in tested)  # the best validation's weights, not the last
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 4)
    crash_after_checkpoint(4)  # after the first validation past the schedule: best step 2, one validation waited
    stopped = tmp_path / "stopped"
    with pytest.raises(Crash):
        rrgcl.main([*converging, "--out", str(stopped)])
    crash_after_checkpoint(None)
    rrgcl.main([*converging, "--out", str(stopped), "--resume"])
    resumed = json.loads((stopped / "eval.json").read_text())
    assert (resumed["steps"], resumed["converge"]) == (results["steps"], results["converge"])
    again = common.load_policy(stopped / "final").model.state_dict()
    assert all(torch.equal(again[k], tested[k]) for k in tested)
    plain = tmp_path / "plain"
    rrgcl.main([*flags, "--out", str(plain)])  # random start: --converge auto = no
    assert read_jsonl(plain / "metrics.jsonl")[-1]["step"] == 3 and "converge" not in json.loads(
        (plain / "eval.json").read_text()
    )
