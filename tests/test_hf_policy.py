"""HFPolicy on a tiny random Qwen2.5-VL (built offline in conftest.py, loaded through
AutoProcessor / AutoModelForImageTextToText like a hub checkpoint): prompts, views once a study, sampling,
log-prob agreement, the rope_deltas pitfall, LoRA, freezing, gradient checkpointing, saving."""

import pytest
import torch

import common
from conftest import torchrun

PROMPT = "You are a radiologist. Describe the chest X-ray."


@pytest.fixture(scope="module")
def policy(tiny_qwen_dir):
    return common.HFPolicy(str(tiny_qwen_dir), device="cpu")


@pytest.fixture(scope="module")
def studies(small_synthetic):
    records = common.load_annotation(small_synthetic)["train"][:3]
    views = [[common.load_image(p, r.id) for p in r.image_paths] for r in records]
    views[1] = views[1] * 2  # an IU X-Ray-like study with two views
    return views, [r.report for r in records]


def test_hub_sampling_defaults_are_replaced(policy):
    g = policy.model.generation_config
    # the saved model asks for top_k 1, top_p 0.001, repetition penalty 1.05: plain sampling instead
    assert (g.top_k, g.top_p, g.repetition_penalty or 1.0) == (0, 1.0, 1.0)
    assert policy.tokenizer.convert_ids_to_tokens(policy.eos_token_id) == "<|im_end|>"
    assert set(policy.eos_token_ids) == {
        policy.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
    }


def test_prompt_batch_left_padded_and_whole(policy, studies):
    views, _ = studies
    p = policy.prompt_batch(views, PROMPT)
    image_id = policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 56 x 56 pixels -> 4 x 4 patches of 14 -> 4 tokens after the 2 x 2 merge, per view
    assert (p["input_ids"] == image_id).sum(1).tolist() == [4, 8, 4]
    assert p["image_grid_thw"].tolist() == [[1, 4, 4]] * 4 and p["n_images"].tolist() == [1, 2, 1]
    # left padding: every row ends with the assistant turn, the shorter ones start with pads
    assert (p["attention_mask"][:, -1] == 1).all()
    assert p["attention_mask"][0, 0] == 0 and p["attention_mask"][1].all()


def test_sft_and_dpo_targets_end_with_eos_at_most_512_tokens(policy):
    ids, mask = policy.encode_targets(["the heart is normal . " * 200, "no effusion ."])
    assert ids.shape[1] == 512 and mask.sum(1)[0] == 512 and ids[0, 511] == policy.eos_token_id
    n = int(mask[1].sum())
    assert n < 512 and ids[1, n - 1] == policy.eos_token_id and not mask[1, n:].any()


def per_row_logprobs(policy, prompts, ids, mask, n):
    """The log-probs as before the views were shared: every row its own copy of its study's views, through the model
    as one batch (rows() of each study, n times in a row)."""
    copies = [policy.rows(prompts, i, i + 1) for i in range(len(prompts["input_ids"])) for _ in range(n)]
    inputs = {k: torch.cat([c[k] for c in copies]) for k in ("input_ids", "attention_mask", "pixel_values")}
    inputs["image_grid_thw"] = torch.cat([c["image_grid_thw"] for c in copies])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], ids], 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], mask.long()], 1)
    if "mm_token_type_ids" in prompts:  # the prompt's image tokens marked, the completion's text
        types_ = torch.cat([c["mm_token_type_ids"] for c in copies])
        inputs["mm_token_type_ids"] = torch.cat([types_, torch.zeros_like(ids)], 1)
    logits = policy.model(**inputs, use_cache=False, logits_to_keep=ids.shape[1] + 1).logits[:, :-1]
    return common.token_logprobs(logits, ids, 1.0, policy.suppressed) * mask


