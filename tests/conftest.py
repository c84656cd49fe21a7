import fcntl
import os
import sys
import tempfile
import zlib

import pytest
import torch

# tools/build_config.py (the build's rules, not part of the installed package) as `build_config`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

GPU_REASON = "needs a CUDA GPU: the kernel tests run on the GPU machine (README), not on CPU-only CI"
BIGMEM = "bigmem: allocates tens of GB; one such test at a time across pytest-xdist workers, the allocator's cache emptied after"


def pytest_configure(config):
    # Also in pyproject.toml; registered here too for tests run from a copy of tests/ without it (the GPU scripts).
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the built kernels")
    config.addinivalue_line("markers", BIGMEM)


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


@pytest.fixture(autouse=True)
def _bigmem_one_at_a_time(request):
    # The whole suite runs under -n 12: two tests of tens of GB at once, or one beside a worker whose caching allocator
    # still holds a previous big test's blocks, ran out of the GPU's memory (5 of 6366 in session 19's run, each
    # passing alone). A big test holds a machine-wide file lock and returns its cached blocks when done.
    if "bigmem" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "flash_attn2_tests_bigmem.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
