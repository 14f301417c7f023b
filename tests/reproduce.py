"""Regenerate the README's effect tables and paper figures from declared seeds, and print them from committed results.

    python tests/reproduce.py NAME                     # run the declared seeds, write tests/results/NAME.json, print
    python tests/reproduce.py NAME --report            # run nothing: the README's lines from tests/results/NAME.json
    python tests/reproduce.py NAME --report --readme README.md   # ...and write them between the README's markers
    python tests/reproduce.py NAME --seeds 308-311     # more seeds: an extension, with its own verdicts
    python tests/reproduce.py NAME --dry-run           # the command lines still to run, nothing run
    python tests/reproduce.py NAME --recheck 300 --out runs/recheck   # one seed again, against its committed row
    python tests/reproduce.py labels --gold FILE.csv   # a labeler against radiologists' labels
    python tests/reproduce.py labels --labeler chexbert --gold synthetic   # the sandbox's CheXbert, synthetic test

For NAME (mrg_r1, deer, orapo, rrgcl, dcrrg), each arm of the table is the script's own command line, the same seeds in
every arm (paired), each run in its own folder under --out/NAME. A finished run is skipped (after checking that it ran
this command); a run stopped half-way is continued with --resume, so a sweep can stop (Ctrl-C) and go on later. Then
tests/results/NAME.json gets every run's numbers and, per run, the machine (CPU model, the kernels torch picked), torch
and Python versions, the numeric pins, the project's commit and the command line.

Seeds and the primary comparison (the paper's claim) of each table are declared in EXPERIMENTS below, before a sweep.
The README leads with the primary verdict on the declared seeds; any other seeds are an extension, reported apart with
their own verdicts, never pooled with the declared ones. A verdict is one of the words of `verdict()`.

Runs take one thread each (--jobs of them at once) under the PINS below, skip METEOR (no table uses it) and their own
figures. CPU-minutes per seed, as measured on the development machine, are in each results file and the README.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common

RESULTS = ROOT / "tests" / "results"
PINS = common.NUMERIC_PINS  # one thread, AVX2 kernels in ATen, MKL and oneDNN: a run repeats to the bit
QUIET = {"RRG_METEOR": "0", "RRG_FIGURES": "0"}  # no JVM per run, no figure per run


@dataclass
class Job:
    """One run: `python ROOT/<argv[0]> argv[1:] --out root/<name>`, finished when root/<name>/<done> exists.

    Jobs of one folder (DEER's stages and tables) run one after another; `after` names the folders that must be
    finished first. "{root}" in argv stands for the sweep's folder."""

    name: str
    argv: list
    done: str = "eval.json"
    after: tuple = ()

    def folder(self, root: Path) -> Path:
        return root / self.name


@dataclass
class Claim:
    """A comparison's verdict line: a - b on `metric`. sign +1: the paper says a > b; -1: a < b; 0: a check of the
    sandbox, not a claim (its words say which way it went)."""

    a: str
    b: str
    metric: str
    sign: int
    label: str


@dataclass
class Experiment:
    title: str
    jobs: object  # (seed, declared seeds) -> [Job]
    read: object  # (folder of NAME, seed) -> {arm: {metric: value}, ...}
    metrics: list  # the paired table's columns; the first is the per-seed table's
    comparisons: list  # (a, b, label): the paired table's rows, a - b
    claims: list  # [Claim]: verdict lines, the first is the primary one (the paper's claim)
    declared: list  # the seeds declared before the sweep
    figure: object = None  # (experiment, results, seeds, path) -> None
    extra: object = None  # (results, seeds) -> [markdown lines] printed under the verdicts
    notes: list = field(default_factory=list)


# --- the rule: when a paired difference is an effect, and the words a verdict may use --------------------------------
CLAIM_WORDS = {1: "reproduced", -1: "reversed", 0: "not reproduced"}
CHECK_WORDS = {1: "higher", -1: "lower", 0: "no effect"}


def paired(a, b) -> dict:
    """Paired a - b over seeds: mean, standard error (sample sd / sqrt n), how many seeds have a > b."""
    d = np.asarray(a, float) - np.asarray(b, float)
    se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return {"mean": float(d.mean()), "se": float(se), "positive": int((d > 0).sum()), "n": len(d), "d": d}


def effect_sign(p: dict) -> int:
    """+1 or -1 when the paired difference is an effect by the README's rule, else 0. The rule: the mean is at least two
    standard errors from 0 and has its sign on more than half of the seeds (two seeds at least)."""
    d = p["d"]
    if len(d) < 2 or np.isnan(d).any() or p["mean"] == 0:
        return 0
    sign = 1 if p["mean"] > 0 else -1
    same = int((np.sign(d) == sign).sum())
    return sign if abs(p["mean"]) >= 2 * p["se"] and same > len(d) / 2 else 0


def verdict(p: dict, claim_sign: int) -> str:
    """The word for a paired difference: for a paper's claim (sign +1 or -1) "reproduced" (an effect the claimed way),
    "reversed" (an effect the other way) or "not reproduced"; for a check (sign 0) "higher", "lower" or "no effect"."""
    found = effect_sign(p)
    if claim_sign == 0:
        return CHECK_WORDS[found]
    return CLAIM_WORDS[found * claim_sign]


def difference(p: dict) -> str:
    """'+0.012 ± 0.004 (8 of 8)': mean ± SE, and on how many seeds a > b. n/a: an arm lacks the metric."""
    if math.isnan(p["mean"]):
        return "n/a"
    return f"{p['mean']:+.3f} ± {p['se']:.3f} ({p['positive']} of {p['n']})"


# --- the experiments: jobs per seed, the numbers read back ------------------------------------------------------------
def ce(result: dict) -> float:
    """The paper's headline CE metric of an evaluation (its eval JSON says which)."""
    return result["ce"][result["headline"]]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def mrg_r1_jobs(seed, declared):
    """Table II rows from one converged warm start per seed (`start`: SFT until validation stops improving, then the
    test split), each row the script's default RL from it; one more arm trains 300 more SFT steps instead of RL."""
    start = f"s{seed}/start"
    init = ["--init", f"{{root}}/{start}/warm_start/final"]
    base = ["mrg_r1.py", "--seed", str(seed)]
    jobs = [Job(start, base + ["--steps", "0"])]
    for reward in ("mccs+format", "format", "ce_f1+format"):
        jobs.append(Job(f"s{seed}/{reward}", base + init + ["--reward", reward], after=(start,)))
    jobs.append(Job(f"s{seed}/sft+300", base + init + ["--sft-steps", "300", "--steps", "0"], after=(start,)))
    return jobs


def mrg_r1_arm(result: dict) -> dict:
    return {
        "CE micro F1": ce(result),
        "CE micro precision": result["ce"]["micro_precision"],
        "CE micro recall": result["ce"]["micro_recall"],
        "greedy reward": result["reward"],
        "greedy MCCS": result.get("reward_mccs", math.nan),
    }


def mrg_r1_read(root, seed):
    folder = root / f"s{seed}"
    out = {"warm start": mrg_r1_arm(read_json(folder / "start" / "eval.json")["test_before"])}
    for arm in ("mccs+format", "format", "ce_f1+format"):
        out[arm] = mrg_r1_arm(read_json(folder / arm / "eval.json")["test_after"])
    out["sft+300"] = mrg_r1_arm(read_json(folder / "sft+300" / "eval.json")["test_before"])  # --steps 0: no RL
    converge = read_json(folder / "start" / "warm_start" / "eval.json")
    out["start"] = {"SFT steps": converge["steps"], "best step": converge["converge"]["best_step"]}
    return out


def mrg_r1_starts(results, seeds) -> list[str]:
    """Where each seed's warm start stopped (the declared rule) and which step's weights it kept."""
    starts = [results[s]["start"] for s in seeds]
    each = ", ".join(f"{s}: {int(x['best step'])} of {int(x['SFT steps'])}" for s, x in zip(seeds, starts))
    return ["", f"Warm starts, the step kept of the SFT steps run until validation stopped improving, by seed: {each}."]


def deer_jobs(seed, declared):
    """Each seed its own SFT cold start (until validation stops improving) and DDSampling subset; from them DiTPO with
    gradient weights (deer.py all: the paper's), with rule weights, and GRPO; Tables 6 and 7 on that SFT model."""

    def job(command, *flags, done):
        return Job(f"s{seed}", ["deer.py", command, "--seed", str(seed), *flags], done)

    return [
        job("all", done="rl_grad/eval.json"),
        job("rl", "--weighting", "rule", done="rl_rule/eval.json"),
        job("rl", "--weighting", "none", done="rl_none/eval.json"),
        job("table6", done="table6.json"),
        job("table7", done="table7.json"),
    ]


DEER_ARMS = {"SFT": "sft", "DiTPO (grad)": "rl_grad", "DiTPO (rule)": "rl_rule", "GRPO": "rl_none"}


def deer_read(root, seed):
    folder = root / f"s{seed}"
    out = {}
    for arm, stage in DEER_ARMS.items():
        r = read_json(folder / stage / "eval.json")["test"]
        out[arm] = {"CE example F1": ce(r), "CE micro F1": r["ce"]["micro_f1"], "BLEU-4": r["nlg"]["BLEU-4"]}
    t6 = read_json(folder / "table6.json")
    t7 = read_json(folder / "table7.json")
    for w in ("grad", "rule", "random"):
        out[f"Table 6, {w}"] = {"labels changed": t6[w]["label_mod_ratio_binary"], "F1 after": t6[w]["post_mask_f1"]}
    for s in ("random_100", "ddsampling"):
        out[f"Table 7, {s}"] = {
            "zero-variance groups": t7[s]["zero_variance"],
            "distinct rewards": t7[s]["unique_rewards"],
            "reward std": t7[s]["reward_std"],
        }
    return out


def orapo_jobs(seed, declared):
    """Fig. 2: OraPO against vanilla GRPO (lambda 0), paired by seed."""
    base = ["orapo.py", "--seed", str(seed)]
    return [Job(f"s{seed}/orapo", base), Job(f"s{seed}/grpo", base + ["--lambda-min", "0", "--lambda-max", "0"])]


def dpo_accuracy(lines: list[dict]) -> float:
    """DPO's accuracy on the zero-reward groups of these steps (each step logs accuracy x zero-group share)."""
    zero = sum(x["zero_group_ratio"] for x in lines)
    return sum(x["dpo_accuracy_x_zero"] for x in lines) / zero if zero else math.nan


def orapo_read(root, seed):
    out = {}
    for arm in ("orapo", "grpo"):
        folder = root / f"s{seed}" / arm
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        r = read_json(folder / "eval.json")["test_after"]
        zero = [x["zero_group_ratio"] for x in lines]
        out[arm] = {
            "test macro F1": ce(r),
            "test FactS": r["facts_reward"],
            "distinct test reports": r["degenerate"]["distinct"],  # of the test split's greedy reports
            "zero-reward groups": float(np.mean(zero)),
            "zero-reward groups, first 50 steps": float(np.mean(zero[:50])),
            "zero-reward groups, last 50 steps": float(np.mean(zero[-50:])),
            "curve": zero,
            "mean lambda": float(np.mean([x.get("lambda", 0.0) for x in lines])),  # Eq. 10's DPO weight; GRPO: 0
        }
    lines = [json.loads(x) for x in (root / f"s{seed}" / "orapo" / "metrics.jsonl").read_text().splitlines()]
    out["DPO, first 50 steps"] = {"accuracy on zero-reward groups": dpo_accuracy(lines[:50])}
    out["DPO, last 50 steps"] = {"accuracy on zero-reward groups": dpo_accuracy(lines[-50:])}
    return out


def rrgcl_jobs(seed, declared):
    """Curriculum against random order at equal steps (400), both ways of pairing the difficulty: each seed's own
    measurement and the first declared seed's file for every seed; Table 2's global Root scheduler on the seed's own."""
    own, first = f"s{seed}/measure", f"s{declared[0]}/measure"  # each writes <folder>/difficulty.json
    base = ["rrgcl.py", "--seed", str(seed), "--steps", "400"]

    def difficulty(measure):
        return ["--difficulty", f"{{root}}/{measure}/difficulty.json"]

    return [
        Job(first, ["rrgcl.py", "--seed", str(declared[0]), "--measure-only"]),  # once, whatever seeds run
        Job(own, ["rrgcl.py", "--seed", str(seed), "--measure-only"]),
        Job(f"s{seed}/none", base + ["--scheduler", "none"] + difficulty(own), after=(own,)),
        Job(f"s{seed}/rrgcl", base + difficulty(own), after=(own,)),
        Job(f"s{seed}/rrgcl_first_file", base + difficulty(first), after=(first,)),
        Job(f"s{seed}/root", base + ["--scheduler", "root"] + difficulty(own), after=(own,)),
    ]


def rrgcl_read(root, seed):
    out = {}
    for arm in ("none", "rrgcl", "rrgcl_first_file", "root"):
        r = read_json(root / f"s{seed}" / arm / "eval.json")["test"]
        out[arm] = {
            "CE micro F1": ce(r),
            "CE macro F1": r["ce"]["macro_f1"],
            "BLEU-4": r["nlg"]["BLEU-4"],
            "CIDEr": r["nlg"]["CIDEr"],
        }
    out["schedule"] = read_json(root / f"s{seed}" / "rrgcl" / "schedule.json")
    # --steps is shared over the epochs in proportion to |D_sub(t)| (Alg. 1 l. 11), so a step of epoch t draws from a
    # share |D_sub(t)| / N of the training set: averaged over the steps, sum |D_sub|^2 / (N sum |D_sub|); random order 1
    sizes = np.array(out["schedule"]["subset_sizes"], float)
    out["rrgcl"]["training set in D_sub(t), over steps"] = float((sizes**2).sum() / (sizes.max() * sizes.sum()))
    declared = EXPERIMENTS["rrgcl"].declared
    out["measurer"] = measurer_agreement(root, seed, declared[1] if seed == declared[0] else declared[0])
    return out


def measurer_agreement(root, seed, first) -> dict:
    """How alike this seed's difficulty file and the first declared seed's (the second's, for the first) rank the
    training studies and the classes (Spearman), the difficulty as the curriculum reads it (Eq. 10, Alg. 1 line 2)."""
    from scipy.stats import spearmanr

    import rrgcl

    def ranks(s):
        m = read_json(root / f"s{s}" / "measure" / "difficulty.json")
        dif = rrgcl.sample_difficulty(np.array(m["dif1"]), np.array(m["dif2"]))
        labels = np.array(m["labels"], dtype=float)
        return dif, rrgcl.curriculum_plan(dif, labels)["table"]

    (dif, classes), (dif_first, classes_first) = ranks(seed), ranks(first)
    by_class = [c["difficulty"] for c in classes], [c["difficulty"] for c in classes_first]
    return {
        "Spearman, studies": float(spearmanr(dif, dif_first)[0]),
        "Spearman, classes": float(spearmanr(*by_class)[0]),
    }


TABLE4 = {1: "m1_fft", 2: "m2_fft", 3: "m3_pt", 4: "m4_pt", 5: "m5_fft", 6: "m6_pt", 7: "m7_fft"}


def dcrrg_jobs(seed, declared):
    """Table 4's seven models (dcrrg.py ablation) at the default budgets, one seed each."""
    return [Job(f"s{seed}", ["dcrrg.py", "ablation", "--seed", str(seed)], done="ablation/ablation.json")]


def dcrrg_read(root, seed):
    out = {}
    for model, folder in TABLE4.items():
        r = read_json(root / f"s{seed}" / "ablation" / folder / "eval.json")
        out[f"Model {model}"] = {
            "CE micro F1": ce(r),
            "BLEU-4": r["nlg"]["BLEU-4"],
            "CIDEr": r["nlg"]["CIDEr"],
            "distinct reports": r["degenerate"]["distinct"],
        }
    step1 = read_json(root / f"s{seed}" / "ablation" / "step1" / "eval.json")
    out["Step 1"] = {"AUROC, image": step1["auroc_image"]["mean"], "AUROC, text": step1["auroc_text"]["mean"]}
    retrieval = read_json(root / f"s{seed}" / "ablation" / "step2" / "eval.json")["retrieval"]
    out["Step 2"] = {"retrieval P@1": retrieval["P@1"], "retrieval P@5": retrieval["P@5"]}
    return out


def more_comparisons(title: str, rows: list) -> object:
    """An `extra` table: (a, b, metric, sign, label) rows, each a - b paired by seed with both means and its verdict
    (sign as Claim's); b a number: a against that value (a paper's figure)."""

    def extra(results, seeds) -> list[str]:
        lines = ["", f"| {title} | a: mean ± sd | b: mean ± sd | a - b (mean ± SE, seeds with a > b) | verdict |"]
        lines.append("|---|---|---|---|---|")
        for a, b, metric, sign, label in rows:
            va = values(results, seeds, a, metric)
            if isinstance(b, str):
                vb = values(results, seeds, b, metric)
                sb = f"{np.mean(vb):.3f} ± {np.std(vb, ddof=1):.3f}"
            else:
                vb = [b] * len(seeds)
                sb = f"{b}"
            p = paired(va, vb)
            mean_a = f"{np.mean(va):.3f} ± {np.std(va, ddof=1):.3f}"
            lines.append(f"| {label} | {mean_a} | {sb} | {difference(p)} | {verdict(p, sign)} |")
        return lines

    return extra


# --- the rule labeler against radiologists (NegBio's Open-i gold) ----------------------------------------------------
# NegBio's Open-i gold standard (its examples/openi_gld_std14.csv joined with the reports on the CXR id): ChestX-ray14
# names, 1 = stated present (uncertain and negated are 0, so our uncertain counts absent here), `normal` = no finding.
GOLD_COLUMNS = {
    "Atelectasis": ("Atelectasis",),
    "Cardiomegaly": ("Cardiomegaly",),
    "Pneumonia": ("Pneumonia",),
    "Pneumothorax": ("Pneumothorax",),
    "Consolidation": ("Consolidation",),
    "Edema": ("Edema",),
    "Pleural Effusion": ("Effusion",),
    "Lung Lesion": ("Mass", "Nodule"),
    "No Finding": ("normal",),  # last
}


def gold_agreement(path, labeler) -> dict:
    """Per label precision, recall, F1 and counts of `labeler` against a gold CSV (columns report, the ChestX-ray14
    findings, normal), the micro F1 over the 8 findings and the No Finding rate."""
    import csv

    if not Path(path).is_file():
        raise FileNotFoundError(f"gold CSV not found: {path}")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for column in ["report"] + [c for cols in GOLD_COLUMNS.values() for c in cols]:
        if not rows or column not in rows[0]:
            raise ValueError(f"{path}: no column {column!r} (needs report, the ChestX-ray14 findings and normal)")
        if column == "report":
            continue
        bad = next((n for n, r in enumerate(rows, 2) if r[column] not in ("0", "1")), None)
        if bad:
            raise ValueError(f"{path}:{bad}: column {column!r} is {rows[bad - 2][column]!r}, not 0 or 1")
    gold = np.array([[any(r[c] == "1" for c in cols) for cols in GOLD_COLUMNS.values()] for r in rows])  # (N, 9)
    labels = common.binarize(labeler([r["report"] for r in rows]), uncertain_as=0)
    ours = labels[:, [common.LABEL_INDEX[n] for n in GOLD_COLUMNS]] == 1  # (N, 9)
    tp, fp, fn = (ours & gold).sum(0), (ours & ~gold).sum(0), (~ours & gold).sum(0)  # (9,) each
    out = {}
    for i, (name, *prf) in enumerate(zip(GOLD_COLUMNS, *common._prf(tp, fp, fn))):
        out[name] = dict(zip(("precision", "recall", "f1"), map(float, prf)))
        out[name] |= {"gold": int(gold[:, i].sum()), "ours": int(ours[:, i].sum())}
    out["micro_f1"] = float(common._prf(tp[:8].sum(), fp[:8].sum(), fn[:8].sum())[2])
    out |= {"n": len(rows), "no_finding_rate": float(ours[:, -1].mean()), "normal_rate": float(gold[:, -1].mean())}
    return out


def mention_f1(ours: np.ndarray, gold: np.ndarray) -> float:
    """Micro F1 over the mentions (positive, negative, uncertain; blank is no mention), CheXbert's own measure."""
    tp = fp = fn = 0
    for value in (1, 0, -1):
        o, g = ours == value, gold == value
        tp, fp, fn = tp + (o & g).sum(), fp + (o & ~g).sum(), fn + (~o & g).sum()
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 1.0


def synthetic_labels_table(labeler) -> list[str]:
    """A labeler against the synthetic test split's own labels: per label and micro, the mentions' F1 and the
    positives' (uncertain negative, as CE counts them)."""
    records = common.load_data("synthetic")["test"]
    gold = np.stack([r.labels for r in records])  # (N, 14)
    ours = labeler([r.report for r in records])
    positives = common.ce_metrics(ours, gold, uncertain_as=0)
    lines = [f"{'':<27} mentions F1  positives F1  mentions"]
    for k, name in enumerate(common.CHEXPERT_LABELS):
        mentioned = int((~np.isnan(gold[:, k])).sum())
        f1 = positives["per_label"][name]["f1"]
        lines.append(f"{name:<27} {mention_f1(ours[:, k], gold[:, k]):11.3f} {f1:13.3f} {mentioned:9d}")
    lines.append(
        f"micro F1 over the 14, {len(records)} test reports: mentions {mention_f1(ours, gold):.3f}, "
        f"positives {positives['micro_f1']:.3f}"
    )
    return lines


def labels_table(gold: str, labeler) -> list[str]:
    """The README's rule-labeler table: `python tests/reproduce.py labels --gold FILE.csv [--labeler chexbert]`."""
    out = gold_agreement(gold, labeler)
    lines = [f"{'':<17} precision recall   F1  gold ours"]
    for name in GOLD_COLUMNS:
        o = out[name]
        normal = "  (gold: normal)" if name == "No Finding" else ""
        lines.append(
            f"{name:<17} {o['precision']:9.3f} {o['recall']:6.3f} {o['f1']:6.3f} {o['gold']:5d} {o['ours']:4d}{normal}"
        )
    lines.append(
        f"micro F1 over the 8 findings: {out['micro_f1']:.3f}; No Finding on {out['no_finding_rate']:.1%} of "
        f"{out['n']} reports (gold normal: {out['normal_rate']:.1%}); uncertain counts as absent"
    )
    return lines


# --- tables -----------------------------------------------------------------------------------------------------------
def arms_of(results: dict, seeds: list, metric: str) -> list[str]:
    return [a for a, v in results[seeds[0]].items() if isinstance(v, dict) and metric in v]


def values(results, seeds, arm, metric) -> list[float]:
    return [results[s][arm].get(metric, math.nan) for s in seeds]


def seed_table(exp: Experiment, results: dict, seeds: list) -> list[str]:
    """The headline metric of every arm, a column per seed."""
    head = exp.metrics[0]
    lines = [f"| {head} | " + " | ".join(map(str, seeds)) + " | mean ± sd |", "|---" * (len(seeds) + 2) + "|"]
    for arm in arms_of(results, seeds, head):
        v = values(results, seeds, arm, head)
        cells = " | ".join(f"{x:.3f}" for x in v)
        lines.append(f"| {arm} | {cells} | {np.mean(v):.3f} ± {np.std(v, ddof=1):.3f} |")
    return lines


def paired_table(exp: Experiment, results: dict, seeds: list) -> list[str]:
    """Each comparison a - b on each metric: mean ± SE over seeds, and on how many seeds a > b."""
    lines = [f"| a - b, paired by seed (mean ± SE, seeds with a > b) | {' | '.join(exp.metrics)} |"]
    lines.append("|---" * (len(exp.metrics) + 1) + "|")
    for a, b, label in exp.comparisons:
        cells = [difference(paired(values(results, seeds, a, m), values(results, seeds, b, m))) for m in exp.metrics]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def verdict_lines(exp: Experiment, results: dict, seeds: list) -> list[str]:
    lines = []
    for k, c in enumerate(exp.claims):
        p = paired(values(results, seeds, c.a, c.metric), values(results, seeds, c.b, c.metric))
        kind = "primary: the paper's claim" if k == 0 else ("the paper's" if c.sign else "a check, no claim")
        claimed = {1: ", claimed > 0", -1: ", claimed < 0", 0: ""}[c.sign]
        line = f"- {c.label}, {c.metric}: **{verdict(p, c.sign)}**, {difference(p)}{claimed} ({kind})"
        lines.append(line)
    return lines


def span(seeds: list) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


def machines(runs: dict, seeds: list) -> list[str]:
    """Where the seeds ran: one line when every run shares machine, versions, pins and commit, else one per seed."""

    def key(record):
        m = record["machine"]
        pins = " ".join(f"{k}={v}" for k, v in sorted(record["pins"].items()))
        return (
            f"{m['cpu']} ({m['cpu_capability']} kernels), torch {m['torch']}, Python {m['python']}; pins {pins}; "
            f"commit {record['commit']}"
        )

    launches = {s: [r for job in runs[str(s)].values() for r in job] for s in seeds}
    by_seed = {s: sorted({key(r) for r in launches[s]}) for s in seeds}
    kinds = sorted({k for ks in by_seed.values() for k in ks})
    cpu = sum(r["cpu_s"] for s in seeds for r in launches[s]) / 60 / len(seeds)
    head = f"CPU-minutes per seed: {cpu:.0f}. "
    if len(kinds) == 1:
        return [head + f"Every run: {kinds[0]}."]
    return [head + "Runs differ by machine, versions or commit:"] + [
        f"- seed {s}: {'; '.join(by_seed[s])}" for s in seeds
    ]


def report(name: str, data: dict) -> list[str]:
    """The README's lines for one table, from its results file: the declared seeds' tables and verdicts, then any
    extension seeds apart, then where the runs ran."""
    exp = EXPERIMENTS[name]
    results = {int(s): v["arms"] for s, v in data["seeds"].items()}
    declared = [s for s in exp.declared if s in results]
    lines = [f"<!-- printed by `python tests/reproduce.py {name} --report` from tests/results/{name}.json -->"]
    if declared != exp.declared:
        return lines + interim(name, exp, data, declared)
    extension = sorted(set(results) - set(declared))
    lines += [f"Declared seeds {span(declared)}, `python tests/reproduce.py {name}`:", ""]
    lines += seed_table(exp, results, declared) + [""] + paired_table(exp, results, declared) + [""]
    lines += verdict_lines(exp, results, declared)
    if exp.extra:
        lines += exp.extra(results, declared)
    if extension:
        lines += ["", f"Extension, seeds {span(extension)} (added after the declaration; not pooled with it):", ""]
        lines += paired_table(exp, results, extension) + [""] + verdict_lines(exp, results, extension)
    lines += [""] + machines(data["runs"], declared + extension)
    if "recheck" in data:
        lines.append(recheck_line(data["recheck"]))
    return lines


def sweep_jobs(exp: Experiment, seeds: list[int]) -> list[Job]:
    """The seeds' jobs, a job two seeds share (RRGCL's first file) once."""
    jobs = {}
    for s in seeds:
        for j in exp.jobs(s, exp.declared):
            jobs[j.name, tuple(j.argv)] = j
    return list(jobs.values())


def interim(name: str, exp: Experiment, data: dict, done: list) -> list[str]:
    """A table whose declared seeds have not all run: the command that runs the rest, and the seeds that have run
    without a verdict (the rule is applied to the declared seeds only, all of them)."""
    n_runs = len(sweep_jobs(exp, exp.declared))
    seeds = f"{len(done)} of {len(exp.declared)} have run"
    head = (
        f"**Not yet measured on the declared seeds {span(exp.declared)}** ({seeds}): "
        f"`python tests/reproduce.py {name}` runs the rest ({n_runs} runs in all) and prints the table and its "
        "verdicts here. No verdict is printed before every declared seed has run."
    )
    lines = [head]
    if done:
        results = {int(s): v["arms"] for s, v in data["seeds"].items()}
        lines += ["", f"Seeds run so far, {span(done)} (interim: no verdict):", ""]
        lines += seed_table(exp, results, done) + [""] + paired_table(exp, results, done)
        lines += [""] + machines(data["runs"], done)
    return lines


README_BEGIN = "<!-- reproduce {name}: begin -->"
README_END = "<!-- reproduce {name}: end -->"


def readme_block(text: str, name: str) -> tuple[int, int]:
    """Start and end (character offsets) of NAME's printed block in the README, between its markers."""
    begin, end = README_BEGIN.format(name=name), README_END.format(name=name)
    if begin not in text or end not in text:
        raise ValueError(f"README has no {begin!r} ... {end!r} markers")
    return text.index(begin) + len(begin) + 1, text.index(end)


def write_readme(path: Path, name: str, lines: list[str]):
    text = path.read_text()
    start, stop = readme_block(text, name)
    path.write_text(text[:start] + "\n".join(lines) + "\n" + text[stop:])


# --- figures ----------------------------------------------------------------------------------------------------------
def plt():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def paired_bars(ax, differences: dict, title: str):
    """A bar per paired difference (mean ± SE over seeds), each seed a dot, the zero line."""
    for k, d in enumerate(differences.values()):
        ax.bar(k, np.mean(d), yerr=np.std(d, ddof=1) / math.sqrt(len(d)), color="#8aa", capsize=3)
        ax.plot([k] * len(d), d, ".", color="#333", ms=3)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(differences)), list(differences), fontsize=7, rotation=20, ha="right")
    ax.set_title(title, fontsize=8)


