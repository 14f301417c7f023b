"""DCRRG: divide-and-conquer radiology report generation, in four steps.

Paper: "Divide and Conquer Radiology Report Generation via Observation Level Fine-grained Pretraining
and Prompt Tuning" (Yuanpin Zhou, Huogen Wang; EMNLP 2024; no arXiv version). Step 1 trains an image and a text
encoder, each alone, to predict one of the 14 CheXpert observations' label under its one-hot prompt (so each is
balanced alone); Step 2 aligns them contrastively with calibrated soft targets ("DCCLIP"); Step 3 trains a decoder
to write one observation's description; Step 4 learns P-Tuning v2 prefixes and a fresh head to write the report.

    python dcrrg.py                  # = dcrrg.py all: synthetic set, tiny sizes, 4 steps + evaluation
    python dcrrg.py step3 --resume   # one step, from out/step2/model.pt
    python dcrrg.py ablation         # Table 4's Models 1-7 -> out/ablation/ablation.json: 12 CPU-min a seed

Equations, and where they are implemented:
    Sec. 3.1    targets: unmentioned negative, uncertain out;  observation_targets, draw_pairs (re-sampling),
                per-observation balancing                      pair_weights (its expected loss); step1_loss, step1
    Eq. 1a, 2a  v = E_img(x_img), t = E_txt(x_txt)            DCRRG.embed_images, DCRRG.embed_texts
    Eq. 1b, 2b  v_p = f_v(concat(v, e_prompt)), t_p likewise  ProjectionHead
    Eq. 3-5     soft targets s, calibrated y^{v->t}, y^{t->v}  soft_targets
    Eq. 6-9     calibrated semantic matching loss              csm_loss, step2_loss (over the global batch), step2
    Sec. 3.3    observation descriptions from sentences        split_sentences, assign_sentences, description_records
    Eq. 10-12   post-LN decoder layer (MMHA, CA, FFN)          DecoderLayer, Attention
    Eq. 13-14   autoregressive decoder, token cross-entropy    Decoder, lm_loss; Step 3: step3_inputs, step3
    Sec. 3.4    P-Tuning v2 prefixes + fresh output head       DCRRG.prefix, step4
    App. A      beam search of width 3                         beam_search
    Sec. 4.4.2  P@K retrieval on 5 x N; Table 6 AUROC          retrieval, auroc_per_observation; Table 4: ablation()
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import common


@dataclasses.dataclass
class Args(common.RunArgs):
    out: str | None = None
    """the run's folder: one sub-folder per step (step1 .. step4, ablation/...); None: runs/dcrrg-<data name>"""
    model: Literal["tiny", "paper"] = "tiny"
    """tiny: small CNN, BERT-Tiny shape, width 128 (CPU); paper: ResNet-50, BERT 512/8 heads (App. A)"""
    pretrained: str = "imagenet"
    """--model paper: the ResNet-50's start, "imagenet" (App. A: torchvision's weights, downloaded once), "none"
    (random) or a state-dict file"""
    text_encoder: str | None = None
    """HF id or folder (App. A: emilyalsentzer/Bio_ClinicalBERT, as it is: 768 / 12 heads); None: with the sandbox's
    foundation (--tiny-start) its BERT, pre-trained on report text without labels, else a random BERT (paper: 512
    hidden, 8 heads) on our vocabulary"""
    extra_data: str | None = None
    """annotation.json whose train records join Step 1 only (Tables 1 and 5: CheXpert)"""
    lr: Annotated[float | None, "[0, 1]"] = None
    """AdamW lr of every step; None: 1e-4 (App. A); --model tiny: see fit()"""
    batch_size: Annotated[int, "[1, inf)"] = 32
    """Steps 1-2, over all ranks (App. A)"""
    decoder_batch_size: Annotated[int, "[1, inf)"] = 16
    """Steps 3-4, over all ranks (App. A)"""
    balance: Literal["resample", "reweight", "none"] | None = None
    """Step 1 (Sec. 3.1); None: resample (paper) with --model paper, reweight (same expected loss) with tiny"""
    step1_steps: Annotated[int | None, "[0, inf)"] = None
    """Step 1's steps; None: 300 with --model tiny, 10 epochs of the training (and --extra-data) studies with paper
    (ours)"""
    step2_steps: Annotated[int | None, "[0, inf)"] = None
    """Step 2's steps; None: 200 with --model tiny, 10 epochs of the training studies with paper (ours)"""
    step3_steps: Annotated[int | None, "[0, inf)"] = None
    """Step 3's steps; None: 600 with --model tiny, 10 epochs of the descriptions with paper (ours)"""
    step4_steps: Annotated[int | None, "[0, inf)"] = None
    """Step 4's steps; None: 400 with --model tiny, 10 epochs of the training studies with paper (ours)"""
    step4: Literal["pt", "fft"] = "pt"
    """pt: P-Tuning v2 (Sec. 3.4); fft: fine-tune image encoder and decoder (Table 4)"""
    prefix_len: Annotated[int, "[1, inf)"] = 16
    """P-Tuning v2 prefix length per attention (paper silent)"""
    n_test: Annotated[int | None, "[1, inf)"] = None
    """Step 4's test studies; None: all, --model tiny: 200 (beam search has no key/value cache)"""


SIZES = {  # --model: image size, random text BERT (hidden, heads, layers), width P of projections and decoder
    "tiny": dict(image_size=64, hidden=128, heads=2, layers=2, width=128, dec_heads=4),  # BERT-Tiny's shape
    "paper": dict(image_size=224, hidden=512, heads=8, layers=8, width=512, dec_heads=8),
}  # App. A; 8 layers: ours
K = len(common.CHEXPERT_LABELS)  # 14 observations = 14 prompts
NO_FINDING = common.LABEL_INDEX["No Finding"]
FIVE = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion"]  # CheXpert's 5 tasks, 5x200
MODALITIES = ("image", "text")
WEIGHT_DECAY, BEAM = 1e-6, 3  # App. A
DROPOUT = 0.1  # decoder and text encoder (paper silent: Vaswani et al.'s and BERT's)
MAX_TEXT_TOKENS, MAX_DESCRIPTION_TOKENS, MAX_REPORT_TOKENS = 256, 48, 128  # word pieces read / Step 3 / Step 4 (ours)
VOCAB_SIZE = 8000  # offline tokenizer: words kept whole, the rest become characters (ours)
RETRIEVAL_PER_CLASS = 200  # CheXpert 5x200's N
CE = dict(headline="micro_f1", uncertain_as=0)  # Sec. 4.2: micro CE P/R/F1 of labels' positives (R2Gen's)
# No schedule in the paper (ours): --model tiny's steps (its default run: ~160 CPU-s), --model paper's epochs
TINY_STEPS = dict(step1=300, step2=200, step3=600, step4=400)
EPOCHS = 10


