"""tests/reproduce.py: the rule in code, the tables printed from results, the experiments' definitions, the runner."""

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reproduce
import sandbox

ROOT = Path(__file__).resolve().parents[1]


def test_seeds_are_declared_ranges_or_lists():
    assert reproduce.parse_seeds("100-103,110") == [100, 101, 102, 103, 110]
    with pytest.raises(SystemExit, match="distinct seeds"):
        reproduce.parse_seeds("1,1")


def test_paired_difference_by_hand():
    p = reproduce.paired([0.5, 0.7, 0.4, 0.9], [0.4, 0.5, 0.5, 0.6])  # d = 0.1, 0.2, -0.1, 0.3
    assert p["mean"] == pytest.approx(0.125) and p["positive"] == 3 and p["negative"] == 1 and p["n"] == 4
    sd = np.sqrt(((0.1 - 0.125) ** 2 + 0.075**2 + 0.225**2 + 0.175**2) / 3)
    assert p["se"] == pytest.approx(sd / 2)
    assert reproduce.difference(p) == "+0.125 [-0.147, +0.397] (3 of 4 higher)"  # +- t(3, 0.975) = 3.1824 SE
    assert reproduce.difference(p, -1) == "+0.125 [-0.147, +0.397] (1 of 4 lower)"  # counted the claimed way


def d(*diffs):
    """A paired difference with these per-seed values (b = 0)."""
    return reproduce.paired(list(diffs), [0.0] * len(diffs))


SPREAD = np.array([0.3, -0.1, 0.2, -0.4, 0.1, 0.0, -0.2, 0.1])  # mean 0: SE sd / sqrt 8, whatever is added


def at(mean: float):
    return d(*(SPREAD - SPREAD.mean() + mean))


def arm_values(exp, value, seed):
    """Every arm of `exp` with every metric its tables read, each value(seed, arm, metric)."""
    arms = {a for c in exp.claims for a in (c.a, c.b)} | {c.a for c in exp.checks}
    arms |= {c.b for c in exp.checks if isinstance(c.b, str)}
    metrics = set(exp.columns) | {m for c in exp.claims for m in c.signs} | {c.metric for c in exp.checks}
    metrics |= {exp.headline + " (gold)", "labelers agree", "commonest share"}
    out = {}
    for a in sorted(arms):
        out[a] = {m: value(seed, a, m) for m in metrics} | {"curve": [0.1] * 20, "distinct reports": 300}
        out[a]["commonest report"] = "The lungs are clear."
    return out | {"start": {"SFT steps": 900, "best step": 500}}


def fake_results(name, seeds, value):
    """A results file for `name` whose arms all score value(seed, arm, metric)."""
    exp = reproduce.EXPERIMENTS[name]
    record = {
        "argv": ["x"],
        "machine": {"cpu": "CPU", "cpu_capability": "AVX2", "torch": "2.x", "python": "3.x"},
        "pins": {"OMP_NUM_THREADS": "1"},
        "commit": "abc",
        "cpu_s": 60.0,
    }
    data = {"name": name, "declared": exp.declared, "seeds": {}, "runs": {}}
    for s in seeds:
        data["seeds"][str(s)] = {"arms": arm_values(exp, value, s)}
        data["runs"][str(s)] = {"job": [record]}
    return data


REFS = {
    row: {"CE macro F1": 0.1 * k, "CE macro F1 (gold)": 0.1 * k, "distinct reports": 1}
    for k, row in enumerate(reproduce.REFERENCE_ROWS)
}


def test_the_rule_at_its_boundaries():
    """The interval and p the words read: mean +- t(n - 1, 0.975) SE (2.3646 SE at 8 seeds, 12.706 at 2, from
    tables) and the paired t-test's p, which crosses 5 % exactly where the interval's edge crosses 0."""
    assert reproduce.t_quantile(0.975, 8) == pytest.approx(2.364624, abs=1e-6)
    assert reproduce.t_quantile(0.975, 2) == pytest.approx(12.7062, abs=1e-4)
    se = SPREAD.std(ddof=1) / np.sqrt(8)
    edge = 2.364624 * se
    lo, hi = reproduce.interval(at(1.0))
    assert (lo, hi) == (pytest.approx(1.0 - edge, rel=1e-6), pytest.approx(1.0 + edge, rel=1e-6))
    assert reproduce.interval(at(1.0), 0.90)[0] == pytest.approx(1.0 - 1.894579 * se, rel=1e-6)
    assert reproduce.t_test(at(edge * 1.001)) < 0.05 < reproduce.t_test(at(edge * 0.999))
    assert reproduce.t_test(at(edge)) == pytest.approx(0.05, abs=1e-6)
    assert reproduce.t_test(at(2.0 * se)) == pytest.approx(0.08556, abs=1e-4)  # t 2.0 at 7 df, two-sided (tables)
    assert reproduce.t_test(at(2.0 * se), side=1) == pytest.approx(0.08556 / 2, abs=1e-4)
    assert reproduce.t_test(at(2.0 * se), null=2.0 * se) == pytest.approx(1.0)
    assert reproduce.t_test(d(-0.5, -0.5, -0.5)) == 0.0  # SE 0: every seed the same way, exactly
    assert reproduce.t_test(d(0.0, 0.0, 0.0)) == 1.0
    assert math.isnan(reproduce.t_test(d(1.0)))  # one seed: no standard error, no test


def test_holm_on_a_made_family():
    """Holm by hand: sorted 0.01, 0.02, 0.03, 0.5 -> 4 x 0.01, max(that, 3 x 0.02), max(..., 2 x 0.03), 1 x 0.5;
    a NaN is no test (the family is 4, not 5)."""
    adjusted = reproduce.holm([0.03, 0.5, 0.01, math.nan, 0.02])
    assert adjusted[:3] == [pytest.approx(0.06), pytest.approx(0.5), pytest.approx(0.04)]
    assert math.isnan(adjusted[3]) and adjusted[4] == pytest.approx(0.06)
    assert reproduce.holm([0.04, 0.04]) == [pytest.approx(0.08), pytest.approx(0.08)]
    assert reproduce.holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1, never below the smaller one's


def claim(signs, effects=None, margins=None):
    return reproduce.Claim("a", "b", signs, "Table 1", effects=effects or {}, margins=margins or {})


def judged(p, c, metric="F1"):
    """The primary's words: raw p-values at 5 %."""
    sign = c.signs[metric]
    return reproduce.words(p, sign, c, metric, *reproduce.claim_p(p, sign, c, metric))


def test_each_word_of_a_directional_claim_on_hand_made_numbers():
    """SPREAD's SE is 0.0749: the 95 % interval is mean +- 0.177. An interval above 0: reproduced; below: reversed;
    holding 0 and excluding the paper's effect: smaller than the paper's; holding both: cannot tell; no size stated:
    no effect seen. A claim a < b is mirrored."""
    up = claim({"F1": 1}, {"MIMIC-CXR": {"F1": 0.5}})
    assert judged(at(0.2), up) == {"": "reproduced"}  # [+0.023, +0.377]: its effect 0.5 outside, still reproduced
    assert judged(at(-0.2), up) == {"": "reversed"}
    assert judged(at(0.1), up) == {"MIMIC-CXR": "smaller than the paper's"}  # [-0.077, +0.277] holds 0, not 0.5
    assert judged(at(0.1), claim({"F1": 1}, {"MIMIC-CXR": {"F1": 0.2}})) == {"MIMIC-CXR": "cannot tell"}
    assert judged(at(0.1), claim({"F1": 1})) == {"": "no effect seen"}
    down = claim({"F1": -1}, {"MIMIC-CXR": {"F1": -0.5}})
    assert judged(at(-0.2), down) == {"": "reproduced"} and judged(at(0.2), down) == {"": "reversed"}
    assert judged(at(-0.1), down) == {"MIMIC-CXR": "smaller than the paper's"}


def test_a_paper_effect_on_several_data_sets_gets_a_word_against_each():
    """MRG-R1's Table II states +0.005 on IU X-Ray and +0.109 on MIMIC-CXR; an interval [-0.077, +0.277]... here
    [-0.157, +0.197] holds 0 and the first, excludes the second."""
    c = claim({"F1": 1}, {"IU X-Ray": {"F1": 0.005}, "MIMIC-CXR": {"F1": 0.3}})
    words = judged(at(0.02), c)
    assert words == {"IU X-Ray": "cannot tell", "MIMIC-CXR": "smaller than the paper's"}
    row = reproduce.Row(c, "F1", 1, at(0.02), True, words=words)
    assert row.word == "cannot tell (IU X-Ray +0.005); smaller than the paper's (MIMIC-CXR +0.300)"
    both = reproduce.Row(c, "F1", 1, at(0.02), True, words={"IU X-Ray": "cannot tell", "MIMIC-CXR": "cannot tell"})
    assert both.word == "cannot tell (IU X-Ray +0.005, MIMIC-CXR +0.300)"
    mrg_r1 = reproduce.EXPERIMENTS["mrg_r1"].claims[0]
    assert mrg_r1.effects_on("CE micro F1") == {"IU X-Ray": 0.0053, "MIMIC-CXR": 0.1089}  # 51.88 - 51.35, 40.39 - 29.50


