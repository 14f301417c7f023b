"""The synthetic sandbox: the set `--data synthetic` reads, the CheXbert that labels it and the foundation its tiny
model starts from; common.sandbox() imports this file only when a run asks for one of them (start), never on real
data.

The set: chest-radiograph-like images drawn by code (draw_synthetic_cxr), one visible sign per finding, and reports
from templates (write_synthetic_report), deterministic from a seed: a sandbox, not a benchmark. What the papers start
from, trained once and shipped in tests/sandbox_models/: a CheXbert of f1chexbert's class trained on the synthetic
reports (the papers' labeler), and a foundation (the tiny VLM trained on captions of images and on report text that
never meet; a small BERT on report text: a pre-trained VLM's and ClinicalBERT's stand-ins).

    python tests/sandbox.py synthetic --out DIR     # the synthetic set (R2Gen's layout) in a folder
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm.auto import trange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as `python tests/sandbox.py`
import common

# Synthetic chest X-ray set (README, "The sandbox"): a visible sign and templated sentences per finding.
# finding: (prevalence, chance that it is mentioned as negative when absent, else it goes unmentioned)
SYNTHETIC_RATES = {
    "Support Devices": (0.29, 0.0),
    "Pleural Effusion": (0.23, 0.7),
    "Lung Opacity": (0.22, 0.2),
    "Atelectasis": (0.20, 0.1),
    "Cardiomegaly": (0.19, 0.6),
    "Edema": (0.12, 0.4),
    "Pneumonia": (0.07, 0.25),
    "Consolidation": (0.05, 0.6),
    "Pneumothorax": (0.045, 0.7),
    "Enlarged Cardiomediastinum": (0.035, 0.4),
    "Lung Lesion": (0.03, 0.15),
    "Fracture": (0.02, 0.25),
    "Pleural Other": (0.015, 0.05),
}
SYNTHETIC_P_UNCERTAIN = 0.15  # of present findings, reported with a hedge (drawn fainter)
# the findings in a lung, on a side
SIDED = set(common.FINDINGS) - {"Enlarged Cardiomediastinum", "Cardiomegaly", "Edema", "Support Devices"}
BILATERAL_OK = {"Lung Opacity", "Atelectasis", "Pleural Effusion"}
GRADED = {"Pleural Effusion", "Pneumothorax", "Cardiomegaly"}
DEGREES = {"small": ("mild", "mildly"), "moderate": ("moderate", "moderately"), "large": ("severe", "severely")}
DEVICE_KINDS = ["endotracheal tube", "central venous catheter", "nasogastric tube", "pacemaker"]
# Sentence templates, variants separated by " | ". Fields: {side} left/right/bilateral, {sev} small/moderate/large,
# {deg} mild/..., {degly} mildly/...; {Side} at a sentence start. One finding per sentence: labels follow from them.
POSITIVE_TEMPLATES = {
    "Enlarged Cardiomediastinum": "The mediastinum is widened. | There is widening of the mediastinum. | "
    "The cardiomediastinal silhouette is enlarged. | Mediastinal widening is present.",
    "Cardiomegaly": "The heart is {degly} enlarged. | There is {deg} cardiomegaly. | {Deg} cardiomegaly. | "
    "The cardiac silhouette is {degly} enlarged.",
    "Lung Opacity": "There is a hazy opacity in the {side} lung. | Hazy {side} lung opacity. | "
    "An ill-defined opacity projects over the {side} lung.",
    "Lung Lesion": "There is a nodule in the {side} lung. | A rounded {side} lung nodule is seen. | "
    "A {side} lung mass is present.",
    "Edema": "There is mild pulmonary edema. | Mild pulmonary edema. | The lungs show interstitial edema.",
    "Consolidation": "There is dense consolidation in the {side} lower lobe. | "
    "Dense {side} lower lobe consolidation. | Consolidation is present in the {side} lung.",
    "Pneumonia": "Patchy {side} lower lobe pneumonia. | There is patchy pneumonia in the {side} lung. | "
    "Patchy airspace findings represent {side} pneumonia.",
    "Atelectasis": "There is plate-like atelectasis at the {side} base. | {Side} basilar atelectasis. | "
    "Linear atelectasis is seen at the {side} base.",
    "Pneumothorax": "There is a {sev} {side} pneumothorax. | {Sev} {side} apical pneumothorax. | "
    "A {sev} {side} pneumothorax is present.",
    "Pleural Effusion": "There is a {sev} {side} pleural effusion. | {Sev} {side} pleural effusion. | "
    "A {sev} {side} pleural effusion is present.",
    "Pleural Other": "There is {side} pleural thickening. | {Side} pleural thickening is noted.",
    "Fracture": "There is a displaced {side} rib fracture. | A {side} rib fracture is seen.",
    "endotracheal tube": "An endotracheal tube is in standard position. | "
    "The endotracheal tube terminates above the carina.",
    "central venous catheter": "A right internal jugular central venous catheter ends in the lower SVC. | "
    "A central venous catheter is in place.",
    "nasogastric tube": "A nasogastric tube courses below the diaphragm. | The nasogastric tube ends in the stomach.",
    "pacemaker": "A left chest wall pacemaker is in place with leads in the right heart. | "
    "A dual-lead pacemaker is present.",
}
UNCERTAIN_TEMPLATES = {
    "Enlarged Cardiomediastinum": "Possible mediastinal widening. | The mediastinum may be widened.",
    "Cardiomegaly": "Possible {deg} cardiomegaly. | The heart is likely {degly} enlarged. | "
    "Probable {deg} cardiomegaly.",
    "Lung Opacity": "Possible faint opacity in the {side} lung. | Questionable {side} lung opacity.",
    "Lung Lesion": "Possible small nodule in the {side} lung. | Questionable {side} lung nodule.",
    "Edema": "Possible mild pulmonary edema. | Mild pulmonary edema cannot be excluded.",
    "Consolidation": "Possible {side} lower lobe consolidation. | "
    "Subtle consolidation in the {side} lung cannot be excluded.",
    "Pneumonia": "Findings are concerning for early {side} pneumonia. | Possible {side} pneumonia. | "
    "Cannot exclude pneumonia in the {side} lung.",
    "Atelectasis": "Probable {side} basilar atelectasis. | Possible minimal atelectasis at the {side} base.",
    "Pneumothorax": "Possible tiny {side} apical pneumothorax. | A tiny {side} pneumothorax cannot be excluded.",
    "Pleural Effusion": "Possible {sev} {side} pleural effusion. | A trace {side} pleural effusion is not excluded.",
    "Pleural Other": "Possible {side} pleural thickening.",
}
NEGATED_PHRASES = {  # the noun phrase of a finding listed as absent
    "Enlarged Cardiomediastinum": "mediastinal widening",
    "Lung Opacity": "focal opacity",
    "Lung Lesion": "suspicious pulmonary nodule",
    "Edema": "pulmonary edema",
    "Consolidation": "focal consolidation",
    "Pneumonia": "pneumonia",
    "Atelectasis": "atelectasis",
    "Pneumothorax": "pneumothorax",
    "Pleural Effusion": "pleural effusion",
    "Pleural Other": "pleural thickening",
    "Fracture": "acute rib fracture",
}
NEGATED_SINGLE = {  # findings that also have a negative sentence of their own
    "Cardiomegaly": "Heart size is normal. | The heart is not enlarged. | Normal heart size. | "
    "The cardiac silhouette is within normal limits.",
    "Enlarged Cardiomediastinum": "The mediastinal contours are normal. | "
    "The cardiomediastinal silhouette is within normal limits.",
    "Pneumothorax": "Pneumothorax is not seen. | No pneumothorax is identified.",
    "Fracture": "No displaced fracture is seen.",
}
NEGATED_LIST_TEMPLATES = "No {list}. | There is no {list}. | No evidence of {list}."
NORMAL_EXTRAS = "No acute cardiopulmonary process. | The lungs are clear. | The osseous structures are unremarkable."


def sample_synthetic_study(rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """One study's findings, {label: attrs} (side, severity, device kind, uncertain), and its (14,) labels."""
    labels = np.full(len(common.CHEXPERT_LABELS), np.nan)
    findings = {}
    for name in common.FINDINGS:
        prevalence, p_negated = SYNTHETIC_RATES[name]
        if rng.random() < prevalence:
            uncertain = name not in ("Support Devices", "Fracture") and rng.random() < SYNTHETIC_P_UNCERTAIN
            a = findings[name] = {"uncertain": bool(uncertain)}
            if name in SIDED:
                a["side"] = str(rng.choice(["left", "right"] + (["bilateral"] if name in BILATERAL_OK else [])))
            if name in GRADED:
                a["severity"] = str(rng.choice(["small", "moderate", "large"]))
            if name == "Support Devices":
                a["kind"] = str(rng.choice(DEVICE_KINDS))
            labels[common.LABEL_INDEX[name]] = common.UNCERTAIN if a["uncertain"] else common.POSITIVE
        elif rng.random() < p_negated:
            labels[common.LABEL_INDEX[name]] = common.NEGATIVE
    return findings, common.apply_no_finding_rule(labels)


