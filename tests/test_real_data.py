"""Real data as users have it: IU X-Ray in the R2GenGPT layout (1-5 views, flat Open-i names, no split field),
R2Gen's cleaning by data set, degenerate output called out, each paper's CE convention, the "auto" defaults and
a CheXbert that cannot be downloaded. The fixtures (tests/conftest.py) write text of our own, never Open-i's."""

import dataclasses
import json
import time

import numpy as np
import pytest

import common
import dcrrg
import deer
import mrg_r1
import orapo
import rrgcl
import sandbox


# --- views and cleaning -----------------------------------------------------------------------
def test_the_r2gengpt_layout_loads_with_its_view_counts(iu_xray):
    data = common.load_annotation(iu_xray)
    counts = sorted({len(r.image_paths) for split in data.values() for r in split})
    assert counts == [1, 2, 3, 4, 5] and all(r.split == s for s, rs in data.items() for r in rs)  # no "split" fields
    assert common.clean_style(data["train"]) == "iu_xray"


def test_r2gen_views_two_per_study_in_file_order():
    """R2Gen reads two views of an IU X-Ray study: the record's first two; a 1-view study repeats its view; a data
    set with one view per study (R2Gen's MIMIC-CXR file) keeps one."""

    def rec(n):
        return common.Record(f"s{n}", [f"v{k}.png" for k in range(n)], "r", "train")

    two = common.r2gen_views({"train": [rec(1), rec(2), rec(5)], "test": [rec(3)]})
    assert [r.image_paths for r in two["train"] + two["test"]] == [
        ["v0.png", "v0.png"],
        ["v0.png", "v1.png"],
        ["v0.png", "v1.png"],
        ["v0.png", "v1.png"],
    ]
    assert common.r2gen_views({"train": [rec(1), rec(1)]})["train"][0].image_paths == ["v0.png"]


def test_cleaning_follows_the_data_set(small_synthetic, iu_xray_r2gen):
    """R2Gen cleans IU X-Ray and MIMIC-CXR reports with different rules: auto takes the data's own (Open-i image names
    mean IU X-Ray), --clean overrides, and the evaluation uses the rule the run recorded."""
    assert common.clean_style(common.load_annotation(small_synthetic)["train"]) == "mimic_cxr"
    assert common.clean_style(common.load_annotation(iu_xray_r2gen)["train"]) == "iu_xray"
    # IU X-Ray's rule keeps a line break (no sentence split there), MIMIC-CXR's turns it into a space and splits
    rows = [{"id": "a", "reference": "No effusion.\nClear lungs.", "generated": "No effusion clear lungs."}]
    iu, mimic = (
        common.evaluate_generations(rows, common.RuleLabeler(), style, meteor=False)
        for style in ("iu_xray", "mimic_cxr")
    )
    assert (iu["clean"], mimic["clean"]) == ("iu_xray", "mimic_cxr")
    assert iu["nlg"]["BLEU-4"] > 0.99 and mimic["nlg"]["BLEU-4"] < 0.5


# --- degenerate output ------------------------------------------------------------------------
REFS = [
    "The heart is normal in size. The lungs are clear.",
    "Small left pleural effusion.",
    "Mild cardiomegaly.",
    "No pneumothorax. Stable sternotomy wires.",
    "The lungs are clear.",
    "Patchy right basilar opacity.",
] * 2


def test_a_constant_normal_report_is_called_out():
    """On IU X-Ray, mostly normal, a constant "normal" report scores a high CE F1: the warning goes into the eval JSON
    and the summary line, beside the CE number."""
    rows = [{"id": str(k), "reference": r, "generated": "The lungs are clear."} for k, r in enumerate(REFS)]
    out = common.evaluate_generations(rows, common.RuleLabeler(), meteor=False, headline="micro_f1")
    assert out["degenerate"]["distinct"] == 1 and out["degenerate"]["most_common_share"] == 1.0
    assert "degenerate output: 1 distinct report(s) of 12" in out["degenerate"]["warning"]
    assert "CE micro f1" in common.summary(out) and "[degenerate output" in common.summary(out)
    dots = common.degenerate_output([". . ." for _ in REFS], REFS)  # no word of the references at all
    assert dots["contentless_share"] == 1.0 and "12 of 12 without a word" in dots["warning"]
    varied = common.degenerate_output(REFS[::-1], REFS)
    assert varied["warning"] == "" and varied["distinct"] == 6 and varied["most_common_share"] == 2 / 12


