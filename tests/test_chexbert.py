"""CheXbertLabeler offline: a tiny random BERT in CheXbert's shape (f1chexbert's class) with a
locally built word-piece vocabulary. Batched labels equal one-at-a-time labels, CheXbert's
class mapping and truncation, strict checkpoint loading. (DEER's input-embedding saliency: tests/test_deer.py.)"""

import string
import time

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertTokenizerFast

import common
import sandbox
from common import CheXbertLabeler, chexbert_model

SENTENCES = [
    "There is a small left pleural effusion.",
    "No pneumothorax.",
    "Heart size is normal.",
    "Mild pulmonary edema cannot be excluded.",
    "An endotracheal tube terminates above the carina.",
    "Plate-like atelectasis at the right base.",
    "The cardiomediastinal silhouette is enlarged.",
    "Possible right lower lobe consolidation or pneumonia.",
    "No acute cardiopulmonary process.",
    "There is a displaced left rib fracture.",
]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    words = sorted({w.strip(string.punctuation).lower() for s in SENTENCES for w in s.split()} - {""})
    pieces = [c for c in string.ascii_lowercase + string.digits] + ["##" + c for c in string.ascii_lowercase]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(string.punctuation) + pieces + words
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    return path


def local_tokenizer(vocab_path):
    # from_pretrained(folder) reads vocab.txt under transformers 4 and 5 alike; transformers 5
    # silently ignores BertTokenizerFast(vocab_file=...) and leaves only the special tokens.
    tok = BertTokenizerFast.from_pretrained(str(vocab_path.parent))
    assert tok.tokenize("No pneumothorax.") == ["no", "pneumothorax", "."]
    return tok


def tiny_config(vocab_size):
    # initializer_range 0.5, not BERT's 0.02: with small weights every report gets the same
    # labels and "batched equals one by one" would prove nothing
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        initializer_range=0.5,
    )


@pytest.fixture(scope="module")
def labeler(vocab_file):
    tok = local_tokenizer(vocab_file)
    torch.manual_seed(0)
    return CheXbertLabeler(model=chexbert_model(tiny_config(tok.vocab_size)), tokenizer=tok, batch_size=4)


def reports(n=30, seed=0):
    rng = np.random.default_rng(seed)
    out = [" ".join(rng.choice(SENTENCES, size=rng.integers(1, 8))) for _ in range(n)]
    out[3] = ""  # empty
    out[7] = "  \n  "  # whitespace only
    out[11] = " ".join(SENTENCES * 40)  # far more than 512 word pieces
    out[13] = "zzqx blorf"  # unknown words: character pieces
    return out


def test_batched_equals_one_by_one(labeler):
    r = reports()
    batched, single = labeler(r), np.concatenate([labeler([x]) for x in r])
    np.testing.assert_array_equal(batched, single)
    assert batched.shape == (30, 14) and batched.dtype == np.float64
    assert set(np.unique(batched[~np.isnan(batched)])) <= {1.0, 0.0, -1.0}
    assert np.isnan(batched[3]).all() and np.isnan(batched[7]).all()
    filled = [i for i in range(30) if i not in (3, 7)]
    assert len({tuple(np.nan_to_num(batched[i], nan=9)) for i in filled}) > 10  # the labels differ across reports


def test_truncation_to_512_pieces_as_chexbert(labeler):
    long = " ".join(SENTENCES * 40)
    ids = labeler.encode(long)
    assert len(ids) == 512 and ids[0] == labeler.tokenizer.cls_token_id and ids[-1] == labeler.tokenizer.sep_token_id
    pieces = labeler.tokenizer.tokenize(long)
    assert len(pieces) > 600
    cut = labeler.tokenizer.convert_tokens_to_string(pieces[:510])  # the text CheXbert actually sees
    assert labeler.encode(cut) == ids
    np.testing.assert_array_equal(labeler([long]), labeler([cut]))


