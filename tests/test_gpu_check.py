"""tests/gpu_check.py without a GPU: the preparation, then one line, every file under --out, exit 0; the memory
formula it compares with; its parts run on the CPU with the tiny Qwen2.5-VL, to check the parts themselves."""

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


def without_pytest(folder: Path) -> dict:
    """The environment of a process that cannot import pytest (the device's image has none): `pytest` and `_pytest`
    first on PYTHONPATH, each raising ModuleNotFoundError, as an absent module does; the processes it starts too."""
    for name in ("pytest.py", "_pytest.py"):
        (folder / name).write_text("raise ModuleNotFoundError('no pytest on the device: gpu_check must not need it')\n")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """`python tests/gpu_check.py --out DIR` with no CUDA device (CUDA_VISIBLE_DEVICES="") and pytest unimportable:
    the process and DIR."""
    out, blocked = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("no_pytest")
    proc = run_python(ROOT / "tests" / "gpu_check.py", "--out", str(out), env=without_pytest(blocked))
    return proc, out


def test_without_cuda_it_prepares_says_so_in_one_line_and_exits_0(prepared):
    """Without pytest, the CPU-side preparation runs (MIMIC-size views, the tiny Qwen2.5-VL, the 3B's and 7B's
    published folders without weights), stdout is one line, the exit status 0, every file under --out, no gpu.json."""
    proc, out = prepared
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and "no CUDA device" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "work"] and not (out / "gpu.json").exists()
    work = out / "work"
    for name, (layers, width) in {"qwen3b": (36, 2048), "qwen7b": (28, 3584)}.items():
        config = json.loads((work / name / "config.json").read_text())["text_config"]
        assert (config["num_hidden_layers"], config["hidden_size"]) == (layers, width)
        assert not list((work / name).glob("*.safetensors"))  # built on the GPU by a part
        pre = json.loads((work / name / "preprocessor_config.json").read_text())
        assert pre["max_pixels"] == 12845056 and "size" not in pre  # the hub's layout
    annotation = json.loads((work / "data" / "annotation.json").read_text())
    views = [r["image_path"] for r in annotation["train"]]
    assert len(views) == 32 and all(len(v) == 1 for v in views)
    from PIL import Image

    with Image.open(work / "data" / "images" / views[0][0]) as im:
        assert im.size == (2544, 3056)


def test_memory_formula_is_the_documented_one():
    """MACHINES.md's estimates for 3B, n = 8 completions of 636 tokens (0.82 GB each): OraPO's full fine-tuning with a
    frozen reference 20 B a parameter and 2 more for the reference's fp32 embedding (311.2 M), 75.1 + 0.6 + 6.6 = 82.3
    GB (the table's 82 GB); MRG-R1's 7B with LoRA r 128 keeps the base in bf16 (16.6 GB) and 18 B per adapter
    parameter (7B: 28 layers x 128 x (q, k, v, o, gate, up, down: in + out) = 323.0 M: 5.8 GB)."""
    assert gpu_check.LORA_R128_PARAMS == 239_468_544
    assert gpu_check.LORA_R128_PARAMS_7B == 28 * 128 * (2 * 7168 + 2 * 4096 + 3 * 22528) == 322_961_408
    assert gpu_check.formula_gb("orapo", 8) == pytest.approx(20 * 3.754622976 + 2 * 0.311164928 + 8 * 0.82, abs=1e-9)
    assert round(gpu_check.formula_gb("orapo", 8)) == 82
    assert gpu_check.formula_gb("mrg_r1", 16) == pytest.approx(2 * 8.292166656 + 18 * 0.322961408 + 16 * 0.82)


def test_the_limits_fit_the_budget_and_the_7b_part_is_not_last():
    """Preparation's share and the parts' limits add to at most the whole check's budget (no part is cut by the
    budget while preparation keeps to its share); the parts run in LIMITS_S's order, the 7B part (mrg_r1, the one
    on qwen7b) not last."""
    assert gpu_check.PREPARE_S + sum(gpu_check.LIMITS_S.values()) <= gpu_check.BUDGET_S
    assert gpu_check.STEP_SHAPES["mrg_r1"][0] == "qwen7b" and list(gpu_check.LIMITS_S)[-1] != "step:mrg_r1"
    assert [k for k, (model, *_) in gpu_check.STEP_SHAPES.items() if model == "qwen7b"] == ["mrg_r1"]


