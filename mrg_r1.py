"""MRG-R1: semantic-driven reinforcement learning for medical report generation.

Paper: "MRG-R1: Reinforcement Learning for Clinically Aligned Medical Report Generation"
(Pengyu Wang, Shuchang Ye, Usman Naseem, Jinman Kim; arXiv:2512.16145). A vision-language model samples
G reports per study; each is scored by the margin CheXbert cosine similarity (MCCS) of the signed label
vectors of the generated and the reference report, plus a small reward for a
"<think>...</think> <report>...</report>" answer; GRPO turns each group's rewards into advantages and
updates the policy (LoRA) under a KL penalty to the frozen starting model. With the tagged prompt only
the text inside <report> is scored.

    python mrg_r1.py                                    # synthetic set, the sandbox's foundation: 5 CPU-minutes
    python mrg_r1.py --reward ce_f1+format              # a Table II row (also mccs, format, nlg, ...)
    python mrg_r1.py --data /data/iu_xray --model FreedomIntelligence/HuatuoGPT-Vision-7B-Qwen2.5VL \\
        --grad-accum 4                                  # one GPU (CheXbert labels and bf16 by default)
    torchrun --nproc_per_node=4 mrg_r1.py --data /data/mimic_cxr \\
        --model FreedomIntelligence/HuatuoGPT-Vision-7B-Qwen2.5VL
    python mrg_r1.py --model ... --steps 0              # Table II's Base row: evaluation only

CE metric (Sec. IV-A): CheXbert P/R/F1 micro over the 14 observations, positives only (uncertain = negative).

Equations, and where they are implemented:
    Eq. 1    GRPO objective, per sequence, KL to the reference   grpo_step() -> common.grpo_loss (dr_grpo)
    Eq. 2    group advantages, population std, eps inside       grpo_advantages()
    Eq. 3-4  signed label vectors over 13 observations          signed_label_vectors()
    Eq. 5    CheXbert cosine similarity (CCS)                   mccs()
    Eq. 6    margin shaping max((CCS - m) / (1 - m), 0)         mccs()
    Sec. III-B1  format reward                                  format_reward()
    Sec. IV-A    each view of a study is its own sample         split_views()
    Sec. IV-B    0.75 clinical + 0.25 format; Table II rows     total_reward()
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch

import common


@dataclass
class Args(common.RunArgs):
    reward: Literal["mccs+format", "mccs", "ce_f1+format", "ce_f1", "format", "nlg"] = "mccs+format"
    """Table II row (Sec. IV-B: mccs+format)"""
    margin: Annotated[float, "(-1, 1)"] = 0.5
    """Eq. 6's m in (-1, 1): the paper says "moderate" without a value; ours"""
    group_size: Annotated[int, "[2, inf)"] = 4
    """G (Sec. IV-B)"""
    prompts_per_step: Annotated[int, "[1, inf)"] = 4
    """studies per step over all ranks: 4 x G = 16 completions, the paper's batch (Sec. IV-B)"""
    grad_accum: Annotated[int, "[1, inf)"] = 1
    """micro-batches per step on each rank: a memory knob (ours)"""
    loss_type: Literal["dr_grpo", "grpo", "bnpo"] = "dr_grpo"
    """dr_grpo: Eq. 1 per sequence; grpo / bnpo: TRL's token means"""
    beta: Annotated[float, "[0, inf)"] = 0.04
    """Eq. 1's KL weight (beta >= 0, no value given): DeepSeekMath's 0.04"""
    lr: Annotated[float | None, "[0, 1]"] = None
    """AdamW lr; None: 5e-6 (Sec. IV-B) for HF models, 1e-4 for the tiny model (ours)"""
    steps: Annotated[int | None, "[0, inf)"] = None
    """RL steps; None: one epoch (Sec. IV-B), 300 for the tiny model; 0: evaluate only (Table II's Base)"""
    max_new_tokens: Annotated[int | None, "[1, inf)"] = None
    """None: 256 for HF models (ours), 128 for the tiny model"""
    sft_steps: Annotated[int | None, "[0, inf)"] = None
    """warm start steps (Table II's "+ SFT"); None: the tiny model until validation stops improving (CONVERGE: the
    sandbox's stand-in for the paper's capable medical VLM), HF models and --init 0"""
    init: str | None = None
    """start from a saved policy (a run's warm_start/final or final/) instead of --model's"""
    max_pixels: Annotated[int, "[784, inf)"] = 512 * 512
    """HF models: pixels per view, at most 334 Qwen image tokens (the paper gives none: ours)"""