def write_synthetic_report(findings: dict, labels: np.ndarray, rng: np.random.Generator) -> str:
    """A study's report: a sentence per finding in FINDINGS order, then the negated in "No A, B, or C." sentences."""

    def pick(variants: str) -> str:
        return str(rng.choice(variants.split(" | ")))

    sentences, negated = [], []
    for name in common.FINDINGS:
        a = findings.get(name)
        if name == "Support Devices" and a:
            sentences.append(pick(POSITIVE_TEMPLATES[a["kind"]]))
        elif a:
            deg, degly = DEGREES[a.get("severity", "small")]
            fields = {"side": a.get("side", ""), "sev": a.get("severity", ""), "deg": deg, "degly": degly}
            fields |= {k.capitalize(): v.capitalize() for k, v in fields.items()}
            text = pick((UNCERTAIN_TEMPLATES if a["uncertain"] else POSITIVE_TEMPLATES)[name]).format(**fields)
            text = text.replace("the bilateral lung", "both lungs").replace("the bilateral base", "both bases")
            sentences.append(text)
        elif labels[common.LABEL_INDEX[name]] == common.NEGATIVE:
            if name in NEGATED_SINGLE and (name not in NEGATED_PHRASES or rng.random() < 0.5):
                sentences.append(pick(NEGATED_SINGLE[name]))
            else:
                negated.append(name)
    rng.shuffle(negated)
    while negated:
        k = int(rng.integers(1, 5))
        phrases, negated = [NEGATED_PHRASES[n] for n in negated[:k]], negated[k:]
        if len(phrases) == 1:
            items = phrases[0]
        else:
            items = ", ".join(phrases[:-1]) + (", or " if len(phrases) > 2 else " or ") + phrases[-1]
        sentences.append(pick(NEGATED_LIST_TEMPLATES).format(list=items))
    if labels[common.LABEL_INDEX["No Finding"]] == 1 and (not sentences or rng.random() < 0.5):
        sentences.append(pick(NORMAL_EXTRAS))
    return " ".join(s[0].upper() + s[1:] for s in sentences)


