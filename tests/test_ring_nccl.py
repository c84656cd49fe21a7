"""flash_attn2.distributed's ring on NCCL with flash_attn2's kernels, one process per GPU (2 and 4 GPUs): every layout
x causal x {MHA, GQA 4:1} x {bf16, fp16}, forward and backward against single-GPU flash_attn2 on the gathered
tensors, under the project's rule (the ring's error against a float32 reference at most 2x the single-GPU one, plus
a small absolute term: the ring merges in fp32 where the kernel keeps one softmax)."""

import os
import tempfile

import pytest
import torch

pytestmark = pytest.mark.gpu

# NVLink multicast stays off on the GPU machines (set before any worker starts).
for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = value


def _worker(rank, world, store_path, results):
    import torch.distributed as dist

    import flash_attn2
    from flash_attn2.distributed import ring
    from flash_attn2.testing import attention_ref, max_error

    assert os.environ.get("NCCL_NVLS_ENABLE") == "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        i = 0
        for layout in ("contiguous", "zigzag", "stripe"):
            for causal in (False, True):
                for heads, heads_k in ((8, 8), (8, 2)):
                    for dtype in (torch.bfloat16, torch.float16):
                        torch.manual_seed(i)
                        seqlen = 2 * world * 256
                        q = torch.randn(2, seqlen, heads, 128, device="cuda", dtype=dtype)
                        k, v = (torch.randn(2, seqlen, heads_k, 128, device="cuda", dtype=dtype) for _ in range(2))
                        dout = torch.randn_like(q)
                        shard = lambda t, dim=1: ring._layout_shard(layout, t, rank, world, dim)  # noqa: E731
                        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
                        fn = {"contiguous": ring.ring_flash_attn_func, "zigzag": ring.zigzag_ring_flash_attn_func,
                              "stripe": ring.stripe_flash_attn_func}[layout]
                        out = fn(ql, kl, vl, causal=causal)
                        grads = torch.autograd.grad(out, (ql, kl, vl), shard(dout))
                        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
                        single = flash_attn2.flash_attn_func(qs, ks, vs, causal=causal)
                        single_grads = torch.autograd.grad(single, (qs, ks, vs), dout)
                        leaves = [t.float().requires_grad_() for t in (q, k, v)]
                        ref = attention_ref(*leaves, causal)[0]
                        ref_grads = torch.autograd.grad(ref, leaves, dout.float())
                        ok = True
                        for ours, one, r, atol in ((out, single, ref, 1e-3),
                                                   *zip(grads, single_grads, ref_grads, (1e-3,) * 3)):
                            ok &= max_error(ours, shard(r)) <= 2 * max_error(one, r) + atol
                        results[(rank, layout, causal, heads_k, str(dtype))] = ok
                        i += 1
        # Packed documents: the all-gather form (causal, with and without a window) and the zigzag ring.
        from flash_attn2.distributed import llama3, ring_varlen
        from flash_attn2.testing import attention_ref_varlen
        docs = [2 * world * n for n in (64, 16, 128)]
        cu = torch.tensor([0] + docs, device="cuda").cumsum(0).to(torch.int32)
        total = int(cu[-1])
        for form, window in (("llama3", (-1, -1)), ("llama3", (127, 0)), ("zigzag_varlen", (-1, -1))):
            torch.manual_seed(i)
            q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            if form == "llama3":
                per = total // world
                take = lambda t: t[rank * per:(rank + 1) * per]  # noqa: E731
                cu_q, cu_k, max_q, max_k, k_slice = llama3.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
                out = llama3.llama3_flash_attn_varlen_func(take(q), take(k), take(v), cu_q, cu_k, max_q, max_k, 1,
                                                           k_slice, causal=True, window_size=window)
            else:
                take = lambda t: ring_varlen.varlen_shard(t, cu, "zigzag", rank, world)  # noqa: E731
                local_cu = cu // world
                out = ring_varlen.zigzag_ring_flash_attn_varlen_func(take(q), take(k), take(v), local_cu,
                                                                     int((local_cu[1:] - local_cu[:-1]).max()),
                                                                     causal=True)
            single = flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu, max(docs), max(docs), causal=True,
                                                        window_size=window)
            ref = attention_ref_varlen(q.float(), k.float(), v.float(), cu, cu, True, window=window)[0]
            results[(rank, form, str(window))] = max_error(out, take(ref)) <= 2 * max_error(single, ref) + 1e-3
            i += 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_nccl(world):
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (device kind nvidia-h200-x{world} / nvidia-h100-x{world})")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), results), nprocs=world, join=True)
        failed = [key for key, ok in results.items() if not ok]
        count = len(results)
    assert count == world * (3 * 2 * 2 * 2 + 3) and not failed, failed