def save(p, fig, axes, path):
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    p.close(fig)


def comparison_figure(exp, results, seeds, path, metrics=None):
    """Per metric, the paired differences of the table's comparisons (mean ± SE over seeds, a dot per seed)."""
    p = plt()
    metrics = metrics or exp.metrics[:3]
    fig, axes = p.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.2), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        differences = {}
        for a, b, label in exp.comparisons:
            d = np.array(values(results, seeds, a, m)) - np.array(values(results, seeds, b, m))
            if not np.isnan(d).any():
                differences[label] = d
        paired_bars(ax, differences, f"{m}: a - b, paired by seed")
    fig.suptitle(f"{exp.title}: seeds {span(seeds)}, mean ± SE (dots: seeds)", fontsize=8)
    save(p, fig, axes[0], path)


def orapo_figure(exp, results, seeds, path):
    """Fig. 2 (left): the share of zero-reward groups over training, OraPO and GRPO, mean ± SE over seeds."""
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(7.4, 2.8))
    for arm, color in (("orapo", "#c33"), ("grpo", "#37a")):
        c = np.array([results[s][arm]["curve"] for s in seeds])  # (seeds, steps)
        w = 10  # a running mean over 10 steps
        c = np.stack([np.convolve(x, np.ones(w) / w, "valid") for x in c])
        x, m, se = np.arange(w, w + c.shape[1]), c.mean(0), c.std(0, ddof=1) / math.sqrt(len(seeds))
        axes[0].plot(x, m, color=color, label=arm, lw=1)
        axes[0].fill_between(x, m - se, m + se, color=color, alpha=0.2, lw=0)
    axes[0].set(xlabel="step", ylabel="zero-reward groups (10-step mean)")
    axes[0].legend(fontsize=7)
    differences = {}
    for m in ("test macro F1", "test FactS"):
        differences[m] = np.array(values(results, seeds, "orapo", m)) - np.array(values(results, seeds, "grpo", m))
    paired_bars(axes[1], differences, "OraPO - GRPO, paired by seed")
    fig.suptitle(f"OraPO Fig. 2 on the synthetic set, seeds {span(seeds)} (mean ± SE)", fontsize=8)
    save(p, fig, axes, path)


