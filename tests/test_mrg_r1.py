"""MRG-R1: MCCS (Eq. 3-6) and the format reward worked out by hand, Eq. 2 advantages, the
reward mix, and a short end-to-end run on the synthetic set with the tiny model."""
import json
import math

import numpy as np
import pytest
import torch

import common
from conftest import Crash, labels, torchrun
import mrg_r1
from mrg_r1 import extract_report, format_reward, grpo_advantages, mccs, signed_label_vectors

N = np.nan
L = {name: i for i, name in enumerate(common.CHEXPERT_LABELS)}


def test_signed_vectors_eq3_drop_no_finding():
    z = signed_label_vectors(np.vstack([labels(Cardiomegaly=1, Edema=0, Atelectasis=-1, No_Finding=1)]))
    assert z.shape == (1, 13)
    expected = np.zeros(13)
    expected[L["Cardiomegaly"]], expected[L["Edema"]], expected[L["Atelectasis"]] = 1, -1, 1
    np.testing.assert_array_equal(z[0], expected)


def test_mccs_by_hand():
    m = 0.5
    # exact match -> CCS 1 -> MCCS 1
    assert mccs(labels(Cardiomegaly=1, Edema=0), labels(Cardiomegaly=1, Edema=0), m)[0] == pytest.approx(1.0)
    # polarity reversal on both -> CCS -1 -> 0
    assert mccs(labels(Cardiomegaly=0, Edema=1), labels(Cardiomegaly=1, Edema=0), m)[0] == 0.0
    # uncertain counts as positive (Eq. 3): same vector, reward 1
    assert mccs(labels(Edema=-1), labels(Edema=1), m)[0] == pytest.approx(1.0)
    # one of two shared, one extra: z = (1, 1, 0), z* = (1, 0, 1) -> CCS 1/2 -> (0.5 - 0.5) / 0.5 = 0
    h, r = labels(Cardiomegaly=1, Edema=1), labels(Cardiomegaly=1, Atelectasis=1)
    assert mccs(h, r, 0.5)[0] == pytest.approx(0.0)
    assert mccs(h, r, 0.0)[0] == pytest.approx(0.5)
    assert mccs(h, r, -0.5)[0] == pytest.approx((0.5 + 0.5) / 1.5)
    # three agree, one negated in the hypothesis: <z, z*> = 3 - 1 = 2, norms 2 and 2 -> CCS 0.5
    h = labels(Cardiomegaly=1, Edema=1, Atelectasis=1, Pneumothorax=0)
    r = labels(Cardiomegaly=1, Edema=1, Atelectasis=1, Pneumothorax=1)
    assert mccs(h, r, 0.2)[0] == pytest.approx((0.5 - 0.2) / 0.8)
    # No Finding ignored: differing No Finding does not change anything
    assert mccs(labels(Edema=1, No_Finding=1), labels(Edema=1), m)[0] == pytest.approx(1.0)


def test_mccs_empty_vectors():
    # one side mentions nothing: CCS = 0 / (eps * ...) = 0 -> MCCS = max(-m / (1 - m), 0)
    assert mccs(labels(), labels(Edema=1), 0.0)[0] == 0.0
    # both silent on the 13 findings (both normal): Eq. 5-6 as written give 0 for m >= 0 ...
    normal = labels(No_Finding=1)
    assert mccs(normal, normal, 0.5)[0] == 0.0
    assert mccs(normal, normal, 0.0)[0] == 0.0
    # ... and (0 - m) / (1 - m) > 0 for m < 0: the literal formula is kept, not forced to 0
    assert mccs(normal, normal, -0.5)[0] == pytest.approx(0.5 / 1.5)
    assert mccs(labels(), labels(Edema=1), -0.5)[0] == pytest.approx(0.5 / 1.5)
    # the option overrides the both-empty case only
    assert mccs(normal, normal, 0.5, both_empty=1.0)[0] == 1.0
    assert mccs(normal, normal, -0.5, both_empty=0.0)[0] == 0.0
    assert mccs(labels(), labels(Edema=1), -0.5, both_empty=0.0)[0] == pytest.approx(0.5 / 1.5)
    with pytest.raises(ValueError, match="--margin"):
        mccs(normal, normal, 1.0)


