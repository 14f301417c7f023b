"""OraPO: ZRR (Eq. 8-9) on a hand-made z sequence and lambda (Eq. 10) by hand, the mixed loss (Eq. 11-12) at its
two ends and in between, a DPO step on the tiny policy, FactS (Eq. 13-15) on hand-written reports, the balanced
subset, what one training step feeds the losses, and end-to-end runs (one process, torchrun, resume, Qwen)."""

import copy
import json
import math

import numpy as np
import pytest
import torch

import common
import orapo
from conftest import (
    Crash,
    assert_applied,
    fake_eval,
    labels,
    metrics_rows,
    one_step_in_micro_batches,
    qwen_flags,
    torchrun,
)
from orapo import (
    SentenceFacts,
    ZeroRewardRate,
    balanced_subset,
    facts_reward,
    mixing_weight,
    orapo_loss,
    zero_reward_indicator,
)

L = common.LABEL_INDEX


# --------------------------------------------------------------------------- Eq. 8-10
def test_zero_reward_indicator_eq8():
    r = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(zero_reward_indicator(r, 4), [0.0, 1.0, 0.0])


def test_zrr_reacts_to_persistent_failure_and_falls_back():
    """App. A: the rate "reacts quickly" to persistent failures and lambda "quickly falls back toward lambda_min"
    once a reward appears. Study "a" fails 3 times, then succeeds; m 0.5, ZRR from 0, lambda 0.05 + 0.45 ZRR^2."""
    zrr, seq = ZeroRewardRate(0.5), []
    for z in (1, 1, 1, 0, 0):
        seq.append(zrr.update(["a"], np.array([float(z)]))[0])
    np.testing.assert_allclose(seq, [0.5, 0.75, 0.875, 0.4375, 0.21875])
    lam = mixing_weight(np.array(seq), 0.05, 0.5, 2.0)
    np.testing.assert_allclose(
        lam,
        [
            0.05 + 0.45 * 0.25,
            0.05 + 0.45 * 0.5625,
            0.05 + 0.45 * 0.765625,
            0.05 + 0.45 * 0.19140625,
            0.05 + 0.45 * 0.0478515625,
        ],
    )
    assert lam[2] > 0.38 and lam[3] < 0.14 and lam[4] < 0.075  # up within 3 failures, back near 0.05 within 2 successes


def test_zrr_first_visit_starts_from_the_minibatch_rate():
    zrr = ZeroRewardRate(0.5)
    # step 1: the minibatch rate is still 0, so a new study's ZRR is 0.5 z; the rate becomes 0.5 * 0.75
    np.testing.assert_allclose(zrr.update(["a", "b", "c", "d"], np.array([1.0, 1.0, 1.0, 0.0])), [0.5, 0.5, 0.5, 0.0])
    assert zrr.values["minibatch"] == pytest.approx(0.375)
    # step 2: new study e starts at 0.375 -> 0.5 * 0.375 + 0.5 * 1; a comes back -> 0.5 * 0.5 + 0
    np.testing.assert_allclose(zrr.update(["e", "a"], np.array([1.0, 0.0])), [0.6875, 0.25])
    assert zrr.values["minibatch"] == pytest.approx(0.5 * 0.375 + 0.5 * 0.5)
    with pytest.raises(AssertionError):
        ZeroRewardRate(1.0)


def test_table6_values_are_the_defaults():
    """Table 6 (arXiv v2): EMA momentum 0.5, w_min 0.05, w_max 0.15, sharpening exponent 2."""
    assert (orapo.ZRR_MOMENTUM, orapo.Args().lambda_min, orapo.Args().lambda_max, orapo.ZRR_POWER) == (
        0.5,
        0.05,
        0.15,
        2.0,
    )


@pytest.mark.parametrize(
    "m, expected, minibatch",
    [
        # Eq. 9 by hand. Step 1 (a, b) z (1, 0); step 2 (a, c) z (1, 1), c new; step 3 (b, d) z (1, 0), d new.
        # m 0.9: a 0.9 x 0 + 0.1 = 0.1, b 0; rate 0.1 x 0.5 = 0.05
        #        | a 0.9 x 0.1 + 0.1 = 0.19, c 0.9 x 0.05 + 0.1 = 0.145; rate 0.9 x 0.05 + 0.1 = 0.145
        #        | b 0.9 x 0 + 0.1 = 0.1, d 0.9 x 0.145 = 0.1305; rate 0.1305 + 0.05 = 0.1805
        (0.9, [[0.1, 0.0], [0.19, 0.145], [0.1, 0.1305]], [0.05, 0.145, 0.1805]),
        # m 0.2: a 0.8, b 0; rate 0.4 | a 0.16 + 0.8 = 0.96, c 0.2 x 0.4 + 0.8 = 0.88; rate 0.88
        #        | b 0.8, d 0.176; rate 0.576
        (0.2, [[0.8, 0.0], [0.96, 0.88], [0.8, 0.176]], [0.4, 0.88, 0.576]),
    ],
)
def test_zrr_momentum_by_hand_where_m_and_1_minus_m_differ(m, expected, minibatch):
    """Eq. 9 at m != 0.5 (at 0.5, m and 1 - m are the same number), the first visit from the minibatch rate."""
    zrr, got, rates = ZeroRewardRate(m), [], []
    for ids, z in ((["a", "b"], [1.0, 0.0]), (["a", "c"], [1.0, 1.0]), (["b", "d"], [1.0, 0.0])):
        got.append(zrr.update(ids, np.array(z)).tolist())
        rates.append(zrr.values["minibatch"])
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_allclose(rates, minibatch, rtol=1e-12)


