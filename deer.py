"""DEER: data-efficient and diagnosis-effective reinforcement learning for report generation.

Paper: "Rethinking the Efficiency and Effectiveness of Reinforcement Learning for Radiology Report Generation"
(Zilin Lu, Ruifeng Yuan, Weiwei Cao, Wanxing Chang, Zhongyu Wei, Sinuo Wang, Yong Xia, Ling Zhang, Jianpeng Zhang;
arXiv:2603.04022). (1) SFT cold start: the vision encoder and projector learn to write reports, the language model
frozen. (2) DDSampling: the SFT model writes K = 10 nucleus-sampled reports per training image; the spread of their
labels is the image's diagnostic diversity D(I); images ranked by D are drawn with log-rank probabilities into a 20 %
RL subset, label-free. (3) DiTPO: GRPO with the reward F1(C(o), C(y)) + gamma BLEU-2 (gamma 0, then 0.25), each
token's advantage the report's times a weight: 1 + alpha TF-IDF of the token in its group (rule) or 1 + beta the
CheXbert saliency of the reference's findings (grad). Table 6 masks the top 10 % of tokens by each weighting; Table 7
compares the reward diversity of groups, random 100 % vs DDSampling 20 %.

    python deer.py                          # = deer.py all: synthetic, tiny: SFT -> DDSampling -> DiTPO, 8 CPU-min
    python deer.py rl --weighting none      # GRPO from the same SFT model and subset (out/rl_none)
    python deer.py table7 && python deer.py table6
    torchrun --nproc_per_node=8 deer.py all --data /data/mimic_cxr --model Qwen/Qwen2.5-VL-3B-Instruct --fsdp

Commands: all (= sft, sample, rl) | sft | sample | rl | table6 | table7, each stage in its folder of --out (sft/,
ddsampling/, rl_<weighting>[_<subset>]/: rl_grad is DEER, rl_grad_all DiTPO on 100 %); --resume skips finished ones.

CE metric (Sec. 4.1, PromptMRG's): sample-wise (example) F1 over the 14 labels, positives only.

Equations, and where they are implemented:
    Stage 1    SFT cold start: vision encoder + projector train     sft(), sft_trainable()
    Stage 2    DDSampling: K samples per image, D(I), RL subset     ddsampling(), score_chunk()
    Stage 3    DiTPO: G rollouts, reward, token weights, update     ditpo(), token_weights()
    Eq. 1      reward F1(C(o), C(y)) + gamma BLEU-2, two phases     report_f1(), reward(), gamma_at()
    Eq. 2      group advantages                                     ditpo_step() -> common.group_advantages
    Eq. 3-4    per-label std over K samples, D(I) = sum_c sigma_c   diagnostic_diversity()
    Eq. 5      log-rank sampling probabilities, the draw            log_rank_probs(), select_subset()
    Eq. 6      token-level advantages A_i w_i^t                     ditpo_step()
    Eq. 7-8    TF-IDF over the group, w = 1 + alpha TF-IDF          tfidf_weights()
    Eq. 9-11   CheXbert saliency of the reference's findings        reference_targets(), chexbert_saliency()
    Eq. 11-12  word pieces -> policy tokens (max), w = 1 + beta s~  token_spans(), align_to_tokens(), gradient_weights()
    Table 6    top-10 % token masking by each weighting             tables(), mask_top_tokens(), masking_effect()
    Table 7    reward diversity of the SFT model's groups           tables(), reward_diversity()
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch

import common


@dataclass
class Args(common.RunArgs):
    out: str | None = None
    """the run's folder, one sub-folder per stage; None: runs/deer-<data name>"""
    weighting: Literal["auto", "none", "rule", "grad"] = "auto"
    """none: GRPO; rule: Eq. 7-8; grad: Eq. 9-12; auto: grad with --labeler chexbert (DEER), else rule"""
    alpha: Annotated[float, "[0, inf)"] = 4.0
    """Eq. 8's alpha (Sec. 4.1)"""
    beta: Annotated[float | None, "[0, inf)"] = None
    """Eq. 12's beta; None: the one that meets Sec. 3.3's premise (w ~ 1 off the findings: BETA_RULE), computed and
    recorded per run; 1: Sec. 4.1's value as printed (the premise need not hold for another CheXbert)"""
    gamma: Annotated[float, "[0, inf)"] = 0.25
    """Eq. 1's BLEU-2 weight in the second phase (Sec. 4.1)"""
    group_size: Annotated[int, "[2, inf)"] = 8
    """rollouts per image (Sec. 4.1)"""
    prompts_per_step: Annotated[int | None, "[1, inf)"] = None
    """RL studies per step over all ranks; None: 64 (Sec. 4.1) for HF models, 8 tiny"""
    grad_accum: Annotated[int, "[1, inf)"] = 1
    """micro-batches per step on each rank, SFT and RL: a memory knob (ours)"""
    fsdp: bool = False
    """torchrun, RL: shard the policy over the GPUs (FSDP2), as full fine-tuning of 3B + AdamW needs"""
    lr: Annotated[float | None, "[0, 1]"] = None
    """RL lr; None: 1e-6 (Sec. 4.1) for HF models, 1e-4 tiny (ours)"""
    steps: Annotated[int | None, "[0, inf)"] = None
    """RL steps; None: one epoch of the subset for HF models (the paper gives none), 120 tiny"""
    sft_lm: Literal["auto", "frozen", "trained"] = "auto"
    """Stage 1's language model: frozen (Sec. 4.1: the vision encoder and projector learn), or trained; auto: frozen,
    but trained for a random tiny model (a random language model writes nothing)"""
    sft_steps: Annotated[int | None, "[0, inf)"] = None
    """SFT steps; None: one epoch for HF models (the paper gives none), tiny: until validation stops improving
    (CONVERGE, the sandbox's stand-in for a finished cold start)"""
    subset: Literal["ddsampling", "random", "all"] = "ddsampling"
    """RL data: Stage 2's draw, a random --fraction, or 100 %"""
    fraction: Annotated[float, "(0, 1]"] = 0.2
    """share of the training set kept for RL (Sec. 4.1: 20 %)"""
    max_new_tokens: Annotated[int | None, "[1, inf)"] = None
    """None: 256 for HF models, 96 tiny (ours)"""
    max_pixels: Annotated[int, "[784, inf)"] = 512 * 512
    """HF models: pixels per view, at most 334 Qwen image tokens (the paper gives none: ours)"""


