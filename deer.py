"""DEER: data-efficient and diagnosis-effective reinforcement learning for report generation.

Paper: "Rethinking the Efficiency and Effectiveness of Reinforcement Learning for Radiology
Report Generation" (Lu, Yuan et al., arXiv:2603.04022; ../shared/papers/deer.txt). Three
stages. (1) SFT cold start: the vision encoder and projector learn to write reports while the
language model stays frozen. (2) DDSampling: the SFT model writes K = 10 nucleus-sampled
reports per training image; the spread of their CheXbert labels is the image's diagnostic
diversity D(I); images ranked by D are drawn with log-rank probabilities into a 20 % RL
subset. It never reads a reference report. (3) DiTPO: GRPO with the reward F1(C(o), C(y)) +
gamma * BLEU-2 (gamma 0, then 0.25), where each token's advantage is the report's advantage
times a token weight: 1 + alpha * TF-IDF of the token within its group (rule) or 1 + beta *
the CheXbert saliency of the reference's positive findings (grad). Two analyses: Table 7
(reward diversity of groups, random 100 % vs DDSampling 20 %) and Table 6 (how often masking
the top 10 % of tokens by each weighting changes the labels).

    python deer.py                        # = deer.py all: synthetic set, tiny model, a few minutes on CPU
    python deer.py rl --weighting none --rl-dir rl_grpo   # GRPO from the same SFT model and subset
    python deer.py table7 && python deer.py table6
    torchrun --nproc_per_node=8 deer.py all --data /data/mimic_cxr/annotation.json \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --labeler chexbert --dtype bf16

Commands: sft | sample | rl | all (the three in order) | table6 | table7; flags follow. Batch
sizes count studies over all ranks (the paper's 64), split evenly over the processes.
Outputs under --out: sft/ (final/, eval.json), ddsampling/ (scores.*.jsonl, selection.json),
<rl-dir>/ (metrics.jsonl, last.pt, final/, eval.json, generations_test.jsonl), table6.json,
table7.json.

Equations, and where they are implemented:
    Eq. 1  reward F1(C(o), C(y)) + gamma * BLEU-2, two phases    reward(), gamma_at()
    Eq. 2  group advantages                                      ditpo() -> common.group_advantages
    Eq. 3-4 per-label std over K samples, D(I) = sum_c sigma_c   diagnostic_diversity()
    Eq. 5  log-rank sampling probabilities                       log_rank_probs(), select_subset()
    Eq. 6  token-level advantages A_i * w_i^t                    token_advantages()
    Eq. 7-8 TF-IDF over the group, w = 1 + alpha * TF-IDF        tfidf_weights()
    Eq. 9-11 CheXbert saliency of the positive findings          gradient_weights() -> CheXbertLabeler.saliency
    Eq. 11-12 word pieces -> policy tokens (max), w = 1 + beta s~  align_to_tokens(), gradient_weights()
    Table 6 token masking, Table 7 reward diversity              table6(), table7()
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import common


@dataclass
class Args:
    data: str = "synthetic"  # "synthetic" or an annotation.json (R2Gen layout) / CSV / JSONL
    model: str = "tiny"  # "tiny" or a Hugging Face VLM id/path (the paper: Qwen/Qwen2.5-VL-3B-Instruct)
    labeler: str = "rule"  # "rule" (offline) or "chexbert" (the paper's C in Eq. 1, 3 and 9)
    chexbert_weights: str | None = None  # local chexbert.pth (else downloaded once)
    out: str = "runs/deer"
    seed: int = 0
    device: str = "auto"
    dtype: str = "fp32"  # fp32 | bf16 | auto (bf16 on a GPU with it); fp16 only for sample/table6/table7 (no loss scaling)
    max_pixels: int | None = 512 * 512  # HF models: pixels per view (334 image tokens); the paper gives none: ours
    resume: bool = False  # continue each stage (same flags) from its checkpoint or scores; finished stages are skipped
    max_new_tokens: int | None = None  # None: 256 for HF models, 96 for the tiny model (our choice)
    n_eval: int | None = None  # test studies scored after SFT and after RL (None: all)
    meteor: bool = True  # METEOR in the test evaluations (pycocoevalcap's Java jar; skipped without Java)
    log_every: int = 10
    save_every: int = 50  # checkpoint every N steps (SFT and RL)
    # Stage 1: SFT cold start (paper Sec. 4.1)
    sft_train: str = "auto"  # vision (paper: LM frozen, vision encoder + projector trained) | all | auto: vision for HF, all for tiny (its LM starts random)
    sft_lr: float | None = None  # None: 1e-5 (paper) for HF models, 1e-3 for the tiny model
    sft_batch_size: int | None = None  # studies per SFT step over all ranks; None: 64 (paper) for HF, 32 for tiny
    sft_grad_accum: int = 1  # micro-batches per SFT step on each rank (a memory knob)
    sft_epochs: float | None = None  # None: 1 (paper: no length; ours); tiny: 600 steps unless this or --sft-steps is set
    sft_steps: int | None = None  # overrides --sft-epochs
    # Stage 2: DDSampling (Sec. 3.2)
    dd_k: int = 10  # K reports per image (paper)
    dd_top_p: float = 0.9  # nucleus mass: the paper says nucleus sampling without a value; our choice
    dd_batch_size: int = 32  # studies per generation chunk (x K reports); chunks are seeded by their index
    fraction: float = 0.2  # share of the training set kept for RL (paper: 20 %)
    # Stage 3: DiTPO (Sec. 3.1, 3.3, 4.1)
    subset: str = "ddsampling"  # RL data: ddsampling (Stage 2's selection) | random (a random --fraction) | all (100 %)
    rl_dir: str = "rl"  # sub-folder of --out for this RL run: compare variants from one SFT model
    weighting: str = "auto"  # none (GRPO) | rule (TF-IDF, Eq. 7-8) | grad (CheXbert saliency, Eq. 9-12) | auto: grad with --labeler chexbert (the paper's DEER), else rule
    alpha: float = 4.0  # Eq. 8 (paper)
    beta: float = 1.0  # Eq. 12 (paper)
    tf: str = "freq"  # Eq. 7 TF: freq (count / report length) or count; the paper names neither: our choice
    idf: str = "log"  # Eq. 7 IDF: log (log(N / df): 0 for tokens in every report) or smooth (log((1 + N) / (1 + df)) + 1)
    targets_no_finding: bool = False  # Eq. 9: count No Finding among the reference's "positive diseases" (ours: it is no disease)
    gamma: float = 0.25  # Eq. 1 BLEU-2 weight in the second phase (paper)
    gamma_switch: float = 0.5  # share of RL steps with gamma = 0 (first phase); the paper gives no switch point: our choice
    group_size: int = 8  # rollouts per image (paper)
    prompts_per_step: int | None = None  # studies per RL step over all ranks; None: 64 (paper) for HF, 8 for tiny
    grad_accum: int | None = None  # micro-batches per RL step on each rank (memory); None: 8 for HF (1 study on 8 GPUs), 1 tiny
    lr: float | None = None  # None: 1e-6 (paper) for HF models, 1e-4 for the tiny model
    max_grad_norm: float = 1.0  # not in the paper: verl's default
    clip_eps: float = 0.2  # the PPO-style clip; the paper gives no value: PPO's
    kl_beta: float = 0.0  # KL weight to the SFT model; the paper's objective has no KL term
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo (common.grpo_loss); the paper does not say
    temperature: float = 1.0  # sampling temperature of rollouts and of DDSampling (the paper gives none)
    epochs: float | None = None  # RL epochs over the subset; None: 1 (paper: no length; ours); tiny: 150 steps unless this or --steps is set
    steps: int | None = None  # overrides --epochs
    # Analyses (Tables 6 and 7)
    analysis_policy: str = "sft"  # the policy that samples: sft or an RL sub-folder name (its final/)
    analysis_n: int = 500  # studies drawn from each set (paper: 10,000 rollouts for Table 6)
    mask_frac: float = 0.1  # Table 6: share of each report's tokens masked (paper: top 10 %)


COMMANDS = ("sft", "sample", "rl", "all", "table6", "table7")
# The flags a stage's output depends on: --resume refuses to continue a stage with others
SHARED_FLAGS = ("data", "model", "seed", "dtype", "max_pixels", "max_new_tokens")
STAGE_FLAGS = {"sft": SHARED_FLAGS + ("sft_train", "sft_lr", "sft_batch_size", "sft_grad_accum"),
               "ddsampling": SHARED_FLAGS + ("labeler", "dd_k", "dd_top_p", "dd_batch_size", "temperature", "fraction"),
               "rl": SHARED_FLAGS + ("labeler", "subset", "fraction", "weighting", "alpha", "beta", "tf", "idf",
                                     "targets_no_finding", "gamma", "gamma_switch", "group_size", "prompts_per_step",
                                     "grad_accum", "lr", "max_grad_norm", "clip_eps", "kl_beta", "loss_type",
                                     "temperature")}
PROMPT = "You are a radiologist. Write the findings section of the report for this chest X-ray."


# Eq. 1: reward ---------------------------------------------------------------------------------
def report_f1(hyp_labels: np.ndarray, ref_labels: np.ndarray, both_empty: float = 0.0) -> np.ndarray:
    """Per-report F1 of the 14 labels, positive or uncertain = 1: 2 TP / (|pos(o)| + |pos(y)|).
    Neither report positive anywhere: `both_empty` (0 as scikit-learn's zero_division=0)."""
    h, r = common.binarize(hyp_labels), common.binarize(ref_labels)  # (N, 14) {0, 1}
    tp, denom = (h & r).sum(1), h.sum(1) + r.sum(1)  # (N,)
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), both_empty)


