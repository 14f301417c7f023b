"""MRG-R1: semantic-driven reinforcement learning for medical report generation.

Paper: "MRG-R1: Reinforcement Learning for Clinically Aligned Medical Report Generation"
(../shared/papers/mrg_r1.txt). A vision-language model samples G reports per study; each is
scored by a margin CheXbert cosine similarity (MCCS) between the signed label vectors of the
generated and the reference report, plus a small reward for the "<think>...</think>
<report>...</report>" structure; GRPO turns the group's rewards into advantages and updates
the policy under a KL penalty to a frozen reference. Only the text inside <report> is the
report that is scored and evaluated.

    python mrg_r1.py                                  # synthetic set, tiny model, a few minutes on CPU
    torchrun --nproc_per_node=4 mrg_r1.py --data /data/mimic_cxr/annotation.json \\
        --model FreedomIntelligence/HuatuoGPT-Vision-7B-Qwen2.5VL --labeler chexbert --dtype bf16

Equations, and where they are implemented:
    Eq. 1  GRPO objective (clipped ratio, KL to the reference)   train() -> common.grpo_loss
    Eq. 2  group advantages, population std with eps inside      grpo_advantages()
    Eq. 3-4 signed label vectors over 13 observations            signed_label_vectors()
    Eq. 5  CheXbert cosine similarity (CCS)                      mccs()
    Eq. 6  margin shaping max((CCS - m) / (1 - m), 0)            mccs()
    Sec. III-B1 format reward                                    format_reward()
    Sec. IV total reward 0.75 MCCS + 0.25 format, ablations      total_reward()
"""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import common


@dataclass
class Args:
    data: str = "synthetic"  # "synthetic" or an annotation.json (R2Gen layout) / CSV / JSONL
    model: str = "tiny"  # "tiny" or a Hugging Face VLM id/path (the paper: HuatuoGPT-Vision-7B-Qwen2.5VL)
    labeler: str = "rule"  # "rule" (offline) or "chexbert" (the paper's labeler)
    chexbert_weights: str | None = None  # local chexbert.pth (else downloaded once)
    out: str = "runs/mrg_r1"
    seed: int = 0
    device: str = "auto"
    dtype: str = "fp32"  # fp32 | bf16 | fp16 | auto
    resume: bool = False  # continue from out/last.pt
    # Algorithm (paper Sec. IV-A unless said otherwise)
    reward: str = "mccs+format"  # mccs+format (the paper), mccs, ce_f1, ce_f1+format, nlg, format (Table II)
    margin: float = 0.5  # Eq. 6 margin m: the paper gives no value ("moderate m"); our choice
    both_empty_reward: float = 0.0  # Eq. 5 gives CCS = 0 when neither report mentions a finding; 1.0 = agree
    format_partial: float = 0.5  # credit for a minor format violation (the paper names no value)
    group_size: int = 4  # G (paper)
    prompts_per_step: int = 4  # 4 prompts x G = 16 completions: the paper's effective batch of 16
    grad_accum: int = 1  # micro-batches per step (prompts_per_step is split among them)
    beta: float = 0.04  # KL weight: Eq. 1 has beta >= 0 without a value; DeepSeekMath's 0.04
    clip_eps: float = 0.2  # Eq. 1 epsilon (not given: PPO's 0.2)
    adv_eps: float = 1e-6  # Eq. 2 epsilon, "on the order of 1e-8 to 1e-6"
    lr: float | None = None  # None: 5e-6 (paper) for HF models, 1e-4 for the tiny model
    weight_decay: float = 0.1  # paper
    warmup_ratio: float = 0.1  # cosine schedule with 10 % warm-up (paper)
    max_grad_norm: float = 0.1  # paper
    epochs: float = 1.0  # paper: one epoch
    steps: int | None = None  # overrides epochs
    max_new_tokens: int | None = None  # None: 256 for HF models, 128 for the tiny model
    temperature: float = 1.0
    lora_r: int = 128  # paper; LoRA on attention and MLP projections of HF models
    lora_alpha: float = 256.0  # paper
    lora_dropout: float = 0.05  # paper
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    sft_steps: int | None = None  # warm start: None = 600 for the tiny model, 0 for HF (the paper starts from a medical VLM)
    sft_lr: float = 1e-3
    sft_batch_size: int = 32  # studies per rank per warm-start step
    eval_every: int = 100  # held-out reward on val studies every N steps
    n_eval: int = 64  # val studies for that check
    log_every: int = 10


PROMPT = ("You are a radiologist. Look at the chest X-ray, reason about the findings inside "
          "<think> </think>, then write the findings section of the report inside <report> </report>.")