@pytest.mark.parametrize("lora", [False, True])
def test_views_once_a_study_give_the_per_row_logprobs_and_gradients(tiny_qwen_dir, studies, lora):
    """G = 4 rows a study (three studies, the second with two views): the vision tower sees each study's patches once
    (not G times), and the log-probs and every gradient equal those of each row carrying its own copy of its views
    (before: Policy.repeat), with and without LoRA. A row given another study's views (a repeat where
    repeat_interleave was meant) changes both."""
    views, reports = studies
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    if lora:
        common.add_lora(pol, dict(r=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"]))
        with torch.no_grad():  # B starts at 0: make the adapters act
            for m in pol.model.modules():
                if isinstance(m, common.LoRALinear):
                    m.lora_B.normal_(std=0.1)
    prompts = pol.prompt_batch(views, PROMPT)
    texts = [r for r in reports for _ in range(4)]
    ids, mask = pol.encode_targets([" ".join(t.split()[: 3 + i % 5]) for i, t in enumerate(texts)])
    patches = []
    hook = pol.model.model.visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0]))
    params = [p for p in pol.model.parameters() if p.requires_grad]
    shared = pol.completion_logprobs(prompts, ids, mask)
    hook.remove()
    assert patches == [prompts["pixel_values"].shape[0]] == [16 * 4]  # 4 views of 16 patches, once each
    grads = torch.autograd.grad((shared * torch.linspace(0.5, 1.5, shared.numel()).view_as(shared)).sum(), params)
    per_row = per_row_logprobs(pol, prompts, ids, mask, 4)
    per_row_grads = torch.autograd.grad(
        (per_row * torch.linspace(0.5, 1.5, per_row.numel()).view_as(per_row)).sum(), params
    )
    torch.testing.assert_close(shared, per_row, rtol=1e-5, atol=1e-5)
    for g, h in zip(grads, per_row_grads, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    swapped = {
        **prompts,
        "pixel_values": torch.cat(
            [prompts["pixel_values"][16:48], prompts["pixel_values"][:16], prompts["pixel_values"][48:]]
        ),
    }
    swapped["image_grid_thw"] = prompts["image_grid_thw"]
    assert (per_row_logprobs(pol, swapped, ids, mask, 4) - per_row).abs().max() > 1e-3  # the test can see a mix-up


@pytest.mark.slow
def test_views_once_under_fsdp_give_the_per_row_gradients(tiny_qwen_dir, tmp_path):
    """--fsdp on 2 gloo processes, G = 4 rows of each of two studies a rank (of one view and two), each study's views
    through the tower once: every parameter's gradient (gathered from the shards, averaged over the ranks) equals one
    process's with every row carrying its own copy of its views, the two ranks' losses averaged."""
    import fsdp_views_once as ranks

    torchrun("tests/fsdp_views_once.py", str(tiny_qwen_dir), str(tmp_path), timeout=300)
    sharded = torch.load(tmp_path / "grads.pt", weights_only=True)
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    loss = 0.0
    for rank in (0, 1):
        prompts = pol.prompt_batch(ranks.studies(rank), ranks.PROMPT)
        ids, mask = ranks.rows(pol, rank)
        per_row = per_row_logprobs(pol, prompts, ids, mask, ranks.G)
        loss = loss + (per_row * ranks.weights(per_row)).sum() / 2  # FSDP2 averages over the 2 ranks
    params = dict(pol.model.named_parameters())
    assert sharded.keys() == params.keys()
    for name, g in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
        torch.testing.assert_close(sharded[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_generate_encodes_each_studys_views_once(policy, studies):
    """generate(prompts, n=G): G samples a study, row iG + j study i's, the vision tower on each study's views once;
    the same samples, token for token, as prompts repeated row by row (each row its own copy of the views)."""
    views, _ = studies
    prompts = policy.prompt_batch(views, PROMPT)
    patches = []
    hook = policy.model.model.visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0]))
    torch.manual_seed(0)
    ids, mask = policy.generate(prompts, 8, n=3)
    hook.remove()
    assert ids.shape[0] == 9 and patches == [prompts["pixel_values"].shape[0]]
    copies = [policy.rows(prompts, i, i + 1) for i in range(3) for _ in range(3)]
    repeated = {k: torch.cat([c[k] for c in copies]) for k in prompts}
    torch.manual_seed(0)
    ids_r, mask_r = common.generate_completions(
        policy,
        policy.model,
        {k: v for k, v in repeated.items() if k in policy.MODEL_KEYS},
        prompts["input_ids"].shape[1],
        8,
        1.0,
        True,
        False,
        1.0,
    )
    assert torch.equal(ids, ids_r) and torch.equal(mask, mask_r)


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_prefills_each_prompt_once(policy, studies, do_sample):
    """generate(prompts, n=G) runs the language model over each study's prompt once: B rows of its first P - 1 tokens,
    the KV cache then repeated to the B G rows, which feed the last prompt token and then each new one, one a step. The
    old way (prompts repeated to the rows: G prefills a study) gives the same tokens, greedy or sampled under one seed,
    and log-probs within float noise: the first token's logits come from a 1-token step over a cache rather than a
    P-token pass (other shapes, other rounding), and a draw falls on the other side of a token's boundary only if
    that noise (~1e-7 here) reaches it. Greedy with n=1 (evaluation) gives each study's row of n=G."""
    views, _ = studies
    prompts = policy.prompt_batch(views, PROMPT)
    (B, P), G = prompts["input_ids"].shape, 3
    embedded = []  # the token rows the language model embeds at each forward (B, L)
    embed = policy.model.model.language_model.embed_tokens
    hook = embed.register_forward_hook(lambda m, args, out: embedded.append(tuple(args[0].shape)))
    torch.manual_seed(0)
    ids, mask, logp = policy.generate(prompts, 8, n=G, do_sample=do_sample, return_logprobs=True)
    hook.remove()
    assert embedded[0] == (B, P - 1) and set(embedded[1:]) == {(B * G, 1)}  # not (B G, P) first
    torch.manual_seed(0)
    with policy.views_once(prompts, G) as inputs:  # the old way: generate on the prompts repeated to the B G rows
        old = common.generate_completions(policy, policy.model, inputs, P, 8, 1.0, do_sample, return_logprobs=True)
    assert torch.equal(ids, old[0]) and torch.equal(mask, old[1])
    assert (logp - old[2]).abs().max() < 1e-4  # as the other comparisons here: a few ulp of the logits
    if not do_sample:
        assert torch.equal(policy.generate(prompts, 8, n=1, do_sample=False)[0], ids[::G])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_forward_then_other_batch_size(policy, studies, temperature):
    views, _ = studies
    prompts = policy.prompt_batch(views, PROMPT)  # 3 studies, 2 rows each
    torch.manual_seed(0)
    ids, mask, recorded = policy.generate(prompts, 10, temperature=temperature, return_logprobs=True, n=2)
    assert ids.shape[0] == 6 and mask.shape == ids.shape
    with torch.no_grad():
        scored = policy.completion_logprobs(prompts, ids, mask, temperature)
    # float32 in other shapes (cached steps vs one pass): a few ulp of the logits, as tests/test_policy.py says: 1e-4
    assert (recorded - scored).abs().max() < 1e-4
    # generate() caches rope_deltas for 6 rows; a forward on 3 rows must not use them (stale positions
    # or "Sizes of tensors must match" in older transformers)
    one_each = policy.prompt_batch(views, PROMPT)
    with torch.no_grad():
        sub = policy.completion_logprobs(one_each, ids[::2], mask[::2], temperature)
    assert (sub - recorded[::2]).abs().max() < 1e-4


