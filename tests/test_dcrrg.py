"""DCRRG: Eq. 3-5 soft targets and the Eq. 6-9 loss by hand, Step 1 targets / re-sampling / importance
weights, observation descriptions from sentences, the decoder (causal, prefixed, batch-independent)
and beam search, retrieval P@K, AUROC; then the steps end to end on the synthetic set: what one Step 2 step
feeds Eq. 3-9 (wiring), P-Tuning leaves every frozen weight bit-identical, exact resume, torchrun against
one process, Table 4's plan."""

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from transformers import BertTokenizerFast

import common
import dcrrg
from conftest import Crash, assert_applied, metrics_rows
from dcrrg import (
    assign_sentences,
    csm_loss,
    draw_pairs,
    observation_targets,
    pair_weights,
    precision_at_k,
    retrieval_set,
    soft_targets,
    split_sentences,
)

N = np.nan
L = common.LABEL_INDEX


def onehots(*names_per_row):
    """Label rows (14,) with 1 for each named observation, NaN elsewhere."""
    out = np.full((len(names_per_row), 14), np.nan)
    for i, names in enumerate(names_per_row):
        for n in names:
            out[i, L[n]] = 1.0
    return torch.tensor(out, dtype=torch.float32)


def label_vectors(labels):
    """Eq. 3's l: 1 for positive and uncertain, 0 otherwise."""
    return ((labels == 1) | (labels == -1)).float()


# Eq. 3-5 ---------------------------------------------------------------------------------------
def test_soft_targets_by_hand():
    # labels: {Cardiomegaly}, {Cardiomegaly, Edema}, {Edema}: Eq. 3 cosines 1, 1/sqrt2, 0
    l = label_vectors(onehots(["Cardiomegaly"], ["Cardiomegaly", "Edema"], ["Edema"]))
    # candidates' uni-modal embeddings: 0 and 1 identical (w = 1), 2 orthogonal to both (w = 0.5)
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    y = soft_targets(l, l, x)
    r2 = 1 / math.sqrt(2)
    # Eq. 4: y_ij = exp(w_ij s_ij) / sum_j exp(w_ij s_ij)
    row0 = np.exp([1 * 1, 1 * r2, 0.5 * 0])
    row1 = np.exp([1 * r2, 1 * 1, 0.5 * r2])
    row2 = np.exp([0.5 * 0, 0.5 * r2, 1 * 1])
    expected = np.stack([row0 / row0.sum(), row1 / row1.sum(), row2 / row2.sum()])
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(y.sum(1).numpy(), 1.0, rtol=1e-6)  # each row a distribution over j
    assert y[0, 0] == pytest.approx(math.e / (math.e + math.exp(r2) + 1), rel=1e-6)  # 0.47304...
    # calibration: make text 1 opposite to text 0 (cos -1 -> w = 0): y_01 falls to exp(0), y_00 rises
    y_far = soft_targets(l, l, torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 3.0]]))
    assert y_far[0, 1] < y[0, 1] and y_far[0, 0] > y[0, 0]
    assert y_far[0, 1] == pytest.approx(1 / (math.e + 1 + 1), rel=1e-6)  # exp(0 * s) = exp(0 * 0) = 1
    # uncalibrated (all w = 1, identical embeddings): plain softmax of s, as MedCLIP's SM loss
    y_sm = soft_targets(l, l, torch.ones(3, 2))
    s = torch.tensor([[1, r2, 0], [r2, 1, r2], [0, r2, 1]])
    torch.testing.assert_close(y_sm, torch.softmax(s, 1))


def test_soft_targets_eq5_uses_the_other_modality_and_no_gradient():
    l_img = label_vectors(onehots(["Edema"], ["Cardiomegaly"]))
    l_txt = label_vectors(onehots(["Edema", "Cardiomegaly"], ["Cardiomegaly"]))
    v = torch.randn(2, 5, requires_grad=True)
    y_tv = soft_targets(l_txt, l_img, v)  # text j over images i, calibrated by image similarity
    assert not y_tv.requires_grad
    w01 = (torch.nn.functional.cosine_similarity(v[0], v[1], dim=0) / 2 + 0.5).item()
    s = [[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.0, 1.0]]  # cos(l_txt_j, l_img_i)
    row0 = np.exp([1 * s[0][0], w01 * s[0][1]])
    np.testing.assert_allclose(y_tv[0].numpy(), row0 / row0.sum(), rtol=1e-5)


def test_csm_loss_by_hand_and_symmetric_as_eq9():
    # two pairs with disjoint labels, orthogonal embeddings, tau = 0.5
    l = label_vectors(onehots(["Edema"], ["Cardiomegaly"]))
    e = torch.eye(2)
    scale = torch.tensor(math.log(1 / 0.5))
    loss, stats = csm_loss(e, e, e, e, l, l, scale)
    y = torch.softmax(torch.tensor([1.0, 0.0]), 0)  # w = 1 on the diagonal, s = 0 off it
    logp = torch.log_softmax(torch.tensor([2.0, 0.0]), 0)  # cos / tau
    assert loss.item() == pytest.approx(-(y * logp).sum().item(), rel=1e-6)
    assert stats["tau"] == pytest.approx(0.5)
    # Eq. 9 is symmetric: exchanging the modalities (projections, embeddings, labels) changes nothing
    torch.manual_seed(0)
    v_p, t_p, v, t = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 5), torch.randn(6, 7)
    l_img = label_vectors(torch.tensor(np.random.default_rng(0).choice([1.0, 0.0, -1.0, np.nan], (6, 14))))
    l_txt = label_vectors(torch.tensor(np.random.default_rng(1).choice([1.0, 0.0, -1.0, np.nan], (6, 14))))
    scale = torch.tensor(math.log(1 / 0.07))
    a, _ = csm_loss(v_p, t_p, v, t, l_img, l_txt, scale)
    b, _ = csm_loss(t_p, v_p, t, v, l_txt, l_img, scale)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    # ... while each direction alone is not: swapping only the calibration embeddings changes the loss
    c, _ = csm_loss(v_p, t_p, t[:, :5], v, l_img, l_txt, scale)
    assert c.item() != pytest.approx(a.item(), rel=1e-4)
    # gradients reach both projections and the temperature
    v_p.requires_grad_(True)
    scale.requires_grad_(True)
    csm_loss(v_p, t_p, v, t, l_img, l_txt, scale)[0].backward()
    assert v_p.grad.abs().sum() > 0 and scale.grad is not None


