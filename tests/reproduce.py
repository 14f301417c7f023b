"""Regenerate the README's effect tables and paper figures over declared seeds.

    python tests/reproduce.py NAME --seeds 100-107 [--jobs 2] [--out runs/reproduce] [--figures tests/figures]
    python tests/reproduce.py NAME --seeds 100-107 --dry-run      # the commands, nothing run
    python tests/reproduce.py labels --gold FILE.csv              # the rule labeler against radiologists' labels

For NAME (mrg_r1, deer, orapo, rrgcl, dcrrg) it runs exactly what the README's table claims: every arm with its
flags and budgets, the same seeds in every arm (paired), each run a script's own command line in its own folder
under --out/NAME. A run whose result file exists is skipped, so a long sweep can stop (Ctrl-C) and go on later with
the same command; a run stopped half-way is continued with --resume. Then it prints the table as the README shows it
(per-seed rows of the headline metric, paired mean difference +- standard error, how many seeds agree in sign), writes
--out/NAME/results.json (every run's numbers) and table.md, and draws the paper's figure into --figures/NAME.png.

Runs use one thread each (--jobs of them at once), skip METEOR (a JVM per run; no table uses it) and their own
figures. On this project's 2-core machine, one seed costs about: mrg_r1 7, deer 6, orapo 5, rrgcl 8, dcrrg 10
CPU-minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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


@dataclass
class Job:
    """One run: `python ROOT/<argv[0]> argv[1:] --out root/<name>`, finished when root/<name>/<done> exists. Jobs of one
    folder (DEER's stages and tables) run one after another; `after` names the folders that must be finished first."""

    name: str
    argv: list
    done: str = "eval.json"
    after: tuple = ()

    def folder(self, root: Path) -> Path:
        return root / self.name


# --- the experiments: jobs per seed, and the numbers read back --------------------------------------------------
def ce(result: dict) -> float:
    """The paper's headline CE metric of an evaluation (its eval JSON says which)."""
    return result["ce"][result["headline"]]


@dataclass
class Experiment:
    title: str
    jobs: callable  # seed, seeds -> [Job]
    read: callable  # folder of NAME, seed -> {arm: {metric: value}}
    comparisons: list  # (arm a, arm b, label): paired a - b
    metrics: list  # metric names shown, the first is the headline
    figure: callable = None  # (results, path) -> None
    note: str = ""
    extra: dict = field(default_factory=dict)


def mrg_r1_jobs(seed, seeds):
    """Table II rows from the same 400-step warm start (deterministic from the seed, so every arm recomputes the same
    one), 100 GRPO steps each; a fifth arm trains 100 more SFT steps instead."""
    base = ["mrg_r1.py", "--seed", str(seed)]
    arms = {
        "mccs+format": ["--steps", "100"],
        "format": ["--reward", "format", "--steps", "100"],
        "ce_f1+format": ["--reward", "ce_f1+format", "--steps", "100"],
        "sft+100": ["--sft-steps", "500", "--steps", "0"],
    }
    return [Job(f"s{seed}/{arm}", base + flags) for arm, flags in arms.items()]


def mrg_r1_read(root, seed):
    out = {}
    for arm in ("mccs+format", "format", "ce_f1+format", "sft+100"):
        r = json.loads((root / f"s{seed}" / arm / "eval.json").read_text())
        after = r.get("test_after", r["test_before"])
        out[arm] = {
            "CE micro F1": ce(after),
            "greedy reward": after["reward"],
            "greedy MCCS": after.get("reward_mccs", math.nan),
        }
        if arm == "mccs+format":
            before = r["test_before"]
            out["warm start"] = {
                "CE micro F1": ce(before),
                "greedy reward": before["reward"],
                "greedy MCCS": before.get("reward_mccs", math.nan),
            }
    return out


def deer_jobs(seed, seeds):
    """Each seed its own SFT model and DDSampling subset (deer.py all: DiTPO with rule weights), then GRPO from the same
    SFT model and subset; Tables 6 and 7 on that SFT model."""
    job = lambda command, *flags, done: Job(f"s{seed}", ["deer.py", command, "--seed", str(seed), *flags], done)
    return [
        job("all", done="rl_rule/eval.json"),
        job("rl", "--weighting", "none", done="rl_none/eval.json"),
        job("table6", done="table6.json"),
        job("table7", done="table7.json"),
    ]


def deer_read(root, seed):
    out = {}
    for arm, stage in (("SFT", "sft"), ("DiTPO (rule)", "rl_rule"), ("GRPO", "rl_none")):
        r = json.loads((root / f"s{seed}" / stage / "eval.json").read_text())["test"]
        out[arm] = {"CE example F1": ce(r), "CE micro F1": r["ce"]["micro_f1"], "BLEU-4": r["nlg"]["BLEU-4"]}
    t6, t7 = (json.loads((root / f"s{seed}" / f"table{k}.json").read_text()) for k in (6, 7))
    out["Table 6"] = {
        f"{w} {k}": t6[w][k] for w in ("rule", "random") for k in ("label_mod_ratio_binary", "post_mask_f1")
    }
    out["Table 7"] = {
        f"{s} {k}": t7[s][k]
        for s in ("random_100", "ddsampling")
        for k in ("zero_variance", "unique_rewards", "reward_std")
    }
    return out


def orapo_jobs(seed, seeds):
    """Fig. 2: OraPO against vanilla GRPO (lambda 0) in the tiny default regime (250 studies, 250 steps of 4: each
    study seen 4 times, so the per-study ZRR acts), paired by seed."""
    base = ["orapo.py", "--seed", str(seed)]
    return [Job(f"s{seed}/orapo", base), Job(f"s{seed}/grpo", base + ["--lambda-min", "0", "--lambda-max", "0"])]


def orapo_read(root, seed):
    out = {}
    for arm in ("orapo", "grpo"):
        lines = [json.loads(x) for x in (root / f"s{seed}" / arm / "metrics.jsonl").read_text().splitlines()]
        r = json.loads((root / f"s{seed}" / arm / "eval.json").read_text())["test_after"]
        out[arm] = {
            "test macro F1": ce(r),
            "test FactS": r["facts_reward"],
            "zero-reward group ratio": float(np.mean([x["zero_group_ratio"] for x in lines])),
            "zero-reward ratio, last 50 steps": float(np.mean([x["zero_group_ratio"] for x in lines[-50:]])),
            "DPO accuracy x zero groups": float(np.mean([x["dpo_accuracy_x_zero"] for x in lines])),
            "curve": [x["zero_group_ratio"] for x in lines],
        }
    return out


def rrgcl_jobs(seed, seeds):
    """Curriculum against random order at equal steps (400), both ways of pairing the difficulty: each seed's own
    measurement (--measure-only --seed S, as the README's commands read) and the first seed's file for every seed;
    Table 2's global Root scheduler on the seed's own file."""
    own, first = f"s{seed}/measure", f"s{seeds[0]}/measure"  # each writes <folder>/difficulty.json
    base, dif = (
        ["rrgcl.py", "--seed", str(seed), "--steps", "400"],
        lambda m: ["--difficulty", f"{{root}}/{m}/difficulty.json"],
    )
    return [
        Job(own, ["rrgcl.py", "--seed", str(seed), "--measure-only"]),
        Job(f"s{seed}/none", base + ["--scheduler", "none"] + dif(own), after=(own,)),
        Job(f"s{seed}/rrgcl", base + dif(own), after=(own,)),
        Job(f"s{seed}/rrgcl_first_file", base + dif(first), after=(first,)),
        Job(f"s{seed}/root", base + ["--scheduler", "root"] + dif(own), after=(own,)),
    ]


def rrgcl_read(root, seed):
    out = {}
    for arm in ("none", "rrgcl", "rrgcl_first_file", "root"):
        r = json.loads((root / f"s{seed}" / arm / "eval.json").read_text())["test"]
        out[arm] = {
            "CE micro F1": ce(r),
            "CE macro F1": r["ce"]["macro_f1"],
            "BLEU-4": r["nlg"]["BLEU-4"],
            "CIDEr": r["nlg"]["CIDEr"],
        }
    out["schedule"] = json.loads((root / f"s{seed}" / "rrgcl" / "schedule.json").read_text())
    return out


TABLE4 = {1: "m1_fft", 2: "m2_fft", 3: "m3_pt", 4: "m4_pt", 5: "m5_fft", 6: "m6_pt", 7: "m7_fft"}


def dcrrg_jobs(seed, seeds):
    """Table 4's seven models (dcrrg.py ablation) at the default budgets, one seed each."""
    return [Job(f"s{seed}", ["dcrrg.py", "ablation", "--seed", str(seed)], done="ablation/ablation.json")]


def dcrrg_read(root, seed):
    out = {}
    for model, folder in TABLE4.items():
        r = json.loads((root / f"s{seed}" / "ablation" / folder / "eval.json").read_text())
        out[f"Model {model}"] = {
            "CE micro F1": ce(r),
            "BLEU-4": r["nlg"]["BLEU-4"],
            "CIDEr": r["nlg"]["CIDEr"],
            "distinct reports": r["degenerate"]["distinct"],
        }
    return out


# --- the rule labeler against radiologists (NegBio's Open-i gold) ------------------------------------------
# NegBio's Open-i gold standard (its examples/openi_gld_std14.csv joined with the reports on the CXR id): ChestX-ray14
# names, 1 = stated present (uncertain and negated are 0, so our uncertain counts absent here), `normal` = no finding.
GOLD_COLUMNS = {
    n: (n,) for n in ("Atelectasis", "Cardiomegaly", "Pneumonia", "Pneumothorax", "Consolidation", "Edema")
} | {"Pleural Effusion": ("Effusion",), "Lung Lesion": ("Mass", "Nodule"), "No Finding": ("normal",)}  # No Finding last


def gold_agreement(path, labeler) -> dict:
    """Per label precision, recall, F1 and counts of `labeler` against a gold CSV (columns report, the
    ChestX-ray14 findings, normal), the micro F1 over the 8 findings and the No Finding rate."""
    import csv

    if not Path(path).is_file():
        raise FileNotFoundError(f"gold CSV not found: {path}")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for column in ["report"] + [c for cols in GOLD_COLUMNS.values() for c in cols]:
        if not rows or column not in rows[0]:
            raise ValueError(f"{path}: no column {column!r} (needs report, the ChestX-ray14 findings and normal)")
        bad = next((n for n, r in enumerate(rows, 2) if column != "report" and r[column] not in ("0", "1")), None)
        if bad:
            raise ValueError(f"{path}:{bad}: column {column!r} is {rows[bad - 2][column]!r}, not 0 or 1")
    gold = np.array([[any(r[c] == "1" for c in cols) for cols in GOLD_COLUMNS.values()] for r in rows])  # (N, 9)
    ours = (
        common.binarize(labeler([r["report"] for r in rows]), uncertain_as=0)[
            :, [common.LABEL_INDEX[n] for n in GOLD_COLUMNS]
        ]
        == 1
    )
    tp, fp, fn = (ours & gold).sum(0), (ours & ~gold).sum(0), (~ours & gold).sum(0)  # (9,) each
    out = {
        name: dict(
            zip(("precision", "recall", "f1"), map(float, prf)), gold=int(gold[:, i].sum()), ours=int(ours[:, i].sum())
        )
        for i, (name, *prf) in enumerate(zip(GOLD_COLUMNS, *common._prf(tp, fp, fn)))
    }
    return out | {
        "micro_f1": float(common._prf(tp[:8].sum(), fp[:8].sum(), fn[:8].sum())[2]),
        "n": len(rows),
        "no_finding_rate": float(ours[:, -1].mean()),
        "normal_rate": float(gold[:, -1].mean()),
    }


def labels_table(gold: str, labeler) -> list[str]:
    """The README's rule-labeler table: `python tests/reproduce.py labels --gold FILE.csv [--labeler chexbert]`."""
    out = gold_agreement(gold, labeler)
    lines = [f"{'':<17} precision recall   F1  gold ours"]
    for name in GOLD_COLUMNS:
        lines.append(
            f"{name:<17} {out[name]['precision']:9.3f} {out[name]['recall']:6.3f} {out[name]['f1']:6.3f} "
            f"{out[name]['gold']:5d} {out[name]['ours']:4d}" + ("  (gold: normal)" if name == "No Finding" else "")
        )
    return lines + [
        f"micro F1 over the 8 findings: {out['micro_f1']:.3f}; No Finding on {out['no_finding_rate']:.1%} of "
        f"{out['n']} reports (gold normal: {out['normal_rate']:.1%}); uncertain counts as absent"
    ]


# --- statistics and tables --------------------------------------------------------------------------------------
def paired(a, b) -> dict:
    """Paired a - b over seeds: mean, standard error (sample sd / sqrt n), and how many seeds have a > b."""
    d = np.asarray(a, float) - np.asarray(b, float)
    se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return {"mean": float(d.mean()), "se": float(se), "positive": int((d > 0).sum()), "n": len(d)}


def verdict(p: dict) -> str:
    """'+0.012 +- 0.004 (8 of 8 > 0)'; the sign is stable when the mean is 2 SE from 0. n/a: an arm lacks the metric."""
    if math.isnan(p["mean"]):
        return "n/a"
    return f"{p['mean']:+.3f} ± {p['se']:.3f} ({p['positive']} of {p['n']} > 0)"


def arms_of(exp: Experiment, results: dict, seeds: list, metric: str) -> list[str]:
    return [a for a, v in results[seeds[0]].items() if isinstance(v, dict) and metric in v]


def render(exp: Experiment, results: dict, seeds: list) -> list[str]:
    """Markdown: the headline metric of every arm per seed (a column each), then each paired comparison per metric."""
    head = exp.metrics[0]
    lines = [f"| {head} | " + " | ".join(map(str, seeds)) + " | mean ± sd |", "|---" * (len(seeds) + 2) + "|"]
    for a in arms_of(exp, results, seeds, head):
        v = [results[s][a][head] for s in seeds]
        lines.append(
            f"| {a} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {np.mean(v):.3f} ± {np.std(v, ddof=1):.3f} |"
        )
    lines += ["", "| paired difference | " + " | ".join(exp.metrics) + " |", "|---" * (len(exp.metrics) + 1) + "|"]
    for a, b, label in exp.comparisons:
        cells = [
            verdict(paired([results[s][a][m] for s in seeds], [results[s][b][m] for s in seeds])) for m in exp.metrics
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


# --- figures ----------------------------------------------------------------------------------------------------
def plt():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def bars(exp: Experiment, results: dict, seeds: list, path: Path, metrics=None):
    """Mean +- SE over seeds of each arm, one panel per metric."""
    p = plt()
    metrics = metrics or exp.metrics[:2]
    arms = arms_of(exp, results, seeds, metrics[0])
    fig, axes = p.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 2.8), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        v = np.array([[results[s][a][m] for a in arms] for s in seeds])  # (seeds, arms)
        ax.bar(range(len(arms)), v.mean(0), yerr=v.std(0, ddof=1) / math.sqrt(len(seeds)), color="#8aa", capsize=3)
        for k in range(len(arms)):
            ax.plot([k] * len(seeds), v[:, k], ".", color="#333", ms=3)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=7)
        ax.set_title(m, fontsize=8)
    fig.suptitle(f"{exp.title}: mean ± SE over seeds {seeds[0]}-{seeds[-1]} (dots: seeds)", fontsize=8)
    save(p, fig, axes[0], path)


