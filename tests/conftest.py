import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: benchmarks and long checks, run with -m slow")
    # Tiny models are all small ops: intra-op threads only spin and fight (10x slower on a
    # busy 2-core machine). Benchmarks that want threads set them themselves.
    import torch
    torch.set_num_threads(int(os.environ.get("RRG_TEST_THREADS", "1")))


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    # `--data synthetic` caches under $RRG_CACHE: keep tests out of the user's cache.
    os.environ["RRG_CACHE"] = str(tmp_path_factory.mktemp("rrg_cache"))


@pytest.fixture(scope="session")
def small_synthetic(tmp_path_factory):
    """A small synthetic set (R2Gen layout) shared by the tests."""
    import common
    out = tmp_path_factory.mktemp("synthetic")
    common.make_synthetic(out, n_train=40, n_val=8, n_test=12, size=64, seed=0)
    return out / "annotation.json"
