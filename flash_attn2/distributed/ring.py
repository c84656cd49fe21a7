"""Ring attention over torch.distributed: ring-flash-attn 0.1.8's functions on flash_attn2's kernels.

Each rank holds its shard of q, k, v (the layout's tokens: contiguous, zigzag or stripe; `zigzag_shard` /
`stripe_shard` make them) and gets its shard of the output. K and V travel around the ring (`KVRing`: the caller's
tensors on the first hop, no copy ahead of it), the next hop's exchange in flight while this step's blocks (the
shared schedule, `_schedule.ring_tasks`) run; the partial results merge in fp32 (`_merge.merge_partial`). The
backward re-sends K and V and carries each block's dK / dV sum with it, one more hop bringing every sum home; dq, dk,
dv accumulate in fp32 and come back in the inputs' dtype. On 2 ranks out, dq, dk and dv stay in the inputs' dtype
throughout, each sum computed in fp32 and rounded once: the same result (`_half_sums`).
GQA rotates the kv heads only.

The ring is the custom ops flash_attn2::ring_fwd / ring_bwd (fakes, autograd; the group by name), so
torch.compile(fullgraph=True) traces through it. Not supported on the ring: windows, dropout, ALiBi, softcap (each
raises NotImplementedError naming it; windows run on the all-gather form, llama3.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..flash_attn_interface import _softmax_scale
from ._merge import merge_partial
from ._schedule import CAUSAL, CAUSAL_STRICT, check_layout, ring_tasks, shard_ranges


# ---- Block backends: what a task runs. The kernels' (default), or a reference on the CPU (the gloo tests). ----

class KernelBackend:
    """flash_attn2's forward and backward ops on one block."""

    @staticmethod
    def forward(q, k, v, causal, scale, busy=True):
        from .. import _ops
        # While a hop is in flight (busy), non-causal blocks take their query tiles from a counter as the persistent
        # blocks free up: NCCL's kernel, spinning until the peer posts, holds SMs when a block starts, and with static
        # slots the blocks behind it finish late (4 H200s, 128k forward: 67.3 -> 57.1 ms; 512k: 966 -> 911; TUNING
        # 148). Without one (the last step) the static slots, which the counter costs 1-4 %.
        with _ops.tile_order("dynamic" if busy else ""):
            out, lse, _ = _ops.fwd(q, k, v, None, None, 0, 0, scale, causal, -1, -1, 0.0, None, False)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, deterministic, dlse=None):
        from .. import _ops
        return _ops.bwd(dout, q, k, v, out.to(q.dtype), lse.contiguous(), None, None, 0, 0, scale, causal, -1, -1, 0.0,
                        None, deterministic, dlse=None if dlse is None else dlse.contiguous())[:3]


class ReferenceBackend:
    """flash_attn2.testing's reference attention (any device and dtype; for tests)."""

    @staticmethod
    def forward(q, k, v, causal, scale, busy=True):
        from ..testing import attention_ref
        return attention_ref(q, k, v, causal, scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, deterministic, dlse=None):
        from ..testing import attention_bwd_ref
        return attention_bwd_ref(q, k, v, out.to(q.dtype), lse, dout, causal, scale, dlse)


def _block(task, q, k, v):
    """A task's (q, k, v) block and the first local query row it writes: CAUSAL_STRICT runs rows [1:) against keys
    [:-1) with causal=True (row 0 sees nothing)."""
    qb, kb, vb = q[:, task.q[0]:task.q[1]], k[:, task.k[0]:task.k[1]], v[:, task.k[0]:task.k[1]]
    if task.mask == CAUSAL_STRICT:
        return qb[:, 1:], kb[:, :-1], vb[:, :-1], True, task.q[0] + 1, (task.k[0], task.k[1] - 1)
    return qb, kb, vb, task.mask == CAUSAL, task.q[0], task.k


def _writes_every_row(task, rows):
    """Whether the task's block writes all `rows` query rows (_block's first row is 0, its last the shard's)."""
    return task.q == (0, rows) and task.mask != CAUSAL_STRICT


# ---- Communication ----

_BARRIER_DONE: set = set()  # groups whose first batched P2P has followed a barrier