def bleu2(texts: list[str], refs: list[str]) -> np.ndarray:
    """Per-report BLEU-2 (pycocoevalcap's) on R2Gen-cleaned text, as the evaluation scores it."""
    clean = lambda t: common.clean_report(t) if t.strip() else ""
    per = common.nlg_metrics([clean(t) for t in texts], [clean(r) for r in refs], meteor=False, per_sample=True)
    return np.asarray(per["per_sample"]["BLEU-2"])


def reward(texts: list[str], refs: list[str], ref_labels: np.ndarray, labeler, gamma: float):
    """Eq. 1: r = F1(C(o), C(y)) + gamma * BLEU-2(o, y). Returns (r (N,), the mean of each term)."""
    f1 = report_f1(labeler(texts), ref_labels)  # (N,)
    b2 = bleu2(texts, refs) if gamma else np.zeros(len(texts))
    return f1 + gamma * b2, {"f1": float(f1.mean()), "bleu2": float(b2.mean())}


def gamma_at(step: int, total: int, switch: float, gamma: float) -> float:
    """Sec. 3.1's two phases: gamma = 0 for the first `switch` share of the steps, then `gamma`."""
    return 0.0 if step < switch * total else gamma


# Eq. 3-5: DDSampling ---------------------------------------------------------------------------
def diagnostic_diversity(labels: np.ndarray) -> np.ndarray:
    """labels (B, K, 14) with 1/0/-1/NaN of K sampled reports per image -> D (B,).
    p_c^(k) = 1 for positive or uncertain; population std over the K samples."""
    p = common.binarize(labels.reshape(-1, labels.shape[-1])).reshape(labels.shape)  # (B, K, 14)
    # Eq. 3: sigma_c = std({p_c^(1), ..., p_c^(K)})
    sigma = p.std(axis=1)  # (B, 14)
    # Eq. 4: D(I) = sum over the C = 14 CheXbert labels of sigma_c
    return sigma.sum(axis=1)


