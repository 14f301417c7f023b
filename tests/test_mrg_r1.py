"""MRG-R1: MCCS (Eq. 3-6) and the format reward worked out by hand, Eq. 2 advantages, the
reward mix, and a short end-to-end run on the synthetic set with the tiny model."""
import json
import math

import numpy as np
import pytest
import torch

import common
import mrg_r1
from mrg_r1 import extract_report, format_reward, grpo_advantages, mccs, signed_label_vectors

N = np.nan
L = {name: i for i, name in enumerate(common.CHEXPERT_LABELS)}


def labels(**values):
    """One (1, 14) label row: labels(Cardiomegaly=1, Edema=0) (names with spaces via _)."""
    row = np.full((1, 14), np.nan)
    for k, v in values.items():
        row[0, L[k.replace("_", " ")]] = v
    return row


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
    # one side mentions nothing: CCS = 0 / (eps * ...) = 0
    assert mccs(labels(), labels(Edema=1), 0.0)[0] == 0.0
    # both silent on the 13 findings (both normal): the literal Eq. 5 gives 0, the option 1
    normal = labels(No_Finding=1)
    assert mccs(normal, normal, 0.5)[0] == 0.0
    assert mccs(normal, normal, 0.5, both_empty=1.0)[0] == 1.0
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


def test_total_reward_mix_and_ablations():
    args = mrg_r1.Args(margin=0.0)
    good = "<think> edema </think> <report> Mild pulmonary edema. </report>"
    bare = "Mild pulmonary edema."
    refs = ["Mild pulmonary edema."] * 2
    lab = common.RuleLabeler()
    r, terms = mrg_r1.total_reward([good, bare], refs, lab, args)
    np.testing.assert_allclose(r, [0.75 * 1 + 0.25 * 1, 0.0])  # the bare report has no <report>: scored ""
    assert terms == {"mccs": pytest.approx(0.5), "format": 0.5}
    r, _ = mrg_r1.total_reward([good], refs[:1], lab, mrg_r1.Args(reward="ce_f1"))
    np.testing.assert_allclose(r, [1.0])
    r, _ = mrg_r1.total_reward([good, good], refs, lab, mrg_r1.Args(reward="nlg"))
    assert r[0] > 1.0  # BLEU-4 + ROUGE-L (1 each) + CIDEr (0 when every reference is the same)
    with pytest.raises(ValueError, match="unknown part"):
        mrg_r1.total_reward([good], refs[:1], lab, mrg_r1.Args(reward="mccs+bleu"))


def test_end_to_end_tiny_run(tmp_path, small_synthetic):
    out = tmp_path / "run"
    mrg_r1.main(["--data", str(small_synthetic), "--steps", "3", "--sft-steps", "3", "--sft-batch-size", "8",
                 "--prompts-per-step", "2", "--max-new-tokens", "16",
                 "--n-eval", "4", "--eval-every", "2", "--log-every", "1", "--out", str(out)])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "reward" in x] == [1, 2, 3]
    assert {"reward", "kl", "loss", "lr"} <= set(lines[0])
    results = json.loads((out / "eval.json").read_text())
    assert {"before", "after", "test"} <= set(results) and 0 <= results["after"]["reward"] <= 1
    gens = [json.loads(x) for x in (out / "generations_test.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and {"id", "reference", "generated", "completion"} <= set(gens[0])
    assert (out / "last.pt").is_file() and (out / "config.json").is_file()
    # resume from the last checkpoint to a longer run
    mrg_r1.main(["--data", str(small_synthetic), "--steps", "4", "--prompts-per-step", "2", "--max-new-tokens", "16", "--n-eval", "4",
                 "--eval-every", "2", "--log-every", "1", "--out", str(out), "--resume"])
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4


def test_torchrun_two_processes(tmp_path, small_synthetic):
    import os
    import subprocess
    import sys
    root = os.path.dirname(common.__file__)
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           os.path.join(root, "mrg_r1.py"), "--data", str(small_synthetic), "--device", "cpu",
                           "--steps", "2", "--sft-steps", "2", "--sft-batch-size", "4", "--prompts-per-step", "2",
                           "--max-new-tokens", "12",
                           "--n-eval", "4", "--log-every", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # rank 0 alone writes
    gens = [json.loads(x) for x in (out / "generations_test.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [f"test_{k:05d}" for k in range(12)]  # both ranks' shards, in order


def test_end_to_end_hugging_face_path(tmp_path, small_synthetic, tiny_qwen_dir):
    """The real path: a (tiny, random) Qwen2.5-VL through AutoProcessor / AutoModelForImageTextToText,
    LoRA on attention and MLP projections, the LoRA-off base as the KL reference, merged save."""
    out = tmp_path / "hf"
    mrg_r1.main(["--data", str(small_synthetic), "--model", str(tiny_qwen_dir), "--steps", "2",
                 "--prompts-per-step", "2", "--max-new-tokens", "8", "--n-eval", "2", "--lora-r", "4",
                 "--log-every", "1", "--out", str(out)])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(math.isfinite(x["loss"]) and x["kl"] >= 0 for x in lines)
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    reloaded = common.HFPolicy(str(out / "final"))
    assert not any(isinstance(m, common.LoRALinear) for m in reloaded.model.modules())  # LoRA merged on save