class RingComm:
    """Sends a flat buffer to the next rank and receives the previous rank's into a buffer of the same size, as one
    batched P2P; the group's first exchange in the process follows a barrier (every rank must join the first batched
    P2P of a group; later ones need none, and a barrier per call would sync the device and stop graph capture)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else \
            (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else \
            (self.rank - 1) % self.world
        self._started = False

    def exchange(self, send, recv=None, tag: int = 0):
        """Starts sending `send` (a tensor, or a tuple of them) on and receiving the previous rank's into `recv` (new
        buffers if None); returns (receive buffer(s), requests). Exchanges in flight together use distinct tags (gloo
        matches by tag; every rank posts them in the same order): tensor i of a tuple goes with tag + 2 i."""
        if not self._started:
            name = self.group.group_name if self.group is not None else "default"
            if name not in _BARRIER_DONE:
                dist.barrier(group=self.group)
                _BARRIER_DONE.add(name)
            self._started = True
        single = isinstance(send, torch.Tensor)
        sends = (send,) if single else tuple(send)
        recvs = tuple(torch.empty_like(t) for t in sends) if recv is None else ((recv,) if single else tuple(recv))
        ops = []
        for i, (out, into) in enumerate(zip(sends, recvs)):
            ops += [dist.P2POp(dist.isend, out, self.next, self.group, tag + 2 * i),
                    dist.P2POp(dist.irecv, into, self.prev, self.group, tag + 2 * i)]
        return (recvs[0] if single else recvs), dist.batch_isend_irecv(ops)


class KVRing:
    """K and V going around the ring, one hop per step, the next hop in flight while the step's blocks run:
    `for step, (k, v) in KVRing(comm, k, v).steps():`.

    The first hop starts at construction and sends the caller's K and V themselves (contiguous ones as they are):
    built before the ring allocates its accumulators, nothing of the ring's is queued on the compute stream ahead of
    it (a packing copy was), so NCCL's transfer is ready to start before the step's first kernel, which on Hopper is
    persistent (a block per SM until it ends) and would leave the transfer no SM, while the next rank's transfer
    waits for it. Later hops receive into two buffers of the call's, alternating: hop h overwrites the block step
    h - 1 read, whose kernels were queued before it (the exchange orders after them)."""

    def __init__(self, comm: RingComm, k: torch.Tensor, v: torch.Tensor, tag: int = 0):
        self.comm, self.tag = comm, tag
        self.kv = (k.contiguous(), v.contiguous())
        self.buffers: list = []
        self.pending = None
        self.hops = 0
        if comm.world > 1:
            self._start_hop()

    def _start_hop(self) -> None:
        """The previous rank's current block, on its way here (world - 1 hops in all)."""
        slot = self.hops % 2
        if slot == len(self.buffers):
            self.buffers.append(tuple(torch.empty_like(t) for t in self.kv))
        self.pending = self.comm.exchange(self.kv, self.buffers[slot], self.tag)
        self.hops += 1

    def steps(self):
        """(step, (k, v) held at it) for every step; the next hop is in flight while the caller's loop body runs,
        and received after it."""
        for step in range(self.comm.world):
            if 0 < step < self.comm.world - 1:
                self._start_hop()
            yield step, self.kv
            if self.pending is not None:
                self.kv = _wait(self.pending)
                self.pending = None


def _wait(pending):
    buf, reqs = pending
    for req in reqs:
        req.wait()
    return buf


_AGREED: dict = {}  # (group, what, shapes) -> None, oldest first; bounded
_AGREED_MAX = 256


_REFUSED = "flash_attn2.distributed: refused"  # what a refusing rank brings to check_ranks_agree's gather


def check_ranks_agree(group, what: str, *tensors) -> None:
    """Every rank of the group calls with the same shapes and dtypes (a ring with mismatched shapes would hang or read
    garbage): checked on the first call with each (group, shapes, dtypes) by a small all_gather_object, a ValueError
    on every rank where they differ or where a rank refused the call (refuse_with_peers), before any of the ring's
    transfers. Limits: a set of shapes is checked once per rank, so if one rank repeats shapes it has checked while
    another brings new ones (or refuses), the first goes on and the collectives no longer match (a hang, as without
    the check); values (varlen document splits) are not compared."""
    key = (group.group_name if group is not None else "default", what,
           tuple((tuple(t.shape), str(t.dtype)) for t in tensors))
    if key in _AGREED:
        return
    if len(_AGREED) >= _AGREED_MAX:
        _AGREED.pop(next(iter(_AGREED)))
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, key[1:], group=group)
    refused = [(r, o[1]) for r, o in enumerate(seen) if o[0] == _REFUSED]
    if refused:
        raise ValueError(f"flash_attn2.distributed: {what}: rank {refused[0][0]} refused the call: {refused[0][1]}")
    if any(other != key[1:] for other in seen):
        raise ValueError(f"flash_attn2.distributed: {what}: the ranks' shapes and dtypes differ "
                         f"(rank: (shape, dtype) of each tensor): {dict(enumerate(s[1] for s in seen))}")
    _AGREED[key] = None


