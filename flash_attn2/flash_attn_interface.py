"""flash-attn 2.x's Python API on flash_attn2's kernels.

Same names, argument names, order, defaults and returns as flash_attn.flash_attn_interface; tensors
are (batch, seqlen, nheads, headdim), or packed (total_tokens, nheads, headdim) for the varlen calls.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ._extension import load

_ext = load()

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------------
# Argument checks: each error names the argument and what was expected.


def _check_unsupported(dropout_p, softcap, alibi_slopes, block_table=None):
    if dropout_p != 0.0:
        raise NotImplementedError(f"flash_attn2: dropout_p={dropout_p} is not supported yet; only dropout_p=0.0")
    if softcap != 0.0:
        raise NotImplementedError(f"flash_attn2: softcap={softcap} is not supported yet; only softcap=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("flash_attn2: alibi_slopes is not supported yet; pass alibi_slopes=None")
    if block_table is not None:
        raise NotImplementedError("flash_attn2: block_table (paged KV cache) is not supported yet; pass block_table=None")


def _causal_from_window(causal: bool, window_size, max_seqlen_k: int) -> bool:
    """flash-attn's window semantics; only the windows that mean 'none' or 'causal' are supported yet."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"flash_attn2: window_size must be a pair of ints, got {window_size!r}") from None
    left = -1 if left < 0 or left >= max_seqlen_k else left
    right = -1 if right < 0 or right >= max_seqlen_k else right
    if causal:
        right = 0
    if left == -1 and right in (-1, 0):
        return right == 0
    raise NotImplementedError(f"flash_attn2: window_size={tuple(window_size)} (sliding-window attention) is not "
                              "supported yet; only (-1, -1), or (-1, 0) which is causal")


def _check_qkv(q, k, v, ndim: int):
    layout = "(batch, seqlen, nheads, headdim)" if ndim == 4 else "(total_tokens, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn2: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"flash_attn2: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"flash_attn2: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"flash_attn2: {name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"flash_attn2: {name} must have a contiguous last dimension (stride 1), "
                             f"got strides {tuple(t.stride())}")
    head_dim = q.shape[-1]
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attn2: head dim (q.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if k.shape != v.shape:
        raise ValueError(f"flash_attn2: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"flash_attn2: k's head dim must equal q's ({head_dim}), got {k.shape[-1]}")
    heads, heads_k = q.shape[-2], k.shape[-2]
    if heads_k == 0 or heads == 0 or heads % heads_k != 0:
        raise ValueError(f"flash_attn2: q's nheads ({heads}) must be a positive multiple of k/v's nheads ({heads_k})")
    if ndim == 4:
        if q.shape[0] == 0:
            raise ValueError("flash_attn2: batch size must be positive, got an empty batch (q.shape[0] == 0)")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"flash_attn2: k's batch size ({k.shape[0]}) must equal q's ({q.shape[0]})")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"flash_attn2: {name} must be on q's device {q.device}, got {t.device}")


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q):
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"flash_attn2: {name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"flash_attn2: {name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"flash_attn2: {name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"flash_attn2: {name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"flash_attn2: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= _INT32_MAX:
            raise ValueError(f"flash_attn2: {name} must be an int in 0..2**31-1, got {m!r}")


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** (-0.5)
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"flash_attn2: softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return scale


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """The kernels read 16-byte vectors: pad the head dim to a multiple of 8 (as flash-attn does) and copy
    tensors whose strides or base address are not 16-byte aligned (e.g. an expanded dout)."""
    if x.shape[-1] % 8:
        x = F.pad(x, (0, 8 - x.shape[-1] % 8))
    aligned = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
        s % 8 == 0 for s, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)
    return x if aligned else x.contiguous() if not x.is_contiguous() else x.clone()


# ----------------------------------------------------------------------------------------------------
# One forward and one backward entry point, and one autograd Function for every variant.


def _flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        out=None, softmax_lse=None):
    """Checked inputs -> (out, softmax_lse). out / softmax_lse may be preallocated (tests poison them)."""
    head_dim = q.shape[-1]
    q, k, v = (_kernel_ready(t) for t in (q, k, v))
    varlen = cu_seqlens_q is not None
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif q.shape[-1] != head_dim:
        raise ValueError("flash_attn2: a preallocated out needs a head dim that is a multiple of 8")
    if softmax_lse is None:
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        softmax_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if q.numel() and k.numel():
        _ext.fwd(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                 causal)
    elif q.numel():  # no keys at all: every row sees nothing
        out.zero_()
        softmax_lse.fill_(-math.inf)
    return out[..., :head_dim], softmax_lse


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, deterministic, dq=None, dk=None, dv=None):
    """Kernel-ready q, k, v, out (head dim a multiple of 8) and the forward's softmax_lse -> (dq, dk, dv).
    dq / dk / dv may be preallocated (tests poison them)."""
    dout = _kernel_ready(dout)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    if q.numel() and k.numel():
        _ext.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, deterministic)
    else:  # no queries or no keys: nothing flows
        for grad in (dq, dk, dv):
            grad.zero_()
    return dq, dk, dv