def log_rank_probs(n: int) -> np.ndarray:
    """Eq. 5: P_r = 1 / (log(r + 1) * sum_{j=1..n} 1 / log(j + 1)) for ranks r = 1..n (any log
    base: it cancels)."""
    inv = 1.0 / np.log(np.arange(1, n + 1) + 1.0)  # (n,)
    return inv / inv.sum()


def select_subset(ids: list[str], D: np.ndarray, fraction: float, seed: int) -> dict:
    """Rank by D descending (rank 1 = most diverse; ties in random order), draw round(fraction * n)
    studies without replacement with the Eq. 5 probabilities (numpy: draw, remove, renormalise)."""
    rng = np.random.default_rng(seed)
    n = len(ids)
    shuffled = rng.permutation(n)
    order = shuffled[np.argsort(-D[shuffled], kind="stable")]  # study indices, rank 1 first
    P = log_rank_probs(n)
    m = max(1, round(fraction * n))
    drawn = rng.choice(n, size=m, replace=False, p=P)  # ranks - 1
    return {"fraction": fraction, "n_pool": n, "ids": [ids[order[k]] for k in drawn],
            "ranked": [{"id": ids[i], "D": float(D[i]), "rank": r + 1, "P": float(P[r])} for r, i in enumerate(order)]}


# Eq. 7-8: rule-based token weights ---------------------------------------------------------------
def tfidf_weights(ids: torch.Tensor, mask: torch.Tensor, G: int, alpha: float, tf: str = "freq",
                  idf: str = "log") -> torch.Tensor:
    """w = 1 + alpha * TF(o_i^t, o_i) * IDF(o_i^t, group), with the N = G reports of one image as
    the documents and the policy's token ids as terms. ids, mask (N, T) -> w (N, T), 1 off the mask.
    TF "freq": count / report length, "count": raw count. IDF "log": log(G / df), so a token
    in every report of the group (template text, EOS) keeps weight 1; "smooth": scikit-learn's
    log((1 + G) / (1 + df)) + 1."""
    w = torch.ones(mask.shape, dtype=torch.float32)  # (N, T)
    for g in range(0, ids.shape[0], G):
        docs = [ids[i][mask[i].bool()].tolist() for i in range(g, g + G)]
        df = Counter(tok for d in docs for tok in set(d))
        for k, d in enumerate(docs):
            counts = Counter(d)
            for t, tok in enumerate(d):
                tf_ = counts[tok] / len(d) if tf == "freq" else counts[tok]
                idf_ = math.log(G / df[tok]) if idf == "log" else math.log((1 + G) / (1 + df[tok])) + 1
                # Eq. 7-8: w_i^t = 1 + alpha * TF * IDF
                w[g + k, t] = 1 + alpha * tf_ * idf_
    return w.to(mask.device)


