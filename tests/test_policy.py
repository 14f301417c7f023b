"""The tiny built-in policy (common.TinyPolicy) against the policy interface, and the rollout
helper: recorded vs recomputed log-probs, masks, padding, temperature, save/load, and that a
few GRPO steps raise a simple reward."""

import numpy as np
import pytest
import torch
from PIL import Image

import common
from common import TinyPolicy, TinyVLM, WordTokenizer, completion_mask, group_advantages, grpo_loss, rollout

REPORTS = [
    "The heart is not enlarged. No pleural effusion.",
    "There is a small left pleural effusion. Plate-like atelectasis at the right base.",
    "No pneumothorax, focal consolidation, or pulmonary edema.",
]


def images(n, size=64, seed=0):
    rng = np.random.default_rng(seed)
    return [[Image.fromarray(rng.integers(0, 255, (size, size), dtype=np.uint8))] for _ in range(n)]


def tiny_policy(n_layer=2, max_len=24):
    tok = WordTokenizer.build(REPORTS)
    return TinyPolicy(
        TinyVLM(len(tok.vocab), n_embd=32, n_layer=n_layer, n_head=2, channels=8, max_len=max_len), tok, image_size=32
    )


@pytest.fixture
def policy():
    torch.manual_seed(0)
    return tiny_policy()


def test_word_tokenizer_round_trip_and_unknown_words():
    tok = WordTokenizer.build(REPORTS, extra_tokens=("<think>", "</think>"))
    assert tok.vocab[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert tok.decode(tok.encode(REPORTS[1])) == REPORTS[1].lower()
    assert tok.encode("<think> heart </think>") == [tok.index["<think>"], tok.index["heart"], tok.index["</think>"]]
    assert tok.encode("cardiomegaly") == [tok.unk_id]


def test_completion_mask_runs_through_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert completion_mask(ids, eos_id=2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_forward_logprobs(policy, temperature):
    # PITFALLS: the log-probs recorded while sampling and those of a training forward must
    # agree (same temperature), or the GRPO ratio is off before any update. The two run other shapes (one token at a
    # time with a cache, the whole sequence at once), so float32 rounding differs: a few ulp of |logp| <= ~5 and of
    # the d = 32 term dot products, ~1e-5 at worst, 5e-7 seen under ATEN_CPU_CAPABILITY=default and avx2; a wrong
    # temperature, position or mask is off by 1e-2 or more.
    torch.manual_seed(1)
    prompts = policy.prompt_batch(images(2))
    ids, mask, sampled = policy.generate(prompts, 20, temperature, return_logprobs=True, n=3)
    assert ids.shape[0] == 6 and mask.shape == ids.shape
    forward = policy.completion_logprobs(prompts, ids, mask, temperature)
    assert forward.dtype == torch.float32
    assert (forward - sampled).abs().max().item() < 1e-4
    assert (forward[mask == 0] == 0).all()


def test_temperature_divides_the_logits(policy):
    prompts = policy.prompt_batch(images(1))
    ids, mask = policy.encode_targets(["no pleural effusion."])
    prefix = policy.model.prefix(prompts["pixel_values"], prompts["view_mask"], policy.tokenizer.bos_id)
    embeds = torch.cat([prefix, policy.model.decoder.transformer.wte(ids)], 1)
    logits = policy.model.decoder(inputs_embeds=embeds).logits[0, prefix.shape[1] - 1 : -1]  # (T, V)
    expected = torch.log_softmax(logits / 2.0, -1).gather(1, ids[0, :, None]).squeeze(1)
    got = policy.completion_logprobs(prompts, ids, mask, temperature=2.0)[0]
    torch.testing.assert_close(got, expected)


def test_padding_does_not_change_logprobs(policy):
    prompts = policy.prompt_batch(images(2))
    ids, mask = policy.encode_targets(["no effusion.", REPORTS[1]])  # first row right-padded
    both = policy.completion_logprobs(prompts, ids, mask)
    alone = policy.completion_logprobs(
        {k: v[:1] for k, v in prompts.items()}, ids[:1, : int(mask[0].sum())], mask[:1, : int(mask[0].sum())]
    )
    torch.testing.assert_close(both[0, : alone.shape[1]], alone[0])


def test_generation_stops_at_eos_and_pads_after(policy):
    with torch.no_grad():  # make EOS the only likely token: every completion is just EOS
        policy.model.decoder.lm_head.weight.zero_()
        policy.model.decoder.transformer.wte.weight[policy.eos_token_id] = 0  # tied head: row stays 0
        policy.model.decoder.lm_head.bias = None
    head = policy.model.decoder.lm_head
    handle = head.register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.tensor([policy.eos_token_id]), 50.0))
    ids, mask = policy.generate(policy.prompt_batch(images(2)), 10, n=2)
    handle.remove()
    assert ids.shape == (4, 1) and mask.tolist() == [[1.0]] * 4  # the EOS counts as a completion token
    assert policy.decode(ids, mask) == [""] * 4  # an empty generation decodes to ""


