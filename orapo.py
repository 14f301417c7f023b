"""OraPO: oracle-educated GRPO with a FactScore-based reward (FactS) for radiology report generation.

Paper: "OraPO: Oracle-educated Reinforcement Learning for Data-efficient and Factual Radiology Report
Generation" (Zhuoxiao Chen, Hongyang Yu, Ying Xu, Yadan Luo, Long Duong, Yuan-Fang Li; arXiv:2509.18600).
RL only: a vision-language model samples G reports per study, and GRPO learns from their FactS rewards
(the report's atomic facts checked against the study's ground-truth labels, F-beta weighted to recall).
When every report of a group scores 0, GRPO has no gradient for that study. OraPO tracks how often that
happens (the zero-reward rate, ZRR) and mixes in a DPO loss that prefers the ground-truth report over
each of the G failed samples, weighted by lambda = lambda_min + (lambda_max - lambda_min) * ZRR^p.
`--lambda-min 0 --lambda-max 0` is vanilla GRPO with the same reward and bookkeeping (Fig. 2's baseline).

    python orapo.py                                            # synthetic set, the foundation: 3 CPU-minutes
    python orapo.py --lambda-min 0 --lambda-max 0 --out runs/orapo_grpo   # vanilla GRPO (Fig. 2)
    python orapo.py --train-size 400                           # Table 4's 400-study row
    python orapo.py --facts hf:Qwen/Qwen2.5-1.5B-Instruct      # facts extracted by a local instruction-tuned LM
    python orapo.py --data /data/chexpert_plus/annotation.json --model Qwen/Qwen2.5-VL-3B-Instruct   # one GPU
    torchrun --nproc_per_node=4 orapo.py --data /data/chexpert_plus/annotation.json \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --fsdp

The equations survive in the text only as their numbers and prose: each is reconstructed from the prose around it.
Table 6's values, lost from that text too, are the arXiv v2 version's; every value no version gives is marked "ours".

CE metric (Sec. 4.2): P/R/F1 macro over the 14 labels (the headline: macro F1), positives only.

Equations, and where they are implemented:
    Eq. 1-2  group mean (and std) and advantages              orapo_step() -> common.group_advantages
    Eq. 3-4  PPO ratio (1: one update a rollout), k3 KL       orapo_loss() -> common.grpo_loss
    Eq. 5-7  DPO, length-normalised (LN-DPO, App. A)           orapo_loss() -> dpo_loss()
    Eq. 8    zero-reward indicator z_q of a group              zero_reward_indicator()
    Eq. 9    EMA of z, the zero-reward rate ZRR_q              ZeroRewardRate.update()
    Eq. 10   mixing weight lambda_q                            mixing_weight()
    Eq. 11   (1 - lambda_q) L_GRPO(q) + lambda_q L_DPO(q)      orapo_loss()
    Eq. 12   pairs (ground-truth report, each completion)      with_chosen(), orapo_loss()
    Eq. 13   atomic facts of a report                          SentenceFacts, LLMFacts
    Eq. 14   per-label entailment, contradictions as FP        fact_claims(), facts_counts()
    Eq. 15   F-beta reward                                     facts_reward()
    Sec. 4.1 1,000 studies, balanced labels, complete reports  balanced_subset(), drop_missing_sections()
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from PIL import Image

import common


@dataclass
class Args(common.RunArgs):
    train_size: Annotated[int | None, "[0, inf)"] = None
    """balanced training studies (Sec. 4.1); None: 1,000 for HF models, 250 tiny (4 visits each); 0: all"""
    group_size: Annotated[int, "[2, inf)"] = 8
    """G (not given: ours)"""
    prompts_per_step: Annotated[int, "[1, inf)"] = 4
    """studies per step over all ranks, 4 x G = 32 completions (the paper: "small"; ours)"""
    lr: Annotated[float | None, "[0, 1]"] = None
    """AdamW lr; None: 1e-6 for HF models (App. A: "conservative"; ours), 5e-4 for the tiny model"""
    steps: Annotated[int | None, "[0, inf)"] = None
    """RL steps; None: 3 epochs (TRL's default) for HF models, 250 for the tiny model; 0: evaluate only"""
    sft_steps: Annotated[int | None, "[0, inf)"] = None
    """warm start before RL (the paper: RL only, from a general VLM); None: 0 for HF models and the sandbox's
    foundation (--tiny-start); a random tiny model (it writes no words) learns report text with blank images until it
    stops improving (CONVERGE): fluent, task-naive"""
    max_new_tokens: Annotated[int | None, "[1, inf)"] = None
    """None: 256 (TRL's max_completion_length) for HF models, 96 for the tiny model"""
    loss_type: Literal["dr_grpo", "grpo", "bnpo"] = "dr_grpo"
    """the normaliser, as TRL's loss_type: dr_grpo token sum / (G max_new_tokens) (App. A); advantages are Dr.
    GRPO's r - mean"""
    beta: Annotated[float, "[0, inf)"] = 0.04
    """Eq. 4's KL weight: Sec. 3.2's "dominated by the KL regularizer" needs beta > 0; DeepSeekMath's 0.04 (ours)"""
    lambda_min: Annotated[float, "[0, 1]"] = 0.05
    """Eq. 10's w_min: Table 6 (arXiv v2)"""
    lambda_max: Annotated[float, "[0, 1]"] = 0.15
    """Eq. 10's w_max: Table 6 (arXiv v2); --lambda-min 0 --lambda-max 0: vanilla GRPO"""
    dpo_beta: Annotated[float, "(0, inf)"] = 2.0
    """Eq. 5's beta on per-token mean log-probs (LN-DPO): SimPO's range 2-2.5 (ours)"""
    facts: str = "sentences"
    """Eq. 13's extractor: "sentences" (offline) or "hf:<instruction-tuned LM id or folder>" """
    max_pixels: Annotated[int, "[784, inf)"] = 512 * 512
    """HF models: pixels per view, at most 334 Qwen image tokens (the paper gives none: ours)"""
    grad_accum: Annotated[int, "[1, inf)"] = 1
    """micro-batches a step: the step's completions are sampled at once, the log-prob passes and the loss in parts"""
    fsdp: bool = False
    """torchrun: shard policy and reference over the GPUs (FSDP2), as full fine-tuning of 3B needs on 24 GB"""


# Settings not worth a flag, and our choices where the paper is silent (TRL's GRPOTrainer defaults: the paper
# trains with it)
PROMPT = "You are a radiologist. Look at the chest X-ray and write the findings section of the report."
SECTIONS = ("findings", "impression")  # Sec. 4.1: "we exclude reports with missing sections"
# The paper fine-tunes the whole 3B policy; dict(r=64, alpha=128, dropout=0.05, targets=[...]) trains adapters
LORA = None
HF_EPOCHS = 3  # TRL's default
TINY_STEPS = 250  # the tiny model's RL steps (ours)
MAX_GRAD_NORM = 1.0  # TRL's default
TEMPERATURE = 1.0  # TRL's default
FACTS_BETA = 2.0  # Eq. 15's beta > 1 weights recall; no value given (ours)
FACT_TOKENS = 256  # the hf: extractor's answer length
ZRR_MOMENTUM, ZRR_POWER = 0.5, 2.0  # Eq. 9's EMA momentum m and Eq. 10's sharpening exponent p: Table 6 (arXiv v2)
WARM_START = dict(lr=1e-3, batch_size=32)  # --sft-steps' settings (ours)
# The paper's policy is a general VLM that has never seen the task: on --data synthetic the sandbox's foundation. A
# random tiny model (real data) instead learns to write reports with each view blank (the report text alone),
# validated every 100 steps by the mean token log-likelihood of N_EVAL validation reports, stopped after 3 validations
# without a gain of 0.01 nats
CONVERGE = dict(every=100, patience=3, min_gain=0.01, max_steps=5000)
# Sec. 4.2: "macro-averaged over labels", the unweighted mean over the 14; positives (the benchmark scores label == 1)
CE = dict(headline="macro_f1", uncertain_as=0)
EVAL_EVERY, N_EVAL = 100, 64  # Fig. 2 (right): Pneumonia and Fracture F1 on N_EVAL val studies every EVAL_EVERY steps


# Sec. 4.1: the training subset -----------------------------------------------------------------------
def drop_missing_sections(records: list, sections=SECTIONS) -> list:
    """Drop records whose `name` or `section_name` text field is empty (CheXpert Plus: section_findings,
    section_impression). Fields no record holds as text are not checked: R2Gen's annotation.json has none."""
    fields = [f for n in sections for f in (n, f"section_{n}") if any(isinstance(r.meta.get(f), str) for r in records)]
    keep = [r for r in records if all(isinstance(r.meta.get(f), str) and r.meta[f].strip() for f in fields)]
    if fields and not keep:
        raise ValueError(f"every training report misses one of {fields}")
    return keep


def balanced_subset(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n studies "with a balanced ground-truth label set"; the paper gives no procedure. Ours: repeatedly take a
    random unused study positive (or uncertain) for the label with the fewest positives so far, so rare labels keep
    all their studies. labels (N, 14) -> sorted indices (n,)."""
    pos = common.binarize(labels).astype(bool)  # (N, 14)
    if n <= 0 or n >= len(pos):
        return np.arange(len(pos))
    rng = np.random.default_rng(seed)
    pools = [list(rng.permutation(np.flatnonzero(pos[:, c]))) for c in range(pos.shape[1])]
    taken = np.zeros(len(pos), dtype=bool)
    counts = np.zeros(pos.shape[1])  # (14,) positives taken per label
    while taken.sum() < n:
        for pool in pools:  # drop studies already taken through another label
            while pool and taken[pool[-1]]:
                pool.pop()
        open_labels = [c for c, pool in enumerate(pools) if pool]
        if not open_labels:  # only studies without a positive label are left
            taken[rng.permutation(np.flatnonzero(~taken))[: n - taken.sum()]] = True
            break
        i = pools[min(open_labels, key=lambda k: counts[k])].pop()
        taken[i] = True
        counts = counts + pos[i]
    return np.flatnonzero(taken)


# Eq. 13-15: the FactS reward ----------------------------------------------------------------------------
# Sentence and clause ends; a clause cut never takes a negation or hedge from its finding: the rule labeler
# scopes its cues by the same words (common.RuleLabeler.TERMINATORS).
_SENTENCE_END = re.compile(r"(?<!\d)\.(?!\d)|;|\n")
_CLAUSE_END = re.compile(r",?\s*\b(?:but|however|although|whereas|except)\b", flags=re.IGNORECASE)


class SentenceFacts:
    """Eq. 13 offline: a report's facts are its sentences, cut at contrast words ("No effusion, but a small
    pneumothorax." -> two facts). The paper prompts GPT-4.1."""

    def __call__(self, reports: list[str]) -> list[list[str]]:
        facts = []
        for report in reports:
            clauses = [c for s in _SENTENCE_END.split(report) for c in _CLAUSE_END.split(s)]
            facts.append([c.strip(" ,:-") for c in clauses if re.search(r"[a-zA-Z]", c)])
        return facts


FACT_PROMPT = (
    "List the atomic clinical facts stated in this chest X-ray report, one per line: a finding with its "
    "attributes (e.g. 'linear atelectasis at the left base') or an explicit absence (e.g. 'no pleural "
    "effusion'). Write only the facts.\n\nReport: {report}"
)


class LLMFacts:
    """Eq. 13 with a local instruction-tuned LM (`--facts hf:<id or folder>`): GPT-4.1's step done offline, greedy,
    one fact per answer line (list markers removed). The labeler then labels each fact (Eq. 14)."""

    def __init__(self, name=None, device="cpu", model=None, tokenizer=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = tokenizer or AutoTokenizer.from_pretrained(name)
        self.model = (model or AutoModelForCausalLM.from_pretrained(name)).to(device).eval()
        self.tok.padding_side = "left"
        self.tok.pad_token = self.tok.pad_token or self.tok.eos_token

    @torch.no_grad()
    def __call__(self, reports: list[str]) -> list[list[str]]:
        ask = [FACT_PROMPT.format(report=r) for r in reports]
        if self.tok.chat_template:
            chats = [[{"role": "user", "content": a}] for a in ask]
            ask = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        enc = self.tok(ask, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        ids = self.model.generate(
            **enc, max_new_tokens=FACT_TOKENS, do_sample=False, pad_token_id=self.tok.pad_token_id
        )
        answers = self.tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        facts = []
        for report, answer in zip(reports, answers):
            lines = [re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", x).strip() for x in answer.splitlines()]
            facts.append([x for x in lines if re.search(r"[a-zA-Z]", x)] if report.strip() else [])
        return facts


def fact_claims(fact_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 14, one report: its F facts' labels (F, 14) -> the labels it claims present (positive or uncertain) and
    those it claims absent, (14,) bool each. No Finding is decided per report (CheXpert's rule over the claims)."""
    present = np.zeros(len(common.CHEXPERT_LABELS), dtype=bool)
    absent = np.zeros(len(common.CHEXPERT_LABELS), dtype=bool)
    if len(fact_labels) == 0:  # no facts, no claims
        return present, absent
    F = len(common.FINDINGS)  # the 13 findings come first
    nf = common.LABEL_INDEX["No Finding"]
    present[:F] = np.isin(fact_labels[:, :F], (common.POSITIVE, common.UNCERTAIN)).any(0)
    absent[:F] = (fact_labels[:, :F] == common.NEGATIVE).any(0)
    present[nf] = common.apply_no_finding_rule(np.where(present, common.POSITIVE, np.nan))[nf] == common.POSITIVE
    return present, absent


def facts_counts(present: np.ndarray, absent: np.ndarray, gt_positive: np.ndarray) -> tuple[int, int, int]:
    """Eq. 14 -> TP, FP, FN over the 14 labels. A claim the ground truth does not hold is a false positive; so is
    a claimed absence of a label it holds ("explicit contradictions to y_c are treated as false positives"), a miss
    too."""
    tp = present & gt_positive
    fp = (present & ~gt_positive) | (absent & gt_positive)
    fn = gt_positive & ~present
    return int(tp.sum()), int(fp.sum()), int(fn.sum())


def facts_reward(
    completions: list[str], gt_labels: np.ndarray, extractor, labeler, beta: float = FACTS_BETA, eps: float = 1e-8
) -> tuple[np.ndarray, dict]:
    """FactS: completions and their studies' ground truth (N, 14) -> rewards (N,) in [0, 1], stats. Uncertain
    ground truth counts as present. A report with no ground-truth label right scores exactly 0."""
    facts = extractor(completions)  # Eq. 13: N lists of facts
    flat = [f for fs in facts for f in fs]
    labels = labeler(flat) if flat else np.empty((0, len(common.CHEXPERT_LABELS)))  # (F_total, 14) each fact's labels
    gt_positive = common.binarize(gt_labels).astype(bool)  # (N, 14)
    P, R = np.zeros(len(facts)), np.zeros(len(facts))  # (N,) precision and recall
    start = 0  # report n's facts are labels[start : start + len(facts[n])]
    for n, fs in enumerate(facts):
        tp, fp, fn = facts_counts(*fact_claims(labels[start : start + len(fs)]), gt_positive[n])  # Eq. 14
        start += len(fs)
        P[n] = tp / (tp + fp) if tp + fp else 0.0
        R[n] = tp / (tp + fn) if tp + fn else 0.0
    rewards = (1 + beta**2) * P * R / (beta**2 * P + R + eps)  # Eq. 15: F-beta, beta > 1 weights recall
    return rewards, {
        "facts_precision": float(P.mean()),
        "facts_recall": float(R.mean()),
        "facts_per_report": len(flat) / max(1, len(facts)),
    }


# Eq. 8-10: the zero-reward rate and the mixing weight -----------------------------------------------------
def zero_reward_indicator(rewards: torch.Tensor, G: int) -> np.ndarray:
    """Eq. 8: z_q = 1 when every reward of prompt q's group is 0, else 0. (B*G,) -> (B,)."""
    return (rewards.view(-1, G) == 0).all(1).float().cpu().numpy()


class ZeroRewardRate:
    """Eq. 9, ZRR_q <- m ZRR_q + (1 - m) z_q, per prompt (study id). The paper also allows one rate per minibatch;
    we keep both: the minibatch rate (an EMA of the batch's zero-group fraction, from 0) is where a study starts
    on its first visit, so a study seen once still gets a lambda that says how it did against how all do. m 0.5
    "reacts quickly to persistent failures" (3 failures in a row: ZRR 0.88, lambda 0.127 of Table 6's 0.05-0.15)
    and, with p = 2, falls back "toward lambda_min" on one success (ZRR 0.44: lambda 0.069). Under torchrun every
    rank applies every rank's z in rank order, so all hold the same state (a study can land on another rank next
    epoch) and any rank's is the checkpoint's."""

    def __init__(self, momentum: float):
        assert 0 <= momentum < 1, momentum
        self.m = momentum
        self.values = {}  # study id -> ZRR, and "minibatch" -> the minibatch rate

    def update(self, ids: list[str], z: np.ndarray) -> np.ndarray:
        """This rank's z (B,) for its studies `ids` -> their ZRR after this step (B,)."""
        m = self.m
        pairs = [p for rank in common.all_gather_objects(list(zip(ids, z.tolist()))) for p in rank]
        prior = self.values.get("minibatch", 0.0)
        for key, z_q in pairs:
            self.values[key] = m * self.values.get(key, prior) + (1 - m) * z_q  # Eq. 9
        z_minibatch = float(np.mean([z_q for _, z_q in pairs]))
        self.values["minibatch"] = m * prior + (1 - m) * z_minibatch  # Eq. 9, minibatch scope
        return np.array([self.values[k] for k in ids])


def mixing_weight(zrr: np.ndarray, lambda_min: float, lambda_max: float, p: float) -> np.ndarray:
    """Eq. 10: lambda_q = lambda_min + (lambda_max - lambda_min) ZRR_q^p, bounded and monotonic."""
    return lambda_min + (lambda_max - lambda_min) * np.power(zrr, p)


# Eq. 11-12: the OraPO objective and the update step ---------------------------------------------------
def dpo_loss(
    policy_chosen,
    policy_rejected,
    ref_chosen,
    ref_rejected,
    beta=0.1,
    length_normalize=False,
    chosen_mask=None,
    rejected_mask=None,
):
    """Sigmoid DPO loss (Rafailov et al. 2023, Eq. 7), mean over N pairs -> (loss, stats). Log-probs per token (N, T)
    with their side's mask, or sequence totals (N,) without one. log pi(y|x) sums the tokens (TRL's "sigmoid");
    length_normalize takes their mean (TRL's "sigmoid_norm"): the margin is |y| times smaller; beta must exceed 0.1."""

    def seq_logp(lp, m):
        """(N, T) with a mask -> (N,); (N,) as it is."""
        if m is None:
            return lp
        total = (lp * m.to(lp.dtype)).sum(-1)  # (N,)
        return total / m.sum(-1).clamp(min=1) if length_normalize else total

    c, ref_c = seq_logp(policy_chosen, chosen_mask), seq_logp(ref_chosen, chosen_mask)  # (N,)
    r, ref_r = seq_logp(policy_rejected, rejected_mask), seq_logp(ref_rejected, rejected_mask)  # (N,)
    # DPO Eq. 7: L = -log sigmoid(beta * ((log pi_c - log ref_c) - (log pi_r - log ref_r)))
    chosen_reward, rejected_reward = beta * (c - ref_c), beta * (r - ref_r)  # (N,) implicit rewards, Sec. 5
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


def orapo_loss(
    logp,
    ref_logp,
    advantages,
    mask,
    lambdas,
    G: int,
    chosen_logp=None,
    ref_chosen_logp=None,
    chosen_mask=None,
    *,
    beta: float = 0.0,
    loss_type: str = "dr_grpo",
    max_len: int | None = None,
    dpo_beta: float = 2.0,
):
    """Eq. 11: L = (1/B) sum_q [(1 - lambda_q) L_GRPO(q) + lambda_q L_DPO(q)] -> (loss, stats).
    logp, ref_logp, mask (B*G, T): the sampled completions, groups contiguous; advantages (B*G,); lambdas (B,).
    chosen_logp, ref_chosen_logp, chosen_mask (B, Tc): each prompt's ground-truth report, or None (lambdas all 0).
    L_GRPO(q) is common.grpo_loss on the group: with every lambda 0 this is grpo_loss over the batch (dr_grpo's
    normaliser G * max_len is one constant). L_DPO(q) is LN-DPO (dpo_loss with per-token means) over q's
    G pairs: with every lambda 1, dpo_loss over all B*G pairs. Eq. 3's ratio is 1 and its clip never acts: one update
    per rollout (common.grpo_loss says why)."""
    if chosen_logp is None and bool((lambdas != 0).any()):
        raise ValueError("lambda > 0 needs the ground-truth report's log-probs (chosen_logp)")
    l_grpo, l_dpo, acc, stats = [], [], [], []
    for q in range(len(lambdas)):
        g = slice(q * G, (q + 1) * G)
        ref_g = None if ref_logp is None else ref_logp[g]
        loss, s = common.grpo_loss(
            logp[g], ref_g, advantages[g], mask[g], beta=beta, loss_type=loss_type, max_completion_length=max_len
        )  # Eq. 3-4
        l_grpo.append(loss)
        if chosen_logp is not None:  # Eq. 12: y+ the ground-truth report, y- each of the G completions
            loss, d = dpo_loss(
                chosen_logp[q : q + 1].expand(G, -1),
                logp[g],
                ref_chosen_logp[q : q + 1].expand(G, -1),
                ref_logp[g],
                dpo_beta,
                length_normalize=True,
                chosen_mask=chosen_mask[q : q + 1].expand(G, -1),
                rejected_mask=mask[g],
            )  # Eq. 5-7
            l_dpo.append(loss)
            acc.append(d["accuracy"])
            s.update(dpo_accuracy=d["accuracy"], dpo_margin=d["reward_margin"])
        stats.append(s)
    l_grpo = torch.stack(l_grpo)  # (B,)
    l_dpo = torch.stack(l_dpo) if l_dpo else torch.zeros_like(l_grpo)  # (B,)
    lam = torch.as_tensor(lambdas, dtype=l_grpo.dtype, device=l_grpo.device)  # (B,)
    loss = ((1 - lam) * l_grpo + lam * l_dpo).mean()  # Eq. 11
    out = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
    return loss, {
        **out,
        "grpo_loss": l_grpo.mean().item(),
        "dpo_loss": l_dpo.mean().item(),
        "dpo_accuracy_q": np.array(acc),
    }


def with_chosen(policy, roll: common.Rollout, reports: list[str], G: int) -> common.Rollout:
    """Eq. 12's pairs in one pass: each study's G completions, then its ground-truth report (the preferred answer) as
    row G of its G + 1, all right-padded to one length, so that the policy's and the reference's log-probs of both come
    from one forward each (the study's prompt and views once)."""
    c_ids, c_mask = policy.encode_targets(reports)  # (B, Tc)
    B, T = len(reports), max(roll.completion_ids.shape[1], c_ids.shape[1])

    def rows(samples, chosen, pad):  # (B*G, T1), (B, Tc) -> (B*(G+1), T)
        samples = torch.nn.functional.pad(samples, (0, T - samples.shape[1]), value=pad).view(B, G, T)
        chosen = torch.nn.functional.pad(chosen, (0, T - chosen.shape[1]), value=pad)
        return torch.cat([samples, chosen[:, None]], 1).view(B * (G + 1), T)

    ids = rows(roll.completion_ids, c_ids, policy.pad_token_id)
    mask = rows(roll.completion_mask, c_mask.to(roll.completion_mask.dtype), 0)
    texts = [t for q in range(B) for t in (*roll.texts[q * G : (q + 1) * G], reports[q])]
    rewards = torch.cat([roll.rewards.view(B, G), roll.rewards.new_zeros(B, 1)], 1).view(-1)  # the chosen's: unused
    apart = torch.tensor([G, roll.completion_ids.shape[1], c_ids.shape[1]])  # the tiny model scores the two apart
    prompts = roll.prompts | {"apart": apart} if isinstance(policy, common.TinyPolicy) else roll.prompts
    return common.Rollout(prompts, ids, mask, texts, rewards)


def samples_and_chosen(x, mask, G: int):
    """(B*(G+1), T) rows of with_chosen -> the completions' (B*G, T1) and the ground truths' (B, T2), each as wide as
    its longest (as before with_chosen padded them to one width: the losses then sum the same numbers in the same
    order, and the sandbox's numbers do not move)."""
    x, mask = x.view(-1, G + 1, x.shape[-1]), mask.view(-1, G + 1, mask.shape[-1])
    widths = int(mask[:, :G].sum(-1).max()), int(mask[:, G].sum(-1).max())
    return x[:, :G, : widths[0]].reshape(-1, widths[0]), x[:, G, : widths[1]]


def orapo_step(policy, rows: common.Rollout, ref_logp, lam, z, G: int, dpo: bool, **loss_settings):
    """The loss of one rollout (or one micro-batch of its groups) in the paper's order, Eq. 1-2 -> 12 -> 11, at the
    mixing weights `lam` (B,) that Eq. 8-10 gave its studies (z (B,): Eq. 8's indicator, for the DPO accuracy on
    zero-reward groups). rows: the G completions of each study, and with dpo (lambda_max > 0; else GRPO alone) its
    ground-truth report as row G (with_chosen); ref_logp: pi_ref of the same rows."""
    logp = policy.completion_logprobs(rows.prompts, rows.completion_ids, rows.completion_mask, TEMPERATURE)  # (N, T)
    mask, rewards, chosen = rows.completion_mask, rows.rewards, {}
    if dpo:  # Eq. 12: the ground-truth report is the preferred answer (the prompt asks for it)
        (logp, chosen_logp), (ref_logp, ref_chosen_logp) = (samples_and_chosen(x, mask, G) for x in (logp, ref_logp))
        mask, chosen_mask = samples_and_chosen(mask, mask, G)
        rewards = rewards.view(-1, G + 1)[:, :G].reshape(-1)
        chosen = dict(chosen_logp=chosen_logp, chosen_mask=chosen_mask, ref_chosen_logp=ref_chosen_logp)  # (B, T)
    A = common.group_advantages(rewards, G, scale="none")  # Eq. 1-2 as Dr. GRPO (App. A): r - mean, (B*G,)
    loss, stats = orapo_loss(logp, ref_logp, A, mask, lam, G, **chosen, **loss_settings)  # Eq. 11
    acc = stats.pop("dpo_accuracy_q")
    # DPO accuracy on zero-reward groups: sum this over steps and divide by zero_group_ratio's sum
    stats["dpo_accuracy_x_zero"] = float((acc * z).mean()) if len(acc) else 0.0
    return loss, {**stats, "reward": rewards.mean().item(), "length": mask.sum(1).mean().item()}


# Training -------------------------------------------------------------------------------------------
def train(args: Args) -> dict:
    if not 0 <= args.lambda_min <= args.lambda_max <= 1:
        raise ValueError(f"need 0 <= --lambda-min <= --lambda-max <= 1, got {args.lambda_min}, {args.lambda_max}")
    if not (args.facts == "sentences" or args.facts.startswith("hf:") and len(args.facts) > 3):
        raise ValueError(f"--facts must be 'sentences' or 'hf:<model id or folder>', got {args.facts!r}")
    notes = []
    if args.facts == "sentences":
        notes.append(
            "FactS (Eq. 13-14): a report's facts are its sentences and clauses labelled by the "
            "labeler, not GPT-4.1's atomic facts and entailment (--facts hf:<id> asks a local LM)"
        )
    dpo, tokens = args.lambda_max > 0, args.max_new_tokens or 256  # a step's shape on a GPU: the memory check
    rows = args.group_size + (1 if dpo else 0)  # with_chosen: the ground truth in the same pass
    step = common.StepShape(args.prompts_per_step, rows, tokens, args.grad_accum, fsdp=args.fsdp)
    step = dataclasses.replace(step, reference=not LORA and (dpo or args.beta > 0), lora=LORA)
    warm = dataclasses.replace(step, studies=WARM_START["batch_size"], rows=1, grad_accum=1, rollout=False)
    run = common.start_run(args, notes=notes, memory=(step, warm) if args.sft_steps else (step,))
    common.seed_everything(args.seed)  # the same initial weights and draws on every rank
    per_process = run.per_rank(args.prompts_per_step, "--prompts-per-step")  # fail now, not after a warm start
    common.exact_div(per_process, args.grad_accum, "--prompts-per-step per process / --grad-accum")
    zrr = ZeroRewardRate(ZRR_MOMENTUM)
    tiny = args.model == "tiny"
    lr = args.lr if args.lr is not None else (5e-4 if tiny else 1e-6)
    max_new = args.max_new_tokens or (96 if tiny else 256)
    train_size = args.train_size if args.train_size is not None else (250 if tiny else 1000)

    # Sec. 4.1: complete reports, then a label-balanced subset. The labels are the labeler's on the reference
    # reports (the paper: the CheXpert labeller), labelled on rank 0 and shared, and are FactS's ground truth y.
    pool = drop_missing_sections(run.data["train"])
    y = common.broadcast_object(run.labeler([r.report for r in pool]) if run.is_main else None)  # (N, 14)
    keep = balanced_subset(y, train_size, args.seed)
    train_set = [pool[i] for i in keep]
    gt = {pool[i].id: y[i] for i in keep}  # study id -> y (14,)
    extractor = SentenceFacts() if args.facts == "sentences" else LLMFacts(args.facts[3:], run.device)

    # RL only (Sec. 4.1), from the sandbox's foundation (a general VLM's stand-in); a random tiny model first learns
    # report text with blank images (task-naive, image-blind: what a general VLM knows of the text, nothing more)
    blind = tiny and args.sft_steps is None and run.foundation is None

    def fluency(stage, policy, step):
        """The blind warm start's validation: the mean token log-likelihood of N_EVAL validation reports."""
        records = run.data["val"][:N_EVAL]
        images = [[Image.new("L", (64, 64))] for _ in records]
        with torch.no_grad():
            return -policy.sft_loss(policy.prompt_batch(images, PROMPT), [r.report for r in records]).item()

    warm_start = dict(WARM_START, steps=args.sft_steps or 0, prompt=PROMPT, blind=blind, validate=fluency)
    warm_start["converge"] = common.Convergence(**CONVERGE) if blind else None
    warm = warm_start["steps"] > 0 or warm_start["converge"] is not None  # the sandbox's Base: SFT before RL
    reports = [r.report for r in train_set]
    policy = common.initial_policy(run, reports, max_new, max_pixels=args.max_pixels, fsdp=args.fsdp and not warm)
    if warm:
        policy = common.warm_start(run, policy, train_set, warm_start, LORA, args.max_pixels, fsdp=args.fsdp)
    reference = args.lambda_max > 0 or args.beta > 0  # DPO and the KL use it
    policy, ref = common.for_training(run, policy, lora=LORA, reference=reference, fsdp=args.fsdp)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    total = args.steps
    if total is None:
        total = TINY_STEPS if tiny else HF_EPOCHS * len(train_set) // args.prompts_per_step
    # AdamW with linear decay, no warm-up, no weight decay: TRL's defaults (the paper names only the lr)
    optimizer, scheduler = common.adamw(params, lr, total, "linear", weight_decay=0.0)
    warm = f"blind, until validation stops improving ({CONVERGE})" if blind else args.sft_steps or 0
    run.record(lr=lr, steps=total, max_new_tokens=max_new, train_size=len(train_set), sft_steps=warm)
    common.seed_everything(args.seed, run.rank)  # ranks sample apart from here
    run.restore(policy.model, optimizer, scheduler, state=zrr.values)  # the ZRR state is in every checkpoint

    def evaluate(records, name):
        """Greedy reports; CE metrics (Sec. 4.2: macro), and FactS."""

        def score(rows, labeler):
            gt_labels = labeler([r["reference"] for r in rows])  # (N, 14)
            reward, stats = facts_reward([r["generated"] for r in rows], gt_labels, extractor, labeler)
            for row, value in zip(rows, reward):
                row["facts_reward"] = float(value)
            return {"facts_reward": float(reward.mean()), **stats}

        return run.evaluate(policy, records, name, PROMPT, max_new, score=score, ce=CE)

    results = {"test_before": evaluate(run.data["test"], "test_before")}
    batches = run.study_batches(train_set, args.prompts_per_step, "--prompts-per-step")
    G, dpo = args.group_size, args.lambda_max > 0  # dpo: Eq. 11 mixes DPO in (lambda_max 0: GRPO alone)
    settings = dict(beta=args.beta, loss_type=args.loss_type, max_len=max_new, dpo_beta=args.dpo_beta)  # Eq. 4, 11, 5
    for step, batch in run.steps(total, batches, "OraPO", bar=("reward", "zero_group_ratio", "lambda", "loss")):
        labels = common.LabelCache(run.labeler)  # each distinct fact labelled once this step
        # separate autocast blocks, as mrg_r1.py says why: the rollout's no_grad casts must not serve the loss's forward
        with run.autocast():
            roll = common.rollout(policy, batch["images"], PROMPT, G, max_new, TEMPERATURE)  # once a step
        y = np.repeat(np.stack([gt[i] for i in batch["id"]]), G, axis=0)  # (B*G, 14) each completion's study's
        rewards = facts_reward(roll.texts, y, extractor, labels)[0]  # Eq. 13-15: FactS against the ground truth
        roll.rewards = torch.as_tensor(rewards, dtype=torch.float32, device=roll.completion_ids.device)  # (B*G,)
        z = zero_reward_indicator(roll.rewards, G)  # Eq. 8, (B,)
        zrr_q = zrr.update(batch["id"], z)  # Eq. 9, (B,) with every rank's studies
        lam = mixing_weight(zrr_q, args.lambda_min, args.lambda_max, ZRR_POWER)  # Eq. 10, (B,)
        run.log(zero_group_ratio=z.mean(), zrr=zrr_q.mean(), **{"lambda": lam.mean()})
        micros = common.micro_batches(policy, roll, args.grad_accum, G)  # --grad-accum: the passes in parts
        studies = common.split_batch(batch, args.grad_accum)
        for k, (micro, mine) in enumerate(zip(micros, studies)):
            q = slice(k * len(mine["id"]), (k + 1) * len(mine["id"]))  # the micro-batch's studies
            rows = with_chosen(policy, micro, mine["report"], G) if dpo else micro  # Eq. 12: + the ground truths
            with common.gradient_sync(policy.forward_module, last=k == len(micros) - 1):
                with run.autocast():
                    ref_logp = common.reference_logprobs(ref, rows, TEMPERATURE)  # pi_ref of the rows, Eq. 4 and 5
                with run.autocast():
                    loss, stats = orapo_step(policy, rows, ref_logp, lam[q], z[q], G, dpo, **settings)
                (loss / args.grad_accum).backward()  # the last micro-batch's averages the gradients over ranks
            run.log(loss=loss.item(), **stats)
        grad_norm = common.clip_gradients(params, MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.log(grad_norm=grad_norm)
        if (step + 1) % EVAL_EVERY == 0 and step + 1 < total:  # Fig. 2 (right): F1 of hard labels over checkpoints
            ce = evaluate(run.data["val"][:N_EVAL], f"val_step{step + 1}")["ce"]
            run.log(
                val_macro_f1=ce["macro_f1"],
                **{f"val_f1_{k.lower()}": ce["per_label"][k]["f1"] for k in ("Pneumonia", "Fracture")},
            )
        run.log_step(step)  # metrics.jsonl: this step's line
        run.checkpoint(step)  # last.pt every 50 steps, at the last step and on Ctrl-C
    if total > 0:  # with --steps 0 the "before" evaluation is the result
        results["test_after"] = evaluate(run.data["test"], "test_after")
    if run.is_main:
        for key, r in results.items():
            pr = f"{r['ce']['macro_precision']:.3f}/{r['ce']['macro_recall']:.3f}"
            print(f"{key}: FactS {r['facts_reward']:.3f}, macro P/R {pr}, {common.summary(r)}")
    return run.finish(results, policy)


def main(argv=None):
    return common.run_main(train, Args, argv, __doc__)


if __name__ == "__main__":
    main()
