"""RRGCL: Radiology Report Generation by Curriculum Learning.

Paper: "RRGCL" (../shared/papers/rrgcl.txt). The paper asks which training studies are hard for a
report generator and answers per study with two scores: the visual neighbourhood semantic gap
(VNS-Gap: a study whose image looks like others' but whose report reads differently confuses the
model) and the image-text alignment score (ITAS: a MINE statistics network's value on the pair).
Their z-scores mix into a difficulty dif(i); a class's difficulty is its studies' mean. A class-level
root schedule then feeds each epoch the easiest lambda_n(t) fraction of every class, easy classes
faster, until every study is in at the last epoch. It wraps any report generator: here it schedules
the teacher-forced SFT of the project's policy (the tiny model, or a Hugging Face VLM).

    python rrgcl.py                                  # synthetic set, tiny model, RRGCL: about 2 CPU-minutes
    python rrgcl.py --scheduler none,rrgcl           # baseline and RRGCL, same budget and seed -> compare.json
    python rrgcl.py q1 --run runs/rrgcl              # Fig. 1: per-class BLEU-4 vs class size and difficulty
    python rrgcl.py --data /data/mimic_cxr/annotation.json --labeler chexbert --visual-encoder resnet101 \\
        --resnet101-weights resnet101_chexpert.pth --text-encoder emilyalsentzer/Bio_ClinicalBERT \\
        --out runs/rrgcl_mimic --measure-only
    torchrun --nproc_per_node=4 rrgcl.py --data /data/mimic_cxr/annotation.json --labeler chexbert \\
        --visual-encoder resnet101 --resnet101-weights resnet101_chexpert.pth \\
        --text-encoder emilyalsentzer/Bio_ClinicalBERT --out runs/rrgcl_mimic \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --dtype bf16
On large data measure first in one process (--measure-only, as above). A run reuses <out>/difficulty.json
whenever it was measured on the same studies with the same measuring flags, so the torchrun ranks do not
wait on rank 0 (NCCL gives up after 10 minutes) while it labels, extracts features and trains MINE.

Equations, and where they are implemented:
    Eq. 1-4   S^v, S^t cosine, G = |S^v - S^t|, dif1 = row sums   vns_gap() (row blocks, never N x N)
    Eq. 5-8   MINE: Donsker-Varadhan bound, maximised over T     dv_bound(), train_mine()
    Eq. 9     dif2(i) = T*(I_i, R_i)                              itas()
    Eq. 10    dif = alpha z(dif1) + beta z(dif2) (ITAS sign flag)  sample_difficulty()
    Alg. 1 l.1-3  classes, class difficulty (mean), class orders  class_members(), class_difficulty(), curriculum_plan()
    Eq. 11    lambda_n(t) class-level root schedule              rrgcl_lambda()
    Eq. 12-13 gamma_n = 1 + (1 - diff_C) c, lambda_n(0)          scheduling_exponents()
    Alg. 1 l.6-11 per-class top fraction, de-duplicated union    rrgcl_subset(), epoch_subset(), train()
    Table 2   Baby Step, Linear, One Pass, Root, Geom            pacing(), epoch_subset()
    Fig. 1    per-class BLEU-4 vs class size / difficulty       q1_analysis()
    Fig. 3    lambda_n(t) curves                                 schedule.json (write_schedule())
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import common


@dataclass
class Args:
    data: str = "synthetic"  # "synthetic" or an annotation.json (R2Gen layout) / CSV / JSONL
    model: str = "tiny"  # the report generator: "tiny" or a Hugging Face VLM id/path (RRGCL is model-agnostic)
    labeler: str = "rule"  # labels reports when the data has no labels (classes, encoders) and scores CE: rule | chexbert
    chexbert_weights: str | None = None  # local chexbert.pth (else downloaded once)
    out: str = "runs/rrgcl"
    seed: int = 0
    device: str = "auto"
    dtype: str = "fp32"  # fp32 | bf16 | fp16 | auto
    resume: bool = False  # continue from out/last.pt; the flags must match out/config.json (only logging, device, workers may change)
    # Scheduler (paper Sec. 3.3, Table 2)
    scheduler: str = "rrgcl"  # rrgcl | root | linear | baby_step | one_pass | geom | none; a comma list trains each under out/<name>
    measure: str = "vns+itas"  # the difficulty: vns+itas (paper), vns or itas alone (Table 2 rows a, b)
    alpha: float = 0.6  # Eq. 10 weight of VNS-Gap (paper Sec. 4.3)
    beta: float = 0.4  # Eq. 10 weight of ITAS (paper Sec. 4.3)
    itas_sign: int = -1  # Eq. 10 adds ITAS although Sec. 3.2.1 says aligned pairs are easier: -1 subtracts (our default), +1 as printed
    unlabelled: str = "class"  # studies positive for none of the 13 keywords: "class" = one more class "Other", "always" = in every epoch
    c0: float = 0.01  # Linear / Root / Geom starting fraction (Platanios et al. 2019 use 0.01)
    buckets: int = 5  # Baby Step / One Pass difficulty buckets (Bengio 2009 gives no number: our choice)
    # Learning-difficulty measurer (paper Sec. 3.2, 4.3)
    visual_encoder: str = "small"  # VNS-Gap phi: "small" (CNN trained briefly on the labels, offline) or "resnet101" (paper)
    resnet101_weights: str | None = None  # torchvision ResNet-101 state dict (paper: fine-tuned on CheXpert)
    text_encoder: str = "small"  # psi: "small" (word CNN trained briefly on the labels) or a BERT id/path (paper: emilyalsentzer/Bio_ClinicalBERT)
    encoder_image_size: int = 64  # small CNN input side (the paper resizes to 256, which ResNet-101 gets)
    encoder_epochs: int = 4  # training epochs of each small encoder on the observation labels (our choice)
    mine_steps: int = 2000  # MINE optimiser steps (paper gives none)
    mine_batch_size: int = 256
    mine_lr: float = 1e-4  # Belghazi et al. 2018
    mine_ma_rate: float = 0.0  # MINE's moving-average bias correction of the gradient (Belghazi et al. Sec. 3.2 use 0.01); 0 = off
    vns_block: int = 2048  # rows of the N x N similarity computed at once: memory O(N x block)
    feature_cache: str | None = None  # cached labels and features; None: $RRG_CACHE/rrgcl when RRG_CACHE is set, else <out>/features
    measure_only: bool = False  # write difficulty.json and schedule.json, then stop (a later run with this --out reuses them)
    # Report generator (SFT on each epoch's subset; "follows the combined RRG method", Sec. 4.3)
    epochs: int = 10  # T
    epoch_steps: int | None = None  # optimiser steps per epoch; None: one full-set pass (N / (batch x ranks)) for every scheduler
    budget: str = "steps"  # "steps": every epoch takes epoch_steps steps from its subset (equal cost); "subset": one pass over the subset
    batch_size: int = 32  # studies per rank per step
    grad_accum: int = 1  # micro-batches per step (batch_size is split among them)
    lr: float | None = None  # None: 1e-3 for the tiny model, 1e-4 with LoRA for HF models (our choice), constant
    max_grad_norm: float = 1.0
    lora_r: int = 16  # LoRA on HF models (0: full fine-tuning)
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    max_new_tokens: int | None = None  # None: 96 for the tiny model, 256 for HF models
    n_eval: int = 100  # val studies: teacher-forced loss after every epoch, reports at the end
    num_workers: int = 0  # image-loading worker processes
    log_every: int = 10
    save_every: int = 500  # steps between checkpoints (and at every epoch's end)


PROMPT = "You are a radiologist. Write the findings section of the report for this chest X-ray."
# Sec. 4.1: "13 keywords excluding Support Devices": the 12 findings and No Finding; a study belongs to
# every keyword labelled 1 (positive).
CLASSES = [n for n in common.CHEXPERT_LABELS if n != "Support Devices"]
SCHEDULERS = ("rrgcl", "root", "linear", "baby_step", "one_pass", "geom", "none")
# --resume may change these only: not --epochs, T is in Eq. 11
RESUMABLE = ("resume", "log_every", "save_every", "device", "num_workers")
# What dif1 and dif2 depend on besides the data: difficulty.json is reused while these match
MEASURE_FLAGS = ("measure", "visual_encoder", "text_encoder", "encoder_image_size", "encoder_epochs", "mine_steps",
                 "mine_batch_size", "mine_lr", "mine_ma_rate", "seed")
RECIPE = "rrgcl-measurer-2"  # in every cache key and in difficulty.json's: change it when the measurer's code changes


def check_args(args: Args):
    for s in args.scheduler.split(","):
        if s not in SCHEDULERS:
            raise ValueError(f"--scheduler: unknown scheduler {s!r}; choose from {', '.join(SCHEDULERS)}")
    checks = {"--measure": (args.measure, ("vns+itas", "vns", "itas")), "--itas-sign": (args.itas_sign, (-1, 1)),
              "--unlabelled": (args.unlabelled, ("class", "always")), "--budget": (args.budget, ("steps", "subset")),
              "--visual-encoder": (args.visual_encoder, ("small", "resnet101"))}
    for flag, (value, allowed) in checks.items():
        if value not in allowed:
            raise ValueError(f"{flag} must be one of {allowed}, got {value!r}")
    if args.visual_encoder == "resnet101" and not args.resnet101_weights:
        raise ValueError("--visual-encoder resnet101 needs --resnet101-weights (a torchvision ResNet-101 state dict)")
    if args.epochs < 1 or args.batch_size % args.grad_accum:
        raise ValueError(f"--epochs must be >= 1 and --batch-size ({args.batch_size}) divisible by --grad-accum ({args.grad_accum})")


# Encoders for the measurer (Sec. 4.3) ------------------------------------------------------------
# The paper's phi is a ResNet-101 fine-tuned on CheXpert, psi Bio_ClinicalBERT, and MINE's image side
# "a pre-trained 5-layer ResNet" (Liao et al. 2021). Offline we train two small encoders for a few
# epochs on the 14 observation labels; SmallImageEncoder (5 conv blocks) also stands in for the
# 5-layer ResNet of ITAS, whichever phi is used for VNS-Gap.
def small_image_encoder(width: int = 32, n_labels: int = 14) -> common.ViewMean:
    """5 strided conv blocks (conv, GroupNorm, ReLU), global average pool: (B, V, 1, S, S) -> (B, 4 width)."""
    body = common.SmallCNN((width, width, 2 * width, 2 * width, 4 * width), strides=(2,) * 5, grid=1, dim=None)
    return common.ViewMean(body, torch.nn.Linear(4 * width, n_labels))


class SmallTextEncoder(torch.nn.Module):
    """(B, L) word ids -> (B, dim): word embeddings, a width-3 convolution (sees "no effusion"), max over words."""

    def __init__(self, vocab_size: int, dim: int = 128, n_labels: int = 14):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 64, padding_idx=0)
        self.conv = torch.nn.Conv1d(64, dim, 3, padding=1)
        self.head = torch.nn.Linear(dim, n_labels)

    def forward(self, ids):
        h = F.relu(self.conv(self.embed(ids).transpose(1, 2)))  # (B, dim, L)
        return h.masked_fill((ids == 0)[:, None], 0).amax(2)  # (B, dim); ReLU output >= 0, so pads never win


def train_label_encoder(model, dataset, x: str, epochs: int, device, seed: int, num_workers: int = 0, desc: str = "encoder"):
    """A few epochs of multi-label BCE from batch[x] on the observation labels (positive and uncertain = 1)."""
    from tqdm.auto import tqdm
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=num_workers,
                                         generator=torch.Generator().manual_seed(seed))
    for _ in tqdm(range(epochs), desc=desc):
        for batch in loader:
            y = torch.as_tensor(common.binarize(batch["labels"]), dtype=torch.float32, device=device)  # (B, 14)
            loss = F.binary_cross_entropy_with_logits(model.head(model(batch[x].to(device))), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def extract(model, dataset, x: str, device, num_workers: int = 0) -> torch.Tensor:
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=num_workers)
    return torch.cat([model(batch[x].to(device)).float().cpu() for batch in loader])  # (N, d)


def resnet101_encoder(path: str) -> torch.nn.Module:
    """torchvision ResNet-101 with the given weights and no classifier: (B, V, 3, H, W) -> (B, 2048)."""
    return common.resnet_encoder(101, path, "--resnet101-weights").eval()


@torch.no_grad()
def bert_features(name: str, reports: list[str], device, batch_size: int = 64) -> torch.Tensor:
    """Mean of the last hidden states over the report's word pieces (the paper does not say how
    Clinical BERT's tokens are pooled; the mean is the usual sentence embedding). (N, H)"""
    from transformers import AutoModel, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(name), AutoModel.from_pretrained(name).to(device).eval()
    return torch.cat([common.mean_pooled_bert_features(model, tok, reports[i:i + batch_size], device).float().cpu()
                      for i in range(0, len(reports), batch_size)])


