"""DEER: Eq. 3-5 (D(I), log-rank probabilities, the subset draw), Eq. 7-8 TF-IDF weights, Eq. 9-12 (CheXbert
saliency recomputed by hand, character spans, word-piece alignment, gradient weights), Eq. 6 through the loss's
gradient, the Eq. 1 reward and its phases, Tables 6/7, what one DiTPO step feeds the loss, and every stage end to
end: resume (exact, and refusing a changed --steps), label-free sampling, torchrun with two processes, the HF path."""

import json
import math
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
import deer
import test_chexbert
from conftest import (
    Crash,
    Stop,
    assert_applied,
    labels,
    metrics_rows,
    one_step_in_micro_batches,
    qwen_flags,
    record_updates,
    torchrun,
)
from deer import (
    align_to_tokens,
    diagnostic_diversity,
    gamma_at,
    log_rank_probs,
    mask_top_tokens,
    reference_targets,
    report_f1,
    reward_diversity,
    select_subset,
    tfidf_weights,
    token_spans,
)

L = common.LABEL_INDEX
vocab_file = test_chexbert.vocab_file  # its module-scoped fixture, for the tiny CheXbert below


def tiny_policy(texts, max_len=32):
    torch.manual_seed(0)
    return common.make_policy("tiny", texts, "cpu", max_new_tokens=max_len)


def encode(policy, texts):
    tok = policy.tokenizer
    return common.pad_completions([tok.encode(t) + [tok.eos_id] for t in texts], tok.pad_id)


# Eq. 3-5 -----------------------------------------------------------------------------------------
def test_log_rank_probs_hand_values():
    np.testing.assert_allclose(log_rank_probs(1), [1.0])
    # 1/ln 2 = 1.4427, 1/ln 3 = 0.9102: P = (0.6131, 0.3869)
    np.testing.assert_allclose(log_rank_probs(2), [0.6131471928, 0.3868528072])
    # + 1/ln 4 = 0.7213: sum 3.0743
    np.testing.assert_allclose(log_rank_probs(3), [0.4692787260, 0.2960819110, 0.2346393630])
    P = log_rank_probs(1000)
    assert P.sum() == pytest.approx(1.0) and (np.diff(P) < 0).all() and P[-1] > 0


def test_diagnostic_diversity_hand_example():
    K = [
        labels(Edema=1, Cardiomegaly=1, Pneumothorax=0),
        labels(Edema=-1, Pneumothorax=0),  # uncertain = positive
        labels(Edema=0, Pneumothorax=0, No_Finding=1),
        labels(Pneumothorax=0, No_Finding=1),
    ]
    same = [labels(Edema=1)] * 4
    D = diagnostic_diversity(np.concatenate([np.stack(K, 1), np.stack(same, 1)]))  # (2, 4, 14)
    # Edema p = (1, 1, 0, 0): std 0.5; Cardiomegaly (1, 0, 0, 0): sqrt(3/16); No Finding (0, 0, 1, 1): 0.5
    np.testing.assert_allclose(D, [0.5 + math.sqrt(3 / 16) + 0.5, 0.0])


def test_select_subset_ranks_and_draws_without_replacement():
    ids = [f"s{i}" for i in range(10)]
    D = np.array([0.1, 2.0, 0.5, 0.5, 3.0, 0.0, 1.0, 0.2, 0.3, 0.4])
    sel = select_subset(ids, D, 0.2, seed=0)
    assert [x["id"] for x in sel["ranked"][:3]] == ["s4", "s1", "s6"] and sel["ranked"][0]["rank"] == 1
    assert [x["D"] for x in sel["ranked"]] == sorted(D, reverse=True)
    np.testing.assert_allclose([x["P"] for x in sel["ranked"]], log_rank_probs(10))
    assert len(sel["ids"]) == 2 == len(set(sel["ids"])) and sel == select_subset(ids, D, 0.2, seed=0)
    # one draw over 3000 seeds: the study of rank r is chosen with probability P_r
    draws = [select_subset(ids, D, 0.1, seed=s)["ids"][0] for s in range(3000)]
    P = log_rank_probs(10)
    assert draws.count("s4") / 3000 == pytest.approx(P[0], abs=0.03)
    assert draws.count("s5") / 3000 == pytest.approx(P[9], abs=0.02)
    assert len(select_subset(ids, D, 1.0, seed=1)["ids"]) == 10


def test_rl_records_random_draws_fraction_of_pool():
    train = list(range(50))
    args = deer.Args(fraction=0.2)
    drawn = deer.rl_records(args, train, "random", 20)  # the tiny default's pool: the first `pool` studies
    assert len(drawn) == 4 == len(set(drawn)) and all(x < 20 for x in drawn)
    assert len(deer.rl_records(args, train, "random", None)) == 10 and deer.rl_records(args, train, "all", 20) == train


def test_the_stages_take_the_model_defaults(tmp_path, synthetic_is_small, tiny_qwen_dir, small_synthetic, monkeypatch):
    """train() resolves what Args leaves to the model and hands each stage its numbers: (max_new, lr, batch, steps,
    converge) to SFT, (max_new, pool) to DDSampling, (max_new, lr, prompts, steps, pool) to DiTPO. Tiny: SFT until
    CONVERGE stops it (a number of steps: that many), 120 RL steps, the pool the first 1000 studies; HF: every study."""
    seen = {}

    def stage(name):
        def record(run, args, *numbers):
            seen[name] = numbers
            return {}

        return record

    for name in ("sft", "ddsampling", "ditpo"):
        monkeypatch.setattr(deer, name, stage(name))
    deer.main(["all", "--out", str(tmp_path / "tiny")])
    assert seen == {"sft": (96, 1e-3, 32, None, True), "ddsampling": (96, 1000), "ditpo": (96, 1e-4, 8, 120, 1000)}
    deer.main(["sft", "--sft-steps", "50", "--out", str(tmp_path / "tiny_50")])
    assert seen["sft"] == (96, 1e-3, 32, 50, False)
    deer.main(["all", *qwen_flags(small_synthetic, tiny_qwen_dir, tmp_path / "hf")])
    assert seen == {
        "sft": (256, 1e-5, 64, None, False),
        "ddsampling": (256, None),
        "ditpo": (256, 1e-6, 64, None, None),
    }