# Sec. 4.1's settings that are not worth a flag, and our choices where the paper is silent
SFT = dict(lr_hf=1e-5, lr_tiny=1e-3, batch_hf=64, batch_tiny=32)  # Sec. 4.1 (HF); the tiny model's: ours
# The paper's RL starts from a finished SFT cold start; the sandbox's tiny model trains SFT until it stops improving:
# validation CE example F1 (the headline) of greedy reports on N_VAL studies every 100 steps, stopped after 4
# validations without a gain of 0.005, the best weights kept (declared before any sweep; README, DEER's premises)
CONVERGE = dict(every=100, patience=4, min_gain=0.005, max_steps=5000)
N_VAL = 200
# Sec. 3.3: the weights give "w > 1 to diagnostically important tokens and w ~ 1 to others". beta = 1 (Sec. 4.1) is
# tuned to the real CheXbert's saliency scale; for any labeler, beta is set so that the median weight of the tokens
# outside the reference's findings (no rule-labeler mention of a target finding over them) is 1.1, on the SFT policy's
# G samples of `studies` RL studies drawn by --seed (declared before the sweep); --beta 1: the printed value
BETA_RULE = dict(median=1.1, studies=64)
K = 10  # Sec. 3.2: sampled reports per image
TOP_P = 0.9  # "nucleus sampling" without a top-p: ours
DD_CHUNK = 32  # DDSampling: studies per generation chunk
GAMMA_SWITCH = 0.5  # share of RL steps in the F1-only phase: the paper gives no switch point (ours)
TEMPERATURE = 1.0  # the paper gives none: 1.0 samples the policy itself
MAX_GRAD_NORM = 1.0  # the paper gives none: verl's clip
LOSS_TYPE = "grpo"  # the paper's loss normalisation is unsaid: each report's token mean
MASK_FRAC = 0.1  # Table 6's 10 %
PROMPT = "You are a radiologist. Write the findings section of the report for this chest X-ray."
ANALYSIS_N = 200  # Tables 6-7: studies drawn from each set, G rollouts each (Table 6: 10,000 rollouts in the paper)
RULE_NOTE = "DiTPO with the rule TF-IDF token weights (Eq. 7-8), not the paper's CheXbert-gradient weights (Eq. 9-12)"
CE = dict(headline="example_f1", uncertain_as=0)  # Sec. 4.1: PromptMRG's sample-wise F1 of CheXbert's positives
BAR = ("reward", "f1", "bleu2", "loss")  # the RL progress bar (every number is in metrics.jsonl)
SHARED = ("data", "model", "tiny_start", "seed", "dtype", "max_pixels", "max_new_tokens", "drop_invalid")
LABELS = ("labeler", "chexbert_weights")  # what reads the reports: SFT's validation, DDSampling, the reward
RL_FLAGS = LABELS + ("weighting", "alpha", "beta", "gamma", "group_size", "prompts_per_step", "grad_accum", "lr")
STAGE_FLAGS = {  # the flags a stage's output depends on
    "sft": SHARED + LABELS + ("sft_steps", "sft_lm"),  # a converging SFT keeps the weights its labels validated best
    "ddsampling": SHARED + LABELS,  # --grad-accum: memory, SFT may differ
    "rl": SHARED + RL_FLAGS + ("steps", "subset", "fraction", "fsdp"),  # --steps places the phase switch
}


# Eq. 1: the reward ------------------------------------------------------------------------------
def report_f1(hyp_labels: np.ndarray, ref_labels: np.ndarray, both_empty: float = 0.0) -> np.ndarray:
    """F1 of the 14 labels per report, positive or uncertain = 1: 2 TP / (|pos(o)| + |pos(y)|), else `both_empty`."""
    h, r = common.binarize(hyp_labels), common.binarize(ref_labels)  # (N, 14) {0, 1}
    denom = h.sum(1) + r.sum(1)  # (N,)
    return np.where(denom > 0, 2 * (h & r).sum(1) / np.maximum(denom, 1), both_empty)


