"""RRGCL: Eq. 10-13 and Algorithm 1 worked out by hand, the Table 2 schedulers' shapes, VNS-Gap in row
blocks against the naive N x N formula, MINE on Gaussians with a known mutual information, and
end-to-end runs (resume, compare-mode resume, Q1 command, cache keys, difficulty reuse, torchrun against one
process, the Hugging Face path).
    python -m pytest -q tests/test_rrgcl.py -m slow -s      # VNS-Gap benchmarks: 20,000 x 512 on CPU, 270,000 on a GPU"""
import json
import math
import dataclasses
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import common
import rrgcl
from rrgcl import (class_difficulty, class_members, dv_bound, pacing, rrgcl_lambda, rrgcl_subset, sample_difficulty,
                   scheduling_exponents, vns_gap)

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
    np.testing.assert_allclose(sample_difficulty(dif1, dif2, 0.6, 0.4, -1), 0.6 * z1 - 0.4 * z2)  # [-1.2247, 0.4899, 0.7348]
    np.testing.assert_allclose(sample_difficulty(dif1, dif2, 0.6, 0.4, +1), [-0.2449, -0.4899, 0.7348], atol=1e-4)
    np.testing.assert_allclose(sample_difficulty(dif1, None, 0.6, 0.4), 0.6 * z1)  # Table 2 (a): VNS-Gap alone
    np.testing.assert_allclose(sample_difficulty(None, dif2, 0.6, 0.4), -0.4 * z2)  # (b): ITAS alone


# Classes, class difficulty, Eq. 11-13 ----------------------------------------------------------------
def test_classes_are_13_keywords_multilabel_and_unlabelled_studies():
    assert len(rrgcl.CLASSES) == 13 and "Support Devices" not in rrgcl.CLASSES and "No Finding" in rrgcl.CLASSES
    labels = label_rows({"Edema": 1, "Cardiomegaly": 1},  # 0: two classes
                        {"Edema": 1, "Pneumonia": -1},  # 1: uncertain does not count
                        {"Support Devices": 1, "No Finding": 1},  # 2: devices only -> No Finding (CheXpert rule)
                        {"Atelectasis": -1, "Edema": 0},  # 3: only uncertain -> no keyword
                        {"No Finding": 1})  # 4
    names, members, outside = class_members(labels, "class")
    assert names == ["Cardiomegaly", "Edema", "No Finding", "Other"]  # empty classes dropped, CLASSES order
    assert [m.tolist() for m in members] == [[0], [0, 1], [2, 4], [3]] and len(outside) == 0
    names, members, outside = class_members(labels, "always")
    assert names == ["Cardiomegaly", "Edema", "No Finding"] and outside.tolist() == [3]


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
    lam = lambda t: rrgcl_lambda(t, T, gamma, lambda0)
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
def plan_for(dif, labels, unlabelled="class"):
    plan = rrgcl.curriculum_plan(dif, labels, unlabelled)
    return plan, plan["classes"]


def test_algorithm1_by_hand():
    # class A (Edema): studies 0, 1, 2, 3 with difficulty 0.3, 0.1, 0.4, 0.2 -> easy-to-hard order 1, 3, 0, 2
    # class B (Cardiomegaly): studies 3, 4 (3 is in both classes); study 5 only uncertain -> "Other"
    dif = np.array([0.3, 0.1, 0.4, 0.2, 0.9, 0.8])
    labels = label_rows({"Edema": 1}, {"Edema": 1}, {"Edema": 1}, {"Edema": 1, "Cardiomegaly": 1}, {"Cardiomegaly": 1},
                        {"Lung Opacity": -1})
    plan, names = plan_for(dif, labels)
    assert names == ["Cardiomegaly", "Edema", "Other"]
    assert [o.tolist() for o in plan["class_orders"]] == [[3, 4], [1, 3, 0, 2], [5]]
    # class means: B (0.2 + 0.9) / 2 = 0.55, A 0.25, Other 0.8 -> normalised 0.5455, 0, 1 -> gamma 2.3636, 4, 1
    np.testing.assert_allclose(plan["gamma"], [1 + (1 - 0.3 / 0.55) * 3, 4.0, 1.0])
    # fractions 0.5 / 0.5 / 1: B's easiest 1 (study 3), A's easiest 2 (1, 3), Other's 1: study 3 counted once
    assert rrgcl_subset(plan["class_orders"], [0.5, 0.5, 1.0]).tolist() == [1, 3, 5]
    assert rrgcl_subset(plan["class_orders"], [0.01, 0.01, 0.01]).tolist() == [1, 3, 5]  # ceil: >= 1 per class
    assert rrgcl_subset(plan["class_orders"], [1.0, 0.75, 1.0]).tolist() == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("unlabelled", ["class", "always"])
