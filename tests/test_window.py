"""Sliding-window attention (flash-attn's window_size) against a float32 reference (GPU): forward and
backward, both paths, every compiled head dim and dtype."""

import math

import pytest
import torch

import flash_attn2
from flash_attn2.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from flash_attn2.testing import attention_ref, attention_ref_varlen, max_error, reference_grads, within_tolerance

from test_backward import check_grads, ran_kernel
from test_forward import (DTYPES, HEAD_DIMS, LSE_ATOL, dense_inputs, poisoned, randn, require_kernel, require_sm80,
                          varlen_inputs)

pytestmark = pytest.mark.gpu

# (causal, (left, right)) as the kernels take them: one key per row; narrow, crossing a block edge; left or
# right only; causal with a left edge; wider than the shorter sequence on the right.
WINDOWS = [(False, (0, 0)), (False, (37, 3)), (False, (200, -1)), (False, (-1, 70)), (True, (130, 0)),
           (False, (5, 300))]
WINDOW_IDS = ["0-0", "37-3", "200-inf", "inf-70", "causal-130", "5-300"]
SEQLENS = [(113, 203), (1023, 1023), (1023, 300), (300, 1023)]


def check_out(out, lse, ref_fn):
    out_ref, lse_ref = ref_fn(True)
    out_pt, _ = ref_fn(False)
    ok, err, err_pt = within_tolerance(out, out_ref, out_pt)
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
    lse_err = max_error(lse, lse_ref)
    assert lse_err <= LSE_ATOL, f"lse error {lse_err:.3e}"


def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap=0.0, alibi_slopes=None):
    """Our forward into NaN-poisoned out and LSE."""
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if cu_q is not None else (q.shape[0], heads, q.shape[1])
    out, lse = poisoned(q.shape, q.dtype), poisoned(lse_shape, torch.float32)
    return _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal, out, lse,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes)


def backward(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, window, deterministic=False, before_backward=None,
             softcap=0.0, alibi_slopes=None):
    out, lse = forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, alibi_slopes)
    if before_backward is not None:
        before_backward()
    dq, dk, dv = (poisoned(t.shape, t.dtype) for t in (q, k, v))
    return _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal,
                                deterministic, dq, dk, dv, window=window, softcap=softcap, alibi_slopes=alibi_slopes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS[:3])
@pytest.mark.parametrize("causal,window", WINDOWS, ids=WINDOW_IDS)
def test_window_fwd(causal, window, seqlen_q, seqlen_k, group, head_dim, dtype):
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, group, head_dim, dtype)
    out, lse = forward(q, k, v, None, None, seqlen_q, seqlen_k, causal, window)
    check_out(out, lse, lambda up: attention_ref(q, k, v, causal, upcast=up, window=window))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [SEQLENS[0], SEQLENS[3]])
@pytest.mark.parametrize("causal,window", WINDOWS, ids=WINDOW_IDS)
def test_window_bwd(causal, window, seqlen_q, seqlen_k, head_dim, dtype):
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, 4, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype)
    grads = backward(q, k, v, dout, None, None, seqlen_q, seqlen_k, causal, window)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, window=window)[0],
                                  (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal,window", WINDOWS, ids=WINDOW_IDS)
def test_window_varlen(causal, window, head_dim, dtype):
    """Each sequence's own lengths align its window; zero-length sequences on either side."""
    require_kernel(head_dim, dtype)
    lens_q, lens_k = [0, 17, 1, 300, 0, 129], [5, 0, 33, 300, 2, 129]
    cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 8, 2, head_dim, dtype)
    out, lse = forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, window)
    check_out(out, lse, lambda up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up, window=window))
    dout = randn(*q.shape, dtype=dtype)
    grads = backward(q, k, v, dout, cu_q, cu_k, max(lens_q), max(lens_k), causal, window)
    ref, ref_pt = reference_grads(
        lambda q, k, v, up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up, window=window)[0], (q, k, v),
        dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal,window", WINDOWS, ids=WINDOW_IDS)