# --- the papers' CE conventions ---------------------------------------------------------------
def test_each_script_scores_ce_as_its_paper():
    """MRG-R1 (Sec. IV-A), RRGCL and DCRRG: micro P/R/F1 over the 14 observations (R2Gen's protocol); DEER: PromptMRG's
    sample-wise (example) F1; OraPO (Sec. 4.2): macro over the 14 labels; all count positives only."""
    assert mrg_r1.CE == rrgcl.CE == dcrrg.CE == dict(headline="micro_f1", uncertain_as=0)
    assert deer.CE == dict(headline="example_f1", uncertain_as=0)
    assert orapo.CE == dict(headline="macro_f1", uncertain_as=0)
    rows = [
        {"id": "a", "reference": "Possible left pleural effusion.", "generated": "Possible left pleural effusion."},
        {"id": "b", "reference": "Small left pleural effusion.", "generated": "Small left pleural effusion."},
    ]
    out = common.evaluate_generations(rows, common.RuleLabeler(), meteor=False, **deer.CE)
    assert out["ce"]["example_f1"] == 0.5 and out["headline"] == "example_f1"  # the uncertain report has no positive


# --- "auto" defaults and a CheXbert that cannot be reached --------------------------------------
def test_auto_labeler_and_dtype():
    """--labeler auto: the papers' CheXbert (on --data synthetic the sandbox's, trained once and cached by start_run),
    except for the tiny model on real data with no weights given, which labels by the offline rules."""

    def args(**k):
        return dataclasses.replace(common.RunArgs(), **k)

    synthetic = common.resolve_defaults(args())  # synthetic, tiny
    assert (synthetic.labeler, synthetic.chexbert_weights) == ("chexbert", None)  # nothing trained here
    assert common.resolve_defaults(args(data="/d/iu", model="tiny")).labeler == "rule"
    assert common.resolve_defaults(args(data="/d/iu", model="tiny", chexbert_weights="c.pth")).labeler == "chexbert"
    assert common.resolve_defaults(args(data="/d/iu", model="Qwen/Qwen2.5-VL-3B-Instruct")).labeler == "chexbert"
    assert common.resolve_defaults(args(labeler="rule", data="/d/iu", model="q")).labeler == "rule"  # on request
    assert common.resolve_defaults(args()).dtype == "fp32"  # no GPU here: bf16 only where a GPU has it


@pytest.mark.usefixtures("synthetic_set_is_small")  # not the full set, drawn
def test_a_synthetic_run_labels_with_the_sandbox_chexbert(tmp_path, small_synthetic, monkeypatch):
    """start_run on --data synthetic with --labeler auto builds CheXbert from the sandbox's weights (trained once by
    synthetic_chexbert) and records their path in config.json."""
    made = []

    def make_labeler(name, weights=None, device="cpu"):
        made.append((name, weights))
        return common.RuleLabeler()

    monkeypatch.setattr(common, "load_data", lambda data, **kwargs: common.load_annotation(small_synthetic))
    monkeypatch.setattr(sandbox, "synthetic_chexbert", lambda: "cache/chexbert-v2/chexbert.pth")
    monkeypatch.setattr(common, "make_labeler", make_labeler)
    run = common.start_run(common.RunArgs(out=str(tmp_path / "r"), tiny_start="random"))
    assert made == [("chexbert", "cache/chexbert-v2/chexbert.pth")]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["chexbert_weights"] == run.args.chexbert_weights


def test_a_real_run_without_chexbert_weights_stops_at_once(tmp_path, iu_xray, tiny_qwen_dir, monkeypatch):
    """A real model on real data labels with CheXbert by default; with no weights cached and the Hub out of reach it
    stops before anything is written, with one line naming --chexbert-weights and --labeler rule."""
    import socket

    import huggingface_hub

    real_download = huggingface_hub.hf_hub_download

    def not_cached(*a, local_files_only=False, **k):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        return real_download(*a, **k)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", not_cached)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
    start = time.time()
    with pytest.raises(
        SystemExit, match=r"^error: --labeler chexbert needs chexbert.pth .* --chexbert-weights FILE .* --labeler rule"
    ):
        mrg_r1.main(["--data", str(iu_xray), "--model", str(tiny_qwen_dir), "--out", str(tmp_path / "run")])
    assert time.time() - start < 30 and not (tmp_path / "run").exists()