def test_generation_prints_no_attention_mask_warning(policy):
    """transformers drops an all-ones attention mask, then warned ("We strongly recommend passing in an
    `attention_mask`") when a finished row fed the pad token back in: a line a user cannot act on, in every run.
    Here row 0 ends at once and row 1 runs on."""
    import logging
    from logging.handlers import BufferingHandler

    logging.Logger.warning_once.cache_clear()  # transformers' once per process: another test may have printed it
    heard = BufferingHandler(100)
    logging.getLogger("transformers").addHandler(heard)

    def eos_first_row(module, inputs, logits):
        logits = logits.clone()
        logits[:, :, policy.eos_token_id] = torch.tensor([50.0, -50.0])[: len(logits), None]
        return logits

    handle = policy.model.decoder.lm_head.register_forward_hook(eos_first_row)
    _, mask = policy.generate(policy.prompt_batch(images(2)), 6, do_sample=False)
    handle.remove()
    logging.getLogger("transformers").removeHandler(heard)
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1] * 6]
    assert not [r.getMessage() for r in heard.buffer if "attention_mask" in r.getMessage()]


def test_sft_loss_decreases(policy):
    prompts = policy.prompt_batch(images(3))
    opt = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = policy.sft_loss(prompts, REPORTS)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_save_and_load_round_trip(policy, tmp_path):
    prompts = policy.prompt_batch(images(2))
    ids, mask = policy.encode_targets(REPORTS[:2])
    policy.save(tmp_path / "ck")
    again = common.load_policy(tmp_path / "ck")
    torch.testing.assert_close(
        again.completion_logprobs(prompts, ids, mask), policy.completion_logprobs(prompts, ids, mask)
    )
    assert again.tokenizer.vocab == policy.tokenizer.vocab


def test_rollout_samples_g_rows_a_study_and_logprobs(policy):
    import copy

    ref = copy.deepcopy(policy)
    r = rollout(policy, images(2), "", G=3, max_new_tokens=8)
    assert r.completion_ids.shape[0] == 6 and r.rewards is None  # the script scores them
    assert r.texts == policy.decode(r.completion_ids, r.completion_mask)
    ref_logp = common.reference_logprobs(ref, r)  # the copy's weights still require gradients: no graph all the same
    assert not ref_logp.requires_grad  # (a graph per reference pass holds a second model's activations)
    with torch.no_grad():  # the copy equals the policy before any update
        torch.testing.assert_close(ref_logp, policy.completion_logprobs(r.prompts, r.completion_ids, r.completion_mask))
    assert common.reference_logprobs(None, r) is None


def test_grpo_steps_raise_the_reward(policy):
    # End to end through the core: reward = share of completion tokens that are "effusion".
    target = policy.tokenizer.index["effusion"]
    torch.manual_seed(0)
    opt = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    imgs = images(4)

    means = []
    for step in range(25):
        r = rollout(policy, imgs, "", G=4, max_new_tokens=6)
        r.rewards = torch.tensor([t.split().count("effusion") / max(1, len(t.split())) for t in r.texts])
        A = group_advantages(r.rewards, 4)
        logp = policy.completion_logprobs(r.prompts, r.completion_ids, r.completion_mask)
        loss, _ = grpo_loss(logp, None, A, r.completion_mask)  # one update per rollout
        opt.zero_grad()
        loss.backward()
        opt.step()
        means.append(r.rewards.mean().item())
    # Seeds 0-7 rose by 0.20-0.35 (torch 2.14) and 0.18-0.33 (torch 2.6: another sampler stream); with lr 0 the two
    # 5-step means (80 completions each) differ by 0.025 at most. 0.1 tells learning from noise on either.
    assert target > 0
    assert np.mean(means[-5:]) > np.mean(means[:5]) + 0.1


