"""The all-gather form of context parallelism (Llama 3's; ring-flash-attn's llama3_flash_attn_varlen_func): each rank
holds a contiguous slice of the packed tokens of any number of documents, gathers every rank's K and V (heads_k_stride
kv heads at a time, the next group's gather in flight), and runs one varlen call of its queries against the keys they
see: per local document piece, the document's keys from its start to the piece's end (causal: bottom-right aligned,
which also places sliding windows right). The backward gathers again and reduce-scatters dK / dV back to their
owners in fp32. Arbitrary document boundaries, empty documents, GQA and causal windows; the prepare step reads cu_seqlens
once per batch on the host (as ring-flash-attn's does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..flash_attn_interface import _softmax_scale
from .ring import refuse_unsupported, refuse_with_peers, require_process_group


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """ring-flash-attn's: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice) of this rank's
    slice [rank T / N, (rank + 1) T / N) of the packed tokens (T = cu_seqlens[-1], divisible by N): its document
    pieces, each piece's keys within the gathered tokens' local_k_slice (causal: up to the slice's end)."""
    values = [int(x) for x in cu_seqlens.tolist()]
    total = values[-1]
    if total % world_size:
        raise ValueError(f"flash_attn2.distributed: the packed length ({total}) must be divisible by the world size "
                         f"({world_size})")
    per_rank = total // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    # Documents overlapping [lo, hi): boundaries inside it, with the slice's ends.
    starts = [b for b in values if lo < b < hi]
    first_doc_start = max(b for b in values if b <= lo)
    bounds_q = [lo] + starts + [hi]
    k_right = hi if causal else min(b for b in values if b >= hi)
    cu_q = [b - lo for b in bounds_q]
    cu_k = [first_doc_start - first_doc_start] + [b - first_doc_start for b in starts] + [k_right - first_doc_start]
    cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device=cu_seqlens.device)
    cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=cu_seqlens.device)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    return cu_seqlens_q, cu_seqlens_k, max_q, max_k, slice(first_doc_start, k_right)


class KernelVarlenBackend:
    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
        from .. import _ops
        out, lse, _ = _ops.fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window[0], window[1], 0.0, None,
                               False)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, deterministic, dlse=None):
        from .. import _ops
        return _ops.bwd(dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, scale, causal, window[0],
                        window[1], 0.0, None, deterministic, dlse=None if dlse is None else dlse.contiguous())[:3]


class ReferenceVarlenBackend:
    """flash_attn2.testing's references, one document at a time (tests)."""

    @staticmethod
    def _segments(cu_q, cu_k):
        return list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
        from ..testing import attention_ref
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64 if q.dtype == torch.float64
                         else torch.float32)
        for q0, q1, k0, k1 in ReferenceVarlenBackend._segments(cu_q, cu_k):
            if q1 > q0:
                o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, scale, window=window)
                out[q0:q1], lse[:, q0:q1] = o[0], l[0]
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, deterministic, dlse=None):
        from ..testing import attention_bwd_ref
        if window != (-1, -1):
            raise NotImplementedError("the reference block backward has no window")
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1 in ReferenceVarlenBackend._segments(cu_q, cu_k):
            if q1 > q0:
                g = attention_bwd_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                                      lse[None, :, q0:q1], dout[None, q0:q1], causal, scale,
                                      None if dlse is None else dlse[None, :, q0:q1])
                dq[q0:q1] += g[0][0]
                dk[k0:k1] += g[1][0]
                dv[k0:k1] += g[2][0]
        return dq, dk, dv


def _gather(x, group, world):
    full = x.new_empty((x.shape[0] * world, *x.shape[1:]))
    dist.all_gather_into_tensor(full, x.contiguous(), group=group)
    return full


