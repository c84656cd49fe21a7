import os
import sys
import zlib

import pytest
import torch

# tools/build_config.py (the build's rules, not part of the installed package) as `build_config`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

GPU_REASON = "needs a CUDA GPU: the kernel tests run on the GPU machine (README), not on CPU-only CI"


def pytest_configure(config):
    # Also in pyproject.toml; registered here too for tests run from a copy of tests/ without it (the GPU scripts).
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the built kernels")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, the same in every run from the test id (str hash() differs per process: a
    # tolerance failure on one draw could not be rerun). FLASH_ATTN2_TEST_SEED=N draws a different set.
    salt = os.environ.get("FLASH_ATTN2_TEST_SEED", "0")
    torch.manual_seed(zlib.crc32(f"{salt}:{request.node.nodeid}".encode()))
