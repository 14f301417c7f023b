"""Rebuild the sandbox's shipped models (tests/sandbox_models/) from their recipes on this machine, beside the
synthetic set, and say how far the rebuild lands from what ships: per file, the same bytes or not and, for weights,
the largest difference of any tensor; the foundation's probe. A maintainer's tool (about 30 CPU-minutes):

    python tests/ship_sandbox.py            # the report, as JSON
    python tests/ship_sandbox.py --write    # the rebuild becomes what ships (its files and MANIFEST.json)
"""

import argparse
import json
import logging
import platform
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as `python tests/ship_sandbox.py`
from common import CHEXBERT_FILE
from sandbox import (
    FOUNDATION,
    FOUNDATION_VERSION,
    NUMERIC_PINS,
    SANDBOX_CHEXBERT,
    SANDBOX_CHEXBERT_VERSION,
    SHIPPED,
    build_once,
    sha256,
    synthetic_data,
)


def tensors(path: Path) -> dict:
    """The weights in a shipped file (chexbert.pth, tiny_policy.pt, model.safetensors)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint.get("model_state_dict", checkpoint.get("state_dict"))


def ship(write: bool = False) -> dict:
    """Rebuild the shipped models from their recipes on this machine, beside the synthetic set; per file, whether it
    is the shipped one to the byte and, for weights, the largest difference of any tensor; the foundation's probe.
    `write`: the rebuild becomes what ships (its files and MANIFEST.json)."""
    annotation = synthetic_data()
    scratch = Path(tempfile.mkdtemp(dir=annotation.parent, prefix=".ship-"))
    recipes = {f"chexbert-v{SANDBOX_CHEXBERT_VERSION}": ("chexbert", CHEXBERT_FILE, SANDBOX_CHEXBERT)}
    recipes[f"foundation-v{FOUNDATION_VERSION}"] = ("foundation", "foundation.json", FOUNDATION)
    info = Path("/proc/cpuinfo")
    cpu = re.findall(r"model name\s*: (.*)", info.read_text()) if info.is_file() else [platform.processor()]
    report = {"machine": cpu[0], "torch": torch.__version__, "files": {}}
    for name, (command, marker, settings) in recipes.items():
        built = build_once(scratch / name, marker, command, annotation, settings)
        for f in sorted(p for p in built.rglob("*") if p.is_file()):
            rel, old = f"{name}/{f.relative_to(built)}", SHIPPED / name / f.relative_to(built)
            row = {"same bytes": old.is_file() and sha256(f) == sha256(old)}
            if f.suffix in (".pth", ".pt", ".safetensors") and old.is_file():
                new_w, old_w = tensors(f), tensors(old)
                row["largest tensor difference"] = max(float((new_w[k] - old_w[k]).abs().max()) for k in old_w)
            report["files"][rel] = row
    probe = json.loads((scratch / f"foundation-v{FOUNDATION_VERSION}" / "foundation.json").read_text())["probe"]
    report["probe"] = {k: probe[k] for k in ("probe_auroc_mean", "caption_signs_f1", "reports_distinct")}
    if write:
        for name in recipes:
            shutil.rmtree(SHIPPED / name, ignore_errors=True)
            shutil.copytree(scratch / name, SHIPPED / name)
        files = {str(f.relative_to(SHIPPED)): sha256(f) for f in sorted(SHIPPED.rglob("*/*")) if f.is_file()}
        built = {k: report[k] for k in ("machine", "torch")} | {"pins": NUMERIC_PINS}
        (SHIPPED / "MANIFEST.json").write_text(json.dumps({"files": files, "built": built}, indent=1) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="replace the shipped models")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(json.dumps(ship(args.write), indent=1))


if __name__ == "__main__":
    main()
