"""The include graph keeps its layers (CPU, reads the sources): common/ headers depend on no arch folder, the
host heuristics reach no kernel translation unit (a heuristic change recompiles no kernel), and the torch
binding sees the public header alone."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
INCLUDE_DIRS = [os.path.join(CSRC, "include"), os.path.join(CSRC, "kernels"), CSRC]


def _includes(path):
    """The project headers `path` includes directly, as resolved paths (system and CuTe headers skipped)."""
    found = []
    with open(path) as f:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), flags=re.M):
            for base in [os.path.dirname(path)] + INCLUDE_DIRS:
                candidate = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(candidate):
                    found.append(candidate)
                    break
            else:
                raise AssertionError(f"{os.path.relpath(path, ROOT)}: #include \"{name}\" not found in the project")
    return found


def _closure(path):
    seen, stack = set(), [path]
    while stack:
        for inc in _includes(stack.pop()):
            if inc not in seen:
                seen.add(inc)
                stack.append(inc)
    return seen


def _rel(paths):
    return sorted(os.path.relpath(p, CSRC) for p in paths)


def _files(folder, ext):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(ext))


def test_common_headers_include_no_arch_folder():
    common = os.path.join(CSRC, "kernels", "common")
    for header in _files(common, ".h"):
        arch = [p for p in _closure(header) if os.sep + "sm80" + os.sep in p or os.sep + "sm90" + os.sep in p]
        assert not arch, f"{os.path.relpath(header, CSRC)} reaches {_rel(arch)}"


@pytest.mark.parametrize("unit", _files(os.path.join(CSRC, "instantiations"), ".cu") + [os.path.join(CSRC, "bwd_aux.cu"),
                                                                              os.path.join(CSRC, "fwd_aux.cu")],
                         ids=os.path.basename)
def test_kernel_units_do_not_see_the_host_heuristics(unit):
    assert os.path.join(CSRC, "heuristics.h") not in _closure(unit)


def test_heuristics_only_in_dispatch():
    users = [p for p in _files(CSRC, ".cpp") + _files(CSRC, ".cu") if os.path.join(CSRC, "heuristics.h") in _includes(p)]
    assert _rel(users) == ["dispatch.cpp"]


def test_torch_binding_sees_the_public_header_alone():
    assert _rel(_closure(os.path.join(CSRC, "flash_api.cpp"))) == ["include/flash_attn2/flash_attn2.h"]
