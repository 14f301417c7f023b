"""Behaviour pinned where a one-line slip would hide (issue 44): a convergence rule's state across a stop and the best
weights each trainer keeps; the flags a stage's --resume checks; each flag's range; the labeler a run uses; the numeric
pins over the caller's environment; the sweep's jobs; FSDP2's dtypes on a real wrap; how rewards read uncertain
labels and pair each completion with its own study; the degenerate-output threshold."""

import dataclasses
import importlib
import json
import typing
from pathlib import Path
from typing import Annotated

import numpy as np
import pytest
import torch

import common
import sandbox
from conftest import Crash, labels

ROOT = Path(__file__).resolve().parents[1]


# --- convergence: the rule at its edges, its state across a stop, the weights each trainer keeps -------------------
def test_a_gain_of_exactly_min_gain_counts_and_patience_is_exact():
    model = torch.nn.Linear(1, 1)
    rule = common.Convergence(every=1, patience=2, min_gain=0.25, max_steps=9)
    shown = [rule.update(score, step, model) for step, score in enumerate([0.5, 0.75, 0.99], 1)]
    assert (rule.best, rule.best_step, rule.waited, rule.converged) == (0.75, 2, 1, False)  # 0.75 = 0.5 + 0.25: a gain
    assert [s["patience_left"] for s in shown] == [2, 2, 1] and shown[-1]["best"] == 0.75
    rule.update(0.2, 4, model)
    assert rule.converged and rule.why(4).startswith("stopped after 4 steps (2 validations without a gain of 0.25)")


@pytest.fixture
def scripted(monkeypatch):
    """Every Convergence.update reads the next of `scores` instead of what was measured, and records the trainable
    weights it was shown: returns (set the scores, the weights by step)."""
    weights, scores = {}, []
    real = common.Convergence.update

    def update(self, score, step, model):
        weights[step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return real(self, scores.pop(0), step, model)

    monkeypatch.setattr(common.Convergence, "update", update)
    return scores.extend, weights


def same(a: dict, b: dict) -> bool:
    return a.keys() <= b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_foundation_trainer_keeps_its_best_held_out_weights(scripted):
    scores, weights = scripted
    scores([-3.0, -2.0, -2.5, -2.6])  # held-out losses 3, 2, 2.5, 2.6: the second is the best
    model = torch.nn.Linear(3, 1)
    record = sandbox.held_out_convergence(
        lambda step: model(torch.ones(1, 3)).sum(), lambda: 0.0, model, "t", 2, 2, 0.1, 40, 0.1
    )
    assert record["best_step"] == 4 and record["steps"] == 8
    assert same(weights[4], dict(model.named_parameters()))


def test_the_image_ceiling_classifier_keeps_its_best_epoch(scripted, small_synthetic):
    import reproduce

    scores, weights = scripted
    scores([-2.0, -1.0, -1.5, -1.6, -1.7])
    data = common.load_annotation(small_synthetic)
    with pytest.MonkeyPatch.context() as mp:
        kept = {}
        real_predict = torch.nn.Sequential.forward

        def forward(self, x):
            if len(x) == len(data["test"]) and not kept:  # the test images, the outer net: the weights predicting
                kept.update({n: p.detach().clone() for n, p in self.named_parameters()})
            return real_predict(self, x)

        mp.setattr(torch.nn.Sequential, "forward", forward)
        _, record = reproduce.image_ceiling_findings(data)
    assert record["best_epoch"] == 2 and same(weights[2], kept)


def test_rrgcl_encoders_and_mine_keep_their_best(scripted, small_synthetic):
    import rrgcl

    scores, weights = scripted
    scores([-1.0, -0.5, -0.7, -0.8])  # the encoder's held-out BCE: the second epoch is the best
    records = common.load_annotation(small_synthetic)["train"]
    studies = [common.Record(r.id, r.image_paths, r.report, r.split, r.labels) for r in records]
    net = common.ViewMean(common.SmallCNN((8, 8), (2, 2), grid=1, dim=None), torch.nn.Linear(8, 14))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rrgcl, "ENCODER_CONVERGE", dict(every=1, patience=2, min_gain=0.01, max_steps=9))
        rrgcl.fit_encoder(net, common.ReportDataset(studies, common.default_transform(16, 1)), "images", "cpu")
    assert same(weights[2], dict(net.named_parameters()))
    scores([0.1, 0.3, 0.2, 0.25])  # MINE's held-out bound: step 2 x every is the best
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rrgcl, "MINE_CONVERGE", dict(every=5, patience=2, min_gain=0.01, max_steps=100))
        T, best = rrgcl.train_mine(torch.randn(40, 3), torch.randn(40, 2), 8, 1e-2, 0.25, 2)
    assert best == 0.3 and same(weights[10], dict(T.named_parameters()))