# Sec. IV-B's settings that are not worth a flag, and our choices where the paper is silent
LORA = dict(
    r=128,
    alpha=256,
    dropout=0.05,
    targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)
# with a cosine schedule (Sec. IV-B); the paper's AdamW is 8-bit (bitsandbytes): ours keeps its states in fp32 (a
# memory saving we leave out, with a package the project does not need: the update differs by the 8-bit rounding)
ADAMW = dict(betas=(0.9, 0.99), weight_decay=0.1)
WARMUP = 0.1  # the schedule's warm-up: 10 % of the steps (Sec. IV-B)
MAX_GRAD_NORM = 0.1  # Sec. IV-B
ADV_EPS = 1e-6  # Eq. 2's eps "on the order of 1e-8 to 1e-6"
FORMAT_PARTIAL = 0.5  # credit for a minor format violation: Sec. III-B1 gives no value (ours)
TEMPERATURE = 1.0  # rollout sampling: the paper gives none; 1.0 samples the policy itself
WARM_START = dict(lr_tiny=1e-3, lr_hf=1e-5, batch_size=32)  # the paper's SFT row names no settings (ours)
# The paper starts RL from a capable medical VLM; the sandbox's tiny model starts from SFT trained until it stops
# improving: validation CE micro F1 (the headline) of greedy reports on N_VAL studies every 100 steps, stopped after 4
# validations without a gain of 0.005, the best weights kept (declared before any sweep; README, MRG-R1's premises)
CONVERGE = dict(every=100, patience=4, min_gain=0.005, max_steps=5000)
N_VAL = 200
# Sec. IV-A: CheXbert P/R/F1 "over 14 chest X-ray observations", the protocol of R2Gen/CMN it cites: micro over the 14,
# positive only (uncertain = negative)
CE = dict(headline="micro_f1", uncertain_as=0)
PROMPTS = {
    "tags": "You are a radiologist. Look at the chest X-ray, reason about the findings inside <think> </think>, "
    "then write the findings section of the report inside <report> </report>.",
    "plain": "You are a radiologist. Look at the chest X-ray and write the findings section of the report.",
}
TAGS = ("<think>", "</think>", "<report>", "</report>")


# Sec. III-B1: the format reward ------------------------------------------------------------------
def format_reward(text: str, partial: float = FORMAT_PARTIAL) -> float:
    """1 when <think>, </think>, <report>, </report> each appear once, in that order, with non-empty
    sections and nothing outside them; `partial` for a minor violation (text outside the tags, or
    an empty <think>); 0 when a tag is missing, repeated or out of order, or the report is empty."""
    if any(text.count(tag) != 1 for tag in TAGS):
        return 0.0
    pos = [text.index(tag) for tag in TAGS]
    if pos != sorted(pos):
        return 0.0
    think, between, report = (text[pos[k] + len(TAGS[k]) : pos[k + 1]].strip() for k in range(3))
    outside = (text[: pos[0]] + text[pos[3] + len(TAGS[3]) :]).strip()
    if not report:
        return 0.0
    return 1.0 if think and not between and not outside else partial


def extract_report(text: str) -> str:
    """The text inside the first <report>...</report>; "" without one."""
    m = re.search(r"<report>(.*?)</report>", text, flags=re.DOTALL)
    return m.group(1).strip() if m else ""


# Eq. 3-6: the margin CheXbert cosine similarity ----------------------------------------------------
def signed_label_vectors(labels: np.ndarray) -> np.ndarray:
    """Eq. 3-4: labels (N, 14) 1 / 0 / -1 / NaN -> z (N, 13) with f(pos) = 1, f(neg) = -1,
    f(uncertain) = 1, f(blank) = 0, over the 13 observations without No Finding."""
    labels = labels[:, [common.LABEL_INDEX[name] for name in common.FINDINGS]]  # (N, 13)
    return np.select([labels == 1, labels == -1, labels == 0], [1.0, 1.0, -1.0], 0.0)