def test_equivalence_inside_and_outside_its_margin():
    """a = b with margin m: equal within m when the 90 % interval (t(7, 0.95) = 1.8946 SE either side) lies inside
    +-m; apart when it lies past m on one side; else cannot tell."""
    se = SPREAD.std(ddof=1) / np.sqrt(8)
    c = claim({"F1": "="}, margins={"F1": 0.5})
    edge = 0.5 - 1.894579 * se  # the largest |mean| still shown equal
    assert judged(at(edge * 0.999), c) == {"": "equal within 0.500"} == judged(at(-edge * 0.999), c)
    assert judged(at(edge * 1.001), c) == {"": "cannot tell"}
    apart = 0.5 + 1.894579 * se  # the smallest |mean| shown apart
    assert judged(at(apart * 1.001), c) == {"": "apart by more than 0.500"} == judged(at(-apart * 1.001), c)
    assert judged(at(apart * 0.999), c) == {"": "cannot tell"}
    assert judged(d(0.0), c) == {"": "cannot tell"}  # one seed shows nothing


def test_detectable_is_the_effect_found_80_percent_of_the_time():
    """detectable(), a design figure: the noncentral t's power at delta SE is 0.8 (a two-sided t test at 5 %, 7 df);
    delta 3.27, 1.38 times the 2.365 SE the test needs; checked by simulation (20,000 tables of 8 normal seeds)."""
    p = at(0.0)
    delta = reproduce.detectable(p) / p["se"]
    assert delta == pytest.approx(3.2698, abs=1e-3) and delta / 2.364624 == pytest.approx(1.383, abs=1e-3)
    rng = np.random.default_rng(0)
    x = rng.normal(delta / np.sqrt(8), 1.0, (20000, 8))  # mean = delta * sd / sqrt(n): delta standard errors
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(8))
    assert np.mean(np.abs(t) >= 2.364624) == pytest.approx(0.8, abs=0.01)


def test_the_primary_at_5_percent_the_secondaries_by_holm():
    """OraPO: the primary (zero-reward groups) is read at 5 % unadjusted; a secondary with the same raw p 0.02 in a
    family of 15 is judged by its Holm-adjusted p and reads cannot tell; the checks use the 95 % interval."""
    exp = reproduce.EXPERIMENTS["orapo"]
    same = SPREAD * 0.1 + 0.0  # the same per-seed spread on both columns
    se = same.std(ddof=1) / np.sqrt(8)
    lift = -2.6 * se  # t 2.6 at 7 df: two-sided p 0.035

    def value(s, arm, m):
        k = exp.declared.index(s)
        moved = m in ("zero-reward groups", "CE macro F1")
        return 0.5 + (same[k] - same.mean() + (lift if m == "zero-reward groups" else -lift)) * (
            arm == "OraPO + FactS" and moved
        )

    rows = reproduce.claim_rows(exp, reproduce.results_of(fake_results("orapo", exp.declared, value)), exp.declared)
    primary = rows[0]
    assert primary.primary and primary.metric == "zero-reward groups" and primary.word == "reproduced"
    assert primary.p_claim == primary.raw[0] == pytest.approx(0.035, abs=0.002)
    f1 = next(
        r for r in rows if r.metric == "CE macro F1" and r.claim.b == "GRPO + FactS" and r.claim.a == "OraPO + FactS"
    )
    assert f1.raw[0] == pytest.approx(primary.raw[0]) and len([r for r in rows if not r.primary]) == 15
    assert f1.p_claim == pytest.approx(min(1.0, 15 * f1.raw[0]))  # the smallest p of its family: times 15
    # its interval, +0.019 [+0.002, +0.037], excludes 0, but Holm's p (0.53) does not: not reproduced; it excludes
    # Table 4's +0.050 (its Holm-adjusted size test below 5 %): smaller than the paper's
    assert f1.p_sizes["CheXpert Plus"] < 0.05
    assert f1.word == "smaller than the paper's"


def test_a_claim_true_by_construction_says_so():
    c = next(c for c in reproduce.EXPERIMENTS["mrg_r1"].claims if c.construction)
    assert reproduce.shown(c, "reproduced").startswith("**reproduced** (by construction: Base is the best")


def test_check_words():
    up, down, none = d(1.0, 1.2, 0.9), d(-1.0, -1.2, -0.9), d(1.0, -1.0, 0.1)
    assert [reproduce.check_word(p) for p in (up, down, none)] == ["higher", "lower", "no difference seen"]


def test_one_seed_deciding_a_verdict_is_called_fragile():
    """Leaving each seed out in turn: a verdict that one seed carries says so and names the seed and the word without
    it; a verdict every seven-seed table keeps "holds". The note never changes the word. The README's form says what
    the word becomes too, without the paper's effects (the summary prints them beside it)."""
    exp = reproduce.EXPERIMENTS["orapo"]
    lift = dict(zip(exp.declared, [0.02, 0.021, 0.019, 0.02, 0.022, 0.018, 0.02, 0.02]))  # a steady -0.02

    def value(s, arm, m):
        return 0.1 - lift[s] if arm == "OraPO + FactS" and m == "zero-reward groups" else 0.1

    def primary():
        results = reproduce.results_of(fake_results("orapo", exp.declared, value))
        row = reproduce.primary_row(exp, results, exp.declared)
        return row, reproduce.fragile(row, reproduce.left_out(exp, results, exp.declared))

    row, changed = primary()
    assert row.word == "reproduced" and changed == [] and reproduce.fragility([]) == "holds"
    # an effect that needs most of its seeds
    lift = dict(zip(exp.declared, [0.010, 0.012, 0.008, -0.004, 0.011, -0.003, 0.009, 0.020]))
    row, changed = primary()
    by_hand = []  # the 95 % interval of the seven others: mean +- t(6, 0.975) = 2.4469 SE, holding 0 or not
    for s in exp.declared:
        x = np.array([v for k, v in lift.items() if k != s])
        if abs(x.mean()) < 2.446912 * x.std(ddof=1) / np.sqrt(7):
            by_hand.append(s)
    assert row.word == "reproduced" and [s for s, _ in changed] == by_hand and len(by_hand) >= 4
    assert all(w == "no effect seen" for _, w in changed)  # Fig. 2 states no size
    assert reproduce.fragility(changed[:1]) == f"fragile: no effect seen without {by_hand[0]}"
    results = reproduce.results_of(fake_results("orapo", exp.declared, value))
    short = f"fragile: no effect seen without {' or '.join(map(str, by_hand))}"  # the README's, summary and line
    assert reproduce.one_seed_out(exp, results, exp.declared, row) == short
    assert (
        f"; {short}. On 800-803" in reproduce.verdict_line("orapo", fake_results("orapo", exp.declared, value), {})[0]
    )
    assert reproduce.fragility([(400, "reversed"), (402, "reversed"), (405, "cannot tell")]) == (
        "fragile: reversed without 400 or 402; cannot tell without 405"
    )


def test_the_readme_says_what_a_fragile_word_becomes_without_the_papers_effects():
    """MRG-R1's paper states its effect on two data sets: the claims table names each data set's effect beside the
    word a seed left out gives; the README's short form gives the word alone, once where the data sets agree and each
    in turn where they differ."""
    exp = reproduce.EXPERIMENTS["mrg_r1"]
    c = exp.claims[0]  # + MCCS + format > + CE F1 + format on CE micro F1: +0.005 (IU X-Ray), +0.109 (MIMIC-CXR)
    effects = c.effects_on(exp.primary)
    assert effects == {"IU X-Ray": pytest.approx(0.005, abs=1e-3), "MIMIC-CXR": pytest.approx(0.109, abs=1e-3)}
    spread = dict(zip(exp.declared, [0.004, -0.004, 0.003, -0.003, 0.002, -0.002, 0.001, -0.001]))

    def value(s, arm, m):
        return 0.5 + (spread[s] + 0.05 * (s == exp.declared[0])) * (arm == c.a and m == exp.primary)

    results = reproduce.results_of(fake_results("mrg_r1", exp.declared, value))
    row = reproduce.primary_row(exp, results, exp.declared)
    # eight seeds: +0.006 [-0.010, +0.023], the first seed's +0.054 widening it: it holds IU X-Ray's +0.005 and rules
    # out MIMIC-CXR's +0.109, a word each
    assert row.words == {"IU X-Ray": "cannot tell", "MIMIC-CXR": "smaller than the paper's"}
    without = reproduce.left_out(exp, results, exp.declared)
    first = without[exp.declared[0]][id(c), exp.primary]  # the seven others: a mean of 0 +- 0.003, ruling both out
    assert first.words == {"IU X-Ray": "smaller than the paper's", "MIMIC-CXR": "smaller than the paper's"}
    assert reproduce.plain(first) == "smaller than the paper's"
    assert reproduce.fragility(reproduce.fragile(row, without)) == (
        f"fragile: smaller than the paper's (IU X-Ray +0.005, MIMIC-CXR +0.109) without {exp.declared[0]}"
    )
    short = reproduce.one_seed_out(exp, results, exp.declared, row)
    assert short == f"fragile: smaller than the paper's without {exp.declared[0]}"
    split = reproduce.Row(c, exp.primary, 1, row.p, True, words={"IU X-Ray": "cannot tell", "MIMIC-CXR": "smaller"})
    assert reproduce.plain(split) == "cannot tell / smaller"


