"""Each paper's settings as a run builds them, read from the objects (the optimiser's param groups, the schedule's
multipliers, which parameters train, the reference, the first rollout's group), on the Hugging Face path (the tiny
random Qwen2.5-VL stands in for Qwen2.5-VL-3B) and on the tiny model's, beside each other. A default that moves on
either path fails a test naming the paper's value. The run stops where the settings have been read (conftest.built).
"""

import json
import math

import numpy as np
import pytest
import torch

import common
import dcrrg
import deer
import mrg_r1
import orapo
import rrgcl
from conftest import Stop, fake_eval, lr_factors, qwen_flags, recorded_but_not_used


@pytest.fixture(scope="module")
def hf_studies(tmp_path_factory, small_synthetic):
    """The small set's 40 training studies four times over (160, new ids, the same images): enough for the papers'
    batches (DEER's 64) to fill one step and an epoch to hold two."""
    out = tmp_path_factory.mktemp("hf_studies")
    (out / "images").symlink_to(small_synthetic.parent / "images")
    annotation = json.loads(small_synthetic.read_text())
    annotation["train"] = [dict(r, id=f"{r['id']}_{k}") for k in range(4) for r in annotation["train"]]
    (out / "annotation.json").write_text(json.dumps(annotation))
    return out / "annotation.json"


def only_lora_trains(read, policy, lora: dict):
    """LoRA as the paper sets it: r, alpha, dropout on every target of the language model, none in the vision tower,
    nothing but the adapters trains."""
    vision, language = policy.vision_and_language()
    assert not [m for m in vision.modules() if isinstance(m, common.LoRALinear)], "LoRA reached the vision tower"
    wrapped = {n: m for n, m in language.named_modules() if isinstance(m, common.LoRALinear)}
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == set(lora["targets"])
    for m in wrapped.values():
        assert m.lora_A.shape[0] == lora["r"] and m.scaling == lora["alpha"] / lora["r"]
        assert m.dropout.p == lora["dropout"]
    assert read.trainable and all(".lora_A" in n or ".lora_B" in n for n in read.trainable)


def adamw_of(read) -> dict:
    """The optimiser's one param group: its lr, betas, weight decay, and whether it holds exactly what trains."""
    (group,) = read.optimizer.param_groups
    held = {id(p) for p in group["params"]}
    trains = {id(p) for p in read.model.parameters() if p.requires_grad}
    lr = group.get("initial_lr", group["lr"])  # a schedule's base lr (its step 0 may be a warm-up's share)
    return dict(lr=lr, betas=group["betas"], weight_decay=group["weight_decay"], all=held == trains)


def is_frozen_copy(ref, policy) -> bool:
    """A frozen reference: another model, nothing of it trains, the policy's weights at the start."""
    weights = dict(ref.model.named_parameters())
    return (
        ref.model is not policy.model
        and not any(p.requires_grad for p in weights.values())
        and all(torch.equal(p.float(), weights[n].float()) for n, p in policy.model.named_parameters())
    )


def subset_sizes(monkeypatch) -> list:
    """The n each call of orapo.balanced_subset is asked for (Sec. 4.1's training subset)."""
    sizes, real = [], orapo.balanced_subset

    def balanced_subset(labels, n, seed):
        sizes.append(n)
        return real(labels, n, seed)

    monkeypatch.setattr(orapo, "balanced_subset", balanced_subset)
    return sizes