def test_deer_sft_keeps_the_weights_it_validated_best(tmp_path, small_synthetic, scripted):
    import deer

    scores, weights = scripted
    scores([0.2, 0.5, 0.4, 0.3])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deer, "SFT", dict(deer.SFT, batch_tiny=8))
        mp.setattr(deer, "CONVERGE", dict(every=2, patience=2, min_gain=0.01, max_steps=40))
        mp.setattr(deer, "N_VAL", 2)
        deer.main(
            [
                "sft",
                "--data",
                str(small_synthetic),
                "--labeler",
                "rule",
                "--out",
                str(tmp_path),
                "--max-new-tokens",
                "4",
            ]
        )
    result = json.loads((tmp_path / "sft" / "eval.json").read_text())
    assert result["steps"] == 8 and result["converge"]["best_step"] == 4
    final = common.load_policy(tmp_path / "sft" / "final").model.state_dict()
    assert same(weights[4], final)


def test_a_converging_warm_start_stopped_and_resumed_equals_one_never_stopped(
    tmp_path, small_synthetic, monkeypatch, crash_after_checkpoint
):
    """The rule's state (best, waited, best weights) travels in the checkpoint: a resumed warm start stops where, and
    keeps what, one never stopped does."""
    import mrg_r1

    monkeypatch.setattr(mrg_r1, "CONVERGE", dict(every=2, patience=2, min_gain=1.0, max_steps=40))  # stops at 6
    monkeypatch.setattr(mrg_r1, "N_VAL", 2)
    monkeypatch.setattr(mrg_r1, "WARM_START", dict(lr_tiny=3e-3, lr_hf=1e-2, batch_size=8))
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", 4)
    flags = ["--data", str(small_synthetic), "--labeler", "rule", "--steps", "0", "--max-new-tokens", "4"]
    mrg_r1.main([*flags, "--out", str(tmp_path / "full")])
    crash_after_checkpoint(4)
    with pytest.raises(Crash):
        mrg_r1.main([*flags, "--out", str(tmp_path / "part")])
    crash_after_checkpoint(None)
    mrg_r1.main([*flags, "--out", str(tmp_path / "part"), "--resume"])
    full, part = (json.loads((tmp_path / d / "warm_start" / "eval.json").read_text()) for d in ("full", "part"))
    assert part["converge"] == full["converge"] and part["steps"] == full["steps"] == 6
    a, b = (common.load_policy(tmp_path / d / "warm_start" / "final").model.state_dict() for d in ("full", "part"))
    assert same(a, b)


@pytest.mark.parametrize("name, title", [("mrg_r1", "MRG-R1"), ("deer", "DEER"), ("rrgcl", "RRGCL")])
def test_each_sft_stopping_rule_is_the_one_its_readme_section_declares(name, title):
    """The rules were declared before the sweeps, in each paper's premises table: the code and the declaration agree
    (a change to either alone fails)."""
    rule = importlib.import_module(name).CONVERGE
    section = (ROOT / "README.md").read_text().split(f"## {title} (`{name}.py`)")[1].split("\n## ")[0]
    assert f"(every {rule['every']} steps, patience {rule['patience']}, gain {rule['min_gain']:g})" in section


# --- the flags a stage's --resume checks ---------------------------------------------------------------------------
def test_deer_stages_depend_on_these_flags_and_no_others():
    """A stage's output depends on every flag listed (a resume with another value is refused) and on no other (it may
    change): the SFT's validation reads the labels, so its labeler counts; the RL's steps place the phase switch."""
    import deer

    shared = {"data", "model", "tiny_start", "seed", "dtype", "max_pixels", "max_new_tokens", "drop_invalid"}
    labels_ = {"labeler", "chexbert_weights"}
    rl = {"weighting", "alpha", "beta", "gamma", "group_size", "prompts_per_step", "grad_accum", "lr", "steps"}
    assert set(deer.STAGE_FLAGS["sft"]) == shared | labels_ | {"sft_steps", "sft_lm"}
    assert set(deer.STAGE_FLAGS["ddsampling"]) == shared | labels_
    assert set(deer.STAGE_FLAGS["rl"]) == shared | labels_ | rl | {"subset", "fraction", "fsdp"}
    every = {f.name for f in dataclasses.fields(deer.Args)}
    assert set().union(*deer.STAGE_FLAGS.values()) <= every