def test_a_collapsed_arm_seed_is_marked_and_counted():
    """An arm-seed below the best constant report (the blind row) or whose commonest report is over a third of its
    reports has collapsed: marked "c" in the per-seed table, counted per arm, noted beside each verdict of a claim on
    it (never changing the word), and a comparison against an arm collapsed on most seeds is named under the
    README's summary."""
    exp = reproduce.EXPERIMENTS["orapo"]
    first, second, third = exp.declared[1:4]
    refs = {row: dict(r) for row, r in REFS.items()}  # the best constant report scores 0.0 on CE macro F1 in REFS
    refs["blind: best constant report"]["CE macro F1"] = 0.15

    def value(s, arm, m):
        if m == "commonest share":
            return {first: 0.34, second: 1 / 3}.get(s, 0.1) if arm == "OraPO + FactS" else 0.1
        if arm == "Base" and m == "CE macro F1":
            return 0.12  # below the blind row on every seed
        return 0.1 if (arm == "OraPO + FactS" and s == third) else 0.2

    data = fake_results("orapo", exp.declared, value)
    results = reproduce.results_of(data)
    assert reproduce.collapsed(exp, results, exp.declared, "OraPO + FactS", refs) == [first, third]
    assert reproduce.collapsed(exp, results, exp.declared, "GRPO + FactS", refs) == []
    table = reproduce.seed_table(exp, results, exp.declared, refs)
    row = next(x for x in table if x.startswith("| OraPO + FactS |"))
    assert row.count(" c |") == 2 and "| 0.100 c |" in row
    outputs = reproduce.outputs_table(exp, results, exp.declared, refs)
    assert "| 2 of 8 |" in next(x for x in outputs if x.startswith("| OraPO + FactS |"))
    claims = reproduce.claims_table(exp, results, exp.declared, refs)
    versus_base = next(x for x in claims if x.startswith("| Table 4, row 6 vs row 1") and "| CE macro F1 |" in x)
    assert "OraPO + FactS collapsed on 2 of 8; Base collapsed on 8 of 8" in versus_base
    summary = reproduce.summary({"orapo": data}, {"orapo": refs})
    assert "| 2, 0 of 8 |" in next(x for x in summary if x.startswith("| orapo |"))
    assert summary[-1].startswith("Comparisons against an arm collapsed on most seeds")
    assert "orapo: Base collapsed on 8 of 8 seeds, in OraPO + FactS - Base, GRPO + FactS - Base." in summary[-1]


def test_report_leads_with_the_confirmatory_seeds_and_keeps_exploratory_and_extension_apart():
    exp = reproduce.EXPERIMENTS["orapo"]
    metric = exp.primary  # Fig. 2: fewer zero-reward groups (a < b)
    seeds = exp.declared + reproduce.EXPLORATORY + [900, 901, 902]

    def value(s, arm, m):
        if arm == exp.claims[0].a and m == metric:
            return 0.1 + (0.05 if s >= 900 or s < 600 else -0.02) + 0.001 * (s % 3)  # confirmatory: lower
        return 0.1

    lines = reproduce.report("orapo", fake_results("orapo", seeds, value), REFS)
    text = "\n".join(lines)
    assert lines[1] == "Confirmatory seeds 600-607, `python tests/reproduce.py orapo`:"
    primary = next(x for x in lines if "(primary)" in x)
    assert "**reproduced**" in primary and "-0.019 [-0.020, -0.018] (8 of 8 lower)" in primary and metric in primary
    exploratory = text[text.index("Exploratory seeds 400-407: their verdict rules were revised after their results") :]
    assert "**reversed**" in exploratory.split("Extension")[0]  # its own verdict, on its own seeds
    extension = text[text.index("Extension, seeds 900-902") :]
    assert "**reversed**" in extension and "(0 of 3 lower)" in extension
    assert "CPU-minutes per seed: 1. Every run: CPU (AVX2 kernels)" in lines[-1]
    assert "| *image ceiling* |" in text and "| 0.200 |" in text  # the reference rows, one value each
    partial = reproduce.report("orapo", fake_results("orapo", exp.declared[:-1] + reproduce.EXPLORATORY, value), REFS)
    partial = "\n".join(partial)
    assert "Not yet measured on the confirmatory seeds 600-607** (7 of 8 have run)" in partial
    assert "`python tests/reproduce.py orapo`" in partial and "interim: no verdict" in partial
    before = partial[: partial.index("Exploratory seeds 400-407")]
    assert "interim: no verdict" in before and not any(f"**{w}**" in before for w in ("reproduced", "reversed"))
    nothing = reproduce.report("orapo", {"seeds": {}, "runs": {}}, {})
    assert len(nothing) == 2 and "(0 of 8 have run)" in nothing[1]
    line = reproduce.verdict_line("orapo", fake_results("orapo", exp.declared, value), REFS)
    assert len(line) == 1 and "**reproduced**" in line[0] and "-0.019 [-0.020, -0.018] (8 of 8 lower)" in line[0]
    assert "one seed out: holds. On 800-803: not yet run (0 of 4; power 1.00)." in line[0]
    waiting = reproduce.summary({"orapo": fake_results("orapo", reproduce.EXPLORATORY, value)}, {"orapo": REFS})
    orapo = next(x for x in waiting if x.startswith("| orapo |"))
    assert "| not yet measured on 600-607; exploratory 400-407: reversed, +0.051 [+0.050, +0.052]" in orapo


REPLICATION_DIFFS = {  # a - b on 800-803 (b = the base value), by hand
    "replicated": [-0.03, -0.02, -0.025, -0.01],  # mean -0.02125, every seed lower
    "not replicated": [-0.03, 0.02, -0.025, 0.01],  # mean -0.00625, two of four lower
    "reversed again": [-0.04, -0.03, -0.05, -0.035],  # a claim a > b read reversed on 600-607: lower again
    "back the paper's way": [0.04, 0.03, 0.05, 0.035],
}


def replication_results(primary: str, f1: str, seeds=tuple(range(600, 608)) + tuple(range(800, 804))):
    """OraPO's table on 600-607 (the primary, fewer zero-reward groups, reproduced: -0.02; Table 4's row 6 - row 3 in
    CE macro F1, claimed a > b, reversed: -0.03) and on the replication seeds present, whose a - b are
    REPLICATION_DIFFS[primary] and [f1]."""

    def value(s, arm, m):
        if arm != "OraPO + FactS" or m not in ("zero-reward groups", "CE macro F1"):
            return 0.1 if m == "zero-reward groups" else 0.5
        base, key = (0.1, primary) if m == "zero-reward groups" else (0.5, f1)
        if s in reproduce.REPLICATION:
            return base + REPLICATION_DIFFS[key][s - 800]
        return base + (-0.02 if m == "zero-reward groups" else -0.03) + 0.001 * (s % 3)

    return fake_results("orapo", list(seeds), value)


def one_sided_p(diffs, side):
    """The paired t-test's one-sided p on four seeds, from scipy's t directly."""
    from scipy.stats import t

    x = np.asarray(diffs)
    return t.sf(side * x.mean() / (x.std(ddof=1) / 2), 3)


def replication_table(lines):
    """The report's replication section, to the exploratory seeds."""
    start = next(i for i, x in enumerate(lines) if x.startswith("Replication, seeds 800-803"))
    return lines[start : next((i for i, x in enumerate(lines) if x.startswith("Exploratory")), len(lines))]


def replication_line(lines, label, metric):
    return next(x for x in lines if x.startswith(f"| {label}") and f"| {metric} |" in x and "| a " in x)