def _pack(*tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat, like):
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return out


# ---- Forward and backward ----

# Where every dq row and every dK / dV key gets at most two blocks' contributions (the ring on 2 ranks: the own-keys
# step and the other rank's, one block each), summing them in the inputs' half-precision dtype is the fp32 sum rounded
# once: the first contribution is exact in either, and a half-precision add computes in fp32 and rounds. So dq, dk and
# dv accumulate in the inputs' dtype there, the sums travel in it (half the bytes of the last, exposed hop) and no
# final cast is left; elsewhere in fp32. (A module flag for the tests that compare both.)
_HALF_SUMS = True


def _half_sums(q, world: int) -> bool:
    return _HALF_SUMS and world == 2 and q.dtype in (torch.float16, torch.bfloat16)


def ring_forward(q, k, v, layout, causal, scale, group, backend):
    """This rank's (out, lse fp32) over every rank's keys: out fp32, or on 2 ranks in the inputs' dtype."""
    check_ranks_agree(group, f"ring ({layout})", q, k, v)
    comm = RingComm(group)
    seqlen = q.shape[1] * comm.world
    kv = KVRing(comm, k, v)  # the first hop, before anything else is queued on the compute stream
    # On 2 ranks out stays in the inputs' dtype: each row merges two blocks, the merge computed in fp32 and rounded
    # once (_merge.merge_partial), as the fp32 out cast at the end (_half_sums).
    acc = q.dtype if _half_sums(q, comm.world) else torch.promote_types(q.dtype, torch.float32)
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    out = lse = None  # from the first block: a copy where it covers every row (every layout's own-keys step)
    for step, (k_cur, v_cur) in kv.steps():
        for task in ring_tasks(layout, seqlen, comm.world, comm.rank, step, causal):
            qb, kb, vb, block_causal, row0, _ = _block(task, q, k_cur, v_cur)
            bout, blse = backend.forward(qb, kb, vb, block_causal, scale, busy=step < comm.world - 1)
            if out is None and _writes_every_row(task, q.shape[1]):  # every row's first block: taken, not merged
                out = bout.to(acc)  # the block's own output (fresh): as it is where the dtype is already acc's
                lse = blse.to(lse_dtype).contiguous()
                continue
            if out is None:
                out = torch.zeros(q.shape, dtype=acc, device=q.device)
                lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=lse_dtype, device=q.device)
            rows = slice(row0, task.q[1])
            merge_partial(out[:, rows], lse[:, :, rows], bout, blse)
    return out, lse


