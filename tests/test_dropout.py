"""Attention dropout in the kernels (GPU) against a float32 reference built from the mask that
flash_attn2/_dropout.py regenerates: so far the Hopper forward, through the internal entry point (the public
API still raises NotImplementedError for dropout_p > 0 until the backward has it too)."""

import pytest
import torch

import flash_attn2
from flash_attn2 import _dropout
from flash_attn2.flash_attn_interface import _flash_attn_forward
from flash_attn2.testing import attention_ref, max_error, within_tolerance

from test_forward import DTYPES, LSE_ATOL, dense_inputs, poisoned, randn, require_kernel, varlen_inputs

pytestmark = pytest.mark.gpu


def require_hopper():
    if torch.cuda.get_device_capability() != (9, 0) or "sm_90a" not in flash_attn2._ops.ext.built_archs.split(";"):
        pytest.skip("dropout runs on the Hopper forward so far: needs an sm_90 GPU and a build with sm_90a")


def rng_state(seed, offset):
    return torch.tensor([seed, offset], dtype=torch.int64, device="cuda")


def forward(q, k, v, causal, p, state, cu_q=None, cu_k=None, max_q=0, max_k=0, **mods):
    """Our forward into NaN-poisoned out and LSE."""
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if cu_q is not None else (q.shape[0], heads, q.shape[1])
    out, lse = poisoned(q.shape, q.dtype), poisoned(lse_shape, torch.float32)
    return _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal, out, lse,
                               dropout_p=p, rng_state=state, **mods)


def check_dense(q, k, v, causal, p, seed, offset, **mods):
    out, lse = forward(q, k, v, causal, p, rng_state(seed, offset), **mods)
    b, sq, h, _ = q.shape
    keep = _dropout.keep_mask(seed, offset, p, b, h, sq, k.shape[1], device="cuda")
    ref = lambda up: attention_ref(q, k, v, causal, upcast=up, dropout_keep=keep,  # noqa: E731
                                   dropout_scale=_dropout.dropout_scale(p), **mods)
    (out_ref, lse_ref), (out_pt, _) = ref(True), ref(False)
    ok, err, err_pt = within_tolerance(out, out_ref, out_pt)
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
    assert max_error(lse, lse_ref) <= LSE_ATOL  # the undropped softmax's
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 17), (113, 203), (1023, 300), (300, 1023)])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_fwd_dropout(p, seqlen_q, seqlen_k, causal, head_dim, dtype):
    """GQA 8:2; d 256's 80-key tiles hold an odd count of 16-key blocks (one draw serves the last alone)."""
    require_hopper()
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, 4, head_dim, dtype)
    check_dense(q, k, v, causal, p, seed=0x1234_5678_9ABC, offset=4 * 1000)


def test_fwd_dropout_with_window_softcap_alibi():
    require_hopper()
    require_kernel(128, torch.bfloat16)
    q, k, v = dense_inputs(2, 500, 700, 4, 2, 128, torch.bfloat16)
    slopes = torch.rand(2, 4, device="cuda") * 0.3
    check_dense(q, k, v, True, 0.3, seed=99, offset=8, window=(250, 0), softcap=20.0, alibi_slopes=slopes)


def test_fwd_dropout_varlen():
    """Varlen draws by (sequence, head) and positions within the sequence: each sequence against a dense
    reference of its own."""
    require_hopper()
    require_kernel(128, torch.bfloat16)
    lens_q, lens_k = [0, 17, 300, 1, 129], [5, 0, 400, 33, 129]
    cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 4, 2, 128, torch.bfloat16)
    seed, offset, p = 5, 12, 0.25
    out, _ = forward(q, k, v, True, p, rng_state(seed, offset), cu_q, cu_k, max(lens_q), max(lens_k))
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        qb, kb, vb = q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0)
        keep = _dropout.keep_mask_one(seed, offset, p, b, 4, lq, lk, device="cuda").unsqueeze(0)
        ref = lambda up: attention_ref(qb, kb, vb, True, upcast=up, dropout_keep=keep,  # noqa: E731
                                       dropout_scale=_dropout.dropout_scale(p))[0]
        ok, err, err_pt = within_tolerance(out[rows].unsqueeze(0), ref(True), ref(False))
        assert ok, f"sequence {b}: out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"


def test_fwd_dropout_reproducible():
    """The same (seed, offset) gives bitwise the same output; another seed or offset another mask; a
    dropout_p that rounds to threshold 256 keeps everything (the plain forward's output)."""
    require_hopper()
    require_kernel(64, torch.bfloat16)
    q, k, v = dense_inputs(1, 256, 256, 4, 1, 64, torch.bfloat16)
    first, _ = forward(q, k, v, False, 0.5, rng_state(3, 0))
    again, _ = forward(q, k, v, False, 0.5, rng_state(3, 0))
    assert torch.equal(first, again)
    for state in (rng_state(4, 0), rng_state(3, 4)):
        other, _ = forward(q, k, v, False, 0.5, state)
        assert not torch.equal(first, other)
    kept_all, _ = forward(q, k, v, False, 1 / 1024, rng_state(3, 0))
    ok, err, err_pt = within_tolerance(kept_all, attention_ref(q, k, v)[0], attention_ref(q, k, v, upcast=False)[0])
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"


def test_public_api_still_refuses_dropout():
    require_kernel(64, torch.bfloat16)
    q = randn(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn2.flash_attn_func(q, q, q, dropout_p=0.1)