# Drawing the synthetic radiograph, numpy only. Coordinates 0..1: x the column, y the row; patient's right on the left.
def draw_synthetic_cxr(findings: dict, rng: np.random.Generator, size: int = 128) -> np.ndarray:
    """A (size, size) uint8 frontal radiograph with one visible sign per finding ({label: attrs}), hedged ones
    fainter. The per-image variation is drawn from `rng` first: adding a finding changes only its region."""

    def U(a, b):
        return float(rng.uniform(a, b))

    def sides(name):
        """The finding's sides: -1 the patient's right, 1 the left."""
        return {"right": (-1,), "left": (1,), "bilateral": (-1, 1)}[findings[name].get("side", "bilateral")]

    def ramp(d, edge):
        """0 below d = 0, 1 above, linear across a band `edge` wide."""
        return np.clip(d / edge + 0.5, 0.0, 1.0)

    def gauss(cx, cy, sx, sy):
        return np.exp(-0.5 * ((x - cx) / sx) ** 2 - 0.5 * ((y - cy) / sy) ** 2)

    def radius(cx, cy, a, b):
        return np.sqrt(((x - cx) / a) ** 2 + ((y - cy) / b) ** 2)

    def line(d, sigma):
        return np.exp(-0.5 * (d / sigma) ** 2)

    def rib_coordinate(cx, cy):
        """Ribs descend laterally; an integer value is the centre of a rib."""
        return (cy - 0.14 * (abs(cx - 0.5) / 0.35) ** 2) / rib_sp + rib_ph

    soft = {n: 0.6 if a.get("uncertain") else 1.0 for n, a in findings.items()}
    grade = {n: ("small", "moderate", "large").index(a["severity"]) for n, a in findings.items() if "severity" in a}
    dx, dy, zoom = U(-0.03, 0.03), U(-0.03, 0.03), U(0.92, 1.04)  # position and zoom
    t = np.arange(size, dtype=np.float32) / (size - 1) - 0.5
    x, y = ((t - dx) / zoom + 0.5)[None, :], ((t - dy) / zoom + 0.5)[:, None]  # anatomical coordinates
    px = 1.0 / (zoom * (size - 1))  # one pixel
    lw = max(0.006, 0.8 * px)  # sigma of thin lines, at least about a pixel
    lx, ly, ax, ay = U(0.19, 0.21), U(0.43, 0.45), U(0.145, 0.165), U(0.28, 0.32)  # lung centres and half-axes
    heart_w, medi_w, rib_sp, rib_ph = U(0.14, 0.155), U(0.05, 0.06), U(0.07, 0.08), U(0.0, 1.0)
    contrast, bright = U(0.85, 1.15), U(-0.06, 0.06)
    noise = U(0.01, 0.03) * rng.standard_normal((size, size), dtype=np.float32)
    # Normal anatomy: the body, two dark lung fields with diaphragm domes (the right one higher)
    img = 0.03 + 0.47 * ramp((1 - radius(0.5, 0.62, 0.47, 0.6)) * 0.47, 0.02)
    L = {}
    for s in (-1, 1):
        cx = 0.5 + s * lx
        r = radius(cx, ly, ax, ay)
        dome = ly + 0.8 * ay - 0.07 * (1 - np.clip((x - cx) / ax, -1, 1) ** 2) - (0.02 if s < 0 else 0.0)
        thorax = ramp((1 - r) * ax, 0.012)  # the lung with its costophrenic recess
        L[s] = dict(cx=cx, r=r, dome=dome, thorax=thorax, lung=thorax * ramp(dome - y, 0.012))
        img += (0.16 - img) * L[s]["lung"]
    lungs = L[-1]["lung"] + L[1]["lung"]
    if "Lung Opacity" in findings:  # a large faint hazy patch
        a = soft["Lung Opacity"]
        for s in sides("Lung Opacity"):
            sd = U(0.07, 0.1) * (0.85 + 0.15 * a)
            patch = gauss(L[s]["cx"] + s * U(-0.3, 0.3) * ax, ly + U(-0.3, 0.3) * ay, sd, 1.3 * sd)
            img += 0.22 * a * patch * L[s]["lung"]
    if "Edema" in findings:  # bilateral perihilar haze
        img += 0.2 * soft["Edema"] * sum(gauss(0.5 + s * 0.12, ly + 0.05, 0.09, 0.13) * L[s]["lung"] for s in (-1, 1))
    if "Consolidation" in findings:  # a dense, homogeneous lower-zone area
        s, a = sides("Consolidation")[0], soft["Consolidation"]
        r = radius(L[s]["cx"] + s * U(0, 0.2) * ax, ly + U(0.3, 0.4) * ay, 0.8 * ax, 0.27 * ay)
        img += (0.68 - img) * ramp((1 - r) * 0.08, 0.006) * L[s]["lung"] * 0.9 * a
    if "Pneumonia" in findings:  # patchy blotches, mid and lower zone
        s, a = sides("Pneumonia")[0], soft["Pneumonia"]
        for _ in range(10):
            sd = U(0.016, 0.028) * (0.7 + 0.3 * a)
            strength = a * U(0.15, 0.3)
            blotch = gauss(L[s]["cx"] + s * U(-0.6, 0.7) * ax, ly + U(-0.2, 0.6) * ay, sd, sd)
            img += strength * blotch * L[s]["lung"]
    if "Lung Lesion" in findings:  # a small, round, sharp-edged bright nodule
        s, a = sides("Lung Lesion")[0], soft["Lung Lesion"]
        cx, cy = L[s]["cx"] + s * U(-0.4, 0.6) * ax, ly + U(-0.6, 0.4) * ay
        img += 0.35 * (0.5 + 0.5 * a) * ramp(0.04 * (0.75 + 0.25 * a) - np.sqrt((x - cx) ** 2 + (y - cy) ** 2), 0.01)
    if "Atelectasis" in findings:  # a thin horizontal plate-like line above the dome
        for s in sides("Atelectasis"):
            a = soft["Atelectasis"]
            xc, half = L[s]["cx"] + s * U(-0.2, 0.3) * ax, U(0.07, 0.1) * (0.7 + 0.3 * a)
            d = y - (ly + 0.8 * ay - 0.07 - U(0.05, 0.09) + U(-0.15, 0.15) * (x - xc))
            img += 0.35 * a * line(d, 1.3 * lw) * ramp(half - np.abs(x - xc), 0.02) * L[s]["lung"]
    if "Pneumothorax" in findings:  # a dark rim at the apex and the side: the lung collapsed towards the hilum
        s, a = sides("Pneumothorax")[0], soft["Pneumothorax"]
        c = 0.15 if a < 1 else (0.2, 0.32, 0.45)[grade["Pneumothorax"]]
        ri = radius(L[s]["cx"] - s * 0.5 * c * ax, ly + 0.7 * c * ay, ax * (1 - 0.5 * c), ay * (1 - 0.7 * c))
        img += (0.05 - img) * ramp((ri - 1) * ax * (1 - 0.5 * c), 0.006) * L[s]["lung"] * (0.5 + 0.5 * a)
    # Ribs: faint lines; a fracture breaks one, with a displaced bright fragment
    u = rib_coordinate(x, y)
    rib_w = max(0.011, lw)
    ribs = line((u - np.rint(u)) * rib_sp, rib_w)
    if "Fracture" in findings:
        s = sides("Fracture")[0]
        xf, yf = L[s]["cx"] + s * U(0.25, 0.55) * ax, ly + U(-0.4, 0.3) * ay
        k = float(np.rint(rib_coordinate(xf, yf)))  # the broken rib
        rib_k = line((u - k) * rib_sp, rib_w)
        lateral = ramp(s * (x - xf), 2 * px) * ramp(0.1 - s * (x - xf), 0.02)
        ribs += lateral * (2.5 * line((u - k - 0.4) * rib_sp, rib_w) - rib_k)  # shifted fragment
        ribs = np.maximum(ribs - rib_k * line(x - xf, 2 * lw), 0)  # the gap
    chest = np.maximum(L[-1]["thorax"], L[1]["thorax"])
    img += 0.1 * ribs * (0.4 + 0.6 * np.minimum(lungs, 1)) * chest * ramp(y - 0.08, 0.03)
    # Mediastinum (its upper part wider with Enlarged Cardiomediastinum), trachea, heart (wider with Cardiomegaly)
    wide = 0.05 * soft.get("Enlarged Cardiomediastinum", 0) * line(y - 0.3, 0.1)
    img += (0.72 - img) * ramp(medi_w + wide - np.abs(x - 0.5), 0.01) * ramp(y - 0.08, 0.03) * ramp(0.62 - y, 0.04)
    img += (0.35 - img) * ramp(0.014 - np.abs(x - 0.5), 0.008) * ramp(0.36 - y, 0.02) * 0.7
    if "Cardiomegaly" in findings:
        heart_w *= 1 + (0.25, 0.38, 0.52)[grade["Cardiomegaly"]] * (0.55 + 0.45 * soft["Cardiomegaly"])
    img += (0.72 - img) * ramp((1 - radius(0.5 + 0.3 * heart_w, 0.6, heart_w, 0.12)) * heart_w, 0.01)
    if "Pleural Effusion" in findings:  # fluid at the base, its meniscus rising laterally
        for s in sides("Pleural Effusion"):
            h = (0.08, 0.15, 0.25)[grade["Pleural Effusion"]] * (0.7 + 0.3 * soft["Pleural Effusion"])
            top = ly + 0.8 * ay - h - 0.07 * np.clip(s * (x - L[s]["cx"]) / ax, 0, 1) ** 2
            fluid = ramp(y - top, 0.025) * ramp(L[s]["dome"] + 0.03 - y, 0.03) * L[s]["thorax"]
            img = np.maximum(img, img + (0.66 - img) * fluid)
    if "Pleural Other" in findings:  # a lobulated band along the lateral chest wall, mid zones
        s, a = sides("Pleural Other")[0], soft["Pleural Other"]
        th = (0.03 + 0.012 * a) * (1 + 0.35 * np.sin(y * 45 + U(0, 6.3))) / ax
        band = ramp(L[s]["r"] - 1 + th, 0.05) * L[s]["thorax"] * ramp(s * (x - L[s]["cx"]) - 0.3 * ax, 0.03)
        img += (0.68 - img) * band * ramp(y - ly + 0.55 * ay, 0.05) * ramp(ly + 0.45 * ay - y, 0.05) * (0.6 + 0.4 * a)
    if "Support Devices" in findings:  # thin, very bright tubes along a few segments
        kind = findings["Support Devices"]["kind"]

        def j():
            return U(-0.015, 0.015)

        curves = {  # every kind's points are drawn (rng), one kind's are used
            "endotracheal tube": [[(0.5 + j(), -0.02), (0.5 + j(), 0.12), (0.5, 0.27 + j())]],  # above the carina
            "central venous catheter": [
                [(0.35 + j(), -0.02), (0.42 + j(), 0.14), (0.47, 0.2 + j()), (0.47 + j(), 0.42)]
            ],
            "nasogastric tube": [[(0.49 + j(), -0.02), (0.49, 0.5), (0.5 + j(), 0.85), (0.66 + j(), 0.8 + j())]],
            "pacemaker": [
                [(0.7, 0.21), (0.6 + j(), 0.2), (0.42 + j(), 0.4), (0.45 + j(), 0.52)],
                [(0.7, 0.21), (0.58 + j(), 0.25), (0.44 + j(), 0.5), (0.54 + j(), 0.7 + j())],
            ],
        }[kind]
        tube = np.zeros((size, size), np.float32)
        for points in curves:
            for (x0, y0), (x1, y1) in itertools.pairwise(points):
                t = np.clip(((x - x0) * (x1 - x0) + (y - y0) * (y1 - y0)) / ((x1 - x0) ** 2 + (y1 - y0) ** 2), 0, 1)
                d = np.sqrt((x - x0 - t * (x1 - x0)) ** 2 + (y - y0 - t * (y1 - y0)) ** 2)  # to the segment
                tube = np.maximum(tube, line(d, max(0.008, 0.6 * px)))
        img += (0.97 - img) * tube
        if kind == "pacemaker":  # the generator box on the left upper chest
            bx, by = 0.72 + j(), 0.2 + j()
            img += (1.0 - img) * ramp(0.045 - np.abs(x - bx), 0.01) * ramp(0.03 - np.abs(y - by), 0.01)
    img = (np.clip(img, 0, 1) - 0.5) * contrast + 0.5 + bright + noise  # exposure, then quantum noise
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