def mccs(hyp_labels: np.ndarray, ref_labels: np.ndarray, margin: float, eps: float = 1e-8) -> np.ndarray:
    """MCCS of each generated / reference pair -> (N,) in [0, 1]. Two reports silent on all 13
    findings have CCS = 0 as Eq. 5 is written, so MCCS = 0 for m >= 0."""
    z, z_ref = signed_label_vectors(hyp_labels), signed_label_vectors(ref_labels)  # (N, 13) each
    # Eq. 5: CCS = <z, z*> / ((||z|| + eps)(||z*|| + eps))
    ccs = (z * z_ref).sum(1) / ((np.linalg.norm(z, axis=1) + eps) * (np.linalg.norm(z_ref, axis=1) + eps))
    return np.maximum((ccs - margin) / (1 - margin), 0.0)  # Eq. 6: MCCS = max((CCS - m) / (1 - m), 0)


def ce_f1_reward(hyp_labels: np.ndarray, ref_labels: np.ndarray) -> np.ndarray:
    """Table II's CE-F1 reward: per-report F1 of the positive (and uncertain) labels, 14 labels."""
    h, r = common.binarize(hyp_labels), common.binarize(ref_labels)  # (N, 14) each
    denom = h.sum(1) + r.sum(1)
    return np.where(denom > 0, 2 * (h & r).sum(1) / np.maximum(denom, 1), 0.0)


def cider_document_frequency(refs: list[str]) -> tuple[Counter, int]:
    """CIDEr-D document frequencies of a fixed corpus, a document per reference (ViLMedic's reward joins them:
    every df 1), so that a reward does not depend on what else shares the batch (SCST's practice)."""
    return Counter(g for r in refs for c in common.ngram_counts(r.split()) for g in c), len(refs)


def total_reward(completions: list[str], references: list[str], labeler, reward: str, margin: float, cider_df=None):
    """Sec. IV-B: 0.75 * clinical + 0.25 * format, or the Table II row `reward` (--reward); `margin`: Eq. 6's m.
    Returns the rewards (N,) and each term's mean. cider_df: the training corpus's CIDEr document frequencies."""
    tags = "format" in reward
    reports = [extract_report(c) if tags else c.strip() for c in completions]
    terms = {}
    if "mccs" in reward:
        terms["mccs"] = mccs(labeler(reports), labeler(references), margin)
    if "ce_f1" in reward:
        terms["ce_f1"] = ce_f1_reward(labeler(reports), labeler(references))
    if reward == "nlg":  # "BLEU+ROUGE+CIDEr", unweighted; CIDEr-D (x10, pycocoevalcap's scale) dominates
        per = common.nlg_metrics(reports, references, meteor=False, per_sample=True, cider_df=cider_df)["per_sample"]
        terms["nlg"] = np.add(per["BLEU-4"], per["ROUGE-L"]) + per["CIDEr"]
    if tags:
        terms["format"] = np.array([format_reward(c) for c in completions])
    clinical = [terms[t] for t in terms if t != "format"]
    if clinical and tags:
        total = 0.75 * clinical[0] + 0.25 * terms["format"]
    else:
        total = clinical[0] if clinical else terms["format"]
    return total, {f"reward_{k}": float(v.mean()) for k, v in terms.items()}


# Eq. 1-2: GRPO --------------------------------------------------------------------------------------
def grpo_advantages(rewards: torch.Tensor, G: int, eps: float = ADV_EPS) -> torch.Tensor:
    """Eq. 2: A_i = (r_i - mean) / sqrt(mean((r - mean)^2) + eps), the population std with eps inside
    the root (TRL: Bessel's std + 1e-4 outside). A group of equal rewards gets exactly 0."""
    r = rewards.view(-1, G)  # (B, G)
    centred = r - r.mean(1, keepdim=True)
    A = centred / torch.sqrt(centred.pow(2).mean(1, keepdim=True) + eps)
    return torch.where((r == r[:, :1]).all(1, keepdim=True), torch.zeros_like(A), A).flatten()  # (B*G,)


def grpo_step(policy, roll: common.Rollout, ref_logp, G: int, beta: float, loss_type: str, max_new_tokens: int):
    """Eq. 2, then Eq. 1's loss for one rollout (or one micro-batch of its groups). Eq. 1's ratio is 1 and its clip
    never acts, one update per rollout (common.grpo_loss says why); dr_grpo's gradient is Eq. 1's up to the constant
    1 / max_new_tokens. LoRA dropout (HF models) is off while sampling (generate runs in eval mode) and on here, as in
    TRL (disable_dropout=False): the gradient and the KL's policy side come from the dropout-perturbed policy (the
    reference, LoRA off, has none), as the paper's LoRA dropout 0.05 asks; the tiny model has no dropout."""
    A = grpo_advantages(roll.rewards, G)  # (N,) Eq. 2
    logp = policy.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask, TEMPERATURE)  # (N, T)
    loss, stats = common.grpo_loss(
        logp,
        ref_logp,
        A,
        roll.completion_mask,
        beta=beta,
        loss_type=loss_type,
        max_completion_length=max_new_tokens,
    )  # Eq. 1
    return loss, {**stats, "reward": roll.rewards.mean().item(), "length": roll.completion_mask.sum(1).mean().item()}


