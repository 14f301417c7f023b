"""common.py: the small shared part of rrg-from-scratch.

Everything here is plumbing that at least two of the method scripts use, in reading order:

  1. Labels    the 14 CheXpert observations (CheXbert order) and the value conventions
  2. Data      R2Gen-layout annotations (IU X-Ray, MIMIC-CXR), CSV/JSONL, report cleaning,
               a torch Dataset, and the synthetic chest X-ray set used offline
  3. Labelers  RuleLabeler (CheXpert-style rules, written here) and CheXbertLabeler
               (f1chexbert's model with the real CheXbert weights)
  4. Metrics   BLEU-1..4, ROUGE-L, CIDEr-D (equal to pycocoevalcap), METEOR via pycocoevalcap's
               Java scorer when present, and clinical-efficacy (CE) precision/recall/F1
  5. Models    one policy interface: TinyPolicy (small CNN + GPT-2-configured decoder, offline)
               and HFPolicy (Qwen2.5-VL and kin through AutoModelForImageTextToText); LoRA
  6. RL core   group advantages, GRPO loss (grpo / bnpo / dr_grpo, k3 KL), DPO loss, rollouts
  7. Running   seeding, torchrun/DDP, rank-0 logging, atomic checkpoints with resume
  8. Command line: `python common.py evaluate --generations FILE.jsonl`,
                   `python common.py synthetic --out DIR`

Label arrays are float (N, 14): 1 positive, 0 negative, -1 uncertain, NaN not mentioned.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("rrg")

# ---------------------------------------------------------------------------------------------
# 1. Labels
# ---------------------------------------------------------------------------------------------
# CheXbert's output order (No Finding last; the CheXpert labeler's CSV puts it first).
CHEXPERT_LABELS = [
    "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema",
    "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion",
    "Pleural Other", "Fracture", "Support Devices", "No Finding",
]
FINDINGS = CHEXPERT_LABELS[:13]  # the 13 observations other than No Finding
LABEL_INDEX = {name: i for i, name in enumerate(CHEXPERT_LABELS)}
POSITIVE, NEGATIVE, UNCERTAIN, BLANK = 1.0, 0.0, -1.0, float("nan")


def binarize(labels, uncertain_as: int = 1, name: str = "labels") -> np.ndarray:
    """(N, 14) labels with 1/0/-1/NaN -> (N, 14) int {0, 1}: 1 is positive, -1 (uncertain) is
    positive iff uncertain_as == 1, 0 (negative) and NaN (not mentioned) are not."""
    if uncertain_as not in (0, 1):
        raise ValueError(f"uncertain_as must be 0 or 1, got {uncertain_as!r}")
    x = np.asarray(labels, dtype=float)
    if x.ndim != 2 or x.shape[1] != len(CHEXPERT_LABELS):
        raise ValueError(f"{name} must have shape (N, {len(CHEXPERT_LABELS)}) in CHEXPERT_LABELS order, got {x.shape}")
    bad = ~np.isnan(x) & ~np.isin(x, (-1.0, 0.0, 1.0))
    if bad.any():  # e.g. raw CheXbert head classes (2 = negative, 3 = uncertain) passed by mistake
        raise ValueError(f"{name} values must be 1, 0, -1 or NaN; found {sorted(set(x[bad].tolist()))[:5]}")
    return ((x == 1) | ((x == -1) & (uncertain_as == 1))).astype(np.int64)


def apply_no_finding_rule(labels: np.ndarray) -> np.ndarray:
    """CheXpert's No Finding: 1 when no observation other than Support Devices is positive or
    uncertain, blank otherwise. Works in place on (14,) or (N, 14) and returns it."""
    others = labels[..., [LABEL_INDEX[n] for n in FINDINGS if n != "Support Devices"]]
    found = np.any((others == 1) | (others == -1), axis=-1)
    labels[..., LABEL_INDEX["No Finding"]] = np.where(found, np.nan, 1.0)
    return labels


def parse_labels(value, where: str) -> np.ndarray:
    """A label field from an annotation file -> float (14,). Accepts a list of 14 values
    (null = blank) or a dict {label name: value}. `where` names the file and record."""
    out = np.full(len(CHEXPERT_LABELS), np.nan)
    if isinstance(value, dict):
        for name, v in value.items():
            if name not in LABEL_INDEX:
                raise ValueError(f"{where}: unknown label {name!r}; known labels: {CHEXPERT_LABELS}")
            out[LABEL_INDEX[name]] = _label_value(v, where, name)
    elif isinstance(value, (list, tuple)):
        if len(value) != len(CHEXPERT_LABELS):
            raise ValueError(f"{where}: 'labels' has {len(value)} values, expected 14 in the order {CHEXPERT_LABELS}")
        for name, v in zip(CHEXPERT_LABELS, value):
            out[LABEL_INDEX[name]] = _label_value(v, where, name)
    else:
        raise ValueError(f"{where}: 'labels' must be a list of 14 values or a dict, got {type(value).__name__}")
    return out


def _label_value(v, where: str, name: str) -> float:
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return np.nan
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: label {name!r} has value {v!r}; expected 1, 0, -1 or blank") from None
    if f not in (1.0, 0.0, -1.0):
        raise ValueError(f"{where}: label {name!r} has value {v!r}; expected 1, 0, -1 or blank")
    return f


# ---------------------------------------------------------------------------------------------
# 2. Data
# ---------------------------------------------------------------------------------------------
SPLITS = ("train", "val", "test")


@dataclass
class Record:
    """One study: its id, absolute image paths (IU X-Ray has two views, MIMIC-CXR one), the
    report and, when the annotation has them, the 14 labels."""
    id: str
    image_paths: list[str]
    report: str
    split: str
    labels: np.ndarray | None = None
    meta: dict = field(default_factory=dict)  # any other fields of the record, kept as is


# Report cleaning. R2Gen (github.com/zhjohnchan/R2Gen, modules/tokenizers.py) lower-cases,
# splits sentences on ". ", deletes punctuation and joins the sentences with " . ". Papers report
# metrics on text cleaned that way, so we offer the same behaviour, written out here. Two of its
# behaviours are quirks rather than intent; `r2gen_quirks=True` (default, for comparable numbers)
# keeps them, False fixes them:
#   - it deletes every "1. " (meant for numbered lists), which also turns "1.5 cm" ... "11. " into
#     damaged numbers ("11. " -> "1"); and " 2. ".." 5. " become sentence breaks.
#   - its punctuation class "[.,?;*!%^&_+():-\[\]{}]" contains the range ":-\[" (0x3A-0x5B),
#     which also deletes ";<=>?@" and upper-case letters (harmless after lower-casing), while
#     "-" itself is kept.
#   - empty sentences are kept (its `!= []` test compares a string with a list), giving ". ."
R2GEN_PUNCT_QUIRK = re.compile(r"[.,?;*!%^&_+():-\[\]{}]")  # the range is deliberate: see above
# The characters R2Gen meant to list, keeping decimal points ("1.5 cm").
R2GEN_PUNCT_FIXED = re.compile(r"[,?;*!%^&_+():\[\]{}]|\.(?!\d)|(?<!\d)\.")
_WHITESPACE = re.compile(r"\s+")


def _replace_repeatedly(text: str, old: str, new: str, times: int) -> str:
    # R2Gen collapses runs ("__", "  ", "..") with a fixed number of str.replace passes, so a
    # run longer than 2**times characters is not fully collapsed. We keep that exact behaviour.
    for _ in range(times):
        text = text.replace(old, new)
    return text


def clean_report(report: str, style: str = "mimic_cxr", r2gen_quirks: bool = True) -> str:
    """Clean a report like R2Gen's clean_report_{mimic_cxr,iu_xray} ("mimic_cxr", "iu_xray"),
    or only normalise whitespace ("plain")."""
    if style == "plain":
        return _WHITESPACE.sub(" ", report).strip()
    if style not in ("mimic_cxr", "iu_xray"):
        raise ValueError(f"unknown cleaning style {style!r}; use mimic_cxr, iu_xray or plain")
    t = report
    if style == "mimic_cxr":  # IU X-Ray's cleaner skips these three steps
        t = t.replace("\n", " ")
        t = _replace_repeatedly(t, "__", "_", 7)
        t = _replace_repeatedly(t, "  ", " ", 6)
    t = _replace_repeatedly(t, "..", ".", 5 if style == "mimic_cxr" else 3)
    if r2gen_quirks:
        t = t.replace("1. ", "")
        for k in "2345":
            t = t.replace(f". {k}. ", ". ")
        for k in "2345":
            t = t.replace(f" {k}. ", ". ")
        punct = R2GEN_PUNCT_QUIRK
    else:
        # Only list markers at the start of the report or of a sentence: "1. The heart ..."
        t = re.sub(r"(^|\.\s+)\d{1,2}\.\s+", lambda m: ". " if m.group(1) else "", t.strip())
        t = _WHITESPACE.sub(" ", t)
        punct = R2GEN_PUNCT_FIXED
    sentences = t.strip().lower().split(". ")
    cleaned = [punct.sub("", s.replace('"', "").replace("/", "").replace("\\", "").replace("'", "").strip().lower())
               for s in sentences]
    if not r2gen_quirks:
        cleaned = [_WHITESPACE.sub(" ", s).strip() for s in cleaned]
        cleaned = [s for s in cleaned if s]
    return " . ".join(cleaned) + " ."


def _resolve_image_root(annotation_path: Path, image_root) -> Path:
    # R2Gen keeps images in <dataset>/images/ next to annotation.json, with paths relative to it.
    if image_root is not None:
        return Path(image_root)
    folder = annotation_path.parent
    return folder / "images" if (folder / "images").is_dir() else folder


def _read_annotation_file(path: Path) -> dict[str, list[dict]]:
    """Read annotation.json (R2Gen layout), .jsonl (one record per line with a 'split' field) or
    .csv (columns id, split, report, image_path, optional one column per label) into
    {split: [raw record dict]}."""
    if not path.is_file():
        raise FileNotFoundError(f"annotation file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected an object {{'train': [...], 'val': [...], 'test': [...]}}, "
                                 f"got {type(data).__name__}")
            for split, rows in data.items():
                if not isinstance(rows, list):
                    raise ValueError(f"{path}: split {split!r} must be a list of records")
            return data
        rows = []
        if suffix == ".jsonl":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        elif suffix == ".csv":
            with path.open(newline="") as f:
                for row in csv.DictReader(f):
                    labels = {k: v for k, v in row.items() if k in LABEL_INDEX}
                    row = {k: v for k, v in row.items() if k not in LABEL_INDEX}
                    if labels:
                        row["labels"] = labels
                    p = (row.get("image_path") or "").strip()
                    # a JSON list, or paths separated by ';'
                    row["image_path"] = json.loads(p) if p.startswith("[") else [s for s in p.split(";") if s]
                    rows.append(row)
        else:
            raise ValueError(f"{path}: unknown annotation format {suffix!r}; use .json (R2Gen layout), .jsonl or .csv")
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    data: dict[str, list[dict]] = {}
    for n, row in enumerate(rows):
        if not isinstance(row, dict) or "split" not in row:
            raise ValueError(f"{path}: record {n} has no 'split' field (needed in .jsonl/.csv files)")
        data.setdefault(row["split"], []).append(row)
    return data


def load_annotation(path, image_root=None, splits=SPLITS, clean: str | None = None,
                    check_images: bool = True, drop_invalid: bool = False) -> dict[str, list[Record]]:
    """Load an annotation file into {split: [Record]}.

    path: annotation.json in R2Gen's layout ({"train": [{"id", "report", "image_path": [...],
    "split"}], "val": [...], "test": [...]}; IU X-Ray has two image paths per study, MIMIC-CXR
    one), or .jsonl / .csv with the same fields. Image paths are relative to `image_root`
    (default: the 'images' folder beside the file if there is one, else the file's folder).
    Optional 'labels': 14 values in CHEXPERT_LABELS order or a {name: value} dict.
    clean: None keeps reports as written, else a clean_report style.
    Bad records raise one error that lists every problem (file, split, index, id); with
    drop_invalid=True they are dropped instead and each drop is logged.
    """
    path = Path(path)
    raw = _read_annotation_file(path)
    root = _resolve_image_root(path, image_root)
    for split in splits:
        if split not in raw:
            raise KeyError(f"{path}: unknown split {split!r}; the file has splits {sorted(raw)}")
    out: dict[str, list[Record]] = {}
    problems: list[str] = []
    for split in splits:
        out[split] = []
        for n, row in enumerate(raw[split]):
            where = f"{path} [{split}][{n}]" + (f" id={row.get('id')!r}" if isinstance(row, dict) else "")
            try:
                out[split].append(_make_record(row, split, root, where, clean, check_images))
            except (KeyError, ValueError, FileNotFoundError) as e:
                problems.append(str(e).strip("'\""))
    if problems:
        if not drop_invalid:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise ValueError(f"{path}: {len(problems)} bad record(s):\n  {shown}{more}\n"
                             f"(pass drop_invalid=True / --drop-invalid to skip them)")
        for p in problems:
            log.warning("dropped: %s", p)
    return out


def _make_record(row, split, root: Path, where, clean, check_images) -> Record:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a record must be an object, got {type(row).__name__}")
    for key in ("id", "report", "image_path"):
        if key not in row:
            raise KeyError(f"{where}: missing key {key!r} (record has {sorted(row)})")
    report = row["report"]
    if not isinstance(report, str) or not report.strip():
        raise ValueError(f"{where}: empty report")
    paths = row["image_path"]
    paths = [paths] if isinstance(paths, str) else paths
    if not isinstance(paths, list) or not paths:
        raise ValueError(f"{where}: 'image_path' must be a non-empty list of paths")
    image_paths = [str(root / p) for p in paths]
    if check_images:
        for p in image_paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{where}: image not found: {p}")
    labels = parse_labels(row["labels"], where) if row.get("labels") is not None else None
    meta = {k: v for k, v in row.items() if k not in ("id", "report", "image_path", "split", "labels")}
    if clean is not None:
        report = clean_report(report, clean)
    return Record(str(row["id"]), image_paths, report, split, labels, meta)


def load_image(path: str, record_id: str = "?"):
    """Open an image as 8-bit grey-scale PIL; a clear error names the file and the record."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as im:
            return im.convert("L")
    except FileNotFoundError:
        raise FileNotFoundError(f"record {record_id}: image not found: {path}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"record {record_id}: cannot read image {path} ({e})") from None


def default_transform(size: int = 224, train: bool = False, channels: int = 3):
    """R2Gen's transform: resize to 256 then random-crop 224 for training, resize to 224 at test,
    ImageNet normalisation (grey images repeated over 3 channels for ImageNet backbones).
    `size` scales both (crop = size, resize = size * 256 / 224)."""
    import torchvision.transforms as T
    mean, std = [0.485, 0.456, 0.406][:channels], [0.229, 0.224, 0.225][:channels]
    steps = [T.Grayscale(num_output_channels=channels)]
    if train:
        steps += [T.Resize(round(size * 256 / 224)), T.RandomCrop(size), T.RandomHorizontalFlip()]
    else:
        steps += [T.Resize((size, size))]
    return T.Compose(steps + [T.ToTensor(), T.Normalize(mean, std)])


class ReportDataset(torch.utils.data.Dataset):
    """Yields {"id", "images": (V, C, H, W) tensor (or a list of PIL images when transform is
    "pil", for Hugging Face processors), "report", "labels": (14,) float tensor, NaN = blank}.
    Records without labels give all-NaN labels; V = number of views (IU X-Ray: 2)."""

    def __init__(self, records: list[Record], transform="default", size: int = 224, train: bool = False):
        self.records = records
        self.transform = default_transform(size, train) if transform == "default" else transform

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        images = [load_image(p, r.id) for p in r.image_paths]
        if self.transform != "pil":
            images = torch.stack([self.transform(im) for im in images])  # (V, C, H, W)
        labels = r.labels if r.labels is not None else np.full(len(CHEXPERT_LABELS), np.nan)
        return {"id": r.id, "images": images, "report": r.report,
                "labels": torch.as_tensor(labels, dtype=torch.float32)}


def collate(batch: list[dict]) -> dict:
    """Stack a batch; studies must have the same number of views (true within IU X-Ray or
    within MIMIC-CXR as R2Gen lays them out)."""
    out = {"id": [b["id"] for b in batch], "report": [b["report"] for b in batch],
           "labels": torch.stack([b["labels"] for b in batch])}
    images = [b["images"] for b in batch]
    out["images"] = torch.stack(images) if isinstance(images[0], torch.Tensor) else images  # (B, V, C, H, W)
    return out



def study_batches(records: list[Record], batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                  start_step: int = 0, transform="pil"):
    """Endless shuffled batches of studies (PIL views by default: the policies process images
    themselves), yielding (epoch, batch). Under torchrun each rank reads its own shard
    (DistributedSampler, reshuffled each epoch from `seed`). The order is a function of
    (seed, step) only, so a run resumed at `start_step` sees exactly the batches it would have."""
    from torch.utils.data import DistributedSampler
    if len(records) < batch_size * world_size:
        raise ValueError(f"{len(records)} studies cannot fill one batch of {batch_size} on each of {world_size} ranks")
    dataset = ReportDataset(records, transform=transform)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    per_epoch = len(sampler) // batch_size
    epoch, skip = divmod(start_step, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)  # this rank's shuffled indices for the epoch
        for b in range(skip, per_epoch):
            yield epoch, collate([dataset[i] for i in order[b * batch_size:(b + 1) * batch_size]])
        epoch, skip = epoch + 1, 0

# Synthetic chest X-ray set -------------------------------------------------------------------
# A sandbox, not a benchmark: images are drawn by draw_synthetic_cxr() (below) with one visible
# sign per finding, reports are written from templates with varied wording, negations and
# hedges, and the ground-truth labels are stored with every record.
# Positive prevalences roughly as the CheXpert labeler finds them on MIMIC-CXR.
SYNTHETIC_PREVALENCE = {
    "Support Devices": 0.29, "Pleural Effusion": 0.23, "Lung Opacity": 0.22, "Atelectasis": 0.20,
    "Cardiomegaly": 0.19, "Edema": 0.12, "Pneumonia": 0.07, "Consolidation": 0.05,
    "Pneumothorax": 0.045, "Enlarged Cardiomediastinum": 0.035, "Lung Lesion": 0.03,
    "Fracture": 0.02, "Pleural Other": 0.015,
}
SYNTHETIC_P_UNCERTAIN = 0.15  # of present findings, reported with a hedge (drawn fainter)
# Chance that an absent finding is mentioned as negative ("No pneumothorax."), else not mentioned.
SYNTHETIC_P_NEGATED = {
    "Pneumothorax": 0.7, "Pleural Effusion": 0.7, "Consolidation": 0.6, "Cardiomegaly": 0.6,
    "Edema": 0.4, "Enlarged Cardiomediastinum": 0.4, "Pneumonia": 0.25, "Lung Opacity": 0.2,
    "Fracture": 0.25, "Lung Lesion": 0.15, "Atelectasis": 0.1, "Pleural Other": 0.05, "Support Devices": 0.0,
}
SIDED = {"Lung Opacity", "Lung Lesion", "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax",
         "Pleural Effusion", "Pleural Other", "Fracture"}
BILATERAL_OK = {"Lung Opacity", "Atelectasis", "Pleural Effusion"}
GRADED = {"Pleural Effusion", "Pneumothorax", "Cardiomegaly"}
DEVICE_KINDS = ["endotracheal tube", "central venous catheter", "nasogastric tube", "pacemaker"]

# Templates. Fields: {side} left/right/bilateral, {sev} small/moderate/large, {deg} mild/moderate/
# severe, {degly} mildly/moderately/severely. One finding per positive or hedged sentence, so the
# labels follow from the sentence states; negations are also written as lists ("No A, B, or C.").
POSITIVE_TEMPLATES = {
    "Enlarged Cardiomediastinum": ["The mediastinum is widened.", "There is widening of the mediastinum.",
                                   "The cardiomediastinal silhouette is enlarged.", "Mediastinal widening is present."],
    "Cardiomegaly": ["The heart is {degly} enlarged.", "There is {deg} cardiomegaly.", "{Deg} cardiomegaly.",
                     "The cardiac silhouette is {degly} enlarged."],
    "Lung Opacity": ["There is a hazy opacity in the {side} lung.", "Hazy {side} lung opacity.",
                     "An ill-defined opacity projects over the {side} lung."],
    "Lung Lesion": ["There is a nodule in the {side} lung.", "A rounded {side} lung nodule is seen.",
                    "A {side} lung mass is present."],
    "Edema": ["There is mild pulmonary edema.", "Mild pulmonary edema.", "The lungs show interstitial edema."],
    "Consolidation": ["There is dense consolidation in the {side} lower lobe.", "Dense {side} lower lobe consolidation.",
                      "Consolidation is present in the {side} lung."],
    "Pneumonia": ["Patchy {side} lower lobe pneumonia.", "There is patchy pneumonia in the {side} lung.",
                  "Patchy airspace findings represent {side} pneumonia."],
    "Atelectasis": ["There is plate-like atelectasis at the {side} base.", "{Side} basilar atelectasis.",
                    "Linear atelectasis is seen at the {side} base."],
    "Pneumothorax": ["There is a {sev} {side} pneumothorax.", "{Sev} {side} apical pneumothorax.",
                     "A {sev} {side} pneumothorax is present."],
    "Pleural Effusion": ["There is a {sev} {side} pleural effusion.", "{Sev} {side} pleural effusion.",
                         "A {sev} {side} pleural effusion is present."],
    "Pleural Other": ["There is {side} pleural thickening.", "{Side} pleural thickening is noted."],
    "Fracture": ["There is a displaced {side} rib fracture.", "A {side} rib fracture is seen."],
    "Support Devices": {"endotracheal tube": ["An endotracheal tube is in standard position.",
                                              "The endotracheal tube terminates above the carina."],
                        "central venous catheter": ["A right internal jugular central venous catheter ends in the lower SVC.",
                                                    "A central venous catheter is in place."],
                        "nasogastric tube": ["A nasogastric tube courses below the diaphragm.",
                                             "The nasogastric tube ends in the stomach."],
                        "pacemaker": ["A left chest wall pacemaker is in place with leads in the right heart.",
                                      "A dual-lead pacemaker is present."]},
}
UNCERTAIN_TEMPLATES = {
    "Enlarged Cardiomediastinum": ["Possible mediastinal widening.", "The mediastinum may be widened."],
    "Cardiomegaly": ["Possible {deg} cardiomegaly.", "The heart is likely {degly} enlarged.",
                     "Borderline cardiomegaly."],
    "Lung Opacity": ["Possible faint opacity in the {side} lung.", "Questionable {side} lung opacity."],
    "Lung Lesion": ["Possible small nodule in the {side} lung.", "Questionable {side} lung nodule."],
    "Edema": ["Possible mild pulmonary edema.", "Mild pulmonary edema cannot be excluded."],
    "Consolidation": ["Possible {side} lower lobe consolidation.", "Subtle consolidation in the {side} lung cannot be excluded."],
    "Pneumonia": ["Findings are concerning for early {side} pneumonia.", "Possible {side} pneumonia.",
                  "Cannot exclude pneumonia in the {side} lung."],
    "Atelectasis": ["Probable {side} basilar atelectasis.", "Possible minimal atelectasis at the {side} base."],
    "Pneumothorax": ["Possible tiny {side} apical pneumothorax.", "A tiny {side} pneumothorax cannot be excluded."],
    "Pleural Effusion": ["Possible {sev} {side} pleural effusion.", "A trace {side} pleural effusion is not excluded."],
    "Pleural Other": ["Possible {side} pleural thickening."],
}
NEGATED_PHRASES = {  # the noun phrase used when a finding is listed as absent
    "Enlarged Cardiomediastinum": "mediastinal widening", "Lung Opacity": "focal opacity",
    "Lung Lesion": "suspicious pulmonary nodule", "Edema": "pulmonary edema", "Consolidation": "focal consolidation",
    "Pneumonia": "pneumonia", "Atelectasis": "atelectasis", "Pneumothorax": "pneumothorax",
    "Pleural Effusion": "pleural effusion", "Pleural Other": "pleural thickening", "Fracture": "acute rib fracture",
}
NEGATED_SINGLE = {  # findings that also have their own negative sentence
    "Cardiomegaly": ["Heart size is normal.", "The heart is not enlarged.", "Normal heart size.",
                     "The cardiac silhouette is within normal limits."],
    "Enlarged Cardiomediastinum": ["The mediastinal contours are normal.",
                                   "The cardiomediastinal silhouette is within normal limits."],
    "Pneumothorax": ["Pneumothorax is not seen.", "No pneumothorax is identified."],
    "Fracture": ["No displaced fracture is seen."],
}
NEGATED_LIST_TEMPLATES = ["No {list}.", "There is no {list}.", "No evidence of {list}."]
NORMAL_EXTRAS = ["No acute cardiopulmonary process.", "The lungs are clear.", "The osseous structures are unremarkable."]


def sample_synthetic_study(rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """Draw one study's finding states: {label: attrs} for present findings (attrs carry side,
    severity, device kind, uncertain) and the (14,) ground-truth label vector."""
    labels = np.full(len(CHEXPERT_LABELS), np.nan)
    findings = {}
    for name in FINDINGS:
        i = LABEL_INDEX[name]
        if rng.random() < SYNTHETIC_PREVALENCE[name]:
            attrs = {"uncertain": bool(name not in ("Support Devices", "Fracture") and rng.random() < SYNTHETIC_P_UNCERTAIN)}
            if name in SIDED:
                sides = ["left", "right"] + (["bilateral"] if name in BILATERAL_OK else [])
                attrs["side"] = str(rng.choice(sides))
            if name in GRADED:
                attrs["severity"] = str(rng.choice(["small", "moderate", "large"]))
            if name == "Support Devices":
                attrs["kind"] = str(rng.choice(DEVICE_KINDS))
            findings[name] = attrs
            labels[i] = UNCERTAIN if attrs["uncertain"] else POSITIVE
        elif rng.random() < SYNTHETIC_P_NEGATED[name]:
            labels[i] = NEGATIVE
    return findings, apply_no_finding_rule(labels)


def write_synthetic_report(findings: dict, labels: np.ndarray, rng: np.random.Generator) -> str:
    """Turn a study's states into a report in anatomical order: devices, heart and mediastinum,
    lungs, pleura, bones. Negated findings go into 'No A, B, or C.' sentences of 1-4 items."""
    sentences, negated = [], []
    for name in FINDINGS:
        state = labels[LABEL_INDEX[name]]
        if name in findings:
            a = findings[name]
            if name == "Support Devices":
                sentences.append(str(rng.choice(POSITIVE_TEMPLATES[name][a["kind"]])))
                continue
            deg, degly = {"small": ("mild", "mildly"), "moderate": ("moderate", "moderately"),
                          "large": ("severe", "severely")}[a.get("severity", "small")]
            fields = {"side": a.get("side", ""), "sev": a.get("severity", ""), "deg": deg, "degly": degly}
            fields.update({k.capitalize(): v.capitalize() for k, v in fields.items()})
            pool = UNCERTAIN_TEMPLATES[name] if a["uncertain"] else POSITIVE_TEMPLATES[name]
            text = str(rng.choice(pool)).format(**fields)
            sentences.append(text.replace("the bilateral lung", "both lungs").replace("the bilateral base", "both bases"))
        elif state == NEGATIVE:
            if name in NEGATED_SINGLE and (name not in NEGATED_PHRASES or rng.random() < 0.5):
                sentences.append(str(rng.choice(NEGATED_SINGLE[name])))
            else:
                negated.append(name)
    rng.shuffle(negated)
    while negated:
        k = int(rng.integers(1, 5))
        phrases = [NEGATED_PHRASES[n] for n in negated[:k]]
        negated = negated[k:]
        items = phrases[-1] if len(phrases) == 1 else \
            ", ".join(phrases[:-1]) + (", or " if len(phrases) > 2 else " or ") + phrases[-1]
        sentences.append(str(rng.choice(NEGATED_LIST_TEMPLATES)).format(list=items))
    if labels[LABEL_INDEX["No Finding"]] == 1 and (not sentences or rng.random() < 0.5):
        sentences.append(str(rng.choice(NORMAL_EXTRAS)))
    return " ".join(s[0].upper() + s[1:] for s in sentences)


# Drawing the synthetic radiograph: one visible sign per finding (DESIGN.md), numpy only.
_CXR_SIDES = {"right": (-1,), "left": (1,), "bilateral": (-1, 1)}  # patient's right = image left
_CXR_GRADE = {"small": 0, "moderate": 1, "large": 2}


def _cxr_ramp(d, edge):
    """Soft step of a signed distance d: 0 well below 0, 1 well above, linear over `edge`."""
    return np.clip(d / edge + 0.5, 0.0, 1.0)


def _cxr_radius(x, y, cx, cy, ax, ay):
    """Elliptic radius: < 1 inside the ellipse centred (cx, cy) with half-axes ax, ay."""
    return np.sqrt(((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2)


def _cxr_gauss(x, y, cx, cy, sx, sy):
    """Separable Gaussian bump with peak 1 (x is a row, y a column: an outer product)."""
    return np.exp(-0.5 * ((y - cy) / sy) ** 2) * np.exp(-0.5 * ((x - cx) / sx) ** 2)


def _cxr_blur(img, sigma):
    """Gaussian blur, sigma in pixels, as two matrix products (rows renormalised at the edges)."""
    i = np.arange(img.shape[0], dtype=np.float32)
    k = np.exp(-0.5 * ((i[:, None] - i[None, :]) / sigma) ** 2)
    k /= k.sum(1, keepdims=True)
    return k @ img @ k.T


def _cxr_bezier(points, n):
    """n points along the Bezier curve with the given control points, as an (n, 2) array."""
    t = np.linspace(0.0, 1.0, n)[:, None]
    k = len(points) - 1
    return sum(math.comb(k, i) * t ** i * (1 - t) ** (k - i) * np.asarray(p) for i, p in enumerate(points))


def draw_synthetic_cxr(findings: dict, rng: np.random.Generator, size: int = 128) -> np.ndarray:
    """A (size, size) uint8 chest-radiograph-like image (frontal view; patient's right on the
    image's left) with one visible sign per present finding of `findings` ({label: attrs}, as
    sample_synthetic_study returns). Hedged findings are drawn fainter and smaller. Every random
    choice comes from `rng`; the per-image variation is drawn first, so for one rng state adding a
    finding changes only the region of its sign."""
    U = lambda a, b: float(rng.uniform(a, b))  # noqa: E731  (python floats keep arrays float32)
    soft = {n: 0.6 if a.get("uncertain") else 1.0 for n, a in findings.items()}
    # Per-image variation: position, zoom, anatomy, exposure, noise.
    dx, dy, zoom = U(-0.03, 0.03), U(-0.03, 0.03), U(0.92, 1.04)
    t = np.arange(size, dtype=np.float32) / (size - 1) - 0.5
    x, y = ((t - dx) / zoom + 0.5)[None, :], ((t - dy) / zoom + 0.5)[:, None]  # anatomical coords
    px = 1.0 / (zoom * (size - 1))                      # one pixel in anatomical units
    lw = max(0.006, 0.8 * px)                           # sigma of thin lines, >= ~1 pixel
    lung_x, lung_y, lung_ax, lung_ay = U(0.19, 0.21), U(0.43, 0.45), U(0.145, 0.165), U(0.28, 0.32)
    heart_w, medi_w, rib_sp, rib_ph = U(0.14, 0.155), U(0.05, 0.06), U(0.07, 0.08), U(0.0, 1.0)
    gamma, contrast, bright, tilt = U(0.8, 1.25), U(0.85, 1.15), U(-0.06, 0.06), U(-0.1, 0.1)
    noise = U(0.01, 0.03) * rng.standard_normal((size, size), dtype=np.float32)
    tex = _cxr_blur(rng.standard_normal((size, size), dtype=np.float32), max(0.7, 0.01 / px))
    tex = np.maximum(tex / (tex.std() + 1e-6), 0)      # vessel-like lung markings

    # Normal anatomy: body outline with neck, two dark lung fields with markings and diaphragm domes.
    img = np.full((size, size), 0.03, np.float32)
    body = _cxr_ramp((1 - _cxr_radius(x, y, 0.5, 0.62, 0.47, 0.6)) * 0.47, 0.02)
    img += (0.5 - img) * np.maximum(body, _cxr_ramp(0.1 - np.abs(x - 0.5), 0.02) * (y < 0.3))
    L = {}
    for s in (-1, 1):
        cx, cy = 0.5 + s * lung_x, lung_y
        r = _cxr_radius(x, y, cx, cy, lung_ax, lung_ay)
        dome = cy + 0.8 * lung_ay - 0.07 * (1 - np.clip((x - cx) / lung_ax, -1, 1) ** 2) - 0.02 * (s < 0)  # right higher
        thorax = _cxr_ramp((1 - r) * lung_ax, 0.012)
        lung = thorax * _cxr_ramp(dome - y, 0.012)
        L[s] = dict(cx=cx, r=r, dome=dome, thorax=thorax, lung=lung)  # thorax: lung + costophrenic recess
        hilum = _cxr_gauss(x, y, 0.5 + s * 0.1, 0.46, 0.06, 0.08)
        img += (0.16 + 0.05 * tex * (0.4 + hilum) + 0.1 * hilum - img) * lung
    lungs = L[-1]["lung"] + L[1]["lung"]
    sides = lambda name: _CXR_SIDES[findings[name].get("side", "bilateral")]  # noqa: E731

    if "Lung Opacity" in findings:  # large faint hazy patch
        for s in sides("Lung Opacity"):
            sd = U(0.07, 0.1) * (0.85 + 0.15 * soft["Lung Opacity"])
            g = _cxr_gauss(x, y, L[s]["cx"] + s * U(-0.3, 0.3) * lung_ax, lung_y + U(-0.3, 0.3) * lung_ay, sd, sd * 1.3)
            img += 0.22 * soft["Lung Opacity"] * g * L[s]["lung"]
    if "Edema" in findings:  # bilateral perihilar haze, more markings, Kerley lines at the bases
        a = soft["Edema"]
        kerley = np.maximum(np.cos(2 * np.pi * y / 0.045), 0) ** 4 * _cxr_ramp(y - lung_y - 0.05, 0.05)
        for s in (-1, 1):
            lateral = _cxr_ramp(s * (x - L[s]["cx"]) - 0.45 * lung_ax, 0.02)
            haze = 0.16 * _cxr_gauss(x, y, 0.5 + s * 0.12, lung_y + 0.05, 0.08, 0.12) + 0.06 * tex
            img += a * (haze + 0.12 * kerley * lateral) * L[s]["lung"]
    if "Consolidation" in findings:  # dense homogeneous lower-zone area with air bronchograms
        s, a = sides("Consolidation")[0], soft["Consolidation"]
        cx, cy = L[s]["cx"] + s * U(0.0, 0.2) * lung_ax, lung_y + U(0.3, 0.4) * lung_ay
        area = _cxr_ramp((1 - _cxr_radius(x, y, cx, cy, 0.8 * lung_ax, 0.27 * lung_ay)) * 0.08, 0.006) * L[s]["lung"]
        img += (0.68 - img) * area * 0.9 * a
        for angle in (U(0.3, 0.6), U(0.9, 1.2)):  # two dark air-filled bronchi, fanning out laterally
            d = np.abs((x - L[s]["cx"] + s * 0.5 * lung_ax) * np.sin(angle) - (y - cy + 0.05) * s * np.cos(angle))
            img -= 0.2 * a * np.exp(-0.5 * (d / lw) ** 2) * area
    if "Pneumonia" in findings:  # patchy mottled blotches, mid and lower zone
        s, a = sides("Pneumonia")[0], soft["Pneumonia"]
        patches = sum(U(0.15, 0.3) * _cxr_gauss(
            x, y, L[s]["cx"] + s * U(-0.6, 0.7) * lung_ax, lung_y + U(-0.2, 0.6) * lung_ay, sd, sd)
            for sd in (U(0.016, 0.028) * (0.7 + 0.3 * a) for _ in range(10)))
        img += a * patches * (0.6 + 0.4 * tex) * L[s]["lung"]
    if "Lung Lesion" in findings:  # small round sharp-edged bright nodule
        s, a = sides("Lung Lesion")[0], soft["Lung Lesion"]
        rad = 0.04 * (0.75 + 0.25 * a)
        cx, cy = L[s]["cx"] + s * U(-0.4, 0.6) * lung_ax, lung_y + U(-0.6, 0.4) * lung_ay
        img += 0.35 * (0.5 + 0.5 * a) * _cxr_ramp(rad - np.sqrt((x - cx) ** 2 + (y - cy) ** 2), 0.01)
    if "Atelectasis" in findings:  # thin horizontal plate-like line above the dome
        for s in sides("Atelectasis"):
            xc, half = L[s]["cx"] + s * U(-0.2, 0.3) * lung_ax, U(0.07, 0.1) * (0.7 + 0.3 * soft["Atelectasis"])
            d = y - (lung_y + 0.8 * lung_ay - 0.07 - U(0.05, 0.09) + U(-0.15, 0.15) * (x - xc))
            plate = np.exp(-0.5 * (d / (1.3 * lw)) ** 2) * _cxr_ramp(half - np.abs(x - xc), 0.02)
            img += 0.35 * soft["Atelectasis"] * plate * L[s]["lung"]
    if "Pneumothorax" in findings:  # dark apex and lateral rim without markings, pleural line
        s, a = sides("Pneumothorax")[0], soft["Pneumothorax"]
        c = 0.15 if a < 1 else (0.2, 0.32, 0.45)[_CXR_GRADE[findings["Pneumothorax"]["severity"]]]  # hedged: tiny
        ax, ay = lung_ax * (1 - 0.5 * c), lung_ay * (1 - 0.7 * c)  # the collapsed lung, shrunk to the hilum
        ri = _cxr_radius(x, y, L[s]["cx"] - s * 0.5 * c * lung_ax, lung_y + 0.7 * c * lung_ay, ax, ay)
        img += (0.05 - img) * _cxr_ramp((ri - 1) * ax, 0.006) * L[s]["lung"] * (0.5 + 0.5 * a)
        inside = _cxr_ramp((1 - L[s]["r"]) * lung_ax - 0.015, 0.01) * _cxr_ramp(L[s]["dome"] - y - 0.015, 0.01)
        img += 0.3 * np.exp(-0.5 * ((ri - 1) * ax / lw) ** 2) * inside  # the visceral pleural line

    # Ribs: faint curved lines descending laterally; a fracture breaks one with a displaced fragment.
    u = (y - 0.14 * (np.abs(x - 0.5) / 0.35) ** 2) / rib_sp + rib_ph  # integer u = centre of a rib
    rib_w = max(0.011, lw)
    ribs = np.exp(-0.5 * ((u - np.rint(u)) * rib_sp / rib_w) ** 2)
    if "Fracture" in findings:  # rib k: a gap, a displaced bright lateral fragment, callus at the step
        s = sides("Fracture")[0]
        xf, yf = L[s]["cx"] + s * U(0.25, 0.55) * lung_ax, lung_y + U(-0.4, 0.3) * lung_ay
        k = float(np.rint((yf - 0.14 * (abs(xf - 0.5) / 0.35) ** 2) / rib_sp + rib_ph))
        rib_k = np.exp(-0.5 * ((u - k) * rib_sp / rib_w) ** 2)
        frag = _cxr_ramp(s * (x - xf), 2 * px) * _cxr_ramp(0.1 - s * (x - xf), 0.02)
        ribs += frag * (2.5 * np.exp(-0.5 * ((u - k - 0.4) * rib_sp / rib_w) ** 2) - rib_k)
        ribs = np.maximum(ribs - rib_k * np.exp(-0.5 * ((x - xf) / (2 * lw)) ** 2), 0)  # the gap
        yk = (k - rib_ph) * rib_sp + 0.14 * (abs(xf - 0.5) / 0.35) ** 2
        ribs += 3.0 * _cxr_gauss(x, y, xf, yk + 0.2 * rib_sp, 0.016, 0.016)
    chest = np.maximum(L[-1]["thorax"], L[1]["thorax"]) * _cxr_ramp(y - 0.08, 0.03)
    img += 0.1 * ribs * (0.4 + 0.6 * np.minimum(lungs, 1)) * chest
    mid = np.abs(x - 0.5)  # clavicles, rising laterally
    img += 0.12 * np.exp(-0.5 * ((y - 0.16 + 0.2 * (mid - 0.04)) / 0.012) ** 2) * _cxr_ramp(0.13 - np.abs(mid - 0.17), 0.02)

    # Mediastinum (widened upper part if Enlarged Cardiomediastinum), trachea, spine, heart.
    wide = 0.05 * soft.get("Enlarged Cardiomediastinum", 0) * np.exp(-0.5 * ((y - 0.3) / 0.1) ** 2)
    medi = _cxr_ramp(medi_w + wide - np.abs(x - 0.5), 0.01) * _cxr_ramp(y - 0.08, 0.03) * _cxr_ramp(0.62 - y, 0.04)
    img += (0.72 - img) * medi
    img += (0.35 - img) * _cxr_ramp(0.014 - np.abs(x - 0.5), 0.008) * _cxr_ramp(0.36 - y, 0.02) * 0.7
    img += 0.05 * _cxr_ramp(0.035 - np.abs(x - 0.5), 0.01) * body
    if "Cardiomegaly" in findings:  # wider heart shadow, graded
        grow = (0.25, 0.38, 0.52)[_CXR_GRADE[findings["Cardiomegaly"]["severity"]]]
        heart_w *= 1 + grow * (0.55 + 0.45 * soft["Cardiomegaly"])
    heart = _cxr_ramp((1 - _cxr_radius(x, y, 0.5 + 0.3 * heart_w, 0.6, heart_w, 0.12)) * heart_w, 0.01)
    img += (0.72 - img) * heart

    if "Pleural Effusion" in findings:  # fluid at the base, meniscus rising laterally, angle blunted
        for s in sides("Pleural Effusion"):
            h = (0.08, 0.15, 0.25)[_CXR_GRADE[findings["Pleural Effusion"]["severity"]]]
            h *= 0.7 + 0.3 * soft["Pleural Effusion"]
            lateral = np.clip(s * (x - L[s]["cx"]) / lung_ax, 0, 1)
            top = lung_y + 0.8 * lung_ay - h - 0.07 * lateral ** 2
            fluid = _cxr_ramp(y - top, 0.025) * _cxr_ramp(L[s]["dome"] + 0.03 - y, 0.03) * L[s]["thorax"]
            img = np.maximum(img, img + (0.62 + 0.08 * _cxr_ramp(y - top - 0.05, 0.1) - img) * fluid)  # only brighter
    if "Pleural Other" in findings:  # lobulated thickened band along the lateral chest wall
        s, a = sides("Pleural Other")[0], soft["Pleural Other"]
        th = (0.03 + 0.012 * a) * (1 + 0.35 * np.sin(y * 45 + U(0, 6.3))) / lung_ax
        band = _cxr_ramp(L[s]["r"] - 1 + th, 0.05) * L[s]["thorax"]
        band *= _cxr_ramp(s * (x - L[s]["cx"]) - 0.3 * lung_ax, 0.03)  # lateral wall only, mid zones
        band *= _cxr_ramp(y - lung_y + 0.55 * lung_ay, 0.05) * _cxr_ramp(lung_y + 0.45 * lung_ay - y, 0.05)
        img += (0.68 - img) * band * (0.6 + 0.4 * a)

    if "Support Devices" in findings:  # thin very bright tubes and lines, per kind
        j = lambda: U(-0.015, 0.015)  # noqa: E731
        kind = findings["Support Devices"]["kind"]
        curves = {  # Bezier control points (x, y): ETT in the trachea above the carina, CVC from the right
            # neck to the SVC, NGT down the midline to the stomach below the left dome, pacemaker leads to RA, RV
            "endotracheal tube": [[(0.5 + j(), -0.02), (0.5 + j(), 0.12), (0.5, 0.27 + j())]],
            "central venous catheter": [[(0.35 + j(), -0.02), (0.42 + j(), 0.14), (0.47, 0.2 + j()), (0.47 + j(), 0.42)]],
            "nasogastric tube": [[(0.49 + j(), -0.02), (0.49, 0.5), (0.5 + j(), 0.85), (0.66 + j(), 0.8 + j())]],
            "pacemaker": [[(0.7, 0.21), (0.6 + j(), 0.2), (0.42 + j(), 0.4), (0.45 + j(), 0.52)],
                          [(0.7, 0.21), (0.58 + j(), 0.25), (0.44 + j(), 0.5), (0.54 + j(), 0.7 + j())]]}[kind]
        lines = np.zeros((size, size), np.float32)  # 1-pixel curves, then blurred to tube width
        for c in curves:
            p = _cxr_bezier(c, 3 * size)
            col = np.rint(((p[:, 0] - 0.5) * zoom + 0.5 + dx) * (size - 1)).astype(int)
            row = np.rint(((p[:, 1] - 0.5) * zoom + 0.5 + dy) * (size - 1)).astype(int)
            ok = (col >= 0) & (col < size) & (row >= 0) & (row < size)
            lines[row[ok], col[ok]] = 1.0
        sig = max(0.6, 0.008 / px)
        img += (0.97 - img) * np.clip(_cxr_blur(lines, sig) * 2.5 * sig, 0, 1)  # 2.5 ~ sqrt(2 pi): peak 1
        if kind == "pacemaker":  # the generator box on the left upper chest
            bx, by = 0.72 + j(), 0.2 + j()
            img += (1.0 - img) * _cxr_ramp(0.045 - np.abs(x - bx), 0.01) * _cxr_ramp(0.03 - np.abs(y - by), 0.01)

    # Exposure: lateral gradient, gamma, contrast, brightness, then quantum noise.
    img = np.clip(img * (1 + tilt * (x - 0.5)), 0, 1) ** gamma
    img = (img - 0.5) * contrast + 0.5 + bright + noise
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def make_synthetic(out_dir, n_train: int = 2000, n_val: int = 200, n_test: int = 500,
                   size: int = 128, seed: int = 0) -> Path:
    """Write a synthetic chest X-ray set in R2Gen's layout: out_dir/images/<id>.png and
    out_dir/annotation.json ({"train": [{"id", "report", "image_path", "split", "labels",
    "findings"}], "val": [...], "test": [...]}). Deterministic from `seed`. Returns out_dir."""
    from PIL import Image
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    annotation = {}
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        annotation[split] = []
        for k in range(n):
            study_id = f"{split}_{k:05d}"
            findings, labels = sample_synthetic_study(rng)
            report = write_synthetic_report(findings, labels, rng)
            image = draw_synthetic_cxr(findings, rng, size)
            Image.fromarray(image).save(out_dir / "images" / f"{study_id}.png")
            annotation[split].append({
                "id": study_id, "report": report, "image_path": [f"{study_id}.png"], "split": split,
                "labels": [None if np.isnan(v) else v for v in labels.tolist()], "findings": findings})
    (out_dir / "annotation.json").write_text(json.dumps(annotation, indent=1))
    return out_dir


def cache_dir() -> Path:
    """Where `--data synthetic` keeps its files: $RRG_CACHE, else ~/.cache/rrg-from-scratch."""
    return Path(os.environ.get("RRG_CACHE", Path.home() / ".cache" / "rrg-from-scratch"))


def synthetic_data(n_train: int = 2000, n_val: int = 200, n_test: int = 500, size: int = 128, seed: int = 0) -> Path:
    """The synthetic set's annotation.json, made once in the cache folder. Built in a temporary
    folder and renamed into place, so several torchrun processes can ask at the same time."""
    final = cache_dir() / f"synthetic-v1-{n_train}-{n_val}-{n_test}-{size}px-seed{seed}"
    if not (final / "annotation.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
        make_synthetic(tmp, n_train, n_val, n_test, size, seed)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: its copy is identical (same seed)
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "annotation.json"


def load_data(data: str, image_root=None, **kwargs) -> dict[str, list[Record]]:
    """`--data` of every script: 'synthetic' or a path to an annotation file (or its folder)."""
    if data == "synthetic":
        return load_annotation(synthetic_data(), **kwargs)
    path = Path(data)
    if path.is_dir():
        path = path / "annotation.json"
    return load_annotation(path, image_root=image_root, **kwargs)


# ---------------------------------------------------------------------------------------------
# 3. Labelers
# ---------------------------------------------------------------------------------------------
def _words(*phrases: str) -> str:
    return r"\b(?:" + "|".join(phrases) + r")\b"


# A gap inside one mention (e.g. "heart ... enlarged"): stays within the clause.
_GAP = r"(?:(?!\bbut\b|\bhowever\b)[^.;,])"
_HEART = r"(?:heart(?: size)?|cardiac (?:silhouette|size|contour|contours|shadow))"
_MEDIASTINUM = r"(?:cardiomediastinal (?:silhouette|contours?)|mediastinal (?:contours?|silhouette)|mediastinum)"
_NORMAL = r"(?:normal|within normal limits|unremarkable)"


class RuleLabeler:
    """CheXpert-style rule labeler (Irvin et al. 2019), written here: mention phrases per
    observation, negation and uncertainty cues scoped to the clause, CheXpert's aggregation and
    No Finding rule. Offline default labeler: fast and deterministic, but only as good as its
    phrase lists (the CheXbert labeler is the one papers report).

    Mention -> state, in CheXpert's order: a pre-negation uncertainty cue ("cannot exclude") in
    reach -> uncertain; else a negation cue -> negative; else an uncertainty cue -> uncertain;
    else positive. Per report: any positive -> 1, else any uncertain -> -1, else any negative
    -> 0, else blank ({0,-1} -> -1, {0,1} -> 1, {-1,1} -> 1).
    """

    # Mention phrases. Organ words only count with their qualifier ("heart ... enlarged",
    # "heart size is normal"): the span covers both, so a cue between them ("the heart is not
    # enlarged", "is likely enlarged") applies.
    MENTIONS = {
        "Enlarged Cardiomediastinum": [
            _words("mediastinal widening", r"widen(?:ed|ing) (?:of the )?(?:superior )?mediastinum",
                   r"enlarged cardiomediastinum", r"enlarged cardiomediastinal silhouette"),
            _MEDIASTINUM + _GAP + r"{0,30}?" + _words(r"widened", r"enlarged", _NORMAL),
            _words("normal") + " " + _MEDIASTINUM],
        "Cardiomegaly": [
            _words("cardiomegaly", r"cardiac enlargement", r"enlarged (?:heart|cardiac silhouette)",
                   r"enlargement of the (?:heart|cardiac silhouette)"),
            r"\b" + _HEART + r"\b" + _GAP + r"{0,30}?" + _words(r"enlarged", r"increased", _NORMAL),
            _words("normal") + " " + _HEART + r"\b"],
        "Lung Opacity": [_words(r"opacit(?:y|ies)", r"opacification", r"opacified", r"infiltrat(?:e|es|ion)",
                                r"haziness", r"hazy", r"air ?space (?:disease|process)", r"ground[- ]glass")],
        "Lung Lesion": [_words(r"nodul(?:e|es|ar)", r"mass(?:es)?", r"lesions?", r"tumou?r", r"neoplasm",
                               r"carcinoma", r"lump")],
        "Edema": [_words(r"edema", r"(?:pulmonary|vascular) congestion", r"congestive heart failure", r"chf",
                         r"fluid overload", r"vascular engorgement")],
        "Consolidation": [_words(r"consolidat(?:ion|ions|ive|ed)")],
        "Pneumonia": [_words(r"pneumonias?", r"bronchopneumonia", r"infection", r"infectious(?: process)?",
                             r"aspiration")],
        "Atelectasis": [_words(r"atelecta(?:sis|ses|tic)", r"collapse")],
        "Pneumothorax": [_words(r"(?:hydro)?pneumothora(?:x|ces)", r"ptx")],
        "Pleural Effusion": [
            r"(?<!pericardial )" + _words(r"(?:pleural )?effusions?", r"pleural fluid", r"hydrothorax"),
            _words(r"blunt(?:ing|ed) (?:of )?(?:the )?(?:\w+ )?costophrenic angles?", r"costophrenic angle blunting")],
        "Pleural Other": [_words(r"pleural (?:thickening|plaques?|scarring|calcifications?)", r"fibrothorax")],
        "Fracture": [_words(r"fractur(?:e|es|ed)")],
        "Support Devices": [_words(
            r"endotracheal tube", r"et tube", r"ett", r"tracheostomy(?: tube)?", r"(?:naso|oro)gastric tube",
            r"ng tube", r"og tube", r"enteric tube", r"feeding tube", r"dobhoff(?: tube)?", r"chest tubes?",
            r"(?:central venous |central |pigtail |swan-ganz |pulmonary artery )?catheters?", r"central (?:venous )?line",
            r"picc(?: line)?", r"port-a-cath", r"portacath", r"mediport", r"pacemaker", r"pacer", r"icd",
            r"defibrillator", r"pacing leads?", r"sternotomy wires", r"intra-aortic balloon pump", r"iabp",
            r"stents?", r"drains?", r"prosthetic valve", r"valve replacement", r"lvad")],
    }

    # Cues: (pattern, kind, direction, reach in characters between cue and mention).
    # kind: "pre_neg_unc" (uncertain although it contains a negation), "neg", "unc".
    # direction: "pre" applies to mentions after the cue, "post" to mentions before it.
    # Any cue inside a mention's span applies whatever its direction.
    CLAUSE = 1000  # reach to the end of the clause
    CUES = [
        (r"can ?not (?:be )?(?:entirely |completely )?(?:excluded|exclude|ruled out|rule out)"
         r"|can't (?:be )?(?:excluded|exclude|ruled out|rule out)|not (?:be )?(?:entirely |completely )?"
         r"(?:excluded|ruled out)|difficult to (?:exclude|rule out)", "pre_neg_unc", "both", CLAUSE),
        (r"no longer|has resolved|have resolved|resolved|(?:has|have) been removed|removed|is absent|are absent"
         r"|not (?:seen|identified|present|appreciated|visualized|demonstrated|evident|detected|enlarged|widened)",
         "neg", "post", 40),
        (r"no evidence of|no signs? of|negative for|free of|clear of|absence of|resolution of|removal of"
         r"|rather than|without|no|not|nor|neither|never", "neg", "pre", CLAUSE),
        (r"normal|within normal limits|unremarkable", "neg", "both", 0),  # only inside "heart size is normal"
        (r"versus|vs\.?|\?", "unc", "both", CLAUSE),
        (r"is possible|are possible|is suspected|are suspected|is likely|are likely|is questioned|may be present"
         r"|is not excluded|are not excluded", "unc", "post", 30),
        (r"possible|possibly|probable|probably|likely|may|might|could|questionable|question of|suspicious for"
         r"|suspected|suspect|concerning for|concern for|worrisome for|suggestive of|suggests?|differential"
         r"|consider(?:ed)?|borderline|equivocal|presumed|presumably|indeterminate|evaluate for|evaluation for"
         r"|assess for|rule out|r/o", "unc", "pre", CLAUSE),
    ]
    # Clause ends: a negation "No effusion, but a small pneumothorax" stops at "but".
    TERMINATORS = (r"\b(?:but|however|although|though|whereas|while|except|apart from|aside from|other than"
                   r"|which|with the exception of|yet)\b|,\s*(?:and )?there (?:is|are)\b")
    SENTENCE_ENDS = r"\.(?!\d)|;|\n"

    def __init__(self):
        self.mentions = [(LABEL_INDEX[name], re.compile("|".join(f"(?:{p})" for p in pats)))
                         for name, pats in self.MENTIONS.items()]
        # One pass over the text finds every cue; group i+1 is CUES[i].
        self.cues = re.compile("|".join(rf"(?<!\w)({p})(?!\w)" if p != r"versus|vs\.?|\?" else f"({p})"
                                        for p, *_ in self.CUES))
        self.boundaries = re.compile(f"{self.SENTENCE_ENDS}|{self.TERMINATORS}")

    def label_one(self, report: str) -> np.ndarray:
        labels = np.full(len(CHEXPERT_LABELS), np.nan)
        text = report.lower()
        if not text.strip():
            # Nothing said: every label blank, No Finding included (our choice; CheXpert's rule
            # would call an empty report "No Finding" and reward empty generations).
            return labels
        bounds = [0] + [m.start() for m in self.boundaries.finditer(text)] + [len(text)]
        bounds_end = [0] + [m.end() for m in self.boundaries.finditer(text)] + [len(text)]
        cues = [(m.start(), m.end(), self.CUES[m.lastindex - 1]) for m in self.cues.finditer(text)]
        states: dict[int, set] = {}
        for idx, pattern in self.mentions:
            for m in pattern.finditer(text):
                start, end = m.start(), m.end()
                # the clause around the mention: last boundary before it, first after it
                lo = max(b for b in bounds_end if b <= start)
                hi = min(b for b in bounds if b >= end)
                states.setdefault(idx, set()).add(self._state(start, end, lo, hi, cues))
        for idx, found in states.items():
            labels[idx] = 1.0 if 1.0 in found else -1.0 if -1.0 in found else 0.0
        return apply_no_finding_rule(labels)

    @staticmethod
    def _state(start, end, lo, hi, cues) -> float:
        applies = {"pre_neg_unc": False, "neg": False, "unc": False}
        for c_start, c_end, (_, kind, direction, reach) in cues:
            if c_start >= start and c_end <= end:
                applies[kind] = True  # inside the mention's own span
            elif lo <= c_start and c_end <= start and direction in ("pre", "both") and start - c_end <= reach:
                applies[kind] = True
            elif end <= c_start and c_end <= hi and direction in ("post", "both") and c_start - end <= reach:
                applies[kind] = True
        if applies["pre_neg_unc"]:
            return UNCERTAIN
        if applies["neg"]:
            return NEGATIVE
        return UNCERTAIN if applies["unc"] else POSITIVE

    def __call__(self, reports: list[str]) -> np.ndarray:
        """Label reports -> float (N, 14), 1 / 0 / -1 / NaN, CHEXPERT_LABELS order."""
        if isinstance(reports, str):
            raise TypeError("RuleLabeler takes a list of reports, not one string")
        out = np.full((len(reports), len(CHEXPERT_LABELS)), np.nan)
        for i, r in enumerate(reports):
            out[i] = self.label_one(r)
        return out


# CheXbert (Smit et al. 2020, https://arxiv.org/abs/2004.09167): BERT-base with one linear head
# per observation over the [CLS] state; 13 heads of 4 classes (0 blank, 1 positive, 2 negative,
# 3 uncertain) and a No Finding head of 2 (0 blank, 1 positive). Mapped as CheXbert's label.py:
CHEXBERT_CLASS_VALUES = (np.nan, POSITIVE, NEGATIVE, UNCERTAIN)
CHEXBERT_MAX_PIECES = 512  # including [CLS] and [SEP]: longer reports keep their first 510 pieces
CHEXBERT_REPO, CHEXBERT_FILE = "StanfordAIMI/RRG_scorers", "chexbert.pth"


def chexbert_model(config=None):
    """f1chexbert's `bert_labeler` (its layout and forward) with the BERT built from a config.
    Its own __init__ fetches bert-base-uncased from the Hub even when real weights follow, so we
    set the same three attributes here; the default config is bert-base-uncased's shape."""
    import warnings
    with warnings.catch_warnings():  # importing f1chexbert calls warnings.filterwarnings("ignore")
        from f1chexbert.f1chexbert import bert_labeler
    from transformers import BertConfig, BertModel
    config = config or BertConfig()  # bert-base-uncased: 30522 word pieces, 768 hidden, 12 layers

    class CheXbertModel(bert_labeler):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.bert = BertModel(config)
            self.dropout = torch.nn.Dropout(0.1)
            heads = [torch.nn.Linear(config.hidden_size, 4) for _ in range(13)]
            self.linear_heads = torch.nn.ModuleList(heads + [torch.nn.Linear(config.hidden_size, 2)])

    return CheXbertModel()


def download_chexbert_weights() -> str:
    """chexbert.pth from the Hub with today's huggingface_hub (f1chexbert 0.0.2 passes the
    removed `force_filename` argument, so its own download never arrives). Cached by the Hub."""
    from huggingface_hub import hf_hub_download
    return hf_hub_download(repo_id=CHEXBERT_REPO, filename=CHEXBERT_FILE)


def load_chexbert_weights(model, path):
    """Load a CheXbert checkpoint ({"model_state_dict": {"module.<name>": tensor}}, saved from
    DataParallel) strictly: a mismatch is an error, not the silent strict=False of f1chexbert."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CheXbert weights not found: {path} (--chexbert-weights PATH, or leave it out "
                                f"to download {CHEXBERT_FILE} from {CHEXBERT_REPO})")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = checkpoint.get("model_state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a CheXbert checkpoint (expected a dict with 'model_state_dict')")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    # Old transformers saved position_ids as a buffer; today it is rebuilt, not loaded.
    if "bert.embeddings.position_ids" not in model.state_dict():
        state.pop("bert.embeddings.position_ids", None)
    missing, unexpected = sorted(set(model.state_dict()) - set(state)), sorted(set(state) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{path}: does not match CheXbert's model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
                         f", unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # same names, other shapes
        raise ValueError(f"{path}: does not match CheXbert's model: {str(e).splitlines()[-1].strip()}") from None
    return model


class CheXbertLabeler:
    """CheXbert labels for reports, in batches: same output as RuleLabeler, float (N, 14) with
    1 / 0 / -1 / NaN. Reports are sorted by length and padded per batch (f1chexbert labels one
    report at a time: label_one_by_one, kept for comparison). `model` / `tokenizer` let tests
    pass a tiny random BERT; by default the real weights (local `weights` path or the Hub) and
    bert-base-uncased's word pieces are used."""

    def __init__(self, weights=None, device="cpu", batch_size: int = 32, tokenizer=None, model=None):
        from transformers import BertTokenizerFast
        if model is None:
            model = load_chexbert_weights(chexbert_model(), weights or download_chexbert_weights())
        self.tokenizer = tokenizer or BertTokenizerFast.from_pretrained("bert-base-uncased")
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.device, self.batch_size = torch.device(device), batch_size

    def encode(self, report: str) -> list[int] | None:
        """[CLS] pieces [SEP], cut to 512 as CheXbert does; None for an empty report. BERT's
        tokenizer splits on any whitespace, so CheXbert's newline/space clean-up changes nothing."""
        if not report.strip():
            return None
        ids = self.tokenizer(report, add_special_tokens=True)["input_ids"]
        return ids if len(ids) <= CHEXBERT_MAX_PIECES else ids[:CHEXBERT_MAX_PIECES - 1] + [self.tokenizer.sep_token_id]

    def _pad(self, seqs: list[list[int]]):
        """Right-pad to the longest -> ids (B, L), attention mask (B, L) on the device."""
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        return ids.to(self.device), mask.to(self.device)

    def _heads(self, hidden):
        """[CLS] state (B, H) -> the 14 heads' logits, a list of (B, 4) x 13 and (B, 2)."""
        cls = self.model.dropout(hidden[:, 0])
        return [head(cls) for head in self.model.linear_heads]

    @staticmethod
    def _classes_to_labels(classes: np.ndarray) -> np.ndarray:
        """argmax classes (B, 14) -> labels (B, 14): 0 blank -> NaN, 1 -> 1, 2 -> 0, 3 -> -1."""
        return np.asarray(CHEXBERT_CLASS_VALUES)[classes]

    @torch.inference_mode()
    def _label_encoded(self, seqs: list[list[int]]) -> np.ndarray:
        ids, mask = self._pad(seqs)
        # the reward runs inside the policy's bf16 autocast: labels must not depend on it
        with torch.autocast(ids.device.type, enabled=False):
            logits = self.model(ids, mask)  # f1chexbert's forward: 14 tensors (B, C)
        classes = torch.stack([lg.argmax(dim=1) for lg in logits], dim=1)  # (B, 14)
        return self._classes_to_labels(classes.cpu().numpy())

    def __call__(self, reports: list[str]) -> np.ndarray:
        if isinstance(reports, str):
            raise TypeError("CheXbertLabeler takes a list of reports, not one string")
        out = np.full((len(reports), len(CHEXPERT_LABELS)), np.nan)  # empty reports stay blank
        encoded = [(i, s) for i, s in enumerate(map(self.encode, reports)) if s is not None]
        encoded.sort(key=lambda x: len(x[1]))  # similar lengths share a batch: little padding
        for b in range(0, len(encoded), self.batch_size):
            chunk = encoded[b:b + self.batch_size]
            out[[i for i, _ in chunk]] = self._label_encoded([s for _, s in chunk])
        return out

    def label_one_by_one(self, reports: list[str]) -> np.ndarray:
        """f1chexbert's way, one forward per report: the reference for the batched path."""
        out = np.full((len(reports), len(CHEXPERT_LABELS)), np.nan)
        for i, r in enumerate(reports):
            s = self.encode(r)
            if s is not None:
                out[i] = self._label_encoded([s])[0]
        return out

    def saliency(self, reports: list[str], target_labels: list[str]) -> list[dict]:
        """Per report {"tokens", "offsets", "saliency"}: for each word piece (no [CLS]/[SEP]),
        the L2 norm over the hidden size of d(sum over the target labels of the positive and
        uncertain logits) / d(input word embedding); offsets are (start, end) characters in the
        report. No Finding has no uncertain class: its positive logit only. (DEER's token weights.)"""
        unknown = [t for t in target_labels if t not in LABEL_INDEX]
        if unknown:
            raise ValueError(f"unknown labels {unknown}; valid: {CHEXPERT_LABELS}")
        heads = [LABEL_INDEX[t] for t in target_labels]
        results = []
        for b in range(0, len(reports), self.batch_size):
            results += self._saliency_batch(reports[b:b + self.batch_size], heads)
        return results

    def _saliency_batch(self, reports: list[str], heads: list[int]) -> list[dict]:
        enc = [self.tokenizer(r, add_special_tokens=False, return_offsets_mapping=True) for r in reports]
        keep = CHEXBERT_MAX_PIECES - 2
        pieces = [e["input_ids"][:keep] for e in enc]
        out = [{"tokens": self.tokenizer.convert_ids_to_tokens(p), "offsets": [tuple(o) for o in e["offset_mapping"][:keep]],
                "saliency": np.zeros(len(p), dtype=np.float32)} for p, e in zip(pieces, enc)]
        rows = [i for i, p in enumerate(pieces) if p]
        if not rows:
            return out
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        ids, mask = self._pad([[cls_id] + pieces[i] + [sep_id] for i in rows])  # (B, L)
        with torch.enable_grad(), torch.autocast(ids.device.type, enabled=False):
            embeds = self.model.bert.embeddings.word_embeddings(ids).detach().requires_grad_(True)  # (B, L, H)
            hidden = self.model.bert(inputs_embeds=embeds, attention_mask=mask)[0]  # (B, L, H)
            logits = self._heads(hidden)
            # positive (class 1) + uncertain (class 3) logits of the target labels; reports are
            # independent under the attention mask, so one backward serves the batch
            score = sum(logits[h][:, 1] + (logits[h][:, 3] if h < 13 else 0) for h in heads)  # (B,)
            (grad,) = torch.autograd.grad(score.sum(), embeds)  # (B, L, H)
        norms = grad.norm(dim=-1).float().cpu().numpy()  # (B, L)
        for k, i in enumerate(rows):
            out[i]["saliency"] = norms[k, 1:1 + len(pieces[i])]
        return out


# ---------------------------------------------------------------------------------------------
# 4. Metrics: NLG (BLEU, METEOR, ROUGE-L, CIDEr-D) and CE (label precision/recall/F1)
# ---------------------------------------------------------------------------------------------
# BLEU, ROUGE-L and CIDEr-D are written here and equal pycocoevalcap 1.2 (bleu/bleu_scorer.py,
# rouge/rouge.py, cider/cider_scorer.py) to 1e-9, corpus and per sample (tests/test_metrics.py).
# We rewrite them because RL rewards score thousands of pairs per step and pycocoevalcap's
# pure-Python O(m*n) LCS dominates its time. METEOR is the Java 1.5 jar through pycocoevalcap:
# no Python port matches it, so we never report an approximation under its name.
NGRAM_N = 4  # BLEU-4 and CIDEr-D both use 1..4-grams
ROUGE_BETA = 1.2  # pycocoevalcap rouge.py: Rouge.beta, recall weighted 1.2x
CIDER_SIGMA = 6.0  # pycocoevalcap cider.py: Cider(sigma=6.0), the "-D" length penalty


def _ngram_counts(tokens: list[str], n: int = NGRAM_N) -> list[Counter]:
    """counts[k - 1] = Counter of the k-grams of `tokens` (unigrams as plain strings, longer
    n-grams as tuples). Mirrors precook() in both bleu_scorer.py and cider_scorer.py (we build
    it once per text and share it between BLEU and CIDEr; pycocoevalcap builds it twice)."""
    # zip of k shifted views yields every k-gram without a per-token Python loop
    return [Counter(tokens)] + [Counter(zip(*(tokens[i:] for i in range(k)))) for k in range(2, n + 1)]


def _check_pairs(hyps, refs) -> list[list[str]]:
    """Validate the inputs and return refs as a list of reference lists."""
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError("hyps and refs must be lists of strings, not a single string")
    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses but {len(refs)} references")
    if len(hyps) == 0:
        # A corpus score of nothing is undefined; returning 0 would hide an empty split.
        raise ValueError("nlg_metrics needs at least one (hypothesis, reference) pair")
    ref_lists = []
    for i, (h, r) in enumerate(zip(hyps, refs)):
        r = [r] if isinstance(r, str) else list(r)
        if not isinstance(h, str) or not r or not all(isinstance(x, str) for x in r):
            raise TypeError(f"pair {i}: need a str hypothesis and a str or non-empty list "
                            f"of str references, got {type(h).__name__} / {r!r:.80}")
        ref_lists.append(r)
    return ref_lists


# --- BLEU ------------------------------------------------------------------
def _bleu_stats(hyp: list[str], hyp_counts, refs: list[list[str]], refs_counts):
    """Clipped matches, guesses and the effective reference length of one pair.
    Mirrors cook_refs()/cook_test() in bleu_scorer.py."""
    # 'closest' reference length, ties go to the SHORTER one: pycocoevalcap takes
    # min((abs(l - testlen), l)), so the tuple's second item breaks ties.
    ref_len = min((abs(len(r) - len(hyp)), len(r)) for r in refs)[1]
    # Clip each hypothesis n-gram count by its max count in any single reference.
    max_counts = refs_counts[0]
    if len(refs_counts) > 1:
        max_counts = [Counter() for _ in range(NGRAM_N)]
        for ref_counts in refs_counts:
            for k in range(NGRAM_N):
                max_counts[k] |= ref_counts[k]  # Counter | Counter = element-wise max
    # Only n-grams in both can match; the key-set intersection runs in C.
    correct = [sum(min(h[g], m[g]) for g in h.keys() & m.keys())
               for h, m in zip(hyp_counts, max_counts)]
    guess = [max(0, len(hyp) - k) for k in range(NGRAM_N)]  # number of (k+1)-grams
    return correct, guess, len(hyp), ref_len


def _bleu_scores(correct, guess, hyp_len, ref_len) -> np.ndarray:
    """BLEU-1..4 for each row. Mirrors BleuScorer.compute_score(): the same smoothing
    constants (so an empty hypothesis gives 0, not NaN) and the same product order,
    which makes per-sample and corpus scores equal pycocoevalcap to the last bits."""
    tiny, small = 1e-15, 1e-9
    correct, guess = np.asarray(correct, float), np.asarray(guess, float)  # (N, 4)
    # BLEU-k = (prod_{j<=k} p_j)^(1/k), p_j = clipped matches / guesses
    prods = np.cumprod((correct + tiny) / (guess + small), axis=1)  # (N, 4)
    bleu = prods ** (1.0 / np.arange(1, NGRAM_N + 1))  # (N, 4)
    # Brevity penalty exp(1 - r/c), applied only when the hypothesis is shorter
    ratio = (np.asarray(hyp_len, float) + tiny) / (np.asarray(ref_len, float) + small)
    with np.errstate(over="ignore"):  # 1/ratio is ~1e16 for an empty hypothesis: exp -> 0
        bp = np.where(ratio < 1, np.exp(1 - 1 / ratio), 1.0)  # (N,)
    return bleu * bp[:, None]


# --- ROUGE-L ---------------------------------------------------------------
def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists.
    Same value as my_lcs() in rouge.py, but bit-parallel (Allison & Dix 1986, in the
    form of Hyyro 2004): one Python big int holds a whole DP column, so the cost is
    O(len(b)) big-int operations instead of O(len(a) * len(b)) Python steps."""
    if not a or not b:
        return 0
    # match[t] has bit i set where a[i] == t
    match = {}
    for i, tok in enumerate(a):
        match[tok] = match.get(tok, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full  # zero bits of v mark the positions where the LCS grew
    for tok in b:
        u = v & match.get(tok, 0)
        v = (v + u) | (v - u)
    return len(a) - (v & full).bit_count()


def _rouge_l(hyp: list[str], refs: list[list[str]], beta: float = ROUGE_BETA) -> float:
    """Mirrors Rouge.calc_score() in rouge.py: precision and recall are maximised
    over the references SEPARATELY (they may come from different references)."""
    if not hyp:
        # pycocoevalcap splits "" into [""], one empty token; that gives 0 here too,
        # except when the reference is also empty, where it would give 1.0. We give 0.
        return 0.0
    prec_max = rec_max = 0.0
    for ref in refs:
        lcs = _lcs_length(hyp, ref)
        prec_max = max(prec_max, lcs / len(hyp))
        rec_max = max(rec_max, lcs / len(ref) if ref else 0.0)
    if prec_max == 0 or rec_max == 0:
        return 0.0
    # F_beta = (1 + b^2) P R / (R + b^2 P), written in pycocoevalcap's operation order
    return ((1 + beta**2) * prec_max * rec_max) / float(rec_max + beta**2 * prec_max)


# --- CIDEr-D ---------------------------------------------------------------
def _cider_vec(counts: list[Counter], idf2: dict, default_idf2: float):
    """L2 norms of the TF-IDF vectors (one per n-gram order) and the 'length'.
    Mirrors counts2vec() in cider_scorer.py, where vec[g] = tf(g) * idf(g); we keep
    the raw counts and the squared idf instead of building the weighted dicts, which
    pycocoevalcap rebuilds for every reference of every pair."""
    # ||vec||^2 = sum_g tf(g)^2 * idf(g)^2, as one dot product per order
    norms = [math.sqrt(sum(tf * tf * idf2.get(g, default_idf2) for g, tf in c.items())) for c in counts]
    # pycocoevalcap's 'length' counts BIGRAMS (its `if n == 1` is the 0-based bigram
    # index), i.e. len(tokens) - 1, and 0 for texts of 0 or 1 token. We keep that
    # quirk: it decides the Gaussian length penalty.
    length = sum(counts[1].values())
    return counts, norms, length


def _cider_sim(hyp, ref, idf2: dict, sigma: float = CIDER_SIGMA) -> list[float]:
    """Per-order clipped cosine similarity with the Gaussian length penalty.
    Mirrors sim() in cider_scorer.py: sum_g min(w_h(g), w_r(g)) * w_r(g) with
    w = tf * idf; as idf >= 0 this is min(tf_h, tf_r) * tf_r * idf^2 (the "-D"
    clipping), and only n-grams present in both contribute."""
    (h_counts, h_norms, h_len), (r_counts, r_norms, r_len) = hyp, ref
    penalty = math.exp(-((h_len - r_len) ** 2) / (2 * sigma**2))
    vals = []
    for h, r, h_norm, r_norm in zip(h_counts, r_counts, h_norms, r_norms):
        val = sum(min(h[g], r[g]) * r[g] * idf2[g] for g in h.keys() & r.keys())
        if h_norm != 0 and r_norm != 0:
            val /= h_norm * r_norm
        vals.append(val * penalty)
    return vals


def _document_frequency(refs_counts) -> Counter:
    """df(g) = number of documents (reference sets) containing the n-gram g."""
    df = Counter()
    for refs in refs_counts:
        df.update(set().union(*(c.keys() for ref in refs for c in ref)))
    return df


def cider_document_frequency(refs) -> tuple[Counter, int]:
    """CIDEr-D document frequencies of a fixed corpus (one document per reference, or per
    list of references), for rewards: scored against the training references, a sample's
    CIDEr no longer depends on which other reports share its batch (the usual SCST
    practice). Pass the result as nlg_metrics(..., cider_df=...). Each reference is its own
    document: ViLMedic's CIDEr-D reward joins them into one, so every df is 1."""
    ref_texts = [[r] if isinstance(r, str) else list(r) for r in refs]
    return _document_frequency([[_ngram_counts(t.split()) for t in rs] for rs in ref_texts]), len(ref_texts)


def _cider_d(hyps_counts, refs_counts, cider_df=None) -> np.ndarray:
    """CIDEr-D of every pair. Mirrors CiderScorer.compute_score(): document
    frequencies come from the references being scored (each pair's reference set is
    one document), so a score depends on the whole evaluated set; with a single pair
    log(N) = 0 and every score is 0. cider_df = (df, N) from cider_document_frequency
    fixes them instead. Score = 10 * mean over n of the similarity, averaged over the
    references."""
    df, n_docs = cider_df if cider_df is not None else (_document_frequency(refs_counts), len(refs_counts))
    log_n = math.log(n_docs)
    # idf = log(N) - log(max(1, df)); n-grams absent from every reference get log(N)
    idf2 = {g: (log_n - math.log(d)) ** 2 for g, d in df.items()}  # squared idf
    scores = []
    for hyp, refs in zip(hyps_counts, refs_counts):
        h = _cider_vec(hyp, idf2, log_n**2)
        total = np.zeros(NGRAM_N)
        for ref in refs:
            total += _cider_sim(h, _cider_vec(ref, idf2, log_n**2), idf2)
        scores.append(np.mean(total) / len(refs) * 10.0)
    return np.array(scores)


# --- METEOR ----------------------------------------------------------------
_METEOR_SCORER = None  # one JVM per process: the jar takes ~7 s to load its tables


def _meteor_available() -> bool:
    return importlib.util.find_spec("pycocoevalcap") is not None and shutil.which("java") is not None


def _meteor_scorer():
    """pycocoevalcap's Meteor (java -jar meteor-1.5.jar -stdio), started once."""
    global _METEOR_SCORER
    if _METEOR_SCORER is None:
        from pycocoevalcap.meteor.meteor import Meteor
        _METEOR_SCORER = Meteor()
    return _METEOR_SCORER


def _meteor(hyps: list[str], refs: list[list[str]]):
    """Corpus METEOR (the jar's own aggregate, not the mean of per-sample scores) and
    per-sample scores. Texts must be one line each: a newline ends a command of the
    jar's stdin protocol, and "|||" separates fields (Meteor._stat only cleans it
    from the hypothesis, so we clean the references too)."""
    def one_line(t):
        return " ".join(t.replace("|||", " ").split())
    res = {i: [one_line(h)] for i, h in enumerate(hyps)}
    gts = {i: [one_line(r) for r in rs] for i, rs in enumerate(refs)}
    score, scores = _meteor_scorer().compute_score(gts, res)
    return float(score), [float(s) for s in scores]


# --- NLG entry point -------------------------------------------------------
def nlg_metrics(hyps, refs, meteor="auto", per_sample: bool = False, cider_df=None) -> dict:
    """BLEU-1..4, ROUGE-L, CIDEr(-D) and, when computed, METEOR, as pycocoevalcap.

    hyps: list of str. refs: list of str, or list of lists of str (several references
    per hypothesis). Texts are used as given: split on any whitespace (newlines
    included), no lower-casing or punctuation handling; clean them before.
    meteor: "auto" (compute when pycocoevalcap and java are present, else leave the
    key out and log a warning), True (raise if unavailable) or False (skip).
    per_sample: also return {"per_sample": {metric: [score per hypothesis]}}.
    cider_df: (df, N) from cider_document_frequency(corpus) to fix CIDEr's document
    frequencies (rewards); None computes them from `refs`, as pycocoevalcap.
    """
    if meteor not in ("auto", True, False):
        raise ValueError(f"meteor must be 'auto', True or False, got {meteor!r}")
    ref_texts = _check_pairs(hyps, refs)
    hyp_toks = [h.split() for h in hyps]  # str.split(): whitespace incl. newlines
    ref_toks = [[r.split() for r in rs] for rs in ref_texts]
    hyp_counts = [_ngram_counts(t) for t in hyp_toks]
    ref_counts = [[_ngram_counts(t) for t in rs] for rs in ref_toks]

    # BLEU: per-sample from each pair's stats, corpus from the summed stats
    stats = [_bleu_stats(*args) for args in zip(hyp_toks, hyp_counts, ref_toks, ref_counts)]
    correct, guess, hyp_len, ref_len = (np.array(x) for x in zip(*stats))
    bleu_each = _bleu_scores(correct, guess, hyp_len, ref_len)  # (N, 4)
    bleu_corpus = _bleu_scores(correct.sum(0, keepdims=True), guess.sum(0, keepdims=True),
                               hyp_len.sum(keepdims=True), ref_len.sum(keepdims=True))[0]
    each = {f"BLEU-{k + 1}": bleu_each[:, k] for k in range(NGRAM_N)}
    out = {f"BLEU-{k + 1}": float(bleu_corpus[k]) for k in range(NGRAM_N)}

    # ROUGE-L and CIDEr-D: the corpus score is the mean of the per-sample scores
    each["ROUGE-L"] = np.array([_rouge_l(h, rs) for h, rs in zip(hyp_toks, ref_toks)])
    each["CIDEr"] = _cider_d(hyp_counts, ref_counts, cider_df)
    out["ROUGE-L"] = float(np.mean(each["ROUGE-L"]))
    out["CIDEr"] = float(np.mean(each["CIDEr"]))

    if meteor is not False:
        if _meteor_available():
            out["METEOR"], each["METEOR"] = _meteor(hyps, ref_texts)
        elif meteor is True:
            raise RuntimeError("METEOR needs pycocoevalcap (pip install pycocoevalcap) and "
                               "a `java` executable on PATH; pass meteor=False to skip it")
        else:
            log.warning("METEOR skipped: needs pycocoevalcap and `java` on PATH "
                                   "(no approximation is reported in its place)")
    if per_sample:
        out["per_sample"] = {k: [float(x) for x in v] for k, v in each.items()}
    return out


# --- CE metrics ------------------------------------------------------------
# F1-CheXbert (R2Gen/CMN/... tables): micro F1 over these 5 observations only
CHEXBERT_5 = ["Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion"]


def _safe_div(num, den) -> np.ndarray:
    """num / den with 0 where den == 0: scikit-learn's zero_division=0."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


def _prf(tp, fp, fn):
    """Precision, recall, F1 = 2TP / (2TP + FP + FN), each 0 when undefined
    (scikit-learn's precision_recall_fscore_support with zero_division=0)."""
    return _safe_div(tp, tp + fp), _safe_div(tp, tp + fn), _safe_div(2 * tp, 2 * tp + fp + fn)


def ce_metrics(hyp_labels, ref_labels, uncertain_as: int = 1) -> dict:
    """Clinical efficacy: labels of generated (hyp) vs reference reports.

    hyp_labels, ref_labels: float arrays (N, 14) in CHEXPERT_LABELS order, with
    1 positive, 0 negative, -1 uncertain, NaN not mentioned.
    uncertain_as: 1 counts uncertain as positive, 0 as negative. Papers differ:
    PromptMRG's code takes CheXbert class 1 only (uncertain_as=0); CheXpert-style
    "U-ones" and DEER's reward count it positive (uncertain_as=1, our default).
    """
    if uncertain_as not in (0, 1):
        raise ValueError(f"uncertain_as must be 0 or 1, got {uncertain_as!r}")
    hyp = binarize(hyp_labels, uncertain_as, "hyp_labels").astype(bool)  # (N, 14) bool
    ref = binarize(ref_labels, uncertain_as, "ref_labels").astype(bool)  # (N, 14) bool
    if hyp.shape != ref.shape:
        raise ValueError(f"hyp_labels {hyp.shape} and ref_labels {ref.shape} differ in shape")
    if hyp.shape[0] == 0:
        raise ValueError("ce_metrics needs at least one report")
    tp = (hyp & ref).astype(float)  # (N, 14)
    fp = (hyp & ~ref).astype(float)
    fn = (~hyp & ref).astype(float)
    out = {}

    # Micro: pool TP/FP/FN over all reports and labels
    p, r, f = _prf(tp.sum(), fp.sum(), fn.sum())
    out.update(micro_precision=p, micro_recall=r, micro_f1=f)

    # Macro: P/R/F1 per label, then the plain mean over the 14 labels (labels with no
    # positive anywhere count as 0, as scikit-learn's average="macro" does)
    p_lab, r_lab, f_lab = _prf(tp.sum(0), fp.sum(0), fn.sum(0))  # (14,) each
    out.update(macro_precision=p_lab.mean(), macro_recall=r_lab.mean(), macro_f1=f_lab.mean())

    # Example-based (PromptMRG, modules/metrics_clinical.py): P/R/F1 per report, then
    # the mean over ALL reports. A report with no predicted positive has precision 0,
    # one with no reference positive recall 0, and one with neither scores 0 on all
    # three (PromptMRG's nan_to_num; equals scikit-learn average="samples",
    # zero_division=0). We keep that, for comparable numbers, though it punishes
    # correct all-negative reports; with CheXbert labels No Finding is usually
    # positive in a normal report, so the case is rare.
    p_ex, r_ex, f_ex = _prf(tp.sum(1), fp.sum(1), fn.sum(1))  # (N,) each
    out.update(example_precision=p_ex.mean(), example_recall=r_ex.mean(), example_f1=f_ex.mean())

    # F1-CheXbert: micro over the 5 common observations
    cols = [CHEXPERT_LABELS.index(name) for name in CHEXBERT_5]
    p, r, f = _prf(tp[:, cols].sum(), fp[:, cols].sum(), fn[:, cols].sum())
    out.update({"5label_micro_precision": p, "5label_micro_recall": r, "5label_micro_f1": f})

    out = {k: float(v) for k, v in out.items()}
    out["per_label"] = {
        name: {"precision": float(p_lab[i]), "recall": float(r_lab[i]), "f1": float(f_lab[i]),
               "support": int(ref[:, i].sum())}
        for i, name in enumerate(CHEXPERT_LABELS)}
    return out


# ---------------------------------------------------------------------------------------------
# 5. Models: one small policy interface, a tiny built-in VLM and Hugging Face VLMs
# ---------------------------------------------------------------------------------------------
# Every RL script talks to a policy through the same methods (N = B prompts x G samples, each
# group contiguous; T completion tokens):
#   prompt_batch(images, text) -> prompts        model inputs of B studies (lists of PIL views)
#   repeat(prompts, G)                           each prompt G times, row i -> rows iG .. iG+G-1
#   generate(prompts, max_new_tokens, temperature) -> ids (N, T), mask (N, T)
#                                                mask: 1 up to AND including the first EOS
#   completion_logprobs(prompts, ids, mask, temperature) -> (N, T) float32, 0 where mask is 0
#   encode_targets(texts) -> ids, mask;  decode(ids, mask) -> texts;  sft_loss(prompts, texts)
#   save(dir) / load(dir)
# Sampling is pure temperature sampling: top-k / top-p would make the recorded log-probs
# differ from the policy's, biasing the GRPO ratio (PITFALLS.md).
_WORD_RE = re.compile(r"</?[a-z_]+>|[a-z0-9]+|[^\sa-z0-9]")


class WordTokenizer:
    """Word-level tokenizer of the tiny model, built from the training reports: lower-cased
    words, numbers and single punctuation marks; angle-bracket tags (<think>) stay whole."""
    PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"

    def __init__(self, vocab: list[str]):
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (self.index[t] for t in (self.PAD, self.BOS, self.EOS, self.UNK))

    @classmethod
    def build(cls, texts: list[str], min_count: int = 1, extra_tokens=()) -> "WordTokenizer":
        counts = Counter(w for t in texts for w in _WORD_RE.findall(t.lower()))
        words = sorted(w for w, c in counts.items() if c >= min_count)
        specials = [cls.PAD, cls.BOS, cls.EOS, cls.UNK, *extra_tokens]
        return cls(specials + [w for w in words if w not in specials])

    def encode(self, text: str) -> list[int]:
        return [self.index.get(w, self.unk_id) for w in _WORD_RE.findall(text.lower())]

    def decode(self, ids) -> str:
        words = [self.vocab[i] for i in ids if i not in (self.pad_id, self.bos_id, self.eos_id)]
        text = " ".join(words)
        return re.sub(r" ?- ?", "-", re.sub(r" ([.,;:?!])", r"\1", text))


class TinyVLM(torch.nn.Module):
    """The offline policy's network: a small CNN turns each view into a grid of prefix
    embeddings that a GPT-2-configured decoder (transformers, random init) reads before BOS.

    image (V, 1, S, S) -> conv stack -> (D, g, g) -> g*g prefix vectors per view -> decoder
    """

    def __init__(self, vocab_size: int, n_views: int = 1, grid: int = 4, n_embd: int = 128, n_layer: int = 2,
                 n_head: int = 4, max_len: int = 96, channels: int = 32):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        self.hparams = dict(vocab_size=vocab_size, n_views=n_views, grid=grid, n_embd=n_embd, n_layer=n_layer,
                            n_head=n_head, max_len=max_len, channels=channels)
        c = channels
        block = lambda i, o: [torch.nn.Conv2d(i, o, 3, stride=2, padding=1), torch.nn.GroupNorm(8, o), torch.nn.ReLU()]
        self.encoder = torch.nn.Sequential(*block(1, c), *block(c, c), *block(c, 2 * c), *block(2 * c, 2 * c),
                                           torch.nn.AdaptiveAvgPool2d(grid))
        self.project = torch.nn.Linear(2 * c, n_embd)
        self.view_embedding = torch.nn.Parameter(torch.zeros(n_views, 1, n_embd))
        self.n_prefix = n_views * grid * grid + 1  # image tokens, then BOS
        # No dropout and GroupNorm rather than BatchNorm: the log-probs of a completion must not
        # depend on train/eval mode or on the batch, or the GRPO ratio is off before any update.
        config = GPT2Config(vocab_size=vocab_size, n_positions=self.n_prefix + max_len, n_embd=n_embd,
                            n_layer=n_layer, n_head=n_head, bos_token_id=1, eos_token_id=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.decoder = GPT2LMHeadModel(config)

    def prefix(self, pixel_values, bos_id: int):
        """(N, V, 1, S, S) -> (N, V*g*g + 1, D): projected image features, then the BOS embedding."""
        N, V = pixel_values.shape[:2]
        if V > len(self.view_embedding):
            raise ValueError(f"studies with {V} views, but the tiny model was built for {len(self.view_embedding)}: "
                             f"build it with n_views={V} (common.make_policy(..., n_views=...))")
        feats = self.encoder(pixel_values.flatten(0, 1))  # (N*V, 2c, g, g)
        feats = self.project(feats.flatten(2).transpose(1, 2))  # (N*V, g*g, D)
        feats = (feats.view(N, V, -1, feats.shape[-1]) + self.view_embedding[:V]).flatten(1, 2)  # (N, V*g*g, D)
        bos = self.decoder.transformer.wte(torch.full((N, 1), bos_id, device=feats.device))  # (N, 1, D)
        return torch.cat([feats, bos], dim=1)


class TinyPolicy:
    """The tiny built-in vision-language policy (offline default, `--model tiny`). The prompt is
    the image prefix + BOS: this model has no text prompt, so `text` is ignored."""

    def __init__(self, model: TinyVLM, tokenizer: WordTokenizer, image_size: int = 64, device="cpu"):
        self.model, self.tokenizer, self.image_size = model.to(device), tokenizer, image_size
        self.device = torch.device(device)
        self.eos_token_id, self.pad_token_id = tokenizer.eos_id, tokenizer.pad_id

    @classmethod
    def build(cls, train_reports: list[str], n_views: int = 1, image_size: int = 64, device="cpu",
              extra_tokens=(), **model_kwargs) -> "TinyPolicy":
        tok = WordTokenizer.build(train_reports, extra_tokens=extra_tokens)
        return cls(TinyVLM(len(tok.vocab), n_views=n_views, **model_kwargs), tok, image_size, device)

    def prompt_batch(self, images, text=None) -> dict:
        """images: one list of PIL views per study -> {"pixel_values": (B, V, 1, S, S)} in [-1, 1]."""
        import torchvision.transforms.functional as F
        if len({len(study) for study in images}) > 1:
            raise ValueError(f"the tiny model takes the same number of views in every study of a batch, got "
                             f"{sorted({len(study) for study in images})} (use the data's fixed view count, "
                             "or one view per sample)")
        views = [torch.stack([F.to_tensor(F.resize(im.convert("L"), [self.image_size, self.image_size]))
                              for im in study]) for study in images]
        return {"pixel_values": (torch.stack(views) * 2 - 1).to(self.device)}  # (B, V, 1, S, S)

    def repeat(self, prompts: dict, G: int) -> dict:
        return {k: v.repeat_interleave(G, dim=0) for k, v in prompts.items()}

    @torch.no_grad()
    def generate(self, prompts: dict, max_new_tokens: int = 80, temperature: float = 1.0, do_sample: bool = True,
                 return_logprobs: bool = False, top_p: float = 1.0):
        """Sample token by token with the KV cache. Returns ids (N, T), mask (N, T) and, with
        return_logprobs, the log-probs of the sampled tokens under the full (temperature-scaled)
        distribution. top_p < 1 is nucleus sampling, for uses outside the RL loss (DEER's
        DDSampling); GRPO rollouts keep top_p = 1."""
        was_training = self.model.training
        self.model.eval()
        dec = self.model.decoder
        max_new_tokens = min(max_new_tokens, self.model.hparams["max_len"])
        embeds = self.model.prefix(prompts["pixel_values"], self.tokenizer.bos_id)  # (N, P, D)
        N = embeds.shape[0]
        ids, logps = [], []
        done = torch.zeros(N, dtype=torch.bool, device=self.device)
        out = dec(inputs_embeds=embeds, use_cache=True)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)  # (N, V)
            tok = torch.multinomial(nucleus_probs(logp, top_p), 1).squeeze(1) if do_sample else logp.argmax(-1)  # (N,)
            tok = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            ids.append(tok)
            logps.append(logp.gather(1, tok[:, None]).squeeze(1))
            done |= tok == self.eos_token_id
            if done.all():
                break
            out = dec(input_ids=tok[:, None], past_key_values=out.past_key_values, use_cache=True)
        self.model.train(was_training)
        ids = torch.stack(ids, 1)  # (N, T)
        mask = completion_mask(ids, self.eos_token_id)  # (N, T)
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, self.pad_token_id))
        return (ids, mask, torch.stack(logps, 1) * mask) if return_logprobs else (ids, mask)

    def completion_logprobs(self, prompts: dict, completion_ids, completion_mask, temperature: float = 1.0):
        """One forward pass over prefix + completion; logits / temperature -> log_softmax -> the
        log-prob of each completion token. (N, T) float32, 0 where the mask is 0. Completions are
        right-padded, so causal attention never lets a pad change a real token's log-prob."""
        prefix = self.model.prefix(prompts["pixel_values"], self.tokenizer.bos_id)  # (N, P, D)
        P, T = prefix.shape[1], completion_ids.shape[1]
        embeds = torch.cat([prefix, self.model.decoder.transformer.wte(completion_ids)], dim=1)  # (N, P+T, D)
        logits = self.model.decoder(inputs_embeds=embeds).logits[:, P - 1:P - 1 + T]  # (N, T, V) predicts token t
        return token_logprobs(logits, completion_ids, temperature) * completion_mask  # (N, T)

    def encode_targets(self, texts: list[str]):
        max_len = self.model.hparams["max_len"]
        seqs = [(self.tokenizer.encode(t)[:max_len - 1]) + [self.eos_token_id] for t in texts]
        return pad_completions(seqs, self.pad_token_id, self.device)

    def decode(self, completion_ids, completion_mask) -> list[str]:
        return [self.tokenizer.decode(row[m.bool()].tolist()) for row, m in zip(completion_ids, completion_mask)]

    def sft_loss(self, prompts: dict, texts: list[str]):
        ids, mask = self.encode_targets(texts)
        logp = self.completion_logprobs(prompts, ids, mask)  # (N, T)
        return -(logp * mask).sum() / mask.sum()  # token sum / token count

    def save(self, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = lora_merged_state_dict(self.model)  # LoRA folded in: loads into a plain TinyVLM
        torch.save({"hparams": self.model.hparams, "state_dict": state, "vocab": self.tokenizer.vocab,
                    "image_size": self.image_size}, path / "tiny_policy.pt")

    @classmethod
    def load(cls, path, device="cpu") -> "TinyPolicy":
        f = Path(path) / "tiny_policy.pt"
        if not f.is_file():
            raise FileNotFoundError(f"no tiny policy at {f}")
        ck = torch.load(f, map_location="cpu", weights_only=True)
        model = TinyVLM(**ck["hparams"])
        model.load_state_dict(ck["state_dict"])
        return cls(model, WordTokenizer(ck["vocab"]), ck["image_size"], device)


class HFPolicy:
    """A Hugging Face vision-language model behind the policy interface, through AutoProcessor
    and AutoModelForImageTextToText: Qwen2.5-VL first (HuatuoGPT-Vision-7B-Qwen2.5VL is the same
    architecture). The prompt is the processor's chat template with one image entry per view and
    the instruction text, left-padded; completions are right-padded. The hub's generation
    defaults (Qwen's top_k, top_p and repetition penalty) are replaced by plain temperature
    sampling, so the recorded and the scored log-probs come from the same distribution.

    Weights are loaded in `dtype` (bf16 on a GPU halves the memory; LoRA adapters stay fp32).
    max_pixels bounds the image tokens per view (Qwen: one token per 28 x 28 pixels)."""

    MODEL_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")

    def __init__(self, name_or_path: str, device="cpu", dtype=torch.float32, gradient_checkpointing: bool = False,
                 freeze_vision: bool = False, freeze_language: bool = False, max_pixels: int | None = None,
                 max_target_tokens: int = 512):
        from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig
        self.name, self.device, self.max_target_tokens = str(name_or_path), torch.device(device), max_target_tokens
        size = {"longest_edge": max_pixels, "shortest_edge": min(max_pixels, 56 * 56)} if max_pixels else None
        self.processor = AutoProcessor.from_pretrained(name_or_path, **({"size": size} if size else {}))
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.padding_side = "left"  # prompts end where generation starts (PITFALLS.md)
        self.model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype).to(self.device)
        self.dtype = dtype
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_id = self.tokenizer.eos_token_id  # ends SFT / DPO targets (<|im_end|> for chat models)
        if self.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        # A vision placeholder (<|image_pad|> ...) sampled into a completion would be taken for an
        # image slot by the next forward ("Image features and image tokens do not match"): a
        # trained model never writes one, a random one can. They are never sampled and get
        # probability 0 in the scored distribution too, so sampling and scoring still agree.
        cfg = self.model.config
        self.suppressed = [i for i in (getattr(cfg, n, None) for n in ("image_token_id", "video_token_id",
                           "vision_start_token_id", "vision_end_token_id")) if i is not None]
        self.model.generation_config = GenerationConfig(
            bos_token_id=gen.bos_token_id, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,  # no hidden sampling tricks
            suppress_tokens=self.suppressed or None)
        if gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            enable({"use_reentrant": False})  # non-reentrant: works with frozen inputs (LoRA)
            self.model.config.use_cache = False  # generate() turns the cache back on (use_cache=True)
        vision, language = self.vision_and_language()
        for part, frozen in ((vision, freeze_vision), (language, freeze_language)):
            for p in part.parameters():
                p.requires_grad_(not frozen)
        # from_pretrained returns eval mode, where gradient checkpointing and LoRA dropout are
        # silently off; the policy trains, and generate() switches to eval and back itself
        self.model.train()

    def vision_and_language(self):
        """(vision tower incl. its projector/merger, language model incl. the LM head) as modules."""
        inner = getattr(self.model, "model", self.model)
        vision = next((getattr(inner, n) for n in ("visual", "vision_tower", "vision_model") if hasattr(inner, n)), None)
        if vision is None:
            raise ValueError(f"{self.name}: no vision tower found (looked for visual, vision_tower, vision_model)")
        vision_ids = {id(p) for p in vision.parameters()}
        language = torch.nn.ModuleList([m for n, m in self.model.named_children() if n != "model"] +
                                       [m for n, m in inner.named_children() if all(id(p) not in vision_ids for p in m.parameters())])
        return vision, language

    def _autocast(self):
        """Weights in bf16/fp16 with some parameters kept in fp32 (fp32_trainable, LoRA) need
        autocast to mix them; the policy applies it itself, whatever the caller does."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _reset_rope(self):
        # Qwen2-VL caches rope_deltas in generate(); a later forward with another batch would reuse
        # them (PITFALLS.md). Positions are recomputed from input_ids when the cache is empty.
        inner = getattr(self.model, "model", None)
        if inner is not None and hasattr(inner, "rope_deltas"):
            inner.rope_deltas = None

    def _inputs(self, prompts: dict) -> dict:
        return {k: v for k, v in prompts.items() if k in self.MODEL_KEYS}

    def prompt_batch(self, images, text) -> dict:
        """images: one list of PIL views per study; text: one instruction or one per study."""
        texts = [text] * len(images) if isinstance(text, str) or text is None else list(text)
        if len(texts) != len(images):
            raise ValueError(f"prompt_batch: {len(images)} studies but {len(texts)} instructions")
        chats = [[{"role": "user", "content": [{"type": "image"} for _ in views] + [{"type": "text", "text": t or ""}]}]
                 for views, t in zip(images, texts)]
        prompt_text = [self.processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        flat = [im.convert("RGB") for views in images for im in views]
        inputs = self.processor(text=prompt_text, images=flat, padding=True, return_tensors="pt")  # never truncated
        prompts = {k: v.to(self.device) for k, v in inputs.items() if k in self.MODEL_KEYS}
        prompts["n_images"] = torch.tensor([len(v) for v in images])  # (B,) views per study, for repeat()
        return prompts

    def repeat(self, prompts: dict, G: int) -> dict:
        """Each study G times in a row. Text tensors are (B, P); pixel_values holds every image's
        patches one after the other (Qwen: grid t*h*w rows per image), so it is cut per study."""
        n_images = prompts["n_images"].tolist()
        if "image_grid_thw" in prompts:
            rows_per_image = prompts["image_grid_thw"].prod(-1).tolist()  # patches per image
        else:
            rows_per_image = [len(prompts["pixel_values"]) // sum(n_images)] * sum(n_images)
        per_study_rows = [sum(c) for c in _split_list(rows_per_image, n_images)]
        out = {k: v.repeat_interleave(G, dim=0) for k, v in prompts.items() if k not in ("pixel_values", "image_grid_thw")}
        out["pixel_values"] = torch.cat([c for c in prompts["pixel_values"].split(per_study_rows) for _ in range(G)])
        if "image_grid_thw" in prompts:
            out["image_grid_thw"] = torch.cat([c for c in prompts["image_grid_thw"].split(n_images) for _ in range(G)])
        return out

    @torch.no_grad()
    def generate(self, prompts: dict, max_new_tokens: int = 256, temperature: float = 1.0, do_sample: bool = True,
                 return_logprobs: bool = False, top_p: float = 1.0):
        """model.generate with the KV cache on; returns completion ids (N, T), mask (N, T) and,
        with return_logprobs, the sampled tokens' log-probs under logits / temperature."""
        was_training = self.model.training
        self.model.eval()
        self._reset_rope()
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
        with self._autocast():
            out = self.model.generate(**self._inputs(prompts), max_new_tokens=max_new_tokens, use_cache=True,
                                      return_dict_in_generate=True, output_logits=return_logprobs, **sampling)
        self._reset_rope()
        self.model.train(was_training)
        ids = out.sequences[:, prompts["input_ids"].shape[1]:]  # (N, T) completion only
        mask = completion_mask(ids, self.eos_token_ids)  # (N, T)
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, self.pad_token_id))
        if not return_logprobs:
            return ids, mask
        logits = torch.stack(out.logits, dim=1)  # (N, T, V) raw logits of each step
        return ids, mask, token_logprobs(logits, ids, temperature, self.suppressed) * mask

    def completion_logprobs(self, prompts: dict, completion_ids, completion_mask, temperature: float = 1.0):
        """One forward pass over prompt + completion; only the T + 1 last positions go through
        the LM head. (N, T) float32, 0 where the mask is 0."""
        self._reset_rope()
        T = completion_ids.shape[1]
        inputs = self._inputs(prompts)
        inputs["input_ids"] = torch.cat([prompts["input_ids"], completion_ids], dim=1)  # (N, P+T)
        inputs["attention_mask"] = torch.cat([prompts["attention_mask"], completion_mask.to(prompts["attention_mask"].dtype)], 1)
        if "mm_token_type_ids" in prompts:  # completions are text (type 0)
            inputs["mm_token_type_ids"] = torch.cat([prompts["mm_token_type_ids"], torch.zeros_like(completion_ids)], 1)
        with self._autocast():
            logits = self.model(**inputs, use_cache=False, logits_to_keep=T + 1).logits[:, :-1]  # (N, T, V) predicts token t
        return token_logprobs(logits, completion_ids, temperature, self.suppressed) * completion_mask  # (N, T)

    def encode_targets(self, texts: list[str]):
        seqs = [self.tokenizer(t, add_special_tokens=False)["input_ids"][:self.max_target_tokens - 1] + [self.eos_token_id]
                for t in texts]
        return pad_completions(seqs, self.pad_token_id, self.device)

    def decode(self, completion_ids, completion_mask) -> list[str]:
        rows = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
        return [t.strip() for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]

    sft_loss = TinyPolicy.sft_loss

    def save(self, path):
        """save_pretrained of the model (LoRA merged into the weights, the live model untouched)
        and of the processor: the folder loads with HFPolicy(path) or plain transformers."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=lora_merged_state_dict(self.model))
        self.processor.save_pretrained(path)

    @classmethod
    def load(cls, path, device="cpu", **kwargs) -> "HFPolicy":
        return cls(path, device=device, **kwargs)


def fp32_trainable(model: torch.nn.Module) -> int:
    """Cast every parameter that trains to float32, in place; the frozen rest keeps its dtype.
    With bf16 weights, AdamW steps of size ~lr (1e-6) are far below bf16's resolution at
    weights of ~0.02 and mostly round away: full fine-tuning needs fp32 master weights.
    Call after freezing, before building the optimizer. Returns the number of cast tensors."""
    cast = [p for p in model.parameters() if p.requires_grad and p.dtype != torch.float32]
    for p in cast:
        p.data = p.data.float()
    return len(cast)


def load_policy(path, device="cpu", dtype=torch.float32, **hf_kwargs):
    """A policy saved by policy.save(path): TinyPolicy (tiny_policy.pt) or HFPolicy."""
    if (Path(path) / "tiny_policy.pt").is_file():
        return TinyPolicy.load(path, device)
    return HFPolicy.load(path, device=device, dtype=dtype, **hf_kwargs)


def _split_list(values: list, sizes: list[int]) -> list[list]:
    out, i = [], 0
    for n in sizes:
        out.append(values[i:i + n])
        i += n
    return out


def make_policy(model: str, train_reports: list[str], device, dtype=torch.float32, max_new_tokens: int = 128,
                extra_tokens=(), gradient_checkpointing: bool = True, n_views: int = 1, max_pixels: int | None = 512 * 512,
                **hf_kwargs):
    """`--model tiny` -> TinyPolicy with a word tokenizer built from the training reports (plus
    extra_tokens) and room for n_views views per study (IU X-Ray: 2); anything else -> HFPolicy
    (hub id or local folder), which takes any number of views. max_pixels bounds the image
    tokens per view (512 x 512 -> 334 Qwen tokens; the processor's default would turn a
    full-size radiograph into ~10,000); None keeps the processor's setting."""
    if model == "tiny":
        return TinyPolicy.build(list(train_reports), n_views=n_views, extra_tokens=extra_tokens, max_len=max_new_tokens,
                                device=device)
    return HFPolicy(model, device=device, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                    max_pixels=max_pixels, **hf_kwargs)


def supervised_finetune(policy, records: list[Record], steps: int, batch_size: int = 16, lr: float = 1e-3,
                        prompt: str = "", seed: int = 0, rank: int = 0, world_size: int = 1,
                        target_fn=None, desc: str = "SFT") -> list[float]:
    """Teacher-forced report likelihood on (image, report) pairs, AdamW, constant lr. The warm
    start the RL scripts give the tiny model (a random policy never earns a reward) and the
    SFT stage of the papers that have one. target_fn(batch) -> target texts (default: the
    reports). Gradients are averaged over ranks. Returns the losses."""
    from tqdm.auto import trange
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    batches = study_batches(records, batch_size, seed, rank, world_size)
    losses = []
    for _ in trange(steps, desc=desc, disable=rank != 0):
        _, batch = next(batches)
        targets = target_fn(batch) if target_fn else batch["report"]
        loss = policy.sft_loss(policy.prompt_batch(batch["images"], prompt), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        all_reduce_gradients(params, world_size)
        opt.step()
        losses.append(loss.item())
    return losses



@torch.no_grad()
def generate_reports(policy, records: list[Record], prompt: str = "", batch_size: int = 32,
                     max_new_tokens: int = 96, rank: int = 0, world_size: int = 1, desc: str = "generate") -> list[str]:
    """Greedy completions for `records`, in their order. Under torchrun each rank generates a
    strided shard and every rank gets the full list back."""
    from tqdm.auto import tqdm
    mine = list(range(rank, len(records), world_size))
    texts = []
    for b in tqdm(range(0, len(mine), batch_size), desc=desc, disable=rank != 0):
        chunk = [records[i] for i in mine[b:b + batch_size]]
        prompts = policy.prompt_batch([[load_image(p, r.id) for p in r.image_paths] for r in chunk], prompt)
        texts += policy.decode(*policy.generate(prompts, max_new_tokens, do_sample=False))
    if world_size == 1:
        return texts
    shards = [None] * world_size
    torch.distributed.all_gather_object(shards, texts)
    out = [None] * len(records)
    for r, shard in enumerate(shards):
        out[r::world_size] = shard
    return out

def token_logprobs(logits, ids, temperature: float = 1.0, suppressed=()):
    """log softmax(logits / temperature) at the given ids: (N, T, V), (N, T) -> (N, T) float32.
    One sequence at a time, so the float32 copy is (T, V), not (N, T, V): with a 150k-word
    vocabulary the full copy would be the largest tensor of the step. `suppressed` token ids
    get probability 0, as in sampling (HFPolicy's vision placeholders)."""
    rows = []
    for lg, tok in zip(logits, ids):  # (T, V), (T,)
        lg = lg.float() / temperature
        if len(suppressed):
            lg[:, list(suppressed)] = float("-inf")
        rows.append(lg.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(lg, dim=-1))  # (T,)
    return torch.stack(rows)  # (N, T)


def nucleus_probs(logp, top_p: float = 1.0):
    """(N, V) log-probs -> sampling probabilities restricted to the smallest set of tokens whose
    mass reaches top_p (nucleus sampling, Holtzman et al. 2020), renormalised. top_p = 1: all."""
    probs = logp.exp()  # (N, V)
    if top_p >= 1.0:
        return probs
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (N, V)
    outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # (N, V) mass before this token already reached top_p
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)  # (N, V) back in vocabulary order
    return kept / kept.sum(-1, keepdim=True)


def completion_mask(ids, eos_id):
    """(N, T) float: 1 up to and including the first EOS, 0 after (all 1 if no EOS). eos_id: one
    id or a list (chat models end a turn with <|im_end|> but may also stop on <|endoftext|>)."""
    is_eos = torch.isin(ids, torch.as_tensor(eos_id, device=ids.device)).int()  # (N, T)
    after_eos = (is_eos.cumsum(1) - is_eos) > 0  # (N, T) strictly after the first EOS
    return (~after_eos).float()


def pad_completions(seqs: list[list[int]], pad_id: int, device="cpu"):
    """Right-pad token lists -> ids (N, T) long, mask (N, T) float."""
    T = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


# Image and text encoders ----------------------------------------------------------------------
# The encoder-side pieces of DCRRG and RRGCL (neither uses the policy interface for them): a
# study's views averaged, a small offline CNN, torchvision ResNets, mean-pooled BERT features.
class ViewMean(torch.nn.Module):
    """Encodes every view of a study and averages them: (B, V, C, H, W) -> (B, d) (IU X-Ray has
    2 views). `head` (optional) is a classifier the caller applies itself; `dim` is d."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module | None = None, dim: int | None = None):
        super().__init__()
        self.body, self.head, self.dim = body, head, dim or getattr(body, "dim", None)

    def forward(self, x):
        return self.body(x.flatten(0, 1)).view(x.shape[0], x.shape[1], -1).mean(1)  # (B, d)


class SmallCNN(torch.nn.Module):
    """Offline image encoder: conv blocks (3 x 3 conv, GroupNorm: no batch statistics, ReLU) with
    the given widths and strides, average-pooled to a grid x grid map and flattened (grid > 1 keeps
    where a sign lies), then Linear + ReLU to `dim` when dim is given. (B, 1, S, S) -> (B, dim)."""

    def __init__(self, widths=(16, 32, 64, 64), strides=(2, 2, 2, 1), grid: int = 8, dim: int | None = 256):
        super().__init__()
        c = [1, *widths]
        blocks = [m for i, o, s in zip(c, c[1:], strides)
                  for m in (torch.nn.Conv2d(i, o, 3, s, 1), torch.nn.GroupNorm(8, o), torch.nn.ReLU())]
        blocks += [torch.nn.AdaptiveAvgPool2d(grid), torch.nn.Flatten()]
        if dim is not None:
            blocks += [torch.nn.Linear(c[-1] * grid * grid, dim), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*blocks)
        self.dim = dim or c[-1] * grid * grid

    def forward(self, x):
        return self.net(x)


def resnet_encoder(depth: int = 50, weights: str | None = None, flag: str = "--pretrained") -> ViewMean:
    """torchvision ResNet-`depth` without its classifier, as a ViewMean (B, V, 3, H, W) -> (B, 2048
    for 50/101/152). weights: None (random), "imagenet" (torchvision's default weights, downloaded
    once when asked) or a state-dict file; training checkpoints ({"state_dict": ...}, "module." or
    "model." prefixes) are accepted, the fc head is dropped, and anything else that does not fit is
    an error naming `flag`."""
    import torchvision
    name = f"resnet{depth}"
    imagenet = torchvision.models.get_model_weights(name).DEFAULT if weights == "imagenet" else None
    net = torchvision.models.get_model(name, weights=imagenet)
    dim, net.fc = net.fc.in_features, torch.nn.Identity()  # v is the pooled feature
    if weights not in (None, "imagenet"):
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file (a torchvision ResNet-{depth} state dict)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = {k.removeprefix("module.").removeprefix("model."): v for k, v in state.get("state_dict", state).items()}
        try:
            net.load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")})
        except RuntimeError as e:
            raise ValueError(f"{flag} {path}: not a torchvision ResNet-{depth} state dict ({str(e)[:300]})") from None
    return ViewMean(net, dim=dim)


def mean_pooled_bert_features(model, tokenizer, texts: list[str], device, max_length: int = 512) -> torch.Tensor:
    """Mean of a BERT-like model's last hidden states over each text's word pieces -> (B, H). No
    torch.no_grad here: a caller that trains the encoder gets gradients."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    h = model(**enc).last_hidden_state  # (B, L, H)
    m = enc["attention_mask"][..., None].to(h.dtype)  # (B, L, 1)
    return (h * m).sum(1) / m.sum(1)


# LoRA ------------------------------------------------------------------------------------------
# LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685), written by hand as PEFT's
# LoraLayer: h = W0 x + (alpha / r) * B A dropout(x), with W0 frozen, A (r, in) drawn
# kaiming-uniform, B (out, r) zeros, so the adapted model starts equal to the base model.
# Switching the LoRA path off gives the base model back: GRPO/DPO use that as the reference
# policy instead of keeping a second copy in memory (`lora_disabled`).
# Two layer kinds are wrapped: nn.Linear (weight (out, in), Qwen's q_proj/v_proj, ...) and
# GPT-2's Conv1D (transformers.pytorch_utils.Conv1D, weight stored transposed as (in, out);
# the tiny policy's c_attn). Only the merge has to know the difference.
class LoRALinear(torch.nn.Module):
    """A frozen nn.Linear or GPT-2 Conv1D plus a trainable low-rank update (alpha / r) * B A."""

    def __init__(self, base: torch.nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.base = base
        self.transposed = not isinstance(base, torch.nn.Linear)  # Conv1D keeps weight as (in, out)
        out_f, in_f = base.weight.shape[::-1] if self.transposed else base.weight.shape
        w = base.weight
        # fp32 adapters whatever the base's dtype (PEFT's autocast_adapter_dtype): bf16 Adam updates
        # of a B that starts at 0 would mostly round away
        self.lora_A = torch.nn.Parameter(torch.empty(r, in_f, device=w.device))  # (r, in)
        self.lora_B = torch.nn.Parameter(torch.zeros(out_f, r, device=w.device))  # (out, r)
        # PEFT's init: A as nn.Linear's default weight init, B = 0 so B A = 0 at the start
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x):  # x (..., in) -> (..., out)
        out = self.base(x)
        if not self.enabled:
            return out
        # h = W0 x + (alpha / r) * B (A dropout(x))
        x = self.dropout(x).to(self.lora_A.dtype)
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_A), self.lora_B)
        return out + (lora * self.scaling).to(out.dtype)

    def delta_weight(self):
        """(alpha / r) * B A in the base weight's layout: (out, in) for Linear, (in, out) for Conv1D."""
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scaling  # (out, in), fp32 for the merge
        return (delta.T if self.transposed else delta).to(self.base.weight.dtype)


def _set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def apply_lora(model: torch.nn.Module, target_modules: list[str], r: int = 8, alpha: float = 16.0,
               dropout: float = 0.0, exclude: torch.nn.Module | None = None) -> list[str]:
    """Wrap every nn.Linear / Conv1D whose name ends with one of `target_modules` (e.g.
    ["q_proj", "v_proj"] or ["c_attn"]) in a LoRALinear, and freeze every other parameter.
    Layers inside `exclude` are left alone (HFPolicy: the vision tower, whose MLP shares the
    language model's gate/up/down_proj names). Returns the wrapped names. A script that
    trains more than the adapters (the tiny policy's image encoder, say) sets requires_grad
    on those parameters again afterwards."""
    from transformers.pytorch_utils import Conv1D
    kinds = (torch.nn.Linear, Conv1D)
    targets = list(target_modules)
    matched, wrong_kind = [], []
    skip = {id(m) for m in exclude.modules()} if exclude is not None else set()
    for name, module in model.named_modules():
        if id(module) in skip or not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} already has LoRA: apply_lora was called twice")
        (matched if isinstance(module, kinds) else wrong_kind).append((name, module))
    if wrong_kind:
        name, module = wrong_kind[0]
        raise ValueError(f"LoRA target {name} is a {type(module).__name__}; only nn.Linear and GPT-2 Conv1D "
                         "layers can be wrapped (name the projections inside it)")
    if not matched:
        raise ValueError(f"no nn.Linear/Conv1D module name ends with any of the LoRA targets {targets}; "
                         "print(model) to see the layer names")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in matched:
        _set_submodule(model, name, LoRALinear(module, r, alpha, dropout))
    return [name for name, _ in matched]


