# #48's chunked-prefill target: new tokens against a long KV cache, contiguous against paged (random page order),
# causal, bf16, graph replay (flash_attn2.bench.decode's method); TFLOP/s counts the visible (query, key) pairs.
#   python benchmarks/dev/chunked_prefill.py [h,h_k,d] [new,ctx ...]      PAGES="1 16 64 256"
import os
import sys

import torch

from flash_attn2 import flash_attn_with_kvcache
from flash_attn2.bench.decode import paged, time_us
from flash_attn2.bench.grid import warm_up_gpu

shape = sys.argv[1] if len(sys.argv) > 1 else "32,8,128"
heads, heads_k, d = (int(x) for x in shape.split(","))
cells = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or [(2048, 32768), (512, 32768), (2048, 4096)]
pages = [int(p) for p in os.environ.get("PAGES", "1 16 64 256").split()]
warm_up_gpu(1)
print(f"# {torch.cuda.get_device_name()}: h {heads}, h_k {heads_k}, d {d}, batch 1; us (graph replay), TFLOP/s")
for new, ctx in cells:
    total = ctx + new  # the cache holds ctx rows, the call's queries are the next `new` positions
    q = torch.randn(1, new, heads, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, total, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), total, device="cuda", dtype=torch.int32)  # keys already in the cache
    pairs = new * ctx + new * (new + 1) / 2  # causal, bottom-right: query i sees ctx + i + 1 keys
    flops = 4 * pairs * heads * d
    layouts = {"contiguous": (k_cache, v_cache, None)}
    for page in pages:
        layouts[f"page {page}"] = paged(k_cache, v_cache, page)
    times = {}
    for name, (kc, vc, table) in layouts.items():
        times[name] = time_us(lambda i, kc=kc, vc=vc, table=table: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, causal=True, block_table=table), 1, True)
    base = times["contiguous"]
    print(f"{new} new x {ctx} cached: " + ", ".join(
        f"{name} {us:.0f} us ({flops / us / 1e6:.0f} TFLOP/s, x{us / base:.3f})" for name, us in times.items()),
        flush=True)
    del layouts, k_cache, v_cache
    torch.cuda.empty_cache()
