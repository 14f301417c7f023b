"""MRG-R1: MCCS (Eq. 3-6) and the format reward by hand, Eq. 2's advantages, the Table II reward rows,
what one training step feeds Eq. 1's loss, and end-to-end runs (tiny model, torchrun, resume, Qwen)."""

import json
import math
import re

import numpy as np
import pytest
import torch

import common
import mrg_r1
import reports
from conftest import (
    Crash,
    assert_applied,
    fake_eval,
    labels,
    metrics_rows,
    one_step_in_micro_batches,
    qwen_flags,
)
from mrg_r1 import extract_report, format_reward, grpo_advantages, mccs, signed_label_vectors

L = common.LABEL_INDEX


def test_signed_vectors_eq3_drop_no_finding():
    z = signed_label_vectors(labels(Cardiomegaly=1, Edema=0, Atelectasis=-1, No_Finding=1))
    expected = np.zeros(13)
    expected[L["Cardiomegaly"]], expected[L["Edema"]], expected[L["Atelectasis"]] = 1, -1, 1
    np.testing.assert_array_equal(z, [expected])


def test_mccs_by_hand():
    assert mccs(labels(Cardiomegaly=1, Edema=0), labels(Cardiomegaly=1, Edema=0), 0.5)[0] == pytest.approx(1.0)
    assert mccs(labels(Cardiomegaly=0, Edema=1), labels(Cardiomegaly=1, Edema=0), 0.5)[0] == 0.0  # CCS -1
    assert mccs(labels(Edema=-1), labels(Edema=1), 0.5)[0] == pytest.approx(1.0)  # uncertain counts as positive
    # z = (1, 1, 0), z* = (1, 0, 1): CCS = 1 / (sqrt 2 sqrt 2) = 0.5
    h, r = labels(Cardiomegaly=1, Edema=1), labels(Cardiomegaly=1, Atelectasis=1)
    assert [mccs(h, r, m)[0] for m in (0.5, 0.0, -0.5)] == pytest.approx([0.0, 0.5, (0.5 + 0.5) / 1.5])
    # three agree, one negated: <z, z*> = 3 - 1 = 2, norms 2 and 2 -> CCS 0.5 -> (0.5 - 0.2) / 0.8
    h = labels(Cardiomegaly=1, Edema=1, Atelectasis=1, Pneumothorax=0)
    r = labels(Cardiomegaly=1, Edema=1, Atelectasis=1, Pneumothorax=1)
    assert mccs(h, r, 0.2)[0] == pytest.approx(0.375)
    assert mccs(labels(Edema=1, No_Finding=1), labels(Edema=1), 0.5)[0] == pytest.approx(1.0)  # No Finding ignored
    # Eq. 5-6 as written: two reports silent on all 13 findings have CCS 0 -> MCCS 0 for m >= 0
    assert mccs(labels(No_Finding=1), labels(No_Finding=1), 0.5)[0] == 0.0
    assert mccs(labels(), labels(Edema=1), -0.5)[0] == pytest.approx(0.5 / 1.5)


@pytest.mark.parametrize(
    "text, score",
    [
        ("<think> effusion </think> <report> Small effusion. </report>", 1.0),
        ("<think>a</think>\n<report>b</report>\n", 1.0),
        ("<think> </think> <report> Small effusion. </report>", 0.5),  # empty think: minor
        ("Sure. <think> a </think> <report> b </report>", 0.5),  # text outside: minor
        ("<think> a </think> extra <report> b </report>", 0.5),  # text between: minor
        ("<think> a </think> <report> </report>", 0.0),  # empty report
        ("<report> b </report> <think> a </think>", 0.0),  # wrong order
        ("<think> a </think> <report> b", 0.0),  # unbalanced
        ("<think> a </think> <think> a </think> <report> b </report>", 0.0),  # repeated
        ("Small effusion.", 0.0),
    ],
)
def test_format_reward(text, score):
    assert format_reward(text, partial=0.5) == score


GOOD = "<think> effusion </think> <report> Small effusion. </report>"