def test_a_stage_refuses_a_listed_flag_changed_and_takes_an_unlisted_one(tmp_path):
    import deer

    args = common.resolve_defaults(deer.Args(data="d", out=str(tmp_path / "rl"), resume=True))
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "config.json").write_text(json.dumps(dataclasses.asdict(args)))

    def resume(**changed):
        return common.Run(dataclasses.replace(args, **changed), 0, 1, "cpu", {}, None, deer.STAGE_FLAGS["rl"])

    with pytest.raises(ValueError, match=r"--alpha 4.0 in the run, 2.0 now"):
        resume(alpha=2.0)
    with pytest.raises(ValueError, match=r"--chexbert-weights None in the run, 'w.pth' now"):
        resume(chexbert_weights="w.pth")
    resume(sft_steps=5, sft_lm="trained")  # the RL stage does not depend on them


def test_dcrrg_resumes_a_step_with_another_steps_budget_refused_and_other_steps_free(tmp_path, small_synthetic):
    import dcrrg

    flags = ["step1", "--data", str(small_synthetic), "--labeler", "rule", "--out", str(tmp_path), "--batch-size", "4"]
    dcrrg.main([*flags, "--step1-steps", "1"])
    with pytest.raises(SystemExit, match=r"--step1-steps 1 in the run, 2 now"):
        dcrrg.main([*flags, "--step1-steps", "2", "--resume"])
    with pytest.raises(SystemExit, match=r"--seed 0 in the run, 1 now"):  # a step's own flags, the shared ones too
        dcrrg.main([*flags, "--step1-steps", "1", "--seed", "1", "--resume"])
    dcrrg.main([*flags, "--step1-steps", "1", "--step2-steps", "7", "--resume"])  # finished: read back


# --- each flag's range: the one its paper or method implies -------------------------------------------------------
STEPS, COUNT, LR, PIXELS = "[0, inf)", "[1, inf)", "[0, 1]", "[784, inf)"  # PIXELS: one 28 x 28 Qwen2.5-VL patch group
RANGES = {  # (script, field): the range, and why its ends are where they are; every ranged flag of every script
    ("common", "seed"): "[0, 2e9]",  # numpy's and torch's seeds are unsigned 32-bit; + rank stays inside
    ("common", "eval_batch_size"): COUNT,
    ("common", "gpu_memory"): "(0, inf)",  # a card's GiB, more than none
    ("mrg_r1", "margin"): "(-1, 1)",  # Eq. 6 states m in (-1, 1) and divides by 1 - m
    ("mrg_r1", "group_size"): "[2, inf)",  # group-relative advantages need 2
    ("mrg_r1", "beta"): "[0, inf)",  # Eq. 1's KL weight, beta >= 0
    ("orapo", "lambda_min"): "[0, 1]",  # Eq. 10-11: a convex weight
    ("orapo", "lambda_max"): "[0, 1]",
    ("orapo", "dpo_beta"): "(0, inf)",  # Eq. 5: beta 0 makes every margin 0
    ("orapo", "group_size"): "[2, inf)",
    ("orapo", "beta"): "[0, inf)",  # the KL weight
    ("orapo", "train_size"): STEPS,  # 0: all
    ("deer", "fraction"): "(0, 1]",  # Sec. 3.2: a share of the data; 0 selects nothing
    ("deer", "alpha"): "[0, inf)",  # Eq. 8: w = 1 + alpha TF-IDF >= 1
    ("deer", "beta"): "[0, inf)",  # Eq. 12
    ("deer", "gamma"): "[0, inf)",  # Eq. 1
    ("deer", "group_size"): "[2, inf)",
    ("rrgcl", "alpha"): "[0, 1]",  # Eq. 10, beta = 1 - alpha
    ("rrgcl", "epochs"): "[1, inf)",  # Eq. 11 divides by T
    ("dcrrg", "prefix_len"): COUNT,
    ("dcrrg", "n_test"): COUNT,
    **{(s, "lr"): LR for s in ("mrg_r1", "orapo", "deer", "rrgcl", "dcrrg")},
    **{(s, "steps"): STEPS for s in ("mrg_r1", "orapo", "deer", "rrgcl")},  # 0: evaluate only
    **{(s, "sft_steps"): STEPS for s in ("mrg_r1", "orapo", "deer")},
    **{(s, "max_new_tokens"): COUNT for s in ("mrg_r1", "orapo", "deer")},
    **{(s, "prompts_per_step"): COUNT for s in ("mrg_r1", "orapo", "deer")},
    **{(s, "grad_accum"): COUNT for s in ("mrg_r1", "deer", "orapo")},
    **{(s, "max_pixels"): PIXELS for s in ("mrg_r1", "orapo", "deer")},
    ("rrgcl", "batch_size"): COUNT,
    ("dcrrg", "batch_size"): COUNT,
    ("dcrrg", "decoder_batch_size"): COUNT,
    **{("dcrrg", f"step{k}_steps"): STEPS for k in (1, 2, 3, 4)},
}


