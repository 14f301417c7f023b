"""OraPO: ZRR (Eq. 8-9) and lambda (Eq. 10) by hand, the combined loss (Eq. 11-12) at its two
ends, a DPO step on the tiny policy, FactS (Eq. 13-15) on hand-written reports, the balanced
subset, and end-to-end runs (one process, exact resume with the ZRR state, torchrun)."""
import json
import shutil

import numpy as np
import pytest
import torch

import common
import orapo
from conftest import labels, torchrun
from orapo import (SentenceFacts, ZeroRewardRate, balanced_subset, facts_reward, mixing_weight, orapo_loss,
                   zero_reward_indicator)

L = common.LABEL_INDEX


# --------------------------------------------------------------------------- Eq. 8-10
def test_zero_reward_indicator_eq8():
    r = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(zero_reward_indicator(r, 4), [0.0, 1.0, 0.0])


def test_zrr_ema_eq9_by_hand():
    zrr = ZeroRewardRate(momentum=0.9)  # starts at a study's first z
    np.testing.assert_allclose(zrr.update(["a", "b"], np.array([1.0, 0.0])), [1.0, 0.0])
    # a: 0.9 * 1 + 0.1 * 0 = 0.9 ; c is new: its first z = 1
    np.testing.assert_allclose(zrr.update(["a", "c"], np.array([0.0, 1.0])), [0.9, 1.0])
    # a: 0.9 * 0.9 + 0.1 * 0 = 0.81 ; b: 0.9 * 0 + 0.1 * 1 = 0.1
    np.testing.assert_allclose(zrr.update(["a", "b"], np.array([0.0, 1.0])), [0.81, 0.1])
    assert zrr.values == pytest.approx({"a": 0.81, "b": 0.1, "c": 1.0})
    zero = ZeroRewardRate(momentum=0.9, init=0.0)  # an EMA started at 0
    np.testing.assert_allclose(zero.update(["a"], np.array([1.0])), [0.1])
    np.testing.assert_allclose(zero.update(["a"], np.array([1.0])), [0.19])
    batch = ZeroRewardRate(momentum=0.5, scope="batch")  # one EMA of the minibatch's zero-group rate
    np.testing.assert_allclose(batch.update(["a", "b", "c", "d"], np.array([1.0, 1.0, 1.0, 0.0])), [0.75] * 4)
    np.testing.assert_allclose(batch.update(["e", "f"], np.array([0.0, 1.0])), [0.625] * 2)  # 0.5*0.75 + 0.5*0.5
    with pytest.raises(ValueError, match="zrr-scope"):
        ZeroRewardRate(0.9, scope="epoch")


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
def test_combined_loss_is_pure_grpo_at_lambda_0(loss_type, scale):
    B, G, T = 3, 4, 5
    logp, ref, mask, chosen, ref_chosen, c_mask, rewards = _batch(B, G, T)
    A = common.group_advantages(rewards, G, scale=scale)
    loss, stats = orapo_loss(logp, ref, A, mask, np.zeros(B), G, chosen, ref_chosen, c_mask, beta=0.04,
                             loss_type=loss_type, max_len=8)
    pure, _ = common.grpo_loss(logp, None, ref, A, mask, 0.2, 0.2, 0.04, loss_type, max_completion_length=8)
    torch.testing.assert_close(loss, pure)
    g1, g_chosen = torch.autograd.grad(loss, (logp, chosen))
    g2, = torch.autograd.grad(pure, logp)
    torch.testing.assert_close(g1, g2)
    assert not g_chosen.any()  # lambda 0: the ground-truth report gets no gradient
    assert np.isfinite(stats["grpo_loss"]) and np.isfinite(stats["dpo_loss"])


@pytest.mark.parametrize("ln", [True, False])
def test_combined_loss_is_pure_dpo_at_lambda_1(ln):
    B, G = 3, 4
    logp, ref, mask, chosen, ref_chosen, c_mask, rewards = _batch(B, G)
    A = common.group_advantages(rewards, G, scale="none")
    loss, _ = orapo_loss(logp, ref, A, mask, np.ones(B), G, chosen, ref_chosen, c_mask, dpo_beta=0.1, ln_dpo=ln)
    # Eq. 12 written out: the ground truth of prompt q against each of its G completions
    rep = lambda x: x.repeat_interleave(G, dim=0)  # (B*G, Tc)
    pure, _ = common.dpo_loss(rep(chosen), logp, rep(ref_chosen), ref, 0.1, ln, rep(c_mask), mask)
    torch.testing.assert_close(loss, pure)
    for x in (logp, chosen):
        torch.testing.assert_close(torch.autograd.grad(loss, x, retain_graph=True)[0],
                                   torch.autograd.grad(pure, x, retain_graph=True)[0])