def test_replication_re_tests_each_reproduced_or_reversed_word_the_way_600_607_read_it():
    """On 800-803 a claim-column reads replicated when its one-sided paired t-test at 5 % goes the way 600-607 read
    (by hand: scipy's t on the four differences); a reversed claim is re-tested in the reversed direction, and going
    the paper's way there reads not replicated. Only reproduced or reversed words are re-tested, the 600-607 words stand
    as judged (never pooled), and the summary and the verdict line carry the primary's replication."""
    primary, row_6_3 = "Fig. 2 (left): fewer zero-reward groups", "Table 4, row 6 vs row 3"
    data = replication_results("replicated", "reversed again")
    lines = reproduce.report("orapo", data, REFS)
    table = replication_table(lines)
    assert table[0].startswith("Replication, seeds 800-803: declared at 3671673 before any run on them")
    first = replication_line(table, primary, "zero-reward groups")
    p = one_sided_p(REPLICATION_DIFFS["replicated"], -1)
    assert p < 0.05 and "(primary)" in first and "| a < b | -0.021 [" in first and "(4 of 4 lower)" in first
    assert f"| {p:.3f} | **replicated** |" in first
    reversed_f1 = replication_line(table, row_6_3, "CE macro F1")
    assert "| reversed, -0.029 [" in reversed_f1 and "| a < b |" in reversed_f1  # claimed a > b: re-tested a < b
    assert f"| {one_sided_p(REPLICATION_DIFFS['reversed again'], -1):.3f} | **replicated** |" in reversed_f1
    assert not any(x.startswith(f"| {row_6_3}") and "| CE macro recall |" in x for x in table)  # not re-tested
    # the 600-607 tables are the same with or without the replication seeds
    alone = reproduce.report("orapo", replication_results("replicated", "reversed again", range(600, 608)), REFS)
    assert lines[: lines.index(table[0])] == alone[: len(lines[: lines.index(table[0])])]
    summary = next(x for x in reproduce.summary({"orapo": data}, {"orapo": REFS}) if x.startswith("| orapo |"))
    assert "| **replicated**, -0.021 [" in summary and f"(4 of 4 lower), p {p:.3f}; power 1.00 |" in summary
    verdict = reproduce.verdict_line("orapo", data, REFS)[0]
    assert verdict.endswith(f"On 800-803: **replicated** (one-sided p {p:.3f}, power 1.00).")

    data = replication_results("not replicated", "back the paper's way")
    table = replication_table(reproduce.report("orapo", data, REFS))
    p = one_sided_p(REPLICATION_DIFFS["not replicated"], -1)
    assert p > 0.05 and f"| {p:.3f} | **not replicated** |" in replication_line(table, primary, "zero-reward groups")
    back = replication_line(table, row_6_3, "CE macro F1")
    assert "(0 of 4 lower)" in back and "| **not replicated** |" in back  # the paper's way is not 600-607's
    assert one_sided_p(REPLICATION_DIFFS["back the paper's way"], -1) > 0.95
    summary = reproduce.summary({"orapo": data}, {"orapo": REFS})
    assert "| **not replicated**, -0.006 [" in next(x for x in summary if x.startswith("| orapo |"))
    assert "On 800-803: **not replicated** (one-sided p" in reproduce.verdict_line("orapo", data, REFS)[0]


def test_replication_not_yet_run_and_never_an_extension():
    """Until all four replication seeds have run, every re-tested row, the summary and the verdict line say how many
    have (no word, no interval); seeds 800-803 are never an extension, whatever else ran; a table whose 600-607 words
    hold no reproduced or reversed column says there is nothing to re-test; a primary not re-tested shows "—"."""
    two = replication_results("replicated", "reversed again", list(range(600, 608)) + [800, 801])
    text = "\n".join(reproduce.report("orapo", two, REFS))
    assert "Extension" not in text and "**replicated**" not in text
    # three columns read reproduced or reversed: the primary, and CE macro F1 against row 3 and row 1 (reversed)
    assert text.count("| not yet run on 800-803 (2 of 4 have run) |") == 3
    summary = next(x for x in reproduce.summary({"orapo": two}, {"orapo": REFS}) if x.startswith("| orapo |"))
    assert "| not yet run (2 of 4 have run); power 1.00 |" in summary
    assert reproduce.verdict_line("orapo", two, REFS)[0].endswith("On 800-803: not yet run (2 of 4; power 1.00).")
    more = replication_results("replicated", "reversed again", list(range(600, 608)) + [800, 801, 802, 803, 900, 901])
    text = "\n".join(reproduce.report("orapo", more, REFS))
    assert "Extension, seeds 900-901 (added after the declaration" in text and "Extension, seeds 80" not in text
    assert "| CE macro F1 | 800 | 801 | 802 | 803 | mean ± sd |" in text  # the replication's own headline table
    exp = reproduce.EXPERIMENTS["orapo"]
    flat = fake_results("orapo", exp.declared + reproduce.REPLICATION, lambda s, a, m: 0.5 + 0.001 * (s % 3))
    text = reproduce.report("orapo", flat, REFS)
    assert any(x.startswith("Replication, seeds 800-803:") and x.endswith("nothing to re-test.") for x in text)
    row = next(x for x in reproduce.summary({"orapo": flat}, {"orapo": REFS}) if x.startswith("| orapo |"))
    assert "| **no effect seen** |" in row and "| holds | — |" in row
    assert reproduce.verdict_line("orapo", flat, REFS)[0].endswith("Not re-tested on 800-803.")
    waiting = reproduce.summary({}, {})
    assert all(x.count("|") == waiting[0].count("|") for x in waiting[2:7])  # the rows not yet measured: every cell


def test_replication_power_of_four_seeds_by_hand():
    """The declared design figure: the one-sided t-test on four seeds (3 df) finds a - b with the 600-607 mean and sd
    with the power of scipy's noncentral t at sqrt(4) |mean| / sd; 80 % at |mean| 1.65 sd and about 46 % at 1.0 sd,
    as the declaration says; and 1.0 sd by simulation (four normal seeds, 200,000 times)."""
    from scipy.stats import nct, t

    sd = SPREAD.std(ddof=1)
    for mean in (0.1, -0.3, 1.65 * sd):
        by_hand = nct.sf(t.ppf(0.95, 3), 3, 2 * abs(mean) / sd)
        assert reproduce.replication_power(at(mean)) == pytest.approx(by_hand, rel=1e-9)
    assert reproduce.replication_power(at(1.65 * sd)) == pytest.approx(0.80, abs=0.01)
    assert reproduce.replication_power(at(-sd)) == pytest.approx(0.46, abs=0.01)
    x = np.random.default_rng(0).normal(1.0, 1.0, size=(200_000, 4))
    found = (x.mean(1) / (x.std(1, ddof=1) / 2) > t.ppf(0.95, 3)).mean()
    assert reproduce.replication_power(d(*(SPREAD / sd + 1.0))) == pytest.approx(found, abs=0.005)


def test_orapo_row_1_is_the_papers_base_and_the_erratum_says_which_words_it_moves():
    """Table 4's row 1 (Base) is 0.097 / 0.104 / 0.034 (P, R, F1); the declaration quoted row 2's 0.026 / 0.162 / 0.089.
    Rows 6 - 1 and 3 - 1 are judged against the paper's effects from row 1 (row 6 0.237 / 0.832 / 0.341, row 3 0.204 /
    0.605 / 0.291), the declared claims kept as they were; under the claims table a line says whether any word moved,
    and names the ones that did (here, a difference whose interval holds row 2's effects but not row 1's)."""
    exp = reproduce.EXPERIMENTS["orapo"]
    claims = {c.label: c for c in exp.claims}
    declared = {c.label: c for c in reproduce.DECLARED_CLAIMS["orapo"]}
    row_6, row_3 = (0.237, 0.832, 0.341), (0.204, 0.605, 0.291)
    for label, row, quote in (("Table 4, row 6 vs row 1", row_6, "0.341"), ("Table 4, row 3 vs row 1", row_3, "0.291")):
        effects = claims[label].effects["CheXpert Plus"]
        by_hand = [round(x - y, 3) for x, y in zip(row, (0.097, 0.104, 0.034))]
        assert [effects[m] for m in ("CE macro precision", "CE macro recall", "CE macro F1")] == pytest.approx(by_hand)
        before = declared[label].effects["CheXpert Plus"]
        assert [before[m] for m in before] == pytest.approx(
            [round(x - y, 3) for x, y in zip(row, (0.026, 0.162, 0.089))]
        )
        assert claims[label].paper == f"F1 {quote} vs 0.034" and declared[label].paper == f"F1 {quote} vs 0.089"
    assert [c for c in exp.claims if c.label not in reproduce.ERRATA["orapo"][1]] == [
        c for c in reproduce.DECLARED_CLAIMS["orapo"] if c.label not in reproduce.ERRATA["orapo"][1]
    ]
    flat = reproduce.results_of(fake_results("orapo", exp.declared, lambda s, a, m: 0.5))
    line = reproduce.erratum(exp, flat, exp.declared)
    same = "judged against the declared effects, every word is the same."
    assert line == [f"Erratum (issue 71): {reproduce.ERRATA['orapo'][0]}; {same}"]
    assert line[0] in reproduce.claims_table(exp, flat, exp.declared, REFS)
    # Base's precision 0.02 below the others, +-2.365 x 0.048: the interval [-0.094, +0.134] excludes row 2's +0.211
    # and +0.178 (smaller than the paper's) and holds row 1's +0.140 and +0.107 (cannot tell, after Holm)
    lift = dict(zip(exp.declared, 0.6 * SPREAD + 0.02))
    results = reproduce.results_of(
        fake_results("orapo", exp.declared, lambda s, a, m: 0.5 - lift[s] * (a == "Base" and m == "CE macro precision"))
    )
    moved = reproduce.erratum(exp, results, exp.declared)[0]
    for versus in ("row 6 vs row 1: OraPO + FactS", "row 3 vs row 1: GRPO + FactS"):
        assert (
            f"Table 4, {versus} - Base, CE macro precision, cannot tell (declared: smaller than the paper's)" in moved
        )
    assert moved.count("(declared:") == 2