def reward(texts: list[str], refs: list[str], ref_labels: np.ndarray, labeler, gamma: float, style: str = "mimic_cxr"):
    """Eq. 1 -> (r (N,), each term's mean); BLEU-2 (on text cleaned by `style`, as in evaluation) only at gamma > 0."""
    f1 = report_f1(labeler(texts), ref_labels)  # (N,)
    if not gamma:
        return f1, {"f1": float(f1.mean())}
    hyps = [common.clean_report(t, style) if t.strip() else "" for t in texts]
    refs = [common.clean_report(t, style) if t.strip() else "" for t in refs]
    b2 = np.asarray(common.nlg_metrics(hyps, refs, meteor=False, per_sample=True)["per_sample"]["BLEU-2"])  # (N,)
    return f1 + gamma * b2, {"f1": float(f1.mean()), "bleu2": float(b2.mean())}


def gamma_at(step: int, total: int, gamma: float, switch: float = GAMMA_SWITCH) -> float:
    """Sec. 3.1's two phases: gamma = 0 for the first `switch` share of the steps, then `gamma`."""
    return 0.0 if step < switch * total else gamma


# Eq. 3-5: DDSampling ---------------------------------------------------------------------------
def diagnostic_diversity(labels: np.ndarray) -> np.ndarray:
    """labels (B, K, 14) 1/0/-1/NaN of K sampled reports per image -> D (B,); p_c = 1 for positive or uncertain."""
    p = common.binarize(labels.reshape(-1, labels.shape[-1])).reshape(labels.shape)  # (B, K, 14)
    sigma = p.std(axis=1)  # Eq. 3: sigma_c = std({p_c^(1), ..., p_c^(K)}), population std: (B, 14)
    return sigma.sum(axis=1)  # Eq. 4: D(I) = sum over the C = 14 labels of sigma_c


def log_rank_probs(n: int) -> np.ndarray:
    """Eq. 5: P_r = 1 / (log(r + 1) * sum_{j=1..n} 1 / log(j + 1)), ranks r = 1..n (the log's base cancels)."""
    inv = 1.0 / np.log(np.arange(1, n + 1) + 1.0)  # (n,)
    return inv / inv.sum()


def select_subset(ids: list[str], D: np.ndarray, fraction: float, seed: int) -> dict:
    """Rank by D descending (ties in random order); draw round(fraction n) ranks without replacement with Eq. 5's P."""
    n = len(ids)
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(n)
    order = shuffled[np.argsort(-D[shuffled], kind="stable")]  # study indices, rank 1 first
    P = log_rank_probs(n)
    drawn = rng.choice(n, size=max(1, round(fraction * n)), replace=False, p=P)  # ranks - 1
    return {
        "fraction": fraction,
        "n_pool": n,
        "ids": [ids[order[k]] for k in drawn],
        "ranked": [{"id": ids[i], "D": float(D[i]), "rank": r + 1, "P": float(P[r])} for r, i in enumerate(order)],
    }


# Eq. 7-8: rule-based token weights ---------------------------------------------------------------
def tfidf_weights(ids: torch.Tensor, mask: torch.Tensor, G: int, alpha: float, special=()) -> torch.Tensor:
    """w = 1 + alpha TF(o_i^t, o_i) IDF(o_i^t, group), the G reports of one image the documents, token ids the terms:
    TF = 1 for a token the report has (count / length shrank w to <= 1 + 4 ln 8 / L: 1.1 at 80 tokens; raw counts
    reached 30+ on repeated commas), IDF = ln(G / df), 0 in every report. `special` (EOS) keeps 1. (N, T) -> (N, T)."""
    w = torch.ones(mask.shape, dtype=torch.float32)  # (N, T)
    for g in range(0, ids.shape[0], G):
        docs = [ids[i][mask[i].bool()].tolist() for i in range(g, g + G)]
        df = Counter(tok for d in docs for tok in set(d))
        for k, d in enumerate(docs):
            for t, tok in enumerate(d):
                if tok not in special:  # Eq. 7-8: w_i^t = 1 + alpha * TF * IDF, TF = 1
                    w[g + k, t] = 1 + alpha * math.log(G / df[tok])
    return w.to(mask.device)


# Eq. 9-12: gradient-based token weights ----------------------------------------------------------
def reference_targets(ref_labels: np.ndarray) -> list[list[str]]:
    """Eq. 9's T per row: the reference's positive or uncertain findings (No Finding is no disease: ours)."""
    return [[name for c, name in enumerate(common.FINDINGS) if row[c]] for row in common.binarize(ref_labels)]


def chexbert_saliency(chexbert, reports: list[str], targets: list[str]) -> list[dict]:
    """Eq. 9-11 for reports sharing one target set T -> per report its word pieces ("tokens"), their character "offsets"
    and s^j = ||dS_target / de_j||_2 ("saliency"), no [CLS]/[SEP]; in fp32 whatever the caller's autocast."""
    tok, model = chexbert.tokenizer, chexbert.model
    heads = [common.LABEL_INDEX[t] for t in targets]
    enc = [tok(r, add_special_tokens=False, return_offsets_mapping=True) for r in reports]
    pieces = [e["input_ids"][: common.CHEXBERT_MAX_PIECES - 2] for e in enc]
    out = [
        {
            "tokens": tok.convert_ids_to_tokens(p),
            "offsets": [tuple(o) for o in e["offset_mapping"][: len(p)]],
            "saliency": np.zeros(len(p), dtype=np.float32),
        }
        for p, e in zip(pieces, enc)
    ]
    rows = [i for i, p in enumerate(pieces) if p]
    for b in range(0, len(rows), chexbert.batch_size):
        chunk = rows[b : b + chexbert.batch_size]
        framed = [[tok.cls_token_id] + pieces[i] + [tok.sep_token_id] for i in chunk]
        ids, att = common.pad_completions(framed, tok.pad_token_id, chexbert.device)  # (B, L) each, right-padded
        with torch.enable_grad(), torch.autocast(ids.device.type, enabled=False):
            E = model.bert.embeddings.word_embeddings(ids).detach().requires_grad_(True)  # (B, L, H)
            cls = model.bert(inputs_embeds=E, attention_mask=att.long())[0][:, 0]  # (B, H) the [CLS] representation
            logits = [model.linear_heads[h](cls) for h in heads]  # (B, 4) each: blank, positive, negative, uncertain
            # Eq. 9: S_target = sum_{c in T} logit_c^pos + logit_c^unc, (B,)
            S = sum(lg[:, 1] + lg[:, 3] for lg in logits)
            (g,) = torch.autograd.grad(S.sum(), E)  # Eq. 10: g = dS_target / dE, (B, L, H)
        s = g.norm(dim=-1).cpu().numpy()  # Eq. 11: s^j = ||g^j||_2, (B, L)
        for k, i in enumerate(chunk):
            out[i]["saliency"] = s[k, 1 : 1 + len(pieces[i])]
    return out