def measure_text(r: common.Record) -> str:
    """Sec. 4.1: the measurer reads "Findings" and "Impression" stitched together: the report and the
    record's "impression" field when the annotation has one, else the report alone."""
    impression = r.meta.get("impression")
    return f"{r.report} {impression.strip()}" if isinstance(impression, str) and impression.strip() else r.report


# Cache keys: what a result was computed from. Features, labels and difficulty.json are reused only
# while the key matches, so an edited image, report or encoder setting is never served stale.
def key_hash(**key) -> str:
    return hashlib.sha1(json.dumps({"recipe": RECIPE, **key}, sort_keys=True).encode()).hexdigest()[:16]


def file_stamp(path) -> list | None:
    """[absolute path, size, mtime] of a file (the path alone if there is no such file)."""
    if not path:
        return None
    try:
        s = os.stat(path)
    except OSError:
        return [os.path.abspath(path)]
    return [os.path.abspath(path), s.st_size, s.st_mtime_ns]


def data_key(args: Args, records) -> str:
    """A hash of everything the measurer reads of the training studies: ids, image files (size and
    mtime), texts, the data's labels, and the labeler where the data has none."""
    h = hashlib.sha1()
    for r in records:
        labels = None if r.labels is None else np.nan_to_num(r.labels, nan=9).tolist()
        h.update(json.dumps([r.id, [file_stamp(p) for p in r.image_paths], measure_text(r), labels]).encode())
    labeler = None if all(r.labels is not None for r in records) else [args.labeler, file_stamp(args.chexbert_weights)]
    return key_hash(studies=h.hexdigest(), labeler=labeler)