def orapo_figure(exp, results, seeds, path):
    """Fig. 2 (left): the share of zero-reward groups over training, OraPO and GRPO, mean +- SE over seeds."""
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
    paired_bars(
        axes[1],
        {m: [results[s]["orapo"][m] - results[s]["grpo"][m] for s in seeds] for m in ("test macro F1", "test FactS")},
        "OraPO - GRPO, paired by seed",
    )
    fig.suptitle(f"OraPO Fig. 2 on the synthetic set, seeds {seeds[0]}-{seeds[-1]} (mean ± SE)", fontsize=8)
    save(p, fig, axes, path)


def paired_bars(ax, differences: dict, title: str):
    """A bar per paired difference (mean ± SE over seeds), each seed a dot."""
    for k, d in enumerate(differences.values()):
        ax.bar(k, np.mean(d), yerr=np.std(d, ddof=1) / math.sqrt(len(d)), color="#8aa", capsize=3)
        ax.plot([k] * len(d), d, ".", color="#333", ms=3)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(differences)), list(differences), fontsize=7)
    ax.set_title(title, fontsize=8)


def save(p, fig, axes, path):
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    p.close(fig)


def rrgcl_figure(exp, results, seeds, path):
    """Fig. 3: lambda_n(t) of each class in the first seed's schedule; and curriculum - random order per seed."""
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(7.4, 2.8))
    sched = results[seeds[0]]["schedule"]
    for c in sched["classes"]:
        axes[0].plot(range(len(c["lambda"])), c["lambda"], lw=0.8, label=f"{c['name'][:14]} ({c['gamma']:.1f})")
    axes[0].set(xlabel="epoch t", ylabel="lambda_n(t)")
    axes[0].legend(fontsize=4.5, ncol=2, title="class (gamma_n)", title_fontsize=5)
    paired_bars(
        axes[1],
        {
            label: [results[s][a]["CE micro F1"] - results[s]["none"]["CE micro F1"] for s in seeds]
            for a, label in (("rrgcl", "RRGCL, own file"), ("rrgcl_first_file", "RRGCL, one file"), ("root", "Root"))
        },
        "CE micro F1 minus random order, paired by seed",
    )
    fig.suptitle(
        f"RRGCL Fig. 3 (seed {seeds[0]}) and the curriculum's effect, seeds {seeds[0]}-{seeds[-1]}", fontsize=8
    )
    save(p, fig, axes, path)