# Eq. 9-12: gradient-based token weights ----------------------------------------------------------
def token_spans(policy, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Character span of every masked token in the decoded report, for Eq. 11's alignment: token t
    covers text[a:b], b the length of the prefix decoded up to t, a the first character where it
    differs from the prefix up to t - 1 (so a span includes the space the token brings, and the
    spans tile the text). Uses only policy.decode, so it holds for the tiny word tokenizer (its
    spacing rules) and byte-level BPE alike, at T batched decodes; EOS gets a = b. Returns the
    texts (equal to policy.decode(ids, mask)) and the spans per row."""
    N, T = ids.shape
    texts, spans = [""] * N, [[] for _ in range(N)]
    prefix = torch.zeros_like(mask)  # (N, T)
    for t in range(T):
        if not mask[:, t].any():
            break
        prefix[:, t] = mask[:, t]
        decoded = policy.decode(ids, prefix)
        for i in range(N):
            if mask[i, t]:
                a = len(os.path.commonprefix([texts[i], decoded[i]]))
                spans[i].append((a, len(decoded[i])))
                texts[i] = decoded[i]
    return texts, spans


def align_to_tokens(spans, piece_offsets, piece_scores) -> np.ndarray:
    """Eq. 11 -> s~: each policy token [a, b) takes the max score of the CheXbert word pieces
    [c, d) that overlap it (c < b and a < d); 0 when none does. -> (len(spans),)"""
    if not len(spans) or not len(piece_offsets):
        return np.zeros(len(spans))
    a, b = np.asarray(spans, dtype=float).T  # (T,) each
    c, d = np.asarray(piece_offsets, dtype=float).T  # (L,) each
    overlap = (c[None, :] < b[:, None]) & (a[:, None] < d[None, :])  # (T, L)
    return np.where(overlap, np.asarray(piece_scores)[None, :], 0.0).max(axis=1)  # saliency >= 0


def reference_targets(ref_labels: np.ndarray, no_finding: bool = False) -> list[list[str]]:
    """Eq. 9's T per row: the reference's positive (or uncertain) labels; No Finding only with the flag."""
    pos = common.binarize(ref_labels)  # (N, 14)
    keep = [c for c, name in enumerate(common.CHEXPERT_LABELS) if no_finding or name != "No Finding"]
    return [[common.CHEXPERT_LABELS[c] for c in keep if row[c]] for row in pos]


def gradient_weights(chexbert, texts: list[str], spans, mask: torch.Tensor, targets: list[list[str]],
                     beta: float) -> torch.Tensor:
    """w_i^t = 1 + beta * s~_i^t (Eq. 12, no further normalisation); rows whose reference has no
    positive finding keep w = 1. mask (N, T) -> w (N, T)."""
    w = torch.ones(mask.shape, dtype=torch.float32)  # (N, T)
    rows_by_targets = defaultdict(list)  # one saliency call per target set (= per image)
    for i, tg in enumerate(targets):
        if tg:
            rows_by_targets[tuple(tg)].append(i)
    for tg, rows in rows_by_targets.items():
        # Eq. 9-11: s_i^j = || d(sum_{c in T} logit_c^pos + logit_c^unc) / d e_j ||_2 per word piece
        for i, s in zip(rows, chexbert.saliency([texts[i] for i in rows], list(tg))):
            s_tilde = align_to_tokens(spans[i], s["offsets"], s["saliency"])  # (T_i,)
            # Eq. 12: w = 1 + beta * s~
            w[i, mask[i].cpu().bool()] = torch.as_tensor(1 + beta * s_tilde, dtype=torch.float32)
    return w.to(mask.device)


def token_weights(weighting: str, args: Args, policy, labeler, ids, mask, texts, ref_labels) -> torch.Tensor:
    """(N, T) token weights: none (all 1), rule (Eq. 7-8) or grad (Eq. 9-12)."""
    if weighting == "none":
        return torch.ones_like(mask)
    if weighting == "rule":
        return tfidf_weights(ids, mask, args.group_size, args.alpha, args.tf, args.idf)
    span_texts, spans = token_spans(policy, ids, mask)
    assert span_texts == texts, "token_spans must decode to the rollout's texts"
    return gradient_weights(labeler, texts, spans, mask, reference_targets(ref_labels, args.targets_no_finding), args.beta)


# Eq. 6: token-level advantages ------------------------------------------------------------------
def token_advantages(A: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Eq. 6: A_i^t = A_i * w_i^t. A (N,) report advantages, w (N, T) token weights -> (N, T)."""
    return A[:, None] * w


# Plumbing: policies, stage folders, batches, evaluation ---------------------------------------
def trained_policy(args: Args, stage: str, device):
    """The policy a stage saved under --out/<stage>/final (tiny or HF, by the folder's content)."""
    path = Path(args.out) / stage / "final"
    if not path.is_dir():
        raise FileNotFoundError(f"no trained policy at {path}: run the stage that writes it first (same --out)")
    return common.load_policy(path, device, common.resolve_dtype(args.dtype, device), max_pixels=args.max_pixels,
                              gradient_checkpointing=True)


def set_sft_trainable(policy, train: str) -> list:
    """Sec. 4.1: freeze the language model, train the vision encoder and the vision-language
    projector ("vision"); or train everything ("all"). Returns the trainable parameters."""
    m = policy.model
    for p in m.parameters():
        p.requires_grad_(train == "all")
    if train == "vision":
        if isinstance(policy, common.TinyPolicy):  # CNN encoder, its projection, the view embeddings
            vision = [*m.encoder.parameters(), *m.project.parameters(), m.view_embedding]
        else:  # Qwen2.5-VL: model.model.visual, whose merger is the projector
            vision = list(policy.vision_and_language()[0].parameters())
        for p in vision:
            p.requires_grad_(True)
    return [p for p in m.parameters() if p.requires_grad]


def local_batches(batch: int, accum: int, world: int, flags: tuple[str, str]) -> tuple[int, int]:
    """A batch of studies over all ranks -> (studies per rank, studies per micro-batch)."""
    per_rank = common.exact_div(batch, world, f"--{flags[0]} over {world} processes")
    return per_rank, common.exact_div(per_rank, accum, f"--{flags[0]} per process / --{flags[1]}")


def open_stage(out: Path, args: Args, dist, stage: str, total: int | None = None) -> str:
    """A stage's folder. Under --resume, when an earlier run left its config.json there, the flags
    the stage depends on (STAGE_FLAGS) must be that run's, and the state is "done" (eval.json says
    the stage finished at `total` steps) or "resume" (from last.pt; DDSampling: from the scores so
    far). Otherwise "fresh": rank 0 removes an earlier run's outputs. Rank 0 saves the config."""
    out.mkdir(parents=True, exist_ok=True)  # on every rank: under --resume nobody makes it first
    resume = common.broadcast_object(args.resume and (out / "config.json").is_file())  # rank 0 decides
    if resume:
        others = [k for k in common.config_dict(args) if k not in STAGE_FLAGS[stage]]
        common.check_resume_config(out, args, may_change=others)
        if (out / "eval.json").is_file() and json.loads((out / "eval.json").read_text()).get("step") == total:
            return "done"
    state = "resume" if resume and (stage == "ddsampling" or (out / "last.pt").is_file()) else "fresh"
    common.barrier()  # everyone has read config.json before it is rewritten
    if dist.is_main:
        old = ("metrics.jsonl", "eval.json", "last.pt", "scores.*.jsonl", "selection.json") if state == "fresh" else ()
        for f in [f for pattern in old for f in out.glob(pattern)]:
            f.unlink()
        common.save_config(out, args)
    common.barrier()
    return state


def evaluate(policy, records, labeler, args: Args, dist, out: Path, step: int) -> dict:
    """Greedy reports for `records`; on rank 0 the common NLG + CE metrics, eval.json (with the
    stage's final step: --resume skips a stage finished at its length) and the generations."""
    texts = common.generate_reports(policy, records, PROMPT, max_new_tokens=args.max_new_tokens,
                                    rank=dist.rank, world_size=dist.world_size, desc="test")
    results = None
    if dist.is_main:
        rows = [{"id": r.id, "reference": r.report, "generated": t} for r, t in zip(records, texts)]
        results = common.evaluate_generations(rows, labeler, meteor="auto" if args.meteor else False)
        results["step"] = step
        with open(out / "generations_test.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        (out / "eval.json").write_text(json.dumps(results, indent=2))
        ce = results["ce"]
        print(f"{out}: CE example F1 {ce['example_f1']:.3f}, micro F1 {ce['micro_f1']:.3f}, "
              f"BLEU-4 {results['nlg']['BLEU-4']:.3f}")
    return common.broadcast_object(results)


# Stage 1: SFT cold start -------------------------------------------------------------------------
def sft(args: Args, dist, data, labeler) -> dict | None:
    out, train = Path(args.out) / "sft", data["train"]
    per_rank, micro = local_batches(args.sft_batch_size, args.sft_grad_accum, dist.world_size,
                                    ("sft-batch-size", "sft-grad-accum"))
    total = args.sft_steps if args.sft_steps is not None else \
        max(1, int(args.sft_epochs * len(train) / args.sft_batch_size))
    state = open_stage(out, args, dist, "sft", total)
    if state == "done":
        return None
    common.seed_everything(args.seed)  # same initial weights on every rank
    policy = common.make_policy(args.model, [r.report for r in train], dist.device,
                                common.resolve_dtype(args.dtype, dist.device), args.max_new_tokens,
                                n_views=max(len(r.image_paths) for r in train), max_pixels=args.max_pixels)
    params = set_sft_trainable(policy, args.sft_train)
    common.fp32_trainable(policy.model)  # bf16 weights: what trains keeps fp32 master weights
    optimizer = torch.optim.AdamW(params, lr=args.sft_lr)
    common.seed_everything(args.seed, dist.rank)
    start = 0
    if state == "resume":  # restores the RNG states too
        start, _ = common.load_checkpoint(out / "last.pt", policy.model, optimizer)
    batches = common.study_batches(train, per_rank, args.seed, dist.rank, dist.world_size, start_step=start)
    with common.RunLog(out, total, dist.is_main, start, desc="DEER SFT") as runlog:
        for step in range(start, total):
            _, batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for k in range(args.sft_grad_accum):
                rows = slice(k * micro, (k + 1) * micro)
                with common.autocast(dist.device, args.dtype):
                    loss = policy.sft_loss(policy.prompt_batch(batch["images"][rows], PROMPT), batch["report"][rows])
                (loss / args.sft_grad_accum).backward()
                losses.append(loss.item())
            common.all_reduce_gradients(params, dist.world_size)
            optimizer.step()
            if (step + 1) % args.log_every == 0 or step + 1 == total:
                runlog.log(step + 1, sft_loss=common.all_reduce_mean(float(np.mean(losses))))
            if (step + 1) % args.save_every == 0 or step + 1 == total:  # "vision": the frozen LM comes from --model
                common.save_checkpoint(out / "last.pt", policy.model, optimizer, None, step + 1, config=args,
                                       trainable_only=args.sft_train == "vision")
    if dist.is_main:
        policy.save(out / "final")
    return evaluate(policy, data["test"][:args.n_eval], labeler, args, dist, out, total)


# Stage 2: DDSampling -----------------------------------------------------------------------------
def read_scores(folder: Path) -> dict[str, float]:
    """{study id: D} from every rank's scores file; a last line without its newline (cut by a
    crash, or being written by another rank) does not count."""
    scores = {}
    for f in sorted(folder.glob("scores.*.jsonl")):
        text = f.read_text()
        for line in text[:text.rfind("\n") + 1].splitlines():
            row = json.loads(line)
            scores[row["id"]] = row["D"]
    return scores


def repeated_prompts(policy, records, n: int) -> dict:
    """The prompts of `records` (their images only), each repeated n times."""
    images = [[common.load_image(p, r.id) for p in r.image_paths] for r in records]
    return policy.repeat(policy.prompt_batch(images, PROMPT), n)


@torch.no_grad()
def score_chunk(policy, records, labeler, args: Args) -> np.ndarray:
    """K nucleus samples per study from its images alone (label-free) -> D(I) (B,)."""
    prompts = repeated_prompts(policy, records, args.dd_k)
    with common.autocast(policy.device, args.dtype):
        ids, mask = policy.generate(prompts, args.max_new_tokens, args.temperature, top_p=args.dd_top_p)
    labels = labeler(policy.decode(ids, mask))  # (B*K, 14)
    return diagnostic_diversity(labels.reshape(len(records), args.dd_k, -1))


def ddsampling(args: Args, dist, data, labeler) -> dict:
    """Score every training study by D(I) in fixed chunks (chunk c on rank c % world_size, seeded
    by c, so a resumed or differently sharded run draws the same samples), then rank 0 draws
    the RL subset into selection.json (drawn again under --resume: it is cheap and seeded)."""
    out = Path(args.out) / "ddsampling"
    open_stage(out, args, dist, "ddsampling")
    path = out / f"scores.{dist.rank}.jsonl"
    if path.is_file():  # a crash can cut the last row: drop it, or the next row is glued onto it
        os.truncate(path, path.read_bytes().rfind(b"\n") + 1)
    pool = data["train"]
    done = read_scores(out)  # under --resume, the studies already scored
    chunks = [pool[c:c + args.dd_batch_size] for c in range(0, len(pool), args.dd_batch_size)]
    mine = [c for c in range(dist.rank, len(chunks), dist.world_size) if any(r.id not in done for r in chunks[c])]
    policy = trained_policy(args, "sft", dist.device) if mine else None
    with open(path, "a") as f:
        for c in tqdm(mine, desc="DDSampling", disable=not dist.is_main):
            torch.manual_seed(args.seed * 1_000_003 + c)
            D = score_chunk(policy, chunks[c], labeler, args)
            f.writelines(json.dumps({"id": r.id, "D": float(d)}) + "\n" for r, d in zip(chunks[c], D))
            f.flush()
    common.barrier()
    summary = None
    if dist.is_main:
        scores = read_scores(out)
        D = np.array([scores[r.id] for r in pool])
        selection = select_subset([r.id for r in pool], D, args.fraction, args.seed)
        selection.update(K=args.dd_k, top_p=args.dd_top_p, temperature=args.temperature)
        (out / "selection.json").write_text(json.dumps(selection, indent=1))
        summary = {"n_pool": len(pool), "ids": selection["ids"], "D_mean": float(D.mean()),
                   "D_mean_selected": float(np.mean([scores[i] for i in selection["ids"]]))}
        print(f"DDSampling: {len(selection['ids'])} of {len(pool)} studies; D mean {summary['D_mean']:.3f}, "
              f"selected mean {summary['D_mean_selected']:.3f}")
    return common.broadcast_object(summary)


def rl_records(args: Args, train: list, subset: str) -> list:
    """The RL data: ddsampling (Stage 2's selection), random (a random --fraction) or all."""
    if subset == "all":
        return train
    if subset == "random":
        rng = np.random.default_rng(args.seed)
        return [train[i] for i in sorted(rng.choice(len(train), max(1, round(args.fraction * len(train))), replace=False))]
    path = Path(args.out) / "ddsampling" / "selection.json"
    if not path.is_file():
        raise FileNotFoundError(f"no DDSampling selection at {path}: run `python deer.py sample` first, or pass --subset all|random")
    by_id = {r.id: r for r in train}
    ids = json.loads(path.read_text())["ids"]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"{path}: {len(missing)} selected ids are not in the training set of --data {args.data} (e.g. {missing[:3]})")
    return [by_id[i] for i in ids]


# Stage 3: DiTPO ----------------------------------------------------------------------------------
def ditpo(args: Args, dist, data, labeler) -> dict | None:
    out = Path(args.out) / args.rl_dir
    records = rl_records(args, data["train"], args.subset)
    per_rank, micro = local_batches(args.prompts_per_step, args.grad_accum, dist.world_size,
                                    ("prompts-per-step", "grad-accum"))
    total = args.steps if args.steps is not None else max(1, int(args.epochs * len(records) / args.prompts_per_step))
    state = open_stage(out, args, dist, "rl", total)
    if state == "done":
        return None
    policy = trained_policy(args, "sft", dist.device)
    policy.model.requires_grad_(True)  # Sec. 4.1: RL unfreezes and optimises the entire model
    ref = "none"
    if args.kl_beta > 0:  # the SFT model, frozen, in the weights' dtype
        ref = copy.deepcopy(policy)
        ref.model.requires_grad_(False)
    # bf16 weights: fp32 master weights for the whole model (3B: ~60 GB per rank with AdamW's state)
    common.fp32_trainable(policy.model)
    params = list(policy.model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr)  # constant lr: the paper names no schedule
    G = args.group_size
    common.seed_everything(args.seed, dist.rank)
    start = 0
    if state == "resume":  # restores the RNG states too
        start, _ = common.load_checkpoint(out / "last.pt", policy.model, optimizer)
    batches = common.study_batches(records, per_rank, args.seed, dist.rank, dist.world_size, start_step=start)
    desc = f"DiTPO ({args.weighting})" if args.weighting != "none" else "GRPO"
    with common.RunLog(out, total, dist.is_main, start, desc=desc) as runlog:
        for step in range(start, total):
            _, batch = next(batches)
            gamma = gamma_at(step, total, args.gamma_switch, args.gamma)  # Sec. 3.1: F1 first, then + BLEU-2
            optimizer.zero_grad(set_to_none=True)
            stats, n_completions = [], 0
            for k in range(args.grad_accum):
                rows = slice(k * micro, (k + 1) * micro)
                refs = batch["report"][rows]
                ref_labels = labeler(refs)  # (B, 14) C(y)
                terms = {}

                def reward_fn(texts, owners):
                    r, t = reward(texts, [refs[o] for o in owners], ref_labels[owners], labeler, gamma)
                    terms.update(t)
                    return r

                with common.autocast(dist.device, args.dtype):
                    roll = common.rollout(policy, batch["images"][rows], PROMPT, G, reward_fn, args.max_new_tokens,
                                          args.temperature, ref=ref)
                # Eq. 2: A_i = (r_i - mean) / std over the group (Bessel's std + 1e-4, as TRL)
                A = common.group_advantages(roll.rewards, G)  # (N,)
                owners = np.repeat(np.arange(micro), G)
                w = token_weights(args.weighting, args, policy, labeler, roll.completion_ids, roll.completion_mask, roll.texts,
                                  ref_labels[owners])  # (N, T)
                A_t = token_advantages(A, w)  # (N, T) Eq. 6
                with common.autocast(dist.device, args.dtype):
                    logp = policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask, args.temperature)
                    # one update per rollout: pi_old = pi_theta (detached), ratio 1 (PITFALLS.md)
                    loss, s = common.grpo_loss(logp, None, roll.ref_logp, A_t, roll.completion_mask, args.clip_eps,
                                               args.clip_eps, args.kl_beta, loss_type=args.loss_type,
                                               max_completion_length=args.max_new_tokens)  # dr_grpo: a fixed L
                (loss / args.grad_accum).backward()
                m = roll.completion_mask.bool()
                r = roll.rewards.view(-1, G)
                s.update(reward=roll.rewards.mean().item(), loss=loss.item(), length=m.sum(1).float().mean().item(),
                         zero_var=(r == r[:, :1]).all(1).float().mean().item(), w_mean=w[m].mean().item(),
                         w_max=w[m].max().item(), **terms)
                stats.append(s)
                n_completions += len(roll.texts)
            common.all_reduce_gradients(params, dist.world_size)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            if (step + 1) % args.log_every == 0 or step + 1 == total:
                mean = common.all_reduce_mean({"completions": n_completions,
                                               **{k: np.mean([s[k] for s in stats]) for k in stats[0]}})
                mean["completions"] *= dist.world_size  # completions this step over all ranks
                runlog.log(step + 1, gamma=gamma, **mean)
            if (step + 1) % args.save_every == 0 or step + 1 == total:
                common.save_checkpoint(out / "last.pt", policy.model, optimizer, None, step + 1, config=args)
    if dist.is_main:
        policy.save(out / "final")
    return evaluate(policy, data["test"][:args.n_eval], labeler, args, dist, out, total)


