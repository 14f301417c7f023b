"""RRGCL: Radiology Report Generation by Curriculum Learning.

Paper: "Radiology Report Generation by Curriculum Learning (RRGCL)", an anonymous review copy: the text
names no authors and no arXiv id. Two scores say how hard a training study is: the visual neighbourhood
semantic gap (VNS-Gap: an image like others' with a report unlike theirs) and the image-text alignment
score (ITAS: a MINE statistics network's value on the pair). Algorithm 1 trains epoch t on the easiest lambda_n(t) of
every class, easy classes (by their studies' mean) faster, all at t = T; around any generator: here the policy's SFT.

    python rrgcl.py                                   # synthetic, the foundation: measure, schedule: 6 CPU-min
    python rrgcl.py --scheduler none --difficulty runs/rrgcl-synthetic/difficulty.json --out runs/none   # baseline
    python rrgcl.py q1 --out runs/rrgcl-synthetic     # Fig. 1 on the run's (or any model's) test reports
    python rrgcl.py --data /data/mimic_cxr --measure-only --difficulty mimic_dif.json --visual-encoder resnet101.pth \\
        --itas-encoder resnet18.pth --text-encoder emilyalsentzer/Bio_ClinicalBERT      # on a GPU, once
    torchrun --nproc_per_node=4 rrgcl.py --data /data/mimic_cxr --difficulty mimic_dif.json \\
        --model Qwen/Qwen2.5-VL-3B-Instruct

Equations, and where they are implemented:
    Sec. 3.2       the learning difficulty measurer: dif1, dif2 of each study   measure()
    Eq. 1-2        phi(I_i), psi(R_i): the image and report features            features()
    Eq. 1-4        S^v, S^t cosines, G = |S^v - S^t|, dif1 = row sums of G      vns_gap() (row blocks, never N x N)
    Eq. 5-9        MINE's DV bound maximised over T; dif2(i) = T*(I_i, R_i)     dv_bound(), train_mine(), itas()
    Eq. 7          T_theta(I, R): MINE's statistics network                     StatisticsNetwork
    Eq. 10         dif = alpha z(dif1) + beta z(dif2) (ITAS sign)               zscore(), sample_difficulty()
    Alg. 1 l.1-3   classes D_n, class difficulty, easy-to-hard orders           class_members(), curriculum_plan()
    Eq. 11         lambda_n(t) = min(1, (l0^g + (1 - l0^g) t / T)^(1/g))        rrgcl_lambda()
    Eq. 12-13      gamma_n = 1 + (1 - diff_C) c, lambda_n(0) = gamma_n / sum    scheduling_exponents()
    Alg. 1 l.6-11  for t: each D_n's easiest lambda_n(t), united; train on it   rrgcl_subset(), the loop in train()
    Table 2        Baby Step, Linear, One Pass, Root, Geom                      pacing(), epoch_subset()
    Fig. 1         per-class BLEU-4 vs class size and difficulty                q1_analysis()
    Fig. 3         lambda_n(t) curves                                           <out>/schedule.json, metrics.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F

import common


@dataclass
class Args(common.RunArgs):
    scheduler: Literal["rrgcl", "root", "linear", "baby_step", "one_pass", "geom", "none"] = "rrgcl"
    """Sec. 3.3, Table 2 (none: all, random)"""
    alpha: Annotated[float, "[0, 1]"] = 0.6
    """Eq. 10's VNS-Gap weight, beta = 1 - alpha (Sec. 4.3: 0.6, 0.4; Table 3: they sum to 1); 1, 0: Table 2 (a), (b)"""
    itas_sign: Literal[-1, 1] = -1
    """Eq. 10 adds ITAS, Sec. 3.2.1 calls aligned pairs easier: -1 subtracts it (ours), 1 as printed"""
    epochs: Annotated[int, "[1, inf)"] = 10
    """T of Eq. 11 (the paper keeps the wrapped model's; ours)"""
    t0: bool = True
    """epochs t = 0..T (Algorithm 1 line 6: the lambda_n(0) subset trains first); --no-t0: t = 1..T (Sec. 3.3.1)"""
    steps: Annotated[int | None, "[0, inf)"] = None
    """Algorithm 1's steps in all, shared over the epochs as their subsets' sizes; None: a pass over each (l. 11)"""
    converge: Literal["auto", "yes", "no"] = "auto"
    """yes: after t = T, train on every study until validation stops improving (CONVERGE), the best weights kept, as
    the sandbox trains every table's model; auto: yes from the sandbox's foundation, else no (the schedule's steps)"""
    batch_size: Annotated[int, "[1, inf)"] = 32
    """studies per step over all ranks (the paper follows the wrapped model; ours)"""
    lr: Annotated[float | None, "[0, 1]"] = None
    """AdamW, constant; None: 1e-3 for the tiny model, 1e-4 with LoRA for HF models (ours)"""
    difficulty: str | None = None
    """JSON: --measure-only writes it, training reads it; None: measured into <out>/difficulty.json"""
    measure_only: bool = False
    """write the difficulty file and <out>/schedule.json, then stop"""
    visual_encoder: str = "small"
    """phi, Eq. 1: "small" (a CNN fit to the labels), a ResNet-101 state dict (paper: CheXpert-tuned) or "imagenet" """
    itas_encoder: str = "small"
    """ITAS's images: "small" (that CNN), a ResNet-18 state dict or "imagenet" (paper: a pre-trained 5-layer ResNet)"""
    text_encoder: str = "small"
    """psi, Eq. 2: "small" (a word CNN fit to the labels) or a BERT (paper: emilyalsentzer/Bio_ClinicalBERT)"""


