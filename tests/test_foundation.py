"""The sandbox's foundation: captions that never name a finding, a model trained on two tasks that never meet, and
every script starting where its paper starts (small copies: tests/conftest.py's SMALL_FOUNDATION)."""

import json
import re

import numpy as np
import pytest
import torch

import common
import sandbox
from conftest import SMALL_FOUNDATION

# words a caption shares with the report templates: articles, prepositions and the sides (the image's, not the
# patient's)
SHARED = {"a", "at", "both", "in", "is", "left", "of", "on", "right", "the", "with"}


def report_words() -> set[str]:
    """Every word the synthetic report templates can write (their fields filled every way)."""
    texts = [
        *sandbox.POSITIVE_TEMPLATES.values(),
        *sandbox.UNCERTAIN_TEMPLATES.values(),
        *sandbox.NEGATED_PHRASES.values(),
    ]
    texts += [*sandbox.NEGATED_SINGLE.values(), sandbox.NEGATED_LIST_TEMPLATES, sandbox.NORMAL_EXTRAS]
    fields = " ".join(" ".join(v) for v in sandbox.DEGREES.values()) + " small moderate large left right bilateral"
    return set(re.findall(r"[a-z]+", (" ".join(texts) + " " + fields).lower())) - {
        "deg",
        "degly",
        "sev",
        "side",
        "list",
    }


def random_studies(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [sandbox.sample_synthetic_study(rng)[0] for _ in range(n)]


def test_captions_never_use_a_report_word_for_a_finding():
    """A caption says where, how large, how bright, what shape: no finding's name, no report word but the shared
    function words and sides, and the sides are the image's (the patient's right is the image's left)."""
    studies = random_studies(3000)
    captions = [sandbox.describe_synthetic_image(f) for f in studies]
    words = {w for c in captions for w in re.findall(r"[a-z]+", c.lower())}
    assert words & report_words() <= SHARED
    names = {w for n in common.CHEXPERT_LABELS for w in n.lower().split()}
    assert not words & (names - SHARED)
    right = next(
        c for f, c in zip(studies, captions) if list(f) == ["Lung Lesion"] and f["Lung Lesion"]["side"] == "right"
    )
    assert right == "A little round bright dot on the left of the image."
    hedged = sandbox.describe_synthetic_image(
        {"Pleural Effusion": {"uncertain": True, "side": "left", "severity": "large"}}
    )
    assert hedged == "A pale very deep white pool at the bottom on the right of the image, its edge rising outward."
    assert sandbox.describe_synthetic_image({}) == "Nothing stands out."


def test_caption_signs_read_back_what_was_drawn():
    studies = random_studies(500, seed=1)
    signs = sandbox.caption_signs([sandbox.describe_synthetic_image(f) for f in studies])  # (N, 13)
    drawn = np.array([[n in f for n in common.FINDINGS] for f in studies])
    assert (signs == drawn).all() and drawn.any(0).all()


def test_the_foundation_is_built_once_from_data_apart_from_the_set(small_foundation, small_synthetic):
    """Two tasks, each a held-out likelihood that fell; its tokenizer covers the set's words, MRG-R1's tags and the
    labels' names; a second call finds it (no retraining); its text encoder loads as a BERT."""
    from transformers import AutoModel, AutoTokenizer

    record = json.loads((small_foundation / "foundation.json").read_text())
    assert record["settings"] == SMALL_FOUNDATION and record["version"] == sandbox.FOUNDATION_VERSION
    for part in ("vlm", "text_encoder"):
        curve = [loss for _, loss in record[part]["curve"]]
        assert curve[-1] < curve[0], (part, curve)
    policy = common.load_policy(small_foundation / "vlm")
    train = common.load_annotation(small_synthetic)["train"]
    words = {w for r in train for w in policy.tokenizer.encode(r.report)}
    assert policy.tokenizer.unk_id not in words
    assert {sandbox.CAPTION_TOKEN, *sandbox.REASONING_TAGS, "cardiomediastinum"} <= set(policy.tokenizer.vocab)
    _images, _captions, reports = sandbox.foundation_data(5, 5, SMALL_FOUNDATION["seed"])
    assert not {r.report for r in train} & set(reports)  # another seed: not the set's studies
    probe = record["probe"]
    assert 0.5 <= probe["probe_auroc_mean"] <= 1 and 0 <= probe["caption_signs_f1"] <= 1
    stamp = (small_foundation / "foundation.json").stat().st_mtime
    assert sandbox.synthetic_foundation(small_synthetic, SMALL_FOUNDATION) == small_foundation
    assert (small_foundation / "foundation.json").stat().st_mtime == stamp
    bert = AutoModel.from_pretrained(small_foundation / "text_encoder")
    tok = AutoTokenizer.from_pretrained(small_foundation / "text_encoder")
    assert (
        bert.config.hidden_size == sandbox.SIZES_TEXT_ENCODER["hidden"]
        and tok.unk_token_id not in tok(train[0].report)["input_ids"]
    )


def test_a_caption_prompt_starts_with_its_own_token(small_foundation):
    """One model, two tasks: the start token is all that tells them apart (the image is the same)."""
    from PIL import Image

    policy = common.load_policy(small_foundation / "vlm")
    image = [[Image.new("L", (64, 64), 128)]]
    report, caption = policy.prompt_batch(image), sandbox.caption_prompts(policy, image)
    assert report["start_ids"].tolist() == [policy.tokenizer.bos_id]
    assert caption["start_ids"].tolist() == [policy.tokenizer.index[sandbox.CAPTION_TOKEN]]
    assert torch.equal(report["pixel_values"], caption["pixel_values"])
    prefix = policy.model.prefix(**report), policy.model.prefix(**caption)
    assert torch.equal(prefix[0][:, :-1], prefix[1][:, :-1]) and not torch.equal(prefix[0][:, -1], prefix[1][:, -1])


def test_tiny_start_resolves_by_the_data():
    import mrg_r1

    def resolved(**flags):
        return common.resolve_defaults(mrg_r1.Args(**flags)).tiny_start

    assert resolved(data="synthetic") == "foundation" and resolved(data="x.json") == "random"
    assert resolved(data="synthetic", tiny_start="random") == "random"
    with pytest.raises(ValueError, match="--tiny-start foundation needs --data synthetic"):
        resolved(data="x.json", tiny_start="foundation")
    assert resolved(data="x.json", model="Qwen/Qwen2.5-VL-3B-Instruct") == "auto"  # not the tiny model's to start


def test_orapo_is_rl_only_from_the_foundation(tmp_path, synthetic_is_small, small_foundation):
    """No warm start: RL's first policy is the foundation's weights (its test_before is the foundation's)."""
    import orapo

    flags = ["--data", "synthetic", "--labeler", "rule", "--out", str(tmp_path), "--steps", "1"]
    orapo.main(flags + ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--train-size", "8"])
    assert not (tmp_path / "warm_start").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tiny_start"] == "foundation"
    first = common.load_policy(small_foundation / "vlm").tokenizer.vocab
    assert common.load_policy(tmp_path / "final").tokenizer.vocab == first


def test_deer_sft_trains_the_vision_side_of_the_foundation_only(tmp_path, synthetic_is_small, small_foundation):
    """Sec. 4.1: the LM frozen, the vision encoder and projector learn; a random tiny model trains all of it."""
    import deer

    flags = [
        "--data",
        "synthetic",
        "--labeler",
        "rule",
        "--out",
        str(tmp_path),
        "--sft-steps",
        "3",
        "--max-new-tokens",
        "8",
    ]
    deer.main(["sft", *flags])
    before = common.load_policy(small_foundation / "vlm").model.state_dict()
    after = common.load_policy(tmp_path / "sft" / "final").model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("encoder.", "project.")) for k in changed), sorted(changed)[:5]
    deer.main(["sft", *flags[:-6], "--out", str(tmp_path / "all"), "--sft-steps", "3", "--sft-lm", "trained"])
    after = common.load_policy(tmp_path / "all" / "sft" / "final").model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))