# Eq. 7-8 -----------------------------------------------------------------------------------------
def test_tfidf_weights_hand_example():
    eos, pad = 2, 0
    docs = [[5, 6, 7, eos], [5, 6, eos], [5, 8, 8]] + [[5, 6, eos]] * 3  # two groups of G = 3; row 2 truncated
    ids, mask = common.pad_completions(docs, pad)
    w = tfidf_weights(ids, mask, 3, alpha=4.0, special={eos})
    # df: 5 -> 3, 6 -> 2, 7 -> 1, 8 -> 1; TF = 1 (present), IDF = ln(3 / df); EOS (df 2 of 3) stays 1
    expected = torch.tensor(
        [
            [1, 1 + 4 * math.log(1.5), 1 + 4 * math.log(3), 1],
            [1, 1 + 4 * math.log(1.5), 1, 1],  # last column is padding
            [1, 1 + 4 * math.log(3), 1 + 4 * math.log(3), 1],
        ]
    )
    torch.testing.assert_close(w[:3], expected.float())
    assert (w[3:] == 1).all()  # a group of identical reports: every token in every report
    assert tfidf_weights(ids, mask, 3, 4.0)[0, 3] == pytest.approx(1 + 4 * math.log(1.5))  # EOS, were it a word


# Eq. 9-12 ----------------------------------------------------------------------------------------
def test_token_spans_of_the_word_tokenizer():
    report = "Plate-like atelectasis at the left base, no effusion."
    policy = tiny_policy([report, "zzqx"])
    ids, mask = encode(policy, [report, "zzqx"])
    texts, spans = token_spans(policy, ids, mask)
    assert texts == policy.decode(ids, mask) == [report.lower(), "zzqx"]
    words = [policy.tokenizer.vocab[i] for i in ids[0][mask[0].bool()].tolist()]
    assert [texts[0][a:b] for a, b in spans[0][:4]] == ["plate", "-", "like", " atelectasis"]  # with its space
    assert [texts[0][a:b].strip() for a, b in spans[0][:-1]] == words[:-1]
    assert "".join(texts[0][a:b] for a, b in spans[0]) == texts[0]  # the spans tile the report
    assert spans[0][-1][0] == spans[0][-1][1] == len(texts[0])  # EOS adds no text
    assert len(spans[1]) == 2


def spans_decoding_the_batch_per_position(policy, ids, mask):
    """token_spans as it was (the reference): the whole batch decoded once per token position."""
    texts, spans = [""] * len(ids), [[] for _ in ids]
    prefix = torch.zeros_like(mask)
    for t in range(ids.shape[1]):
        if not mask[:, t].any():
            break
        prefix[:, t] = mask[:, t]
        for i, text in enumerate(policy.decode(ids, prefix)):
            if mask[i, t]:
                spans[i].append((len(os.path.commonprefix([texts[i], text])), len(text)))
                texts[i] = text
    return texts, spans


@pytest.mark.parametrize("kind", ["tiny", "qwen"])
def test_token_spans_equal_those_of_decoding_the_batch_per_position(kind, tiny_qwen_dir):
    """Each report's prefixes decoded in one call on the CPU give the spans the per-position decoding gave, on the
    word tokenizer and on a byte-level BPE (Qwen's: a word in pieces, a space inside a token), an empty row too."""
    texts = ["Plate-like atelectasis at the left base, no effusion.", "zzqx", "No pneumothorax or effusion."]
    policy = tiny_policy(texts) if kind == "tiny" else common.HFPolicy(str(tiny_qwen_dir))
    ids, mask = policy.encode_targets(texts)
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, torch.zeros_like(mask[:1])])  # a 4th row with no token
    got = token_spans(policy, ids, mask)
    assert got == spans_decoding_the_batch_per_position(policy, ids, mask)
    assert got[1][3] == [] and got[0][0] == (texts[0].lower() if kind == "tiny" else texts[0])  # tiny: lower case


def test_align_to_tokens_max_over_overlaps():
    # "small left effusion."  policy tokens: small | left | effusion | . | EOS ; a BPE-like " left"
    spans = [(0, 5), (6, 10), (11, 19), (19, 20), (20, 20), (5, 10)]
    pieces = [(0, 5), (6, 10), (11, 14), (14, 19), (19, 20)]  # small left eff ##usion .
    scores = [0.1, 0.2, 0.5, 0.7, 0.05]
    np.testing.assert_allclose(align_to_tokens(spans, pieces, scores), [0.1, 0.2, 0.7, 0.05, 0.0, 0.2])
    np.testing.assert_allclose(align_to_tokens([(0, 3)], [], []), [0.0])  # nothing for CheXbert to score


def test_reference_targets_positive_or_uncertain_without_no_finding():
    ref = np.concatenate([labels(Edema=1, Pleural_Effusion=-1, Cardiomegaly=0), labels(No_Finding=1)])
    assert reference_targets(ref) == [["Edema", "Pleural Effusion"], []]


@pytest.fixture(scope="module")
def chexbert(vocab_file):
    """test_chexbert's tiny random CheXbert, in batches of 2."""
    tok = test_chexbert.local_tokenizer(vocab_file)
    torch.manual_seed(0)
    model = common.chexbert_model(test_chexbert.tiny_config(tok.vocab_size))
    return common.CheXbertLabeler(model=model, tokenizer=tok, batch_size=2)