# Data ---------------------------------------------------------------------------------------------
def split_views(records: list[common.Record]) -> list[common.Record]:
    """Sec. IV-A: multi-view studies become "multiple image-report pairs, with each image paired to
    the same report and counted as a separate sample" (ids get _v0, _v1, ...)."""
    return [
        dataclasses.replace(r, id=f"{r.id}_v{v}", image_paths=[p]) if len(r.image_paths) > 1 else r
        for r in records
        for v, p in enumerate(r.image_paths)
    ]


def warm_start_targets(batch: dict, labeler, tags: bool) -> list[str]:
    """The warm start's answers: the report, or with tags "<think> the reference's positive and
    uncertain findings </think> <report> report </report>" (a stand-in: a randomly initialised model
    cannot reason on its own). Records without labels (real data) get the labeler's."""
    if not tags:
        return list(batch["report"])
    labels = batch["labels"].numpy().copy()  # (B, 14)
    missing = np.isnan(labels).all(1)
    if missing.any():
        labels[missing] = labeler([r for r, m in zip(batch["report"], missing) if m])
    names = [", ".join(n.lower() for n, v in zip(common.CHEXPERT_LABELS, row) if v in (1, -1)) for row in labels]
    return [f"<think> {n or 'no finding'} </think> <report> {r} </report>" for n, r in zip(names, batch["report"])]