@pytest.mark.parametrize("text, score", [
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
    ("", 0.0),
])
def test_format_reward(text, score):
    assert format_reward(text, partial=0.5) == score


def test_extract_report():
    assert extract_report("<think> x </think> <report> Small effusion. </report>") == "Small effusion."
    assert extract_report("Small effusion.") == ""


def test_eq2_advantages_population_std_eps_inside():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    A = grpo_advantages(r, 4, eps=1e-6)
    # group 1: mean 0.25, population var = (0.5625 + 3 * 0.0625) / 4 = 0.1875
    sd = math.sqrt(0.1875 + 1e-6)
    torch.testing.assert_close(A[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / sd)
    assert (A[4:] == 0).all()  # identical rewards: exactly zero, no NaN


class CountingLabeler:
    """The rule labeler, counting the texts it is asked to label."""

    def __init__(self):
        self.inner, self.texts = common.RuleLabeler(), []

    def __call__(self, reports):
        self.texts += list(reports)
        return self.inner(reports)


def test_total_reward_mix_and_ablations():
    args = mrg_r1.Args(margin=0.0)
    good = "<think> edema </think> <report> Mild pulmonary edema. </report>"
    bare = "Mild pulmonary edema."
    refs = ["Mild pulmonary edema."] * 2
    lab = common.RuleLabeler()
    r, terms = mrg_r1.total_reward([good, bare], refs, lab, args)
    np.testing.assert_allclose(r, [0.75 * 1 + 0.25 * 1, 0.0])  # the bare report has no <report>: scored ""
    assert terms == {"mccs": pytest.approx(0.5), "format": 0.5}
    # Table II rows without the format term: plain prompt, the whole completion is the report
    r, _ = mrg_r1.total_reward([bare], refs[:1], lab, mrg_r1.Args(reward="mccs", margin=0.0))
    np.testing.assert_allclose(r, [1.0])
    r, _ = mrg_r1.total_reward([bare], refs[:1], lab, mrg_r1.Args(reward="mccs", margin=0.0, prompt="tags"))
    np.testing.assert_allclose(r, [0.0])  # asked for tags: no <report>, nothing scored
    r, _ = mrg_r1.total_reward([bare], refs[:1], lab, mrg_r1.Args(reward="ce_f1"))
    np.testing.assert_allclose(r, [1.0])
    with pytest.raises(ValueError, match="unknown part"):
        mrg_r1.total_reward([good], refs[:1], lab, mrg_r1.Args(reward="mccs+bleu"))
    with pytest.raises(ValueError, match="--prompt plain"):
        mrg_r1.total_reward([good], refs[:1], lab, mrg_r1.Args(prompt="plain"))


def test_nlg_reward_cider_from_the_training_corpus():
    args = mrg_r1.Args(reward="nlg")
    train = ["mild pulmonary edema .", "no pleural effusion .", "heart size is normal .", "small left effusion ."]
    df = common.cider_document_frequency(train)
    hyp, ref = "mild pulmonary edema .", "mild pulmonary edema ."
    r1, _ = mrg_r1.total_reward([hyp], [ref], None, args, df)
    # the same pair scored in a batch whose other references differ: the same reward
    r2, _ = mrg_r1.total_reward([hyp, "heart size is normal ."], [ref, "heart size is normal ."], None, args, df)
    assert r1[0] == pytest.approx(r2[0])
    # BLEU-4 1 + ROUGE-L 1 + CIDEr-D (x10 scale: about 10 for an exact match of rare n-grams)
    per = common.nlg_metrics([hyp], [ref], meteor=False, per_sample=True, cider_df=df)["per_sample"]
    assert r1[0] == pytest.approx(per["BLEU-4"][0] + per["ROUGE-L"][0] + per["CIDEr"][0]) and per["CIDEr"][0] > 1
    with pytest.raises(ValueError, match="cider_df"):
        mrg_r1.total_reward([hyp], [ref], None, args)


def test_label_cache_labels_each_reference_once_per_group():
    counter = CountingLabeler()
    cache = common.LabelCache(counter)
    G = 4
    completions = ["<think> a </think> <report> Mild pulmonary edema. </report>"] * 2 + ["<report> x </report>"] * 2
    refs = ["Mild pulmonary edema."] * G  # one study's reference, once per completion
    r_cached, _ = mrg_r1.total_reward(completions, refs, cache, mrg_r1.Args())
    assert sorted(counter.texts) == sorted({"Mild pulmonary edema.", "x"})  # 2 distinct texts, not 8
    r_plain, _ = mrg_r1.total_reward(completions, refs, common.RuleLabeler(), mrg_r1.Args())
    np.testing.assert_array_equal(r_cached, r_plain)


def test_prompt_style_split_views_and_schedule():
    assert mrg_r1.prompt_style(mrg_r1.Args()) == "tags"
    assert mrg_r1.prompt_style(mrg_r1.Args(reward="mccs")) == "plain"
    assert mrg_r1.prompt_style(mrg_r1.Args(reward="nlg", prompt="tags")) == "tags"
    two = common.Record("s1", ["/a/f.png", "/a/l.png"], "Normal.", "train")
    one = common.Record("s2", ["/a/x.png"], "Edema.", "train")
    split = mrg_r1.split_views([two, one])
    assert [(r.id, r.image_paths, r.report) for r in split] == [
        ("s1_v0", ["/a/f.png"], "Normal."), ("s1_v1", ["/a/l.png"], "Normal."), ("s2", ["/a/x.png"], "Edema.")]
    # 10 steps, 1 warm-up step: lr x 1 at step 0, then cosine from 1 down to 0
    f = [mrg_r1.cosine_with_warmup(s, 10, 1) for s in range(10)]
    assert f[0] == 1.0 and f[1] == 1.0 and f[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 9)))
    assert mrg_r1.cosine_with_warmup(0, 10, 4) == 0.25 and mrg_r1.cosine_with_warmup(3, 10, 4) == 1.0