def test_class_mapping(vocab_file):
    # Zero weights and hand-set biases make each head's argmax known: CheXbert's label.py mapping
    tok = local_tokenizer(vocab_file)
    model = chexbert_model(tiny_config(tok.vocab_size))
    wanted = [0, 1, 2, 3, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # classes for the 13 four-class heads
    with torch.no_grad():
        for h, c in enumerate(wanted):
            model.linear_heads[h].weight.zero_()
            model.linear_heads[h].bias.copy_(torch.eye(4)[c])
        model.linear_heads[13].weight.zero_()
        model.linear_heads[13].bias.copy_(torch.tensor([0.0, 1.0]))
    lab = CheXbertLabeler(model=model, tokenizer=tok)
    expected = [np.nan, 1, 0, -1, 1, 0, -1, np.nan, 1, 0, -1, np.nan, 1] + [1]
    np.testing.assert_array_equal(lab(["No pneumothorax."])[0], np.array(expected, dtype=float))
    with torch.no_grad():
        model.linear_heads[13].bias.copy_(torch.tensor([1.0, 0.0]))
    assert np.isnan(lab(["No pneumothorax."])[0, 13])  # No Finding: class 0 is blank


def test_importing_f1chexbert_keeps_warnings_on(monkeypatch):
    """f1chexbert's module calls warnings.filterwarnings("ignore") on import; common.chexbert_model must not let it
    silence the user's warnings. Imported afresh here (its modules out of sys.modules for this test, put back after)."""
    import sys
    import warnings

    from transformers import BertConfig

    for name in [m for m in sys.modules if m.split(".")[0] == "f1chexbert"]:
        monkeypatch.delitem(sys.modules, name)
    config = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    with warnings.catch_warnings():  # pytest's own filters come back after the test
        common.chexbert_model(config)
        assert "f1chexbert.f1chexbert" in sys.modules  # imported again, by chexbert_model
        catch_all = [
            f for f in warnings.filters if f[0] == "ignore" and f[1] is None and f[2] is Warning and f[3] is None
        ]
    assert catch_all == []  # no catch-all "ignore" filter was left behind


def test_layout_matches_f1chexbert_bert_labeler(vocab_file, tmp_path):
    # f1chexbert's own constructor, offline, from a saved tiny BERT: same names, shapes, outputs
    from f1chexbert.f1chexbert import bert_labeler
    from transformers import BertModel

    tok = local_tokenizer(vocab_file)
    BertModel(tiny_config(tok.vocab_size)).save_pretrained(tmp_path / "bert")
    theirs = bert_labeler(pretrain_path=str(tmp_path / "bert")).eval()
    ours = chexbert_model(tiny_config(tok.vocab_size)).eval()
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    theirs.load_state_dict(ours.state_dict())
    ids = torch.tensor([tok("No pneumothorax.")["input_ids"]])
    for a, b in zip(theirs(ids, torch.ones_like(ids)), ours(ids, torch.ones_like(ids))):
        torch.testing.assert_close(a, b)


def save_as_chexbert_checkpoint(model, path):
    """CheXbert's file format: DataParallel names ("module." prefix) under model_state_dict."""
    state = {"module." + k: v for k, v in model.state_dict().items()}
    state["module.bert.embeddings.position_ids"] = torch.arange(512)[None]  # as old transformers saved it
    torch.save({"epoch": 3, "model_state_dict": state}, path)
    return state


def test_strict_loading(labeler, vocab_file, tmp_path):
    tok = labeler.tokenizer
    path = tmp_path / "chexbert.pth"
    state = save_as_chexbert_checkpoint(labeler.model, path)
    fresh = chexbert_model(tiny_config(tok.vocab_size), path)
    again = CheXbertLabeler(model=fresh, tokenizer=tok)
    r = reports()
    np.testing.assert_array_equal(again(r), labeler(r))

    del state["module.linear_heads.13.bias"]
    torch.save({"model_state_dict": state}, tmp_path / "broken.pth")
    with pytest.raises(
        ValueError, match=r"(?s)broken.pth: does not match CheXbert's model .*Missing key.*linear_heads.13.bias"
    ):
        chexbert_model(tiny_config(tok.vocab_size), tmp_path / "broken.pth")
    with pytest.raises(ValueError, match="does not match"):  # same names, other shapes
        chexbert_model(tiny_config(tok.vocab_size + 1), path)
    with pytest.raises(FileNotFoundError, match="--chexbert-weights"):
        CheXbertLabeler(weights=tmp_path / "nope.pth", tokenizer=tok)


@pytest.mark.slow
def test_batched_speedup_bert_base_size(tmp_path):
    """Benchmark (tests/MACHINES.md): a bert-base-size random CheXbert, 128 reports of 40-120 words,
    batches of 32 sorted by length vs one report at a time (f1chexbert's way), 2 threads.
        python -m pytest -q tests/test_chexbert.py -m slow -s"""
    torch.set_num_threads(2)
    words = sorted({w.strip(string.punctuation).lower() for s in SENTENCES for w in s.split()} - {""})
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + words) + "\n")
    tok = BertTokenizerFast.from_pretrained(str(tmp_path))
    torch.manual_seed(0)
    lab = CheXbertLabeler(model=chexbert_model(BertConfig(vocab_size=tok.vocab_size)), tokenizer=tok, batch_size=32)
    rng = np.random.default_rng(0)
    r = [" ".join(rng.choice(SENTENCES, size=rng.integers(6, 18))) for _ in range(128)]
    lab(r[:4])  # warm up
    t0 = time.time()
    batched = lab(r)
    t1 = time.time()
    single = np.concatenate([lab([x]) for x in r])
    t2 = time.time()
    n_words = np.mean([len(x.split()) for x in r])
    print(
        f"\nCheXbert (bert-base size, random), {len(r)} reports of {n_words:.0f} words: "
        f"batched {len(r) / (t1 - t0):.1f} reports/s, one by one {len(r) / (t2 - t1):.1f} reports/s, "
        f"speed-up {(t2 - t1) / (t1 - t0):.2f}x"
    )
    np.testing.assert_array_equal(batched, single)  # the speed-up is reported, not asserted (a shared machine)