# OraPO (Sec. 4.1, App. A: the whole 3B trains, RL only, TRL's GRPOTrainer defaults) ---------------------------------
def test_orapo_settings_on_a_hugging_face_model(tmp_path, hf_studies, tiny_qwen_dir, built, monkeypatch):
    sizes = subset_sizes(monkeypatch)
    with pytest.raises(Stop):
        orapo.main(qwen_flags(hf_studies, tiny_qwen_dir, tmp_path / "run"))
    read, (made,) = built.restores["run"], built.policies
    assert sizes == [1000], "Sec. 4.1: 1,000 balanced training studies"
    assert adamw_of(read) == dict(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0, all=True), "lr 1e-6, TRL's AdamW"
    total = built.steps["run"].total
    assert total == 3 * len(made.records) // 4, "TRL's 3 epochs of 4 studies a step"
    assert lr_factors(read.scheduler, [0, total // 2, total]) == [1.0, round(1 - (total // 2) / total, 6), 0.0]
    assert not read.frozen and not [m for m in made.policy.model.modules() if isinstance(m, common.LoRALinear)]
    assert is_frozen_copy(made.ref, made.policy), "a frozen copy of the start is DPO's and the KL's reference"
    assert not (tmp_path / "run" / "warm_start").exists(), "RL only: no SFT before it"
    r = built.rollout
    assert (r.G, r.studies, r.max_new_tokens, r.temperature) == (8, 4, 256, 1.0)
    args = built.run.args
    assert (args.loss_type, args.beta, args.lambda_min, args.lambda_max) == ("dr_grpo", 0.04, 0.05, 0.15)
    assert (orapo.MAX_GRAD_NORM, orapo.ZRR_MOMENTUM, orapo.ZRR_POWER) == (1.0, 0.5, 2.0)
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


def test_orapo_settings_on_the_tiny_model(tmp_path, synthetic_is_small, built, monkeypatch):
    sizes = subset_sizes(monkeypatch)
    with pytest.raises(Stop):
        orapo.main(["--out", str(tmp_path / "run")])
    read, (made,) = built.restores["run"], built.policies
    assert sizes == [250] and built.steps["run"].total == 250
    assert adamw_of(read) == dict(lr=5e-4, betas=(0.9, 0.999), weight_decay=0.0, all=True)
    assert lr_factors(read.scheduler, [0, 125, 250]) == [1.0, 0.5, 0.0]
    assert not read.frozen and is_frozen_copy(made.ref, made.policy)
    assert built.run.foundation is not None and not (tmp_path / "run" / "warm_start").exists()
    assert (built.rollout.G, built.rollout.max_new_tokens) == (8, 96)
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


def test_orapo_warm_start_on_a_hugging_face_model(tmp_path, hf_studies, tiny_qwen_dir, built):
    """--sft-steps on the HF path (ours: the paper has no SFT): WARM_START's lr and batch, the whole model trains."""
    built.skip, built.stop = {"warm_start"}, {"run"}
    with pytest.raises(Stop):
        orapo.main(qwen_flags(hf_studies, tiny_qwen_dir, tmp_path / "run", "--sft-steps", "3"))
    sft = built.restores["warm_start"]
    assert orapo.WARM_START == dict(lr=1e-3, batch_size=32)
    assert adamw_of(sft) == dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, all=True)  # torch AdamW's defaults
    assert len(built.steps["warm_start"].batch["id"]) == 32 and built.steps["warm_start"].total == 3
    assert not sft.frozen and recorded_but_not_used(built, "run", tmp_path / "run") == {}


def test_orapo_random_tiny_model_learns_report_text_blind_first(tmp_path, small_synthetic, built):
    built.skip = {"warm_start"}
    with pytest.raises(Stop):
        orapo.main(["--data", str(small_synthetic), "--out", str(tmp_path / "run")])
    sft = built.restores["warm_start"]
    assert adamw_of(sft)["lr"] == 1e-3 and len(built.steps["warm_start"].batch["id"]) == 32
    assert {k: sft.state[k] for k in ("every", "patience", "min_gain", "max_steps")} == orapo.CONVERGE
    assert orapo.CONVERGE == dict(every=100, patience=3, min_gain=0.01, max_steps=5000)
    assert built.run.args.labeler == "rule", "--labeler auto on real data with the tiny model: the offline rules"


# MRG-R1 (Sec. IV-B: LoRA r 128, alpha 256 on Qwen2.5-VL-3B; AdamW 5e-6, betas 0.9/0.99, wd 0.1, cosine, 10 % warm-up)
def test_mrg_r1_settings_on_a_hugging_face_model(tmp_path, hf_studies, tiny_qwen_dir, built):
    with pytest.raises(Stop):
        mrg_r1.main(qwen_flags(hf_studies, tiny_qwen_dir, tmp_path / "run"))
    read, (made,) = built.restores["run"], built.policies
    lora = dict(r=128, alpha=256, dropout=0.05, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    lora["targets"] += ["gate_proj", "up_proj", "down_proj"]
    only_lora_trains(read, made.policy, lora)
    assert adamw_of(read) == dict(lr=5e-6, betas=(0.9, 0.99), weight_decay=0.1, all=True)
    total = built.steps["run"].total
    assert total == len(made.records) // 4, "one epoch of 4 studies (16 completions) a step"
    w = int(0.1 * total)
    assert w >= 1 and lr_factors(read.scheduler, [0, w, total]) == [round(1 / w, 6), 1.0, 0.0], "cosine, 10 % warm-up"
    assert isinstance(made.ref, common.LoRAOff) and made.ref.policy is made.policy, "the reference: adapters off"
    assert not (tmp_path / "run" / "warm_start").exists(), "RL from the model as it is: no SFT"
    r = built.rollout
    assert (r.G, r.studies, r.max_new_tokens, r.temperature) == (4, 4, 256, 1.0)
    assert (built.run.args.beta, built.run.args.reward, mrg_r1.MAX_GRAD_NORM) == (0.04, "mccs+format", 0.1)
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


def test_mrg_r1_warm_start_on_a_hugging_face_model(tmp_path, hf_studies, tiny_qwen_dir, built):
    """--sft-steps on the HF path (the paper's SFT row names no settings; ours): lr 1e-5 (the tiny model's 1e-3 would
    wreck a 3B), 32 studies a step, the LoRA adapters alone train, as many steps as asked, no convergence rule."""
    built.skip, built.stop = {"warm_start"}, {"run"}
    with pytest.raises(Stop):
        mrg_r1.main(qwen_flags(hf_studies, tiny_qwen_dir, tmp_path / "run", "--sft-steps", "3"))
    sft, (_,) = built.restores["warm_start"], built.policies  # one policy trains: the warm start loads back
    assert adamw_of(sft)["lr"] == 1e-5 and len(built.steps["warm_start"].batch["id"]) == 32
    assert mrg_r1.WARM_START == dict(lr_tiny=1e-3, lr_hf=1e-5, batch_size=32)
    assert built.steps["warm_start"].total == 3 and built.warm_start["converge"] is None
    assert sft.trainable and all(".lora_A" in n or ".lora_B" in n for n in sft.trainable)
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


def test_mrg_r1_settings_on_the_tiny_model(tmp_path, synthetic_is_small, built):
    built.skip = {"warm_start"}
    with pytest.raises(Stop):
        mrg_r1.main(["--out", str(tmp_path / "run")])
    sft, read, (made,) = built.restores["warm_start"], built.restores["run"], built.policies
    assert adamw_of(sft)["lr"] == 1e-3 and len(built.steps["warm_start"].batch["id"]) == 32
    assert {k: sft.state[k] for k in ("every", "patience", "min_gain", "max_steps")} == mrg_r1.CONVERGE
    assert mrg_r1.CONVERGE == dict(every=100, patience=4, min_gain=0.005, max_steps=5000)
    assert adamw_of(read) == dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, all=True)
    assert built.steps["run"].total == 300 and lr_factors(read.scheduler, [0, 30, 300]) == [round(1 / 30, 6), 1.0, 0.0]
    assert not read.frozen and is_frozen_copy(made.ref, made.policy), "tiny: all of it trains, a frozen reference"
    assert (built.rollout.G, built.rollout.max_new_tokens) == (4, 128)
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


# DEER (Sec. 4.1: SFT lr 1e-5, batch 64, the LM frozen; RL lr 1e-6, 64 studies x G = 8, no KL) ------------------------
def test_deer_settings_on_a_hugging_face_model(tmp_path, hf_studies, tiny_qwen_dir, built):
    built.skip, built.stop = {"sft"}, {"ddsampling"}
    flags = qwen_flags(hf_studies, tiny_qwen_dir, tmp_path / "run", "--weighting", "rule")
    with pytest.raises(Stop):
        deer.main(["all", *flags])
    sft = built.restores["sft"]
    assert not built.policies, "Stage 1 starts from the model as it is"
    assert adamw_of(sft) == dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01, all=True) and sft.scheduler is None
    assert len(built.steps["sft"].batch["id"]) == 64 and built.steps["sft"].total == 160 // 64, "one epoch of 64"
    vision = {n for n, _ in sft.model.model.visual.named_parameters()}
    assert sft.trainable == {f"model.visual.{n}" for n in vision}, "Stage 1: the vision encoder and projector only"
    assert sft.state is None, "one epoch, no stopping rule"
    assert recorded_but_not_used(built, "sft", tmp_path / "run" / "sft") == {}
    with pytest.raises(Stop):
        deer.main(["rl", *flags, "--subset", "all"])
    read, (made,) = built.restores["rl_rule_all"], built.policies
    assert adamw_of(read) == dict(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01, all=True)
    assert read.scheduler is None, "a constant lr: the paper names no schedule"
    assert not read.frozen and made.ref is None, "all of the SFT model trains; no KL, no reference"
    assert built.steps["rl_rule_all"].total == 160 // 64
    r = built.rollout
    assert (r.G, r.studies, r.max_new_tokens, r.temperature) == (8, 64, 256, 1.0)
    assert (built.run.args.alpha, built.run.args.gamma, built.run.args.fraction) == (4.0, 0.25, 0.2)
    assert (deer.K, deer.TOP_P, deer.TEMPERATURE) == (10, 0.9, 1.0), "Sec. 3.2: K = 10 nucleus samples (top-p ours)"
    assert deer.MAX_GRAD_NORM == 1.0, "the paper gives none: verl's clip"
    assert recorded_but_not_used(built, "rl_rule_all", tmp_path / "run" / "rl_rule_all") == {}


