"""flash_attn2.distributed's schedule and merge, emulated in one process on the CPU (float64): every rank's ring steps
run its tasks with reference block attention, merge them, and the unsharded result must equal full attention; the
backward sums each block's gradients (from the whole row's out and lse) into the query's and the key source's
shards. The GPU drivers run the same tasks (issue #51)."""

import math

import pytest
import torch

from flash_attn2.distributed._schedule import Task
from flash_attn2.distributed import CAUSAL, CAUSAL_STRICT, FULL, coverage, merge_partial, ring_tasks, shard_indices
from flash_attn2.testing import attention_bwd_ref, attention_ref

LAYOUTS = ["contiguous", "zigzag", "stripe"]


def run_block(q, k, v, task, fn):
    """A task's block with `fn(q, k, v, causal)`, its rows [0, 1) empty for CAUSAL_STRICT (rows [1:) against keys [:-1),
    as the kernels run it). Returns what fn returns for the rows it ran, and the row offset."""
    qb, kb, vb = q[:, task.q[0]:task.q[1]], k[:, task.k[0]:task.k[1]], v[:, task.k[0]:task.k[1]]
    if task.mask == CAUSAL_STRICT:
        return fn(qb[:, 1:], kb[:, :-1], vb[:, :-1], True), 1
    return fn(qb, kb, vb, task.mask == CAUSAL), 0