def feature_cache(args: Args) -> Path:
    if args.feature_cache:
        return Path(args.feature_cache)
    return Path(os.environ["RRG_CACHE"]) / "rrgcl" if "RRG_CACHE" in os.environ else Path(args.out) / "features"


def cached(cache: Path, kind: str, key: dict, compute) -> torch.Tensor:
    """compute() once per key: cache/<kind>-<hash of key>.pt."""
    path = cache / f"{kind}-{key_hash(**key)}.pt"
    if path.is_file():
        print(f"cache: {kind} from {path}")
        return torch.load(path, weights_only=True)
    value = compute()
    common.atomic_save(value, path)
    return value


def extract_features(args: Args, records, labels: np.ndarray, data: str, device) -> dict:
    """The (N, d) features of the training studies that --measure needs: "text" (psi), "vns_image"
    (phi, VNS-Gap only) and "itas_image" (MINE's small CNN, ITAS only). data: data_key()."""
    cache, base = feature_cache(args), {"data": data, "seed": args.seed, "epochs": args.encoder_epochs}
    studies = [dataclasses.replace(r, labels=l) for r, l in zip(records, labels)]  # the labels the encoders learn

    def small_image():
        torch.manual_seed(args.seed)
        dataset = common.ReportDataset(studies, transform=common.default_transform(args.encoder_image_size, channels=1))
        model = train_label_encoder(small_image_encoder(), dataset, "images", args.encoder_epochs, device, args.seed,
                                    args.num_workers, "small image encoder")
        return extract(model, dataset, "images", device, args.num_workers)

    def small_text():
        torch.manual_seed(args.seed)
        tok = common.WordTokenizer.build([measure_text(r) for r in records])
        seqs = [torch.tensor(tok.encode(measure_text(r))[:256] or [tok.unk_id]) for r in records]
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=tok.pad_id)  # (N, L); pad id is 0
        dataset = [{"ids": i, "labels": torch.as_tensor(l, dtype=torch.float32)} for i, l in zip(ids, labels)]
        model = train_label_encoder(SmallTextEncoder(len(tok.vocab)), dataset, "ids", 2 * args.encoder_epochs, device,
                                    args.seed, desc="small text encoder")
        return extract(model, dataset, "ids", device)

    # the small CNN is ITAS's image side whatever phi is, and phi itself unless --visual-encoder resnet101
    small = None
    if "itas" in args.measure or args.visual_encoder == "small":
        small = cached(cache, "small_image", {**base, "size": args.encoder_image_size}, small_image)
    feats = {"itas_image": small} if "itas" in args.measure else {}
    if "vns" in args.measure and args.visual_encoder == "resnet101":
        dataset = common.ReportDataset(studies, transform=common.default_transform(256))  # Sec. 4.1: 256 x 256
        feats["vns_image"] = cached(cache, "resnet101", {"data": data, "weights": file_stamp(args.resnet101_weights)},
                                    lambda: extract(resnet101_encoder(args.resnet101_weights).to(device), dataset, "images",
                                                    device, args.num_workers))
    elif "vns" in args.measure:
        feats["vns_image"] = small
    if args.text_encoder == "small":
        feats["text"] = cached(cache, "small_text", base, small_text)
    else:
        feats["text"] = cached(cache, "bert", {"data": data, "model": args.text_encoder},
                               lambda: bert_features(args.text_encoder, [measure_text(r) for r in records], device))
    return feats


# Eq. 1-4: visual neighbourhood semantic gap ------------------------------------------------------
@torch.no_grad()
def vns_gap(v: torch.Tensor, t: torch.Tensor, block: int = 2048, device="cpu") -> torch.Tensor:
    """dif1(i) = sum_j |S^v_ij - S^t_ij| for (N, d_v) visual and (N, d_t) text features, in row blocks:
    memory O(N x block), never N x N. One matmul gives S^v - S^t: [v, t] . [v, -t] = v.v' - t.t'.
    G is symmetric, so block b only computes columns j >= its first row and hands the part right of
    its own rows to those rows as column sums: half the multiplications. Returns (N,) float64
    (block sums in the features' dtype, accumulated in float64)."""
    dtype = v.dtype if v.dtype == torch.float64 else torch.float32
    v = F.normalize(v.to(device, dtype), dim=1)  # Eq. 1 denominators
    t = F.normalize(t.to(device, dtype), dim=1)  # Eq. 2 denominators
    a, b = torch.cat([v, t], 1), torch.cat([v, -t], 1)  # (N, d_v + d_t)
    N = len(a)
    dif1 = torch.zeros(N, dtype=torch.float64, device=device)
    for s in range(0, N, block):
        e = min(s + block, N)
        G = (a[s:e] @ b[s:].T).abs_()  # Eq. 3: (e - s, N - s) = |S^v_ij - S^t_ij| for j >= s
        dif1[s:e] += G.sum(1).double()  # Eq. 4, columns j >= s (summed in G's dtype: no float64 copy of G)
        dif1[e:] += G[:, e - s:].sum(0).double()  # G_ji = G_ij: rows after the block, columns s..e
        del G  # freed before the next block's is made
    return dif1.cpu()