PROMPT = "You are a radiologist. Write the findings section of the report for this chest X-ray."
CE = dict(headline="micro_f1", uncertain_as=0)  # Sec. 4.2's CE P/R/F1 on MIMIC-CXR (R2Gen's: micro, positives)
# Sec. 4.1: "13 keywords excluding Support Devices" (12 findings, No Finding); a study is in every class it is 1 for
CLASSES = [n for n in common.CHEXPERT_LABELS if n != "Support Devices"]
# The measurer's encoders: the small ones ours (text 2 x epochs); ResNets at Sec. 4.1's 256 px
ENCODER = dict(image_size=64, batch_size=64, lr=1e-3, resnet_size=256, seed=0, held_out=0.1)
# The measurer converges before it schedules (declared before any sweep). The paper's encoders are pre-trained once
# (ResNet-101 tuned on CheXpert, Bio_ClinicalBERT): the stand-ins train with one seed, ENCODER["seed"], whatever --seed,
# on 90 % of the training studies until the BCE on the other 10 % stops improving (ENCODER_CONVERGE, in epochs);
# MINE's T trains until its DV bound on held-out pairs stops improving (MINE_CONVERGE, in steps). Best weights kept.
ENCODER_CONVERGE = dict(every=1, patience=2, min_gain=0.001, max_steps=30)
MINE_CONVERGE = dict(every=500, patience=5, min_gain=0.01, max_steps=20000)
# Sec. 4.3's ResNet depths; ITAS: the smallest torchvision ResNet (Liao et al.'s isn't one)
RESNET = {"--visual-encoder": 101, "--itas-encoder": 18}
MINE = dict(batch_size=256, lr=1e-4, held_out=0.2, shuffles=10)  # per half (itas()); Belghazi et al. 2018's lr
VNS_BLOCK = 2048  # rows of G computed at once: memory O(N x block)
ARRAYS = ("labels", "dif1", "dif2")  # of the difficulty file, NaN (a blank label) written as null
C0 = 0.01  # Linear / Root / Geom start (Platanios et al. 2019)
BUCKETS = 5  # Baby Step / One Pass buckets (Bengio 2009 gives none)
MAX_GRAD_NORM = 1.0
# The sandbox trains the generator to convergence, as it does every table's model: validation CE micro F1 of greedy
# reports on N_VAL studies every 100 steps, and after Algorithm 1's last epoch (t = T: every study) on over all studies
# until 4 validations bring no gain of 0.005; the best validated weights kept (declared before the sweep)
CONVERGE = dict(every=100, patience=4, min_gain=0.005, max_steps=5000)
N_VAL = 200
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=16, alpha=32, dropout=0.05, targets=LORA_TARGETS)


# Eq. 1-4: visual neighbourhood semantic gap -----------------------------------------------------
@torch.no_grad()
def vns_gap(v: torch.Tensor, t: torch.Tensor, block: int = VNS_BLOCK, device="cpu") -> torch.Tensor:
    """dif1 (N,) float64 for (N, d_v), (N, d_t) features, in row blocks (memory O(N x block)).
    [v, t] . [v, -t]' = S^v - S^t; G is symmetric, so a block computes columns j >= its first row and adds those
    right of it to their rows."""
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    v = F.normalize(v.to(device, dtype), dim=1)  # Eq. 1's denominators
    t = F.normalize(t.to(device, dtype), dim=1)  # Eq. 2's denominators
    a, b = torch.cat([v, t], 1), torch.cat([v, -t], 1)  # (N, d_v + d_t)
    dif1 = torch.zeros(len(a), dtype=torch.float64, device=device)
    for s in range(0, len(a), block):
        e = min(s + block, len(a))
        G = (a[s:e] @ b[s:].T).abs_()  # Eq. 3: (e - s, N - s) = |S^v_ij - S^t_ij|, j >= s
        dif1[s:e] += G.sum(1).double()  # Eq. 4 over columns j >= s
        dif1[e:] += G[:, e - s :].sum(0).double()  # G_ji = G_ij: the rows after the block
    return dif1.cpu()


# Eq. 5-9: image-text alignment score by MINE --------------------------------------------------------
class StatisticsNetwork(torch.nn.Sequential):
    """T_theta(I, R) of Eq. 7: an MLP (ours: 2 x 256, ELU) on the concatenated features -> (B,)."""

    def __init__(self, d: int, h: int = 256):
        super().__init__(
            torch.nn.Linear(d, h), torch.nn.ELU(), torch.nn.Linear(h, h), torch.nn.ELU(), torch.nn.Linear(h, 1)
        )

    def forward(self, image, text):
        return super().forward(torch.cat([image, text], -1)).squeeze(-1)