TAGS = ("<think>", "</think>", "<report>", "</report>")


# Sec. III-B1: format reward --------------------------------------------------------------------
def format_reward(text: str, partial: float = 0.5) -> float:
    """1 when <think>, </think>, <report>, </report> each appear once, in that order, with
    non-empty sections and nothing outside them; `partial` for a minor violation (text outside
    the tags, or an empty <think>); 0 when a tag is missing, repeated or out of order, or the
    report is empty. The paper gives "partial credit for minor violations" without a value."""
    positions = []
    for tag in TAGS:
        if text.count(tag) != 1:
            return 0.0
        positions.append(text.index(tag))
    if positions != sorted(positions):
        return 0.0
    think = text[positions[0] + len(TAGS[0]):positions[1]].strip()
    between = text[positions[1] + len(TAGS[1]):positions[2]].strip()
    report = text[positions[2] + len(TAGS[2]):positions[3]].strip()
    outside = (text[:positions[0]] + text[positions[3] + len(TAGS[3]):]).strip()
    if not report:
        return 0.0
    return 1.0 if think and not between and not outside else partial


def extract_report(text: str) -> str:
    """The text inside the first <report>...</report> (the only part scored); "" without one."""
    m = re.search(r"<report>(.*?)</report>", text, flags=re.S)
    return m.group(1).strip() if m else ""


# Eq. 3-6: margin CheXbert cosine similarity -----------------------------------------------------
def signed_label_vectors(labels: np.ndarray) -> np.ndarray:
    """Eq. 3-4: labels (N, 14) with 1 / 0 / -1 / NaN -> z (N, 13) with f(pos) = 1, f(neg) = -1,
    f(uncertain) = 1, f(blank) = 0, over the 13 observations without No Finding."""
    labels = labels[:, [i for i, name in enumerate(common.CHEXPERT_LABELS) if name != "No Finding"]]
    z = np.zeros_like(labels)  # blank -> 0
    z[labels == 1] = 1.0  # positive
    z[labels == -1] = 1.0  # uncertain counts as suspicion
    z[labels == 0] = -1.0  # negative
    return z


def mccs(hyp_labels: np.ndarray, ref_labels: np.ndarray, margin: float, both_empty: float = 0.0,
         eps: float = 1e-8) -> np.ndarray:
    """Margin CheXbert cosine similarity of each generated/reference pair -> (N,) in [0, 1]."""
    if not -1 < margin < 1:
        raise ValueError(f"--margin must lie in (-1, 1) (Eq. 6), got {margin}")
    z, z_ref = signed_label_vectors(hyp_labels), signed_label_vectors(ref_labels)  # (N, 13)
    # Eq. 5: CCS = <z, z*> / ((||z|| + eps)(||z*|| + eps))
    ccs = (z * z_ref).sum(1) / ((np.linalg.norm(z, axis=1) + eps) * (np.linalg.norm(z_ref, axis=1) + eps))
    # Eq. 6: MCCS = max((CCS - m) / (1 - m), 0)
    reward = np.maximum((ccs - margin) / (1 - margin), 0.0)
    # Neither report mentions any of the 13 findings: Eq. 5 gives 0; the option says they agree
    empty = ~z.any(1) & ~z_ref.any(1)
    return np.where(empty, both_empty, reward)


def ce_f1_reward(hyp_labels: np.ndarray, ref_labels: np.ndarray) -> np.ndarray:
    """Table II's CE-F1 reward: per-report F1 of the positive (incl. uncertain) labels, 14 labels."""
    h, r = common.binarize(hyp_labels), common.binarize(ref_labels)
    tp = (h & r).sum(1)
    denom = h.sum(1) + r.sum(1)
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)


def total_reward(completions: list[str], references: list[str], labeler, args: Args) -> tuple[np.ndarray, dict]:
    """Sec. IV: 0.75 * clinical + 0.25 * format, or one reward alone (Table II's rows)."""
    parts = args.reward.split("+")
    unknown = set(parts) - {"mccs", "ce_f1", "nlg", "format"}
    if unknown:
        raise ValueError(f"--reward: unknown part(s) {sorted(unknown)}; use mccs, ce_f1, nlg, format joined by '+'")
    reports = [extract_report(c) for c in completions]
    terms = {}
    if "mccs" in parts or "ce_f1" in parts:
        hyp, ref = labeler(reports), labeler(references)
        if "mccs" in parts:
            terms["mccs"] = mccs(hyp, ref, args.margin, args.both_empty_reward)
        if "ce_f1" in parts:
            terms["ce_f1"] = ce_f1_reward(hyp, ref)
    if "nlg" in parts:  # BLEU-4 + ROUGE-L + CIDEr-D per report, CIDEr's df from this batch's references
        per = common.nlg_metrics(reports, references, meteor=False, per_sample=True)["per_sample"]
        terms["nlg"] = np.asarray(per["BLEU-4"]) + np.asarray(per["ROUGE-L"]) + np.asarray(per["CIDEr"])
    if "format" in parts:
        terms["format"] = np.array([format_reward(c, args.format_partial) for c in completions])
    clinical = [t for t in terms if t != "format"]
    if clinical and "format" in terms:
        reward = 0.75 * sum(terms[t] for t in clinical) + 0.25 * terms["format"]
    else:
        reward = sum(terms.values())
    return reward, {k: float(v.mean()) for k, v in terms.items()}