@pytest.mark.slow
def test_tiny_sft_beats_the_most_common_report():
    """Benchmark (tests/MACHINES.md): SFT of the tiny policy on the synthetic set, greedy reports on the
    500 test studies, CE micro F1 (rule labeler) against always writing the most common
    training report.   python -m pytest -q tests/test_policy.py -m slow -s"""
    import time
    from collections import Counter

    torch.set_num_threads(2)
    torch.manual_seed(0)
    data = common.load_data("synthetic")
    train, test = data["train"], data["test"]
    policy = common.make_policy("tiny", [r.report for r in train], "cpu")
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    batches, losses, t0 = common.study_batches(train, 32), [], time.time()
    for _ in range(1200):
        batch = next(batches)[1]
        loss = policy.sft_loss(policy.prompt_batch(batch["images"]), batch["report"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    t_sft = time.time() - t0
    generated = []
    for i in range(0, len(test), 100):
        chunk = test[i : i + 100]
        prompts = policy.prompt_batch([[common.load_image(p, r.id) for p in r.image_paths] for r in chunk])
        generated += policy.decode(*policy.generate(prompts, 96, do_sample=False))
    labeler = common.RuleLabeler()
    refs = labeler([r.report for r in test])
    f1 = common.ce_metrics(labeler(generated), refs)["micro_f1"]
    most_common = Counter(r.report for r in train).most_common(1)[0][0]
    f1_const = common.ce_metrics(labeler([most_common] * len(test)), refs)["micro_f1"]
    print(
        f"\ntiny SFT: 1200 steps x 32 in {t_sft:.0f} s "
        f"(loss {np.mean(losses[:20]):.2f} -> {np.mean(losses[-20:]):.2f}); "
        f"CE micro F1 {f1:.3f} vs most common report {f1_const:.3f} ({most_common!r})"
    )
    assert f1 > f1_const + 0.3


@pytest.mark.slow
def test_tiny_grpo_step_timing():
    """Benchmark (tests/MACHINES.md): one GRPO step of the tiny policy on CPU, 8 prompts x G = 8, split into
    sampling, scoring (old/ref log-probs and rewards) and the update."""
    import copy
    import time

    torch.set_num_threads(2)
    data = common.load_data("synthetic")
    policy = common.make_policy("tiny", [r.report for r in data["train"]], "cpu")
    ref = copy.deepcopy(policy)
    batch = next(common.study_batches(data["train"], 8))[1]
    labeler = common.RuleLabeler()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-5)
    times = {"sample": [], "score": [], "update": []}
    for _ in range(4):
        t0 = time.time()
        prompts = policy.prompt_batch(batch["images"])
        ids, mask = policy.generate(prompts, 96, n=8)
        t1 = time.time()
        texts = policy.decode(ids, mask)
        hyp, ref_labels = labeler(texts), labeler([batch["report"][n // 8] for n in range(64)])
        rewards = torch.tensor((common.binarize(hyp) == common.binarize(ref_labels)).mean(1))  # label accuracy
        with torch.no_grad():
            ref_logp = ref.completion_logprobs(prompts, ids, mask)
        t2 = time.time()
        logp = policy.completion_logprobs(prompts, ids, mask)
        loss, _ = grpo_loss(logp, ref_logp, group_advantages(rewards, 8), mask, beta=0.04)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t3 = time.time()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[k].append(v)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(
        f"\ntiny GRPO step, 8 x 8, T = {ids.shape[1]}: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in med.items())
        + f", total {sum(med.values()) * 1000:.0f} ms"
    )  # reported, not asserted: a shared machine


def test_any_number_of_views_in_one_batch():
    """A study's views are averaged position by position (R2GenGPT's way): studies with 1, 3 and 2 views share a batch
    (zero-padded, masked), and each gets exactly the prefix and log-probs it gets alone; its view order does not
    count."""
    torch.manual_seed(0)
    pol = tiny_policy(n_layer=1, max_len=8)
    views = [v[0] for v in images(6, seed=3)]
    studies = [views[:1], views[1:4], views[4:6]]
    prompts = pol.prompt_batch(studies)
    assert prompts["pixel_values"].shape[:2] == (3, 3) and prompts["view_mask"].tolist() == [
        [1, 0, 0],
        [1, 1, 1],
        [1, 1, 0],
    ]
    ids, mask = pol.encode_targets(["no effusion.", REPORTS[1], "heart size is normal."])
    both = pol.completion_logprobs(prompts, ids, mask)
    for i, study in enumerate(studies):
        n = int(mask[i].sum())
        alone = pol.completion_logprobs(pol.prompt_batch([study[::-1]]), ids[i : i + 1, :n], mask[i : i + 1, :n])
        torch.testing.assert_close(both[i, :n], alone[0], atol=1e-5, rtol=1e-5)
    repeated = pol.repeated(prompts, 2)  # (pixel_values, view_mask, start_ids): each study's row twice in a row
    assert repeated[1].tolist() == [[1, 0, 0]] * 2 + [[1, 1, 1]] * 2 + [[1, 1, 0]] * 2
    assert pol.generate(prompts, 4, n=2)[0].shape[0] == 6