@torch.no_grad()
def lora_merged_state_dict(model: torch.nn.Module) -> dict:
    """The state dict the model would have with every LoRA folded into its base layer (names
    as without LoRA), computed on the side: the live model keeps training with its adapters."""
    state = model.state_dict()
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            for key in ("lora_A", "lora_B"):
                state.pop(f"{name}.{key}")
            for key in ("weight", "bias"):
                if f"{name}.base.{key}" in state:
                    state[f"{name}.{key}"] = state.pop(f"{name}.base.{key}")
            state[f"{name}.weight"] = state[f"{name}.weight"] + m.delta_weight()
    return state


@contextlib.contextmanager
def lora_disabled(model: torch.nn.Module):
    """Inside the block the model is its base (LoRA paths off): the reference policy for free."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> list[str]:
    """Fold (alpha / r) * B A into each base weight and put the plain layer back, in place
    (whatever `enabled` says). Used on save, so the saved model loads without this code;
    deep-copy the model first if training goes on. Returns the merged names."""
    merged = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, m in merged:
        m.base.weight += m.delta_weight()
        _set_submodule(model, name, m.base)
    return [name for name, _ in merged]


# ---------------------------------------------------------------------------------------------
# 6. RL core: group advantages, the GRPO clipped loss (three normalisations), DPO, rollouts
# ---------------------------------------------------------------------------------------------
# Written by hand against TRL 1.x's GRPOTrainer._compute_loss and DPOTrainer (sigmoid loss),
# the reference most readers compare with. Notation: N sequences (= B prompts x G samples,
# each group contiguous), T completion tokens, A advantages. The loss functions are pure:
# tensors in, (tensor, python floats) out, no state.
def group_advantages(rewards, group_size, scale="std", eps=1e-4):
    """Group-relative advantages (DeepSeekMath GRPO, Sec. 4.1.2), one per sequence.

    rewards: (B*G,) sequence rewards; rows g*G .. g*G+G-1 are the G samples of prompt g.
    scale="std":  A = (r - mean_g) / (std_g + eps), std with Bessel's correction (TRL).
    scale="none": A = r - mean_g (Dr. GRPO, arXiv:2503.20783, drops the std division).
    Only sequence rewards are accepted: token-level schemes (e.g. DEER's token weights)
    multiply these (N,) advantages by their (N, T) weights and pass the result to
    grpo_loss, which takes A of shape (N,) or (N, T). A group whose rewards are all equal
    gets exactly 0 (set explicitly: in float, r - mean(r) can be ~1e-8 instead of 0).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B*G,), got shape {tuple(rewards.shape)}; "
                         "weight tokens after computing sequence advantages")
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if group_size < (2 if scale == "std" else 1):
        # Bessel's std of one sample is 0/0 = NaN: fail here, not as NaN losses later.
        raise ValueError(f"group_size={group_size}: scale='std' needs at least 2 samples per group")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards is not a multiple of group_size={group_size}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"non-finite rewards (NaN/inf) at indices {bad}")
    r = rewards.view(-1, group_size).to(torch.promote_types(rewards.dtype, torch.float32))  # (B, G)
    # Eq. (GRPO outcome supervision): A_i = (r_i - mean(r)) / std(r)
    A = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale == "std":
        A = A / (r.std(dim=1, keepdim=True) + eps)  # (B, G), unbiased std (N - 1)
    same = (r == r[:, :1]).all(dim=1, keepdim=True)  # (B, 1) all rewards in the group equal
    return torch.where(same, torch.zeros_like(A), A).flatten()  # (B*G,)


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2,
              beta=0.0, loss_type="grpo", max_completion_length=None):
    """Clipped GRPO surrogate plus optional k3 KL, as TRL's GRPOTrainer. Returns (loss, stats).

    logp, old_logp, ref_logp, mask: (N, T). old_logp=None means one update per rollout:
    old = logp.detach(), the ratio is exactly 1 and clipping never acts (loss ~ -mean A,
    gradient not zero). ref_logp may be None only when beta == 0. Padded positions of the
    log-prob tensors must hold finite numbers (0 is fine): they are zeroed by the mask.
    advantages: (N,) per sequence, or (N, T) per token.
    Normalisation of the masked per-token loss L_it (the place the variants differ):
      "grpo":    mean over each sequence's tokens, then mean over the N sequences
      "bnpo":    sum over all tokens / number of completion tokens in the batch
      "dr_grpo": sum over all tokens / (N * max_completion_length), default T
    A sequence with an empty mask contributes 0 (token counts are clamped at 1); it still
    counts as one of the N sequences in "grpo" and "dr_grpo".
    """
    if loss_type not in ("grpo", "bnpo", "dr_grpo"):
        raise ValueError(f"loss_type must be 'grpo', 'bnpo' or 'dr_grpo', got {loss_type!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    mask = mask.to(logp.dtype)  # (N, T)
    old_logp = logp.detach() if old_logp is None else old_logp  # (N, T)
    A = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (N, 1) or (N, T)
    # DeepSeekMath Eq. 3: ratio = pi_theta / pi_old, per token
    ratio = torch.exp(logp - old_logp)  # (N, T)
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)  # (N, T)
    # GRPO (DeepSeekMath Eq. 3): L = -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)
    per_token = -torch.min(ratio * A, clipped * A)  # (N, T)
    if ref_logp is not None:
        # DeepSeekMath Eq. 4, the k3 estimator: KL = exp(ref - logp) - (ref - logp) - 1 >= 0
        # (unbiased, always positive: http://joschu.net/blog/kl-approx.html)
        log_r = ref_logp - logp  # (N, T)
        kl = torch.exp(log_r) - log_r - 1  # (N, T)
        if beta > 0:
            per_token = per_token + beta * kl  # (N, T)
    n_tokens = mask.sum().clamp(min=1)  # () all completion tokens, clamped for empty batches
    if loss_type == "grpo":
        # mean per sequence (empty ones clamp their length at 1 and give 0), then over N
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()  # ()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / n_tokens  # ()
    else:
        # Dr. GRPO: a constant denominator, so long and short answers weigh the same per token
        L = mask.shape[1] if max_completion_length is None else max_completion_length
        loss = (per_token * mask).sum() / (mask.shape[0] * L)  # ()

    # Stats, as TRL counts them: a token is clipped when the min picked the clipped branch
    with torch.no_grad():
        A_t = A.expand_as(ratio)  # (N, T)
        is_low = (ratio < 1 - clip_eps_low) & (A_t < 0)  # (N, T) pushed down, held at 1-eps
        is_high = (ratio > 1 + clip_eps_high) & (A_t > 0)  # (N, T) pushed up, held at 1+eps
        is_clipped = (is_low | is_high).to(mask.dtype)  # (N, T)
        stats = {
            "clip_fraction": ((is_clipped * mask).sum() / n_tokens).item(),
            "kl": ((kl * mask).sum() / n_tokens).item() if ref_logp is not None else 0.0,
            "ratio_mean": ((ratio * mask).sum() / n_tokens).item(),
        }
    return loss, stats


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1,
             length_normalize=False, chosen_mask=None, rejected_mask=None):
    """Sigmoid DPO loss (Rafailov et al. 2023, Eq. 7), mean over the N pairs. Returns (loss, stats).

    Each log-prob input is either per token (N, T) with its side's mask (N, T) (policy and
    reference share the mask), or already summed per sequence (N,) when the mask is None.
    Normalisation: log pi(y|x) = sum of the completion's token log-probs (TRL's default);
    length_normalize=True uses the mean per token instead (needs masks).
    """
    if length_normalize and (chosen_mask is None or rejected_mask is None):
        raise ValueError("length_normalize=True needs chosen_mask and rejected_mask (token counts)")

    def seq_logp(lp, m):  # (N, T) + mask -> (N,), or (N,) passed through
        if m is None:
            if lp.dim() != 1:
                raise ValueError("without a mask, log-probs must be summed per sequence (N,), "
                                 f"got shape {tuple(lp.shape)}")
            return lp
        m = m.to(lp.dtype)  # (N, T)
        total = (lp * m).sum(-1)  # (N,)
        return total / m.sum(-1).clamp(min=1) if length_normalize else total

    c, ref_c = seq_logp(policy_chosen, chosen_mask), seq_logp(ref_chosen, chosen_mask)  # (N,)
    r = seq_logp(policy_rejected, rejected_mask)  # (N,)
    ref_r = seq_logp(ref_rejected, rejected_mask)  # (N,)
    # DPO Eq. 7: L = -log sigmoid(beta * ((log pi_c - log ref_c) - (log pi_r - log ref_r)))
    chosen_reward = beta * (c - ref_c)  # (N,) implicit reward, DPO Sec. 5
    rejected_reward = beta * (r - ref_r)  # (N,)
    margin = chosen_reward - rejected_reward  # (N,)
    loss = -torch.nn.functional.logsigmoid(margin).mean()  # ()
    with torch.no_grad():
        stats = {
            "reward_margin": margin.mean().item(),
            "chosen_reward": chosen_reward.mean().item(),
            "rejected_reward": rejected_reward.mean().item(),
            "accuracy": (margin > 0).float().mean().item(),
        }
    return loss, stats