def test_zrr_under_two_ranks_applies_every_ranks_groups(monkeypatch):
    """Rank 1's update with rank 0's (a, b) and its own (c, d) gathered, m 0.8: every study's rate is held on every
    rank, the minibatch rate is the mean over all four groups; rank 1 gets its own studies' rates back."""
    monkeypatch.setattr(common, "all_gather_objects", lambda mine: [[("a", 1.0), ("b", 1.0)], mine])
    zrr = ZeroRewardRate(0.8)
    np.testing.assert_allclose(zrr.update(["c", "d"], np.array([0.0, 1.0])), [0.0, 0.2])
    assert zrr.values == pytest.approx({"a": 0.2, "b": 0.2, "c": 0.0, "d": 0.2, "minibatch": 0.2 * 0.75})


def test_mixing_weight_eq10_where_min_max_and_p_show():
    # lambda_min 0.1, lambda_max 0.7, p 3: 0.1 + 0.6 x ZRR^3
    lam = mixing_weight(np.array([0.0, 0.5, 0.8, 1.0]), 0.1, 0.7, 3.0)
    np.testing.assert_allclose(lam, [0.1, 0.1 + 0.6 * 0.125, 0.1 + 0.6 * 0.512, 0.7], rtol=1e-12)


def test_mixing_weight_eq10_by_hand():
    lam = mixing_weight(np.array([0.0, 0.5, 0.9, 1.0]), 0.05, 0.5, 2.0)
    np.testing.assert_allclose(lam, [0.05, 0.05 + 0.45 * 0.25, 0.05 + 0.45 * 0.81, 0.5])
    assert np.all(np.diff(mixing_weight(np.linspace(0, 1, 11), 0.05, 0.5, 3.0)) > 0)  # monotonic


# --------------------------------------------------------------------------- Eq. 11-12
def _batch(B=3, G=4, T=5, Tc=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B * G, T, generator=g) * 3).requires_grad_()
    ref = -torch.rand(B * G, T, generator=g) * 3
    mask = torch.ones(B * G, T)
    mask[1, 3:] = 0
    mask[5, 1:] = 0
    chosen = (-torch.rand(B, Tc, generator=g) * 3).requires_grad_()
    ref_chosen = -torch.rand(B, Tc, generator=g) * 3
    c_mask = torch.ones(B, Tc)
    c_mask[0, 4:] = 0
    rewards = torch.rand(B * G, generator=g)
    rewards[:G] = 0  # one zero-reward group
    return logp, ref, mask, chosen, ref_chosen, c_mask, rewards


@pytest.mark.parametrize("loss_type, scale", [("dr_grpo", "none"), ("grpo", "std")])
def test_mixed_loss_is_pure_grpo_at_lambda_0(loss_type, scale):
    B, G, T = 3, 4, 5
    logp, ref, mask, chosen, ref_chosen, c_mask, rewards = _batch(B, G, T)
    A = common.group_advantages(rewards, G, scale=scale)
    loss, _ = orapo_loss(
        logp, ref, A, mask, np.zeros(B), G, chosen, ref_chosen, c_mask, beta=0.04, loss_type=loss_type, max_len=8
    )
    pure, _ = common.grpo_loss(logp, ref, A, mask, 0.04, loss_type, max_completion_length=8)
    torch.testing.assert_close(loss, pure)
    g1, g_chosen = torch.autograd.grad(loss, (logp, chosen))
    torch.testing.assert_close(g1, torch.autograd.grad(pure, logp)[0])
    assert not g_chosen.any()  # lambda 0: the ground-truth report gets no gradient


def test_mixed_loss_is_ln_dpo_at_lambda_1_written_out():
    B, G = 3, 4
    logp, ref, mask, chosen, ref_chosen, c_mask, rewards = _batch(B, G)
    A = common.group_advantages(rewards, G, scale="none")
    loss, _ = orapo_loss(logp, ref, A, mask, np.ones(B), G, chosen, ref_chosen, c_mask, dpo_beta=2.0, max_len=8)

    def mean(x, m):
        return (x * m).sum(1) / m.sum(1)

    # Eq. 5-7 and 12 by hand: mean per-token log-ratio of the ground truth minus that of each completion
    c = (mean(chosen, c_mask) - mean(ref_chosen, c_mask)).repeat_interleave(G)  # (B*G,)
    h = 2.0 * (c - (mean(logp, mask) - mean(ref, mask)))
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(h).mean())