def emulate(layout, world, causal, q, k, v, dout):
    """Ring forward and backward of every rank; returns unsharded (out, lse, dq, dk, dv)."""
    batch, seqlen, heads = q.shape[:3]
    idx = [torch.tensor(shard_indices(layout, seqlen, world, r)) for r in range(world)]
    qs, ks, vs, dos = ([t[:, i] for i in idx] for t in (q, k, v, dout))
    outs, lses = [], []
    for r in range(world):
        out = torch.zeros_like(qs[r])
        lse = torch.full((batch, heads, qs[r].shape[1]), -math.inf, dtype=q.dtype)
        for step in range(world):
            src = (r - step) % world
            for task in ring_tasks(layout, seqlen, world, r, step, causal):
                (bo, bl), off = run_block(qs[r], ks[src], vs[src], task,
                                          lambda a, b, c, cz: attention_ref(a, b, c, cz))
                rows = slice(task.q[0] + off, task.q[1])
                o, l = out[:, rows].clone(), lse[:, :, rows].clone()
                merge_partial(o, l, bo, bl)
                out[:, rows], lse[:, :, rows] = o, l
        outs.append(out)
        lses.append(lse)
    dqs = [torch.zeros_like(t) for t in qs]
    dks, dvs = [torch.zeros_like(t) for t in ks], [torch.zeros_like(t) for t in vs]
    for r in range(world):
        for step in range(world):
            src = (r - step) % world
            for task in ring_tasks(layout, seqlen, world, r, step, causal):
                rows = slice(task.q[0], task.q[1])
                o, l, d = outs[r][:, rows], lses[r][:, :, rows], dos[r][:, rows]

                def bwd(a, b, c, cz, o=o, l=l, d=d):
                    cut = slice(1, None) if task.mask == CAUSAL_STRICT else slice(None)
                    return attention_bwd_ref(a, b, c, o[:, cut], l[:, :, cut], d[:, cut], cz)
                (dq, dk, dv), off = run_block(qs[r], ks[src], vs[src], task, bwd)
                dqs[r][:, task.q[0] + off:task.q[1]] += dq
                keys = slice(task.k[0], task.k[1] - (1 if task.mask == CAUSAL_STRICT else 0))
                dks[src][:, keys] += dk
                dvs[src][:, keys] += dv

    def unshard(parts, dim=1):
        full = torch.empty(parts[0].shape[0], seqlen, *parts[0].shape[2:], dtype=parts[0].dtype) if dim == 1 else \
            torch.empty(*parts[0].shape[:2], seqlen, dtype=parts[0].dtype)
        for i, part in zip(idx, parts):
            if dim == 1:
                full[:, i] = part
            else:
                full[:, :, i] = part
        return full
    return unshard(outs), unshard(lses, 2), unshard(dqs), unshard(dks), unshard(dvs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,heads_k", [(4, 4), (4, 2), (4, 1)])
def test_ring_matches_full_attention(layout, world, causal, heads, heads_k):
    torch.manual_seed(world * 7 + heads_k)
    seqlen = 4 * world * 3  # divisible by 2 x world (zigzag), chunks of 6 tokens
    q = torch.randn(2, seqlen, heads, 16, dtype=torch.float64)
    k, v = (torch.randn(2, seqlen, heads_k, 16, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = emulate(layout, world, causal, q, k, v, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    assert torch.allclose(out, ref, atol=1e-10) and torch.allclose(lse, ref_lse, atol=1e-10)
    for name, g, r in zip("qkv", (dq, dk, dv), ref_grads):
        assert torch.allclose(g, r, atol=1e-9), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_every_visible_pair_once(layout, world, causal):
    seqlen = 2 * world * 3
    counts = coverage(layout, seqlen, world, causal)
    visible = {(i, j) for i in range(seqlen) for j in range(seqlen) if not causal or j <= i}
    assert set(counts) == visible and set(counts.values()) == {1}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_the_causal_work(world):
    """After step 0 every rank computes the same number of (query, key) pairs at every step (zigzag's point)."""
    seqlen = 2 * world * 4

    def work(rank, step):
        pairs = 0
        for t in ring_tasks("zigzag", seqlen, world, rank, step, True):
            n_q, n_k = t.q[1] - t.q[0], t.k[1] - t.k[0]
            pairs += n_q * n_k if t.mask == FULL else n_q * (n_q + 1) // 2
        return pairs
    for step in range(1, world):
        assert len({work(rank, step) for rank in range(world)}) == 1, step
    assert len({work(rank, 0) for rank in range(world)}) == 1


def test_zigzag_is_pytorchs_head_tail_order():
    lb_module = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for seqlen, world in ((16, 2), (48, 4), (24, 3)):
        order = lb_module._HeadTailLoadBalancer(seqlen, world, torch.device("cpu"))._generate_indices()
        ours = [p for r in range(world) for p in shard_indices("zigzag", seqlen, world, r)]
        assert order.flatten().tolist() == ours


def test_merge_edge_cases():
    """Rows with no key on either side stay out 0 / lse -inf; a first empty side takes the other; LSE gaps of +-80."""
    out = torch.zeros(1, 3, 1, 2)
    lse = torch.tensor([[[-math.inf, -math.inf, 0.0]]])
    bout = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]]])
    blse = torch.tensor([[[-math.inf, 1.0, 80.0]]])
    merge_partial(out, lse, bout, blse)
    assert torch.equal(out[0, 0, 0], torch.zeros(2)) and lse[0, 0, 0] == -math.inf
    assert torch.equal(out[0, 1, 0], torch.tensor([3.0, 4.0])) and lse[0, 0, 1] == 1.0
    assert torch.allclose(out[0, 2, 0], torch.tensor([5.0, 6.0])) and torch.isfinite(out).all()
    assert torch.allclose(lse[0, 0, 2], torch.tensor(80.0))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_own_keys_are_one_causal_call(layout, world):
    """A rank's diagonal step is a single causal kernel call over its whole shard (no split blocks, no merge)."""
    seqlen = 8 * world
    for rank in range(world):
        assert ring_tasks(layout, seqlen, world, rank, 0, True) == [Task((0, 8), (0, 8), CAUSAL)]


def test_merge_in_place_on_views_and_low_precision_blocks():
    """merge_partial writes through strided views (the ring merges into row slices of its fp32 out) and takes the
    block in the kernels' dtype; the result equals the merge of fp32 copies."""
    torch.manual_seed(0)
    out = torch.randn(2, 10, 3, 8)
    lse = torch.randn(2, 3, 10)
    lse[0, 1, 4] = -math.inf
    bout = torch.randn(2, 6, 3, 8).to(torch.bfloat16)
    blse = torch.randn(2, 3, 6)
    blse[1, 2, 0] = -math.inf
    o_ref, l_ref = out[:, 4:].clone(), lse[:, :, 4:].clone()
    merge_partial(o_ref, l_ref, bout.float(), blse)
    merge_partial(out[:, 4:], lse[:, :, 4:], bout, blse)
    torch.testing.assert_close(out[:, 4:], o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, :, 4:], l_ref, rtol=0, atol=0)