def test_dcrrg_encoders_start_from_the_sandbox_pre_trained_ones(tmp_path, synthetic_is_small, small_foundation):
    """Step 1's image encoder is the foundation's CNN (ImageNet's stand-in), its text encoder the sandbox BERT."""
    import dcrrg

    flags = ["--data", "synthetic", "--labeler", "rule", "--out", str(tmp_path), "--batch-size", "4"]
    dcrrg.main(["step1", *flags, "--step1-steps", "0"])
    config = json.loads((tmp_path / "step1" / "config.json").read_text())
    assert config["text_encoder"] == str(small_foundation / "text_encoder")
    state = torch.load(tmp_path / "step1" / "model.pt", weights_only=True)
    vlm = common.load_policy(small_foundation / "vlm").model.state_dict()
    assert torch.equal(state["image_encoder.body.encoder.0.weight"], vlm["encoder.0.weight"])
    assert torch.equal(state["image_encoder.body.project.weight"], vlm["project.weight"])


def test_foundation_image_encoder_reads_dcrrgs_transform_as_the_policy_reads_pixels(small_foundation, small_synthetic):
    """The same image through DCRRG's ImageNet-normalised transform and TinyPolicy's [-1, 1] gives the same features."""
    policy = common.load_policy(small_foundation / "vlm")
    record = common.load_annotation(small_synthetic)["test"][0]
    image = common.load_image(record.image_paths[0])
    encoder = sandbox.FoundationImageEncoder(policy.model)
    x = common.default_transform(64, 1)(image)[None]  # (1, 1, 64, 64)
    with torch.no_grad():
        ours = encoder(x)
        theirs = policy.model.prefix(**policy.prompt_batch([[image]]))[:, :-1].flatten(1)
    assert ours.shape == (1, encoder.dim) and torch.allclose(ours, theirs, atol=1e-5)