def _np_softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _np_cos(a, b):
    """Row cosines; an all-zero row (a label vector with nothing positive) gives 0, as F.normalize does."""
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return a @ b.T


def test_csm_loss_calibrates_each_direction_by_the_candidates_modality():
    """Eq. 3-9 in numpy (float64) where images and texts disagree: Eq. 4 (image anchors over text candidates) is
    calibrated by text-text similarity, Eq. 5 (text anchors over image candidates) by image-image similarity. Images 0
    and 1 look alike while their texts are opposite; labels differ between the modalities."""
    v = np.array([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.0, 0.2, 1.0]])  # images 0 and 1 alike
    t = np.array([[1.0, 0.0], [-1.0, 0.1], [0.3, 1.0]])  # texts 0 and 1 opposite
    l_img = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    l_txt = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    rng = np.random.default_rng(0)
    v_p, t_p, tau = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), 0.1
    logits = _np_cos(v_p, t_p) / tau  # Eq. 6-7
    y_vt = _np_softmax((_np_cos(t, t) / 2 + 0.5) * _np_cos(l_img, l_txt))  # Eq. 4: anchor image i, candidate text j
    y_tv = _np_softmax((_np_cos(v, v) / 2 + 0.5) * _np_cos(l_txt, l_img))  # Eq. 5: anchor text i, candidate image j
    l_vt = -(y_vt * np.log(_np_softmax(logits))).sum(1).mean()  # Eq. 8
    l_tv = -(y_tv * np.log(_np_softmax(logits.T))).sum(1).mean()

    def T(x):
        return torch.tensor(x, dtype=torch.float64)

    loss, _ = csm_loss(T(v_p), T(t_p), T(v), T(t), T(l_img), T(l_txt), T(math.log(1 / tau)))
    assert loss.item() == pytest.approx((l_vt + l_tv) / 2, rel=1e-5)  # Eq. 9 (in float32: a few ulp per exp and log)
    swapped = (
        -(_np_softmax((_np_cos(v, v) / 2 + 0.5) * _np_cos(l_img, l_txt)) * np.log(_np_softmax(logits))).sum(1).mean()
    )
    assert abs(swapped - l_vt) > 1e-3  # the test can fail: the anchor's own modality gives another loss


def test_step2_label_vectors_hold_positive_and_uncertain(tmp_path, monkeypatch):
    """Eq. 3's l from a batch's labels: 1 for positive and uncertain, 0 for negative and blank, in both modalities."""
    tok = dcrrg.build_tokenizer(dcrrg.Args(), ["no pleural effusion.", "mild cardiomegaly."], Rank0(tmp_path))
    torch.manual_seed(0)
    model = dcrrg.DCRRG(dcrrg.Args(), tok).eval()
    labels = torch.full((3, 14), float("nan"))
    labels[0, :4] = torch.tensor([1.0, -1.0, 0.0, float("nan")])
    labels[1, 13], labels[2, 5] = 1.0, -1.0
    seen, real = [], dcrrg.csm_loss

    def spy(*a):
        seen.append(a)
        return real(*a)

    monkeypatch.setattr(dcrrg, "csm_loss", spy)
    dcrrg.step2_loss(
        model,
        {"images": torch.randn(3, 1, 1, 64, 64), "report": ["mild cardiomegaly."] * 3, "labels": labels},
        world_size=1,
    )
    expected = torch.zeros(3, 14)
    expected[0, :2], expected[1, 13], expected[2, 5] = 1.0, 1.0, 1.0
    assert len(seen) == 14 and all(torch.equal(a[4], expected) and torch.equal(a[5], expected) for a in seen)


# Step 1 ----------------------------------------------------------------------------------------
def test_observation_targets_unmentioned_negative_uncertain_out():
    t = observation_targets(np.array([[1.0, 0.0, -1.0, N] + [N] * 10]))
    np.testing.assert_array_equal(t[0, :4], [1.0, 0.0, N, 0.0])


def test_draw_pairs_balances_each_observation():
    rng = np.random.default_rng(0)
    targets = np.zeros((1000, 14))
    targets[:10, 3] = 1  # a rare positive
    targets[:50, 5] = np.nan  # uncertain
    targets[:, 7] = np.nan  # an observation never labelled
    rows, obs = draw_pairs(targets, 20000, rng)
    assert not np.isnan(targets[rows, obs]).any() and 7 not in obs
    assert abs((obs == 3).mean() - 1 / 13) < 0.01  # observations uniform among the 13 labelled
    assert abs(targets[rows[obs == 3], 3].mean() - 0.5) < 0.03  # the rare one drawn 50/50
    assert set(rows[(obs == 3) & (targets[rows, 3] == 1)]) <= set(range(10))
    assert targets[rows[obs == 4], 4].sum() == 0  # one class only: always that class


def test_pair_weights_equal_resampling_in_expectation():
    # obs 0: one positive, two negatives, one uncertain; obs 1: negatives only. N = 4, K' = 2.
    targets = np.full((4, 14), np.nan)
    targets[:, 0] = [1, 0, 0, N]
    targets[:, 1] = 0
    w = pair_weights(targets, balance=True)
    # N * share / (K' * n_kc): positive 4 * .5 / (2 * 1) = 1, negative 4 * .5 / (2 * 2) = .5,
    # a single-class observation gets all its mass: 4 * 1 / (2 * 4) = .5
    np.testing.assert_allclose(w[:, :2], [[1, 0.5], [0.5, 0.5], [0.5, 0.5], [0, 0.5]])
    assert (w[:, 2:] == 0).all()
    ce = np.random.default_rng(0).random((4, 14))
    # draw_pairs: observation 1/2; class 1/2; a sample of the class (obs 1 falls back to negatives)
    resampled = 0.5 * (0.5 * ce[0, 0] + 0.5 * ce[1:3, 0].mean()) + 0.5 * ce[:, 1].mean()
    assert (w * ce).sum() / 4 == pytest.approx(resampled)  # E over uniform rows of sum(w * CE)
    plain = pair_weights(targets, balance=False)
    assert plain.sum() == pytest.approx(4)  # weights 1 / mean labelled count: the mean over pairs


