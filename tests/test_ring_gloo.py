"""flash_attn2.distributed's ring drivers over gloo on the CPU, 2 and 4 processes, with the reference block backend:
forward and backward of every layout against full attention on the gathered sequence (float64)."""


import pytest
import torch
import torch.distributed as dist

from flash_attn2.distributed import ring
from flash_attn2.testing import attention_ref, run_ranks


def _worker(rank, world, store_path, cases, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for i, (layout, causal, heads, heads_k) in enumerate(cases):
            torch.manual_seed(i)
            seqlen = 2 * world * 3
            q = torch.randn(2, seqlen, heads, 8, dtype=torch.float64)
            k, v = (torch.randn(2, seqlen, heads_k, 8, dtype=torch.float64) for _ in range(2))
            dout = torch.randn_like(q)
            shard = lambda t: ring._layout_shard(layout, t, rank, world, 1)  # noqa: E731
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
            out, lse, _ = ring._ring_func(layout, ql, kl, vl, 0.0, None, causal, (-1, -1), None, False, True, None,
                                          backend=ring.ReferenceBackend)
            grads = torch.autograd.grad(out, (ql, kl, vl), shard(dout))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = attention_ref(*leaves, causal)
            ref_grads = torch.autograd.grad(ref, leaves, dout)
            errors = [(out - shard(ref)).abs().max().item(), (lse - ring._layout_shard(layout, ref_lse, rank, world, 2)).abs().max().item()]
            errors += [(g - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)]
            results[(rank, i)] = max(errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])  # 1: no hop, and dk / dv (one fp64 buffer) must not alias
def test_ring_over_gloo(world):
    cases = [(layout, causal, heads, heads_k) for layout in ("contiguous", "zigzag", "stripe")
             for causal in (False, True) for heads, heads_k in ((4, 4), (4, 1))]
    worst = run_ranks(_worker, world, cases)
    assert len(worst) == world * len(cases)
    bad = {cases[i]: err for (rank, i), err in worst.items() if not err <= 1e-9}
    assert not bad, bad


class _HalfBackend:
    """The kernels' dtypes on the CPU: blocks computed in fp32 from bf16 inputs, out and the gradients returned in
    bf16, lse in fp32."""

    @staticmethod
    def forward(q, k, v, causal, scale, busy=True):
        out, lse = attention_ref(q.float(), k.float(), v.float(), causal, scale)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, deterministic, dlse=None):
        from flash_attn2.testing import attention_bwd_ref
        grads = attention_bwd_ref(q.float(), k.float(), v.float(), out.float(), lse, dout.float(), causal, scale, dlse)
        return tuple(g.to(q.dtype) for g in grads)


def _half_worker(rank, world, store_path, cases, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for i, (layout, causal) in enumerate(cases):
            torch.manual_seed(i)
            seqlen = 2 * world * 4
            q, k, v, dout = (torch.randn(1, seqlen, 2, 16).to(torch.bfloat16) for _ in range(4))
            shard = lambda t: ring._layout_shard(layout, t, rank, world, 1)  # noqa: E731
            ql, kl, vl, dl = (shard(t) for t in (q, k, v, dout))
            fwd = {}
            for half in (True, False):
                ring._HALF_SUMS = half
                fwd[half] = ring.ring_forward(ql, kl, vl, layout, causal, 0.25, None, _HalfBackend)
            ring._HALF_SUMS = True
            out, lse = fwd[True]
            same_fwd = (out.dtype == torch.bfloat16 and torch.equal(out, fwd[False][0].to(torch.bfloat16)) and
                        torch.equal(lse, fwd[False][1]))
            grads = {}
            for half in (True, False):
                ring._HALF_SUMS = half
                grads[half] = ring.ring_backward(dl, ql, kl, vl, out.to(ql.dtype), lse, layout, causal, 0.25, None,
                                                 _HalfBackend, False)
            ring._HALF_SUMS = True
            results[(rank, i)] = same_fwd and all(torch.equal(a, b) and a.dtype == torch.bfloat16
                                                  for a, b in zip(grads[True], grads[False]))
    finally:
        dist.destroy_process_group()


def test_half_sums_equal_fp32_sums_on_two_ranks():
    """On 2 ranks out, dq, dk and dv stay in bf16 (ring._half_sums): bitwise the fp32 merges and sums cast once, for
    every layout, causal or not (blocks computed in fp32 from bf16, returned in bf16 as the kernels do)."""
    cases = [(layout, causal) for layout in ("contiguous", "zigzag", "stripe") for causal in (False, True)]
    same = run_ranks(_half_worker, 2, cases)
    assert len(same) == 2 * len(cases) and all(same.values()), same


def test_bad_use_raises_before_any_collective():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="window_size"):
        ring.zigzag_ring_flash_attn_func(q, q, q, window_size=(4, 0))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        ring.ring_flash_attn_func(q, q, q, dropout_p=0.1)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="not initialized"):
            ring.ring_flash_attn_func(q, q, q)


