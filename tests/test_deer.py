"""DEER: Eq. 3-5 (D(I), log-rank probabilities, the subset draw), Eq. 7-8 TF-IDF weights, Eq. 9-12
(character spans, word-piece alignment, gradient weights from a tiny random CheXbert), Eq. 6 token
advantages through the GRPO loss, the Eq. 1 reward and its two phases, the Table 6/7 statistics, and
every stage end to end: resume, label-free sampling, torchrun with two processes, the HF path."""
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from conftest import Crash
import deer
from deer import (align_to_tokens, diagnostic_diversity, gamma_at, log_rank_probs, mask_top_tokens, reference_targets,
                  report_f1, reward_diversity, select_subset, tfidf_weights, token_advantages, token_spans)
from test_chexbert import local_tokenizer, tiny_config, vocab_file  # noqa: F401 (vocab_file is a fixture)

N = np.nan
L = {name: i for i, name in enumerate(common.CHEXPERT_LABELS)}


def labels(**values):
    """One (14,) label row: labels(Edema=1, Pleural_Effusion=-1)."""
    row = np.full(14, np.nan)
    for k, v in values.items():
        row[L[k.replace("_", " ")]] = v
    return row


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
    K = [labels(Edema=1, Cardiomegaly=1, Pneumothorax=0),
         labels(Edema=-1, Pneumothorax=0),  # uncertain counts as positive
         labels(Edema=0, Pneumothorax=0, No_Finding=1),
         labels(Pneumothorax=0, No_Finding=1)]
    same = [labels(Edema=1)] * 4
    D = diagnostic_diversity(np.array([K, same]))  # (2, 4, 14)
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
    # one draw: study of rank r is chosen with probability P_r
    draws = [select_subset(ids, D, 0.1, seed=s)["ids"][0] for s in range(3000)]
    P = log_rank_probs(10)
    assert draws.count("s4") / 3000 == pytest.approx(P[0], abs=0.03)
    assert draws.count("s5") / 3000 == pytest.approx(P[9], abs=0.02)
    assert len(select_subset(ids, D, 1.0, seed=1)["ids"]) == 10


# Eq. 7-8 -----------------------------------------------------------------------------------------
def test_tfidf_weights_hand_example():
    eos, pad = 2, 0
    docs = [[5, 6, 7, eos], [5, 6, eos], [5, 8, 8, eos]] + [[5, 6, eos]] * 3  # two groups of G = 3
    ids, mask = common.pad_completions(docs, pad)
    w = tfidf_weights(ids, mask, 3, alpha=4.0)
    # df: 5 -> 3, 6 -> 2, 7 -> 1, 8 -> 1, EOS -> 3; TF = count / length, IDF = log(3 / df)
    expected = torch.tensor([[1, 1 + 4 * 0.25 * math.log(1.5), 1 + 4 * 0.25 * math.log(3), 1],
                             [1, 1 + 4 / 3 * math.log(1.5), 1, 1],  # last column is padding
                             [1, 1 + 4 * 0.5 * math.log(3), 1 + 4 * 0.5 * math.log(3), 1]])
    torch.testing.assert_close(w[:3], expected.float())
    assert (w[3:] == 1).all()  # a group of identical reports: every token in every report
    assert tfidf_weights(ids, mask, 3, 4.0, tf="count")[2, 1] == pytest.approx(1 + 4 * 2 * math.log(3))
    assert tfidf_weights(ids, mask, 3, 4.0, idf="smooth")[0, 0] == pytest.approx(1 + 4 * 0.25 * 1.0)


# Eq. 9-12 ----------------------------------------------------------------------------------------
def test_token_spans_of_the_word_tokenizer():
    report = "Plate-like atelectasis at the left base, no effusion."
    policy = common.TinyPolicy.build([report, "zzqx"])
    tok = policy.tokenizer
    ids, mask = common.pad_completions([tok.encode(report) + [tok.eos_id], tok.encode("zzqx") + [tok.eos_id]], tok.pad_id)
    texts, spans = token_spans(policy, ids, mask)
    assert texts == policy.decode(ids, mask) == [report.lower(), "zzqx"]
    words = [tok.vocab[i] for i in ids[0][mask[0].bool()].tolist()]
    assert [texts[0][a:b] for a, b in spans[0][:4]] == ["plate", "-", "like", " atelectasis"]  # with its space
    assert [texts[0][a:b].strip() for a, b in spans[0][:-1]] == words[:-1]
    assert "".join(texts[0][a:b] for a, b in spans[0]) == texts[0]  # the spans tile the report
    assert spans[0][-1][0] == spans[0][-1][1] == len(texts[0])  # EOS adds no text
    assert len(spans[1]) == 2