def rrgcl_figure(exp, results, seeds, path):
    """Fig. 3: lambda_n(t) of each class in the first seed's schedule, a panel per third of the classes by gamma; and
    the curriculum's paired differences against random order."""
    p = plt()
    fig, axes = p.subplots(1, 4, figsize=(12, 3.0))
    classes = sorted(results[seeds[0]]["schedule"]["classes"], key=lambda c: -c["gamma"])
    thirds = np.array_split(np.arange(len(classes)), 3)
    for ax, part in zip(axes[:3], thirds):
        for k in part:
            c = classes[k]
            ax.plot(range(len(c["lambda"])), c["lambda"], lw=1, label=f"{c['name']} ({c['gamma']:.1f})")
        ax.set(xlabel="epoch t", ylabel="lambda_n(t)", ylim=(0, 1.02))
        ax.legend(fontsize=6, title="class (gamma_n)", title_fontsize=6)
    differences = {}
    for arm, label in (("rrgcl", "RRGCL, own file"), ("rrgcl_first_file", "RRGCL, one file"), ("root", "Root")):
        a = np.array(values(results, seeds, arm, "CE micro F1"))
        differences[label] = a - np.array(values(results, seeds, "none", "CE micro F1"))
    paired_bars(axes[3], differences, "CE micro F1 minus random order")
    fig.suptitle(f"RRGCL Fig. 3 (seed {seeds[0]}, easiest classes first) and the curriculum's effect", fontsize=8)
    save(p, fig, axes, path)


