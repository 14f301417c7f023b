"""MRG-R1: semantic-driven reinforcement learning for medical report generation.

Paper: "MRG-R1: Reinforcement Learning for Clinically Aligned Medical Report Generation"
(../shared/papers/mrg_r1.txt). A vision-language model samples G reports per study; each is
scored by a margin CheXbert cosine similarity (MCCS) between the signed label vectors of the
generated and the reference report, plus a small reward for the "<think>...</think>
<report>...</report>" structure; GRPO turns the group's rewards into advantages and updates
the policy under a KL penalty to a frozen reference. With the tagged prompt only the text
inside <report> is the report that is scored and evaluated.

    python mrg_r1.py                                  # synthetic set, tiny model, ~10 minutes on CPU
    torchrun --nproc_per_node=2 mrg_r1.py --data /data/mimic_cxr/annotation.json \\
        --model FreedomIntelligence/HuatuoGPT-Vision-7B-Qwen2.5VL --labeler chexbert --dtype bf16
    python mrg_r1.py --model ... --steps 0 --sft-steps 0  # Table II's "Base" row: evaluation only

Equations, and where they are implemented:
    Eq. 1  GRPO objective (clipped ratio, KL to the reference)   policy_loss() -> common.grpo_loss
    Eq. 2  group advantages, population std with eps inside      grpo_advantages()
    Eq. 3-4 signed label vectors over 13 observations            signed_label_vectors()
    Eq. 5  CheXbert cosine similarity (CCS)                      mccs()
    Eq. 6  margin shaping max((CCS - m) / (1 - m), 0)            mccs()
    Sec. III-B1 format reward                                    format_reward()
    Sec. IV-A one sample per view                                split_views()
    Sec. IV-B total reward 0.75 clinical + 0.25 format, Table II total_reward()
    Sec. IV-B cosine schedule with 10 % warm-up                  cosine_with_warmup()
"""
from __future__ import annotations

import copy
import dataclasses
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
    model: str = "tiny"  # "tiny" or a Hugging Face VLM id/path (paper Sec. IV-B: HuatuoGPT-Vision-7B-Qwen2.5VL)
    labeler: str = "rule"  # "rule" (offline) or "chexbert" (the paper's labeler, Sec. III-B2)
    chexbert_weights: str | None = None  # local chexbert.pth (else downloaded once)
    out: str = "runs/mrg_r1"  # output folder
    seed: int = 0  # random seed (rank r uses seed + r after the model is built)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "fp32"  # fp32 | bf16 | fp16 | auto (paper: bf16)
    resume: bool = False  # continue from out/last.pt (the other flags must match out/config.json)
    split_views: bool = True  # paper Sec. IV-A: each view of a multi-view study is its own sample
    # Rewards (paper Sec. III-B and IV-B unless said otherwise)
    reward: str = "mccs+format"  # mccs+format (the paper), mccs, ce_f1, ce_f1+format, nlg, format (Table II rows)
    prompt: str | None = None  # tags | plain; None: tags iff --reward has format (Table II rows without it)
    margin: float = 0.5  # Eq. 6 margin m: the paper gives no value ("moderate m"); our choice
    both_empty_reward: float | None = None  # no finding in either report: None = Eq. 5-6 as written (CCS 0)
    format_partial: float = 0.5  # credit for a minor format violation: Sec. III-B1 names no value; ours
    uncertain_as: int = 1  # CE metrics: uncertain counts as positive (1) or negative (0); paper silent
    meteor: bool = True  # METEOR on the test evaluations (pycocoevalcap's Java jar; skipped with a warning without Java)
    # GRPO (paper Sec. III-A and IV-B unless said otherwise)
    group_size: int = 4  # G (paper Sec. IV-B)
    prompts_per_step: int = 4  # studies per step over ALL ranks: 4 x G = 16 completions, the paper's batch 16
    grad_accum: int = 1  # micro-batches per step on each rank (ours: a memory knob)
    loss_type: str = "grpo"  # grpo (TRL: mean per sequence) | bnpo | dr_grpo (token sum: Eq. 1 per sequence)
    beta: float = 0.04  # KL weight: Eq. 1 has beta >= 0 without a value; DeepSeekMath's 0.04
    clip_eps: float = 0.2  # Eq. 1 epsilon: not given; PPO's 0.2
    adv_eps: float = 1e-6  # Eq. 2 epsilon, "on the order of 1e-8 to 1e-6"
    temperature: float = 1.0  # rollout sampling temperature: paper gives none; 1.0 samples the policy
    max_new_tokens: int | None = None  # None: 256 for HF (ours; may cut think + report), 128 for tiny
    # Optimiser (paper Sec. IV-B unless said otherwise)
    lr: float | None = None  # None: 5e-6 (paper) for HF models, 1e-4 for the tiny model (ours)
    weight_decay: float = 0.1  # paper; applied to every trainable parameter
    warmup_ratio: float = 0.1  # cosine schedule with 10 % warm-up (paper)
    max_grad_norm: float = 0.1  # gradient clipping (paper)
    epochs: float = 1.0  # paper: one epoch
    steps: int | None = None  # RL steps, overrides --epochs; 0 = evaluate only (Table II's Base / Base + SFT)
    lora_r: int = 128  # LoRA rank (paper), HF models only
    lora_alpha: float = 256.0  # LoRA alpha (paper)
    lora_dropout: float = 0.05  # LoRA dropout (paper)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # paper: attention + MLP (LM only)
    # Supervised warm start (Table II's "+ SFT"; the tiny model needs it to earn any reward)
    sft_steps: int | None = None  # None: 600 for the tiny model, 0 for HF (the paper starts RL from a medical VLM)
    sft_lr: float | None = None  # None: 1e-3 tiny, 1e-5 HF (ours: the paper gives no SFT settings)
    sft_batch_size: int = 32  # studies per warm-start step over all ranks (ours)
    # Monitoring
    eval_every: int = 100  # held-out reward on val studies (and a checkpoint) every N steps
    n_eval: int = 64  # val studies (images with --split-views) for those checks
    log_every: int = 10  # a metrics.jsonl line every N steps