def token_spans(policy, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """For Eq. 11: (texts, spans), token t covering text[a:b], b the length of the prefix decoded up to t, a where it
    first differs from the prefix up to t - 1 (spans tile the text; EOS: a = b). Any tokenizer: policy.decode only,
    every prefix of a report in one call, on the CPU (one transfer, no read of a device tensor element by element)."""
    ids, mask = ids.cpu(), mask.cpu()
    texts, spans = [], []
    for row, m in zip(ids, mask):
        n = int(m.sum())  # the report's tokens, EOS included: the mask is 1 on a prefix of the row
        prefixes = torch.tril(torch.ones(n, len(row)))  # (n, T) prefix t: tokens 0 .. t
        text, mine = "", []
        for now in policy.decode(row.expand(n, -1), prefixes) if n else []:
            mine.append((len(os.path.commonprefix([text, now])), len(now)))
            text = now
        texts.append(text)
        spans.append(mine)
    return texts, spans


def align_to_tokens(spans, piece_offsets, piece_scores) -> np.ndarray:
    """Eq. 11 -> s~: each policy token [a, b) gets the max over the word pieces [c, d) it overlaps (c < b, a < d)."""
    if not len(spans) or not len(piece_offsets):
        return np.zeros(len(spans))
    a, b = np.asarray(spans, dtype=float).T  # (T,) each
    c, d = np.asarray(piece_offsets, dtype=float).T  # (L,) each
    overlap = (c[None, :] < b[:, None]) & (a[:, None] < d[None, :])  # (T, L)
    return np.where(overlap, np.asarray(piece_scores)[None, :], 0.0).max(axis=1)  # saliency >= 0


def gradient_weights(chexbert, texts: list[str], spans, mask: torch.Tensor, targets: list[list[str]], beta: float):
    """Eq. 12, no normalisation (as the paper): mask (N, T) -> w (N, T); 1 where the reference has no finding."""
    w = torch.ones(mask.shape, dtype=torch.float32)  # (N, T)
    for tg in dict.fromkeys(tuple(t) for t in targets if t):  # one saliency call per target set (= per image)
        rows = [i for i, t in enumerate(targets) if tuple(t) == tg]
        for i, s in zip(rows, chexbert_saliency(chexbert, [texts[i] for i in rows], list(tg))):
            s_tilde = align_to_tokens(spans[i], s["offsets"], s["saliency"])  # (T_i,) Eq. 11's mapping
            w[i, mask[i].cpu().bool()] = torch.as_tensor(1 + beta * s_tilde, dtype=torch.float32)  # Eq. 12
    return w.to(mask.device)


def token_weights(
    weighting: str, policy, labeler, ids, mask, ref_labels, G: int, alpha: float, beta=1.0
) -> torch.Tensor:
    """(N, T) token weights: none (all 1), rule (Eq. 7-8, with `alpha` over groups of G) or grad (Eq. 9-12, `beta`)."""
    if weighting == "none":
        return torch.ones(mask.shape, device=mask.device)
    if weighting == "rule":
        return tfidf_weights(ids, mask, G, alpha, special=set(policy.eos_token_ids))
    texts, spans = token_spans(policy, ids, mask)
    return gradient_weights(labeler, texts, spans, mask, reference_targets(ref_labels), beta)


@torch.no_grad()
def premise_beta(run: common.Run, args: Args, max_new: int, policy, records) -> dict:
    """BETA_RULE: beta = (median - 1) / the median s~ of the tokens outside the reference's findings, on the policy's G
    samples of BETA_RULE's studies drawn by --seed -> {"beta", the median s~ outside and inside them, the tokens}."""
    torch.manual_seed(args.seed)
    rng, rules, outside, inside = np.random.default_rng(args.seed), common.RuleLabeler(), [], []
    for _, g in sample_groups(run, args, max_new, records, rng, BETA_RULE["studies"], policy):
        targets = reference_targets(g["ref_labels"])
        texts, spans = token_spans(policy, g["ids"], g["mask"])
        s_tilde = gradient_weights(run.labeler, texts, spans, g["mask"], targets, 1.0) - 1  # (N, T) Eq. 11's s~
        for i, (text, tg) in enumerate(zip(texts, targets)):
            names = {common.LABEL_INDEX[t] for t in tg}
            found = [m.span() for k, pattern, _ in rules.mentions if k in names for m in pattern.finditer(text.lower())]
            for t, (a, e) in enumerate(spans[i] if tg else []):  # a reference without findings: w = 1 everywhere
                named = any(c < e and a < d for c, d in found)
                (inside if named else outside).append(float(s_tilde[i, t]))
    median = float(np.median(outside)) if outside else 0.0
    beta = (BETA_RULE["median"] - 1) / median if median > 0 else 1.0
    medians = {"median_s_outside": median, "median_s_inside": float(np.median(inside or [0]))}
    return {"beta": beta, **medians, "tokens_outside": len(outside), "tokens_inside": len(inside)}


# Eq. 2 and 6: the DiTPO update ------------------------------------------------------------------
def ditpo_step(policy, roll: common.Rollout, w: torch.Tensor, G: int):
    """Eq. 2 -> 6 -> the GRPO loss: the gradient -sum_i sum_t A_i^t grad log pi(o_i^t) / |o_i| / N (the PPO ratio is
    1, its clip never acts: one update per rollout, common.grpo_loss says why)."""
    # Eq. 2: A_i = (r_i - mean) / std over the group (Bessel's std + 1e-4, as TRL)
    A = common.group_advantages(roll.rewards, G)  # (N,)
    A_t = A[:, None] * w  # (N, T) Eq. 6: A_i^t = A_i * w_i^t
    logp = policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask, TEMPERATURE)  # (N, T)
    loss, stats = common.grpo_loss(logp, None, A_t, roll.completion_mask, loss_type=LOSS_TYPE)  # no KL term
    m = roll.completion_mask.bool()  # (N, T)
    r = roll.rewards.view(-1, G)  # (B, G)
    return loss, {
        **stats,
        "reward": roll.rewards.mean().item(),
        "length": m.sum(1).float().mean().item(),
        "zero_var": (r == r[:, :1]).all(1).float().mean().item(),
        "w_mean": w[m].mean().item(),
        "w_median": w[m].median().item(),
        "w_max": w[m].max().item(),
    }