def test_combined_loss_mixes_per_prompt_and_zero_groups_stay_finite():
    B, G = 3, 4
    logp, ref, mask, chosen, ref_chosen, c_mask, rewards = _batch(B, G)
    A = common.group_advantages(rewards, G, scale="std")
    assert (A[:G] == 0).all()  # the zero-reward group: no advantage, no NaN
    lam = np.array([0.5, 0.05, 0.2])
    loss, _ = orapo_loss(logp, ref, A, mask, lam, G, chosen, ref_chosen, c_mask, beta=0.0, loss_type="grpo")
    parts = []
    for q in range(B):
        g, c = slice(q * G, (q + 1) * G), slice(q, q + 1)
        lg, _ = common.grpo_loss(logp[g], None, ref[g], A[g], mask[g], loss_type="grpo")
        ld, _ = common.dpo_loss(chosen[c].expand(G, -1), logp[g], ref_chosen[c].expand(G, -1), ref[g], 0.1, True,
                                c_mask[c].expand(G, -1), mask[g])
        parts.append((1 - lam[q]) * lg + lam[q] * ld)
    torch.testing.assert_close(loss, torch.stack(parts).mean())
    assert parts[0].item() == pytest.approx(0.5 * np.log(2), abs=0.2)  # GRPO part 0, DPO part near log 2
    with pytest.raises(ValueError, match="chosen_logp"):
        orapo_loss(logp, ref, A, mask, lam, G)


def test_dpo_step_raises_chosen_logprob(small_synthetic):
    torch.manual_seed(0)
    records = common.load_data(str(small_synthetic))["train"][:2]
    policy = common.TinyPolicy.build([r.report for r in records], max_len=24)
    ref = orapo.copy.deepcopy(policy)
    images = [[common.load_image(p) for p in r.image_paths] for r in records]
    prompts = policy.prompt_batch(images)
    G = 4
    rep = policy.repeat(prompts, G)
    ids, mask = policy.generate(rep, 24)  # the rejected samples
    c_ids, c_mask = policy.encode_targets([r.report for r in records])
    with torch.no_grad():
        ref_logp = ref.completion_logprobs(rep, ids, mask)
        ref_c = ref.completion_logprobs(prompts, c_ids, c_mask)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.5)
    before = (ref_c * c_mask).sum(1) / c_mask.sum(1)
    for _ in range(3):
        loss, s = orapo_loss(policy.completion_logprobs(rep, ids, mask), ref_logp, torch.zeros(2 * G), mask,
                             np.ones(2), G, policy.completion_logprobs(prompts, c_ids, c_mask), ref_c, c_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = (policy.completion_logprobs(prompts, c_ids, c_mask) * c_mask).sum(1) / c_mask.sum(1)
        rejected = (policy.completion_logprobs(rep, ids, mask) * mask).sum() - (ref_logp * mask).sum()
    assert (after > before + 0.05).all(), (before, after)
    assert rejected < 0  # the sampled reports lost probability


# --------------------------------------------------------------------------- Eq. 13-15
def test_sentence_facts_split_sentences_and_contrast_clauses():
    facts = SentenceFacts()(["Mild cardiomegaly. No pneumothorax, effusion, or consolidation; heart size 1.5 cm.",
                             "No focal consolidation, but there is a small left effusion.", "", " . "])
    assert facts == [["Mild cardiomegaly", "No pneumothorax, effusion, or consolidation", "heart size 1.5 cm"],
                     ["No focal consolidation", "there is a small left effusion"], [], []]


GT = labels(Cardiomegaly=1, Edema=1, Pleural_Effusion=0)  # two findings present, effusion ruled out


@pytest.mark.parametrize("report, p, r", [
    ("Mild cardiomegaly. There is mild pulmonary edema.", 1.0, 1.0),  # both found
    ("Mild cardiomegaly.", 1.0, 0.5),  # edema missed
    ("The heart is mildly enlarged. There is a small right pleural effusion.", 0.5, 0.5),  # effusion unsupported
    ("No pulmonary edema. Mild cardiomegaly.", 0.5, 0.5),  # contradiction: a false positive as well as a miss
    ("There is mild pulmonary edema. No pulmonary edema. Mild cardiomegaly.", 2 / 3, 1.0),  # self-contradiction
    ("Possible mild cardiomegaly.", 1.0, 0.5),  # uncertain counts as claimed present
    ("No pleural effusion.", 0.0, 0.0),  # true, but no ground-truth finding: No Finding claimed, wrongly
    ("", 0.0, 0.0),  # empty: nothing claimed
])
def test_facts_reward_by_hand(report, p, r):
    beta = 2.0
    f = (1 + beta ** 2) * p * r / (beta ** 2 * p + r) if p + r else 0.0
    reward, stats = facts_reward([report], GT, SentenceFacts(), common.RuleLabeler(), beta)
    assert reward[0] == pytest.approx(f, abs=1e-6)
    assert (stats["facts_precision"], stats["facts_recall"]) == pytest.approx((p, r))


def test_facts_reward_recall_weighting_and_no_finding():
    lab, ex = common.RuleLabeler(), SentenceFacts()
    # P = 1, R = 1/2: F2 = 5 * 0.5 / (4 * 1 + 0.5) = 0.556 < F1 = 2 * 0.5 / 1.5 = 0.667 (beta 2 punishes the miss)
    r2, _ = facts_reward(["Mild cardiomegaly."], GT, ex, lab, beta=2.0)
    r1, _ = facts_reward(["Mild cardiomegaly."], GT, ex, lab, beta=1.0)
    assert r2[0] == pytest.approx(2.5 / 4.5, abs=1e-6) and r1[0] == pytest.approx(2 / 3, abs=1e-6)
    # a normal study: No Finding is the one positive label; a normal report matches it exactly
    normal = labels(Pleural_Effusion=0, No_Finding=1)
    rewards, _ = facts_reward(["The lungs are clear. No pleural effusion.", "Small left pleural effusion.", ""],
                              np.repeat(normal, 3, 0), ex, lab)
    np.testing.assert_allclose(rewards, [1.0, 0.0, 0.0], atol=1e-6)


def test_llm_fact_extractor_with_a_local_model():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    words = ["<pad>", "<eos>", "<unk>", "no", "pleural", "effusion", "mild", "cardiomegaly", "report", "list", "the"]
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_embd=16, n_layer=1, n_head=2, n_positions=256,
                                       eos_token_id=1, bos_token_id=1))
    ex = orapo.LLMFacts(model=model, tokenizer=tok, max_new_tokens=6, batch_size=2)
    out = ex(["Mild cardiomegaly.", "", "No pleural effusion.", "Mild cardiomegaly."])
    assert out[1] == [] and out[0] == out[3]  # empty report not asked; greedy, batch-independent
    assert all(isinstance(f, str) and f for fs in out for f in fs)
    assert orapo.parse_fact_lines("- mild cardiomegaly\n2. no pleural effusion\n\n* \n") == \
        ["mild cardiomegaly", "no pleural effusion"]
    with pytest.raises(ValueError, match="--facts"):
        orapo.make_fact_extractor("gpt-4.1")


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
    assert len(keep) == 20 and set(rare) <= set(keep)  # every rare study is in
    assert (np.diff(keep) > 0).all()
    np.testing.assert_array_equal(keep, balanced_subset(lab, 20, seed=0))  # deterministic
    assert len(balanced_subset(lab, 0, 0)) == 200 and len(balanced_subset(lab, 500, 0)) == 200