def test_a_claim_on_an_arm_that_writes_a_handful_of_reports_is_noted_degenerate():
    """Fewer than exp.min_distinct distinct reports on most seeds: a note beside the word, which it never changes."""
    exp = reproduce.EXPERIMENTS["orapo"]
    data = fake_results("orapo", exp.declared, lambda s, a, m: 0.5 + (0.1 + 0.001 * s) * (a == "OraPO + FactS"))
    for s in exp.declared[:5]:  # 5 of 8 seeds: 9 distinct reports, one fewer than declared
        data["seeds"][str(s)]["arms"]["GRPO + FactS"]["distinct reports"] = exp.min_distinct - 1
    results = reproduce.results_of(data)
    rows = {(r.claim.label, r.metric): r.word for r in reproduce.claim_rows(exp, results, exp.declared)}
    assert rows["Table 4, row 6 vs row 3", "CE macro F1"] == "reproduced"
    table = "\n".join(reproduce.claims_table(exp, results, exp.declared, REFS))
    assert table.count("GRPO + FactS degenerate") == 13  # every column of the 5 claims on it
    data["seeds"][str(exp.declared[0])]["arms"]["GRPO + FactS"]["distinct reports"] = exp.min_distinct  # 4 of 8
    table = "\n".join(reproduce.claims_table(exp, reproduce.results_of(data), exp.declared, REFS))
    assert "degenerate" not in table


def test_every_equivalence_claim_declares_its_margin_and_source():
    """Each "=" column has a margin m, a size the paper reports (its source named), printed in the claims table."""
    for name, exp in reproduce.EXPERIMENTS.items():
        for c in exp.claims:
            equal = {m for m, s in c.signs.items() if s == "="}
            assert set(c.margins) == equal and all(c.margins[m] > 0 for m in equal), (name, c.label)
            assert bool(c.margin_source) == bool(equal), (name, c.label)
    exp = reproduce.EXPERIMENTS["dcrrg"]
    c = next(c for c in exp.claims if c.margins)
    assert c.margins["CE micro F1"] == pytest.approx(0.376 - 0.365)  # Table 4: Model 6 - Model 4, F1
    results = reproduce.results_of(fake_results("dcrrg", exp.declared, lambda s, a, m: 0.6))
    table = "\n".join(reproduce.claims_table(exp, results, exp.declared, {}))
    assert "| margin ±0.011 |" in table and c.margin_source in table


def test_every_claim_names_the_paper_table_and_a_column_of_the_arms():
    """Declared before the confirmatory sweep: each claim has a table (or appendix) in its label, a sign for each
    column, arms the experiment reads, and effects whose sign agrees with the declared one on every data set; each
    paper one primary column of its first claim; seeds 600-607 confirmatory, 400-407 exploratory."""
    for name, exp in reproduce.EXPERIMENTS.items():
        assert exp.claims and all(("Table" in c.label or "Fig." in c.label or "App." in c.label) for c in exp.claims), (
            name
        )
        assert exp.primary in exp.claims[0].signs and exp.claims[0].signs[exp.primary] != "=", name
        for c in exp.claims:
            assert c.signs and set(c.signs.values()) <= {1, -1, "="}, (name, c.label)
            for effects in c.effects.values():
                for metric, effect in effects.items():
                    assert c.signs[metric] in (1, -1) and effect * c.signs[metric] > 0, (name, c.label, metric)
        assert exp.declared == list(range(600, 608)) and exp.min_distinct == 10
    assert reproduce.EXPLORATORY == list(range(400, 408))


def test_recheck_compares_a_seed_with_its_committed_row_to_the_printed_digits(tmp_path, monkeypatch):
    exp = reproduce.EXPERIMENTS["orapo"]
    data = fake_results("orapo", reproduce.EXPLORATORY, lambda s, arm, metric: 0.25)  # a recheck of seed 400
    row = data["seeds"]["400"]["arms"]
    same = json.loads(json.dumps(row))
    same["OraPO + FactS"]["CE macro F1"] = 0.2501  # rounds to the printed 0.250
    monkeypatch.setattr(exp, "read", lambda root, seed: same)
    check = reproduce.recheck("orapo", 400, tmp_path, data)
    assert check["differs"] == [] and check["largest_difference"] == pytest.approx(1e-4)
    line = reproduce.recheck_line(check)
    assert line.startswith("Seed 400 run again") and f"all {check['numbers']} numbers" in line
    moved = json.loads(json.dumps(row))
    moved["GRPO + FactS"]["curve"][3] = 0.2  # one point of a curve: printed 0.200, committed 0.100
    moved["OraPO + FactS"]["Pneumonia F1"] = 0.2506  # printed 0.251
    monkeypatch.setattr(exp, "read", lambda root, seed: moved)
    check = reproduce.recheck("orapo", 400, tmp_path, data)
    assert sorted(check["differs"]) == ["GRPO + FactS/curve[3]", "OraPO + FactS/Pneumonia F1"]
    assert "2 of" in reproduce.recheck_line(check)
    data["recheck"] = check
    assert reproduce.report("orapo", data, REFS)[-1] == reproduce.recheck_line(check)
    del moved["GRPO + FactS"]["curve"]
    with pytest.raises(ValueError, match="definition changed"):
        reproduce.recheck("orapo", 400, tmp_path, data)


def test_documents_print_the_reports_verbatim():
    """Every table the README and tests/RESULTS.md print comes from `--report` on committed results files, to the
    character: the summary in both, each paper's verdict line in the README, RESULTS.md's full sections."""
    readme, results_doc = (ROOT / "README.md").read_text(), reproduce.RESULTS_DOC.read_text()
    datas, refs = reproduce.results_files(), reproduce.load_references()
    for doc, text in (("README", readme), ("RESULTS.md", results_doc)):
        start, stop = reproduce.readme_block(text, "summary")
        assert text[start:stop].splitlines() == reproduce.summary(datas, refs), f"{doc}'s summary differs"
    for name in reproduce.EXPERIMENTS:
        data = datas.get(name, {"seeds": {}, "runs": {}})
        start, stop = reproduce.readme_block(readme, f"{name} verdict")
        printed = reproduce.verdict_line(name, data, refs.get(name, {}))
        assert readme[start:stop].splitlines() == printed, f"README's {name} verdict differs from its --report"
        start, stop = reproduce.readme_block(results_doc, name)
        printed = reproduce.report(name, data, refs.get(name, {}))
        assert results_doc[start:stop].splitlines() == printed, f"RESULTS.md's {name} section differs"


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
    """One converged warm start per seed (Base); every arm starts from it (--init) and differs from MRG-R1's own by its
    reward alone, or (+ SFT) by SFT steps instead of RL."""
    runs = dry_run("mrg_r1", tmp_path, capsys, "--seeds", "400")
    arm = {name.split("/")[1]: flags(argv) for name, (argv,) in runs.items()}
    assert arm["start"] == {"--seed": "400", "--steps": "0"}  # the script's own warm start, until it converges
    assert (
        arm["mccs+format"]["--init"].endswith("/s400/start/warm_start/final") and arm["mccs+format"]["--seed"] == "400"
    )
    assert arm["mccs+format"]["--reward"] == "mccs+format"
    for other in ("format", "ce_f1+format", "mccs", "ce_f1", "nlg"):
        assert differ(arm[other], arm["mccs+format"]) == {"--reward": (other, "mccs+format")}
    sft = differ(arm["sft+300"], arm["mccs+format"])
    assert sft == {"--sft-steps": ("300", None), "--steps": ("0", None), "--reward": (None, "mccs+format")}
    assert set(reproduce.MRG_R1_ARMS.values()) == set(arm)  # every run is a row of the table


def test_deer_arms_are_tables_1_and_4s_rows(tmp_path, capsys):
    """One SFT and DDSampling per seed (`all` runs DEER itself); each RL row differs by its weighting and subset."""
    (runs,) = dry_run("deer", tmp_path, capsys, "--seeds", "400").values()
    commands = {(argv[1], flags(argv).get("--weighting"), flags(argv).get("--subset")) for argv in runs}
    assert commands == {
        ("all", None, None),
        ("rl", "rule", "ddsampling"),
        ("rl", "none", "all"),
        ("rl", "grad", "all"),
        ("rl", "rule", "all"),
        ("rl", "none", "random"),
        ("table6", None, None),
        ("table7", None, None),
    }
    jobs = {j.argv[1] + str(j.argv[4:]): j.done for j in reproduce.deer_jobs(400, [400])}
    assert jobs["rl['--weighting', 'none', '--subset', 'all']"] == "rl_none_all/eval.json"  # deer.py's folder
    assert jobs["rl['--weighting', 'rule', '--subset', 'ddsampling']"] == "rl_rule/eval.json"
    stages = {j.done.split("/")[0] for j in reproduce.deer_jobs(400, [400]) if "/" in j.done}
    assert stages == set(reproduce.DEER_ARMS.values()) - {"sft"}  # every RL row is run, and read