def dv_bound(t_joint: torch.Tensor, t_marginal: torch.Tensor) -> torch.Tensor:
    """Eq. 6-7: E_P(IR)[T] - log E_P(I) x P(R)[e^T], the expectations as batch means."""
    return t_joint.mean() - (torch.logsumexp(t_marginal, 0) - math.log(len(t_marginal)))


def train_mine(image, text, batch_size: int, lr: float, held_out: float, shuffles: int, seed: int = 0):
    """Eq. 8: theta* = argmax of the DV bound, Adam on batches, marginals by shuffling the batch's reports; no
    moving-average correction (Belghazi et al. 2018, Sec. 3.2); until the bound on `held_out` of the pairs stops
    improving (MINE_CONVERGE). Returns (T at its best, that bound)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(image), generator=g)
    n_held = max(1, int(held_out * len(image)))
    held, fit = order[:n_held], order[n_held:]
    # the held-out pairs' marginal: their images with `shuffles` shuffles of their reports (a steadier bound)
    images = held.repeat(shuffles)
    unpaired = torch.cat([held[torch.randperm(len(held), generator=g)] for _ in range(shuffles)])
    T = StatisticsNetwork(image.shape[1] + text.shape[1])
    opt = torch.optim.Adam(T.parameters(), lr=lr)
    rule = common.Convergence(**MINE_CONVERGE)
    for step in range(1, rule.max_steps + 1):
        i = fit[torch.randint(len(fit), (batch_size,), generator=g)]
        j = i[torch.randperm(batch_size, generator=g)]  # shuffled reports: P(I) x P(R)
        mi = dv_bound(T(image[i], text[i]), T(image[i], text[j]))  # Eq. 7
        opt.zero_grad(set_to_none=True)
        (-mi).backward()  # Eq. 8: maximise the bound
        opt.step()
        if step % rule.every == 0:
            with torch.no_grad():
                rule.update(dv_bound(T(image[held], text[held]), T(image[images], text[unpaired])).item(), step, T)
            if rule.converged:
                break
    T.load_state_dict(rule.best_weights)
    return T.eval(), rule.best


@torch.no_grad()
def itas(image: torch.Tensor, text: torch.Tensor, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Eq. 9: dif2(i) = T*(I_i, R_i), cross-fitted (ours): T fit on one half of the pairs scores the other half,
    and the other way round; each half's scores standardised apart, as the DV bound leaves T free up to a constant."""
    image, text = ((x - x.mean(0)) / x.std(0).clamp_min(1e-6) for x in (image, text))  # standardised features (ours)
    a, b = np.array_split(np.random.default_rng(seed).permutation(len(image)), 2)
    dif2 = np.zeros(len(image))
    stats = {"dv_train": [], "dv_held_out": []}  # the bound on the pairs held out of T's fit, and on the scored
    for k, (held, fit) in enumerate([(a, b), (b, a)]):
        with torch.enable_grad():
            T, dv_train = train_mine(image[fit], text[fit], **MINE, seed=seed + k)
        t_joint = T(image[held], text[held])  # (N/2,)
        shuffled = np.random.default_rng(seed + k).permutation(held)
        stats["dv_train"].append(dv_train)
        stats["dv_held_out"].append(dv_bound(t_joint, T(image[held], text[shuffled])).item())  # Eq. 7 on unseen pairs
        dif2[held] = zscore(t_joint.double().numpy())
    return dif2, stats


# Eq. 10, and Algorithm 1 lines 1-4: classes, class difficulty, Eq. 11-13 ------------------------------
def zscore(x) -> np.ndarray:
    """Eq. 10's z: (x - mu) / sigma, the population std (the paper names mu, sigma only)."""
    return (np.asarray(x, float) - np.mean(x)) / (np.std(x) or 1.0)


def sample_difficulty(dif1, dif2, alpha: float = 0.6, itas_sign: int = -1) -> np.ndarray:
    """Eq. 10, beta = 1 - alpha, ITAS entering with itas_sign: -1 (ours), as Sec. 3.2.1 calls aligned pairs easier."""
    return alpha * zscore(dif1) + itas_sign * (1 - alpha) * zscore(dif2)