# Sec. 3.1 and 3.3: targets ----------------------------------------------------------------------
def observation_targets(labels: np.ndarray) -> np.ndarray:
    """(N, 14) labels 1/0/-1/NaN -> 1 positive, 0 negative or unmentioned ("treat unmentioned labels as
    negative"), NaN uncertain ("exclude data with uncertain labels")."""
    return np.where(labels == 1, 1.0, np.where(labels == -1, np.nan, 0.0))


def draw_pairs(targets: np.ndarray, n: int, rng: np.random.Generator):
    """Sec. 3.1's re-sampling: n (sample, observation) pairs: an observation (uniform among those with labels),
    a class (1/2 each; an observation with one class: that one), a sample of it. -> rows (n,), observations (n,)."""
    obs, cls = rng.choice(np.flatnonzero((~np.isnan(targets)).any(0)), size=n), rng.integers(2, size=n)
    pools = [np.flatnonzero(targets[:, k] == c) for k, c in zip(obs, cls)]
    pools = [p if len(p) else np.flatnonzero(targets[:, k] == 1 - c) for p, k, c in zip(pools, obs, cls)]
    return np.array([p[rng.integers(len(p))] for p in pools], dtype=np.int64), obs


def pair_weights(targets: np.ndarray, balance: bool) -> np.ndarray:
    """(N, 14) weights for B uniform samples under all 14 prompts, loss sum(weight * CE) / B. Balanced: N / (2 K' n_kc)
    for class c of k (n_kc samples, K' labelled observations), draw_pairs' expected loss; else the plain mean."""
    labelled = ~np.isnan(targets)
    if not balance:
        return labelled / labelled.sum(1).mean()
    n = np.stack([(targets == 0).sum(0), (targets == 1).sum(0)])  # (2, 14): samples of each class
    classes = (n > 0).sum(0)  # (14,): 2, or 1 when an observation has one class (it takes all the mass)
    w = len(targets) / ((classes > 0).sum() * np.maximum(classes, 1) * np.maximum(n, 1))  # (2, 14): w[c, k]
    return np.where(labelled, w[np.nan_to_num(targets).astype(int), np.arange(K)], 0.0)


HEADER = re.compile(
    r"\b(?:[A-Z][A-Z ]*[A-Z]|(?i:findings|impression|comparison|indication|history|technique|"
    r"examination|conclusions?))\s*:"
)  # "FINDINGS:", "Impression:"
LIST_MARKER = re.compile(r"^(?:\d{1,2}[.)]|[-*\u2022])\s+")  # "1. ", "2) ", "- "


def split_sentences(report: str) -> list[str]:
    """Sentences end at . ! ? before a space, a line break or a header; list markers and letterless parts go."""
    parts = re.split(r"(?<=[.!?])\s+|\n+", HEADER.sub("\n", report))
    return [s for s in (LIST_MARKER.sub("", p.strip()).strip() for p in parts) if re.search("[A-Za-z]", s)]


def assign_sentences(sentences: list[str], labels: np.ndarray, no_finding: bool) -> dict[int, str]:
    """Sec. 3.3 (paper silent on how): a sentence goes to each of the 13 findings the labeler finds in it; one naming
    none to No Finding if the study's No Finding is 1, else it is dropped. -> {observation: description}."""
    out: dict[int, str] = {}
    for sentence, row in zip(sentences, labels):
        found = [k for k in range(K) if k != NO_FINDING and not np.isnan(row[k])]
        for k in found or ([NO_FINDING] if no_finding else []):
            out[k] = f"{out[k]} {sentence}" if k in out else sentence
    return out


def description_records(records, labeler) -> list[common.Record]:
    """Step 3's examples: a Record per (study, observation described), report = the description."""
    sentences = [split_sentences(r.report) for r in records]
    labels, ends = labeler([s for ss in sentences for s in ss]), np.cumsum([len(ss) for ss in sentences])  # all at once
    return [
        dataclasses.replace(r, id=f"{r.id}#{k}", report=d, meta={"obs": k, "study_report": r.report})
        for r, ss, end in zip(records, sentences, ends)
        for k, d in sorted(assign_sentences(ss, labels[end - len(ss) : end], r.labels[NO_FINDING] == 1).items())
    ]