# Sec. 3.3 ---------------------------------------------------------------------------------------
def test_split_sentences():
    assert split_sentences("Tube 1.5 cm above the carina. No effusion!\nStable.  ") == [
        "Tube 1.5 cm above the carina.",
        "No effusion!",
        "Stable.",
    ]
    assert split_sentences("") == []
    # MIMIC-style headers and lists: headers and markers go, fragments without a letter are dropped
    report = (
        "FINDINGS: Heart size is normal. ___\nIMPRESSION:\n1. Small left effusion. 2. No pneumothorax.\n"
        "- Lines unchanged.\nImpression: Stable."
    )
    assert split_sentences(report) == [
        "Heart size is normal.",
        "Small left effusion.",
        "No pneumothorax.",
        "Lines unchanged.",
        "Stable.",
    ]
    assert split_sentences("1. 2. ___ .") == []


def test_assign_sentences_by_hand():
    sentences = ["A", "B", "C", "D"]
    labels = np.full((4, 14), np.nan)
    labels[0, L["Cardiomegaly"]] = 0
    labels[1, [L["Pleural Effusion"], L["No Finding"]]] = [1, N]
    labels[2, [L["Pneumothorax"], L["Consolidation"]]] = [0, -1]
    labels[3, L["No Finding"]] = 1  # names none of the 13 findings
    # a normal study (No Finding 1): D describes No Finding
    out = assign_sentences(sentences, labels, no_finding=True)
    assert out == {
        L["Cardiomegaly"]: "A",
        L["Pleural Effusion"]: "B",
        L["Pneumothorax"]: "C",
        L["Consolidation"]: "C",
        L["No Finding"]: "D",
    }
    # an abnormal study: D describes no observation and is dropped; an all-NaN sentence too
    labels_nan = np.vstack([labels, np.full(14, np.nan)])
    out = assign_sentences(sentences + ["E"], labels_nan, no_finding=False)
    assert out == {L["Cardiomegaly"]: "A", L["Pleural Effusion"]: "B", L["Pneumothorax"]: "C", L["Consolidation"]: "C"}
    assert assign_sentences(["E"], labels_nan[4:], no_finding=True) == {L["No Finding"]: "E"}
    two = assign_sentences(["A", "B"], np.stack([labels[2], labels[2]]), False)  # report order kept
    assert two[L["Pneumothorax"]] == "A B"


def test_description_records_with_the_rule_labeler():
    report = (
        "Heart size is normal. There is a small left pleural effusion. "
        "No pneumothorax or focal consolidation. No acute cardiopulmonary process."
    )
    normal = "FINDINGS: Heart size is normal. IMPRESSION: 1. No acute cardiopulmonary process."

    def nf(v):  # only No Finding matters here
        return np.array([N] * 13 + [v])

    records = [common.Record("a", [], report, "train", nf(N)), common.Record("b", [], normal, "train", nf(1.0))]
    got = {(r.id, r.meta["obs"]): r.report for r in dcrrg.description_records(records, common.RuleLabeler())}
    # the effusion makes study a abnormal: its last sentence describes nothing and is dropped
    assert got == {
        ("a#1", L["Cardiomegaly"]): "Heart size is normal.",
        ("a#9", L["Pleural Effusion"]): "There is a small left pleural effusion.",
        ("a#8", L["Pneumothorax"]): "No pneumothorax or focal consolidation.",
        ("a#5", L["Consolidation"]): "No pneumothorax or focal consolidation.",
        ("b#1", L["Cardiomegaly"]): "Heart size is normal.",
        ("b#13", L["No Finding"]): "No acute cardiopulmonary process.",
    }


# Decoder and beam search --------------------------------------------------------------------------
@pytest.fixture
def decoder():
    torch.manual_seed(0)
    dec = dcrrg.Decoder(vocab=30, d=16, heads=4, dropout=0.0).eval()
    dec.memory_mean.normal_()  # fitted-looking fixed statistics
    return dec


def test_decoder_causal_prefixed_and_batch_independent(decoder):
    prefix = torch.randn(2, 2, 2, 3, 16)
    tokens, f_I, obs = torch.randint(0, 30, (2, 7)), torch.randn(2, 14, 16), torch.tensor([3, 9])
    with torch.no_grad():
        full = decoder(tokens, f_I, prefix, obs=obs)  # (2, 7, 30)
        changed = tokens.clone()
        changed[:, 5:] = 0
        torch.testing.assert_close(decoder(changed, f_I, prefix, obs=obs)[:, :5], full[:, :5])  # no peeking ahead
        steps = [decoder(tokens[:, : t + 1], f_I, prefix, obs=obs)[:, -1] for t in range(7)]  # as beam search reads it
        torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(decoder(tokens, f_I, prefix, obs=obs.flip(0)), full)  # the prompt matters
        assert not torch.allclose(decoder(tokens, f_I, None, obs=obs), full)  # so does the prefix
        # a row's output does not depend on the other rows of its batch, in training mode too (no BatchNorm):
        # Step 3's image + text batches and Step 4's image batches see one normalisation
        decoder.train()
        alone = decoder(tokens[:1], f_I[:1], prefix, obs=obs[:1])
        mixed = decoder(
            torch.cat([tokens[:1], tokens]), torch.cat([f_I[:1], f_I * 5 + 3]), prefix, obs=torch.cat([obs[:1], obs])
        )
        torch.testing.assert_close(mixed[:1], alone)
        # the fixed standardisation: (f_I - mean) / std per slot and feature
        decoder.eval()
        plain = copy.deepcopy(decoder)
        plain.memory_mean.zero_()
        decoder.memory_std.uniform_(0.5, 2.0)
        torch.testing.assert_close(
            decoder(tokens, f_I, prefix, obs=obs),
            plain(tokens, (f_I - decoder.memory_mean) / decoder.memory_std, prefix, obs=obs),
        )


