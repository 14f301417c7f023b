"""tests/reproduce.py: the rule in code, the tables printed from results, the experiments' definitions, the runner."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reproduce

ROOT = Path(__file__).resolve().parents[1]


def test_seeds_are_declared_ranges_or_lists():
    assert reproduce.parse_seeds("100-103,110") == [100, 101, 102, 103, 110]
    with pytest.raises(SystemExit, match="distinct seeds"):
        reproduce.parse_seeds("1,1")


def test_paired_difference_by_hand():
    p = reproduce.paired([0.5, 0.7, 0.4, 0.9], [0.4, 0.5, 0.5, 0.6])  # d = 0.1, 0.2, -0.1, 0.3
    assert p["mean"] == pytest.approx(0.125) and p["positive"] == 3 and p["n"] == 4
    sd = np.sqrt(((0.1 - 0.125) ** 2 + 0.075**2 + 0.225**2 + 0.175**2) / 3)
    assert p["se"] == pytest.approx(sd / 2)
    assert reproduce.difference(p) == "+0.125 ± 0.085 (3 of 4)"


def d(*diffs):
    """A paired difference with these per-seed values (b = 0)."""
    return reproduce.paired(list(diffs), [0.0] * len(diffs))


def test_the_rule_at_its_boundaries():
    """An effect: the mean at least 2 SE from 0 and its sign on more than half of the seeds."""
    exactly_two_se = d(3.0, 1.0)  # mean 2, sd sqrt(2), SE 1: 2 SE exactly, both seeds positive
    assert exactly_two_se["mean"] == 2 * exactly_two_se["se"]
    assert reproduce.effect_sign(exactly_two_se) == 1
    just_under = d(3.0, 0.99)  # mean 1.995, SE 1.005: 1.99 SE
    assert reproduce.effect_sign(just_under) == 0
    # mean 2 SE from 0 but its sign on only half of the seeds: not an effect
    half = d(*[1.0] * 5, *[-0.01] * 5)  # mean 0.495, SE 0.166
    assert half["mean"] > 2 * half["se"] and reproduce.effect_sign(half) == 0
    three_of_five = d(10.0, 10.0, 10.0, -0.1, -0.1)  # its sign on 3 of 5: more than half
    assert three_of_five["mean"] > 2 * three_of_five["se"] and reproduce.effect_sign(three_of_five) == 1
    assert reproduce.effect_sign(d(-0.5, -0.5, -0.5)) == -1  # SE 0: every seed the same way
    assert reproduce.effect_sign(d(0.0, 0.0, 0.0)) == 0
    assert reproduce.effect_sign(d(1.0)) == 0  # one seed: no standard error, no effect


def test_verdict_words():
    up, down, none = d(1.0, 1.2, 0.9), d(-1.0, -1.2, -0.9), d(1.0, -1.0, 0.1)
    assert [reproduce.verdict(p, 1) for p in (up, down, none)] == ["reproduced", "reversed", "not reproduced"]
    assert [reproduce.verdict(p, -1) for p in (up, down, none)] == ["reversed", "reproduced", "not reproduced"]
    assert [reproduce.verdict(p, 0) for p in (up, down, none)] == ["higher", "lower", "no effect"]


def fake_results(name, seeds, value):
    """A results file for `name` whose arms all score value(seed, arm, metric)."""
    exp = reproduce.EXPERIMENTS[name]
    arms = {a for c in exp.comparisons for a in c[:2]} | {a for c in exp.claims for a in (c.a, c.b)}
    arms |= {"DPO, first 50 steps", "DPO, last 50 steps"}  # OraPO's extra rows
    metrics = exp.metrics + ["zero-reward groups, first 50 steps", "accuracy on zero-reward groups"]
    record = {
        "argv": ["x"],
        "machine": {"cpu": "CPU", "cpu_capability": "AVX2", "torch": "2.x", "python": "3.x"},
        "pins": {"OMP_NUM_THREADS": "1"},
        "commit": "abc",
        "cpu_s": 60.0,
    }
    data = {"name": name, "declared": exp.declared, "seeds": {}, "runs": {}}
    for s in seeds:
        numbers = {a: {m: value(s, a, m) for m in metrics} | {"curve": [0.1] * 20} for a in sorted(arms)}
        data["seeds"][str(s)] = {"arms": numbers}
        data["runs"][str(s)] = {"job": [record]}
    return data


def test_report_leads_with_the_declared_seeds_and_keeps_an_extension_apart():
    exp = reproduce.EXPERIMENTS["orapo"]
    claim = exp.claims[0]  # Fig. 2: fewer zero-reward groups (sign -1)
    seeds = exp.declared + [900, 901, 902]

    def value(s, arm, metric):
        if arm == claim.a and metric == claim.metric:
            return 0.1 + (0.05 if s >= 900 else -0.02) + 0.001 * (s % 3)  # declared: lower; extension: higher
        return 0.1

    lines = reproduce.report("orapo", fake_results("orapo", seeds, value))
    text = "\n".join(lines)
    primary = next(x for x in lines if "(primary" in x)
    assert "**reproduced**" in primary and "-0.019 ± 0.000 (0 of 8)" in primary
    extension = text[text.index("Extension, seeds 900-902") :]
    assert "**reversed**" in extension  # its own verdict, on its own seeds
    assert "(8 of 8)" not in extension and "(3 of 3)" in extension
    assert "CPU-minutes per seed: 1. Every run: CPU (AVX2 kernels)" in lines[-1]
    partial = "\n".join(reproduce.report("orapo", fake_results("orapo", exp.declared[:-1], value)))
    assert "Not yet measured on the declared seeds 300-307** (7 of 8 have run)" in partial
    assert "`python tests/reproduce.py orapo`" in partial and "interim: no verdict" in partial
    assert not any(f"**{w}**" in partial for w in [*reproduce.CLAIM_WORDS.values(), *reproduce.CHECK_WORDS.values()])
    nothing = reproduce.report("orapo", {"seeds": {}, "runs": {}})
    assert len(nothing) == 2 and "(0 of 8 have run)" in nothing[1]


def test_recheck_compares_a_seed_with_its_committed_row_to_the_printed_digits(tmp_path, monkeypatch):
    exp = reproduce.EXPERIMENTS["orapo"]
    data = fake_results("orapo", exp.declared, lambda s, arm, metric: 0.25)
    row = data["seeds"]["300"]["arms"]
    same = json.loads(json.dumps(row))
    same["orapo"]["test macro F1"] = 0.2501  # rounds to the printed 0.250
    monkeypatch.setattr(exp, "read", lambda root, seed: same)
    check = reproduce.recheck("orapo", 300, tmp_path, data)
    assert check["differs"] == [] and check["largest_difference"] == pytest.approx(1e-4)
    line = reproduce.recheck_line(check)
    assert line.startswith("Seed 300 run again") and f"all {check['numbers']} numbers" in line
    moved = json.loads(json.dumps(row))
    moved["grpo"]["curve"][3] = 0.2  # one point of a curve: printed 0.200, committed 0.100
    moved["orapo"]["test FactS"] = 0.2506  # printed 0.251
    monkeypatch.setattr(exp, "read", lambda root, seed: moved)
    check = reproduce.recheck("orapo", 300, tmp_path, data)
    assert sorted(check["differs"]) == ["grpo/curve[3]", "orapo/test FactS"]
    assert "2 of" in reproduce.recheck_line(check)
    data["recheck"] = check
    assert reproduce.report("orapo", data)[-1] == reproduce.recheck_line(check)
    del moved["grpo"]["curve"]
    with pytest.raises(ValueError, match="definition changed"):
        reproduce.recheck("orapo", 300, tmp_path, data)


def test_readme_tables_are_the_reports_verbatim():
    """Every table the README prints comes from `--report` on a committed results file, to the character."""
    readme = (ROOT / "README.md").read_text()
    for name in reproduce.EXPERIMENTS:
        results = ROOT / "tests" / "results" / f"{name}.json"
        if reproduce.README_BEGIN.format(name=name) not in readme:
            assert not results.is_file(), f"{results} is committed but the README does not print it"
            continue
        start, stop = reproduce.readme_block(readme, name)
        data = json.loads(results.read_text()) if results.is_file() else {"seeds": {}, "runs": {}}
        printed = reproduce.report(name, data)
        assert readme[start:stop].splitlines() == printed, f"README's {name} table differs from its --report"


def dry_run(name, tmp_path, capsys, *flags) -> dict[str, list[str]]:
    """The real command lines of a sweep (`--dry-run`), by run folder: {"s100/orapo": [flags...]}."""
    reproduce.main([name, "--dry-run", "--out", str(tmp_path), *flags])
    out = {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        argv = line.split()
        folder = Path(argv[argv.index("--out") + 1]).relative_to(tmp_path / name)
        argv = argv[1:]  # without the interpreter
        out.setdefault(str(folder), []).append(argv)
    return out


def flags(argv: list[str]) -> dict[str, str]:
    """--flag value pairs of a command line (a flag without a value: True), without --out."""
    out, k = {}, 1
    while k < len(argv):
        value = argv[k + 1] if k + 1 < len(argv) and not argv[k + 1].startswith("--") else True
        out[argv[k]] = value
        k += 2 if value is not True else 1
    out.pop("--out")
    return out


def differ(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_orapo_arms_differ_by_lambda_only(tmp_path, capsys):
    runs = dry_run("orapo", tmp_path, capsys)
    for s in reproduce.EXPERIMENTS["orapo"].declared:
        (orapo,), (grpo,) = runs[f"s{s}/orapo"], runs[f"s{s}/grpo"]
        assert flags(orapo)["--seed"] == str(s)
        assert differ(flags(grpo), flags(orapo)) == {"--lambda-min": ("0", None), "--lambda-max": ("0", None)}


def test_mrg_r1_arms_differ_by_their_reward_only(tmp_path, capsys):
    """One converged warm start per seed; every arm starts from it (--init) and differs from the primary arm by its
    reward alone, or (the check) by SFT steps instead of RL."""
    runs = dry_run("mrg_r1", tmp_path, capsys, "--seeds", "300")
    arm = {name.split("/")[1]: flags(argv) for name, (argv,) in runs.items()}
    assert arm["start"] == {"--seed": "300", "--steps": "0"}  # the script's own warm start, until it converges
    assert (
        arm["mccs+format"]["--init"].endswith("/s300/start/warm_start/final") and arm["mccs+format"]["--seed"] == "300"
    )
    assert arm["mccs+format"]["--reward"] == "mccs+format"
    for other in ("format", "ce_f1+format"):
        assert differ(arm[other], arm["mccs+format"]) == {"--reward": (other, "mccs+format")}
    sft = differ(arm["sft+300"], arm["mccs+format"])
    assert sft == {"--sft-steps": ("300", None), "--steps": ("0", None), "--reward": (None, "mccs+format")}


def test_rrgcl_first_file_is_the_first_declared_seeds_whatever_seeds_run(tmp_path, capsys):
    first = reproduce.EXPERIMENTS["rrgcl"].declared[0]
    runs = dry_run("rrgcl", tmp_path, capsys, "--seeds", f"{first + 2}-{first + 3}")
    assert f"s{first}/measure" in runs  # measured once, though its seed is not run
    for s in (first + 2, first + 3):
        (own,), (first_file,), (none,) = runs[f"s{s}/rrgcl"], runs[f"s{s}/rrgcl_first_file"], runs[f"s{s}/none"]
        assert flags(first_file)["--difficulty"].endswith(f"/s{first}/measure/difficulty.json")
        assert flags(own)["--difficulty"].endswith(f"/s{s}/measure/difficulty.json")
        assert differ(flags(first_file), flags(own)) == {
            "--difficulty": (flags(first_file)["--difficulty"], flags(own)["--difficulty"])
        }
        assert differ(flags(none), flags(own)) == {"--scheduler": ("none", None)}


def test_every_arm_is_a_valid_command_line(tmp_path, capsys):
    """Each arm's flags parse with its script's own Args: a misspelt flag or value fails here, not in a sweep."""
    import importlib

    import common

    for name, exp in reproduce.EXPERIMENTS.items():
        for argvs in dry_run(name, tmp_path, capsys, "--seeds", str(exp.declared[0])).values():
            for argv in argvs:
                script = importlib.import_module(Path(argv[0]).stem)
                flags_only = argv[2:] if not argv[1].startswith("-") else argv[1:]  # deer, dcrrg: a command first
                common.parse_args(script.Args, flags_only)


def test_every_run_of_a_seed_has_that_seed(tmp_path, capsys):
    for name, exp in reproduce.EXPERIMENTS.items():
        seeds = exp.declared[:2]
        runs = dry_run(name, tmp_path, capsys, "--seeds", f"{seeds[0]},{seeds[1]}")
        for folder, argvs in runs.items():
            for argv in argvs:
                assert flags(argv)["--seed"] == folder.split("/")[0][1:], (name, folder)


def write_eval(path: Path, before: dict, after: dict | None = None, key: str = "test"):
    path.mkdir(parents=True, exist_ok=True)
    result = {"test_before": before, "test_after": after} if after else {key: before}
    (path / "eval.json").write_text(json.dumps(result))


def evaluation(headline: str, value: float, **extra) -> dict:
    ce = dict.fromkeys(("micro_f1", "macro_f1", "example_f1", "micro_precision", "micro_recall"), value)
    nlg = {"BLEU-4": value, "CIDEr": value}
    return {"ce": ce, "headline": headline, "nlg": nlg, "degenerate": {"distinct": int(value * 100)}} | extra


def test_tables_read_the_evaluation_after_training(tmp_path):
    """RL arms are read from test_after (test_before is the start they share); the SFT-only arm from its only one."""
    root = tmp_path / "mrg_r1"
    for arm in ("mccs+format", "format", "ce_f1+format"):
        before = evaluation("micro_f1", 0.2, reward=0.2)
        write_eval(root / "s1" / arm, before, evaluation("micro_f1", 0.9, reward=0.9))
    write_eval(root / "s1" / "sft+300", evaluation("micro_f1", 0.5, reward=0.5), key="test_before")
    write_eval(root / "s1" / "start", evaluation("micro_f1", 0.1, reward=0.1), key="test_before")
    (root / "s1" / "start" / "warm_start").mkdir()
    (root / "s1" / "start" / "warm_start" / "eval.json").write_text('{"steps": 900, "converge": {"best_step": 500}}')
    out = reproduce.mrg_r1_read(root, 1)
    assert out["warm start"]["CE micro F1"] == 0.1 and out["sft+300"]["CE micro F1"] == 0.5
    assert {out[a]["CE micro F1"] for a in ("mccs+format", "format", "ce_f1+format")} == {0.9}
    assert {out[a]["CE micro recall"] for a in ("mccs+format", "format", "ce_f1+format")} == {0.9}
    root = tmp_path / "orapo"
    for arm in ("orapo", "grpo"):
        before = evaluation("macro_f1", 0.1, facts_reward=0.1)
        write_eval(root / "s1" / arm, before, evaluation("macro_f1", 0.9, facts_reward=0.9))
        (root / "s1" / arm / "metrics.jsonl").write_text(
            json.dumps({"zero_group_ratio": 0.5, "dpo_accuracy_x_zero": 0.25, "lambda": 0.07}) + "\n"
        )
    out = reproduce.orapo_read(root, 1)
    assert out["orapo"]["test macro F1"] == 0.9 and out["grpo"]["test FactS"] == 0.9
    assert out["orapo"]["distinct test reports"] == 90  # after training, not before (10)
    assert out["orapo"]["mean lambda"] == 0.07
    assert out["DPO, first 50 steps"]["accuracy on zero-reward groups"] == 0.5  # 0.25 of the steps' 0.5 zero groups


def test_runner_order_skips_finished_and_resumes_started(tmp_path, monkeypatch):
    """Each job runs after the folders it needs; a finished one is skipped; a folder already holding a run gets
    --resume; every launch is recorded with the machine, the pins and the commit."""
    order = tmp_path / "order.txt"
    script = (
        "import sys, pathlib; out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); out.mkdir(parents=True, "
        "exist_ok=True); (out / sys.argv[1]).write_text('x'); open(sys.argv[2], 'a').write(sys.argv[1] + "
        "(' resume' if '--resume' in sys.argv else '') + '\\n')"
    )
    (tmp_path / "stand_in.py").write_text(script)
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    jobs = [
        reproduce.Job("m", ["stand_in.py", "measure", str(order)], done="measure"),
        reproduce.Job("x", ["stand_in.py", "train", str(order)], done="train", after=("m",)),
        reproduce.Job("x", ["stand_in.py", "table", str(order)], done="table"),
    ]
    reproduce.run_all(jobs, tmp_path, 2, dry_run=False)
    lines = order.read_text().splitlines()
    assert lines.index("measure") < [x.split()[0] for x in lines].index("train")
    assert sorted(lines) in (["measure", "table resume", "train"], ["measure", "table", "train resume"])
    record = reproduce.records(jobs[0], tmp_path)[0]
    assert record["pins"]["ATEN_CPU_CAPABILITY"] == "avx2" and record["exit"] == 0 and record["commit"]
    assert record["machine"]["cpu_capability"] == "AVX2"  # the pin took effect in the child
    order.write_text("")
    reproduce.run_all(jobs, tmp_path, 2, dry_run=False)  # all finished, and ran these flags: nothing runs
    assert order.read_text() == ""
    changed = [reproduce.Job("m", ["stand_in.py", "measure", str(order), "--other"], done="measure")]
    with pytest.raises(SystemExit, match="the definition changed"):
        reproduce.run_all(changed, tmp_path, 2, dry_run=False)


def test_runner_never_runs_two_jobs_of_one_folder_at_once(tmp_path, monkeypatch):
    """DEER's stages share a folder (sft, then rl, then the tables): with free slots, they still run one at a time."""
    log = tmp_path / "log.txt"
    script = (
        "import sys, time; log = open(sys.argv[2], 'a', buffering=1); log.write('start ' + sys.argv[1] + '\\n'); "
        "time.sleep(0.3); log.write('end ' + sys.argv[1] + '\\n')"
    )
    (tmp_path / "stand_in.py").write_text(script)
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    jobs = [reproduce.Job("s1", ["stand_in.py", stage, str(log)], done=stage) for stage in ("all", "rl", "table6")]
    reproduce.run_all(jobs, tmp_path, 3, dry_run=False)
    lines = log.read_text().splitlines()
    assert [x.split()[0] for x in lines] == ["start", "end"] * 3, lines


