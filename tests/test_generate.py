"""A trained run's report for new images (`python tests/reports.py generate`), a real-data run that never reads the
sandbox, and the sandbox's shipped models: the files every run loads, as MANIFEST.json lists them."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import common
import reports
import sandbox
from conftest import ROOT, run_python


@pytest.fixture(scope="module")
def real_data_run(tmp_path_factory, small_synthetic):
    """`python mrg_r1.py` as a user runs it (a script as __main__) on an annotation file with the tiny model: one RL
    step; then the modules the process imported (Python's -X importtime lists each as it is first imported)."""
    out = tmp_path_factory.mktemp("generate") / "run"
    flags = ["--data", str(small_synthetic), "--out", str(out), "--labeler", "rule", "--steps", "1"]
    flags += ["--sft-steps", "0", "--max-new-tokens", "8", "--prompts-per-step", "2"]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "mrg_r1.py"), *flags],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {x.rsplit("|", 1)[-1].strip() for x in done.stderr.splitlines() if x.startswith("import time:")}
    return out, imported


def test_a_real_data_run_never_imports_the_sandbox(real_data_run):
    imported = real_data_run[1]
    assert "common" in imported and "sandbox" not in imported  # common: the list is read right


def test_a_run_records_how_it_writes_a_report(real_data_run):
    """final/generation.json: the prompt, the length and the report function of the run's evaluation, by module and
    name (a script run as __main__ by its file's name: what `generate` imports)."""
    import mrg_r1

    settings = json.loads((real_data_run[0] / "final" / "generation.json").read_text())
    assert settings == {"prompt": mrg_r1.PROMPTS["tags"], "max_new_tokens": 8, "report": "mrg_r1:extract_report"}


