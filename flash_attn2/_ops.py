"""The torch ops behind every public function, and their fake implementations.

csrc/flash_api.cpp defines `flash_attn2::fwd` and `flash_attn2::bwd` with their CUDA kernels and registers
the autograd formula on `fwd` in C++ (`bwd` raises when differentiated); `learnable_sink` (attention sinks) is
one more differentiable input of `fwd`, and `bwd` returns its gradient as a fourth output. The fakes below check the
tensors as the CUDA kernel does and give torch.compile, torch.export and FakeTensor the exact shapes,
dtypes and strides of the real outputs, in the inputs' head dim: out and softmax_lse contiguous; each
gradient in its input's strides where that input is dense with its head dim innermost and a multiple of 8
(as a model's transposed q/k views are) and its rows' stride a nonzero multiple of 8, else contiguous.
"""

from __future__ import annotations

import contextlib

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from ._checks import check_alibi_slopes, check_tensors
from ._extension import load

ext = load()  # loading the library registers the ops

fwd = torch.ops.flash_attn2.fwd
bwd = torch.ops.flash_attn2.bwd
fwd_kvcache = torch.ops.flash_attn2.fwd_kvcache  # its fake: flash_attn2/_kvcache.py


@contextlib.contextmanager
def tile_order(order: str):
    """The Hopper forward's tile order for this thread's calls inside the block, where FLASH_ATTN2_TILE_ORDER is
    unset: 'dynamic' hands non-causal query tiles to persistent blocks as they free up (the ring's blocks, beside
    NCCL's kernels), 'static' deals every grid's tiles in a fixed order, '' is the default (csrc/flash_api.cpp)."""
    previous = ext.set_tile_order(order)
    try:
        yield
    finally:
        ext.set_tile_order(previous)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    """softmax_lse's shape: (nheads, total_q) for varlen, else (batch, nheads, seqlen_q)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """csrc/flash_api.cpp's grad_like."""
    strides_ok = t.dim() >= 3 and t.stride(-3) != 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    if t.shape[-1] % 8 == 0 and t.stride(-1) == 1 and strides_ok and is_non_overlapping_and_dense_or_false(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return _empty_like(t)


@torch.library.register_fake("flash_attn2::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, deterministic, dropout_p=0.0, learnable_sink=None):
    check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)  # at trace time, as the CUDA kernel does in eager mode
    check_alibi_slopes(alibi_slopes, q, cu_seqlens_q)
    if learnable_sink is not None:
        from ._sinks import check_sink
        check_sink(learnable_sink, q.shape[-2], q)
    # rng_state: (seed, offset) with dropout, else empty.
    rng_state = q.new_empty((2 if dropout_p > 0 else 0,), dtype=torch.int64)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # in v's head dim (MLA's d_v may differ from d_qk), contiguous
    return out, q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32), rng_state


@torch.library.register_fake("flash_attn2::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, alibi_slopes, deterministic, dropout_p=0.0, rng_state=None,
              learnable_sink=None, dlse=None):
    # dsink: (nheads,) in learnable_sink's dtype, or empty fp32 without sinks.
    dsink = (learnable_sink.new_empty(learnable_sink.shape) if learnable_sink is not None
             else q.new_empty((0,), dtype=torch.float32))
    return _grad_like(q), _grad_like(k), _grad_like(v), dsink