# Stage 1: SFT cold start -------------------------------------------------------------------------
def sft_trainable(policy, frozen_lm: bool) -> list:
    """Sec. 4.1: the LM frozen, the vision encoder + projector (Qwen's tower and merger; the tiny model's CNN and
    projection) train; else all of it."""
    policy.model.requires_grad_(not frozen_lm)
    policy.vision_and_language()[0].requires_grad_(True)
    common.fp32_trainable(policy.model)  # bf16 weights: what trains keeps fp32 master weights
    return [p for p in policy.model.parameters() if p.requires_grad]


def sft(run: common.Run, args: Args, max_new: int, lr: float, batch: int, steps: int | None, converge: bool) -> dict:
    """Stage 1, SFT cold start (common.sft_stage): the reports teacher-forced, sft_trainable()'s parameters train, one
    epoch (steps None) or `steps`, or until validation stops improving (converge); then the test split."""
    if run.done:
        return run.done
    studies = run.data["train"]
    policy = common.initial_policy(run, [r.report for r in studies], max_new, max_pixels=args.max_pixels)
    random_lm = args.model == "tiny" and run.foundation is None  # a random language model writes nothing: it trains
    frozen_lm = args.sft_lm == "frozen" or (args.sft_lm == "auto" and not random_lm)
    sft_trainable(policy, frozen_lm)
    convergence = common.Convergence(**CONVERGE) if converge else None
    steps = steps if steps is not None else len(studies) // batch  # one epoch
    until = f"until validation stops improving ({CONVERGE})" if convergence else steps
    run.record(lr=lr, batch=batch, sft_steps=until, lm="frozen" if frozen_lm else "trained")

    def validate(stage, policy, step):
        """The headline, CE example F1, of greedy reports on N_VAL validation studies."""
        r = stage.evaluate(policy, stage.data["val"][:N_VAL], f"val_step{step}", PROMPT, max_new, ce=CE)
        return r["ce"][r["headline"]]

    def test(stage, policy):
        return {"test": evaluate(stage, policy, max_new)}

    sft_rule = dict(converge=convergence, validate=validate, grad_accum=args.grad_accum, extra=test)
    return common.sft_stage(run, policy, studies, steps, lr, batch, PROMPT, **sft_rule)


# Stage 2: DDSampling -----------------------------------------------------------------------------
def study_prompts(policy, records) -> dict:
    """The prompts of `records`: their images only, no report."""
    images = [[common.load_image(p, r.id) for p in r.image_paths] for r in records]
    return policy.prompt_batch(images, PROMPT)


@torch.no_grad()
def score_chunk(policy, records, labeler, max_new: int) -> np.ndarray:
    """K nucleus samples per study from its images alone (label-free) -> D(I) (B,)."""
    ids, mask = policy.generate(study_prompts(policy, records), max_new, TEMPERATURE, top_p=TOP_P, n=K)
    return diagnostic_diversity(labeler(policy.decode(ids, mask)).reshape(len(records), K, -1))  # (B, K, 14) -> (B,)


