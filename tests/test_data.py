"""Data: annotation formats, R2Gen-compatible cleaning, the Dataset, bad input, synthetic set."""

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

import common
import sandbox
from common import (
    CHEXPERT_LABELS,
    ReportDataset,
    RuleLabeler,
    clean_report,
    collate,
    load_annotation,
    load_data,
)
from sandbox import make_synthetic


# --- cleaning: expected strings worked out by hand from R2Gen's steps -------------------------
@pytest.mark.parametrize("style", ["mimic_cxr", "iu_xray"])
def test_clean_basic(style):
    assert clean_report("The heart is normal. No effusion.", style) == "the heart is normal . no effusion ."


def test_clean_r2gen_punctuation_range_quirk():
    # ":-[" is a character range in R2Gen's class, so "<", "=", "?" and "@" go too (and "-" stays).
    text = "Size <= 5 mm? Yes @ x-ray apex."
    assert clean_report(text, "mimic_cxr") == "size  5 mm yes  x-ray apex ."


def test_clean_numbered_lists_and_number_damage():
    assert clean_report("1. Small effusion. 2. No pneumothorax.", "mimic_cxr") == "small effusion . no pneumothorax ."
    # R2Gen deletes every "1. ", numbers included
    assert clean_report("Nodule measures 11. Stable.", "mimic_cxr") == "nodule measures 1stable ."
    assert clean_report("A 1.5 cm nodule.", "mimic_cxr") == "a 15 cm nodule ."


def test_clean_empty_sentences_kept_as_r2gen_does():
    assert clean_report("Normal.. . Clear.", "mimic_cxr") == "normal .  . clear ."


def test_clean_newlines_only_in_mimic_style():
    assert clean_report("No effusion.\nClear.", "mimic_cxr") == "no effusion . clear ."  # "\n" -> " " makes ". "
    assert clean_report("No effusion.\nClear.", "iu_xray") == "no effusion\nclear ."


# --- annotation files ------------------------------------------------------------------------
def write_png(path, value=128, size=16):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size), value, np.uint8)).save(path)


def make_iu_style(tmp_path, records=None):
    """An IU X-Ray-like annotation.json (two views per study) with images under images/."""
    if records is None:
        records = {
            "train": [
                {
                    "id": "CXR1_IM-1",
                    "report": "No pneumothorax.",
                    "image_path": ["CXR1_IM-1/0.png", "CXR1_IM-1/1.png"],
                    "split": "train",
                    "labels": [None] * 8 + [0] + [None] * 5,
                }
            ],
            "val": [
                {
                    "id": "CXR2_IM-2",
                    "report": "Small left effusion.",
                    "image_path": ["CXR2_IM-2/0.png", "CXR2_IM-2/1.png"],
                    "split": "val",
                }
            ],
            "test": [
                {
                    "id": "CXR3_IM-3",
                    "report": "Heart size is normal.",
                    "image_path": ["CXR3_IM-3/0.png", "CXR3_IM-3/1.png"],
                    "split": "test",
                }
            ],
        }
    for split in records.values():
        for r in split:
            for p in r.get("image_path", []):
                write_png(tmp_path / "images" / p)
    path = tmp_path / "annotation.json"
    path.write_text(json.dumps(records))
    return path


def test_load_r2gen_layout(tmp_path):
    data = load_annotation(make_iu_style(tmp_path))
    assert set(data) == {"train", "val", "test"}
    r = data["train"][0]
    assert r.id == "CXR1_IM-1" and r.report == "No pneumothorax." and r.split == "train"
    assert r.image_paths == [str(tmp_path / "images" / "CXR1_IM-1" / f"{k}.png") for k in (0, 1)]
    assert r.labels[CHEXPERT_LABELS.index("Pneumothorax")] == 0 and np.isnan(r.labels[0])
    assert data["val"][0].labels is None


def test_images_beside_the_annotation_without_an_images_folder(tmp_path):
    path = make_iu_style(tmp_path)
    for p in (tmp_path / "images").iterdir():
        p.rename(tmp_path / p.name)
    (tmp_path / "images").rmdir()
    assert load_annotation(path)["val"][0].image_paths[0] == str(tmp_path / "CXR2_IM-2" / "0.png")
    assert load_data(str(tmp_path))["val"][0].id == "CXR2_IM-2"  # --data may name the folder