# Eq. 2: group-relative advantages ----------------------------------------------------------------
def grpo_advantages(rewards: torch.Tensor, G: int, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean) / sqrt(mean((r - mean)^2) + eps): the population std with eps inside
    the root, as Eq. 2 writes it (TRL uses Bessel's std + 1e-4 outside: common.group_advantages).
    Identical rewards give exactly 0."""
    r = rewards.view(-1, G)  # (B, G)
    centred = r - r.mean(1, keepdim=True)
    A = centred / torch.sqrt(centred.pow(2).mean(1, keepdim=True) + eps)
    same = (r == r[:, :1]).all(1, keepdim=True)
    return torch.where(same, torch.zeros_like(A), A).flatten()  # (B*G,)


# The model ---------------------------------------------------------------------------------------
def sft_target(report: str, labels: torch.Tensor) -> str:
    """Tiny warm start only: the tagged answer the tiny model learns to write. Its <think> lists
    the reference's positive and uncertain findings (a stand-in: the paper's model reasons on its
    own, and a randomly initialised one cannot)."""
    names = [n for n, v in zip(common.CHEXPERT_LABELS, labels.tolist()) if v in (1.0, -1.0)]
    return f"<think> {', '.join(names).lower() or 'no finding'} </think> <report> {report} </report>"


def build_policy(args: Args, train_records, dist):
    dtype = common.resolve_dtype(args.dtype, dist.device)
    label_words = [n.lower() for n in common.CHEXPERT_LABELS]  # the tiny model's <think> lists findings
    policy = common.make_policy(args.model, [r.report for r in train_records] + label_words, dist.device, dtype,
                                args.max_new_tokens, extra_tokens=TAGS)
    if args.model == "tiny":
        return policy, copy.deepcopy(policy)  # full fine-tuning: the reference is a frozen copy
    common.apply_lora(policy.model, args.lora_targets.split(","), args.lora_r, args.lora_alpha, args.lora_dropout)
    return policy, "lora"  # the reference is the base model with LoRA switched off


def evaluate(policy, records, labeler, args: Args, dist, name: str) -> dict:
    """Greedy reports for `records`: mean reward, and on rank 0 the common metrics + files."""
    completions = common.generate_reports(policy, records, PROMPT, max_new_tokens=args.max_new_tokens,
                                          rank=dist.rank, world_size=dist.world_size, desc=name)
    reward, terms = total_reward(completions, [r.report for r in records], labeler, args)
    rows = [{"id": r.id, "reference": r.report, "generated": extract_report(c), "completion": c}
            for r, c in zip(records, completions)]
    results = common.evaluate_generations(rows, labeler, meteor=False)
    results.update(reward=float(reward.mean()), reward_terms=terms)
    if dist.is_main:
        out = Path(args.out)
        with open(out / f"generations_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        (out / f"eval_{name}.json").write_text(json.dumps(results, indent=2))
    return results


def train(args: Args) -> dict:
    dist = common.setup_distributed(args.device)
    common.seed_everything(args.seed)  # same initial weights on every rank
    tiny = args.model == "tiny"
    args.lr = args.lr or (1e-4 if tiny else 5e-6)
    args.max_new_tokens = args.max_new_tokens or (128 if tiny else 256)
    args.sft_steps = (600 if tiny else 0) if args.sft_steps is None else args.sft_steps
    out = Path(args.out)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        common.save_config(out, args)
    data = common.load_data(args.data)
    train_records, val_records, test_records = data["train"], data["val"][:args.n_eval], data["test"]
    labeler = common.make_labeler(args.labeler, args.chexbert_weights, dist.device)
    policy, ref = build_policy(args, train_records, dist)
    common.broadcast_parameters(policy.model)
    if args.sft_steps and not args.resume:
        common.supervised_finetune(policy, train_records, args.sft_steps, batch_size=args.sft_batch_size, lr=args.sft_lr,
                                   prompt=PROMPT, seed=args.seed, rank=dist.rank, world_size=dist.world_size,
                                   target_fn=lambda b: [sft_target(r, l) for r, l in zip(b["report"], b["labels"])])
        if ref != "lora":
            ref = copy.deepcopy(policy)  # GRPO's reference is the warm-started model
            if dist.is_main:
                ref.save(out / "sft")  # kept for --resume
    elif args.sft_steps and ref != "lora":
        ref = common.TinyPolicy.load(out / "sft", dist.device)
    for p in ([] if ref == "lora" else ref.model.parameters()):
        p.requires_grad_(False)

    # AdamW with betas (0.9, 0.99), weight decay 0.1, cosine schedule with 10 % warm-up (paper)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    per_step = args.prompts_per_step * dist.world_size
    total = args.steps or max(1, int(args.epochs * len(train_records) / per_step))
    warmup = int(args.warmup_ratio * total)
    schedule = lambda s: (s + 1) / max(1, warmup) if s < warmup else \
        0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    common.seed_everything(args.seed, dist.rank)  # ranks sample differently from here on
    start = 0
    if args.resume:  # restores the RNG states too, so sampling continues where it stopped
        start, _ = common.load_checkpoint(out / "last.pt", policy.model, optimizer, scheduler)

    results = {"before": evaluate(policy, val_records, labeler, args, dist, "val_before")} if start == 0 else {}
    batches = common.study_batches(train_records, args.prompts_per_step, args.seed, dist.rank, dist.world_size,
                                   start_step=start)
    micro = args.prompts_per_step // args.grad_accum
    if micro * args.grad_accum != args.prompts_per_step:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is not divisible by --grad-accum {args.grad_accum}")
    with common.RunLog(out, total, dist.is_main, start, desc="MRG-R1 GRPO") as runlog:
        for step in range(start, total):
            _, batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            stats = []
            for k in range(args.grad_accum):
                rows = slice(k * micro, (k + 1) * micro)
                refs = batch["report"][rows]
                reward_fn = lambda texts, owners: total_reward(texts, [refs[o] for o in owners], labeler, args)[0]
                with common.autocast(dist.device, args.dtype):
                    roll = common.rollout(policy, batch["images"][rows], PROMPT, args.group_size, reward_fn,
                                          args.max_new_tokens, args.temperature, ref=ref if args.beta > 0 else "none")
                    A = grpo_advantages(roll.rewards, args.group_size, args.adv_eps)  # Eq. 2
                    logp = policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask,
                                                      args.temperature)
                    # Eq. 1: one update per rollout, so pi_old = pi_theta (detached) and the ratio is 1
                    loss, s = common.grpo_loss(logp, None, roll.ref_logp, A, roll.completion_mask, args.clip_eps,
                                               args.clip_eps, args.beta, loss_type="grpo")
                (loss / args.grad_accum).backward()
                s.update(reward=roll.rewards.mean().item(), loss=loss.item(),
                         length=roll.completion_mask.sum(1).mean().item())
                stats.append(s)
            common.all_reduce_gradients(params, dist.world_size)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            if (step + 1) % args.log_every == 0 or step + 1 == total:
                mean = common.all_reduce_mean({k: np.mean([s[k] for s in stats]) for k in stats[0]})
                runlog.log(step + 1, lr=scheduler.get_last_lr()[0], **mean)
            if (step + 1) % args.eval_every == 0 and step + 1 < total:
                r = evaluate(policy, val_records, labeler, args, dist, "val")
                runlog.log(step + 1, val_reward=r["reward"], val_ce_micro_f1=r["ce"]["micro_f1"])
            if (step + 1) % args.eval_every == 0 or step + 1 == total:
                common.save_checkpoint(out / "last.pt", policy.model, optimizer, scheduler, step + 1)

    results["after"] = evaluate(policy, val_records, labeler, args, dist, "val_after")
    results["test"] = evaluate(policy, test_records, labeler, args, dist, "test")
    if dist.is_main:
        policy.save(out / "final")
        (out / "eval.json").write_text(json.dumps(results, indent=2))
        b, a = results.get("before"), results["after"]
        if b:
            print(f"held-out reward {b['reward']:.3f} -> {a['reward']:.3f}, "
                  f"CE micro F1 {b['ce']['micro_f1']:.3f} -> {a['ce']['micro_f1']:.3f}")
    common.cleanup_distributed()
    return results


def main(argv=None):
    train(common.parse_args(Args, argv, __doc__))


if __name__ == "__main__":
    main()