def test_sft_targets_label_unlabelled_references():
    nan = float("nan")
    lab = torch.full((2, 14), nan)
    lab[0, L["Cardiomegaly"]] = 1.0  # labelled record: its labels are used as they are
    batch = {"report": ["Heart size is normal.", "Mild pulmonary edema."], "labels": lab}
    targets = mrg_r1.sft_targets(batch, common.RuleLabeler(), "tags")
    assert targets[0] == "<think> cardiomegaly </think> <report> Heart size is normal. </report>"
    assert targets[1] == "<think> edema </think> <report> Mild pulmonary edema. </report>"  # labelled by the labeler
    assert mrg_r1.sft_targets(batch, common.RuleLabeler(), "plain") == batch["report"]


def hand_rollout(policy, images, texts, rewards, G):
    """A rollout with chosen completions (of different lengths) and rewards."""
    prompts = policy.repeat(policy.prompt_batch(images), G)
    ids, mask = policy.encode_targets(texts)
    return common.Rollout(prompts, ids, mask, texts, torch.tensor(rewards), None, None)


def test_policy_gradient_step_raises_the_best_completion(small_synthetic):
    """Eq. 1-2 with non-zero advantages: one update raises log pi(o|q) of the group's best
    completion and lowers the worst; dr_grpo's gradient is Eq. 1's sequence-level one."""
    data = common.load_data(str(small_synthetic))
    torch.manual_seed(0)
    policy = common.TinyPolicy.build([r.report for r in data["train"]], extra_tokens=mrg_r1.TAGS, max_len=16)
    images = [[common.load_image(p) for p in data["train"][0].image_paths]]
    words = data["train"][0].report.split()
    texts = [" ".join(words[:n]) for n in (2, 5, 9, 3)]  # one group of G = 4, lengths 3..10 with EOS
    roll = hand_rollout(policy, images, texts, [0.0, 1.0, 0.25, 0.5], G=4)
    args = mrg_r1.Args(beta=0.0, max_new_tokens=16)
    seq_logp = lambda: (policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask)
                        * roll.completion_mask).sum(1)
    with torch.no_grad():
        before = seq_logp()
    loss, _ = mrg_r1.policy_loss(policy, roll, args)
    loss.backward()
    torch.optim.SGD(policy.model.parameters(), lr=0.05).step()
    with torch.no_grad():
        after = seq_logp()
    assert after[1] > before[1] and after[0] < before[0]

    def grads(loss):
        policy.model.zero_grad(set_to_none=True)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    # dr_grpo: -sum_i A_i grad log pi(o_i|q) / (N * max_new_tokens), the sequence ratio's gradient
    A = mrg_r1.grpo_advantages(roll.rewards, 4, args.adv_eps)
    g_dr = grads(mrg_r1.policy_loss(policy, roll, mrg_r1.Args(beta=0.0, max_new_tokens=16, loss_type="dr_grpo"))[0])
    g_eq1 = grads(-(A * seq_logp()).sum() / (4 * 16))
    torch.testing.assert_close(g_dr, g_eq1)
    g_grpo = grads(mrg_r1.policy_loss(policy, roll, args)[0])  # per-sequence token means: another gradient
    assert not torch.allclose(g_grpo / g_grpo.norm(), g_dr / g_dr.norm(), atol=1e-3)