PROMPTS = {
    "tags": "You are a radiologist. Look at the chest X-ray, reason about the findings inside "
            "<think> </think>, then write the findings section of the report inside <report> </report>.",
    "plain": "You are a radiologist. Look at the chest X-ray and write the findings section of the report.",
}
TAGS = ("<think>", "</think>", "<report>", "</report>")
REWARD_PARTS = ("mccs", "ce_f1", "nlg", "format")


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
    """The text inside the first <report>...</report>; "" without one."""
    m = re.search(r"<report>(.*?)</report>", text, flags=re.S)
    return m.group(1).strip() if m else ""


def reward_parts(reward: str) -> list[str]:
    parts = reward.split("+")
    unknown = set(parts) - set(REWARD_PARTS)
    if unknown:
        raise ValueError(f"--reward: unknown part(s) {sorted(unknown)}; use {', '.join(REWARD_PARTS)} joined by '+'")
    return parts


def prompt_style(args: Args) -> str:
    """--prompt: "tags" asks for <think>/<report> and scores the text inside <report>; "plain"
    asks for the report and scores the whole completion. Default: tags exactly when the reward
    has the format term (Table II's rows without "+ reasoning" have no tags to ask for)."""
    has_format = "format" in reward_parts(args.reward)
    style = args.prompt or ("tags" if has_format else "plain")
    if style not in PROMPTS:
        raise ValueError(f"--prompt must be one of {sorted(PROMPTS)}, got {style!r}")
    if style == "plain" and has_format:
        raise ValueError(f"--prompt plain with --reward {args.reward}: the plain prompt asks for no tags to reward")
    return style


def report_text(completion: str, style: str) -> str:
    """The part of a completion that is the report: inside <report> (tags), or all of it (plain)."""
    return extract_report(completion) if style == "tags" else completion.strip()


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