# Step 1: encoders with prompts (Eq. 1-2), per-observation classification ---------------------------
class ProjectionHead(nn.Module):
    """Eq. 1b / 2b: f(concat(x, e_prompt)), f not given: LayerNorm, Linear to 4P, GELU, Linear to P (a linear f makes
    the prompt a shift the classifier cannot use); prompt weights start at unit scale (else ~sqrt(D) times weaker)."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim + K, 4 * width), nn.Linear(4 * width, width)
        nn.init.normal_(self.fc1.weight[:, dim:])

    def forward(self, x):  # x (B, D) -> (B, 14, P): under every prompt
        e = torch.eye(K, dtype=x.dtype, device=x.device).expand(len(x), K, K)  # (B, 14, 14) one-hot prompts
        return self.fc2(F.gelu(self.fc1(torch.cat([self.norm(x)[:, None].expand(-1, K, -1), e], -1))))  # (B, 14, P)


class DCRRG(nn.Module):
    """All the parts: each step trains some (set_trainable) and saves all."""

    def __init__(self, args: Args, tokenizer, foundation=None):
        super().__init__()
        size = SIZES[args.model]
        self.tokenizer = tokenizer
        # Eq. 1a's E_img, averaged over a study's views: ResNet-50's pooled 2048-d feature (App. A); --model tiny: the
        # sandbox foundation's image side (ImageNet's stand-in, `foundation`), or a random small CNN
        if args.model == "tiny" and foundation is not None:
            vlm = common.load_policy(foundation / "vlm").model
            self.image_encoder = common.ViewMean(common.sandbox().FoundationImageEncoder(vlm))
        elif args.model == "tiny":
            self.image_encoder = common.ViewMean(common.SmallCNN())
        else:
            weights = None if args.pretrained == "none" else args.pretrained
            self.image_encoder = common.resnet_encoder(50, weights, "--pretrained")
        from transformers import AutoModel, BertConfig, BertModel

        dropout = dict(hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
        if args.text_encoder:
            self.text_encoder = AutoModel.from_pretrained(args.text_encoder, **dropout)
        else:
            hidden = size["hidden"]
            shape = dict(hidden_size=hidden, num_attention_heads=size["heads"], num_hidden_layers=size["layers"])
            config = BertConfig(vocab_size=len(tokenizer), intermediate_size=4 * hidden, **shape, **dropout)
            self.text_encoder = BertModel(config, add_pooling_layer=False)
        D, M, P = self.image_encoder.dim, self.text_encoder.config.hidden_size, size["width"]
        self.f_v, self.f_t = ProjectionHead(D, P), ProjectionHead(M, P)  # Eq. 1b, 2b
        self.cls_v, self.cls_t = nn.Linear(P, 2), nn.Linear(P, 2)  # Step 1: negative/positive under any prompt
        self.heads = {"image": (self.f_v, self.cls_v), "text": (self.f_t, self.cls_t)}  # projection, classifier
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # Eq. 7: 1 / tau, tau = 0.07 at first
        self.decoder = Decoder(len(tokenizer), P, size["dec_heads"], DROPOUT)
        # Step 4, P-Tuning v2 (Liu et al. 2022, arXiv:2110.07602): in every layer, L_p trainable keys and values
        # before those of both attentions, and a "randomly-initialized classification head"
        self.prefix = nn.Parameter(torch.randn(len(self.decoder.layers), 2, 2, args.prefix_len, P) * 0.02)
        self.prompt_head = nn.Linear(P, len(tokenizer))

    def forward(self, loss_fn, batch):
        """A training step's loss, loss_fn(self, batch): each step of the paper has its own, and this is the forward
        that DistributedDataParallel runs (common.data_parallel) to average the step's gradients over ranks."""
        return loss_fn(self, batch)

    def embed_images(self, images):  # Eq. 1a: (B, V, C, H, W) -> v (B, D)
        return self.image_encoder(images.to(self.logit_scale.device))

    def embed_texts(self, texts: list[str]):
        """Eq. 2a: t (B, M), the mean of the last hidden states (paper silent)."""
        device = self.logit_scale.device
        return common.mean_pooled_bert_features(self.text_encoder, self.tokenizer, texts, device, MAX_TEXT_TOKENS)

    def embed(self, records, modality: str, transform):  # Eq. 1a / 2a of records -> (B, D) or (B, M)
        if modality == "image":
            return self.embed_images(load_images(records, transform))
        return self.embed_texts([r.report for r in records])

    @torch.no_grad()
    def project(self, records, modality: str, transform):  # Eq. 1 / 2 of records, 64 at a time -> (N, 14, P)
        f = self.heads[modality][0]
        return torch.cat([f(self.embed(records[b : b + 64], modality, transform)) for b in range(0, len(records), 64)])


def build_tokenizer(args: Args, reports: list[str], run):
    """--text-encoder's tokenizer, else out/tokenizer/vocab.txt: the most frequent words of the training reports
    and every character alone and as ##continuation (`tokenizers`' trainer breaks ties in hash order). Made at every
    start: once a step of the folder has trained (a .pt file), other reports (other token ids) are an error."""
    from transformers import AutoTokenizer, BertTokenizerFast

    if args.text_encoder:
        return AutoTokenizer.from_pretrained(args.text_encoder)
    path = run.out / "tokenizer" / "vocab.txt"
    problem = None
    if run.is_main:
        counts = Counter(w for r in reports for w in re.findall(r"\w+|[^\w\s]", r.lower()))
        words = sorted(counts, key=lambda w: (-counts[w], w))[:VOCAB_SIZE]
        chars = sorted({c for w in counts for c in w})
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        vocab = "\n".join(dict.fromkeys(specials + chars + ["##" + c for c in chars] + words)) + "\n"
        if path.is_file() and path.read_text() != vocab and any(run.out.rglob("*.pt")):
            problem = (
                f"{path} was made from other training reports than those of --data {args.data}: {run.out} holds "
                "a run on other data; give another --out"
            )
        else:  # new, the same, or left by a start that trained nothing
            run.write("tokenizer/vocab.txt", vocab)
    problem = common.broadcast_object(problem)  # the other ranks read the file once it is there
    if problem:
        raise ValueError(problem)
    return BertTokenizerFast.from_pretrained(str(path.parent))


def step1_loss(model: DCRRG, batch, records, targets, weights, transform):
    """Sec. 3.1: per modality, the CE of each pair's label under its observation's prompt. batch: per modality
    (rows, observations) of re-sampled pairs, or (rows, None): samples under all 14 prompts, pair_weights."""
    device = model.logit_scale.device
    loss, stats = 0.0, {}
    for m in MODALITIES:
        f, cls = model.heads[m]
        rows, obs = batch[m]
        logits = cls(f(model.embed([records[i] for i in rows], m, transform)))  # Eq. 1-2: (B, 14, 2), every prompt
        if obs is None:
            y, w = targets[rows], weights[rows]
        else:  # each pair under its own observation's prompt: (B, 2)
            y, w = targets[rows, obs], np.ones(len(rows))
            logits = logits[torch.arange(len(rows)), torch.as_tensor(obs)]
        y_t = torch.as_tensor(np.nan_to_num(y), device=device).long()
        ce = F.cross_entropy(logits.float().flatten(0, -2), y_t.flatten(), reduction="none").view(y_t.shape)
        loss_m = (torch.as_tensor(w, device=device, dtype=torch.float32) * ce).sum() / len(rows)
        loss = loss + loss_m
        stats[f"{m}_loss"] = loss_m.item()
        stats[f"{m}_acc"] = float((logits.argmax(-1) == y_t).cpu().numpy()[~np.isnan(y)].mean())
    return loss, stats