def dcrrg_figure(exp, results, seeds, path):
    """Table 4: each model's CE micro F1 and BLEU-4 (mean ± SE), with a key of what each model trains."""
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(9, 3.2))
    arms = [f"Model {k}" for k in TABLE4]
    for ax, m in zip(axes, ("CE micro F1", "BLEU-4")):
        v = np.array([values(results, seeds, a, m) for a in arms]).T  # (seeds, models)
        ax.bar(range(len(arms)), v.mean(0), yerr=v.std(0, ddof=1) / math.sqrt(len(seeds)), color="#8aa", capsize=3)
        ax.set_xticks(range(len(arms)), [str(k) for k in TABLE4])
        ax.set(xlabel="model", title=m)
    key = "\n".join(f"{k}: {what}" for k, what in TABLE4_KEY.items())
    axes[1].text(1.03, 0.5, key, transform=axes[1].transAxes, fontsize=7, va="center")
    fig.suptitle(f"DCRRG Table 4, seeds {span(seeds)} (mean ± SE)", fontsize=8)
    save(p, fig, axes, path)


TABLE4_KEY = {
    1: "Step 1, FFT",
    2: "Step 2, FFT",
    3: "Steps 2+3, PT",
    4: "Steps 1+3, PT",
    5: "Steps 1+2, FFT",
    6: "Steps 1+2+3, PT (DCRRG)",
    7: "Steps 1+2+3, FFT",
}

