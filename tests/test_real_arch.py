"""The papers' real architectures at their real widths, with random weights and nothing downloaded (issue 22).

Qwen2.5-VL-3B-Instruct (OraPO, DEER; MRG-R1's HuatuoGPT-Vision-7B is the 7B of the same family) built from its
config.json written out below, the decoder and the vision tower cut to 2 layers each; Qwen2.5-VL's image processor;
CheXbert (bert-base); Bio_ClinicalBERT's shape; torchvision ResNet-50/101. Parameter counts are worked out here
from the configs by hand, never read back from the module under test. All slow:

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_real_arch.py -m slow
    OMP_NUM_THREADS=1 python tests/test_real_arch.py     # the measurements behind tests/MACHINES.md's table
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

pytestmark = pytest.mark.slow

from hub_layout import (
    QWEN3B_PARAMS,
    QWEN3B_TEXT,
    QWEN3B_VISION,
    QWEN7B_TEXT,
    QWEN7B_VISION,
    qwen_config,
)

CUT = dict(
    num_hidden_layers=2, depth=2, fullatt_block_indexes=[1]
)  # block 0 windowed, block 1 full, as the real pattern


# Parameter counts from the configs (Qwen2: q/k/v with bias, o without; RMSNorms; vision: qkv and proj with bias,
# SwiGLU with bias, merger RMSNorm + Linear(4h, 4h) + GELU + Linear(4h, out), Conv3d patch embedding without bias)
def decoder_layer_params(t):
    d, hd = t["hidden_size"], t["hidden_size"] // t["num_attention_heads"]
    kv = t["num_key_value_heads"] * hd
    return (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * t["intermediate_size"] + 2 * d


def vision_block_params(v):
    h, f = v["hidden_size"], v["intermediate_size"]
    return 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * f + f) + (f * h + h)


def merger_params(v):
    m = v["hidden_size"] * v["spatial_merge_size"] ** 2
    return v["hidden_size"] + (m * m + m) + (m * v["out_hidden_size"] + v["out_hidden_size"])


def qwen_vl_params(t, v):
    """(language model with its head, vision tower with its merger)."""
    embed = t["vocab_size"] * t["hidden_size"]
    lm = (
        embed * (1 if t["tie_word_embeddings"] else 2)
        + t["num_hidden_layers"] * decoder_layer_params(t)
        + t["hidden_size"]
    )
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * v["hidden_size"]
    return lm, patch + v["depth"] * vision_block_params(v) + merger_params(v)


def smart_resize(h, w, min_pixels, max_pixels, factor=28):
    """Qwen2-VL's rounding, written out from the Qwen2-VL paper / qwen-vl-utils: sides to multiples of 28, the
    area into [min_pixels, max_pixels] keeping the aspect ratio (floor when shrinking, ceil when growing)."""
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        s = math.sqrt(h * w / max_pixels)
        hb, wb = max(factor, math.floor(h / s / factor) * factor), max(factor, math.floor(w / s / factor) * factor)
    elif hb * wb < min_pixels:
        s = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * s / factor) * factor, math.ceil(w * s / factor) * factor
    return hb, wb


def test_qwen25_vl_3b_published_size():
    lm, vis = qwen_vl_params(QWEN3B_TEXT, QWEN3B_VISION)
    assert (lm, vis) == (3_085_938_688, 668_684_288)  # 311.2 M embedding (tied) + 36 x 77.1 M; 32 x 19.7 M + merger
    assert lm + vis == QWEN3B_PARAMS
    assert sum(qwen_vl_params(QWEN7B_TEXT, QWEN7B_VISION)) == 8_292_166_656  # Qwen2.5-VL-7B: "8.29B params"


# (a) Qwen2.5-VL-3B's widths, 2 + 2 layers: shapes, LoRA names, one forward + backward through HFPolicy -------------
@pytest.fixture(scope="module")
def qwen3b_cut_dir(tmp_path_factory):
    """The cut model saved with a processor (Qwen2.5-VL's image processor, a small local BPE tokenizer: no
    download), so that HFPolicy loads it as it loads the hub checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from hub_layout import QWEN_CHAT, QWEN_SPECIALS

    out = tmp_path_factory.mktemp("qwen3b_cut")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(
        ["There is no pleural effusion. The heart size is normal.", "You are a radiologist."],
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_CHAT
    )
    # the vision token ids are the small tokenizer's; every width, depth pattern and rope setting is the 3B's
    ids = dict(
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    config, _, _ = qwen_config(ids=ids, **CUT)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    patch = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056, **patch),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**patch),
        chat_template=QWEN_CHAT,
    ).save_pretrained(out)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    counts = {
        "lm": sum(p.numel() for p in model.model.language_model.parameters()),
        "visual": sum(p.numel() for p in model.model.visual.parameters()),
        "tied": model.lm_head.weight is model.model.language_model.embed_tokens.weight,
        "dtype": {p.dtype for p in model.parameters()},
    }
    model.save_pretrained(out)
    del model
    return out, shapes, counts


