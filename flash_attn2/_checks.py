"""Argument checks: each error names the argument and what was expected.

`check_tensors` (dtypes, shapes, strides, devices: everything that needs only tensor metadata) exists
twice. Here it runs in the op's fake implementation, so at trace time under torch.compile and
torch.export, and for tensors that are not on a GPU. `check_inputs` in csrc/flash_api.cpp runs the same
checks with the same messages and error types inside the op, for eager calls: in Python they would cost
a quarter of a small call's host time. tests/test_api_validation.py runs every case through both.
"""

from __future__ import annotations

import torch

MAX_HEAD_DIM = 256
# Longest sequence, max_seqlen and packed length the kernels take (flash_attn2.h: kMaxSeqlen).
MAX_SEQLEN = 2**31 - 2**16
DTYPES = (torch.float16, torch.bfloat16)


def require_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn2: {name} must be a torch.Tensor, got {type(t).__name__}")


def require_device(t, name, q):
    if t.device != q.device:
        raise ValueError(f"flash_attn2: {name} must be on q's device {q.device}, got {t.device}")


def require_last_dim_contiguous(t, name):
    if t.stride(-1) != 1:
        raise ValueError(f"flash_attn2: {name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(t.stride())}")


def check_cu_seqlens(cu, name, q, entries=None):
    """An int32 (batch + 1,) offsets tensor on q's device; `entries`: the length it must have (cu_seqlens_q's)."""
    if cu.dtype != torch.int32:
        raise TypeError(f"flash_attn2: {name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2 or (entries is not None and cu.shape[0] != entries):
        like = " (as cu_seqlens_q)" if entries is not None else ""
        raise ValueError(f"flash_attn2: {name} must be 1-D with batch + 1 >= 2 entries{like}, got shape "
                         f"{tuple(cu.shape)}")
    require_device(cu, name, q)
    if not cu.is_contiguous():
        raise ValueError(f"flash_attn2: {name} must be contiguous, got strides {tuple(cu.stride())}")


def check_types(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None):
    """What the op's schema cannot say in our words: the arguments are tensors."""
    named = (("q", q), ("k", k), ("v", v))
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        named += (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    if alibi_slopes is not None:
        named += (("alibi_slopes", alibi_slopes),)
    for name, t in named:
        require_tensor(t, name)


def check_max_seqlen(max_seqlen_q, max_seqlen_k):
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or not 0 <= m <= MAX_SEQLEN:
            raise ValueError(f"flash_attn2: {name} must be an int in 0..2**31-2**16, got {m!r}")


def check_alibi_slopes(alibi_slopes, q, cu_seqlens_q):
    """alibi_slopes: None, or fp32 (nheads,) or (batch, nheads) on q's device with a contiguous last dimension;
    csrc/flash_api.cpp's check_alibi_slopes is the same."""
    if alibi_slopes is None:
        return
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"flash_attn2: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    heads = q.shape[-2]
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"flash_attn2: alibi_slopes must be (nheads,) = ({heads},) or (batch, nheads) = ({batch}, "
                         f"{heads}), got shape {tuple(alibi_slopes.shape)}")
    require_last_dim_contiguous(alibi_slopes, "alibi_slopes")
    require_device(alibi_slopes, "alibi_slopes", q)


def check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """The tensors of one call, fixed-length (cu_seqlens None) or varlen; csrc/flash_api.cpp's check_inputs
    is the same, in the same order."""
    varlen = cu_seqlens_q is not None
    ndim = 3 if varlen else 4
    dtype = q.dtype
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPES:
            raise TypeError(f"flash_attn2: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.dtype != dtype:
            raise TypeError(f"flash_attn2: {name} must have q's dtype {dtype}, got {t.dtype}")
        if t.dim() != ndim:
            layout = "(batch, seqlen, nheads, headdim)" if ndim == 4 else "(total_tokens, nheads, headdim)"
            raise ValueError(f"flash_attn2: {name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
        require_last_dim_contiguous(t, name)
    head_dim = q.shape[-1]
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attn2: head dim (q.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"flash_attn2: k and v must have the same shape but for the head dim, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"flash_attn2: k's head dim must equal q's ({head_dim}), got {k.shape[-1]}")
    if not 0 < v.shape[-1] <= MAX_HEAD_DIM:  # v's may differ (MLA: d_qk 192, d_v 128)
        raise ValueError(f"flash_attn2: v's head dim (v.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {v.shape[-1]}")
    heads, heads_k = q.shape[-2], k.shape[-2]
    if heads_k == 0 or heads == 0 or heads % heads_k != 0:
        raise ValueError(f"flash_attn2: q's nheads ({heads}) must be a positive multiple of k/v's nheads ({heads_k})")
    if not varlen:
        if q.shape[0] == 0:
            raise ValueError("flash_attn2: batch size must be positive, got an empty batch (q.shape[0] == 0)")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"flash_attn2: k's batch size ({k.shape[0]}) must equal q's ({q.shape[0]})")
    for name, t in (("k", k), ("v", v)):
        require_device(t, name, q)
    if not varlen:
        if q.shape[1] > MAX_SEQLEN or k.shape[1] > MAX_SEQLEN:
            raise ValueError(f"flash_attn2: seqlen_q and seqlen_k must be at most 2**31-2**16, got {q.shape[1]} "
                             f"and {k.shape[1]}")
        return
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_cu_seqlens(cu, name, q)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"flash_attn2: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, rows in (("q.shape[0] (total_q)", q.shape[0]), ("k.shape[0] (total_k)", k.shape[0])):
        if rows > MAX_SEQLEN:
            raise ValueError(f"flash_attn2: {name} must be at most 2**31-2**16 packed rows, got {rows}")