def _reference_decoder(dec, tokens, f_I, prefix, obs):
    """Eq. 10-13 with P-Tuning v2 written out (float64): post-LN layers; in every layer i, prefix[i][0] holds the keys
    and values put before the self-attention's, prefix[i][1] the cross-attention's, visible to every position; the
    self-attention is causal over the tokens."""

    def linear(m, x):
        return x @ m.weight.T + m.bias

    def attention(m, x, source, causal, pre):
        B, T, d = x.shape
        H = m.heads

        def heads(z):
            return z.reshape(B, -1, H, d // H).transpose(1, 2)

        q = heads(linear(m.q, x))
        k = heads(torch.cat([pre[0].expand(B, -1, -1), linear(m.k, source)], 1))
        v = heads(torch.cat([pre[1].expand(B, -1, -1), linear(m.v, source)], 1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // H)  # (B, H, T, L_p + S)
        if causal:  # token i sees the prefix and tokens j <= i
            L_p = pre.shape[1]
            blocked = torch.arange(T)[None, :] > torch.arange(T)[:, None]  # (T, T) j > i
            scores[..., L_p:] = scores[..., L_p:].masked_fill(blocked, -math.inf)
        return linear(m.o, (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, d))

    def ln(m, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], m.weight, m.bias, m.eps)

    y = dec.embed.weight[tokens].clone()
    y[:, 0] += dec.prompts.weight[obs]  # Step 3's observation prompt on the first input
    memory = (f_I - dec.memory_mean) / dec.memory_std + dec.slots
    for layer, pre in zip(dec.layers, prefix):
        y = ln(layer.ln1, y + attention(layer.self_attn, y, y, True, pre[0]))  # Eq. 12
        y = ln(layer.ln2, y + attention(layer.cross_attn, y, memory, False, pre[1]))  # Eq. 11
        ffn = linear(layer.ffn[3], torch.relu(linear(layer.ffn[0], y)))
        y = ln(layer.ln3, y + ffn)  # Eq. 10
    return linear(dec.head, y)


def test_decoder_with_prefixes_equals_the_equations(decoder):
    """Each layer reads its own prefixes, self-attention's and cross-attention's apart, keys and values apart; every
    token sees the whole prefix. Float64, so the bound is float64 rounding."""
    dec = decoder.double()
    torch.manual_seed(1)
    prefix = torch.randn(2, 2, 2, 3, 16, dtype=torch.float64)  # (layer, self/cross, key/value, L_p, d)
    tokens, f_I, obs = torch.randint(0, 30, (2, 6)), torch.randn(2, 14, 16, dtype=torch.float64), torch.tensor([3, 9])
    with torch.no_grad():
        got, expected = dec(tokens, f_I, prefix, obs=obs), _reference_decoder(dec, tokens, f_I, prefix, obs)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        for part in ((1, 0, 0), (1, 1, 1), (0, 0, 1)):  # layer 1's own prefixes, and each part, matter
            changed = prefix.clone()
            changed[part] += 1.0
            assert not torch.allclose(dec(tokens, f_I, changed, obs=obs), got)


def test_beam_of_one_is_greedy(decoder):
    f_I = torch.randn(3, 14, 16)
    got = dcrrg.beam_search(decoder, f_I, bos=1, eos=2, pad=0, beam=1, max_len=6)
    tokens = torch.ones(3, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, decoder(tokens, f_I)[:, -1].argmax(-1, keepdim=True)], 1)
    for row, seq in zip(tokens[:, 1:].tolist(), got):
        assert seq == (row[: row.index(2)] if 2 in row else row)


class Markov:
    """A stand-in decoder whose next-token probabilities depend on the last token only (table P).
    Tokens: 0 pad, 1 bos, 2 eos, 3 a, 4 b."""

    P = torch.tensor(
        [
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0, 0, 0.1, 0.5, 0.4],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0, 0, 0.3, 0.36, 0.34],
            [0, 0, 0.95, 0.025, 0.025],
        ]
    ).clamp_min(1e-9)

    def __call__(self, tokens, f_I, prefix=None, head=None, obs=None):
        return self.P[tokens].log()  # (N, T, V)


def test_beam_search_by_hand():
    f_I = torch.zeros(1, 14, 4)
    # greedy: a (.5), then a (.36), then a: "a a a", log-prob per token log(.0648) / 3 = -0.91
    assert dcrrg.beam_search(Markov(), f_I, bos=1, eos=2, pad=0, beam=1, max_len=3) == [[3, 3, 3]]
    # width 3 keeps "b" (.4), which ends at once (.95): log(.38) / 2 = -0.48 beats "a b eos"
    # (log(.5 * .34 * .95) / 3 = -0.61) and "a a a" (-0.91)
    assert dcrrg.beam_search(Markov(), f_I, bos=1, eos=2, pad=0, beam=3, max_len=3) == [[4]]


def test_beam_answer_is_the_best_log_prob_per_token():
    """Width 2, 3 steps. From BOS: a .7, b .3; after b: EOS 1; after a: a .6, EOS .4. Beams: {a, b}, then {a a (.42),
    b EOS (.3)}, then {b EOS (.3), a a a (.252)}. Per token, a a a (log .252 / 3 = -0.46) beats b EOS (log .3 / 2 =
    -0.60), though its summed log-prob is lower."""

    class Short(Markov):
        P = torch.tensor(
            [
                [0.2, 0.2, 0.2, 0.2, 0.2],
                [0, 0, 0, 0.7, 0.3],
                [0.2, 0.2, 0.2, 0.2, 0.2],
                [0, 0, 0.4, 0.6, 0],
                [0, 0, 1, 0, 0],
            ]
        ).clamp_min(1e-12)

    assert dcrrg.beam_search(Short(), torch.zeros(1, 14, 4), bos=1, eos=2, pad=0, beam=2, max_len=3) == [[3, 3, 3]]


def test_beam_search_never_emits_special_tokens():
    class Specials(Markov):  # pad (0) and bos (1) are the likeliest next tokens everywhere
        P = torch.tensor([[0.4, 0.3, 0.05, 0.15, 0.1]] * 5)

    f_I = torch.zeros(2, 14, 4)
    unmasked = dcrrg.beam_search(Specials(), f_I, bos=1, eos=2, pad=0, beam=3, max_len=4)
    assert any(t in (0, 1) for row in unmasked for t in row)  # the test can fail
    for beam in (1, 3):
        got = dcrrg.beam_search(Specials(), f_I, bos=1, eos=2, pad=0, beam=beam, max_len=4, banned=[0, 1])
        assert all(t in (3, 4) for row in got for t in row) and got[0]  # eos (2) may end, never in the text


