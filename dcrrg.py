"""DCRRG: divide-and-conquer radiology report generation, in four steps.

Paper: "Divide and Conquer Radiology Report Generation via Observation Level Fine-grained
Pretraining and Prompt Tuning" (Zhou & Wang, EMNLP 2024; ../shared/papers/dcrrg.txt). A report
is treated as descriptions of the 14 CheXpert observations. Step 1 trains an image encoder and a
text encoder, each on its own modality, to predict one observation's label from the embedding
concatenated with that observation's one-hot prompt (so each observation can be re-sampled to
balance without touching the others). Step 2 aligns the two encoders with a contrastive loss
whose soft targets are label similarities calibrated by uni-modal similarity (Steps 1-2 are
"DCCLIP"). Step 3 trains a two-layer transformer decoder to write one observation's description
from the image or the text representation under that observation's prompt. Step 4 freezes it
all and learns prefix keys/values in every decoder attention plus a fresh output head (P-Tuning
v2), so the decoder writes the full report; `--step4 fft` fine-tunes image encoder and decoder.

    python dcrrg.py all              # synthetic set, tiny sizes: 4 steps + evaluation, a few minutes on CPU
    python dcrrg.py ablation         # Table 4's rows, one budget and seed -> runs/dcrrg/ablation/ablation.json
    python dcrrg.py step3 --resume   # one step; starts from runs/dcrrg/step2/model.pt (or --init FOLDER)
    torchrun --nproc_per_node=4 dcrrg.py all --data /data/mimic_cxr/annotation.json --model paper \\
        --pretrained imagenet --text-encoder emilyalsentzer/Bio_ClinicalBERT --labeler chexbert \\
        --step1-steps 20000 --step2-steps 10000 --step3-steps 20000 --step4-steps 20000
(batch sizes are global: each of N processes takes 1/N; Step 2 contrasts the whole global batch)

Equations, and where they are implemented:
    Eq. 1a, 2a  v = E_img(x_img), t = E_txt(x_txt)              DCRRG.embed_images, DCRRG.embed_texts
    Eq. 1b, 2b  v_p = f_v(concat(v, e_prompt)), same for t     ProjectionHead
    Sec. 3.1    per-prompt label CE, unmentioned = negative,   observation_targets, pair_pools,
                uncertain left out, per-observation balance     draw_pairs, pair_weights, step1
    Eq. 3-5     soft targets s, calibrated y^{v->t}, y^{t->v}  soft_targets
    Eq. 6-9     calibrated semantic matching loss, tau 0.07    csm_loss (global batch: gather_batch), step2
    Eq. 10-12   post-LN decoder layer (MMHA, CA, FFN)          DecoderLayer
    Eq. 13-14   autoregressive decoder, token cross-entropy   Decoder, lm_loss, step3
    Sec. 3.3    observation descriptions from sentences       split_sentences, assign_sentences
    Sec. 3.4    P-Tuning v2 prefixes + fresh output head      Prefix, step4
    App. A      beam search of width 3                        beam_search
    Sec. 4.3    P@K retrieval on 5 x N, AUROC probes          retrieval_set, precision_at_k, probes
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common


@dataclass
class Args:
    data: str = "synthetic"  # "synthetic" or an annotation.json (R2Gen layout) / CSV / JSONL
    model: str = "tiny"  # "tiny" (CPU: small CNN, BERT-Tiny shape, width 128) or "paper" (ResNet-50, BERT 512/8 heads)
    image_encoder: str | None = None  # None: by --model; "cnn" (small, offline) or "resnet50" (paper App. A)
    pretrained: str | None = None  # ResNet-50 start: a state_dict .pth or "imagenet" (torchvision's, the paper's)
    text_encoder: str | None = None  # HF id/path (paper: emilyalsentzer/Bio_ClinicalBERT); None: random-init BERT
    vocab_size: int = 8000  # words the local tokenizer keeps whole, most frequent first; rarer become characters
    labeler: str = "rule"  # "rule" (offline) or "chexbert"; the paper labels with the CheXpert labeler
    chexbert_weights: str | None = None  # local chexbert.pth (else downloaded once)
    extra_data: str | None = None  # annotation file whose 'train' records join Step 1 only (paper: CheXpert)
    extra_modality: str = "both"  # which Step 1 encoder(s) the extra records train: both, image or text
    out: str = "runs/dcrrg"
    init: str | None = None  # folder whose model.pt one step starts from (default: previous step in --out); "scratch"
    seed: int = 0
    device: str = "auto"
    dtype: str = "fp32"  # fp32 | bf16 | auto (fp16 is refused: no loss scaling here)
    resume: bool = False  # continue a stopped step from its last.pt and keep finished ones, if their flags and init match
    # Steps 1-2, DCCLIP (paper App. A: AdamW, lr 1e-4, weight decay 1e-6, batch 32)
    lr: float | None = None  # every step; None: 1e-4 (paper App. A), with --model tiny see learning_rate()
    weight_decay: float = 1e-6  # paper App. A
    batch_size: int = 32  # over all ranks. Step 1: (sample, observation) pairs per modality; Step 2: image-text pairs (paper)
    balance: str = "reweight"  # Step 1, per observation: "resample" (paper), "reweight" (its expected loss), "none"
    step1_steps: int = 500  # the paper gives no schedule: our budget for the synthetic set
    step2_steps: int = 300  # our budget
    # Steps 3-4, decoder (paper App. A: AdamW, lr 1e-4, batch 16)
    decoder_batch_size: int = 16  # over all ranks (paper App. A)
    step3_steps: int = 1200  # our budget
    step4_steps: int = 800  # our budget
    step4: str = "pt"  # "pt": P-Tuning v2 (paper); "fft": full fine-tuning of image encoder and decoder (Table 4)
    pt_lr: float | None = None  # Step 4 P-Tuning lr; None: as --lr (paper), 5e-3 with --model tiny (P-Tuning v2)
    prefix_len: int = 16  # P-Tuning v2 prefix length per attention (paper silent)
    text_view: bool = True  # Step 3 also learns from text representations (Sec. 3.3's second view)
    positions: str = "none"  # decoder input: "none" = token embeddings only (Sec. 3.3), or "sinusoidal"
    dropout: float = 0.1  # decoder dropout (paper silent: Vaswani et al.'s)
    text_dropout: float = 0.1  # text encoder's hidden and attention dropout (paper silent: BERT's)
    max_text_tokens: int = 256  # word pieces the text encoder reads
    max_description_tokens: int = 48  # Step 3 targets
    max_report_tokens: int = 128  # Step 4 targets and generation
    beam: int = 3  # beam width (paper App. A)
    # Evaluation
    n_test: int | None = None  # test studies for report metrics (None: all)
    meteor: bool = True  # METEOR through pycocoevalcap's Java scorer when Java is there (the paper reports it)
    retrieval_per_class: int = 200  # N of the 5 x N retrieval set (CheXpert 5x200); fewer if the test split has fewer
    probes: bool = True  # after Step 2: AUROC of linear probe and fine-tuning with 1/10/100 % of labels (Sec. 4.4.3)
    probe_steps: int = 100  # optimiser steps per probe (paper silent)
    probe_lr: float = 1e-3  # probe learning rate (paper silent)
    log_every: int = 20
    ckpt_every: int = 200


SIZES = {  # --model: image encoder and size, text BERT (hidden, heads, layers), width P of projections and decoder
    "tiny": dict(image="cnn", image_size=64, hidden=128, heads=2, layers=2, width=128, dec_heads=4),  # BERT-Tiny shape
    # App. A: 8 heads, hidden 512; layers not given: 8, as Google's BERT-Medium of that width
    "paper": dict(image="resnet50", image_size=224, hidden=512, heads=8, layers=8, width=512, dec_heads=8),
}
K = len(common.CHEXPERT_LABELS)  # 14 observations = 14 prompts
NO_FINDING = common.LABEL_INDEX["No Finding"]
# CheXpert 5x200's classes, the five competition tasks (Sec. 4.1 names four of them: Consolidation is missing)
FIVE = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion"]
STAGES = ("step1", "step2", "step3", "step4")
MODALITIES = ("image", "text")


# Sec. 3.1: observation labels -------------------------------------------------------------------
def observation_targets(labels: np.ndarray) -> np.ndarray:
    """(N, 14) labels 1/0/-1/NaN -> Step 1 targets: 1 positive, 0 negative or not mentioned
    ("we treat unmentioned labels as negative"), NaN uncertain ("exclude data with uncertain labels")."""
    targets = np.where(labels == 1, 1.0, 0.0)
    targets[labels == -1] = np.nan
    return targets


def pair_pools(targets: np.ndarray):
    """What Step 1's re-sampling draws from, computed once: the observations with labels, and per
    observation the rows of each class (0, 1); an observation with one class only gets that class's
    rows for both. -> (usable observations, {observation: (negative rows, positive rows)})."""
    usable = np.flatnonzero((~np.isnan(targets)).any(0))
    pools = {}
    for k in usable:
        neg, pos = np.flatnonzero(targets[:, k] == 0), np.flatnonzero(targets[:, k] == 1)
        pools[k] = (neg if len(neg) else pos, pos if len(pos) else neg)
    return usable, pools


def draw_pairs(pools, n: int, rng: np.random.Generator):
    """Step 1 re-sampling, literally: n (sample, observation) pairs, each drawn as an observation
    (uniformly among those with labels), then positive or negative with equal chance, then a sample
    with that label; so one observation is balanced without touching the others (the paper's
    point). Uncertain pairs are never drawn. pools: pair_pools(targets). -> rows (n,), observations (n,)."""
    usable, by_class = pools
    obs, cls = rng.choice(usable, size=n), rng.integers(2, size=n)
    rows = np.array([by_class[k][c][rng.integers(len(by_class[k][c]))] for k, c in zip(obs, cls)], dtype=np.int64)
    return rows, obs


def pair_weights(targets: np.ndarray, balance: bool) -> np.ndarray:
    """(N, 14) weight of each (sample, observation) pair when a batch of B uniformly drawn samples
    is scored under all 14 prompts and the loss is sum(weight * CE) / B. Balanced: N / (2 K' n_kc)
    for a pair of class c (n_kc samples of that class, K' observations with labels), so the expected
    loss equals that of draw_pairs' re-sampling while one image forward serves 14 pairs. Else
    1 / (labelled pairs per sample): the plain mean. Uncertain pairs weigh 0."""
    labelled = ~np.isnan(targets)
    if not balance:
        return labelled / labelled.sum(1).mean()
    n = np.stack([(targets == 0).sum(0), (targets == 1).sum(0)])  # (2, 14): samples of each class
    classes = (n > 0).sum(0)  # (14,): 2, or 1 when an observation has one class (it takes all the mass)
    w = len(targets) / ((classes > 0).sum() * np.maximum(classes, 1) * np.maximum(n, 1))  # (2, 14): w[c, k]
    return np.where(labelled, w[np.nan_to_num(targets).astype(int), np.arange(K)], 0.0)


# Sec. 3.3: a report as observation descriptions -------------------------------------------------
HEADER = re.compile(r"\b(?:[A-Z][A-Z ]*[A-Z]|(?i:findings|impression|comparison|indication|history|technique|"
                    r"examination|conclusions?))\s*:")  # "FINDINGS:", "Impression:"
LIST_MARKER = re.compile(r"^(?:\d{1,2}[.)]|[-*\u2022])\s+")  # "1. ", "2) ", "- "


def split_sentences(report: str) -> list[str]:
    """Section headers become breaks; sentences end at . ! ? followed by white space, or at a line
    break ("1.5 cm" stays whole); list markers are stripped and fragments with no letter ("1.",
    "___") dropped."""
    parts = re.split(r"(?<=[.!?])\s+|\n+", HEADER.sub("\n", report))
    return [s for s in (LIST_MARKER.sub("", p.strip()).strip() for p in parts) if re.search("[A-Za-z]", s)]


def assign_sentences(sentences: list[str], labels: np.ndarray, no_finding: bool) -> dict[int, str]:
    """Each sentence goes to every one of the 13 findings the labeler finds in it (positive,
    negative or uncertain). A sentence naming none of them ("No acute cardiopulmonary process.")
    goes to No Finding when the study's No Finding label is 1 (no_finding), else it is dropped: it
    describes no observation of an abnormal study. (The paper does not say; CheXpert's No Finding
    rule per sentence would tag every negative sentence.) -> {observation: its sentences in order}."""
    out: dict[int, list[str]] = {}
    for sentence, row in zip(sentences, labels):
        found = [k for k in range(K) if k != NO_FINDING and not np.isnan(row[k])]
        for k in found or ([NO_FINDING] if no_finding else []):
            out.setdefault(k, []).append(sentence)
    return {k: " ".join(v) for k, v in out.items()}


def observation_descriptions(reports: list[str], labeler, no_finding: list[bool]) -> list[dict[int, str]]:
    """Per report {observation: description}; all sentences are labelled in one labeler call.
    no_finding: per report, whether its study's No Finding label is 1."""
    sentences = [split_sentences(r) for r in reports]
    labels = labeler([s for ss in sentences for s in ss])  # (sum of sentences, 14)
    out, start = [], 0
    for ss, nf in zip(sentences, no_finding):
        out.append(assign_sentences(ss, labels[start:start + len(ss)], nf))
        start += len(ss)
    return out


# Encoders (Eq. 1-2) -----------------------------------------------------------------------------
def build_image_encoder(name: str, pretrained: str | None) -> common.ViewMean:
    """Eq. 1a's E_img over a study's views: (B, V, C, H, W) -> v (B, D), the views averaged (IU X-Ray
    has two). "cnn": common.SmallCNN (an 8 x 8 grid flattened, so where a sign lies survives);
    "resnet50": the paper's, v its pooled 2048-d feature."""
    if name == "cnn":
        if pretrained:
            raise ValueError("--pretrained is for --image-encoder resnet50")
        return common.ViewMean(common.SmallCNN())
    if name != "resnet50":
        raise ValueError(f"--image-encoder must be 'cnn' or 'resnet50', got {name!r}")
    return common.resnet_encoder(50, pretrained, "--pretrained")  # "imagenet": torchvision downloads once, when asked


def build_tokenizer(args: Args, reports: list[str], out: Path, dist):
    """Bio_ClinicalBERT's (or any named model's) tokenizer, else a word-piece vocabulary built from
    the training reports and written to out/tokenizer/vocab.txt, where later steps and resumed
    runs read it: the vocab_size most frequent words (split as BERT splits: lower case, punctuation
    apart) and every character alone and as a ##continuation, so an unseen word becomes characters.
    (The `tokenizers` WordPiece trainer breaks ties in hash order: another vocabulary every run.)"""
    from transformers import AutoTokenizer, BertTokenizerFast
    if args.text_encoder:
        return AutoTokenizer.from_pretrained(args.text_encoder)
    folder = out / "tokenizer"
    if dist.is_main and not (folder / "vocab.txt").is_file():
        counts = Counter(w for r in reports for w in re.findall(r"\w+|[^\w\s]", r.lower()))
        words = sorted(counts, key=lambda w: (-counts[w], w))[:args.vocab_size]
        chars = sorted({c for w in counts for c in w})
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + words
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    common.broadcast_object(None)  # the other ranks wait until the vocabulary is on disk
    # from_pretrained(folder): transformers 5 ignores BertTokenizerFast(vocab_file=...) (tests/test_chexbert.py)
    return BertTokenizerFast.from_pretrained(str(folder))


class ProjectionHead(nn.Module):
    """Eq. 1b / 2b: f(concat(embedding, e_prompt)), e_prompt the one-hot of an observation. The
    paper does not say what f is. A linear f would make the prompt a constant shift that a shared
    linear classifier cannot tell apart, so f is an MLP (LayerNorm on the embedding, Linear to 4P,
    GELU, Linear to P), and the prompt's input weights start at unit scale: a one-hot input is
    otherwise ~sqrt(D) times weaker than the embedding, and each prompt is slow to find its units."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim + K, 4 * width), nn.Linear(4 * width, width)
        with torch.no_grad():
            self.fc1.weight[:, dim:].normal_()

    def forward(self, x, obs=None):
        """x (B, D) -> (B, P) under prompt obs (B,), or (B, 14, P) under every prompt when obs is None."""
        x = self.norm(x)
        if obs is not None:
            z = torch.cat([x, F.one_hot(obs, K).to(x.dtype)], -1)  # (B, D + 14)
        else:
            e = torch.eye(K, dtype=x.dtype, device=x.device).expand(len(x), K, K)  # (B, 14, 14)
            z = torch.cat([x[:, None].expand(-1, K, -1), e], -1)  # (B, 14, D + 14)
        return self.fc2(F.gelu(self.fc1(z)))


# Decoder (Eq. 10-14) with P-Tuning v2 prefixes ----------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention whose keys/values may start with trainable prefix vectors (P-Tuning v2)
    and, while generating, with the cached keys/values of earlier tokens."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.dropout = heads, dropout

    def forward(self, x, source, causal: bool, prefix=None, cache: dict | None = None):
        B, T, d = x.shape
        split = lambda z: z.reshape(B, -1, self.heads, d // self.heads).transpose(1, 2)  # (B, H, L, d/H)
        q, k, v = split(self.q(x)), split(self.k(source)), split(self.v(source))
        if cache is not None:  # generation: prepend the keys/values of the tokens before
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        mask = None
        if causal:  # query i (after `past` cached tokens) sees keys 0 .. past + i
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
        if prefix is not None:  # prefix (2, L_p, d): keys and values every position sees
            k = torch.cat([split(prefix[0].expand(B, -1, -1)), k], 2)
            v = torch.cat([split(prefix[1].expand(B, -1, -1)), v], 2)
            if mask is not None:
                mask = torch.cat([mask.new_ones(T, prefix.shape[1]), mask], 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.o(out.transpose(1, 2).reshape(B, T, d))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(d, heads, dropout), Attention(d, heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(4 * d, d))
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, y, f_I, prefix=None, cache=None):
        """prefix (2, 2, L_p, d): self- and cross-attention key/value prefixes of this layer, or None."""
        # Eq. 12: e_attn = LN(MMHA(y) + y)
        e_attn = self.ln1(y + self.drop(self.self_attn(y, y, True, None if prefix is None else prefix[0], cache)))
        # Eq. 11: e_ca = LN(CA(e_attn, f_I) + e_attn), Q from e_attn, K and V from f_I
        e_ca = self.ln2(e_attn + self.drop(self.cross_attn(e_attn, f_I, False, None if prefix is None else prefix[1])))
        # Eq. 10: f_d(y) = LN(FFN(e_ca) + e_ca)
        return self.ln3(e_ca + self.drop(self.ffn(e_ca)))


class Decoder(nn.Module):
    """Two post-LN decoder layers over token embeddings (Eq. 13: p(T|I) = prod_t p(y_t | y_<t, I)),
    cross-attending to f_I (B, S, P), then a linear head (the log-softmax is in the loss).

    Step 3's "specific prompt" (the paper does not say how the decoder gets it): f_I is the study
    under all 14 prompts (Eq. 1b), one memory slot each, and the prompt embedding of the observation
    to describe is added to the first input ([CLS]). So cross-attention learns to find the slot of
    the observation at hand, and Step 4 can keep f_I as it is and put the trained prefixes in the
    prompt's place. (With one slot, v_p^k alone, softmax over one key is 1: the cross-attention's
    Q and K would never learn, and a frozen decoder could not read a full study in Step 4.)"""

    def __init__(self, vocab: int, d: int, heads: int, dropout: float, positions: str, layers: int = 2):
        super().__init__()
        if positions not in ("none", "sinusoidal"):
            raise ValueError(f"--positions must be 'none' or 'sinusoidal', got {positions!r}")
        self.embed, self.positions = nn.Embedding(vocab, d), positions
        self.prompts = nn.Embedding(K, d)  # Step 3: one per observation
        # Step 2's flat soft targets (Eq. 4: a softmax of values in [0, 1]) at tau = 0.07 pull the
        # projections of all studies together (cosine ~0.9 on the synthetic set): what tells studies
        # apart is small against what they share, and a decoder reading them raw barely sees the
        # study. So f_I is standardised per slot and feature (BatchNorm without affine; running
        # statistics once frozen), and a learned embedding marks each slot. Paper silent.
        self.memory_norm = nn.BatchNorm1d(K * d, affine=False)
        self.slots = nn.Parameter(torch.randn(K, d))  # (14, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, dropout) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, f_I, prefix=None, head=None, cache: list | None = None, obs=None):
        """tokens (N, T), f_I (N, S, P), obs (N,) observations to describe or None -> logits (N, T, V)."""
        past = cache[0]["k"].shape[2] if cache and "k" in cache[0] else 0
        y = self.embed(tokens)  # (N, T, d): "only token embedding is adopted" (Sec. 3.3)
        if obs is not None and past == 0:
            y = torch.cat([y[:, :1] + self.prompts(obs)[:, None], y[:, 1:]], 1)  # prompt on the first input
        if self.positions == "sinusoidal":  # the other reading: Vaswani et al.'s encoding
            pos = torch.arange(past, past + tokens.shape[1], device=y.device)[:, None]
            freq = torch.exp(torch.arange(0, y.shape[-1], 2, device=y.device) * (-math.log(1e4) / y.shape[-1]))
            y = y + torch.stack([torch.sin(pos * freq), torch.cos(pos * freq)], -1).flatten(1)
        f_I = self.memory_norm(f_I.flatten(1)).view_as(f_I) + self.slots  # (N, 14, P)
        for i, layer in enumerate(self.layers):
            y = layer(y, f_I, None if prefix is None else prefix[i], None if cache is None else cache[i])
        return (head or self.head)(y)  # (N, T, V)


class Prefix(nn.Module):
    """P-Tuning v2 (Liu et al. 2022): in every layer, L_p trainable key and value vectors before
    the keys/values of both attentions, as if the decoder had already read L_p tokens. With the
    fresh output head these are Step 4's only trainable weights."""

    def __init__(self, layers: int, length: int, d: int):
        super().__init__()
        self.kv = nn.Parameter(torch.randn(layers, 2, 2, length, d) * 0.02)  # (layer, self/cross, key/value, L_p, d)

    def forward(self):
        return self.kv


class DCRRG(nn.Module):
    """All the model's parts; each step trains some of them (set_trainable) and saves all."""

    def __init__(self, args: Args, tokenizer):
        super().__init__()
        size = SIZES[args.model]
        self.tokenizer, self.max_text_tokens = tokenizer, args.max_text_tokens
        self.image_encoder = build_image_encoder(args.image_encoder or size["image"], args.pretrained)
        dropout = dict(hidden_dropout_prob=args.text_dropout, attention_probs_dropout_prob=args.text_dropout)
        if args.text_encoder:
            from transformers import AutoModel
            self.text_encoder = AutoModel.from_pretrained(args.text_encoder, **dropout)
        else:
            from transformers import BertConfig, BertModel
            self.text_encoder = BertModel(BertConfig(
                vocab_size=len(tokenizer), hidden_size=size["hidden"], num_attention_heads=size["heads"],
                num_hidden_layers=size["layers"], intermediate_size=4 * size["hidden"], pad_token_id=tokenizer.pad_token_id,
                **dropout), add_pooling_layer=False)
        D, M, P = self.image_encoder.dim, self.text_encoder.config.hidden_size, size["width"]
        self.f_v, self.f_t = ProjectionHead(D, P), ProjectionHead(M, P)  # Eq. 1b, 2b
        self.cls_v, self.cls_t = nn.Linear(P, 2), nn.Linear(P, 2)  # Step 1: negative/positive under each prompt
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # Eq. 7: 1 / tau, tau = 0.07 at first
        self.decoder = Decoder(len(tokenizer), P, size["dec_heads"], args.dropout, args.positions)
        self.prefix = Prefix(len(self.decoder.layers), args.prefix_len, P)
        self.prompt_head = nn.Linear(P, len(tokenizer))  # Step 4's "randomly-initialized classification head"

    def embed_images(self, images):
        return self.image_encoder(images)  # Eq. 1a: (B, V, C, H, W) -> v (B, D)

    def embed_texts(self, texts: list[str]):
        """Eq. 2a: reports -> t (B, M), the mean of the last hidden states over the word pieces
        (the paper does not say how; mean pooling learns faster from scratch than [CLS])."""
        return common.mean_pooled_bert_features(self.text_encoder, self.tokenizer, texts, self.logit_scale.device,
                                                self.max_text_tokens)

    def embed_records(self, records, modality: str, transform):
        """Eq. 1a / 2a of records: their images or their reports -> (B, D) or (B, M)."""
        if modality == "image":
            return self.embed_images(load_images(records, transform).to(self.logit_scale.device))
        return self.embed_texts([r.report for r in records])

    def heads(self, modality: str):
        """Eq. 1b / 2b's projection and Step 1's classifier of a modality."""
        return (self.f_v, self.cls_v) if modality == "image" else (self.f_t, self.cls_t)


def set_trainable(model: DCRRG, names: list[str]) -> list[nn.Parameter]:
    """Train only the named top-level parts; the others are frozen and in eval mode (no dropout,
    BatchNorm statistics untouched). Returns the trainable parameters."""
    for name, part in model.named_children():
        part.requires_grad_(name in names)
        part.train(name in names)
    model.logit_scale.requires_grad_("logit_scale" in names)
    return [p for p in model.parameters() if p.requires_grad]


# Step 2: calibrated semantic matching loss (Eq. 3-9) ---------------------------------------------
def label_vectors(labels: torch.Tensor) -> torch.Tensor:
    """(B, 14) 1/0/-1/NaN -> Eq. 3's label vectors: 1 for positive and uncertain, else 0 (paper silent)."""
    return ((labels == 1) | (labels == -1)).float()


def soft_targets(l_anchor, l_cand, x_cand):
    """Eq. 3-5: anchors i (e.g. images) against candidates j (their paired texts); x_cand (N, D)
    are the candidates' raw uni-modal embeddings (t of Eq. 2a, or v for Eq. 5). -> (N, N), row i a
    distribution over j. Targets carry no gradient."""
    # Eq. 3: s_ij = l_i . l_j / (|l_i| |l_j|)  (an all-zero label vector gives s = 0)
    s = F.normalize(l_anchor, dim=1) @ F.normalize(l_cand, dim=1).T
    # Eq. 4: w_ij = sim(t_i, t_j) / 2 + 0.5, the candidates' uni-modal similarity; Eq. 5 likewise
    # with images (its "sim(v_i, v_i)" is a typo for v_j, v_i)
    x = F.normalize(x_cand.detach().float(), dim=1)
    w = (x @ x.T) / 2 + 0.5
    return torch.softmax(w * s, dim=1)


def csm_loss(v_p, t_p, v, t, l_img, l_txt, logit_scale):
    """Eq. 6-9 for one batch of N pairs: v_p, t_p (N, P) projections under one prompt, v (N, D), t
    (N, M) raw embeddings, labels (N, 14). Cross-entropy summed over candidates, mean over anchors."""
    y_vt = soft_targets(l_img, l_txt, t)  # Eq. 4: image i over texts j
    y_tv = soft_targets(l_txt, l_img, v)  # Eq. 5: text j over images i
    # Eq. 6: s^_ij = v~_i . t~_j; Eq. 7: / tau. Eq. 7 writes the sum over i for both directions; we
    # normalise over the candidates of each direction, as CLIP and Eq. 4-5 do.
    s_hat = F.normalize(v_p, dim=1) @ F.normalize(t_p, dim=1).T  # (N, N)
    logits = s_hat.float() * logit_scale.clamp(max=math.log(100)).exp()  # 1/tau capped at 100 (CLIP's)
    # Eq. 8: L^{v->l} = -1/N sum_i sum_j y_ij log y^_ij, and L^{l->v} on the transpose
    loss_vl = -(y_vt * F.log_softmax(logits, dim=1)).sum(1).mean()
    loss_lv = -(y_tv * F.log_softmax(logits.T, dim=1)).sum(1).mean()
    # Eq. 9
    loss = (loss_vl + loss_lv) / 2
    entropy = -(y_vt * y_vt.clamp_min(1e-12).log()).sum(1).mean() - (y_tv * y_tv.clamp_min(1e-12).log()).sum(1).mean()
    return loss, {"tau": 1 / logit_scale.exp().item(), "kl": (loss - entropy / 2).item()}  # kl: loss above its floor


def gather_batch(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """(B, ...) on each rank -> (world_size * B, ...), ranks in order, the same on every rank, so
    Eq. 7's softmax runs over the whole global batch of candidates. The gradient flows into this
    rank's part only, times world_size: every rank computes the same global loss, and averaging
    their gradients (all_reduce_gradients) then gives each encoder weight exactly the
    single-process gradient, while tau, used after the gather, gets its own unscaled (CLIP's
    gather, made exact)."""
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(parts, x.detach().contiguous())
    parts[torch.distributed.get_rank()] = x + (x - x.detach()) * (world_size - 1)  # value x, gradient x world_size
    return torch.cat(parts)


# Decoding: Eq. 14 loss and beam search ---------------------------------------------------------
def lm_loss(decoder, f_I, texts: list[str], tokenizer, max_len: int, prefix=None, head=None, obs=None):
    """Eq. 14: -sum_t log p(y_t | y_<t, I), over the batch's target tokens ([SEP] ends each
    text) divided by their number. f_I (N, S, P), texts N strings."""
    pieces = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_len - 1)["input_ids"]
    seqs = [[tokenizer.cls_token_id] + p + [tokenizer.sep_token_id] for p in pieces]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    ids = ids.to(f_I.device)
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == tokenizer.pad_token_id, -100)  # (N, T-1)
    logits = decoder(ids[:, :-1], f_I, prefix, head, obs=obs)  # (N, T-1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