def ring_backward(dout, q, k, v, out, lse, layout, causal, scale, group, backend, deterministic, dlse=None):
    """(dq, dk, dv) of this rank's shard: dk / dv summed over every rank's queries; dlse: the merged lse's gradient
    where the loss uses it (each block's D less its rows' dlse: exact, every block reads the merged lse). The keys and
    values go around again (the next hop in flight during this step's blocks); the held block's dK / dV sum travels
    one hop behind them (received from the previous rank during this step, added to, sent on), and the world-th hop
    brings every sum home, as two tensors (dk, dv: outputs of the op may not alias)."""
    comm = RingComm(group)
    seqlen = q.shape[1] * comm.world
    kv = KVRing(comm, k, v)  # the first hop, before anything else is queued on the compute stream
    acc = q.dtype if _half_sums(q, comm.world) else torch.promote_types(q.dtype, torch.float32)
    dq = None  # from the first block: a copy where it covers every row
    sums_in = None  # the held block's dK / dV sum so far, arriving from the previous rank
    for step, (k_cur, v_cur) in kv.steps():
        grads = []  # the step's blocks' dK / dV, added once the sums have arrived (the kernels run meanwhile)
        for task in ring_tasks(layout, seqlen, comm.world, comm.rank, step, causal):
            qb, kb, vb, block_causal, row0, keys = _block(task, q, k_cur, v_cur)
            rows = slice(row0, task.q[1])
            bdq, bdk, bdv = backend.backward(dout[:, rows], qb, kb, vb, out[:, rows], lse[:, :, rows], block_causal,
                                             scale, deterministic, None if dlse is None else dlse[:, :, rows])
            if dq is None and _writes_every_row(task, q.shape[1]):
                dq = bdq.to(acc)  # the block's own output (fresh): on 2 ranks taken as it is, added to in place
            else:
                if dq is None:
                    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
                dq[:, rows] += bdq
            grads.append((keys, bdk, bdv))
        # The held block's dK / dV in one flat buffer, sent on as it is: at step 0 a new one (the first block's
        # dK / dV copied in where it covers every key, else zeros), later the one that arrived from the previous rank
        # (a fresh receive buffer each hop), added to in place (ring-flash-attn adds into the received buffer too).
        if sums_in is not None:
            sums = _wait(sums_in)
            dk, dv = _unpack(sums, (k, v))
        else:
            every_key = grads and grads[0][0] == (0, k.shape[1])
            make = torch.empty if every_key else torch.zeros
            sums = make(k.numel() + v.numel(), dtype=acc, device=k.device)
            dk, dv = _unpack(sums, (k, v))
            if every_key:
                (_, bdk, bdv), grads = grads[0], grads[1:]
                dk.copy_(bdk)
                dv.copy_(bdv)
        for keys, bdk, bdv in grads:
            dk[:, keys[0]:keys[1]] += bdk
            dv[:, keys[0]:keys[1]] += bdv
        if comm.world == 1:  # nothing to send: the sums are this rank's own block's already
            return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)  # dk, dv: views of one buffer
        if step < comm.world - 1:
            sums_in = comm.exchange(sums, tag=1)  # on to the next rank, which holds this block next
        else:  # the world-th hop, every sum home: two buffers
            sums_in = comm.exchange((dk, dv), tag=1)
    dq = dq.to(q.dtype)  # queued before the last wait: it runs while the sums come home
    dk, dv = _wait(sums_in)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---- The ring as torch custom ops (fakes, autograd), so that torch.compile traces a model through it without a
# graph break; the process group travels by name (as torch's own collectives' ops take it). ----

_BACKENDS = {"kernel": KernelBackend, "reference": ReferenceBackend}


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


@torch.library.custom_op("flash_attn2::ring_fwd", mutates_args=())
def _ring_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, causal: bool, scale: float,
              group_name: str, backend: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = ring_forward(q, k, v, layout, causal, scale, _group(group_name), _BACKENDS[backend])
    return out.to(q.dtype), lse


@_ring_fwd.register_fake
def _(q, k, v, layout, causal, scale, group_name, backend, deterministic):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.empty_like(q, memory_format=torch.contiguous_format),  # the real outputs are contiguous
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc))


@torch.library.custom_op("flash_attn2::ring_bwd", mutates_args=())
def _ring_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, layout: str, causal: bool, scale: float, group_name: str, backend: str,
              deterministic: bool, dlse: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ring_backward(dout, q, k, v, out, lse, layout, causal, scale, _group(group_name), _BACKENDS[backend],
                         deterministic, dlse)