def test_mixed_loss_mixes_per_prompt():
    B, G = 3, 4
    logp, ref, mask, chosen, ref_chosen, c_mask, rewards = _batch(B, G)
    A = common.group_advantages(rewards, G, scale="std")
    assert (A[:G] == 0).all()  # the zero-reward group: no advantage, no NaN
    lam = np.array([0.5, 0.05, 0.2])
    loss, _ = orapo_loss(logp, ref, A, mask, lam, G, chosen, ref_chosen, c_mask, loss_type="grpo")
    parts = []
    for q in range(B):
        g, c = slice(q * G, (q + 1) * G), slice(q, q + 1)
        lg, _ = common.grpo_loss(logp[g], ref[g], A[g], mask[g], loss_type="grpo")
        ld, _ = orapo.dpo_loss(
            chosen[c].expand(G, -1),
            logp[g],
            ref_chosen[c].expand(G, -1),
            ref[g],
            2.0,
            True,
            c_mask[c].expand(G, -1),
            mask[g],
        )
        parts.append((1 - lam[q]) * lg + lam[q] * ld)
    torch.testing.assert_close(loss, torch.stack(parts).mean())
    with pytest.raises(ValueError, match="chosen_logp"):
        orapo_loss(logp, ref, A, mask, lam, G)


def test_one_pass_rows_carry_each_studys_samples_then_its_ground_truth(small_synthetic):
    """with_chosen: row q (G + 1) + G is study q's ground truth, the rows before it its samples (not another study's);
    samples_and_chosen gives both back at their own widths. The tiny model scores such rows in two passes, bit for bit
    the two passes scored before the one-pass rows (the sandbox's committed numbers), gradients too."""
    torch.manual_seed(0)
    records = common.load_data(str(small_synthetic))["train"][:3]
    policy = common.make_policy("tiny", [r.report for r in records], "cpu", max_new_tokens=24)
    prompts = policy.prompt_batch([[common.load_image(p) for p in r.image_paths] for r in records])
    G, reports = 2, ["no effusion.", "mild edema.", "heart size is normal."]
    ids, mask = policy.generate(prompts, 24, n=G)
    assert ids.shape[1] > policy.encode_targets(reports)[0].shape[1]  # the two kinds of rows of other widths
    roll = common.Rollout(prompts, ids, mask, policy.decode(ids, mask), torch.arange(6.0))
    rows = orapo.with_chosen(policy, roll, reports, G)
    assert rows.texts[G :: G + 1] == reports and rows.texts[0] == roll.texts[0] and rows.texts[G + 1] == roll.texts[G]
    c_ids, c_mask = policy.encode_targets(reports)
    logp = policy.completion_logprobs(rows.prompts, rows.completion_ids, rows.completion_mask)
    (samples, chosen), (s_mask, c_mask_back) = (
        orapo.samples_and_chosen(x, rows.completion_mask, G) for x in (logp, rows.completion_mask)
    )
    apart = policy.completion_logprobs(prompts, ids, mask), policy.completion_logprobs(prompts, c_ids, c_mask)
    assert torch.equal(samples, apart[0]) and torch.equal(chosen, apart[1])  # the same bits
    assert torch.equal(s_mask, mask) and torch.equal(c_mask_back, c_mask)
    weights = [p for p in policy.model.parameters() if p.requires_grad]
    one = torch.autograd.grad(samples.sum() + 2 * chosen.sum(), weights)
    two = torch.autograd.grad(apart[0].sum() + 2 * apart[1].sum(), weights)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_dpo_step_raises_the_ground_truth_over_the_samples(small_synthetic):
    torch.manual_seed(0)
    records = common.load_data(str(small_synthetic))["train"][:2]
    policy = common.make_policy("tiny", [r.report for r in records], "cpu", max_new_tokens=24)
    ref = copy.deepcopy(policy)
    prompts = policy.prompt_batch([[common.load_image(p) for p in r.image_paths] for r in records])
    G = 4
    ids, mask = policy.generate(prompts, 24, n=G)  # the rejected samples
    c_ids, c_mask = policy.encode_targets([r.report for r in records])
    ref_logp, ref_c = (
        common.reference_logprobs(ref, common.Rollout(prompts, ids, mask, [], None)),
        common.reference_logprobs(ref, common.Rollout(prompts, c_ids, c_mask, [], None)),
    )
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.05)

    def mean(x, m):
        return (x * m).sum(1) / m.sum(1)

    for k in range(4):
        loss, s = orapo_loss(
            policy.completion_logprobs(prompts, ids, mask),
            ref_logp,
            torch.zeros(2 * G),
            mask,
            np.ones(2),
            G,
            policy.completion_logprobs(prompts, c_ids, c_mask),
            ref_c,
            c_mask,
            max_len=24,
        )
        if k == 0:  # the policy is its reference: margin 0, L_DPO = log 2
            assert loss.item() == pytest.approx(math.log(2), abs=1e-6) and s["dpo_margin"] == 0
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert s["dpo_accuracy"] == 1.0 and s["dpo_margin"] > 0 and loss.item() < math.log(2)  # before the 4th step
    with torch.no_grad():
        up = mean(policy.completion_logprobs(prompts, c_ids, c_mask), c_mask) - mean(ref_c, c_mask)  # (2,)
        down = (mean(policy.completion_logprobs(prompts, ids, mask), mask) - mean(ref_logp, mask)).view(2, G)
    assert (up[:, None] > down).all() and down.mean() < 0  # the ground truth gained on every sample; samples lost