def ddsampling(run: common.Run, args: Args, max_new: int, pool: int | None) -> dict:
    """Stage 2: D(I) of every study of the pool (the first `pool`), a chunk per rank and step, chunk c seeded by c (the
    same samples under any ranks or a resume); the scores so far are the checkpoint. Then the draw of the RL subset."""
    if run.done:
        return run.done
    studies = run.data["train"][:pool]
    policy = sft_policy(run, args)
    chunks = [studies[c : c + DD_CHUNK] for c in range(0, len(studies), DD_CHUNK)]
    scores = {}  # study id -> D(I)
    common.seed_everything(args.seed, run.rank)
    run.restore(torch.nn.Module(), state=scores)  # no weights to save: the checkpoint holds the scores
    W = run.world_size
    for step, _ in run.steps(
        math.ceil(len(chunks) / W), lambda start: iter(range(start, len(chunks))), "DDSampling", bar=("D",)
    ):
        c = step * W + run.rank
        torch.manual_seed(args.seed * 1_000_003 + c)
        mine = {}  # a rank past the last chunk scores nothing
        if c < len(chunks):
            with run.autocast():
                D_chunk = score_chunk(policy, chunks[c], run.labeler, max_new)
            mine = dict(zip([r.id for r in chunks[c]], D_chunk.tolist()))
        shards = common.all_gather_objects(mine)
        scores.update({k: v for shard in shards for k, v in shard.items()})
        run.log(D=np.mean([d for shard in shards for d in shard.values()]))
        run.log_step(step)  # metrics.jsonl: this step's line
        run.checkpoint(step)  # last.pt every 50 steps, at the last step and on Ctrl-C
    D = np.array([scores[r.id] for r in studies])
    selection = select_subset([r.id for r in studies], D, args.fraction, args.seed)
    run.write("selection.json", json.dumps(selection, indent=1))
    chosen = [scores[i] for i in selection["ids"]]
    return run.finish(
        {"n_pool": len(studies), "n_selected": len(chosen), "D_mean": D.mean(), "D_mean_selected": np.mean(chosen)}
    )


# Stage 3: DiTPO ----------------------------------------------------------------------------------
def rl_records(args: Args, train: list, subset: str, pool: int | None) -> list:
    """The RL data: ddsampling (Stage 2's selection), random (a random --fraction of the first `pool`) or all."""
    if subset == "all":
        return train
    if subset == "random":
        train = train[:pool]
        rng = np.random.default_rng(args.seed)
        drawn = rng.choice(len(train), max(1, round(args.fraction * len(train))), replace=False)
        return [train[i] for i in sorted(drawn)]
    path = Path(args.out) / "ddsampling" / "selection.json"
    if not path.is_file():
        raise FileNotFoundError(f"no DDSampling selection at {path}: run `deer.py sample` first, or --subset all")
    by_id = {r.id: r for r in train}
    ids = json.loads(path.read_text())["ids"]
    if any(i not in by_id for i in ids):
        raise ValueError(f"{path}: selected ids are not in the training set of --data {args.data}")
    return [by_id[i] for i in ids]