def test_qwen3b_cut_shapes(qwen3b_cut_dir):
    _, shapes, counts = qwen3b_cut_dir
    t, v = dict(QWEN3B_TEXT, num_hidden_layers=2), dict(QWEN3B_VISION, depth=2)
    d, f, kv, vh, vf = 2048, 11008, 2 * 128, 1280, 3420
    for i in range(2):  # every decoder layer
        p = f"model.language_model.layers.{i}."
        assert {
            k: shapes[p + k]
            for k in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            )
        } == {
            "self_attn.q_proj.weight": (d, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, d),
            "mlp.gate_proj.weight": (f, d),
            "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f),
        }
        assert sum(math.prod(s) for n, s in shapes.items() if n.startswith(p)) == decoder_layer_params(t) == 77_076_992
        b = f"model.visual.blocks.{i}."
        assert (
            shapes[b + "attn.qkv.weight"],
            shapes[b + "attn.proj.weight"],
            shapes[b + "mlp.gate_proj.weight"],
            shapes[b + "mlp.down_proj.weight"],
        ) == ((3 * vh, vh), (vh, vh), (vf, vh), (vh, vf))
        assert sum(math.prod(s) for n, s in shapes.items() if n.startswith(b)) == vision_block_params(v) == 19_702_200
    assert shapes["model.visual.patch_embed.proj.weight"] == (vh, 3, 2, 14, 14)
    assert shapes["model.visual.merger.mlp.0.weight"] == (4 * vh, 4 * vh) and shapes[
        "model.visual.merger.mlp.2.weight"
    ] == (d, 4 * vh)
    assert shapes["model.language_model.embed_tokens.weight"] == (151936, d)
    assert counts["tied"] and counts["dtype"] == {torch.bfloat16}
    assert (counts["lm"], counts["visual"]) == qwen_vl_params(t, v)  # 465.3 M + 77.6 M = the 543 M trial
    # the full model is the cut one plus 34 decoder layers and 30 vision blocks of these sizes: 3.75 B
    assert counts["lm"] + counts["visual"] + 34 * decoder_layer_params(t) + 30 * vision_block_params(v) == QWEN3B_PARAMS