def test_evaluate_labels_each_text_once(tmp_path, small_synthetic):
    records = common.load_data(str(small_synthetic))["val"][:4]
    torch.manual_seed(0)
    policy = common.TinyPolicy.build([r.report for r in records], extra_tokens=mrg_r1.TAGS, max_len=8)
    args = mrg_r1.Args(out=str(tmp_path), max_new_tokens=8, prompt="plain", reward="mccs")
    counter = CountingLabeler()
    results = mrg_r1.evaluate(policy, records, counter, args, common.Dist(), "val")
    rows = [json.loads(x) for x in (tmp_path / "generations_val.jsonl").read_text().splitlines()]
    texts = {r["generated"] for r in rows} | {r["reference"] for r in rows}
    assert sorted(counter.texts) == sorted(texts)  # reward and CE metrics share one labelling
    assert results["labeler"] == "CountingLabeler" and results["uncertain_as"] == 1
    ref_labels = common.RuleLabeler()([rows[0]["reference"]])[0]
    assert [np.nan if v is None else v for v in rows[0]["labels"]["reference"]] == pytest.approx(ref_labels.tolist(), nan_ok=True)
    assert len(rows[0]["labels"]["generated"]) == 14


FLAGS = ["--sft-steps", "3", "--sft-batch-size", "8", "--prompts-per-step", "2", "--max-new-tokens", "12",
         "--n-eval", "4", "--eval-every", "2", "--log-every", "1", "--no-meteor"]


def test_end_to_end_tiny_run(tmp_path, small_synthetic):
    out = tmp_path / "run"
    mrg_r1.main(["--data", str(small_synthetic), "--steps", "3", "--out", str(out)] + FLAGS)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "reward" in x] == [1, 2, 3]
    assert {"reward", "reward_mccs", "reward_format", "kl", "loss", "lr", "grad_norm", "completions"} <= set(lines[0])
    assert lines[0]["completions"] == 2 * 4
    # the lr logged is the one the step used: warm-up int(0.1 * 3) = 0 steps, so step 1 runs at the full lr
    assert lines[0]["lr"] == pytest.approx(1e-4)
    results = json.loads((out / "eval.json").read_text())
    assert set(results) == {"val_before", "test_before", "val_after", "test_after"}
    assert 0 <= results["val_after"]["reward"] <= 1
    assert "METEOR" not in results["test_after"]["nlg"]  # --no-meteor (tests skip the Java start)
    gens = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and {"id", "reference", "generated", "completion", "reward", "labels"} <= set(gens[0])
    assert (out / "generations_test_before.jsonl").is_file()
    ck = torch.load(out / "last.pt", weights_only=True)
    assert ck["step"] == 3 and not ck["trainable_only"] and ck["config"]["prompts_per_step"] == 2
    # --steps 0: no RL step, the warm-started model evaluated (Table II's Base + SFT row)
    zero = tmp_path / "zero"
    mrg_r1.main(["--data", str(small_synthetic), "--steps", "0", "--out", str(zero)] + FLAGS)
    assert set(json.loads((zero / "eval.json").read_text())) == {"val_before", "test_before"}
    assert not (zero / "metrics.jsonl").exists() and (zero / "final" / "tiny_policy.pt").is_file()
    with pytest.raises(ValueError, match="--grad-accum"):
        mrg_r1.main(["--data", str(small_synthetic), "--prompts-per-step", "3", "--grad-accum", "2",
                     "--out", str(tmp_path / "bad")])


