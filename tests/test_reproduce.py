"""tests/reproduce.py's machinery: seeds, paired statistics, the table, the runner's order and its skipping."""

import sys

import numpy as np
import pytest

import reproduce


def test_seeds_are_declared_ranges_or_lists():
    assert reproduce.parse_seeds("100-103,110") == [100, 101, 102, 103, 110]
    with pytest.raises(SystemExit, match="distinct seeds"):
        reproduce.parse_seeds("1,1")


def test_paired_difference_by_hand():
    p = reproduce.paired([0.5, 0.7, 0.4, 0.9], [0.4, 0.5, 0.5, 0.6])  # d = 0.1, 0.2, -0.1, 0.3
    assert p["mean"] == pytest.approx(0.125) and p["positive"] == 3 and p["n"] == 4
    assert p["se"] == pytest.approx(np.sqrt(((0.1 - 0.125) ** 2 + 0.075**2 + 0.225**2 + 0.175**2) / 3) / 2)
    assert reproduce.verdict(p) == "+0.125 ± 0.085 (3 of 4 > 0)"


def test_table_rows_and_comparisons():
    exp = reproduce.Experiment("t", None, None, [("a", "b", "a - b")], ["F1", "BLEU-4"])
    results = {
        1: {"a": {"F1": 0.5, "BLEU-4": 0.1}, "b": {"F1": 0.4, "BLEU-4": 0.1}, "meta": [1]},
        2: {"a": {"F1": 0.7, "BLEU-4": 0.2}, "b": {"F1": 0.5, "BLEU-4": 0.3}, "meta": [2]},
    }
    lines = reproduce.render(exp, results, [1, 2])
    assert lines[0] == "| F1 | 1 | 2 | mean ± sd |" and lines[2] == "| a | 0.500 | 0.700 | 0.600 ± 0.141 |"
    assert lines[3] == "| b | 0.400 | 0.500 | 0.450 ± 0.071 |"
    assert lines[-1] == "| a - b | +0.150 ± 0.050 (2 of 2 > 0) | -0.050 ± 0.050 (0 of 2 > 0) |"  # BLEU: 0, -0.1


def test_runner_order_skips_finished_and_resumes_started(tmp_path, monkeypatch):
    """Each job runs after the folders it needs; a finished one is skipped; a folder already holding a run gets
    --resume; two jobs of one folder never run at once."""
    order = tmp_path / "order.txt"
    script = (
        "import sys, pathlib; out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); out.mkdir(parents=True, "
        "exist_ok=True); (out / sys.argv[1]).write_text('x'); open(sys.argv[2], 'a').write(sys.argv[1] + "
        "(' resume' if '--resume' in sys.argv else '') + '\\n')"
    )
    monkeypatch.setattr(
        reproduce,
        "command",
        lambda job, root: (
            [sys.executable, "-c", script, job.argv[0], str(order), "--out", str(job.folder(root))]
            + ["--resume"] * (job.folder(root).is_dir() and any(job.folder(root).iterdir()))
        ),
    )
    jobs = [
        reproduce.Job("m", ["measure"], done="measure"),
        reproduce.Job("x", ["train"], done="train", after=("m",)),
        reproduce.Job("x", ["table"], done="table"),
        reproduce.Job("done", ["old"], done="old"),
    ]
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "old").write_text("finished before")
    reproduce.run_all(jobs, tmp_path, 2, dry_run=False)
    lines = order.read_text().splitlines()
    assert lines.index("measure") < [x.split()[0] for x in lines].index("train") and "old" not in lines
    assert sorted(lines) in (["measure", "table resume", "train"], ["measure", "table", "train resume"])


def test_runner_never_runs_two_jobs_of_one_folder_at_once(tmp_path, monkeypatch):
    """DEER's stages share a folder (sft, then rl, then the tables): with free slots, they still run one at a time."""
    log = tmp_path / "log.txt"
    script = (
        "import sys, time; log = open(sys.argv[2], 'a', buffering=1); log.write('start ' + sys.argv[1] + '\\n'); "
        "time.sleep(0.3); log.write('end ' + sys.argv[1] + '\\n')"
    )
    monkeypatch.setattr(reproduce, "command", lambda job, root: [sys.executable, "-c", script, job.argv[0], str(log)])
    jobs = [reproduce.Job("s1", [stage], done=stage) for stage in ("all", "rl", "table6")]
    reproduce.run_all(jobs, tmp_path, 3, dry_run=False)
    lines = log.read_text().splitlines()
    assert [x.split()[0] for x in lines] == ["start", "end"] * 3, lines