@dataclass
class Rollout:
    """G sampled completions for each of B prompts (N = B*G rows, groups contiguous)."""
    prompts: dict  # model inputs, each prompt repeated G times
    completion_ids: torch.Tensor  # (N, T)
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    texts: list  # N decoded completions
    rewards: torch.Tensor  # (N,)
    old_logp: torch.Tensor | None  # (N, T) sampling policy, when updates reuse the rollout
    ref_logp: torch.Tensor | None  # (N, T) reference policy, when the KL term is on


def rollout(policy, images, text, G: int, reward_fn, max_new_tokens: int, temperature: float = 1.0,
            ref="none", need_old_logp: bool = False) -> Rollout:
    """Sample G completions per study, score them, and record the log-probs the loss needs.

    reward_fn(texts, owners) -> N rewards, where owners[n] = n // G is the study (0..B-1) that
    completion n answers. ref: "none" (beta = 0), "lora" (the policy with its LoRA switched
    off: no second copy in memory) or another policy object (a frozen copy)."""
    prompts = policy.repeat(policy.prompt_batch(images, text), G)
    ids, mask = policy.generate(prompts, max_new_tokens, temperature)  # (N, T), (N, T)
    texts = policy.decode(ids, mask)
    owners = [n // G for n in range(len(texts))]
    rewards = torch.as_tensor(reward_fn(texts, owners), dtype=torch.float32, device=ids.device)  # (N,)
    if rewards.shape != (len(texts),):
        raise ValueError(f"reward_fn returned shape {tuple(rewards.shape)}, expected ({len(texts)},)")
    old_logp = ref_logp = None
    with torch.no_grad():
        if need_old_logp:
            old_logp = policy.completion_logprobs(prompts, ids, mask, temperature)
        if ref == "lora":
            if not any(isinstance(m, LoRALinear) for m in policy.model.modules()):
                raise ValueError('rollout(ref="lora"): the policy has no LoRA layers, so its "LoRA off" '
                                 "reference would be the policy itself (KL 0); pass a frozen copy instead")
            with lora_disabled(policy.model):
                ref_logp = policy.completion_logprobs(prompts, ids, mask, temperature)
        elif isinstance(ref, str) and ref != "none":
            raise ValueError(f'rollout: ref must be "none", "lora" or a policy, got {ref!r}')
        elif ref != "none":
            ref_logp = ref.completion_logprobs(prompts, ids, mask, temperature)
    return Rollout(prompts, ids, mask, texts, rewards, old_logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# 7. Running: torchrun, seeding, dtype, logging, checkpoints
# ---------------------------------------------------------------------------------------------
# The same script runs under `python script.py` (one process) and under
# `torchrun --nproc_per_node=N script.py`, which sets RANK, WORLD_SIZE and LOCAL_RANK (as
# nanoGPT's train.py). Rank 0 is the master: it alone logs, shows the bar and writes files.
@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    is_main: bool = True
    backend: str | None = None  # "nccl" or "gloo" under torchrun, None for one process


def resolve_device(device_arg: str = "auto") -> torch.device:
    """`--device auto|cpu|cuda|cuda:N`; auto picks CUDA when there is one."""
    if device_arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_arg)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device_arg}: CUDA is not available on this machine (use --device cpu)")
    return device