def test_algorithm1_subsets_grow_and_reach_all_at_T(unlabelled):
    rng = np.random.default_rng(0)
    N, T = 300, 8
    labels = np.where(rng.random((N, 14)) < 0.15, 1.0, np.nan)
    labels[rng.random(N) < 0.1] = np.nan  # some studies in no class
    labels[:5, :] = -1.0  # and some with only uncertain findings
    plan, _ = plan_for(rng.normal(size=N), labels, unlabelled)
    subsets = [rrgcl.epoch_subset("rrgcl", t, T, plan, rrgcl.Args()) for t in range(1, T + 1)]
    for a, b in zip(subsets, subsets[1:]):
        assert set(a) <= set(b) and len(a) < len(b)  # grows monotonically (strictly here)
    assert subsets[-1].tolist() == list(range(N))  # all studies at t = T, none twice
    assert all(len(np.unique(s)) == len(s) for s in subsets)
    if unlabelled == "always":
        assert set(plan["outside"]) <= set(subsets[0])
    for order in plan["class_orders"]:  # every class present from the first epoch, easiest first
        assert order[0] in subsets[0]


# Table 2 schedulers ---------------------------------------------------------------------------------------
def test_ablation_schedulers_shapes():
    T, c0, K = 10, 0.01, 5
    hi = lambda name: [pacing(name, t, T, c0, K)[1] for t in range(1, T + 1)]
    np.testing.assert_allclose(hi("linear"), [0.01 + 0.99 * t / 10 for t in range(1, 11)])
    np.testing.assert_allclose(hi("root")[0], math.sqrt(0.1 * (1 - 1e-4) + 1e-4))  # 0.31623
    np.testing.assert_allclose(hi("geom")[4], 0.1)  # 0.01^(1 - 5/10)
    assert hi("baby_step") == [0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8, 0.8, 1.0, 1.0]  # staircase, one bucket per 2 epochs
    for name in ("linear", "root", "geom", "baby_step"):
        h = hi(name)
        assert h[-1] == pytest.approx(1.0) and all(a <= b for a, b in zip(h, h[1:]))
        assert all(pacing(name, t, T)[0] == 0 for t in range(1, T + 1))  # always from the easiest
    assert hi("root")[0] > hi("linear")[0] > hi("geom")[0]  # root fastest early, geometric slowest
    one = [pacing("one_pass", t, T, c0, K) for t in range(1, T + 1)]
    assert one == [((s - 1) / 5, s / 5) for s in (1, 1, 2, 2, 3, 3, 4, 4, 5, 5)]  # each bucket alone, in order
    assert pacing("none", 1, T) == (0.0, 1.0)


def test_global_subsets_follow_the_easy_to_hard_order():
    N, T = 100, 10
    dif = np.random.default_rng(1).normal(size=N)
    plan = {"order": np.argsort(dif)}
    args = rrgcl.Args(c0=0.01, buckets=5)
    sub = lambda name, t: rrgcl.epoch_subset(name, t, T, plan, args)
    easiest = lambda k: set(np.argsort(dif)[:k])
    assert set(sub("root", 1)) == easiest(32)  # ceil(0.31623 * 100)
    assert set(sub("geom", 5)) == easiest(10) and len(sub("linear", 10)) == N
    buckets = [set(sub("one_pass", t)) for t in (1, 3, 5, 7, 9)]
    assert all(len(b) == 20 for b in buckets) and set().union(*buckets) == set(range(N))  # disjoint, covering
    assert len(sub("none", 1)) == N


