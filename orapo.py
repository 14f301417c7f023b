"""OraPO: Oracle-educated GRPO with a FactScore-based reward (FactS) for report generation.

Paper: "OraPO: Oracle-educated Reinforcement Learning for Data-efficient and Factual Radiology
Report Generation" (../shared/papers/orapo.txt). RL only, no SFT: a vision-language model
samples G reports per study and GRPO learns from their FactS rewards (facts of the report
checked against the study's ground-truth labels, F-beta with recall weighted). When every
report of a group scores 0, GRPO has no gradient for that study; OraPO tracks, per study, an
exponential moving average of such failures (the zero-reward rate, ZRR) and mixes in a DPO
loss that prefers the ground-truth report over each of the G failed samples, weighted by
lambda = lambda_min + (lambda_max - lambda_min) * ZRR^p. `--no-dpo` is vanilla GRPO with the
same reward and bookkeeping: the Fig. 2 baseline.

    python orapo.py                                   # synthetic set, tiny model, 2-4 minutes on CPU
    python orapo.py --no-dpo --out runs/orapo_grpo    # vanilla GRPO, same seed and budget (Fig. 2)
    python orapo.py --facts hf:Qwen/Qwen2.5-1.5B-Instruct  # facts extracted by a local instruction-tuned LM
    torchrun --nproc_per_node=4 orapo.py --data /data/chexpert_plus/annotation.json \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --labeler chexbert --dtype bf16

The equations and Table 6 (hyper-parameters) were lost when the paper was turned into text;
we follow the reconstruction in ../shared/PAPER_NOTES.md, and every value the paper does not
give is marked "ours" below.

One policy update per rollout (pi_old = pi_theta, TRL's default), so Eq. 3's ratio is 1. The
KL term of Eq. 4 is on (--beta 0.04): the paper's Sec. 3.2 says a zero-reward group's update "is
dominated by the KL regularizer", which holds only with beta > 0 (`--beta 0` drops it).

Equations, and where they are implemented:
    Eq. 1-2  group advantages (Dr. GRPO: mean only)          train() -> common.group_advantages
    Eq. 3-4  clipped ratio, k3 KL to the reference           orapo_loss() -> common.grpo_loss
    Eq. 5-7  DPO, length-normalised (LN-DPO)                 orapo_loss() -> common.dpo_loss
    Eq. 8    zero-reward indicator z_q of a group            zero_reward_indicator()
    Eq. 9    EMA per prompt, ZRR_q                           ZeroRewardRate.update()
    Eq. 10   mixing weight lambda_q                          mixing_weight()
    Eq. 11   (1 - lambda_q) L_GRPO(q) + lambda_q L_DPO(q)    orapo_loss()
    Eq. 12   pairs (ground truth, each completion)           orapo_loss()
    Eq. 13   atomic facts of a report                        SentenceFacts / LLMFacts
    Eq. 14   per-label entailment, contradictions as FP      fact_claims(), facts_counts()
    Eq. 15   F-beta reward                                   facts_reward()
    Sec. 4.1 1,000 studies with a balanced label set         balanced_subset(), drop_missing_sections()
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import common


@dataclass
class Args:
    data: str = "synthetic"  # "synthetic" or an annotation.json (R2Gen layout) / CSV / JSONL
    model: str = "tiny"  # "tiny" or a Hugging Face VLM id/path (the paper: Qwen/Qwen2.5-VL-3B-Instruct)
    labeler: str = "rule"  # "rule" (offline) or "chexbert": labels the GT reports and the extracted facts
    chexbert_weights: str | None = None  # local chexbert.pth (else downloaded once)
    out: str = "runs/orapo"  # output folder
    seed: int = 0  # random seed: the training subset, the model, the samples (rank r: seed + r)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "fp32"  # fp32 | bf16 | auto (bf16 on a GPU with it); trainable weights stay fp32
    resume: bool = False  # continue from out/last.pt, ZRR state included (flags must match out/config.json)
    # Data (paper Sec. 4.1)
    train_size: int = 1000  # training studies drawn with a balanced label set (paper); 0 = the whole split
    sections: str = "findings,impression"  # drop training reports missing one of these sections (paper); "" keeps all
    # OraPO (paper Sec. 3.2 and App. A; Table 6's values are lost in the text: ours, from PAPER_NOTES.md)
    dpo: bool = True  # --no-dpo: vanilla GRPO (lambda = 0), the Fig. 2 baseline
    zrr_momentum: float = 0.9  # Eq. 9 EMA momentum m (ours)
    zrr_scope: str = "prompt"  # Eq. 9 per prompt (study id) or "batch" (one EMA of the batch's rate): paper allows both
    zrr_init: float | None = None  # ZRR before a study's first visit: None = its first z (ours), else this
    lambda_min: float = 0.05  # Eq. 10 (ours)
    lambda_max: float = 0.5  # Eq. 10 (ours)
    zrr_power: float = 2.0  # Eq. 10 sharpening exponent p (ours; the paper says "relatively sharp")
    dpo_beta: float = 0.1  # Eq. 5 temperature beta (ours: TRL's DPO default; not in Table 6)
    ln_dpo: bool = True  # LN-DPO, length-normalised log-probs (paper App. A); --no-ln-dpo sums them (plain DPO)
    grpo_loss: str = "dr_grpo"  # dr_grpo (paper App. A: no std division, constant normaliser) or grpo
    beta: float = 0.04  # Eq. 4 KL weight, > 0 by Sec. 3.2 ("dominated by the KL regularizer"); DeepSeekMath 0.04 (ours)
    clip_eps: float = 0.2  # Eq. 4 clip epsilon (not given: PPO's and TRL's 0.2)
    # FactS (paper Sec. 3.3)
    facts: str = "sentences"  # Eq. 13 extractor: "sentences" (offline) or "hf:<instruction-tuned LM id/path>"
    facts_beta: float = 2.0  # Eq. 15 beta > 1 weights recall (ours: the paper gives no value)
    facts_max_new_tokens: int = 256  # token budget of the hf: extractor per report
    # Optimisation (paper Sec. 4.1; App. A lost the values)
    group_size: int = 8  # G (ours)
    prompts_per_step: int = 4  # studies per step over ALL ranks: 4 x G = 32 completions (ours; "small effective batch")
    grad_accum: int = 1  # micro-batches per step on each rank (ours: a memory knob)
    lr: float | None = None  # None: 1e-6 for HF models (ours, "conservative"), 5e-4 for the tiny model (ours)
    max_grad_norm: float = 1.0  # TRL's default (the paper trains with TRL's GRPOTrainer)
    epochs: float | None = None  # None: 3 (TRL's default) for HF models, 1 for the tiny model
    steps: int | None = None  # RL steps, overrides --epochs; 0 = evaluate only
    max_new_tokens: int | None = None  # None: 256 (TRL's max_completion_length) for HF, 96 for the tiny model
    temperature: float = 1.0  # sampling temperature (TRL's default)
    lora_r: int = 0  # 0: full fine-tuning (the paper fine-tunes the 3B policy, no adapter named); > 0: LoRA rank
    lora_alpha: float = 128.0  # LoRA only (ours)
    lora_dropout: float = 0.05  # LoRA only (ours)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # LoRA only: the LM's attention + MLP
    sft_steps: int | None = None  # warm start: None = 300 for the tiny model (not in the paper), 0 for HF (RL only)
    sft_lr: float | None = None  # None: 1e-3 tiny, 1e-5 HF (ours)
    sft_batch_size: int = 32  # studies per warm-start step over all ranks (ours)
    eval_every: int = 100  # held-out macro F1 (and Pneumonia / Fracture F1, Fig. 2) every N steps
    n_eval: int = 64  # val studies for those checks
    log_every: int = 10  # metrics.jsonl: means over the last N steps
    uncertain_as: int = 1  # CE metrics: uncertain counts as positive (1) or negative (0); paper silent
    meteor: bool = True  # METEOR on the test evaluations (pycocoevalcap's Java jar; skipped without Java)


PROMPT = ("You are a radiologist. Write the findings and impression of the radiology report for this "
          "chest X-ray.")  # ours: the paper does not print its prompt


# Sec. 4.1: the training subset ---------------------------------------------------------------
def drop_missing_sections(records: list, sections: str) -> list:
    """Paper Sec. 4.1: "we exclude reports with missing sections". A section is a text field of
    the annotation, named `name` or `section_name` (CheXpert Plus: section_findings,
    section_impression). Fields that no record holds as text are not checked: R2Gen's
    annotation.json keeps the findings only, as the report itself."""
    names = [s.strip() for s in sections.split(",") if s.strip()]
    fields = [f for n in names for f in (n, f"section_{n}") if any(isinstance(r.meta.get(f), str) for r in records)]
    keep = [r for r in records if all(isinstance(r.meta.get(f), str) and r.meta[f].strip() for f in fields)]
    if fields and not keep:
        raise ValueError(f"--sections {sections!r}: every training report misses one of {fields}")
    return keep


def balanced_subset(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Paper Sec. 4.1: n studies "with a balanced ground-truth label set". The paper gives no
    procedure; ours: repeatedly take a random unused study positive (or uncertain) for the
    label with the fewest positives chosen so far, so rare labels keep every study they have
    and common ones fill the rest. labels (N, 14) -> sorted indices (n,)."""
    pos = common.binarize(labels).astype(bool)  # (N, 14)
    if n <= 0 or n >= len(pos):
        return np.arange(len(pos))
    rng = np.random.default_rng(seed)
    pools = [list(rng.permutation(np.flatnonzero(pos[:, c]))) for c in range(pos.shape[1])]
    taken = np.zeros(len(pos), dtype=bool)
    counts = np.zeros(pos.shape[1])
    while taken.sum() < n:
        for pool in pools:  # drop studies already taken through another label
            while pool and taken[pool[-1]]:
                pool.pop()
        open_labels = [c for c, pool in enumerate(pools) if pool]
        if not open_labels:  # only studies without any positive label are left
            rest = rng.permutation(np.flatnonzero(~taken))[:n - taken.sum()]
            taken[rest] = True
            break
        c = min(open_labels, key=lambda k: counts[k])
        i = pools[c].pop()
        taken[i] = True
        counts += pos[i]
    return np.flatnonzero(taken)