def test_dataset_two_views_and_collate(tmp_path):
    data = load_annotation(make_iu_style(tmp_path))
    ds = ReportDataset(data["train"] + data["val"], common.default_transform(32))
    item = ds[0]
    assert item["images"].shape == (2, 3, 32, 32)  # (V, C, H, W)
    assert item["labels"].shape == (14,) and item["labels"].dtype == torch.float32
    batch = collate([ds[0], ds[1]])
    assert batch["images"].shape == (2, 2, 3, 32, 32)  # (B, V, C, H, W)
    assert torch.isnan(batch["labels"][1]).all()  # the val record has no labels
    pil = ReportDataset(data["train"], transform="pil")[0]["images"]
    assert len(pil) == 2 and pil[0].mode == "L"


# --- bad input: each names the file and the record -------------------------------------------
def test_missing_annotation_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="annotation file not found: .*nope.json"):
        load_annotation(tmp_path / "nope.json")


def test_malformed_json(tmp_path):
    (tmp_path / "annotation.json").write_text('{"train": [')
    with pytest.raises(ValueError, match="annotation.json: not a JSON file"):
        load_annotation(tmp_path / "annotation.json")


def test_wrong_top_level(tmp_path):
    (tmp_path / "annotation.json").write_text("[]")
    with pytest.raises(ValueError, match=r"annotation.json: expected \{'train'.*R2Gen's layout\), got list"):
        load_annotation(tmp_path / "annotation.json")
    (tmp_path / "annotation.json").write_text('{"train": [], "valid": []}')
    with pytest.raises(ValueError, match=r"got \['train', 'valid'\]"):
        load_annotation(tmp_path / "annotation.json")


def test_missing_key_empty_report_missing_image_all_reported(tmp_path):
    records = {
        "train": [
            {"id": "a", "report": "ok.", "image_path": ["a.png"], "split": "train"},
            {"id": "b", "image_path": ["b.png"], "split": "train"},  # no report
            {"id": "c", "report": "  ", "image_path": ["c.png"], "split": "train"},  # empty report
            {"id": "d", "report": "ok.", "image_path": ["d.png"], "split": "train"},  # image removed below
            {"id": "e", "report": "ok.", "image_path": ["e.png"], "split": "train", "labels": {"Edema": 1}},
            {"id": "f", "report": "ok.", "image_path": ["f.png"], "split": "train", "labels": [1] * 13},
            {"id": "g", "report": "ok.", "image_path": ["g.png"], "split": "train", "labels": [2] + [None] * 13},
            {"id": "h", "report": "ok.", "image_path": ["h.png"], "split": "train", "labels": [True] + [None] * 13},
        ],
        "val": [],
        "test": [],
    }
    path = make_iu_style(tmp_path, records)
    (tmp_path / "images" / "d.png").unlink()
    with pytest.raises(ValueError) as err:
        load_annotation(path)
    msg = str(err.value)
    assert "7 bad record(s)" in msg
    assert "[train][1] id='b': a record needs 'id', 'report' and 'image_path'" in msg
    assert "[train][2] id='c': empty report" in msg
    assert "[train][3] id='d': image not found:" in msg and "d.png" in msg
    for n, i in ((4, "e"), (5, "f"), (6, "g"), (7, "h")):
        assert f"[train][{n}] id='{i}': 'labels' must be 14 values (1, 0, -1 or null)" in msg
    assert str(path) in msg and "(--drop-invalid skips them)" in msg


def test_drop_invalid_keeps_the_good_records_and_logs_the_rest(tmp_path, caplog):
    records = {
        "train": [
            {"id": "a", "report": "ok.", "image_path": ["a.png"], "split": "train"},
            {"id": "b", "report": "", "image_path": ["b.png"], "split": "train"},
        ],
        "val": [],
        "test": [],
    }
    with caplog.at_level(logging.WARNING, logger="rrg"):
        data = load_annotation(make_iu_style(tmp_path, records), drop_invalid=True)
    assert [r.id for r in data["train"]] == ["a"]
    assert "id='b': empty report" in caplog.text


@pytest.mark.parametrize("content", [b"", b"not a png at all"])
def test_unreadable_image_is_a_load_error_that_drop_invalid_skips(tmp_path, content):
    """Images are opened (their headers) at load time: a 0-byte or foreign file stops the run before any training,
    naming the record and the file, and --drop-invalid skips the study instead."""
    path = make_iu_style(tmp_path)
    (tmp_path / "images" / "CXR1_IM-1" / "1.png").write_bytes(content)
    with pytest.raises(ValueError, match=r"\[train\]\[0\] id='CXR1_IM-1': cannot read image CXR1_IM-1/1.png"):
        load_annotation(path)
    assert [r.id for r in load_annotation(path, drop_invalid=True)["train"]] == []