def test_align_to_tokens_max_over_overlaps():
    # "small left effusion."  policy tokens: small | left | effusion | . | EOS ; a BPE-like " left"
    spans = [(0, 5), (6, 10), (11, 19), (19, 20), (20, 20), (5, 10)]
    pieces = [(0, 5), (6, 10), (11, 14), (14, 19), (19, 20)]  # small left eff ##usion .
    scores = [0.1, 0.2, 0.5, 0.7, 0.05]
    np.testing.assert_allclose(align_to_tokens(spans, pieces, scores), [0.1, 0.2, 0.7, 0.05, 0.0, 0.2])
    np.testing.assert_allclose(align_to_tokens([(0, 3)], [], []), [0.0])  # nothing for CheXbert to score


@pytest.fixture(scope="module")
def chexbert(vocab_file):  # noqa: F811
    tok = local_tokenizer(vocab_file)
    torch.manual_seed(0)
    return common.CheXbertLabeler(model=common.chexbert_model(tiny_config(tok.vocab_size)), tokenizer=tok, batch_size=4)


def test_reference_targets():
    ref = np.array([labels(Edema=1, Pleural_Effusion=-1, Cardiomegaly=0), labels(No_Finding=1)])
    assert reference_targets(ref) == [["Edema", "Pleural Effusion"], []]
    assert reference_targets(ref, no_finding=True)[1] == ["No Finding"]


def test_gradient_weights_from_chexbert_saliency(chexbert):
    texts = ["small left pleural effusion, zzqx edema.", "no pneumothorax."]
    policy = common.TinyPolicy.build(texts)
    tok = policy.tokenizer
    ids, mask = common.pad_completions([tok.encode(t) + [tok.eos_id] for t in texts], tok.pad_id)
    targets = [["Edema", "Pleural Effusion"], []]  # the second reference has no positive finding
    decoded, spans = token_spans(policy, ids, mask)
    w = deer.gradient_weights(chexbert, decoded, spans, mask, targets, beta=1.0)
    assert (w[1] == 1).all() and (w[0, mask[0] == 0] == 1).all()
    s = chexbert.saliency([decoded[0]], targets[0])[0]
    pieces = dict(zip(s["tokens"], s["saliency"]))
    words = [tok.vocab[i] for i in ids[0][mask[0].bool()].tolist()]
    assert s["tokens"][5:9] == ["z", "##z", "##q", "##x"]  # unknown to CheXbert's vocabulary: four pieces
    for t, word in enumerate(words[:-1]):
        expected = max(s["saliency"][5:9]) if word == "zzqx" else pieces[word]
        assert w[0, t].item() == pytest.approx(1 + expected, rel=1e-5)
    assert w[0, len(words) - 1] == 1  # EOS
    w2 = deer.gradient_weights(chexbert, decoded, spans, mask, targets, beta=2.0)
    torch.testing.assert_close(w2 - 1, 2 * (w - 1))  # Eq. 12: no normalisation


# Eq. 6, Eq. 1, Tables 6-7 ------------------------------------------------------------------------
def test_token_advantages_broadcast_through_grpo_loss():
    A = torch.tensor([1.0, -1.0])
    w = torch.tensor([[1.0, 2.0, 7.0], [3.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    A_t = token_advantages(A, w)
    torch.testing.assert_close(A_t, torch.tensor([[1.0, 2.0, 7.0], [-3.0, -1.0, -1.0]]))
    logp = torch.randn(2, 3, requires_grad=True)
    loss, _ = common.grpo_loss(logp, None, None, A_t, mask, loss_type="grpo")
    # ratio 1: loss = -(1/N) sum_i sum_t A_it m_it / n_i = -((1 + 2) / 2 + (-5) / 3) / 2
    assert loss.item() == pytest.approx(-(1.5 - 5 / 3) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.5, 0.0], [0.5, 1 / 6, 1 / 6]]))
    seq, _ = common.grpo_loss(logp, None, None, A, mask)  # unit weights = sequence advantages
    assert common.grpo_loss(logp, None, None, token_advantages(A, torch.ones(2, 3)), mask)[0].item() == pytest.approx(seq.item())