# Eq. 13-15: the FactS reward -----------------------------------------------------------------
# Clause ends inside a sentence. Splitting there never cuts a negation or hedge off its finding:
# the labeler scopes its cues by the same words (common.RuleLabeler.TERMINATORS).
_SENTENCE_END = re.compile(r"(?<!\d)\.(?!\d)|;|\n")
_CLAUSE_END = re.compile(r",?\s*\b(?:but|however|although|whereas|except)\b", flags=re.I)


class SentenceFacts:
    """Eq. 13 offline: a report's atomic facts are its sentences, cut further at contrast words
    ("No effusion, but a small pneumothorax." -> two facts). The paper prompts GPT-4.1 instead."""

    def __call__(self, reports: list[str]) -> list[list[str]]:
        out = []
        for report in reports:
            clauses = (c for s in _SENTENCE_END.split(report) for c in _CLAUSE_END.split(s))
            out.append([c.strip(" ,:-") for c in clauses if re.search(r"[a-zA-Z]", c)])
        return out


FACT_PROMPT = ("List the atomic clinical facts stated in this chest X-ray report, one per line: a finding "
               "with its attributes (e.g. 'linear atelectasis at the left base'), or an explicit absence "
               "(e.g. 'no pleural effusion'). Write only the facts.\n\nReport: {report}")