def class_members(labels: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
    """Algorithm 1 line 1: D_n = the studies labelled 1 for keyword n (a study may sit in several). Paper silent:
    studies positive for none form one more class "Other"; empty classes are dropped (c counts the rest)."""
    positive = labels[:, [common.LABEL_INDEX[n] for n in CLASSES]] == 1  # (N, 13)
    positive = np.column_stack([positive, ~positive.any(1)])  # (N, 14): "Other" last
    kept = [k for k in range(positive.shape[1]) if positive[:, k].any()]
    return [(CLASSES + ["Other"])[k] for k in kept], [np.flatnonzero(positive[:, k]) for k in kept]


def class_difficulty(dif: np.ndarray, members: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 line 2: diff_C(n) = mean dif(i) over D_n -> (raw, min-max normalised: Eq. 12 needs [0, 1]; ours)."""
    raw = np.array([dif[m].mean() for m in members])
    span = raw.max() - raw.min()
    return raw, (raw - raw.min()) / span if span > 0 else np.zeros_like(raw)


def rrgcl_lambda(t, T: int, gamma, lambda0):
    """Eq. 11: lambda_n(t) = min(1, (lambda_n(0)^gamma_n + (1 - lambda_n(0)^gamma_n) t / T)^(1 / gamma_n))."""
    g, l0 = np.asarray(gamma, float), np.asarray(lambda0, float)
    return np.minimum(1.0, (l0**g + (1 - l0**g) * t / T) ** (1 / g))


def scheduling_exponents(diff_c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 12-13 for normalised class difficulties (c,) -> (gamma (c,), lambda_0 (c,))."""
    gamma = 1 + (1 - diff_c) * len(diff_c)  # Eq. 12: gamma_n in [1, c + 1], easier class -> larger
    return gamma, gamma / gamma.sum()  # Eq. 13: lambda_n(0) = gamma_n / sum_i gamma_i


def curriculum_plan(dif: np.ndarray, labels: np.ndarray) -> dict:
    """Algorithm 1 lines 1-3: each D_n sorted easy to hard, diff_C(n), gamma_n, lambda_n(0); Table 2's global order."""
    names, members = class_members(labels)
    raw, norm = class_difficulty(dif, members)
    gamma, lambda0 = scheduling_exponents(norm)
    table = [
        {"name": n, "size": len(m), "difficulty": float(d), "gamma": float(g), "lambda0": float(l0)}
        for n, m, d, g, l0 in zip(names, members, raw, gamma, lambda0)
    ]  # what files show
    class_orders = [m[np.argsort(dif[m], kind="stable")] for m in members]  # each D_n easy to hard
    plan = {"classes": names, "gamma": gamma, "lambda0": lambda0, "table": table, "class_orders": class_orders}
    return plan | {"order": np.argsort(dif, kind="stable")}


def rrgcl_subset(class_orders: list[np.ndarray], fractions) -> np.ndarray:
    """Algorithm 1 lines 7-10: the easiest ceil(lambda_n(t) |D_n|) of every class ("the top lambda proportion";
    ceil keeps every class in from the start), united without duplicates: D_sub(t)."""
    return np.unique(np.concatenate([o[: math.ceil(f * len(o) - 1e-9)] for o, f in zip(class_orders, fractions)]))


# Table 2: the ablation schedulers, on the global easy-to-hard order ------------------------------
def pacing(name: str, t: int, T: int, c0: float = C0, buckets: int = BUCKETS) -> tuple[float, float]:
    """The slice [lo, hi) of the easy-to-hard order that epoch t trains on (fractions of N)."""
    K = min(buckets, T)  # never more buckets than epochs, or One Pass would skip some
    stage = max(1, math.ceil(K * t / T))  # 1..K
    hi = {
        "linear": c0 + (1 - c0) * t / T,  # Platanios et al. 2019's linear competence
        "root": math.sqrt(t * (1 - c0**2) / T + c0**2),  # Platanios et al. 2019
        "geom": c0 ** (1 - t / T),  # Penha & Hauff 2020: 2^(log2(c0) (1 - t / T))
        "baby_step": stage / K,  # Bengio 2009: K buckets, one more at every stage
        "one_pass": stage / K,  # Cirik et al. 2016: each bucket once, alone, easiest first
    }.get(name, 1.0)
    lo = (stage - 1) / K if name == "one_pass" else 0.0
    return lo, min(1.0, hi)


def epoch_subset(scheduler: str, t: int, T: int, plan: dict) -> np.ndarray:
    """D_sub(t) under any scheduler (all studies at t = T but One Pass's last bucket); train() writes RRGCL's out."""
    if scheduler == "rrgcl":
        return rrgcl_subset(plan["class_orders"], rrgcl_lambda(t, T, plan["gamma"], plan["lambda0"]))
    lo, hi = pacing(scheduler, t, T)
    n = len(plan["order"])
    return np.sort(plan["order"][math.ceil(lo * n - 1e-9) : math.ceil(hi * n - 1e-9)])


# Training: Algorithm 1 around the wrapped generator -----------------------------------------------
def train(args: Args) -> dict:
    step = common.StepShape(args.batch_size, tokens=256, rollout=False, lora=LORA, trained="lora")  # SFT, LoRA
    run = common.start_run(args, notes=measurer_notes(args), memory=() if args.measure_only else (step,))
    run.data = common.r2gen_views(run.data)  # R2Gen's two views per study (IU X-Ray has 1-5): the wrapped models' input
    train_set, test_set = run.data["train"], run.data["test"]

    # The learning difficulty measurer (Sec. 3.2), Eq. 10, then Algorithm 1 lines 1-4
    m, path = difficulty_scores(run, args)  # labels, dif1 (Eq. 1-4), dif2 (Eq. 5-9): read, or measured on rank 0
    dif = sample_difficulty(m["dif1"], m["dif2"], args.alpha, args.itas_sign)  # Eq. 10
    plan = curriculum_plan(dif, m["labels"])  # D_n sorted easy to hard, diff_C(n), gamma_n, lambda_n(0)
    T, ts = args.epochs, list(range(0 if args.t0 else 1, args.epochs + 1))  # T, the epochs t
    sizes = [len(epoch_subset(args.scheduler, t, T, plan)) for t in ts]  # |D_sub(t)|: the step budget needs them first
    curves = rrgcl_lambda(np.arange(T + 1)[:, None], T, plan["gamma"], plan["lambda0"])  # Fig. 3: (T + 1, c)
    class_curves = [{**c, "lambda": curves[:, k].tolist()} for k, c in enumerate(plan["table"])]
    run.write("schedule.json", json.dumps({"t": ts, "subset_sizes": sizes, "classes": class_curves}, indent=1))
    if args.measure_only:
        return run.finish({"difficulty": str(path), "classes": plan["table"], "mine": m["mine"]})

    # The wrapped report generator G_theta (tiny: all of it; HF: LoRA): the same initial weights, measured here or not
    common.seed_everything(args.seed)
    tiny = args.model == "tiny"
    max_new = 96 if tiny else 256  # the greedy test reports' length
    policy = common.initial_policy(run, [r.report for r in train_set], max_new)
    policy, _ = common.for_training(run, policy, lora=None if tiny else LORA, reference=False)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    steps = [max(1, n // args.batch_size) for n in sizes]  # Algorithm 1 line 11: an epoch, one pass over D_sub(t)
    if args.steps is not None:  # or --steps shared in proportion to |D_sub(t)|
        steps = np.diff(np.round(args.steps * np.cumsum([0] + sizes) / sum(sizes)).astype(int))
    ends = np.cumsum(steps)  # each epoch's last step
    lr = args.lr or (1e-3 if tiny else 1e-4)
    optimizer, scheduler = common.adamw(params, lr, int(ends[-1]))
    converge = args.converge == "yes" or (args.converge == "auto" and run.foundation is not None)
    run.record(lr=lr, steps=int(ends[-1]), converge=f"after t = T, {CONVERGE}" if converge else "no")
    rule = common.Convergence(**CONVERGE) if converge else None
    common.seed_everything(args.seed, run.rank)  # ranks draw apart from here
    start = run.restore(policy.model, optimizer, scheduler, state=vars(rule) if rule else None)  # > 0: --resume
    epochs = list(enumerate(ts))
    if rule:  # after t = T, every study until the rule stops (counted as epoch T + 1)
        epochs.append((len(ts), T + 1))
        ends = np.append(ends, ends[-1] + CONVERGE["max_steps"])
    trained = start  # steps trained so far
    for e, t in epochs:  # Algorithm 1 lines 6-12; line 6: for t = 0 to T
        lam = rrgcl_lambda(min(t, T), T, plan["gamma"], plan["lambda0"])  # Eq. 11: lambda_n(t) of every class n, (c,)
        # lines 7-10: D_sub(t) = the easiest lambda_n(t) of each D_n, united (Table 2's schedulers: a global slice)
        if t > T:
            d_sub = np.arange(len(train_set))
        elif args.scheduler == "rrgcl":
            d_sub = rrgcl_subset(plan["class_orders"], lam)
        else:
            d_sub = epoch_subset(args.scheduler, t, T, plan)
        first, end = (int(ends[e - 1]) if e else 0), int(ends[e])  # the epoch's steps: first..end - 1
        if max(start, first) >= end or (rule and rule.converged and t > T):
            continue  # trained before --resume, or no step of --steps falls in this epoch
        batches = epoch_batches(run, d_sub, first, end, e)  # line 11: train G on D_sub(t)
        shown = ("loss", "validation", "best", "patience_left")
        for step, batch in run.steps(end, batches, f"RRGCL t = {t}", start=max(start, first), bar=shown):
            if rule and rule.converged and t > T:
                break  # decided at the last validation (its metrics line is written)
            if step == first:
                lambdas = {}
                if args.scheduler == "rrgcl" and t <= T:
                    lambdas = {f"lambda/{n}": x for n, x in zip(plan["classes"], lam)}
                run.log(epoch=t, subset=len(d_sub), **lambdas)
            with run.autocast():
                loss = sft_step(policy, batch, run)
            loss.backward()  # DDP averages the gradients over ranks here
            grad_norm = common.clip_gradients(params, MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.log(loss=loss.item(), grad_norm=grad_norm)
            trained = step + 1
            if rule and trained % rule.every == 0:  # the sandbox's convergence rule
                r = run.evaluate(policy, run.data["val"][:N_VAL], f"val_step{trained}", PROMPT, max_new, ce=CE)
                run.log(**rule.update(r["ce"][r["headline"]], trained, policy.model))
            run.log_step(step)  # metrics.jsonl: this step's line
            run.checkpoint(step)  # last.pt every 50 steps, at the last step and on Ctrl-C
    if rule:
        policy.model.load_state_dict(rule.best_weights, strict=False)  # the best validation's weights
        if run.is_main:
            common.log.info("RRGCL: %s", rule.why(trained))

    def q1(rows, labeler):
        """Fig. 1 on the greedy test reports."""
        return {"q1": q1_analysis(rows, class_labels(test_set, labeler), plan["table"], args.clean)}

    result = run.evaluate(policy, test_set, "test", PROMPT, max_new, score=q1, meteor=True, ce=CE)
    if run.is_main:
        print(f"{args.scheduler} after {trained} steps: {common.summary(result)}")
    record = {"steps": trained}
    if rule:
        record["converge"] = dataclasses.asdict(dataclasses.replace(rule, best_weights={}))
    return run.finish({"test": result, "scheduler": args.scheduler, **record, "classes": plan["table"]}, policy)


# The generator's side: each step's studies, the loss ------------------------------------------------
def epoch_batches(run: common.Run, d_sub: np.ndarray, first: int, end: int, epoch: int):
    """batches(start) for run.steps over steps first..end - 1: passes over D_sub(t), each shuffled from (seed, epoch)
    alone (a resumed run draws the same); each step's --batch-size studies shared over the ranks."""
    B, n = run.args.batch_size, run.per_rank(run.args.batch_size, "--batch-size")  # a step's studies, this rank's
    dataset = common.ReportDataset(run.data["train"])
    rng = np.random.default_rng([run.args.seed, epoch])
    studies = np.concatenate([rng.permutation(d_sub) for _ in range(math.ceil((end - first) * B / len(d_sub)))])
    studies = studies[: (end - first) * B].reshape(-1, B)  # (steps, B)

    def batches(start: int):
        """The batches of steps start..end - 1: this rank's share of each step's studies."""
        for idx in studies[start - first :]:  # (B,) study indices per step
            yield common.collate([dataset[i] for i in idx[run.rank * n : (run.rank + 1) * n]])

    return batches


def sft_step(policy, batch, run) -> torch.Tensor:
    """The wrapped generator's loss, the token mean of the teacher-forced NLL over the step: this rank's token mean
    times n / mean n over ranks (its share of the step's tokens times the world size: DDP averages)."""
    n = float(policy.encode_targets(batch["report"])[1].sum())  # this rank's report tokens
    loss = policy.sft_loss(policy.prompt_batch(batch["images"], PROMPT), batch["report"])  # this rank's token mean
    return loss * (n / common.all_reduce_mean(n))


# The measurer's plumbing (Sec. 4.1, 4.3): texts, labels, encoders, the difficulty file ----------------
def measure_text(r: common.Record) -> str:
    """Sec. 4.1: "Findings" and "Impression" stitched: the report and the record's "impression" when it has one."""
    return f"{r.report} {r.meta['impression'].strip()}" if str(r.meta.get("impression") or "").strip() else r.report


def class_labels(records, labeler) -> np.ndarray:
    """(N, 14): the data's labels, else the labeler's reading of measure_text: train and test (Q1) alike."""
    labels = np.array([np.full(14, np.nan) if r.labels is None else r.labels for r in records], dtype=float)
    missing = [i for i, r in enumerate(records) if r.labels is None]
    if missing:
        labels[missing] = labeler([measure_text(records[i]) for i in missing])
    return labels


class SmallTextEncoder(torch.nn.Module):
    """(B, L) word ids -> (B, 128): embeddings, a width-3 convolution (it sees "no effusion"), max over words."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 64, padding_idx=0)
        self.conv = torch.nn.Conv1d(64, 128, 3, padding=1)
        self.head = torch.nn.Linear(128, 14)  # trained on the labels, then dropped

    def forward(self, ids):
        h = F.relu(self.conv(self.embed(ids).transpose(1, 2)))  # (B, 128, L)
        return h.masked_fill((ids == 0)[:, None], 0).amax(2)  # (B, 128): ReLU >= 0, so pads never win


def fit_encoder(model, dataset, x: str, device):
    """Multi-label BCE from batch[x] on the 14 labels (uncertain = 1) on 90 % of the studies, each epoch validated on
    the rest, until ENCODER_CONVERGE stops it; the best epoch's weights kept."""
    torch.manual_seed(ENCODER["seed"])  # the split and the shuffles: the same for every measurement seed
    order = torch.randperm(len(dataset)).tolist()
    n_val = max(1, int(ENCODER["held_out"] * len(dataset)))
    fit, val = torch.utils.data.Subset(dataset, order[n_val:]), torch.utils.data.Subset(dataset, order[:n_val])

    def bce(batch):
        y = torch.as_tensor(common.binarize(batch["labels"]), dtype=torch.float32, device=device)  # (B, 14)
        return F.binary_cross_entropy_with_logits(model.head(model(batch[x].to(device))), y)

    opt = torch.optim.AdamW(model.to(device).parameters(), lr=ENCODER["lr"])
    rule = common.Convergence(**ENCODER_CONVERGE)
    for epoch in range(1, rule.max_steps + 1):
        model.train()
        for b in torch.utils.data.DataLoader(fit, ENCODER["batch_size"], shuffle=True):
            loss = bce(b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            model.eval()
            rule.update(-np.mean([bce(b).item() for b in torch.utils.data.DataLoader(val, 256)]), epoch, model)
        if rule.converged:
            break
    model.load_state_dict(rule.best_weights, strict=False)


@torch.no_grad()
def extract(model, dataset, x: str, device) -> torch.Tensor:
    """The (N, d) features of every study."""
    model.to(device).eval()
    return torch.cat([model(b[x].to(device)).float().cpu() for b in torch.utils.data.DataLoader(dataset, 256)])


def features(args: Args, records, labels: np.ndarray, device) -> dict:
    """Eq. 1-2's (N, d) features: "vns_image" (phi), "itas_image" (ITAS's images), "text" (psi). Images: "small" is 5
    strided conv blocks (64 px) fit to the labels until converged; a ResNet (state dict, "imagenet") as is, 256 px."""
    studies = [common.Record(r.id, r.image_paths, r.report, r.split, l) for r, l in zip(records, labels)]

    def image_features(choice: str, flag: str) -> torch.Tensor:
        if choice != "small":  # a pre-trained ResNet, used as it is
            net = common.resnet_encoder(RESNET[flag], choice, flag)
            dataset = common.ReportDataset(studies, common.default_transform(ENCODER["resnet_size"], 3))
            return extract(net, dataset, "images", device)
        torch.manual_seed(ENCODER["seed"])  # the stand-in's initial weights: the same for every measurement seed
        cnn = common.SmallCNN((32, 32, 64, 64, 128), (2,) * 5, grid=1, dim=None)  # then the labels' head
        net = common.ViewMean(cnn, torch.nn.Linear(128, 14))
        dataset = common.ReportDataset(studies, common.default_transform(ENCODER["image_size"], 1))
        fit_encoder(net, dataset, "images", device)
        return extract(net, dataset, "images", device)

    feats = {"vns_image": image_features(args.visual_encoder, "--visual-encoder")}
    if args.itas_encoder == args.visual_encoder == "small":  # the small CNN is fit once when both ask for it
        feats["itas_image"] = feats["vns_image"]
    else:
        feats["itas_image"] = image_features(args.itas_encoder, "--itas-encoder")
    texts = [measure_text(r) for r in records]
    if args.text_encoder == "small":
        tok = common.WordTokenizer.build(texts)
        seqs = [torch.tensor(tok.encode(t)[:256] or [tok.unk_id]) for t in texts]
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=tok.pad_id)  # (N, L); pad id 0
        data = [{"ids": i, "labels": torch.as_tensor(l, dtype=torch.float32)} for i, l in zip(ids, labels)]
        torch.manual_seed(ENCODER["seed"])
        encoder = SmallTextEncoder(len(tok.vocab))
        fit_encoder(encoder, data, "ids", device)
        feats["text"] = extract(encoder, data, "ids", device)
    else:  # Clinical BERT, mean-pooled over word pieces (the paper does not say how it pools)
        from transformers import AutoModel, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.text_encoder)
        bert = AutoModel.from_pretrained(args.text_encoder).to(device).eval()
        chunks = [texts[i : i + 64] for i in range(0, len(texts), 64)]
        with torch.no_grad():
            parts = [common.mean_pooled_bert_features(bert, tok, c, device).float().cpu() for c in chunks]
            feats["text"] = torch.cat(parts)
    return feats


def measure(args: Args, records, labeler, device) -> dict:
    """{"ids", "labels" (N, 14), "dif1" (Eq. 1-4), "dif2" (Eq. 9), "mine", "encoders"} of the training studies."""
    labels = class_labels(records, labeler)
    feats = features(args, records, labels, device)
    N, d = len(records), feats["vns_image"].shape[1] + feats["text"].shape[1]  # MIMIC-CXR: 270,000^2 x 2816: 2e14 FLOP
    if torch.device(device).type == "cpu" and N * N * d > 1e12:
        common.log.warning("VNS-Gap: %d studies, %.0e FLOP: hours on a CPU (--measure-only on a GPU)", N, N * N * d)
    dif1 = vns_gap(feats["vns_image"], feats["text"], VNS_BLOCK, device).numpy()
    dif2, mine = itas(feats["itas_image"], feats["text"], args.seed)
    bounds = [", ".join(f"{x:.2f}" for x in mine[k]) for k in ("dv_train", "dv_held_out")]
    common.log.info(
        "MINE: Donsker-Varadhan lower bound on the image-report mutual information (>= 0; below 0, T found no link "
        "that holds on unseen pairs and ITAS is noise): %s nats on its training batches, %s on held-out pairs",
        *bounds,
    )
    out = {"ids": [r.id for r in records], "labels": labels, "dif1": dif1, "dif2": dif2, "mine": mine}
    return out | {"encoders": {"visual": args.visual_encoder, "itas": args.itas_encoder, "text": args.text_encoder}}


def difficulty_scores(run: common.Run, args: Args) -> tuple[dict, Path]:
    """The measurer's scores, on every rank: from --difficulty (or a resumed run's file), else measured there first."""
    path = Path(args.difficulty or run.out / "difficulty.json")
    if args.measure_only and args.difficulty and path.is_file():
        raise ValueError(f"--measure-only: {path} exists; delete it to measure again")
    # a file to read: --difficulty (unless --measure-only is to write it), or the resumed run's own
    readable = (args.difficulty and not args.measure_only) or (run.resuming and path.is_file())
    if run.world_size > 1 and not readable:  # rank 0 would measure for hours while the others time out waiting
        first = "`python rrgcl.py --measure-only --difficulty FILE` with this --data, then torchrun --difficulty FILE"
        raise ValueError(f"the difficulty is measured in one process, not under torchrun: first {first}")
    if run.is_main and not readable:
        m = measure(args, run.data["train"], run.labeler, run.device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**m, **{k: np.where(np.isnan(m[k]), None, m[k]).tolist() for k in ARRAYS}}))
    return common.broadcast_object(read_difficulty(path, run.data["train"]) if run.is_main else None), path


def read_difficulty(path: Path, records) -> dict:
    """The difficulty file, checked against the training studies; ARRAYS as float arrays (null: NaN)."""
    if not path.is_file():
        raise FileNotFoundError(f"--difficulty {path}: no such file (write it with --measure-only --difficulty {path})")
    m = json.loads(path.read_text())
    if m["ids"] != [r.id for r in records]:
        raise ValueError(f"--difficulty {path} was measured on other training studies than --data has")
    return {**m, **{k: np.array(m[k], dtype=float) for k in ARRAYS}}


def measurer_notes(args: Args) -> list[str]:
    """What this run's measurer does not do as Sec. 4.3 does, one line each (none when it reads --difficulty)."""
    if args.difficulty and not args.measure_only:
        return []
    notes = {  # each a small stand-in fit to the labels
        "visual": "VNS-Gap images (phi, Eq. 1): a small CNN, not a CheXpert-tuned ResNet-101 (--visual-encoder FILE)",
        "itas": "ITAS images: a small CNN, not a pre-trained 5-layer ResNet (--itas-encoder FILE: a ResNet-18)",
        "text": "reports (psi, Eq. 2): a word CNN, not Clinical BERT (--text-encoder emilyalsentzer/Bio_ClinicalBERT)",
    }
    return [note for k, note in notes.items() if getattr(args, f"{k}_encoder") == "small"]


# Fig. 1: Q1 --------------------------------------------------------------------------------------
def q1_analysis(rows: list[dict], labels: np.ndarray, classes: list[dict], style: str = "mimic_cxr") -> dict:
    """Per-class corpus BLEU-4 of the test reports (cleaned as common.evaluate_generations) against the class's
    training size and difficulty: Spearman rho over the keyword classes with test studies (labels: class_labels)."""
    from scipy.stats import spearmanr

    per_class = []
    for c in classes:
        sel = np.flatnonzero(labels[:, common.LABEL_INDEX[c["name"]]] == 1) if c["name"] in CLASSES else []
        if len(sel):
            hyps = [
                common.clean_report(rows[i]["generated"], style) if rows[i]["generated"].strip() else "" for i in sel
            ]
            refs = [common.clean_report(rows[i]["reference"], style) for i in sel]
            per_class.append({**c, "n_test": len(sel), "bleu4": common.nlg_metrics(hyps, refs, meteor=False)["BLEU-4"]})
    out = {"per_class": sorted(per_class, key=lambda c: -c["size"])}
    if len(per_class) >= 3:
        for key in ("size", "difficulty"):
            rho, p = spearmanr([c[key] for c in per_class], [c["bleu4"] for c in per_class])
            out[f"spearman_bleu4_vs_{key}"] = {"rho": float(rho), "p": float(p), "n_classes": len(per_class)}
    return out


def q1_command(args: Args) -> dict:
    """`python rrgcl.py q1 --out DIR`: Fig. 1 for DIR/generations_test.jsonl (any model's: id, generated)."""
    data = common.load_data(args.data)
    out = Path(common.resolve_defaults(args).out)  # (resolves --labeler auto)
    test = {r.id: r for r in data["test"]}
    rows = common.read_generations(out / "generations_test.jsonl")
    if any(row["id"] not in test for row in rows):
        raise ValueError(f"{out / 'generations_test.jsonl'}: ids that are not test studies of --data {args.data}")
    labels = class_labels([test[row["id"]] for row in rows], common.make_labeler(args.labeler, args.chexbert_weights))
    m = read_difficulty(Path(args.difficulty or out / "difficulty.json"), data["train"])
    plan = curriculum_plan(sample_difficulty(m["dif1"], m["dif2"], args.alpha, args.itas_sign), m["labels"])
    style = common.clean_style(data["train"]) if args.clean == "auto" else args.clean
    result = q1_analysis(rows, labels, plan["table"], style)
    (out / "q1.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "per_class"}, indent=1))
    return result


def main(argv=None):
    def command(name: str, args: Args) -> dict:
        return q1_command(args) if name == "q1" else train(args)

    return common.run_main(command, Args, argv, __doc__, commands=("train", "q1"))


if __name__ == "__main__":
    main()