def test_drop_missing_sections():
    R = lambda i, **meta: common.Record(str(i), ["x.png"], "report", "train", None, meta)
    records = [R(0, section_findings="Clear.", section_impression="Normal."), R(1, section_findings="Clear."),
               R(2, section_findings="", section_impression="Normal."), R(3, findings={"Edema": {}})]
    assert [r.id for r in orapo.drop_missing_sections(records, "findings,impression")] == ["0"]
    assert len(orapo.drop_missing_sections(records, "")) == 4
    plain = [R(0), R(1, findings={"Edema": {}})]  # no section held as text (synthetic, R2Gen): none checked
    assert len(orapo.drop_missing_sections(plain, "findings,impression")) == 2


# --------------------------------------------------------------------------- end to end
RUN = ["--steps", "4", "--sft-steps", "3", "--sft-batch-size", "8", "--prompts-per-step", "2", "--group-size", "4",
       "--max-new-tokens", "16", "--n-eval", "4", "--eval-every", "2", "--log-every", "1", "--no-meteor"]


def test_end_to_end_and_exact_resume_with_zrr_state(tmp_path, small_synthetic, monkeypatch):
    out = tmp_path / "run"
    saved = {}
    real_save = common.save_checkpoint

    def save_and_keep(path, *a, **kw):  # keep a copy of the step-2 checkpoint: a run stopped there
        real_save(path, *a, **kw)
        saved.setdefault(a[3], tmp_path / f"step{a[3]}.pt")
        shutil.copy(path, saved[a[3]])

    monkeypatch.setattr(common, "save_checkpoint", save_and_keep)
    orapo.main(["--data", str(small_synthetic), *RUN, "--out", str(out)])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "reward" in x]
    assert [x["step"] for x in train_lines] == [1, 2, 3, 4]
    assert {"zero_group_ratio", "zrr", "lambda", "grpo_loss", "dpo_loss", "reward", "kl", "loss"} <= set(lines[0])
    assert all(0.05 <= x["lambda"] <= 0.5 and np.isfinite(x["loss"]) for x in train_lines)
    # Eq. 4's KL is on by default (beta 0.04): 0 while the policy is the reference, then > 0
    assert json.loads((out / "config.json").read_text())["beta"] == 0.04
    assert train_lines[0]["kl"] == pytest.approx(0, abs=1e-6) and train_lines[-1]["kl"] > 0
    assert any("val_macro_f1" in x for x in lines)
    results = json.loads((out / "eval.json").read_text())
    assert set(results) == {"val_before", "test_before", "val_after", "test_after"}
    after = results["test_after"]
    assert 0 <= after["ce"]["macro_f1"] <= 1 and 0 <= after["facts_reward"] <= 1 and "METEOR" not in after["nlg"]
    gens = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and {"id", "reference", "generated", "facts_reward"} <= set(gens[0])
    final = torch.load(out / "last.pt", weights_only=True)
    assert len(final["extra"]["zrr"]) == 8  # 4 steps x 2 studies, all different in 40

    # the same run stopped after step 2 and resumed: same ZRR state and weights at step 4
    shutil.copy(saved[2], out / "last.pt")
    orapo.main(["--data", str(small_synthetic), *RUN, "--out", str(out), "--resume"])
    again = torch.load(out / "last.pt", weights_only=True)
    assert again["step"] == 4 and again["extra"]["zrr"] == final["extra"]["zrr"]
    for k, v in final["model"].items():
        torch.testing.assert_close(again["model"][k], v)