def parse_fact_lines(text: str) -> list[str]:
    """An extractor's answer -> facts: one per line, list markers ("-", "*", "1.") removed."""
    lines = (re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", line).strip() for line in text.splitlines())
    return [line for line in lines if re.search(r"[a-zA-Z]", line)]


class LLMFacts:
    """Eq. 13 with a local instruction-tuned causal LM (`--facts hf:<id or path>`), the paper's
    GPT-4.1 step done offline: greedy answer to FACT_PROMPT, parsed by parse_fact_lines. Each
    fact is then labelled by the labeler (Eq. 14), not by the LM."""

    def __init__(self, name_or_path=None, device="cpu", max_new_tokens: int = 256, batch_size: int = 16,
                 model=None, tokenizer=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(name_or_path)
        self.model = (model or AutoModelForCausalLM.from_pretrained(name_or_path)).to(device).eval()
        self.tokenizer.padding_side = "left"  # generation continues at the right end
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device, self.max_new_tokens, self.batch_size = torch.device(device), max_new_tokens, batch_size

    def prompt(self, report: str) -> str:
        text = FACT_PROMPT.format(report=report)
        if self.tokenizer.chat_template is None:
            return text + "\n"
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)

    @torch.no_grad()
    def __call__(self, reports: list[str]) -> list[list[str]]:
        out = [[] for _ in reports]  # an empty report has no facts: the model is not asked
        todo = [i for i, r in enumerate(reports) if r.strip()]
        for b in range(0, len(todo), self.batch_size):
            rows = todo[b:b + self.batch_size]
            enc = self.tokenizer([self.prompt(reports[i]) for i in rows], return_tensors="pt", padding=True,
                                 add_special_tokens=False).to(self.device)
            ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id)
            answers = self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, text in zip(rows, answers):
                out[i] = parse_fact_lines(text)
        return out


def make_fact_extractor(name: str, device="cpu", max_new_tokens: int = 256):
    """`--facts sentences` or `--facts hf:<model id or local path>`."""
    if name == "sentences":
        return SentenceFacts()
    if name.startswith("hf:") and len(name) > 3:
        return LLMFacts(name[3:], device, max_new_tokens)
    raise ValueError(f"--facts must be 'sentences' or 'hf:<model id or path>', got {name!r}")