def _malformed():
    """Every way an answer can be malformed, from GOOD, with the credit format_reward's docstring gives
    (partial 0.3)."""
    out = []
    for tag in mrg_r1.TAGS:  # each tag missing, or repeated (before itself and at the end)
        out += [(GOOD.replace(tag, ""), 0.0), (GOOD.replace(tag, tag + " " + tag), 0.0), (GOOD + " " + tag, 0.0)]
    order = [("<think>", " effusion "), ("</think>", " "), ("<report>", " Small effusion. "), ("</report>", "")]
    for i in range(3):  # two neighbouring tags exchanged
        o = list(order)
        o[i], o[i + 1] = (o[i + 1][0], o[i][1]), (o[i][0], o[i + 1][1])
        out.append(("".join(t + x for t, x in o), 0.0))
    out += [
        ("<think> effusion </think> <report>  \n </report>", 0.0),  # empty report
        ("<think> a <report> b </report> </think>", 0.0),  # nested: </think> after the report
        ("<think> \n </think> <report> Small effusion. </report>", 0.3),  # empty think: minor
        ("Sure. " + GOOD, 0.3),
        (GOOD + " Done.", 0.3),  # text before or after the tags: minor
        ("<think> effusion </think> so <report> Small effusion. </report>", 0.3),  # text between: minor
        ("Sure. <think> </think> <report> x </report> Done.", 0.3),  # several minor violations: still partial
        ("Small effusion.", 0.0),
        ("", 0.0),
        (GOOD, 1.0),
        ("\n<think>a</think><report>b</report>\n", 1.0),
    ]
    return out


@pytest.mark.parametrize("text, score", _malformed())
def test_format_reward_every_malformation(text, score):
    assert format_reward(text, partial=0.3) == score


def test_extract_report():
    assert extract_report("<think> x </think> <report> Small effusion. </report>") == "Small effusion."
    assert extract_report("Small effusion.") == ""
    assert (
        extract_report("<report>\nSmall effusion.\nNo pneumothorax.\n</report>") == "Small effusion.\nNo pneumothorax."
    )
    assert extract_report("<report> a </report> <report> b </report>") == "a"  # the first one
    assert extract_report("<think> x </think> <report> unclosed") == "" and extract_report("<report></report>") == ""


