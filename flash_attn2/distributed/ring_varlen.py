"""Ring attention over packed documents (ring-flash-attn's ring_ / zigzag_ring_flash_attn_varlen_func): every document
is split over the ranks like one sequence of the dense layouts, so each rank holds its share of every document and
cu_seqlens are the local ones (the global cu_seqlens divided by the world size; each document's length divisible by
world, or 2 world for zigzag). At each step the dense schedule's tasks (in chunk units: `_schedule.ring_tasks` over a
sequence of one token per chunk) select the same chunks of every document, which one varlen kernel call runs. The
exchange and the backward are ring.py's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..flash_attn_interface import _softmax_scale
from ._merge import merge_partial
from ._schedule import CAUSAL, ring_tasks
from .llama3 import KernelVarlenBackend
from .ring import (KVRing, RingComm, _pack, _unpack, _wait, check_ranks_agree, refuse_unsupported, refuse_with_peers,
                   require_process_group)

_CHUNKS = {"contiguous": 1, "zigzag": 2}


def _select(local_cu: list[int], chunks: int, lo: int, hi: int, device):
    """Rows of chunks [lo, hi) of every document (chunk = its local length / chunks): (row index, cu_seqlens, max)."""
    rows, cu = [], [0]
    for start, end in zip(local_cu, local_cu[1:]):
        size = (end - start) // chunks
        rows.append(torch.arange(start + lo * size, start + hi * size, device=device))
        cu.append(cu[-1] + (hi - lo) * size)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
    return index, torch.tensor(cu, dtype=torch.int32, device=device), max(lengths, default=0)


def _tasks(layout, world, rank, step, causal):
    chunks = _CHUNKS[layout]
    return ring_tasks(layout, chunks * world, world, rank, step, causal)


def ring_varlen_forward(q, k, v, local_cu, layout, causal, scale, group, backend):
    check_ranks_agree(group, f"varlen ring ({layout})", q, k, v, torch.tensor(local_cu))
    comm = RingComm(group)
    chunks = _CHUNKS[layout]
    kv = KVRing(comm, k, v)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    for step, (k_cur, v_cur) in kv.steps():
        for task in _tasks(layout, comm.world, comm.rank, step, causal):
            qi, cu_q, max_q = _select(local_cu, chunks, *task.q, q.device)
            ki, cu_k, max_k = _select(local_cu, chunks, *task.k, q.device)
            if qi.numel() == 0 or ki.numel() == 0:
                continue
            bout, blse = backend.forward(q[qi], k_cur[ki], v_cur[ki], cu_q, cu_k, max_q, max_k, task.mask == CAUSAL,
                                         scale, (-1, -1))
            o, l = out[qi].unsqueeze(0), lse[:, qi].unsqueeze(0)
            merge_partial(o, l, bout.unsqueeze(0), blse.unsqueeze(0))
            out[qi], lse[:, qi] = o[0], l[0]
    return out, lse


def ring_varlen_backward(dout, q, k, v, out, lse, local_cu, layout, causal, scale, group, backend, deterministic,
                         dlse=None):
    """ring.ring_backward's schedule over documents: the next hop's keys in flight, the dK / dV sums one hop behind;
    dlse (the merged lse's gradient) as ring.ring_backward takes it."""
    comm = RingComm(group)
    chunks = _CHUNKS[layout]
    kv = KVRing(comm, k, v)
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    sums_in = None
    for step, (k_cur, v_cur) in kv.steps():
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for task in _tasks(layout, comm.world, comm.rank, step, causal):
            qi, cu_q, max_q = _select(local_cu, chunks, *task.q, q.device)
            ki, cu_k, max_k = _select(local_cu, chunks, *task.k, q.device)
            if qi.numel() == 0 or ki.numel() == 0:
                continue
            g = backend.backward(dout[qi], q[qi], k_cur[ki], v_cur[ki], out[qi].to(q.dtype), lse[:, qi], cu_q, cu_k,
                                 max_q, max_k, task.mask == CAUSAL, scale, (-1, -1), deterministic,
                                 None if dlse is None else dlse[:, qi])
            dq[qi] += g[0].to(acc)
            dk[ki] += g[1].to(acc)
            dv[ki] += g[2].to(acc)
        if sums_in is not None:
            prev_dk, prev_dv = _unpack(_wait(sums_in), (dk, dv))
            dk += prev_dk
            dv += prev_dv
        if comm.world == 1:
            return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)
        sums_in = comm.exchange(_pack(dk, dv), tag=1)
    dk, dv = (t.clone() for t in _unpack(_wait(sums_in), (k, v)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, local_cu, layout, causal, scale, group, backend, deterministic):
        out, lse = ring_varlen_forward(q, k, v, local_cu, layout, causal, scale, group, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (local_cu, layout, causal, scale, group, backend, deterministic)
        ctx.set_materialize_grads(False)  # lse's gradient None where the loss does not use it
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # a loss through lse alone
            dout = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dq, dk, dv = ring_varlen_backward(dout, q, k, v, out, lse, *ctx.args, dlse)
        return dq, dk, dv, *([None] * 7)


def _varlen_func(layout, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                 alibi_slopes, deterministic, return_attn_probs, group, backend=None):
    local_cu = [int(x) for x in cu_seqlens.tolist()]  # once per call, as ring-flash-attn's half indices
    try:
        if len(local_cu) < 2:
            raise ValueError(f"flash_attn2.distributed: cu_seqlens must hold at least two entries (batch + 1), got "
                             f"{local_cu}")
        refuse_unsupported("the ring", q, v, dropout_p)
        if tuple(window_size) != (-1, -1):
            raise NotImplementedError("flash_attn2.distributed: window_size on the ring is not supported yet (the "
                                      "all-gather form, llama3_flash_attn_varlen_func, takes causal windows)")
        if alibi_slopes is not None:
            raise NotImplementedError("flash_attn2.distributed: alibi_slopes on the ring is not supported")
        chunks = _CHUNKS[layout]
        bad = [b - a for a, b in zip(local_cu, local_cu[1:]) if (b - a) % chunks]
        if bad or local_cu[-1] != q.shape[0]:
            raise ValueError(f"flash_attn2.distributed: cu_seqlens must be this rank's (the global ones / world) and "
                             f"end at q's rows ({q.shape[0]}), each document's local length divisible by {chunks}; "
                             f"got {local_cu}")
        require_process_group()
        scale = _softmax_scale(softmax_scale, q.shape[-1])  # flash_attn_func's check (positive, finite)
    except (ValueError, NotImplementedError) as error:
        refuse_with_peers(group, error)
    out, lse = _RingVarlen.apply(q, k, v, local_cu, layout, bool(causal), scale, group, backend or KernelVarlenBackend,
                                 bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None):
    """ring-flash-attn's ring_flash_attn_varlen_func: q, k, v (local tokens, heads, d) hold rank r's r-th part of
    every document (each split in world equal parts); cu_seqlens (and max_seqlen) are the local ones."""
    return _varlen_func("contiguous", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None):
    """ring-flash-attn's zigzag_ring_flash_attn_varlen_func: every document split in 2 world chunks, rank r holding
    chunks r and 2 world - 1 - r of each (varlen_shard); cu_seqlens are the local ones."""
    return _varlen_func("zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, deterministic, return_attn_probs, group)


def varlen_shard(x, cu_seqlens, layout, rank, world, dim=0):
    """This rank's share of every document of packed x (global cu_seqlens), in the layout's order."""
    from ._schedule import shard_indices
    cu = [int(c) for c in cu_seqlens.tolist()]
    idx = []
    for start, end in zip(cu, cu[1:]):
        idx += [start + i for i in shard_indices(layout, end - start, world, rank)] if end > start else []
    return x.index_select(dim, torch.tensor(idx, dtype=torch.long, device=x.device))
