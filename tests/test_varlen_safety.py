"""Untrusted cu_seqlens and max_seqlen values (GPU): the kernels clamp every sequence to the packed tensors
and compute every row whatever the max_seqlen hint, as flash_attn2.h documents. Each case runs forward and
backward with every output poisoned and compares with a float32 reference of those semantics. The GPU
run also executes this file under compute-sanitizer memcheck (.ci/gpu_run)."""

import math

import pytest
import torch

from flash_attn2 import _ops
from flash_attn2.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from flash_attn2.testing import GRAD_ATOL, attention_ref, max_error, reference_grads, within_tolerance

from test_forward import poisoned, randn, require_kernel

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def clamped_ranges(cu_seqlens, total):
    """flash_attn2.h's reading of cu_seqlens: each pair clamped to [0, total]; a decreasing pair is empty."""
    ranges = []
    for b in range(len(cu_seqlens) - 1):
        begin = min(max(cu_seqlens[b], 0), total)
        ranges.append((begin, min(max(cu_seqlens[b + 1], begin), total)))
    return ranges


def reference(q, k, v, ranges_q, ranges_k, causal, upcast=True):
    """out (total_q, h, d) and lse (h, total_q): each sequence's attention; rows outside every sequence 0, -inf."""
    dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, device=q.device)
    for (q0, q1), (k0, k1) in zip(ranges_q, ranges_k):
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, upcast=upcast)
        out[q0:q1] = o[0].to(dtype)
        lse[:, q0:q1] = l[0]
    return out, lse


# (name, cu_seqlens_q, total_q, cu_seqlens_k, total_k, max_seqlen_q, max_seqlen_k)
CASES = [
    ("past-the-end", [0, 30, 90], 60, [0, 20, 200], 100, 60, 80),
    ("decreasing-pair", [0, 40, 70, 50], 70, [0, 30, 80, 60], 80, 40, 50),
    ("negative-entry", [-7, 10, 30], 30, [-1, 25, 40], 40, 20, 25),
    ("rows-outside-sequences", [5, 20, 50], 64, [3, 40, 41], 50, 30, 37),
    ("max-seqlen-too-small", [0, 300, 317, 446], 446, [0, 129, 129, 400], 400, 1, 0),
    ("all-keys-empty", [0, 10, 25, 40], 40, [0, 0, 0, 0], 33, 15, 0),
]


def nan_outside(t, ranges):
    """t with NaN in every row outside the sequences (what an uninitialized packed buffer may hold there)."""
    inside = torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
    for begin, end in ranges:
        inside[begin:end] = True
    return t.masked_fill(~inside[:, None, None], math.nan)


@pytest.mark.parametrize("head_dim", [64, 128])  # on Hopper: dQ as rows (128-row steps) and as fragments
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("outside", ["random", "nan"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_untrusted_cu_seqlens(case, outside, group, causal, head_dim):
    """Rows outside every sequence never reach a sequence's results, even when they hold NaN (the last key
    block of a sequence reaches past its end: those keys are masked, and 0 x NaN must not happen)."""
    require_kernel(head_dim, BF16)
    _, cu_q, total_q, cu_k, total_k, max_q, max_k = case
    heads, d = 4, head_dim
    q = randn(total_q, heads, d, dtype=BF16)
    k, v = (randn(total_k, heads // group, d, dtype=BF16) for _ in range(2))
    cu_q_t, cu_k_t = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    ranges_q, ranges_k = clamped_ranges(cu_q, total_q), clamped_ranges(cu_k, total_k)
    if outside == "nan":
        q = nan_outside(q, ranges_q)
        k, v = nan_outside(k, ranges_k), nan_outside(v, ranges_k)
    scale = d ** -0.5

    out, lse = _flash_attn_forward(q, k, v, cu_q_t, cu_k_t, max_q, max_k, scale, causal,
                                   poisoned(q.shape, BF16), poisoned((heads, total_q), torch.float32))
    out_ref, lse_ref = reference(q, k, v, ranges_q, ranges_k, causal)
    out_pt, _ = reference(q, k, v, ranges_q, ranges_k, causal, upcast=False)
    ok, err, err_pt = within_tolerance(out, out_ref, out_pt)
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
    assert max_error(lse, lse_ref) <= 1e-3

    dout = randn(*q.shape, dtype=BF16)
    if outside == "nan":
        dout = nan_outside(dout, ranges_q)
    grads = _flash_attn_backward(dout, q, k, v, out, lse, cu_q_t, cu_k_t, max_q, max_k, scale, causal, False,
                                 *(poisoned(t.shape, BF16) for t in (q, k, v)))
    ref, ref_pt = reference_grads(lambda q, k, v, up: reference(q, k, v, ranges_q, ranges_k, causal, up)[0],
                                  (q, k, v), dout)
    for name, g, r, r_pt in zip(("dq", "dk", "dv"), grads, ref[1:], ref_pt[1:]):
        ok, err, err_pt = within_tolerance(g, r, r_pt, atol=GRAD_ATOL)
        assert ok, f"{name} error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"


def test_c_api_rejects_bad_softmax_scale():
    """The kernels' own entry point (not just the Python checks) refuses a scale that is not positive and finite."""
    require_kernel(64, BF16)
    q = randn(1, 16, 2, 64, dtype=BF16)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 16, device="cuda")
    for scale in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(RuntimeError, match="softmax_scale must be positive and finite"):
            _ops.ext.fwd_out(q, q, q, out, lse, None, None, 16, 16, scale, False, -1, -1, 0.0, None, 0.0, None, False, None)
