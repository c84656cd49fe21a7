"""Logit soft-capping (flash-attn's softcap) against a float32 reference (GPU): forward and backward, both
paths, every compiled head dim and dtype, with causal, windows, GQA and varlen."""

import pytest
import torch

from flash_attn2.testing import attention_ref, attention_ref_varlen, reference_grads

from test_forward import DTYPES, HEAD_DIMS, dense_inputs, randn, require_kernel, varlen_inputs
from test_backward import check_grads
from test_window import backward, check_out, check_public_deterministic, forward

pytestmark = pytest.mark.gpu

SEQLENS = [(113, 203), (1023, 1023), (300, 1023)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS[:2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap_fwd(softcap, causal, seqlen_q, seqlen_k, head_dim, dtype):
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype)
    q = q * 4  # scores of a few units, where the cap bends them
    out, lse = forward(q, k, v, None, None, seqlen_q, seqlen_k, causal, (-1, -1), softcap)
    check_out(out, lse, lambda up: attention_ref(q, k, v, causal, upcast=up, softcap=softcap))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [SEQLENS[0], SEQLENS[2]])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_bwd(causal, seqlen_q, seqlen_k, head_dim, dtype):
    require_kernel(head_dim, dtype)
    softcap = 5.0
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, 4, head_dim, dtype)
    q = q * 4
    dout = randn(*q.shape, dtype=dtype)
    grads = backward(q, k, v, dout, None, None, seqlen_q, seqlen_k, causal, (-1, -1), softcap=softcap)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, softcap=softcap)[0],
                                  (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_softcap_window_varlen(head_dim, dtype):
    """Softcap with a sliding window (Gemma 2's local layers) over varlen sequences, some empty."""
    require_kernel(head_dim, dtype)
    softcap, causal, window = 20.0, True, (37, 0)
    lens_q, lens_k = [0, 17, 1, 300, 0, 129], [5, 0, 33, 300, 2, 129]
    cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 8, 2, head_dim, dtype)
    q = q * 4
    ref_fn = lambda q, k, v, up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up, window=window,  # noqa: E731
                                                      softcap=softcap)
    out, lse = forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, window, softcap)
    check_out(out, lse, lambda up: ref_fn(q, k, v, up))
    dout = randn(*q.shape, dtype=dtype)
    grads = backward(q, k, v, dout, cu_q, cu_k, max(lens_q), max(lens_k), causal, window, softcap=softcap)
    ref, ref_pt = reference_grads(lambda q, k, v, up: ref_fn(q, k, v, up)[0], (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_sm80(causal, head_dim, monkeypatch):
    """The SM80 kernels forced: the backward always, the forward where this build has it."""
    dtype, softcap = torch.bfloat16, 5.0
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, 300, 1023, 8, 4, head_dim, dtype)
    q = q * 4
    monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
    try:
        out, lse = forward(q, k, v, None, None, 300, 1023, causal, (-1, -1), softcap)
        check_out(out, lse, lambda up: attention_ref(q, k, v, causal, upcast=up, softcap=softcap))
    except NotImplementedError as e:
        assert "FLASH_ATTN2_SM80_FWD=1" in str(e)
    monkeypatch.delenv("FLASH_ATTN2_BACKEND")
    dout = randn(*q.shape, dtype=dtype)
    grads = backward(q, k, v, dout, None, None, 300, 1023, causal, (-1, -1), softcap=softcap,
                     before_backward=lambda: monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80"))
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, softcap=softcap)[0],
                                  (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


def test_softcap_public_api_deterministic():
    """flash_attn_func's softcap through autograd, deterministic: bitwise-equal gradients run to run."""
    dtype, softcap = torch.bfloat16, 10.0
    require_kernel(96, dtype)
    q = (randn(2, 500, 4, 80, dtype=dtype) * 4).requires_grad_()
    k, v = (randn(2, 600, 2, 80, dtype=dtype).requires_grad_() for _ in range(2))
    check_public_deterministic(q, k, v, True, softcap=softcap)