# --------------------------------------------------------------------------- Eq. 13-15
def test_sentence_facts_split_sentences_and_contrast_clauses():
    facts = SentenceFacts()(
        [
            "Mild cardiomegaly. No pneumothorax, effusion, or consolidation; heart size 1.5 cm.",
            "No focal consolidation, but there is a small left effusion.",
            "",
            " . ",
        ]
    )
    assert facts == [
        ["Mild cardiomegaly", "No pneumothorax, effusion, or consolidation", "heart size 1.5 cm"],
        ["No focal consolidation", "there is a small left effusion"],
        [],
        [],
    ]


GT = labels(Cardiomegaly=1, Edema=1, Pleural_Effusion=0)  # two findings present, effusion ruled out


@pytest.mark.parametrize(
    "report, p, r",
    [
        ("Mild cardiomegaly. There is mild pulmonary edema.", 1.0, 1.0),  # both found
        ("Mild cardiomegaly.", 1.0, 0.5),  # edema missed
        ("The heart is mildly enlarged. There is a small right pleural effusion.", 0.5, 0.5),  # effusion unsupported
        ("No pulmonary edema. Mild cardiomegaly.", 0.5, 0.5),  # contradiction: a false positive as well as a miss
        ("There is mild pulmonary edema. No pulmonary edema. Mild cardiomegaly.", 2 / 3, 1.0),  # self-contradiction
        ("Possible mild cardiomegaly.", 1.0, 0.5),  # uncertain counts as claimed present
        ("No pleural effusion.", 0.0, 0.0),  # true, but no ground-truth finding: No Finding claimed, wrongly
        ("", 0.0, 0.0),  # empty: nothing claimed
        (" . ;\n", 0.0, 0.0),  # punctuation only: no fact
    ],
)
def test_facts_reward_by_hand(report, p, r):
    f = (1 + 4) * p * r / (4 * p + r) if p + r else 0.0  # Eq. 15 with beta 2, the beta a run uses (ours: none given)
    reward, stats = facts_reward([report], GT, SentenceFacts(), common.RuleLabeler())  # as train() calls it
    assert reward[0] == pytest.approx(f, abs=1e-6)
    assert (stats["facts_precision"], stats["facts_recall"]) == pytest.approx((p, r))


def test_facts_reward_recall_weighting_and_no_finding():
    lab, ex = common.RuleLabeler(), SentenceFacts()
    # P = 1, R = 1/2: F2 = 5 * 0.5 / (4 * 1 + 0.5) = 0.556 < F1 = 2 * 0.5 / 1.5 = 0.667 (beta 2 punishes the miss)
    assert facts_reward(["Mild cardiomegaly."], GT, ex, lab, beta=2.0)[0][0] == pytest.approx(2.5 / 4.5, abs=1e-6)
    assert facts_reward(["Mild cardiomegaly."], GT, ex, lab, beta=1.0)[0][0] == pytest.approx(2 / 3, abs=1e-6)
    normal = labels(Pleural_Effusion=0, No_Finding=1)  # a normal study: No Finding is its one positive label
    rewards, _ = facts_reward(
        ["The lungs are clear. No pleural effusion.", "Small left pleural effusion.", "", ". ;"],
        np.repeat(normal, 4, 0),
        ex,
        lab,
    )
    np.testing.assert_allclose(rewards, [1.0, 0.0, 0.0, 0.0], atol=1e-6)  # no fact claims no No Finding


def test_llm_fact_extractor_with_a_local_model(monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "no", "pleural", "effusion", "mild", "cardiomegaly", "report", "list", "the"]
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(words), n_embd=16, n_layer=1, n_head=2, n_positions=256, eos_token_id=1, bos_token_id=1
        )
    )
    monkeypatch.setattr(orapo, "FACT_TOKENS", 6)
    out = orapo.LLMFacts(model=model, tokenizer=tok)(["Mild cardiomegaly.", "", "No pleural effusion."])
    assert out[1] == [] and all(isinstance(f, str) and f for fs in out for f in fs)  # an empty report has no facts
    # the answer's lines, list markers removed: a model that answers with a fixed text
    monkeypatch.setattr(tok, "batch_decode", lambda *a, **k: ["- mild cardiomegaly\n2. no pleural effusion\n\n* \n"])
    assert orapo.LLMFacts(model=model, tokenizer=tok)(["Mild cardiomegaly."]) == [
        ["mild cardiomegaly", "no pleural effusion"]
    ]


