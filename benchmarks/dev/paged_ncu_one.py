"""One decode call (batch 1 x CTX, 32 / 8, d 128) on LAYOUT (contig, ident<P>, perm<P>), for ncu: two warm calls,
then the profiled one (ncu --launch-skip)."""
import os

import torch

from flash_attn2 import flash_attn_with_kvcache
from flash_attn2.bench.decode import paged

ctx, lay = int(os.environ.get("CTX", 4096)), os.environ.get("LAYOUT", "contig")
q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, ctx, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
table = None
if lay.startswith("ident"):
    p = int(lay[5:])
    k, v, table = k.view(-1, p, 8, 128), v.view(-1, p, 8, 128), torch.arange(ctx // p, device="cuda", dtype=torch.int32)[None]
elif lay.startswith("perm"):
    k, v, table = paged(k, v, int(lay[4:]))
for _ in range(3):
    flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, block_table=table)
torch.cuda.synchronize()