def ranged_flags(script: str) -> dict:
    """{field: its range} of every flag of `script` that declares one (common: RunArgs's own)."""
    args_class = common.RunArgs if script == "common" else importlib.import_module(script).Args
    inherited = set() if script == "common" else {f.name for f in dataclasses.fields(common.RunArgs)}
    fields = [
        f for f in dataclasses.fields(args_class) if f.name not in inherited or f.name in args_class.__annotations__
    ]
    hints = typing.get_type_hints(args_class, include_extras=True)  # Annotated[int, "[0, inf)"]: its range
    return {f.name: typing.get_args(hints[f.name])[1] for f in fields if typing.get_origin(hints[f.name]) is Annotated}


@pytest.mark.parametrize("script", ["common", "mrg_r1", "orapo", "deer", "rrgcl", "dcrrg"])
def test_each_flag_range_is_the_one_its_method_implies(script):
    """Every ranged flag is in RANGES (a new one, or a range dropped, fails too) with the range given there."""
    expected = {name: r for (s, name), r in RANGES.items() if s == script}
    assert ranged_flags(script) == expected


def test_mccs_at_the_edge_of_its_margin_range_and_dpo_beta_0_would_learn_nothing():
    """What the ranges keep out: m = 1 divides by zero; DPO's margin is 0 whatever the log-probs at beta 0."""
    import mrg_r1
    import orapo

    hyp = ref = labels(Cardiomegaly=1)
    assert mrg_r1.mccs(hyp, ref, margin=0.999)[0] == pytest.approx(1.0, abs=1e-3)
    orthogonal = labels(Edema=1)  # CCS 0: a negative margin (Eq. 6's m in (-1, 1)) still pays (0 + 0.5) / 1.5
    assert mrg_r1.mccs(hyp, orthogonal, margin=-0.5)[0] == pytest.approx(1 / 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        assert mrg_r1.mccs(hyp, ref, margin=1.0)[0] == 0.0  # every report 0: no reward left to learn from
    lp = torch.tensor([[-1.0], [-3.0]])
    loss, _ = orapo.dpo_loss(lp[:1], lp[1:], lp[1:], lp[:1], beta=0.0)
    assert loss.item() == pytest.approx(np.log(2))  # no preference at all


# --- the labeler a run uses -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data, model, labeler, weights, expected",
    [
        ("synthetic", "tiny", "auto", None, ("chexbert", "sandbox")),
        ("synthetic", "tiny", "auto", "mine.pth", ("chexbert", "mine.pth")),  # given weights win over the sandbox's
        ("synthetic", "tiny", "rule", None, ("rule", None)),
        ("real", "tiny", "auto", None, ("rule", None)),  # the tiny model on real data, offline
        ("real", "tiny", "auto", "mine.pth", ("chexbert", "mine.pth")),
        ("real", "tiny", "chexbert", None, ("chexbert", None)),  # CheXbert's real weights, downloaded
        ("synthetic", "Qwen/Qwen2.5-VL-3B-Instruct", "auto", None, ("chexbert", "sandbox")),
        ("real", "Qwen/Qwen2.5-VL-3B-Instruct", "auto", None, ("chexbert", None)),  # a paper's model: its labeler
        ("real", "Qwen/Qwen2.5-VL-3B-Instruct", "auto", "mine.pth", ("chexbert", "mine.pth")),
    ],
)
@pytest.mark.usefixtures("synthetic_set_is_small")  # not the full set, drawn
def test_the_labeler_a_run_uses(tmp_path, small_synthetic, monkeypatch, data, model, labeler, weights, expected):
    made = []
    monkeypatch.setattr(sandbox, "synthetic_chexbert", lambda *a, **k: "sandbox")
    monkeypatch.setattr(common, "load_data", lambda *a, **k: common.load_annotation(small_synthetic))
    monkeypatch.setattr(common, "make_labeler", lambda name, w=None, device=None: made.append((name, w)) or None)
    args = common.RunArgs(
        data="synthetic" if data == "synthetic" else str(small_synthetic),
        model=model,
        labeler=labeler,
        chexbert_weights=weights,
        tiny_start="random",
        out=str(tmp_path / "r"),
    )
    common.start_run(args)
    assert made == [expected]