# --------------------------------------------------------------------------- data (Sec. 4.1)
def test_balanced_subset_takes_rare_labels_first():
    rng = np.random.default_rng(0)
    lab = np.full((200, 14), np.nan)
    lab[:, L["No Finding"]] = 1.0  # 200 normal studies ...
    rare = rng.choice(200, 6, replace=False)
    lab[rare, L["No Finding"]] = np.nan
    lab[rare, L["Fracture"]] = 1.0  # ... 6 with a fracture
    lab[rare[:2], L["Edema"]] = -1.0  # 2 of them with uncertain edema
    keep = balanced_subset(lab, 20, seed=0)
    assert len(keep) == 20 and set(rare) <= set(keep) and (np.diff(keep) > 0).all()  # every rare study is in
    np.testing.assert_array_equal(keep, balanced_subset(lab, 20, seed=0))  # deterministic
    assert len(balanced_subset(lab, 0, 0)) == 200 and len(balanced_subset(lab, 500, 0)) == 200


def test_balanced_subset_takes_the_label_with_fewest_positives_so_far():
    """Cardiomegaly 100 studies, Edema 10, Fracture 3, disjoint; 9 drawn: the label with the fewest positives so far
    (ties: CheXbert order) gets the next study, so the three take turns: 3 each."""
    lab = np.full((113, 14), np.nan)
    lab[:100, L["Cardiomegaly"]], lab[100:110, L["Edema"]], lab[110:, L["Fracture"]] = 1.0, 1.0, 1.0
    keep = balanced_subset(lab, 9, seed=0)
    assert (np.nansum(lab[keep], 0)[[L["Cardiomegaly"], L["Edema"], L["Fracture"]]] == 3).all()


def test_drop_missing_sections():
    def R(i, **meta):
        return common.Record(str(i), ["x.png"], "report", "train", None, meta)

    records = [
        R(0, section_findings="Clear.", section_impression="Normal."),
        R(1, section_findings="Clear."),
        R(2, section_findings="", section_impression="Normal."),
        R(3, findings={"Edema": {}}),
    ]
    assert [r.id for r in orapo.drop_missing_sections(records)] == ["0"]
    assert len(orapo.drop_missing_sections(records, ())) == 4
    plain = [R(0), R(1, findings={"Edema": {}})]  # no section held as text (synthetic, R2Gen): none checked
    assert len(orapo.drop_missing_sections(plain)) == 2


# --------------------------------------------------------------------------- one step, end to end
@pytest.fixture
def fast(monkeypatch):
    """Small budgets for end-to-end runs on the small synthetic set."""
    monkeypatch.setattr(orapo, "WARM_START", dict(lr=3e-3, batch_size=8))
    monkeypatch.setattr(orapo, "N_EVAL", 4)
    return ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "16", "--sft-steps", "40"]


def independent_facts(texts, gt):
    """Eq. 13-15 written again: sentences, each labelled; present = positive or uncertain in any sentence, absent =
    negative in any; TP, FP (unsupported claims and contradicted ground truth), FN; F2. gt (N, 14)."""
    lab, out = common.RuleLabeler(), []
    for text, y in zip(texts, gt):
        sents = [s for s in text.replace(";", ".").split(". ") if any(ch.isalpha() for ch in s)]
        f = lab(sents) if sents else np.empty((0, 14))
        present = np.isin(f, (1.0, -1.0)).any(0)
        absent = (f == 0.0).any(0)
        present[13] = bool(sents) and not present[:12].any()  # No Finding: nothing but Support Devices claimed
        truth = np.isin(y, (1.0, -1.0))
        tp, fn = (present & truth).sum(), (truth & ~present).sum()
        fp = ((present & ~truth) | (absent & truth)).sum()
        p, r = (tp / (tp + fp) if tp + fp else 0.0), (tp / (tp + fn) if tp + fn else 0.0)
        out.append(5 * p * r / (4 * p + r) if p + r else 0.0)
    return np.array(out)