# Neutral captions of what draw_synthetic_cxr drew, read by the sandbox's foundation model (README): where, how large,
# how bright, what shape, in the image's own left and right (the patient's right is the image's left); never a report's
# word for a finding, nor a finding's name (tests/test_foundation.py checks the vocabulary against the templates').
IMAGE_SIDES = {"right": "on the left of the image", "left": "on the right of the image", "bilateral": "on both sides"}
CAPTIONS = {  # {pale} / {slightly}: a hedged finding, drawn fainter; {size}: its grade in CAPTION_SIZES
    "Enlarged Cardiomediastinum": "the middle column is {slightly}broad at the top",
    "Cardiomegaly": "the white shape at the bottom of the middle is {slightly}{size}",
    "Lung Opacity": "a {pale}fuzzy cloud {where}",
    "Lung Lesion": "a {pale}little round bright dot {where}",
    "Edema": "a {pale}soft glow around the middle on both sides",
    "Consolidation": "a {pale}solid white area low {where}",
    "Pneumonia": "{pale}scattered blotches {where}",
    "Atelectasis": "a {pale}thin flat stroke low {where}",
    "Pneumothorax": "a {pale}{size} dark rim along the top and outer edge {where}",
    "Pleural Effusion": "a {pale}{size} white pool at the bottom {where}, its edge rising outward",
    "Pleural Other": "a {pale}wavy band along the outer edge {where}",
    "Fracture": "a broken curved stroke with a shifted piece at the outer edge {where}",
    "endotracheal tube": "a thin bright stroke from the top edge down to the middle",
    "central venous catheter": "a thin bright stroke from the top curving in to the middle",
    "nasogastric tube": "a thin bright stroke down the whole middle, turning at the bottom",
    "pacemaker": "a bright box high on the right of the image with two thin bright strokes",
}
CAPTION_SIZES = {
    "Cardiomegaly": ("broad", "very broad", "huge"),
    "Pneumothorax": ("narrow", "broad", "very broad"),
    "Pleural Effusion": ("shallow", "deep", "very deep"),
}
CAPTION_SIGNS = {  # the words that name each finding's sign in a caption: what a generated caption is scored by
    "Enlarged Cardiomediastinum": "middle column",
    "Cardiomegaly": "white shape",
    "Lung Opacity": "fuzzy cloud",
    "Lung Lesion": "round bright dot",
    "Edema": "soft glow",
    "Consolidation": "solid white area",
    "Pneumonia": "scattered blotches",
    "Atelectasis": "flat stroke",
    "Pneumothorax": "dark rim",
    "Pleural Effusion": "white pool",
    "Pleural Other": "wavy band",
    "Fracture": "broken curved stroke",
    "Support Devices": "thin bright stroke|bright box",
}