def mccs(hyp_labels: np.ndarray, ref_labels: np.ndarray, margin: float, both_empty: float | None = None,
         eps: float = 1e-8) -> np.ndarray:
    """Margin CheXbert cosine similarity of each generated/reference pair -> (N,) in [0, 1].
    both_empty=None keeps the formula where neither report mentions a finding (CCS = 0, so
    MCCS = max(-m / (1 - m), 0): 0 for m >= 0, > 0 for m < 0); a number replaces it there."""
    if not -1 < margin < 1:
        raise ValueError(f"--margin must lie in (-1, 1) (Eq. 6), got {margin}")
    z, z_ref = signed_label_vectors(hyp_labels), signed_label_vectors(ref_labels)  # (N, 13)
    # Eq. 5: CCS = <z, z*> / ((||z|| + eps)(||z*|| + eps))
    ccs = (z * z_ref).sum(1) / ((np.linalg.norm(z, axis=1) + eps) * (np.linalg.norm(z_ref, axis=1) + eps))
    # Eq. 6: MCCS = max((CCS - m) / (1 - m), 0)
    reward = np.maximum((ccs - margin) / (1 - margin), 0.0)
    if both_empty is not None:  # our option: two reports silent on all 13 findings (two normals) agree
        reward = np.where(~z.any(1) & ~z_ref.any(1), both_empty, reward)
    return reward


def ce_f1_reward(hyp_labels: np.ndarray, ref_labels: np.ndarray) -> np.ndarray:
    """Table II's CE-F1 reward: per-report F1 of the positive (incl. uncertain) labels, 14 labels."""
    h, r = common.binarize(hyp_labels), common.binarize(ref_labels)
    tp = (h & r).sum(1)
    denom = h.sum(1) + r.sum(1)
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)


def total_reward(completions: list[str], references: list[str], labeler, args: Args,
                 cider_df=None) -> tuple[np.ndarray, dict]:
    """Sec. IV-B: 0.75 * clinical + 0.25 * format, or one reward alone (Table II's rows).
    cider_df: CIDEr-D document frequencies of the training references, for the nlg reward."""
    parts, style = reward_parts(args.reward), prompt_style(args)
    reports = [report_text(c, style) for c in completions]
    terms = {}
    if "mccs" in parts or "ce_f1" in parts:
        hyp, ref = labeler(reports), labeler(references)  # (N, 14) each
        if "mccs" in parts:
            terms["mccs"] = mccs(hyp, ref, args.margin, args.both_empty_reward)
        if "ce_f1" in parts:
            terms["ce_f1"] = ce_f1_reward(hyp, ref)
    if "nlg" in parts:
        # BLEU-4 + ROUGE-L + CIDEr-D per report (the paper: "BLEU+ROUGE+CIDEr", no weights).
        # CIDEr-D is pycocoevalcap's, x10 (about 0-10 where the others are 0-1), so it dominates.
        if cider_df is None:
            raise ValueError("the nlg reward needs cider_df = common.cider_document_frequency(training reports)")
        per = common.nlg_metrics(reports, references, meteor=False, per_sample=True, cider_df=cider_df)["per_sample"]
        terms["nlg"] = np.asarray(per["BLEU-4"]) + np.asarray(per["ROUGE-L"]) + np.asarray(per["CIDEr"])
    if "format" in parts:
        terms["format"] = np.array([format_reward(c, args.format_partial) for c in completions])
    clinical = [t for t in terms if t != "format"]
    if clinical and "format" in terms:
        reward = 0.75 * sum(terms[t] for t in clinical) + 0.25 * terms["format"]
    else:
        reward = sum(terms.values())
    return reward, {k: float(v.mean()) for k, v in terms.items()}


