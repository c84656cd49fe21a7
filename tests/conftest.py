import pytest
import torch

GPU_REASON = "needs a CUDA GPU: the kernel tests run on the GPU machine (README), not on CPU-only CI"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, reproducible from the test id.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