def test_deer_settings_on_the_tiny_model(tmp_path, synthetic_is_small, built):
    built.skip, built.stop = {"sft"}, {"ddsampling"}
    flags = ["--out", str(tmp_path / "run"), "--weighting", "rule"]
    with pytest.raises(Stop):
        deer.main(["all", *flags])
    sft = built.restores["sft"]
    assert adamw_of(sft)["lr"] == 1e-3 and len(built.steps["sft"].batch["id"]) == 32
    assert {k: sft.state[k] for k in ("every", "patience", "min_gain", "max_steps")} == deer.CONVERGE
    assert deer.CONVERGE == dict(every=100, patience=4, min_gain=0.005, max_steps=5000)
    model = sft.model
    assert sft.trainable == {f"encoder.{n}" for n, _ in model.encoder.named_parameters()} | {
        f"project.{n}" for n, _ in model.project.named_parameters()
    }, "from the foundation the language model stays frozen, as Sec. 4.1's"
    with pytest.raises(Stop):
        deer.main(["rl", *flags, "--subset", "all"])
    read = built.restores["rl_rule_all"]
    assert adamw_of(read)["lr"] == 1e-4 and built.steps["rl_rule_all"].total == 120
    assert (built.rollout.G, built.rollout.studies, built.rollout.max_new_tokens) == (8, 8, 96)
    assert recorded_but_not_used(built, "rl_rule_all", tmp_path / "run" / "rl_rule_all") == {}
    assert recorded_but_not_used(built, "sft", tmp_path / "run" / "sft") == {}