# Analyses: Tables 6 and 7 ------------------------------------------------------------------------
def reward_diversity(rewards: np.ndarray) -> dict:
    """Table 7 from rewards (groups, G): share of groups whose rewards are all equal, mean number of
    distinct rewards per group, mean (population) std per group."""
    r = np.round(rewards, 6)
    return {"zero_variance": float((r == r[:, :1]).all(1).mean()),
            "unique_rewards": float(np.mean([len(np.unique(g)) for g in r])),
            "reward_std": float(r.std(axis=1).mean()), "n_groups": len(r)}


def mask_top_tokens(weights: torch.Tensor, candidates: torch.Tensor, frac: float, rng) -> torch.Tensor:
    """Table 6: per row, drop the ceil(frac * n) candidate tokens with the largest weights (ties in
    random order). weights, candidates (N, T) -> keep mask (N, T) (the candidates not dropped)."""
    keep = candidates.clone().float().cpu()
    for i in range(len(keep)):
        pos = candidates[i].cpu().nonzero().flatten().numpy()
        if len(pos):
            w = weights[i].cpu().numpy()[pos]
            top = pos[np.lexsort((rng.random(len(pos)), -w))[:math.ceil(frac * len(pos))]]
            keep[i, top] = 0
    return keep


def masking_effect(policy, labeler, ids, mask, w, labels: np.ndarray, frac: float, rng) -> dict[str, list]:
    """Table 6 for one weighting: remove the top `frac` of each report's tokens by w (EOS adds no
    text: never), label what is left -> per report: labels changed (any of the 14, NaN = NaN),
    changed after binarising, F1 of the masked report's labels against the unmasked (`labels`)."""
    eos = torch.tensor(getattr(policy, "eos_token_ids", [policy.eos_token_id]), device=ids.device)
    candidates = mask.bool() & ~torch.isin(ids, eos)  # (N, T)
    masked = labeler(policy.decode(ids, mask_top_tokens(w, candidates, frac, rng).to(ids.device)))  # (N, 14)
    same = (masked == labels) | (np.isnan(masked) & np.isnan(labels))
    return {"label_mod_ratio": (~same).any(1).tolist(),
            "label_mod_ratio_binary": (common.binarize(masked) != common.binarize(labels)).any(1).tolist(),
            "post_mask_f1": report_f1(masked, labels, both_empty=1.0).tolist()}