def fact_claims(fact_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 14, one report: the labels of its F facts (F, 14) -> which labels the report claims
    present (positive or uncertain) and which it claims absent, (14,) bool each. No Finding is
    decided for the whole report (CheXpert's rule: claimed when no fact claims a finding other
    than Support Devices), not fact by fact. A report without facts claims nothing."""
    present = np.zeros(len(common.CHEXPERT_LABELS), dtype=bool)
    absent = np.zeros_like(present)
    if len(fact_labels) == 0:
        return present, absent
    F, nf = len(common.FINDINGS), common.LABEL_INDEX["No Finding"]  # the 13 findings come first
    present[:F] = np.isin(fact_labels[:, :F], (common.POSITIVE, common.UNCERTAIN)).any(0)
    absent[:F] = (fact_labels[:, :F] == common.NEGATIVE).any(0)
    summary = np.where(present, common.POSITIVE, np.nan)  # (14,)
    present[nf] = common.apply_no_finding_rule(summary)[nf] == common.POSITIVE
    return present, absent


def facts_counts(present: np.ndarray, absent: np.ndarray, gt_positive: np.ndarray) -> tuple[int, int, int]:
    """Eq. 14 -> TP, FP, FN of one report over the 14 labels. A claim of a label the ground
    truth does not hold is a false positive (unsupported); so is a claimed absence of a label
    the ground truth holds ("explicit contradictions to y_c are treated as false positives"),
    which is also a miss."""
    tp = present & gt_positive
    fp = (present & ~gt_positive) | (absent & gt_positive)
    fn = gt_positive & ~present
    return int(tp.sum()), int(fp.sum()), int(fn.sum())


def facts_reward(completions: list[str], gt_labels: np.ndarray, extractor, labeler, beta: float = 2.0,
                 eps: float = 1e-8) -> tuple[np.ndarray, dict]:
    """FactS (Eq. 13-15): facts of each completion, labelled one by one, checked label by label
    against the study's ground truth gt_labels (N, 14) -> rewards (N,) in [0, 1] and stats.
    An empty report, or one that gets no ground-truth label right, scores exactly 0."""
    facts = extractor(completions)  # Eq. 13: N lists of facts
    flat = [f for fs in facts for f in fs]
    labels = labeler(flat) if flat else np.empty((0, len(common.CHEXPERT_LABELS)))  # (F_total, 14)
    gt_positive = common.binarize(gt_labels).astype(bool)  # (N, 14), uncertain counts as positive
    rewards, precision, recall = np.zeros(len(completions)), np.zeros(len(completions)), np.zeros(len(completions))
    start = 0
    for n, fs in enumerate(facts):
        present, absent = fact_claims(labels[start:start + len(fs)])  # Eq. 14
        start += len(fs)
        tp, fp, fn = facts_counts(present, absent, gt_positive[n])
        p = tp / (tp + fp) if tp + fp else 0.0
        r = tp / (tp + fn) if tp + fn else 0.0
        # Eq. 15: R_FactS = (1 + beta^2) P R / (beta^2 P + R + eps)
        rewards[n] = (1 + beta ** 2) * p * r / (beta ** 2 * p + r + eps)
        precision[n], recall[n] = p, r
    stats = {"facts_precision": float(precision.mean()), "facts_recall": float(recall.mean()),
             "facts_per_report": len(flat) / max(1, len(facts))}
    return rewards, stats


# Eq. 8-10: zero-reward rate and the mixing weight ----------------------------------------------
def zero_reward_indicator(rewards: torch.Tensor, G: int) -> np.ndarray:
    """Eq. 8: z_q = 1 when every reward of prompt q's group is 0, else 0. (B*G,) -> (B,)."""
    return (rewards.view(-1, G) == 0).all(1).float().cpu().numpy()


class ZeroRewardRate:
    """Eq. 9: ZRR_q <- m * ZRR_q + (1 - m) * z_q, per prompt (study id) or, with scope "batch",
    one value fed with the minibatch's fraction of zero-reward groups. Under torchrun every rank
    applies every rank's updates in rank order, so all ranks hold the same state (a study can
    land on another rank next epoch), and any rank's `values` is the checkpoint's."""

    def __init__(self, momentum: float, scope: str = "prompt", init: float | None = None):
        if scope not in ("prompt", "batch"):
            raise ValueError(f"--zrr-scope must be 'prompt' or 'batch', got {scope!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"--zrr-momentum must lie in [0, 1), got {momentum}")
        self.momentum, self.scope, self.init = momentum, scope, init
        self.values: dict[str, float] = {}

    def update(self, ids: list[str], z: np.ndarray) -> np.ndarray:
        """Feed this rank's z (B,) for its studies `ids`; returns their updated ZRR (B,)."""
        updates = [list(zip(ids, z.tolist()))]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            updates = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(updates, list(zip(ids, z.tolist())))
        pairs = [pair for rank in updates for pair in rank]
        if self.scope == "batch":
            pairs = [("minibatch", float(np.mean([zq for _, zq in pairs])))]
        m = self.momentum
        for key, zq in pairs:
            # Paper silent on the start value: with init None a study's first z is its ZRR (an EMA
            # started at 0 would keep lambda near lambda_min for studies seen once or twice)
            old = self.values.get(key, zq if self.init is None else self.init)
            self.values[key] = m * old + (1 - m) * zq  # Eq. 9
        return np.array([self.values["minibatch" if self.scope == "batch" else k] for k in ids])


def mixing_weight(zrr: np.ndarray, lambda_min: float, lambda_max: float, p: float) -> np.ndarray:
    """Eq. 10: lambda_q = lambda_min + (lambda_max - lambda_min) * ZRR_q^p (bounded, monotonic)."""
    return lambda_min + (lambda_max - lambda_min) * np.power(zrr, p)


# Eq. 11-12: the OraPO objective ------------------------------------------------------------------
def orapo_loss(logp, ref_logp, advantages, mask, lambdas, G: int, chosen_logp=None, ref_chosen_logp=None,
               chosen_mask=None, *, beta: float = 0.0, clip_eps: float = 0.2, loss_type: str = "dr_grpo",
               max_len: int | None = None, dpo_beta: float = 0.1, ln_dpo: bool = True):
    """Eq. 11: L = (1/B) sum_q [(1 - lambda_q) L_GRPO(q) + lambda_q L_DPO(q)]. Returns (loss, stats).

    logp, ref_logp, mask: (B*G, T) the sampled completions (groups contiguous); advantages
    (B*G,); lambdas (B,). chosen_logp, ref_chosen_logp, chosen_mask: (B, Tc) the ground-truth
    report of each prompt, or None for GRPO alone (lambdas must then be 0).
    L_GRPO(q) is common.grpo_loss on the group's G rows; "dr_grpo" divides its token sum by
    G * max_len with one constant max_len for every group, and "grpo" takes the mean per
    sequence, so with every lambda_q = 0 this equals grpo_loss over the whole batch.
    L_DPO(q) is common.dpo_loss over the G pairs (y+, y_i) (Eq. 12), so with every lambda_q = 1
    it equals dpo_loss over all B*G pairs."""
    B = len(lambdas)
    if chosen_logp is None and bool((lambdas != 0).any()):
        raise ValueError("lambda > 0 needs the ground-truth report's log-probs (chosen_logp)")
    grpo_parts, dpo_parts, stats = [], [], []
    for q in range(B):
        g = slice(q * G, (q + 1) * G)
        # Eq. 3-4 on the group's samples (one update per rollout: pi_old = pi_theta detached)
        l_grpo, s = common.grpo_loss(logp[g], None, None if ref_logp is None else ref_logp[g], advantages[g], mask[g],
                                     clip_eps, clip_eps, beta, loss_type, max_completion_length=max_len)
        grpo_parts.append(l_grpo)
        if chosen_logp is not None:
            # Eq. 12: y+ = the ground-truth report, y- = each of the G completions
            rep = lambda x: x[q:q + 1].expand(G, -1)  # (G, Tc) the chosen report once per pair
            l_dpo, d = common.dpo_loss(rep(chosen_logp), logp[g], rep(ref_chosen_logp), ref_logp[g], dpo_beta,
                                       length_normalize=ln_dpo, chosen_mask=rep(chosen_mask), rejected_mask=mask[g])
            dpo_parts.append(l_dpo)
            s.update(dpo_accuracy=d["accuracy"], dpo_margin=d["reward_margin"])
        stats.append(s)
    l_grpo = torch.stack(grpo_parts)  # (B,)
    l_dpo = torch.stack(dpo_parts) if dpo_parts else torch.zeros_like(l_grpo)  # (B,)
    lam = torch.as_tensor(lambdas, dtype=l_grpo.dtype, device=l_grpo.device)  # (B,)
    # Eq. 11
    loss = ((1 - lam) * l_grpo + lam * l_dpo).mean()
    out = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
    out.update(grpo_loss=l_grpo.mean().item(), dpo_loss=l_dpo.mean().item())
    return loss, out


# The model ---------------------------------------------------------------------------------------
def build_policy(args: Args, train_records, dist, warm_resume: bool):
    """The policy before any LoRA: a new one, or the warm-started one of a resumed run."""
    dtype = common.resolve_dtype(args.dtype, dist.device)
    if warm_resume and args.model == "tiny":
        return common.TinyPolicy.load(Path(args.out) / "sft", dist.device)
    model = str(Path(args.out) / "sft") if warm_resume else args.model
    return common.make_policy(model, [r.report for r in train_records], dist.device, dtype, args.max_new_tokens)


def reference_logprobs(policy, ref, prompts, ids, mask, temperature):
    """Log-probs under the reference policy: a frozen copy, or the policy with LoRA switched off."""
    with torch.no_grad():
        if ref == "lora":
            with common.lora_disabled(policy.model):
                return policy.completion_logprobs(prompts, ids, mask, temperature)
        return ref.completion_logprobs(prompts, ids, mask, temperature)


def evaluate(policy, records, labeler, extractor, args: Args, dist, name: str, meteor=False) -> dict:
    """Greedy reports for `records`; on rank 0 the FactS reward, NLG and CE metrics (macro P/R/F1
    over the 14 labels is the paper's convention; micro, example-based and 5-label micro are
    there too), out/eval_{name}.json and out/generations_{name}.jsonl. Every rank returns them."""
    texts = common.generate_reports(policy, records, PROMPT, max_new_tokens=args.max_new_tokens,
                                    rank=dist.rank, world_size=dist.world_size, desc=name)
    results = None
    if dist.is_main:
        cache = common.LabelCache(labeler)  # references labelled once for the reward and the metrics
        references = [r.report for r in records]
        reward, stats = facts_reward(texts, cache(references), extractor, cache, args.facts_beta)
        rows = [{"id": r.id, "reference": r.report, "generated": t, "facts_reward": float(f)}
                for r, t, f in zip(records, texts, reward)]
        results = common.evaluate_generations(rows, cache, uncertain_as=args.uncertain_as, meteor=meteor)
        results.update(facts_reward=float(reward.mean()), **stats)
        with open(Path(args.out) / f"generations_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        (Path(args.out) / f"eval_{name}.json").write_text(json.dumps(results, indent=2))
    return common.broadcast_object(results)


def check_args(args: Args):
    if args.grpo_loss not in ("dr_grpo", "grpo"):
        raise ValueError(f"--grpo-loss must be 'dr_grpo' or 'grpo', got {args.grpo_loss!r}")
    if not 0 <= args.lambda_min <= args.lambda_max <= 1:
        raise ValueError(f"need 0 <= --lambda-min <= --lambda-max <= 1, got {args.lambda_min}, {args.lambda_max}")
    if args.group_size < 2:
        raise ValueError(f"--group-size must be at least 2 (GRPO compares samples), got {args.group_size}")
    if args.lora_r > 0 and args.model == "tiny":
        raise ValueError("--lora-r is for Hugging Face models; the tiny model trains fully")
    if args.dtype == "fp16":
        raise ValueError("--dtype fp16 cannot train here: fp16 gradients need loss scaling (a GradScaler), which "
                         "orapo.py does not do; use bf16 or fp32")


def train(args: Args) -> dict:
    dist = common.setup_distributed(args.device)
    common.seed_everything(args.seed)  # same initial weights on every rank
    tiny = args.model == "tiny"
    # Model-dependent defaults, resolved before config.json records them
    args.lr = args.lr or (5e-4 if tiny else 1e-6)
    args.max_new_tokens = args.max_new_tokens or (96 if tiny else 256)
    args.sft_steps = (300 if tiny else 0) if args.sft_steps is None else args.sft_steps
    args.sft_lr = args.sft_lr or (1e-3 if tiny else 1e-5)
    args.epochs = args.epochs or (1.0 if tiny else 3.0)
    check_args(args)
    # --prompts-per-step and --sft-batch-size count studies over all ranks (the effective batch)
    world = dist.world_size
    per_rank = common.exact_div(args.prompts_per_step, world, f"--prompts-per-step over {world} processes")
    micro = common.exact_div(per_rank, args.grad_accum, "--prompts-per-step per process / --grad-accum")
    sft_per_rank = common.exact_div(args.sft_batch_size, world, f"--sft-batch-size over {world} processes") \
        if args.sft_steps else 0
    out = common.start_run(args.out, args, dist)  # --resume: the flags must be the run's

    # Sec. 4.1: complete reports, then a label-balanced subset; the labels are the labeler's on
    # the ground-truth reports (the paper uses the CheXpert labeller) and serve as FactS's y
    data = common.load_data(args.data)
    labeler = common.make_labeler(args.labeler, args.chexbert_weights, dist.device)
    pool = drop_missing_sections(data["train"], args.sections)
    # (N, 14), labelled on rank 0 alone and broadcast: every rank must draw the same subset
    pool_labels = common.broadcast_object(labeler([r.report for r in pool]) if dist.is_main else None)
    keep = balanced_subset(pool_labels, args.train_size, args.seed)
    train_records = [pool[i] for i in keep]
    gt = {pool[i].id: pool_labels[i] for i in keep}
    val_records, test_records = data["val"][:args.n_eval], data["test"]
    extractor = make_fact_extractor(args.facts, dist.device, args.facts_max_new_tokens)

    # Policy, warm start, reference ---------------------------------------------------------------
    warm_resume = args.resume and args.sft_steps > 0
    policy = build_policy(args, train_records, dist, warm_resume)
    common.broadcast_parameters(policy.model)
    if args.sft_steps > 0 and not args.resume:
        # Not in the paper (RL only): the random tiny model needs words before it earns any reward
        common.fp32_trainable(policy.model)  # bf16 HF weights: SFT's AdamW steps need fp32 master weights
        common.supervised_finetune(policy, train_records, args.sft_steps, batch_size=sft_per_rank, lr=args.sft_lr,
                                   prompt=PROMPT, seed=args.seed, rank=dist.rank, world_size=world)
        if not tiny:  # back to the run's dtype, as out/sft reloads on --resume (the reference is a copy of it)
            for p in policy.model.parameters():
                p.data = p.data.to(common.resolve_dtype(args.dtype, dist.device))
        if dist.is_main:
            policy.save(out / "sft")  # RL's starting point and reference, kept for --resume
    # DPO (Eq. 5-7) and the KL term (Eq. 4) score against the reference. Eq. 4's beta is on by
    # default: Sec. 3.2 says zero-reward groups leave "the update dominated by the KL regularizer"
    # (so beta > 0); the value is lost with Table 6, ours is DeepSeekMath's 0.04 (--beta 0: no KL)
    need_ref = args.dpo or args.beta > 0
    if args.lora_r > 0:  # the reference is the policy with LoRA off; the vision tower stays frozen
        common.apply_lora(policy.model, args.lora_targets.split(","), args.lora_r, args.lora_alpha,
                          args.lora_dropout, exclude=policy.vision_and_language()[0])
        common.broadcast_parameters(policy.model)
        ref = "lora"
    else:  # full fine-tuning: the reference is a frozen copy of the policy RL starts from
        ref = copy.deepcopy(policy) if need_ref else "none"
        if ref != "none":
            ref.model.eval().requires_grad_(False)
    common.fp32_trainable(policy.model)  # bf16 weights: what trains keeps fp32 master weights (the copy stays bf16)

    # AdamW with a linearly decaying lr, no warm-up, no weight decay: TRL's defaults (the paper
    # trains with TRL's GRPOTrainer and names no optimiser settings but the lr)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.steps if args.steps is not None else \
        max(1, int(args.epochs * len(train_records) / args.prompts_per_step))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(1, total))  # lr x (1 - s / total)
    zrr = ZeroRewardRate(args.zrr_momentum, args.zrr_scope, args.zrr_init)
    common.seed_everything(args.seed, dist.rank)  # ranks sample differently from here on
    start = 0
    if args.resume:  # restores the RNG states too, so sampling continues where it stopped
        start, extra = common.load_checkpoint(out / "last.pt", policy.model, optimizer, scheduler)
        zrr.values = dict(extra["zrr"])

    # Before RL ------------------------------------------------------------------------------------
    evals = {"val": (val_records, False), "test": (test_records, "auto" if args.meteor else False)}
    results = {}
    if start == 0:
        for split, (records, meteor) in evals.items():
            results[f"{split}_before"] = evaluate(policy, records, labeler, extractor, args, dist, f"{split}_before",
                                                  meteor)
    elif dist.is_main:  # resumed: the files the first run wrote
        results = {n: json.loads((out / f"eval_{n}.json").read_text())
                   for n in ("val_before", "test_before") if (out / f"eval_{n}.json").is_file()}

    # OraPO ----------------------------------------------------------------------------------------
    batches = common.study_batches(train_records, per_rank, args.seed, dist.rank, world, start_step=start)
    G = args.group_size
    scale = "none" if args.grpo_loss == "dr_grpo" else "std"  # Dr. GRPO drops the std division
    stats = []  # per micro-batch, since the last log line
    with common.RunLog(out, total, dist.is_main, start, desc="OraPO" if args.dpo else "GRPO") as runlog:
        for step in range(start, total):
            _, batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]  # the lr this step uses
            cache = common.LabelCache(labeler)  # each distinct fact labelled once this step
            for k in range(args.grad_accum):
                rows = slice(k * micro, (k + 1) * micro)
                ids, refs, images = batch["id"][rows], batch["report"][rows], batch["images"][rows]
                y = np.stack([gt[i] for i in ids])  # (b, 14) ground-truth labels
                reward_fn = lambda texts, owners: facts_reward(texts, y[owners], extractor, cache, args.facts_beta)[0]
                with common.autocast(dist.device, args.dtype):
                    roll = common.rollout(policy, images, PROMPT, G, reward_fn, args.max_new_tokens, args.temperature,
                                          ref=ref if need_ref else "none")
                    z = zero_reward_indicator(roll.rewards, G)  # Eq. 8, (b,)
                    zrr_q = zrr.update(ids, z)  # Eq. 9, (b,) the same state on every rank
                    lam = mixing_weight(zrr_q, args.lambda_min, args.lambda_max, args.zrr_power) if args.dpo \
                        else np.zeros(len(ids))  # Eq. 10, (b,)
                    A = common.group_advantages(roll.rewards, G, scale=scale)  # Eq. 1-2, (b*G,)
                    logp = policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask,
                                                      args.temperature)  # (b*G, T)
                    chosen = {}
                    if args.dpo:  # Eq. 12: the ground-truth report of each study is the preferred answer
                        prompts = policy.prompt_batch(images, PROMPT)
                        c_ids, c_mask = policy.encode_targets(refs)  # (b, Tc)
                        chosen = dict(chosen_logp=policy.completion_logprobs(prompts, c_ids, c_mask, args.temperature),
                                      ref_chosen_logp=reference_logprobs(policy, ref, prompts, c_ids, c_mask,
                                                                         args.temperature),
                                      chosen_mask=c_mask)
                    loss, s = orapo_loss(logp, roll.ref_logp, A, roll.completion_mask, lam, G, **chosen,
                                         beta=args.beta, clip_eps=args.clip_eps, loss_type=args.grpo_loss,
                                         max_len=args.max_new_tokens, dpo_beta=args.dpo_beta, ln_dpo=args.ln_dpo)
                (loss / args.grad_accum).backward()
                s.update(reward=roll.rewards.mean().item(), zero_group_ratio=z.mean(), zrr=zrr_q.mean(),
                         **{"lambda": lam.mean()}, loss=loss.item(), length=roll.completion_mask.sum(1).mean().item())
                stats.append(s)
            common.all_reduce_gradients(params, world)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
            optimizer.step()
            scheduler.step()
            if (step + 1) % args.log_every == 0 or step + 1 == total:  # means over the steps since the last line
                mean = common.all_reduce_mean({k: np.mean([s[k] for s in stats]) for k in stats[0]})
                runlog.log(step + 1, lr=lr, grad_norm=grad_norm, **mean)
                stats = []
            if (step + 1) % args.eval_every == 0 and step + 1 < total:  # Fig. 2 (right): F1 over checkpoints
                ce = evaluate(policy, val_records, labeler, extractor, args, dist, "val")["ce"]
                runlog.log(step + 1, val_macro_f1=ce["macro_f1"], val_f1_pneumonia=ce["per_label"]["Pneumonia"]["f1"],
                           val_f1_fracture=ce["per_label"]["Fracture"]["f1"])
            if (step + 1) % args.eval_every == 0 or step + 1 == total:
                common.save_checkpoint(out / "last.pt", policy.model, optimizer, scheduler, step + 1,
                                       extra={"zrr": zrr.values}, config=args, trainable_only=ref == "lora")

    if total > 0:
        for split, (records, meteor) in evals.items():
            results[f"{split}_after"] = evaluate(policy, records, labeler, extractor, args, dist, f"{split}_after",
                                                 meteor)
    if dist.is_main:
        policy.save(out / "final")
        (out / "eval.json").write_text(json.dumps(results, indent=2))
        for split in evals:
            line = " -> ".join(f"macro P/R/F1 {r['ce']['macro_precision']:.3f}/{r['ce']['macro_recall']:.3f}/"
                               f"{r['ce']['macro_f1']:.3f}, FactS {r['facts_reward']:.3f}"
                               for r in (results.get(f"{split}_before"), results.get(f"{split}_after")) if r)
            print(f"{split}: {line}")
    common.cleanup_distributed()
    return results


def main(argv=None):
    train(common.parse_args(Args, argv, __doc__))


if __name__ == "__main__":
    main()