def test_labels_ignore_the_callers_autocast(labeler):
    # rewards are computed inside the policy's bf16 autocast; the labels must be the fp32 ones
    texts = reports(40, seed=3)
    plain = labeler(texts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        np.testing.assert_array_equal(labeler(texts), plain)


# --- the sandbox's CheXbert (--labeler chexbert on --data synthetic, offline) ----------------------------------------
TINY_SANDBOX = dict(hidden=32, layers=1, heads=2, epochs=4, lr=3e-3, batch_size=8)


def test_the_sandbox_chexbert_trains_and_loads_as_chexbert_pth(small_synthetic, tmp_path):
    """Trained on the training reports against their own labels, saved in chexbert.pth's layout with its small BERT's
    config.json and word pieces beside it, loaded offline by the same code as the real weights; seeded: repeatable."""
    records = common.load_annotation(small_synthetic)["train"]
    path = sandbox.train_chexbert(records, tmp_path / "a", **TINY_SANDBOX)
    assert sorted(p.name for p in path.parent.iterdir()) == ["chexbert.pth", "config.json", "vocab.txt"]
    state = torch.load(path, weights_only=True)["model_state_dict"]
    assert state and all(k.startswith("module.") for k in state)  # as the real file (saved from DataParallel)
    again = torch.load(sandbox.train_chexbert(records, tmp_path / "b", **TINY_SANDBOX), weights_only=True)
    assert all(torch.equal(v, again["model_state_dict"][k]) for k, v in state.items())
    labeler = common.make_labeler("chexbert", path)
    assert labeler.model.bert.config.hidden_size == 32 and labeler.tokenizer.tokenize("no pneumothorax") == [
        "no",
        "pneumothorax",
    ]
    labels = labeler([r.report for r in records])  # (N, 14)
    gold = np.stack([r.labels for r in records])
    mentioned = ~np.isnan(gold)
    blank_only = (~mentioned).mean()  # what labelling every observation blank would get right
    agree = ((labels == gold) | (np.isnan(labels) & ~mentioned)).mean()
    assert agree > blank_only + 0.05, (agree, blank_only)  # 4 epochs on 40 reports: it has begun to read them


def test_the_sandbox_chexbert_is_trained_once_beside_its_data(small_synthetic, monkeypatch):
    """In a process of its own under the numeric pins, into <data folder>/chexbert; then read from there."""
    path = sandbox.synthetic_chexbert(small_synthetic, TINY_SANDBOX)
    assert path == small_synthetic.parent / "chexbert-v2" / "chexbert.pth" and path.is_file()
    stamp = path.stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("trained again")

    monkeypatch.setattr(sandbox.subprocess, "run", no_training)
    assert sandbox.synthetic_chexbert(small_synthetic, TINY_SANDBOX) == path and path.stat().st_mtime_ns == stamp


def test_evaluation_scores_against_the_references_own_labels_and_checks_the_labeler(labeler):
    """Beside CE against the labeler's reading of the references, "ce_gold" against their own labels (generated
    reports still read by the labeler); with CheXbert, how often the rules read the generated reports as it does."""
    refs = ["There is mild cardiomegaly.", "No pneumothorax.", "Small left pleural effusion.", "The lungs are clear."]
    hyps = ["There is mild cardiomegaly.", "Small left pleural effusion.", "No pneumothorax.", "The lungs are clear."]
    rows = [{"reference": r, "generated": h} for r, h in zip(refs, hyps)]
    gold = common.RuleLabeler()(refs)  # the references' own labels (the rules read these sentences right)
    out = common.evaluate_generations(rows, labeler, meteor=False, uncertain_as=0, gold=gold)
    assert out["ce_gold"] == common.ce_metrics(labeler(hyps), gold, uncertain_as=0)
    assert out["ce"] == common.ce_metrics(labeler(hyps), labeler(refs), uncertain_as=0)
    same = common.binarize(labeler(hyps), 0) == common.binarize(common.RuleLabeler()(hyps), 0)  # (4, 14)
    assert out["labelers_agree"] == {"reports": same.all(1).mean(), "labels": same.mean()}
    assert "labelers_agree" not in common.evaluate_generations(rows, common.RuleLabeler(), meteor=False)
