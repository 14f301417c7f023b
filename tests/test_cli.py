"""`python tests/reports.py evaluate` and `python tests/sandbox.py synthetic`, run as a user would; what a default run
prints; a broken install."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import reports
import reproduce
import sandbox
from conftest import run_python

ROOT = Path(__file__).resolve().parents[1]

ROWS = [
    {
        "id": "a",
        "reference": "There is a small left pleural effusion. No pneumothorax.",
        "generated": "Small left pleural effusion. No pneumothorax.",
    },
    {
        "id": "b",
        "reference": "The heart is mildly enlarged. No focal consolidation.",
        "generated": "There is mild cardiomegaly. There is a right pleural effusion.",
    },
    {"id": "c", "reference": "The lungs are clear. No acute cardiopulmonary process.", "generated": ""},
]


def run_reports(*args):
    return run_python(ROOT / "tests" / "reports.py", *args, cwd=ROOT, timeout=120)


def test_evaluate_writes_the_same_numbers_as_the_functions(tmp_path):
    gen = tmp_path / "generations.jsonl"
    gen.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    proc = run_reports("evaluate", "--generations", str(gen), "--no-meteor")
    assert proc.returncode == 0, proc.stderr
    assert '"5label_micro_f1": 0.8' in proc.stdout
    # its own name beside the generations, never a run's eval.json
    assert not (tmp_path / "eval.json").exists()
    result = json.loads((tmp_path / "generations.scores.json").read_text())
    assert result["n"] == 3 and result["n_empty_generations"] == 1
    # no run files beside it: the rule labeler, MIMIC-CXR's cleaning, the papers' uncertain-negative micro F1
    rules = {"labeler": "RuleLabeler", "clean": "mimic_cxr", "uncertain_as": 0, "headline": "micro_f1"}
    assert {k: result[k] for k in rules} == rules and "from the defaults; given: none" in proc.stdout
    hyps = [common.clean_report(r["generated"]) if r["generated"] else "" for r in ROWS]
    refs = [common.clean_report(r["reference"]) for r in ROWS]
    expected = common.nlg_metrics(hyps, refs, meteor=False)
    for key, value in expected.items():
        assert result["nlg"][key] == pytest.approx(value, abs=1e-12)
    labeler = common.RuleLabeler()
    ce = common.ce_metrics(labeler([r["generated"] for r in ROWS]), labeler([r["reference"] for r in ROWS]))
    # by hand: refs positive: a effusion; b cardiomegaly; c No Finding.
    # hyps positive: a effusion; b cardiomegaly + effusion; c nothing (empty).
    # TP 2, FP 1, FN 1 -> micro P = R = F1 = 2/3
    assert ce["micro_f1"] == pytest.approx(2 / 3)
    assert result["ce"]["micro_f1"] == pytest.approx(2 / 3)
    # 5 labels (No Finding not among them): TP 2, FP 1, FN 0 -> F1 = 4 / 5
    assert result["ce"]["5label_micro_f1"] == pytest.approx(0.8)


def test_evaluate_bad_file_names_the_line(tmp_path):
    """One line that names the file and line, no traceback (reports.main as the command calls it: SystemExit(message)
    prints the message to stderr and exits 1)."""
    gen = tmp_path / "generations.jsonl"
    gen.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"id": "x", "generated": "ok"}) + "\n")
    with pytest.raises(SystemExit) as stop:
        reports.main(["evaluate", "--generations", str(gen), "--no-meteor"])
    assert isinstance(stop.value.code, str) and f"{gen}:2" in stop.value.code and "'reference'" in stop.value.code
    with pytest.raises(SystemExit) as stop:
        reports.main(["evaluate", "--generations", str(tmp_path / "missing.jsonl")])
    assert isinstance(stop.value.code, str) and "missing.jsonl" in stop.value.code
    assert not list(tmp_path.glob("*.scores.json"))


def test_synthetic_command_writes_a_loadable_set(tmp_path):
    sandbox.main(
        ["synthetic", "--out", str(tmp_path / "syn"), "--n-train", "6", "--n-val", "2", "--n-test", "3"]
        + ["--size", "32", "--seed", "3"]
    )
    data = common.load_annotation(tmp_path / "syn" / "annotation.json")
    assert [len(data[s]) for s in ("train", "val", "test")] == [6, 2, 3]
    labels = np.stack([r.labels for r in data["train"]])
    np.testing.assert_array_equal(common.RuleLabeler()([r.report for r in data["train"]]), labels)


def test_plot_draws_every_logged_number_of_a_run_and_its_stages(tmp_path, monkeypatch, capsys):
    """`python tests/reproduce.py plot RUN` (common.draw_training): RUN/figures/training.png and one per stage folder
    below, a panel per key of metrics.jsonl ("lambda/a" and "lambda/b" share a panel); without matplotlib, one line
    and nothing drawn."""
    from PIL import Image

    rows = [{"step": k + 1, "time": 0.1, "loss": 1 / (k + 1), "lambda/a": 0.1 * k} for k in range(40)]
    rows[-1]["lambda/b"] = 0.5  # logged at one step only
    for folder in (tmp_path, tmp_path / "sft"):
        folder.mkdir(exist_ok=True)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reproduce.main(["plot", str(tmp_path)])
    assert capsys.readouterr().out.count("wrote") == 2
    for folder in (tmp_path, tmp_path / "sft"):
        with Image.open(folder / "figures" / "training.png") as im:
            assert im.size[0] == 2 * 3.2 * 80 and im.size[1] == 2.3 * 80  # 2 panels: loss, lambda
    (tmp_path / "stopped").mkdir()  # a run stopped before its first number: step and time only, a blank figure
    (tmp_path / "stopped" / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.1}) + "\n")
    assert common.draw_training(tmp_path / "stopped") == [tmp_path / "stopped" / "figures" / "training.png"]
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        reproduce.main(["plot", str(tmp_path / "nothing")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as when it is not installed
    assert common.draw_training(tmp_path) == []
    reproduce.main(["plot", str(tmp_path)])
    assert "pip install matplotlib" in capsys.readouterr().out


def test_every_run_draws_its_training_figure_when_it_ends(tmp_path, monkeypatch):
    """Run.finish draws out/figures/training.png from its metrics.jsonl (matplotlib installed; RRG_FIGURES=0, as the
    tests and the sweeps set it, draws none)."""
    run = common.Run(common.RunArgs(out=str(tmp_path / "run")), 0, 1, torch.device("cpu"), None, None)
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.1, "loss": 0.5}) + "\n")
    run.finish({})
    assert not (tmp_path / "run" / "figures").exists()
    monkeypatch.delenv("RRG_FIGURES")
    run.finish({})
    assert (tmp_path / "run" / "figures" / "training.png").is_file()


TINY_CHEXBERT = dict(hidden=32, layers=1, heads=2, epochs=1, lr=3e-3, batch_size=8)


def rescore(generations, scores, *flags) -> dict:
    reports.main(["evaluate", "--generations", str(generations), "--out", str(scores), "--no-meteor", *flags])
    return json.loads(Path(scores).read_text())


def test_a_run_says_what_it_read_and_wrote_and_rescoring_gives_its_numbers(tmp_path, small_synthetic, iu_xray, capsys):
    """A short real OraPO run on IU X-Ray-like data with a CheXbert: at its start the folder, data, model and labeler
    (weights), at its end its files; no library warning, bars of at most 4 numbers (metrics.jsonl keeps all). Then
    `tests/reports.py evaluate` on its test generations scores by the run's rules (its CheXbert, IU X-Ray's cleaning,
    OraPO's macro F1 with uncertain negative) and gives the run's own CE and NLG numbers; flags given win; a stage's
    file finds the run's config.json above it; the eval JSON's convention is the one taken."""
    weights = sandbox.train_chexbert(common.load_annotation(small_synthetic)["train"], tmp_path / "cb", **TINY_CHEXBERT)
    out = tmp_path / "run"
    flags = ["--data", str(iu_xray), "--out", str(out), "--labeler", "chexbert", "--chexbert-weights", str(weights)]
    flags += ["--steps", "2", "--sft-steps", "2", "--train-size", "32", "--prompts-per-step", "2", "--group-size", "2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "orapo.py"), *flags, "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout + proc.stderr
    assert f"run folder  {out} (a new run)\ndata        {iu_xray}: train 40, val 8, test 12 studies;" in printed
    assert "studies; cleaning iu_xray\nmodel       tiny; fp32 on cpu; 1 process(es)\n" in printed
    assert f"labeler     chexbert, {weights}\n" in printed
    assert proc.stdout.endswith(
        f"run folder  {out}\nresults     warm_start/eval.json, eval.json\n"
        "generations generations_test_before.jsonl, generations_test_after.jsonl\n"
    )
    assert not re.search(r"Warning|\[transformers\]|attention_mask", printed), printed
    bars = [b for b in re.split(r"[\r\n]", proc.stderr) if b.startswith("OraPO:") and "=" in b]
    assert bars and all(b.count("=") <= 4 for b in bars)
    assert min(len(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()) > 10  # every number

    run_eval, same = json.loads((out / "eval_test_after.json").read_text()), ("ce", "nlg", "degenerate", "clean")
    scores = rescore(out / "generations_test_after.jsonl", tmp_path / "s.json")
    assert {k: scores[k] for k in same} == {k: run_eval[k] for k in same} and scores["clean"] == "iu_xray"
    assert (scores["labeler"], scores["headline"], scores["uncertain_as"]) == ("CheXbertLabeler", "macro_f1", 0)
    assert run_eval["labeler"] == "CheXbertLabeler"  # not the LabelCache around it
    assert (
        f"test_after: FactS {run_eval['facts_reward']:.3f}" in proc.stdout and common.summary(run_eval) in proc.stdout
    )
    said = capsys.readouterr().out
    assert f"from {out / 'config.json'}, {out / 'eval_test_after.json'}; given: none" in said
    assert f"{common.summary(run_eval)}\nwrote" in said  # the run's own line

    scores = rescore(
        out / "generations_test_after.jsonl", tmp_path / "s.json", "--uncertain-as", "1", "--clean", "none"
    )
    assert (scores["uncertain_as"], scores["clean"], scores["labeler"]) == (1, None, "CheXbertLabeler")
    rows = common.read_generations(out / "generations_test_after.jsonl")
    labeler = common.make_labeler("chexbert", weights)
    hyps, refs = (labeler([r[k] for r in rows]) for k in ("generated", "reference"))
    assert scores["ce"] == json.loads(json.dumps(common.ce_metrics(hyps, refs, uncertain_as=1)))
    assert scores["nlg"] == common.nlg_metrics([r["generated"] for r in rows], [r["reference"] for r in rows], False)

    (tmp_path / "copy" / "stage").mkdir(parents=True)  # a stage's generations, the run's config.json above
    shutil.copy(out / "generations_test_after.jsonl", tmp_path / "copy" / "stage" / "generations_x.jsonl")
    shutil.copy(out / "config.json", tmp_path / "copy" / "config.json")
    (tmp_path / "copy" / "stage" / "eval_x.json").write_text(json.dumps({**run_eval, "headline": "example_f1"}))
    scores = rescore(tmp_path / "copy" / "stage" / "generations_x.jsonl", tmp_path / "s.json")
    assert {k: scores[k] for k in same[:2]} == {k: run_eval[k] for k in same[:2]} and scores["headline"] == "example_f1"
    assert scores["degenerate"]["warning"] == run_eval["degenerate"]["warning"].replace("(test_after)", "(x)")


@pytest.mark.parametrize(
    "fake",
    [
        {"torchvision/__init__.py": "raise RuntimeError('operator torchvision::nms does not exist')"},
        {"transformers/__init__.py": "", "transformers/utils.py": "def is_torch_available():\n    return False\n"},
    ],
    ids=["torchvision built for another torch", "transformers without torch"],
)
def test_a_broken_install_is_one_line_with_the_versions_and_the_fix(tmp_path, fake):
    """A torch/torchvision/transformers mismatch ended `python orapo.py` in a 60-line traceback: at import of common.py
    it is one line naming the versions found and the fix. The broken package is a fake one ahead on the path."""
    for name, text in fake.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", "import common"], capture_output=True, text=True, cwd=ROOT, env=env, check=False
    )
    versions = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in ("torch", "torchvision", "transformers"))
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {versions} do not work together (")
    assert proc.stderr.count("\n") == 1 and "pip install --upgrade torch torchvision transformers" in proc.stderr