def step1(run, args: Args, env: dict, name: str, init: str | None) -> dict:
    """Sec. 3.1: each encoder learns alone on its modality's (sample, observation) pairs (--extra-data joins
    both: common's loader needs a report per record); then Table 6: AUROC of each observation."""
    balance = args.balance or ("resample" if args.model == "paper" else "reweight")
    records = env["train"] + env["extra"]
    targets = observation_targets(np.stack([r.labels for r in records]))
    weights = pair_weights(targets, balance != "none")
    n = run.per_rank(args.batch_size, "--batch-size")

    def batches(start):
        """The global batch depends on (seed, step) only, so a resumed run draws the same; ranks slice it."""
        for step in range(start, 1 << 62):
            rng = np.random.default_rng([args.seed, step])
            mine = slice(run.rank * n, (run.rank + 1) * n)
            batch = {}
            for m in MODALITIES:  # each modality its own draw
                if balance == "resample":
                    batch[m] = tuple(a[mine] for a in draw_pairs(targets, args.batch_size, rng))
                else:
                    batch[m] = (rng.integers(len(records), size=args.batch_size)[mine], None)
            yield batch

    def loss_fn(model, batch):
        return step1_loss(model, batch, records, targets, weights, env["transform"])

    def evaluate(model, st):
        y = observation_targets(np.stack([r.labels for r in env["test"]]))
        out = {"balance": balance}
        for m in MODALITIES:
            logits = model.heads[m][1](model.project(env["test"], m, env["transform"]))  # (N, 14, 2): Table 6
            out[f"auroc_{m}"] = auroc_per_observation(torch.softmax(logits.float(), -1)[..., 1].cpu().numpy(), y)
        return out

    parts = ["image_encoder", "f_v", "cls_v", "text_encoder", "f_t", "cls_t"]
    return fit(run, args, env, name, init, "step1", len(records), parts, batches, loss_fn, evaluate)


# Step 2: calibrated semantic matching loss (Eq. 3-9) and its loop ---------------------------------
def soft_targets(l_anchor, l_cand, x_cand):
    """Eq. 3-5 -> (N, N): row i a distribution over candidates j (no gradient); x_cand (N, D): their raw embeddings."""
    # Eq. 3: s_ij = l_i . l_j / (|l_i| |l_j|)  (an all-zero label vector gives s = 0)
    s = F.normalize(l_anchor, dim=1) @ F.normalize(l_cand, dim=1).T
    # Eq. 4: w_ij = sim(t_i, t_j) / 2 + 0.5; Eq. 5 likewise with images (its "sim(v_i, v_i)" read as v_j, v_i)
    x = F.normalize(x_cand.detach().float(), dim=1)
    w = (x @ x.T) / 2 + 0.5
    return torch.softmax(w * s, dim=1)  # Eq. 4 / 5: y_ij = exp(w_ij s_ij) / sum_j exp(w_ij s_ij)


def csm_loss(v_p, t_p, v, t, l_img, l_txt, logit_scale):
    """Eq. 6-9: v_p, t_p (N, P) under one prompt, v (N, D), t (N, M), labels (N, 14); CE summed over j, mean over i."""
    y_vt = soft_targets(l_img, l_txt, t)  # Eq. 4: image i over texts j
    y_tv = soft_targets(l_txt, l_img, v)  # Eq. 5: text j over images i
    # Eq. 6: s^_ij = v~_i . t~_j; Eq. 7: softmax of s^ / tau. Eq. 7 sums over i in both directions; we
    # normalise over the candidates of each direction, as CLIP and Eq. 4-5 do.
    s_hat = F.normalize(v_p, dim=1) @ F.normalize(t_p, dim=1).T  # (N, N)
    logits = s_hat.float() * logit_scale.clamp(max=math.log(100)).exp()  # 1/tau capped at 100 (CLIP's)
    # Eq. 8: L^{v->l} = -1/N sum_i sum_j y_ij log y^_ij, and L^{l->v} on the transpose
    loss_vl = -(y_vt * F.log_softmax(logits, dim=1)).sum(1).mean()
    loss_lv = -(y_tv * F.log_softmax(logits.T, dim=1)).sum(1).mean()
    return (loss_vl + loss_lv) / 2, {"tau": 1 / logit_scale.exp().item()}  # Eq. 9


def gather_batch(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """(B, ...) on each rank -> (world_size * B, ...) in rank order, on every rank. The gradient reaches this rank's
    part only, times world_size: every rank computes the same loss, so DDP's average gives one process's."""
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(parts, x.detach().contiguous())
    parts[torch.distributed.get_rank()] = x + (x - x.detach()) * (world_size - 1)  # value x, gradient x world_size
    return torch.cat(parts)


def step2_loss(model: DCRRG, batch, world_size: int):
    """Eq. 1-2 then Eq. 3-9 on the global batch of image-report pairs (every rank gathers all candidates)."""
    v, t = model.embed_images(batch["images"]), model.embed_texts(batch["report"])  # Eq. 1a, 2a
    v_p, t_p = model.f_v(v), model.f_t(t)  # Eq. 1b, 2b: (B, 14, P), under every prompt
    # Eq. 3's l: positive, uncertain (paper silent); l_img = l_txt
    l = ((batch["labels"] == 1) | (batch["labels"] == -1)).float().to(v.device)
    v_p, t_p, v, t, l = (gather_batch(x, world_size) for x in (v_p, t_p, v, t, l))
    # Which prompt feeds Eq. 6 is not said: the loss is averaged over all 14, so each is aligned (Steps 3-4 read all)
    per_prompt = [csm_loss(v_p[:, k], t_p[:, k], v, t, l, l, model.logit_scale) for k in range(K)]
    return torch.stack([loss for loss, _ in per_prompt]).mean(), per_prompt[0][1]


def step2(run, args: Args, env: dict, name: str, init: str | None) -> dict:
    """Eq. 3-9: align the encoders on image-report pairs (DCCLIP); then retrieval P@K (Table 2)."""

    def loss_fn(model, batch):
        return step2_loss(model, batch, run.world_size)

    def evaluate(model, st):
        found = retrieval(model, env["test"], env["transform"])
        if st.is_main and found["skipped"]:
            common.log.warning(
                "Step 2 retrieval skips %s (no test study positive for it alone): %s",
                ", ".join(found["skipped"]),
                "P@K over the other classes" if "P@1" in found else "no P@K (under two classes)",
            )
        return {"retrieval": found}

    parts = ["image_encoder", "f_v", "text_encoder", "f_t", "logit_scale"]
    batches = run.study_batches(env["train"], args.batch_size, "--batch-size", env["transform"])
    return fit(run, args, env, name, init, "step2", len(env["train"]), parts, batches, loss_fn, evaluate)


# The decoder (Eq. 10-14) --------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention (Eq. 11-12's MMHA and CA); keys and values may start with P-Tuning v2 prefixes."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.dropout = heads, dropout

    def forward(self, x, source, causal: bool, prefix=None):
        B, T, d = x.shape

        def split(z):  # (B, S, d) -> (B, heads, S, d / heads)
            return z.reshape(B, -1, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(source)), split(self.v(source))
        if prefix is not None:  # prefix (2, L_p, d): keys and values every position sees
            k = torch.cat([split(prefix[0].expand(B, -1, -1)), k], 2)
            v = torch.cat([split(prefix[1].expand(B, -1, -1)), v], 2)
        mask = None
        if causal:  # query i sees the prefix and the keys up to i
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.o(out.transpose(1, 2).reshape(B, T, d))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(d, heads, dropout), Attention(d, heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(4 * d, d))
        self.ln1, self.ln2, self.ln3, self.drop = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d), nn.Dropout(dropout)

    def forward(self, y, f_I, prefix=None):  # prefix (2, 2, L_p, d): self- and cross-attention keys/values, or None
        # Eq. 12: e_attn = LN(MMHA(y) + y)
        e_attn = self.ln1(y + self.drop(self.self_attn(y, y, True, None if prefix is None else prefix[0])))
        # Eq. 11: e_ca = LN(CA(e_attn, f_I) + e_attn), Q from e_attn, K and V from f_I
        e_ca = self.ln2(e_attn + self.drop(self.cross_attn(e_attn, f_I, False, None if prefix is None else prefix[1])))
        return self.ln3(e_ca + self.drop(self.ffn(e_ca)))  # Eq. 10: f_d(y) = LN(FFN(e_ca) + e_ca)