DECLARED = list(range(300, 308))  # the papers' premises (README): declared for every table before its sweep

EXPERIMENTS = {
    "mrg_r1": Experiment(
        "MRG-R1 Table II rows from a converged warm start",
        mrg_r1_jobs,
        mrg_r1_read,
        ["CE micro F1", "CE micro precision", "CE micro recall", "greedy MCCS"],  # not "greedy reward": its own
        [
            ("mccs+format", "format", "mccs+format - format"),
            ("mccs+format", "ce_f1+format", "mccs+format - ce_f1+format"),
            ("mccs+format", "warm start", "mccs+format - warm start"),
            ("format", "warm start", "format - warm start"),
            ("ce_f1+format", "warm start", "ce_f1+format - warm start"),
            ("sft+300", "warm start", "300 more SFT steps - warm start"),
            ("mccs+format", "sft+300", "mccs+format - 300 more SFT steps"),
        ],
        [
            Claim("mccs+format", "format", "CE micro F1", 1, "the clinical term teaches (mccs+format - format)"),
            Claim("mccs+format", "warm start", "CE micro F1", 1, "RL over the SFT start (mccs+format - warm start)"),
            Claim("mccs+format", "ce_f1+format", "CE micro F1", 1, "Table II: MCCS over CE-F1 as the reward"),
            Claim("sft+300", "warm start", "CE micro F1", 0, "the start has converged: 300 more SFT steps"),
        ],
        declared=DECLARED,
        figure=comparison_figure,
        extra=mrg_r1_starts,
    ),
    "deer": Experiment(
        "DEER DiTPO vs GRPO from a converged SFT cold start",
        deer_jobs,
        deer_read,
        ["CE example F1", "CE micro F1", "BLEU-4"],
        [
            ("DiTPO (grad)", "GRPO", "DiTPO (grad) - GRPO"),
            ("DiTPO (rule)", "GRPO", "DiTPO (rule) - GRPO"),
            ("DiTPO (grad)", "DiTPO (rule)", "DiTPO (grad) - DiTPO (rule)"),
            ("GRPO", "SFT", "GRPO - SFT"),
            ("DiTPO (grad)", "SFT", "DiTPO (grad) - SFT"),
        ],
        [
            Claim("DiTPO (grad)", "GRPO", "CE example F1", 1, "DiTPO (the paper's gradient weights) over GRPO"),
            Claim("DiTPO (rule)", "GRPO", "CE example F1", 1, "DiTPO with rule weights over GRPO"),
            Claim("GRPO", "SFT", "CE example F1", 1, "RL over the SFT cold start (GRPO - SFT)"),
        ],
        declared=DECLARED,
        figure=comparison_figure,
        extra=more_comparisons(
            "DEER Tables 6-7, paired by seed",
            [
                ("Table 6, grad", "Table 6, random", "labels changed", 1, "Table 6: top 10 % by grad weight vs random"),
                ("Table 6, rule", "Table 6, random", "labels changed", 1, "Table 6: top 10 % by rule weight vs random"),
                ("Table 7, ddsampling", "Table 7, random_100", "zero-variance groups", -1, "Table 7: zero-variance"),
                ("Table 7, ddsampling", "Table 7, random_100", "distinct rewards", 1, "Table 7: distinct rewards"),
            ],
        ),
    ),
    "orapo": Experiment(
        "OraPO Fig. 2 from a task-naive start",
        orapo_jobs,
        orapo_read,
        ["zero-reward groups", "zero-reward groups, last 50 steps", "test macro F1", "test FactS"],
        [("orapo", "grpo", "OraPO - GRPO")],
        [
            Claim("orapo", "grpo", "zero-reward groups", -1, "Fig. 2: fewer zero-reward groups with OraPO"),
            Claim("orapo", "grpo", "test macro F1", 1, "Table 1: OraPO's test macro F1 over GRPO's"),
        ],
        declared=DECLARED,
        figure=orapo_figure,
        extra=more_comparisons(
            "OraPO's mechanism",
            [
                (
                    "grpo",
                    0.3,
                    "zero-reward groups, first 50 steps",
                    0,
                    "GRPO's zero-reward groups, first 50 steps, vs Fig. 2's ~0.3",
                ),
                (
                    "DPO, last 50 steps",
                    "DPO, first 50 steps",
                    "accuracy on zero-reward groups",
                    0,
                    "OraPO's DPO on the zero-reward groups: accuracy, last 50 vs first 50 steps",
                ),
                (
                    "DPO, last 50 steps",
                    0.5,
                    "accuracy on zero-reward groups",
                    0,
                    "OraPO's DPO on the zero-reward groups: accuracy, last 50 steps, vs chance (step 0: 0, a tie)",
                ),
                ("orapo", 0.05, "mean lambda", 0, "OraPO's DPO weight lambda (Eq. 10), mean over steps, vs its floor"),
                ("orapo", 1, "distinct test reports", 0, "OraPO's greedy test reports: distinct, vs one for all"),
                ("grpo", 1, "distinct test reports", 0, "GRPO's greedy test reports: distinct, vs one for all"),
            ],
        ),
    ),
    "rrgcl": Experiment(
        "RRGCL curriculum vs random order, from a converged measurer",
        rrgcl_jobs,
        rrgcl_read,
        ["CE micro F1", "CE macro F1", "BLEU-4", "CIDEr"],
        [
            ("rrgcl", "none", "RRGCL (own file) - random"),
            ("rrgcl_first_file", "none", "RRGCL (first seed's file) - random"),
            ("root", "none", "Root - random"),
            ("rrgcl", "root", "RRGCL (own file) - Root"),
        ],
        [
            Claim("rrgcl", "none", "CE micro F1", 1, "the curriculum over random order (own file)"),
            Claim("rrgcl_first_file", "none", "CE micro F1", 1, "the curriculum over random order (one file)"),
            Claim("rrgcl", "root", "CE micro F1", 1, "Table 2: RRGCL's scheduler over Root"),
        ],
        declared=DECLARED,
        figure=rrgcl_figure,
        extra=more_comparisons(
            "RRGCL's measurer (each seed's file vs the first's; declared criterion 0.8) and the subsets it trains on",
            [
                ("measurer", 0.8, "Spearman, studies", 0, "difficulty of the training studies, Spearman"),
                ("measurer", 0.8, "Spearman, classes", 0, "class difficulty (Eq. 12's diff_C), Spearman"),
                (
                    "rrgcl",
                    1.0,
                    "training set in D_sub(t), over steps",
                    0,
                    "RRGCL: the share of the training set a step draws from, mean over steps, vs random order's 1",
                ),
            ],
        ),
    ),
    "dcrrg": Experiment(
        "DCRRG Table 4 under the sandbox's CheXbert",
        dcrrg_jobs,
        dcrrg_read,
        ["CE micro F1", "BLEU-4", "CIDEr"],
        [
            ("Model 6", "Model 3", "Step 1 (6 - 3)"),
            ("Model 5", "Model 2", "Step 1 (5 - 2)"),
            ("Model 6", "Model 4", "Step 2 (6 - 4)"),
            ("Model 5", "Model 1", "Step 2, no Step 3 (5 - 1)"),
            ("Model 7", "Model 5", "Step 3 (7 - 5)"),
            ("Model 6", "Model 5", "Step 3 and PT instead of FFT (6 - 5)"),
            ("Model 3", "Model 2", "Step 3 and PT instead of FFT (3 - 2)"),
            ("Model 6", "Model 7", "PT vs FFT (6 - 7)"),
        ],
        [
            Claim("Model 6", "Model 3", "CE micro F1", 1, "Step 1 is essential (6 - 3)"),
            Claim("Model 6", "Model 4", "CE micro F1", 1, "Step 2 helps (6 - 4)"),
            Claim("Model 6", "Model 4", "BLEU-4", 1, "Step 2 helps (6 - 4)"),
            Claim("Model 7", "Model 5", "BLEU-4", 1, "Step 3 helps NLG (7 - 5)"),
            Claim("Model 6", "Model 7", "CE micro F1", 0, "PT matches FFT (6 - 7)"),
        ],
        declared=DECLARED,
        figure=dcrrg_figure,
        extra=more_comparisons(
            "DCRRG's Steps 1 and 2 on their own (against chance)",
            [
                ("Step 1", 0.5, "AUROC, image", 0, "Step 1: the image encoder's AUROC, mean over the 14"),
                ("Step 1", 0.5, "AUROC, text", 0, "Step 1: the text encoder's AUROC, mean over the 14"),
                ("Step 2", 0.2, "retrieval P@1", 0, "Step 2: image-to-text retrieval P@1, 5 classes"),
            ],
        ),
    ),
}