# Retrieval ---------------------------------------------------------------------------------------
def test_precision_at_k_by_hand():
    sim = torch.tensor(
        [
            [0.9, 0.1, 0.8, 0.2],  # query of class 0: ranks 0, 2, 3, 1 -> hits 1, 0, 0, 1
            [0.9, 0.4, 0.3, 0.2],  # query of class 1: ranks 0, 1, 2, 3 -> hits 0, 0, 1, 1
        ]
    )
    p = precision_at_k(sim, [0, 1], [0, 0, 1, 1], ks=(1, 2, 3, 4))
    assert p == pytest.approx({"P@1": (1 + 0) / 2, "P@2": (0.5 + 0) / 2, "P@3": (1 / 3 + 1 / 3) / 2, "P@4": 0.5})
    tie = precision_at_k(torch.zeros(1, 4), [1], [0, 0, 1, 1], ks=(1, 2))  # ties: lower index first
    assert tie == {"P@1": 0.0, "P@2": 0.0}
    # K above the candidate count: flagged, not a wrong P@K
    assert precision_at_k(sim, [0, 1], [0, 0, 1, 1], ks=(1, 5)) == {"P@1": 0.5}


def test_retrieval_set_one_class_each_and_balanced():
    rows = [
        ["Atelectasis"],
        ["Atelectasis", "Edema"],
        ["Cardiomegaly", "Support Devices"],
        ["Edema"],
        ["Consolidation"],
        ["Pleural Effusion"],
        ["Atelectasis"],
        ["Edema"],
        ["Cardiomegaly"],
    ]
    labels = onehots(*rows).numpy()
    idx, cls = retrieval_set(labels, per_class=5)
    assert list(idx) == [0, 2, 4, 3, 5] and list(cls) == [0, 1, 2, 3, 4]  # N = 1: Consolidation has one
    # Consolidation and Pleural Effusion have no study alone: left out, N = 1 of the three others (rows 0, 2, 3)
    idx, cls = retrieval_set(labels[:4], 5)
    assert list(idx) == [0, 2, 3] and list(cls) == [0, 1, 3]
    assert len(retrieval_set(labels[[1, 2]], 5)[0]) == 1  # Cardiomegaly alone: one class left


def test_auroc_five_competition_tasks_and_mean():
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 2, (40, 14)).astype(float)
    targets[:, L["Fracture"]] = 0  # one class: skipped
    targets[:5, L["Edema"]] = np.nan  # left out
    scores = rng.random((40, 14))
    scores[:, L["Cardiomegaly"]] = targets[:, L["Cardiomegaly"]]  # perfect: AUROC 1
    got = dcrrg.auroc_per_observation(scores, targets)
    assert "Fracture" not in got and got["Cardiomegaly"] == 1.0
    # by hand: AUROC = share of (positive, negative) pairs ranked right (ties 1/2)
    e = L["Edema"]
    pos, neg = scores[5:, e][targets[5:, e] == 1], scores[5:, e][targets[5:, e] == 0]
    assert got["Edema"] == pytest.approx(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))
    names = [n for n in common.CHEXPERT_LABELS if n != "Fracture"]
    assert got["mean"] == pytest.approx(np.mean([got[n] for n in names]))
    assert got["mean_5"] == pytest.approx(np.mean([got[n] for n in dcrrg.FIVE]))


def test_lm_loss_is_the_mean_over_real_tokens(tmp_path):
    """Eq. 14 by hand with a stand-in decoder whose next-token logits are a fixed table of the last token: the mean of
    -log p(y_t | y_{t-1}) over each text's tokens and its [SEP], never over padding."""
    tok = dcrrg.build_tokenizer(dcrrg.Args(), ["alpha beta gamma"], Rank0(tmp_path))
    table = torch.randn(len(tok), len(tok), generator=torch.Generator().manual_seed(0))

    def decoder(tokens, f_I, prefix=None, head=None, obs=None):  # (N, T, V)
        return table[tokens]

    def ids(t):
        return [tok.cls_token_id] + tok(t, add_special_tokens=False)["input_ids"] + [tok.sep_token_id]

    loss = dcrrg.lm_loss(decoder, torch.zeros(2, 14, 4), ["alpha", "alpha beta gamma"], tok, 16)
    nll = [
        -torch.log_softmax(table[a], 0)[b] for t in ("alpha", "alpha beta gamma") for a, b in zip(ids(t), ids(t)[1:])
    ]
    assert len(nll) == 6 and loss.item() == pytest.approx(torch.stack(nll).mean().item(), rel=1e-6)


