# Kernel time against the batch (so the number of tiles) at one (head dim, causal, seqlen): the per-tile cost
# of the forward. PYTHONPATH=. python benchmarks/dev/tiles_sweep.py HEAD_DIM CAUSAL(0/1) SEQLEN
import sys, torch, statistics
from flash_attn2 import flash_attn_func
d, causal, s = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
h = 2048 // d
def t(b):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(5): flash_attn_func(q, k, v, causal=causal)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
    for a, e in ev:
        a.record(); flash_attn_func(q, k, v, causal=causal); e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(e) for a, e in ev) * 1000
for b in (1, 2, 4, 8, 16, 32, 64):
    us = t(b)
    print(f"d{d} causal={causal} s={s} b={b}: {us:8.1f} us  {4*b*h*s*s*d/(2 if causal else 1)/us/1e6:6.1f} TFLOP/s")