@_ring_bwd.register_fake
def _(dout, q, k, v, out, lse, layout, causal, scale, group_name, backend, deterministic, dlse=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _ring_setup(ctx, inputs, output):
    q, k, v, layout, causal, scale, group_name, backend, deterministic = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (layout, causal, scale, group_name, backend)
    ctx.deterministic = deterministic or torch.are_deterministic_algorithms_enabled()


def _ring_grad(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    layout, causal, scale, group_name, backend = ctx.args
    dq, dk, dv = _ring_bwd(dout.contiguous(), q, k, v, out, lse, layout, causal, scale, group_name, backend,
                           ctx.deterministic, None if dlse is None else dlse.contiguous())
    return dq, dk, dv, None, None, None, None, None, None


_ring_fwd.register_autograd(_ring_grad, setup_context=_ring_setup)


def refuse_with_peers(group, error: Exception):
    """Raise `error`, a refusal from this rank's own checks (an argument the path does not take, a length its layout
    cannot split), after taking part in the one collective its peers may be in: check_ranks_agree's first gather of
    these shapes, which this rank joins with the error, so that a peer whose own checks passed raises a ValueError
    naming this rank instead of waiting for its transfers. Not while compiling (the checks run at trace time) or
    without a process group (no collective to join). Where the peers have run these shapes before they skip that
    gather: check_ranks_agree's limit."""
    if dist.is_available() and dist.is_initialized() and not torch.compiler.is_compiling():
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, (_REFUSED, f"{type(error).__name__}: {error}"), group=group)
    raise error


def require_process_group() -> None:
    """A ValueError unless torch.distributed is initialized (every form's check; without a group there is no peer to
    tell, so refuse_with_peers just raises it)."""
    if not dist.is_initialized():
        raise ValueError("flash_attn2.distributed: torch.distributed is not initialized (init_process_group first)")


def refuse_unsupported(where: str, q, v, dropout_p) -> None:
    """What no form of flash_attn2.distributed takes yet (`where`: the form), as NotImplementedError naming it."""
    if dropout_p:
        raise NotImplementedError(f"flash_attn2.distributed: dropout_p > 0 on {where} is not supported")
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"flash_attn2.distributed: v's head dim ({v.shape[-1]}) other than q's "
                                  f"({q.shape[-1]}) (MLA) on {where} is not supported yet")


def _ring_func(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_attn_probs, group, backend=None, softcap=0.0):
    try:
        refuse_unsupported("the ring", q, v, dropout_p)
        if tuple(window_size) != (-1, -1):
            raise NotImplementedError("flash_attn2.distributed: window_size on the ring is not supported yet")
        if alibi_slopes is not None:
            raise NotImplementedError("flash_attn2.distributed: alibi_slopes on the ring is not supported")
        if softcap:
            raise NotImplementedError("flash_attn2.distributed: softcap on the ring is not supported yet")
        require_process_group()
        world = dist.get_world_size(group)
        check_layout(layout, q.shape[1] * world, world)  # the layout's divisibility, before any transfer
        scale = _softmax_scale(softmax_scale, q.shape[-1])  # flash_attn_func's check (positive, finite)
    except (ValueError, NotImplementedError) as error:
        refuse_with_peers(group, error)
    group_name = (group if group is not None else dist.group.WORLD).group_name
    name = {KernelBackend: "kernel", ReferenceBackend: "reference", None: "kernel"}[backend]
    out, lse = _ring_fwd(q, k, v, layout, bool(causal), scale, group_name, name, bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's ring_flash_attn_func: each rank's q, k, v (batch, seqlen / world, heads, d) are consecutive
    tokens (rank r holds [r L, (r + 1) L)); returns this rank's out (and with return_attn_probs, (out, lse, None))."""
    return _ring_func("contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's zigzag_ring_flash_attn_func: rank r holds chunks r and 2 world - 1 - r of 2 world
    (zigzag_shard), which balances causal work."""
    return _ring_func("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      return_attn_probs, group)


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's stripe_flash_attn_func: rank r holds tokens r, r + world, ... (stripe_shard)."""
    return _ring_func("stripe", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      return_attn_probs, group)


def _shard_index(layout, seqlen, world, rank, device):
    """shard_indices' positions as an index tensor, from its ranges (a Python list of a 1M-token sequence's positions
    takes tens of milliseconds)."""
    return torch.cat([torch.arange(r.start, r.stop, r.step, device=device)
                      for r in shard_ranges(layout, seqlen, world, rank)])


def _layout_shard(layout, x, rank, world, dim):
    return x.index_select(dim, _shard_index(layout, x.shape[dim], world, rank, x.device))


def zigzag_shard(x, rank, world, dim=1):
    """This rank's zigzag shard of a full sequence (PyTorch's head-tail load balancer's order)."""
    return _layout_shard("zigzag", x, rank, world, dim)


def stripe_shard(x, rank, world, dim=1):
    return _layout_shard("stripe", x, rank, world, dim)


def unshard(parts, layout, dim=1):
    """The full sequence from every rank's shard (in rank order)."""
    world = len(parts)
    seqlen = parts[0].shape[dim] * world
    shape = list(parts[0].shape)
    shape[dim] = seqlen
    full = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, _shard_index(layout, seqlen, world, rank, part.device), part)
    return full