def test_one_step_feeds_the_losses_the_paper_quantities(tmp_path, small_synthetic, fast, monkeypatch):
    """One training step: the rewards reaching the loss equal FactS written here; Eq. 1-2's dr_grpo advantages;
    the reference's log-probs equal the policy's (step 1); DPO gets the study's reference report (the findings the
    prompt asks for) against the G samples, beta 2, per-token means; and the loss equals Eq. 11 worked by hand:
    at step 1 every log-ratio is 0, so L_DPO = log 2 and L_GRPO(q) = -sum_i A_i |o_i| / (G max_new_tokens), with
    lambda_q = 0.1 + 0.5 (0.3 z_q)^2 (ZRR from 0; m 0.7, lambda 0.1 to 0.6: a swap of m and 1 - m, or of the two
    lambdas, shows)."""
    seen, rolls, steps = {"grpo": [], "dpo": []}, [], []
    real = {"grpo": common.grpo_loss, "dpo": orapo.dpo_loss, "rollout": common.rollout, "step": orapo.orapo_step}
    monkeypatch.setattr(common, "grpo_loss", lambda *a, **k: seen["grpo"].append((a, k)) or real["grpo"](*a, **k))
    monkeypatch.setattr(orapo, "dpo_loss", lambda *a, **k: seen["dpo"].append((a, k)) or real["dpo"](*a, **k))
    monkeypatch.setattr(common, "rollout", lambda *a, **k: rolls.append(real["rollout"](*a, **k)) or rolls[-1])
    monkeypatch.setattr(orapo, "orapo_step", lambda *a, **k: steps.append((a, real["step"](*a, **k))) or steps[-1][1])
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)  # not under test
    monkeypatch.setattr(orapo, "ZRR_MOMENTUM", 0.7)  # Table 6 fixes m at 0.5, where m and 1 - m are equal
    orapo.main(
        [
            "--data",
            str(small_synthetic),
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--lambda-min",
            "0.1",
            "--lambda-max",
            "0.6",
        ]
        + fast
    )
    roll, ((policy, rows, *_), (loss, _)) = rolls[0], steps[0]
    G, B, T = 4, 2, 16
    batch = {"report": rows.texts[G :: G + 1]}  # with_chosen: each study's ground truth after its G samples
    assert rows.texts[:: G + 1] == roll.texts[::G]  # row 0 of each group of G + 1: the study's first sample
    gt = common.RuleLabeler()(batch["report"])
    expected = independent_facts(roll.texts, gt[np.arange(B * G) // G])
    np.testing.assert_allclose(roll.rewards.numpy(), expected, atol=1e-6)
    r = roll.rewards.view(B, G)
    A = (r - r.mean(1, keepdim=True)).flatten()  # Dr. GRPO: no std division
    for q, ((logp, ref_logp, A_q, mask), kw) in enumerate(seen["grpo"]):
        torch.testing.assert_close(A_q, A[q * G : (q + 1) * G])
        assert kw["beta"] == 0.04 and kw["loss_type"] == "dr_grpo" and kw["max_completion_length"] == T
        torch.testing.assert_close(ref_logp, logp.detach(), atol=1e-5, rtol=0)  # step 1: the policy is its reference
    for q, ((chosen, rejected, ref_chosen, ref_rejected, beta), kw) in enumerate(seen["dpo"]):
        assert beta == 2.0 and kw["length_normalize"]
        assert (
            policy.decode(policy.encode_targets([batch["report"][q]])[0], kw["chosen_mask"][:1])[0]
            == policy.decode(*policy.encode_targets([batch["report"][q]]))[0]
        )
        sample_mask = kw["rejected_mask"]  # padded to the longer of the samples and the ground truth: zeros past T
        torch.testing.assert_close(sample_mask[:, :T], roll.completion_mask[q * G : (q + 1) * G])
        assert not sample_mask[:, T:].any()
        torch.testing.assert_close(ref_chosen, chosen.detach(), atol=1e-5, rtol=0)
    z = (r == 0).all(1).float().numpy()
    lam = 0.1 + 0.5 * (0.3 * z) ** 2
    lengths = roll.completion_mask.sum(1)
    l_grpo = -(A * lengths).view(B, G).sum(1) / (G * T)
    assert loss.item() == pytest.approx(float(((1 - lam) * l_grpo.numpy() + lam * math.log(2)).mean()), abs=1e-5)
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert logged["lambda"] == pytest.approx(lam.mean()) and logged["zero_group_ratio"] == z.mean()


def test_end_to_end_tiny_run(tmp_path, small_synthetic, fast, monkeypatch, applied_updates):
    """A short run: the files a user plots, Fig. 2's columns in metrics.jsonl, the val checks of Fig. 2 (right),
    the ZRR state in the checkpoint; --lambda-max 0 is vanilla GRPO; --steps 0 evaluates only. What each optimiser
    step applied: the warm start's constant lr, gradients as the backward left them; RL's lr decaying linearly from
    the tiny model's 5e-4 to 0 over --steps (no warm-up), gradients clipped to MAX_GRAD_NORM (lowered to 0.25 here:
    the tiny run's raw norms are 0.3-1.1, so that every step's shows; test_paper_settings holds TRL's 1.0)."""
    monkeypatch.setattr(orapo, "EVAL_EVERY", 2)
    monkeypatch.setattr(orapo, "MAX_GRAD_NORM", 0.25)
    out = tmp_path / "run"
    orapo.main(["--data", str(small_synthetic), "--out", str(out), "--steps", "4"] + fast)
    warm, rl = applied_updates
    assert_applied(warm, [3e-3] * 40, clip=None)
    assert_applied(rl, [5e-4 * (4 - k) / 4 for k in range(4)], clip=0.25)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert {
        "zero_group_ratio",
        "zrr",
        "lambda",
        "grpo_loss",
        "dpo_loss",
        "dpo_accuracy",
        "dpo_accuracy_x_zero",
        "reward",
        "kl",
        "loss",
        "lr",
        "grad_norm",
    } <= set(lines[0])
    assert all(0.05 <= x["lambda"] <= 0.5 and math.isfinite(x["loss"]) for x in lines)
    assert lines[0]["kl"] == pytest.approx(0, abs=1e-6) and lines[-1]["kl"] > 0  # Eq. 4's KL on by default
    assert "val_f1_pneumonia" in lines[1] and "val_f1_fracture" in lines[1]
    results = json.loads((out / "eval.json").read_text())
    assert set(results) == {"test_before", "test_after"}
    assert 0 <= results["test_after"]["ce"]["macro_f1"] <= 1 and 0 <= results["test_after"]["facts_reward"] <= 1
    gens = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and {"id", "reference", "generated", "facts_reward"} <= set(gens[0])
    zrr = torch.load(out / "last.pt", weights_only=True)["extra"]
    assert len(zrr) == 4 * 2 + 1  # 4 steps x 2 studies, all different in 40, and the minibatch rate
    grpo = tmp_path / "grpo"
    orapo.main(
        [
            "--data",
            str(small_synthetic),
            "--out",
            str(grpo),
            "--steps",
            "2",
            "--lambda-min",
            "0",
            "--lambda-max",
            "0",
            "--beta",
            "0",
            "--loss-type",
            "grpo",
        ]
        + fast
    )
    lines = [json.loads(x) for x in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert all(x["lambda"] == 0 and x["dpo_loss"] == 0 and x["kl"] == 0 for x in lines)  # no reference at all
    assert "zero_group_ratio" in lines[0]  # still tracked: the Fig. 2 baseline
    orapo.main(["--data", str(small_synthetic), "--out", str(tmp_path / "zero"), "--steps", "0"] + fast)
    assert set(json.loads((tmp_path / "zero" / "eval.json").read_text())) == {"test_before"}


def test_bad_input_is_one_line(tmp_path, small_synthetic):
    for flags, message in (
        (["--lambda-min", "0.6"], "--lambda-min <= --lambda-max"),
        (["--facts", "gpt-4.1"], "--facts must be"),
    ):
        with pytest.raises(SystemExit, match=f"^error: .*{message}"):
            orapo.main(["--data", str(small_synthetic), "--out", str(tmp_path / "a"), "--steps", "1"] + flags)
    with pytest.raises(SystemExit):  # argparse: only TRL's three normalisers
        orapo.main(["--loss-type", "dapo"])


def test_resume_matches_an_uninterrupted_run(tmp_path, small_synthetic, fast, monkeypatch, crash_after_checkpoint):
    """Stopped after the step-2 checkpoint and resumed by `--out DIR --resume` alone (the flags from its config.json), a
    run ends with the weights, ZRR state and metrics of one never stopped. Bit for bit: conftest.crash_after_checkpoint
    says why that holds on any CPU."""
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 2)
    flags = ["--data", str(small_synthetic), "--steps", "4"] + fast
    orapo.main(flags + ["--out", str(tmp_path / "full")])
    crash_after_checkpoint(2)
    with pytest.raises(Crash):
        orapo.main(flags + ["--out", str(tmp_path / "part")])
    crash_after_checkpoint(None)
    with pytest.raises(SystemExit, match="--dpo-beta 2.0 in the run, 0.1 now"):
        orapo.main(flags + ["--out", str(tmp_path / "part"), "--resume", "--dpo-beta", "0.1"])
    orapo.main(["--out", str(tmp_path / "part"), "--resume"])
    full, part = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in ("full", "part"))
    assert full["extra"] == part["extra"] and len(full["extra"]) == 9
    assert all(torch.equal(full["model"][k], part["model"][k]) for k in full["model"])
    assert metrics_rows(tmp_path / "full" / "metrics.jsonl") == metrics_rows(tmp_path / "part" / "metrics.jsonl")


def test_the_quick_start_and_your_own_data_get_folders_of_their_own(
    tmp_path, small_synthetic, iu_xray, fast, monkeypatch
):
    """The issue's walk: the quick start, then the script on a real-format folder, both without --out: each run gets
    runs/orapo-<data name> (the default --out once ignored --data and refused the second run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)  # not under test
    for data in (small_synthetic, iu_xray.parent):
        orapo.main(["--data", str(data), "--steps", "1", "--train-size", "32"] + fast + ["--sft-steps", "1"])
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert names == sorted(f"orapo-{d.parent.name}" for d in (small_synthetic, iu_xray))
    assert all((tmp_path / "runs" / name / "eval.json").is_file() for name in names)


@pytest.mark.parametrize("lora", [None, dict(r=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"])])
def test_hugging_face_policy_full_and_lora(tmp_path, small_synthetic, tiny_qwen_dir, lora, monkeypatch):
    """The HF branch on a tiny random Qwen2.5-VL: full fine-tuning against a frozen copy (the paper's), and LoRA
    against the policy with its adapters off; the reference scores the ground-truth report too (KL and DPO 0 at
    step 1: L_DPO = log 2)."""
    monkeypatch.setattr(orapo, "LORA", lora)
    out = tmp_path / "hf"
    short = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--lr", "1e-3"]
    orapo.main(qwen_flags(small_synthetic, tiny_qwen_dir, out, *short, "--max-pixels", str(56 * 56)))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(math.isfinite(x["loss"]) for x in lines)
    assert lines[0]["kl"] == 0.0 and lines[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert (out / "final" / "config.json").is_file()
    assert torch.load(out / "last.pt", weights_only=True)["partial"] == bool(lora)


@pytest.mark.slow
def test_fsdp_hugging_face_policy(tmp_path, small_synthetic, tiny_qwen_dir):
    """torchrun --fsdp on a tiny random Qwen2.5-VL (its decoder layers and vision blocks sharded): the ranks' generate()
    calls stay in step, and final/ (gathered on rank 0) loads in plain transformers with the checkpoint's weights."""
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "hf_fsdp"
    short = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--lr", "1e-3"]
    flags = qwen_flags(small_synthetic, tiny_qwen_dir, out, *short, "--max-pixels", str(56 * 56), "--fsdp")
    torchrun("orapo.py", *flags, timeout=600)
    saved, ckpt = AutoModelForImageTextToText.from_pretrained(out / "final").state_dict(), torch.load(out / "last.pt")
    assert saved.keys() == ckpt["model"].keys() and all(torch.equal(saved[k], v) for k, v in ckpt["model"].items())
    assert all(isinstance(k, str) for k in ckpt["optimizer"]["state"])  # gathered by parameter name: it was sharded


def test_the_tiny_start_is_blind_report_text_until_fluent(tmp_path, small_synthetic, fast, monkeypatch):
    """OraPO's policy has never seen the task: the tiny model's warm start sees each view blank (report text alone),
    validated by the log-likelihood of validation reports, until CONVERGE stops it; then RL sees the images."""
    monkeypatch.setattr(orapo, "CONVERGE", dict(every=2, patience=1, min_gain=100.0, max_steps=40))
    seen = []
    real = common.TinyPolicy.prompt_batch

    def spy(self, images, text=None):
        seen.append(max(view.getextrema()[1] for views in images for view in views))  # the brightest pixel
        return real(self, images, text)

    monkeypatch.setattr(common.TinyPolicy, "prompt_batch", spy)
    flags = [f for f in fast if f not in ("--sft-steps", "40")]
    orapo.main(["--data", str(small_synthetic), "--out", str(tmp_path / "o"), "--steps", "1"] + flags)
    stage = json.loads((tmp_path / "o" / "warm_start" / "eval.json").read_text())
    assert stage["steps"] == 4 and stage["converge"]["best_step"] == 2  # step 2's fluency, then no gain of 100
    assert stage["converge"]["best"] < 0  # a mean token log-likelihood
    warm_start = 4 + 2  # training batches, and the validations at steps 2 and 4
    assert seen[:warm_start] == [0] * warm_start and min(seen[warm_start:]) > 0  # blank, then the real images


def test_grad_accum_samples_once_a_step_and_keeps_the_gradient(tmp_path, small_synthetic, monkeypatch):
    """--grad-accum k (OraPO had none): one generate() call a step whatever k (1, 2, 4), the same completions, and the
    gradient of k micro-batches (Eq. 8-10 once over the step's studies, each micro-batch's studies at their own
    lambda, Eq. 11's loss in parts) that of the whole step, to float noise."""
    steps = ["--steps", "1", "--sft-steps", "0", "--prompts-per-step", "4", "--max-new-tokens", "12"]

    def reward(texts, *a, **k):  # the first half of the studies all 0 (z = 1: a larger lambda), the rest by length
        return np.array([0.0 if n < len(texts) // 2 else len(t) % 7 for n, t in enumerate(texts)]), {}

    monkeypatch.setattr(orapo, "facts_reward", reward)
    seen = {}
    for k in (1, 2, 4):
        argv = ["--data", str(small_synthetic), "--out", str(tmp_path / f"k{k}"), *steps, "--group-size", "4"]
        seen[k] = one_step_in_micro_batches(monkeypatch, orapo.main, argv, k)
    assert [seen[k][0] for k in (1, 2, 4)] == [1, 1, 1]
    assert seen[4][1] == seen[1][1] and len(set(seen[1][1])) > 1
    torch.testing.assert_close(seen[4][2], seen[1][2], rtol=1e-4, atol=1e-6)
    assert seen[1][2].abs().max() > 1e-3


def test_balanced_subset_counts_uncertain_ground_truth_as_positive():
    """Sec. 4.1's balanced subset reads the labeler's labels as FactS does (uncertain present): a study uncertain for
    Fracture alone is in Fracture's pool, taken first (its label has the fewest positives, ahead of No Finding's)."""
    y = np.full((3, 14), np.nan)
    y[0, common.LABEL_INDEX["Fracture"]] = -1  # uncertain only
    y[2, common.LABEL_INDEX["No Finding"]] = 1
    assert balanced_subset(y, 1, seed=0).tolist() == [0]
    y[0, common.LABEL_INDEX["Fracture"]] = 0  # a negative is no positive: No Finding's study instead
    assert balanced_subset(y, 1, seed=0).tolist() == [2]