def describe_synthetic_image(findings: dict) -> str:
    """A caption of the image draw_synthetic_cxr draws for `findings` ({label: attrs}), a sentence per sign."""
    sentences = []
    for name in common.FINDINGS:
        a = findings.get(name)
        if not a:
            continue
        hedged = a.get("uncertain", False)
        template = CAPTIONS[a["kind"] if name == "Support Devices" else name]
        fields = {"pale": "pale " if hedged else "", "slightly": "slightly " if hedged else ""}
        fields["where"] = IMAGE_SIDES[a.get("side", "bilateral")]
        if name in CAPTION_SIZES:
            fields["size"] = CAPTION_SIZES[name][("small", "moderate", "large").index(a.get("severity", "small"))]
        sentences.append(template.format(**fields))
    sentences = sentences or ["nothing stands out"]
    return " ".join(s[0].upper() + s[1:] + "." for s in sentences)


def caption_signs(captions: list[str]) -> np.ndarray:
    """(N, 13) bool: which findings' signs each caption names (CAPTION_SIGNS)."""
    return np.array([[bool(re.search(CAPTION_SIGNS[n], c.lower())) for n in common.FINDINGS] for c in captions])


def make_synthetic(out_dir, n_train=2000, n_val=200, n_test=500, size=128, seed=0) -> Path:
    """The synthetic set in R2Gen's layout (out_dir/images/<id>.png, annotation.json), deterministic from `seed`."""
    (Path(out_dir) / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    annotation = {"train": [], "val": [], "test": []}
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        for k in range(n):
            name = f"{split}_{k:05d}"
            findings, labels = sample_synthetic_study(rng)
            report = write_synthetic_report(findings, labels, rng)
            Image.fromarray(draw_synthetic_cxr(findings, rng, size)).save(Path(out_dir) / "images" / f"{name}.png")
            record = {"id": name, "report": report, "image_path": [f"{name}.png"], "split": split}
            record["labels"] = [None if np.isnan(v) else v for v in labels.tolist()]
            record["findings"] = findings
            annotation[split].append(record)
    (Path(out_dir) / "annotation.json").write_text(json.dumps(annotation, indent=1))
    return Path(out_dir)


def synthetic_data(n_train: int = 2000, n_val: int = 200, n_test: int = 500, size: int = 128, seed: int = 0) -> Path:
    """The synthetic set, made once in $RRG_CACHE (~/.cache/rrg-from-scratch): built aside, renamed into place."""
    cache = Path(os.environ.get("RRG_CACHE", Path.home() / ".cache" / "rrg-from-scratch"))
    final = cache / f"synthetic-v4-{n_train}-{n_val}-{n_test}-{size}px-seed{seed}"
    if not (final / "annotation.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = make_synthetic(tempfile.mkdtemp(dir=cache, prefix=".tmp-"), n_train, n_val, n_test, size, seed)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "annotation.json"


# The sandbox's CheXbert (README): the papers' labeler on --data synthetic, nothing downloaded. Saved as chexbert.pth
# is, with its BERT's config.json and vocab.txt beside it: the same loading code serves it and the real weights.
SPECIAL_PIECES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # BERT's, first, in its order
SANDBOX_CHEXBERT_VERSION = 2  # of the recipe below: a new one trains into a new folder
SANDBOX_CHEXBERT = dict(hidden=128, layers=4, heads=4, epochs=40, lr=2e-3, batch_size=32)
# What makes a CPU run repeat to the bit, on one machine kind and (as measured) across kinds with AVX2: one thread,
# ATen's, MKL's and oneDNN's AVX2 code paths. The sandbox's CheXbert trains under them; so do tests/reproduce.py's runs.
NUMERIC_PINS = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


# The sandbox's trained models ship beside this file, built by `python tests/ship_sandbox.py --write` (under
# NUMERIC_PINS, in build_once's processes): every run on the synthetic set loads these files, and no machine trains them
SHIPPED = Path(__file__).resolve().parent / "sandbox_models"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shipped(name: str) -> Path:
    """tests/sandbox_models/<name>, each of its files checked against MANIFEST.json's digest."""
    files = json.loads((SHIPPED / "MANIFEST.json").read_text())["files"]
    changed = [f for f, digest in files.items() if f.startswith(name + "/") and sha256(SHIPPED / f) != digest]
    if changed or not any(f.startswith(name + "/") for f in files):
        raise ValueError(f"{SHIPPED / name}: {changed or 'not'} as shipped (MANIFEST.json; tests/ship_sandbox.py)")
    return SHIPPED / name


def word_piece_tokenizer(texts: list[str], out_dir: Path):
    """A BERT tokenizer whose word pieces are every word of the texts as BERT splits them, and every character alone
    and as a word's continuation ("##x"), so that an unseen word still gets pieces (a trainer's merges break ties by
    chance); its vocab.txt is written to out_dir."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    from transformers import BertTokenizerFast

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    normalize, split = BertNormalizer(lowercase=True), BertPreTokenizer()
    words = {w for t in texts for w, _ in split.pre_tokenize_str(normalize.normalize_str(t))}
    characters = {c for w in words for c in w}
    pieces = SPECIAL_PIECES + sorted(words | characters | {"##" + c for c in characters})
    (Path(out_dir) / "vocab.txt").write_text("\n".join(pieces) + "\n")
    return BertTokenizerFast.from_pretrained(str(out_dir))


def train_chexbert(records, out_dir, hidden, layers, heads, epochs, lr, batch_size, seed=0) -> Path:
    """CheXbert (f1chexbert's model) trained on the records' reports against their labels: cross-entropy summed over
    the 14 heads, AdamW with a 5 % warm-up then a linear decay. Writes chexbert.pth, config.json, vocab.txt."""
    from transformers import BertConfig

    out_dir = Path(out_dir)
    reports = [r.report for r in records]
    tokenizer = word_piece_tokenizer(reports, out_dir)
    size = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden)
    config = BertConfig(vocab_size=tokenizer.vocab_size, **size)
    config.to_json_file(out_dir / "config.json")
    labels = np.stack([r.labels for r in records])  # (N, 14): 1, 0, -1, NaN
    classes = np.select([labels == 1, labels == 0, labels == -1], [1, 2, 3], 0)  # (N, 14): CheXbert's classes
    no_finding = common.LABEL_INDEX["No Finding"]
    classes[:, no_finding] = labels[:, no_finding] == 1  # its head: blank or positive
    classes = torch.as_tensor(classes)
    ids = [tokenizer(t)["input_ids"][: common.CHEXBERT_MAX_PIECES] for t in reports]
    torch.manual_seed(seed)
    model = common.chexbert_model(config).train()
    total = epochs * math.ceil(len(ids) / batch_size)
    optimizer, scheduler = common.adamw(model.parameters(), lr, total, "linear", warmup=0.05)
    order = torch.Generator().manual_seed(seed)
    for _ in trange(epochs, desc="sandbox CheXbert (epochs)"):
        shuffled = torch.randperm(len(ids), generator=order)
        for b in range(0, len(ids), batch_size):
            batch = shuffled[b : b + batch_size]
            x, mask = common.pad_completions([ids[i] for i in batch], tokenizer.pad_token_id)  # (B, L) each
            logits = model(x, mask.long())  # 14 tensors (B, C)
            loss = sum(torch.nn.functional.cross_entropy(z, classes[batch, k]) for k, z in enumerate(logits))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    state = {"module." + k: v for k, v in model.state_dict().items()}  # chexbert.pth's keys (saved from DataParallel)
    torch.save({"model_state_dict": state}, out_dir / common.CHEXBERT_FILE)
    return out_dir / common.CHEXBERT_FILE


def synthetic_chexbert(annotation=None, settings=None) -> Path:
    """The sandbox's CheXbert: the shipped one for the synthetic set; for another set (`annotation`) or other settings,
    trained once beside it on its training split (9 CPU-minutes at full size)."""
    if annotation is None and settings is None:
        return shipped(f"chexbert-v{SANDBOX_CHEXBERT_VERSION}") / common.CHEXBERT_FILE
    annotation = Path(annotation or synthetic_data())
    final = annotation.parent / f"chexbert-v{SANDBOX_CHEXBERT_VERSION}"
    settings = settings or SANDBOX_CHEXBERT
    return build_once(final, common.CHEXBERT_FILE, "chexbert", annotation, settings) / common.CHEXBERT_FILE


def build_once(final: Path, marker: str, command: str, annotation: Path, settings: dict) -> Path:
    """`python tests/sandbox.py COMMAND --data ANNOTATION --out FINAL` (`settings` as flags) unless FINAL/MARKER is
    there: in a process of its own under NUMERIC_PINS, so that every machine gets the same weights. One process builds
    it, others wait; stopped (Ctrl-C) or failed, no half-built folder is left."""
    with cache_lock(final.parent / f".{command}.lock"):
        if not (final / marker).is_file():
            common.log.info("training the sandbox's %s beside %s, once: %s", command, annotation, final)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{command}-"))
            argv = [sys.executable, str(Path(__file__).resolve()), command, "--data", str(annotation)]
            argv += ["--out", str(tmp)]
            for name, value in settings.items():
                argv += [f"--{name.replace('_', '-')}", str(value)]
            try:
                subprocess.run(argv, env=dict(os.environ, **NUMERIC_PINS), check=True)
                tmp.rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def cache_lock(path: Path):
    """An exclusive lock on `path` (a file beside a cached model): one process trains it, the others wait for it."""
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# The sandbox's foundation (README): what the papers start from, a general pre-trained vision-language model, for
# --model tiny on --data synthetic. The tiny VLM learns two tasks that never meet: captions of images drawn apart from
# the synthetic set (another seed), started by <caption>; and report text with each view blank, started by BOS, as a
# language model reads text. It sees, and it writes report language, but it was never shown which report an image has.
# Beside it, DCRRG's ClinicalBERT stand-in: a small BERT that learned the same report text as a masked language model,
# no labels. Both train once, in a process of their own under NUMERIC_PINS, until the likelihood of held-out data
# stops improving (the best weights kept); foundation.json records the curves, the probe and the CPU seconds.
FOUNDATION_VERSION = 1  # of the recipe below: a new one trains into a new folder
CAPTION_TOKEN = "<caption>"
REASONING_TAGS = ("<think>", "</think>", "<report>", "</report>")  # MRG-R1's answer tags, in the vocabulary
FOUNDATION = dict(images=4000, reports=4000, held_out=400, batch_size=32, lr=1e-3, every=250, patience=3)
FOUNDATION |= dict(min_gain=0.005, max_steps=20000, seed=1)  # min_gain in nats per token; seed 1: not the set's 0
SIZES_TEXT_ENCODER = dict(hidden=128, layers=2, heads=2)  # DCRRG --model tiny's BERT (BERT-Tiny's shape)


def caption_prompts(policy: common.TinyPolicy, images) -> dict:
    """The foundation's other task: the policy's prompts with <caption> as the start token."""
    prompts = policy.prompt_batch(images)
    prompts["start_ids"] = torch.full_like(prompts["start_ids"], policy.tokenizer.index[CAPTION_TOKEN])
    return prompts


def foundation_data(n_images: int, n_reports: int, seed: int) -> tuple[list, list[str], list[str]]:
    """What the foundation reads, drawn apart from the synthetic set: images with their captions, and report texts."""
    rng = np.random.default_rng(seed)
    images, captions, reports = [], [], []
    for _ in range(n_images):
        findings, _ = sample_synthetic_study(rng)
        images.append(Image.fromarray(draw_synthetic_cxr(findings, rng)))
        captions.append(describe_synthetic_image(findings))
    for _ in range(n_reports):
        findings, labels = sample_synthetic_study(rng)
        reports.append(write_synthetic_report(findings, labels, rng))
    return images, captions, reports


def held_out_convergence(loss_fn, held_out_fn, model, desc, every, patience, min_gain, max_steps, lr) -> dict:
    """AdamW on loss_fn(step) until held_out_fn() (a loss, no gradient) stops falling by min_gain for `patience`
    validations, every `every` steps; the best weights loaded. -> {"steps", "best_step", "curve": [[step, loss]]}."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    rule, curve, step = common.Convergence(every, patience, min_gain, max_steps), [], 0
    for step in trange(1, max_steps + 1, desc=desc):
        loss = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % every == 0:
            with torch.no_grad():
                held = float(held_out_fn())
            rule.update(-held, step, model)
            curve.append([step, held])
            if rule.converged:
                break
    model.load_state_dict(rule.best_weights, strict=False)
    return {"steps": step, "best_step": rule.best_step, "curve": curve}


def train_foundation_vlm(train_records, images, captions, reports, held_out, out_dir, batch_size, seed, **rule):
    """The tiny VLM on captions (<caption> first) and blank-view reports (BOS first), half a batch each: the mean of
    the two teacher-forced NLLs. Saved as a policy (load_policy) in out_dir. -> its training record."""
    # the tokenizer covers the captions, the reports, the synthetic set's words and the labels' names (MRG-R1's SFT)
    words = [r.report for r in train_records] + [n.lower() for n in common.CHEXPERT_LABELS]
    tokenizer = common.WordTokenizer.build(captions + reports + words, (CAPTION_TOKEN, *REASONING_TAGS))
    torch.manual_seed(seed)
    policy = common.TinyPolicy(common.TinyVLM(len(tokenizer.vocab), max_len=128), tokenizer)
    pixels = caption_prompts(policy, [[im] for im in images])  # every image once: (N, 1, 1, S, S), <caption>
    blank = policy.prompt_batch([[Image.new("L", images[0].size)]])  # a blank view, BOS
    n_images, n_reports = len(images) - held_out, len(reports) - held_out

    def nll(c, r):
        """The mean of the captions' NLL (images c) and the reports' (texts r), each a token mean."""
        caption_prompts = {k: v[c] for k, v in pixels.items()}
        report_prompts = {k: v.expand(len(r), *v.shape[1:]) for k, v in blank.items()}
        loss_c = policy.sft_loss(caption_prompts, [captions[i] for i in c])
        return (loss_c + policy.sft_loss(report_prompts, [reports[i] for i in r])) / 2

    g = torch.Generator().manual_seed(seed)

    def batch_loss(step):
        half = batch_size // 2
        return nll(torch.randint(n_images, (half,), generator=g), torch.randint(n_reports, (half,), generator=g))

    def held_out_loss():
        c, r = torch.arange(n_images, len(images)), torch.arange(n_reports, len(reports))
        return np.mean([nll(c[k : k + 100], r[k : k + 100]).item() for k in range(0, held_out, 100)])

    record = held_out_convergence(batch_loss, held_out_loss, policy.model, "sandbox foundation VLM (steps)", **rule)
    policy.save(out_dir)
    return record | {"vocabulary": len(tokenizer.vocab)}


def train_text_encoder(reports, held_out, out_dir, hidden, layers, heads, batch_size, seed, words=(), **rule):
    """DCRRG's ClinicalBERT stand-in: a BERT (BertForMaskedLM) that learns report text as BERT did, 15 % of the word
    pieces masked (80 % [MASK], 10 % a random piece, 10 % kept), until the held-out MLM loss stops falling. Saved with
    its tokenizer (AutoModel and AutoTokenizer load it); `words`: texts whose words the word pieces also cover. -> its
    training record."""
    from transformers import BertConfig, BertForMaskedLM

    tokenizer = word_piece_tokenizer(reports + list(words), out_dir)
    size = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden)
    torch.manual_seed(seed)
    model = BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, **size)).train()
    special = torch.tensor(tokenizer.all_special_ids)
    fit, held = reports[:-held_out], reports[-held_out:]

    def mlm_loss(texts, g):
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        ids = enc["input_ids"]  # (B, L)
        u = torch.rand(ids.shape, generator=g)
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & ~torch.isin(ids, special)  # (B, L)
        masked = torch.where(chosen & (u < 0.8), tokenizer.mask_token_id, ids)
        noise = torch.randint(len(SPECIAL_PIECES), tokenizer.vocab_size, ids.shape, generator=g)
        masked = torch.where(chosen & (u >= 0.8) & (u < 0.9), noise, masked)
        labels = torch.where(chosen, ids, -100)
        return model(input_ids=masked, attention_mask=enc["attention_mask"], labels=labels).loss

    g = torch.Generator().manual_seed(seed)

    def batch_loss(step):
        return mlm_loss([fit[i] for i in torch.randint(len(fit), (batch_size,), generator=g)], g)

    def held_out_loss():
        fixed = torch.Generator().manual_seed(seed)  # the same masks at every validation
        return np.mean([mlm_loss(held[k : k + 100], fixed).item() for k in range(0, len(held), 100)])

    record = held_out_convergence(batch_loss, held_out_loss, model, "sandbox text encoder (steps)", **rule)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return record | {"vocabulary": tokenizer.vocab_size}