def test_eq1_reward_and_two_phases():
    lab = common.RuleLabeler()
    ref = "Small left pleural effusion. Mild pulmonary edema."
    texts = [ref, "Small left pleural effusion.", ""]
    ref_labels = lab([ref] * 3)
    r, terms = deer.reward(texts, [ref] * 3, ref_labels, lab, gamma=0.0)
    np.testing.assert_allclose(r, [1.0, 2 / 3, 0.0])  # F1 = 2 TP / (|o| + |y|) = 2 / (1 + 2)
    r, terms = deer.reward(texts, [ref] * 3, ref_labels, lab, gamma=0.25)
    assert r[0] == pytest.approx(1.25) and terms["bleu2"] > 0 and r[1] > 2 / 3 and r[2] == 0
    assert report_f1(np.array([labels()]), np.array([labels()]), both_empty=1.0)[0] == 1.0
    assert [gamma_at(s, 10, 0.5, 0.25) for s in range(10)] == [0.0] * 5 + [0.25] * 5
    assert gamma_at(0, 10, 0.0, 0.25) == 0.25 and gamma_at(9, 10, 1.0, 0.25) == 0.0


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
    policy = common.TinyPolicy.build(reports)
    tok = policy.tokenizer
    ids, mask = common.pad_completions([tok.encode(t) + [tok.eos_id] for t in reports], tok.pad_id)
    top = ["effusion", "mild", "no", "normal"]  # the token with the largest weight in each report
    w = torch.tensor([[9.0 if tok.vocab[i] == t else 1.0 for i in row.tolist()] for row, t in zip(ids, top)])
    w[ids == tok.eos_id] = 99  # EOS is never a candidate, whatever its weight
    lab = common.RuleLabeler()
    effect = deer.masking_effect(policy, lab, ids, mask, w, lab(reports), 0.2, np.random.default_rng(0))
    # "small left pleural ."  Pleural Effusion 1 -> No Finding 1: changed, binary changed, F1 0
    # "pulmonary edema."      Edema 1 as before: unchanged, F1 1
    # "pneumothorax."         Pneumothorax 0 + No Finding 1 -> Pneumothorax 1: changed, binary changed, F1 0
    # "heart size is ."       Cardiomegaly 0 + No Finding 1 -> No Finding 1: changed (0 -> blank), binary the same, F1 1
    assert effect["label_mod_ratio"] == [True, False, True, True]
    assert effect["label_mod_ratio_binary"] == [True, False, True, False]
    assert effect["post_mask_f1"] == [0.0, 1.0, 0.0, 1.0]


def test_ddsampling_is_label_free(small_synthetic):
    records = common.load_data(str(small_synthetic))["train"][:4]
    args = deer.resolve(deer.Args(dd_k=3, max_new_tokens=12))
    policy = common.TinyPolicy.build([r.report for r in records], max_len=12)
    torch.manual_seed(0)
    D = deer.score_chunk(policy, records, common.RuleLabeler(), args)
    torch.manual_seed(0)
    blind = [replace(r, report="", labels=None) for r in records]
    np.testing.assert_array_equal(deer.score_chunk(policy, blind, common.RuleLabeler(), args), D)


def test_bad_flags_and_defaults():
    with pytest.raises(ValueError, match="needs --labeler chexbert"):
        deer.resolve(deer.Args(weighting="grad"))
    with pytest.raises(ValueError, match="--subset must be one of"):
        deer.resolve(deer.Args(subset="half"))
    with pytest.raises(SystemExit, match="unknown command 'train'"):
        deer.main(["train"])
    with pytest.raises(ValueError, match="GradScaler"):  # before any data is read
        deer.main(["sft", "--dtype", "fp16", "--data", "/nonexistent.json"])
    # the tiny model's step counts apply only when no length was asked for
    tiny = deer.resolve(deer.Args())
    assert (tiny.sft_steps, tiny.steps) == (600, 150)
    given = deer.resolve(deer.Args(sft_epochs=2.0, epochs=3.0))
    assert (given.sft_steps, given.steps, given.sft_epochs, given.epochs) == (None, None, 2.0, 3.0)
    hf = deer.resolve(deer.Args(model="some/vlm"))
    assert (hf.sft_steps, hf.steps, hf.epochs, hf.prompts_per_step, hf.grad_accum) == (None, None, 1.0, 64, 8)
    assert deer.local_batches(64, 8, 8, ("prompts-per-step", "grad-accum")) == (8, 1)  # the paper's batch on 8 GPUs
    with pytest.raises(ValueError, match="--prompts-per-step over 3 processes"):
        deer.local_batches(64, 8, 3, ("prompts-per-step", "grad-accum"))


