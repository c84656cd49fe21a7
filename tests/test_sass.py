"""The Hopper forward kernels run on wgmma: the built library's disassembly shows HGMMA in every one of
them and no mma.sync (HMMA), so a silent fall-back to the SM80 instructions cannot pass; and the plain kernels
keep their spills within a budget. Needs a build for sm_90a and cuobjdump with nvdisasm beside it or on PATH
(CUDA_HOME/bin, or the nvidia-cuda-cuobjdump and -nvdisasm wheels); no GPU."""

import functools
import os
import re
import shutil
import subprocess

import pytest
import torch

from build_config import bwd_sm90_kernel_dim  # tools/build_config.py
from flash_attn2 import _ops


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    try:  # the nvidia-cuda-cuobjdump wheel (CI installs it with nvidia-cuda-nvdisasm)
        import nvidia
        candidates += [os.path.join(path, "cu13", "bin", "cuobjdump") for path in nvidia.__path__]
    except ImportError:
        pass
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


@functools.lru_cache(maxsize=1)  # the tests ask for each dump twice in a row (forward, backward)
def _dump(what):
    """cuobjdump's --dump-<what> of the built library (skips unless it holds sm_90a code and cuobjdump is found)."""
    if "sm_90a" not in _ops.ext.built_archs.split(";"):
        pytest.skip(f"built for {_ops.ext.built_archs}, not sm_90a")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (PATH, CUDA_HOME/bin or the nvidia-cuda-cuobjdump wheel)")
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(tool), os.environ.get("PATH", "")]))  # its nvdisasm
    return subprocess.run([tool, f"--dump-{what}", _ops.ext.__file__], capture_output=True, text=True, check=True,
                          env=env).stdout


def _hopper_kernels(kernel_name):
    """{name: SASS} of the built library's kernels called kernel_name."""
    sass = _dump("sass")
    kernels = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = chunk.partition("\n")
        if kernel_name + "<" in name or f"{len(kernel_name)}{kernel_name}I" in name:  # demangled or mangled
            kernels[name.strip()] = body
    return kernels


def _compiled_head_dims():
    """[(dtype, head dim)] of the compiled buckets."""
    return [(dtype, d) for dtype in (torch.float16, torch.bfloat16) for d in range(32, 257, 32)
            if _ops.ext.fwd_head_dim_bucket(d, dtype == torch.bfloat16) == d]


def _check_wgmma(kernels, dims, what, extra=0, per_dim=3):
    """per_dim kernels per (dtype, kernel head dim): the plain one, the extended one (softcap, ALiBi) and dropout's,
    and the forward's paged plain one (per_dim 4); extra: more kernels with other tiles."""
    expected = per_dim * len(dims) + extra
    assert len(kernels) == expected, f"{len(kernels)} Hopper {what} kernels for {len(dims)} (dtype, head dim)"
    for name, body in kernels.items():
        assert "HGMMA" in body, f"{name}: no HGMMA"
        assert not re.search(r"\bHMMA\b", body), f"{name}: HMMA (mma.sync) in a Hopper kernel"


# Head dims with a second plain forward tile (fwd_short_causal_max_seqlen_q_sm90 in csrc/kernels/sm90/tile_size.h):
# its plain and paged plain kernels.
SHORT_TILE_HEAD_DIMS = {256}


def test_hopper_forward_kernels_use_wgmma():
    """Every head dim's four kernels (plain, extended, dropout, paged plain), two more on a short causal tile, and
    four per (dtype, head-dim pair) the build has (ext.head_dim_pairs: MLA's (192, 128)), built for each compiled
    dtype whose pair's q / k head dim is compiled."""
    dims = _compiled_head_dims()
    flat = list(_ops.ext.head_dim_pairs)
    pair_kernels = sum(4 for d_qk in flat[::2] for dtype, d in dims if d == d_qk)
    _check_wgmma(_hopper_kernels("fwd_kernel_sm90"), dims, "forward", per_dim=4,
                 extra=2 * sum(d in SHORT_TILE_HEAD_DIMS for _, d in dims) + pair_kernels)


# Head dims with a second plain backward kernel, ALiBi's (BwdTraitsSm90::kPlainAlibi,
# csrc/kernels/sm90/bwd_launch.h).
PLAIN_ALIBI_HEAD_DIMS = {64, 128}


def test_hopper_backward_kernels_use_wgmma():
    """The backward kernels serving the compiled head dims (160 and 224 run on the 192 and 256 ones)."""
    dims = {(dtype, bwd_sm90_kernel_dim(d)) for dtype, d in _compiled_head_dims()}
    _check_wgmma(_hopper_kernels("bwd_kernel_sm90"), dims, "backward",
                 extra=sum(d in PLAIN_ALIBI_HEAD_DIMS for _, d in dims))


# The plain kernels' (no softcap, ALiBi or dropout) stack frames, where ptxas puts spilled registers: bytes by
# head dim (None: the others), the largest measured (local ptxas, bf16) with slack. Measured: the forward 0-24 B but
# d 224 40 (8 before the KV-cache route, TUNING 137) and d 256 40; the backward 24-40 B but d 64 128
# (168 in ALiBi's plain kernel). A change to a helper the forward shares (the SlotRing's receive, step 108) grew the
# d 256 forward's frame from 32 to 136 B and cost it 10-15% while every test passed (TUNING 110).
PLAIN_STACK_BUDGET = {"fwd_kernel_sm90": {None: 64}, "bwd_kernel_sm90": {None: 64, 64: 192}}


@pytest.mark.parametrize("kernel_name", sorted(PLAIN_STACK_BUDGET))
def test_hopper_plain_kernels_stack(kernel_name):
    usage = _dump("resource-usage")
    budget = PLAIN_STACK_BUDGET[kernel_name]
    over, plain = {}, 0
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:\d+ STACK:(\d+)", usage):
        name, stack = m.group(1), int(m.group(2))
        # Plain: no softcap / ALiBi, no dropout (the forward's paged plain kernel has a third flag, kPaged).
        plain_kind = re.search(r"EELb0ELb0E(?:Lb[01]E)?EEvNS_11\w+ArgsSm90", name)
        if f"{len(kernel_name)}{kernel_name}I" not in name or not plain_kind:
            continue
        plain += 1
        head_dim = int(re.search(r"Sm90(?:Wide)?ILi(\d+)E", name).group(1))
        if stack > budget.get(head_dim, budget[None]):
            over[name] = stack
    assert plain, f"no plain {kernel_name} in the resource usage"
    assert not over, f"stack frames (spills) over their budget {budget}: {over}"
