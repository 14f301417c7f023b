"""A Qwen2.5-VL saved the way Qwen/Qwen2.5-VL-3B-Instruct is published (conftest.save_as_published: the image
processor's min/max_pixels at the top of preprocessor_config.json and no `size`, near-greedy sampling with two EOS
ids, the hub's chat template and tokenizer settings): every setting the project applies takes effect on that layout.
A MIMIC-CXR view (2544 x 3056 px) is 320 image tokens at --max-pixels 512 x 512 (at most max_pixels / 784) in every
pass a run makes: SFT, the rollout, the loss's forward, OraPO's DPO targets, evaluation, and after save and reload
(final/, `tests/reports.py generate`)."""

import functools
import json

import pytest
import torch
from PIL import Image

import common
import reports
from conftest import qwen_flags

MIMIC_VIEW = (2544, 3056)  # width, height of a MIMIC-CXR view
TOKENS_AT_512 = 320  # smart_resize to 640 x 504 px: 20 x 16 tokens after the 2 x 2 merge (tests/test_real_arch.py)


def image_tokens(policy, image) -> int:
    prompts = policy.prompt_batch([[image]], "Describe.")
    return int((prompts["input_ids"] == policy.model.config.image_token_id).sum())


def test_the_tests_load_the_published_layout(tiny_qwen_dir):
    """The files beside the weights are the hub's: pixel bounds at the top level (no size), sampling values that
    HFPolicy must undo, two EOS ids, a chat template with its default system turn."""
    pre = json.loads((tiny_qwen_dir / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"]) == (3136, 12845056) and "size" not in pre
    assert not (tiny_qwen_dir / "processor_config.json").exists()
    gen = json.loads((tiny_qwen_dir / "generation_config.json").read_text())
    assert (gen["top_k"], gen["top_p"], gen["temperature"], gen["repetition_penalty"]) == (1, 0.001, 0.1, 1.05)
    assert len(gen["eos_token_id"]) == 2
    assert (
        "You are a helpful assistant."
        in json.loads((tiny_qwen_dir / "chat_template.json").read_text())["chat_template"]
    )
    tok = json.loads((tiny_qwen_dir / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "Qwen2Tokenizer" and tok["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("max_pixels, tokens", [(512 * 512, TOKENS_AT_512), (448 * 448, 17 * 14), (None, 9919)])
def test_max_pixels_wins_over_the_published_bounds(tiny_qwen_dir, max_pixels, tokens):
    """--max-pixels bounds a view whatever the checkpoint's own bounds (None: the hub's 12.8 M px, 9,919 tokens);
    each count at most max_pixels / 784; a view under 56 x 56 grows to it (Qwen2.5-VL's min_pixels), 4 tokens."""
    policy = common.HFPolicy(str(tiny_qwen_dir), device="cpu", max_pixels=max_pixels)
    image_id = policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    p = policy.prompt_batch([[Image.new("L", MIMIC_VIEW, 100)]], "Describe.")
    assert (p["input_ids"] == image_id).sum().item() == tokens
    assert tokens <= (max_pixels or 12845056) / 784
    small = policy.prompt_batch([[Image.new("L", (20, 20), 100)]], "Describe.")  # grows to 56 x 56, as trained
    assert (small["input_ids"] == image_id).sum().item() == 4


def test_the_policy_samples_at_plain_temperature_and_stops_at_either_eos(tiny_qwen_dir):
    """The hub's top_k 1, top_p 0.001, temperature 0.1 and repetition penalty 1.05 give way to plain sampling at the
    run's temperature (sampled log-probs are then the scored ones); both of the hub's EOS ids end a completion."""
    policy = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    g = policy.model.generation_config
    assert (g.do_sample, g.top_k, g.top_p, g.temperature, g.repetition_penalty or 1.0) == (True, 0, 1.0, 1.0, 1.0)
    hub_eos = json.loads((tiny_qwen_dir / "generation_config.json").read_text())["eos_token_id"]
    assert set(policy.eos_token_ids) == set(hub_eos) and policy.eos_token_id in hub_eos
    torch.manual_seed(0)
    prompts = policy.prompt_batch([[Image.new("L", (64, 64), 90)]], "Describe.")
    ids, mask = policy.generate(prompts, 6, n=8)
    assert len({tuple(r) for r in ids.tolist()}) > 1  # sampled, not the hub's near-greedy
    assert torch.equal(mask, common.completion_mask(ids, hub_eos))  # a completion ends at the first of either


@pytest.fixture(scope="module")
def mimic_views(tmp_path_factory):
    """An annotation of studies with one MIMIC-CXR-sized view each (2 train, 1 val, 1 test)."""
    root = tmp_path_factory.mktemp("mimic_views")
    (root / "images").mkdir()
    splits = {}
    for split, n in (("train", 2), ("val", 1), ("test", 1)):
        splits[split] = []
        for k in range(n):
            name = f"{split}{k}.png"
            Image.new("L", MIMIC_VIEW, 60 + 40 * k).save(root / "images" / name)
            report = "The heart is normal in size. There is a small left pleural effusion."
            splits[split].append({"id": f"{split}{k}", "report": report, "image_path": [name]})
    (root / "annotation.json").write_text(json.dumps(splits))
    return root / "annotation.json"


def test_a_mimic_view_is_320_tokens_in_every_pass_of_a_run(tmp_path, mimic_views, tiny_qwen_dir, monkeypatch, capsys):
    """OraPO with a warm start (SFT), one RL step (the rollout, the loss's forward, the DPO target's forward) and its
    evaluations, then `tests/reports.py generate` on its final/: every forward that sees images sees 320 tokens a
    view."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Vision

    import orapo

    seen = []  # the image tokens of each view, per pass through the vision tower (every pass that sees images)
    real = Vision.forward

    @functools.wraps(real)
    def spy(self, hidden_states, grid_thw, **kwargs):
        seen.append((grid_thw.prod(-1) // 4).tolist())  # patches per view, 4 merged into a token
        return real(self, hidden_states, grid_thw, **kwargs)

    monkeypatch.setattr(Vision, "forward", spy)
    monkeypatch.setitem(orapo.WARM_START, "batch_size", 2)  # the warm start's batch: the 2 training studies
    out = tmp_path / "run"
    short = ["--steps", "1", "--sft-steps", "1", "--prompts-per-step", "1", "--group-size", "4"]
    orapo.main(qwen_flags(mimic_views, tiny_qwen_dir, out, *short, "--max-new-tokens", "4", "--train-size", "0"))
    passes = [len(views) for views in seen]  # views per pass
    # SFT (2 studies); test_before (1); the RL step: the rollout's generate, the reference's and the policy's passes,
    # each the study's view once for its 4 samples and its ground-truth report (before issue "Each study's images once
    # a pass": 3 passes of 4 views and 2 of 1); test_after (1)
    assert passes == [2, 1, 1, 1, 1, 1], passes
    rl_step = sum(passes[2:5])  # views through the tower in the RL step, 1 study x G 4: once a pass, 3 passes
    assert rl_step <= 3.5 * 1, rl_step  # (before: 4 + 4 + 4 + 1 + 1 = 14, a copy a row and the ground truth's 2)
    lengths, real_generate = [], common.HFPolicy.generate
    monkeypatch.setattr(
        common.HFPolicy, "generate", lambda self, p, n, *a, **k: lengths.append(n) or real_generate(self, p, n, *a, **k)
    )
    reports.main(["generate", str(out), str(mimic_views.parent / "images" / "test0.png")])
    assert len(seen) == len(passes) + 1 and capsys.readouterr().out.strip() != ""
    assert {t for views in seen for t in views} == {TOKENS_AT_512}
    assert lengths == [4]  # the run's --max-new-tokens, read from final/generation.json
    reloaded = common.HFPolicy(str(out / "final"))  # final/'s processor keeps the run's bounds, no flag needed
    assert image_tokens(reloaded, Image.new("L", MIMIC_VIEW, 100)) == TOKENS_AT_512