# Eq. 1-2: GRPO -----------------------------------------------------------------------------------
def grpo_advantages(rewards: torch.Tensor, G: int, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean) / sqrt(mean((r - mean)^2) + eps): the population std with eps inside
    the root, as Eq. 2 writes it (TRL uses Bessel's std + 1e-4 outside: common.group_advantages).
    Identical rewards give exactly 0."""
    r = rewards.view(-1, G)  # (B, G)
    centred = r - r.mean(1, keepdim=True)
    A = centred / torch.sqrt(centred.pow(2).mean(1, keepdim=True) + eps)
    same = (r == r[:, :1]).all(1, keepdim=True)
    return torch.where(same, torch.zeros_like(A), A).flatten()  # (B*G,)


def policy_loss(policy, roll: common.Rollout, args: Args) -> tuple[torch.Tensor, dict]:
    """Eq. 2 advantages and the Eq. 1 loss of one rollout. Eq. 1's ratio is over whole sequences,
    pi(o_i|q); one update per rollout makes pi_old = pi_theta (detached), so the ratio is 1,
    clipping never acts and the gradient is -sum_i A_i grad log pi(o_i|q), which --loss-type
    dr_grpo (token sum / (N * max_new_tokens)) gives up to the constant 1 / max_new_tokens.
    The default grpo weighs each sequence's tokens by 1 / |o_i| (TRL, DeepSeekMath)."""
    A = grpo_advantages(roll.rewards, args.group_size, args.adv_eps)  # (N,) Eq. 2
    logp = policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask,
                                      args.temperature)  # (N, T)
    return common.grpo_loss(logp, None, roll.ref_logp, A, roll.completion_mask, args.clip_eps, args.clip_eps,
                            args.beta, loss_type=args.loss_type, max_completion_length=args.max_new_tokens)


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """Sec. IV-B's schedule as an lr multiplier: linear warm-up over `warmup` steps (step 0
    already trains, at 1 / warmup), then cosine decay from 1 towards 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# Data and model ----------------------------------------------------------------------------------
def split_views(records: list[common.Record]) -> list[common.Record]:
    """Sec. IV-A: "multi-view studies ... are treated as multiple image-report pairs, with each
    image paired to the same report and counted as a separate sample" (ids get _v0, _v1, ...)."""
    out = []
    for r in records:
        if len(r.image_paths) == 1:
            out.append(r)
        else:
            out += [dataclasses.replace(r, id=f"{r.id}_v{v}", image_paths=[p]) for v, p in enumerate(r.image_paths)]
    return out


def sft_target(report: str, labels) -> str:
    """The tagged answer of the warm start. Its <think> lists the reference's positive and
    uncertain findings (a stand-in: the paper's model reasons on its own, and a randomly
    initialised one cannot)."""
    names = [n for n, v in zip(common.CHEXPERT_LABELS, list(labels)) if v in (1.0, -1.0)]
    return f"<think> {', '.join(names).lower() or 'no finding'} </think> <report> {report} </report>"


def sft_targets(batch: dict, labeler, style: str) -> list[str]:
    """Warm-start targets of a batch: the report (plain) or sft_target() (tags). Records without
    labels (real data: all NaN) get the labeler's labels of their reference."""
    if style == "plain":
        return list(batch["report"])
    labels = batch["labels"].numpy().copy()  # (B, 14)
    missing = np.isnan(labels).all(1)
    if missing.any():
        labels[missing] = labeler([r for r, m in zip(batch["report"], missing) if m])
    return [sft_target(r, l) for r, l in zip(batch["report"], labels)]


def add_lora(policy, args: Args):
    """LoRA on the language model's attention and MLP projections; the vision tower (whose MLP
    shares the names) keeps its weights frozen."""
    common.apply_lora(policy.model, args.lora_targets.split(","), args.lora_r, args.lora_alpha, args.lora_dropout,
                      exclude=policy.vision_and_language()[0])


def build_policy(args: Args, train_records, dist, model: str):
    """The policy and its KL reference: the tiny model fine-tunes fully against a frozen copy;
    a HF model trains LoRA adapters and its reference is itself with LoRA switched off."""
    dtype = common.resolve_dtype(args.dtype, dist.device)
    label_words = [n.lower() for n in common.CHEXPERT_LABELS]  # the tiny model's <think> lists findings
    policy = common.make_policy(model, [r.report for r in train_records] + label_words, dist.device, dtype,
                                args.max_new_tokens, extra_tokens=TAGS,
                                n_views=max(len(r.image_paths) for r in train_records))
    if args.model == "tiny":
        return policy, copy.deepcopy(policy)
    add_lora(policy, args)
    return policy, "lora"