def ditpo(
    run: common.Run, args: Args, max_new: int, lr: float, prompts: int, steps: int | None, pool: int | None
) -> dict:
    """Stage 3, from the SFT model on the RL data (rl_records: of the first `pool` studies). Per step (`steps`, None:
    one epoch): G rollouts for each of `prompts` studies, Eq. 1 in its phase, token weights (Eq. 7-8 or 9-12), Eq. 2 ->
    6, one update. The test split's metrics at the end."""
    if run.done:
        return run.done
    records = rl_records(args, run.data["train"], args.subset, pool)
    G = args.group_size
    total = steps if steps is not None else len(records) // prompts  # one epoch
    init = Path(args.out) / "sft" / "final"  # the SFT model, all of it trainable
    reports = [r.report for r in records]
    policy = common.initial_policy(run, reports, max_new, max_pixels=args.max_pixels, init=init, fsdp=args.fsdp)
    policy, _ = common.for_training(run, policy, reference=False, fsdp=args.fsdp)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer, _ = common.adamw(params, lr, total)  # constant lr: the paper names no schedule
    premise = {"beta": args.beta}  # Eq. 12's beta: as given, or BETA_RULE's on the SFT policy's samples
    if args.weighting == "grad" and args.beta is None:
        premise = premise_beta(run, args, max_new, policy, records)
    run.record(lr=lr, prompts_per_step=prompts, steps=total, max_new_tokens=max_new, studies=len(records))
    run.record(beta=premise)
    common.seed_everything(args.seed, run.rank)  # ranks sample apart from here
    run.restore(policy.model, optimizer)
    batches = run.study_batches(records, prompts, "--prompts-per-step")
    for step, batch in run.steps(
        total, batches, "GRPO" if args.weighting == "none" else f"DiTPO ({args.weighting})", bar=BAR
    ):
        gamma = gamma_at(step, total, args.gamma)  # Sec. 3.1: F1 first, then + gamma BLEU-2
        ref_labels = run.labeler(batch["report"])  # (B, 14) C(y)
        with run.autocast():
            roll = common.rollout(policy, batch["images"], PROMPT, G, max_new, TEMPERATURE)  # once a step
        ids, mask = roll.completion_ids, roll.completion_mask  # (N, T) each
        group_labels = np.repeat(ref_labels, G, axis=0)  # (N, 14) each reference's labels, G times
        refs = [r for r in batch["report"] for _ in range(G)]
        rewards, terms = reward(roll.texts, refs, group_labels, run.labeler, gamma, args.clean)  # Eq. 1
        run.log(**terms)
        roll.rewards = torch.as_tensor(rewards, dtype=torch.float32, device=ids.device)  # (N,)
        w = token_weights(args.weighting, policy, run.labeler, ids, mask, group_labels, G, args.alpha, premise["beta"])
        micros = common.micro_batches(policy, roll, args.grad_accum, G)  # --grad-accum: the passes in parts
        n = len(ids) // len(micros)  # rows of a micro-batch
        for k, micro in enumerate(micros):
            with common.gradient_sync(policy.forward_module, last=k == len(micros) - 1):
                with run.autocast():
                    loss, stats = ditpo_step(policy, micro, w[k * n : (k + 1) * n], G)  # Eq. 2 -> 6 -> loss
                (loss / args.grad_accum).backward()  # the last micro-batch's averages the gradients over ranks
            run.log(loss=loss.item(), gamma=gamma, **stats)
        grad_norm = common.clip_gradients(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # a constant lr: no schedule
        run.log(grad_norm=grad_norm)
        run.log_step(step)  # metrics.jsonl: this step's line
        run.checkpoint(step)  # last.pt every 50 steps, at the last step and on Ctrl-C
    return run.finish({"test": evaluate(run, policy, max_new), "beta": premise}, policy)


# Evaluation and Tables 6-7 ---------------------------------------------------------------------
def evaluate(run: common.Run, policy, max_new: int) -> dict:
    """Greedy reports on the test split: NLG and CE metrics (METEOR where Java is), into the stage's folder."""
    results = run.evaluate(policy, run.data["test"], "test", PROMPT, max_new, meteor=True, ce=CE)
    if run.is_main:
        print(f"{run.out}: {common.summary(results)}")
    return results


def sft_policy(run: common.Run, args: Args):
    if not (Path(args.out) / "sft" / "final").is_dir():
        raise FileNotFoundError(f"no SFT policy in {args.out}/sft/final: run `deer.py sft` first (same --out)")
    return common.load_policy(Path(args.out) / "sft" / "final", run.device, run.dtype, max_pixels=args.max_pixels)


def reward_diversity(rewards: np.ndarray) -> dict:
    """Table 7 from rewards (groups, G): share of groups of equal rewards; distinct rewards, population std a group."""
    r = np.round(rewards, 6)
    return {
        "zero_variance": float((r == r[:, :1]).all(1).mean()),
        "reward_std": float(r.std(axis=1).mean()),
        "unique_rewards": float(np.mean([len(np.unique(g)) for g in r])),
        "n_groups": len(r),
    }


def mask_top_tokens(weights: torch.Tensor, candidates: torch.Tensor, frac: float, rng) -> torch.Tensor:
    """Table 6: per row, drop the ceil(frac n) candidates of largest weight (ties at random) -> keep mask (N, T)."""
    keep = candidates.clone().float().cpu()
    for i in range(len(keep)):
        pos = candidates[i].cpu().nonzero().flatten().numpy()
        if len(pos):
            top = pos[np.lexsort((rng.random(len(pos)), -weights[i].cpu().numpy()[pos]))[: math.ceil(frac * len(pos))]]
            keep[i, top] = 0
    return keep


def masking_effect(policy, labeler, ids, mask, w, labels: np.ndarray, frac: float, rng) -> dict[str, list]:
    """Table 6 for one weighting: remove the top `frac` of each report's tokens by w (never EOS), label the rest -> per
    report: labels changed (NaN = NaN), changed after binarising, F1 of the masked report's labels against `labels`."""
    candidates = mask.bool() & ~torch.isin(ids, torch.tensor(policy.eos_token_ids, device=ids.device))  # (N, T)
    masked = labeler(policy.decode(ids, mask_top_tokens(w, candidates, frac, rng).to(ids.device)))  # (N, 14)
    same = (masked == labels) | (np.isnan(masked) & np.isnan(labels))
    return {
        "label_mod_ratio": (~same).any(1).tolist(),
        "post_mask_f1": report_f1(masked, labels, both_empty=1.0).tolist(),
        "label_mod_ratio_binary": (common.binarize(masked) != common.binarize(labels)).any(1).tolist(),
    }


@torch.no_grad()
def sample_groups(run: common.Run, args: Args, max_new: int, records, rng, n: int | None = None, policy=None):
    """The SFT model's (or `policy`'s) G rollouts (temperature sampling, as in RL) for n (ANALYSIS_N) drawn studies."""
    policy = policy or sft_policy(run, args)
    drawn = sorted(rng.choice(len(records), min(n or ANALYSIS_N, len(records)), replace=False))
    for b in range(0, len(drawn), DD_CHUNK):
        chunk = [records[i] for i in drawn[b : b + DD_CHUNK]]
        with run.autocast():
            ids, mask = policy.generate(study_prompts(policy, chunk), max_new, TEMPERATURE, n=args.group_size)
        refs = [r.report for r in chunk for _ in range(args.group_size)]
        yield policy, dict(ids=ids, mask=mask, texts=policy.decode(ids, mask), refs=refs, ref_labels=run.labeler(refs))


def tables(command: str, run: common.Run, args: Args, max_new: int, pool: int | None) -> dict:
    """Table 7: reward diversity (phase-1 reward) of the SFT model's groups on the training set vs the DDSampling
    subset (of the first `pool` studies). Table 6: mask the top 10 % of each SFT rollout's tokens by random, rule and
    (with CheXbert) grad weights."""
    rng = np.random.default_rng(args.seed)
    results = {"G": args.group_size, "mask_frac": MASK_FRAC}
    if command == "table7":
        for name, subset in (("random_100", "all"), ("ddsampling", "ddsampling")):
            groups = sample_groups(run, args, max_new, rl_records(args, run.data["train"], subset, pool), rng)
            r = [reward(g["texts"], g["refs"], g["ref_labels"], run.labeler, 0.0)[0] for _, g in groups]  # phase 1: F1
            results[name] = reward_diversity(np.concatenate(r).reshape(-1, args.group_size))
    else:
        strategies = ["random", "rule"]
        if isinstance(run.labeler, common.CheXbertLabeler):  # Eq. 9-11 need CheXbert's gradients
            strategies.append("grad")
        stats = {name: defaultdict(list) for name in strategies}
        for policy, g in sample_groups(run, args, max_new, run.data["train"], rng):
            labels = run.labeler(g["texts"])  # (N, 14) C(o)
            for name in strategies:
                if name == "random":
                    w = torch.rand(g["mask"].shape)
                else:
                    w = token_weights(
                        name, policy, run.labeler, g["ids"], g["mask"], g["ref_labels"], args.group_size, args.alpha
                    )
                for k, v in masking_effect(policy, run.labeler, g["ids"], g["mask"], w, labels, MASK_FRAC, rng).items():
                    stats[name][k] += v
        for name in strategies:
            results[name] = {k: float(np.mean(v)) for k, v in stats[name].items()}
        results["n_reports"] = len(stats["random"]["post_mask_f1"])
    print(json.dumps(results, indent=1))
    run.write(f"{command}.json", json.dumps(results, indent=2))
    return results


# Running ---------------------------------------------------------------------------------------
def train(command: str, args: Args) -> dict:
    """The commands of the module doc string: Stages 1, 2, 3 in order (--resume skips finished ones); Tables 6-7."""
    common.resolve_defaults(args)
    if args.weighting == "auto":
        args.weighting = "grad" if args.labeler == "chexbert" else "rule"
    if args.weighting == "grad" and args.labeler != "chexbert":
        raise ValueError("--weighting grad needs --labeler chexbert (CheXbert's input-embedding saliency, Eq. 9-11)")
    tiny = args.model == "tiny"  # what Args leaves to the model: the paper's values for HF models, ours for tiny

    def pick(value, tiny_default, hf_default):
        """The flag's value if given, else the model's default."""
        return value if value is not None else (tiny_default if tiny else hf_default)

    max_new = pick(args.max_new_tokens, 96, 256)  # every stage (ours)
    lr = pick(args.lr, 1e-4, 1e-6)  # RL: Sec. 4.1's 1e-6
    prompts = pick(args.prompts_per_step, 8, 64)  # RL studies per step: Sec. 4.1's 64
    steps = pick(args.steps, 120, None)  # RL; None: one epoch of the RL data (the paper gives none)
    sft_lr = SFT["lr_tiny" if tiny else "lr_hf"]  # SFT: Sec. 4.1's for HF models, ours for tiny
    sft_batch = SFT["batch_tiny" if tiny else "batch_hf"]
    sft_converge = tiny and args.sft_steps is None  # --sft-steps None: one epoch, or until CONVERGE stops it (tiny)
    pool = 1000 if tiny else None  # DDSampling's (the costliest stage) and --subset random's studies: the first
    shapes = {
        "sft": common.StepShape(sft_batch, 1, max_new, args.grad_accum, rollout=False, trained="vision"),
        "rl": common.StepShape(prompts, args.group_size, max_new, args.grad_accum, fsdp=args.fsdp),  # no ref.
    }
    memory = [shape for stage, shape in shapes.items() if command in (stage, "all")]
    run = common.start_run(args, stages=True, notes=[RULE_NOTE] if args.weighting == "rule" else [], memory=memory)
    common.seed_everything(args.seed)  # the same initial weights and draws on every rank
    for stage, batch, flag in (("sft", sft_batch, "the SFT batch"), ("rl", prompts, "--prompts-per-step")):
        if command in (stage, "all"):  # fail now, not hours later
            common.exact_div(run.per_rank(batch, flag), args.grad_accum, f"{flag} per process / --grad-accum")
    results = {}
    if command in ("sft", "all"):  # Stage 1: SFT cold start
        sft_run = run.stage("sft", STAGE_FLAGS["sft"])
        results["sft"] = sft(sft_run, args, max_new, sft_lr, sft_batch, args.sft_steps, sft_converge)
    if command in ("sample", "all"):  # Stage 2: DDSampling, the RL subset
        results["ddsampling"] = ddsampling(run.stage("ddsampling", STAGE_FLAGS["ddsampling"]), args, max_new, pool)
    if command in ("rl", "all"):  # Stage 3: DiTPO from the SFT model on the subset (--weighting none: GRPO)
        subset = "" if args.subset == "ddsampling" else f"_{args.subset}"  # rl_grad: DEER, rl_none_all: GRPO 100 %
        rl_run = run.stage(f"rl_{args.weighting}{subset}", STAGE_FLAGS["rl"])
        results["rl"] = ditpo(rl_run, args, max_new, lr, prompts, steps, pool)
    if command in ("table6", "table7"):  # analyses of the SFT policy, in one process
        if run.world_size > 1:
            raise ValueError(f"run `deer.py {command}` with python, not torchrun (a single-process analysis)")
        return tables(command, run, args, max_new, pool)
    return results


def main(argv=None):
    return common.run_main(train, Args, argv, __doc__, commands=("all", "sft", "sample", "rl", "table6", "table7"))


if __name__ == "__main__":
    main()
