"""Import-time errors: missing extension, wrong GPU arch (CPU)."""

import importlib
import sys

import pytest

from flash_attn2 import _extension


@pytest.mark.parametrize("built,cap,ok", [
    (["sm_80"], (8, 0), True),
    (["sm_80"], (8, 6), True),
    (["sm_80"], (9, 0), False),
    (["sm_80", "compute_80"], (9, 0), True),
    (["sm_90"], (9, 0), True),
    (["sm_90"], (10, 0), False),
    (["sm_90a"], (9, 0), True),
    (["sm_90a"], (9, 1), False),
    (["sm_80", "sm_90", "compute_90"], (12, 0), True),
    (["compute_90"], (8, 9), False),
])
def test_gpu_supported(built, cap, ok):
    assert _extension.gpu_supported(built, cap) is ok


def test_arch_error_names_gpu_archs_and_knob():
    msg = _extension.arch_error(["sm_80", "sm_90"], (10, 0), "NVIDIA B200")
    assert "sm_80, sm_90" in msg and "NVIDIA B200 (sm_100)" in msg and "FLASH_ATTN2_CUDA_ARCHS=100" in msg
    assert "sm_80 (Ampere) or newer" in _extension.arch_error(["sm_80"], (7, 5), "Tesla T4")
    assert _extension.arch_error(["sm_90"], (9, 0), "H100") is None


def test_missing_extension_raises_helpful_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn2_cuda", None)  # makes `import flash_attn2_cuda` fail
    with pytest.raises(ImportError, match="flash_attn2_cuda is not built.*pip install --no-build-isolation"):
        _extension.load()
    for name in [m for m in sys.modules if m.startswith("flash_attn2.") and m != "flash_attn2._extension"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "flash_attn2")
    with pytest.raises(ImportError, match="flash_attn2_cuda is not built"):
        importlib.import_module("flash_attn2")