def test_vanilla_grpo_flag(tmp_path, small_synthetic):
    out = tmp_path / "grpo"
    orapo.main(["--data", str(small_synthetic), *RUN, "--steps", "2", "--no-dpo", "--grpo-loss", "grpo",
                "--beta", "0", "--out", str(out)])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "reward" in x]
    assert all(x["lambda"] == 0 and x["dpo_loss"] == 0 for x in lines)
    assert all(x["kl"] == 0 for x in lines)  # no DPO, no KL: no reference scored at all
    assert "zero_group_ratio" in lines[0]  # still tracked: the Fig. 2 baseline
    with pytest.raises(ValueError, match="grpo-loss"):
        orapo.main(["--data", str(small_synthetic), "--grpo-loss", "dapo", "--out", str(out)])
    with pytest.raises(ValueError, match="fp16"):  # no loss scaling here: refused, not silently wrong
        orapo.main(["--data", str(small_synthetic), "--dtype", "fp16", "--out", str(out)])


def test_torchrun_two_processes(tmp_path, small_synthetic):
    out = tmp_path / "ddp"
    torchrun("orapo.py", "--data", str(small_synthetic), "--steps", "2", "--sft-steps", "2", "--sft-batch-size", "4",
             "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12", "--n-eval", "4",
             "--log-every", "1", "--no-meteor", "--out", str(out))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # rank 0 alone writes
    zrr = torch.load(out / "last.pt", weights_only=True)["extra"]["zrr"]
    assert len(zrr) == 8  # 2 steps x 4 studies (2 per rank): both ranks' prompts in one state
    gens = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shards, in order


@pytest.mark.parametrize("lora, extra", [("0", []), ("4", []), ("0", ["--sft-steps", "2", "--dtype", "bf16"])])
def test_hugging_face_policy_full_and_lora(tmp_path, small_synthetic, tiny_qwen_dir, lora, extra):
    """The HF branch on a tiny random Qwen2.5-VL: full fine-tuning against a frozen copy, LoRA
    against the policy with its adapters off, and a bf16 run with a warm start."""
    out = tmp_path / f"hf{lora}"
    orapo.main(["--data", str(small_synthetic), "--model", str(tiny_qwen_dir), "--lora-r", lora, "--steps", "2",
                "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--n-eval", "2",
                "--log-every", "1", "--lr", "1e-3", "--no-meteor", "--out", str(out), *extra])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(np.isfinite(x["dpo_loss"]) for x in lines)
    assert (out / "final" / "config.json").is_file() and (out / "sft").is_dir() == bool(extra)


@pytest.mark.slow
def test_fig2_orapo_lowers_zero_reward_ratio_default_runs(tmp_path):
    """The README's Fig. 2 comparison: the default synthetic run as OraPO and as vanilla GRPO
    (same seed, data and budget; 2-4 minutes each on 2 cores)."""
    runs = {}
    for name, extra in (("orapo", []), ("grpo", ["--no-dpo"])):
        orapo.main(["--out", str(tmp_path / name), "--no-meteor", *extra])
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        eval_ = json.loads((tmp_path / name / "eval.json").read_text())
        runs[name] = (np.mean([x["zero_group_ratio"] for x in lines if "zero_group_ratio" in x]),
                      eval_["test_after"]["ce"]["macro_f1"])
        print(name, "mean zero-reward group ratio %.3f, test macro F1 %.3f" % runs[name])
    assert runs["orapo"][0] < runs["grpo"][0] and runs["orapo"][1] > runs["grpo"][1]