@torch.no_grad()
def sample_groups(policy, records, labeler, args: Args):
    """G rollouts (temperature sampling, as RL) per study, in batches -> per-batch dicts."""
    for b in range(0, len(records), args.dd_batch_size):
        chunk = records[b:b + args.dd_batch_size]
        prompts = repeated_prompts(policy, chunk, args.group_size)
        with common.autocast(policy.device, args.dtype):
            ids, mask = policy.generate(prompts, args.max_new_tokens, args.temperature)
        refs = [r.report for r in chunk for _ in range(args.group_size)]
        yield {"ids": ids, "mask": mask, "texts": policy.decode(ids, mask), "refs": refs, "ref_labels": labeler(refs)}


def analysis_setup(args: Args):
    """The policy the analyses sample from (one process), seeded; rng; draw(records): --analysis-n of them at random."""
    policy = trained_policy(args, args.analysis_policy, common.resolve_device(args.device))
    common.seed_everything(args.seed)
    rng = np.random.default_rng(args.seed)
    draw = lambda rs: [rs[i] for i in sorted(rng.choice(len(rs), min(args.analysis_n, len(rs)), replace=False))]
    return policy, rng, draw


def table7(args: Args, data, labeler) -> dict:
    """Reward diversity of G rollouts per study (phase-1 reward, F1 only) on a random sample of the
    full training set vs of the DDSampling subset."""
    policy, _, draw = analysis_setup(args)
    sets = {"random_100": draw(data["train"]), "ddsampling": draw(rl_records(args, data["train"], "ddsampling"))}
    results = {"policy": args.analysis_policy, "G": args.group_size}
    for name, records in sets.items():
        rewards = [reward(g["texts"], g["refs"], g["ref_labels"], labeler, 0.0)[0]
                   for g in sample_groups(policy, records, labeler, args)]
        results[name] = reward_diversity(np.concatenate(rewards).reshape(-1, args.group_size))
        print(f"Table 7 {name}: {results[name]}")
    (Path(args.out) / "table7.json").write_text(json.dumps(results, indent=2))
    return results