def _no_double_backward(backward):
    """Like torch's @once_differentiable, but the gradients always carry a node that raises a clear error
    when differentiated (create_graph=True), instead of silently acting as constants when dout itself
    does not require grad."""
    message = (b"flash_attn2: double backward (differentiating through flash_attn2's gradients, e.g. with "
               b"create_graph=True) is not supported")

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled():
            return grads
        error = torch._C._functions.DelayedError(message, len(grads))
        return error(*[g.detach().requires_grad_() if g is not None else None for g in grads])
    return wrapper


class FlashAttnFunc(torch.autograd.Function):
    """Every public variant: fixed-length (cu_seqlens None) or varlen, MHA / MQA / GQA."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                deterministic):
        head_dim = q.shape[-1]
        q, k, v = (_kernel_ready(t) for t in (q, k, v))
        out, softmax_lse = _flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        ctx.deterministic = deterministic
        ctx.head_dim = head_dim
        ctx.mark_non_differentiable(softmax_lse)
        return out[..., :head_dim], softmax_lse

    @staticmethod
    @_no_double_backward
    def backward(ctx, dout, dsoftmax_lse):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv = _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, *ctx.args,
                                          deterministic)
        d = ctx.head_dim
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None, None, None, None, None


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    _check_unsupported(dropout_p, softcap, alibi_slopes, block_table)
    varlen = cu_seqlens_q is not None
    _check_qkv(q, k, v, ndim=3 if varlen else 4)
    if varlen:
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
    else:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    causal = _causal_from_window(bool(causal), window_size, max_seqlen_k)
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    if not q.is_cuda:  # last, so every other check also runs on CPU tensors
        raise ValueError(f"flash_attn2: q, k, v must be CUDA tensors, got device {q.device}")
    out, softmax_lse = FlashAttnFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                           causal, bool(deterministic))
    # S_dmask carries the dropout pattern in flash-attn; without dropout it is None there too.
    return (out, softmax_lse, None) if return_attn_probs else out


# ----------------------------------------------------------------------------------------------------
# Public API (flash-attn 2.x signatures).


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.

    causal aligns the mask to the bottom-right corner: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    A query row that sees no key gets output 0 and softmax_lse -inf. Returns out (batch, seqlen_q, nheads,
    headdim); with return_attn_probs, (out, softmax_lse (batch, nheads, seqlen_q) fp32, None).
    """
    return _attention(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim); sequence b owns rows
    cu_seqlens[b]:cu_seqlens[b + 1] (int32, on q's device). max_seqlen_q/k must be >= every sequence's length.

    Zero-length sequences are allowed. With return_attn_probs, softmax_lse is (nheads, total_q) fp32.
    """
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim)."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, nheads, headdim)."""
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def compiled_head_dims(dtype: torch.dtype) -> list[int]:
    """Head-dim buckets with a compiled forward kernel for dtype."""
    return [d for d in range(32, MAX_HEAD_DIM + 1, 32) if _ext.fwd_head_dim_bucket(d, dtype == torch.bfloat16) == d]
