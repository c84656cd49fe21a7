# #47's batch-1 lever: decode time against the number of key splits, to check fwd_kv_splits' choice (heuristics.h)
# where a call is latency-bound. One new token, bf16, graph replay (flash_attn2.bench.decode's method), the heuristic
# (num_splits=0, its choice printed) beside forced 1..128 splits; PAGES="0 1 16 64": the cache layouts (0 contiguous,
# n pages of n rows in random order), each cell's layouts on the same caches:
#   PAGES="0 1 64" python benchmarks/dev/decode_splits.py [h,h_k,d] [b,ctx ...]
import os
import sys

import torch

from flash_attn2 import _ops, flash_attn_with_kvcache
from flash_attn2.bench.decode import paged, time_us
from flash_attn2.bench.grid import warm_up_gpu

shape = sys.argv[1] if len(sys.argv) > 1 else "32,8,128"
heads, heads_k, d = (int(x) for x in shape.split(","))
cells = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or [
    (1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 131072), (4, 8192), (8, 8192)]
SPLITS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
warm_up_gpu(1)
print(f"# {torch.cuda.get_device_name()}: h {heads}, h_k {heads_k}, d {d}; us per call (graph replay)")
PAGES = [int(p) for p in os.environ.get("PAGES", "0").split()]
print("batch x ctx, page | heuristic (splits) | " + " | ".join(f"{s}" for s in SPLITS[1:]) + " | best")
for batch, ctx in cells:
    copies = max(1, -(-256_000_000 // (2 * batch * ctx * heads_k * d * 2)))  # rotate caches past the L2
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    caches = [tuple(torch.randn(batch, ctx, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(copies)]
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    for page in PAGES:
        layouts = [(kc, vc, None) for kc, vc in caches] if page == 0 else [paged(kc, vc, page) for kc, vc in caches]
        times = {}
        for splits in SPLITS:
            times[splits] = time_us(lambda i, s=splits: flash_attn_with_kvcache(
                q, layouts[i][0], layouts[i][1], cache_seqlens=seqlens, block_table=layouts[i][2], causal=True,
                num_splits=s), copies, True)
        chosen = _ops.ext.kvcache_num_splits(batch, 1, ctx, heads, heads_k, d, True, False, 0, page, False, False)
        best = min(SPLITS[1:], key=times.get)
        print(f"{batch} x {ctx}, {page or 'contiguous'} | {times[0]:.1f} ({chosen}) | " +
              " | ".join(f"{times[s]:.1f}" for s in SPLITS[1:]) + f" | {best}: {times[best]:.1f}", flush=True)
        del layouts
    del caches
    torch.cuda.empty_cache()