def test_mask_runs_to_the_first_eos_and_decode_drops_specials(policy):
    eos, pad = policy.eos_token_id, policy.pad_token_id
    word = policy.tokenizer("heart", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([word + [eos, pad], word + word[:1] + [eos]])
    mask = common.completion_mask(ids, policy.eos_token_ids)
    assert mask.tolist() == [[1.0] * (len(word) + 1) + [0.0], [1.0] * (len(word) + 2)]
    assert policy.decode(ids, mask)[0] == "heart"
    targets, tmask = policy.encode_targets(["heart", ""])
    assert targets[0, len(word)].item() == eos and tmask.sum(1).tolist() == [len(word) + 1, 1]


def test_sft_steps_lower_the_loss(tiny_qwen_dir, studies):
    views, reports = studies
    torch.manual_seed(0)
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    opt = torch.optim.AdamW(pol.model.parameters(), lr=3e-3)
    prompts = pol.prompt_batch(views, PROMPT)
    losses = []
    for _ in range(8):
        loss = pol.sft_loss(prompts, reports)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_frozen_language_model_trains_only_the_vision_tower(tiny_qwen_dir, studies):
    views, reports = studies
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    vision, language = pol.vision_and_language()
    language.requires_grad_(False)  # DEER's cold start: the vision tower and its merger train
    trainable = {id(p) for p in pol.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in vision.parameters()} and trainable
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
    opt = torch.optim.SGD([p for p in pol.model.parameters() if p.requires_grad], lr=0.1)
    pol.sft_loss(pol.prompt_batch(views, PROMPT), reports).backward()
    opt.step()
    changed = {n for n, p in pol.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".visual." in f".{n}" for n in changed)


def test_gradient_checkpointing_gives_the_same_gradient(tiny_qwen_dir, studies):
    views, reports = studies
    grads = []
    for ckpt in (False, True):
        pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu", gradient_checkpointing=ckpt)
        pol.model.train()
        pol.sft_loss(pol.prompt_batch(views, PROMPT), reports).backward()
        grads.append(torch.cat([p.grad.flatten() for p in pol.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_lora_reference_save_merged_and_reload(tiny_qwen_dir, studies, tmp_path):
    views, reports = studies
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    prompts = pol.prompt_batch(views, PROMPT)
    ids, mask = pol.encode_targets(reports)
    with torch.no_grad():
        base = pol.completion_logprobs(prompts, ids, mask)
    wrapped = common.apply_lora(pol.model, ["q_proj", "v_proj", "gate_proj"], r=4, alpha=8)
    assert wrapped and all("visual" not in n or "proj" in n for n in wrapped)
    for m in pol.model.modules():  # move away from B = 0 so LoRA changes the outputs
        if isinstance(m, common.LoRALinear):
            torch.nn.init.normal_(m.lora_B, std=0.05)
    with torch.no_grad():
        adapted = pol.completion_logprobs(prompts, ids, mask)
        with common.lora_disabled(pol.model):
            reference = pol.completion_logprobs(prompts, ids, mask)
    assert (adapted - base).abs().max() > 1e-3
    torch.testing.assert_close(reference, base)
    # the LoRA-off reference of a rollout: the model without its adapters
    roll = common.rollout(pol, views[:2], PROMPT, 2, 6)
    ref_logp = common.reference_logprobs(common.LoRAOff(pol), roll)
    assert ref_logp.shape == roll.completion_ids.shape and not ref_logp.requires_grad
    with torch.no_grad(), common.lora_disabled(pol.model):
        torch.testing.assert_close(
            ref_logp, pol.completion_logprobs(roll.prompts, roll.completion_ids, roll.completion_mask)
        )
    pol.save(tmp_path / "merged")
    assert any(isinstance(m, common.LoRALinear) for m in pol.model.modules())  # the live model keeps its adapters
    reloaded = common.HFPolicy(str(tmp_path / "merged"), device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.completion_logprobs(prompts, ids, mask), adapted, rtol=1e-4, atol=1e-4)


def test_make_policy_picks_the_kind(tiny_qwen_dir):
    assert isinstance(common.make_policy("tiny", ["no effusion ."], "cpu"), common.TinyPolicy)
    assert isinstance(common.make_policy(str(tiny_qwen_dir), [], "cpu"), common.HFPolicy)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU benchmark")
def test_gpu_grpo_step_speed_and_memory(small_synthetic):
    """One GRPO step of a real VLM on one GPU: 8 prompts x G = 8, up to 256 new tokens, bf16
    weights, gradient checkpointing, LoRA r 128 on attention + MLP, LoRA-off reference.
        RRG_BENCH_MODEL=Qwen/Qwen2.5-VL-3B-Instruct python -m pytest -q tests/test_hf_policy.py -m slow -s
    (the model must be in the local Hugging Face cache or a local folder)."""
    import os
    import time

    name = os.environ.get("RRG_BENCH_MODEL")
    if not name:
        pytest.skip("set RRG_BENCH_MODEL to a local Qwen2.5-VL id or folder")
    pol = common.HFPolicy(
        name,
        device="cuda",
        dtype=torch.bfloat16,
        gradient_checkpointing=True,
        max_pixels=int(os.environ.get("RRG_BENCH_MAX_PIXELS", str(448 * 448))),
    )
    common.apply_lora(
        pol.model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 128, 256
    )
    params = [p for p in pol.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-6)
    records = common.load_annotation(small_synthetic)["train"][:8]
    views = [[common.load_image(p, r.id) for p in r.image_paths] for r in records]
    for step in range(2):  # the first step warms up kernels and the allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        roll = common.rollout(pol, views, PROMPT, 8, 256)
        roll.rewards = torch.tensor([float(len(t) % 3) for t in roll.texts])
        torch.cuda.synchronize()
        t1 = time.time()
        opt.zero_grad(set_to_none=True)
        for micro in common.micro_batches(pol, roll, 4, 8):  # 4 micro-batches of 16 completions
            ref_logp = common.reference_logprobs(common.LoRAOff(pol), micro)
            logp = pol.completion_logprobs(micro.prompts, micro.completion_ids, micro.completion_mask)
            A = common.group_advantages(micro.rewards, 8)
            loss, _ = common.grpo_loss(logp, ref_logp, A, micro.completion_mask, beta=0.04)
            (loss / 4).backward()
        opt.step()
        torch.cuda.synchronize()
        t2 = time.time()
    tokens = roll.completion_mask.sum().item()
    print(
        f"\n{name}: step {t2 - t0:.1f} s (rollout + reference {t1 - t0:.1f} s, {tokens / (t1 - t0):.0f} generated "
        f"tokens/s incl. scoring; update {t2 - t1:.1f} s), "
        f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )


def test_policy_trains_in_training_mode_and_lora_skips_the_vision_tower(tiny_qwen_dir, studies):
    views, _ = studies
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu", gradient_checkpointing=True)
    assert pol.model.training  # from_pretrained gives eval mode: checkpointing and dropout would be off
    pol.generate(pol.prompt_batch(views[:1], PROMPT), 2)
    assert pol.model.training  # generate() samples in eval mode and switches back
    wrapped = common.apply_lora(
        pol.model, ["q_proj", "gate_proj", "up_proj", "down_proj"], r=2, alpha=4, exclude=pol.vision_and_language()[0]
    )
    assert wrapped and not any("visual" in n for n in wrapped)
    assert not any(p.requires_grad for p in pol.vision_and_language()[0].parameters())


def test_vision_placeholders_are_never_sampled(tiny_qwen_dir, studies):
    views, _ = studies
    pol = common.HFPolicy(str(tiny_qwen_dir), device="cpu")
    image_pad = pol.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert image_pad in pol.suppressed
    with torch.no_grad():  # make <|image_pad|> by far the likeliest next token everywhere
        pol.model.lm_head.weight[image_pad] = pol.model.lm_head.weight.abs().max() * 50
    prompts = pol.prompt_batch(views, PROMPT)
    torch.manual_seed(0)
    ids, mask, recorded = pol.generate(prompts, 6, return_logprobs=True, n=2)
    assert not (ids == image_pad).any()
    with torch.no_grad():  # the forward would fail on an image token without image features
        scored = pol.completion_logprobs(prompts, ids, mask)
    assert (scored - recorded).abs().max() < 1e-4


def test_bf16_weights_with_fp32_trainable_parts(tiny_qwen_dir, studies):
    """bf16 weights (the GPU setting) with the trained part in fp32 master weights: the policy
    applies autocast itself, so generate, scoring and the loss run without the caller's help,
    and a small AdamW step really changes the trained weights (bf16 would round it away)."""
    views, reports = studies
    pol = common.make_policy(str(tiny_qwen_dir), [], "cpu", dtype=torch.bfloat16, max_pixels=56 * 56)
    vision, language = pol.vision_and_language()
    for p in language.parameters():
        p.requires_grad_(False)
    common.fp32_trainable(pol.model)
    assert all(p.dtype == torch.float32 for p in vision.parameters())
    assert all(p.dtype == torch.bfloat16 for p in language.parameters())
    prompts = pol.prompt_batch(views, PROMPT)
    ids, mask = pol.generate(prompts, 4)
    assert pol.completion_logprobs(prompts, ids, mask).dtype == torch.float32
    before = [p.detach().clone() for p in vision.parameters()]
    opt = torch.optim.AdamW(vision.parameters(), lr=1e-6)
    pol.sft_loss(prompts, reports).backward()
    opt.step()
    changed = sum((p != b).float().mean().item() for p, b in zip(vision.parameters(), before)) / len(before)
    assert changed > 0.9  # in bf16 most of these 1e-6 steps would round to nothing


def test_rows_cut_a_batch_with_its_images(policy, studies):
    """rows(prompts, start, stop): the rows' own images (a two-view study among one-view ones) and tokens, as a
    batch made of those studies alone (left padding aside)."""
    views, _ = studies
    p = policy.prompt_batch(views, PROMPT)
    for start, stop in ((1, 3), (0, 1), (2, 3)):
        part, alone = policy.rows(p, start, stop), policy.prompt_batch(views[start:stop], PROMPT)
        for k in ("pixel_values", "image_grid_thw", "n_images"):
            assert torch.equal(part[k], alone[k]), (start, stop, k)
        tokens = [row[mask.bool()].tolist() for row, mask in zip(part["input_ids"], part["attention_mask"])]
        assert tokens == [row[m.bool()].tolist() for row, m in zip(alone["input_ids"], alone["attention_mask"])]