def _merge_torch(out, lse, bout, blse):
    """merge_partial's torch path, on copies (the reference for the kernel)."""
    out, lse = out.clone(), lse.clone()
    blse = blse.to(lse.dtype)
    new = torch.logaddexp(lse, blse)
    shift = new.masked_fill(new == -math.inf, 0.0)
    a = (lse - shift).exp().transpose(1, 2).unsqueeze(-1)
    b = (blse - shift).exp().transpose(1, 2).unsqueeze(-1)
    return out * a + bout.to(out.dtype) * b, new


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,view", [(128, False), (64, True), (200, True), (62, False)])
def test_merge_kernel_matches_torch(dtype, head_dim, view):
    """On CUDA merge_partial runs one kernel (csrc/fwd_aux.cu: merge_partial_kernel) where the tensors suit it (fp32
    out / lse, an fp16 / bf16 block, head dim a multiple of 4; 62 takes the torch path): the same out and lse as the
    torch path within fp32 rounding, through row-slice views of a larger out (the ring's zigzag halves), with rows
    empty on one side, on both, and LSE gaps of +-80."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from flash_attn2 import _ops
    torch.manual_seed(1)
    full_out = torch.randn(2, 40, 5, head_dim, device="cuda")
    full_lse = torch.randn(2, 5, 40, device="cuda") * 3
    rows = slice(8, 40) if view else slice(0, 40)
    out, lse = full_out[:, rows], full_lse[:, :, rows]
    n = out.shape[1]
    bout = torch.randn(2, n, 5, head_dim, device="cuda").to(dtype)
    blse = torch.randn(2, 5, n, device="cuda") * 3
    lse[0, 1, 3] = -math.inf                                  # only the block sees keys
    blse[1, 2, 0] = -math.inf                                 # only out does
    lse[1, 0, 5], blse[1, 0, 5] = -math.inf, -math.inf        # neither
    lse[0, 4, 7], blse[0, 4, 7] = 80.0, -80.0                 # far apart
    ref_out, ref_lse = _merge_torch(out, lse, bout, blse)
    untouched = full_out[:, :8].clone() if view else None
    served = _ops.ext.merge_partial_(out.clone(), lse.clone(), bout, blse)
    assert served == (head_dim % 4 == 0)
    merge_partial(out, lse, bout, blse)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    assert lse[1, 0, 5] == -math.inf and torch.equal(out[1, 5, 0], torch.zeros(head_dim, device="cuda"))
    if view:
        assert torch.equal(full_out[:, :8], untouched)
    # An empty block (a causal stripe ring's first step with one token a rank) is nothing to merge, and a NaN LSE
    # propagates as the torch ops propagate it.
    merge_partial(out[:, :0], lse[:, :, :0], bout[:, :0], blse[:, :, :0])
    lse[0, 0, 0], blse[0, 0, 0] = math.nan, -math.inf
    merge_partial(out, lse, bout, blse)
    assert math.isnan(lse[0, 0, 0]) and torch.isnan(out[0, 0, 0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_kernel_in_dtype_is_fp32_merge_rounded(dtype):
    """The merge kernel with out in the block's dtype (MergeParams::out_in_dtype: a 2-rank ring's forward) writes the
    fp32 merge of the same values rounded once, bitwise, through row-slice views; the torch fallback (a head dim the
    kernel does not take) rounds the same fp32 merge."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from flash_attn2 import _ops
    torch.manual_seed(2)
    for head_dim, kernel in ((128, True), (62, False)):
        full = torch.randn(2, 40, 5, head_dim, device="cuda").to(dtype)
        lse = torch.randn(2, 5, 32, device="cuda") * 3
        bout = torch.randn(2, 32, 5, head_dim, device="cuda").to(dtype)
        blse = torch.randn(2, 5, 32, device="cuda") * 3
        lse[0, 1, 3], blse[1, 2, 0] = -math.inf, -math.inf
        wide, wide_lse = full[:, 8:].float(), lse.clone()
        assert _ops.ext.merge_partial_(wide.clone(), wide_lse.clone(), bout, blse) == kernel
        merge_partial(wide, wide_lse, bout, blse)
        untouched = full[:, :8].clone()
        merge_partial(full[:, 8:], lse, bout, blse)
        assert torch.equal(full[:, 8:], wide.to(dtype)) and torch.equal(lse, wide_lse)
        assert torch.equal(full[:, :8], untouched)