# --- each script end to end on the R2GenGPT layout ----------------------------------------------
def check_eval(out, n: int, headline: str):
    config, results = json.loads((out / "config.json").read_text()), json.loads((out / "eval.json").read_text())
    assert config["clean"] == "iu_xray" and config["labeler"] == "rule" and config["dtype"] == "fp32"
    assert any("rule labeler" in note for note in config["notes"])
    result = results.get("test_after") or results["test"]
    assert result["n"] == n and result["clean"] == "iu_xray" and result["headline"] == headline
    assert (
        0 <= result["ce"][headline] <= 1 and np.isfinite(result["nlg"]["BLEU-4"]) and "warning" in result["degenerate"]
    )
    return config


def test_mrg_r1_orapo_deer_on_real_format_iu_xray(tmp_path, iu_xray, monkeypatch):
    """One short run of each RL script on 1-5-view studies: MRG-R1 splits the views into samples (Sec. IV-A), the
    tiny model of OraPO and DEER reads all of a study's views."""
    data = common.load_annotation(iu_xray)
    monkeypatch.setattr(mrg_r1, "WARM_START", dict(lr_tiny=3e-3, lr_hf=1e-2, batch_size=4))
    rl = [
        "--data",
        str(iu_xray),
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--max-new-tokens",
        "8",
        "--sft-steps",
        "2",
    ]
    mrg_r1.main(rl + ["--out", str(tmp_path / "m")])
    check_eval(tmp_path / "m", sum(len(r.image_paths) for r in data["test"]), "micro_f1")
    monkeypatch.setattr(orapo, "WARM_START", dict(lr=3e-3, batch_size=4))
    monkeypatch.setattr(orapo, "N_EVAL", 2)
    orapo.main(rl + ["--out", str(tmp_path / "o"), "--group-size", "2"])
    config = check_eval(tmp_path / "o", len(data["test"]), "macro_f1")
    assert any("FactS" in note for note in config["notes"])
    for k, v in dict(K=2, DD_CHUNK=8, SFT=dict(deer.SFT, batch_tiny=4)).items():
        monkeypatch.setattr(deer, k, v)
    deer.main(rl + ["--out", str(tmp_path / "d"), "--group-size", "2"])
    config = check_eval(tmp_path / "d" / "rl_rule", len(data["test"]), "example_f1")
    assert any("TF-IDF" in note for note in config["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["iu_xray", "iu_xray_r2gen"])
def test_all_five_scripts_on_iu_xray(tmp_path, layout, request, monkeypatch):
    """Each of the five scripts, a tiny budget each, on IU X-Ray as users have it (R2GenGPT's 1-5 views, R2Gen's 2):
    exit 0 and an eval.json with finite numbers (`python -m pytest -q tests/test_real_data.py -m slow`)."""
    data = str(request.getfixturevalue(layout))
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 1000)
    rl = ["--data", data, "--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "8", "--sft-steps", "2"]
    mrg_r1.main(rl + ["--out", str(tmp_path / "m")])
    orapo.main(rl + ["--out", str(tmp_path / "o"), "--group-size", "2"])
    deer.main(rl + ["--out", str(tmp_path / "d"), "--group-size", "2"])
    rrgcl.main(["--data", data, "--out", str(tmp_path / "r"), "--steps", "2", "--epochs", "1", "--batch-size", "8"])
    dcrrg.main(
        [
            "--data",
            data,
            "--out",
            str(tmp_path / "c"),
            "--batch-size",
            "8",
            "--decoder-batch-size",
            "4",
            *[f for k in range(1, 5) for f in (f"--step{k}-steps", "2")],
        ]
    )
    for out in ("m", "o", "d/rl_rule", "r", "c/step4"):
        text = (tmp_path / out / "eval.json").read_text()
        assert "NaN" not in text and json.loads((tmp_path / out / "config.json").read_text())["clean"] == "iu_xray"