# Eq. 5-9: image-text alignment score by MINE -----------------------------------------------------
class StatisticsNetwork(torch.nn.Module):
    """T_theta(I, R): an MLP on the concatenated image and report features -> one number (Eq. 7)."""

    def __init__(self, d_image: int, d_text: int, hidden: int = 256):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_image + d_text, hidden), torch.nn.ELU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ELU(), torch.nn.Linear(hidden, 1))

    def forward(self, image, text):
        return self.net(torch.cat([image, text], -1)).squeeze(-1)  # (B,)


def dv_bound(t_joint: torch.Tensor, t_marginal: torch.Tensor) -> torch.Tensor:
    """Eq. 6-7: E_P(IR)[T] - log E_P(I) x P(R)[e^T], the expectations as batch means (log-mean-exp)."""
    return t_joint.mean() - (torch.logsumexp(t_marginal, 0) - math.log(len(t_marginal)))


def train_mine(image: torch.Tensor, text: torch.Tensor, steps: int, batch_size: int = 256, lr: float = 1e-4,
               ma_rate: float = 0.0, seed: int = 0, device="cpu", log_every: int = 0):
    """Eq. 8: theta* = argmax of the DV bound. Joint pairs (I_i, R_i); the product of marginals pairs
    each image with the report of another study of the batch (a shuffle). With ma_rate > 0 the
    gradient of log E[e^T] uses MINE's moving average of E[e^T] as denominator instead of the
    batch's (Belghazi et al. 2018, Sec. 3.2: the batch estimate is biased). Returns (T, history of
    (step, DV bound on the batch))."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    image, text = image.to(device), text.to(device)
    T = StatisticsNetwork(image.shape[1], text.shape[1]).to(device)
    opt = torch.optim.Adam(T.parameters(), lr=lr)
    log_ma, history = None, []
    for step in range(steps):
        i = torch.randint(len(image), (batch_size,), generator=g).to(device)
        j = i[torch.randperm(batch_size, generator=g).to(device)]  # shuffled reports: P(I) x P(R)
        t_joint, t_marg = T(image[i], text[i]), T(image[i], text[j])  # (B,), (B,)
        mi = dv_bound(t_joint, t_marg)  # Eq. 7
        if ma_rate > 0:
            log_et = torch.logsumexp(t_marg, 0) - math.log(batch_size)  # log E[e^T] on this batch
            log_ma = log_et.detach() if log_ma is None else \
                torch.logaddexp(math.log(1 - ma_rate) + log_ma, math.log(ma_rate) + log_et.detach())
            loss = -(t_joint.mean() - torch.exp(log_et - log_ma))  # gradient: E[grad T] - E[e^T grad T] / ma
        else:
            loss = -mi  # Eq. 8: maximise the bound
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            history.append((step + 1, mi.item()))
    return T.eval(), history


@torch.no_grad()
def itas(T, image, text, batch_size: int = 4096) -> torch.Tensor:
    """Eq. 9: dif2(i) = T*(I_i, R_i). DV is unchanged by adding a constant to T, so only the
    standardised scores of Eq. 10 carry meaning."""
    device = next(T.parameters()).device
    return torch.cat([T(image[s:s + batch_size].to(device), text[s:s + batch_size].to(device)).cpu()
                      for s in range(0, len(image), batch_size)]).double()  # (N,)


# Eq. 10 and the classes (Algorithm 1, lines 1-3) -------------------------------------------------
def zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() or 1.0)  # population std (the paper names mu, sigma only)


def sample_difficulty(dif1, dif2, alpha: float = 0.6, beta: float = 0.4, itas_sign: int = -1) -> np.ndarray:
    """Eq. 10: alpha (dif1 - mu1) / sigma1 + beta (dif2 - mu2) / sigma2, ITAS entering with itas_sign:
    Sec. 3.2.1 says stronger alignment is easier, so by default a high T(I, R) lowers the
    difficulty (-1); +1 is Eq. 10 as printed. A measure left out (None) contributes nothing
    (Table 2 rows a, b)."""
    dif = 0.0
    if dif1 is not None:
        dif = dif + alpha * zscore(np.asarray(dif1, dtype=float))
    if dif2 is not None:
        dif = dif + itas_sign * beta * zscore(np.asarray(dif2, dtype=float))
    return np.asarray(dif, dtype=float)


def class_members(labels: np.ndarray, unlabelled: str = "class") -> tuple[list[str], list[np.ndarray], np.ndarray]:
    """Algorithm 1 line 1: D_n = studies labelled 1 for keyword n (a study may sit in several).
    Paper silent: studies positive for none of the 13 keywords (only uncertain findings) form one
    more class "Other" (unlabelled="class"), or are returned apart to join every epoch ("always").
    Empty classes are dropped (c counts the classes that have studies). Returns (names, member
    index arrays, the indices outside every class)."""
    positive = labels[:, [common.LABEL_INDEX[n] for n in CLASSES]] == 1  # (N, 13)
    names, members = [], []
    for n, name in enumerate(CLASSES):
        if positive[:, n].any():
            names.append(name)
            members.append(np.flatnonzero(positive[:, n]))
    outside = np.flatnonzero(~positive.any(1))
    if unlabelled == "class" and len(outside):
        names.append("Other")
        members.append(outside)
        outside = outside[:0]
    return names, members, outside


def class_difficulty(dif: np.ndarray, members: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 line 2: diff_C(n) = mean dif(i) over class n. Eq. 12 needs it in [0, 1] for
    gamma_n in [1, c + 1]; the paper does not say how, so we min-max normalise over the classes
    (the easiest class gets gamma = c + 1, the hardest 1). Returns (raw means, normalised)."""
    raw = np.array([dif[m].mean() for m in members])
    span = raw.max() - raw.min()
    return raw, (raw - raw.min()) / span if span > 0 else np.zeros_like(raw)


