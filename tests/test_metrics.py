"""Tests of the metrics section of common.py.

NLG: parity with pycocoevalcap (Bleu, Rouge, Cider, Meteor) and small values worked out
by hand. CE: hand-computed values and scikit-learn. The speed benchmark is marked slow:
    python -m pytest tests/test_metrics.py -m slow -s
"""

import logging
import math
import random
import shutil
import time

import numpy as np
import pytest

import common
from common import CHEXPERT_LABELS, ce_metrics, nlg_metrics

TOL = 1e-9
NLG_KEYS = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr"]

# --- realistic synthetic reports -------------------------------------------------
SENTENCES = [
    "the heart size is normal .",
    "the cardiomediastinal silhouette is within normal limits .",
    "there is no focal consolidation , pleural effusion or pneumothorax .",
    "the lungs are clear without focal consolidation .",
    "no acute osseous abnormalities are identified .",
    "mild cardiomegaly is unchanged compared to the prior study .",
    "there is a small left pleural effusion with adjacent atelectasis .",
    "bibasilar opacities likely reflect atelectasis , infection is not excluded .",
    "the pulmonary vasculature is not engorged .",
    "there is mild pulmonary edema , slightly worse than before .",
    "a right internal jugular catheter terminates in the mid svc .",
    "an endotracheal tube is in standard position above the carina .",
    "degenerative changes of the thoracic spine are noted .",
    "no pneumothorax is seen .",
    "a retrocardiac opacity may represent atelectasis or consolidation .",
    "the aorta is tortuous and calcified .",
    "healed right rib fractures are again seen .",
    "lung volumes are low , causing crowding of the bronchovascular markings .",
    "there is no free air under the diaphragm .",
    "no significant interval change since the prior radiograph .",
    "moderate right pleural effusion has increased in size .",
    "the nasogastric tube courses below the diaphragm , tip not seen .",
    "hilar contours are normal .",
    "there are low lung volumes with mild bibasilar atelectasis .",
]
SWAPS = {
    "left": "right",
    "right": "left",
    "mild": "moderate",
    "moderate": "severe",
    "small": "large",
    "no": "a",
    "normal": "enlarged",
    "is": "was",
}


def make_report(rng: random.Random) -> str:
    return " ".join(rng.sample(SENTENCES, rng.randint(4, 7)))


def perturb(report: str, rng: random.Random) -> str:
    """A plausible generated report: sentences dropped/added, some words swapped."""
    sents = [s.strip() + " ." for s in report.split(" .") if s.strip()]
    sents = [s for s in sents if rng.random() > 0.25] + rng.sample(SENTENCES, rng.randint(0, 2))
    rng.shuffle(sents)
    words = " ".join(sents).split()
    words = [SWAPS.get(w, w) if rng.random() < 0.15 else w for w in words]
    return " ".join(words)


def make_pairs(n: int, seed: int = 0):
    rng = random.Random(seed)
    refs = [make_report(rng) for _ in range(n)]
    return [perturb(r, rng) for r in refs], refs


# Pairs that stress the corners of the reference code
EDGE_HYPS = [
    "the heart is normal",  # identical to its reference
    "normal",  # one token vs a long reference
    "the the the the the",  # repeated words: clipping
    "no effusion no effusion",  # repeated bigram
    "a b c d e",  # longer than its reference: no brevity penalty
    "lungs are clear",  # shorter than its reference
    "",  # empty hypothesis
    "heart size normal .\nlungs clear .",  # newline inside a report
    "pneumothorax",  # one token, identical reference
    "x y",  # no overlap at all
]
EDGE_REFS = [
    "the heart is normal",
    "the heart size is normal and the lungs are clear",
    "the heart is the normal size",
    "no effusion",
    "a b c d",
    "the lungs are clear",
    "no acute findings",
    "heart size normal . lungs\n clear .",
    "pneumothorax",
    "p q r",
]


def parity_set():
    hyps, refs = make_pairs(300, seed=1)
    return hyps + EDGE_HYPS, refs + EDGE_REFS


def as_coco(hyps, refs):
    """pycocoevalcap input: {id: [text]}; texts one line, single-spaced (its ROUGE
    splits on ' ' only and its METEOR breaks on newlines)."""

    def norm(t):
        return " ".join(t.split())

    gts = {i: [norm(r)] for i, r in enumerate(refs)}
    res = {i: [norm(h)] for i, h in enumerate(hyps)}
    return gts, res


