"""#48 probe: what a paged batch-1 decode pays over the contiguous cache, split into the kernel's paged path and the
pages' placement. Layouts timed interleaved in one time_runs (graph replay, us): contiguous; `ident<P>`: the same
tensors viewed as pages of P rows with an identity table (the paged code path, the contiguous addresses); `perm<P>`:
pages in random order (the decode suite's paged layout). PAGES="16 64 256": the page sizes.
    python benchmarks/dev/paged_probe.py [h,h_k,d] [b,ctx ...]"""
import math
import os
import sys

import torch

from flash_attn2 import flash_attn_with_kvcache
from flash_attn2.bench.decode import paged, runner, time_runs

shape = sys.argv[1] if len(sys.argv) > 1 else "32,8,128"
cells = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or [(1, 4096), (1, 1024), (8, 4096)]
h, hk, d = (int(x) for x in shape.split(","))
for batch, ctx in cells:
    kv_bytes = 2 * batch * ctx * hk * d * 2
    copies = max(1, math.ceil(256e6 / kv_bytes))
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    caches = [tuple(torch.randn(batch, ctx, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(copies)]
    layouts = {"contig": [(k, v, None) for k, v in caches]}
    for page in [int(x) for x in os.environ.get("PAGES", "16 64 256").split()]:
        if ctx % page:
            continue
        per_seq = ctx // page
        table = torch.arange(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
        layouts[f"ident{page}"] = [(k.view(-1, page, hk, d), v.view(-1, page, hk, d), table) for k, v in caches]
        layouts[f"perm{page}"] = [paged(k, v, page) for k, v in caches]
    runs = {}
    for name, lay in layouts.items():
        fn = lambda i, lay=lay: flash_attn_with_kvcache(q, lay[i][0], lay[i][1], cache_seqlens=lens, causal=True,
                                                          block_table=lay[i][2])
        runs[name] = runner(fn, copies, True)
    ref = flash_attn_with_kvcache(q, caches[0][0], caches[0][1], cache_seqlens=lens, causal=True)
    for name, lay in layouts.items():
        out = flash_attn_with_kvcache(q, lay[0][0], lay[0][1], cache_seqlens=lens, causal=True, block_table=lay[0][2])
        err = (out.float() - ref.float()).abs().max().item()  # split plans may differ by layout: not bitwise
        assert err < 2e-2, (name, err)
    for rnd in range(2):
        t = time_runs(runs, copies, rounds=9)
        base = t["contig"]
        print(f"{h}/{hk} d{d} {batch}x{ctx} round {rnd}: " + "  ".join(f"{k} {v:.2f} ({v / base:.3f})" for k, v in t.items()),
              flush=True)
    del caches, layouts, runs
    torch.cuda.empty_cache()