EXPERIMENTS = {
    "mrg_r1": Experiment(
        "MRG-R1 Table II rows",
        mrg_r1_jobs,
        mrg_r1_read,
        [
            ("mccs+format", "warm start", "mccs+format - warm start"),
            ("format", "warm start", "format - warm start"),
            ("ce_f1+format", "warm start", "ce_f1+format - warm start"),
            ("sft+100", "warm start", "100 more SFT steps - warm start"),
            ("mccs+format", "format", "mccs+format - format"),
            ("mccs+format", "ce_f1+format", "mccs+format - ce_f1+format"),
            ("mccs+format", "sft+100", "mccs+format - 100 more SFT steps"),
        ],
        ["CE micro F1", "greedy MCCS"],  # not "greedy reward" (in results.json): each arm's is its own reward's
        figure=lambda e, r, s, p: bars(e, r, s, p),
    ),
    "deer": Experiment(
        "DEER DiTPO vs GRPO",
        deer_jobs,
        deer_read,
        [
            ("DiTPO (rule)", "GRPO", "DiTPO (rule) - GRPO"),
            ("DiTPO (rule)", "SFT", "DiTPO (rule) - SFT"),
            ("GRPO", "SFT", "GRPO - SFT"),
        ],
        ["CE example F1", "CE micro F1", "BLEU-4"],
        figure=lambda e, r, s, p: bars(e, r, s, p),
    ),
    "orapo": Experiment(
        "OraPO Fig. 2",
        orapo_jobs,
        orapo_read,
        [("orapo", "grpo", "OraPO - GRPO")],
        [
            "test macro F1",
            "test FactS",
            "zero-reward group ratio",
            "zero-reward ratio, last 50 steps",
            "DPO accuracy x zero groups",
        ],
        figure=orapo_figure,
    ),
    "rrgcl": Experiment(
        "RRGCL curriculum vs random order",
        rrgcl_jobs,
        rrgcl_read,
        [
            ("rrgcl", "none", "RRGCL (own file) - random"),
            ("rrgcl_first_file", "none", "RRGCL (first seed's file) - random"),
            ("root", "none", "Root - random"),
            ("rrgcl", "root", "RRGCL (own file) - Root"),
        ],
        ["CE micro F1", "CE macro F1", "BLEU-4", "CIDEr"],
        figure=rrgcl_figure,
    ),
    "dcrrg": Experiment(
        "DCRRG Table 4",
        dcrrg_jobs,
        dcrrg_read,
        [
            ("Model 6", "Model 3", "Step 1 (6 - 3)"),
            ("Model 5", "Model 2", "Step 1 (5 - 2)"),
            ("Model 6", "Model 4", "Step 2 (6 - 4)"),
            ("Model 5", "Model 1", "Step 2, no Step 3 (5 - 1)"),
            ("Model 6", "Model 5", "Step 3 (6 - 5)"),
            ("Model 3", "Model 2", "Step 3 (3 - 2)"),
            ("Model 7", "Model 5", "Step 3 with FFT (7 - 5)"),
            ("Model 6", "Model 7", "PT vs FFT (6 - 7)"),
        ],
        ["CE micro F1", "BLEU-4", "CIDEr"],
        figure=lambda e, r, s, p: bars(e, r, s, p, ["CE micro F1", "BLEU-4"]),
    ),
}