def test_llama3_refuses_a_non_causal_window():
    from flash_attn2.distributed import llama3
    x = torch.zeros(8, 2, 8)
    with pytest.raises(NotImplementedError, match="window_size without causal"):
        llama3.llama3_flash_attn_varlen_func(x, x, x, None, None, 4, 4, 1, slice(0, 8), window_size=(2, 2))


def test_shard_unshard_roundtrip():
    x = torch.arange(2 * 24).view(2, 24)
    for layout in ("contiguous", "zigzag", "stripe"):
        parts = [ring._layout_shard(layout, x, r, 4, 1) for r in range(4)]
        assert torch.equal(ring.unshard(parts, layout, 1), x)
    assert ring.zigzag_shard(x, 0, 4, 1)[0].tolist() == [0, 1, 2, 21, 22, 23]


def _llama3_worker(rank, world, store_path, cases, results):
    from flash_attn2.distributed import llama3
    from flash_attn2.testing import attention_ref_varlen

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for i, (docs, causal, heads, heads_k, stride, window) in enumerate(cases):
            torch.manual_seed(i)
            cu = torch.tensor([0] + docs).cumsum(0).to(torch.int32)
            total = int(cu[-1])
            q = torch.randn(total, heads, 8, dtype=torch.float64)
            k, v = (torch.randn(total, heads_k, 8, dtype=torch.float64) for _ in range(2))
            dout = torch.randn_like(q)
            per = total // world
            mine = slice(rank * per, (rank + 1) * per)
            cu_q, cu_k, max_q, max_k, k_slice = llama3.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
            ql, kl, vl = (t[mine].clone().requires_grad_() for t in (q, k, v))
            out, lse, _ = llama3.llama3_flash_attn_varlen_func(
                ql, kl, vl, cu_q, cu_k, max_q, max_k, stride, k_slice, causal=causal, window_size=window,
                return_attn_probs=True, _backend=llama3.ReferenceVarlenBackend)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = attention_ref_varlen(*leaves, cu, cu, causal, window=window)
            errors = [(out - ref[mine]).abs().max().item(), (lse - ref_lse[:, mine]).abs().max().item()]
            if window == (-1, -1):  # a loss through out and lse (lse's gradient: each piece's D less its dlse)
                dlse = torch.randn_like(ref_lse)
                grads = torch.autograd.grad((out, lse), (ql, kl, vl), (dout[mine], dlse[:, mine]))
                ref_grads = torch.autograd.grad((ref, ref_lse), leaves, (dout, dlse))
                errors += [(g - r[mine]).abs().max().item() for g, r in zip(grads, ref_grads)]
            results[(rank, i)] = max(errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_llama3_all_gather_over_gloo(world):
    """Documents of any length (one spanning every rank, an empty one), GQA, heads_k_stride 1 and all, a window."""
    cases = [([13, 0, 30, 5, 8, 24], True, 4, 2, 1, (-1, -1)), ([13, 0, 30, 5, 8, 24], False, 4, 2, 2, (-1, -1)),
             ([80], True, 4, 4, 2, (-1, -1)), ([3, 77], True, 4, 1, 1, (5, 0)), ([40, 40], True, 2, 2, 1, (6, 3))]
    worst = run_ranks(_llama3_worker, world, cases)
    assert len(worst) == world * len(cases)
    bad = {i: err for (rank, i), err in worst.items() if not err <= 1e-9}
    assert not bad, bad


def _varlen_worker(rank, world, store_path, cases, results):
    from flash_attn2.distributed import llama3, ring_varlen
    from flash_attn2.testing import attention_ref_varlen

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for i, (layout, docs, causal, heads, heads_k) in enumerate(cases):
            torch.manual_seed(i)
            cu = torch.tensor([0] + docs).cumsum(0).to(torch.int32)
            total = int(cu[-1])
            q = torch.randn(total, heads, 8, dtype=torch.float64)
            k, v = (torch.randn(total, heads_k, 8, dtype=torch.float64) for _ in range(2))
            dout = torch.randn_like(q)
            shard = lambda t: ring_varlen.varlen_shard(t, cu, layout, rank, world)  # noqa: E731
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
            local_cu = cu // world
            out, lse, _ = ring_varlen._varlen_func(layout, ql, kl, vl, local_cu, int((local_cu[1:] - local_cu[:-1]).max()),
                                                   0.0, None, causal, (-1, -1), None, False, True, None,
                                                   backend=llama3.ReferenceVarlenBackend)
            dlse = torch.randn(heads, total, dtype=torch.float64)  # a loss through out and lse
            grads = torch.autograd.grad((out, lse), (ql, kl, vl), (shard(dout), shard(dlse.t()).t()))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = attention_ref_varlen(*leaves, cu, cu, causal)
            ref_grads = torch.autograd.grad((ref, ref_lse), leaves, (dout, dlse))
            errors = [(out - shard(ref)).abs().max().item(), (lse - shard(ref_lse.t()).t()).abs().max().item()]
            errors += [(g - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)]
            results[(rank, i)] = max(errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_varlen_over_gloo(world):
    """ring / zigzag varlen: documents of different lengths (multiples of 2 world), MHA and MQA, causal or not."""
    docs = [2 * world * n for n in (3, 1, 5)]
    cases = [(layout, docs, causal, 4, heads_k) for layout in ("contiguous", "zigzag") for causal in (False, True)
             for heads_k in (4, 1)]
    worst = run_ranks(_varlen_worker, world, cases)
    assert len(worst) == world * len(cases)
    bad = {cases[i][:3]: err for (rank, i), err in worst.items() if not err <= 1e-9}
    assert not bad, bad


def _compile_worker(rank, world, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        q = torch.randn(1, 4 * world, 2, 8, dtype=torch.float64)
        k, v = torch.randn_like(q), torch.randn_like(q)
        shard = lambda t: ring._layout_shard("zigzag", t, rank, world, 1)  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))

        def step(q, k, v):
            out = ring._ring_func("zigzag", q, k, v, 0.0, None, True, (-1, -1), None, False, False, None,
                                  backend=ring.ReferenceBackend)
            return (out * 2).sum()

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
        loss = compiled(ql, kl, vl)
        grads = torch.autograd.grad(loss, (ql, kl, vl))
        eager_loss = step(ql, kl, vl)
        eager_grads = torch.autograd.grad(eager_loss, (ql, kl, vl))
        results[rank] = bool(torch.allclose(loss, eager_loss) and
                             all(torch.allclose(a, b) for a, b in zip(grads, eager_grads)))
    finally:
        dist.destroy_process_group()


def test_ring_compiles_without_a_graph_break():
    assert run_ranks(_compile_worker, 2) == {0: True, 1: True}


def _mismatch_worker(rank, world, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        seqlen = 8 if rank == 0 else 12  # rank 1 holds another length: the ring would hang or read garbage
        q = torch.randn(1, seqlen, 2, 8, dtype=torch.float64)
        try:
            ring._ring_func("zigzag", q, q, q, 0.0, None, True, (-1, -1), None, False, False, None,
                            backend=ring.ReferenceBackend)
            results[rank] = "no error"
        except ValueError as e:
            results[rank] = str(e)
    finally:
        dist.destroy_process_group()


def test_mismatched_shapes_raise_on_every_rank():
    got = run_ranks(_mismatch_worker, 2)
    assert all("shapes and dtypes differ" in got[r] for r in (0, 1)), got


def _refusal_worker(rank, world, store_path, results):
    import datetime
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a regression fails here instead of hanging
    try:
        q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
        cases = {  # rank 1's call: refused by its own checks, rank 0's passes them
            "length": (q[:, :5] if rank == 1 else q, (-1, -1)),  # zigzag over 2 ranks: 10 rows, not in 4 chunks
            "window": (q, (4, 0) if rank == 1 else (-1, -1)),
            "dtype": (q.float() if rank == 1 else q, (-1, -1)),  # passes both ranks' checks: the agreement's
        }
        for name, (x, window) in cases.items():
            try:
                ring._ring_func("zigzag", x, x, x, 0.0, None, True, window, None, False, False, None,
                                backend=ring.ReferenceBackend)
                results[(rank, name)] = "no error"
            except (ValueError, NotImplementedError) as e:
                results[(rank, name)] = f"{type(e).__name__}: {e}"
        from flash_attn2.distributed import packed  # a packed form: rank 1's qkv packs 4 tensors, not 3
        qkv = torch.randn(1, 8, 4 if rank == 1 else 3, 2, 8, dtype=torch.float64)
        try:
            packed.zigzag_ring_flash_attn_qkvpacked_func(qkv, causal=True)
            results[(rank, "packed")] = "no error"
        except ValueError as e:
            results[(rank, "packed")] = f"{type(e).__name__}: {e}"
        dist.barrier()  # no rank tears its connections down while a peer still finishes the last gather (a CI run
        # of 2026-11-29 saw rank 0 abort in the teardown once: "terminate called without an active exception")
    finally:
        dist.destroy_process_group()


def test_a_rank_refusing_a_call_makes_every_rank_raise():
    """A rank whose own checks refuse a call (here a length the zigzag layout cannot split, a window the ring does not
    take) joins the shape agreement with its error (ring.refuse_with_peers): its peer, whose checks passed, raises a
    ValueError naming it instead of waiting in the ring for its transfers. Dtypes that differ across ranks: a
    ValueError on both from the agreement."""
    got = run_ranks(_refusal_worker, 2)
    assert got[(1, "length")].startswith("ValueError") and "divisible" in got[(1, "length")], got
    assert got[(1, "window")].startswith("NotImplementedError") and "window_size" in got[(1, "window")], got
    assert "qkv must be" in got[(1, "packed")], got
    for name in ("length", "window", "packed"):
        assert got[(0, name)].startswith("ValueError") and "rank 1 refused the call" in got[(0, name)], got
    assert all(got[(r, "dtype")].startswith("ValueError") and "float32" in got[(r, "dtype")] for r in (0, 1)), got


def _lse_worker(rank, world, store_path, cases, results):
    """A loss through the ring's out and its merged lse (the reference block backend, float64): every rank's dq, dk,
    dv against full attention's through both."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for i, (layout, causal) in enumerate(cases):
            torch.manual_seed(100 + i)
            seqlen = 2 * world * 3
            q = torch.randn(2, seqlen, 4, 8, dtype=torch.float64)
            k, v = (torch.randn(2, seqlen, 2, 8, dtype=torch.float64) for _ in range(2))
            dout, dlse = torch.randn_like(q), torch.randn(2, 4, seqlen, dtype=torch.float64)
            shard = lambda t, dim=1: ring._layout_shard(layout, t, rank, world, dim)  # noqa: E731
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
            out, lse, _ = ring._ring_func(layout, ql, kl, vl, 0.0, None, causal, (-1, -1), None, False, True, None,
                                          backend=ring.ReferenceBackend)
            grads = torch.autograd.grad((out, lse), (ql, kl, vl), (shard(dout), shard(dlse, 2)))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = attention_ref(*leaves, causal)
            ref_grads = torch.autograd.grad((ref, ref_lse), leaves, (dout, dlse))
            results[(rank, i)] = max((g - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_loss_through_lse(world):
    """The ring's lse is differentiable like flash_attn_func's: its gradient enters each block's backward (D less
    the rows' dlse), exact for every layout, causal or not."""
    cases = [(layout, causal) for layout in ("contiguous", "zigzag", "stripe") for causal in (False, True)]
    worst = run_ranks(_lse_worker, world, cases)
    assert len(worst) == world * len(cases)
    bad = {cases[i]: err for (rank, i), err in worst.items() if not err <= 1e-9}
    assert not bad, bad