def test_window_sm80(causal, window, head_dim, monkeypatch):
    """The SM80 kernels forced, forward and backward (on sm_90 the Hopper ones serve these head dims)."""
    dtype = torch.bfloat16
    require_kernel(head_dim, dtype)
    require_sm80()
    q, k, v = dense_inputs(2, 300, 1023, 8, 4, head_dim, dtype)
    monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
    out, lse = forward(q, k, v, None, None, 300, 1023, causal, window)
    check_out(out, lse, lambda up: attention_ref(q, k, v, causal, upcast=up, window=window))
    dout = randn(*q.shape, dtype=dtype)
    grads = backward(q, k, v, dout, None, None, 300, 1023, causal, window)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, window=window)[0],
                                  (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


def check_public_deterministic(q, k, v, causal, window=(-1, -1), softcap=0.0):
    """flash_attn_func (window_size=window, softcap) through autograd with deterministic=True, three times:
    bitwise-equal gradients, and gradients and output against the float32 reference."""
    dout = randn(*q.shape, dtype=q.dtype)
    grads = []
    for _ in range(3):
        out = flash_attn2.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                          deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))
    ref_fn = lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, window=window, softcap=softcap)  # noqa: E731
    ref, ref_pt = reference_grads(lambda q, k, v, up: ref_fn(q, k, v, up)[0], (q, k, v), dout)
    check_grads(grads[0], ref[1:], ref_pt[1:])
    assert within_tolerance(out, ref_fn(q, k, v, True)[0], ref_fn(q, k, v, False)[0])[0]


@pytest.mark.parametrize("causal,window", [(False, (64, 64)), (True, (300, 0))], ids=["64-64", "causal-300"])
def test_window_public_api_and_deterministic(causal, window):
    """flash_attn_func's window_size through autograd, a head dim between buckets; deterministic=True gives
    bitwise-equal gradients with the window."""
    dtype = torch.bfloat16
    require_kernel(96, dtype)
    q = randn(2, 700, 4, 80, dtype=dtype).requires_grad_()
    k, v = (randn(2, 900, 2, 80, dtype=dtype).requires_grad_() for _ in range(2))
    check_public_deterministic(q, k, v, causal, window=window)


@pytest.mark.parametrize("backend", ["default", "sm80"])
def test_window_bwd_head_splits(backend, monkeypatch):
    """GQA 8:1, head dim 128, 8k rows, window 512: the blocks that run together would span 8k query rows of 8
    heads (67 MB of Q, dO and dQ-accumulator rows), more than half the L2 of an H100, so the query heads split
    (csrc/heuristics.h: bwd_head_splits) and dK / dV go through fp32 accumulators; the profiler shows their
    conversion running."""
    dtype, seqlen, window = torch.bfloat16, 8192, (511, 0)
    require_kernel(128, dtype)
    if backend == "sm80":
        require_sm80()
    if torch.cuda.get_device_properties(0).L2_cache_size > 64 << 20:
        pytest.skip("an L2 this large holds the window's rows without splits")
    q, k, v = dense_inputs(1, seqlen, seqlen, 8, 8, 128, dtype)
    dout = randn(*q.shape, dtype=dtype)
    set_backend = (lambda: monkeypatch.setenv("FLASH_ATTN2_BACKEND", backend)) if backend != "default" else None
    grads, split = ran_kernel(
        lambda: backward(q, k, v, dout, None, None, seqlen, seqlen, False, window, before_backward=set_backend),
        "convert_dkv")
    assert split, "the backward did not split the query heads"
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, False, upcast=up, window=window)[0],
                                  (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


def test_window_normalization():
    """A left side at least seqlen_k or a right side at least seqlen_q wide is no window; causal sets right to 0;
    (-1, 0) is causal."""
    require_kernel(64, torch.bfloat16)
    q, k, v = (randn(1, 200, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    full = flash_attn2.flash_attn_func(q, k, v)
    causal = flash_attn2.flash_attn_func(q, k, v, causal=True)
    same = lambda a, b: torch.testing.assert_close(a, b, atol=0, rtol=0)  # noqa: E731
    same(flash_attn2.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    same(flash_attn2.flash_attn_func(q, k, v, window_size=(200, 500)), full)
    same(flash_attn2.flash_attn_func(q, k, v, window_size=(-5, -7)), full)
    same(flash_attn2.flash_attn_func(q, k, v, causal=True, window_size=(300, 40)), causal)


def test_window_right_edge_with_more_queries_than_keys():
    """seqlen_q > seqlen_k + 1: a right edge of seqlen_k or more still hides every key from the first rows
    (query i sees j <= i + seqlen_k - seqlen_q + right); those rows get output 0 and LSE -inf, through the
    public API (whose window rules once dropped such an edge, as flash-attn's right >= seqlen_k does)."""
    require_kernel(64, torch.bfloat16)
    q, k, v = dense_inputs(2, 300, 40, 4, 1, 64, torch.bfloat16)
    for right in (40, 100, 298):
        out, lse, _ = flash_attn2.flash_attn_func(q, k, v, window_size=(-1, right), return_attn_probs=True)
        check_out(out, lse, lambda up: attention_ref(q, k, v, False, upcast=up, window=(-1, right)))
        hidden = 300 - 40 - right  # rows that see no key
        assert hidden <= 0 or (out[:, :hidden].abs().max() == 0 and (lse[:, :, :hidden] == -math.inf).all())