@torch.no_grad()
def foundation_probe(policy, data: dict, write: bool = True) -> dict:
    """Does the foundation see? A linear probe (logistic regression) on its frozen image features (the prefix grid,
    flattened) fit on the training split's images, its AUROC per label on the test split; and (write) its greedy
    captions of the test images against what was drawn (the signs each names, micro F1 over the 13 findings), and
    what it writes for them started as a report (BOS)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    def features(records):
        images = [[common.load_image(r.image_paths[0], r.id)] for r in records]
        chunks = [policy.prompt_batch(images[k : k + 256]) for k in range(0, len(images), 256)]
        return torch.cat([policy.model.prefix(**p)[:, :-1].flatten(1) for p in chunks]).numpy()  # (N, g*g*D)

    x_train, x_test = features(data["train"]), features(data["test"])
    y_train, y_test = (common.binarize(np.stack([r.labels for r in data[s]])) for s in ("train", "test"))  # (N, 14)
    auroc = {}
    for k, name in enumerate(common.CHEXPERT_LABELS):
        if 0 < y_train[:, k].sum() < len(y_train) and 0 < y_test[:, k].sum() < len(y_test):
            probe = LogisticRegression(max_iter=2000).fit(x_train, y_train[:, k])
            auroc[name] = float(roc_auc_score(y_test[:, k], probe.decision_function(x_test)))
    out = {"probe_auroc": auroc, "probe_auroc_mean": float(np.mean(list(auroc.values())))}
    if not write:
        return out
    records = data["test"]
    written, reports = [], []
    for k in range(0, len(records), 64):
        images = [[common.load_image(r.image_paths[0], r.id)] for r in records[k : k + 64]]
        written += policy.decode(*policy.generate(caption_prompts(policy, images), 96, do_sample=False))
        reports += policy.decode(*policy.generate(policy.prompt_batch(images), 96, do_sample=False))
    drawn = [describe_synthetic_image(r.meta["findings"]) for r in records]
    said, truth = caption_signs(written), caption_signs(drawn)  # (N, 13) each
    tp, fp, fn = (said & truth).sum(), (said & ~truth).sum(), (~said & truth).sum()
    return (
        out
        | {
            "caption_signs_f1": float(2 * tp / max(1, 2 * tp + fp + fn)),
            "captions_exact": float(np.mean([w == d.lower() for w, d in zip(written, drawn)])),  # decode lower-cases
            "captions": [{"drawn": d, "written": w} for d, w in list(zip(drawn, written))[:5]],
            "reports_distinct": len(set(reports)),  # of the test images, started as a report: never trained with images
            "reports": Counter(reports).most_common(3),
        }
    )


def train_foundation(annotation, out_dir, settings: dict) -> Path:
    """The sandbox's foundation for the synthetic set at `annotation` (its training words, its images for the probe):
    out_dir/vlm (the tiny VLM), out_dir/text_encoder (the BERT), out_dir/foundation.json."""
    out_dir, clock = Path(out_dir), time.process_time()
    s = dict(settings)
    data = common.load_annotation(annotation)
    n, held_out, seed = s.pop("images"), s["held_out"], s.pop("seed")
    images, captions, reports = foundation_data(n + held_out, s.pop("reports") + held_out, seed)
    rule = {k: s[k] for k in ("every", "patience", "min_gain", "max_steps", "lr", "batch_size")} | {"seed": seed}
    vlm = train_foundation_vlm(data["train"], images, captions, reports, held_out, out_dir / "vlm", **rule)
    words = [r.report for r in data["train"]]  # the set's words are whole word pieces (DCRRG's decoder writes them)
    text = train_text_encoder(reports, held_out, out_dir / "text_encoder", **SIZES_TEXT_ENCODER, words=words, **rule)
    probe = foundation_probe(common.load_policy(out_dir / "vlm"), data)
    torch.manual_seed(seed)  # the same model untrained: what a probe reads from random features
    untrained = common.TinyPolicy(common.TinyVLM(vlm["vocabulary"], max_len=128), common.WordTokenizer.build([]))
    probe["probe_auroc_mean_untrained"] = foundation_probe(untrained, data, write=False)["probe_auroc_mean"]
    record = {"version": FOUNDATION_VERSION, "settings": settings, "vlm": vlm, "text_encoder": text, "probe": probe}
    record["cpu_seconds"] = round(time.process_time() - clock, 1)
    (out_dir / "foundation.json").write_text(json.dumps(record, indent=1))
    return out_dir


def synthetic_foundation(annotation=None, settings=None) -> Path:
    """The sandbox's foundation: the shipped one for the synthetic set; for another set (`annotation`) or other
    settings, trained once beside it (20 CPU-minutes at full size)."""
    if annotation is None and settings is None:
        return shipped(f"foundation-v{FOUNDATION_VERSION}")
    annotation = Path(annotation or synthetic_data())
    final = annotation.parent / f"foundation-v{FOUNDATION_VERSION}"
    return build_once(final, "foundation.json", "foundation", annotation, settings or FOUNDATION)


class FoundationImageEncoder(torch.nn.Module):
    """The sandbox foundation's image side (a TinyVLM's CNN and projection) as an encoder of images normalised as
    default_transform(S, 1) gives them: (B, 1, S, S) -> (B, g*g*D), its g x g prefix features flattened (where a sign
    lies stays visible), as ImageNet's ResNet-50 stands for a pre-trained image encoder (DCRRG, App. A)."""

    def __init__(self, vlm: common.TinyVLM):
        super().__init__()
        self.encoder, self.project = vlm.encoder, vlm.project
        self.dim = vlm.hparams["grid"] ** 2 * vlm.hparams["n_embd"]

    def forward(self, x):
        x = (x * 0.229 + 0.485) * 2 - 1  # default_transform's ImageNet normalisation -> TinyPolicy's [-1, 1]
        return self.project(self.encoder(x).flatten(2).transpose(1, 2)).flatten(1)  # (B, g*g, D) -> (B, g*g*D)