def test_eq2_advantages_population_std_eps_inside():
    A = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]), 4, eps=1e-6)
    sd = math.sqrt(0.1875 + 1e-6)  # group 1: mean 0.25, population variance (0.5625 + 3 x 0.0625) / 4
    torch.testing.assert_close(A[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / sd)
    assert (A[4:] == 0).all()  # identical rewards: exactly zero, no NaN
    # a group whose spread is below eps: eps inside the root dominates. Mean 2.5e-4, population variance 1.875e-7:
    # A = (-2.5e-4, 7.5e-4, -2.5e-4, -2.5e-4) / sqrt(1.875e-7 + 1e-6), not / (sqrt(1.875e-7) + 1e-6) (2.5 times larger)
    A = grpo_advantages(torch.tensor([0.0, 1e-3, 0.0, 0.0], dtype=torch.float64), 4, eps=1e-6)
    torch.testing.assert_close(
        A, torch.tensor([-2.5e-4, 7.5e-4, -2.5e-4, -2.5e-4], dtype=torch.float64) / math.sqrt(1.1875e-6)
    )


def test_table_ii_rows_by_hand():
    lab = common.RuleLabeler()
    tagged = "<think> edema </think> <report> Mild pulmonary edema. </report>"
    bare, ref = "Mild pulmonary edema.", ["Mild pulmonary edema."]
    r, terms = mrg_r1.total_reward([tagged, bare], ref * 2, lab, "mccs+format", 0.0)
    np.testing.assert_allclose(r, [0.75 * 1 + 0.25 * 1, 0.0])  # the bare answer has no <report>: scored ""
    assert terms == {"reward_mccs": pytest.approx(0.5), "reward_format": 0.5}
    assert mrg_r1.total_reward([bare], ref, lab, "mccs", 0.0)[0] == pytest.approx([1.0])  # no tags
    assert mrg_r1.total_reward([tagged], ref, lab, "format", 0.5)[0] == pytest.approx([1.0])
    # CE-F1: positives {Edema, Lung Opacity} vs {Edema}: 2 x 1 / (2 + 1)
    two = "Mild pulmonary edema. Hazy left lung opacity."
    assert mrg_r1.total_reward([two], ref, lab, "ce_f1", 0.5)[0] == pytest.approx([2 / 3])
    r, _ = mrg_r1.total_reward([f"<think> a </think> <report> {two} </report>"], ref, lab, "ce_f1+format", 0.5)
    assert r == pytest.approx([0.75 * 2 / 3 + 0.25])
    # clinical 1 with format 0.5 (text outside the tags): 0.75 x 1 + 0.25 x 0.5, and the reverse
    r, terms = mrg_r1.total_reward(
        ["Sure. " + tagged, "<think> x </think> <report> No pleural effusion. </report>"],
        ref * 2,
        lab,
        "mccs+format",
        0.0,
    )
    np.testing.assert_allclose(r, [0.75 + 0.25 * 0.5, 0.25])  # the second: MCCS 0 (no shared finding), format 1


def test_nlg_reward_uses_the_training_corpus_frequencies():
    df = mrg_r1.cider_document_frequency(["mild pulmonary edema .", "no pleural effusion .", "heart size is normal ."])
    hyp = "mild pulmonary edema ."
    alone = mrg_r1.total_reward([hyp], [hyp], None, "nlg", 0.5, df)[0][0]
    batched = mrg_r1.total_reward([hyp, "no effusion ."], [hyp, "heart size is normal ."], None, "nlg", 0.5, df)[0][0]
    # BLEU-4 1 + ROUGE-L 1 + CIDEr-D: idf of each n-gram log(3 / df); every n-gram of the pair matches
    assert alone == pytest.approx(batched) and alone > 2 + 1


def test_cider_with_document_frequencies_of_a_fixed_corpus():
    texts = ["the heart is normal", "small left pleural effusion seen"]
    corpus = mrg_r1.cider_document_frequency(texts)
    df, n = corpus
    assert n == 2 and df["heart"] == 1 and df[("the", "heart")] == 1  # unigrams are plain strings
    # with the scored references as the corpus, nothing changes
    assert common.nlg_metrics(texts, texts, meteor=False, cider_df=corpus)["CIDEr"] == pytest.approx(10.0)
    # a single pair now scores like it does inside the corpus (without a corpus it is 0)
    assert common.nlg_metrics(texts[:1], texts[:1], meteor=False, cider_df=corpus)["CIDEr"] == pytest.approx(10.0)
    # each reference is its own document: an n-gram in both references has df 2 and idf 0
    df2, _ = mrg_r1.cider_document_frequency(["no effusion", "no pneumothorax"])
    assert df2["no"] == 2
    # an n-gram no corpus document has gets df 1 (CiderScorer's max(1, df)): idf log(N), as in the norms.
    # "a b" against "a c", corpus {"a x", "y z"}: every unigram has idf log 2, so order 1 scores 1/2
    # (a matches, b and c do not), orders 2-4 nothing: CIDEr-D = 10 x (1/2) / 4
    unseen = mrg_r1.cider_document_frequency(["a x", "y z"])
    assert common.nlg_metrics(["a c"], ["a b"], meteor=False, cider_df=unseen)["CIDEr"] == pytest.approx(1.25)
    assert common.nlg_metrics(["q r s t"], ["q r s t"], meteor=False, cider_df=unseen)["CIDEr"] == pytest.approx(10.0)


def test_split_views_and_warm_start_targets():
    two, one = (
        common.Record("s1", ["/f.png", "/l.png"], "Normal.", "train"),
        common.Record("s2", ["/x.png"], "Edema.", "train"),
    )
    assert [(r.id, r.image_paths) for r in mrg_r1.split_views([two, one])] == [
        ("s1_v0", ["/f.png"]),
        ("s1_v1", ["/l.png"]),
        ("s2", ["/x.png"]),
    ]
    lab = torch.full((2, 14), float("nan"))
    lab[0, L["Cardiomegaly"]] = 1.0  # a labelled record keeps its labels; the other is labelled by the labeler
    batch = {"report": ["Heart size is normal.", "Mild pulmonary edema."], "labels": lab}
    assert mrg_r1.warm_start_targets(batch, common.RuleLabeler(), tags=True) == [
        "<think> cardiomegaly </think> <report> Heart size is normal. </report>",
        "<think> edema </think> <report> Mild pulmonary edema. </report>",
    ]
    assert mrg_r1.warm_start_targets(batch, common.RuleLabeler(), tags=False) == batch["report"]
    lab[0, L["Pleural Effusion"]], lab[0, L["Edema"]] = (
        -1.0,
        0.0,
    )  # uncertain is a finding to reason about, negative not
    assert (
        mrg_r1.warm_start_targets(batch, common.RuleLabeler(), tags=True)[0]
        == "<think> cardiomegaly, pleural effusion </think> <report> Heart size is normal. </report>"
    )


@pytest.fixture
def fast(monkeypatch):
    """Small budgets for end-to-end runs on the small synthetic set."""
    monkeypatch.setattr(mrg_r1, "WARM_START", dict(lr_tiny=3e-3, lr_hf=1e-2, batch_size=8))
    return ["--prompts-per-step", "2", "--max-new-tokens", "24"]


def test_one_step_feeds_eq1_the_paper_quantities(tmp_path, small_synthetic, fast, monkeypatch):
    """What reaches common.grpo_loss in a training step, against values computed here from the completions' texts:
    each completion's reward (0.75 MCCS with --margin 0.25 + 0.25 format, Eq. 3-6 and Sec. III-B1 written out),
    Eq. 2's advantages, the reference's log-probs (equal to the policy's at step 1), dr_grpo's max_new_tokens.
    A 40-step warm start rarely writes a labelled report, so the reward reads texts where every other one is
    a tagged report: the study's own reference, or another training report (MCCS between 0 and 1, not only 0)."""
    seen, rolls, micro = [], [], []
    pool = [r.report for r in common.load_data(str(small_synthetic))["train"]]

    def answers(n):
        return micro[-1]["report"][n // 4] if n % 4 == 1 else pool[n]

    real_decode = common.TinyPolicy.decode
    monkeypatch.setattr(
        common.TinyPolicy,
        "decode",
        lambda self, *a: [
            f"<think> x </think> <report> {answers(n)} </report>" if n % 2 else t
            for n, t in enumerate(real_decode(self, *a))
        ],
    )
    real_loss, real_rollout, real_steps = common.grpo_loss, common.rollout, common.Run.steps
    monkeypatch.setattr(common, "grpo_loss", lambda *a, **k: seen.append((a, k)) or real_loss(*a, **k))
    monkeypatch.setattr(common, "rollout", lambda *a, **k: rolls.append(real_rollout(*a, **k)) or rolls[-1])

    def steps(self, *a, **k):  # every batch a loop draws: the last, the RL step's
        for step, batch in real_steps(self, *a, **k):
            micro.append(batch)
            yield step, batch

    monkeypatch.setattr(common.Run, "steps", steps)
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)  # not under test
    mrg_r1.main(
        [
            "--data",
            str(small_synthetic),
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--sft-steps",
            "40",
            "--margin",
            "0.25",
        ]
        + fast
    )
    (logp, ref_logp, A, mask), kw = seen[0]
    roll, G = rolls[0], 4
    references = [micro[0]["report"][n // G] for n in range(len(roll.texts))]  # completion n answers study n // G
    lab = common.RuleLabeler()
    keep = [i for i, name in enumerate(common.CHEXPERT_LABELS) if name != "No Finding"]
    found = [re.search("<report>(.*?)</report>", t, re.DOTALL) for t in roll.texts]
    inside = [m.group(1).strip() if m else "" for m in found]
    z, zr = (
        np.select([x == 1, x == -1, x == 0], [1.0, 1.0, -1.0], 0.0)
        for x in (lab(inside)[:, keep], lab(references)[:, keep])
    )
    cos = (z * zr).sum(1) / ((np.linalg.norm(z, axis=1) + 1e-8) * (np.linalg.norm(zr, axis=1) + 1e-8))

    def fmt(t):
        """Sec. III-B1 written out: each tag once, in order; 0.5 for text outside / between or an empty think."""
        m = re.fullmatch(r"(.*)<think>(.*)</think>(.*)<report>(.*)</report>(.*)", t, re.DOTALL)
        if not m or any(t.count(tag) != 1 for tag in mrg_r1.TAGS) or not m.group(4).strip():
            return 0.0
        return 1.0 if m.group(2).strip() and not (m.group(1) + m.group(3) + m.group(5)).strip() else 0.5

    mccs = np.maximum((cos - 0.25) / 0.75, 0)
    np.testing.assert_allclose(
        roll.rewards.numpy(), 0.75 * mccs + 0.25 * np.array([fmt(t) for t in roll.texts]), atol=1e-6
    )
    assert mccs.max() > 0 and roll.rewards.std() > 0  # a clinical reward that varies reached the loss
    c = roll.rewards.view(-1, G) - roll.rewards.view(-1, G).mean(1, keepdim=True)
    torch.testing.assert_close(A, (c / torch.sqrt(c.pow(2).mean(1, keepdim=True) + 1e-6)).flatten())
    assert kw["loss_type"] == "dr_grpo" and kw["max_completion_length"] == 24 and kw["beta"] == 0.04
    torch.testing.assert_close(mask, roll.completion_mask)
    torch.testing.assert_close(ref_logp, logp.detach(), atol=1e-5, rtol=0)  # step 1: the policy is its reference


def test_policy_gradient_raises_the_best_completion(small_synthetic):
    """Eq. 1-2 with non-zero advantages: one step raises log pi(o|q) of the group's best completion and lowers
    the worst; dr_grpo's gradient is Eq. 1's per sequence, -sum_i A_i grad log pi(o_i|q) / (N max_new_tokens)."""
    data = common.load_data(str(small_synthetic))
    torch.manual_seed(0)
    policy = common.make_policy("tiny", [r.report for r in data["train"]], "cpu", max_new_tokens=16)
    prompts = policy.prompt_batch([[common.load_image(p) for p in data["train"][0].image_paths]])  # 4 rows of it
    words = data["train"][0].report.split()
    texts = [" ".join(words[:n]) for n in (2, 5, 9, 3)]
    ids, mask = policy.encode_targets(texts)
    roll = common.Rollout(prompts, ids, mask, texts, torch.tensor([0.0, 1.0, 0.25, 0.5]))

    def seq_logp():
        return (policy.completion_logprobs(prompts, ids, mask) * mask).sum(1)

    settings = dict(ref_logp=None, G=4, beta=0.0, loss_type="dr_grpo", max_new_tokens=16)

    def grads(loss):
        policy.model.zero_grad(set_to_none=True)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])

    A = grpo_advantages(roll.rewards, 4)
    g_step = grads(mrg_r1.grpo_step(policy, roll, **settings)[0])
    torch.testing.assert_close(g_step, grads(-(A * seq_logp()).sum() / (4 * 16)))
    g_grpo = grads(mrg_r1.grpo_step(policy, roll, **(settings | {"loss_type": "grpo"}))[0])
    assert not torch.allclose(g_grpo / g_grpo.norm(), g_step / g_step.norm(), atol=1e-3)  # TRL's form: another gradient
    before = seq_logp().detach()
    grads(mrg_r1.grpo_step(policy, roll, **settings)[0])
    torch.optim.SGD(policy.model.parameters(), lr=0.5).step()
    after = seq_logp().detach()
    assert after[1] > before[1] and after[0] < before[0]


def test_end_to_end_tiny_run_learns_the_format(tmp_path, small_synthetic, fast, monkeypatch, applied_updates):
    """A short run whose warm start is too short to write the tags well: the sampled reward is non-zero, varies,
    and the policy moves; the files a user plots are there; --steps 0 is Table II's Base + SFT row. What each
    optimiser step applied: the warm start's constant lr, gradients as the backward left them; RL's cosine schedule
    after a linear warm-up, gradients clipped to 0.1 (Sec. IV-B). The warm-up share is half here: 10 % of 4 steps
    rounds to none (test_paper_settings holds the 10 %), half is 2 steps, lr x 1/2, 1, then cos from 1 down."""
    monkeypatch.setattr(mrg_r1, "WARMUP", 0.5)
    out = tmp_path / "run"
    mrg_r1.main(["--data", str(small_synthetic), "--out", str(out), "--steps", "4", "--sft-steps", "40"] + fast)
    warm, rl = applied_updates
    assert_applied(warm, [3e-3] * 40, clip=None)
    cosine = [0.5 * (1 + math.cos(math.pi * (k - 2) / (4 - 2))) for k in (2, 3)]
    assert_applied(rl, [1e-4 * f for f in (1 / 2, 2 / 2, *cosine)], clip=0.1)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert {"reward", "reward_mccs", "reward_format", "kl", "loss", "lr", "grad_norm", "length"} <= set(lines[0])
    assert max(x["reward"] for x in lines) > 0 and len({x["reward"] for x in lines}) > 1
    assert max(x["kl"] for x in lines[1:]) > 0  # the policy left its reference
    results = json.loads((out / "eval.json").read_text())
    assert set(results) == {"test_before", "test_after"}
    gens = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and {"id", "reference", "generated", "completion", "reward"} <= set(gens[0])
    zero = tmp_path / "zero"
    mrg_r1.main(["--data", str(small_synthetic), "--out", str(zero), "--steps", "0", "--sft-steps", "2"] + fast)
    assert set(json.loads((zero / "eval.json").read_text())) == {"test_before"}


def test_lr_zero_is_zero(tmp_path, small_synthetic, fast):
    """--lr 0 is a learning rate of 0 (not "the default"): the policy ends as it started, the warm-started one."""
    flags = ["--data", str(small_synthetic), "--sft-steps", "10"] + fast
    mrg_r1.main(flags + ["--out", str(tmp_path / "base"), "--steps", "0"])
    mrg_r1.main(flags + ["--out", str(tmp_path / "lr0"), "--steps", "2", "--lr", "0"])
    assert all(json.loads(x)["lr"] == 0 for x in (tmp_path / "lr0" / "metrics.jsonl").read_text().splitlines())
    base, lr0 = (
        torch.load(tmp_path / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"] for d in ("base", "lr0")
    )
    assert all(torch.equal(base[k], lr0[k]) for k in base)


def test_bad_input_is_one_line(tmp_path, small_synthetic, capsys):
    with pytest.raises(
        SystemExit, match="^error: --prompts-per-step per process / --grad-accum: 2 is not divisible by 3"
    ):
        mrg_r1.main(
            [
                "--data",
                str(small_synthetic),
                "--out",
                str(tmp_path / "a"),
                "--prompts-per-step",
                "2",
                "--grad-accum",
                "3",
                "--sft-steps",
                "0",
                "--steps",
                "1",
            ]
        )
    with pytest.raises(SystemExit, match="^error: annotation file not found"):
        mrg_r1.main(["--data", str(tmp_path / "nothing.json"), "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()  # nothing written before the inputs are checked


def test_resume_matches_an_uninterrupted_run(tmp_path, small_synthetic, fast, monkeypatch, crash_after_checkpoint):
    """Stopped after the step-2 checkpoint and resumed, a run ends with the weights of one never stopped.
    Bit for bit: conftest.crash_after_checkpoint says why that holds on any CPU."""
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 2)
    flags = ["--data", str(small_synthetic), "--steps", "4", "--sft-steps", "10"] + fast
    mrg_r1.main(flags + ["--out", str(tmp_path / "full")])
    crash_after_checkpoint(2)
    with pytest.raises(Crash):
        mrg_r1.main(flags + ["--out", str(tmp_path / "part")])
    crash_after_checkpoint(None)
    with pytest.raises(SystemExit, match="--margin 0.5 in the run, 0.3 now"):
        mrg_r1.main(flags + ["--out", str(tmp_path / "part"), "--resume", "--margin", "0.3"])
    mrg_r1.main(flags + ["--out", str(tmp_path / "part"), "--resume"])
    full, part = (
        torch.load(tmp_path / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"] for d in ("full", "part")
    )
    assert all(torch.equal(full[k], part[k]) for k in full)
    assert metrics_rows(tmp_path / "full" / "metrics.jsonl") == metrics_rows(tmp_path / "part" / "metrics.jsonl")


def test_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir, fast, monkeypatch):
    """The real path on a tiny random Qwen2.5-VL: a warm start folded into the weights, fresh LoRA on the language
    model, the LoRA-off warm-started model as the reference (KL 0 at step 1), LoRA-only checkpoints, merged save."""
    monkeypatch.setattr(mrg_r1, "LORA", dict(mrg_r1.LORA, r=4, alpha=8))
    rolls, real_rollout = [], common.rollout
    monkeypatch.setattr(common, "rollout", lambda *a, **k: rolls.append(real_rollout(*a, **k)) or rolls[-1])
    out = tmp_path / "hf"  # 64 x 64 views: 4 x 4 patches of 14 px at the default, 2 x 2 under --max-pixels 28 x 28
    short = ["--steps", "2", "--sft-steps", "2", "--max-new-tokens", "8", "--prompts-per-step", "2"]
    mrg_r1.main(qwen_flags(small_synthetic, tiny_qwen_dir, out, *short, "--max-pixels", "784"))
    assert (rolls[0].prompts["image_grid_thw"].prod(-1) == 4).all()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kl"] == 0.0 and all(math.isfinite(x["loss"]) for x in lines)
    ck = torch.load(out / "last.pt", weights_only=True)
    params = [k for k in ck["model"] if "lora_" in k]
    assert ck["partial"] and params and not any("visual" in k for k in params)
    loaded = common.load_policy(out / "final")
    assert not any(isinstance(m, common.LoRALinear) for m in loaded.model.modules())
    # final/ is a Hugging Face model folder: transformers' own from_pretrained reads the same weights (LoRA folded in)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    plain = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert AutoProcessor.from_pretrained(out / "final").tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    theirs, ours = plain.state_dict(), loaded.model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    # and `python tests/reports.py generate` writes its report with the run's prompt and <report> extraction
    study = common.load_annotation(small_synthetic)["test"][0]
    (row,) = reports.generate_reports(out, [(study.id, study.image_paths)])
    completion = common.greedy_reports(loaded, [study], mrg_r1.PROMPTS["tags"], 8, "cpu", torch.float32)[0]
    assert row == {"id": study.id, "views": study.image_paths, "report": mrg_r1.extract_report(completion)}


def test_the_warm_start_is_a_stage_that_resumes(tmp_path, small_synthetic, fast, monkeypatch, crash_after_checkpoint):
    """Stopped inside the warm start (after its step-4 checkpoint), --resume continues it, and the run ends with the
    weights of one never stopped; the stage keeps its own folder (config, metrics, final/)."""
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 4)
    flags = ["--data", str(small_synthetic), "--steps", "2", "--sft-steps", "8"] + fast
    mrg_r1.main(flags + ["--out", str(tmp_path / "full")])
    crash_after_checkpoint(4)
    with pytest.raises(Crash):
        mrg_r1.main(flags + ["--out", str(tmp_path / "part")])
    crash_after_checkpoint(None)
    assert not (tmp_path / "part" / "warm_start" / "final").exists()  # stopped half-way through it
    mrg_r1.main(flags + ["--out", str(tmp_path / "part"), "--resume"])
    stage = metrics_rows(tmp_path / "part" / "warm_start" / "metrics.jsonl")
    assert [r["step"] for r in stage] == list(range(1, 9))  # every warm-start step once
    assert stage == metrics_rows(tmp_path / "full" / "warm_start" / "metrics.jsonl")
    full, part = (
        torch.load(tmp_path / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"] for d in ("full", "part")
    )
    assert all(torch.equal(full[k], part[k]) for k in full)


def test_the_warm_start_converges_by_its_declared_rule(tmp_path, small_synthetic, fast, monkeypatch):
    """Without --sft-steps the tiny model trains until validation stops improving (CONVERGE): validations every
    `every` steps, stopped after `patience` without a gain of `min_gain`, the best validation's weights kept."""
    monkeypatch.setattr(mrg_r1, "CONVERGE", dict(every=2, patience=2, min_gain=1.0, max_steps=40))  # no gain is 1.0
    monkeypatch.setattr(mrg_r1, "N_VAL", 4)
    mrg_r1.main(["--data", str(small_synthetic), "--out", str(tmp_path / "c"), "--steps", "0"] + fast)
    stage = tmp_path / "c" / "warm_start"
    result = json.loads((stage / "eval.json").read_text())
    # the first validation (step 2) is the best any F1 can be beaten by 1.0; two more without: stop after step 6
    assert result["steps"] == 6 and result["converge"]["best_step"] == 2 and result["converge"]["waited"] == 2
    assert sorted(p.name for p in stage.glob("eval_val_step*.json")) == [f"eval_val_step{k}.json" for k in (2, 4, 6)]
    rows = metrics_rows(stage / "metrics.jsonl")
    assert [r["step"] for r in rows if "validation" in r] == [2, 4, 6]
    # the best weights are step 2's: those of a warm start of 2 steps (validating draws no random number)
    mrg_r1.main(
        ["--data", str(small_synthetic), "--out", str(tmp_path / "two"), "--steps", "0", "--sft-steps", "2"] + fast
    )
    best, two = (
        torch.load(tmp_path / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"] for d in ("c", "two")
    )
    assert all(torch.equal(best[k], two[k]) for k in best)


def test_convergence_by_hand():
    """The rule on a made-up curve: a gain counts only when it reaches min_gain over the best."""
    model = torch.nn.Linear(1, 1)
    rule = common.Convergence(every=1, patience=2, min_gain=0.01, max_steps=100)
    for step, score in enumerate([0.50, 0.60, 0.605, 0.62, 0.615, 0.625], 1):
        with torch.no_grad():
            model.weight.fill_(step)
        rule.update(score, step, model)
    # best 0.62 at step 4 (0.605 is < 0.60 + 0.01; 0.625 < 0.62 + 0.01): two validations since, converged
    assert (rule.best, rule.best_step, rule.waited, rule.converged) == (0.62, 4, 2, True)
    assert rule.best_weights["weight"].item() == 4.0


def test_grad_accum_samples_once_a_step_and_keeps_the_gradient(tmp_path, small_synthetic, monkeypatch):
    """--grad-accum k: one generate() call a step whatever k (1, 2, 4), the same completions (one seed), and the
    gradient of k micro-batches that of the whole step, to float noise (sums in another order)."""
    steps = ["--steps", "1", "--sft-steps", "0", "--prompts-per-step", "4", "--max-new-tokens", "12"]
    # a random model scores 0 everywhere: a reward by the completion's length gives every group an advantage
    monkeypatch.setattr(mrg_r1, "total_reward", lambda texts, *a: (np.array([len(t) % 7 for t in texts], float), {}))
    seen = {}
    for k in (1, 2, 4):
        argv = ["--data", str(small_synthetic), "--out", str(tmp_path / f"k{k}"), *steps]
        seen[k] = one_step_in_micro_batches(monkeypatch, mrg_r1.main, argv, k)
    assert [seen[k][0] for k in (1, 2, 4)] == [1, 1, 1]
    assert seen[4][1] == seen[1][1] and len(set(seen[1][1])) > 1
    torch.testing.assert_close(seen[4][2], seen[1][2], rtol=1e-4, atol=1e-6)
    assert seen[1][2].abs().max() > 1e-3  # a gradient that says something


def test_ce_f1_reward_counts_uncertain_as_present():
    """Table II's CE-F1 reward, as its docstring states: positive and uncertain labels are present (binarize's 1),
    negative and blank absent; a report's F1 over the 14 by hand."""
    assert mrg_r1.ce_f1_reward(labels(Cardiomegaly=-1), labels(Cardiomegaly=1))[0] == 1.0
    assert mrg_r1.ce_f1_reward(labels(Cardiomegaly=0), labels(Cardiomegaly=1))[0] == 0.0
    both = labels(Cardiomegaly=1, Edema=-1)  # 2 present; the reference's 1 present: F1 = 2 * 1 / (2 + 1)
    assert mrg_r1.ce_f1_reward(both, labels(Cardiomegaly=1, Edema=0))[0] == pytest.approx(2 / 3)