# --- the numeric pins win over the caller's environment ------------------------------------------------------------
OTHERS = {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"}


def test_sandbox_training_runs_under_the_pins_whatever_the_caller_set(tmp_path, small_synthetic, monkeypatch):
    seen = []

    def capture(command, env, **kwargs):
        seen.append(env)
        raise KeyboardInterrupt  # nothing to train here

    for k, v in OTHERS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sandbox.subprocess, "run", capture)
    for build in (sandbox.synthetic_chexbert, sandbox.synthetic_foundation):
        with pytest.raises(KeyboardInterrupt):
            build(tmp_path / "x" / "annotation.json", {"epochs": 1})
    assert len(seen) == 2 and all({k: env[k] for k in sandbox.NUMERIC_PINS} == sandbox.NUMERIC_PINS for env in seen)


def test_a_sweeps_run_reads_the_pins_in_its_own_process(tmp_path, monkeypatch):
    import reproduce

    for k, v in OTHERS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    job = reproduce.Job("r", [str(ROOT / "tests" / "stand_in.py"), "env"], done="env.json")
    reproduce.run_all([job], tmp_path, 1, dry_run=False)
    env = json.loads((tmp_path / "r" / "env.json").read_text())
    assert {k: env[k] for k in sandbox.NUMERIC_PINS} == sandbox.NUMERIC_PINS
    assert reproduce.records(job, tmp_path)[0]["machine"]["cpu_capability"] == "AVX2"  # not the caller's "default"


# --- the sweep's jobs -----------------------------------------------------------------------------------------------
def test_each_tables_jobs_for_a_seed():
    """The exact runs a seed of each table takes: a dropped arm, a flag or a wrong dependency fails here."""
    import reproduce

    def runs(name):
        return [(j.name, j.argv, j.done, j.after) for j in reproduce.EXPERIMENTS[name].jobs(401, reproduce.EXPLORATORY)]

    init = ["--init", "{root}/s401/start/warm_start/final"]
    seed = ["--seed", "401"]
    mrg = [("s401/start", ["mrg_r1.py", *seed, "--steps", "0"], "eval.json", ())]
    mrg += [
        (f"s401/{r}", ["mrg_r1.py", *seed, *init, "--reward", r], "eval.json", ("s401/start",))
        for r in ("mccs+format", "format", "ce_f1+format", "mccs", "ce_f1", "nlg")
    ]
    mrg += [
        (
            "s401/sft+300",
            ["mrg_r1.py", *seed, *init, "--sft-steps", "300", "--steps", "0"],
            "eval.json",
            ("s401/start",),
        )
    ]
    assert runs("mrg_r1") == mrg
    deer_rl = [("rule", "ddsampling", "rl_rule"), ("none", "all", "rl_none_all"), ("grad", "all", "rl_grad_all")]
    deer_rl += [("rule", "all", "rl_rule_all"), ("none", "random", "rl_none_random")]
    assert runs("deer") == [("s401", ["deer.py", "all", *seed], "rl_grad/eval.json", ())] + [
        ("s401", ["deer.py", "rl", *seed, "--weighting", w, "--subset", s], f"{f}/eval.json", ()) for w, s, f in deer_rl
    ] + [("s401", ["deer.py", t, *seed], f"{t}.json", ()) for t in ("table6", "table7")]
    assert runs("orapo") == [
        ("s401/orapo", ["orapo.py", *seed], "eval.json", ()),
        ("s401/grpo", ["orapo.py", *seed, "--lambda-min", "0", "--lambda-max", "0"], "eval.json", ()),
        ("s401/orapo400", ["orapo.py", *seed, "--train-size", "100", "--steps", "100"], "eval.json", ()),  # row 4
    ]
    own = ["--difficulty", "{root}/s401/measure/difficulty.json"]
    assert runs("rrgcl") == [
        ("s400/measure", ["rrgcl.py", "--seed", "400", "--measure-only"], "eval.json", ()),
        ("s401/measure", ["rrgcl.py", *seed, "--measure-only"], "eval.json", ()),
        ("s401/none", ["rrgcl.py", *seed, *own, "--scheduler", "none"], "eval.json", ("s401/measure",)),
        ("s401/rrgcl", ["rrgcl.py", *seed, *own], "eval.json", ("s401/measure",)),
        ("s401/root", ["rrgcl.py", *seed, *own, "--scheduler", "root"], "eval.json", ("s401/measure",)),
    ]
    assert runs("dcrrg") == [("s401", ["dcrrg.py", "ablation", *seed], "ablation/ablation.json", ())]


