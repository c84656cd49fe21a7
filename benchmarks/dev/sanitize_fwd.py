# A few small forward calls (fixed and varlen; causal, windows, softcap, ALiBi, dropout, sinks) for compute-sanitizer, on
# the default path and on the SM80 one (FLASH_ATTN2_BACKEND=sm80); head dims 64 and 128 where compiled (bf16);
# then flash_attn_with_kvcache (the update kernel, the split-KV forward and its combine) with hostile device values.
import os

import torch
from flash_attn2 import _ops, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn2.bench.grid import forward_backend

# The default sm_90 build has no SM80 path (FLASH_ATTN2_SM80=1 adds it).
for backend in (None, "sm80") if _ops.ext.sm80_built else (None,):
    for d in (d for d in (64, 128) if _ops.ext.fwd_head_dim_bucket(d, True) == d):  # those compiled
        for causal, window, softcap, alibi, p in ((False, (-1, -1), 0.0, False, 0.0), (True, (-1, -1), 0.0, False, 0.0),
                                                  (False, (40, 7), 0.0, False, 0.0), (True, (90, 0), 0.0, False, 0.0),
                                                  (False, (-1, -1), 30.0, False, 0.0), (True, (-1, -1), 0.0, True, 0.0),
                                                  (False, (40, 7), 30.0, True, 0.0), (True, (-1, -1), 0.0, False, 0.2),
                                                  (False, (40, 7), 30.0, True, 0.3)):
            extra = dict(softcap=softcap, dropout_p=p, alibi_slopes=torch.rand(4, device="cuda") if alibi else None)
            q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu = torch.tensor([0, 17, 300, 450], device="cuda", dtype=torch.int32)
            qv, kv, vv = (torch.randn(450, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            with forward_backend(backend):
                flash_attn_func(q, k, v, causal=causal, window_size=window, **extra)
                flash_attn_varlen_func(qv, kv, vv, cu, cu, 283, 283, causal=causal, window_size=window, **extra)
        sink = torch.randn(4, device="cuda")  # attention sinks, with rows that see no key (sq > sk, causal)
        with forward_backend(backend):
            flash_attn_func(q, k[:, :100], v[:, :100], causal=True, learnable_sink=sink)
            flash_attn_varlen_func(qv, kv, vv, cu, cu, 283, 283, causal=True, window_size=(40, 0), learnable_sink=sink)
torch.cuda.synchronize()
print("small: ok")

# MLA (192, 128): the Hopper pair kernel (fixed, causal and not, GQA, a tail tile; varlen with a window and an empty
# sequence; dropout; a sink), where the build has it; elsewhere the same calls run padded.
if _ops.ext.fwd_head_dim_bucket(192, True) == 192:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(2, 203, 8, 192, **bf16), torch.randn(2, 333, 2, 192, **bf16), torch.randn(2, 333, 2, 128, **bf16)
    for causal, p in ((False, 0.0), (True, 0.0), (True, 0.2)):
        flash_attn_func(q, k, v, causal=causal, dropout_p=p, learnable_sink=torch.randn(8, device="cuda"))
    cu_q = torch.tensor([0, 150, 150, 203], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 210, 333], device="cuda", dtype=torch.int32)
    flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 150, 200, causal=True, window_size=(64, 0))
    torch.cuda.synchronize()
    print("mla: ok")