def test_chexbert_saliency_by_hand(chexbert):
    """Eq. 9-11 recomputed by hand: d(sum of the targets' positive + uncertain logits) / d(word embeddings) of
    [CLS] pieces [SEP], its L2 norm per piece; offsets point at the pieces; batching and autocast change nothing."""
    r = ["There is a small  left\npleural effusion.", "", "Zzqx edema.", "No pneumothorax."]
    out = deer.chexbert_saliency(chexbert, r, ["Pleural Effusion", "Edema"])
    for report, s in zip(r, out):
        assert len(s["tokens"]) == len(s["offsets"]) == len(s["saliency"]) and (s["saliency"] >= 0).all()
        assert all(report[a:b].lower() == tok.removeprefix("##") for tok, (a, b) in zip(s["tokens"], s["offsets"]))
    assert out[1]["tokens"] == [] and out[0]["tokens"][:4] == ["there", "is", "a", "small"]
    m = chexbert.model
    for i in (0, 2, 3):
        ids = torch.tensor([chexbert.encode(r[i])])
        emb = m.bert.embeddings.word_embeddings(ids).detach().requires_grad_(True)
        cls = m.bert(inputs_embeds=emb, attention_mask=torch.ones_like(ids))[0][:, 0]
        lg = [h(cls) for h in m.linear_heads]
        e, p = L["Pleural Effusion"], L["Edema"]
        (lg[e][0, 1] + lg[e][0, 3] + lg[p][0, 1] + lg[p][0, 3]).backward()
        np.testing.assert_allclose(out[i]["saliency"], emb.grad[0, 1:-1].norm(dim=-1).numpy(), rtol=1e-4, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = deer.chexbert_saliency(chexbert, r[2:], ["Pleural Effusion", "Edema"])
    np.testing.assert_allclose(again[0]["saliency"], out[2]["saliency"], rtol=1e-4, atol=1e-6)


def test_gradient_weights_from_chexbert_saliency(chexbert):
    texts = ["small left pleural effusion, zzqx edema.", "no pneumothorax."]
    policy = tiny_policy(texts)
    ids, mask = encode(policy, texts)
    targets = [["Edema", "Pleural Effusion"], []]  # the second reference has no positive finding
    decoded, spans = token_spans(policy, ids, mask)
    w = deer.gradient_weights(chexbert, decoded, spans, mask, targets, beta=1.0)
    assert (w[1] == 1).all() and (w[0, mask[0] == 0] == 1).all()
    s = deer.chexbert_saliency(chexbert, [decoded[0]], targets[0])[0]
    pieces = dict(zip(s["tokens"], s["saliency"]))
    words = [policy.tokenizer.vocab[i] for i in ids[0][mask[0].bool()].tolist()]
    assert s["tokens"][5:9] == ["z", "##z", "##q", "##x"]  # unknown to CheXbert's vocabulary: four pieces
    for t, word in enumerate(words[:-1]):
        expected = max(s["saliency"][5:9]) if word == "zzqx" else pieces[word]
        assert w[0, t].item() == pytest.approx(1 + expected, rel=1e-5)
    assert w[0, len(words) - 1] == 1  # EOS
    w2 = deer.gradient_weights(chexbert, decoded, spans, mask, targets, beta=2.0)
    torch.testing.assert_close(w2 - 1, 2 * (w - 1))  # Eq. 12: no normalisation


# Eq. 6, Eq. 1, Tables 6-7 ------------------------------------------------------------------------
def test_eq6_token_weights_scale_each_tokens_gradient(small_synthetic):
    """ditpo_step's gradient is -sum_i sum_t A_i w_i^t grad log pi(o_i^t) / |o_i| / N, with A from Eq. 2 (Bessel's
    std + 1e-4): weights of 1 give GRPO's gradient, and a weight of 3 on one token triples that token's push."""
    data = common.load_data(str(small_synthetic))
    policy = tiny_policy([r.report for r in data["train"]], max_len=16)
    prompts = policy.prompt_batch([[common.load_image(p) for p in data["train"][0].image_paths]])  # 2 rows of it
    ids, mask = policy.encode_targets(["heart size is normal.", "small left pleural effusion."])
    roll = common.Rollout(prompts, ids, mask, [], torch.tensor([0.0, 1.0]))
    w = torch.ones(mask.shape)
    w[1, 3] = 3.0
    A = torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 1e-4)  # rewards (0, 1): mean 0.5, Bessel's std sqrt(0.5)

    def grads(loss):
        policy.model.zero_grad(set_to_none=True)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])

    logp = policy.completion_logprobs(prompts, ids, mask)
    n = mask.sum(1)
    expected = grads(-((A[:, None] * w * logp * mask).sum(1) / n).mean())
    torch.testing.assert_close(grads(deer.ditpo_step(policy, roll, w, 2)[0]), expected)
    unweighted = grads(deer.ditpo_step(policy, roll, torch.ones(mask.shape), 2)[0])
    assert not torch.allclose(unweighted, expected, atol=1e-6)


def test_eq1_reward_and_two_phases():
    lab = common.RuleLabeler()
    ref = "Small left pleural effusion. Mild pulmonary edema."
    texts = [ref, "Small left pleural effusion.", ""]
    r, terms = deer.reward(texts, [ref] * 3, lab([ref] * 3), lab, gamma=0.0)
    np.testing.assert_allclose(r, [1.0, 2 / 3, 0.0])  # F1 = 2 TP / (|o| + |y|) = 2 / (1 + 2)
    assert set(terms) == {"f1"}  # phase 1: BLEU-2 is neither computed nor logged as 0
    r, terms = deer.reward(texts, [ref] * 3, lab([ref] * 3), lab, gamma=0.25)
    assert r[0] == pytest.approx(1.25) and terms["bleu2"] > 0 and r[1] > 2 / 3 and r[2] == 0
    assert report_f1(labels(), labels(), both_empty=1.0)[0] == 1.0
    # an empty completion earns nothing, also against a reference that names no finding (no label on either side)
    for gamma in (0.0, 0.25):
        r, _ = deer.reward(["", " "], ["", "No acute findings."], np.full((2, 14), np.nan), lab, gamma)
        np.testing.assert_array_equal(r, [0.0, 0.0])
        r, _ = deer.reward([""], ["Heart size is normal."], lab(["Heart size is normal."]), lab, gamma)
        assert r[0] == 0.0
    assert [gamma_at(s, 10, 0.25) for s in range(10)] == [0.0] * 5 + [0.25] * 5
    assert gamma_at(0, 10, 0.25, switch=0.0) == 0.25 and gamma_at(9, 10, 0.25, switch=1.0) == 0.0