def test_image_that_breaks_after_loading_is_named_with_its_record(tmp_path):
    path = make_iu_style(tmp_path)
    ds = ReportDataset(load_annotation(path)["train"], common.default_transform(16))
    (tmp_path / "images" / "CXR1_IM-1" / "1.png").write_bytes(b"not a png at all")
    with pytest.raises(ValueError, match=r"record CXR1_IM-1: cannot read image .*CXR1_IM-1/1.png"):
        ds[0]


# --- synthetic set ----------------------------------------------------------------------------
def test_synthetic_layout_and_labels(small_synthetic):
    data = load_annotation(small_synthetic)
    assert [len(data[s]) for s in ("train", "val", "test")] == [40, 8, 12]
    records = [r for s in data.values() for r in s]
    # the stored ground truth is what the rule labeler reads from the report
    got = RuleLabeler()([r.report for r in records])
    truth = np.stack([r.labels for r in records])
    assert np.array_equal(np.isnan(got), np.isnan(truth)) and np.array_equal(
        got[~np.isnan(got)], truth[~np.isnan(truth)]
    )
    item = ReportDataset(data["train"], common.default_transform(64))[0]
    assert item["images"].shape == (1, 3, 64, 64)


def test_synthetic_is_deterministic(tmp_path):
    a = make_synthetic(tmp_path / "a", n_train=6, n_val=2, n_test=2, size=48, seed=7)
    b = make_synthetic(tmp_path / "b", n_train=6, n_val=2, n_test=2, size=48, seed=7)
    c = make_synthetic(tmp_path / "c", n_train=6, n_val=2, n_test=2, size=48, seed=8)
    assert (a / "annotation.json").read_text() == (b / "annotation.json").read_text()
    assert (a / "annotation.json").read_text() != (c / "annotation.json").read_text()
    for png in (a / "images").iterdir():
        assert png.read_bytes() == (b / "images" / png.name).read_bytes()


def test_synthetic_label_statistics():
    rng = np.random.default_rng(0)
    samples = [sandbox.sample_synthetic_study(rng) for _ in range(4000)]
    labels = np.stack([l for _, l in samples])
    reports = [sandbox.write_synthetic_report(f, l, rng) for f, l in samples]
    present = (labels == 1) | (labels == -1)
    prevalence = dict(zip(CHEXPERT_LABELS, present.mean(0)))
    assert prevalence["Support Devices"] > 0.25 and prevalence["Fracture"] < 0.04  # skewed as MIMIC-CXR
    assert 0.15 < prevalence["No Finding"] < 0.45  # normal studies exist
    assert (labels == -1).any(0)[:11].all()  # hedged mentions of every hedgeable finding
    assert (labels == 0).any(0)[:12].all()  # explicit negations
    text = " ".join(reports)
    for phrase in ("No pneumothorax", "Possible", "cannot be excluded", "Heart size is normal"):
        assert phrase in text


def test_synthetic_data_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("RRG_CACHE", str(tmp_path))
    first = sandbox.synthetic_data(n_train=4, n_val=2, n_test=2, size=32)
    stamp = first.stat().st_mtime_ns
    second = sandbox.synthetic_data(n_train=4, n_val=2, n_test=2, size=32)
    assert first == second and second.stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_study_batches_shard_resume_and_size_check(small_synthetic):
    from itertools import islice

    records = load_annotation(small_synthetic)["train"]  # 40 studies

    def ids(it, n):
        return [b["id"] for _, b in islice(it, n)]

    # two ranks: disjoint shards within an epoch, together all 40 studies once (bs 5: 4 steps)
    r0 = ids(common.study_batches(records, 5, seed=3, rank=0, world_size=2), 4)
    r1 = ids(common.study_batches(records, 5, seed=3, rank=1, world_size=2), 4)
    flat = [i for b in r0 + r1 for i in b]
    assert sorted(flat) == sorted(r.id for r in records)
    # resuming at step 6 gives exactly steps 6, 7, ... of the uninterrupted order (epoch 2 included)
    full = ids(common.study_batches(records, 5, seed=3), 12)
    assert ids(common.study_batches(records, 5, seed=3, start_step=6), 6) == full[6:]
    first, second = full[:8], full[8:12]  # epoch 0 is 8 steps; epoch 1 reshuffles
    assert sorted(i for b in first for i in b) == sorted(r.id for r in records)
    assert second != first[:4]
    batch = next(common.study_batches(records, 2))[1]
    assert isinstance(batch["images"][0][0], Image.Image) and len(batch["report"]) == 2
    with pytest.raises(ValueError, match="cannot fill one batch of 16 on each of 3 ranks"):
        next(common.study_batches(records, 16, world_size=3))