def test_rrgcl_arms_differ_by_their_scheduler_and_the_first_seed_is_measured_whatever_seeds_run(tmp_path, capsys):
    first = reproduce.EXPERIMENTS["rrgcl"].declared[0]
    runs = dry_run("rrgcl", tmp_path, capsys, "--seeds", f"{first + 2}-{first + 3}")
    assert f"s{first}/measure" in runs  # measured once, though its seed is not run: the measurer's agreement
    for s in (first + 2, first + 3):
        (own,), (none,), (root,) = runs[f"s{s}/rrgcl"], runs[f"s{s}/none"], runs[f"s{s}/root"]
        assert flags(own)["--difficulty"].endswith(f"/s{s}/measure/difficulty.json") and "--steps" not in flags(own)
        assert differ(flags(none), flags(own)) == {"--scheduler": ("none", None)}
        assert differ(flags(root), flags(own)) == {"--scheduler": ("root", None)}


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


def evaluation(value: float, **extra) -> dict:
    """An evaluation (common.evaluate_generations' layout) whose every number is `value`."""
    ce = {f"{a}_{m}": value for a in ("micro", "macro", "example") for m in ("precision", "recall", "f1")}
    ce["per_label"] = {n: {"f1": value} for n in ("Pneumonia", "Fracture")}
    nlg = dict.fromkeys(("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"), value)
    degenerate = {"distinct": int(value * 100), "most_common_share": value, "most_common": "No acute process."}
    return {"ce": ce, "ce_gold": ce, "nlg": nlg, "degenerate": degenerate} | extra


def test_tables_read_the_evaluation_after_training(tmp_path):
    """RL arms are read from test_after (test_before is the start they share); the SFT-only arms from their only one."""
    root = tmp_path / "mrg_r1"
    for arm, run in reproduce.MRG_R1_ARMS.items():
        if run in ("start", "sft+300"):
            write_eval(root / "s1" / run, evaluation(0.1 if run == "start" else 0.5, reward=0.2), key="test_before")
        else:
            write_eval(root / "s1" / run, evaluation(0.2, reward=0.2), evaluation(0.9, reward=0.9))
    (root / "s1" / "start" / "warm_start").mkdir()
    (root / "s1" / "start" / "warm_start" / "eval.json").write_text('{"steps": 900, "converge": {"best_step": 500}}')
    out = reproduce.mrg_r1_read(root, 1)
    assert out["Base"]["CE micro F1"] == 0.1 and out["+ SFT"]["CE micro F1"] == 0.5
    assert {out[a]["CE micro recall"] for a in reproduce.MRG_R1_ARMS if a not in ("Base", "+ SFT")} == {0.9}
    assert out["Base"]["CE micro F1 (gold)"] == 0.1 and out["Base"]["distinct reports"] == 10
    root = tmp_path / "orapo"
    for arm in reproduce.ORAPO_ARMS.values():
        write_eval(root / "s1" / arm, evaluation(0.1, facts_reward=0.1), evaluation(0.9, facts_reward=0.9))
        (root / "s1" / arm / "metrics.jsonl").write_text(
            json.dumps({"zero_group_ratio": 0.5, "dpo_accuracy_x_zero": 0.25, "lambda": 0.07}) + "\n"
        )
    out = reproduce.orapo_read(root, 1)
    assert out["OraPO + FactS"]["CE macro F1"] == 0.9 and out["GRPO + FactS"]["test FactS"] == 0.9
    assert out["OraPO + FactS"]["distinct reports"] == 90  # after training, not before (10)
    assert out["Base"]["CE macro F1"] == 0.1 and out["Base"]["distinct reports"] == 10  # Table 4's row 1: before RL
    assert out["OraPO + FactS"]["mean lambda"] == 0.07 and out["GRPO + FactS"]["Fracture F1"] == 0.9
    assert out["DPO, first 50 steps"]["accuracy on zero-reward groups"] == 0.5  # 0.25 of the steps' 0.5 zero groups


def test_rrgcl_measurer_agreement_reads_each_seeds_own_file_against_its_series_first(tmp_path):
    """The measurer's agreement across seeds (RRGCL's table): a seed's difficulty file against its series' first
    seed's (the first against the second), Spearman over the studies' Eq. 10 difficulty and the classes' diff_C. Five
    seeds' files all differ, so that each pairing has Spearman values of its own and reading another seed's file
    (or the same one twice: 1.0) shows."""
    from scipy.stats import spearmanr

    import rrgcl

    rng, root, files = np.random.default_rng(3), tmp_path / "rrgcl", {}
    labels = np.where(rng.random((40, 14)) < 0.3, 1.0, np.nan)
    for seed in (600, 601, 602, 800, 801):
        folder = root / f"s{seed}"
        for run in reproduce.RRGCL_ARMS.values():
            (folder / run).mkdir(parents=True)
            (folder / run / "eval.json").write_text(json.dumps({"test": evaluation(0.5), "steps": 1000}))
        (folder / "rrgcl" / "schedule.json").write_text(json.dumps({"subset_sizes": [10, 20, 40]}))
        files[seed] = {"dif1": rng.random(40).tolist(), "dif2": rng.random(40).tolist(), "labels": labels.tolist()}
        (folder / "measure").mkdir()
        (folder / "measure" / "difficulty.json").write_text(json.dumps(files[seed]))

    def agreement(a, b):  # by hand, from the files' contents in memory
        dif = {s: rrgcl.sample_difficulty(np.array(files[s]["dif1"]), np.array(files[s]["dif2"])) for s in (a, b)}
        classes = {s: [c["difficulty"] for c in rrgcl.curriculum_plan(dif[s], labels)["table"]] for s in (a, b)}
        return {
            "Spearman, studies": float(spearmanr(dif[a], dif[b])[0]),
            "Spearman, classes": float(spearmanr(classes[a], classes[b])[0]),
        }

    pairs = {600: 601, 601: 600, 602: 600, 800: 801, 801: 800}  # a confirmatory or replication seed: its series' first
    wrong = [(602, 601), (801, 600), (602, 602)]  # another seed's file, another series' first, its own twice
    apart = {tuple(sorted(p)) for p in [*pairs.items(), *wrong]}  # Spearman is symmetric
    values = [agreement(*p)["Spearman, studies"] for p in apart]
    assert len(set(values)) == len(values) == 6 and sorted(values)[-2] < 0.9  # each pairing its own value; 1: itself
    for seed, first in pairs.items():
        assert reproduce.EXPERIMENTS["rrgcl"].read(root, seed)["measurer"] == pytest.approx(agreement(seed, first))


def test_every_claim_reads_numbers_the_tables_produce(tmp_path):
    """Each claim's and check's arms and metrics are among those the experiment's read() returns from its runs'
    files (a misspelt arm or column fails here, not after a sweep)."""
    for name, exp in reproduce.EXPERIMENTS.items():
        root = tmp_path / name
        seed = exp.declared[0]
        write_runs(name, root, seed)
        out = reproduce.EXPERIMENTS[name].read(root, seed)
        for c in exp.claims:
            for arm in (c.a, c.b):
                assert set(c.signs) <= set(out[arm]), (name, arm, set(c.signs) - set(out[arm]))
        for c in exp.checks:
            assert c.metric in out[c.a] and (not isinstance(c.b, str) or c.metric in out[c.b]), (name, c.label)
        assert all(m in out[a] for a in reproduce.report_arms(exp, {seed: out}, [seed]) for m in exp.columns)