def test_a_recheck_refuses_the_sweeps_own_folder(tmp_path, monkeypatch):
    import reproduce

    exp = reproduce.EXPERIMENTS["orapo"]
    job = exp.jobs(400, exp.declared)[0]
    record = {"argv": reproduce.portable(reproduce.arm_argv(job, tmp_path / "orapo"), tmp_path / "orapo")}
    data = {"seeds": {"400": {"arms": {}}}, "runs": {"400": {"x": [record]}}}
    results = tmp_path / "orapo.json"
    results.write_text(json.dumps(data))
    (tmp_path / "orapo").mkdir()
    reproduce.records_path(job, tmp_path / "orapo").parent.mkdir(parents=True, exist_ok=True)
    later = {**record, "started": "a launch of its own"}  # beside the sweep's record: the folder still holds that
    reproduce.records_path(job, tmp_path / "orapo").write_text(json.dumps(record) + "\n" + json.dumps(later) + "\n")
    monkeypatch.setattr(reproduce, "run_all", lambda *a, **k: pytest.fail("the recheck ran in the sweep's folder"))
    with pytest.raises(SystemExit, match="holds the sweep's own runs of seed 400: give --out a fresh folder"):
        reproduce.main(["orapo", "--recheck", "400", "--out", str(tmp_path), "--results", str(tmp_path)])


# --- FSDP2 on a real wrap: the dtypes it gathers in, reduces in and keeps -------------------------------------------
def test_fsdp2_gathers_in_bf16_reduces_in_fp32_and_keeps_fp32_masters(tmp_path):
    from torch.distributed.fsdp import FSDPModule

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        size = dict(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=8, bos_token_id=1, eos_token_id=2)
        model = GPT2LMHeadModel(GPT2Config(**size))
        common.shard(model, torch.bfloat16)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert [type(m).__name__ for m in units] == ["FSDPGPT2LMHeadModel", "FSDPGPT2Block", "FSDPGPT2Block"]
        for m in units:
            policy = m._get_fsdp_state()._mp_policy
            assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # the sharded masters stay fp32
        model(torch.arange(6)[None]).logits.float().sum().backward()
        assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}
    finally:
        torch.distributed.destroy_process_group()


