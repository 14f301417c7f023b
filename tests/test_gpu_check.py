"""tests/gpu_check.py without a GPU: the preparation, then one line and exit 0; the memory formula it
compares with; two of its parts run on the CPU, to check the parts themselves."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import common

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import gpu_check
from conftest import run_python


def test_without_cuda_it_prepares_says_so_in_one_line_and_exits_0(tmp_path):
    """CUDA_VISIBLE_DEVICES="" hides any GPU: the CPU-side preparation runs (the data, the tiny Qwen2.5-VL, the 3B's
    config without weights, the word pieces), stdout is one line, the exit status 0, and no gpu.json is written."""
    work, out = tmp_path / "work", tmp_path / "gpu.json"
    proc = run_python(ROOT / "tests" / "gpu_check.py", "--work", str(work), "--out", str(out))  # with no CUDA device
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and "no CUDA device" in proc.stdout
    assert not out.exists()
    config = json.loads((work / "qwen3b" / "config.json").read_text())
    assert (config["text_config"]["num_hidden_layers"], config["vision_config"]["depth"]) == (36, 32)
    assert not list((work / "qwen3b").glob("*.safetensors"))  # built on the GPU by the part
    assert (work / "qwen_tiny" / "model.safetensors").is_file() and (work / "bert_vocab.txt").is_file()
    assert len(json.loads((work / "data512" / "annotation.json").read_text())["train"]) == 8


def test_memory_formula_is_the_documented_one():
    """MACHINES.md's estimates for 3B, n = 8 completions of 636 tokens (0.82 GB each): OraPO's full fine-tuning with a
    frozen reference 20 B a parameter and 2 more for the reference's fp32 embedding (311.2 M), 75.1 + 0.6 + 6.6 = 82.3
    GB (the table's 82 GB); MRG-R1's LoRA r 128 keeps the base in bf16 (7.5 GB) and 18 B per adapter parameter
    (239.5 M: 4.3 GB)."""
    assert gpu_check.LORA_R128_PARAMS == 239_468_544  # 36 layers x 128 x (q, k, v, o, gate, up, down: in + out)
    assert gpu_check.formula_gb("orapo", 8) == pytest.approx(20 * 3.754622976 + 2 * 0.311164928 + 8 * 0.82, abs=1e-9)
    assert round(gpu_check.formula_gb("orapo", 8)) == 82
    assert gpu_check.formula_gb("mrg_r1", 8) == pytest.approx(2 * 3.754622976 + 18 * 0.239468544 + 6.56, abs=1e-9)


def test_unknown_part_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="error: --parts: unknown gpu"):
        gpu_check.main(["--parts", "gpu", "--work", str(tmp_path)])


def test_parts_run_on_the_cpu(tmp_path, monkeypatch):
    """Two parts in this process with the CPU as their device (a CPU run of the CUDA check checks the check): the RL
    core's CPU-against-CPU differences are 0; mrg_r1 runs with the tiny model and the tiny Qwen2.5-VL, stopped after
    RL's step 1 and resumed to step 2."""
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    for name in ("RRG_CACHE", "RRG_METEOR", "TOKENIZERS_PARALLELISM"):  # run_part sets them
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(common.Run, "checkpoint", common.Run.checkpoint)  # the part stops runs after step 1
    monkeypatch.setattr(common, "CHECKPOINT_EVERY", common.CHECKPOINT_EVERY)
    gpu_check.prepare(tmp_path)
    (tmp_path / "parts").mkdir()
    for part in ("rl_core", "scripts:mrg_r1"):
        gpu_check.run_part(part, tmp_path)
    core = json.loads((tmp_path / "parts" / "rl_core.json").read_text())
    assert core["bf16_within_bound"] and set(core["bf16"]["relative_difference"].values()) == {0.0}
    runs = json.loads((tmp_path / "parts" / "scripts_mrg_r1.json").read_text())
    steps = {".": [1, 2], "warm_start": [1, 2]}  # RL's two steps (stopped after 1), after a 2-step warm start
    assert {model: r["steps"] for model, r in runs.items()} == {"tiny": steps, "qwen": steps}
