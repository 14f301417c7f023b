"""common.py: what a real run shares, in the order of one training step: 1 data; 2 the policy, its rollout, LoRA;
3 labels and CheXbert; 4 the RL core (advantages, GRPO); 5 what a step writes (Run); 6 set-up (flags, start_run, the
policy and its reference, warm starts, AdamW, resume); 7 metrics; 8 the flags; 9 what a reader skips (CheXpert's
rules, collectives). The sandbox (`--data synthetic`) is tests/sandbox.py, read on demand; scoring a generations file
and a trained run's reports for new images: tests/reports.py."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, ClassVar, Literal, get_args, get_origin, get_type_hints

import docstring_parser
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

log = logging.getLogger("rrg")
try:  # a torchvision built for another torch fails in its C++ operators, then transformers in each model it imports
    import torchvision
    import transformers.utils

    if not transformers.utils.is_torch_available():
        raise ImportError("transformers does not take this torch")
except (ImportError, RuntimeError, AttributeError) as e:  # one line, not 60 of traceback
    found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    versions = ", ".join(f"{name} {found.get(name)}" for name in ("torch", "torchvision", "transformers"))
    raise SystemExit(
        f"error: {versions} do not work together ({type(e).__name__}: {' '.join(str(e).split())[:99]}): pip install "
        "--upgrade torch torchvision transformers, together, at least requirements.txt's floors"
    ) from None


# ==== 1. Data: annotation files, views, cleaning, batches; the image and text encoders DCRRG and RRGCL use ============
@dataclass
class Record:
    """One study: id, image paths (IU X-Ray: 1-5 views, MIMIC-CXR in R2Gen's file: one), report, labels if given."""

    id: str
    image_paths: list[str]
    report: str
    split: str
    labels: np.ndarray | None = None
    meta: dict = field(default_factory=dict)  # any other fields of the record, kept as is


# Report cleaning as R2Gen (github.com/zhjohnchan/R2Gen, modules/tokenizers.py), as in the papers' NLG numbers, quirks
# and all: it deletes every "1. " (list markers, but also in "11. " and "1.5"), its punctuation class holds the range
# ":-\[" (0x3A-0x5B), which also deletes ";<=>?@" while "-" stays, and empty sentences stay (". .").
R2GEN_PUNCT = re.compile(r"[.,?;*!%^&_+():-\[\]{}]")  # the range is R2Gen's: see above


def clean_report(report: str, style: str = "mimic_cxr") -> str:
    """R2Gen's clean_report_mimic_cxr (style "mimic_cxr") or clean_report_iu_xray ("iu_xray")."""

    def collapse(t, old, new, times):  # R2Gen collapses runs ("__", "  ", "..") with a fixed number of passes
        for _ in range(times):
            t = t.replace(old, new)
        return t

    def sent_cleaner(s):  # R2Gen's, per sentence: quotes and slashes out, then R2GEN_PUNCT
        s = s.replace('"', "").replace("/", "").replace("\\", "").replace("'", "")
        return R2GEN_PUNCT.sub("", s.strip().lower())

    if style == "mimic_cxr":  # IU X-Ray's cleaner skips these three steps
        report = collapse(collapse(report.replace("\n", " "), "__", "_", 7), "  ", " ", 6)
    t = collapse(report, "..", ".", 5 if style == "mimic_cxr" else 3).replace("1. ", "")
    for marker in [f". {k}. " for k in "2345"] + [f" {k}. " for k in "2345"]:  # list markers 2.-5., in R2Gen's order
        t = t.replace(marker, ". ")
    return " . ".join(sent_cleaner(s) for s in t.strip().lower().split(". ")) + " ."


def clean_style(records: list[Record]) -> str:
    """Open-i image names (CXR<n>_IM-...) give "iu_xray", others "mimic_cxr"."""
    iu = re.compile(r"(?:^|/)CXR\d+_IM-\d+")
    return "iu_xray" if any(iu.search(p) for r in records for p in r.image_paths) else "mimic_cxr"


def r2gen_views(data: dict[str, list[Record]], n: int = 2) -> dict[str, list[Record]]:
    """R2Gen's image input: n views per study (IU X-Ray: 2), the first n of the record; a study with fewer repeats
    its last (R2Gen's own IU file keeps 2-view studies only); n = 1 when no study has more (MIMIC-CXR's file)."""
    n = min(n, max(len(r.image_paths) for records in data.values() for r in records))
    return {
        split: [dataclasses.replace(r, image_paths=(r.image_paths + [r.image_paths[-1]] * n)[:n]) for r in records]
        for split, records in data.items()
    }


def load_annotation(path, splits=("train", "val", "test"), drop_invalid: bool = False) -> dict[str, list[Record]]:
    """R2Gen's annotation.json, {split: [{"id", "report", "image_path": [...], "labels" (optional: 14 of 1/0/-1/null)}]}
    -> {split: [Record]}, images under its 'images' folder if any. Bad records: one error listing them, or dropped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"annotation file not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(raw, dict) or any(not isinstance(raw.get(s), list) for s in splits):
        raise ValueError(
            f"{path}: expected {{'train': [records], 'val': [...], 'test': [...]}} (R2Gen's layout), "
            f"got {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}"
        )
    root = path.parent / "images" if (path.parent / "images").is_dir() else path.parent
    rows = [(split, n, row) for split in splits for n, row in enumerate(raw[split])]
    for _, _, row in rows:  # one image name: a list of one
        if isinstance(row, dict) and isinstance(row.get("image_path"), str):
            row["image_path"] = [row["image_path"]]

    def image_problem(name: str) -> str | None:  # the header only: a 0-byte or foreign file fails at load, not mid-run
        try:
            with Image.open(root / name) as im:
                return None if min(im.size) > 0 else f"empty image {name}"
        except FileNotFoundError:
            return f"image not found: {name}"
        except (UnidentifiedImageError, OSError) as e:
            return f"cannot read image {name} ({type(e).__name__})"

    names = {p for *_, row in rows if isinstance(row, dict) for p in row.get("image_path") or [] if isinstance(p, str)}
    with ThreadPoolExecutor(8) as pool:  # every image's header, in threads
        unreadable = dict(zip(names, pool.map(image_problem, names)))
    out, problems = {split: [] for split in splits}, []
    for split, n, row in rows:
        where = f"{path} [{split}][{n}]" + (f" id={row.get('id')!r}" if isinstance(row, dict) else "")
        paths, labels = row.get("image_path") if isinstance(row, dict) else None, None
        if not isinstance(row, dict) or any(k not in row for k in ("id", "report", "image_path")):
            problems.append(f"{where}: a record needs 'id', 'report' and 'image_path'")
        elif not isinstance(row["report"], str) or not row["report"].strip():
            problems.append(f"{where}: empty report")
        elif not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            problems.append(f"{where}: 'image_path' must be a file name or a list of them, got {paths!r:.200}")
        elif bad := [unreadable[p] for p in paths if unreadable[p]]:
            problems.append(f"{where}: {bad[0]} (under {root})")
        elif (labels := row.get("labels")) is not None and (
            not isinstance(labels, list)
            or len(labels) != len(CHEXPERT_LABELS)
            or any(v not in (1, 0, -1, None) or isinstance(v, bool) for v in labels)
        ):
            problems.append(f"{where}: 'labels' must be 14 values (1, 0, -1 or null) in the order {CHEXPERT_LABELS}")
        else:
            labels = None if labels is None else np.array([np.nan if v is None else float(v) for v in labels])
            meta = {k: v for k, v in row.items() if k not in ("id", "report", "image_path", "split", "labels")}
            out[split].append(
                Record(str(row["id"]), [str(root / p) for p in paths], row["report"], split, labels, meta)
            )
    if problems and not drop_invalid:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"{path}: {len(problems)} bad record(s):\n  {shown}\n(--drop-invalid skips them)")
    for p in problems:
        log.warning("dropped: %s", p)
    return out


def load_image(path: str, record_id: str = "?"):
    """An 8-bit grey-scale PIL image; a clear error names the file and the record."""
    try:
        with Image.open(path) as im:
            return im.convert("L")
    except FileNotFoundError:
        raise FileNotFoundError(f"record {record_id}: image not found: {path}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"record {record_id}: cannot read image {path} ({e})") from None


def default_transform(size: int = 224, channels: int = 3):
    """R2Gen's test transform, grey over `channels` (its training flip would swap the sides the reports name)."""
    T = torchvision.transforms
    mean, std = [0.485, 0.456, 0.406][:channels], [0.229, 0.224, 0.225][:channels]  # ImageNet's
    return T.Compose([T.Grayscale(channels), T.Resize((size, size)), T.ToTensor(), T.Normalize(mean, std)])


class ReportDataset(torch.utils.data.Dataset):
    """{"id", "images": (V, C, H, W) (PIL views with transform="pil"), "report", "labels": (14,), NaN blank}."""

    def __init__(self, records: list[Record], transform="pil"):
        self.records, self.transform = records, transform

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        images = [load_image(p, r.id) for p in r.image_paths]
        if self.transform != "pil":
            images = torch.stack([self.transform(im) for im in images])  # (V, C, H, W)
        labels = r.labels if r.labels is not None else np.full(len(CHEXPERT_LABELS), np.nan)
        labels = torch.as_tensor(labels, dtype=torch.float32)
        return {"id": r.id, "images": images, "report": r.report, "labels": labels}


def pad_views(studies: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """B studies' views (V_i, C, H, W) -> (B, V, C, H, W) zero-padded to the most views, view_mask (B, V): 1 if real."""
    images = torch.nn.utils.rnn.pad_sequence(studies, batch_first=True)
    return images, torch.nn.utils.rnn.pad_sequence([torch.ones(len(x)) for x in studies], batch_first=True)


def collate(batch: list[dict]) -> dict:
    """ReportDataset items -> a batch; tensor images as pad_views() gives them, with "view_mask"."""
    out = {k: [b[k] for b in batch] for k in ("id", "report", "images")}
    out["labels"] = torch.stack([b["labels"] for b in batch])
    if isinstance(out["images"][0], torch.Tensor):
        out["images"], out["view_mask"] = pad_views(out["images"])
    return out


def split_batch(batch: dict, n: int) -> list[dict]:
    """B studies -> n micro-batches of B / n (gradient accumulation)."""
    size = exact_div(len(batch["id"]), n, "studies per process / --grad-accum")
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(n)]


def study_batches(records: list[Record], batch_size: int, seed=0, rank=0, world_size=1, start_step=0, transform="pil"):
    """Endless (epoch, batch) of shuffled studies, each rank its shard: resumed at `start_step`, the same batches."""
    if len(records) < batch_size * world_size:
        raise ValueError(f"{len(records)} studies cannot fill one batch of {batch_size} on each of {world_size} ranks")
    dataset = ReportDataset(records, transform)
    sampler = torch.utils.data.DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
    per_epoch = len(sampler) // batch_size
    epoch, skip = divmod(start_step, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)  # this rank's shuffled indices for the epoch
        for b in range(skip, per_epoch):
            yield epoch, collate([dataset[i] for i in order[b * batch_size : (b + 1) * batch_size]])
        epoch, skip = epoch + 1, 0


def load_data(data: str, **kwargs) -> dict[str, list[Record]]:
    """--data: "synthetic", an annotation.json or its folder."""
    if data == "synthetic":
        return load_annotation(sandbox().synthetic_data(), **kwargs)
    return load_annotation(Path(data) / "annotation.json" if Path(data).is_dir() else data, **kwargs)


# Image and text encoders of DCRRG and RRGCL (neither uses the policy interface for them) ----------
class ViewMean(torch.nn.Module):
    """Encodes every view of a study and averages them: (B, V, C, H, W) -> (B, d)."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module | None = None, dim: int | None = None):
        super().__init__()
        self.body, self.head, self.dim = body, head, dim or getattr(body, "dim", None)

    def forward(self, x):
        return self.body(x.flatten(0, 1)).view(x.shape[0], x.shape[1], -1).mean(1)  # (B, d)


class SmallCNN(torch.nn.Module):
    """Offline image encoder (B, 1, S, S) -> (B, dim): 3 x 3 conv blocks (GroupNorm: no batch statistics),
    average-pooled to grid x grid (where a sign lies stays visible), flattened, then Linear + ReLU to `dim`."""

    def __init__(self, widths=(16, 32, 64, 64), strides=(2, 2, 2, 1), grid: int = 8, dim: int | None = 256):
        super().__init__()
        c = [1, *widths]
        blocks = []
        for i, o, s in zip(c, c[1:], strides):
            blocks += [torch.nn.Conv2d(i, o, 3, s, 1), torch.nn.GroupNorm(8, o), torch.nn.ReLU()]
        blocks += [torch.nn.AdaptiveAvgPool2d(grid), torch.nn.Flatten()]
        if dim is not None:
            blocks += [torch.nn.Linear(c[-1] * grid * grid, dim), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*blocks)
        self.dim = dim or c[-1] * grid * grid

    def forward(self, x):
        return self.net(x)


def resnet_encoder(depth: int = 50, weights: str | None = None, flag: str = "--pretrained") -> ViewMean:
    """torchvision ResNet-`depth` without its classifier, as a ViewMean -> (B, 2048). weights: None, "imagenet"
    (downloaded once when asked) or a state-dict file (a checkpoint's "module."/"model." prefixes are dropped)."""
    name = f"resnet{depth}"
    imagenet = torchvision.models.get_model_weights(name).DEFAULT if weights == "imagenet" else None
    net = torchvision.models.get_model(name, weights=imagenet)
    dim, net.fc = net.fc.in_features, torch.nn.Identity()
    if weights not in (None, "imagenet"):
        if not Path(weights).is_file():
            raise FileNotFoundError(f"{flag} {weights}: no such file (a torchvision ResNet-{depth} state dict)")
        state = torch.load(weights, map_location="cpu", weights_only=True)
        state = {k.removeprefix("module.").removeprefix("model."): v for k, v in state.get("state_dict", state).items()}
        try:
            net.load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")})
        except RuntimeError as e:
            raise ValueError(f"{flag} {weights}: not a torchvision ResNet-{depth} state dict ({e!s:.300})") from None
    return ViewMean(net, dim=dim)


def mean_pooled_bert_features(model, tokenizer, texts: list[str], device, max_length: int = 512) -> torch.Tensor:
    """Mean of a BERT-like model's last hidden states over each text's word pieces -> (B, H)."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    h = model(**enc).last_hidden_state  # (B, L, H)
    m = enc["attention_mask"][..., None].to(h.dtype)  # (B, L, 1)
    return (h * m).sum(1) / m.sum(1)


def sandbox():
    """tests/sandbox.py (the synthetic set and its trained models), imported on first use: real data never reads it."""
    tests = str(Path(__file__).resolve().parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("sandbox")


# ==== 2. The policy: the rollout, one interface for the tiny VLM and Hugging Face VLMs, LoRA ==========================
@dataclass
class Rollout:
    """G sampled completions for each of B prompts (N = B*G rows, groups contiguous)."""

    prompts: dict  # model inputs of the B studies, once each (the policy repeats them to the rows it scores)
    completion_ids: torch.Tensor  # (N, T)
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    texts: list  # N decoded completions
    rewards: torch.Tensor | None = None  # (N,), the script's scores of the texts


def rollout(policy, images, text, G, max_new_tokens, temperature=1.0) -> Rollout:
    """Sample G completions per study, rows iG .. iG + G - 1 study i's; the script scores them (rewards). Once a step,
    whatever --grad-accum: a generate() call costs about the same for 8 or 64 rows (weight reads bound decoding)."""
    prompts = policy.prompt_batch(images, text)  # B studies, once each
    ids, mask = policy.generate(prompts, max_new_tokens, temperature, n=G)  # (N, T), (N, T): G rows a study
    return Rollout(prompts, ids, mask, policy.decode(ids, mask))


def micro_batches(policy, roll: Rollout, k: int, G: int) -> list[Rollout]:
    """--grad-accum k: the rollout as k micro-batches of whole groups, in order (TRL's gradient accumulation)."""
    if k == 1:
        return [roll]
    b = exact_div(len(roll.texts) // G, k, "studies per process / --grad-accum")  # studies a micro-batch
    rows = (roll.completion_ids, roll.completion_mask, roll.texts, roll.rewards)
    firsts = range(0, len(roll.texts) // G, b)  # each micro-batch's first study
    return [Rollout(policy.rows(roll.prompts, i, i + b), *(x[i * G : (i + b) * G] for x in rows)) for i in firsts]


class LoRAOff:
    """A LoRA policy's reference: the same model with its adapters switched off (no second copy of the weights)."""

    def __init__(self, policy):
        self.policy = policy

    def completion_logprobs(self, prompts: dict, completion_ids, completion_mask, temperature: float = 1.0):
        with lora_disabled(self.policy.model):
            return self.policy.completion_logprobs(prompts, completion_ids, completion_mask, temperature)


def reference_logprobs(ref, roll: Rollout, temperature: float = 1.0):
    """log pi_ref (N, T) of the sampled completions, no gradient: ref a frozen_reference or LoRAOff; None without."""
    if ref is None:
        return None
    with torch.no_grad():
        return ref.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask, temperature)


class Policy:
    """What scripts call on a policy (N = B prompts x G samples, groups contiguous; T tokens); TinyPolicy, HFPolicy have
      prompt_batch(images, text) -> prompts      model inputs of B studies (lists of PIL views), once each
      rows(prompts, start, stop)                 studies start .. stop - 1 of a batch of prompts
      generate(prompts, max_new_tokens, temperature, n=G) -> ids (N, T), mask (N, T) 1 up to AND including the first EOS
      completion_logprobs(prompts, ids, mask, temperature) -> (N, T) float32, 0 where mask is 0; N / B rows a study
      decode(ids, mask) -> N texts; encode_targets(texts) -> ids, mask: right-padded, EOS last
      save(dir), read back by load_policy(dir); vision_and_language() -> (vision modules, language modules)
    and both compute the SFT loss below from them. completion_logprobs runs `forward_module` (the model, or under
    torchrun without --fsdp its DistributedDataParallel: data_parallel); generate() runs the model (no gradient)."""

    forward_module: torch.nn.Module
    ROW_KEY: str  # a key of prompts with one entry per study

    def rows_per_study(self, prompts: dict, completion_ids) -> int:
        """N / B: the completions of each study, rows in order (G a study: rows iG .. iG + G - 1 are study i's)."""
        return exact_div(len(completion_ids), len(prompts[self.ROW_KEY]), "completions / studies")

    def sft_loss(self, prompts: dict, texts: list[str]):
        """Teacher-forced NLL of the texts: token sum / token count."""
        ids, mask = self.encode_targets(texts)
        return -(self.completion_logprobs(prompts, ids, mask) * mask).sum() / mask.sum()


_WORD_RE = re.compile(r"</?[a-z_]+>|[a-z0-9]+|[^\sa-z0-9]")


class TinyPolicy(Policy):
    """The tiny built-in policy (`--model tiny`): its prompt is the image prefix + BOS (`text` is ignored)."""

    ROW_KEY = "start_ids"

    def __init__(self, model: TinyVLM, tokenizer: WordTokenizer, image_size: int = 64, device="cpu"):
        self.model, self.tokenizer, self.image_size = model.to(device), tokenizer, image_size
        self.device = torch.device(device)
        self.eos_token_ids = [tokenizer.eos_id]  # as HFPolicy's, a list
        self.suppressed = ()  # ids never sampled: none (HFPolicy's: vision placeholders)
        self.eos_token_id, self.pad_token_id = tokenizer.eos_id, tokenizer.pad_id
        self.forward_module = self.model

    def prompt_batch(self, images, text=None) -> dict:
        """PIL views per study -> {"pixel_values": (B, V, 1, S, S) in [-1, 1] zero-padded, "view_mask": (B, V)}."""
        F = torchvision.transforms.functional
        S = [self.image_size] * 2  # each view S x S, (V, 1, S, S) a study
        views = [torch.stack([F.to_tensor(F.resize(im.convert("L"), S)) * 2 - 1 for im in study]) for study in images]
        pixel_values, view_mask = pad_views(views)
        start_ids = torch.full((len(views),), self.tokenizer.bos_id)  # (B,) a report's start token
        prompts = {"pixel_values": pixel_values, "view_mask": view_mask, "start_ids": start_ids}
        return {k: v.to(self.device) for k, v in prompts.items()}

    def vision_and_language(self):
        return torch.nn.ModuleList([self.model.encoder, self.model.project]), self.model.decoder

    def rows(self, prompts: dict, start: int, stop: int) -> dict:
        return {k: v[start:stop] for k, v in prompts.items()}

    def repeated(self, prompts: dict, n: int) -> tuple:
        """The model's inputs for n rows a study (row i n + j: study i), each row its own copy of the views."""
        return tuple(prompts[k].repeat_interleave(n, 0) for k in ("pixel_values", "view_mask", "start_ids"))

    def generate(self, prompts, max_new_tokens=80, temperature=1.0, n=1, **sampling):  # generate_completions' options
        embeds = self.model.prefix(*self.repeated(prompts, n))  # (N, P, D)
        attention_mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        inputs = dict(inputs_embeds=embeds, attention_mask=attention_mask)
        max_new_tokens = min(max_new_tokens, self.model.hparams["max_len"])
        return generate_completions(self, self.model.decoder, inputs, 0, max_new_tokens, temperature, **sampling)

    def decode(self, completion_ids, completion_mask) -> list[str]:
        return [self.tokenizer.decode(row[m.bool()].tolist()) for row, m in zip(completion_ids, completion_mask)]

    def completion_logprobs(self, prompts: dict, completion_ids, completion_mask, temperature: float = 1.0):
        """One forward pass over prefix + (right-padded) completion -> (N, T) float32, 0 where the mask is 0."""
        if "apart" in prompts:
            return self.scored_apart(prompts, completion_ids, completion_mask, temperature)
        inputs = (*self.repeated(prompts, self.rows_per_study(prompts, completion_ids)), completion_ids)
        logits = self.forward_module(*inputs)  # (N, T, V): the logits that predict each completion token
        return token_logprobs(logits, completion_ids, temperature) * completion_mask  # (N, T)

    def scored_apart(self, prompts: dict, completion_ids, completion_mask, temperature: float = 1.0):
        """Rows of G + 1 a study whose last is another kind (OraPO's ground truth after its G samples: prompts["apart"]
        = G, the samples' length, the last's), scored in two passes, as the sandbox's committed numbers were: a
        batch of other shapes rounds differently in float, and 250 steps carry that into every number printed."""
        G, T, Tl = prompts["apart"].tolist()
        plain = {k: v for k, v in prompts.items() if k != "apart"}
        B = len(plain["start_ids"])
        ids, mask = completion_ids.view(B, G + 1, -1), completion_mask.view(B, G + 1, -1)
        rows = (ids[:, :G, :T].reshape(B * G, T), mask[:, :G, :T].reshape(B * G, T))
        samples = self.completion_logprobs(plain, *rows, temperature)
        last = self.completion_logprobs(plain, ids[:, G, :Tl], mask[:, G, :Tl], temperature)
        out = torch.zeros(ids.shape, device=ids.device)  # (B, G + 1, T')
        out[:, :G, :T], out[:, G, :Tl] = samples.view(B, G, T), last
        return out.view(B * (G + 1), -1)

    def encode_targets(self, texts: list[str]):
        targets = [self.tokenizer.encode(t)[: self.model.hparams["max_len"] - 1] + [self.eos_token_id] for t in texts]
        return pad_completions(targets, self.pad_token_id, self.device)

    def save(self, path, state_dict: dict | None = None):
        """path/tiny_policy.pt, LoRA folded in (it loads into a plain TinyVLM); `state_dict`: a sharded model's."""
        Path(path).mkdir(parents=True, exist_ok=True)
        checkpoint = {"hparams": self.model.hparams, "state_dict": state_dict or lora_merged_state_dict(self.model)}
        checkpoint |= {"vocab": self.tokenizer.vocab, "image_size": self.image_size}
        torch.save(checkpoint, Path(path) / "tiny_policy.pt")


class HFPolicy(Policy):
    """A Qwen2-VL-family model (Qwen2.5-VL, HuatuoGPT-Vision-7B-Qwen2.5VL): the chat template with one image per view,
    left-padded; completions right-padded. The hub's top_k / top_p / repetition penalty give way to plain temperature
    sampling (sampled log-probs equal scored ones). max_pixels bounds the image tokens per view (one per 28 x 28 px)."""

    MODEL_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")  # of MODEL_KEYS, a row each (B, P)
    ROW_KEY = "input_ids"
    MAX_TARGET_TOKENS = 512  # of an SFT / DPO target, EOS included

    def __init__(
        self, name_or_path, device="cpu", dtype=torch.float32, gradient_checkpointing=False, max_pixels=None, host=False
    ):
        """host: the weights stay in host memory (--fsdp: shard() moves each rank's part to its GPU, block by block);
        else onto `device` (through host memory unless accelerate is installed: transformers' device_map needs it)."""
        from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

        self.device, self.dtype = torch.device(device), dtype
        try:
            self.processor = AutoProcessor.from_pretrained(name_or_path)
        except OSError as e:  # no such folder, hub id or cached download
            raise ValueError(f"--model {name_or_path}: cannot load it ({str(e).splitlines()[0][:200]})") from None
        if max_pixels:  # on the loaded processor: the hub's top-level min/max_pixels win over from_pretrained's size=
            bounds = {"longest_edge": max_pixels, "shortest_edge": min(max_pixels, 56 * 56)}
            self.processor.image_processor.size = bounds  # a 2544 x 3056 view: 320 tokens at 512^2, not 9,919
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.padding_side = "left"  # prompts end where generation starts
        onto, load = torch.device("cpu") if host else self.device, dict(dtype=dtype)
        if onto.type == "cuda" and importlib.util.find_spec("accelerate"):  # transformers' device_map needs it
            load["device_map"] = onto  # straight onto this GPU, not through host memory
        self.model = self.forward_module = AutoModelForImageTextToText.from_pretrained(name_or_path, **load).to(onto)
        if not hasattr(getattr(self.model, "model", None), "visual"):
            raise ValueError(f"--model {name_or_path}: a {type(self.model).__name__}, not of the Qwen2-VL family")
        gen, cfg = self.model.generation_config, self.model.config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_id = self.tokenizer.eos_token_id  # ends SFT / DPO targets (<|im_end|> for chat models)
        self.eos_token_ids = list(dict.fromkeys(([eos] if isinstance(eos, int) else list(eos)) + [self.eos_token_id]))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = self.eos_token_ids[0] if pad is None else pad
        # A vision placeholder (<|image_pad|> ...) in a completion (a random model writes them) would be taken for an
        # image slot by the next forward ("Image features and image tokens do not match"): never sampled, probability 0.
        vision_tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        self.suppressed = [getattr(cfg, n) for n in vision_tokens if getattr(cfg, n, None) is not None]
        special = dict(bos_token_id=gen.bos_token_id, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id)
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        self.model.generation_config = GenerationConfig(**special, **sampling, suppress_tokens=self.suppressed or None)
        if gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", self.model.gradient_checkpointing_enable)
            enable({"use_reentrant": False})  # works with frozen inputs (LoRA); transformers 5 renamed it
            self.model.config.use_cache = False  # generate() turns the cache back on (use_cache=True)
        self.model.train()  # from_pretrained gives eval mode (no checkpointing, no LoRA dropout); generate() toggles it

    def vision_and_language(self):
        return self.model.model.visual, torch.nn.ModuleList([self.model.model.language_model, self.model.lm_head])

    def prompt_batch(self, images, text) -> dict:
        """images: PIL views per study; text: one instruction, or one per study."""
        texts = [text] * len(images) if isinstance(text, str) or text is None else list(text)
        chats = [
            [{"role": "user", "content": [{"type": "image"} for _ in views] + [{"type": "text", "text": t or ""}]}]
            for views, t in zip(images, texts)
        ]
        prompt_text = [self.processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        flat = [im.convert("RGB") for views in images for im in views]
        inputs = self.processor(text=prompt_text, images=flat, padding=True, return_tensors="pt")  # never truncated
        prompts = {k: v.to(self.device) for k, v in inputs.items() if k in self.MODEL_KEYS}
        prompts["n_images"] = torch.tensor([len(v) for v in images])  # (B,) views per study, for repeat()
        return prompts

    def rows(self, prompts: dict, start: int, stop: int) -> dict:
        """Studies start .. stop - 1; pixel_values and image_grid_thw (per image) cut at their images."""
        n_images = prompts["n_images"].tolist()
        first, last = sum(n_images[:start]), sum(n_images[:stop])  # the rows' images
        patches = prompts["image_grid_thw"].prod(-1).tolist()  # patch rows per image
        out = {k: v[start:stop] for k, v in prompts.items() if k not in ("pixel_values", "image_grid_thw")}
        out["pixel_values"] = prompts["pixel_values"][sum(patches[:first]) : sum(patches[:last])]
        out["image_grid_thw"] = prompts["image_grid_thw"][first:last]
        return out

    @contextlib.contextmanager
    def views_once(self, prompts: dict, n: int):
        """The model's inputs for n rows a study: the text repeated to the rows, each study's views through the vision
        tower once, their features repeated to its rows (get_image_features; autograd sums the rows' gradients back)."""
        vision = self.model.model  # Qwen2-VL's: its forward calls self.get_image_features(pixel_values, grid)
        views = prompts["n_images"].tolist()
        first = np.cumsum([0, *views])
        index = [k for i, v in enumerate(views) for _ in range(n) for k in range(first[i], first[i] + v)]  # rows' views
        encode = vision.get_image_features

        def get_image_features(pixel_values, image_grid_thw=None, **kwargs):
            out = encode(pixel_values, prompts["image_grid_thw"], **kwargs)  # the studies' views, once each
            out.pooler_output = tuple(out.pooler_output[k] for k in index)  # each row's views (forward reads these)
            return out

        inputs = {k: prompts[k].repeat_interleave(n, 0) for k in self.TEXT_KEYS if k in prompts}
        inputs |= dict(pixel_values=prompts["pixel_values"], image_grid_thw=prompts["image_grid_thw"][index])
        vision.get_image_features = get_image_features  # for this call only
        try:
            yield inputs
        finally:
            del vision.get_image_features

    def generate(self, prompts, max_new_tokens=256, temperature=1.0, n=1, **sampling):  # as TinyPolicy's
        P = prompts["input_ids"].shape[1]
        with autocast(self.device, self.dtype):  # prefilled() runs in generate_completions, the weights gathered
            return generate_completions(
                self, self.model, lambda: self.prefilled(prompts, n), P, max_new_tokens, temperature, **sampling
            )

    def prefilled(self, prompts: dict, n: int) -> dict:
        """model.generate's inputs for n rows a study: each prompt but its last token through the model once (views and
        text), the KV cache repeated to the rows; generate's first step feeds the last token, row by row (no images)."""
        text = [k for k in self.TEXT_KEYS if k in prompts]
        once = {k: v for k, v in prompts.items() if k in self.MODEL_KEYS} | {k: prompts[k][:, :-1] for k in text}
        out = self.model(**once, use_cache=True, logits_to_keep=1)  # B rows: the prompts' P - 1 tokens
        key = "cache" if "cache" in out else "past_key_values"  # transformers 5.x renamed it (the old name warns)
        out[key].batch_repeat_interleave(n)  # (B, heads, P - 1, d) -> (B n, ...) each layer, row i n + j study i's
        # the prefill left rope_deltas (B, 1) on the model (mrope: the text's offset after the images); generate adds it
        # to the B n rows' positions as is (_prepare_position_ids_for_generation repeats nothing; forward would)
        self.model.model.rope_deltas = self.model.model.rope_deltas.repeat_interleave(n, 0)
        return {k: prompts[k].repeat_interleave(n, 0) for k in text} | {key: out[key]}

    def decode(self, completion_ids, completion_mask) -> list[str]:
        rows = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
        return [t.strip() for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]

    def completion_logprobs(self, prompts: dict, completion_ids, completion_mask, temperature: float = 1.0):
        """One forward pass over prompt + completion, the LM head on the last T + 1 positions -> (N, T) (views_once)."""
        T = completion_ids.shape[1]
        with self.views_once(prompts, self.rows_per_study(prompts, completion_ids)) as inputs:
            completions = dict(input_ids=completion_ids, attention_mask=completion_mask)  # text: mm type 0
            completions["mm_token_type_ids"] = torch.zeros_like(completion_ids)
            for k in [k for k in completions if k in inputs]:  # (N, P) + (N, T) -> (N, P + T)
                inputs[k] = torch.cat([inputs[k], completions[k].to(inputs[k].dtype)], 1)
            # no KV cache: positions are recomputed, never generate()'s cached rope_deltas (tests/test_hf_policy.py)
            with autocast(self.device, self.dtype):
                logits = self.forward_module(**inputs, use_cache=False, logits_to_keep=T + 1).logits[:, :-1]  # (N,T,V)
        return token_logprobs(logits, completion_ids, temperature, self.suppressed) * completion_mask  # (N, T)

    def encode_targets(self, texts: list[str]):
        targets = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        targets = [ids[: self.MAX_TARGET_TOKENS - 1] + [self.eos_token_id] for ids in targets]
        return pad_completions(targets, self.pad_token_id, self.device)

    def save(self, path, state_dict: dict | None = None):
        """save_pretrained with LoRA folded into the weights (the live model untouched), and the processor: the folder
        loads with HFPolicy(path) or plain transformers. `state_dict`: a sharded model's (full_state_dicts)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=state_dict or lora_merged_state_dict(self.model))
        self.processor.save_pretrained(path)


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 matmuls under torch.autocast (also mixing bf16 weights with fp32 parts: fp32_trainable, LoRA); fp32: off."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype)


def make_policy(
    model, reports, device, dtype=torch.float32, max_new_tokens=128, extra_tokens=(), max_pixels=512 * 512, host=False
):
    """`--model tiny`: TinyPolicy (the reports' words), else HFPolicy, checkpointed (512^2 px: <= 334 tokens a view)."""
    if model == "tiny":
        tok = WordTokenizer.build(list(reports), extra_tokens)
        return TinyPolicy(TinyVLM(len(tok.vocab), max_len=max_new_tokens), tok, device=device)
    return HFPolicy(model, device, dtype, gradient_checkpointing=True, max_pixels=max_pixels, host=host)


def load_policy(path, device="cpu", dtype=torch.float32, host=False, **hf_kwargs):
    """A policy saved by policy.save(path): TinyPolicy (tiny_policy.pt) or HFPolicy (`host`: HFPolicy's)."""
    f = Path(path) / "tiny_policy.pt"
    if not f.is_file():
        hf_kwargs.setdefault("gradient_checkpointing", True)  # as make_policy
        return HFPolicy(str(path), device, dtype, host=host, **hf_kwargs)
    ck = torch.load(f, map_location="cpu", weights_only=True)
    model = TinyVLM(**ck["hparams"])
    model.load_state_dict(ck["state_dict"])
    return TinyPolicy(model, WordTokenizer(ck["vocab"]), ck["image_size"], device)


def fp32_trainable(model: torch.nn.Module):
    """Cast what trains to fp32 (bf16 rounds away AdamW's ~1e-6 steps on ~0.02): after freezing, before AdamW."""
    for p in [p for p in model.parameters() if p.requires_grad and p.dtype != torch.float32]:
        p.data = p.data.float()


@torch.no_grad()
def generate_completions(
    policy, model, inputs, P, max_new_tokens, temperature, do_sample=True, return_logprobs=False, top_p=1.0
):
    """model.generate after P prompt tokens -> ids (N, T) padded after the first EOS, mask (N, T) and the log-probs
    under logits / temperature. Plain temperature sampling unless top_p < 1 (DEER's DDSampling, not RL losses)."""
    was_training = policy.model.training
    policy.model.eval()
    sampling = dict(temperature=temperature, top_p=top_p, top_k=0) if do_sample else {}  # greedy: none
    stop = dict(max_new_tokens=max_new_tokens, eos_token_id=policy.eos_token_ids, pad_token_id=policy.pad_token_id)
    output = dict(use_cache=True, return_dict_in_generate=True, output_logits=return_logprobs)
    fsdp = isinstance(policy.model, FSDPModule)  # synced_gpus: every rank runs as many forwards
    with gathered(policy.model, once=policy.vision_and_language()[0]):
        inputs = inputs() if callable(inputs) else inputs  # HFPolicy's prefill, under the weights gathered
        out = model.generate(**inputs, **stop, **output, do_sample=do_sample, **sampling, synced_gpus=fsdp)
    policy.model.train(was_training)
    ids = out.sequences[:, P:]  # (N, T) the completion only
    mask = completion_mask(ids, policy.eos_token_ids)  # (N, T)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, policy.pad_token_id))
    if not return_logprobs:
        return ids, mask
    return ids, mask, token_logprobs(torch.stack(out.logits, 1), ids, temperature, policy.suppressed) * mask


def token_logprobs(logits, ids, temperature: float = 1.0, suppressed=()):
    """log softmax(logits / temperature) at ids -> (N, T) float32, row by row: without grad no fp32 (N, T, V) copy; with
    grad each row's copy is saved (608 KB a token at 151,936 words: tests/MACHINES.md). `suppressed` ids: p = 0."""
    rows = []
    for lg, tok in zip(logits, ids):  # (T, V), (T,)
        lg = lg.float() / temperature
        if len(suppressed):
            lg[:, list(suppressed)] = float("-inf")
        rows.append(lg.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(lg, dim=-1))  # (T,)
    return torch.stack(rows)  # (N, T)


def completion_mask(ids, eos_id):
    """(N, T) float: 1 up to and including the first EOS (any of eos_id: <|im_end|>, <|endoftext|>), 0 after."""
    is_eos = torch.isin(ids, torch.as_tensor(eos_id, device=ids.device)).int()  # (N, T)
    return ((is_eos.cumsum(1) - is_eos) == 0).float()  # (N, T) no EOS strictly before


def pad_completions(seqs: list[list[int]], pad_id: int, device="cpu"):
    """Right-padded: ids (N, T) long, mask (N, T)."""
    T = max(1, max(len(s) for s in seqs))
    ids, mask = torch.full((len(seqs), T), pad_id, dtype=torch.long), torch.zeros(len(seqs), T)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


class TinyVLM(torch.nn.Module):
    """A small CNN turns each view (1, S, S) into g x g features; a study's views are averaged position by position
    (R2GenGPT's way: any number of views) into g x g prefix embeddings read before BOS by a random GPT-2 decoder."""

    _no_split_modules = ("GPT2Block",)  # shard()'s blocks

    def __init__(self, vocab_size: int, grid=4, n_embd=128, n_layer=2, n_head=4, max_len=96, channels=32):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt2_size = dict(n_embd=n_embd, n_layer=n_layer, n_head=n_head)
        self.hparams = dict(vocab_size=vocab_size, grid=grid, **gpt2_size, max_len=max_len, channels=channels)
        c, blocks = channels, []
        for i, o in [(1, c), (c, c), (c, 2 * c), (2 * c, 2 * c)]:
            blocks += [torch.nn.Conv2d(i, o, 3, stride=2, padding=1), torch.nn.GroupNorm(8, o), torch.nn.ReLU()]
        self.encoder = torch.nn.Sequential(*blocks, torch.nn.AdaptiveAvgPool2d(grid))
        self.project = torch.nn.Linear(2 * c, n_embd)
        # No dropout, GroupNorm not BatchNorm: log-probs must not depend on train/eval mode or the batch (GRPO's ratio)
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        size = dict(n_positions=grid * grid + 1 + max_len, **gpt2_size)  # the image prefix, BOS, the report
        # WordTokenizer's <bos>, <eos>; no pad id: generate() drops the all-ones mask, then warned of each pad fed back
        config = GPT2Config(vocab_size=vocab_size, **size, **no_dropout, bos_token_id=1, eos_token_id=2)
        self.decoder = GPT2LMHeadModel(config)

    def prefix(self, pixel_values, view_mask, start_ids):
        """(N, V, 1, S, S) zero-padded views, view_mask (N, V), start_ids (N,) or one id -> (N, g*g + 1, D): the views'
        mean features, then the start token (BOS: a report; the foundation's <caption>: a caption)."""
        N, V = pixel_values.shape[:2]
        feats = self.encoder(pixel_values.flatten(0, 1))  # (N*V, 2c, g, g)
        feats = self.project(feats.flatten(2).transpose(1, 2)).view(N, V, -1, self.hparams["n_embd"])  # (N, V, g*g, D)
        m = view_mask.to(feats.dtype)[:, :, None, None]  # (N, V, 1, 1)
        feats = (feats * m).sum(1) / m.sum(1)  # (N, g*g, D) mean over the study's real views
        start = torch.as_tensor(start_ids, device=feats.device).reshape(-1, 1).expand(N, 1)  # (N, 1)
        return torch.cat([feats, self.decoder.transformer.wte(start)], dim=1)

    def forward(self, pixel_values, view_mask, start_ids, completion_ids):
        """Teacher-forced: the prefix, then the right-padded completion (N, T) -> (N, T, V), each token's logits."""
        prefix = self.prefix(pixel_values, view_mask, start_ids)  # (N, P, D)
        P, T = prefix.shape[1], completion_ids.shape[1]
        embeds = torch.cat([prefix, self.decoder.transformer.wte(completion_ids)], dim=1)  # (N, P+T, D)
        return self.decoder(inputs_embeds=embeds).logits[:, P - 1 : P - 1 + T]  # (N, T, V)


class WordTokenizer:
    """The tiny model's tokenizer from the training reports: lower-cased words, numbers, punctuation; <think> whole."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0-3 in a built vocabulary

    def __init__(self, vocab: list[str]):
        self.vocab, self.index = list(vocab), {w: i for i, w in enumerate(vocab)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = [self.index[t] for t in self.SPECIALS]

    @classmethod
    def build(cls, texts: list[str], extra_tokens=()) -> WordTokenizer:
        words = sorted({w for t in texts for w in _WORD_RE.findall(t.lower())})
        specials = [*cls.SPECIALS, *extra_tokens]
        return cls(specials + [w for w in words if w not in specials])

    def encode(self, text: str) -> list[int]:
        return [self.index.get(w, self.unk_id) for w in _WORD_RE.findall(text.lower())]

    def decode(self, ids) -> str:
        text = " ".join(self.vocab[i] for i in ids if i not in (self.pad_id, self.bos_id, self.eos_id))
        return re.sub(r" ?- ?", "-", re.sub(r" ([.,;:?!])", r"\1", text))


# LoRA (Hu et al. 2021, arXiv:2106.09685) as PEFT's LoraLayer: W0 frozen, B = 0 at first; switched off, the reference.
class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        super().__init__()
        self.base = base
        out_f, in_f = base.weight.shape
        # fp32 adapters whatever the base's dtype (PEFT's autocast_adapter_dtype): bf16 would round updates away
        self.lora_A = torch.nn.Parameter(torch.empty(r, in_f, device=base.weight.device))  # (r, in)
        self.lora_B = torch.nn.Parameter(torch.zeros(out_f, r, device=base.weight.device))  # (out, r)
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's default init, as PEFT
        self.scaling, self.enabled = alpha / r, True
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        base.requires_grad_(False)

    def forward(self, x):
        out = self.base(x)
        if not self.enabled:
            return out
        x = self.dropout(x).to(self.lora_A.dtype)  # h = W0 x + (alpha / r) * B (A dropout(x))
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_A), self.lora_B) * self.scaling
        return out + delta.to(out.dtype)

    def delta_weight(self):
        """(alpha / r) * B A, (out, in), fp32: merges add it to the base weight in fp32 and round the sum once."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling


def apply_lora(model, target_modules, r=8, alpha=16.0, dropout=0.0, exclude=None) -> list[str]:
    """Wraps each nn.Linear named ...<target> outside `exclude` in a LoRALinear, freezes the rest -> their names."""
    skip = {id(m) for m in exclude.modules()} if exclude is not None else set()
    linear = [(n, m) for n, m in model.named_modules() if id(m) not in skip and isinstance(m, torch.nn.Linear)]
    matched = [(n, m) for n, m in linear if any(n == t or n.endswith("." + t) for t in target_modules)]
    if not matched:
        raise ValueError(f"no nn.Linear layer name ends with one of the LoRA targets {target_modules}")
    model.requires_grad_(False)
    for name, module in matched:
        model.set_submodule(name, LoRALinear(module, r, alpha, dropout))
    return [name for name, _ in matched]


@torch.no_grad()
def lora_merged_state_dict(model: torch.nn.Module) -> dict:
    """The state dict with every LoRA folded into its base layer (names as without LoRA), on the side."""
    state = model.state_dict()
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        del state[f"{name}.lora_A"], state[f"{name}.lora_B"]
        for key in [k for k in ("weight", "bias") if f"{name}.base.{k}" in state]:
            state[f"{name}.{key}"] = state.pop(f"{name}.base.{key}")
        state[f"{name}.weight"] = (state[f"{name}.weight"].float() + m.delta_weight()).to(m.base.weight.dtype)
    return state


@contextlib.contextmanager
def lora_disabled(model: torch.nn.Module):
    """Inside the block, LoRA off: the base model, the reference for free."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


# ==== 3. Labels: the 14 observations, the label cache, the labelers a reward calls (CheXbert; the rules: part 9) ======
# CheXbert's output order (No Finding last; the CheXpert labeler's CSV puts it first)
CHEXPERT_LABELS = ["Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema"]
CHEXPERT_LABELS += ["Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion", "Pleural Other"]
CHEXPERT_LABELS += ["Fracture", "Support Devices", "No Finding"]
FINDINGS = CHEXPERT_LABELS[:13]  # the 13 observations other than No Finding
LABEL_INDEX = {name: i for i, name in enumerate(CHEXPERT_LABELS)}
POSITIVE, NEGATIVE, UNCERTAIN, BLANK = 1.0, 0.0, -1.0, float("nan")


def binarize(labels, uncertain_as: int = 1) -> np.ndarray:
    """(N, 14) labels 1/0/-1/NaN -> int {0, 1}: positive, and uncertain when uncertain_as == 1."""
    x = np.asarray(labels, dtype=float)
    return ((x == 1) | ((x == -1) & (uncertain_as == 1))).astype(np.int64)


def apply_no_finding_rule(labels: np.ndarray) -> np.ndarray:
    """CheXpert's No Finding, in place: 1 when nothing but Support Devices is positive or uncertain, else blank."""
    others = [LABEL_INDEX[n] for n in FINDINGS if n != "Support Devices"]
    labels[..., LABEL_INDEX["No Finding"]] = np.where(np.isin(labels[..., others], (1, -1)).any(-1), np.nan, 1.0)
    return labels


class LabelCache:
    """Labels each distinct text once (a reference's G copies, repeated completions, reward texts again for CE)."""

    def __init__(self, labeler):
        self.labeler, self.labels = labeler, {}  # labels: text -> (14,) labels

    def __call__(self, texts: list[str]) -> np.ndarray:
        new = [t for t in dict.fromkeys(texts) if t not in self.labels]
        if new:
            self.labels.update(zip(new, self.labeler(new)))
        return np.array([self.labels[t] for t in texts]).reshape(len(texts), len(CHEXPERT_LABELS))  # (N, 14)


def make_labeler(name: str, chexbert_weights=None, device=None):
    """--labeler rule|chexbert; CheXbert on `device`, by default the GPU where there is one."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return RuleLabeler() if name == "rule" else CheXbertLabeler(weights=chexbert_weights, device=device)


# CheXbert (Smit et al. 2020, arXiv:2004.09167): BERT-base, one linear head per observation over [CLS]; 13 heads of
# 4 classes (0 blank, 1 positive, 2 negative, 3 uncertain), No Finding's of 2 (0 blank, 1 positive). As label.py:
CHEXBERT_CLASS_VALUES = (np.nan, POSITIVE, NEGATIVE, UNCERTAIN)
CHEXBERT_MAX_PIECES = 512  # including [CLS] and [SEP]: longer reports keep their first 510 pieces
CHEXBERT_REPO, CHEXBERT_FILE = "StanfordAIMI/RRG_scorers", "chexbert.pth"


def chexbert_model(config=None, path=None):
    """f1chexbert's bert_labeler, its BERT built from a config (its own __init__ downloads bert-base-uncased); `path`:
    chexbert.pth ({"model_state_dict": {"module.<name>": ...}}) loaded strictly (f1chexbert: strict=False)."""
    with warnings.catch_warnings():  # importing f1chexbert calls warnings.filterwarnings("ignore")
        from f1chexbert.f1chexbert import bert_labeler
    from transformers import BertConfig, BertModel

    sandbox = path is not None and Path(path).with_name("vocab.txt").is_file()  # the sandbox's layout
    if config is None and sandbox and Path(path).with_name("config.json").is_file():  # its small BERT's config
        config = BertConfig.from_json_file(Path(path).with_name("config.json"))
    config = config or BertConfig()  # bert-base-uncased: 30522 word pieces, 768 hidden, 12 layers

    class CheXbertModel(bert_labeler):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.bert, self.dropout = BertModel(config), torch.nn.Dropout(0.1)
            heads = [torch.nn.Linear(config.hidden_size, 4) for _ in range(13)]
            self.linear_heads = torch.nn.ModuleList(heads + [torch.nn.Linear(config.hidden_size, 2)])

    model = CheXbertModel()
    if path is None:
        return model
    if not Path(path).is_file():
        raise FileNotFoundError(f"CheXbert weights not found: {path} (or no --chexbert-weights: {CHEXBERT_REPO}'s)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        state = {k.removeprefix("module."): v for k, v in checkpoint.get("model_state_dict", checkpoint).items()}
    except (RuntimeError, OSError, EOFError, AttributeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not a CheXbert checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
    if "bert.embeddings.position_ids" not in model.state_dict():  # older transformers saved this buffer
        state.pop("bert.embeddings.position_ids", None)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: does not match CheXbert's model ({str(e)[:300]})") from None
    return model


def from_hub(load):
    """load(True) from the HF cache, else load(False) if the Hub answers, else an error now (no retries)."""
    try:
        return load(True)
    except OSError:  # not cached (transformers and huggingface_hub raise OSError subclasses)
        try:
            socket.create_connection(("huggingface.co", 443), timeout=5).close()
        except OSError as e:
            raise ValueError(
                f"--labeler chexbert needs {CHEXBERT_FILE} (Hub repo {CHEXBERT_REPO}) and bert-base-uncased's "
                f"tokenizer, and huggingface.co cannot be reached ({e}): give --chexbert-weights FILE (with the "
                "tokenizer in the Hugging Face cache), or --labeler rule (offline rules)"
            ) from None
    return load(False)


class CheXbertLabeler:
    """CheXbert's labels (N, 14) as RuleLabeler's, in batches sorted by length (f1chexbert labels one at a time)."""

    def __init__(self, weights=None, device="cpu", batch_size: int = 32, tokenizer=None, model=None):
        from transformers import BertTokenizerFast

        if model is None:  # the Hub's file: f1chexbert 0.0.2's own download passes the removed `force_filename`
            from huggingface_hub import hf_hub_download

            def download(offline):
                return hf_hub_download(CHEXBERT_REPO, CHEXBERT_FILE, local_files_only=offline)

            model = chexbert_model(path=from_hub(download) if weights is None else weights)
        vocab = Path(weights).with_name("vocab.txt") if weights is not None else None
        if tokenizer is None and vocab is not None and vocab.is_file():  # the sandbox's word pieces, beside the weights
            tokenizer = BertTokenizerFast.from_pretrained(str(vocab.parent))
        bert_base = "bert-base-uncased"  # CheXbert's word pieces
        self.tokenizer = tokenizer or from_hub(
            lambda hub: BertTokenizerFast.from_pretrained(bert_base, local_files_only=hub)
        )
        self.model = model.to(device).eval().requires_grad_(False)
        self.device, self.batch_size = torch.device(device), batch_size

    def encode(self, report: str) -> list[int] | None:
        """[CLS] pieces [SEP], cut to 512 as CheXbert; None for an empty report."""
        if not report.strip():
            return None
        ids = self.tokenizer(report, add_special_tokens=True)["input_ids"]
        if len(ids) > CHEXBERT_MAX_PIECES:
            ids = ids[: CHEXBERT_MAX_PIECES - 1] + [self.tokenizer.sep_token_id]
        return ids

    @torch.inference_mode()
    def __call__(self, reports: list[str]) -> np.ndarray:
        out = np.full((len(reports), len(CHEXPERT_LABELS)), np.nan)  # empty reports stay blank
        encoded = [(i, s) for i, s in enumerate(map(self.encode, reports)) if s is not None]
        encoded.sort(key=lambda x: len(x[1]))  # similar lengths share a batch: little padding
        for b in range(0, len(encoded), self.batch_size):
            chunk = encoded[b : b + self.batch_size]
            ids, mask = pad_completions([s for _, s in chunk], self.tokenizer.pad_token_id, self.device)  # (B, L) each
            # the reward runs inside the policy's bf16 autocast: labels must not depend on it
            with torch.autocast(ids.device.type, enabled=False):
                logits = self.model(ids, mask.long())  # f1chexbert's forward: 14 tensors (B, C)
            classes = torch.stack([lg.argmax(dim=1) for lg in logits], dim=1)  # (B, 14) 0 blank, 1 pos, 2 neg, 3 unc
            out[[i for i, _ in chunk]] = np.asarray(CHEXBERT_CLASS_VALUES)[classes.cpu().numpy()]
        return out


# ==== 4. The RL core: group advantages, the GRPO loss, the gradient average and clip; DPO is in orapo.py ===========
# Checked against TRL's GRPOTrainer._compute_loss and DPOTrainer; N rows and T tokens as in Policy; (loss, stats) out.
def group_advantages(rewards, group_size: int, scale: str = "std", eps: float = 1e-4):
    """Group-relative advantages (DeepSeekMath 4.1.2), (B*G,) -> (B*G,): "std" (r - mean_g) / (std_g + eps), Bessel's
    std (TRL); "none" r - mean_g (Dr. GRPO). Equal rewards give exactly 0 (r - mean(r) can be 1e-8 in float)."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"the reward function returned NaN or inf at completions {bad}")
    if group_size < 2:  # one completion per prompt: every advantage is 0 and nothing would be learned
        raise ValueError(f"--group-size {group_size}: group-relative advantages need at least 2 completions per prompt")
    r = rewards.view(-1, group_size).to(torch.promote_types(rewards.dtype, torch.float32))  # (B, G)
    A = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale == "std":
        A = A / (r.std(dim=1, keepdim=True) + eps)  # (B, G), Bessel's std (N - 1)
    same = (r == r[:, :1]).all(dim=1, keepdim=True)  # (B, 1) every reward of the group equal
    return torch.where(same, torch.zeros_like(A), A).flatten()  # (B*G,)


def grpo_loss(logp, ref_logp, advantages, mask, beta=0.0, loss_type="grpo", max_completion_length=None):
    """GRPO's loss for one update per rollout, plus the k3 KL -> (loss, stats): TRL's GRPOTrainer loss with
    num_iterations 1 (use_bias_correction_kl=False). One update per rollout makes pi_old the policy itself, so
    DeepSeekMath Eq. 3's ratio pi_theta / pi_old is exactly 1 (with logp's gradient) and its clip never acts: the loss
    per token is -A, its gradient -A grad log pi (so no --clip-eps). ref_logp None: no reference (beta 0). By loss_type:
      "grpo":    mean over each sequence's tokens, then over the N sequences
      "bnpo":    sum over all tokens / number of completion tokens in the batch
      "dr_grpo": sum over all tokens / (N * max_completion_length), a constant: a token weighs the same at any length
    A sequence with an empty mask contributes 0 and still counts among the N."""
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("dr_grpo needs max_completion_length (its constant normaliser)")
    mask = mask.to(logp.dtype)  # (N, T)
    A = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (N, 1) or (N, T)
    ratio = torch.exp(logp - logp.detach())  # (N, T) DeepSeekMath Eq. 3's ratio: 1, its gradient logp's
    per_token = -ratio * A  # (N, T)
    kl = None  # (N, T) with a reference
    if ref_logp is not None:
        # DeepSeekMath Eq. 4, k3 (unbiased, >= 0: http://joschu.net/blog/kl-approx.html): KL = exp(r) - r - 1
        log_r = ref_logp - logp  # (N, T) r = log pi_ref - log pi_theta
        kl = torch.exp(log_r) - log_r - 1  # (N, T)
        if beta:
            per_token = per_token + beta * kl  # (N, T)
    n_tokens = mask.sum().clamp(min=1)  # ()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()  # ()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / n_tokens  # ()
    else:
        loss = (per_token * mask).sum() / (mask.shape[0] * max_completion_length)  # ()
    return loss, {"kl": ((kl * mask).sum() / n_tokens).item() if kl is not None else 0.0}  # KL per token, logged


@contextlib.contextmanager
def gradient_sync(module: torch.nn.Module, last: bool):
    """--grad-accum under DDP: gradients averaged over ranks in the last micro-batch's backward only (no_sync). FSDP2
    reduce-scatters each micro-batch's (no unsharded gradients kept: 15 GB at 3B; k reductions a step, not 1)."""
    accumulate = isinstance(module, torch.nn.parallel.DistributedDataParallel) and not last
    with module.no_sync() if accumulate else contextlib.nullcontext():
        yield


def clip_gradients(params, max_norm: float | None) -> float:
    """The gradient norm over ranks (a sharded one gathered) before clipping to max_norm (None: no clipping)."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm or float("inf"))
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


# ==== 5. What one step writes and when: Run's steps, log line, optimizer step, checkpoint; its set-up and end =========
CHECKPOINT_EVERY = 50  # steps between checkpoints (also at the end, and when stopped by Ctrl-C)


class Run:
    """One run: processes (rank, world size, device, dtype), inputs (data, labeler), folder (README, "Run folders")."""

    def __init__(
        self, args, rank, world_size, device, data, labeler, resume_flags=None, check=True, notes=(), foundation=None
    ):
        self.args, self.out, self.data, self.labeler, self.notes = args, Path(args.out), data, labeler, list(notes)
        self.foundation = foundation  # the sandbox's foundation folder (--tiny-start foundation), else None
        self.rank, self.world_size, self.device, self.is_main = rank, world_size, device, rank == 0
        self.dtype = torch.bfloat16 if resolve_defaults(args).dtype == "bf16" else torch.float32
        self.resume_flags = resume_flags  # the flags a resume must keep; None: all but MAY_CHANGE_ON_RESUME
        self.start, self._saved = 0, None  # the first step and what checkpoints hold: restore() sets both
        self.trained, self.done = 0, None  # steps done (log_step: an evaluation's step); a finished run's eval.json
        self._stats = defaultdict(list)  # log()'s numbers of this step
        problem = self._check_folder() if check and self.is_main else None
        problem, self.done = broadcast_object((problem, self.done))
        if problem:
            raise ValueError(problem)
        self.resuming = bool(args.resume and (self.out / "config.json").is_file())
        self.resolved = {}  # what the flags' None and "auto" came to (record())
        if check:  # the flags, beside the run's files (a folder holding nothing else is a run that failed its checks)
            self.record()
        reports = check and self.is_main and args.report_to != "none"
        self.reporter = Reporter(args.report_to, self.out, asdict(args)) if reports else None

    def steps(self, total: int, batches, desc: str = "", start: int | None = None, bar=("loss", "reward")):
        """(step, batch), step = start (default: restore()'s) .. total - 1, a progress bar showing 4 of `bar`; the loop
        calls log_step(step), then checkpoint(step). Ctrl-C or SIGTERM is noted: that step's checkpoint() stops."""
        start = self.start if start is None else start
        self._progress = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, disable=not self.is_main)
        self._clock, self._total, self._bar, self._stop, self._stopped = time.time(), total, bar, [], False
        data = batches(start)
        optimizer = self._saved[1] if self._saved else None
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():  # Python sets handlers in the main thread only
            for signum in (signal.SIGINT, signal.SIGTERM):
                old_handlers[signum] = signal.signal(signum, lambda *_: self._stop.append(1))
        try:
            for step in range(start, total):
                self._lr = {"lr": optimizer.param_groups[0]["lr"]} if optimizer is not None else {}  # before the update
                yield step, next(data)
                if self._stopped:  # Ctrl-C: checkpoint() saved this step; the run stops here
                    saved = f"stopped after step {step + 1}, with {self.out / 'last.pt'} saved"
                    raise KeyboardInterrupt(f"{saved}: the same command with --resume continues")
        finally:
            self._progress.close()
            for signum, handler in old_handlers.items():
                signal.signal(signum, handler)

    def log(self, **stats):
        """Numbers for this step's line in metrics.jsonl (several calls in a step are averaged)."""
        for k, v in stats.items():
            self._stats[k].append(float(v))

    def log_step(self, step: int):
        """metrics.jsonl's line of `step` (as step + 1): time, lr, log()'s means over ranks. Every rank calls it."""
        stats = all_reduce_mean({k: float(np.mean(v)) for k, v in sorted(self._stats.items())})
        row = {"step": step + 1, "time": round(time.time() - self._clock, 2), **self._lr, **stats}
        self.trained = step + 1
        self._stats.clear()
        if self.is_main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.reporter:
                self.reporter.log(row, step + 1)
            self._progress.update(1)
            self._progress.set_postfix({k: f"{row[k]:.3g}" for k in self._bar[:4] if k in row}, refresh=False)

    def checkpoint(self, step: int):
        """out/last.pt after `step` when due: every CHECKPOINT_EVERY steps, at the last, after Ctrl-C (then steps()
        stops the run). Every rank calls it: its RNG state goes in, a resume draws as if never stopped."""
        self._stopped = all_reduce_mean(float(bool(self._stop))) > 0  # every rank stops at the same step
        if self._saved and ((step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == self._total or self._stopped):
            self.save_checkpoint(step + 1)

    def save_checkpoint(self, step: int):
        """out/last.pt with the step count `step`: what restore() named, and every rank's RNG states."""
        model, optimizer, scheduler, state = self._saved
        kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as tensors and lists: loadable with weights_only
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        rng["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        states = all_gather_objects(rng)
        frozen = {k for k, p in model.named_parameters() if not p.requires_grad}  # not saved: the start holds them
        weights, optim = full_state_dicts(model, optimizer) if isinstance(model, FSDPModule) else (None, None)
        if self.is_main:
            weights = weights or {k: v for k, v in model.state_dict().items() if k not in frozen}
            if optim is None and optimizer is not None:  # not sharded
                optim = optimizer.state_dict()
            checkpoint = {"step": step, "model": weights, "partial": bool(frozen), "rng": states, "extra": state or {}}
            schedule = scheduler.state_dict() if scheduler is not None else None
            checkpoint |= {"optimizer": optim, "scheduler": schedule, "config": asdict(self.args)}
            atomic_save(checkpoint, self.out / "last.pt")
        barrier()

    def autocast(self):
        return autocast(self.device, self.dtype)

    def write(self, name: str, text: str):
        """Rank 0 writes out/<name> ("a/x.json" too) atomically: no half-written file."""
        if self.is_main:
            atomic_save(text, self.out / name)

    # Set-up: the folder and its flags, stages, resume, batches -------------------------------------------
    def record(self, **resolved):
        """config.json: the flags, the notes, and what a script resolved its defaults to (`resolved`: "lr": 1e-4)."""
        self.resolved |= resolved
        config = asdict(self.args) | {"notes": self.notes, "resolved": self.resolved}
        self.write("config.json", json.dumps(config, indent=2, default=str))

    def _check_folder(self) -> str | None:
        """A fresh run needs an empty folder, a resumed one the run's flags; a finished one sets .done (eval.json)."""
        config = self.out / "config.json"
        if not self.args.resume:
            if self.out.is_dir() and any(p.is_file() and p.name != "config.json" for p in self.out.rglob("*")):
                return f"{self.out} already holds a run: pass --resume to continue it, or give another --out"
        elif config.is_file():
            saved, now = json.loads(config.read_text()), json.loads(json.dumps(asdict(self.args), default=str))
            keep = self.resume_flags or [k for k in now if k not in MAY_CHANGE_ON_RESUME]
            diff = [k for k in keep if k in saved and saved[k] != now[k]]  # a flag newer than the run: its default
            if diff:
                shown = "; ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} in the run, {now[k]!r} now" for k in diff)
                return f"--resume with flags that differ from {config}: {shown}"
            if (self.out / "eval.json").is_file():
                self.done = json.loads((self.out / "eval.json").read_text())
        elif self.resume_flags is None:
            return f"--resume: {config} not found; is --out the folder of the run to resume?"

    def stage(self, name: str, flags) -> Run:
        """A run in out/<name> (config, log, checkpoint) sharing processes, data, labeler; --resume checks `flags`."""
        args, inputs = dataclasses.replace(self.args, out=str(self.out / name)), (self.data, self.labeler)
        processes = (self.rank, self.world_size, self.device)
        return Run(args, *processes, *inputs, resume_flags=tuple(flags), notes=self.notes, foundation=self.foundation)

    def per_rank(self, batch_size: int, flag: str) -> int:
        """A global batch (as the papers count) -> this rank's share."""
        return exact_div(batch_size, self.world_size, f"{flag} over {self.world_size} processes")

    def restore(self, model, optimizer=None, scheduler=None, state: dict | None = None) -> int:
        """Checkpoints hold the trainable weights, buffers, optimiser, schedule, `state`; --resume loads them."""
        self._saved = (model, optimizer, scheduler, state)
        if self.resuming and (self.out / "last.pt").is_file():
            self.start, extra = load_checkpoint(self.out / "last.pt", model, optimizer, scheduler)
            if state is not None:
                state.update(extra)
        if self.resuming and self.is_main and (self.out / "metrics.jsonl").is_file():  # drop lines after the checkpoint
            rows = (self.out / "metrics.jsonl").read_text().splitlines(keepends=True)
            self.write("metrics.jsonl", "".join(r for r in rows if json.loads(r)["step"] <= self.start))
        return self.start

    def study_batches(self, records: list, batch_size: int, flag: str = "--batch-size", transform="pil"):
        """batches(start) for steps(): this rank's share of shuffled global batches of studies (images: `transform`)."""
        n = self.per_rank(batch_size, flag)

        def batches(start: int):
            epochs_and_batches = study_batches(records, n, self.args.seed, self.rank, self.world_size, start, transform)
            return (batch for _, batch in epochs_and_batches)

        return batches

    # The end: evaluation, the trained model, the results -------------------------------------------------
    def evaluate(self, policy, records, name, prompt, max_new_tokens, report=None, score=None, meteor=False, ce=None):
        """Greedy reports for `records`, shared over ranks; rank 0 scores report(completion) by NLG, CE (`ce`: the
        paper's convention), score(rows, labeler) -> eval_<name>.json, generations_<name>.jsonl (--resume: read)."""
        module = getattr(report, "__module__", "builtins")  # "module:name" of report(), for `tests/reports.py generate`
        module = Path(sys.argv[0]).stem if module == "__main__" else module  # `python mrg_r1.py`: mrg_r1
        report_fn = None if report is None else f"{module}:{report.__qualname__}"
        self.generation = {"prompt": prompt, "max_new_tokens": max_new_tokens, "report": report_fn}  # final/'s
        path = self.out / f"eval_{name}.json"
        if self.resuming and path.is_file():
            return broadcast_object(json.loads(path.read_text()) if self.is_main else None)
        mine = records[self.rank :: self.world_size]  # each rank a strided share, greedy
        # padded as long as rank 0's share: every rank makes as many generate() calls (FSDP)
        padded = mine + records[: len(records[:: self.world_size]) - len(mine)]
        bar, batch = name if self.is_main else None, self.args.eval_batch_size
        completions = greedy_reports(policy, padded, prompt, max_new_tokens, self.device, self.dtype, bar, batch)
        completions = gather_strided(completions[: len(mine)], self.world_size)
        results = None
        if self.is_main:
            rows = [{"id": r.id, "reference": r.report, "generated": c} for r, c in zip(records, completions)]
            if report:  # the report taken from the completion, the completion beside it
                rows = [row | {"generated": report(row["generated"]), "completion": row["generated"]} for row in rows]
            labeler = LabelCache(self.labeler)  # the method's score and the CE metrics label the same texts
            gold = np.stack([r.labels for r in records]) if all(r.labels is not None for r in records) else None
            ce = dict(ce or {}, gold=gold, name=name)
            results = evaluate_generations(rows, labeler, self.args.clean, meteor=meteor, **ce)
            if score:
                results |= score(rows, labeler)
            self.write(f"generations_{name}.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
            self.write(path.name, json.dumps(results, indent=2))
            if self.reporter:  # the headline CE number and the NLG columns, at the steps run so far
                headline = {f"{name}/{results['headline']}": results["ce"][results["headline"]]}
                self.reporter.log(headline | {f"{name}/{k}": v for k, v in results["nlg"].items()}, self.trained)
        return broadcast_object(results)

    def finish(self, results: dict, policy=None) -> dict:
        """The trained policy to out/final/, the results to out/eval.json (--resume's sign that the run is done)."""
        weights = full_state_dicts(policy.model)[0] if isinstance(getattr(policy, "model", None), FSDPModule) else None
        if self.is_main and policy is not None:
            policy.save(self.out / "final", weights)
            if getattr(self, "generation", None):  # how it writes a report: `tests/reports.py generate RUN IMAGE`
                atomic_save(json.dumps(self.generation, indent=1), self.out / "final" / "generation.json")
        self.write("eval.json", json.dumps(results, indent=2))
        if self.is_main and os.environ.get("RRG_FIGURES") != "0":  # RRG_FIGURES=0: none (the tests, the sweeps)
            draw_training(self.out)
        if self.reporter:
            self.reporter.close()
        barrier()
        return results


class Reporter:
    """--report-to: metrics.jsonl's lines and each evaluation's headline numbers, live, in TensorBoard or W&B."""

    def __init__(self, kind: str, out: Path, config: dict):
        if importlib.util.find_spec(kind) is None:
            raise ValueError(f"--report-to {kind}: `pip install {kind}` first (it is no requirement of this project)")
        self.kind = kind
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"))
        else:
            import wandb

            self.writer = wandb.init(project="rrg-from-scratch", name=str(out), dir=str(out), config=config)

    def log(self, numbers: dict, step: int):
        numbers = {k: float(v) for k, v in numbers.items() if isinstance(v, int | float) and k != "step"}
        if self.kind == "wandb":
            return self.writer.log(numbers, step=step)
        for k, v in numbers.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # seen at once, not after TensorBoard's 2 minutes

    def close(self):
        if self.kind == "wandb":
            return self.writer.finish()
        self.writer.close()


def draw_training(out) -> list[Path]:
    """<folder>/figures/training.png for out and every stage folder below it, from its metrics.jsonl: a panel per
    logged number against the step (keys "a/b" share panel a), with a running mean. Needs matplotlib (else none)."""
    try:
        from matplotlib import figure  # not pyplot: no global backend to set, no figure to close
    except ImportError:
        return []
    drawn = []
    for metrics in sorted(Path(out).glob("**/metrics.jsonl")):
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        panels = defaultdict(dict)  # panel -> {line: (n, 2) steps and values}
        for key in dict.fromkeys(k for r in rows for k in r if k not in ("step", "time")):
            panel, _, line = key.partition("/")
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            panels[panel][line or panel] = np.array(points)
        cols, n_rows = max(1, min(4, len(panels))), max(1, math.ceil(len(panels) / 4))  # 4 a row at most; none: blank
        fig = figure.Figure(figsize=(3.2 * cols, 2.3 * n_rows))
        axes = fig.subplots(n_rows, cols, squeeze=False)
        for ax, (panel, lines) in zip(axes.flat, panels.items()):
            for label, (x, y) in ((k, v.T) for k, v in lines.items() if len(v)):
                w = max(1, len(x) // 15)  # running mean over w steps
                alpha, marker = (0.35 if w > 1 else 1), ("." if len(x) <= 30 else None)
                (raw,) = ax.plot(x, y, lw=0.6, alpha=alpha, marker=marker, label=label)  # a legend with two or more
                if w > 1:
                    ax.plot(x[w - 1 :], np.convolve(y, np.ones(w) / w, "valid"), lw=1.2, color=raw.get_color())
            ax.set_title(panel, fontsize=8)
            ax.tick_params(labelsize=6)
            if len(lines) > 1:
                ax.legend(fontsize=5)
        for ax in axes.flat[len(panels) :]:
            ax.axis("off")
        fig.suptitle(f"{metrics.parent} (x: step)", fontsize=8)
        fig.tight_layout()
        png = metrics.parent / "figures" / "training.png"
        png.parent.mkdir(exist_ok=True)
        fig.savefig(png, dpi=80)
        drawn.append(png)
    return drawn


def greedy_reports(policy, records, prompt, max_new_tokens: int, device, dtype, bar=None, batch: int = 32) -> list[str]:
    """Greedy completions for the records' views, `batch` studies at a time (`bar`: a progress bar's name)."""
    completions = []
    for b in tqdm(range(0, len(records), batch), desc=bar, disable=bar is None):
        images = [[load_image(p, r.id) for p in r.image_paths] for r in records[b : b + batch]]
        with torch.no_grad(), autocast(torch.device(device), dtype):
            prompts = policy.prompt_batch(images, prompt)
            completions += policy.decode(*policy.generate(prompts, max_new_tokens, do_sample=False))
    return completions


def atomic_save(obj, path: Path):
    """torch.save (a str: its text) beside `path`, then renamed: a crash keeps the old file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, str):
        tmp.write_text(obj)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


# ==== 6. Set-up: the shared flags, start_run, warm starts, the policy and its reference, AdamW, resume ================
@dataclass
class RunArgs:
    """The flags every script shares; a script's Args adds its paper's hyper-parameters."""

    data: str = "synthetic"
    """"synthetic", or an R2Gen-layout annotation.json (IU X-Ray, MIMIC-CXR) or its folder"""
    model: str = "tiny"
    """"tiny" (built in, offline) or a Hugging Face vision-language model id or folder"""
    labeler: Literal["auto", "rule", "chexbert"] = "auto"
    """chexbert (the papers'); rule (offline CheXpert rules); auto: chexbert, rule for tiny on real data unweighted"""
    chexbert_weights: str | None = None
    """a local chexbert.pth (else downloaded once from the Hub; on --data synthetic the sandbox's, shipped)"""
    out: str | None = None
    """the run's folder, empty or absent for a fresh run; None: runs/<script>-<data name> ("synthetic", the folder's)"""
    seed: Annotated[int, "[0, 2e9]"] = 0
    """data order, initial weights and samples (rank r samples with seed + r)"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 (the papers') on a GPU that has it, else fp32; what trains keeps fp32 master weights"""
    clean: Literal["auto", "iu_xray", "mimic_cxr"] = "auto"
    """R2Gen's report cleaning (NLG metrics); auto: IU X-Ray's for Open-i image names, else MIMIC-CXR's"""
    tiny_start: Literal["auto", "foundation", "random"] = "auto"
    """--model tiny's start: the sandbox's foundation (a pre-trained tiny VLM) or random; auto: foundation, synthetic"""
    resume: bool = False
    """continue the run in --out from its last checkpoint, with the flags in its config.json"""
    drop_invalid: bool = False
    """skip annotation records with a missing image or an empty report (each is logged)"""
    eval_batch_size: Annotated[int, "[1, inf)"] = 32
    """studies a generate() call when evaluating (greedy); a GPU runs 64 rows about as fast as 8 (tests/MACHINES.md)"""
    gpu_memory: Annotated[float | None, "(0, inf)"] = None
    """GiB a GPU holds, for the memory check a Hugging Face run makes before it loads weights; None: the GPU's own"""
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    """mirror metrics.jsonl and each evaluation's headline numbers to TensorBoard or W&B (pip install it first)"""


MAY_CHANGE_ON_RESUME = ("resume", "out", "report_to")  # another --steps would move the lr schedule: another run


def resolve_defaults(args):
    """The "auto" flags made concrete, as config.json records them: labeler, dtype (clean needs the data)."""
    if args.labeler == "auto":  # the papers' CheXbert (the sandbox's own on --data synthetic), else rules offline
        offline = args.model == "tiny" and args.data != "synthetic" and not args.chexbert_weights
        args.labeler = "rule" if offline else "chexbert"
    if args.dtype == "auto":  # no fp16: its gradients need loss scaling, which no script does
        args.dtype = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if args.model == "tiny" and args.tiny_start == "auto":  # as the papers, a pre-trained start (the sandbox's)
        args.tiny_start = "foundation" if args.data == "synthetic" else "random"
    if args.model == "tiny" and args.tiny_start == "foundation" and args.data != "synthetic":
        raise ValueError("--tiny-start foundation needs --data synthetic: the foundation knows its images and words")
    return args


def start_run(args, stages: bool = False, notes=(), memory: tuple = ()) -> Run:
    """torchrun, device, threads; the "auto" flags; data and labeler; the folder (Run checks it). Nothing is written
    before inputs are checked. `notes`: what the run cannot do as the paper does. The script seeds, in view."""
    rank, world_size, device = setup_distributed()
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # one thread (tests/MACHINES.md, "Threads"):
        torch.set_num_threads(1)  # spinning threads ran 17x slower on a busy machine, sleeping ones 1.3x
    resolve_defaults(args)
    foundation = sandbox().start(args, rank) if args.data == "synthetic" else None  # the set, CheXbert, foundation
    data = load_data(args.data, drop_invalid=args.drop_invalid)
    empty = [split for split in ("train", "test") if not data[split]]
    if empty:  # before anything is written: a start that fails leaves nothing behind
        dropped = " left by --drop-invalid" if args.drop_invalid else ""
        raise ValueError(f"--data {args.data}: no {' or '.join(empty)} studies{dropped}")
    if args.clean == "auto":
        args.clean = clean_style([r for records in data.values() for r in records])
    if args.model != "tiny" and memory:  # before the weights load, and before anything is written
        check_memory(args, memory, rank, world_size, device, np.mean([len(r.image_paths) for r in data["train"]]))
    labeler = make_labeler(args.labeler, args.chexbert_weights, device)
    rule = (
        "labels from the rule labeler (offline CheXpert-style rules), not CheXbert as in the papers: rewards and "
        "CE numbers do not compare with published ones (--labeler chexbert)"
    )
    notes = [rule, *notes] if args.labeler == "rule" else list(notes)
    run = Run(args, rank, world_size, device, data, labeler, check=not stages, notes=notes, foundation=foundation)
    if rank == 0:
        log.info(start_block(run))
        for note in notes:
            log.warning("note: %s", note)
    return run


GPU_RESERVE_GIB = 2.0  # kept free of the estimate: the CUDA context, NCCL's buffers, the allocator's slack (ours)


def check_memory(args, shapes, rank: int, world: int, device, views: float):
    """A Hugging Face run's peak GiB per GPU (memory_estimate, the largest over its kinds of step), logged beside the
    GPU's (--gpu-memory, else the device's); beyond it, one error naming what would fit (--grad-accum, --fsdp, LoRA)."""
    pixels = getattr(args, "max_pixels", 512 * 512)

    def need(change=None) -> float:  # the peak over the kinds of step, each changed by `change`
        steps = [dataclasses.replace(s, **change or {}) for s in shapes]
        return max(max(memory_estimate(args.model, s, world, views, pixels).values()) for s in steps)

    have = args.gpu_memory
    if have is None and device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory / 2**30
    peak = need()
    if rank == 0:
        log.info("%-12s~%.1f GiB per GPU at the step's peak%s", "memory", peak, f", of {have:.1f}" if have else "")
    if have is None or peak <= have - GPU_RESERVE_GIB:
        return
    per_rank = min(s.studies // world // s.grad_accum for s in shapes)  # studies a micro-batch
    options = [f"--grad-accum {k * shapes[0].grad_accum}" for k in (2, 4, 8, 16) if per_rank % k == 0]
    options = [o for o in options if need({"grad_accum": int(o.split()[1])}) <= have - GPU_RESERVE_GIB][:1]
    if world > 1 and hasattr(args, "fsdp") and not args.fsdp and need({"fsdp": True}) <= have - GPU_RESERVE_GIB:
        options.append("--fsdp")
    lora = dict(r=64, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if not any(s.lora for s in shapes) and need({"lora": lora, "reference": False}) <= have - GPU_RESERVE_GIB:
        options.append("LoRA (r 64: the script's LORA)")
    fits = "would fit: " + ", or ".join(options) if options else "more GPUs with --fsdp, or a smaller model"
    raise ValueError(
        f"--model {args.model}: ~{peak:.1f} GiB per GPU at this step's peak, over the {have:.1f} GiB GPU less "
        f"{GPU_RESERVE_GIB:g} kept free; {fits} (tests/MACHINES.md, 'Memory per GPU')"
    )


def start_block(run: Run) -> str:
    """What a run reads and where it writes, a line each."""
    args, views = run.args, Counter(len(r.image_paths) for records in run.data.values() for r in records)
    data = sandbox().synthetic_data() if args.data == "synthetic" else args.data
    weights = args.chexbert_weights or "StanfordAIMI/RRG_scorers' chexbert.pth (the papers')"
    lines = {
        "run folder": f"{run.out} ({'a new run' if not args.resume else '--resume: continued'})",
        "data": f"{data}: {', '.join(f'{k} {len(v)}' for k, v in run.data.items())} studies; views per study: "
        f"{', '.join(f'{v} in {n}' for v, n in views.most_common())} studies; cleaning {args.clean}",
        "model": f"{args.model}; {args.dtype} on {run.device}; {run.world_size} process(es)"
        + (f"; starts from the sandbox's foundation, {run.foundation}" if run.foundation else ""),
        "labeler": f"chexbert, {weights}" if args.labeler == "chexbert" else "rule (offline CheXpert-style rules)",
    }
    if args.resume and run.done:  # a finished run: --resume reads its results back, trains nothing
        lines["run folder"] = f"{run.out} (finished: --resume has nothing to train; its eval.json is read back)"
    return "\n".join(f"{k:<12}{v}" for k, v in lines.items())


def run_main(train, args_class, argv=None, doc=None, commands: tuple = ()):
    """A script's main(): flags (a first word picks one of `commands`), train; bad input or Ctrl-C: one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = None
    if commands:  # the first word, else the first command
        command = argv.pop(0) if argv and not argv[0].startswith("-") else commands[0]
        if command not in commands:
            raise SystemExit(f"error: unknown command {command!r}; use one of {', '.join(commands)}")
    args = parse_args(args_class, argv, doc)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:  # any other exception is a bug: its traceback propagates
        results = train(command, args) if commands else train(args)
    except (OSError, ValueError) as e:  # bad input (a file, a record, a flag): one line, no traceback
        end_process(f"error: {e}", at_once=True)
    except KeyboardInterrupt as e:  # Ctrl-C: the shell's code for SIGINT, 128 + 2
        end_process(f"interrupted{': ' + str(e) if str(e) else ''}", code=130)
    if os.environ.get("RANK", "0") == "0":
        print(end_block(args.out))
    end_process()
    return results


def end_block(out) -> str:
    """Where a run wrote, a line each: its folder, results, test generations and learning curves (its stages' too)."""
    out, lines = Path(out), [f"{'run folder':<12}{out}"]
    files = {"results": "eval.json", "generations": "generations_test*.jsonl", "figures": "figures/training.png"}
    for kind, glob in files.items():
        found = sorted([*out.glob(glob), *out.glob(f"*/{glob}")], key=os.path.getmtime)
        if found:
            lines.append(f"{kind:<12}{', '.join(str(f.relative_to(out)) for f in found)}")
    return "\n".join(lines)


@dataclass
class Convergence:
    """A stopping rule declared before any run: every `every` steps a validation score (higher: better), the best
    weights kept; it stops after `patience` without a `min_gain` gain, or at `max_steps`. Checkpoints hold its state."""

    every: int
    patience: int
    min_gain: float
    max_steps: int
    best: float = -math.inf
    best_step: int = 0
    waited: int = 0  # validations since the best
    best_weights: dict = field(default_factory=dict)  # the trainable parameters at the best validation

    def update(self, score: float, step: int, model: torch.nn.Module) -> dict:
        """One validation's score -> the numbers a progress bar shows (this score, the best, validations left)."""
        if score >= self.best + self.min_gain:
            self.best, self.best_step, self.waited = score, step, 0
            self.best_weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        else:
            self.waited += 1
        return {"validation": score, "best": self.best, "patience_left": self.patience - self.waited}

    @property
    def converged(self) -> bool:
        return self.waited >= self.patience

    def why(self, steps: int) -> str:
        """The line that ends a run of the rule: where it stopped, why, and which weights it kept."""
        reason = f"{self.waited} validations without a gain of {self.min_gain:g}" if self.converged else "max_steps"
        kept = f"kept step {self.best_step}'s weights (validation {self.best:.4f})"
        return f"stopped after {steps} steps ({reason}); {kept}"


def sft_stage(
    stage,
    policy,
    records,
    steps,
    lr,
    batch_size,
    prompt,
    targets=None,
    blind=False,
    converge=None,
    validate=None,
    grad_accum=1,
    extra=None,
):
    """SFT in a stage of its own: the teacher-forced likelihood of targets(batch) (default: the reports) on what
    requires grad, AdamW at a constant lr, `grad_accum` micro-batches a step; `blind`: each view a blank image (a
    fluent, task-naive start). `steps` steps, or with `converge` until validate(stage, policy, step) stops improving,
    the best weights kept; extra(stage, policy) adds to its results. --resume continues it, or reads it back."""
    if stage.done is not None:
        return stage.done
    fp32_trainable(policy.model)
    policy.forward_module = data_parallel(policy.model, stage.world_size)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer, _ = adamw(params, lr, total=1)  # a constant lr: no schedule
    seed_everything(stage.args.seed, stage.rank)  # ranks sample apart from here
    trained = stage.restore(policy.model, optimizer, state=vars(converge) if converge else None)
    total = converge.max_steps if converge else steps
    batches = stage.study_batches(records, batch_size, f"the {stage.out.name} batch")
    shown = ("sft_loss", "validation", "best", "patience_left")
    for step, batch in stage.steps(total, batches, stage.out.name, bar=shown):
        if converge and converge.converged:
            break  # decided at the last validation (its metrics line is written)
        micros = split_batch(batch, grad_accum)
        for k, micro in enumerate(micros):
            images = micro["images"]
            if blind:
                images = [[Image.new("L", view.size) for view in views] for views in images]
            texts = targets(micro) if targets else micro["report"]
            with gradient_sync(policy.forward_module, last=k == len(micros) - 1):
                with stage.autocast():
                    loss = policy.sft_loss(policy.prompt_batch(images, prompt), texts)
                (loss / grad_accum).backward()  # the last micro-batch's averages the gradients over ranks
            stage.log(sft_loss=loss.item())
        stage.log(grad_norm=clip_gradients(params, None))  # no clipping: the norm is logged
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trained = step + 1
        if converge and trained % converge.every == 0:
            stage.log(**converge.update(validate(stage, policy, trained), trained, policy.model))
        stage.log_step(step)  # <stage>/metrics.jsonl: this step's line
        stage.checkpoint(step)  # <stage>/last.pt every 50 steps, at the last step and on Ctrl-C
    results = {"steps": trained}
    if converge:
        policy.model.load_state_dict(converge.best_weights, strict=False)  # the best validation's weights
        results["converge"] = asdict(dataclasses.replace(converge, best_weights={}))
        if stage.is_main:
            log.info("%s: %s", stage.out.name, converge.why(trained))
    return stage.finish(results | (extra(stage, policy) if extra else {}), policy)


# The RL scripts' policy, optimiser and schedule --------------------------------------------------
def initial_policy(run, reports, max_new: int, extra_tokens=(), max_pixels=512 * 512, init=None, fsdp=False):
    """--model's policy before training, equal on every rank: `init` (a saved policy), the sandbox's foundation, a
    random tiny model on the reports' words, or the HF model's own weights (fsdp: kept in host memory, for shard())."""
    host = fsdp and run.world_size > 1 and run.args.model != "tiny"
    if init is not None or run.foundation is not None:
        policy = load_policy(init or run.foundation / "vlm", run.device, run.dtype, max_pixels=max_pixels, host=host)
    else:
        policy = make_policy(run.args.model, reports, run.device, run.dtype, max_new, extra_tokens, max_pixels, host)
    if run.args.model == "tiny":  # random weights drawn alike on every rank, or not: rank 0's (a HF model's are read)
        broadcast_parameters(policy.model)
    return policy


def add_lora(policy, lora: dict):
    """Adapters ({r, alpha, dropout, targets}) on the language model, none in the vision tower."""
    vision = policy.vision_and_language()[0]  # its MLP shares the LM's names
    apply_lora(policy.model, lora["targets"], lora["r"], lora["alpha"], lora["dropout"], exclude=vision)


def warm_start(run, policy, records: list, settings: dict, lora: dict | None = None, max_pixels=512 * 512, fsdp=False):
    """SFT before RL (sft_stage's `settings`) in out/warm_start, on `lora`'s adapters if given, the model whole on
    each GPU; the policy it saved (LoRA folded in), loaded back: the RL's start (fsdp: kept in host memory)."""
    if lora:
        add_lora(policy, lora)
    stage = run.stage("warm_start", run.resume_flags or ())
    sft_stage(stage, policy, records, **settings)
    host = fsdp and run.world_size > 1 and run.args.model != "tiny"
    return load_policy(stage.out / "final", run.device, run.dtype, max_pixels=max_pixels, host=host)


def for_training(run: Run, policy, *, lora: dict | None = None, reference: bool = True, fsdp: bool = False):
    """(policy, reference) to train: `lora`: fresh LM adapters, the reference them off (LoRAOff); else a frozen copy, or
    None (reference=False). What trains keeps fp32 weights; under torchrun FSDP2 shards it (fsdp), or DDP."""
    if lora:
        add_lora(policy, lora)
    ref = LoRAOff(policy) if lora else (frozen_reference(policy) if reference else None)
    if fsdp:  # after any warm start, which saved the model whole; block by block, fp32 master weights in each
        shard(policy.model, run.dtype)
        if isinstance(ref, Policy):
            shard(ref.model, run.dtype)
    fp32_trainable(policy.model)  # bf16 weights: AdamW's small steps need fp32 master weights (sharded: done)
    policy.forward_module = data_parallel(policy.model, run.world_size)
    return policy, ref


def frozen_reference(policy):
    """A frozen copy computing as the policy at its start: linear and conv weights in --dtype (autocast's anyway), the
    rest (embeddings, norms) fp32 where fp32_trainable makes the policy's (bf16: KL and DPO margins not 0 at step 0)."""
    ref = copy.deepcopy(policy)
    for m, m_ref in zip(policy.model.modules(), ref.model.modules()):
        pairs = zip(m.parameters(recurse=False), m_ref.parameters(recurse=False))
        linear = isinstance(m, torch.nn.Linear | torch.nn.Conv2d | torch.nn.Conv3d)
        for p_ref in [q for p, q in pairs if p.requires_grad and not linear]:
            p_ref.data = p_ref.data.float()
    ref.model.eval().requires_grad_(False)
    return ref


# What a step holds on one GPU, said before the weights load ------------------------------------------------------
@dataclass
class StepShape:
    """One step as a GPU holds it, for memory_estimate: `studies` a step over all ranks, `rows` scored a study (G, +1
    with OraPO's ground truth; 1 for SFT), `tokens` a row's completion or target; rollout: the step samples first."""

    studies: int
    rows: int = 1
    tokens: int = 256
    grad_accum: int = 1
    rollout: bool = True
    reference: bool = False  # a frozen copy of the policy (LoRA's reference is the adapters off: no copy)
    lora: dict | None = None
    trained: str = "all"  # all, lora (the adapters) or vision (the tower and merger, the LM frozen)
    fsdp: bool = False


def memory_estimate(model: str, shape: StepShape, world: int, views: float = 1, max_pixels: int = 512 * 512) -> dict:
    """Peak GiB per GPU of each phase of a Qwen2-VL-family step (bf16 compute, fp32 master weights, AdamW, activation
    checkpointing), from the config, by the terms tests/memory_check.py measures with MemTracker."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        net = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model))
    text, vis = net.config.text_config, net.config.vision_config
    N = sum(p.numel() for p in net.parameters())
    embed = net.get_input_embeddings().weight.numel()
    vision = sum(p.numel() for p in net.model.visual.parameters())
    lm_linear = [m for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and ".visual." not in f".{n}."]
    if shape.lora:  # r (in + out) a targeted LM linear
        targets = [m for n, m in net.named_modules() if m in lm_linear and n.split(".")[-1] in shape.lora["targets"]]
        trained = sum(shape.lora["r"] * (m.in_features + m.out_features) for m in targets)
    else:
        trained = vision if shape.trained == "vision" else N
    k, GiB = (world if shape.fsdp else 1), 2**30
    d, L, V = text.hidden_size, text.num_hidden_layers, text.vocab_size
    kv = text.num_key_value_heads * (d // text.num_attention_heads)
    blocks = [m for m in net.modules() if type(m).__name__ in net._no_split_modules]
    block = max(sum(p.numel() for p in m.parameters()) for m in blocks)
    tokens_per_view = max_pixels // 28**2  # Qwen2-VL: a token per 28 x 28 pixels after the 2 x 2 merge
    P = math.ceil(views) * tokens_per_view + 60  # the chat template's text around the views
    studies = math.ceil(shape.studies / world)  # (a script checks that they divide)
    rows = studies * shape.rows  # scored this step on this GPU
    micro_studies, micro_rows = studies / shape.grad_accum, rows / shape.grad_accum
    # the states: fp32 master weights, gradients and AdamW of what trains, the rest in bf16; a frozen copy (linear
    # weights bf16, the embedding fp32); FSDP2 shards all of it, and holds a block and the root's embedding whole
    states = (16 * trained + 2 * (N - trained) + (2 * (N - embed) + 4 * embed if shape.reference else 0)) / k
    gathered = 2 * (2 * block + embed) if shape.fsdp and k > 1 else 0
    cast = 0 if shape.fsdp and k > 1 else 2 * trained  # autocast's bf16 copies of fp32 weights (FSDP2 gathers bf16)
    # generate: the KV cache at its full length, bf16, and under FSDP2 the language model gathered (common.gathered)
    cache = studies * shape.rows * (P + shape.tokens) * L * 2 * kv * 2
    rollout = states - 4 * trained / k + cast + cache + (2 * (N - vision) if shape.fsdp and k > 1 else 0)  # no grads
    # a micro-batch's forward and backward: each layer's input kept (checkpointing), the views' through the tower
    # once a study, bf16 logits with each row's fp32 log-softmax saved and the logits' bf16 gradient
    layers = micro_rows * (P + shape.tokens) * d * 2 * L
    layers += micro_studies * views * 4 * tokens_per_view * vis.hidden_size * 2 * vis.depth
    logits = micro_rows * shape.tokens * V * (2 + 4 + 2)
    # the first micro-batch's forward has no gradients yet; its backward ends with them and few activations left
    before = states - (4 * trained / k if shape.grad_accum == 1 else 0)
    update = max(before + layers + logits, states) + gathered + cast
    reference = before + gathered + micro_rows * shape.tokens * V * 2 + shape.tokens * V * 4  # no graph: row by row
    phases = dict(rollout=rollout if shape.rollout else 0, reference=reference if shape.reference or shape.lora else 0)
    temporaries = 8 * embed / k if trained == N else 0  # AdamW's step: the largest trained tensor's, twice in fp32
    root = 2 * embed if shape.fsdp and k > 1 else 0  # FSDP2's root keeps its own weights (the embedding) gathered
    phases |= dict(update=update, optimizer=states + temporaries + root)
    return {name: b / GiB for name, b in phases.items()}


def adamw(params, lr: float, total: int, schedule: str = "constant", warmup: float = 0.0, **kwargs):
    """AdamW; lr rises linearly over a `warmup` share of `total` steps, then stays or decays to 0 (linear, cosine).
    On GPUs the fused kernel: one pass over each tensor, no fp32 temporary the size of the model (the foreach one)."""
    params = list(params)
    fused = bool(params) and all(p.is_cuda for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, fused=fused or None, **kwargs)
    w = int(warmup * total)  # warm-up steps

    def factor(step):
        span = max(1, total - w)  # steps after the warm-up
        cosine = 0.5 * (1 + math.cos(math.pi * (step - w) / span))
        decay = {"linear": (total - step) / span, "constant": 1.0, "cosine": cosine}
        return (step + 1) / w if step < w else decay[schedule]

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def seed_everything(seed: int, rank: int = 0):
    """Seeds python, numpy and torch (all CUDA devices too) with seed + rank (nanoGPT)."""
    for seed_rng in (random.seed, np.random.seed, torch.manual_seed):
        seed_rng(seed + rank)


def exact_div(a: int, b: int, what: str) -> int:
    """a / b for batch sizes that must be whole (lm-human-preference-details)."""
    if b <= 0 or a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def load_checkpoint(path, model, optimizer=None, scheduler=None):
    """Restore the model, optimiser, schedule and this rank's RNG states -> (step, extra)."""
    sharded = isinstance(model, FSDPModule)  # shard()'s: rank 0 alone reads (weights, AdamW: 36 GB for 3B) and sends
    ckpt, problem = {}, None
    if not sharded or torch.distributed.get_rank() == 0:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # ranks share the file's pages
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
            problem = f"{path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:160]})"
    if sharded:  # the small parts to every rank
        problem, small = broadcast_object((problem, {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}))
        ckpt = ckpt or small
    if problem:
        raise ValueError(problem)
    if sharded:  # full state dicts (Run.checkpoint) from rank 0, each rank keeping its shards
        from torch.distributed.checkpoint import state_dict as dcp

        options = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        dcp.set_model_state_dict(model, ckpt.get("model", {}), options=options)  # (set_state_dict skips the model
        dcp.set_optimizer_state_dict(model, optimizer, ckpt.get("optimizer", {}), options=options)  # on empty ranks)
    else:
        try:
            missing, unexpected = model.load_state_dict(ckpt["model"], strict=not ckpt["partial"])
        except RuntimeError:  # names or shapes that do not fit
            missing, unexpected = ["?"], ["?"]
        if unexpected or {k for k, p in model.named_parameters() if p.requires_grad} & set(missing):
            raise ValueError(f"{path} holds the trainable weights of another set-up: resume with the run's flags")
        if optimizer is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if _distributed() else (0, 1)
    if len(ckpt["rng"]) == world:
        state = ckpt["rng"][rank]
        version, internal, gauss_next = state["python"]  # Python's RNG state is tuples; the checkpoint holds lists
        random.setstate((version, tuple(internal), gauss_next))
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    elif rank == 0:
        log.warning("%s: saved by %d processes, not %d: RNG states not restored", path, len(ckpt["rng"]), world)
    return ckpt["step"], ckpt["extra"]


# ==== 7. Metrics and evaluation: NLG (BLEU, METEOR, ROUGE-L, CIDEr-D), CE (P/R/F1), degenerate output =================
# BLEU, ROUGE-L and CIDEr-D equal pycocoevalcap 1.2 (tests/test_metrics.py), written here because rewards score
# thousands of pairs a step; one reference per report. METEOR is pycocoevalcap's Java jar: no port matches it.
NGRAM_N, ROUGE_BETA, CIDER_SIGMA = 4, 1.2, 6.0  # BLEU-4 / CIDEr 1..4-grams; rouge.py's beta; cider.py's sigma
_METEOR_SCORER = None  # one JVM per process: the jar takes ~7 s to load its tables


def ngram_counts(tokens: list[str]) -> list[Counter]:
    """[k-gram Counter, k = 1..4]: precook() of bleu/cider_scorer.py."""
    return [Counter(tokens)] + [Counter(zip(*(tokens[i:] for i in range(k)))) for k in range(2, NGRAM_N + 1)]


def _lcs_length(a: list[str], b: list[str]) -> int:
    """LCS length, my_lcs() of rouge.py bit-parallel (Allison & Dix 1986; Hyyro 2004): a big int holds a DP column."""
    match = {}  # match[t] has bit i set where a[i] == t
    for i, tok in enumerate(a):
        match[tok] = match.get(tok, 0) | (1 << i)
    full = v = (1 << len(a)) - 1  # zero bits of v mark where the LCS grew
    for tok in b:
        u = v & match.get(tok, 0)
        v = (v + u) | (v - u)
    return len(a) - (v & full).bit_count()


def nlg_metrics(hyps: list[str], refs: list[str], meteor=True, per_sample: bool = False, cider_df=None) -> dict:
    """BLEU-1..4, ROUGE-L, CIDEr-D and METEOR (with java, unless RRG_METEOR=0) of each text against its one reference,
    as pycocoevalcap; per_sample adds per-report scores; cider_df: (df, documents) of a corpus, for CIDEr-D."""
    if len(hyps) != len(refs) or not hyps:
        raise ValueError(f"need as many references as hypotheses, at least one: got {len(hyps)} and {len(refs)}")
    hyp_toks, ref_toks = [h.split() for h in hyps], [r.split() for r in refs]
    hyp_counts, ref_counts = [ngram_counts(t) for t in hyp_toks], [ngram_counts(t) for t in ref_toks]

    # BLEU (cook_test of bleu_scorer.py): matches clipped by the reference's counts; corpus BLEU from their sums
    def bleu(correct, guess, hyp_len, ref_len):  # BLEU-1..4 per row (N, 4), in BleuScorer.compute_score()'s order
        tiny, small = 1e-15, 1e-9  # its smoothing: an empty hypothesis gives 0, not NaN
        # BLEU-k = (prod_{j<=k} p_j)^(1/k), p_j = clipped matches / guesses
        b = np.cumprod((correct + tiny) / (guess + small), axis=1) ** (1.0 / np.arange(1, NGRAM_N + 1))  # (N, 4)
        ratio = (hyp_len + tiny) / (ref_len + small)  # brevity penalty exp(1 - r/c) when the hypothesis is shorter
        with np.errstate(over="ignore"):  # 1/ratio is ~1e16 for an empty hypothesis: exp -> 0
            return b * np.where(ratio < 1, np.exp(1 - 1 / ratio), 1.0)[:, None]

    correct = np.zeros((len(hyps), NGRAM_N))  # (N, 4)
    for i, (hc, rc) in enumerate(zip(hyp_counts, ref_counts)):
        correct[i] = [sum(min(h[g], r[g]) for g in h.keys() & r.keys()) for h, r in zip(hc, rc)]
    guess = np.array([[max(0, len(t) - k) for k in range(NGRAM_N)] for t in hyp_toks], dtype=float)  # (N, 4)
    hyp_len, ref_len = np.array([len(t) for t in hyp_toks], float), np.array([len(t) for t in ref_toks], float)
    each = dict(zip([f"BLEU-{k}" for k in range(1, NGRAM_N + 1)], bleu(correct, guess, hyp_len, ref_len).T))
    corpus = bleu(*(x.sum(0, keepdims=True) for x in (correct, guess, hyp_len, ref_len)))[0]
    out = {f"BLEU-{k + 1}": float(corpus[k]) for k in range(NGRAM_N)}
    # ROUGE-L (Rouge.calc_score() of rouge.py): F_beta of LCS precision and recall in pycocoevalcap's operation order,
    # 0 for an empty text (pycocoevalcap would give 1.0 to an empty hypothesis against an empty reference)
    lcs = np.array([_lcs_length(h, r) if h and r else 0 for h, r in zip(hyp_toks, ref_toks)], float)  # (N,)
    prec, rec = lcs / np.maximum(hyp_len, 1), lcs / np.maximum(ref_len, 1)  # (N,) each
    with np.errstate(invalid="ignore"):  # 0 / 0 where lcs == 0
        each["ROUGE-L"] = np.where(lcs > 0, ((1 + ROUGE_BETA**2) * prec * rec) / (rec + ROUGE_BETA**2 * prec), 0.0)
    # CIDEr-D as CiderScorer: 10 x the mean over orders of sum_g min(w_h, w_r) w_r / norms (w = tf idf) times a Gaussian
    # length penalty on pycocoevalcap's 'length', which counts bigrams (its `if n == 1` is 0-based). Document
    # frequencies from the references scored (one pair: all 0), or cider_df's of a corpus. Sums run over the
    # hypothesis's n-grams in their order, as CiderScorer's: a set's order would move the last digit with the hash seed
    df, n_docs = cider_df or (Counter(g for ref in ref_counts for c in ref for g in c), len(ref_counts))
    log_n = math.log(n_docs)
    idf2 = {g: (log_n - math.log(d)) ** 2 for g, d in df.items()}  # squared idf
    unseen = log_n**2  # an n-gram no document holds counts as in one (CiderScorer's max(1, df))

    def norm(counts):
        return [math.sqrt(sum(tf * tf * idf2.get(g, unseen) for g, tf in c.items())) for c in counts]

    each["CIDEr"] = []
    for h, r in zip(hyp_counts, ref_counts):
        penalty = math.exp(-((sum(h[1].values()) - sum(r[1].values())) ** 2) / (2 * CIDER_SIGMA**2))
        sims = [
            sum(min(hc[g], rc[g]) * rc[g] * idf2.get(g, unseen) for g in hc if g in rc) / (hn * rn if hn and rn else 1)
            for hc, rc, hn, rn in zip(h, r, norm(h), norm(r))
        ]
        each["CIDEr"].append(10.0 * np.mean(sims) * penalty)
    out.update({k: float(np.mean(each[k])) for k in ("ROUGE-L", "CIDEr")})  # the mean of the per-report scores
    meteor = meteor and os.environ.get("RRG_METEOR") != "0"  # RRG_METEOR=0: left out on purpose, nothing to say
    if meteor and importlib.util.find_spec("pycocoevalcap") and shutil.which("java"):
        global _METEOR_SCORER  # corpus METEOR: the jar's own aggregate, not the mean per report
        if _METEOR_SCORER is None:
            from pycocoevalcap.meteor.meteor import Meteor

            _METEOR_SCORER = Meteor()
        # references first, a line each (a newline ends a jar command, "|||" splits fields; pycocoevalcap cleans hyps)
        by_id = [{i: [" ".join(t.replace("|||", " ").split())] for i, t in enumerate(texts)} for texts in (refs, hyps)]
        score, scores = _METEOR_SCORER.compute_score(*by_id)
        out["METEOR"], each["METEOR"] = float(score), [float(s) for s in scores]
    elif meteor:
        log.warning("METEOR skipped: it needs `pip install pycocoevalcap` and java on PATH")
    if per_sample:
        out["per_sample"] = {k: [float(x) for x in v] for k, v in each.items()}
    return out


def _prf(tp, fp, fn):
    """Precision, recall, F1 = 2TP / (2TP + FP + FN); 0 where undefined (scikit-learn's zero_division=0)."""
    pairs = ((tp, tp + fp), (tp, tp + fn), (2 * tp, 2 * tp + fp + fn))  # (numerator, denominator) of each
    return tuple(np.divide(a, b, out=np.zeros_like(np.asarray(a, float)), where=np.asarray(b) != 0) for a, b in pairs)


def ce_metrics(hyp_labels, ref_labels, uncertain_as: int = 1) -> dict:
    """Clinical efficacy of generated (hyp) vs reference labels (N, 14), uncertain positive (uncertain_as=1) or not."""
    hyp = binarize(hyp_labels, uncertain_as).astype(bool)  # (N, 14); uncertain_as=1: CheXpert's "U-ones" (DEER; ours)
    ref = binarize(ref_labels, uncertain_as).astype(bool)  # (N, 14); uncertain_as=0: PromptMRG's code
    tp, fp, fn = (hyp & ref).astype(float), (hyp & ~ref).astype(float), (~hyp & ref).astype(float)  # (N, 14) each
    # Micro: TP/FP/FN pooled over reports and labels
    out = dict(zip(("micro_precision", "micro_recall", "micro_f1"), _prf(tp.sum(), fp.sum(), fn.sum())))
    # Macro: per label, then the plain mean over the 14 (a label never positive counts 0: scikit-learn's "macro")
    p_lab, r_lab, f_lab = _prf(tp.sum(0), fp.sum(0), fn.sum(0))  # (14,) each
    out.update(macro_precision=p_lab.mean(), macro_recall=r_lab.mean(), macro_f1=f_lab.mean())
    # Example-based (PromptMRG, modules/metrics_clinical.py): per report, then the mean over all reports; a report with
    # no predicted (or no reference) positive scores 0, as PromptMRG's nan_to_num and scikit-learn's "samples" average
    p_ex, r_ex, f_ex = _prf(tp.sum(1), fp.sum(1), fn.sum(1))  # (N,) each
    out.update(example_precision=p_ex.mean(), example_recall=r_ex.mean(), example_f1=f_ex.mean())
    # F1-CheXbert (R2Gen/CMN/... tables): micro over the 5 common observations only
    cols = [LABEL_INDEX[name] for name in ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion")]
    p, r, f = _prf(tp[:, cols].sum(), fp[:, cols].sum(), fn[:, cols].sum())
    out.update({"5label_micro_precision": p, "5label_micro_recall": r, "5label_micro_f1": f})
    scores = zip(CHEXPERT_LABELS, p_lab, r_lab, f_lab, ref.sum(0))
    per_label = {n: dict(precision=float(p), recall=float(r), f1=float(f), support=int(s)) for n, p, r, f, s in scores}
    return {k: float(v) for k, v in out.items()} | {"per_label": per_label}


def evaluate_generations(
    rows, labeler, clean="mimic_cxr", uncertain_as=1, meteor=True, headline="micro_f1", gold=None, name=""
) -> dict:
    """NLG metrics on R2Gen-cleaned text, CE from the labels of the raw generated and reference reports (`headline`: the
    paper's CE number); an empty report scores 0. "degenerate": signs the numbers say nothing (warned, naming `name`);
    "ce_gold": against `gold`, its labels; with CheXbert, "labelers_agree": how often the rules agree."""
    hyps, refs = [r["generated"] for r in rows], [r["reference"] for r in rows]
    n_empty = sum(not h.strip() for h in hyps)
    if n_empty:
        log.warning("%d of %d generated reports are empty: they score 0 on every metric", n_empty, len(hyps))
    cleaned = [[clean_report(t, clean) if clean and t.strip() else t for t in texts] for texts in (hyps, refs)]
    hyp_labels, inner = labeler(hyps), getattr(labeler, "labeler", labeler)  # inside a LabelCache, the labeler
    out = {"n": len(rows), "n_empty_generations": n_empty, "degenerate": degenerate_output(hyps, refs, name)}
    out |= {"clean": clean, "labeler": type(inner).__name__, "uncertain_as": uncertain_as, "headline": headline}
    out |= {"nlg": nlg_metrics(*cleaned, meteor=meteor), "ce": ce_metrics(hyp_labels, labeler(refs), uncertain_as)}
    if gold is not None:
        out["ce_gold"] = ce_metrics(hyp_labels, gold, uncertain_as=uncertain_as)
    if isinstance(inner, CheXbertLabeler):
        same = binarize(hyp_labels, uncertain_as) == binarize(RuleLabeler()(hyps), uncertain_as)  # (N, 14)
        out["labelers_agree"] = {"reports": float(same.all(1).mean()), "labels": float(same.mean())}
    return out


STOP_WORDS = {"a", "an", "the", "and", "or", "this", "that", "it", "its", "there"}
STOP_WORDS |= {"of", "in", "on", "at", "to", "for", "as", "by", "from", "with", "without"}
STOP_WORDS |= {"is", "are", "was", "were", "be", "been", "has", "have", "no", "not"}


def degenerate_output(hyps: list[str], refs: list[str], name: str = "") -> dict:
    """Signs that the numbers say nothing of the model: over half the reports identical (a constant "normal" report
    scores a high CE F1 on IU X-Ray, mostly normal), or over half without a word of the references beyond stop words."""

    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z]+", text.lower())) - STOP_WORDS

    vocab = set().union(*map(words, refs))
    top, count = Counter(hyps).most_common(1)[0]
    n, distinct = len(hyps), len(set(hyps))
    contentless = sum(not words(h) & vocab for h in hyps)
    signs = []
    if n >= 5 and count > n / 2:
        signs.append(f"{distinct} distinct report(s) of {n}, {count} identical ({top[:40]!r})")
    if contentless > n / 2:
        signs.append(f"{contentless} of {n} without a word of the references' vocabulary")
    warning = ""
    if signs:
        where = f" ({name})" if name else ""  # the evaluation: test_after, val_step300, ...
        warning = f"degenerate output{where}: " + "; ".join(signs) + ": its CE and NLG numbers say little"
        log.warning(warning)
    out = dict(distinct=distinct, most_common_share=count / n, contentless_share=contentless / n, warning=warning)
    return out | {"most_common": top[:200]}


def summary(results: dict) -> str:
    """The paper's headline CE metric, BLEU-4 and the degenerate-output warning, in a line."""
    h, unc = results["headline"], "positive" if results["uncertain_as"] else "negative"
    line = f"CE {h.replace('_', ' ')} {results['ce'][h]:.3f} (uncertain = {unc}), BLEU-4 {results['nlg']['BLEU-4']:.3f}"
    return line + (f"  [{results['degenerate']['warning']}]" if results["degenerate"]["warning"] else "")


def read_generations(path) -> list[dict]:
    """generations.jsonl: a {"id", "reference", "generated", ...} per line."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"generations file not found: {path}")
    rows = []
    for n, line in [(n, x) for n, x in enumerate(Path(path).read_text().splitlines(), 1) if x.strip()]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not all(isinstance(row.get(k), str) for k in ("reference", "generated")):
            raise ValueError(f"{path}:{n}: 'reference' and 'generated' must be strings (the line has {sorted(row)})")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no generations in the file")
    return rows


# ==== 8. The command line: flags from an Args dataclass ===============================================================
def parse_args(args_class, argv=None, description: str | None = None):
    """Flags from an Args dataclass, `--flag-name` per field: its help the string under the field, a bool as --flag /
    --no-flag, Literal[...] as choices, a number checked against its Annotated range. A bad flag is one line (an unknown
    one names the closest). --out defaults to runs/<script>-<data name>; --resume: the flags not given are the run's."""
    helps = {}
    for cls in reversed(args_class.__mro__[:-1]):  # a subclass's help wins
        helps |= {d.arg_name: " ".join(d.description.split()) for d in docstring_parser.parse_from_object(cls).params}
    hints = get_type_hints(args_class, include_extras=True)  # Annotated[int | None, "[0, inf)"] -> int | None, range
    ranges = {k: get_args(t)[1] for k, t in hints.items() if get_origin(t) is Annotated}
    # a bad value raises (one line below, no usage block); --ste is no --steps; a flag not given stays out of the result
    strict = dict(exit_on_error=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **strict)
    paper = p.add_argument_group("the paper's settings (and ours where it gives none)")
    run = p.add_argument_group("the run, its data and model (every script's)")
    fields, shared = dataclasses.fields(args_class), {f.name for f in dataclasses.fields(RunArgs)}
    for f in fields:
        kind = get_args(hints[f.name])[0] if f.name in ranges else hints[f.name]
        kind = get_args(kind)[0] if type(None) in get_args(kind) else kind  # int | None -> int
        in_range = f"; in {ranges[f.name]}" if f.name in ranges else ""
        how = {"help": f"{helps.get(f.name, '')} (default: {f.default}{in_range})".replace("%", "%%")}
        if kind is bool:
            how |= {"action": argparse.BooleanOptionalAction}
        elif get_origin(kind) is Literal:
            how |= {"choices": get_args(kind), "type": type(get_args(kind)[0])}
        else:
            how |= {"type": kind}
        (run if f.name in shared else paper).add_argument("--" + f.name.replace("_", "-"), **how)
    try:
        given, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        p.exit(2, f"error: {e} (--help lists every flag)\n")
    if unknown:
        close = difflib.get_close_matches(unknown[0].split("=")[0], ["--" + f.name.replace("_", "-") for f in fields])
        hint = f"did you mean {close[0]}?" if close else "--help lists every flag"
        p.exit(2, f"error: unrecognized arguments: {' '.join(unknown)} ({hint})\n")
    given = vars(given)
    flags = {f.name: f.default for f in fields} | given
    if flags["out"] is None:  # runs/<script>-<"synthetic", an annotation.json's folder (or given), another file's name>
        data = Path(flags["data"]).parent if Path(flags["data"]).name == "annotation.json" else Path(flags["data"])
        script = Path(getattr(sys.modules[args_class.__module__], "__file__", "run")).stem
        flags["out"] = f"runs/{script}-{data.stem if data.suffix == '.json' else data.resolve().name}"
    out = Path(flags["out"])
    configs = [out / "config.json"] if (out / "config.json").is_file() else list(out.glob("*/config.json"))
    if flags["resume"] and configs:  # the flags not given: the run's (of stages: the newest stage's)
        saved = json.loads(max(configs, key=os.path.getmtime).read_text())
        flags |= {k: saved[k] for k in flags.keys() & saved.keys() - given.keys() - set(MAY_CHANGE_ON_RESUME)}
    for name, interval in ranges.items():  # each number in the range beside it: [ ] take their end, ( ) do not
        (lo, hi), v = map(float, interval[1:-1].split(",")), flags[name]
        if not (v is None or lo < v < hi or (v == lo and interval[0] == "[") or (v == hi and interval[-1] == "]")):
            raise SystemExit(f"error: --{name.replace('_', '-')} {v}: out of range, it must lie in {interval}")
    return args_class(**flags | {"out": str(out)})


# ==== 9. The insides a reader skips: the rule labeler's phrase lists, the collectives =================================
def _words(*phrases: str) -> str:
    """The phrases as one group that ends a word (RuleLabeler puts one word start before all of a label's phrases)."""
    return r"(?:" + "|".join(phrases) + r")\b"


_GAP = r"(?:(?!\bbut\b|\bhowever\b)[^.;,])"  # a gap inside one mention ("heart ... enlarged"), within the clause
_HEART = r"(?:heart(?: size)?|cardiac (?:silhouette|size|contour|contours|shadow))"
_MEDIASTINUM = r"(?:cardiomediastinal (?:silhouette|contours?)|mediastinal (?:contours?|silhouette)|mediastinum)"
_NORMAL = r"(?:normal|within normal limits|unremarkable)"  # "heart size ... limits of normal" reaches "normal"
_STABLE = r"(?:stable|unchanged)\b"


class RuleLabeler:
    """The CheXpert labeler's rules (Irvin et al. 2019, github.com/stanfordmlgroup/chexpert-labeler, MIT) as regexes:
    its phrases, cues, aggregation, No Finding rule; not CheXbert (tests/RESULTS.md). A mention is uncertain with a
    pre-negation uncertainty cue in reach, else negative with a negation cue, else uncertain with an uncertainty cue,
    else positive. A report: 1 if a mention is positive, else -1 if one is uncertain, 0 if any, else blank."""

    # Mention phrases (CheXpert's phrases/mention/*.txt), a pattern or a list. Organ words count with their qualifier
    # ("heart ... enlarged", "heart size is normal"): the span covers both, so a cue between ("is not enlarged") acts.
    MENTIONS: ClassVar[dict] = {
        "Enlarged Cardiomediastinum": [
            _words(
                r"mediastinal widening|widen(?:ed|ing) (?:of the )?(?:superior )?mediastinum|enlarged cardiomediastinum"
                r"|enlarged cardiomediastinal silhouette"
            ),
            _MEDIASTINUM + _GAP + r"{0,30}?\b" + _words(r"widened", r"enlarged", _NORMAL),
            _words("normal") + " " + _MEDIASTINUM,
        ],
        "Cardiomegaly": [
            _words(
                r"cardiomegaly|(?:cardiac|heart) enlargement|enlarged (?:heart|cardiac silhouette)"
                r"|enlargement of the (?:heart|cardiac silhouette)|increase in (?:the )?heart size"
            ),
            _HEART + r"\b" + _GAP + r"{0,30}?\b" + _words(r"enlarged", r"increased", r"large", r"borderline", _NORMAL),
            _words("normal") + " " + _HEART + r"\b",
        ],
        "Lung Opacity": _words(
            r"opacit(?:y|ies)|opacification|opacified|infiltrat(?:e|es|ion)|haziness|hazy"
            r"|air ?space (?:disease|process)|ground[- ]glass|scar(?:s|ring)?|interstitial (?:markings?|pattern)"
            r"|reticular (?:pattern|markings?)|reticulation|(?:peribronchial|wall) thickening|increased density"
        ),
        "Lung Lesion": _words(
            r"mass(?:es)?|mass-?like|nodules?|lumps?|cavitary lesions?|carcinoma"
            r"|nodular (?:densit(?:y|ies)|opacit(?:y|ies)|opacification)|neoplasms?|tumou?rs?"
        ),
        "Edema": _words(r"edema", r"heart failure", r"chf"),
        "Consolidation": _words(r"consolidat(?:ion|ions|ive|ed)"),
        # CheXpert also lists "infection" and "infectious": the radiologists' gold rarely reads them as pneumonia (ours)
        "Pneumonia": _words(r"pneumonias?", r"bronchopneumonia", r"infectious process"),
        "Atelectasis": _words(r"atelecta(?:sis|ses|tic)", r"collapse"),
        "Pneumothorax": _words(r"(?:hydro)?pneumothora(?:x|ces)", r"ptx"),
        "Pleural Effusion": _words(r"(?:pleural )?effusions?", r"pleural fluid", r"hydrothorax"),
        "Pleural Other": _words(
            r"pleural (?:thickening|plaques?|calcifications?)|fibrothorax|fibrosis"
            r"|pleur(?:al|o)[- ]?(?:(?:parenchymal|pericardial) )?scar(?:s|ring)?"
        ),
        "Fracture": _words(r"fractur(?:e|es|ed)"),
        "Support Devices": _words(
            r"endotracheal tube|et tube|ett|tracheostomy(?: tube)?|(?:naso|oro)gastric tube|ng tube|og tube"
            r"|enteric tube|feeding tube|dobhoff(?: tube)?|chest tubes?"
            r"|(?:central venous |central |pigtail |swan-ganz |pulmonary artery )?catheters?|central (?:venous )?line"
            r"|picc(?: line)?|port-a-cath|portacath|mediport|pacemaker|pacer|icd|defibrillator|pacing leads?"
            r"|sternotomy wires|intra-aortic balloon pump|iabp|stents?|drains?|prosthetic valve|valve replacement|lvad"
        ),
        # CheXpert's No Finding mentions (phrases/mention/no_finding.txt), matched inside words as there: abnormal
        # findings outside the 13 observations. One not negated turns No Finding off (stages/aggregate.py).
        "No Finding": (
            r"emphysema|blunt|densit(?:y|ies)|elevation|eventration|scoliosis|degenera|calcifi|hyperinflat"
            r"|bronchospasm|asthma|hernia|copd|interstitial markings|plaque|osteophytosis|aortic disease"
            r"|bronchiolitis|airways? disease|thickening|cephalization|aspiration|bullae|contusion"
            r"|atherosclero|osteopenia|metastas|granuloma|pneumomediastinum|pneumoperitoneum|osteodystrophy"
            r"|cuffing|irregular lucency|inflam|fissure|hypertension|prominen|kyphosis|defib|hyperexpan"
            r"|bullet|reticula|thoracentesis|bronchitis|volume loss|deformit|hemorrhage|hematoma|radiopaque"
            r"|aerophagia|arthropathy|tracheostomy"  # CheXpert's list ends; ours (synonyms of its entries):
            r"|spondyl|osteophyt|arthrit|curvature|tortu|ecta(?:tic|sia)|unfold|elevated|hypoinflat|low lung volume"
        ),
    }
    # Not a mention where one of these overlaps it (CheXpert's phrases/unmention/*.txt; CheXpert's "calcified nodule"
    # is left out: the radiologists' gold counts it a nodule, while a calcified granuloma is no lesion in either)
    UNMENTIONS: ClassVar[dict] = {"Pleural Effusion": r"pericardial effusion", "Lung Opacity": r"pleural scar"}
    # At most uncertain (positive -> uncertain, negative stays): CheXpert's post-negation uncertainty patterns (a stable
    # heart, "vascular congestion", ...) and, from its aggregation, "chf" and "heart failure" as uncertain Cardiomegaly.
    HEDGED: ClassVar[dict] = {
        "Enlarged Cardiomediastinum": [_MEDIASTINUM + _GAP + r"{0,30}?\b" + _STABLE, _STABLE + " " + _MEDIASTINUM],
        "Cardiomegaly": [
            _words("chf", "heart failure", r"borderline (?:heart|cardiac) size"),
            _HEART + r"\b" + _GAP + r"{0,30}?\b" + _STABLE,
            _STABLE + " " + _HEART + r"\b",
        ],
        "Edema": [_words(r"(?:vascular|pulmonary) congestion", r"indistinctness", r"vascular prominence")],
    }
    # Cues (CheXpert's patterns/{pre_negation_uncertainty,negation,post_negation_uncertainty}.txt): (pattern, kind,
    # direction, reach: characters from cue to mention). kind: "pre_neg_unc" (uncertain despite a negation), "neg",
    # "unc"; direction: "pre" acts on mentions after the cue, "post" on those before; one inside a mention acts on it.
    CLAUSE = 1000  # reach to the end of the clause
    PRE_NEGATION_UNCERTAINTY = (
        r"can ?not (?:be )?(?:entirely |completely )?(?:excluded|exclude|ruled out|rule out)"
        r"|can't (?:be )?(?:excluded|exclude|ruled out|rule out)|not (?:be )?(?:entirely |completely )?"
        r"(?:excluded|ruled out)|difficult to (?:entirely |completely )?(?:exclude|rule out)"
    )
    NEGATION_AFTER = (  # "the effusion has resolved"
        r"no longer|(?:has|have) (?:resolved|cleared)|resolved|(?:has|have) been removed|removed|is absent|are absent"
        r"|not (?:seen|identified|present|appreciated|visualized|demonstrated|evident|detected|enlarged|widened)"
    )
    NEGATION_BEFORE = (  # "no effusion"
        r"no evidence of|no signs? of|negative for|free of|clear of|absence of|resolution of|removal of"
        r"|history of|disappearance of|rather than|without|no|not|nor|neither|never"
    )
    UNCERTAINTY_AFTER = (  # "pneumonia is suspected"
        r"is possible|are possible|(?:is |are )?suspected|is likely|are likely|is questioned|may be present"
        r"|is not excluded|are not excluded|(?:is )?(?:a |another )?consideration"
    )
    UNCERTAINTY_BEFORE = (  # "possible pneumonia"
        r"possible|possibly|probable|probably|likely|may|might|could|questionable|question(?: of)?|suspicious for"
        r"|suspicion (?:of|for)|suspect|concerning for|concern for|worrisome for|suggestive of|suggests?|suggesting"
        r"|suggestion of|maybe|favou?r(?:s|ing|ed)?|differential|consider(?:ed)?|equivocal|presumed|presumably"
        r"|indeterminate|evaluate for|evaluation for|assess for|rule out|r/o|correlate clinically for"
    )
    CUES = (
        (PRE_NEGATION_UNCERTAINTY, "pre_neg_unc", "both", CLAUSE),
        (NEGATION_AFTER, "neg", "post", 40),
        (r"not well[- ](?:seen|visualized|evaluated|appreciated)|poorly evaluated", "unc", "post", 40),
        (NEGATION_BEFORE, "neg", "pre", CLAUSE),
        (r"normal|within normal limits|unremarkable", "neg", "both", 0),  # only inside "heart size is normal"
        (UNCERTAINTY_AFTER, "unc", "post", 30),
        (UNCERTAINTY_BEFORE, "unc", "pre", CLAUSE),
        (r"\?", "unc", "both", CLAUSE),  # last: the one cue that need not start a word
    )
    TERMINATORS = (  # clause ends: the negation of "No effusion, but a small pneumothorax" stops at "but"
        r"\b(?:but|however|although|though|whereas|while|except|apart from|aside from|other than"
        r"|which|with the exception of|yet)\b|,\s*(?:and )?there (?:is|are)\b"
    )
    SENTENCE_ENDS = r"\.(?<!\bvs\.)(?!\d)|;|\n"  # not "1.2 cm", not "vs."

    def __init__(self):
        self.mentions = []  # (label index, mention pattern, unmention pattern), one per label
        for name, phrases in self.MENTIONS.items():
            alternatives = [f"(?:{p})" for p in ([phrases] if isinstance(phrases, str) else phrases)]
            if hedged := self.HEDGED.get(name):
                alternatives.append(f"(?P<hedged>{'|'.join(hedged)})")
            word_start = "" if name == "No Finding" else r"\b"  # No Finding's phrases match inside words
            pattern = re.compile(word_start + "(?:" + "|".join(alternatives) + ")")
            self.mentions.append((LABEL_INDEX[name], pattern, re.compile(self.UNMENTIONS.get(name, "(?!)"))))
        # One pass over the text finds every cue; group i+1 is CUES[i].
        words = "|".join(f"({pattern})" for pattern, *_ in self.CUES[:-1])
        self.cues = re.compile(rf"(?<!\w)(?:{words})(?!\w)|({self.CUES[-1][0]})")
        self.boundaries = re.compile(f"{self.SENTENCE_ENDS}|{self.TERMINATORS}")

    def _mentions(self, text: str) -> np.ndarray:
        """(14,) labels of one lower-cased report; No Finding's place holds the abnormal findings outside the 13."""
        labels = np.full(len(CHEXPERT_LABELS), np.nan)
        boundaries = [(0, 0)] + [m.span() for m in self.boundaries.finditer(text)] + [(len(text), len(text))]
        starts, ends = [start for start, _ in boundaries], [end for _, end in boundaries]
        cues = [(m.start(), m.end(), self.CUES[m.lastindex - 1]) for m in self.cues.finditer(text)]
        for idx, pattern, unmention in self.mentions:
            found = set()
            unmentions = None  # looked for at the label's first mention
            for m in pattern.finditer(text):
                if unmentions is None:
                    unmentions = [u.span() for u in unmention.finditer(text)]
                if any(a < m.end() and m.start() < b for a, b in unmentions):
                    continue
                lo = ends[bisect.bisect_right(ends, m.start()) - 1]  # the clause: from the last boundary before it
                hi = starts[bisect.bisect_left(starts, m.end())]  # to the first after it
                state = self._state(*m.span(), lo, hi, cues)
                found.add(UNCERTAIN if m.lastgroup == "hedged" and state == POSITIVE else state)
            labels[idx] = next((s for s in (POSITIVE, UNCERTAIN, NEGATIVE) if s in found), BLANK)
        return labels

    @staticmethod
    def _state(start, end, lo, hi, cues) -> float:
        kinds = {
            kind
            for c_start, c_end, (_, kind, direction, reach) in cues
            if (start <= c_start and c_end <= end)  # inside the mention's own span
            or (lo <= c_start and c_end <= start and direction in ("pre", "both") and start - c_end <= reach)
            or (end <= c_start and c_end <= hi and direction in ("post", "both") and c_start - end <= reach)
        }
        order = (("pre_neg_unc", UNCERTAIN), ("neg", NEGATIVE), ("unc", UNCERTAIN))  # the first found decides
        return next((label for kind, label in order if kind in kinds), POSITIVE)

    def __call__(self, reports: list[str]) -> np.ndarray:
        """(N, 14) float labels, 1 / 0 / -1 / NaN, in CHEXPERT_LABELS order."""
        if not reports:
            return np.zeros((0, len(CHEXPERT_LABELS)))
        labels = np.stack([self._mentions(r.lower()) for r in reports])
        other = np.isin(labels[:, -1], (POSITIVE, UNCERTAIN))  # an abnormal finding outside the 13
        labels = apply_no_finding_rule(labels)
        # nothing said: all blank, No Finding too (CheXpert's rule would reward empty reports)
        labels[other | np.array([not r.strip() for r in reports]), -1] = np.nan
        return labels


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): one process without RANK, else join the group, on the GPU of LOCAL_RANK."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not _distributed():  # NCCL's default 10-minute timeout is too short while rank 0 evaluates alone
        timeout = timedelta(minutes=float(os.environ.get("RRG_DIST_TIMEOUT_MIN", "120")))
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier():
    if _distributed():
        torch.distributed.barrier()


def end_process(message: str | None = None, at_once: bool = False, code: int = 1):
    """The end of a script (`message`: an error, exit `code`). Under torchrun: leave the group after the others, then
    skip the teardown (os._exit), where gloo aborted ~1 run in 70 ("terminate called without an active exception")."""
    if _distributed():
        if not at_once:  # at_once: an error, maybe this rank's alone (the others in a collective); torchrun stops them
            barrier()
            torch.distributed.destroy_process_group()
        sys.stderr.write(f"{message}\n" if message else "")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if message else 0)
    if message and code != 1:  # SystemExit(message) exits 1
        sys.stderr.write(f"{message}\n")
        raise SystemExit(code)
    if message:
        raise SystemExit(message)


def all_reduce_mean(x):
    """The mean over ranks of a number, a list or a dict of numbers (the same keys on every rank)."""
    if isinstance(x, dict):
        return dict(zip(x.keys(), all_reduce_mean([float(v) for v in x.values()]) if x else []))
    t = torch.as_tensor(x, dtype=torch.float64)
    if _distributed():
        t = t.to("cuda" if torch.distributed.get_backend() == "nccl" else "cpu")  # NCCL reduces on the GPU only
        torch.distributed.all_reduce(t)
        t = t.cpu() / torch.distributed.get_world_size()
    return t.item() if t.dim() == 0 else t.tolist()


def all_gather_objects(obj) -> list:
    """Every rank's object, in rank order, on every rank ([obj] in one process)."""
    out = [obj] * (torch.distributed.get_world_size() if _distributed() else 1)
    if _distributed():
        torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    box = [obj]
    if _distributed():
        torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, src: int = 0):
    """Rank src's parameters and buffers on every rank, as DDP's wrap."""
    if _distributed():
        for t in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(t.data, src=src)


def data_parallel(module: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """Several processes without --fsdp: DistributedDataParallel around what trains (after LoRA, fp32_trainable): the
    gradients averaged in its buckets (no second copy), each rank's own buffers kept. One process, FSDP2: as is."""
    if world_size == 1 or isinstance(module, FSDPModule):
        return module
    return torch.nn.parallel.DistributedDataParallel(module, broadcast_buffers=False, gradient_as_bucket_view=True)


@contextlib.contextmanager
def gathered(model: torch.nn.Module, once=None):
    """FSDP2 around generate(): each sharded module's weights gathered at the first token, kept for the rest, then
    resharded: unsharded in --dtype through the rollout, but `once`'s (the vision tower: one forward) as usual."""
    skip = {id(m) for m in once.modules()} if once is not None else set()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule) and id(m) not in skip]
    for m in modules:  # the first token's forward gathers each module, and each keeps its weights to the end
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # FSDP2's own: the root keeps its weights


def shard(model: torch.nn.Module, dtype=torch.float32):
    """FSDP2 for full fine-tuning beyond one GPU: each block (HF's _no_split_modules), then the rest; a rank keeps
    1/world of the weights, gradients and AdamW states, averages gradients in fp32 (generate() syncs ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    for m in [m for m in model.modules() if type(m).__name__ in model._no_split_modules] + [model]:
        fp32_trainable(m)  # this block's master weights, where the model is (host memory: initial_policy(fsdp=True))
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    for name in [n for n in ("generate", "prefix") if hasattr(model, n)]:  # entry points besides forward()
        register_fsdp_forward_method(model, name)


def full_state_dicts(model, optimizer=None) -> tuple[dict, dict | None]:
    """A shard()ed model's (an FSDPModule's) and optimiser's full state dicts on the CPU; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    return model_state, get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None


def gather_strided(mine: list, world_size: int) -> list:
    """Each rank's x[rank::world_size] -> all of x on every rank."""
    shards = all_gather_objects(mine)
    return [shards[k % world_size][k // world_size] for k in range(sum(map(len, shards)))]
