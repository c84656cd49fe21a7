# One forward call timed: python benchmarks/dev/time_fwd.py HEAD_DIM CAUSAL(0/1) SEQLEN (16k tokens, hidden 2048, bf16).
from flash_attn2 import flash_attn_func
d = int(sys.argv[1]); causal = sys.argv[2] == "1"; s = int(sys.argv[3])
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(5): flash_attn_func(q, k, v, causal=causal)
ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
for a, e in ev:
    a.record(); flash_attn_func(q, k, v, causal=causal); e.record()
torch.cuda.synchronize()
ms = statistics.median(a.elapsed_time(e) for a, e in ev)
print(f"d{d} causal={causal} s={s}: {ms:.3f} ms {4*b*h*s*s*d/(2 if causal else 1)/ms/1e9:.1f} TFLOP/s")