def table6(args: Args, data, labeler) -> dict:
    """Mask (remove) the top --mask-frac tokens of each rollout by random, rule and (with CheXbert)
    grad weights; share of reports whose labels change, and F1 of the masked report's labels against
    the unmasked report's."""
    policy, rng, draw = analysis_setup(args)
    strategies = ["random", "rule"] + (["grad"] if hasattr(labeler, "saliency") else [])
    stats = {name: defaultdict(list) for name in strategies}
    for g in sample_groups(policy, draw(data["train"]), labeler, args):
        labels = labeler(g["texts"])  # (N, 14) C(o)
        for name in strategies:
            w = (torch.rand(g["mask"].shape) if name == "random" else
                 token_weights(name, args, policy, labeler, g["ids"], g["mask"], g["texts"], g["ref_labels"]))
            for k, v in masking_effect(policy, labeler, g["ids"], g["mask"], w, labels, args.mask_frac, rng).items():
                stats[name][k] += v
    results = {"policy": args.analysis_policy, "mask_frac": args.mask_frac,
               "n_reports": len(stats["random"]["post_mask_f1"])}
    for name in strategies:
        results[name] = {k: float(np.mean(v)) for k, v in stats[name].items()}
        print(f"Table 6 {name}: {results[name]}")
    (Path(args.out) / "table6.json").write_text(json.dumps(results, indent=2))
    return results