def write_runs(name: str, root: Path, seed: int):
    """The files a seed's runs write that read() takes its numbers from, every number 0.5."""
    folder = root / f"s{seed}"
    if name == "mrg_r1":
        test_tables_read_shape = evaluation(0.5, reward=0.5, reward_mccs=0.5)
        for run in reproduce.MRG_R1_ARMS.values():
            write_eval(folder / run, test_tables_read_shape, test_tables_read_shape)
        (folder / "start" / "warm_start").mkdir()
        (folder / "start" / "warm_start" / "eval.json").write_text('{"steps": 9, "converge": {"best_step": 5}}')
    elif name == "deer":
        for stage in reproduce.DEER_ARMS.values():
            write_eval(folder / stage, evaluation(0.5))
            if stage.startswith("rl_"):  # each step's token weights, Eq. 12's beta
                (folder / stage / "metrics.jsonl").write_text(json.dumps({"w_mean": 1, "w_median": 1, "w_max": 2}))
                result = json.loads((folder / stage / "eval.json").read_text())
                (folder / stage / "eval.json").write_text(json.dumps(result | {"beta": {"beta": 0.1}}))
        row = {"label_mod_ratio_binary": 0.5, "post_mask_f1": 0.5}
        (folder / "table6.json").write_text(json.dumps({w: row for w in ("grad", "rule", "random")}))
        row = {"zero_variance": 0.5, "unique_rewards": 2.0, "reward_std": 0.1}
        (folder / "table7.json").write_text(json.dumps({s: row for s in ("random_100", "ddsampling")}))
    elif name == "orapo":
        for run in reproduce.ORAPO_ARMS.values():
            write_eval(folder / run, evaluation(0.5, facts_reward=0.5), evaluation(0.5, facts_reward=0.5))
            line = {"zero_group_ratio": 0.5, "dpo_accuracy_x_zero": 0.25, "lambda": 0.07}
            (folder / run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    elif name == "rrgcl":
        for run in reproduce.RRGCL_ARMS.values():
            (folder / run).mkdir(parents=True)
            (folder / run / "eval.json").write_text(json.dumps({"test": evaluation(0.5), "steps": 1000}))
        (folder / "rrgcl" / "schedule.json").write_text(json.dumps({"subset_sizes": [10, 20, 40]}))
        rng = np.random.default_rng(0)
        labels = np.where(rng.random((40, 14)) < 0.3, 1.0, np.nan).tolist()
        for s in (seed, seed + 1):
            m = {"dif1": rng.random(40).tolist(), "dif2": rng.random(40).tolist(), "labels": labels}
            (root / f"s{s}" / "measure").mkdir(parents=True)
            (root / f"s{s}" / "measure" / "difficulty.json").write_text(json.dumps(m))
    else:
        for model in reproduce.TABLE4.values():
            (folder / "ablation" / model).mkdir(parents=True)
            (folder / "ablation" / model / "eval.json").write_text(json.dumps(evaluation(0.5)))
        views = {"val_loss_image_view": 2.0, "val_loss_text_view": 1.0}  # Step 3 of Models 6 and 3
        for step, result in (
            ("step1", {"auroc_image": {"mean": 0.7}, "auroc_text": {"mean": 0.9}}),
            ("step2", {"retrieval": {"P@1": 0.4, "P@5": 0.4}}),
            ("step3", views),
            ("step3_no_step1", views),
        ):
            (folder / "ablation" / step).mkdir(parents=True)
            (folder / "ablation" / step / "eval.json").write_text(json.dumps(result))


def test_runner_order_skips_finished_and_resumes_started(tmp_path, monkeypatch):
    """Each job runs after the folders it needs; a finished one is skipped; a folder already holding a run gets
    --resume; every launch is recorded with the machine, the pins and the commit."""
    order, stand_in = tmp_path / "order.txt", str(ROOT / "tests" / "stand_in.py")
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    jobs = [
        reproduce.Job("m", [stand_in, "order", "measure", str(order)], done="measure"),
        reproduce.Job("x", [stand_in, "order", "train", str(order)], done="train", after=("m",)),
        reproduce.Job("x", [stand_in, "order", "table", str(order)], done="table"),
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
    changed = [reproduce.Job("m", [stand_in, "order", "measure", str(order), "--other"], done="measure")]
    with pytest.raises(SystemExit, match="the definition changed"):
        reproduce.run_all(changed, tmp_path, 2, dry_run=False)


def test_runner_never_runs_two_jobs_of_one_folder_at_once(tmp_path, monkeypatch):
    """DEER's stages share a folder (sft, then rl, then the tables): with free slots, they still run one at a time."""
    log, stand_in = tmp_path / "log.txt", str(ROOT / "tests" / "stand_in.py")
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    jobs = [
        reproduce.Job("s1", [stand_in, "overlap", stage, str(log)], done=stage) for stage in ("all", "rl", "table6")
    ]
    reproduce.run_all(jobs, tmp_path, 3, dry_run=False)
    lines = log.read_text().splitlines()
    assert [x.split()[0] for x in lines] == ["start", "end"] * 3, lines


def test_a_later_sweep_adds_its_seeds_to_the_results_and_keeps_the_ones_there(tmp_path, monkeypatch, capsys):
    """`--seeds 900-901` after the declared sweep: the results file keeps seeds 600-607 with their launch records, and
    adds 900-901."""
    exp = reproduce.EXPERIMENTS["orapo"]

    def value(seed, arm, metric):
        return 0.1 + 0.001 * seed

    (tmp_path / "orapo.json").write_text(json.dumps(fake_results("orapo", exp.declared, value)))
    monkeypatch.setattr(reproduce, "run_all", lambda *a, **k: None)  # the runs: done
    monkeypatch.setattr(reproduce, "collect", lambda name, seeds, root: fake_results(name, seeds, value))
    reproduce.main(
        ["orapo", "--seeds", "900-901", "--out", str(tmp_path), "--results", str(tmp_path), "--figures", str(tmp_path)]
    )
    data = json.loads((tmp_path / "orapo.json").read_text())
    seeds = [str(s) for s in [*exp.declared, 900, 901]]
    assert sorted(data["seeds"]) == sorted(data["runs"]) == sorted(seeds)
    assert data["seeds"]["600"] == fake_results("orapo", [600], value)["seeds"]["600"]
    assert "Extension, seeds 900-901" in capsys.readouterr().out


def test_report_command_prints_from_the_results_file(tmp_path):
    exp = reproduce.EXPERIMENTS["orapo"]
    data = fake_results("orapo", exp.declared, lambda s, a, m: 0.1 * (a == "OraPO + FactS") + 0.001 * s)
    (tmp_path / "orapo.json").write_text(json.dumps(data))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "reproduce.py"), "orapo", "--report", "--results", str(tmp_path)]
        + ["--figures", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    refs = reproduce.load_references().get("orapo", {})
    lines = [*reproduce.report("orapo", data, refs), f"wrote {tmp_path / 'orapo.png'}"]
    assert proc.stdout.splitlines() == lines  # once, and nothing else


def test_mention_f1_by_hand():
    """CheXbert's measure: micro F1 over positive, negative and uncertain mentions; blank is no mention."""
    nan = np.nan
    gold = np.array([[1, 0, nan, -1], [nan, 1, 0, nan]])
    ours = np.array([[1, nan, 0, 1], [nan, 1, 0, -1]])
    # mentions: gold 5, ours 6; matching (value and place): (0,0) 1, (1,1) 1, (1,2) 0 -> TP 3, FP 3, FN 2
    assert reproduce.mention_f1(ours, gold) == pytest.approx(6 / 11)


def test_commit_is_marked_changed_by_code_not_by_a_sweeps_figures(tmp_path, monkeypatch):
    """A run records the commit it ran at: a change to what a run reads (a script, common.py, the sandbox, its shipped
    models, the sweep's own runner) marks it '+changes'; what a sweep writes (results, figures) and the documents
    (README, tests/RESULTS.md, MACHINES.md) do not. Each file is changed alone, in a repository made here."""

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    code = ["orapo.py", "mrg_r1.py", "deer.py", "dcrrg.py", "rrgcl.py", "common.py", "tests/sandbox.py"]
    code += ["tests/reproduce.py", "tests/sandbox_models/chexbert-v2/a.pt"]
    outputs = ["tests/figures/orapo.png", "tests/results/orapo.json", "README.md", "tests/RESULTS.md"]
    outputs += ["tests/MACHINES.md"]
    for name in code + outputs:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("first\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    clean = reproduce.commit()
    assert len(clean) == 12 and "+" not in clean
    for name in code + outputs:
        (tmp_path / name).write_text("changed\n")
        marked = reproduce.commit()
        git("checkout", "--", name)
        assert marked == (clean + "+changes" if name in code else clean), name
    (tmp_path / "notes.py").write_text("untracked\n")  # not part of the commit: no run reads it
    assert reproduce.commit() == clean
    (tmp_path / "common.py").write_text("staged\n")  # a change staged but not committed is still a change
    git("add", "common.py")
    assert reproduce.commit() == clean + "+changes"
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "d")  # committed: a new, clean commit
    later = reproduce.commit()
    assert len(later) == 12 and "+" not in later and later != clean
    (tmp_path / "deer.py").unlink()  # a script removed
    assert reproduce.commit() == later + "+changes"


def test_best_constant_report_by_hand():
    """The blind row's report: the training report whose labels, written for every training study, score the best
    headline. Micro F1 of a constant prediction, by hand: cardiomegaly 6 / 12, edema 2 / 12, clear lungs 4 / 12."""
    import common

    texts = ["There is mild cardiomegaly."] * 3 + ["There is mild pulmonary edema."] + ["The lungs are clear."] * 2
    train = [common.Record(str(k), [], t, "train") for k, t in enumerate(texts)]
    best = reproduce.best_constant(train, common.RuleLabeler(), "micro_f1", 0)
    assert best == "There is mild cardiomegaly."
    labels = common.RuleLabeler()(texts)
    score = common.ce_metrics(np.tile(labels[0], (6, 1)), labels, 0)["micro_f1"]
    assert score == pytest.approx(0.5)
    assert reproduce.best_constant(train, common.RuleLabeler(), "example_f1", 0) == "There is mild cardiomegaly."


def test_templated_reports_say_the_findings_they_are_given():
    """The ceilings write findings through the set's own templates: the rules read back exactly those findings."""
    import common

    rng = np.random.default_rng(3)
    studies = [sandbox.sample_synthetic_study(rng)[0] for _ in range(300)]
    reports = [reproduce.templated_report(f, rng) for f in studies]
    labels = common.RuleLabeler()(reports)[:, :13]  # (N, 13)
    for f, row in zip(studies, labels):
        for k, name in enumerate(common.FINDINGS):
            expected = (common.UNCERTAIN if f[name]["uncertain"] else common.POSITIVE) if name in f else None
            assert (row[k] == expected) if expected is not None else row[k] not in (1, -1), (name, f, row)


def test_image_ceiling_classifier_predicts_attribute_sets_it_was_shown(small_synthetic):
    import common

    data = common.load_annotation(small_synthetic)
    findings, record = reproduce.image_ceiling_findings(data)
    options = reproduce.finding_options(data["train"] + data["val"])
    assert len(findings) == len(data["test"]) and record["best_epoch"] >= 1
    for f in findings:
        for name, attrs in f.items():
            assert json.dumps(attrs, sort_keys=True) in options[common.FINDINGS.index(name)]


def test_deer_prints_each_weighted_arms_token_weights_and_beta():
    """Eq. 6's weights and Eq. 12's beta as the diagnosis cites them: mean over seeds (fewest, most); GRPO's weights,
    all 1, leave it out; a rule arm has no beta."""
    nan = math.nan
    weights = {"token weight mean": 1.0, "token weight median": 1.0, "token weight max": 1.0, "beta": nan}
    grad = [
        dict(weights, **{"token weight max": m, "beta": b, "median s~ off the findings": 1.6})
        for m, b in ((2, 0.06), (3, 0.04))
    ]
    results = {
        1: {
            "GRPO (100 %)": weights,
            "DiTPO (100 %)": grad[0],
            "DEER, rule": dict(weights, **{"token weight max": 9.0}),
        },
        2: {
            "GRPO (100 %)": weights,
            "DiTPO (100 %)": grad[1],
            "DEER, rule": dict(weights, **{"token weight max": 9.0}),
        },
    }
    lines = reproduce.deer_token_weights(results, [1, 2])
    ditpo = (
        "| DiTPO (100 %) | 0.050 (0.040, 0.060) | 1.600 (1.600, 1.600) | 1.000 (1.000, 1.000) | 1.000 (1.000, 1.000)"
    )
    assert lines[3] == ditpo + " | 2.500 (2.000, 3.000) |"
    assert lines[4] == "| DEER, rule |  |  | 1.000 (1.000, 1.000) | 1.000 (1.000, 1.000) | 9.000 (9.000, 9.000) |"
    assert len(lines) == 5 and reproduce.EXPERIMENTS["deer"].extra is reproduce.deer_token_weights


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def declared_sources(source: str, names=reproduce.RULE + reproduce.DECLARATION) -> dict:
    """The source text of each name a declaration fixes (by default reproduce.RULE and reproduce.DECLARATION) in a
    version of tests/reproduce.py."""
    tree = ast.parse(source)
    out = {}
    for node in tree.body:
        found = [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else []
        found += [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        for name in set(found) & set(names):
            out[name] = ast.get_source_segment(source, node)
    return out


def provenance_errors(datas: dict, declared_at: str, seeds=reproduce.CONFIRMATORY) -> list[str]:
    """Each launch record of these seeds that did not run at their declaration commit or a descendant of it, clean."""
    errors = []
    for name, data in datas.items():
        for seed in seeds:
            for argv, launches in data.get("runs", {}).get(str(seed), {}).items():
                for record in launches:
                    commit = record["commit"]
                    if commit.endswith("+changes"):
                        errors.append(f"{name} {seed} {argv}: ran with uncommitted changes at {commit}")
                    elif git("merge-base", "--is-ancestor", declared_at, commit).returncode != 0:
                        errors.append(f"{name} {seed} {argv}: ran at {commit}, not at or after the declaration")
    return errors


def declaration_holds(declared_at: str, names: tuple, seeds: list):
    """The declaration commit is in this history (a full clone); there, each name it fixes reads as it does here, and
    no results file held one of its seeds."""
    assert git("rev-parse", "--is-shallow-repository").stdout.strip() == "false", "needs the full history"
    assert git("cat-file", "-e", declared_at + "^{commit}").returncode == 0, declared_at
    then = declared_sources(git("show", f"{declared_at}:tests/reproduce.py").stdout, names)
    now = declared_sources((ROOT / "tests" / "reproduce.py").read_text(), names)
    assert set(then) == set(now) == set(names)
    assert [k for k in now if then[k] != now[k]] == []
    for name in reproduce.EXPERIMENTS:
        before = json.loads(git("show", f"{declared_at}:tests/results/{name}.json").stdout)
        assert not set(map(str, seeds)) & set(before["seeds"]), name


def planted_runs_are_caught(declared_at: str, seeds: list):
    """A launch record of the declared seeds at the declaration's parent, or with uncommitted changes, is an error;
    one at the declaration is not."""
    parent = git("rev-parse", "--short=12", declared_at + "^").stdout.strip()
    record, seed = {"commit": parent}, str(seeds[0])
    planted = {"orapo": {"runs": {seed: {f"orapo.py --seed {seed}": [record, {"commit": declared_at[:12]}]}}}}
    assert provenance_errors(planted, declared_at, seeds) == [
        f"orapo {seed} orapo.py --seed {seed}: ran at {parent}, not at or after the declaration"
    ]
    record["commit"] = git("rev-parse", "--short=12", "HEAD").stdout.strip() + "+changes"
    assert provenance_errors(planted, declared_at, seeds)[0].endswith("uncommitted changes at " + record["commit"])
    assert provenance_errors(planted, declared_at, [int(seed) + 1]) == []  # another series' seeds are not its


def test_every_confirmatory_run_ran_after_the_declaration_and_its_rule_is_unchanged():
    """The declaration commit is in this history (a full clone); there, the rule's functions, the seeds, the paper's
    tables and the claims read as they do here, and no results file held a confirmatory seed; every confirmatory
    launch record ran at that commit or a descendant, clean. A record before it, or with changes, fails."""
    declaration_holds(reproduce.DECLARED_AT, reproduce.RULE + reproduce.DECLARATION, reproduce.CONFIRMATORY)
    assert provenance_errors(reproduce.results_files(), reproduce.DECLARED_AT) == []
    planted_runs_are_caught(reproduce.DECLARED_AT, reproduce.CONFIRMATORY)


def test_every_replication_run_ran_after_its_declaration_and_its_rule_is_unchanged():
    """As the confirmatory seeds': the replication's declaration commit is in this history, descends from the
    confirmatory one, and declared what REPLICATION_RULE names as they read here, the seeds 800-803 among them; no
    results file there held one of them; every launch record of 800-803 in tests/results ran at that commit or a
    descendant, clean (none yet before the sweep). A record before it, or with changes, fails."""
    assert git("merge-base", "--is-ancestor", reproduce.DECLARED_AT, reproduce.REPLICATION_DECLARED_AT).returncode == 0
    declaration_holds(reproduce.REPLICATION_DECLARED_AT, reproduce.REPLICATION_RULE, reproduce.REPLICATION)
    assert reproduce.REPLICATION == [800, 801, 802, 803] and reproduce.REPLICATES == ("reproduced", "reversed")
    datas = reproduce.results_files()
    assert provenance_errors(datas, reproduce.REPLICATION_DECLARED_AT, reproduce.REPLICATION) == []
    planted_runs_are_caught(reproduce.REPLICATION_DECLARED_AT, reproduce.REPLICATION)


def test_machines_line_groups_the_seeds_that_ran_alike():
    """One line when every run matches; else a line per kind with the seeds that ran it (a seed whose runs differ in
    commit, a resumed run, shows both)."""

    def run(cpu, commit, cpu_s=60.0):
        machine = dict(cpu=cpu, cpu_capability="AVX2", torch="2.0", python="3.11")
        return dict(machine=machine, pins={"OMP_NUM_THREADS": "1"}, commit=commit, cpu_s=cpu_s)

    runs = {str(s): {"a": [run("AMD", "c1")], "b": [run("AMD", "c1")]} for s in (600, 601, 602)}
    kind = "(AVX2 kernels), torch 2.0, Python 3.11; pins OMP_NUM_THREADS=1; commit"
    assert reproduce.machines(runs, [600, 601, 602]) == [f"CPU-minutes per seed: 2. Every run: AMD {kind} c1."]
    runs |= {str(s): {"a": [run("Intel", "c0")], "b": [run("Intel", "c0")]} for s in (400, 401)}
    runs["602"]["b"].append(run("AMD", "c2"))  # resumed at another commit
    lines = reproduce.machines(runs, [600, 601, 602, 400, 401])
    assert lines[1:] == [
        f"- seeds 600-601: AMD {kind} c1",
        f"- seed 602: AMD {kind} c1; AMD {kind} c2",
        f"- seeds 400-401: Intel {kind} c0",
    ]