def scheduling_exponents(diff_c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 12-13 for normalised class difficulties diff_c (c,) -> (gamma (c,), lambda_0 (c,))."""
    c = len(diff_c)
    gamma = 1 + (1 - diff_c) * c  # Eq. 12: gamma_n in [1, c + 1], easier class -> larger
    return gamma, gamma / gamma.sum()  # Eq. 13: lambda_n(0) = gamma_n / sum_i gamma_i


def rrgcl_lambda(t, T: int, gamma, lambda0):
    """Eq. 11: lambda_n(t) = min(1, (lambda_n(0)^gamma_n + (1 - lambda_n(0)^gamma_n) t / T)^(1 / gamma_n))."""
    g, l0 = np.asarray(gamma, float), np.asarray(lambda0, float)
    return np.minimum(1.0, (l0 ** g + (1 - l0 ** g) * t / T) ** (1 / g))


def take(order: np.ndarray, fraction: float) -> np.ndarray:
    """The first ceil(fraction x n) of `order` ("the top lambda proportion"; ceil keeps every class
    present from the first epoch and gives all at fraction 1)."""
    return order[:math.ceil(fraction * len(order) - 1e-9)]


def rrgcl_subset(class_orders: list[np.ndarray], fractions) -> np.ndarray:
    """Algorithm 1 lines 7-9: the easiest lambda_n(t) of every class, united without duplicates."""
    return np.unique(np.concatenate([take(o, f) for o, f in zip(class_orders, fractions)]))


def curriculum_plan(dif: np.ndarray, labels: np.ndarray, unlabelled: str = "class") -> dict:
    """Algorithm 1 lines 1-3 from the study difficulties dif (N,) and labels (N, 14): the classes,
    their difficulty and Eq. 12-13's gamma_n, lambda_n(0), every class sorted from easy to hard,
    and the global easy-to-hard order for Table 2's schedulers."""
    names, members, outside = class_members(labels, unlabelled)
    raw, norm = class_difficulty(dif, members)
    gamma, lambda0 = scheduling_exponents(norm)
    return {"classes": names, "members": members, "outside": outside, "class_difficulty": raw,
            "class_difficulty_norm": norm, "gamma": gamma, "lambda0": lambda0,
            "class_orders": [idx[np.argsort(dif[idx], kind="stable")] for idx in members],
            "order": np.argsort(dif, kind="stable")}

# Table 2: the ablation schedulers, global (no classes) on the easy-to-hard order ---------------
def pacing(name: str, t: int, T: int, c0: float = 0.01, buckets: int = 5) -> tuple[float, float]:
    """The slice [lo, hi) of the easy-to-hard order used at epoch t (fractions of N)."""
    K = min(buckets, T)  # never more buckets than epochs, or One Pass would skip some
    stage = max(1, math.ceil(K * t / T))  # 1..K for t = 0..T
    if name == "linear":  # Platanios et al. 2019 linear competence (Bengio 2009's linear pace)
        return 0.0, min(1.0, c0 + (1 - c0) * t / T)
    if name == "root":  # Platanios et al. 2019: c(t) = min(1, sqrt(t (1 - c0^2) / T + c0^2))
        return 0.0, min(1.0, math.sqrt(t * (1 - c0 ** 2) / T + c0 ** 2))
    if name == "geom":  # Penha & Hauff 2020 geometric progression: 2^(log2(c0) (1 - t / T)) = c0^(1 - t/T)
        return 0.0, min(1.0, c0 ** (1 - t / T))
    if name == "baby_step":  # Bengio 2009 / Spitkovsky 2010: K buckets, one more joins at every stage
        return 0.0, stage / K
    if name == "one_pass":  # Cirik et al. 2016: each bucket once, alone, easiest first
        return (stage - 1) / K, stage / K
    if name == "none":
        return 0.0, 1.0
    raise ValueError(f"unknown scheduler {name!r}")


def epoch_subset(scheduler: str, t: int, T: int, plan: dict, args: Args) -> np.ndarray:
    """Indices of the training studies for epoch t = 1..T (t = T: all, except One Pass's last bucket)."""
    if scheduler == "rrgcl":
        fractions = rrgcl_lambda(t, T, plan["gamma"], plan["lambda0"])
        return np.union1d(rrgcl_subset(plan["class_orders"], fractions), plan["outside"])
    lo, hi = pacing(scheduler, t, T, args.c0, args.buckets)
    order = plan["order"]
    return np.sort(order[math.ceil(lo * len(order) - 1e-9):math.ceil(hi * len(order) - 1e-9)])


# The measurer, end to end ------------------------------------------------------------------------
def record_labels(records, labeler, texts: list[str] | None = None) -> np.ndarray:
    """(N, 14) labels: the data's own where it has them, else the labeler's reading of `texts` (default: the reports)."""
    texts = texts or [r.report for r in records]
    labels = np.array([np.full(14, np.nan) if r.labels is None else r.labels for r in records])  # (N, 14)
    missing = [i for i, r in enumerate(records) if r.labels is None]
    if missing:
        labels[missing] = labeler([texts[i] for i in missing])
    return labels


def zscore_columns(x: torch.Tensor) -> torch.Tensor:
    """Standardise each feature for MINE's network (our choice: the paper feeds features as they come)."""
    return (x - x.mean(0)) / x.std(0).clamp_min(1e-6)


def measure_difficulty(args: Args, records, labeler, data: str, device) -> dict:
    """Labels and features -> dif1 (Eq. 1-4) and dif2 (Eq. 5-9) of the training studies. data: data_key()."""
    # the labels are cached with the features: the labeler reads the 270k MIMIC-CXR reports once
    labels = cached(feature_cache(args), "labels", {"data": data}, lambda: torch.from_numpy(
        record_labels(records, labeler, [measure_text(r) for r in records]))).numpy()
    feats = extract_features(args, records, labels, data, device)
    dif1 = dif2 = None
    if "vns" in args.measure:
        dif1 = vns_gap(feats["vns_image"], feats["text"], args.vns_block, device).numpy()
    if "itas" in args.measure:
        img, txt = zscore_columns(feats["itas_image"]), zscore_columns(feats["text"])
        T, history = train_mine(img, txt, args.mine_steps, args.mine_batch_size, args.mine_lr, args.mine_ma_rate,
                                args.seed, device, log_every=max(1, args.mine_steps // 10))
        dif2 = itas(T, img, txt).numpy()
        print(f"MINE: DV bound on training batches {[round(m, 3) for _, m in history]} nats")
    return {"labels": labels, "dif1": dif1, "dif2": dif2}


def difficulty(args: Args, records, labeler, device) -> dict:
    """{"key", "ids", "labels" (N, 14), "dif1", "dif2"} of the training studies: from <out>/difficulty.json
    when its key matches (the same studies: ids, image files, texts, labels; the same measuring
    flags), as after a --measure-only run or on resume; else measured now."""
    path = Path(args.out) / "difficulty.json"
    data = data_key(args, records)
    key = key_hash(data=data, resnet101=file_stamp(args.resnet101_weights), **{f: getattr(args, f) for f in MEASURE_FLAGS})
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            print(f"difficulty: reusing {path} (same studies and measuring flags)")
            s, arr = saved["samples"], lambda x: None if x is None else np.asarray(x, dtype=float)  # null -> NaN
            return {"key": key, "ids": s["ids"], "labels": arr(s["labels"]), "dif1": arr(s["dif1"]), "dif2": arr(s["dif2"])}
        if args.resume and (Path(args.out) / "last.pt").is_file():
            raise ValueError(f"--resume: {path} was measured on other training data than --data {args.data} has now "
                             "(studies, images or reports changed); start a new --out")
        print(f"difficulty: {path} was measured on other studies or with other flags: measuring again")
    return {"key": key, "ids": [r.id for r in records], **measure_difficulty(args, records, labeler, data, device)}


def save_difficulty(path: Path, measured: dict, dif: np.ndarray, plan: dict):
    """difficulty.json: the per-study labels and scores (a later run reuses them and rebuilds the classes)
    and a per-class summary for readers and the Q1 command."""
    js = lambda a: None if a is None else np.where(np.isnan(a), None, a).tolist()  # NaN -> null
    classes = [{"name": n, "size": len(idx), "difficulty": float(d), "difficulty_norm": float(dn), "gamma": float(g),
                "lambda0": float(l0)} for n, idx, d, dn, g, l0 in zip(plan["classes"], plan["members"], plan["class_difficulty"],
                                                                     plan["class_difficulty_norm"], plan["gamma"], plan["lambda0"])]
    samples = {"ids": measured["ids"], "labels": js(measured["labels"]), "dif1": js(measured["dif1"]),
               "dif2": js(measured["dif2"]), "dif": js(dif)}
    path.write_text(json.dumps({"key": measured["key"], "classes": classes, "samples": samples}))


def write_schedule(path: Path, plan: dict, N: int, args: Args):
    """Fig. 3 as JSON: lambda_n(t) of every class for t = 0..T, the ablation schedulers' fractions,
    and the subset sizes each scheduler gives this data."""
    T, ts = args.epochs, np.arange(args.epochs + 1)
    curves = rrgcl_lambda(ts[:, None], T, plan["gamma"], plan["lambda0"])  # (T + 1, c)
    out = {"T": T, "N": N, "t": ts.tolist(),
           "classes": [{"name": n, "size": len(idx), "gamma": float(g), "lambda0": float(l0), "lambda": curves[:, k].tolist()}
                       for k, (n, idx, g, l0) in enumerate(zip(plan["classes"], plan["members"], plan["gamma"], plan["lambda0"]))],
           "pacing": {s: [list(pacing(s, t, T, args.c0, args.buckets)) for t in ts] for s in SCHEDULERS if s != "rrgcl"},
           "subset_sizes": {s: [len(epoch_subset(s, t, T, plan, args)) for t in range(1, T + 1)] for s in SCHEDULERS}}
    path.write_text(json.dumps(out, indent=1))


# Fig. 1: Q1 analysis ------------------------------------------------------------------------------
def q1_analysis(rows: list[dict], classes: list[dict]) -> dict:
    """Per-class corpus BLEU-4 of generated test reports (texts cleaned as common.evaluate_generations
    does) against the class's training size and its difficulty, with Spearman rank correlations,
    over the 13 keyword classes that have test studies. rows: {"reference", "generated", "labels" (14)}."""
    from scipy.stats import spearmanr
    labels = np.array([[np.nan if v is None else v for v in r["labels"]] for r in rows], dtype=float)
    per_class = []
    for c in classes:
        if c["name"] not in CLASSES:
            continue
        sel = [i for i in np.flatnonzero(labels[:, common.LABEL_INDEX[c["name"]]] == 1)]
        if not sel:
            continue
        hyps = [common.clean_report(rows[i]["generated"]) if rows[i]["generated"].strip() else "" for i in sel]
        refs = [common.clean_report(rows[i]["reference"]) for i in sel]
        per_class.append({**c, "n_test": len(sel), "bleu4": common.nlg_metrics(hyps, refs, meteor=False)["BLEU-4"]})
    out = {"per_class": sorted(per_class, key=lambda c: -c["size"])}
    if len(per_class) >= 3:
        bleu = [c["bleu4"] for c in per_class]
        for key in ("size", "difficulty"):
            rho, p = spearmanr([c[key] for c in per_class], bleu)
            out[f"spearman_bleu4_vs_{key}"] = {"rho": float(rho), "p": float(p), "n_classes": len(per_class)}
    return out


@dataclass
class Q1Args:
    run: str = "runs/rrgcl"  # a run folder of this script
    generations: str | None = None  # generated test reports with reference labels (default: <run>/generations_test.jsonl)
    difficulty: str | None = None  # class sizes and difficulty (default: <run>/difficulty.json)
    out: str | None = None  # the result (default: <run>/q1.json; with --generations FILE: FILE with the suffix .q1.json)
    labeler: str = "rule"  # labels the references of rows that carry no "labels": rule | chexbert
    chexbert_weights: str | None = None


def q1_command(argv):
    """`python rrgcl.py q1 --run DIR`: Fig. 1 for any model's generated test reports."""
    a = common.parse_args(Q1Args, argv, "Fig. 1: per-class BLEU-4 vs class size and class difficulty")
    run = Path(a.run)
    rows = common.read_generations(a.generations or run / "generations_test.jsonl")
    unlabelled = [r for r in rows if "labels" not in r]
    if unlabelled:
        labels = common.make_labeler(a.labeler, a.chexbert_weights)([r["reference"] for r in unlabelled])
        for r, l in zip(unlabelled, labels):
            r["labels"] = [None if np.isnan(v) else v for v in l]
    result = q1_analysis(rows, json.loads(Path(a.difficulty or run / "difficulty.json").read_text())["classes"])
    out = Path(a.out or (Path(a.generations).with_suffix(".q1.json") if a.generations else run / "q1.json"))
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "per_class"}, indent=1), f"\nwrote {out}")