def test_reward_diversity_hand_example():
    stats = reward_diversity(np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0.5, 0.5, 1.0]]))
    assert stats["zero_variance"] == pytest.approx(2 / 3) and stats["unique_rewards"] == pytest.approx(5 / 3)
    assert stats["reward_std"] == pytest.approx(math.sqrt(0.125) / 3)


def test_mask_top_tokens():
    w = torch.tensor([[1.0, 3, 2, 1, 1, 5, 1, 1, 1, 1, 9, 0], [4.0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    cand = torch.tensor([[1.0] * 10 + [0, 0], [1, 1, 1] + [0] * 9])  # 9 is EOS/padding: never masked
    rng = np.random.default_rng(0)
    keep = mask_top_tokens(w, cand, 0.1, rng)
    assert keep[0].tolist() == [1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0] and keep[1].tolist()[:3] == [0, 1, 1]
    keep = mask_top_tokens(w, cand, 0.25, rng)  # ceil(2.5) = 3 of 10
    assert (keep[0, :10] == 0).nonzero().flatten().tolist() == [1, 2, 5]


def test_table6_masking_effect_hand_example():
    """One token removed per report (ceil(0.2 x n), n <= 5), chosen by fixed weights; the rule labeler."""
    reports = ["small left pleural effusion.", "mild pulmonary edema.", "no pneumothorax.", "heart size is normal."]
    policy = tiny_policy(reports)
    ids, mask = encode(policy, reports)
    vocab = policy.tokenizer.vocab
    top = ["effusion", "mild", "no", "normal"]  # the token with the largest weight in each report
    w = torch.tensor([[9.0 if vocab[i] == t else 1.0 for i in row.tolist()] for row, t in zip(ids, top)])
    w[ids == policy.tokenizer.eos_id] = 99  # EOS is never a candidate, whatever its weight
    lab = common.RuleLabeler()
    effect = deer.masking_effect(policy, lab, ids, mask, w, lab(reports), 0.2, np.random.default_rng(0))
    # "small left pleural ."  Pleural Effusion 1 -> No Finding 1: changed, binary changed, F1 0
    # "pulmonary edema."      Edema 1 as before: unchanged, F1 1
    # "pneumothorax."         Pneumothorax 0 + No Finding 1 -> Pneumothorax 1: changed, binary changed, F1 0
    # "heart size is ."       Cardiomegaly 0 + No Finding 1 -> No Finding 1: changed (0 -> blank), binary the same, F1 1
    assert effect["label_mod_ratio"] == [True, False, True, True]
    assert effect["label_mod_ratio_binary"] == [True, False, True, False]
    assert effect["post_mask_f1"] == [0.0, 1.0, 0.0, 1.0]


def test_ddsampling_is_label_free(small_synthetic, monkeypatch):
    monkeypatch.setattr(deer, "K", 3)
    records = common.load_data(str(small_synthetic))["train"][:4]
    policy = tiny_policy([r.report for r in records], max_len=12)
    torch.manual_seed(0)
    D = deer.score_chunk(policy, records, common.RuleLabeler(), 12)
    torch.manual_seed(0)
    blind = [replace(r, report="", labels=None) for r in records]
    np.testing.assert_array_equal(deer.score_chunk(policy, blind, common.RuleLabeler(), 12), D)
    assert D.shape == (4,)


class SamplesByStudy:
    """A stand-in policy: sample k of study b reads EDEMA or NORMAL as PATTERNS[b][k] says (E or N); prompts are the
    study's index, repeated as the policy interface does."""

    EDEMA, NORMAL, PATTERNS = "Mild pulmonary edema.", "No pleural effusion.", ["EEEE", "ENEN", "ENNN"]

    def __init__(self):
        self.calls = []

    def prompt_batch(self, images, text):
        return {"study": torch.arange(len(images))}

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, n=1):
        self.calls.append((max_new_tokens, temperature, top_p))
        study = prompts["study"].repeat_interleave(n)  # row i n + j: study i's j-th sample
        k = torch.arange(len(study)) - torch.searchsorted(study, study)  # the sample's index within its study
        return torch.stack([study, k], 1), None

    def decode(self, ids, mask):
        return [self.EDEMA if self.PATTERNS[b][k] == "E" else self.NORMAL for b, k in ids.tolist()]


def test_ddsampling_scores_each_studys_own_k_samples(small_synthetic, monkeypatch):
    """Eq. 3-4 on each study's own K = 4 samples. Study 0 writes one report 4 times: D = 0. Study 1 alternates edema /
    "no pleural effusion": Edema p = (1, 0, 1, 0), No Finding (0, 1, 0, 1), std 0.5 each, Pleural Effusion p 0: D = 1.
    Study 2 writes edema once, then 3 normal reports: p = (1, 0, 0, 0) and (0, 1, 1, 1), std sqrt(3) / 4 each: D =
    sqrt(3) / 2. Samples of different studies grouped together give other values."""
    monkeypatch.setattr(deer, "K", 4)
    policy, records = SamplesByStudy(), common.load_data(str(small_synthetic))["train"][:3]
    np.testing.assert_allclose(
        deer.score_chunk(policy, records, common.RuleLabeler(), 12), [0.0, 1.0, math.sqrt(3) / 2]
    )
    assert policy.calls == [(12, deer.TEMPERATURE, deer.TOP_P)]  # nucleus sampling (Sec. 3.2)


def test_bad_flags(tmp_path, small_synthetic):
    with pytest.raises(SystemExit, match="^error: --weighting grad needs --labeler chexbert"):
        deer.main(["rl", "--weighting", "grad", "--labeler", "rule", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="unknown command 'train'"):
        deer.main(["train"])
    with pytest.raises(SystemExit, match="--prompts-per-step per process / --grad-accum: 8 is not divisible by 3"):
        deer.main(["rl", "--grad-accum", "3", "--out", str(tmp_path / "b"), "--data", str(small_synthetic)])
    assert not (tmp_path / "b").exists()


# End to end --------------------------------------------------------------------------------------
def metrics(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


SMALL = dict(K=3, DD_CHUNK=8, SFT=dict(deer.SFT, batch_tiny=8))


@pytest.fixture(scope="module")
def staged_updates():
    """What the SFT stage of `staged` applied at each optimiser step (conftest.record_updates)."""
    return []


@pytest.fixture(scope="module")
def staged(tmp_path_factory, small_synthetic, staged_updates):
    """SFT (6 steps) and DDSampling once for the tests below: (out folder, common flags)."""
    out = tmp_path_factory.mktemp("deer")
    base = ["--data", str(small_synthetic), "--out", str(out), "--max-new-tokens", "16", "--sft-steps", "6"]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in SMALL.items():
            mp.setattr(deer, k, v)
        mp.setattr(common, "CHECKPOINT_EVERY", 3)
        made = record_updates(mp)
        deer.main(["sft", *base])
        deer.main(["sample", *base])
    staged_updates.extend(made)
    return out, base


@pytest.fixture
def small(monkeypatch):
    for k, v in SMALL.items():
        monkeypatch.setattr(deer, k, v)


def test_sft_and_sample_stages(staged, staged_updates, small):
    out, base = staged
    losses = [x["sft_loss"] for x in metrics(out / "sft" / "metrics.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    (sft,) = staged_updates  # the SFT stage's optimiser (DDSampling trains nothing): a constant lr, no clip
    assert_applied(sft, [deer.SFT["lr_tiny"]] * 6, clip=None)
    assert (out / "sft" / "final" / "tiny_policy.pt").is_file() and "ce" in json.loads(
        (out / "sft" / "eval.json").read_text()
    )["test"]
    sel = json.loads((out / "ddsampling" / "selection.json").read_text())
    assert sel["n_pool"] == 40 and len(sel["ids"]) == 8 == len(set(sel["ids"]))
    D = [x["D"] for x in sel["ranked"]]
    assert D == sorted(D, reverse=True) and max(D) > 0
    assert len(metrics(out / "ddsampling" / "metrics.jsonl")) == 5  # 40 studies in chunks of 8
    with pytest.raises(SystemExit, match="--max-new-tokens 16 in the run, 12 now"):  # another sampling: another stage
        deer.main(["sample", *base, "--resume", "--max-new-tokens", "12"])
    deer.main(["sample", *base, "--resume", "--lr", "0.5"])  # an RL flag: no concern of this finished stage


def test_ddsampling_resume_draws_the_same(tmp_path, staged, small, monkeypatch, crash_after_checkpoint):
    """Stopped after chunk 2 and resumed, DDSampling ends with the scores and selection of a run never stopped.
    Bit for bit: conftest.crash_after_checkpoint says why that holds on any CPU."""
    out, base = staged
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 2)
    part = tmp_path / "part"
    shutil.copytree(out / "sft", part / "sft")
    flags = [*base[:2], "--out", str(part), *base[4:]]
    crash_after_checkpoint(2)
    with pytest.raises(Crash):
        deer.main(["sample", *flags])
    crash_after_checkpoint(None)
    deer.main(["sample", *flags, "--resume"])
    assert json.loads((part / "ddsampling" / "selection.json").read_text()) == json.loads(
        (out / "ddsampling" / "selection.json").read_text()
    )


def test_one_ditpo_step_feeds_the_loss_the_paper_quantities(tmp_path, staged, small, monkeypatch):
    """What reaches common.grpo_loss in one rule-weighted step, against values computed here from the sampled
    tokens: the Eq. 1 phase-1 reward (report F1 written out), Eq. 2's advantages, Eq. 7-8's TF-IDF weights with
    EOS at 1, Eq. 6's product, and each completion's own study's labels handed to the weighting (Eq. 9's targets).
    Dropping the weights from the loss fails it."""
    out, base = staged
    shutil.copytree(out / "sft", tmp_path / "sft")
    seen, rolls = [], []
    real_loss, real_rollout = common.grpo_loss, common.rollout

    def recorded_loss(*a, **k):
        seen.append((a, k))
        return real_loss(*a, **k)

    def recorded_rollout(*a, **k):
        rolls.append(real_rollout(*a, **k))
        return rolls[-1]

    def first_studies(self, records, n, flag):
        def batches(start):
            return iter([common.collate([common.ReportDataset(records[:n])[i] for i in range(n)])])

        return batches

    weighed, real_weights = [], deer.token_weights

    def recorded_weights(*a):
        weighed.append(a[5])  # the labels each completion's weights read (Eq. 9's targets): its own study's
        return real_weights(*a)

    monkeypatch.setattr(common, "grpo_loss", recorded_loss)
    monkeypatch.setattr(common, "rollout", recorded_rollout)
    monkeypatch.setattr(deer, "token_weights", recorded_weights)
    monkeypatch.setattr(deer, "evaluate", lambda *a: {})  # not under test
    monkeypatch.setattr(common.Run, "study_batches", first_studies)  # the first 2 studies
    deer.main(
        [
            "rl",
            *base[:2],
            "--out",
            str(tmp_path),
            *base[4:],
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--subset",
            "all",
            "--max-new-tokens",
            "24",
        ]
    )
    (_, ref_logp, A_t, mask), kw = seen[0]
    roll, G, lab = rolls[0], 8, common.RuleLabeler()
    refs = [r.report for r in common.load_data(base[1])["train"][:2] for _ in range(G)]
    h, y = ((x == 1) | (x == -1) for x in (lab(roll.texts), lab(refs)))  # positive or uncertain
    f1 = np.where(h.sum(1) + y.sum(1) > 0, 2 * (h & y).sum(1) / np.maximum(h.sum(1) + y.sum(1), 1), 0.0)
    np.testing.assert_allclose(roll.rewards.numpy(), f1, atol=1e-6)
    np.testing.assert_array_equal(weighed[0], lab(refs))  # completion n: study n // G's labels (NaN equal to NaN)
    r = roll.rewards.view(-1, G)
    A = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    A[torch.repeat_interleave((r == r[:, :1]).all(1), G)] = 0
    w = torch.ones(mask.shape)
    eos = 2  # the tiny tokenizer's <eos>
    for g in range(0, len(roll.texts), G):
        docs = [roll.completion_ids[i][roll.completion_mask[i].bool()].tolist() for i in range(g, g + G)]
        for k, d in enumerate(docs):
            for t, tok in enumerate(d):
                df = sum(tok in other for other in docs)
                w[g + k, t] = 1 if tok == eos else 1 + 4.0 * math.log(G / df)  # TF = 1: the token is there
    assert (w[mask.bool()] > 1).any() and A.abs().sum() > 0  # weights and advantages that matter
    torch.testing.assert_close(A_t, A[:, None] * w)
    torch.testing.assert_close(mask, roll.completion_mask)
    assert ref_logp is None and kw["loss_type"] == "grpo"
    row = metrics(tmp_path / "rl_rule_all" / "metrics.jsonl")[0]  # --subset all: its own stage folder
    assert (
        "bleu2" not in row
        and row["gamma"] == 0
        and row["w_mean"] == pytest.approx(w[mask.bool()].mean().item(), rel=1e-5)
    )


def test_rl_resume_exact_and_refuses_changed_steps(tmp_path, staged, small, monkeypatch, crash_after_checkpoint):
    """Stopped after the step-2 checkpoint and resumed, an RL run ends with the weights and the log of a run never
    stopped; a resume with another --steps (which moves the phase switch) or --lr is refused. Reward: the text's
    length mod 7, so every step updates. Bit for bit: conftest.crash_after_checkpoint says why that holds on any CPU."""
    out, base = staged
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 2)

    def length_reward(texts, refs, ref_labels, labeler, gamma, style):
        """The text's length mod 7; logs the gamma it is given."""
        return np.array([len(t) % 7 / 7 for t in texts]), {"f1": 0.0, "reward_gamma": gamma}

    monkeypatch.setattr(deer, "reward", length_reward)
    for d in ("full", "part"):
        shutil.copytree(out / "sft", tmp_path / d / "sft")
        shutil.copytree(out / "ddsampling", tmp_path / d / "ddsampling")

    def rl(d):
        """The RL command into tmp_path / d, --steps last."""
        flags = ["--prompts-per-step", "2", "--grad-accum", "2", "--steps", "4"]
        return ["rl", *base[:2], "--out", str(tmp_path / d), *base[4:], *flags]

    made = record_updates(monkeypatch)
    deer.main(rl("full"))
    (full,) = made  # what the RL steps applied: the tiny model's constant 1e-4, gradients (both micro-batches'
    assert_applied(full, [1e-4] * 4, clip=1.0)  # sum) clipped to verl's 1.0
    crash_after_checkpoint(2)
    with pytest.raises(Crash):
        deer.main(rl("part"))
    crash_after_checkpoint(None)
    with pytest.raises(SystemExit, match="--steps 4 in the run, 6 now"):
        deer.main(rl("part")[:-1] + ["6", "--resume"])
    with pytest.raises(SystemExit, match="--lr None in the run, 0.01 now"):
        deer.main(rl("part") + ["--resume", "--lr", "0.01"])
    deer.main(["rl", "--out", str(tmp_path / "part"), "--resume"])  # the flags: the newest stage's config.json

    def weights(d):
        return torch.load(tmp_path / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"]

    full, part, sft = weights("full/rl_rule"), weights("part/rl_rule"), weights("full/sft")
    assert all(torch.equal(full[k], part[k]) for k in full)
    assert any(not torch.equal(full[k], sft[k]) for k in full)  # RL changed the weights

    def rows(d):
        return metrics_rows(tmp_path / d / "rl_rule" / "metrics.jsonl")

    assert rows("full") == rows("part") and [x["step"] for x in rows("part")] == [1, 2, 3, 4]
    assert [x["gamma"] for x in rows("part")] == [x["reward_gamma"] for x in rows("part")] == [0, 0, 0.25, 0.25]
    # GRPO from the same SFT model and subset, beside it; `all --resume` skips the finished stages
    stamp = (tmp_path / "full" / "sft" / "final" / "tiny_policy.pt").stat().st_mtime_ns
    deer.main(rl("full")[:-1] + ["2", "--weighting", "none"])
    assert all(x["w_mean"] == 1 for x in metrics(tmp_path / "full" / "rl_none" / "metrics.jsonl"))
    deer.main(["all"] + rl("full")[1:] + ["--resume", "--weighting", "rule"])  # not given: rl_none's, the newest
    assert (tmp_path / "full" / "sft" / "final" / "tiny_policy.pt").stat().st_mtime_ns == stamp


def test_tables_6_and_7(staged, small, chexbert, monkeypatch):
    out, base = staged
    monkeypatch.setattr(deer, "ANALYSIS_N", 6)
    deer.main(["table7", *base])
    t7 = json.loads((out / "table7.json").read_text())
    assert t7["random_100"]["n_groups"] == 6 and t7["ddsampling"]["n_groups"] == 6
    assert 0 <= t7["ddsampling"]["zero_variance"] <= 1 and 1 <= t7["ddsampling"]["unique_rewards"] <= 8
    monkeypatch.setattr(deer, "ANALYSIS_N", 4)
    deer.main(["table6", *base])
    t6 = json.loads((out / "table6.json").read_text())
    assert set(t6) >= {"random", "rule"} and "grad" not in t6 and t6["n_reports"] == 32
    assert t6["mask_frac"] == 0.1, "Table 6: the top 10 % of each report's tokens masked"
    assert all(0 <= t6[k]["label_mod_ratio"] <= 1 and 0 <= t6[k]["post_mask_f1"] <= 1 for k in ("random", "rule"))
    monkeypatch.setattr(common, "make_labeler", lambda *a, **k: chexbert)  # the tiny random CheXbert, offline
    monkeypatch.setattr(deer, "ANALYSIS_N", 2)
    deer.main(["table6", *base, "--labeler", "chexbert"])
    assert "grad" in json.loads((out / "table6.json").read_text())


def test_grad_weighting_with_chexbert(tmp_path, staged, small, chexbert, monkeypatch):
    """--weighting grad (auto with CheXbert): weights above 1; the beta every step's token weights are built with is
    the one the declared rule set and the stage recorded (config.json, eval.json)."""
    out, base = staged
    shutil.copytree(out / "sft", tmp_path / "sft")
    monkeypatch.setattr(common, "make_labeler", lambda *a, **k: chexbert)
    monkeypatch.setattr(deer, "evaluate", lambda *a: {})
    used, real = [], deer.token_weights

    def token_weights(*a):
        used.append(a[-1])  # beta
        return real(*a)

    monkeypatch.setattr(deer, "token_weights", token_weights)
    deer.main(
        [
            "rl",
            *base[:2],
            "--out",
            str(tmp_path),
            *base[4:],
            "--labeler",
            "chexbert",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--subset",
            "random",
        ]
    )
    assert json.loads((tmp_path / "rl_grad_random" / "config.json").read_text())["weighting"] == "grad"  # auto: grad
    lines = metrics(tmp_path / "rl_grad_random" / "metrics.jsonl")
    assert all(x["w_mean"] >= 1 for x in lines) and max(x["w_max"] for x in lines) > 1
    recorded = json.loads((tmp_path / "rl_grad_random" / "config.json").read_text())["resolved"]["beta"]["beta"]
    assert recorded != 1.0 and used == [recorded, recorded]  # the rule's beta, not Sec. 4.1's 1, at both steps
    assert json.loads((tmp_path / "rl_grad_random" / "eval.json").read_text())["beta"]["beta"] == recorded


@pytest.mark.slow
def test_torchrun_fsdp_equals_unsharded(tmp_path, small_synthetic):
    """All three stages under two processes (as test_distributed.py's test_deer_under_two_processes), then the RL
    stage again from the same SFT model and subset with --fsdp: the same steps within rel 1e-4 (test_distributed.py's
    test_orapo_fsdp_stopped_and_resumed_equals_two_processes says why that bound holds on any CPU; deer passes the
    flag through the same common.for_training)."""
    out, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    rl = ["--data", str(small_synthetic), "--max-new-tokens", "8", "--steps", "2", "--prompts-per-step", "2"]
    torchrun("deer.py", "all", *rl, "--sft-steps", "2", "--out", str(out))
    for stage in ("sft", "ddsampling"):
        shutil.copytree(out / stage, fsdp / stage)
    torchrun("deer.py", "rl", *rl, "--out", str(fsdp), "--fsdp")
    for a, b in zip(metrics(out / "rl_rule" / "metrics.jsonl"), metrics(fsdp / "rl_rule" / "metrics.jsonl")):
        assert all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a if k != "time"), (a, b)


def test_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir, small, monkeypatch):
    """A tiny random Qwen2.5-VL in bf16: SFT trains the vision tower only (the LM frozen) with fp32 master weights
    and checkpoints it alone; DDSampling; DiTPO trains everything; --max-pixels reaches the processor; the
    token spans of byte-level BPE tokens tile the decoded report."""
    monkeypatch.setattr(deer, "SFT", dict(deer.SFT, batch_hf=2, lr_hf=1e-3))
    monkeypatch.setattr(deer, "evaluate", lambda *a: {})
    out = tmp_path / "hf"
    short = ["--max-new-tokens", "8", "--dtype", "bf16", "--sft-steps", "2", "--steps", "1", "--prompts-per-step", "2"]
    deer.main(["all", *qwen_flags(small_synthetic, tiny_qwen_dir, out, *short, "--max-pixels", "6272")])
    sft_ckpt = torch.load(out / "sft" / "last.pt", weights_only=True)
    vision = {n for n, _ in common.HFPolicy(str(tiny_qwen_dir)).vision_and_language()[0].named_parameters()}
    trained = {k.split("visual.")[-1] for k, v in sft_ckpt["model"].items() if "visual." in k}
    assert sft_ckpt["partial"] and trained == vision and not any("language_model" in k for k in sft_ckpt["model"])
    assert all(sft_ckpt["model"][k].dtype == torch.float32 for k in sft_ckpt["model"] if "visual." in k)  # fp32 masters
    rl_model = torch.load(out / "rl_rule" / "last.pt", weights_only=True)["model"]
    assert any("language_model" in k for k in rl_model)  # RL trains the entire model
    before, after = (common.HFPolicy(str(p), dtype=torch.bfloat16) for p in (tiny_qwen_dir, out / "sft" / "final"))
    assert after.processor.image_processor.size["longest_edge"] == 6272  # saved with the policy
    (vis0, lang0), (vis1, lang1) = before.vision_and_language(), after.vision_and_language()
    assert all(torch.equal(a, b) for a, b in zip(lang0.parameters(), lang1.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(vis0.parameters(), vis1.parameters()))
    ids, mask = after.encode_targets(["Small left pleural effusion.", "No pneumothorax."])
    texts, spans = token_spans(after, ids, mask)
    assert texts == after.decode(ids, mask) and ["".join(t[a:b] for a, b in s) for t, s in zip(texts, spans)] == texts


def test_sft_converges_by_its_declared_rule(tmp_path, small_synthetic, monkeypatch):
    """Without --sft-steps the tiny model's SFT cold start trains until validation CE example F1 stops improving
    (CONVERGE), the best validation's weights kept: the start RL gets is the best one, and the test split sees it."""
    for k, v in SMALL.items():
        monkeypatch.setattr(deer, k, v)
    monkeypatch.setattr(deer, "CONVERGE", dict(every=2, patience=2, min_gain=1.0, max_steps=40))
    monkeypatch.setattr(deer, "N_VAL", 4)
    deer.main(["sft", "--data", str(small_synthetic), "--out", str(tmp_path / "d"), "--max-new-tokens", "8"])
    rows = [json.loads(x) for x in (tmp_path / "d" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["step"] for r in rows if "validation" in r] == [
        2,
        4,
        6,
    ]
    best = json.loads((tmp_path / "d" / "sft" / "eval_val_step2.json").read_text())
    assert rows[1]["validation"] == best["ce"]["example_f1"]  # what was validated is what the rule read


def test_the_premise_beta_by_hand(monkeypatch):
    """BETA_RULE on made-up samples: beta = (1.1 - 1) / the median s~ (Eq. 11's normalised saliency, w - 1 at beta 1)
    of the tokens outside the reference's findings (no rule-labeler mention of a target over them). Report 1 (reference:
    Cardiomegaly) has s~ 0.4, 3.0, 0.2, 0.6, 0.8, 0.2 on "mild", "cardiomegaly", ".", "lungs", "clear", "."; only
    "cardiomegaly" names the finding: outside 0.4, 0.2, 0.6, 0.8, 0.2, median 0.4 -> beta 0.25. Report 2's reference
    has no finding (its w is 1 everywhere): none of its tokens count. A median of 0 keeps the printed beta, 1."""
    text = "mild cardiomegaly. lungs clear."
    spans = [(0, 4), (5, 17), (17, 18), (19, 24), (25, 30), (30, 31)]
    s_tilde = torch.tensor([[0.4, 3.0, 0.2, 0.6, 0.8, 0.2], [9.0] * 6])
    ref_labels = np.vstack([labels(Cardiomegaly=1), labels(No_Finding=1)])
    group = dict(ids=torch.zeros(2, 6, dtype=torch.long), mask=torch.ones(2, 6), ref_labels=ref_labels)
    monkeypatch.setattr(deer, "sample_groups", lambda *a: iter([(None, group)]))
    monkeypatch.setattr(deer, "token_spans", lambda policy, ids, mask: ([text, text], [spans, spans]))
    monkeypatch.setattr(deer, "gradient_weights", lambda labeler, texts, spans, mask, targets, beta: s_tilde + beta)
    run = type("Run", (), {"labeler": None})()
    premise = deer.premise_beta(run, deer.Args(), None, None, None)
    assert premise == pytest.approx(
        dict(beta=0.25, median_s_outside=0.4, median_s_inside=3.0, tokens_outside=5, tokens_inside=1)
    )
    s_tilde[0] = 0.0
    assert deer.premise_beta(run, deer.Args(), None, None, None)["beta"] == 1.0
    assert deer.BETA_RULE == dict(median=1.1, studies=64) and deer.Args().beta is None


def test_beta_as_printed_is_a_flag(tmp_path, synthetic_is_small, built, monkeypatch):
    """--beta 1 (Sec. 4.1's value) skips the rule; without it the rule's beta is computed and recorded by the stage."""
    monkeypatch.setattr(deer, "premise_beta", lambda *a: {"beta": 0.25, "median_s_outside": 0.4})
    built.skip, built.stop = {"sft"}, {"ddsampling"}
    with pytest.raises(Stop):
        deer.main(["all", "--out", str(tmp_path / "run")])
    for flags, beta in (([], {"beta": 0.25, "median_s_outside": 0.4}), (["--beta", "1"], {"beta": 1.0})):
        with pytest.raises(Stop):
            deer.main(["rl", "--out", str(tmp_path / "run"), "--subset", "all", *flags])
        stage = tmp_path / "run" / "rl_grad_all"
        assert json.loads((stage / "config.json").read_text())["resolved"]["beta"] == beta
        shutil.rmtree(stage)


def test_grad_accum_samples_once_a_step_and_keeps_the_gradient(tmp_path, staged, monkeypatch):
    """--grad-accum k: one generate() call a step whatever k (1, 2, 4), the same completions, and the gradient of k
    micro-batches (each group's TF-IDF weights computed once on the step's rollout) that of the whole step."""
    out, base = staged
    monkeypatch.setattr(deer, "reward", lambda texts, *a: (np.array([len(t) % 7 for t in texts], float), {}))
    seen = {}
    for k in (1, 2, 4):
        shutil.copytree(out / "sft", tmp_path / f"k{k}" / "sft")
        flags = [*base[:2], "--out", str(tmp_path / f"k{k}"), *base[4:], "--steps", "1", "--prompts-per-step", "4"]
        argv = ["rl", *flags, "--subset", "all", "--weighting", "rule", "--group-size", "4"]
        seen[k] = one_step_in_micro_batches(monkeypatch, deer.main, argv, k)
    assert [seen[k][0] for k in (1, 2, 4)] == [1, 1, 1]
    assert seen[4][1] == seen[1][1] and len(set(seen[1][1])) > 1
    torch.testing.assert_close(seen[4][2], seen[1][2], rtol=1e-4, atol=1e-6)
    assert seen[1][2].abs().max() > 1e-3