# Running -----------------------------------------------------------------------------------------
def resolve(args: Args) -> Args:
    """Fill the model-dependent defaults and check the choices before any stage starts."""
    tiny = args.model == "tiny"
    pick = lambda value, t, hf: value if value is not None else (t if tiny else hf)
    args.max_new_tokens = pick(args.max_new_tokens, 96, 256)
    args.sft_lr, args.sft_batch_size = pick(args.sft_lr, 1e-3, 1e-5), pick(args.sft_batch_size, 32, 64)
    args.prompts_per_step, args.grad_accum = pick(args.prompts_per_step, 8, 64), pick(args.grad_accum, 1, 8)
    args.lr = pick(args.lr, 1e-4, 1e-6)
    # the tiny model's run lengths, unless a length was asked for
    if tiny and args.sft_steps is None and args.sft_epochs is None:
        args.sft_steps = 600
    if tiny and args.steps is None and args.epochs is None:
        args.steps = 150
    args.sft_epochs, args.epochs = pick(args.sft_epochs, 1.0, 1.0), pick(args.epochs, 1.0, 1.0)
    if args.sft_train == "auto":
        args.sft_train = "all" if tiny else "vision"
    if args.weighting == "auto":
        args.weighting = "grad" if args.labeler == "chexbert" else "rule"
    choices = {"sft_train": ("vision", "all"), "weighting": ("none", "rule", "grad"), "subset": ("ddsampling", "random", "all"),
               "tf": ("freq", "count"), "idf": ("log", "smooth")}
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, got {getattr(args, name)!r}")
    if args.weighting == "grad" and args.labeler != "chexbert":
        raise ValueError("--weighting grad needs --labeler chexbert (CheXbert's input-embedding saliency, Eq. 9-11)")
    if not 0 < args.fraction <= 1 or not 0 <= args.gamma_switch <= 1:
        raise ValueError(f"--fraction must lie in (0, 1] and --gamma-switch in [0, 1], got {args.fraction}, {args.gamma_switch}")
    return args


def train(command: str, args: Args) -> dict:
    args = resolve(args)
    if args.dtype == "fp16" and command in ("sft", "rl", "all"):
        raise ValueError("--dtype fp16 cannot train here: fp16 gradients need loss scaling (torch.amp.GradScaler), which "
                         "deer.py does not do; train in bf16 or fp32 (fp16 is fine for sample, table6, table7)")
    data = common.load_data(args.data)
    if command in ("table6", "table7"):  # analyses of a trained policy, in one process
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(f"run `deer.py {command}` with python, not torchrun (it is a single-process analysis)")
        labeler = common.make_labeler(args.labeler, args.chexbert_weights, common.resolve_device(args.device))
        return (table6 if command == "table6" else table7)(args, data, labeler)
    dist = common.setup_distributed(args.device)
    if command in ("sft", "all"):  # uneven batches fail now, not after hours of the stage before
        local_batches(args.sft_batch_size, args.sft_grad_accum, dist.world_size, ("sft-batch-size", "sft-grad-accum"))
    if command in ("rl", "all"):
        local_batches(args.prompts_per_step, args.grad_accum, dist.world_size, ("prompts-per-step", "grad-accum"))
    labeler = common.make_labeler(args.labeler, args.chexbert_weights, dist.device)
    results = {}
    if command in ("sft", "all"):
        results["sft"] = sft(args, dist, data, labeler)
    if command in ("sample", "all"):
        results["ddsampling"] = ddsampling(args, dist, data, labeler)
    if command in ("rl", "all"):
        results["rl"] = ditpo(args, dist, data, labeler)
    common.cleanup_distributed()
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "all"
    if command not in COMMANDS:
        raise SystemExit(f"deer.py: unknown command {command!r}; use one of {', '.join(COMMANDS)} (see --help)")
    train(command, common.parse_args(Args, argv, __doc__))


if __name__ == "__main__":
    main()