for d in (d for d in (64, 128) if _ops.ext.fwd_head_dim_bucket(d, True) == d):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(4, 2, 8, d, **bf16), torch.randn(4, 2, 2, d, **bf16), torch.randn(4, 2, 2, d, **bf16)
    k_cache, v_cache = torch.randn(3, 77, 2, d, **bf16), torch.randn(3, 77, 2, d, **bf16)
    angle = torch.rand(77, d // 4, device="cuda")
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    ints = lambda *x: torch.tensor(x, device="cuda", dtype=torch.int32)  # noqa: E731
    for seqlens, idx, leftpad in ((ints(0, 10, 75, 76), ints(0, 1, 2, 1), None),
                                  (ints(-5, 76, 2**31 - 1, 40), ints(-1, 2, 99, 0), ints(3, -2, 60, 2**30))):
        for causal, window, softcap, alibi, splits in ((False, (-1, -1), 0.0, None, 0), (True, (-1, -1), 0.0, None, 3),
                                                       (False, (5, 3), 30.0, torch.rand(8, device="cuda"), 128)):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens, idx, leftpad, causal=causal,
                                    window_size=window, softcap=softcap, alibi_slopes=alibi, num_splits=splits,
                                    learnable_sink=torch.randn(8, device="cuda") if splits == 3 else None)
    flash_attn_func(q[:3, :1], k_cache, v_cache, causal=True)  # decode through flash_attn_func: the split kernel
    # Paged, page 7: a -1-padded table and hostile entries (-5, 10**6) and lengths
    k_pages, v_pages = torch.randn(20, 7, 2, d, **bf16), torch.randn(20, 7, 2, d, **bf16)
    table = torch.tensor([[3, -1, -1], [10**6, -5, 19], [0, 1, 2], [-1, -1, -1]], device="cuda", dtype=torch.int32)
    for splits in (0, 1, 5):
        flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cos[:21], sin[:21], ints(3, 20, 2**31 - 1, -4),
                                block_table=table, causal=True, num_splits=splits,
                                learnable_sink=torch.randn(8, device="cuda"))
    # Tall query tiles (80 rows per head > 64, dispatch.cpp: hopper_serves_kv_cache): the Hopper forward on sm_90,
    # with the same hostile lengths, batch indices, left pads and (pages of 16, 48, 64 and 128: boxes of 16, 64 and
    # a whole block, sm90/tile_size.h) tables; the split kernel
    # elsewhere. (40 rows a head, as here before, ran the split kernel everywhere: a helper's review found it.)
    q_tall = torch.randn(4, 80, 8, d, **bf16)
    k_new, v_new = torch.randn(4, 5, 2, d, **bf16), torch.randn(4, 5, 2, d, **bf16)
    for seqlens, idx, leftpad in ((ints(0, 10, 75, 76), ints(0, 1, 2, 1), None),
                                  (ints(-5, 76, 2**31 - 1, 40), ints(-1, 2, 99, 0), ints(3, -2, 60, 2**30))):
        for causal, window, softcap in ((False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (5, 3), 30.0)):
            flash_attn_with_kvcache(q_tall, k_cache, v_cache, k_new, v_new, None, None, seqlens, idx, leftpad,
                                    causal=causal, window_size=window, softcap=softcap)
    for page in (16, 48, 64, 128):
        k_pages, v_pages = torch.randn(9, page, 2, d, **bf16), torch.randn(9, page, 2, d, **bf16)
        table = torch.tensor([[3, -1, -1], [10**6, -5, 8], [0, 1, 2], [-1, -1, -1]], device="cuda", dtype=torch.int32)
        flash_attn_with_kvcache(q_tall, k_pages, v_pages, k_new, v_new, cache_seqlens=ints(3, 20, 2**31 - 1, -4),
                                block_table=table, causal=True, learnable_sink=torch.randn(8, device="cuda"))
        # varlen q against the pages (SGLang's call), a 0-row sequence; 80 rows a sequence on average and a longest
        # of 120, past the split kernel's 64 (the Hopper forward's route)
        cu_q = ints(0, 80, 80, 200, 320)
        flash_attn_with_kvcache(q_tall.reshape(-1, 8, d), k_pages, v_pages, cache_seqlens=ints(30, 0, 2**30, -1),
                                page_table=table, cu_seqlens_q=cu_q, max_seqlen_q=120, causal=True)
    # vLLM's form (flash_attn_varlen_func with block_table): hostile cu_seqlens_q (decreasing, past q's rows),
    # seqused_k (negative, past the capacity), cu_seqlens_k instead of seqused_k (decreasing), a -1-padded table with
    # out-of-range entries; short rows (split kernel) and tall ones (the Hopper forward on pages of 16).
    pages7 = torch.randn(20, 7, 2, d, **bf16), torch.randn(20, 7, 2, d, **bf16)
    pages16 = torch.randn(9, 16, 2, d, **bf16), torch.randn(9, 16, 2, d, **bf16)
    for (kp, vp), q_rows, max_q in ((pages7, 12, 4), (pages16, 400, 200)):
        qv = torch.randn(q_rows, 8, d, **bf16)
        table = torch.tensor([[3, -1, -1], [10**6, -5, 8], [0, 1, 2], [-1, -1, -1]], device="cuda", dtype=torch.int32)
        cu_q = ints(0, q_rows // 2, q_rows // 4, q_rows + 50, 2**30)
        flash_attn_varlen_func(qv, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=ints(-3, 2**31 - 1, 5, 40),
                               max_seqlen_k=48, block_table=table, causal=True, out=torch.empty_like(qv))
        flash_attn_varlen_func(qv, kp, vp, cu_q, ints(0, 30, 10, 2**20, -7), max_q, 48, causal=True, block_table=table,
                               num_splits=3)
    # Long splits on pages of 16 (one-page chunks: 141 a warp at 9000 keys, enough for a read-ahead of the table to
    # wrap, as the entry rings of TUNING 200-205 did), hostile entries scattered through the table, hostile lengths.
    k_pages, v_pages = torch.randn(2400, 16, 2, d, **bf16), torch.randn(2400, 16, 2, d, **bf16)
    table = torch.randperm(2400, device="cuda").to(torch.int32).view(4, 600).contiguous()
    table[1, 7], table[1, 300], table[2, 510], table[3, 599] = 10**6, -5, -1, 2**31 - 1
    for splits in (1, 2, 0):
        flash_attn_with_kvcache(q[:, :1], k_pages, v_pages, cache_seqlens=ints(9000, 2**31 - 1, 8191, -4),
                                block_table=table, causal=True, num_splits=splits)
    # The same on pages of one row (chunks of rows on their own pages: 16 entries a chunk, one a row).
    k_pages, v_pages = torch.randn(4000, 1, 2, d, **bf16), torch.randn(4000, 1, 2, d, **bf16)
    table = torch.randperm(4000, device="cuda").to(torch.int32).view(2, 2000).contiguous()
    table[0, 5], table[0, 900], table[1, 1999] = 10**6, -5, -1
    for splits in (1, 0):
        flash_attn_with_kvcache(q[:2, :1], k_pages, v_pages, cache_seqlens=ints(1999, 2**31 - 1),
                                block_table=table, causal=True, num_splits=splits)
torch.cuda.synchronize()
print("kvcache: ok")

# The cluster combine (FLASH_ATTN2_SPLIT_COMBINE=cluster: the split kernels' 2-16 splits merged in a cluster, sm_90):
# hostile lengths, empty splits, a sink, the extended kernel, pages.
os.environ["FLASH_ATTN2_SPLIT_COMBINE"] = "cluster"
for d in (d for d in (64, 128) if _ops.ext.fwd_head_dim_bucket(d, True) == d):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(4, 2, 8, d, **bf16), torch.randn(4, 2, 2, d, **bf16), torch.randn(4, 2, 2, d, **bf16)
    k_cache, v_cache = torch.randn(3, 77, 2, d, **bf16), torch.randn(3, 77, 2, d, **bf16)
    ints = lambda *x: torch.tensor(x, device="cuda", dtype=torch.int32)  # noqa: E731
    for seqlens, idx in ((ints(0, 10, 75, 76), ints(0, 1, 2, 1)), (ints(-5, 76, 2**31 - 1, 40), ints(-1, 2, 99, 0))):
        for causal, window, softcap, alibi, splits in ((False, (-1, -1), 0.0, None, 2), (True, (-1, -1), 0.0, None, 3),
                                                       (False, (5, 3), 30.0, torch.rand(8, device="cuda"), 8),
                                                       (True, (-1, -1), 0.0, None, 13)):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=idx,
                                    causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi,
                                    num_splits=splits, learnable_sink=torch.randn(8, device="cuda") if splits == 3 else None)
    q5 = torch.randn(4, 5, 8, d, **bf16)  # 20 packed rows: the 64-row kernel
    for splits in (3, 16):
        flash_attn_with_kvcache(q5, k_cache, v_cache, cache_seqlens=ints(-5, 76, 2**31 - 1, 40),
                                cache_batch_idx=ints(0, 1, 2, 1), causal=True, num_splits=splits,
                                learnable_sink=torch.randn(8, device="cuda"))
    k_pages, v_pages = torch.randn(20, 7, 2, d, **bf16), torch.randn(20, 7, 2, d, **bf16)
    table = torch.tensor([[3, -1, -1], [10**6, -5, 19], [0, 1, 2], [-1, -1, -1]], device="cuda", dtype=torch.int32)
    for splits in (0, 5):
        flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=ints(3, 20, 2**31 - 1, -4), block_table=table,
                                causal=True, num_splits=splits, learnable_sink=torch.randn(8, device="cuda"))
    for page in (16, 64):  # every chunk on one page (the narrow kernel's one entry a chunk), hostile entries
        k_pages, v_pages = torch.randn(9, page, 2, d, **bf16), torch.randn(9, page, 2, d, **bf16)
        table = torch.tensor([[3, -1, -1], [10**6, -5, 8], [0, 1, 2], [-1, -1, -1]], device="cuda", dtype=torch.int32)
        for splits in (0, 5):
            flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=ints(3, 40, 2**31 - 1, -4), block_table=table,
                                    causal=True, num_splits=splits)
del os.environ["FLASH_ATTN2_SPLIT_COMBINE"]
torch.cuda.synchronize()
print("kvcache, cluster combine: ok")
