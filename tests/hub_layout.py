"""Qwen2.5-VL as the hub publishes it, without pytest (tests/gpu_check.py and tests/memory_check.py run without it):
the 3B's and 7B's configs, and a tiny random Qwen2.5-VL saved in the published checkpoint's layout (processor,
tokenizer, chat template, generation config), so that HFPolicy's real path runs offline. conftest.py and
test_real_arch.py take them from here."""

from pathlib import Path

# Qwen/Qwen2.5-VL-3B-Instruct, config.json (rope_scaling {"type": "mrope"} is transformers 5's rope_parameters)
QWEN3B_TEXT = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
    bos_token_id=151643,
    eos_token_id=151645,
)
QWEN3B_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=2048,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    hidden_act="silu",
)
QWEN3B_IDS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
)
QWEN3B_PARAMS = 3_754_622_976  # "3.75B params" on the model card; the sum below, term by term
# Qwen/Qwen2.5-VL-7B-Instruct (HuatuoGPT-Vision-7B-Qwen2.5VL's base, MRG-R1): the widths the memory table needs
QWEN7B_TEXT = dict(
    QWEN3B_TEXT,
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
QWEN7B_VISION = dict(QWEN3B_VISION, out_hidden_size=3584)


def qwen_config(text=QWEN3B_TEXT, vision=QWEN3B_VISION, ids=QWEN3B_IDS, **cut):
    from transformers import Qwen2_5_VLConfig

    t = dict(text, **{k: v for k, v in cut.items() if k in text})
    v = dict(vision, **{k: v for k, v in cut.items() if k in vision})
    return Qwen2_5_VLConfig(text_config=t, vision_config=v, tie_word_embeddings=t["tie_word_embeddings"], **ids), t, v


# A tiny randomly initialised Qwen2.5-VL with a processor assembled around a locally trained
# byte-level BPE tokenizer, saved like a hub checkpoint, so HFPolicy's real path
# (AutoProcessor, AutoModelForImageTextToText, chat template, image grid, generate) runs offline.
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# The chat template Qwen/Qwen2.5-VL-3B-Instruct publishes (chat_template.json): a default system turn, an image slot
# per view, the assistant's turn opened by add_generation_prompt
QWEN_CHAT = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen/Qwen2.5-VL-3B-Instruct's files beside its weights, as published: the image processor's pixel bounds at the top
# level (no `size`), near-greedy sampling with two EOS ids, the tokenizer's settings
HUB_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
HUB_SAMPLING = dict(do_sample=True, repetition_penalty=1.05, temperature=0.1, top_p=0.001, top_k=1)
HUB_TOKENIZER = {
    "add_prefix_space": False,
    "bos_token": None,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "errors": "replace",
    "model_max_length": 131072,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer",
    "unk_token": None,
}


def save_as_published(out_dir):
    """Rewrite a saved tiny Qwen2.5-VL's processor, tokenizer and generation files into the hub checkpoint's layout
    (preprocessor_config.json, chat_template.json, tokenizer_config.json, generation_config.json)."""
    import json

    out_dir = Path(out_dir)
    for name in ("processor_config.json", "chat_template.jinja", "video_preprocessor_config.json"):
        (out_dir / name).unlink(missing_ok=True)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(HUB_PREPROCESSOR, indent=2))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT}, indent=2))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(HUB_TOKENIZER | {"chat_template": QWEN_CHAT}, indent=2))
    generation = json.loads((out_dir / "generation_config.json").read_text())
    ids = {k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(ids | HUB_SAMPLING, indent=2))


def build_tiny_qwen(out_dir, texts, image_pixels: int = 56 * 56, seed: int = 0, hub_layout: bool = True):
    """A tiny random Qwen2.5-VL saved as Qwen/Qwen2.5-VL-3B-Instruct is published (hub_layout), or as
    save_pretrained writes it (its processor bounded to `image_pixels`)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=600, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_CHAT
    )
    patch = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=image_pixels, max_pixels=image_pixels, **patch),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**patch),
        chat_template=QWEN_CHAT,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            window_size=56,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]  # the hub's: both end a turn
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    if hub_layout:
        save_as_published(out_dir)  # its image bounds: the hub's, the test images small (64 px: 4 tokens a view)
    return out_dir