# --- rewards: uncertain labels, and each completion against its own study ------------------------------------------
def test_every_reward_counts_an_uncertain_finding_as_present():
    """MRG-R1's MCCS and CE-F1, DEER's F1 and DDSampling, OraPO's FactS: a hedged finding is a finding (each paper's
    reading), for the generated report and for the reference alike."""
    import deer
    import mrg_r1
    import orapo

    unsure, sure = labels(Edema=-1), labels(Edema=1)
    for generated, reference in [(unsure, sure), (sure, unsure)]:
        assert mrg_r1.mccs(generated, reference, 0.5)[0] == pytest.approx(1.0)
        assert mrg_r1.ce_f1_reward(generated, reference)[0] == 1.0
        assert deer.report_f1(generated, reference)[0] == 1.0
    assert deer.diagnostic_diversity(np.stack([unsure[0], sure[0]])[None])[0] == 0.0  # the same binary label in both
    reward, _ = orapo.facts_reward(
        ["Possible mild pulmonary edema."], sure, orapo.SentenceFacts(), common.RuleLabeler()
    )
    assert reward[0] == pytest.approx(1.0)
    reward, _ = orapo.facts_reward(
        ["There is mild pulmonary edema."], unsure, orapo.SentenceFacts(), common.RuleLabeler()
    )
    assert reward[0] == pytest.approx(1.0)


@pytest.mark.parametrize("script", ["mrg_r1", "deer", "orapo"])
def test_each_completion_is_scored_against_its_own_studys_reference(tmp_path, small_synthetic, monkeypatch, script):
    """The rewards a real step gives two studies with different findings: each study's first half of its G rows
    writes its own reference, the second half the other study's; every row is scored against its own study's
    (the own rows above the crossed)."""
    module = importlib.import_module(script)
    train = common.load_annotation(small_synthetic)["train"]
    a = next(
        r
        for r in train
        if common.binarize(r.labels[None]).sum() and r.labels[common.LABEL_INDEX["Support Devices"]] != 1
    )
    b = next(r for r in train if r.labels[common.LABEL_INDEX["No Finding"]] == 1)
    batch = common.collate([common.ReportDataset([r])[0] for r in (a, b)])
    monkeypatch.setattr(common.Run, "study_batches", lambda self, *args, **kwargs: lambda start: iter([batch] * 10))
    texts, captured = [a.report, b.report], []
    if script == "mrg_r1":
        texts = [f"<think> x </think> <report> {t} </report>" for t in texts]

    def rollout(policy, images, text, G, *args, **kwargs):
        rows = [texts[(i + (j >= G // 2)) % 2] for i in range(2) for j in range(G)]  # own, then the other's
        return common.Rollout(policy.prompt_batch(images, text), *policy.encode_targets(rows), rows)

    def micro_batches(policy, roll, k, G):
        captured.append((roll.rewards.view(2, G), G))
        raise Crash("captured")

    flags = ["--data", str(small_synthetic), "--labeler", "rule", "--out", str(tmp_path), "--max-new-tokens", "4"]
    if script == "deer":
        module.main(["sft", *flags, "--sft-steps", "1"])
        flags = ["rl", *flags, "--subset", "all", "--sft-steps", "1", "--prompts-per-step", "2"]
    else:
        flags += ["--sft-steps", "0", "--prompts-per-step", "2", "--group-size", "2"]
    if script == "orapo":
        flags += ["--train-size", "0"]
    monkeypatch.setattr(common, "rollout", rollout)
    monkeypatch.setattr(common, "micro_batches", micro_batches)
    with pytest.raises(Crash):
        module.main(flags)
    rewards, G = captured[0]
    own, crossed = rewards[:, : G // 2], rewards[:, G // 2 :]
    assert own.min() > crossed.max(), rewards


# --- the degenerate-output warning ----------------------------------------------------------------------------------
def test_degenerate_output_warns_past_half_identical_and_not_at_half():
    refs = [f"Report number {k} of the lungs." for k in range(10)]
    half = ["The lungs are clear."] * 5 + refs[5:]
    assert common.degenerate_output(half, refs)["warning"] == ""  # 5 of 10 alike: not over half
    over = ["The lungs are clear."] * 6 + refs[6:]
    assert "6 identical" in common.degenerate_output(over, refs, "test")["warning"]
    assert "(test)" in common.degenerate_output(over, refs, "test")["warning"]
    assert common.degenerate_output(["The lungs are clear."] * 4, refs[:4])["warning"] == ""  # under 5: no call
    for contentless, warned in [(5, False), (6, True)]:  # of 10 with no word of the references, all distinct
        hyps = [f"zzz{k}" for k in range(contentless)] + refs[contentless:]
        warning = common.degenerate_output(hyps, refs)["warning"]
        assert (f"{contentless} of 10 without a word" in warning) == warned and (warning != "") == warned