# --- running ----------------------------------------------------------------------------------------------------
def parse_seeds(text: str) -> list[int]:
    """'100-107' or '1,3,5' (or both: '100-103,110')."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"error: --seeds {text!r}: give distinct seeds, e.g. 100-107")
    return seeds


def command(job: Job, root: Path) -> list[str]:
    """The job's command line; --resume when its folder holds a started run (or another stage of the same run)."""
    argv = [a.replace("{root}", str(root)) for a in job.argv]
    started = job.folder(root).is_dir() and any(job.folder(root).iterdir())
    return [sys.executable, str(ROOT / argv[0]), *argv[1:], "--out", str(job.folder(root))] + ["--resume"] * started


def run_all(jobs: list[Job], root: Path, n_jobs: int, dry_run: bool):
    """Run what is not finished, at most n_jobs at once, each after the folders it needs."""
    done = lambda j: (j.folder(root) / j.done).is_file()
    todo = [j for j in jobs if not done(j)]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs done; {len(todo)} to run", flush=True)
    if dry_run:
        for j in todo:
            print(" ".join(command(j, root)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", RRG_METEOR="0", RRG_FIGURES="0", PYTHONPATH=str(ROOT))
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
                log = open(str(j.folder(root)) + ".log", "a")
                print(f"[{time.strftime('%H:%M:%S')}] start {j.name}: {' '.join(command(j, root)[1:])}", flush=True)
                running[
                    pool.submit(subprocess.run, command(j, root), env=env, stdout=log, stderr=subprocess.STDOUT)
                ] = j
            if not running:
                raise SystemExit(f"error: runs wait for jobs that cannot run: {[j.name for j in todo]}")
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                j = running.pop(future)
                if future.result().returncode != 0:
                    raise SystemExit(
                        f"error: {j.name} failed (exit {future.result().returncode}); see {j.folder(root)}.log"
                    )
                if not any(t.name == j.name for t in todo) and done(j):
                    finished.add(j.name)  # a folder is finished when all of its jobs are
                print(f"[{time.strftime('%H:%M:%S')}] done {j.name}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(EXPERIMENTS) + ["labels"])
    p.add_argument("--seeds", help="declared before running, e.g. 100-107")
    p.add_argument(
        "--gold", help="labels: a gold CSV in NegBio's Open-i layout (id, report, ChestX-ray14 findings, normal)"
    )
    p.add_argument("--labeler", default="rule", choices=["rule", "chexbert"], help="labels: the labeler to score")
    p.add_argument("--chexbert-weights", help="labels: a local chexbert.pth")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    p.add_argument("--out", default=str(ROOT / "runs" / "reproduce"))
    p.add_argument("--figures", default=str(ROOT / "tests" / "figures"))
    p.add_argument("--dry-run", action="store_true", help="print the commands still to run")
    args = p.parse_args(argv)
    if args.name == "labels":
        try:
            return print("\n".join(labels_table(args.gold, common.make_labeler(args.labeler, args.chexbert_weights))))
        except (FileNotFoundError, ValueError, TypeError) as e:
            raise SystemExit(f"error: {e}" if args.gold else "error: labels needs --gold FILE.csv") from None
    if not args.seeds:
        raise SystemExit(f"error: {args.name} needs --seeds, declared before running (e.g. 100-107)")
    exp, seeds, root = EXPERIMENTS[args.name], parse_seeds(args.seeds), Path(args.out) / args.name
    jobs = [j for s in seeds for j in exp.jobs(s, seeds)]
    run_all(jobs, root, args.jobs, args.dry_run)
    if args.dry_run:
        return
    results = {s: exp.read(root, s) for s in seeds}
    lines = [f"`python tests/reproduce.py {args.name} --seeds {args.seeds}`", "", *render(exp, results, seeds)]
    print("\n".join(lines))
    (root / "table.md").write_text("\n".join(lines) + "\n")
    (root / "results.json").write_text(json.dumps({"seeds": seeds, "results": results}, indent=1, default=float))
    if exp.figure:
        try:
            Path(args.figures).mkdir(parents=True, exist_ok=True)
            exp.figure(exp, results, seeds, Path(args.figures) / f"{args.name}.png")
            print(f"wrote {Path(args.figures) / f'{args.name}.png'}")
        except ImportError:
            print("figure skipped: it needs `pip install matplotlib`")


if __name__ == "__main__":
    main()