def test_generate_writes_the_report_the_run_evaluated_with(real_data_run, small_synthetic, capsys):
    """The command prints, for a test study's image, the report of RUN/final's greedy completion (the run's prompt,
    length, and <report> extraction): the report its test evaluation scored for that study."""
    out = real_data_run[0]
    test = common.load_annotation(small_synthetic)["test"]
    rows = {json.loads(x)["id"]: json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()}
    reports.main(["generate", str(out), *test[0].image_paths])
    assert capsys.readouterr().out.strip() == rows[test[0].id]["generated"].strip()
    folder = out.parent / "images"
    folder.mkdir()
    for r in test[:3]:
        shutil.copy(r.image_paths[0], folder / f"{r.id}.png")
    reports.main(["generate", str(out), str(folder)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [x.split(":")[0] for x in lines] == [r.id for r in test[:3]]
    reports.main(
        ["generate", str(out), "--data", str(small_synthetic), "--split", "test", "--json", str(out / "g.jsonl")]
    )
    written = [json.loads(x) for x in (out / "g.jsonl").read_text().splitlines()]
    assert [w["id"] for w in written] == [r.id for r in test] and written[0]["views"] == test[0].image_paths
    assert all(w["report"] == rows[w["id"]]["generated"] for w in written)


def test_generate_takes_the_length_the_run_resolved_not_its_flag(real_data_run, small_synthetic, tmp_path, monkeypatch):
    """`generate` writes reports as long as final/generation.json says the run evaluated with (its flags resolved),
    never config.json's --max-new-tokens: a copy of the run (generation.json: 8) whose flag is left to the default
    (None: what a run without it records) or names another length."""
    run = tmp_path / "run"
    shutil.copytree(real_data_run[0], run)
    config = json.loads((run / "config.json").read_text())
    lengths, real = [], common.TinyPolicy.generate

    def generate(self, prompts, max_new_tokens, *args, **kwargs):
        lengths.append(max_new_tokens)
        return real(self, prompts, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(common.TinyPolicy, "generate", generate)
    image = common.load_annotation(small_synthetic)["test"][0].image_paths[0]
    for flag in (None, 3):
        (run / "config.json").write_text(json.dumps(config | {"max_new_tokens": flag}))
        reports.main(["generate", str(run), image])
    assert json.loads((run / "final" / "generation.json").read_text())["max_new_tokens"] == 8
    assert lengths == [8, 8]


def test_generate_from_the_command_line(real_data_run, small_synthetic):
    """`python tests/reports.py generate` in a process of its own (it imports mrg_r1 for the report)."""
    out, study = real_data_run[0], common.load_annotation(small_synthetic)["test"][0]
    done = run_python(ROOT / "tests" / "reports.py", "generate", str(out), *study.image_paths, timeout=120)
    rows = [json.loads(x) for x in (out / "generations_test_after.jsonl").read_text().splitlines()]
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.strip() == next(r["generated"] for r in rows if r["id"] == study.id).strip()


@pytest.mark.parametrize("case", ["missing image", "no final", "another model", "no image"])
def test_generate_errors_are_one_line(real_data_run, small_synthetic, tmp_path, case):
    out = real_data_run[0]
    image = common.load_annotation(small_synthetic)["test"][0].image_paths[0]
    if case == "missing image":
        argv, expected = [str(out), str(tmp_path / "none.png")], "image not found"
    elif case == "no final":
        argv, expected = [str(tmp_path), image], "no final/generation.json"
    elif case == "another model":
        shutil.copytree(out, tmp_path / "run")
        config = json.loads((tmp_path / "run" / "config.json").read_text())
        (tmp_path / "run" / "config.json").write_text(json.dumps(config | {"model": "Qwen/Qwen2.5-VL-3B-Instruct"}))
        argv, expected = [str(tmp_path / "run"), image], "not a model of --model Qwen/Qwen2.5-VL-3B-Instruct"
    else:
        argv, expected = [str(out)], "no image given"
    with pytest.raises(SystemExit) as e:
        reports.main(["generate", *argv])
    message = str(e.value)
    assert message.startswith("error: ") and expected in message and "\n" not in message


# The shipped sandbox models ---------------------------------------------------------------------
def test_the_shipped_models_are_the_files_the_manifest_lists():
    """Every file under tests/sandbox_models is in MANIFEST.json with its digest, and the sandbox loads those."""
    manifest = json.loads((sandbox.SHIPPED / "MANIFEST.json").read_text())
    on_disk = {str(p.relative_to(sandbox.SHIPPED)) for p in sandbox.SHIPPED.rglob("*") if p.is_file()}
    assert on_disk - {"MANIFEST.json"} == set(manifest["files"])
    assert all(sandbox.sha256(sandbox.SHIPPED / f) == digest for f, digest in manifest["files"].items())
    assert (
        sandbox.synthetic_chexbert()
        == sandbox.SHIPPED / f"chexbert-v{sandbox.SANDBOX_CHEXBERT_VERSION}" / "chexbert.pth"
    )
    assert sandbox.synthetic_foundation() == sandbox.SHIPPED / f"foundation-v{sandbox.FOUNDATION_VERSION}"
    assert set(manifest["built"]["pins"]) == set(sandbox.NUMERIC_PINS)


def test_a_changed_shipped_file_is_an_error_naming_it(tmp_path, monkeypatch):
    shutil.copytree(sandbox.SHIPPED, tmp_path / "shipped")
    monkeypatch.setattr(sandbox, "SHIPPED", tmp_path / "shipped")
    policy = tmp_path / "shipped" / f"foundation-v{sandbox.FOUNDATION_VERSION}" / "vlm" / "tiny_policy.pt"
    data = bytearray(policy.read_bytes())
    data[-100] ^= 1
    policy.write_bytes(bytes(data))
    assert sandbox.synthetic_chexbert().is_file()  # the other model is untouched
    with pytest.raises(ValueError, match="vlm/tiny_policy.pt"):
        sandbox.synthetic_foundation()


def test_a_model_folder_the_manifest_does_not_list_is_an_error_naming_it(tmp_path, monkeypatch):
    """A folder of tests/sandbox_models whose files MANIFEST.json does not list (here CheXbert's, its entries
    dropped) is not loaded as shipped, though every file in it is unchanged; the listed foundation still loads."""
    shutil.copytree(sandbox.SHIPPED, tmp_path / "shipped")
    monkeypatch.setattr(sandbox, "SHIPPED", tmp_path / "shipped")
    manifest = json.loads((tmp_path / "shipped" / "MANIFEST.json").read_text())
    chexbert = f"chexbert-v{sandbox.SANDBOX_CHEXBERT_VERSION}"
    manifest["files"] = {f: d for f, d in manifest["files"].items() if not f.startswith(chexbert + "/")}
    (tmp_path / "shipped" / "MANIFEST.json").write_text(json.dumps(manifest))
    assert (tmp_path / "shipped" / chexbert / "chexbert.pth").is_file()  # on disk, as shipped, but not listed
    assert sandbox.synthetic_foundation() == tmp_path / "shipped" / f"foundation-v{sandbox.FOUNDATION_VERSION}"
    with pytest.raises(ValueError, match=chexbert):
        sandbox.synthetic_chexbert()


def test_the_shipped_models_keep_their_quality(small_synthetic):
    """The shipped CheXbert reads the synthetic reports' labels (micro F1 >= 0.97 over the small set's 60), and the
    foundation's probe (its build record) has a mean AUROC of at least 0.90."""
    records = [r for split in common.load_annotation(small_synthetic).values() for r in split]
    labeler = common.CheXbertLabeler(weights=sandbox.synthetic_chexbert())
    ce = common.ce_metrics(labeler([r.report for r in records]), np.stack([r.labels for r in records]), 1)
    assert ce["micro_f1"] >= 0.97
    probe = json.loads((sandbox.synthetic_foundation() / "foundation.json").read_text())["probe"]
    assert probe["probe_auroc_mean"] >= 0.90


@pytest.mark.slow
def test_a_rebuild_lands_near_the_shipped_models():
    """`python tests/ship_sandbox.py` on this CPU (about 30 CPU-minutes, the full synthetic set drawn first): every
    shipped file rebuilt, the weights' largest difference and the probe printed; the rebuild keeps the quality bar, and
    on the CPU kind they were built on it is the same to the byte (tests/RESULTS.md: "What repeats to the bit")."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ship_sandbox.py")],
        capture_output=True,
        text=True,
        check=False,
        timeout=7200,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    print(json.dumps(report, indent=1))
    manifest = json.loads((sandbox.SHIPPED / "MANIFEST.json").read_text())
    assert set(report["files"]) == set(manifest["files"])
    assert report["probe"]["probe_auroc_mean"] >= 0.90
    if report["machine"] == manifest["built"]["machine"]:
        assert all(row["same bytes"] for row in report["files"].values())