@torch.no_grad()
def beam_search(decoder, f_I, bos: int, eos: int, pad: int, beam: int, max_len: int, prefix=None, head=None, obs=None,
                banned=()):
    """Width-`beam` search (App. A) -> one token list per row of f_I (B, S, P), without BOS/EOS.
    Beams compete on summed log-probs; a finished beam keeps its score (it may only add padding at
    no cost); the answer is the beam with the best log-prob per token (paper silent on length).
    Tokens in `banned` (the special tokens other than EOS) are never emitted."""
    B, dev = f_I.shape[0], f_I.device
    f_I = f_I.repeat_interleave(beam, 0)  # (B*k, S, P)
    obs = None if obs is None else obs.repeat_interleave(beam, 0)
    tokens = torch.full((B * beam, 1), bos, dtype=torch.long, device=dev)
    scores = torch.full((B, beam), -math.inf, device=dev)
    scores[:, 0] = 0  # all beams start equal: expand the first only
    done = torch.zeros(B * beam, dtype=torch.bool, device=dev)
    length = torch.zeros(B * beam, device=dev)
    cache = [{} for _ in decoder.layers]
    step_in = tokens
    for _ in range(max_len):
        logp = F.log_softmax(decoder(step_in, f_I, prefix, head, cache, obs)[:, -1].float(), -1)  # (B*k, V)
        V = logp.shape[1]
        logp[:, list(banned)] = -math.inf
        logp[done] = -math.inf
        logp[done, pad] = 0.0
        scores, idx = (scores.view(-1, 1) + logp).view(B, beam * V).topk(beam, dim=1)  # (B, k)
        origin = (idx // V + torch.arange(B, device=dev)[:, None] * beam).flatten()  # (B*k,) beam continued
        tok = (idx % V).flatten()
        tokens = torch.cat([tokens[origin], tok[:, None]], 1)
        length = length[origin] + (~done[origin]).float()  # counts tokens up to and including EOS
        done = done[origin] | (tok == eos)
        for c in cache:
            c["k"], c["v"] = c["k"][origin], c["v"][origin]
        step_in = tok[:, None]
        if done.all():
            break
    best = (scores / length.view(B, beam)).argmax(1)  # (B,)
    rows = tokens.view(B, beam, -1)[torch.arange(B, device=dev), best, 1:].tolist()
    return [r[:r.index(eos)] if eos in r else r for r in rows]


# Evaluation: AUROC, retrieval, probes ------------------------------------------------------------
def auroc_per_observation(scores: np.ndarray, targets: np.ndarray) -> dict:
    """AUROC per observation over its labelled rows (NaN targets left out); observations whose
    labelled rows are all one class are skipped. "mean" over the rest."""
    from sklearn.metrics import roc_auc_score
    out = {}
    for k, name in enumerate(common.CHEXPERT_LABELS):
        m = ~np.isnan(targets[:, k])
        if 0 < targets[m, k].sum() < m.sum():
            out[name] = float(roc_auc_score(targets[m, k], scores[m, k]))
    out["mean"] = float(np.mean(list(out.values()))) if out else float("nan")
    return out


def retrieval_set(labels: np.ndarray, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """A 5 x N set built like CheXpert 5x200: studies positive for exactly one of the five
    classes, the first N of each class, N = min(per_class, the rarest class's count) so classes are
    balanced. -> (row indices, class of each)."""
    positive = labels[:, [common.LABEL_INDEX[c] for c in FIVE]] == 1  # (N, 5)
    only = positive.sum(1) == 1
    pools = [np.flatnonzero(only & positive[:, c]) for c in range(len(FIVE))]
    n = min([per_class] + [len(p) for p in pools])
    return np.concatenate([p[:n] for p in pools]), np.repeat(np.arange(len(FIVE)), n)


def precision_at_k(sim: torch.Tensor, query_cls, cand_cls, ks=(1, 2, 5, 10)) -> dict:
    """sim (Q, C) -> Precision@K: per query, the share of its K most similar candidates whose class
    is the query's, averaged over queries (ties: the lower candidate index first). A K above the
    C candidates has no Precision@K: it is left out, with a warning, and listed under "skipped"."""
    order = torch.argsort(sim, dim=1, descending=True, stable=True)  # (Q, C)
    hit = torch.as_tensor(cand_cls)[order] == torch.as_tensor(query_cls)[:, None]
    out = {f"P@{k}": hit[:, :k].float().mean().item() for k in ks if k <= sim.shape[1]}
    skipped = [f"P@{k}" for k in ks if k > sim.shape[1]]
    if skipped:
        common.log.warning("retrieval: %s skipped, only %d candidates", ", ".join(skipped), sim.shape[1])
        out["skipped"] = skipped
    return out


def load_images(records, transform) -> torch.Tensor:
    return torch.stack([common.ReportDataset([r], transform)[0]["images"] for r in records])  # (B, V, C, H, W)


@torch.no_grad()
def in_chunks(fn, records, batch: int = 64) -> torch.Tensor:
    """fn(list of records) -> (B, D), over all records in chunks, without gradients."""
    return torch.cat([fn(records[b:b + batch]) for b in range(0, len(records), batch)])


def probes(encoder: nn.Module, train, test, transform, args: Args, device) -> dict:
    """Sec. 4.4.3: per-observation AUROC on the test split of a linear classifier on frozen
    features (linear probe) and of encoder + linear head trained together (fine-tuning), with
    1 %, 10 % and 100 % of the training labels; targets as Step 1's (uncertain left out), masked
    binary cross-entropy. One run each (the paper averages five)."""
    y_train = torch.tensor(observation_targets(np.stack([r.labels for r in train])), dtype=torch.float32)
    y_test = observation_targets(np.stack([r.labels for r in test]))
    image_fn = lambda enc: lambda rs: enc(load_images(rs, transform).to(device))
    features = lambda enc, recs: in_chunks(image_fn(enc), recs).float()  # (N, D)
    encoder = encoder.eval()
    feats_train, feats_test = features(encoder, train), features(encoder, test)  # (N, D)
    out, rng = {}, np.random.default_rng(args.seed)
    for frac in (0.01, 0.1, 1.0):
        subset = rng.permutation(len(train))[:max(2, round(frac * len(train)))]
        for setting in ("linear", "finetune"):
            torch.manual_seed(args.seed)
            enc = copy.deepcopy(encoder).train() if setting == "finetune" else None
            head = nn.Linear(feats_train.shape[1], K).to(device)
            params = list(head.parameters()) + (list(enc.parameters()) if enc else [])
            opt = torch.optim.AdamW(params, lr=args.probe_lr, weight_decay=args.weight_decay)
            for _ in range(args.probe_steps):
                if enc:  # mini-batches through the encoder
                    rows = rng.choice(subset, size=min(args.batch_size, len(subset)), replace=False)
                    x = enc(load_images([train[i] for i in rows], transform).to(device))
                else:  # full batch of frozen features
                    rows, x = subset, feats_train[subset]
                y = y_train[rows].to(device)
                labelled = ~torch.isnan(y)
                loss = F.binary_cross_entropy_with_logits(head(x)[labelled], y[labelled])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            with torch.no_grad():
                x = features(enc.eval(), test) if enc else feats_test
                out[f"{setting}_{round(frac * 100)}%"] = auroc_per_observation(torch.sigmoid(head(x)).cpu().numpy(), y_test)
    return out


@torch.no_grad()
def retrieval(model: DCRRG, records, transform, per_class: int) -> dict:
    """Image-to-text retrieval on the 5 x N set: every image queries all 5N reports. Similarity:
    the mean over the 14 prompts of cos(v_p^k, t_p^k) (the query's class is unknown, and Step 2
    aligned every prompt)."""
    rows, classes = retrieval_set(np.stack([r.labels for r in records]), per_class)
    if len(rows) == 0:
        common.log.warning("retrieval skipped: some of the five classes has no test study positive for it alone")
        return {"n_per_class": 0}
    subset = [records[i] for i in rows]
    v_p, t_p = (F.normalize(model.heads(m)[0](in_chunks(lambda rs: model.embed_records(rs, m, transform), subset)), dim=-1)
                for m in MODALITIES)  # (5N, 14, P) each
    sim = torch.einsum("ikp,jkp->ij", v_p, t_p) / K  # (5N, 5N)
    return {"n_per_class": len(rows) // len(FIVE), **precision_at_k(sim, classes, classes)}


@torch.no_grad()
def generate(model: DCRRG, inputs_fn, records, args: Args, dist, max_len: int, **decoder_kw) -> list[str]:
    """Beam-search texts for `records` in their order; under torchrun each rank takes a strided
    shard and all get the full list. inputs_fn(records) -> {"f_I": (B, S, P)[, "obs": (B,)]}."""
    from tqdm.auto import tqdm
    tok, mine, texts = model.tokenizer, records[dist.rank::dist.world_size], []
    banned = [i for i in tok.all_special_ids if i != tok.sep_token_id]
    for b in tqdm(range(0, len(mine), 32), desc="beam search", disable=not dist.is_main):
        ids = beam_search(model.decoder, bos=tok.cls_token_id, eos=tok.sep_token_id, pad=tok.pad_token_id,
                          beam=args.beam, max_len=max_len, banned=banned, **inputs_fn(mine[b:b + 32]), **decoder_kw)
        # BERT's pre-tokenizer splits "plate-like" into three pieces that decode as "plate - like"
        texts += [re.sub(r"\s*-\s*", "-", t) for t in tok.batch_decode(ids, skip_special_tokens=True)]
    if dist.world_size == 1:
        return texts
    shards = [None] * dist.world_size
    torch.distributed.all_gather_object(shards, texts)
    out = [None] * len(records)
    for r, shard in enumerate(shards):
        out[r::dist.world_size] = shard
    return out


def description_records(records, labeler) -> list[common.Record]:
    """Step 3's examples: one Record per (study, observation its report mentions) whose report is
    that observation's description; meta keeps the observation and the study's full report."""
    out = []
    no_finding = [r.labels[NO_FINDING] == 1 for r in records]
    for r, desc in zip(records, observation_descriptions([r.report for r in records], labeler, no_finding)):
        out += [dataclasses.replace(r, id=f"{r.id}#{k}", report=d, meta={"obs": k, "study_report": r.report})
                for k, d in sorted(desc.items())]
    return out


def parameter_counts(model: DCRRG) -> dict:
    """Trainable parameters of Step 4 under P-Tuning (prefixes + fresh head) and under FFT (image
    encoder, its projection head and the decoder: Table 4's caption)."""
    count = lambda *parts: sum(p.numel() for part in parts for p in part.parameters())
    pt, fft = count(model.prefix, model.prompt_head), count(model.image_encoder, model.f_v, model.decoder)
    return {"pt": pt, "fft": fft, "pt_share_of_fft": pt / fft}


# The steps ---------------------------------------------------------------------------------------
def prepare(args: Args, dist, out: Path) -> dict:
    """What every step reads: the splits with the labeler's labels (the paper labels reports with
    the CheXpert labeler; stored labels are kept only for --extra-data records), the tokenizer,
    the image transform and each rank's share of the (global) batch sizes."""
    world = dist.world_size
    per_rank = {"batch_size": common.exact_div(args.batch_size, world, f"--batch-size over {world} processes"),
                "decoder_batch_size": common.exact_div(args.decoder_batch_size, world,
                                                       f"--decoder-batch-size over {world} processes")}
    labeler = common.make_labeler(args.labeler, args.chexbert_weights, dist.device)
    relabel = lambda recs: [dataclasses.replace(r, labels=l) for r, l in zip(recs, labeler([r.report for r in recs]))]
    data = {split: relabel(recs) for split, recs in common.load_data(args.data).items()}
    extra = []
    if args.extra_data:
        extra = common.load_annotation(args.extra_data, splits=("train",))["train"]
        unlabelled = [r for r in extra if r.labels is None]
        extra = [r for r in extra if r.labels is not None] + (relabel(unlabelled) if unlabelled else [])
    size = SIZES[args.model]
    channels = 1 if (args.image_encoder or size["image"]) == "cnn" else 3
    # No augmentation: R2Gen's random flip swaps left and right, which the reports name.
    transform = common.default_transform(size["image_size"], train=False, channels=channels)
    tokenizer = build_tokenizer(args, [r.report for r in data["train"] + extra], out, dist)
    return dict(data, extra=extra, labeler=labeler, transform=transform, tokenizer=tokenizer, dist=dist, **per_rank)


def weights_sha256(state: dict) -> str:
    """sha256 of a state dict's names and bytes: the same weights give the same digest."""
    h = hashlib.sha256()
    for k, v in state.items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fit(model: DCRRG, names, batches, loss_fn, total: int, folder: Path, args: Args, dist, desc: str, lr: float,
        resuming: bool) -> list[str]:
    """The loop every step shares: AdamW (App. A; constant lr, the paper names no schedule) on
    the named parts, gradients averaged over ranks, a log line every log_every steps, last.pt every
    ckpt_every steps (exact resume: batches(start) depends only on the step), model.pt at the end.
    Returns every rank's sha256 of its final weights (they must agree)."""
    params = set_trainable(model, names)
    # BatchNorm statistics of the trained parts (the decoder's memory_norm, a ResNet under FFT) see
    # each rank's batch: averaged after every step, so all ranks hold the same model
    buffers = [b for n in names if n != "logit_scale" for b in getattr(model, n).buffers() if b.is_floating_point()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    start = 0
    if resuming and (folder / "last.pt").is_file():
        start, _ = common.load_checkpoint(folder / "last.pt", model, optimizer)
        if start > total:
            raise ValueError(f"--resume: {folder / 'last.pt'} is at step {start}, past the {total} steps asked for")
    data = batches(start)
    with common.RunLog(folder, total, dist.is_main, start, desc=f"DCRRG {desc}") as runlog:
        for step in range(start, total):
            with common.autocast(dist.device, args.dtype):
                loss, stats = loss_fn(next(data))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            common.all_reduce_gradients(params, dist.world_size)
            optimizer.step()
            for b in buffers if dist.world_size > 1 else []:
                torch.distributed.all_reduce(b)
                b /= dist.world_size
            if (step + 1) % args.log_every == 0 or step + 1 == total:
                runlog.log(step + 1, **common.all_reduce_mean({"loss": loss.item(), **stats}))
            if (step + 1) % args.ckpt_every == 0 or step + 1 == total:
                common.save_checkpoint(folder / "last.pt", model, optimizer, step=step + 1, config=args)
    if dist.is_main:
        torch.save(model.state_dict(), folder / "model.pt")
    digests = [weights_sha256(model.state_dict())] * dist.world_size
    if dist.world_size > 1:
        torch.distributed.all_gather_object(digests, digests[0])  # filled in place, rank by rank
    if len(set(digests)) > 1:
        common.log.warning("%s: the ranks ended with different weights (sha256 %s)", desc, digests)
    return digests


def learning_rate(args: Args, stage: str) -> float:
    """--lr (--pt-lr for P-Tuning) when given, else the paper's 1e-4 (App. A). With --model tiny the
    parts trained from random init in a few hundred CPU steps take 1e-3 (Steps 1, 3, 4 FFT) and
    P-Tuning 5e-3 (P-Tuning v2's range); Step 2 keeps 1e-4: at 1e-3 the contrastive loss undoes
    much of Step 1 (retrieval P@1 0.46 against 0.80 on the synthetic set)."""
    pt = stage == "step4" and args.step4 == "pt"
    if pt and args.pt_lr:
        return args.pt_lr
    if args.lr or args.model != "tiny" or stage == "step2":
        return args.lr or 1e-4
    return 5e-3 if pt else 1e-3


def study_stream(records, per_rank: int, args: Args, env: dict):
    """batches(start) for fit: this rank's shard of the shuffled studies from step `start` on."""
    dist = env["dist"]
    return lambda start: (b for _, b in common.study_batches(records, per_rank, args.seed, dist.rank, dist.world_size,
                                                              start, env["transform"]))


def step1(model: DCRRG, args: Args, env: dict, train_parts) -> dict:
    """Sec. 3.1: each encoder learns alone on its modality's (sample, observation) pairs; then
    Table 6: AUROC of each observation's prediction on the test split."""
    dist, device, transform = env["dist"], env["dist"].device, env["transform"]
    pools = {m: env["train"] + [r for r in env["extra"] if args.extra_modality in ("both", m)] for m in MODALITIES}
    targets = {m: observation_targets(np.stack([r.labels for r in pools[m]])) for m in MODALITIES}
    weights = {m: pair_weights(targets[m], args.balance != "none") for m in MODALITIES}
    by_class = {m: pair_pools(targets[m]) for m in MODALITIES}
    mine = slice(dist.rank * env["batch_size"], (dist.rank + 1) * env["batch_size"])

    def batches(start):  # the global batch depends only on (seed, step), so a resumed run draws the same; ranks slice it
        for step in range(start, sys.maxsize):
            rng = np.random.default_rng([args.seed, step])
            if args.balance == "resample":  # B re-sampled (sample, observation) pairs
                yield {m: tuple(a[mine] for a in draw_pairs(by_class[m], args.batch_size, rng)) for m in MODALITIES}
            else:  # B samples, every prompt
                yield {m: (rng.integers(len(pools[m]), size=args.batch_size)[mine], None) for m in MODALITIES}

    def loss_fn(batch):
        loss, stats = 0.0, {}
        for m in MODALITIES:
            (f, cls), (rows, obs) = model.heads(m), batch[m]
            x = model.embed_records([pools[m][i] for i in rows], m, transform)  # Eq. 1a / 2a: (B, D)
            if obs is not None:  # Eq. 1b / 2b under each pair's prompt -> logits (B, 2)
                logits, y, w = cls(f(x, torch.as_tensor(obs, device=device))), targets[m][rows, obs], np.ones(len(rows))
            else:  # Eq. 1b / 2b under all 14 prompts -> logits (B, 14, 2)
                logits, y, w = cls(f(x)), targets[m][rows], weights[m][rows]
            y_t = torch.as_tensor(np.nan_to_num(y), device=device).long()
            ce = F.cross_entropy(logits.float().flatten(0, -2), y_t.flatten(), reduction="none").view(y_t.shape)
            loss_m = (torch.as_tensor(w, device=device, dtype=torch.float32) * ce).sum() / len(rows)
            loss = loss + loss_m
            hit = (logits.argmax(-1) == y_t).cpu().numpy()[~np.isnan(y)]
            stats[f"{m}_loss"], stats[f"{m}_acc"] = loss_m.item(), float(hit.mean())
        return loss, stats

    train_parts(["image_encoder", "f_v", "cls_v", "text_encoder", "f_t", "cls_t"], batches, loss_fn)
    results = {}
    if dist.is_main:
        model.eval()
        y = observation_targets(np.stack([r.labels for r in env["test"]]))
        for m in MODALITIES:
            f, cls = model.heads(m)
            with torch.no_grad():
                x = in_chunks(lambda rs: model.embed_records(rs, m, transform), env["test"])
                p = torch.softmax(cls(f(x)).float(), -1)[..., 1]  # (N, 14)
            results[f"auroc_{m}"] = auroc_per_observation(p.cpu().numpy(), y)
    return results


def step2(model: DCRRG, args: Args, env: dict, train_parts) -> dict:
    """Eq. 3-9: align the encoders on image-report pairs (DCCLIP); then retrieval P@K and the probes."""
    dist, device = env["dist"], env["dist"].device

    def loss_fn(batch):
        v, t = model.embed_images(batch["images"].to(device)), model.embed_texts(batch["report"])
        v_p, t_p = model.f_v(v), model.f_t(t)  # (B, 14, P): under every prompt
        l = label_vectors(batch["labels"]).to(device)  # paired data: l_img = l_txt
        # every rank scores the whole global batch: the same candidates as one process with that batch
        v_p, t_p, v, t, l = (gather_batch(x, dist.world_size) for x in (v_p, t_p, v, t, l))
        # The paper does not say which prompt feeds Eq. 6: we average the loss over all 14, so
        # every prompt's space is aligned (Steps 3-4 read them all).
        per_prompt = [csm_loss(v_p[:, k], t_p[:, k], v, t, l, l, model.logit_scale) for k in range(K)]
        loss = torch.stack([loss for loss, _ in per_prompt]).mean()
        return loss, {"tau": per_prompt[0][1]["tau"], "kl": float(np.mean([s["kl"] for _, s in per_prompt]))}

    train_parts(["image_encoder", "f_v", "text_encoder", "f_t", "logit_scale"],
                study_stream(env["train"], env["batch_size"], args, env), loss_fn)
    results = {}
    if dist.is_main:
        model.eval()
        results["retrieval"] = retrieval(model, env["test"], env["transform"], args.retrieval_per_class)
        if args.probes:  # DCCLIP's image encoder against the one Step 1 starts from (random or ImageNet)
            common.seed_everything(args.seed)
            start_encoder = build_image_encoder(args.image_encoder or SIZES[args.model]["image"], args.pretrained)
            results["probes"] = {name: probes(enc.to(device), env["train"], env["test"], env["transform"], args, device)
                                 for name, enc in (("dcclip", model.image_encoder), ("initial", start_encoder))}
    return results


def step3_inputs(model: DCRRG, images, rows, text_view: bool) -> dict:
    """Sec. 3.3: the study under all 14 prompts, v_p, and with the text view also t_p of its report
    (a second view of the image), with the observation each example describes. The encoders are
    frozen: the decoder learns from "given" representations. -> {"f_I": (B or 2B, 14, P), "obs": (B or 2B,)}"""
    device = model.logit_scale.device
    obs = torch.tensor([r.meta["obs"] for r in rows], device=device)
    with torch.no_grad():
        f_I = [model.f_v(model.embed_images(images.to(device)))]
        if text_view:
            f_I.append(model.f_t(model.embed_texts([r.meta["study_report"] for r in rows])))
    return {"f_I": torch.cat(f_I), "obs": obs.repeat(len(f_I))}


def step3(model: DCRRG, args: Args, env: dict, train_parts) -> dict:
    """Eq. 10-14: the decoder learns to write one observation's description; then the held-out
    description loss from each view, and Table 7-style example descriptions."""
    dist, tok, transform = env["dist"], env["tokenizer"], env["transform"]
    examples = description_records(env["train"], env["labeler"])
    by_id = {r.id: r for r in examples}

    def loss_fn(batch):
        inputs = step3_inputs(model, batch["images"], [by_id[i] for i in batch["id"]], args.text_view)
        texts = batch["report"] * (len(inputs["obs"]) // len(batch["id"]))
        return lm_loss(model.decoder, texts=texts, tokenizer=tok, max_len=args.max_description_tokens, **inputs), {}

    train_parts(["decoder"], study_stream(examples, env["decoder_batch_size"], args, env), loss_fn)
    results = {}
    if dist.is_main:
        model.eval()
        val_examples = description_records(env["val"], env["labeler"])
        for v, view in enumerate(MODALITIES):
            losses = []
            for b in range(0, len(val_examples), 64):
                chunk = val_examples[b:b + 64]
                inputs = step3_inputs(model, load_images(chunk, transform), chunk, True)
                half = slice(v * len(chunk), (v + 1) * len(chunk))  # image rows, then text rows
                with torch.no_grad():
                    losses.append(lm_loss(model.decoder, inputs["f_I"][half], [r.report for r in chunk], tok,
                                          args.max_description_tokens, obs=inputs["obs"][half]).item())
            results[f"val_loss_{view}_view"] = float(np.mean(losses))
        shown = val_examples[:24]
        texts = generate(model, lambda rs: step3_inputs(model, load_images(rs, transform), rs, False), shown,
                         args, dataclasses.replace(dist, rank=0, world_size=1), args.max_description_tokens)
        with open(env["folder"] / "descriptions_val.jsonl", "w") as f:
            f.writelines(json.dumps({"id": r.id, "observation": common.CHEXPERT_LABELS[r.meta["obs"]],
                                     "reference": r.report, "generated": g}) + "\n" for r, g in zip(shown, texts))
    return results


def step4(model: DCRRG, args: Args, env: dict, train_parts) -> dict:
    """Sec. 3.4: P-Tuning v2 (or --step4 fft) to write the full report; then NLG and CE metrics of
    the beam-searched test reports."""
    dist, tok, transform = env["dist"], env["tokenizer"], env["transform"]
    pt = args.step4 == "pt"
    decoder_kw = lambda: dict(prefix=model.prefix(), head=model.prompt_head) if pt else {}
    # f_I as in Step 3: the image under all 14 prompts; no observation prompt: the prefixes ask
    # for the full report
    f_I_fn = lambda images: model.f_v(model.embed_images(images.to(dist.device)))  # (B, 14, P)
    loss_fn = lambda batch: (lm_loss(model.decoder, f_I_fn(batch["images"]), batch["report"], tok,
                                     args.max_report_tokens, **decoder_kw()), {})
    # Sec. 3.4: P-Tuning trains the prefixes and the fresh head only; FFT the image side and the decoder
    train_parts(["prefix", "prompt_head"] if pt else ["image_encoder", "f_v", "decoder"],
                study_stream(env["train"], env["decoder_batch_size"], args, env), loss_fn)
    model.eval()
    records = env["test"][:args.n_test] if args.n_test else env["test"]
    texts = generate(model, lambda rs: {"f_I": f_I_fn(load_images(rs, transform))}, records, args, dist,
                     args.max_report_tokens, **decoder_kw())
    results = {"trainable_parameters": parameter_counts(model), "step4": args.step4}
    if dist.is_main:
        rows = [{"id": r.id, "reference": r.report, "generated": g} for r, g in zip(records, texts)]
        with open(env["folder"] / "generations_test.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        results.update(common.evaluate_generations(rows, env["labeler"], meteor="auto" if args.meteor else False))
    return results


STEPS = {"step1": step1, "step2": step2, "step3": step3, "step4": step4}
# flags a resumed step may change: its budget and logging, not what it trains (the init is checked by hash)
RESUMABLE = ("resume", "init", "out", "device", "log_every", "ckpt_every") + tuple(f"{s}_steps" for s in STAGES)
STEP_FILES = ("eval.json", "model.pt", "last.pt", "metrics.jsonl", "descriptions_val.jsonl", "generations_test.jsonl")


def run_step(stage: str, args: Args, env: dict, folder: Path, init: Path | None) -> dict:
    """Train one step into `folder` from init/model.pt (None: random weights), then evaluate what
    it made; returns (and writes to folder/eval.json) the results. With --resume a step continues
    its last.pt, or returns its finished eval.json, only if its config.json holds the same flags
    (budget and logging may change) and the same init weights (by sha256); a fresh start first
    removes the folder's old results, so nothing in it comes from another run."""
    dist, total = env["dist"], getattr(args, f"{stage}_steps")
    if init is not None and not (init / "model.pt").is_file():
        raise FileNotFoundError(f"{init / 'model.pt'} not found: run the step before {stage} first, "
                                f"or pass --init FOLDER (or --init scratch)")
    state = torch.load(init / "model.pt", map_location=dist.device, weights_only=True) if init else None
    config = {**common.config_dict(args), "stage": stage, "init": str(init) if init else "scratch",
              "init_sha256": weights_sha256(state) if init else None}
    resuming = args.resume and (folder / "config.json").is_file()
    if resuming:
        saved = json.loads((folder / "config.json").read_text())
        if saved.get("init_sha256") != config["init_sha256"]:
            raise ValueError(f"--resume: {folder} started from {saved.get('init')}/model.pt with sha256 "
                             f"{saved.get('init_sha256')}, but {config['init']}/model.pt now has {config['init_sha256']} "
                             f"(the step before was trained again): run {stage} without --resume")
        common.check_resume_config(folder, config, may_change=RESUMABLE)
        if (folder / "eval.json").is_file():
            done = json.loads((folder / "eval.json").read_text())
            if done["steps"] == total:
                return done  # finished before
    elif dist.is_main:
        for name in STEP_FILES:
            (folder / name).unlink(missing_ok=True)
    if dist.is_main:
        common.save_config(folder, config)
    common.seed_everything(args.seed)  # same initial weights on every rank
    model = DCRRG(args, env["tokenizer"]).to(dist.device)
    if state is not None:
        if stage == "step4":  # P-Tuning's prefixes and head start fresh (and may have another --prefix-len)
            state.update({k: v for k, v in model.state_dict().items() if k.startswith(("prefix.", "prompt_head."))})
        model.load_state_dict(state)
    common.broadcast_parameters(model)
    common.seed_everything(args.seed, dist.rank)  # ranks draw differently from here on
    lr = learning_rate(args, stage)
    results = {"init": config["init"], "init_sha256": config["init_sha256"], "steps": total, "lr": lr}

    def train_parts(names, batches, loss_fn):
        results["weights_sha256_per_rank"] = fit(model, names, batches, loss_fn, total, folder, args, dist,
                                                 stage + (f" ({args.step4})" if stage == "step4" else ""), lr, resuming)

    results.update(STEPS[stage](model, args, dict(env, folder=folder), train_parts))
    if dist.is_main:
        (folder / "eval.json").write_text(json.dumps(results, indent=2))
    return common.broadcast_object(results)


# Table 4: ablation on one budget and seed ---------------------------------------------------------
ABLATION = [  # (folder under out/ablation, step, folder it starts from, Step 4 mode)
    ("step1", "step1", None, None), ("step2", "step2", "step1", None), ("step3", "step3", "step2", None),
    ("step4_pt", "step4", "step3", "pt"),  # Model 6: Steps 1 + 2 + 3 + PT (DCRRG)
    ("step4_fft_no_step3", "step4", "step2", "fft"),  # Model 5: no Step 3, so FFT
    ("step2_no_step1", "step2", None, None), ("step3_no_step1", "step3", "step2_no_step1", None),
    ("step4_pt_no_step1", "step4", "step3_no_step1", "pt"),  # Model 3: no Step 1
    ("step4_fft", "step4", "step3", "fft"),  # Model 7: Steps 1 + 2 + 3 + FFT
]
ABLATION_ROWS = {  # Table 4 model: (its Step 2 folder, its Step 4 folder)
    "6 (Steps 1+2+3, PT: DCRRG)": ("step2", "step4_pt"), "3 (no Step 1)": ("step2_no_step1", "step4_pt_no_step1"),
    "5 (no Step 3, FFT)": ("step2", "step4_fft_no_step3"), "7 (Steps 1+2+3, FFT)": ("step2", "step4_fft")}


def ablation(args: Args, env: dict) -> dict:
    """Table 4's rows with the same steps, seed and budget; a step that rows share is trained once
    (Models 6 and 7 share Steps 1-3, Model 5 reuses Steps 1-2). Writes out/ablation/ablation.json."""
    out = Path(args.out) / "ablation"
    done = {}
    for folder, stage, init, mode in ABLATION:
        step_args = dataclasses.replace(args, step4=mode or args.step4)
        done[folder] = run_step(stage, step_args, env, out / folder, out / init if init else None)
    table = {}
    for name, (s2, s4) in ABLATION_ROWS.items():
        nlg, ce = done[s4]["nlg"], done[s4]["ce"]
        table[name] = {**{k: nlg[k] for k in ("BLEU-4", "METEOR", "ROUGE-L", "CIDEr") if k in nlg},
                       "CE P": ce["micro_precision"], "CE R": ce["micro_recall"], "CE F1": ce["micro_f1"],
                       "retrieval P@1": done[s2]["retrieval"].get("P@1", math.nan),
                       "retrieval P@5": done[s2]["retrieval"].get("P@5", math.nan),
                       "trainable": done[s4]["trainable_parameters"]["pt" if done[s4]["step4"] == "pt" else "fft"]}
    if env["dist"].is_main:
        (out / "ablation.json").write_text(json.dumps(table, indent=2))
        keys = list(next(iter(table.values())))
        print("model  " + "  ".join(keys))
        for name, row in table.items():
            print(f"{name}  " + "  ".join(f"{row[k]:.4g}" for k in keys))
    return table


def train(args: Args, stage: str = "all") -> dict:
    choices = {"model": (args.model, tuple(SIZES)), "step4": (args.step4, ("pt", "fft")),
               "balance": (args.balance, ("resample", "reweight", "none")),
               "extra-modality": (args.extra_modality, ("both", "image", "text"))}
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"--{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if args.dtype == "fp16":
        raise ValueError("--dtype fp16 cannot train here: fp16 gradients need loss scaling (a GradScaler), which "
                         "dcrrg.py does not have; use --dtype bf16 or fp32")
    if args.init is not None and stage not in STAGES:
        raise ValueError("--init is for a single step (dcrrg.py step2 --init FOLDER)")
    dist = common.setup_distributed(args.device)
    out = Path(args.out)
    if dist.is_main:
        common.save_config(out, args)
    env = prepare(args, dist, out)
    if stage == "ablation":
        results = ablation(args, env)
    else:
        results = {}
        for s in STAGES if stage == "all" else (stage,):
            previous = out / STAGES[STAGES.index(s) - 1] if s != "step1" else None
            init = None if args.init == "scratch" else Path(args.init) if args.init else previous
            results[s] = run_step(s, args, env, out / s, init)
        if dist.is_main and stage == "all":
            (out / "eval.json").write_text(json.dumps(results, indent=2))
    common.cleanup_distributed()
    return results


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    stage = argv.pop(0) if argv and not argv[0].startswith("-") else "all"
    if stage not in STAGES + ("all", "ablation"):
        raise SystemExit(f"error: unknown command {stage!r}; use step1, step2, step3, step4, all or ablation")
    train(common.parse_args(Args, argv, __doc__), stage)


if __name__ == "__main__":
    main()