def test_epoch_batches_deterministic_and_from_the_subset():
    subset = np.array([3, 5, 7, 11, 13])
    b = rrgcl.epoch_batches(subset, steps=3, batch_size=4, world_size=2, seed=0, epoch=2)
    assert b.shape == (3, 2, 4) and set(b.ravel()) == set(subset)  # repeated as the steps need
    np.testing.assert_array_equal(b, rrgcl.epoch_batches(subset, 3, 4, 2, 0, 2))
    assert not np.array_equal(b, rrgcl.epoch_batches(subset, 3, 4, 2, 0, 3))
    counts = np.bincount(b.ravel()[:20])  # the first 4 passes: each study exactly 4 times
    assert sorted(counts[counts > 0].tolist()) == [4] * 5


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
    """Benchmark (README): VNS-Gap on CPU, N = 20,000, 512-dim features.
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
    print(f"\nVNS-Gap N = 270,000 (2048 + 768 dims) on {torch.cuda.get_device_name()}: {wall:.1f} s, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    rows = [0, 4095, 4096, 269_999]
    torch.testing.assert_close(dif1[rows], naive_rows(v, t, rows).cpu(), rtol=1e-5, atol=1e-2)
    assert dif1.shape == (270_000,) and torch.isfinite(dif1).all() and wall < 60


# Eq. 5-9: MINE ------------------------------------------------------------------------------------------
def test_dv_bound_by_hand():
    # E[T_joint] = 1.5; log E[e^T_marg] = log((1 + 3) / 2) = log 2
    assert dv_bound(torch.tensor([1.0, 2.0]), torch.tensor([0.0, math.log(3.0)])).item() == pytest.approx(1.5 - math.log(2))


def mine_estimate(T, image, text, seed=0):
    """The DV bound over a whole held-out set: an honest lower bound on the mutual information."""
    with torch.no_grad():
        j = torch.randperm(len(image), generator=torch.Generator().manual_seed(seed))
        return dv_bound(T(image, text), T(image, text[j])).item()


def gaussian_pairs(n, d, rho, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, rho * x + math.sqrt(1 - rho ** 2) * torch.randn(n, d, generator=g)


@pytest.mark.parametrize("ma_rate", [0.0, 0.01])
def test_mine_approaches_known_mutual_information_from_below(ma_rate):
    d, rho = 2, 0.8
    true_mi = -d / 2 * math.log(1 - rho ** 2)  # 1.0217 nats for 2 dims with correlation 0.8
    x, y = gaussian_pairs(4000, d, rho, 0)
    x_test, y_test = gaussian_pairs(20000, d, rho, 1)  # held out: the DV value is then a lower bound
    estimates = []
    for steps in (15, 200):
        T, history = rrgcl.train_mine(x, y, steps, batch_size=128, lr=1e-3, ma_rate=ma_rate, seed=0)
        estimates.append(mine_estimate(T, x_test, y_test))
    assert estimates[0] < estimates[1] <= true_mi + 0.03  # rises towards the true value, not past it
    assert estimates[1] > 0.85 * true_mi
    dif2 = rrgcl.itas(T, x_test[:100], y_test[:100])  # Eq. 9 on aligned pairs vs shuffled ones
    assert dif2.shape == (100,) and dif2.mean() > rrgcl.itas(T, x_test[:100], y_test[100:200]).mean()


# Q1 analysis ------------------------------------------------------------------------------------------------
def test_q1_per_class_bleu_and_spearman():
    ref = "the heart is enlarged and there is a small left pleural effusion with basilar atelectasis"
    rows = []
    for name, gen in (("Edema", ref), ("Cardiomegaly", "the heart is enlarged and there is a small right pleural "
                                                       "effusion with mild atelectasis"), ("Fracture", "no acute findings seen today")):
        for _ in range(3):
            rows.append({"reference": ref, "generated": gen, "labels": [1.0 if n == name else None for n in common.CHEXPERT_LABELS]})
    classes = [{"name": "Edema", "size": 30, "difficulty": -0.5}, {"name": "Cardiomegaly", "size": 20, "difficulty": 0.1},
               {"name": "Fracture", "size": 10, "difficulty": 0.4}, {"name": "Other", "size": 5, "difficulty": 0.0},
               {"name": "Lung Lesion", "size": 4, "difficulty": 0.0}]  # Other is no keyword; Lung Lesion has no test study
    out = rrgcl.q1_analysis(rows, classes)
    bleu = {c["name"]: c["bleu4"] for c in out["per_class"]}
    assert list(bleu) == ["Edema", "Cardiomegaly", "Fracture"] and bleu["Edema"] == pytest.approx(1.0)
    assert 0.05 < bleu["Cardiomegaly"] < 0.9 and bleu["Fracture"] < 1e-3
    assert out["spearman_bleu4_vs_size"]["rho"] == pytest.approx(1.0)
    assert out["spearman_bleu4_vs_difficulty"]["rho"] == pytest.approx(-1.0)


# Encoders -------------------------------------------------------------------------------------------------
def test_bert_features_mean_pool_a_local_bert(tmp_path):
    from transformers import BertConfig, BertModel, BertTokenizerFast
    words = "no pleural effusion the heart is enlarged mild edema".split()
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + words) + "\n")
    BertTokenizerFast.from_pretrained(str(tmp_path)).save_pretrained(tmp_path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words) + 6, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path)
    reports = ["No pleural effusion.", "The heart is enlarged. Mild edema."]
    feats = rrgcl.bert_features(str(tmp_path), reports, "cpu")
    model = BertModel.from_pretrained(str(tmp_path)).eval()
    tok = BertTokenizerFast.from_pretrained(str(tmp_path))
    with torch.no_grad():
        alone = model(**tok(reports[0], return_tensors="pt")).last_hidden_state.mean(1)[0]
    assert feats.shape == (2, 16)
    torch.testing.assert_close(feats[0], alone, rtol=1e-5, atol=1e-5)  # padding in the batch changes nothing


def test_resnet101_weights_loading(tmp_path):
    import torchvision
    net = torchvision.models.resnet101(weights=None, num_classes=14)  # a CheXpert head: dropped
    path = tmp_path / "r101.pth"
    torch.save({"state_dict": {"module." + k: v for k, v in net.state_dict().items()}}, path)
    enc = rrgcl.resnet101_encoder(str(path))
    with torch.no_grad():
        assert enc(torch.zeros(2, 1, 3, 32, 32)).shape == (2, 2048)
    torch.save({"conv1.weight": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="not a torchvision ResNet-101"):
        rrgcl.resnet101_encoder(str(path))


def test_bad_flags_name_the_flag():
    with pytest.raises(ValueError, match="--scheduler"):
        rrgcl.check_args(rrgcl.Args(scheduler="rrgcl,cosine"))
    with pytest.raises(ValueError, match="--itas-sign"):
        rrgcl.check_args(rrgcl.Args(itas_sign=0))
    with pytest.raises(ValueError, match="--resnet101-weights"):
        rrgcl.check_args(rrgcl.Args(visual_encoder="resnet101"))


def test_the_measurer_reads_findings_and_impression():
    r = common.Record("s1", [], "The heart is enlarged.", "train", meta={"impression": " Cardiomegaly. "})
    assert rrgcl.measure_text(r) == "The heart is enlarged. Cardiomegaly."  # Sec. 4.1: the two sections stitched
    assert rrgcl.measure_text(dataclasses.replace(r, meta={})) == "The heart is enlarged."
    assert rrgcl.measure_text(dataclasses.replace(r, meta={"impression": ""})) == "The heart is enlarged."


@pytest.fixture
def private_data(tmp_path, small_synthetic):
    """A copy of the small synthetic set whose files a test may touch."""
    shutil.copytree(small_synthetic.parent, tmp_path / "data")
    return tmp_path / "data" / "annotation.json"


def test_caches_recompute_when_a_key_changes_and_only_needed_features(tmp_path, private_data, monkeypatch):
    records = common.load_data(str(private_data))["train"]
    labels = rrgcl.record_labels(records, common.RuleLabeler())
    trained = []  # the small encoders trained (a cache hit trains none)
    train_label_encoder = rrgcl.train_label_encoder
    monkeypatch.setattr(rrgcl, "train_label_encoder", lambda model, dataset, x, *a, **kw:
                        trained.append(x) or train_label_encoder(model, dataset, x, *a, **kw))

    def features(**flags):
        trained.clear()
        args = rrgcl.Args(feature_cache=str(tmp_path / "cache"), **{"encoder_epochs": 1, **flags})
        return rrgcl.extract_features(args, records, labels, rrgcl.data_key(args, records), "cpu")
    first = features(measure="vns")
    assert set(first) == {"vns_image", "text"} and trained == ["images", "ids"]
    again = features(measure="vns")
    assert trained == [] and all(torch.equal(first[k], again[k]) for k in first)  # served from the cache
    st = os.stat(records[5].image_paths[0])
    os.utime(records[5].image_paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # an image rewritten
    features(measure="vns")
    assert trained == ["images", "ids"]
    features(measure="vns", encoder_epochs=2)
    assert trained == ["images", "ids"]
    monkeypatch.setattr(rrgcl, "RECIPE", "another recipe")  # the measurer's code changed
    features(measure="vns")
    assert trained == ["images", "ids"]

    # only what --measure needs: ITAS never runs ResNet-101, VNS-Gap with ResNet-101 needs no small CNN
    monkeypatch.setattr(rrgcl, "resnet101_encoder", lambda path: common.ViewMean(
        torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten())))  # (B, 3, 256, 256) -> (B, 12)
    f = features(measure="itas", visual_encoder="resnet101", resnet101_weights=str(tmp_path / "absent.pth"))
    assert set(f) == {"itas_image", "text"} and f["itas_image"].shape[1] == 128
    f = features(measure="vns", visual_encoder="resnet101", resnet101_weights=str(tmp_path / "absent.pth"))
    assert set(f) == {"vns_image", "text"} and f["vns_image"].shape == (40, 12) and "images" not in trained

    # labels: the labeler reads the training reports once per data key (studies + labeler)
    bare = [dataclasses.replace(r, labels=None) for r in records]
    reads = []
    rule = common.RuleLabeler()
    labeler = lambda texts: reads.append(len(texts)) or rule(texts)
    args = rrgcl.Args(feature_cache=str(tmp_path / "cache"), encoder_epochs=1, measure="vns")
    for _ in range(2):
        m = rrgcl.measure_difficulty(args, bare, labeler, rrgcl.data_key(args, bare), "cpu")
    assert reads == [40] and m["dif2"] is None and m["dif1"].shape == (40,)
    np.testing.assert_array_equal(m["labels"], rule([r.report for r in records]))
    args.labeler = "chexbert"  # another labeler: other labels (the fake one here reads as the rule one)
    rrgcl.measure_difficulty(args, bare, labeler, rrgcl.data_key(args, bare), "cpu")
    assert reads == [40, 40]


def test_val_loss_is_the_token_mean_over_all_val_reports(small_synthetic):
    records = common.load_data(str(small_synthetic))["val"][:5]
    common.seed_everything(0)
    policy = common.make_policy("tiny", [r.report for r in records], "cpu")
    got = rrgcl.val_loss(policy, records, rrgcl.Args(batch_size=2), common.Dist())  # chunks of 2, 2, 1
    nll = tokens = 0.0
    with torch.no_grad():
        for r in records:  # one report at a time: its token sum and count
            n = policy.encode_targets([r.report])[1].sum().item()
            images = [[common.load_image(p) for p in r.image_paths]]
            nll += policy.sft_loss(policy.prompt_batch(images, rrgcl.PROMPT), [r.report]).item() * n
            tokens += n
    assert got == pytest.approx(nll / tokens, rel=1e-5)


# End to end -----------------------------------------------------------------------------------------------
SMALL = ["--epochs", "3", "--batch-size", "8", "--encoder-epochs", "1", "--mine-steps", "40", "--n-eval", "4",
         "--max-new-tokens", "16", "--log-every", "1"]


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_end_to_end_resume_and_q1(tmp_path, small_synthetic, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["--data", str(small_synthetic), "--out", str(out), "--feature-cache", str(tmp_path / "cache")] + SMALL
    rrgcl.main(args)
    for name in ("config.json", "metrics.jsonl", "eval.json", "generations_test.jsonl", "difficulty.json",
                 "schedule.json", "q1.json", "last.pt"):
        assert (out / name).is_file(), name
    epochs = [x for x in read_jsonl(out / "metrics.jsonl") if "epoch" in x]
    assert [x["epoch"] for x in epochs] == [1, 2, 3] and [x["step"] for x in epochs] == [5, 10, 15]  # 40 // 8 steps each
    assert epochs[-1]["subset"] == 40 and epochs[0]["subset"] < 40  # the curriculum starts on a part
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] - 0.5 and epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    schedule = json.loads((out / "schedule.json").read_text())
    assert all(c["lambda"][-1] == pytest.approx(1) for c in schedule["classes"])
    assert schedule["subset_sizes"]["rrgcl"][-1] == 40 and schedule["subset_sizes"]["none"] == [40] * 3
    gens = read_jsonl(out / "generations_test.jsonl")
    assert len(gens) == 12 and len(gens[0]["labels"]) == 14
    results = json.loads((out / "eval.json").read_text())
    assert results["steps"] == 15 and "BLEU-4" in results["test"]["nlg"] and "per_class" in results["q1"]

    # the Q1 command on the run folder, and on another model's generations without labels (the labeler
    # reads the references), written beside them: the run's own q1.json stays
    (out / "q1.json").unlink()
    rrgcl.main(["q1", "--run", str(out)])
    assert json.loads((out / "q1.json").read_text()) == results["q1"]
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({k: g[k] for k in ("id", "reference", "generated")}) + "\n" for g in gens))
    (out / "q1.json").write_text("{}")
    rrgcl.main(["q1", "--run", str(out), "--generations", str(bare)])
    assert json.loads((tmp_path / "bare.q1.json").read_text()) == results["q1"]  # rule labels = synthetic ground truth
    assert (out / "q1.json").read_text() == "{}"

    # a stopped run resumed from its checkpoint ends with the weights of the uninterrupted one
    straight = torch.load(out / "last.pt", weights_only=True)["model"]
    save = common.save_checkpoint

    def crash_after_step_7(path, model, optimizer=None, scheduler=None, step=0, **kw):
        save(path, model, optimizer, scheduler, step, **kw)
        if step == 7:
            raise KeyboardInterrupt
    monkeypatch.setattr(common, "save_checkpoint", crash_after_step_7)
    capsys.readouterr()
    out2 = tmp_path / "run2"
    args2 = ["--data", str(small_synthetic), "--out", str(out2), "--feature-cache", str(tmp_path / "cache"),
             "--save-every", "7"] + SMALL
    with pytest.raises(KeyboardInterrupt):
        rrgcl.main(args2)
    assert "cache: small_image from" in capsys.readouterr().out  # extraction skipped: cached
    monkeypatch.setattr(common, "save_checkpoint", save)
    for changed in (["--lr", "0.01"], ["--epochs", "4"], ["--alpha", "0.5"]):  # T is in Eq. 11; alpha in Eq. 10
        with pytest.raises(ValueError, match=changed[0]):
            rrgcl.main(args2 + ["--resume"] + changed)
    rrgcl.main(args2 + ["--resume"])
    assert "difficulty: reusing" in capsys.readouterr().out  # not measured again
    resumed = torch.load(out2 / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [x["step"] for x in read_jsonl(out2 / "metrics.jsonl") if "loss" in x] == list(range(1, 16))

    # another measuring flag: measured again; the same flags after --measure-only: reused
    rrgcl.main(args2 + ["--mine-steps", "41", "--measure-only"])
    assert "measuring again" in capsys.readouterr().out
    rrgcl.main(args2 + ["--mine-steps", "41", "--measure-only"])
    assert "difficulty: reusing" in capsys.readouterr().out


def test_compare_and_ablations_same_budget_and_resume(tmp_path, small_synthetic, capsys):
    out = tmp_path / "cmp"
    args = ["--data", str(small_synthetic), "--out", str(out), "--scheduler", "none,one_pass", "--measure", "vns",
            "--buckets", "3", "--epoch-steps", "2"] + SMALL
    rrgcl.main(args)
    assert "difficulty: reusing" in capsys.readouterr().out  # one_pass reuses what none measured
    table = json.loads((out / "compare.json").read_text())
    assert list(table) == ["none", "one_pass"] and table["none"]["steps"] == table["one_pass"]["steps"] == 6
    subsets = [x["subset"] for x in read_jsonl(out / "one_pass" / "metrics.jsonl") if "epoch" in x]
    assert sum(subsets) == 40 and len(set(subsets)) <= 2  # three disjoint buckets of 13-14
    assert json.loads((out / "one_pass" / "difficulty.json").read_text())["samples"]["dif2"] is None  # VNS-Gap only

    # interrupted in one_pass before its first checkpoint: --resume skips none, restarts one_pass
    none_metrics = (out / "none" / "metrics.jsonl").read_text()
    for name in ("last.pt", "eval.json", "compare.json"):
        (out / ("" if name == "compare.json" else "one_pass") / name).unlink()
    rrgcl.main(args + ["--resume"])
    assert (out / "none" / "metrics.jsonl").read_text() == none_metrics  # not trained again
    assert [x["step"] for x in read_jsonl(out / "one_pass" / "metrics.jsonl") if "loss" in x] == list(range(1, 7))
    assert json.loads((out / "compare.json").read_text()) == table  # the same runs, the same numbers


def test_budget_subset_is_one_pass_over_each_subset(tmp_path, small_synthetic):
    out = tmp_path / "subset"
    rrgcl.main(["--data", str(small_synthetic), "--out", str(out), "--budget", "subset", "--measure", "vns"] + SMALL)
    sizes = json.loads((out / "schedule.json").read_text())["subset_sizes"]["rrgcl"]
    epochs = [x for x in read_jsonl(out / "metrics.jsonl") if "epoch" in x]
    assert [x["subset"] for x in epochs] == sizes and sizes[0] < sizes[-1] == 40
    assert [x["step"] for x in epochs] == np.cumsum([max(1, s // 8) for s in sizes]).tolist()  # fewer steps while the subset is small


# A torchrun entry point that also saves every rank's final weights, so the test can compare them
DUMP_WEIGHTS = """import os, sys, torch
import common, rrgcl
save = common.save_checkpoint
def save_and_dump(path, model, *args, **kwargs):
    save(path, model, *args, **kwargs)
    torch.save(model.state_dict(), os.path.join(os.path.dirname(path), f"weights_rank{os.environ.get('RANK', '0')}.pt"))