# --- running ----------------------------------------------------------------------------------------------------------
def parse_seeds(text: str) -> list[int]:
    """'100-107' or '1,3,5' (or both: '100-103,110')."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"error: --seeds {text!r}: give distinct seeds, e.g. 100-107")
    return seeds


def arm_argv(job: Job, root: Path) -> list[str]:
    """The job's flags as the script gets them (without --resume): what a finished run is checked against."""
    return [a.replace("{root}", str(root)) for a in job.argv] + ["--out", str(job.folder(root))]


def command(job: Job, root: Path) -> list[str]:
    """The job's command line; --resume when its folder holds a started run (or another stage of the same run)."""
    argv = arm_argv(job, root)
    started = job.folder(root).is_dir() and any(job.folder(root).iterdir())
    resume = ["--resume"] if started else []
    return [sys.executable, str(ROOT / argv[0]), *argv[1:], *resume]


def machine() -> dict:
    """What a run's numbers depend on besides the code: the CPU, the kernels torch picks under the pins, versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        names = [
            x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in x
        ]
        cpu = names[0] if names else cpu
    capability = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=dict(os.environ, **PINS),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {"cpu": cpu, "cpu_capability": capability, "torch": torch.__version__, "python": platform.python_version()}


def commit() -> str:
    """The project's commit; '+changes' when tracked files that a run reads differ from it (a sweep should run from a
    commit). The figures and results a sweep writes, and the README, do not count."""

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    outputs = (":!tests/figures", ":!tests/results", ":!*.md")
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs) else "")


def records_path(job: Job, root: Path) -> Path:
    return Path(str(job.folder(root)) + ".runs.jsonl")


def records(job: Job, root: Path) -> list[dict]:
    """This job's launches (a line each in <folder>.runs.jsonl: command, machine, pins, commit, CPU seconds, exit)."""
    path = records_path(job, root)
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    wanted = portable(arm_argv(job, root), root)
    return [r for r in lines if r["argv"] == wanted]