def test_deer_weights_with_chexbert_by_default(tmp_path, synthetic_set_is_small, built, monkeypatch):
    """--weighting auto with CheXbert (the papers' labeler, the default for a Hugging Face model) is Eq. 9-12's."""

    def sft(*a):
        raise Stop("read the flags")

    monkeypatch.setattr(deer, "sft", sft)
    with pytest.raises(Stop):
        deer.main(["all", "--out", str(tmp_path / "run")])
    assert (built.run.args.labeler, built.run.args.weighting) == ("chexbert", "grad")


# RRGCL (Sec. 4.3: the wrapped generator's own recipe; HF: LoRA, ours) ------------------------------------------------
@pytest.fixture
def made_up_difficulty(tmp_path):
    """A difficulty file for a set's training studies (random scores): what training reads."""

    def write(annotation):
        records = common.load_annotation(annotation)["train"]
        rng = np.random.default_rng(0)
        labels = np.stack([r.labels for r in records])
        m = {"ids": [r.id for r in records], "labels": np.where(np.isnan(labels), None, labels).tolist()}
        m |= {"dif1": rng.random(len(records)).tolist(), "dif2": rng.random(len(records)).tolist(), "mine": {}}
        path = tmp_path / "difficulty.json"
        path.write_text(json.dumps(m))
        return str(path)

    return write


def test_rrgcl_settings_on_a_hugging_face_model(tmp_path, small_synthetic, tiny_qwen_dir, built, made_up_difficulty):
    built.stop = {"run"}
    flags = qwen_flags(
        small_synthetic, tiny_qwen_dir, tmp_path / "run", "--difficulty", made_up_difficulty(small_synthetic)
    )
    with pytest.raises(Stop):
        rrgcl.main(flags)
    read, (made,) = built.restores["run"], built.policies
    only_lora_trains(read, made.policy, dict(r=16, alpha=32, dropout=0.05, targets=rrgcl.LORA_TARGETS))
    assert len(rrgcl.LORA_TARGETS) == 7 and adamw_of(read)["lr"] == 1e-4
    assert lr_factors(read.scheduler, [0, 5]) == [1.0, 1.0] and read.state is None, "constant lr, no stopping rule"
    assert rrgcl.MAX_GRAD_NORM == 1.0
    assert rrgcl.MINE == dict(batch_size=256, lr=1e-4, held_out=0.2, shuffles=10), "MINE's (Belghazi et al.) lr"
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