# Training -------------------------------------------------------------------------------------------
def epoch_batches(subset: np.ndarray, steps: int, batch_size: int, world_size: int, seed: int, epoch: int) -> np.ndarray:
    """(steps, world_size, batch_size) study indices: the epoch's subset shuffled (from seed and
    epoch alone, so a resumed run sees the same batches) and repeated as often as the steps need."""
    if not len(subset):
        raise ValueError(f"epoch {epoch + 1}: the scheduler gives no studies (fewer studies than --buckets?)")
    rng = np.random.default_rng([seed, epoch])
    need = steps * world_size * batch_size
    order = np.concatenate([rng.permutation(subset) for _ in range(math.ceil(need / len(subset)))])
    return order[:need].reshape(steps, world_size, batch_size)


def build_policy(args: Args, train_records, dist):
    dtype = common.resolve_dtype(args.dtype, dist.device)
    policy = common.make_policy(args.model, [r.report for r in train_records], dist.device, dtype, args.max_new_tokens,
                                n_views=max(len(r.image_paths) for r in train_records))
    if args.model != "tiny" and args.lora_r > 0:
        common.apply_lora(policy.model, args.lora_targets.split(","), args.lora_r, args.lora_alpha, args.lora_dropout,
                          exclude=policy.vision_and_language()[0])  # the language model only
    return policy