def setup_distributed(device_arg: str = "auto") -> Dist:
    """One process when RANK is unset; under torchrun, join the process group (NCCL on CUDA,
    gloo on CPU) and give each rank the GPU of its local rank."""
    device = resolve_device(device_arg)
    if "RANK" not in os.environ:
        return Dist(device=device)
    import torch.distributed as tdist
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per process, whatever index was asked
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not tdist.is_initialized():
        # NCCL's default watchdog kills a collective after 10 minutes; rank 0 alone sometimes works
        # longer while the others wait (measuring difficulty, probes, evaluation on MIMIC-CXR)
        from datetime import timedelta
        minutes = float(os.environ.get("RRG_DIST_TIMEOUT_MIN", 120))
        tdist.init_process_group(backend=backend, timeout=timedelta(minutes=minutes))
    return Dist(rank, world_size, local_rank, device, rank == 0, backend)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def cleanup_distributed():
    if _distributed():
        torch.distributed.destroy_process_group()


def _collective_device() -> torch.device:
    """NCCL reduces tensors on the GPU only; gloo on the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(x):
    """Mean over ranks of a number, a tensor or a dict of numbers (one collective; every rank
    must pass the same keys in the same order). For logging: returns python floats."""
    if isinstance(x, dict):
        values = all_reduce_mean(torch.tensor([float(v) for v in x.values()], dtype=torch.float64))  # (K,)
        return dict(zip(x.keys(), values))
    t = torch.as_tensor(x, dtype=torch.float64).detach().clone()
    if _distributed():
        t = t.to(_collective_device())
        torch.distributed.all_reduce(t)
        t /= torch.distributed.get_world_size()
    t = t.cpu()
    return t.item() if t.dim() == 0 else t.tolist()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s python object on every rank (e.g. a run name or an eval decision)."""
    if not _distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, src: int = 0):
    """Copy rank `src`'s parameters and buffers to every rank. DDP does this when it wraps a
    model; code that averages gradients itself (all_reduce_gradients) must do it once after
    building the model, or ranks seeded apart start from different weights."""
    if not _distributed():
        return
    for t in list(model.parameters()) + list(model.buffers()):
        torch.distributed.broadcast(t.data, src=src)


