"""DCRRG: Eq. 3-5 soft targets and the Eq. 6-9 loss by hand, Step 1 targets / re-sampling /
importance weights, observation descriptions from sentences (headers, list markers, No Finding),
the decoder (causal, cached, prefixed) and beam search (no special tokens), retrieval P@K, then
the four steps end to end on the synthetic set (prefix tuning leaves every frozen weight
bit-identical), exact resume and what --resume refuses, and a torchrun run that equals one
process with the same global batch."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
import dcrrg
from dcrrg import (assign_sentences, csm_loss, draw_pairs, observation_targets, pair_pools, pair_weights,
                   precision_at_k, retrieval_set, soft_targets, split_sentences)

N = np.nan
L = common.LABEL_INDEX


def onehots(*names_per_row):
    """Label rows (14,) with 1 for each named observation, NaN elsewhere."""
    out = np.full((len(names_per_row), 14), np.nan)
    for i, names in enumerate(names_per_row):
        for n in names:
            out[i, L[n]] = 1.0
    return torch.tensor(out, dtype=torch.float32)


# Eq. 3-5 ---------------------------------------------------------------------------------------
def test_soft_targets_by_hand():
    # labels: {Cardiomegaly}, {Cardiomegaly, Edema}, {Edema}: Eq. 3 cosines 1, 1/sqrt2, 0
    l = dcrrg.label_vectors(onehots(["Cardiomegaly"], ["Cardiomegaly", "Edema"], ["Edema"]))
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
    l_img = dcrrg.label_vectors(onehots(["Edema"], ["Cardiomegaly"]))
    l_txt = dcrrg.label_vectors(onehots(["Edema", "Cardiomegaly"], ["Cardiomegaly"]))
    v = torch.randn(2, 5, requires_grad=True)
    y_tv = soft_targets(l_txt, l_img, v)  # text j over images i, calibrated by image similarity
    assert not y_tv.requires_grad
    w01 = (torch.nn.functional.cosine_similarity(v[0], v[1], dim=0) / 2 + 0.5).item()
    s = [[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.0, 1.0]]  # cos(l_txt_j, l_img_i)
    row0 = np.exp([1 * s[0][0], w01 * s[0][1]])
    np.testing.assert_allclose(y_tv[0].numpy(), row0 / row0.sum(), rtol=1e-5)


def test_csm_loss_by_hand_and_symmetric_as_eq9():
    # two pairs with disjoint labels, orthogonal embeddings, tau = 0.5
    l = dcrrg.label_vectors(onehots(["Edema"], ["Cardiomegaly"]))
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
    l_img = dcrrg.label_vectors(torch.tensor(np.random.default_rng(0).choice([1.0, 0.0, -1.0, np.nan], (6, 14))))
    l_txt = dcrrg.label_vectors(torch.tensor(np.random.default_rng(1).choice([1.0, 0.0, -1.0, np.nan], (6, 14))))
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
    pools = pair_pools(targets)
    assert set(pools[0]) == set(range(14)) - {7} and list(pools[1][3][1]) == list(range(10))
    rows, obs = draw_pairs(pools, 20000, rng)
    assert not np.isnan(targets[rows, obs]).any() and 7 not in obs
    assert abs((obs == 3).mean() - 1 / 13) < 0.01  # observations uniform among the 13 labelled
    assert abs(targets[rows[obs == 3], 3].mean() - 0.5) < 0.03  # the rare one drawn 50/50
    assert targets[rows[obs == 4], 4].sum() == 0  # one class only: always that class


def test_pair_weights_equal_resampling_in_expectation():
    # obs 0: one positive, two negatives, one uncertain; obs 1: negatives only. N = 4, K' = 2.
    targets = np.full((4, 14), np.nan)
    targets[:, 0] = [1, 0, 0, N]
    targets[:, 1] = 0
    w = pair_weights(targets, balance=True)
    # N * share / (K' * n_kc): positive 4 * .5 / (2 * 1) = 1, negative 4 * .5 / (2 * 2) = .5,
    # a single-class observation gets all its mass: 4 * 1 / (2 * 4) = .5
    np.testing.assert_allclose(w[:, :2], [[1, .5], [.5, .5], [.5, .5], [0, .5]])
    assert (w[:, 2:] == 0).all()
    ce = np.random.default_rng(0).random((4, 14))
    # draw_pairs: observation 1/2; class 1/2; a sample of the class (obs 1 falls back to negatives)
    resampled = .5 * (.5 * ce[0, 0] + .5 * ce[1:3, 0].mean()) + .5 * ce[:, 1].mean()
    assert (w * ce).sum() / 4 == pytest.approx(resampled)  # E over uniform rows of sum(w * CE)
    plain = pair_weights(targets, balance=False)
    assert plain.sum() == pytest.approx(4)  # weights 1 / mean labelled count: the mean over pairs


# Sec. 3.3 ---------------------------------------------------------------------------------------
def test_split_sentences():
    assert split_sentences("Tube 1.5 cm above the carina. No effusion!\nStable.  ") == \
        ["Tube 1.5 cm above the carina.", "No effusion!", "Stable."]
    assert split_sentences("") == []
    # MIMIC-style headers and lists: headers and markers go, fragments without a letter are dropped
    report = ("FINDINGS: Heart size is normal. ___\nIMPRESSION:\n1. Small left effusion. 2. No pneumothorax.\n"
              "- Lines unchanged.\nImpression: Stable.")
    assert split_sentences(report) == ["Heart size is normal.", "Small left effusion.", "No pneumothorax.",
                                       "Lines unchanged.", "Stable."]
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
    assert out == {L["Cardiomegaly"]: "A", L["Pleural Effusion"]: "B", L["Pneumothorax"]: "C",
                   L["Consolidation"]: "C", L["No Finding"]: "D"}
    # an abnormal study: D describes no observation and is dropped; an all-NaN sentence too
    labels_nan = np.vstack([labels, np.full(14, np.nan)])
    out = assign_sentences(sentences + ["E"], labels_nan, no_finding=False)
    assert out == {L["Cardiomegaly"]: "A", L["Pleural Effusion"]: "B", L["Pneumothorax"]: "C", L["Consolidation"]: "C"}
    assert assign_sentences(["E"], labels_nan[4:], no_finding=True) == {L["No Finding"]: "E"}
    two = assign_sentences(["A", "B"], np.stack([labels[2], labels[2]]), False)  # report order kept
    assert two[L["Pneumothorax"]] == "A B"


def test_observation_descriptions_with_the_rule_labeler():
    report = ("Heart size is normal. There is a small left pleural effusion. "
              "No pneumothorax or focal consolidation. No acute cardiopulmonary process.")
    normal = "FINDINGS: Heart size is normal. IMPRESSION: 1. No acute cardiopulmonary process."
    desc, desc_normal = dcrrg.observation_descriptions([report, normal], common.RuleLabeler(), [False, True])
    # the effusion makes the study abnormal: the last sentence describes nothing and is dropped
    assert desc == {L["Cardiomegaly"]: "Heart size is normal.",
                    L["Pleural Effusion"]: "There is a small left pleural effusion.",
                    L["Pneumothorax"]: "No pneumothorax or focal consolidation.",
                    L["Consolidation"]: "No pneumothorax or focal consolidation."}
    assert desc_normal == {L["Cardiomegaly"]: "Heart size is normal.",
                           L["No Finding"]: "No acute cardiopulmonary process."}


# Decoder and beam search --------------------------------------------------------------------------
@pytest.fixture
def decoder():
    torch.manual_seed(0)
    dec = dcrrg.Decoder(vocab=30, d=16, heads=4, dropout=0.0, positions="none").eval()
    dec.memory_norm.running_mean.normal_()  # a used-looking frozen normaliser
    return dec


@pytest.mark.parametrize("positions", ["none", "sinusoidal"])
def test_decoder_causal_and_cache_equals_full_forward(positions):
    torch.manual_seed(0)
    dec = dcrrg.Decoder(vocab=30, d=16, heads=4, dropout=0.0, positions=positions).eval()
    prefix = dcrrg.Prefix(2, 3, 16)()
    tokens, f_I, obs = torch.randint(0, 30, (2, 7)), torch.randn(2, 14, 16), torch.tensor([3, 9])
    with torch.no_grad():
        full = dec(tokens, f_I, prefix, obs=obs)  # (2, 7, 30)
        changed = tokens.clone()
        changed[:, 5:] = 0
        torch.testing.assert_close(dec(changed, f_I, prefix, obs=obs)[:, :5], full[:, :5])  # no peeking ahead
        cache = [{} for _ in dec.layers]
        steps = [dec(tokens[:, t:t + 1], f_I, prefix, cache=cache, obs=obs) for t in range(7)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(dec(tokens, f_I, prefix, obs=obs.flip(0)), full)  # the prompt matters
        assert not torch.allclose(dec(tokens, f_I, None, obs=obs), full)  # so does the prefix


def test_beam_of_one_is_greedy(decoder):
    f_I = torch.randn(3, 14, 16)
    got = dcrrg.beam_search(decoder, f_I, bos=1, eos=2, pad=0, beam=1, max_len=6)
    tokens = torch.ones(3, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, decoder(tokens, f_I)[:, -1].argmax(-1, keepdim=True)], 1)
    for row, seq in zip(tokens[:, 1:].tolist(), got):
        assert seq == (row[:row.index(2)] if 2 in row else row)


class Markov:
    """A stand-in decoder whose next-token probabilities depend on the last token only (table P),
    keeping its history in the cache as beam_search expects. Tokens: 0 pad, 1 bos, 2 eos, 3 a, 4 b."""
    layers = [None]
    P = torch.tensor([[.2, .2, .2, .2, .2], [0, 0, .1, .5, .4], [.2, .2, .2, .2, .2],
                      [0, 0, .3, .36, .34], [0, 0, .95, .025, .025]]).clamp_min(1e-9)

    def __call__(self, tokens, f_I, prefix=None, head=None, cache=None, obs=None):
        seen = tokens[:, None, :, None].float()
        cache[0]["k"] = seen if "k" not in cache[0] else torch.cat([cache[0]["k"], seen], 2)
        cache[0]["v"] = cache[0]["k"]
        return self.P[tokens].log()  # (N, T, V)


def test_beam_search_by_hand():
    f_I = torch.zeros(1, 14, 4)
    # greedy: a (.5), then a (.36), then a: "a a a", log-prob per token log(.0648) / 3 = -0.91
    assert dcrrg.beam_search(Markov(), f_I, bos=1, eos=2, pad=0, beam=1, max_len=3) == [[3, 3, 3]]
    # width 3 keeps "b" (.4), which ends at once (.95): log(.38) / 2 = -0.48 beats "a b eos"
    # (log(.5 * .34 * .95) / 3 = -0.61) and "a a a" (-0.91)
    assert dcrrg.beam_search(Markov(), f_I, bos=1, eos=2, pad=0, beam=3, max_len=3) == [[4]]


def test_beam_search_never_emits_special_tokens():
    class Specials(Markov):  # pad (0) and bos (1) are the likeliest next tokens everywhere
        P = torch.tensor([[.4, .3, .05, .15, .1]] * 5)
    f_I = torch.zeros(2, 14, 4)
    unmasked = dcrrg.beam_search(Specials(), f_I, bos=1, eos=2, pad=0, beam=3, max_len=4)
    assert any(t in (0, 1) for row in unmasked for t in row)  # the test can fail
    for beam in (1, 3):
        got = dcrrg.beam_search(Specials(), f_I, bos=1, eos=2, pad=0, beam=beam, max_len=4, banned=[0, 1])
        assert all(t in (3, 4) for row in got for t in row) and got[0]  # eos (2) may end, never in the text


# Retrieval ---------------------------------------------------------------------------------------
def test_precision_at_k_by_hand():
    sim = torch.tensor([[0.9, 0.1, 0.8, 0.2],   # query of class 0: ranks 0, 2, 3, 1 -> hits 1, 0, 0, 1
                        [0.9, 0.4, 0.3, 0.2]])  # query of class 1: ranks 0, 1, 2, 3 -> hits 0, 0, 1, 1
    p = precision_at_k(sim, [0, 1], [0, 0, 1, 1], ks=(1, 2, 3, 4))
    assert p == pytest.approx({"P@1": (1 + 0) / 2, "P@2": (.5 + 0) / 2, "P@3": (1 / 3 + 1 / 3) / 2, "P@4": .5})
    tie = precision_at_k(torch.zeros(1, 4), [1], [0, 0, 1, 1], ks=(1, 2))  # ties: lower index first
    assert tie == {"P@1": 0.0, "P@2": 0.0}
    # K above the candidate count: flagged, not a wrong P@K
    assert precision_at_k(sim, [0, 1], [0, 0, 1, 1], ks=(1, 5)) == {"P@1": 0.5, "skipped": ["P@5"]}


def test_retrieval_set_one_class_each_and_balanced():
    rows = [["Atelectasis"], ["Atelectasis", "Edema"], ["Cardiomegaly", "Support Devices"], ["Edema"],
            ["Consolidation"], ["Pleural Effusion"], ["Atelectasis"], ["Edema"], ["Cardiomegaly"]]
    labels = onehots(*rows).numpy()
    idx, cls = retrieval_set(labels, per_class=5)
    assert list(idx) == [0, 2, 4, 3, 5] and list(cls) == [0, 1, 2, 3, 4]  # N = 1: Consolidation has one
    assert len(retrieval_set(labels[:4], 5)[0]) == 0  # a class missing: empty


def test_frozen_parts_keep_batchnorm_statistics(tmp_path):
    # ResNet-50 (BatchNorm) under P-Tuning: a training forward must not move the frozen statistics
    args = dcrrg.Args(model="tiny", image_encoder="resnet50")

    class Rank0:
        is_main = True
    tok = dcrrg.build_tokenizer(args, ["No pleural effusion.", "Mild cardiomegaly."], tmp_path, Rank0())
    model = dcrrg.DCRRG(args, tok)
    params = dcrrg.set_trainable(model, ["prefix", "prompt_head"])
    assert {id(p) for p in params} == {id(p) for p in list(model.prefix.parameters()) + list(model.prompt_head.parameters())}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f_I = model.f_v(model.embed_images(torch.randn(2, 1, 3, 64, 64)))
    dcrrg.lm_loss(model.decoder, f_I, ["no pleural effusion.", "mild cardiomegaly."], tok, 12,
                  prefix=model.prefix(), head=model.prompt_head).backward()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.prefix.kv.grad.abs().sum() > 0 and model.image_encoder.body.conv1.weight.grad is None


# End to end ----------------------------------------------------------------------------------------
FAST = ["--step1-steps", "4", "--step2-steps", "2", "--step3-steps", "3", "--step4-steps", "3", "--batch-size", "8",
        "--decoder-batch-size", "4", "--probe-steps", "1", "--max-report-tokens", "12", "--max-description-tokens", "8",
        "--log-every", "1", "--ckpt-every", "2", "--no-meteor", "--retrieval-per-class", "2"]


def states(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, small_synthetic):
    out = tmp_path_factory.mktemp("dcrrg") / "run"
    results = dcrrg.train(common.parse_args(dcrrg.Args, ["--data", str(small_synthetic), "--out", str(out)] + FAST))
    return out, results


def test_all_steps_end_to_end(pipeline):
    out, results = pipeline
    assert set(results) == {"step1", "step2", "step3", "step4"}
    for step in results:
        assert (out / step / "model.pt").is_file() and (out / step / "eval.json").is_file()
    assert (out / "tokenizer" / "vocab.txt").is_file() and (out / "eval.json").is_file()
    assert 0 <= results["step1"]["auroc_image"]["mean"] <= 1 and "auroc_text" in results["step1"]
    assert set(results["step2"]["probes"]) == {"dcclip", "initial"}
    assert set(results["step2"]["probes"]["dcclip"]) == {f"{s}_{p}%" for s in ("linear", "finetune") for p in (1, 10, 100)}
    assert "val_loss_image_view" in results["step3"] and (out / "step3" / "descriptions_val.jsonl").is_file()
    gens = [json.loads(x) for x in (out / "step4" / "generations_test.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]
    step4 = results["step4"]
    assert {"nlg", "ce"} <= set(step4) and step4["step4"] == "pt"
    assert 0 < step4["trainable_parameters"]["pt_share_of_fft"] < 1
    lines = [json.loads(x) for x in (out / "step2" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and {"loss", "tau", "kl"} <= set(lines[0])


def test_prefix_tuning_leaves_frozen_weights_bit_identical(pipeline):
    out, _ = pipeline
    before, after = states(out / "step3" / "model.pt"), states(out / "step4" / "model.pt")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"prefix.kv", "prompt_head.weight", "prompt_head.bias"}  # buffers included
    # and Step 3 trained the decoder only
    step2 = states(out / "step2" / "model.pt")
    assert {k.split(".")[0] for k in before if not torch.equal(before[k], step2[k])} == {"decoder"}


def test_resume_skips_finished_steps_and_continues_a_stopped_one(pipeline, small_synthetic):
    out, results = pipeline
    mtime = (out / "step2" / "model.pt").stat().st_mtime
    again = dcrrg.train(common.parse_args(dcrrg.Args, ["--data", str(small_synthetic), "--out", str(out), "--resume"] + FAST))
    assert (out / "step2" / "model.pt").stat().st_mtime == mtime and again["step2"] == results["step2"]
    # Step 1 for 4 steps at once equals 2 steps, then resumed to 4 (same batches, RNG and optimiser)
    base = ["--data", str(small_synthetic), "--no-meteor", "--batch-size", "4", "--ckpt-every", "2"]
    dcrrg.main(["step1", "--out", str(out.parent / "straight"), "--step1-steps", "4"] + base)
    dcrrg.main(["step1", "--out", str(out.parent / "stopped"), "--step1-steps", "2"] + base)
    dcrrg.main(["step1", "--out", str(out.parent / "stopped"), "--step1-steps", "4", "--resume"] + base)
    a, b = states(out.parent / "straight" / "step1" / "model.pt"), states(out.parent / "stopped" / "step1" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (out.parent / "stopped" / "step1" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4]


def test_resume_refuses_other_flags_and_another_init_and_a_fresh_start_clears(tmp_path, small_synthetic, monkeypatch):
    base = ["--data", str(small_synthetic), "--out", str(tmp_path), "--no-meteor", "--batch-size", "4",
            "--step1-steps", "2", "--step2-steps", "1", "--no-probes", "--retrieval-per-class", "1"]
    dcrrg.main(["step1"] + base)
    dcrrg.main(["step2"] + base)
    with pytest.raises(ValueError, match="--lr"):  # not a budget flag: another run
        dcrrg.main(["step1", "--resume", "--lr", "0.01"] + base)
    dcrrg.main(["step2", "--resume"] + base + ["--step2-steps", "2"])  # a longer budget continues
    assert json.loads((tmp_path / "step2" / "eval.json").read_text())["steps"] == 2
    dcrrg.main(["step1"] + base + ["--step1-steps", "3"])  # Step 1 trained again: new weights
    with pytest.raises(ValueError, match="sha256.*without --resume"):
        dcrrg.main(["step2", "--resume"] + base + ["--step2-steps", "2"])
    # a fresh start removes the old results before it trains: a crash leaves nothing to mistake for them

    def crash(*a, **k):
        raise RuntimeError("stopped")
    monkeypatch.setattr(dcrrg, "fit", crash)
    with pytest.raises(RuntimeError, match="stopped"):
        dcrrg.main(["step2"] + base)
    assert not any((tmp_path / "step2" / f).exists() for f in dcrrg.STEP_FILES)


def test_bad_input_is_a_clear_error(tmp_path, small_synthetic):
    with pytest.raises(SystemExit, match="unknown command"):
        dcrrg.main(["step5"])
    with pytest.raises(FileNotFoundError, match="step2.*model.pt"):
        dcrrg.main(["step3", "--data", str(small_synthetic), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--step4"):
        dcrrg.main(["step4", "--step4", "lora", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--init"):
        dcrrg.main(["all", "--init", "scratch", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--dtype fp16"):
        dcrrg.main(["all", "--dtype", "fp16", "--out", str(tmp_path)])


def test_ablation_plan_is_consistent():
    made = set()
    for folder, stage, init, mode in dcrrg.ABLATION:
        assert init is None or init in made  # every row starts from a step trained before it
        assert (mode is not None) == (stage == "step4")
        made.add(folder)
    assert {s4 for _, s4 in dcrrg.ABLATION_ROWS.values()} <= made


@pytest.mark.slow
def test_ablation_command(tmp_path, small_synthetic):
    table = dcrrg.train(common.parse_args(dcrrg.Args, ["--data", str(small_synthetic), "--out", str(tmp_path)] + FAST),
                        "ablation")
    assert set(table) == set(dcrrg.ABLATION_ROWS)
    assert json.loads((tmp_path / "ablation" / "ablation.json").read_text()) == json.loads(json.dumps(table))


def test_torchrun_two_processes_equal_one_process(tmp_path, small_synthetic):
    """Batch sizes are global and Step 2 contrasts the gathered global batch: two ranks of 4 end
    Steps 1-2 with the weights of one process with batch 8; every step's ranks end identical."""
    root = os.path.dirname(common.__file__)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    flags = ["--data", str(small_synthetic), "--device", "cpu", "--text-dropout", "0", "--no-probes"] + FAST
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           os.path.join(root, "dcrrg.py"), "all", "--out", str(tmp_path / "ddp")] + flags,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for step in dcrrg.STAGES:  # every rank's sha256 of its final weights
        digests = json.loads((tmp_path / "ddp" / step / "eval.json").read_text())["weights_sha256_per_rank"]
        assert len(digests) == 2 and digests[0] == digests[1], step
    lines = [json.loads(x) for x in (tmp_path / "ddp" / "step4" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]  # rank 0 alone writes
    gens = [json.loads(x) for x in (tmp_path / "ddp" / "step4" / "generations_test.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shards, in order
    dcrrg.main(["step1", "--out", str(tmp_path / "one")] + flags)
    one, ddp = states(tmp_path / "one" / "step1" / "model.pt"), states(tmp_path / "ddp" / "step1" / "model.pt")
    for k in one:
        torch.testing.assert_close(ddp[k], one[k], atol=2e-5, rtol=1e-4, msg=k)
    # Step 2: Adam's first steps divide by |gradient|, so an element whose gradient is rounding noise
    # may move by its full lr either way: compare the total difference with the total update
    dcrrg.main(["step2", "--out", str(tmp_path / "one")] + flags)
    start, one, ddp = one, states(tmp_path / "one" / "step2" / "model.pt"), states(tmp_path / "ddp" / "step2" / "model.pt")
    floats = [k for k in one if one[k].is_floating_point()]
    diff = sum((ddp[k] - one[k]).abs().sum() for k in floats) / sum((one[k] - start[k]).abs().sum() for k in floats)
    assert diff < 1e-3, float(diff)  # measured 1e-5; 0.47 when each rank contrasts only its own half
