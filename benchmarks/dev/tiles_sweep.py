# Kernel time against the batch (so the number of tiles) at one (head dim, causal, seqlen): the per-tile cost
# of the forward.  python benchmarks/dev/tiles_sweep.py HEAD_DIM CAUSAL(0/1) SEQLEN
import sys

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.bench.grid import HIDDEN, flops, median_ms

d, causal, s = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
h = HIDDEN // d
for b in (1, 2, 4, 8, 16, 32, 64):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    us = median_ms(lambda: flash_attn_func(q, k, v, causal=causal)) * 1000
    print(f"d{d} causal={causal} s={s} b={b}: {us:8.1f} us  {flops(b, h, s, d, causal, 'fwd') / us / 1e6:6.1f} TFLOP/s")