def test_resume_matches_an_uninterrupted_run(tmp_path, small_synthetic, monkeypatch, crash_after_checkpoint):
    """Stopped after the step-2 checkpoint and resumed, a run ends with the weights of a run that
    was never stopped. The reward depends on the text, so every step really updates."""
    def text_reward(completions, references, labeler, args, cider_df=None):
        return np.array([len(c) % 7 / 7 for c in completions]), {"chars": float(np.mean([len(c) for c in completions]))}
    monkeypatch.setattr(mrg_r1, "total_reward", text_reward)
    flags = ["--data", str(small_synthetic), "--steps", "4"] + FLAGS
    mrg_r1.main(flags + ["--out", str(tmp_path / "full")])
    crash_after_checkpoint(2)
    part = tmp_path / "part"
    with pytest.raises(Crash):
        mrg_r1.main(flags + ["--out", str(part)])
    crash_after_checkpoint(None)
    with pytest.raises(ValueError, match="--lr"):  # other flags than the run had: refused
        mrg_r1.main(flags + ["--out", str(part), "--resume", "--lr", "0.01"])
    mrg_r1.main(flags + ["--out", str(part), "--resume"])

    full = torch.load(tmp_path / "full" / "final" / "tiny_policy.pt", weights_only=True)["state_dict"]
    resumed = torch.load(part / "final" / "tiny_policy.pt", weights_only=True)["state_dict"]
    sft = torch.load(part / "sft" / "tiny_policy.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert any(not torch.equal(full[k], sft[k]) for k in full)  # RL changed the weights
    rows = lambda out: [{k: v for k, v in json.loads(x).items() if k != "time"}
                        for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows(tmp_path / "full") == rows(part)
    assert len({r["reward"] for r in rows(part) if "reward" in r}) > 1
    assert set(json.loads((part / "eval.json").read_text())) == {"val_before", "test_before", "val_after", "test_after"}


def test_torchrun_two_processes(tmp_path, small_synthetic):
    out = tmp_path / "ddp"
    # --prompts-per-step is global: 4 studies = 2 per rank, 16 completions; one epoch of 40 x 0.2 = 2 steps
    torchrun("mrg_r1.py", "--data", str(small_synthetic), "--epochs", "0.2", "--sft-steps", "2", "--sft-batch-size", "4",
             "--prompts-per-step", "4", "--max-new-tokens", "12", "--n-eval", "4", "--log-every", "1", "--no-meteor",
             "--out", str(out))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # rank 0 alone writes
    assert [x["completions"] for x in lines] == [16, 16]  # 2 studies x G 4 on each of 2 ranks
    gens = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shards, in order


def test_end_to_end_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir):
    """The real path: a (tiny, random) Qwen2.5-VL through AutoProcessor / AutoModelForImageTextToText,
    an SFT warm start folded into the weights, fresh LoRA on the language model's attention and MLP
    projections, the LoRA-off warm-started model as the KL reference, LoRA-only checkpoints, merged save."""
    out = tmp_path / "hf"
    mrg_r1.main(["--data", str(small_synthetic), "--model", str(tiny_qwen_dir), "--steps", "2",
                 "--sft-steps", "2", "--sft-batch-size", "2", "--sft-lr", "0.01",
                 "--prompts-per-step", "2", "--max-new-tokens", "8", "--n-eval", "2", "--lora-r", "4",
                 "--log-every", "1", "--no-meteor", "--out", str(out)])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(math.isfinite(x["loss"]) and x["kl"] >= 0 for x in lines)
    # fresh adapters start at B = 0: the policy equals its reference at step 1 only if the
    # reference (LoRA off) is the warm-started model, not the base before SFT
    assert lines[0]["kl"] == 0.0
    ck = torch.load(out / "last.pt", weights_only=True)
    assert ck["trainable_only"] and ck["model"] and all(".lora_" in k for k in ck["model"])
    assert not any("visual" in k for k in ck["model"])  # no LoRA on the vision tower
    assert (out / "sft" / "config.json").is_file()
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    reloaded = common.HFPolicy(str(out / "final"))
    assert not any(isinstance(m, common.LoRALinear) for m in reloaded.model.modules())  # LoRA merged on save