# Training ---------------------------------------------------------------------------------------
def train(args: Args) -> dict:
    step = common.StepShape(args.prompts_per_step, args.group_size, args.max_new_tokens or 256, args.grad_accum)
    step = dataclasses.replace(step, lora=LORA, trained="lora")  # the reference: the adapters off, no copy
    warm = dataclasses.replace(step, studies=WARM_START["batch_size"], rows=1, grad_accum=1, rollout=False)
    run = common.start_run(args, memory=(step, warm) if args.sft_steps else (step,))
    common.seed_everything(args.seed)  # the same initial weights and draws on every rank
    per_process = run.per_rank(args.prompts_per_step, "--prompts-per-step")  # fail now, not after a warm start
    common.exact_div(per_process, args.grad_accum, "--prompts-per-step per process / --grad-accum")
    tiny = args.model == "tiny"
    tags = "format" in args.reward  # Table II's rows without format ask for no tags
    prompt = PROMPTS["tags" if tags else "plain"]
    lr = args.lr if args.lr is not None else (1e-4 if tiny else 5e-6)
    max_new = args.max_new_tokens or (128 if tiny else 256)
    sft_steps = args.sft_steps
    if sft_steps is None:
        sft_steps = 0 if args.init or not tiny else None  # None: until CONVERGE stops it
    data = {split: split_views(records) for split, records in run.data.items()}  # Sec. IV-A
    train_set, test_set = data["train"], data["test"]
    # CIDEr's document frequencies from the training references: a reward must not depend on the batch
    cider_df = cider_document_frequency([r.report for r in train_set]) if args.reward == "nlg" else None

    report = extract_report if tags else None  # what the metrics score: the text in <report>, or all of it

    def validate(stage, policy, step):
        """The warm start's validation: CE micro F1 of greedy reports on N_VAL validation samples."""
        r = stage.evaluate(policy, data["val"][:N_VAL], f"val_step{step}", prompt, max_new, report, ce=CE)
        return r["ce"][r["headline"]]

    # The policy (HF: LoRA on the language model, Sec. IV-B; tiny: all of it) and its frozen reference
    warm_start = dict(
        steps=sft_steps or 0,
        lr=WARM_START["lr_tiny" if tiny else "lr_hf"],
        prompt=prompt,
        batch_size=WARM_START["batch_size"],
        targets=lambda b: warm_start_targets(b, run.labeler, tags),
        converge=common.Convergence(**CONVERGE) if sft_steps is None else None,
        validate=validate,
    )
    words = TAGS + tuple(n.lower() for n in common.CHEXPERT_LABELS)  # the tiny model's vocabulary needs them
    policy = common.initial_policy(run, [r.report for r in train_set], max_new, words, args.max_pixels, args.init)
    lora = None if tiny else LORA
    if warm_start["steps"] > 0 or warm_start["converge"] is not None:  # Base: SFT before RL
        policy = common.warm_start(run, policy, train_set, warm_start, lora, args.max_pixels)
    policy, ref = common.for_training(run, policy, lora=lora, reference=args.beta > 0)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    total = args.steps
    if total is None:  # one epoch (Sec. IV-B); the tiny model: ours
        total = 300 if tiny else len(train_set) // args.prompts_per_step
    optimizer, scheduler = common.adamw(params, lr, total, "cosine", WARMUP, **ADAMW)
    warm = sft_steps if sft_steps is not None else f"until validation stops improving ({CONVERGE})"
    run.record(lr=lr, steps=total, max_new_tokens=max_new, sft_steps=warm)  # config.json: the defaults resolved
    common.seed_everything(args.seed, run.rank)  # ranks sample apart from here
    run.restore(policy.model, optimizer, scheduler)

    def evaluate(records, name):
        """Greedy reports on the test split, scored by the common metrics and the reward."""

        def score(rows, labeler):
            """The training reward of the greedy reports."""
            completions = [row.get("completion", row["generated"]) for row in rows]
            r, terms = total_reward(
                completions, [row["reference"] for row in rows], labeler, args.reward, args.margin, cider_df
            )
            for row, value in zip(rows, r):
                row["reward"] = float(value)
            return {"reward": float(r.mean()), **terms}

        return run.evaluate(policy, records, name, prompt, max_new, report, score, meteor=True, ce=CE)

    results = {"test_before": evaluate(test_set, "test_before")}
    batches = run.study_batches(train_set, args.prompts_per_step, "--prompts-per-step")
    ref = ref if args.beta > 0 else None  # no KL, no reference pass (with LoRA the reference is there even so)
    G = args.group_size
    for step, batch in run.steps(total, batches, "MRG-R1", bar=("reward", "reward_mccs", "reward_format", "loss")):
        labels = common.LabelCache(run.labeler)  # each distinct text labelled once this step
        # separate autocast blocks: bf16 copies of the weights cast under the rollout's no_grad must not serve the
        # loss's forward (autocast caches them per block; torch <= 2.9 reuses them there, pytorch#112583: no gradient)
        with run.autocast():
            roll = common.rollout(policy, batch["images"], prompt, G, max_new, TEMPERATURE)  # once a step
        references = [r for r in batch["report"] for _ in range(G)]  # each completion's study's report
        rewards, terms = total_reward(roll.texts, references, labels, args.reward, args.margin, cider_df)  # Table II
        run.log(**terms)
        roll.rewards = torch.as_tensor(rewards, dtype=torch.float32, device=roll.completion_ids.device)  # (N,)
        micros = common.micro_batches(policy, roll, args.grad_accum, G)  # --grad-accum: the passes in parts
        for k, micro in enumerate(micros):
            with common.gradient_sync(policy.forward_module, last=k == len(micros) - 1):
                with run.autocast():
                    ref_logp = common.reference_logprobs(ref, micro, TEMPERATURE)  # (N, T) Eq. 1's pi_ref
                with run.autocast():
                    loss, stats = grpo_step(policy, micro, ref_logp, G, args.beta, args.loss_type, max_new)  # Eq. 1-2
                (loss / args.grad_accum).backward()  # the last micro-batch's averages the gradients over ranks
            run.log(loss=loss.item(), **stats)
        grad_norm = common.clip_gradients(params, MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.log(grad_norm=grad_norm)
        run.log_step(step)  # metrics.jsonl: this step's line
        run.checkpoint(step)  # last.pt every 50 steps, at the last step and on Ctrl-C
    if total > 0:  # with --steps 0 the "before" evaluation is the result
        results["test_after"] = evaluate(test_set, "test_after")
    if run.is_main:
        for key, r in results.items():
            print(f"{key}: reward {r['reward']:.3f}, {common.summary(r)}")
    return run.finish(results, policy)


def main(argv=None):
    return common.run_main(train, Args, argv, __doc__)


if __name__ == "__main__":
    main()