def test_p_tuning_trains_only_prefixes_and_head_and_keeps_batchnorm(tmp_path):
    """A ResNet (BatchNorm) under P-Tuning: a training forward must not move its frozen statistics."""
    tok = dcrrg.build_tokenizer(dcrrg.Args(), ["No pleural effusion.", "Mild cardiomegaly."], Rank0(tmp_path))
    model = dcrrg.DCRRG(dcrrg.Args(), tok)
    model.image_encoder, model.f_v = common.resnet_encoder(18), dcrrg.ProjectionHead(512, 128)
    params = dcrrg.set_trainable(model, ["prefix", "prompt_head"])
    assert {id(p) for p in params} == {id(model.prefix)} | {id(p) for p in model.prompt_head.parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f_I = model.f_v(model.embed_images(torch.randn(2, 1, 3, 64, 64)))
    dcrrg.lm_loss(
        model.decoder,
        f_I,
        ["no pleural effusion.", "mild cardiomegaly."],
        tok,
        12,
        prefix=model.prefix,
        head=model.prompt_head,
    ).backward()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.prefix.grad.abs().sum() > 0 and model.image_encoder.body.conv1.weight.grad is None


def test_generate_gathers_each_ranks_texts_in_record_order(tmp_path, monkeypatch):
    """dcrrg.generate under 2 ranks, each in turn (the gather simulated): a stand-in decoder that says the word its f_I
    names, then [SEP]; the gathered texts come back in the records' order."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    tok = dcrrg.build_tokenizer(dcrrg.Args(), [" ".join(words)], Rank0(tmp_path))
    V = len(tok)

    def says(tokens, f_I, prefix=None, head=None, obs=None):  # log-probs (N, t, V): the word first, then [SEP]
        out = torch.full((*tokens.shape, V), -30.0)
        out[torch.arange(len(tokens)), -1, f_I[:, 0, 0].long() if tokens.shape[1] == 1 else tok.sep_token_id] = 0.0
        return out

    model = type("Model", (), {"tokenizer": tok, "decoder": staticmethod(says)})

    def inputs(rs):
        return {"f_I": torch.tensor([float(tok.convert_tokens_to_ids(w)) for w in rs])[:, None, None].expand(-1, 14, 4)}

    def rank(r):
        return type("Stage", (), {"rank": r, "world_size": 2})

    sent = []

    def gather_on_rank_1(mine):
        sent.append(mine)
        return [mine, mine]

    monkeypatch.setattr(common, "all_gather_objects", gather_on_rank_1)
    dcrrg.generate(model, inputs, words, rank(1), 4)
    assert sent == [["beta", "delta"]]
    monkeypatch.setattr(common, "all_gather_objects", lambda mine: [mine, sent[0]])
    assert dcrrg.generate(model, inputs, words, rank(0), 4) == words


class Rank0:
    def __init__(self, out):
        self.out, self.is_main = out, True

    def write(self, name, text):
        (self.out / name).parent.mkdir(parents=True, exist_ok=True)
        (self.out / name).write_text(text)


# End to end ----------------------------------------------------------------------------------------
FAST = ["--step1-steps", "4", "--step2-steps", "2", "--step3-steps", "3", "--step4-steps", "3"]  # a few steps each
FAST += ["--batch-size", "8", "--decoder-batch-size", "4"]


FAST_CONSTANTS = dict(MAX_REPORT_TOKENS=12, MAX_DESCRIPTION_TOKENS=8, RETRIEVAL_PER_CLASS=2, DROPOUT=0.0)


@pytest.fixture
def fast(monkeypatch):
    """Short texts, no dropout (so a step can be recomputed), checkpoints every 2 steps."""
    for name, value in FAST_CONSTANTS.items():
        monkeypatch.setattr(dcrrg, name, value)
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 2)


def states(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_all_steps_on_iu_xray_after_a_failed_start_and_p_tuning_keeps_frozen_weights(
    tmp_path, iu_xray, small_synthetic, fast, monkeypatch, caplog, applied_updates
):
    """All four steps on IU X-Ray as users have it (R2GenGPT layout: 1-5 views a study, flat Open-i names), in a
    folder where a start on other data failed after making its vocabulary; then other data there is refused. Step 3's
    per-view validation losses recomputed by hand (step3_validation_by_hand). Each step's optimiser applied its
    constant lr (the tiny model's: 1e-3, Step 2 1e-4, P-Tuning v2 5e-3) at every step, and the gradients as the
    backward left them (App. A gives no clipping)."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:  # a start that fails after prepare(): nothing trained

        def no_model(*a):
            raise ValueError("no model today")

        m.setattr(dcrrg, "DCRRG", no_model)
        with pytest.raises(SystemExit, match="no model today"):
            dcrrg.main(["all", "--data", str(small_synthetic), "--out", str(out)] + FAST)
    synthetic_vocab = (out / "tokenizer" / "vocab.txt").read_text()
    envs, models, prepare, init = [], [], dcrrg.prepare, dcrrg.DCRRG.__init__
    monkeypatch.setattr(dcrrg, "prepare", lambda *a: envs.append(prepare(*a)) or envs[-1])
    monkeypatch.setattr(dcrrg.DCRRG, "__init__", lambda self, *a: models.append(self) or init(self, *a))
    results = dcrrg.main(["all", "--data", str(iu_xray), "--out", str(out)] + FAST)
    step3_validation_by_hand(results["step3"], models[-1], out / "step3" / "model.pt", envs[-1])
    assert len(applied_updates) == 4  # the failed start made none
    for seen, lr, steps in zip(applied_updates, (1e-3, 1e-4, 1e-3, 5e-3), (4, 2, 3, 3)):
        assert_applied(seen, [lr] * steps, clip=None)
    vocab = (out / "tokenizer" / "vocab.txt").read_text().split()
    assert vocab != synthetic_vocab.split() and "xxxx" in vocab and "granuloma" in vocab  # made anew from IU X-Ray's
    assert set(results) == {"step1", "step2", "step3", "step4"}
    assert json.loads((out / "eval.json").read_text()) == results
    assert all((out / s / "model.pt").is_file() for s in results)
    assert results["step1"]["balance"] == "reweight" and 0 <= results["step1"]["auroc_image"]["mean_5"] <= 1
    # IU X-Ray's test split has no study positive for Atelectasis, Consolidation or Edema alone (rule labels)
    retrieval = results["step2"]["retrieval"]
    assert retrieval["skipped"] == ["Atelectasis", "Consolidation", "Edema"] and retrieval["n_per_class"] == 1
    assert set(retrieval) >= {"P@1", "P@2"}
    assert "Step 2 retrieval skips Atelectasis, Consolidation, Edema" in caplog.text
    assert "val_loss_text_view" in results["step3"] and (out / "step3" / "descriptions_val.jsonl").is_file()
    gens = [json.loads(x) for x in (out / "step4" / "generations_test.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [r["id"] for r in json.loads(iu_xray.read_text())["test"]]
    step4 = results["step4"]
    assert (step4["step4"], step4["clean"], step4["n"]) == ("pt", "iu_xray", 12)
    assert 0 <= step4["ce"]["micro_f1"] <= 1
    assert (step4["headline"], step4["uncertain_as"]) == ("micro_f1", 0) and "BLEU-4" in step4["nlg"]
    assert json.loads((out / "step1" / "config.json").read_text())["clean"] == "iu_xray"
    assert [x["step"] for x in metrics_rows(out / "step2" / "metrics.jsonl")] == [1, 2]
    # P-Tuning changed the prefixes and the fresh head only (buffers included); Step 3 the decoder only
    step2, step3, step4 = (states(out / s / "model.pt") for s in ("step2", "step3", "step4"))
    assert {k for k in step3 if not torch.equal(step3[k], step4[k])} == {
        "prefix",
        "prompt_head.weight",
        "prompt_head.bias",
    }
    assert {k.split(".")[0] for k in step3 if not torch.equal(step3[k], step2[k])} == {"decoder"}
    # the decoder's fixed statistics are those of the training images under the Step 2 model
    assert not torch.equal(step3["decoder.memory_std"], torch.ones_like(step3["decoder.memory_std"]))
    with pytest.raises(SystemExit, match="already holds a run"):  # a fresh run never mixes with an old one
        dcrrg.main(["step1", "--data", str(iu_xray), "--out", str(out)] + FAST)
    with pytest.raises(SystemExit, match="vocab.txt was made from other training reports"):  # nor does another data set
        dcrrg.main(["step2", "--resume", "--data", str(small_synthetic), "--out", str(out)] + FAST)


@torch.no_grad()
def step3_validation_by_hand(results: dict, model, weights, env):
    """Step 3's per-view validation losses (Eq. 14 on the first 64 val studies' descriptions), each recomputed from its
    named view: the image view's f_v(E_img(views)) or the text view's f_t(E_txt(the study's report)), with each
    description's own observation prompt. The two views' losses differ, and so do the losses without the prompts or
    with another row's, so that a view named for the other, or a prompt lost, shows."""
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    val = dcrrg.description_records(env["val"][:64], env["labeler"])
    obs = torch.tensor([r.meta["obs"] for r in val])
    views = {
        "image": model.f_v(model.embed_images(dcrrg.load_images(val, env["transform"]))),
        "text": model.f_t(model.embed_texts([r.meta["study_report"] for r in val])),
    }
    descriptions, tok, n = [r.report for r in val], env["tokenizer"], dcrrg.MAX_DESCRIPTION_TOKENS
    assert len(val) > 1 and len(set(obs.tolist())) > 1
    for name, f_I in views.items():
        expected = dcrrg.lm_loss(model.decoder, f_I, descriptions, tok, n, obs=obs).item()
        assert results[f"val_loss_{name}_view"] == pytest.approx(expected, rel=1e-5), name
        for other in (None, obs.roll(1)):  # no prompt, or the next row's
            assert abs(dcrrg.lm_loss(model.decoder, f_I, descriptions, tok, n, obs=other).item() - expected) > 1e-3
    assert abs(results["val_loss_image_view"] - results["val_loss_text_view"]) > 1e-3


def test_one_step2_step_feeds_eq3_to_9_the_global_batch(tmp_path, small_synthetic, fast, monkeypatch, tmp_path_factory):
    """Wiring: run Step 2 for one step and capture what reaches csm_loss; check it against the batch's studies
    recomputed from the Step 1 weights, label vectors written from the labels, and the logged loss against
    Eq. 3-9 computed here from the captured tensors. Then a step from these weights on other --data is refused."""
    flags = ["--data", str(small_synthetic), "--out", str(tmp_path), "--batch-size", "8"]
    flags += ["--step1-steps", "2", "--step2-steps", "1"]
    dcrrg.main(["step1"] + flags)
    calls, real = [], dcrrg.csm_loss

    def spy(*a):
        calls.append([x.detach().clone() for x in a])
        return real(*a)

    monkeypatch.setattr(dcrrg, "csm_loss", spy)
    dcrrg.main(["step2"] + flags)
    assert len(calls) == 14  # one per prompt
    v_p = torch.stack([c[0] for c in calls], 1)  # (8, 14, P)
    t_p = torch.stack([c[1] for c in calls], 1)
    _, _, v, t, l_img, l_txt, scale = calls[0]
    assert all(torch.equal(c[2], v) and torch.equal(c[3], t) and torch.equal(c[4], l_img) for c in calls)
    # the batch: the scaffold's first shuffled batch of 8 training studies, recomputed with the Step 1 weights
    data = {
        s: [dataclasses.replace(r, labels=common.RuleLabeler()([r.report])[0]) for r in rs]
        for s, rs in common.load_annotation(small_synthetic).items()
    }
    transform = common.default_transform(64, channels=1)
    _, batch = next(common.study_batches(data["train"], 8, 0, 0, 1, 0, transform))
    tok = BertTokenizerFast.from_pretrained(str(tmp_path / "tokenizer"))
    model = dcrrg.DCRRG(dcrrg.Args(), tok)
    model.load_state_dict(states(tmp_path / "step1" / "model.pt"))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(v, model.embed_images(batch["images"]))
        torch.testing.assert_close(t, model.embed_texts(batch["report"]))
        torch.testing.assert_close(v_p, model.f_v(v))
        torch.testing.assert_close(t_p, model.f_t(t))
    # Eq. 3's label vectors: 1 for positive and uncertain
    labels = np.stack([common.RuleLabeler()([r])[0] for r in batch["report"]])
    np.testing.assert_array_equal(l_img.numpy(), ((labels == 1) | (labels == -1)).astype(np.float32))
    assert torch.equal(l_img, l_txt) and scale.exp().item() == pytest.approx(1 / 0.07)  # tau = 0.07 at first

    # Eq. 3-9 by hand (numpy, float64), mean over the 14 prompts -> the logged loss of step 1
    L_ = l_img.double().numpy()
    s = _np_cos(L_, L_)  # Eq. 3
    y_vt = _np_softmax((_np_cos(t.double().numpy(), t.double().numpy()) / 2 + 0.5) * s)  # Eq. 4
    y_tv = _np_softmax((_np_cos(v.double().numpy(), v.double().numpy()) / 2 + 0.5) * s)  # Eq. 5
    losses = []
    for k in range(14):
        logits = _np_cos(v_p[:, k].double().numpy(), t_p[:, k].double().numpy()) / 0.07  # Eq. 6-7
        log_vt, log_tv = np.log(_np_softmax(logits)), np.log(_np_softmax(logits.T))
        losses.append((-(y_vt * log_vt).sum(1).mean() - (y_tv * log_tv).sum(1).mean()) / 2)  # Eq. 8-9
    logged = metrics_rows(tmp_path / "step2" / "metrics.jsonl")[0]
    assert logged["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert logged["tau"] == pytest.approx(0.07)
    other = tmp_path_factory.mktemp("elsewhere") / "synthetic"  # the same files (the same vocabulary), another --data
    other.symlink_to(small_synthetic.parent)
    with pytest.raises(SystemExit, match=r"step2/model.pt was trained on --data .*, not .*elsewhere"):
        dcrrg.main(["step3", "--data", str(other / "annotation.json")] + flags[2:])


def test_resume_matches_an_uninterrupted_run(tmp_path, small_synthetic, fast, crash_after_checkpoint):
    """Step 1 stopped after its step-2 checkpoint and resumed ends as one never stopped; a finished step is
    returned as it is; --resume with another flag of the step is refused. Bit for bit: conftest.crash_after_checkpoint
    says why that holds on any CPU."""
    flags = ["--data", str(small_synthetic), "--batch-size", "4", "--step1-steps", "4", "--step2-steps", "2"]
    full = dcrrg.main(["step1", "--out", str(tmp_path / "full")] + flags)
    crash_after_checkpoint(2)
    with pytest.raises(Crash):
        dcrrg.main(["step1", "--out", str(tmp_path / "part")] + flags)
    crash_after_checkpoint(None)
    with pytest.raises(SystemExit, match="--lr None in the run, 0.01 now"):
        dcrrg.main(["step1", "--out", str(tmp_path / "part"), "--resume", "--lr", "0.01"] + flags)
    part = dcrrg.main(["step1", "--out", str(tmp_path / "part"), "--resume"] + flags)
    a, b = states(tmp_path / "full" / "step1" / "model.pt"), states(tmp_path / "part" / "step1" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a) and part == full
    assert metrics_rows(tmp_path / "full" / "step1" / "metrics.jsonl") == metrics_rows(
        tmp_path / "part" / "step1" / "metrics.jsonl"
    )
    mtime = (tmp_path / "part" / "step1" / "model.pt").stat().st_mtime  # done: not trained again; Step 2 runs
    both = dcrrg.main(
        ["all", "--out", str(tmp_path / "part"), "--resume"] + flags + ["--step3-steps", "0", "--step4-steps", "0"]
    )
    assert (tmp_path / "part" / "step1" / "model.pt").stat().st_mtime == mtime and both["step1"] == full["step1"]


def test_bad_input_is_a_clear_error(tmp_path, small_synthetic):
    with pytest.raises(SystemExit, match="unknown command"):
        dcrrg.main(["step5"])
    with pytest.raises(SystemExit, match="step2.*model.pt not found"):
        dcrrg.main(["step3", "--data", str(small_synthetic), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        dcrrg.main(["step4", "--step4", "lora", "--out", str(tmp_path)])


def test_model_paper_offline_is_one_error_at_once(tmp_path, small_synthetic, monkeypatch):
    """--model paper fetches App. A's ImageNet ResNet-50 (torchvision's weights) before labelling anything; without
    network that is one error naming the flag for random weights, and it leaves nothing in --out."""
    import socket

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # no cached weights: the download is tried

    def no_network(*a, **k):
        raise socket.gaierror(-3, "no network")

    def labeller(*a):
        pytest.fail("labelled the data before fetching the weights")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(common.RuleLabeler, "__call__", labeller)
    out = tmp_path / "run"
    with pytest.raises(
        SystemExit, match=r"--pretrained imagenet: .*ImageNet ResNet-50 .*no network.*--pretrained none"
    ):
        dcrrg.main(["--model", "paper", "--labeler", "rule", "--data", str(small_synthetic), "--out", str(out)])
    assert not out.exists() and not (tmp_path / "torch" / "hub" / "checkpoints" / "resnet50").exists()


def test_paper_size_defaults_notes_and_help(capsys):
    """--model paper: App. A's ImageNet start, EPOCHS passes over each step's examples, a note for each part that is
    not App. A's; --model tiny keeps its budgets; each --stepN-steps help says its own default."""
    tiny, paper = dcrrg.Args(), dcrrg.Args(model="paper")
    assert paper.pretrained == "imagenet" and (paper.lr, paper.batch_size, paper.decoder_batch_size) == (None, 32, 16)
    assert [dcrrg.budget(tiny, f"step{k}", 1000) for k in range(1, 5)] == [300, 200, 600, 400]
    # ceil(1000 / batch) batches an epoch
    assert [dcrrg.budget(paper, f"step{k}", 1000) for k in range(1, 5)] == [10 * 32, 10 * 32, 10 * 63, 10 * 63]
    assert dcrrg.budget(dataclasses.replace(paper, step3_steps=0), "step3", 1000) == 0
    assert dcrrg.paper_notes(tiny) == [] and dcrrg.paper_notes(dataclasses.replace(paper, text_encoder="x")) == []
    resnet, bert = dcrrg.paper_notes(dataclasses.replace(paper, pretrained="none"))
    assert "random ResNet-50" in resnet
    assert "random BERT" in bert and "--text-encoder emilyalsentzer/Bio_ClinicalBERT" in bert
    with pytest.raises(SystemExit):
        dcrrg.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for k in range(1, 5):
        assert (
            f"--step{k}-steps STEP{k}_STEPS Step {k}'s steps; None: {dcrrg.TINY_STEPS[f'step{k}']} with --model tiny, "
            f"{dcrrg.EPOCHS} epochs of" in text
        )


def test_ablation_plan_is_table_4():
    made, plan = set(), {}
    for folder, step, init, mode in dcrrg.ABLATION:
        assert init is None or init in made  # every step starts from one trained before it
        assert (mode is not None) == (step == "step4")
        made.add(folder)
        plan[folder] = (step, init, mode)

    def steps(folder):  # the Steps a model went through, from its Step 4 back
        step, init, _ = plan[folder]
        return (steps(init) if init else []) + [step]

    # Table 4's check marks: Models 1-7 (Steps 1, 2, 3 and the Step 4 mode)
    expected = {
        1: (["step1"], "fft"),
        2: (["step2"], "fft"),
        3: (["step2", "step3"], "pt"),
        4: (["step1", "step3"], "pt"),
        5: (["step1", "step2"], "fft"),
        6: (["step1", "step2", "step3"], "pt"),
        7: (["step1", "step2", "step3"], "fft"),
    }
    rows = {int(name.split()[0]): folder for name, folder in dcrrg.TABLE4.items()}
    assert {m: (steps(f)[:-1], plan[f][2]) for m, f in rows.items()} == expected


@pytest.mark.slow
def test_ablation_command(tmp_path, small_synthetic, fast):
    table = dcrrg.main(["ablation", "--data", str(small_synthetic), "--out", str(tmp_path)] + FAST)
    assert len(table) == 7
    assert json.loads((tmp_path / "ablation" / "ablation.json").read_text()) == json.loads(json.dumps(table))


def test_gather_batch_in_rank_order_with_the_gradient_to_this_ranks_part(monkeypatch):
    """On rank 1 of 3: the global batch is rank 0's, this rank's, rank 2's rows, in order; the loss's gradient reaches
    this rank's rows only, times 3 (every rank computes the same loss; the all-reduce then averages)."""
    others = {0: torch.tensor([[1.0, 2.0]]), 2: torch.tensor([[5.0, 6.0]])}
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)

    def all_gather(parts, x):
        for r, p in enumerate(parts):
            p.copy_(others.get(r, x))

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    out = dcrrg.gather_batch(x, 3)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    (out * torch.tensor([[1.0, 1.0], [2.0, -1.0], [7.0, 7.0]])).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[6.0, -3.0]]))
