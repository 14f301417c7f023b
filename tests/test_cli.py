"""`python common.py evaluate` and `python common.py synthetic`, run as a user would."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import common

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


def run_common(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "common.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_evaluate_writes_the_same_numbers_as_the_functions(tmp_path):
    gen = tmp_path / "generations.jsonl"
    gen.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    proc = run_common("evaluate", "--generations", str(gen), "--no-meteor")
    assert proc.returncode == 0, proc.stderr
    assert '"5label_micro_f1": 0.8' in proc.stdout
    # its own name beside the generations, never a run's eval.json
    assert not (tmp_path / "eval.json").exists()
    result = json.loads((tmp_path / "generations.scores.json").read_text())
    assert result["n"] == 3 and result["n_empty_generations"] == 1
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
    gen = tmp_path / "generations.jsonl"
    gen.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"id": "x", "generated": "ok"}) + "\n")
    proc = run_common("evaluate", "--generations", str(gen), "--no-meteor")
    assert proc.returncode != 0
    assert f"{gen}:2" in proc.stderr and "'reference'" in proc.stderr
    proc = run_common("evaluate", "--generations", str(tmp_path / "missing.jsonl"))
    assert proc.returncode != 0 and "missing.jsonl" in proc.stderr


def test_synthetic_command_writes_a_loadable_set(tmp_path):
    proc = run_common(
        "synthetic",
        "--out",
        str(tmp_path / "syn"),
        "--n-train",
        "6",
        "--n-val",
        "2",
        "--n-test",
        "3",
        "--size",
        "32",
        "--seed",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    data = common.load_annotation(tmp_path / "syn" / "annotation.json")
    assert [len(data[s]) for s in ("train", "val", "test")] == [6, 2, 3]
    labels = np.stack([r.labels for r in data["train"]])
    np.testing.assert_array_equal(common.RuleLabeler()([r.report for r in data["train"]]), labels)


def test_plot_draws_every_logged_number_of_a_run_and_its_stages(tmp_path, monkeypatch, capsys):
    """`python common.py plot RUN`: RUN/figures/training.png and one per stage folder below, a panel per key of
    metrics.jsonl ("lambda/a" and "lambda/b" share a panel); without matplotlib, one line and nothing drawn."""
    from PIL import Image

    rows = [{"step": k + 1, "time": 0.1, "loss": 1 / (k + 1), "lambda/a": 0.1 * k} for k in range(40)]
    rows[-1]["lambda/b"] = 0.5  # logged at one step only
    for folder in (tmp_path, tmp_path / "sft"):
        folder.mkdir(exist_ok=True)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common.main(["plot", str(tmp_path)])
    assert capsys.readouterr().out.count("wrote") == 2
    for folder in (tmp_path, tmp_path / "sft"):
        with Image.open(folder / "figures" / "training.png") as im:
            assert im.size[0] == 2 * 3.2 * 80 and im.size[1] == 2.3 * 80  # 2 panels: loss, lambda
    (tmp_path / "stopped").mkdir()  # a run stopped before its first number: step and time only, a blank figure
    (tmp_path / "stopped" / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.1}) + "\n")
    assert common.plot_run(tmp_path / "stopped") == [tmp_path / "stopped" / "figures" / "training.png"]
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        common.main(["plot", str(tmp_path / "nothing")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as when it is not installed
    assert common.plot_run(tmp_path) == []