def all_reduce_gradients(params, world_size: int, bucket_numel: int = 25_000_000):
    """Average the gradients of `params` over ranks, as DDP does, in flat buckets of at most
    `bucket_numel` elements (one all_reduce each). We call it explicitly after backward instead
    of wrapping the model in DDP: the policies run sub-modules and generate(), which DDP's
    forward hook never sees. A trainable parameter without a gradient this step (a frozen
    path, an unused head) sends zeros, so every rank makes the same collective calls."""
    if world_size == 1:
        return
    import torch.distributed as tdist
    params = list(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for i, p in enumerate(params):
        bucket.append(p)
        size += p.numel()
        if size >= bucket_numel or i == len(params) - 1:
            flat = torch.cat([q.grad.flatten() for q in bucket])  # (size,)
            tdist.all_reduce(flat)
            flat /= world_size
            offset = 0
            for q in bucket:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
            bucket, size = [], 0


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (all CUDA devices too) with seed + rank, so ranks draw
    different samples (nanoGPT's seed offset). Build models before offsetting, or broadcast
    them, if every rank must start from the same weights. Returns the seed used."""
    seed = seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


# Mixed precision. `--dtype fp32|bf16|fp16|auto`: weights stay fp32, matmuls run in the lower
# precision under torch.autocast. fp16 needs a torch.amp.GradScaler("cuda") against underflow;
# bf16 does not. On CPU only bf16 is offered (CPU autocast's fp16 is slow and patchy).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(flag: str, device) -> torch.dtype:
    """`--dtype` flag -> torch dtype, checked against the device; auto = bf16 where the GPU has
    it, else fp32."""
    device = torch.device(device)
    if flag == "auto":
        flag = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if flag not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES) + ['auto']}, got {flag!r}")
    if flag == "fp16" and device.type != "cuda":
        raise ValueError(f"--dtype fp16 needs a CUDA device, got {device}; use bf16 or fp32")
    if flag == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("--dtype bf16: this GPU has no bf16 support; use fp16 or fp32")
    return DTYPES[flag]


def autocast(device, flag: str):
    """Context for the forward passes: torch.autocast in bf16/fp16, nothing for fp32."""
    dtype = resolve_dtype(flag, device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


# Logging: one tqdm bar and one JSONL line per log step, on rank 0 only (as CleanRL and
# lm-human-preference-details: the other ranks get a logger that does nothing).
class RunLog:
    """tqdm bar over the run's steps with the latest scalars, and `out_dir/metrics.jsonl`
    with one {"step", "time", **scalars} line per call ("time": seconds since the start).
    The file is appended to, so a resumed run continues it."""

    def __init__(self, out_dir, total_steps: int, is_main: bool = True, start_step: int = 0, desc: str = "train"):
        self.is_main = is_main
        if not is_main:
            return
        from tqdm.auto import tqdm
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)

    def log(self, step: int, **scalars):
        if not self.is_main:
            return
        row = {"step": step, "time": round(time.time() - self.start, 3)}
        row.update({k: float(v) for k, v in scalars.items()})  # tensors and numpy numbers too
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.bar.update(max(0, step - self.bar.n))
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in row.items() if k not in ("step", "time")}, refresh=False)

    def close(self):
        if self.is_main:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def config_dict(args) -> dict:
    """A dataclass, argparse Namespace or dict as JSON-ready values (paths become strings)."""
    if is_dataclass(args):
        d = asdict(args)
    elif isinstance(args, dict):
        d = dict(args)
    else:
        d = vars(args)
    return json.loads(json.dumps(d, default=str))


def check_resume_config(out_dir, args, may_change=("resume", "steps", "epochs", "eval_every", "log_every", "device")):
    """--resume with other flags than the run had would quietly train something else: compare
    the Args with out_dir/config.json and raise naming every difference. Fields in
    `may_change` may differ (a longer run, another logging rhythm, another device)."""
    path = Path(out_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {path} not found; is --out the folder of the run to resume?")
    saved, now = json.loads(path.read_text()), config_dict(args)
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} in the run, {v!r} now" for k, v in now.items()
            if k not in may_change and saved.get(k) != v]
    if diff:
        raise ValueError(f"--resume with flags that differ from {path}: {'; '.join(diff)}. Resume with the run's "
                         "flags, or start a new --out")


def exact_div(a: int, b: int, what: str) -> int:
    """a / b for batch arithmetic that must come out whole (lm-human-preference-details' helper)."""
    if b <= 0 or a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def save_config(out_dir, args) -> Path:
    """out_dir/config.json: the full configuration of the run (call it on the master only).
    Written to a temporary file and renamed, so a reader never sees half a file."""
    path = Path(out_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config_dict(args), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def barrier():
    """Wait for every rank (nothing to wait for in one process)."""
    if _distributed():
        torch.distributed.barrier()


def start_run(out_dir, args, dist, may_change=None) -> Path:
    """The run's folder with its config.json. Under --resume every rank first compares the flags
    with the saved config.json (check_resume_config, `may_change` as there); once all have read
    it, rank 0 writes the new one."""
    out = Path(out_dir)
    if getattr(args, "resume", False):
        check_resume_config(out, args, **({} if may_change is None else {"may_change": may_change}))
    barrier()
    if dist.is_main:
        save_config(out, args)
    barrier()
    return out


# Checkpoints. One file, `out/last.pt`, overwritten atomically (torch.save to a temporary file
# in the same folder, then os.replace), so a crash mid-save leaves the previous checkpoint.
# RNG choice: every rank's RNG states (python, numpy, torch, its own CUDA device) are gathered
# to rank 0 and saved, and on resume each rank gets its own back, so a resumed run draws the
# same samples and dropout masks as an uninterrupted one, on every rank. If the world size
# changed, exact resume is impossible anyway: the RNG is left as seed_everything set it, with a
# warning. Data order is the sampler's business (study_batches resumes from its step).
def rng_state() -> dict:
    """This process's RNG states, as plain tensors and lists (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one per rank
    return state


def set_rng_state(state: dict):
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(x):
    """random.setstate wants the nested tuples random.getstate gave, whatever the round trip made of them."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_checkpoint(path, model, optimizer=None, scheduler=None, step: int = 0, extra: dict | None = None,
                    config=None, trainable_only: bool = False):
    """Save everything a resume needs to `path` (scripts use out/last.pt). Call it on EVERY
    rank: the RNG states are gathered (a collective), rank 0 alone writes, and all ranks wait
    for the file. `extra`: the method's own state (a curriculum's counters, a baseline ...) as
    plain python values and tensors. `config`: the run's Args, saved with the weights.
    trainable_only: keep only the parameters that train (LoRA adapters of a 7B model: MBs,
    not 15 GB); the frozen rest is what the model was built from, and must be again."""
    states = [rng_state()]
    if _distributed():
        states = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, rng_state())
    if not _distributed() or torch.distributed.get_rank() == 0:
        state = model.state_dict()
        if trainable_only:
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trainable}
        ckpt = {"step": step, "model": state, "trainable_only": trainable_only,
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": states, "extra": extra or {}, "config": config_dict(config) if config is not None else None}
        atomic_save(ckpt, Path(path))
    if _distributed():
        torch.distributed.barrier()  # nobody reads or overwrites it before it is complete


def atomic_save(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX and Windows when in the same folder
    finally:
        if os.path.exists(tmp):  # only when saving failed
            os.remove(tmp)


def load_checkpoint(path, model, optimizer=None, scheduler=None, map_location="cpu"):
    """Restore model, optimizer, scheduler and this rank's RNG states from `path` (a file, or
    a folder holding last.pt). Returns (step, extra). A LoRA model needs apply_lora before
    loading, so the parameter names match."""
    path = Path(path)
    if path.is_dir():
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (--resume takes a checkpoint file or its run folder)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        reason = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"{path} is not a readable checkpoint (truncated, or not written by save_checkpoint): "
                         f"{type(e).__name__} {reason}") from e
    if ckpt.get("trainable_only"):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        unknown, absent = set(ckpt["model"]) - set(model.state_dict()), trainable - set(ckpt["model"])
        if unknown or absent:
            raise ValueError(f"{path} holds the trainable parameters of another model set-up (not in this model: "
                             f"{sorted(unknown)[:5]}; trainable here but not saved: {sorted(absent)[:5]}); resume "
                             "with the flags of the run that wrote it")
        model.load_state_dict(ckpt["model"], strict=False)
    else:
        model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    rank = torch.distributed.get_rank() if _distributed() else 0
    world_size = torch.distributed.get_world_size() if _distributed() else 1
    if len(ckpt["rng"]) == world_size:
        set_rng_state(ckpt["rng"][rank])
    elif rank == 0:
        log.warning("checkpoint %s was saved by %d processes, now %d: RNG states not restored, the "
                    "resumed run will not draw the same samples as an uninterrupted one",
                    path, len(ckpt["rng"]), world_size)
    return ckpt["step"], ckpt["extra"]


# ---------------------------------------------------------------------------------------------
# 8. Command line
# ---------------------------------------------------------------------------------------------
def read_generations(path) -> list[dict]:
    """generations.jsonl: one {"id", "reference", "generated", ...} object per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"generations file not found: {path}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        for key in ("reference", "generated"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path}:{n}: field {key!r} missing or not a string (line has {sorted(row)})")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no generations in the file")
    return rows


def parse_args(args_class, argv=None, description: str | None = None):
    """Every script's command line, built from its `Args` dataclass: one `--flag-name` per
    field, typed from the annotation (`int`, `float`, `str`, `X | None`; a bool becomes
    `--flag` / `--no-flag`), its help the comment after the field in the source, so a knob
    is written down once. Returns an `args_class` instance."""
    import inspect
    helps = dict(re.findall(r"^\s+(\w+)\s*:[^=\n]*=[^#\n]*#\s*(.*)$", inspect.getsource(args_class), flags=re.M))
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    casts = {"int": int, "float": float, "str": str}
    for f in args_class.__dataclass_fields__.values():
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        flag, default = "--" + f.name.replace("_", "-"), f.default
        help_ = f"{helps.get(f.name, '')} (default: {default})".replace("%", "%%")  # argparse formats help with %
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        base = kind.replace("| None", "").strip()
        if base not in casts:
            raise TypeError(f"{args_class.__name__}.{f.name}: parse_args handles int, float, str, bool "
                            f"(optionally | None), not {kind}")
        p.add_argument(flag, type=casts[base], default=default, help=help_)
    return args_class(**vars(p.parse_args(argv)))


class LabelCache:
    """A labeler that labels each distinct text once: the G copies of a reference in a step,
    repeated completions, and texts scored for a reward and again for the CE metrics. Make
    one per step or evaluation, so it stays small."""

    def __init__(self, labeler):
        self.labeler, self.labels = labeler, {}

    def __call__(self, texts: list[str]) -> np.ndarray:
        new = [t for t in dict.fromkeys(texts) if t not in self.labels]
        if new:
            self.labels.update(zip(new, self.labeler(new)))
        return np.array([self.labels[t] for t in texts]).reshape(len(texts), len(CHEXPERT_LABELS))  # (N, 14)


def make_labeler(name: str, chexbert_weights=None, device="cpu"):
    """`--labeler rule|chexbert` of every script."""
    if name == "rule":
        return RuleLabeler()
    if name == "chexbert":
        return CheXbertLabeler(weights=chexbert_weights, device=device)
    raise ValueError(f"--labeler must be 'rule' or 'chexbert', got {name!r}")


def evaluate_generations(rows: list[dict], labeler, clean: str | None = "mimic_cxr", uncertain_as: int = 1,
                         meteor="auto") -> dict:
    """NLG metrics on cleaned text (R2Gen convention) and CE metrics from the labels of the raw
    generated and reference reports."""
    hyps = [r["generated"] for r in rows]
    refs = [r["reference"] for r in rows]
    n_empty = sum(not h.strip() for h in hyps)
    if n_empty:
        log.warning("%d of %d generated reports are empty: they score 0 on every metric", n_empty, len(hyps))
    if clean is not None:
        hyps_c = [clean_report(h, clean) if h.strip() else "" for h in hyps]
        refs_c = [clean_report(r, clean) for r in refs]
    else:
        hyps_c, refs_c = hyps, refs
    results = {"n": len(rows), "n_empty_generations": n_empty, "clean": clean,
               "labeler": type(labeler).__name__, "uncertain_as": uncertain_as}
    results["nlg"] = nlg_metrics(hyps_c, refs_c, meteor=meteor)
    results["ce"] = ce_metrics(labeler(hyps), labeler(refs), uncertain_as=uncertain_as)
    return results


def format_table(results: dict) -> str:
    nlg, ce = results["nlg"], results["ce"]
    lines = [f"{results['n']} reports, labeler {results['labeler']}, uncertain counted as {results['uncertain_as']}",
             "  ".join(f"{k} {v:.4f}" for k, v in nlg.items() if isinstance(v, float))]
    for conv in ("micro", "macro", "example"):
        lines.append(f"CE {conv:8s} P {ce[f'{conv}_precision']:.4f}  R {ce[f'{conv}_recall']:.4f}  F1 {ce[f'{conv}_f1']:.4f}")
    lines.append(f"CE 5-label micro F1 {ce['5label_micro_f1']:.4f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="rrg-from-scratch shared tools")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("evaluate", help="score a generations.jsonl file (NLG + CE metrics)")
    e.add_argument("--generations", required=True, help="JSONL with 'reference' and 'generated' per line")
    e.add_argument("--labeler", default="rule", choices=["rule", "chexbert"])
    e.add_argument("--chexbert-weights", default=None, help="local chexbert.pth (else downloaded once)")
    e.add_argument("--clean", default="mimic_cxr", choices=["mimic_cxr", "iu_xray", "plain", "none"],
                   help="text normalisation before NLG metrics (R2Gen's cleaning by default)")
    e.add_argument("--uncertain-as", type=int, default=1, choices=[0, 1], help="CE: count uncertain as positive (1) or not")
    e.add_argument("--no-meteor", action="store_true", help="skip METEOR (needs Java + pycocoevalcap)")
    e.add_argument("--out", default=None, help="JSON output (default: next to the generations file)")
    s = sub.add_parser("synthetic", help="write the synthetic chest X-ray set (R2Gen layout)")
    s.add_argument("--out", required=True)
    s.add_argument("--n-train", type=int, default=2000)
    s.add_argument("--n-val", type=int, default=200)
    s.add_argument("--n-test", type=int, default=500)
    s.add_argument("--size", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _run_command(args)
    except (FileNotFoundError, ValueError) as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None


def _run_command(args):
    if args.command == "evaluate":
        rows = read_generations(args.generations)
        labeler = make_labeler(args.labeler, args.chexbert_weights)
        results = evaluate_generations(rows, labeler, None if args.clean == "none" else args.clean,
                                       args.uncertain_as, meteor=False if args.no_meteor else "auto")
        out = Path(args.out) if args.out else Path(args.generations).with_name("eval.json")
        out.write_text(json.dumps(results, indent=2))
        print(format_table(results))
        print(f"wrote {out}")
    elif args.command == "synthetic":
        path = make_synthetic(args.out, args.n_train, args.n_val, args.n_test, args.size, args.seed)
        print(f"wrote {path / 'annotation.json'} and {args.n_train + args.n_val + args.n_test} images")


if __name__ == "__main__":
    main()