class Decoder(nn.Module):
    """Two post-LN layers over token embeddings (Sec. 3.3), cross-attending to f_I (N, 14, P), then a linear head
    (Eq. 13: p(T|I) = prod_t p(y_t | y_<t, I)). Paper silent: f_I is the study under all 14 prompts, a slot each (with
    v_p^k alone, softmax over one key is 1: cross-attention never learns); Step 3 adds the observation's prompt
    embedding to the first input. Step 2 pulls all projections together (cosine ~0.9): standardise_memory fixes f_I's
    statistics per slot and feature (BatchNorm's would differ in Step 3's image + text batches)."""

    def __init__(self, vocab: int, d: int, heads: int, dropout: float, layers: int = 2):
        super().__init__()
        self.embed, self.prompts = nn.Embedding(vocab, d), nn.Embedding(K, d)  # prompts: Step 3, one per observation
        self.register_buffer("memory_mean", torch.zeros(K, d))
        self.register_buffer("memory_std", torch.ones(K, d))
        self.slots = nn.Parameter(torch.randn(K, d))  # (14, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, dropout) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, f_I, prefix=None, head=None, obs=None):
        """tokens (N, T), f_I (N, 14, P), obs (N,) observations to describe or None -> logits (N, T, V)."""
        y = self.embed(tokens)  # (N, T, d)
        if obs is not None:
            y = torch.cat([y[:, :1] + self.prompts(obs)[:, None], y[:, 1:]], 1)  # the prompt on the first input
        f_I = (f_I - self.memory_mean) / self.memory_std + self.slots  # (N, 14, P)
        for i, layer in enumerate(self.layers):
            y = layer(y, f_I, None if prefix is None else prefix[i])
        return (head or self.head)(y)  # (N, T, V)


@torch.no_grad()
def standardise_memory(model: DCRRG, records, transform):
    """The decoder's fixed f_I mean and std per slot and feature, from the first 512 training images."""
    f = model.project(records[:512], "image", transform)  # (N, 14, P)
    model.decoder.memory_mean.copy_(f.mean(0))
    model.decoder.memory_std.copy_(f.std(0) + 1e-5)


def lm_loss(decoder, f_I, texts: list[str], tokenizer, max_len: int, prefix=None, head=None, obs=None):
    """Eq. 14: -sum_t log p(y_t | y_<t, I) over the batch's tokens ([SEP] ends each text) / their number."""
    pieces = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_len - 1)["input_ids"]
    rows = [torch.tensor([tokenizer.cls_token_id, *p, tokenizer.sep_token_id]) for p in pieces]
    ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tokenizer.pad_token_id).to(f_I.device)
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == tokenizer.pad_token_id, -100)  # (N, T-1)
    logits = decoder(ids[:, :-1], f_I, prefix, head, obs=obs)  # (N, T-1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


# Step 3: observation descriptions ----------------------------------------------------------------
@torch.no_grad()
def step3_inputs(model: DCRRG, images, rows, text_view: bool = True) -> dict:
    """Sec. 3.3: frozen v_p of the study under all 14 prompts and t_p of its report (the text view, "an augmented
    view"), with the observation to describe. -> {"f_I": (B or 2B, 14, P), "obs": (B or 2B,)}"""
    f_I = [model.f_v(model.embed_images(images))]
    if text_view:
        f_I.append(model.f_t(model.embed_texts([r.meta["study_report"] for r in rows])))
    obs = torch.tensor([r.meta["obs"] for r in rows], device=model.logit_scale.device)
    return {"f_I": torch.cat(f_I), "obs": obs.repeat(len(f_I))}