# What a run on the synthetic set asks of the sandbox (common.start_run)
def start(args, rank: int) -> Path | None:
    """start_run on --data synthetic: the set, its CheXbert (--labeler chexbert without --chexbert-weights) and the
    foundation (--tiny-start foundation) -> the foundation's folder or None. Rank 0 first: it builds what is missing."""
    if rank != 0:
        common.barrier()
    synthetic_data()
    if args.labeler == "chexbert" and not args.chexbert_weights:
        args.chexbert_weights = str(synthetic_chexbert())  # the shipped one (config.json records it)
    foundation = synthetic_foundation() if args.model == "tiny" and args.tiny_start == "foundation" else None
    if rank == 0:
        common.barrier()
    return foundation


def main(argv=None):
    """`python tests/sandbox.py synthetic --out DIR`: the synthetic set in a folder; `chexbert --out DIR`: a CheXbert of
    the sandbox's kind trained on --data's labelled reports; `foundation --out DIR`: a foundation, and its probe."""
    p = argparse.ArgumentParser(description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    recipes = {"chexbert": SANDBOX_CHEXBERT | {"seed": 0}, "foundation": FOUNDATION}
    recipes["synthetic"] = dict(n_train=2000, n_val=200, n_test=500, size=128, seed=0)
    for command, recipe in recipes.items():
        c = sub.add_parser(command, help=f"{command} (its recipe's settings below)")
        c.add_argument("--data", default="synthetic", help='"synthetic" or an annotation.json (chexbert: with labels)')
        c.add_argument("--out", required=True, help="a fresh folder")
        for name, default in recipe.items():
            c.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = {k: getattr(args, k) for k in recipes[args.command]}
    if args.command == "synthetic":
        path = make_synthetic(args.out, **settings)
        return print(f"wrote {path / 'annotation.json'} and {args.n_train + args.n_val + args.n_test} images")
    if args.command == "chexbert":
        records = common.load_data(args.data)["train"]
        if any(r.labels is None for r in records):
            raise SystemExit(f"error: {args.data}: every training record needs 'labels' to train CheXbert on")
        return print(f"wrote {train_chexbert(records, args.out, **settings)}")
    out = train_foundation(synthetic_data() if args.data == "synthetic" else args.data, args.out, settings)
    record = json.loads((out / "foundation.json").read_text())
    auroc, f1 = record["probe"]["probe_auroc_mean"], record["probe"]["caption_signs_f1"]
    print(f"wrote {out}: probe AUROC {auroc:.3f}, caption signs F1 {f1:.3f}, {record['cpu_seconds']:.0f} CPU-seconds")


if __name__ == "__main__":
    main()