def test_rrgcl_settings_on_the_tiny_model(tmp_path, synthetic_is_small, small_synthetic, built, made_up_difficulty):
    built.stop = {"run"}
    with pytest.raises(Stop):
        rrgcl.main(["--out", str(tmp_path / "run"), "--difficulty", made_up_difficulty(small_synthetic)])
    read = built.restores["run"]
    assert adamw_of(read)["lr"] == 1e-3 and not read.frozen
    assert {k: read.state[k] for k in ("every", "patience", "min_gain", "max_steps")} == rrgcl.CONVERGE
    assert (built.run.args.epochs, built.run.args.batch_size, built.run.args.alpha) == (10, 32, 0.6)
    assert recorded_but_not_used(built, "run", tmp_path / "run") == {}


# DCRRG (App. A: AdamW 1e-4, weight decay 1e-6, batches 32 / 16; Sec. 3.1's re-sampling; Sec. 3.4's P-Tuning v2) -------
def test_dcrrg_settings_of_the_paper_model(tmp_path, small_synthetic, built, monkeypatch):
    """--model paper (ResNet-50, BERT 512 / 8 heads): each step's optimiser, batch, budget and what trains."""
    built.skip = {"step1", "step2", "step3", "step4"}
    real_fit = dcrrg.fit

    def fit(*a):  # the real fit, its evaluation skipped
        return real_fit(*a[:-1], lambda model, st: fake_eval())

    monkeypatch.setattr(dcrrg, "fit", fit)
    monkeypatch.setattr(dcrrg, "standardise_memory", lambda *a: None)
    flags = ["all", "--data", str(small_synthetic), "--model", "paper", "--pretrained", "none", "--labeler", "rule"]
    dcrrg.main([*flags, "--out", str(tmp_path / "run")])
    n_train = 40
    for step, parts in dict(
        step1=["image_encoder", "f_v", "cls_v", "text_encoder", "f_t", "cls_t"],
        step2=["image_encoder", "f_v", "text_encoder", "f_t", "logit_scale"],
        step3=["decoder"],
        step4=["prefix", "prompt_head"],
    ).items():
        read = built.restores[step]
        assert adamw_of(read) == dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-6, all=True), step
        assert read.scheduler is None, "a constant lr: the paper gives no schedule"
        if parts:
            trained = {
                name for name, part in read.model.named_children() if any(p.requires_grad for p in part.parameters())
            }
            trained |= {n for n, p in read.model.named_parameters(recurse=False) if p.requires_grad}
            assert trained == set(parts), step
        assert recorded_but_not_used(built, step, tmp_path / "run" / step) == {}, step
    batch = built.steps["step1"].batch
    assert len(batch["image"][0]) == 32 and batch["image"][1] is not None, "32 re-sampled (study, observation) pairs"
    assert len(built.steps["step4"].batch["id"]) == 16 and built.steps["step4"].total == 10 * math.ceil(n_train / 16)
    assert built.steps["step1"].total == 10 * math.ceil(n_train / 32)
    model = built.restores["step4"].model
    assert type(model.image_encoder.body).__name__ == "ResNet" and model.image_encoder.dim == 2048
    assert model.text_encoder.config.hidden_size == 512 and model.text_encoder.config.num_attention_heads == 8
    # P-Tuning v2 (Sec. 3.4): a key and a value prefix of 16 (the paper silent: ours) at each attention of each layer
    assert model.prefix.shape[:4] == (len(model.decoder.layers), 2, 2, 16)  # (layers, attentions, key/value, length)
    dropouts = {m.p for m in model.decoder.modules() if isinstance(m, torch.nn.Dropout)}
    text = model.text_encoder.config
    assert dropouts == {0.1} and text.hidden_dropout_prob == text.attention_probs_dropout_prob == 0.1, "ours: 0.1"
    assert dcrrg.RETRIEVAL_PER_CLASS == 200, "CheXpert 5x200: 200 studies of each of the 5 observations"