def step3(run, args: Args, env: dict, name: str, init: str | None) -> dict:
    """Eq. 10-14: the decoder writes one observation's description from either view; then held-out ones (Table 7)."""
    tok, transform = env["tokenizer"], env["transform"]
    examples = description_records(env["train"], env["labeler"])
    by_id = {r.id: r for r in examples}

    def loss_fn(model, batch):
        inputs = step3_inputs(model, batch["images"], [by_id[i] for i in batch["id"]])  # image rows, then text rows
        texts = batch["report"] * 2  # for the image rows, then the text rows
        return lm_loss(model.decoder, texts=texts, tokenizer=tok, max_len=MAX_DESCRIPTION_TOKENS, **inputs), {}

    def evaluate(model, st):
        """Held-out descriptions of the first 64 validation studies: the loss from each view, 24 beam-searched."""
        val = description_records(env["val"][:64], env["labeler"])
        inputs = step3_inputs(model, load_images(val, transform), val)  # image rows, then text rows
        out = {}
        for m, f_I, obs in zip(MODALITIES, inputs["f_I"].chunk(2), inputs["obs"].chunk(2)):
            loss = lm_loss(model.decoder, f_I, [r.report for r in val], tok, MAX_DESCRIPTION_TOKENS, obs=obs)
            out[f"val_loss_{m}_view"] = loss.item()

        def inputs_fn(rows):  # the image view alone
            return step3_inputs(model, load_images(rows, transform), rows, text_view=False)

        texts = generate(model, inputs_fn, val[:24], st, MAX_DESCRIPTION_TOKENS)
        rows = [
            {"id": r.id, "observation": common.CHEXPERT_LABELS[r.meta["obs"]], "reference": r.report, "generated": g}
            for r, g in zip(val, texts)
        ]
        st.write("descriptions_val.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
        return out

    batches = run.study_batches(examples, args.decoder_batch_size, "--decoder-batch-size", transform)
    return fit(run, args, env, name, init, "step3", len(examples), ["decoder"], batches, loss_fn, evaluate)


# Step 4: prefixes (P-Tuning v2) and beam search ------------------------------------------------------
@torch.no_grad()
def beam_search(decoder, f_I, bos, eos, pad, beam: int, max_len: int, prefix=None, head=None, obs=None, banned=()):
    """Width-`beam` search (App. A) -> a token list per row of f_I, without BOS/EOS. Beams compete on summed log-probs,
    finished ones pad at no cost; the answer has the best log-prob per token (paper silent). No key/value cache."""
    B, dev = f_I.shape[0], f_I.device
    f_I = f_I.repeat_interleave(beam, 0)  # (B*k, S, P)
    obs = None if obs is None else obs.repeat_interleave(beam, 0)
    tokens = torch.full((B * beam, 1), bos, dtype=torch.long, device=dev)
    scores = torch.tensor([0.0] + [-math.inf] * (beam - 1), device=dev).repeat(B, 1)  # (B, k): expand the first
    done, length = torch.zeros(B * beam, dtype=torch.bool, device=dev), torch.zeros(B * beam, device=dev)
    for _ in range(max_len):
        logp = F.log_softmax(decoder(tokens, f_I, prefix, head, obs)[:, -1].float(), -1)  # (B*k, V)
        V = logp.shape[1]
        logp[:, list(banned)] = -math.inf
        logp[done] = torch.where(torch.arange(V, device=dev) == pad, 0.0, -math.inf)  # finished: pad at no cost
        scores, idx = (scores.view(-1, 1) + logp).view(B, beam * V).topk(beam, dim=1)  # (B, k)
        origin = (idx // V + torch.arange(B, device=dev)[:, None] * beam).flatten()  # (B*k,): the beam extended
        tok = (idx % V).flatten()  # (B*k,): by this token
        tokens = torch.cat([tokens[origin], tok[:, None]], 1)
        length = length[origin] + (~done[origin]).float()  # tokens up to and including EOS
        done = done[origin] | (tok == eos)
        if done.all():
            break
    best = (scores / length.view(B, beam)).argmax(1)  # (B,)
    rows = tokens.view(B, beam, -1)[torch.arange(B, device=dev), best, 1:].tolist()
    return [r[: r.index(eos)] if eos in r else r for r in rows]


@torch.no_grad()
def generate(model: DCRRG, inputs_fn, records, st, max_len: int) -> list[str]:
    """Beam-searched texts of `records`, a strided share per rank. inputs_fn(records) -> {"f_I"[, "obs", "prefix",
    "head"]}: beam_search's inputs."""
    tok = model.tokenizer
    specials = dict(bos=tok.cls_token_id, eos=tok.sep_token_id, pad=tok.pad_token_id)
    banned = [i for i in tok.all_special_ids if i != tok.sep_token_id]  # [SEP] ends a text; no other is written
    mine = records[st.rank :: st.world_size]
    texts = []
    for b in range(0, len(mine), 32):
        inputs = inputs_fn(mine[b : b + 32])
        ids = beam_search(model.decoder, **specials, beam=BEAM, max_len=max_len, banned=banned, **inputs)
        # BERT's pre-tokenizer splits "plate-like" into three pieces that decode as "plate - like"
        texts += [re.sub(r"\s*-\s*", "-", t) for t in tok.batch_decode(ids, skip_special_tokens=True)]
    return common.gather_strided(texts, st.world_size)


def step4(run, args: Args, env: dict, name: str, init: str | None) -> dict:
    """Sec. 3.4: P-Tuning v2 (or --step4 fft) writes the report from f_I, no observation prompt; then test NLG, CE."""
    tok, transform = env["tokenizer"], env["transform"]
    pt = args.step4 == "pt"

    def decoder_inputs(model, images):
        """f_I, the study under all 14 prompts; P-Tuning v2 writes through the prefixes and the fresh head."""
        f_I = model.f_v(model.embed_images(images))
        return dict(f_I=f_I, prefix=model.prefix, head=model.prompt_head) if pt else dict(f_I=f_I)

    def loss_fn(model, batch):
        inputs = decoder_inputs(model, batch["images"])
        return lm_loss(model.decoder, texts=batch["report"], tokenizer=tok, max_len=MAX_REPORT_TOKENS, **inputs), {}

    def evaluate(model, st):
        records = env["test"][: args.n_test or (200 if args.model == "tiny" else None)]
        texts = generate(
            model, lambda rows: decoder_inputs(model, load_images(rows, transform)), records, st, MAX_REPORT_TOKENS
        )
        rows = [{"id": r.id, "reference": r.report, "generated": g} for r, g in zip(records, texts)]
        st.write("generations_test.jsonl", "".join(json.dumps(row) + "\n" for row in rows))  # rank 0 writes and scores
        gold = [env["gold"].get(r.id) for r in records]  # the annotation's labels, where it has them
        gold = np.stack(gold) if all(g is not None for g in gold) else None
        scores = common.evaluate_generations(rows, env["labeler"], args.clean, gold=gold, **CE) if st.is_main else {}
        return {"step4": args.step4, **scores}

    # Sec. 3.4: P-Tuning trains the prefixes and the fresh head only; FFT the image side and the decoder
    parts = ["prefix", "prompt_head"] if pt else ["image_encoder", "f_v", "decoder"]
    batches = run.study_batches(env["train"], args.decoder_batch_size, "--decoder-batch-size", transform)
    return fit(run, args, env, name, init, "step4", len(env["train"]), parts, batches, loss_fn, evaluate)


# Evaluation: AUROC, retrieval ----------------------------------------------------------------------
def auroc_per_observation(scores: np.ndarray, targets: np.ndarray) -> dict:
    """AUROC per observation (NaN rows out, one-class ones skipped), their mean, "mean_5" over the five tasks."""
    from sklearn.metrics import roc_auc_score

    masks = [~np.isnan(targets[:, k]) for k in range(K)]
    out = {
        name: float(roc_auc_score(targets[m, k], scores[m, k]))
        for k, (name, m) in enumerate(zip(common.CHEXPERT_LABELS, masks))
        if 0 < targets[m, k].sum() < m.sum()
    }

    def mean(xs):
        return float(np.mean(xs)) if xs else math.nan

    return {**out, "mean": mean(list(out.values())), "mean_5": mean([out[c] for c in FIVE if c in out])}


def retrieval_set(labels: np.ndarray, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """CheXpert 5x200's way: the first N studies positive for one class alone, N = min(per_class, the rarest) -> rows,
    their classes (indices into FIVE). A class with no such study is left out (5x200 has 200 of each: ours)."""
    positive = labels[:, [common.LABEL_INDEX[c] for c in FIVE]] == 1  # (N, 5)
    pools = [np.flatnonzero((positive.sum(1) == 1) & positive[:, c]) for c in range(len(FIVE))]
    kept = [c for c, p in enumerate(pools) if len(p)]
    n = min([per_class] + [len(pools[c]) for c in kept])
    return np.array([i for c in kept for i in pools[c][:n]], dtype=np.int64), np.repeat(kept, n).astype(np.int64)


def precision_at_k(sim: torch.Tensor, query_cls, cand_cls, ks=(1, 2, 5, 10)) -> dict:
    """sim (Q, C) -> mean share of each query's top K of its class (ties: lower index); none for K > C."""
    order = torch.argsort(sim, dim=1, descending=True, stable=True).cpu()  # (Q, C); the classes are on the CPU
    hit = torch.as_tensor(cand_cls)[order] == torch.as_tensor(query_cls)[:, None]
    return {f"P@{k}": hit[:, :k].float().mean().item() for k in ks if k <= sim.shape[1]}


def retrieval(model: DCRRG, records, transform) -> dict:
    """Image-to-text P@K on the 5 x N set by the 14 prompts' mean cos(v_p^k, t_p^k); "skipped": the classes left out."""
    rows, classes = retrieval_set(np.stack([r.labels for r in records]), RETRIEVAL_PER_CLASS)
    kept = sorted(set(classes.tolist()))
    out = {"n_per_class": len(rows) // max(len(kept), 1), "skipped": [c for i, c in enumerate(FIVE) if i not in kept]}
    if len(kept) < 2:
        return out
    studies = [records[i] for i in rows]
    v_p = F.normalize(model.project(studies, "image", transform), dim=-1)  # (5N, 14, P)
    t_p = F.normalize(model.project(studies, "text", transform), dim=-1)
    return out | precision_at_k(torch.einsum("ikp,jkp->ij", v_p, t_p) / K, classes, classes)


def load_images(records, transform) -> torch.Tensor:
    return torch.stack([common.ReportDataset([r], transform)[0]["images"] for r in records])  # (B, V, C, H, W)


# Running the steps -----------------------------------------------------------------------------------
def set_trainable(model: DCRRG, names: list[str]) -> list[nn.Parameter]:
    """Train the named parts only; the others are frozen, in eval mode (BatchNorm statistics untouched)."""
    for name, part in model.named_children():
        part.requires_grad_(name in names).train(name in names)
    for name, p in model.named_parameters(recurse=False):  # logit_scale, prefix
        p.requires_grad_(name in names)
    return [p for p in model.parameters() if p.requires_grad]


def budget(args: Args, kind: str, n: int) -> int:
    """--stepN-steps, else TINY_STEPS with --model tiny, or EPOCHS passes over the step's n examples."""
    steps = getattr(args, f"{kind}_steps")
    if steps is not None:
        return steps
    if args.model == "tiny":
        return TINY_STEPS[kind]
    batch = args.batch_size if kind in ("step1", "step2") else args.decoder_batch_size
    return EPOCHS * -(-n // batch)  # batches rounded up


def fit(run, args: Args, env: dict, name: str, init, kind: str, n: int, parts, batches, loss_fn, evaluate) -> dict:
    """One step in out/<name>, from out/<init>/model.pt or fresh: AdamW on `parts` (App. A; constant lr: no schedule
    given) for budget() steps, evaluate(model, stage), out/<name>/model.pt. --resume returns a done step's results."""
    others = {"resume", "out"} | {f"{s}_steps" for s in STEPS if s != kind}  # --resume checks this step's flags only
    st = run.stage(name, [f.name for f in dataclasses.fields(args) if f.name not in others])
    if st.done is not None:
        return st.done
    common.seed_everything(args.seed)  # the same fresh weights on every rank
    model = DCRRG(args, env["tokenizer"], env["foundation"]).to(run.device)
    if init is not None:
        path = run.out / init / "model.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run {init} first")
        then = json.loads((path.parent / "config.json").read_text())["data"]
        if then != args.data:
            raise ValueError(f"{path} was trained on --data {then}, not {args.data}: give another --out")
        model.load_state_dict(torch.load(path, map_location=run.device, weights_only=True))  # prefixes, head: as drawn
    params = set_trainable(model, parts)
    if kind in ("step3", "step4") and bool((model.decoder.memory_std == 1).all()):  # Step 3, or Step 4 without it
        standardise_memory(model, env["train"], env["transform"])
    common.broadcast_parameters(model)
    # --lr, else App. A's 1e-4; tiny: 1e-3, Step 2 1e-4 (1e-3 undid Step 1), P-Tuning v2 5e-3 (its range)
    tiny_lr = {"step2": 1e-4, "step4": 5e-3 if args.step4 == "pt" else 1e-3}.get(kind, 1e-3)
    lr = args.lr or (tiny_lr if args.model == "tiny" else 1e-4)
    total = budget(args, kind, n)
    optimizer, _ = common.adamw(params, lr, total, weight_decay=WEIGHT_DECAY)
    st.record(lr=lr, steps=total, parts=parts)
    common.seed_everything(args.seed, run.rank)  # ranks draw apart from here
    st.restore(model, optimizer)
    step_model = common.data_parallel(model, run.world_size)  # several processes: DDP averages the gradients
    for step, batch in st.steps(total, batches, f"DCRRG {name}"):
        with st.autocast():
            loss, stats = step_model(loss_fn, batch)  # loss_fn(model, batch), as DCRRG.forward
        loss.backward()
        grad_norm = common.clip_gradients(params, None)  # no clipping (App. A gives none): the norm is logged
        st.log(loss=loss.item(), grad_norm=grad_norm, **stats)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        st.log_step(step)  # <step>/metrics.jsonl: this step's line
        st.checkpoint(step)  # <step>/last.pt every 50 steps, at the last step and on Ctrl-C
    common.broadcast_parameters(model)  # rank 0's BatchNorm statistics (a ResNet-50 that trained) on every rank
    model.eval()
    with torch.no_grad(), st.autocast():
        results = {"init": init, "steps": total, "lr": lr, **evaluate(model, st)}
    if st.is_main:
        common.atomic_save(model.state_dict(), st.out / "model.pt")
    return st.finish(results)


STEPS = {"step1": step1, "step2": step2, "step3": step3, "step4": step4}
# Table 4: (folder under out/ablation, step, the folder it starts from, Step 4 mode); shared steps train once
ABLATION = [
    ("step1", "step1", None, None),
    ("step2", "step2", "step1", None),
    ("step3", "step3", "step2", None),
    ("m6_pt", "step4", "step3", "pt"),
    ("m7_fft", "step4", "step3", "fft"),
    ("m5_fft", "step4", "step2", "fft"),
    ("m1_fft", "step4", "step1", "fft"),
    ("step3_no_step2", "step3", "step1", None),
    ("m4_pt", "step4", "step3_no_step2", "pt"),
    ("step2_no_step1", "step2", None, None),
    ("m2_fft", "step4", "step2_no_step1", "fft"),
    ("step3_no_step1", "step3", "step2_no_step1", None),
    ("m3_pt", "step4", "step3_no_step1", "pt"),
]
TABLE4 = {
    "1 (Step 1, FFT)": "m1_fft",
    "2 (Step 2, FFT)": "m2_fft",
    "3 (Steps 2+3, PT)": "m3_pt",
    "4 (Steps 1+3, PT)": "m4_pt",
    "5 (Steps 1+2, FFT)": "m5_fft",
    "6 (Steps 1+2+3, PT: DCRRG)": "m6_pt",
    "7 (Steps 1+2+3, FFT)": "m7_fft",
}


def ablation(run, args: Args, env: dict) -> dict:
    """Table 4's seven models on one budget and seed -> out/ablation/ablation.json."""
    done = {}
    for folder, step, init, mode in ABLATION:
        step_args = dataclasses.replace(args, step4=mode or args.step4)
        done[folder] = STEPS[step](run, step_args, env, f"ablation/{folder}", f"ablation/{init}" if init else None)
    ce = {"CE P": "micro_precision", "CE R": "micro_recall", "CE F1": "micro_f1"}
    table = {
        row: {
            **{k: done[f]["nlg"][k] for k in ("BLEU-4", "METEOR", "ROUGE-L", "CIDEr") if k in done[f]["nlg"]},
            **{k: done[f]["ce"][v] for k, v in ce.items()},
        }
        for row, f in TABLE4.items()
    }
    run.write("ablation/ablation.json", json.dumps(table, indent=2))
    return table


def prepare(run, args: Args) -> dict:
    """App. A's ImageNet weights (--model paper) first; the splits labelled by --labeler (--extra-data: its labels)."""
    if args.model == "paper" and args.pretrained == "imagenet":  # now, not after hours of labelling
        import torchvision

        try:  # torchvision's weights API: downloaded once into torch's cache, where every DCRRG() finds them
            torchvision.models.get_model_weights("resnet50").DEFAULT.get_state_dict(progress=run.is_main)
        except OSError as e:
            raise OSError(
                f"--pretrained imagenet: torchvision's ImageNet ResNet-50 weights could not be downloaded ({e}); "
                "pass --pretrained none for random weights, or a state-dict file"
            ) from None

    def relabel(records):
        labels = run.labeler([r.report for r in records])
        return [dataclasses.replace(r, labels=l) for r, l in zip(records, labels)]

    extra = common.load_annotation(args.extra_data, ("train",), args.drop_invalid)["train"] if args.extra_data else []
    extra = [r for r in extra if r.labels is not None] + relabel([r for r in extra if r.labels is None])
    # R2Gen's two views of an IU X-Ray study (Sec. 4.1 follows R2Gen's preprocessing), averaged by the image encoder
    data = common.r2gen_views({split: relabel(recs) for split, recs in run.data.items()} | {"extra": extra})
    # No augmentation: R2Gen's random flip swaps left and right, which the reports name
    transform = common.default_transform(SIZES[args.model]["image_size"], channels=1 if args.model == "tiny" else 3)
    tokenizer = build_tokenizer(args, [r.report for r in data["train"] + data["extra"]], run)
    gold = {r.id: r.labels for records in run.data.values() for r in records}  # before relabel(): the annotation's
    return dict(
        data, labeler=run.labeler, transform=transform, tokenizer=tokenizer, foundation=run.foundation, gold=gold
    )


def paper_notes(args: Args) -> list[str]:
    """What --model paper cannot do as App. A does: logged, in config.json."""
    notes = []
    if args.model == "paper" and args.pretrained == "none":
        notes.append("image encoder: a random ResNet-50 (--pretrained none), not App. A's ImageNet weights")
    if args.model == "paper" and args.text_encoder is None:
        notes.append(
            "text encoder: a random BERT (512 hidden, 8 heads, 8 layers) on our vocabulary of the training reports' "
            "words, not App. A's ClinicalBERT weights (--text-encoder emilyalsentzer/Bio_ClinicalBERT)"
        )
    return notes


def train(command: str, args: Args) -> dict:
    run = common.start_run(args, stages=True, notes=paper_notes(args))
    if run.foundation is not None and args.text_encoder is None:  # ClinicalBERT's stand-in: the sandbox's text BERT
        args.text_encoder = str(run.foundation / "text_encoder")
    env = prepare(run, args)
    if command == "ablation":
        return ablation(run, args, env)
    results = {}
    previous = None
    for name, step in STEPS.items():  # Steps 1-4, each from the one before
        if command in ("all", name):
            results[name] = step(run, args, env, name, previous)
        previous = name
    if command == "all":
        run.write("eval.json", json.dumps(results, indent=2))
    if run.is_main and "step4" in results:  # the paper's CE number, BLEU-4, and a degenerate-output warning
        print(f"{run.out / 'step4'}: {common.summary(results['step4'])}")
    return results


def main(argv=None):
    return common.run_main(train, Args, argv, __doc__, commands=("all", *STEPS, "ablation"))


if __name__ == "__main__":
    main()