def test_qwen3b_cut_lora_forward_backward(qwen3b_cut_dir):
    """mrg_r1's LoRA (r 128) wrapped as common.add_lora wraps it (the vision tower excluded), one teacher-forced
    completion through HFPolicy.completion_logprobs in bf16: finite loss, gradients on LoRA parameters only."""
    from PIL import Image

    import mrg_r1

    out, _, _ = qwen3b_cut_dir
    policy = common.HFPolicy(str(out), dtype=torch.bfloat16, max_pixels=224 * 224)
    lora = mrg_r1.LORA
    wrapped = common.apply_lora(
        policy.model,
        lora["targets"],
        lora["r"],
        lora["alpha"],
        lora["dropout"],
        exclude=policy.vision_and_language()[0],
    )
    common.fp32_trainable(policy.model)
    expected = [
        f"model.language_model.layers.{i}.{part}"
        for i in range(2)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    assert sorted(wrapped) == sorted(expected)  # 7 per decoder layer; the vision tower's gate/up/down_proj untouched
    assert not any(isinstance(m, common.LoRALinear) for m in policy.model.model.visual.modules())
    trainable = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    assert set(trainable) == {f"{w}.lora_{ab}" for w in expected for ab in "AB"}
    # r (in + out) per projection: q 128 (2048 + 2048), k and v 128 (2048 + 256), o as q, each MLP 128 (2048 + 11008)
    assert sum(p.numel() for p in trainable.values()) == 2 * 128 * (2 * 4096 + 2 * 2304 + 3 * 13056) == 13_303_808
    assert {p.dtype for p in trainable.values()} == {torch.float32}

    image = Image.new("RGB", (224, 224), 128)  # 224 x 224 at max_pixels 224^2: 16 x 16 patches -> 64 image tokens
    prompts = policy.prompt_batch([[image]], "You are a radiologist.")
    assert int((prompts["input_ids"] == policy.model.config.image_token_id).sum()) == (224 // 28) ** 2 == 64
    ids, mask = policy.encode_targets(["There is no pleural effusion.", "The heart size is normal."][:1])
    logp = policy.completion_logprobs(prompts, ids, mask)  # (1, T)
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 0
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    assert set(grads) == set(trainable)
    assert all(torch.isfinite(g).all() for g in grads.values())
    # B = 0 at the start: dL/dA = 0 exactly, dL/dB != 0 (LoRA's init, Hu et al. 2021)
    assert all((g == 0).all() for n, g in grads.items() if n.endswith("lora_A"))
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("lora_B"))


# (a') one step of each RL script's own code path (main() with its flags) on the cut 3B, bf16 ----------------------
@pytest.fixture
def grads_at_steps(monkeypatch):
    """For each update of a script (its common.clip_gradients call): {parameter name: gradient finite?} of the model
    given to the last Run.restore."""
    seen, models, restore, clip = [], [], common.Run.restore, common.clip_gradients

    def restore_and_keep(self, model, *a, **k):
        models.append(model)
        return restore(self, model, *a, **k)

    def record_then_clip(params, max_norm):
        seen.append(
            {n: bool(torch.isfinite(p.grad).all()) for n, p in models[-1].named_parameters() if p.grad is not None}
        )
        return clip(params, max_norm)

    monkeypatch.setattr(common.Run, "restore", restore_and_keep)
    monkeypatch.setattr(common, "clip_gradients", record_then_clip)
    return seen


def _losses(path):
    return [json.loads(x)["loss"] for x in Path(path).read_text().splitlines()]


SMALL_RL = [
    "--dtype",
    "bf16",
    "--max-pixels",
    str(56 * 56),
    "--max-new-tokens",
    "4",
    "--group-size",
    "2",
    "--steps",
    "1",
]


def test_mrg_r1_step_at_3b_width(qwen3b_cut_dir, small_synthetic, tmp_path, grads_at_steps):
    """mrg_r1.main: LoRA r 128 on the 7 projections of each decoder layer, gradients on those adapters alone."""
    import mrg_r1

    mrg_r1.main(
        [
            "--data",
            str(small_synthetic),
            "--model",
            str(qwen3b_cut_dir[0]),
            "--labeler",
            "rule",
            "--out",
            str(tmp_path / "m"),
            "--sft-steps",
            "0",
            "--prompts-per-step",
            "1",
            *SMALL_RL,
        ]
    )
    expected = {
        f"model.language_model.layers.{i}.{part}.lora_{ab}"
        for i in range(2)
        for ab in "AB"
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert len(grads_at_steps) == 1 and set(grads_at_steps[0]) == expected and all(grads_at_steps[0].values())
    assert all(math.isfinite(x) for x in _losses(tmp_path / "m" / "metrics.jsonl"))


def test_orapo_step_at_3b_width(qwen3b_cut_dir, small_synthetic, tmp_path, grads_at_steps):
    """orapo.main: full fine-tuning against a frozen copy: a finite gradient on every parameter, vision tower
    included."""
    import orapo

    orapo.main(
        [
            "--data",
            str(small_synthetic),
            "--model",
            str(qwen3b_cut_dir[0]),
            "--labeler",
            "rule",
            "--out",
            str(tmp_path / "o"),
            "--prompts-per-step",
            "1",
            *SMALL_RL,
        ]
    )
    names = {n for n, _ in common.HFPolicy(str(qwen3b_cut_dir[0])).model.named_parameters()}
    assert len(grads_at_steps) == 1 and set(grads_at_steps[0]) == names and all(grads_at_steps[0].values())
    assert all(math.isfinite(x) for x in _losses(tmp_path / "o" / "metrics.jsonl"))


def test_deer_sft_then_rl_step_at_3b_width(qwen3b_cut_dir, small_synthetic, tmp_path, grads_at_steps, monkeypatch):
    """deer.main sft then rl (all studies: DDSampling is inference only): SFT's gradients on the vision tower and its
    merger alone, the LM frozen; RL's on every parameter."""
    import deer

    monkeypatch.setattr(deer, "SFT", dict(deer.SFT, batch_hf=2))
    monkeypatch.setattr(deer, "evaluate", lambda *a: {})  # greedy test reports: not what this test is about
    flags = [
        "--data",
        str(small_synthetic),
        "--model",
        str(qwen3b_cut_dir[0]),
        "--labeler",
        "rule",
        "--out",
        str(tmp_path / "d"),
        "--sft-steps",
        "1",
        "--prompts-per-step",
        "1",
        "--subset",
        "all",
        *SMALL_RL,
    ]
    deer.main(["sft", *flags])
    deer.main(["rl", *flags])
    names = {n for n, _ in common.HFPolicy(str(qwen3b_cut_dir[0])).model.named_parameters()}
    assert len(grads_at_steps) == 2 and all(all(g.values()) for g in grads_at_steps)
    assert set(grads_at_steps[0]) == {n for n in names if n.startswith("model.visual.")}
    assert set(grads_at_steps[1]) == names


# (b) image tokens per view on a MIMIC-CXR-sized image ---------------------------------------------------------------
@pytest.mark.parametrize(
    "max_pixels, tokens",
    [
        (512 * 512, 320),  # the scripts' --max-pixels default
        (28 * 28 * 1280, 1248),  # Qwen2VLImageProcessor's class default
        (12845056, 9919),
    ],
)  # Qwen2.5-VL-*-Instruct's preprocessor_config.json
def test_qwen_image_tokens_per_view(max_pixels, tokens):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    W, H = 2544, 3056  # a MIMIC-CXR PA view (portrait)
    h, w = smart_resize(H, W, 56 * 56, max_pixels)
    assert (h // 28) * (w // 28) == tokens  # 320 = 20 x 16, 1248 = 39 x 32, 9919 = 109 x 91
    proc = Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    grid = proc(images=[Image.new("RGB", (W, H), 100)], return_tensors="pt")["image_grid_thw"]  # (1, 3) t, h/14, w/14
    assert grid.tolist() == [[1, h // 14, w // 14]]
    assert int(grid.prod()) // 4 == tokens  # 2 x 2 patches merged per token


# (c) CheXbert, (d) Bio_ClinicalBERT and ResNet-50/101 -------------------------------------------------------------
BERT_BASE = dict(vocab=30522, hidden=768, layers=12, ff=3072, positions=512, types=2)


def bert_params(vocab, hidden, layers, ff, positions, types, pooler=True):
    embed = (vocab + positions + types) * hidden + 2 * hidden
    layer = 4 * (hidden * hidden + hidden) + 2 * hidden + (hidden * ff + ff) + (ff * hidden + hidden) + 2 * hidden
    return embed + layers * layer + (hidden * hidden + hidden if pooler else 0)


def test_chexbert_bert_base():
    model = common.chexbert_model()
    assert sum(p.numel() for p in model.bert.parameters()) == bert_params(**BERT_BASE) == 109_482_240
    heads = model.linear_heads
    assert len(heads) == 14 and [h.out_features for h in heads] == [4] * 13 + [2]
    assert sum(p.numel() for p in model.parameters()) == 109_482_240 + 13 * (768 * 4 + 4) + (768 * 2 + 2)
    model.eval()
    with torch.no_grad():
        out = model(torch.randint(0, 30522, (2, 16)), torch.ones(2, 16, dtype=torch.long))
    assert [tuple(o.shape) for o in out] == [(2, 4)] * 13 + [(2, 2)] and all(torch.isfinite(o).all() for o in out)


def test_bio_clinicalbert_shape():
    from transformers import BertConfig, BertModel

    # emilyalsentzer/Bio_ClinicalBERT, config.json: BERT-base with the cased BioBERT vocabulary
    model = BertModel(
        BertConfig(
            vocab_size=28996,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=512,
            type_vocab_size=2,
        )
    )
    assert sum(p.numel() for p in model.parameters()) == bert_params(**dict(BERT_BASE, vocab=28996)) == 108_310_272
    model.eval()
    with torch.no_grad():
        h = model(
            input_ids=torch.randint(0, 28996, (2, 12)), attention_mask=torch.ones(2, 12, dtype=torch.long)
        ).last_hidden_state
    assert h.shape == (2, 12, 768)


@pytest.mark.parametrize("depth, params, views", [(50, 23_508_032, 2), (101, 42_500_160, 1)])
def test_resnet_encoder(depth, params, views):
    enc = common.resnet_encoder(depth, weights=None).eval()  # torchvision: 25,557,032 / 44,549,160 less fc (2,049,000)
    assert sum(p.numel() for p in enc.parameters()) == params
    with torch.no_grad():
        z = enc(torch.randn(2, views, 3, 224, 224))  # (B, V, C, H, W)
    assert z.shape == (2, 2048) and torch.isfinite(z).all()


@pytest.fixture(scope="module")
def bio_clinicalbert_dir(tmp_path_factory):
    """A random BERT in Bio_ClinicalBERT's shape, saved with a small local WordPiece vocabulary (ids < 28,996)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = tmp_path_factory.mktemp("bio_clinicalbert")
    text = "there is no pleural effusion the heart size normal lungs are clear . , right left"
    words = sorted(set(text.split()))
    (out / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt")).save_pretrained(out)
    BertModel(
        BertConfig(
            vocab_size=28996, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
        )
    ).save_pretrained(out)
    return out


def test_dcrrg_step1_at_paper_widths(bio_clinicalbert_dir, small_synthetic, tmp_path, grads_at_steps):
    """dcrrg.main step1 with --model paper (ResNet-50 at 224) and a Bio_ClinicalBERT-shaped text encoder: one step,
    finite gradients on both encoders, their projections and prompt heads (BERT's unused pooler aside), nothing else."""
    import dcrrg

    dcrrg.main(
        [
            "step1",
            "--data",
            str(small_synthetic),
            "--model",
            "paper",
            "--pretrained",
            "none",
            "--labeler",
            "rule",
            "--text-encoder",
            str(bio_clinicalbert_dir),
            "--step1-steps",
            "1",
            "--batch-size",
            "4",
            "--out",
            str(tmp_path / "dc"),
        ]
    )
    (g,) = grads_at_steps
    assert all(g.values()) and {n.split(".")[0] for n in g} == {
        "image_encoder",
        "f_v",
        "cls_v",
        "text_encoder",
        "f_t",
        "cls_t",
    }
    assert {f"image_encoder.{n}" for n, _ in common.resnet_encoder(50).named_parameters()} <= set(g)
    assert "text_encoder.encoder.layer.11.output.dense.weight" in g and not any(".pooler." in n for n in g)


def test_rrgcl_measurer_at_paper_widths(bio_clinicalbert_dir, small_synthetic, tmp_path, monkeypatch):
    """rrgcl.measure with a ResNet-101 state dict (phi, 256 x 256) and the BERT (psi): features of the paper's widths,
    finite Eq. 1-4 and Eq. 9 difficulties for every study."""
    import numpy as np
    import torchvision

    import rrgcl

    torch.save(torchvision.models.resnet101().state_dict(), tmp_path / "resnet101.pt")
    shapes, features = {}, rrgcl.features

    def features_and_shapes(*a):
        feats = features(*a)
        shapes.update({k: tuple(v.shape) for k, v in feats.items()})
        return feats

    monkeypatch.setattr(rrgcl, "features", features_and_shapes)
    args = rrgcl.Args(visual_encoder=str(tmp_path / "resnet101.pt"), text_encoder=str(bio_clinicalbert_dir))
    m = rrgcl.measure(args, common.load_annotation(small_synthetic)["train"], common.RuleLabeler(), "cpu")
    assert shapes == {"itas_image": (40, 128), "vns_image": (40, 2048), "text": (40, 768)}
    assert m["dif1"].shape == m["dif2"].shape == (40,) and np.isfinite(m["dif1"]).all() and np.isfinite(m["dif2"]).all()


# Memory per decoder layer at Qwen2.5-VL-3B's widths -----------------------------------------------------------------
def saved_bytes(fn, exclude=()):
    """Run fn() and sum the distinct storages autograd saves for backward (parameters in `exclude` left out):
    the activation memory a backward pass needs, measured without a GPU."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def text_stack(layers, lora=None, vocab=512):
    """Qwen2.5-VL-3B's language model with `layers` layers and a small vocabulary (the embedding is not
    measured here): full fine-tuning (fp32 master weights, as fp32_trainable) or mrg_r1's LoRA on bf16."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(0)
    model = Qwen2_5_VLTextModel._from_config(
        Qwen2_5_VLTextConfig(**dict(QWEN3B_TEXT, num_hidden_layers=layers, vocab_size=vocab)), dtype=torch.bfloat16
    )
    if lora and layers:
        common.apply_lora(model, lora["targets"], lora["r"], lora["alpha"], lora["dropout"])
    common.fp32_trainable(model)
    return model.train()


def layer_activation_bytes(S, lora=None):
    """Saved bytes of one decoder layer for each token count in S (1 layer minus none), under bf16 autocast
    as HFPolicy."""
    out = []
    for layers in (0, 1):
        model, row = text_stack(layers, lora), []
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for s in S:
            # the embedding's output dtype; requires_grad: the layer saves what a middle layer saves
            x = torch.randn(1, s, 2048, dtype=next(model.parameters()).dtype, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                row.append(
                    saved_bytes(lambda m=model, x=x: m(inputs_embeds=x, use_cache=False).last_hidden_state, frozen)[0]
                )
        out.append(row)
        del model, frozen
    return [b - a for a, b in zip(*out)]


def vision_block_activation_bytes(grids=((1, 16, 16), (1, 32, 16))):
    """Saved bytes of one vision block (trained, fp32 master weights, bf16 autocast) per image patch: 2 blocks
    minus 1 block, at two image sizes (patches = t h w of the 14 x 14 grid)."""
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    out = []
    for depth in (1, 2):
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
            Qwen2_5_VLVisionConfig(**dict(QWEN3B_VISION, depth=depth, fullatt_block_indexes=[depth - 1])),
            dtype=torch.bfloat16,
        )
        common.fp32_trainable(tower.train())
        row = []
        for g in grids:
            thw = torch.tensor([g])
            pixels = torch.randn(int(thw.prod()), 3 * 2 * 14 * 14)  # (patches, C t p p) as the processor's pixel_values
            with torch.autocast("cpu", dtype=torch.bfloat16):
                row.append(saved_bytes(lambda tower=tower, pixels=pixels, thw=thw: tower(pixels, grid_thw=thw))[0])
        out.append(row)
        del tower
    (a1, a2), n = [b - a for a, b in zip(*out)], [math.prod(g) for g in grids]
    return (a2 - a1) / (n[1] - n[0])


def measure_layer_memory(S=(64, 128)):
    """Per decoder layer at 3B widths: weights, gradients and AdamW states (full fine-tuning and LoRA r 128),
    saved activations per token (a S1 / S2 two-point fit, and the weight copies autocast keeps), and the
    per-token bytes of the log-prob rows over the 151,936-word vocabulary."""
    import mrg_r1

    res = {}
    for name, lora in (("full", None), ("lora", mrg_r1.LORA)):
        model = text_stack(1, lora)
        layer = model.layers[0]
        train = [p for p in layer.parameters() if p.requires_grad]
        frozen = [p for p in layer.parameters() if not p.requires_grad]
        x = torch.randn(1, 8, 2048, dtype=next(model.parameters()).dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(inputs_embeds=x, use_cache=False).last_hidden_state.float().sum().backward()
        opt = torch.optim.AdamW(train, lr=1e-6)
        opt.step()
        res[name] = dict(
            train_params=sum(p.numel() for p in train),
            frozen_params=sum(p.numel() for p in frozen),
            weight_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            grad_bytes=sum(p.grad.numel() * p.grad.element_size() for p in train),
            adam_bytes=sum(v.numel() * v.element_size() for p in train for v in opt.state[p].values() if v.dim() > 0),
        )
        del model, layer, train, frozen, opt  # keep the peak under ~3 GB
        a1, a2 = layer_activation_bytes(S, lora)
        res[name]["act_per_token"] = (a2 - a1) / (S[1] - S[0])
        res[name]["act_const"] = a1 - res[name]["act_per_token"] * S[0]  # autocast's bf16 weight copies (full FT)
        res[name]["ckpt_per_token"] = 2048 * x.element_size()  # checkpointing keeps the layer's input only:
        # the residual stream is fp32 under full fine-tuning (fp32 embedding), bf16 under LoRA
    # the log-prob rows: HFPolicy keeps bf16 logits (N, T, V); token_logprobs' fp32 copy of each row is saved for
    # the backward of logsumexp, so all N rows are alive at once under autograd
    V, N, T = 151936, 2, 8
    logits = torch.randn(N, T, V, dtype=torch.bfloat16, requires_grad=True)
    b, _ = saved_bytes(lambda: common.token_logprobs(logits, torch.randint(0, V, (N, T))))
    res["logprob_saved_per_token"] = b / (N * T)
    res["logits_bf16_per_token"] = V * 2
    res["vision_block_act_per_patch"] = vision_block_activation_bytes()
    return res


def test_decoder_layer_memory():
    m = measure_layer_memory()
    full, lora = m["full"], m["lora"]
    P = decoder_layer_params(QWEN3B_TEXT)
    # full fine-tuning: fp32 master weights (4 B), fp32 gradients (4 B), AdamW's two fp32 moments (8 B)
    assert (full["train_params"], full["weight_bytes"], full["grad_bytes"], full["adam_bytes"]) == (
        P,
        4 * P,
        4 * P,
        8 * P,
    )
    # LoRA r 128: the bf16 base (2 B) frozen, 1.64 M fp32 adapter parameters with their gradients and moments
    A = 128 * (2 * 4096 + 2 * 2304 + 3 * 13056)
    assert (lora["train_params"], lora["frozen_params"]) == (A, P)
    assert (lora["weight_bytes"], lora["grad_bytes"], lora["adam_bytes"]) == (2 * P + 4 * A, 4 * A, 8 * A)
    # autocast saves a bf16 copy of every fp32 weight it casts for a matmul (2 B / parameter)
    assert abs(full["act_const"] - 2 * (P - 2 * 2048)) < 0.05 * 2 * P
    assert abs(lora["act_const"] - 2 * A) < 0.05 * 2 * A  # the LoRA matrices' bf16 casts
    assert 20_000 < full["act_per_token"] < 400_000 and 20_000 < lora["act_per_token"] < 400_000
    # fp32 log-softmax rows saved for backward: 4 B per word per token
    assert m["logprob_saved_per_token"] == pytest.approx(151936 * 4, rel=0.01)
    assert 20_000 < m["vision_block_act_per_patch"] < 200_000


def memory_table(m, prompt=380, views_tokens=320):
    """MACHINES.md's memory table (GB = 1e9 B) from the measurements m: per GPU, each rank holding every weight (DDP):
    states + n (P + T) [L c + a] + n T V 6 + n 4 I D (D_c + v), checkpointing on (the scripts' default; off: c = a,
    D_c = v), n the completions (studies for SFT) per rank per micro-batch, I the image tokens per view."""
    V, L, D, pix = 151936, 36, 32, 4 * views_tokens
    P3, (lm3, vis3) = QWEN3B_PARAMS, qwen_vl_params(QWEN3B_TEXT, QWEN3B_VISION)
    P7, A7 = sum(qwen_vl_params(QWEN7B_TEXT, QWEN7B_VISION)), 28 * 128 * (2 * 7168 + 2 * 4096 + 3 * 22528)
    full, lora, v = m["full"], m["lora"], m["vision_block_act_per_patch"]
    a7 = lora["act_per_token"] * (3584 + 18944) / (2048 + 11008)  # 7B: scaled by d + ff (not measured)
    rows = {  # name: (states bytes, tokens/completion, completion tokens, completions per step, L, a, c, vision trains)
        "mrg_r1 7B LoRA r128 (paper)": (P7 * 2 + A7 * 18, prompt + 256, 256, 16, 28, a7, 2 * 3584, False),
        "mrg_r1 on 3B, LoRA r128": (
            P3 * 2 + 36 * lora["train_params"] * 18,
            prompt + 256,
            256,
            16,
            L,
            lora["act_per_token"],
            4096,
            False,
        ),
        "orapo 3B full FT, G 8 x 4": (P3 * (16 + 2 + 2), prompt + 256, 256, 32, L, full["act_per_token"], 8192, True),
        "deer SFT, vision tower, 64": (
            vis3 * 18 + lm3 * 2,
            prompt + 128,
            128,
            64,
            L,
            lora["act_per_token"],
            4096,
            True,
        ),
        "deer RL 3B full FT, 64 x 8": (P3 * (16 + 2), prompt + 256, 256, 512, L, full["act_per_token"], 8192, True),
    }
    out = {}
    for name, (states, tok, T, N, layers, a, c, vis) in rows.items():

        def act(n, ckpt=True, tok=tok, T=T, layers=layers, a=a, c=c, vis=vis):
            """Activation bytes of n completions (checkpointed or not): layers, log-prob rows, the vision tower."""
            vision = pix * (D * (5120 if ckpt else v) + (v if ckpt else 0)) if vis else 0
            return n * (tok * (layers * (c if ckpt else a) + (a if ckpt else 0)) + T * V * 6 + vision)

        out[name] = dict(
            states=states / 1e9,
            act_per_completion=act(1) / 1e9,
            act_per_completion_no_ckpt=act(1, False) / 1e9,
            one_gpu=(states + act(N)) / 1e9,
            one_gpu_no_ckpt=(states + act(N, False)) / 1e9,
            completions=N,
        )
    return out


if __name__ == "__main__":  # print the measurements (JSON) and the estimates of the memory table (tests/MACHINES.md)
    torch.set_num_threads(1)
    m = measure_layer_memory()
    print(json.dumps(m, indent=1))
    print(json.dumps(memory_table(m), indent=1))