def _reduce_scatter(full, group, world):
    """Sum over ranks of each rank's rows (NCCL: reduce_scatter; other backends: all_reduce, then this rank's rows)."""
    rows = full.shape[0] // world
    if dist.get_backend(group) == "nccl":
        part = full.new_empty((rows, *full.shape[1:]))
        dist.reduce_scatter_tensor(part, full.contiguous(), group=group)
        return part
    dist.all_reduce(full, group=group)
    rank = dist.get_rank(group)
    return full[rank * rows:(rank + 1) * rows]


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride, local_k_slice, scale, causal, window,
                deterministic, group, backend):
        from .ring import check_ranks_agree
        check_ranks_agree(group, "all-gather (llama3)", k, v)  # the gathers need equal slices
        world = dist.get_world_size(group)
        heads, heads_k = q.shape[1], k.shape[1]
        group_q = heads // heads_k
        outs, lses = [], []
        for h in range(0, heads_k, heads_k_stride):  # one kv head group gathered at a time
            kf = _gather(k[:, h:h + heads_k_stride], group, world)[local_k_slice]
            vf = _gather(v[:, h:h + heads_k_stride], group, world)[local_k_slice]
            o, l = backend.forward(q[:, h * group_q:(h + heads_k_stride) * group_q], kf, vf, cu_q, cu_k, max_q, max_k,
                                   causal, scale, window)
            outs.append(o)
            lses.append(l)
        out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=0)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, heads_k_stride, local_k_slice, scale, causal, window, deterministic, group, backend)
        ctx.set_materialize_grads(False)  # lse's gradient None where the loss does not use it (no zeros to subtract)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        if dout is None:  # a loss through lse alone
            dout = torch.zeros_like(out)
        max_q, max_k, heads_k_stride, local_k_slice, scale, causal, window, deterministic, group, backend = ctx.args
        world = dist.get_world_size(group)
        heads, heads_k = q.shape[1], k.shape[1]
        group_q = heads // heads_k
        dq = torch.empty_like(q)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        for h in range(0, heads_k, heads_k_stride):
            hs, qs = slice(h, h + heads_k_stride), slice(h * group_q, (h + heads_k_stride) * group_q)
            kf = _gather(k[:, hs], group, world)
            vf = _gather(v[:, hs], group, world)
            g = backend.backward(dout[:, qs], q[:, qs], kf[local_k_slice], vf[local_k_slice], out[:, qs],
                                 lse[qs], cu_q, cu_k, max_q, max_k, causal, scale, window, deterministic,
                                 None if dlse is None else dlse[qs])  # lse's gradient: each piece's D less its dlse
            dq[:, qs] = g[0]
            dkf = torch.zeros(kf.shape, dtype=acc, device=k.device)
            dvf = torch.zeros(vf.shape, dtype=acc, device=v.device)
            dkf[local_k_slice] = g[1].to(acc)
            dvf[local_k_slice] = g[2].to(acc)
            dk[:, hs] = _reduce_scatter(dkf, group, world).to(k.dtype)
            dv[:, hs] = _reduce_scatter(dvf, group, world).to(v.dtype)
        return dq, dk, dv, *([None] * 12)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                  _backend=None):
    """ring-flash-attn's llama3_flash_attn_varlen_func: q, k, v (local tokens, heads, d) of this rank's slice of the
    packed sequence, cu_seqlens_q / _k, max_seqlen_q / _k and local_k_slice from llama3_flash_attn_prepare_cu_seqlens;
    heads_k_stride kv heads gathered at a time (a divisor of k's heads). Returns the local out (and with
    return_attn_probs, (out, lse (heads, local tokens), None))."""
    window = (int(window_size[0]), int(window_size[1]))
    try:
        refuse_unsupported("the all-gather path", q, v, dropout_p)
        if alibi_slopes is not None:
            raise NotImplementedError("flash_attn2.distributed: alibi_slopes on the all-gather path is not supported")
        if not causal and window != (-1, -1):
            # Non-causal pieces take their document's keys to its end, so a piece that stops before it is not
            # bottom-right aligned with its keys: the kernels' window would sit in the wrong place (causal pieces
            # end where their keys end).
            raise NotImplementedError("flash_attn2.distributed: window_size without causal on the all-gather path is "
                                      "not supported")
        if heads_k_stride < 1 or k.shape[1] % heads_k_stride:
            raise ValueError(f"flash_attn2.distributed: heads_k_stride ({heads_k_stride}) must divide k's heads "
                             f"({k.shape[1]})")
        require_process_group()
        scale = _softmax_scale(softmax_scale, q.shape[-1])  # flash_attn_func's check (positive, finite)
    except (ValueError, NotImplementedError) as error:
        refuse_with_peers(group, error)
    out, lse = _Llama3Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                      local_k_slice, scale, bool(causal), window, bool(deterministic), group,
                                      _backend or KernelVarlenBackend)
    return (out, lse, None) if return_attn_probs else out