common.save_checkpoint = save_and_dump
rrgcl.main(sys.argv[1:])
"""


def test_torchrun_two_processes_equal_one_process_of_the_combined_batch(tmp_path, small_synthetic):
    root = os.path.dirname(common.__file__)
    (tmp_path / "dump.py").write_text(DUMP_WEIGHTS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    flags = ["--data", str(small_synthetic), "--device", "cpu", "--epochs", "2", "--encoder-epochs", "1", "--mine-steps",
             "40", "--n-eval", "1", "--log-every", "1"]  # 1 val study: rank 1's shard is empty; reports of unequal length
    # 2 ranks x 2 micro-batches of 2 studies against 1 process x 8 studies: the same studies every step
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(tmp_path / "dump.py"), "--out", str(tmp_path / "ddp"), "--batch-size", "4",
                           "--grad-accum", "2"] + flags, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rrgcl.main(["--out", str(tmp_path / "one"), "--batch-size", "8"] + flags)
    ddp, one = read_jsonl(tmp_path / "ddp" / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [x["step"] for x in ddp if "loss" in x] == list(range(1, 11))  # 40 // (4 x 2 ranks) per epoch; rank 0 writes
    for key in ("loss", "train_loss", "val_loss"):  # token means over the whole step / all val reports
        np.testing.assert_allclose([x[key] for x in ddp if key in x], [x[key] for x in one if key in x], rtol=1e-5)
    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # the ranks stay in step
    single = torch.load(tmp_path / "one" / "last.pt", weights_only=True)["model"]
    for k in rank0:  # float noise (Adam magnifies it to ~1e-5); averaging per-micro-batch means gives ~1e-2
        torch.testing.assert_close(rank0[k], single[k], rtol=0, atol=1e-4)
    gens = read_jsonl(tmp_path / "ddp" / "generations_test.jsonl")
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]


def test_end_to_end_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir):
    out = tmp_path / "hf"
    rrgcl.main(["--data", str(small_synthetic), "--model", str(tiny_qwen_dir), "--out", str(out), "--epochs", "2",
                "--epoch-steps", "1", "--batch-size", "2", "--encoder-epochs", "1", "--mine-steps", "20", "--n-eval", "2",
                "--max-new-tokens", "8", "--lora-r", "4", "--log-every", "1"])
    lines = [x for x in read_jsonl(out / "metrics.jsonl") if "loss" in x]
    assert [x["step"] for x in lines] == [1, 2] and all(math.isfinite(x["loss"]) for x in lines)
    assert (out / "final" / "config.json").is_file()
    ckpt = torch.load(out / "last.pt", weights_only=True)  # LoRA: the adapters only, not the frozen model
    assert ckpt["trainable_only"] and ckpt["model"] and all("lora" in k for k in ckpt["model"])