# End to end --------------------------------------------------------------------------------------
def metrics(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def staged(tmp_path_factory, small_synthetic):
    """SFT and DDSampling once for the tests below: (out folder, common flags)."""
    out = tmp_path_factory.mktemp("deer")
    base = ["--data", str(small_synthetic), "--out", str(out), "--max-new-tokens", "16", "--n-eval", "4",
            "--log-every", "1", "--dd-k", "3", "--dd-batch-size", "8", "--sft-steps", "6", "--sft-batch-size", "8",
            "--no-meteor"]
    deer.main(["sft", *base, "--save-every", "3"])
    deer.main(["sample", *base])
    return out, base


def test_sft_and_sample_stages(staged):
    out, base = staged
    losses = [x["sft_loss"] for x in metrics(out / "sft" / "metrics.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (out / "sft" / "final" / "tiny_policy.pt").is_file() and "ce" in json.loads((out / "sft" / "eval.json").read_text())
    sel = json.loads((out / "ddsampling" / "selection.json").read_text())
    assert sel["n_pool"] == 40 and len(sel["ids"]) == 8 == len(set(sel["ids"])) and sel["K"] == 3
    D = [x["D"] for x in sel["ranked"]]
    assert D == sorted(D, reverse=True) and max(D) > 0
    # a run killed mid-way, in the first row of a chunk (rows 16-23: chunk 2), resumes to the same
    # selection: the cut row is dropped, not glued to the next one
    scores = out / "ddsampling" / "scores.0.jsonl"
    full = scores.read_text()
    lines = full.splitlines()
    scores.write_text("\n".join(lines[:16]) + "\n" + lines[16][:9])
    (out / "ddsampling" / "selection.json").unlink()
    with pytest.raises(ValueError, match="--dd-k 3 in the run, 4 now"):  # other flags than the run had
        deer.main(["sample", *base, "--resume", "--dd-k", "4"])
    deer.main(["sample", *base, "--resume", "--sft-lr", "0.5"])  # an SFT flag: no concern of this stage
    assert json.loads((out / "ddsampling" / "selection.json").read_text())["ids"] == sel["ids"]
    assert scores.read_text() == full  # chunks 2-4 scored again, exactly as before


def test_rl_stage_resume_and_grpo_baseline(staged):
    out, base = staged
    rl = base + ["--prompts-per-step", "2", "--save-every", "2"]
    deer.main(["rl", *rl, "--steps", "3"])
    lines = metrics(out / "rl" / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2, 3] and [x["gamma"] for x in lines] == [0, 0, 0.25]
    assert all(x["w_mean"] > 1 for x in lines)  # rule weights (the default with the rule labeler)
    assert {"reward", "f1", "bleu2", "zero_var", "loss"} <= set(lines[0])
    assert all(x["completions"] == 2 * 8 for x in lines)  # 2 studies x G = 8
    gens = [json.loads(x) for x in (out / "rl" / "generations_test.jsonl").read_text().splitlines()]
    assert len(gens) == 4 and (out / "rl" / "final").is_dir()
    deer.main(["rl", *rl, "--steps", "4", "--resume"])
    assert [x["step"] for x in metrics(out / "rl" / "metrics.jsonl")] == [1, 2, 3, 4]
    deer.main(["rl", *rl, "--steps", "2", "--weighting", "none", "--rl-dir", "grpo", "--subset", "random"])
    assert all(x["w_mean"] == 1 for x in metrics(out / "grpo" / "metrics.jsonl"))
    # `all --resume` skips every finished stage
    stamp = (out / "sft" / "final" / "tiny_policy.pt").stat().st_mtime_ns
    deer.main(["all", *rl, "--steps", "4", "--resume"])
    assert (out / "sft" / "final" / "tiny_policy.pt").stat().st_mtime_ns == stamp
    assert len(metrics(out / "rl" / "metrics.jsonl")) == 4


def test_rl_resume_matches_an_uninterrupted_run(staged, monkeypatch, crash_after_checkpoint):
    """Stopped after the step-2 checkpoint and resumed, an RL run ends with the weights and the log
    of a run that was never stopped. The reward is the text's length mod 7, so every step updates."""
    out, base = staged
    monkeypatch.setattr(deer, "reward", lambda texts, refs, ref_labels, labeler, gamma:
                        (np.array([len(t) % 7 / 7 for t in texts]), {"f1": 0.0, "bleu2": 0.0}))
    rl = base + ["--prompts-per-step", "2", "--grad-accum", "2", "--steps", "4", "--save-every", "2"]
    deer.main(["rl", *rl, "--rl-dir", "full"])
    crash_after_checkpoint(2)
    with pytest.raises(Crash):
        deer.main(["rl", *rl, "--rl-dir", "part"])
    crash_after_checkpoint(None)
    with pytest.raises(ValueError, match="--lr 0.0001 in the run, 0.01 now"):  # other flags than the run had
        deer.main(["rl", *rl, "--rl-dir", "part", "--resume", "--lr", "0.01"])
    deer.main(["rl", *rl, "--rl-dir", "part", "--resume"])
    weights = lambda d: torch.load(out / d / "final" / "tiny_policy.pt", weights_only=True)["state_dict"]
    full, part, sft = weights("full"), weights("part"), weights("sft")
    assert all(torch.equal(full[k], part[k]) for k in full)
    assert any(not torch.equal(full[k], sft[k]) for k in full)  # RL changed the weights
    rows = lambda d: [{k: v for k, v in x.items() if k != "time"} for x in metrics(out / d / "metrics.jsonl")]
    assert rows("full") == rows("part") and [x["step"] for x in rows("part")] == [1, 2, 3, 4]
    assert len({x["reward"] for x in rows("part")}) > 1 and all(x["completions"] == 16 for x in rows("part"))


def test_tables_6_and_7(staged):
    out, base = staged
    deer.main(["table7", *base, "--analysis-n", "6"])
    t7 = json.loads((out / "table7.json").read_text())
    assert t7["random_100"]["n_groups"] == 6 and t7["ddsampling"]["n_groups"] == 6
    assert 0 <= t7["ddsampling"]["zero_variance"] <= 1 and 1 <= t7["ddsampling"]["unique_rewards"] <= 8
    deer.main(["table6", *base, "--analysis-n", "4"])
    t6 = json.loads((out / "table6.json").read_text())
    assert set(t6) >= {"random", "rule"} and "grad" not in t6 and t6["n_reports"] == 32
    assert all(0 <= t6[k]["label_mod_ratio"] <= 1 and 0 <= t6[k]["post_mask_f1"] <= 1 for k in ("random", "rule"))


def test_grad_weighting_with_chexbert(staged, chexbert, monkeypatch, tmp_path):
    out, base = staged
    monkeypatch.setattr(common, "make_labeler", lambda *a, **k: chexbert)  # the tiny random CheXbert, offline
    deer.main(["rl", *base, "--labeler", "chexbert", "--steps", "2", "--prompts-per-step", "2", "--rl-dir", "grad"])
    lines = metrics(out / "grad" / "metrics.jsonl")
    assert json.loads((out / "grad" / "config.json").read_text())["weighting"] == "grad"  # auto -> grad
    assert all(x["w_mean"] >= 1 for x in lines) and max(x["w_max"] for x in lines) > 1
    deer.main(["table6", *base, "--labeler", "chexbert", "--analysis-n", "2"])
    assert "grad" in json.loads((out / "table6.json").read_text())


def test_torchrun_two_processes(staged, tmp_path):
    out, base = staged
    ddp = tmp_path / "ddp"
    shutil.copytree(out / "sft", ddp / "sft")  # the same, finished SFT stage: `all --resume` skips it
    root = os.path.dirname(common.__file__)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    # --prompts-per-step is global: 2 studies = 1 per rank; one epoch of 8 studies is 4 steps, whatever the ranks
    flags = [*base[:2], "--out", str(ddp), *base[4:], "--device", "cpu", "--epochs", "0.5", "--prompts-per-step", "2"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           os.path.join(root, "deer.py"), "all", *flags, "--resume"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (ddp / "sft" / "metrics.jsonl").read_text() == (out / "sft" / "metrics.jsonl").read_text()
    single = json.loads((out / "ddsampling" / "selection.json").read_text())
    assert json.loads((ddp / "ddsampling" / "selection.json").read_text())["ids"] == single["ids"]  # same chunks, same seeds
    assert len(list((ddp / "ddsampling").glob("scores.*.jsonl"))) == 2
    lines = metrics(ddp / "rl" / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2]  # rank 0 alone writes
    assert [x["completions"] for x in lines] == [16, 16]  # 1 study x G = 8 on each of 2 ranks
    gens = [json.loads(x) for x in (ddp / "rl" / "generations_test.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(4)]


def test_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir):
    """A tiny random Qwen2.5-VL in bf16: SFT trains the vision tower only (LM frozen) with fp32 master
    weights and checkpoints it alone, DDSampling with nucleus sampling, DiTPO trains everything in fp32;
    --max-pixels reaches the processor; token spans of byte-level BPE tokens tile the decoded report."""
    out = tmp_path / "hf"
    base = ["--data", str(small_synthetic), "--model", str(tiny_qwen_dir), "--out", str(out), "--max-new-tokens", "8",
            "--n-eval", "2", "--log-every", "1", "--dtype", "bf16", "--max-pixels", "6272", "--no-meteor"]
    deer.main(["all", *base, "--sft-steps", "2", "--sft-batch-size", "2", "--sft-lr", "1e-3", "--dd-k", "2",
               "--dd-batch-size", "20", "--steps", "1", "--prompts-per-step", "2", "--grad-accum", "1"])
    sft_ckpt = torch.load(out / "sft" / "last.pt", weights_only=True)
    vision = {n for n, _ in common.HFPolicy(str(tiny_qwen_dir)).vision_and_language()[0].named_parameters()}
    assert sft_ckpt["trainable_only"] and {k.split("visual.")[-1] for k in sft_ckpt["model"]} == vision
    assert all(v.dtype == torch.float32 for v in sft_ckpt["model"].values())  # fp32 master weights
    rl_model = torch.load(out / "rl" / "last.pt", weights_only=True)["model"]
    assert len(rl_model) > len(sft_ckpt["model"]) and all(v.dtype == torch.float32 for v in rl_model.values() if v.is_floating_point())
    before, after = (common.HFPolicy(str(p), dtype=torch.bfloat16) for p in (tiny_qwen_dir, out / "sft" / "final"))
    assert after.processor.image_processor.size["longest_edge"] == 6272  # saved with the policy
    (vis0, lang0), (vis1, lang1) = before.vision_and_language(), after.vision_and_language()
    assert all(torch.equal(a, b) for a, b in zip(lang0.parameters(), lang1.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(vis0.parameters(), vis1.parameters()))
    assert len(json.loads((out / "ddsampling" / "selection.json").read_text())["ids"]) == 8
    assert [x["step"] for x in metrics(out / "rl" / "metrics.jsonl")] == [1]
    ids, mask = after.encode_targets(["Small left pleural effusion.", "No pneumothorax."])
    texts, spans = token_spans(after, ids, mask)
    assert texts == after.decode(ids, mask)
    assert ["".join(t[a:b] for a, b in s) for t, s in zip(texts, spans)] == texts


@pytest.mark.slow
def test_default_run_sft_grpo_ditpo(tmp_path):
    """The README's figures: `deer.py all` (synthetic set, tiny model: SFT, DDSampling, DiTPO with rule
    weights), then GRPO from the same SFT model and subset, same budget and seed; test-set CE F1.
        python -m pytest -q tests/test_deer.py -m slow -s"""
    out = str(tmp_path / "deer")
    deer.main(["all", "--out", out])
    deer.main(["rl", "--out", out, "--weighting", "none", "--rl-dir", "rl_grpo"])
    f1 = {name: json.loads((tmp_path / "deer" / name / "eval.json").read_text())["ce"] for name in ("sft", "rl_grpo", "rl")}
    for name, ce in f1.items():
        print(f"{name}: CE example F1 {ce['example_f1']:.3f}, micro F1 {ce['micro_f1']:.3f}")
    assert f1["rl"]["example_f1"] > f1["sft"]["example_f1"]  # RL with the F1 reward raises CE F1
