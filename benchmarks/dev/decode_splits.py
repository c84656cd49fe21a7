# #47's batch-1 lever: decode time against the number of key splits, to check fwd_kv_splits' choice (heuristics.h)
# where a call is latency-bound. One new token, bf16, graph replay (flash_attn2.bench.decode's method), the heuristic
# (num_splits=0, its choice printed) beside forced 1..128 splits:
#   python benchmarks/dev/decode_splits.py [h,h_k,d] [b,ctx ...]
import sys

import torch

from flash_attn2 import _ops, flash_attn_with_kvcache
from flash_attn2.bench.decode import time_us
from flash_attn2.bench.grid import warm_up_gpu

shape = sys.argv[1] if len(sys.argv) > 1 else "32,8,128"
heads, heads_k, d = (int(x) for x in shape.split(","))
cells = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or [
    (1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 131072), (4, 8192), (8, 8192)]
SPLITS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
warm_up_gpu(1)
print(f"# {torch.cuda.get_device_name()}: h {heads}, h_k {heads_k}, d {d}; us per call (graph replay)")
print("batch x ctx | heuristic (splits) | " + " | ".join(f"{s}" for s in SPLITS[1:]) + " | best")
for batch, ctx in cells:
    copies = max(1, -(-256_000_000 // (2 * batch * ctx * heads_k * d * 2)))  # rotate caches past the L2
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    caches = [tuple(torch.randn(batch, ctx, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(copies)]
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    times = {}
    for splits in SPLITS:
        times[splits] = time_us(lambda i, s=splits: flash_attn_with_kvcache(q, *caches[i], cache_seqlens=seqlens,
                                                                            causal=True, num_splits=s), copies, True)
    chosen = _ops.ext.kvcache_num_splits(batch, 1, ctx, heads, heads_k, d, True, False, 0, 0, False, False)
    best = min(SPLITS[1:], key=times.get)
    print(f"{batch} x {ctx} | {times[0]:.1f} ({chosen}) | " + " | ".join(f"{times[s]:.1f}" for s in SPLITS[1:]) +
          f" | {best}: {times[best]:.1f}", flush=True)
    del caches
    torch.cuda.empty_cache()