def test_report_command_prints_from_the_results_file(tmp_path):
    exp = reproduce.EXPERIMENTS["orapo"]
    data = fake_results("orapo", exp.declared, lambda s, a, m: 0.1 * (a == "orapo") + 0.001 * s)
    (tmp_path / "orapo.json").write_text(json.dumps(data))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "reproduce.py"), "orapo", "--report", "--results", str(tmp_path)]
        + ["--figures", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"RRG_FIGURES": "0", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[: len(reproduce.report("orapo", data))] == reproduce.report("orapo", data)


def test_mention_f1_by_hand():
    """CheXbert's measure: micro F1 over positive, negative and uncertain mentions; blank is no mention."""
    nan = np.nan
    gold = np.array([[1, 0, nan, -1], [nan, 1, 0, nan]])
    ours = np.array([[1, nan, 0, 1], [nan, 1, 0, -1]])
    # mentions: gold 5, ours 6; matching (value and place): (0,0) 1, (1,1) 1, (1,2) 0 -> TP 3, FP 3, FN 2
    assert reproduce.mention_f1(ours, gold) == pytest.approx(6 / 11)


def test_commit_is_marked_changed_by_code_not_by_a_sweeps_figures(tmp_path, monkeypatch):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "tests" / "figures").mkdir(parents=True)
    (tmp_path / "orapo.py").write_text("x = 1\n")
    (tmp_path / "tests" / "figures" / "orapo.png").write_bytes(b"png")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    clean = reproduce.commit()
    (tmp_path / "tests" / "figures" / "orapo.png").write_bytes(b"drawn by a sweep")
    assert reproduce.commit() == clean and "+" not in clean
    (tmp_path / "orapo.py").write_text("x = 2\n")
    assert reproduce.commit() == clean + "+changes"