def portable(argv: list[str], root: Path) -> list[str]:
    """A command line with the sweep's folder and the project's root as placeholders (machine-independent)."""
    return [a.replace(str(root), "{root}").replace(str(ROOT), "{project}") for a in argv]


def check_finished(job: Job, root: Path):
    """A finished run is skipped only if a launch record shows it ran this job's flags: else a definition changed."""
    if not records(job, root):
        raise SystemExit(
            f"error: {job.folder(root)} holds a finished run, but no launch record shows it ran "
            f"{' '.join(portable(arm_argv(job, root), root))}: the definition changed since (or the run predates "
            "the records); delete the folder or use another --out"
        )


def run_job(job: Job, root: Path, machine_info: dict, revision: str) -> int:
    """Run one job under the pins, appending its launch record (with the CPU seconds it used) to <folder>.runs.jsonl."""
    cmd = command(job, root)
    env = dict(os.environ, **PINS, **QUIET, PYTHONPATH=str(ROOT))
    start = time.time()
    with open(str(job.folder(root)) + ".log", "a") as log:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    record = {
        "argv": portable(arm_argv(job, root), root),
        "resumed": "--resume" in cmd,
        "machine": machine_info,
        "pins": PINS,
        "commit": revision,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
        "wall_s": round(time.time() - start, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "exit": code,
    }
    with open(records_path(job, root), "a") as f:
        f.write(json.dumps(record) + "\n")
    return code


def run_all(jobs: list[Job], root: Path, n_jobs: int, dry_run: bool):
    """Run what is not finished, at most n_jobs at once, each after the folders it needs."""

    def done(j):
        return (j.folder(root) / j.done).is_file()

    todo = [j for j in jobs if not done(j)]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs done; {len(todo)} to run", flush=True)
    if dry_run:
        for j in todo:
            print(" ".join(command(j, root)))
        return
    for j in jobs:
        if done(j):
            check_finished(j, root)
    machine_info, revision = machine(), commit()
    running, finished = {}, {j.name for j in jobs if done(j)} - {j.name for j in todo}
    with ThreadPoolExecutor(n_jobs) as pool:
        while todo or running:
            for j in [j for j in todo if set(j.after) <= finished]:
                if len(running) >= n_jobs:
                    break
                if j.name in {r.name for r in running.values()}:  # one folder's jobs one after another
                    continue
                todo.remove(j)
                j.folder(root).parent.mkdir(parents=True, exist_ok=True)
                print(f"[{time.strftime('%H:%M:%S')}] start {j.name}: {' '.join(command(j, root)[1:])}", flush=True)
                running[pool.submit(run_job, j, root, machine_info, revision)] = j
            if not running:
                raise SystemExit(f"error: runs wait for jobs that cannot run: {[j.name for j in todo]}")
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                j = running.pop(future)
                if future.result() != 0:
                    raise SystemExit(f"error: {j.name} failed (exit {future.result()}); see {j.folder(root)}.log")
                if not any(t.name == j.name for t in todo) and done(j):
                    finished.add(j.name)  # a folder is finished when all of its jobs are
                print(f"[{time.strftime('%H:%M:%S')}] done {j.name}", flush=True)


def leaves(x, path=""):
    """(path, value) of every number in a results tree: {"arm": {"metric": 0.5}} -> ("arm/metric", 0.5)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}/{k}" if path else k)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def printed(x) -> str:
    """A number as the tables print it (3 decimals); NaN as 'nan'."""
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def recheck(name: str, seed: int, root: Path, data: dict) -> dict:
    """One seed run again (its folders under root), compared with its committed row: every number to the printed
    digits, and the largest difference."""
    exp = EXPERIMENTS[name]
    fresh = dict(leaves(json.loads(json.dumps(exp.read(root, seed), default=float))))
    committed = dict(leaves(data["seeds"][str(seed)]["arms"]))
    if fresh.keys() != committed.keys():
        raise ValueError(f"seed {seed}'s re-run has other numbers than its committed row: the definition changed")
    differs = [k for k in committed if printed(committed[k]) != printed(fresh[k])]
    gaps = [
        abs(committed[k] - fresh[k])
        for k in committed
        if isinstance(committed[k], float) and committed[k] == committed[k]
    ]
    runs = [r for j in exp.jobs(seed, exp.declared) for r in records(j, root)]
    return {
        "seed": seed,
        "commit": sorted({r["commit"] for r in runs}),
        "machine": sorted({r["machine"]["cpu"] for r in runs}),
        "numbers": len(committed),
        "differs": differs,
        "largest_difference": max(gaps, default=0.0),
    }


def recheck_line(check: dict) -> str:
    """The README's sentence on a re-run seed."""
    head = (
        f"Seed {check['seed']} run again in a fresh folder (commit {', '.join(check['commit'])}; "
        f"{', '.join(check['machine'])}): "
    )
    if not check["differs"]:
        largest = f"largest difference {check['largest_difference']:.1g}"
        return head + f"all {check['numbers']} numbers of its row the same to the printed digits ({largest})."
    return head + f"{len(check['differs'])} of {check['numbers']} numbers differ: {', '.join(check['differs'][:5])}."


def collect(name: str, seeds: list[int], root: Path) -> dict:
    """Every seed's numbers and its jobs' launch records, as tests/results/NAME.json holds them."""
    exp = EXPERIMENTS[name]
    data = {"name": name, "declared": exp.declared, "seeds": {}, "runs": {}}
    for s in seeds:
        data["seeds"][str(s)] = {"arms": exp.read(root, s)}
        data["runs"][str(s)] = {" ".join(j.argv): records(j, root) for j in exp.jobs(s, exp.declared)}
    return data


def draw(name: str, data: dict, folder: Path):
    exp = EXPERIMENTS[name]
    if not exp.figure:
        return
    results = {int(s): v["arms"] for s, v in data["seeds"].items()}
    if not set(exp.declared) <= set(results):
        return print(f"figure skipped: {name}'s declared seeds have not all run")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        exp.figure(exp, results, exp.declared, folder / f"{name}.png")
        print(f"wrote {folder / f'{name}.png'}")
    except ImportError:
        print("figure skipped: it needs `pip install matplotlib`")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(EXPERIMENTS) + ["labels"])
    p.add_argument("--seeds", help="default: the declared ones; others are an extension")
    p.add_argument("--report", action="store_true", help="run nothing: print the README's lines from the results file")
    p.add_argument("--readme", help="with --report: write the lines between the README's markers for NAME")
    p.add_argument(
        "--gold", help="labels: a gold CSV in NegBio's Open-i layout (id, report, ChestX-ray14 findings, normal)"
    )
    p.add_argument("--labeler", default="rule", choices=["rule", "chexbert"], help="labels: the labeler to score")
    p.add_argument("--chexbert-weights", help="labels: a local chexbert.pth")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    p.add_argument("--out", default=str(ROOT / "runs" / "reproduce"), help="the sweep's run folders")
    p.add_argument("--results", default=str(RESULTS), help="where NAME.json is written and read")
    p.add_argument("--figures", default=str(ROOT / "tests" / "figures"))
    p.add_argument("--dry-run", action="store_true", help="print the commands still to run")
    p.add_argument(
        "--recheck",
        type=int,
        metavar="SEED",
        help="run one seed again under --out (not the sweep's folder) and record whether it gives its committed row",
    )
    args = p.parse_args(argv)
    if args.name == "labels":
        weights = args.chexbert_weights
        if args.labeler == "chexbert" and args.gold == "synthetic" and not weights:
            weights = common.synthetic_chexbert()  # the sandbox's
        try:
            labeler = common.make_labeler(args.labeler, weights)
            if args.gold == "synthetic":
                return print("\n".join(synthetic_labels_table(labeler)))
            return print("\n".join(labels_table(args.gold, labeler)))
        except (FileNotFoundError, ValueError, TypeError) as e:
            raise SystemExit(f"error: {e}" if args.gold else "error: labels needs --gold FILE.csv") from None
    exp, results_file = EXPERIMENTS[args.name], Path(args.results) / f"{args.name}.json"
    if args.report:
        data = read_json(results_file) if results_file.is_file() else {"seeds": {}, "runs": {}}
        try:
            lines = report(args.name, data)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        print("\n".join(lines))
        if args.readme:
            write_readme(Path(args.readme), args.name, lines)
        draw(args.name, data, Path(args.figures))
        return
    root = Path(args.out) / args.name
    if args.recheck is not None:
        return recheck_seed(args, exp, results_file, root)
    seeds = parse_seeds(args.seeds) if args.seeds else exp.declared
    jobs = sweep_jobs(exp, seeds)
    run_all(jobs, root, args.jobs, args.dry_run)
    if args.dry_run:
        return
    old = read_json(results_file) if results_file.is_file() else {"seeds": {}, "runs": {}}
    new = collect(args.name, seeds, root)
    data = {**old, **new, "seeds": {**old["seeds"], **new["seeds"]}, "runs": {**old["runs"], **new["runs"]}}
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(data, indent=1, default=float) + "\n")
    print(f"wrote {results_file}")
    print("\n".join(report(args.name, data)))
    draw(args.name, data, Path(args.figures))


def recheck_seed(args, exp: Experiment, results_file: Path, root: Path):
    """--recheck SEED: the seed's runs again in a folder of their own, compared with the committed row."""
    seed = args.recheck
    data = read_json(results_file) if results_file.is_file() else {"seeds": {}}
    if str(seed) not in data["seeds"]:
        raise SystemExit(f"error: {results_file} has no seed {seed} to check")
    jobs = sweep_jobs(exp, [seed])
    committed = [r for runs in data["runs"][str(seed)].values() for r in runs]
    if any(r in committed for j in jobs for r in records(j, root)):
        raise SystemExit(f"error: {root} holds the sweep's own runs of seed {seed}: give --out a fresh folder")
    run_all(jobs, root, args.jobs, args.dry_run)
    if args.dry_run:
        return
    data["recheck"] = recheck(args.name, seed, root, data)
    results_file.write_text(json.dumps(data, indent=1, default=float) + "\n")
    print(recheck_line(data["recheck"]))


if __name__ == "__main__":
    main()