def coco_scores(hyps, refs):
    """Corpus and per-sample scores from pycocoevalcap's Bleu(4), Rouge, Cider."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    gts, res = as_coco(hyps, refs)
    corpus, each = {}, {}
    bleu, bleu_each = Bleu(4).compute_score(gts, res, verbose=0)
    for k in range(4):
        corpus[f"BLEU-{k + 1}"], each[f"BLEU-{k + 1}"] = bleu[k], bleu_each[k]
    corpus["ROUGE-L"], each["ROUGE-L"] = Rouge().compute_score(gts, res)
    corpus["CIDEr"], each["CIDEr"] = Cider().compute_score(gts, res)
    return corpus, each


# --- NLG parity ------------------------------------------------------------------
def test_parity_with_pycocoevalcap():
    pytest.importorskip("pycocoevalcap")
    hyps, refs = parity_set()
    ours = nlg_metrics(hyps, refs, meteor=False, per_sample=True)
    corpus, each = coco_scores(hyps, refs)
    for key in NLG_KEYS:
        assert ours[key] == pytest.approx(corpus[key], abs=TOL, rel=0), key
        np.testing.assert_allclose(ours["per_sample"][key], each[key], atol=TOL, rtol=0, err_msg=key)
    assert "METEOR" not in ours and "METEOR" not in ours["per_sample"]


def test_parity_small_corpora():
    # CIDEr's df depends on the whole set; check tiny sets too (N = 2, 3)
    pytest.importorskip("pycocoevalcap")
    hyps, refs = parity_set()
    for lo, hi in [(300, 302), (303, 306), (0, 3)]:
        ours = nlg_metrics(hyps[lo:hi], refs[lo:hi], meteor=False, per_sample=True)
        corpus, each = coco_scores(hyps[lo:hi], refs[lo:hi])
        for key in NLG_KEYS:
            assert ours[key] == pytest.approx(corpus[key], abs=TOL, rel=0), (lo, key)
            np.testing.assert_allclose(ours["per_sample"][key], each[key], atol=TOL, rtol=0)


@pytest.mark.skipif(shutil.which("java") is None, reason="METEOR needs java")
def test_meteor_equals_pycocoevalcap(monkeypatch):
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.meteor.meteor import Meteor

    monkeypatch.setenv("RRG_METEOR", "1")
    hyps, refs = parity_set()
    hyps, refs = hyps[:60] + hyps[-10:], refs[:60] + refs[-10:]
    # The jar on its own: a scorer (and JVM) of its own, called the documented pycocoevalcap way; started first, so
    # that its JVM loads its tables while ours does
    reference = Meteor()
    ours = nlg_metrics(hyps, refs, meteor=True, per_sample=True)
    score, scores = reference.compute_score(*as_coco(hyps, refs))
    assert ours["METEOR"] == pytest.approx(score, abs=TOL)
    np.testing.assert_allclose(ours["per_sample"]["METEOR"], scores, atol=TOL)
    assert 0 < ours["METEOR"] < 1


# --- NLG values worked out by hand ---------------------------------------------
def test_bleu_by_hand():
    # Pair 1: "the heart is normal" vs "the heart is normal size"
    #   1-grams 4/4, 2-grams 3/3, 3-grams 2/2, 4-grams 1/1
    # Pair 2: "no effusion" vs "no pleural effusion"
    #   1-grams 2/2, 2-grams 0/1 ("no effusion" is not in the reference), no 3/4-grams
    # Corpus: p1 = 6/6, p2 = 3/4, p3 = 2/2, p4 = 1/1; c = 6, r = 8, BP = exp(1 - 8/6)
    out = nlg_metrics(
        ["the heart is normal", "no effusion"], ["the heart is normal size", "no pleural effusion"], meteor=False
    )
    bp = math.exp(1 - 8 / 6)
    expected = [1.0 * bp, (0.75) ** (1 / 2) * bp, (0.75) ** (1 / 3) * bp, (0.75) ** (1 / 4) * bp]
    for k in range(4):
        assert out[f"BLEU-{k + 1}"] == pytest.approx(expected[k], rel=1e-8)


def test_rouge_l_by_hand():
    # LCS("no acute cardiopulmonary process", "no acute process seen here") = 3
    # P = 3/4, R = 3/5, F = (1 + 1.2^2) P R / (R + 1.2^2 P) = 1.098 / 1.68
    out = nlg_metrics(["no acute cardiopulmonary process"], ["no acute process seen here"], meteor=False)
    assert out["ROUGE-L"] == pytest.approx(1.098 / 1.68, rel=1e-12)


def test_lcs_matches_dynamic_programming():
    import common

    def lcs_dp(a, b):
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]

    rng = random.Random(3)
    for _ in range(300):
        # lengths cross the 64-bit word boundary; a small vocabulary forces many matches
        a = [rng.choice("abcde") for _ in range(rng.randint(0, 90))]
        b = [rng.choice("abcdef") for _ in range(rng.randint(0, 90))]
        assert common._lcs_length(a, b) == lcs_dp(a, b)


def test_cider_by_hand():
    # Two pairs, hypothesis == reference, disjoint vocabularies, >= 4 tokens: every
    # n-gram has df = 1, idf = log 2 for all, cosine 1 per order, no length penalty
    # -> CIDEr = 10 * mean(1, 1, 1, 1) = 10 for each pair
    texts = ["the heart is normal", "small left pleural effusion seen"]
    out = nlg_metrics(texts, texts, meteor=False, per_sample=True)
    assert out["per_sample"]["CIDEr"] == pytest.approx([10.0, 10.0], rel=1e-12)
    # A single pair: log(N) = 0, so every idf is 0 and CIDEr is 0 even for a perfect match
    assert nlg_metrics(texts[:1], texts[:1], meteor=False)["CIDEr"] == 0.0


def test_identical_and_empty():
    hyps = ["the heart is normal in size .", "", "lungs are clear ."]
    refs = ["the heart is normal in size .", "no pleural effusion .", ""]
    out = nlg_metrics(hyps, refs, meteor=False, per_sample=True)
    ps = out["per_sample"]
    assert ps["BLEU-4"][0] == pytest.approx(1.0, abs=1e-6)
    assert ps["ROUGE-L"][0] == pytest.approx(1.0)
    for key in NLG_KEYS:
        assert ps[key][1] == 0.0, key  # empty hypothesis: 0, not NaN
        assert all(math.isfinite(v) for v in ps[key]), key
    # Both empty: 0 everywhere (pycocoevalcap's ROUGE-L would say 1.0, see the code)
    out = nlg_metrics(["", "a b"], ["", "a b"], meteor=False, per_sample=True)
    assert [out["per_sample"][k][0] for k in NLG_KEYS] == [0.0] * len(NLG_KEYS)


def test_per_sample_only_on_request_and_types():
    out = nlg_metrics(["a b c"], ["a b c"], meteor=False)
    assert set(out) == set(NLG_KEYS)
    assert all(type(v) is float for v in out.values())
    out = nlg_metrics(["a b c"], ["a b c"], meteor=False, per_sample=True)
    assert set(out["per_sample"]) == set(NLG_KEYS) and out["per_sample"]["BLEU-1"] == [pytest.approx(1.0)]


def test_nlg_errors():
    with pytest.raises(ValueError, match=r"need as many references as hypotheses, at least one: got 3 and 2"):
        nlg_metrics(["a", "b", "c"], ["a", "b"], meteor=False)
    with pytest.raises(ValueError, match="at least one"):
        nlg_metrics([], [], meteor=False)


def test_meteor_unavailable(monkeypatch, caplog):
    monkeypatch.setenv("RRG_METEOR", "1")
    monkeypatch.setattr(common.shutil, "which", lambda name: None)  # no java on PATH
    with caplog.at_level(logging.WARNING):
        out = nlg_metrics(["a b"], ["a b"], meteor=True, per_sample=True)
    assert "METEOR" not in out and "METEOR" not in out["per_sample"]
    assert sum("METEOR skipped" in r.getMessage() and "java" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert "METEOR" not in nlg_metrics(["a b"], ["a b"], meteor=False)
    assert not caplog.records


# --- CE metrics ------------------------------------------------------------------
def labels(rows: list[dict]) -> np.ndarray:
    """(N, 14) array, NaN (not mentioned) unless given."""
    out = np.full((len(rows), len(CHEXPERT_LABELS)), np.nan)
    for i, row in enumerate(rows):
        for name, v in row.items():
            out[i, CHEXPERT_LABELS.index(name)] = v
    return out


REF = labels([{"Cardiomegaly": 1, "Edema": 1}, {"No Finding": 1}, {"Pleural Effusion": -1, "Atelectasis": 1}])
HYP = labels(
    [{"Cardiomegaly": 1, "Edema": 0}, {"No Finding": 1, "Cardiomegaly": np.nan}, {"Pleural Effusion": 1, "Edema": 1}]
)


def test_ce_by_hand_uncertain_positive():
    # Positives (uncertain -> positive):
    #   ref: r0 {Card, Edema}, r1 {NF}, r2 {PE, Atel};  hyp: r0 {Card}, r1 {NF}, r2 {PE, Edema}
    #   TP = 3 (Card r0, NF r1, PE r2), FP = 1 (Edema r2), FN = 2 (Edema r0, Atel r2)
    out = ce_metrics(HYP, REF, uncertain_as=1)
    assert out["micro_precision"] == pytest.approx(3 / 4)
    assert out["micro_recall"] == pytest.approx(3 / 5)
    assert out["micro_f1"] == pytest.approx(6 / 9)
    # per label: Card, NF, PE perfect; Edema (tp 0, fp 1, fn 1) and Atel (fn 1) zero
    assert out["macro_precision"] == pytest.approx(3 / 14)
    assert out["macro_recall"] == pytest.approx(3 / 14)
    assert out["macro_f1"] == pytest.approx(3 / 14)
    # per report: r0 P 1, R 1/2, F 2/3; r1 1, 1, 1; r2 P 1/2, R 1/2, F 1/2
    assert out["example_precision"] == pytest.approx(5 / 6)
    assert out["example_recall"] == pytest.approx(2 / 3)
    assert out["example_f1"] == pytest.approx(13 / 18)
    # 5 labels: TP 2 (Card, PE), FP 1 (Edema r2), FN 2 (Edema r0, Atel r2)
    assert out["5label_micro_precision"] == pytest.approx(2 / 3)
    assert out["5label_micro_recall"] == pytest.approx(1 / 2)
    assert out["5label_micro_f1"] == pytest.approx(4 / 7)
    assert out["per_label"]["Edema"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert out["per_label"]["Cardiomegaly"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 1}
    assert out["per_label"]["Fracture"]["support"] == 0


def test_ce_by_hand_uncertain_negative():
    # The reference's uncertain PE becomes negative, so the hypothesis' PE is an FP:
    # TP 2, FP 2, FN 2
    out = ce_metrics(HYP, REF, uncertain_as=0)
    assert (out["micro_precision"], out["micro_recall"], out["micro_f1"]) == pytest.approx((0.5, 0.5, 0.5))
    assert out["per_label"]["Pleural Effusion"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    # Uncertain in the hypothesis follows the same rule
    hyp = labels([{"Edema": -1}])
    ref = labels([{"Edema": 1}])
    assert ce_metrics(hyp, ref, uncertain_as=1)["micro_f1"] == 1.0
    assert ce_metrics(hyp, ref, uncertain_as=0)["micro_f1"] == 0.0


def test_ce_matches_sklearn():
    from sklearn.metrics import precision_recall_fscore_support as prfs

    rng = np.random.default_rng(0)
    values = np.array([1.0, 0.0, -1.0, np.nan])
    hyp = rng.choice(values, size=(300, 14), p=[0.15, 0.3, 0.05, 0.5])
    ref = rng.choice(values, size=(300, 14), p=[0.15, 0.3, 0.05, 0.5])
    hyp[:10], ref[5:15] = np.nan, 0.0  # reports with no positive on one or both sides
    for u in (0, 1):
        out = ce_metrics(hyp, ref, uncertain_as=u)
        y_pred = (hyp == 1) | ((hyp == -1) & (u == 1))
        y_true = (ref == 1) | ((ref == -1) & (u == 1))
        for avg in ("micro", "macro", "samples"):
            p, r, f, _ = prfs(y_true, y_pred, average=avg, zero_division=0)
            name = "example" if avg == "samples" else avg
            assert (out[f"{name}_precision"], out[f"{name}_recall"], out[f"{name}_f1"]) == pytest.approx(
                (p, r, f), abs=1e-12
            ), (u, avg)
        p, r, f, s = prfs(y_true, y_pred, average=None, zero_division=0)
        for i, name in enumerate(CHEXPERT_LABELS):
            got = out["per_label"][name]
            assert (got["precision"], got["recall"], got["f1"]) == pytest.approx((p[i], r[i], f[i]))
            assert got["support"] == s[i]
        cols = [
            CHEXPERT_LABELS.index(n)
            for n in ["Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion"]
        ]
        p, r, f, _ = prfs(y_true[:, cols], y_pred[:, cols], average="micro", zero_division=0)
        assert out["5label_micro_f1"] == pytest.approx(f, abs=1e-12)
        assert out["5label_micro_precision"] == pytest.approx(p, abs=1e-12)


# --- speed -----------------------------------------------------------------------
@pytest.mark.slow
def test_benchmark_vs_pycocoevalcap():
    pytest.importorskip("pycocoevalcap")
    hyps, refs = make_pairs(4000, seed=5)
    words = np.mean([len(t.split()) for t in hyps + refs])
    start = time.perf_counter()
    ours = nlg_metrics(hyps, refs, meteor=False)
    t_ours = time.perf_counter() - start
    start = time.perf_counter()
    corpus, _ = coco_scores(hyps, refs)
    t_coco = time.perf_counter() - start
    print(
        f"\n4000 pairs, {words:.1f} words per report on average: ours {t_ours:.2f} s, "
        f"pycocoevalcap Bleu(4)+Rouge()+Cider() {t_coco:.2f} s, speed-up {t_coco / t_ours:.1f}x"
    )
    for key in NLG_KEYS:
        assert ours[key] == pytest.approx(corpus[key], abs=TOL, rel=0), key
    # 3.3x on a quiet 2-core machine; a shared machine moves both timings, so only a generous bound
    assert t_coco / t_ours > 1.0