@pytest.mark.parametrize(
    "name, peaks",
    [
        ("NVIDIA H100 80GB HBM3", (989e12, 3.35e12)),  # SXM5
        ("NVIDIA H100 PCIe", (756e12, 2.0e12)),
        ("NVIDIA H100 NVL", (835e12, 3.9e12)),
        ("NVIDIA H200", (989e12, 4.8e12)),
        ("NVIDIA H200 NVL", (835e12, 4.8e12)),
        ("NVIDIA A100-SXM4-80GB", (312e12, 2.039e12)),
        ("NVIDIA A100-PCIE-40GB", (312e12, 1.555e12)),
        ("NVIDIA A100 80GB PCIe", (312e12, 1.935e12)),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", (None, None)),  # a slice: not the card's peaks
        ("NVIDIA H100", (None, None)),  # which H100: not said
        ("NVIDIA L40S", (None, None)),
        ("cpu", (None, None)),
    ],
)
def test_device_peaks_are_the_exact_cards(name, peaks):
    """The data sheet's dense bf16 rate and HBM bandwidth of the card the name says: a PCIe or NVL H100 does not get
    the SXM's; an unknown card, a MIG slice or a bare "H100" none (no utilisation printed)."""
    assert gpu_check.device_peaks(name) == peaks


def test_unknown_part_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="error: --parts: unknown gpu"):
        gpu_check.main(["--parts", "gpu", "--out", str(tmp_path)])


def test_parts_run_on_the_cpu(prepared, monkeypatch):
    """The parts with the CPU as their device (a CPU run of the CUDA check checks the check), the tiny Qwen2.5-VL in
    place of the 3B: the processor's 320 tokens; the RL core's CPU-against-CPU differences 0; the generation sweep (2
    and 3 rows); OraPO's step part: 3 steps, the last one's four phases, its completions and decode rate, no
    utilisation (no GPU's peak known)."""
    _, out = prepared
    work = out / "work"
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    for attr in ("rollout", "reference_logprobs", "clip_gradients", "for_training"):  # the parts patch them
        monkeypatch.setattr(common, attr, getattr(common, attr))
    for owner, attr in ((common.Run, "log_step"), (common.Run, "evaluate"), (common.Run, "checkpoint")):
        monkeypatch.setattr(owner, attr, getattr(owner, attr))
    for attr in ("generate", "completion_logprobs", "save"):
        monkeypatch.setattr(common.HFPolicy, attr, getattr(common.HFPolicy, attr))
    from transformers import AutoModelForImageTextToText

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", AutoModelForImageTextToText.from_pretrained)
    figures = {}
    for name, run in {
        "processor": lambda f: gpu_check.part_processor(work, f),
        "rl_core": lambda f: gpu_check.part_rl_core(work, f),
        "generation": lambda f: gpu_check.part_generation(work, f, model="qwen_tiny", new_tokens=4, rows=(2, 3)),
        "step": lambda f: gpu_check.part_step("orapo", work, f, model="qwen_tiny", new_tokens=6),
    }.items():
        figures[name] = gpu_check.Figures(work / "parts" / f"cpu_{name}.json")
        if name == "step":
            gpu_check.keep_policies()
        run(figures[name])
    assert figures["processor"]["tokens_at_512"] == 320 and figures["processor"]["tokens_unbounded"] == 9919
    assert figures["rl_core"]["bf16_within_bound"] and set(
        figures["rl_core"]["bf16"]["relative_difference"].values()
    ) == {0.0}
    assert set(figures["generation"]["rows"]) == {2, 3}  # the GPU's 8, 32, 64 rows, fewer on the CPU
    step = figures["step"]
    assert set(step["phases"]) == {"generate", "reference", "forward + backward", "optimizer"}
    assert step["completions"] == 8 and step["new_tokens"] == 6 and step["update_mfu"] is None
    assert step["update_tokens"] > 8 * 6 and step["peak_gb"] == 0.0  # the CPU: no CUDA memory counted
    lines = [json.loads(x) for x in (work / "runs" / "orapo" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert torch.cuda.is_available() or step["phases"]["generate"]["seconds"] > 0