def evaluate(policy, records, labeler, args: Args, dist, name: str, cider_df=None, meteor=False) -> dict:
    """Greedy reports for `records`; on rank 0 the mean reward, the common metrics, and
    out/eval_{name}.json + out/generations_{name}.jsonl. Every rank returns the results."""
    completions = common.generate_reports(policy, records, PROMPTS[args.prompt], max_new_tokens=args.max_new_tokens,
                                          rank=dist.rank, world_size=dist.world_size, desc=name)
    results = None
    if dist.is_main:
        cache = common.LabelCache(labeler)  # the reward and the CE metrics label the same texts
        references = [r.report for r in records]
        reward, terms = total_reward(completions, references, cache, args, cider_df)
        generated = [report_text(c, args.prompt) for c in completions]
        as_list = lambda row: [None if np.isnan(v) else float(v) for v in row]  # NaN is not JSON
        rows = [{"id": r.id, "reference": r.report, "generated": g, "completion": c, "reward": float(rw),
                 "labels": {"generated": as_list(hl), "reference": as_list(rl)}}
                for r, g, c, rw, hl, rl in zip(records, generated, completions, reward, cache(generated), cache(references))]
        results = common.evaluate_generations(rows, cache, uncertain_as=args.uncertain_as, meteor=meteor)
        results.update(labeler=type(labeler).__name__, reward=float(reward.mean()), reward_terms=terms)
        out = Path(args.out)
        with open(out / f"generations_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        (out / f"eval_{name}.json").write_text(json.dumps(results, indent=2))
    return common.broadcast_object(results)


def train(args: Args) -> dict:
    dist = common.setup_distributed(args.device)
    common.seed_everything(args.seed)  # same initial weights on every rank
    tiny = args.model == "tiny"
    # Model-dependent defaults, resolved before config.json records them
    args.lr = args.lr or (1e-4 if tiny else 5e-6)
    args.sft_lr = args.sft_lr or (1e-3 if tiny else 1e-5)
    args.max_new_tokens = args.max_new_tokens or (128 if tiny else 256)
    args.sft_steps = (600 if tiny else 0) if args.sft_steps is None else args.sft_steps
    args.prompt = prompt_style(args)
    if args.loss_type not in ("grpo", "bnpo", "dr_grpo"):
        raise ValueError(f"--loss-type must be grpo, bnpo or dr_grpo, got {args.loss_type!r}")
    # --prompts-per-step and --sft-batch-size count studies over all ranks (the paper's effective batch)
    world = dist.world_size
    per_rank = common.exact_div(args.prompts_per_step, world, f"--prompts-per-step over {world} processes")
    micro = common.exact_div(per_rank, args.grad_accum, "--prompts-per-step per process / --grad-accum")
    sft_per_rank = common.exact_div(args.sft_batch_size, world, f"--sft-batch-size over {world} processes") \
        if args.sft_steps else 0
    out = common.start_run(args.out, args, dist)  # --resume: the flags must be the run's
    data = common.load_data(args.data)
    if args.split_views:
        data = {split: split_views(records) for split, records in data.items()}
    train_records, val_records, test_records = data["train"], data["val"][:args.n_eval], data["test"]
    labeler = common.make_labeler(args.labeler, args.chexbert_weights, dist.device)
    # CIDEr-D's document frequencies from the training references, once: a reward must not
    # depend on which other studies share its batch
    cider_df = common.cider_document_frequency([r.report for r in train_records]) \
        if "nlg" in reward_parts(args.reward) else None

    # Policy, warm start, reference ---------------------------------------------------------------
    warm_resume = args.resume and args.sft_steps > 0
    # a resumed HF run rebuilds from the saved warm-started weights: its checkpoint holds only LoRA
    policy, ref = build_policy(args, train_records, dist, str(out / "sft") if warm_resume and not tiny else args.model)
    common.broadcast_parameters(policy.model)
    if args.sft_steps > 0 and not args.resume:
        common.supervised_finetune(policy, train_records, args.sft_steps, batch_size=sft_per_rank, lr=args.sft_lr,
                                   prompt=PROMPTS[args.prompt], seed=args.seed, rank=dist.rank, world_size=world,
                                   target_fn=lambda b: sft_targets(b, labeler, args.prompt))
        if tiny:
            ref = copy.deepcopy(policy)  # GRPO's reference is the warm-started model
        else:
            # fold the warm-start adapters into the weights and start GRPO with fresh ones: the
            # LoRA-off reference is then the warm-started model too
            common.merge_lora(policy.model)
        if dist.is_main:
            policy.save(out / "sft")  # kept for --resume
        if not tiny:
            add_lora(policy, args)
            common.broadcast_parameters(policy.model)
    elif warm_resume and tiny:
        ref = common.TinyPolicy.load(out / "sft", dist.device)
    for p in ([] if ref == "lora" else ref.model.parameters()):
        p.requires_grad_(False)

    # AdamW with betas (0.9, 0.99), weight decay 0.1, cosine schedule with 10 % warm-up (paper;
    # it uses 8-bit AdamW under DeepSpeed ZeRO-1, plain AdamW here)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    total = args.steps if args.steps is not None else max(1, int(args.epochs * len(train_records) / args.prompts_per_step))
    warmup = int(args.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, total, warmup))
    common.seed_everything(args.seed, dist.rank)  # ranks sample differently from here on
    start = 0
    if args.resume:  # restores the RNG states too, so sampling continues where it stopped
        start, _ = common.load_checkpoint(out / "last.pt", policy.model, optimizer, scheduler)

    # Before RL (the warm-started model: Table II's Base or Base + SFT) --------------------------
    evals = {"val": (val_records, False), "test": (test_records, "auto" if args.meteor else False)}
    results = {}
    if start == 0:
        for split, (records, meteor) in evals.items():
            results[f"{split}_before"] = evaluate(policy, records, labeler, args, dist, f"{split}_before", cider_df, meteor)
    elif dist.is_main:  # resumed: the files the first run wrote
        results = {n: json.loads((out / f"eval_{n}.json").read_text())
                   for n in ("val_before", "test_before") if (out / f"eval_{n}.json").is_file()}

    # GRPO ---------------------------------------------------------------------------------------
    batches = common.study_batches(train_records, per_rank, args.seed, dist.rank, world, start_step=start)
    with common.RunLog(out, total, dist.is_main, start, desc="MRG-R1 GRPO") as runlog:
        for step in range(start, total):
            _, batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]  # the lr this step uses (scheduler.step() comes after)
            cache = common.LabelCache(labeler)  # each distinct text labelled once this step, not G times
            stats, n_completions = [], 0
            for k in range(args.grad_accum):
                refs, terms = batch["report"][k * micro:(k + 1) * micro], []

                def reward_fn(texts, owners):
                    r, t = total_reward(texts, [refs[o] for o in owners], cache, args, cider_df)
                    terms.append(t)
                    return r
                with common.autocast(dist.device, args.dtype):
                    roll = common.rollout(policy, batch["images"][k * micro:(k + 1) * micro], PROMPTS[args.prompt],
                                          args.group_size, reward_fn, args.max_new_tokens, args.temperature,
                                          ref=ref if args.beta > 0 else "none")
                    loss, s = policy_loss(policy, roll, args)  # Eq. 1-2
                (loss / args.grad_accum).backward()
                s.update({f"reward_{name}": v for name, v in terms[0].items()}, reward=roll.rewards.mean().item(),
                         loss=loss.item(), length=roll.completion_mask.sum(1).mean().item())
                stats.append(s)
                n_completions += len(roll.texts)
            common.all_reduce_gradients(params, world)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
            optimizer.step()
            scheduler.step()
            if (step + 1) % args.log_every == 0 or step + 1 == total:
                mean = common.all_reduce_mean({"completions": n_completions, "grad_norm": grad_norm,
                                               **{k: np.mean([s[k] for s in stats]) for k in stats[0]}})
                mean["completions"] *= world  # completions this step over all ranks
                runlog.log(step + 1, lr=lr, **mean)
            if (step + 1) % args.eval_every == 0 and step + 1 < total:
                r = evaluate(policy, val_records, labeler, args, dist, "val", cider_df)
                runlog.log(step + 1, val_reward=r["reward"], val_ce_micro_f1=r["ce"]["micro_f1"])
            if (step + 1) % args.eval_every == 0 or step + 1 == total:
                common.save_checkpoint(out / "last.pt", policy.model, optimizer, scheduler, step + 1, config=args,
                                       trainable_only=not tiny)  # HF: the LoRA adapters only

    if total > 0:  # with --steps 0 the "before" evaluations are the result
        for split, (records, meteor) in evals.items():
            results[f"{split}_after"] = evaluate(policy, records, labeler, args, dist, f"{split}_after", cider_df, meteor)
    if dist.is_main:
        policy.save(out / "final")
        (out / "eval.json").write_text(json.dumps(results, indent=2))
        for split in evals:
            b, a = results.get(f"{split}_before"), results.get(f"{split}_after")
            line = " -> ".join(f"reward {r['reward']:.3f}, CE micro F1 {r['ce']['micro_f1']:.3f}" for r in (b, a) if r)
            print(f"{split} ({'before -> after' if b and a else 'after' if a else 'before'}): {line}")
    common.cleanup_distributed()
    return results


def main(argv=None):
    train(common.parse_args(Args, argv, __doc__))


if __name__ == "__main__":
    main()