@pytest.mark.parametrize("layout,seqlen,world,match", [
    ("zigzag", 10, 4, "divisible by 8"), ("contiguous", 10, 3, "divisible by 3"), ("ring", 8, 2, "layout must be"),
])
def test_bad_layouts_raise(layout, seqlen, world, match):
    with pytest.raises(ValueError, match=match):
        ring_tasks(layout, seqlen, world, 0, 0, True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_index_is_shard_indices(layout, world):
    """The ring's shard / unshard helpers build positions with torch ops from the schedule's ranges (ring.py:
    _shard_index); shard_indices is the definition: both must agree for every rank, and refuse the same bad lengths."""
    from flash_attn2.distributed._schedule import check_layout
    from flash_attn2.distributed.ring import _shard_index
    seqlen = 2 * world * 6
    for rank in range(world):
        assert _shard_index(layout, seqlen, world, rank, "cpu").tolist() == shard_indices(layout, seqlen, world, rank)
    with pytest.raises(ValueError, match="divisible"):  # (world 1 divides any length but zigzag's: ask 2 ranks)
        check_layout(layout, seqlen + 1, max(world, 2))
    with pytest.raises(ValueError, match="layout must be one of"):
        _shard_index("spiral", seqlen, world, 0, "cpu")


def test_kernel_backend_asks_for_dynamic_tiles(monkeypatch):
    """The ring's forward blocks run with the counter's tile order (their blocks start behind NCCL's kernels; TUNING
    148) and leave the thread's order as they found it, an error inside included; FLASH_ATTN2_TILE_ORDER still rules
    (csrc/flash_api.cpp reads it first). Bad orders are refused by name."""
    from flash_attn2 import _ops
    from flash_attn2.distributed.ring import KernelBackend

    def current():
        previous = _ops.ext.set_tile_order("")
        _ops.ext.set_tile_order(previous)
        return previous

    seen = []

    def fake_fwd(q, *args):
        seen.append(current())
        if q is None:
            raise ValueError("boom")
        return q, q, None

    monkeypatch.setattr(_ops, "fwd", fake_fwd)
    x = torch.zeros(1)
    assert KernelBackend.forward(x, x, x, False, 1.0)[0] is x
    assert seen == ["dynamic"] and current() == ""
    with _ops.tile_order("static"):
        with pytest.raises(ValueError, match="boom"):
            KernelBackend.forward(None, x, x, True, 1.0)
        assert current() == "static"
    assert seen == ["dynamic", "dynamic"] and current() == ""
    with pytest.raises(RuntimeError, match="tile order must be"):
        _ops.ext.set_tile_order("sideways")
    assert current() == ""


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_two_ranks_sum_at_most_two_blocks(layout, causal):
    """ring.py accumulates dq, dk and dv in the inputs' half-precision dtype on 2 ranks (_half_sums), which equals the
    fp32 sum rounded once only while each query row and each key gets at most two blocks' contributions: every rank's
    rows over its steps, and each key block's sum over the ranks that hold it (rank b + s at step s)."""
    world, seqlen = 2, 24
    for rank in range(world):
        rows = [0] * (seqlen // world)
        for step in range(world):
            for task in ring_tasks(layout, seqlen, world, rank, step, causal):
                for r in range(task.q[0] + (task.mask == CAUSAL_STRICT), task.q[1]):
                    rows[r] += 1
        assert max(rows) <= 2, (rank, rows)
    for block in range(world):
        keys = [0] * (seqlen // world)
        for step in range(world):
            for task in ring_tasks(layout, seqlen, world, (block + step) % world, step, causal):
                for c in range(task.k[0], task.k[1] - (task.mask == CAUSAL_STRICT)):
                    keys[c] += 1
        assert max(keys) <= 2, (block, keys)