def n_tokens(policy, texts: list[str]) -> float:
    """Target tokens of the texts (end of text included): the weight of their mean in a token mean."""
    return float(policy.encode_targets(texts)[1].sum())


@torch.no_grad()
def val_loss(policy, records, args: Args, dist) -> float:
    """Teacher-forced NLL per token of the val reports: each rank a strided shard (uneven, or empty
    when there are fewer studies than ranks), token sums and counts summed over ranks."""
    mine = records[dist.rank::dist.world_size]
    was_training = policy.model.training
    policy.model.eval()  # no LoRA dropout
    nll = tokens = 0.0
    for i in range(0, len(mine), args.batch_size):
        chunk = mine[i:i + args.batch_size]
        images = [[common.load_image(p, r.id) for p in r.image_paths] for r in chunk]
        n = n_tokens(policy, [r.report for r in chunk])
        with common.autocast(dist.device, args.dtype):
            nll += policy.sft_loss(policy.prompt_batch(images, PROMPT), [r.report for r in chunk]).item() * n
        tokens += n
    policy.model.train(was_training)
    nll, tokens = common.all_reduce_mean([nll, tokens])  # means over ranks: their ratio is the ratio of the sums
    return nll / tokens if tokens else float("nan")


def evaluate(policy, records, labeler, args: Args, dist, name: str) -> dict:
    """Greedy reports for `records`; on rank 0 the common NLG and CE metrics, and the files."""
    texts = common.generate_reports(policy, records, PROMPT, max_new_tokens=args.max_new_tokens,
                                    rank=dist.rank, world_size=dist.world_size, desc=name)
    if not dist.is_main:
        return {}
    labels = record_labels(records, labeler)
    rows = [{"id": r.id, "reference": r.report, "generated": g, "labels": [None if np.isnan(v) else v for v in l]}
            for r, g, l in zip(records, texts, labels)]
    results = common.evaluate_generations(rows, labeler, meteor="auto" if name == "test" else False)
    with open(Path(args.out) / f"generations_{name}.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    (Path(args.out) / f"eval_{name}.json").write_text(json.dumps(results, indent=2))
    return results


def train(args: Args) -> dict:
    check_args(args)
    dist = common.setup_distributed(args.device)
    tiny = args.model == "tiny"
    lora = not tiny and args.lora_r > 0
    args.lr = args.lr or (1e-3 if tiny else 1e-4)
    args.max_new_tokens = args.max_new_tokens or (96 if tiny else 256)
    out = common.start_run(args.out, args, dist, may_change=RESUMABLE)  # --resume: the run's flags
    data = common.load_data(args.data)
    train_records, val_records, test_records = data["train"], data["val"][:args.n_eval], data["test"]
    labeler = common.make_labeler(args.labeler, args.chexbert_weights, dist.device)

    # Learning-difficulty measurer (Sec. 3.2), on rank 0; the other ranks receive its result
    measured = common.broadcast_object(difficulty(args, train_records, labeler, dist.device) if dist.is_main else None)
    dif = sample_difficulty(measured["dif1"], measured["dif2"], args.alpha, args.beta, args.itas_sign)  # Eq. 10
    plan = curriculum_plan(dif, measured["labels"], args.unlabelled)
    T, N = args.epochs, len(train_records)
    subsets = [epoch_subset(args.scheduler, t, T, plan, args) for t in range(1, T + 1)]  # Algorithm 1, t = 1..T
    if dist.is_main:
        save_difficulty(out / "difficulty.json", measured, dif, plan)
        write_schedule(out / "schedule.json", plan, N, args)
        print("classes (size, difficulty, gamma, lambda_0): " + "; ".join(
            f"{n} {len(i)} {d:+.2f} {g:.1f} {l:.3f}" for n, i, d, g, l in zip(plan["classes"], plan["members"],
                                                                           plan["class_difficulty"], plan["gamma"], plan["lambda0"])))
        print(f"{args.scheduler}: subset sizes per epoch {[len(s) for s in subsets]} of {N}")
    if args.measure_only:
        return {"classes": plan["classes"], "subset_sizes": [len(s) for s in subsets]}

    # Report generator: same seed, so every scheduler starts from the same weights
    common.seed_everything(args.seed)
    policy = build_policy(args, train_records, dist)
    common.broadcast_parameters(policy.model)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    per_step = args.batch_size * dist.world_size
    # Budget: "steps" gives every epoch (so every scheduler) the same optimiser steps, a full-set
    # pass's worth, drawn from its subset; "subset" is one pass over the subset (Algorithm 1 line 11
    # read literally: a curriculum then takes fewer steps than the baseline).
    steps = [(args.epoch_steps or max(1, N // per_step)) if args.budget == "steps" else max(1, len(s) // per_step)
             for s in subsets]
    ends = np.cumsum(steps)  # global step at the end of each epoch
    common.seed_everything(args.seed, dist.rank)
    start = 0
    if args.resume and (out / "last.pt").is_file():  # a run stopped before its first checkpoint starts again
        start, _ = common.load_checkpoint(out / "last.pt", policy.model, optimizer)
    if dist.is_main and (out / "metrics.jsonl").is_file():  # drop what was logged after the checkpoint
        lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
        (out / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x)["step"] <= start))
    dataset = common.ReportDataset(train_records, transform="pil")
    policy.model.train()
    micro = args.batch_size // args.grad_accum
    with common.RunLog(out, int(ends[-1]), dist.is_main, start, desc=f"RRGCL SFT ({args.scheduler})") as runlog:
        # Algorithm 1 lines 6-11: epoch t = epoch + 1 trains the report generator on D_sub(t)
        for epoch in range(int(np.searchsorted(ends, start, side="right")), T):
            first = max(0, start - (ends[epoch] - steps[epoch]))  # steps of this epoch already done (resume)
            batches = epoch_batches(subsets[epoch], steps[epoch], args.batch_size, dist.world_size, args.seed, epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches[first:, dist.rank].tolist(),
                                                 collate_fn=common.collate, num_workers=args.num_workers)
            losses = []
            for step, batch in enumerate(loader, start=int(ends[epoch] - steps[epoch] + first)):
                # The step's loss is the token mean over the whole step, all micro-batches of all ranks, so
                # --grad-accum and the number of ranks do not change it: micro-batch k's token mean is
                # weighted by its share of the step's tokens, times world size (all_reduce_gradients averages).
                parts = [slice(k * micro, (k + 1) * micro) for k in range(args.grad_accum)]
                counts = [n_tokens(policy, batch["report"][p]) for p in parts]
                total = common.all_reduce_mean(sum(counts)) * dist.world_size
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for p, n in zip(parts, counts):
                    with common.autocast(dist.device, args.dtype):
                        loss = policy.sft_loss(policy.prompt_batch(batch["images"][p], PROMPT), batch["report"][p])
                    (loss * (n * dist.world_size / total)).backward()
                    step_loss += loss.item() * n * dist.world_size / total
                losses.append(step_loss)  # its mean over ranks is the step's token mean
                common.all_reduce_gradients(params, dist.world_size)
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                if (step + 1) % args.log_every == 0:
                    runlog.log(step + 1, loss=common.all_reduce_mean(np.mean(losses[-args.log_every:])))
                end_of_epoch = step + 1 == ends[epoch]
                if end_of_epoch:
                    runlog.log(step + 1, epoch=epoch + 1, subset=len(subsets[epoch]), subset_fraction=len(subsets[epoch]) / N,
                               train_loss=common.all_reduce_mean(np.mean(losses)),
                               val_loss=val_loss(policy, val_records, args, dist))
                if end_of_epoch or (step + 1) % args.save_every == 0:
                    common.save_checkpoint(out / "last.pt", policy.model, optimizer, None, step + 1,
                                           extra={"epoch": epoch + 1}, config=args, trainable_only=lora)  # LoRA: adapters only

    results = {"val": evaluate(policy, val_records, labeler, args, dist, "val"),
               "test": evaluate(policy, test_records, labeler, args, dist, "test")}
    if dist.is_main:
        policy.save(out / "final")
        results["q1"] = q1_analysis(common.read_generations(out / "generations_test.jsonl"),
                                    json.loads((out / "difficulty.json").read_text())["classes"])
        (out / "q1.json").write_text(json.dumps(results["q1"], indent=2))
        results.update(scheduler=args.scheduler, steps=int(ends[-1]), examples_seen=int(ends[-1]) * per_step)
        (out / "eval.json").write_text(json.dumps(results, indent=2))
        t = results["test"]
        print(f"{args.scheduler}: test BLEU-4 {t['nlg']['BLEU-4']:.4f}, ROUGE-L {t['nlg']['ROUGE-L']:.4f}, "
              f"CE micro F1 {t['ce']['micro_f1']:.4f} after {ends[-1]} steps")
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["q1"]:
        return q1_command(argv[1:])
    args = common.parse_args(Args, argv, __doc__)
    schedulers = args.scheduler.split(",")
    if len(schedulers) == 1:
        train(args)
    else:  # same budget and seed, one run folder each, and the comparison side by side
        is_main = os.environ.get("RANK", "0") == "0"
        table, cache, root = {}, str(feature_cache(args)), Path(args.out)  # the features are shared
        for s in schedulers:
            sub = root / s
            if args.resume and (sub / "eval.json").is_file():  # finished before the interruption
                r = json.loads((sub / "eval.json").read_text()) if is_main else {}
            else:
                first = root / schedulers[0] / "difficulty.json"  # measured once: reused while its key matches
                if is_main and s != schedulers[0] and first.is_file() and not (sub / "difficulty.json").is_file():
                    sub.mkdir(parents=True, exist_ok=True)
                    shutil.copy(first, sub / "difficulty.json")
                r = train(dataclasses.replace(args, scheduler=s, out=str(sub), feature_cache=cache,
                                              resume=args.resume and (sub / "config.json").is_file()))
            if r.get("test"):
                table[s] = {"test_nlg": r["test"]["nlg"], "test_ce": r["test"]["ce"],
                            "steps": r["steps"], "examples_seen": r["examples_seen"]}
        if table:
            (root / "compare.json").write_text(json.dumps(table, indent=2))
            for s, r in table.items():
                print(f"{s:10s} BLEU-4 {r['test_nlg']['BLEU-4']:.4f}  ROUGE-L {r['test_nlg']['ROUGE-L']:.4f}  "
                      f"CE micro F1 {r['test_ce']['micro_f1']:.4f}  ({r['steps']} steps)")
    common.cleanup_distributed()


if __name__ == "__main__":
    main()
