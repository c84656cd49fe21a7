# One forward point of the FA2 grid (16k tokens, hidden 2048, bf16), timed as the benchmark times it:
#   python benchmarks/dev/time_fwd.py HEAD_DIM CAUSAL(0/1) SEQLEN
import sys

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import HIDDEN, TOKENS, flops, median_ms

d, causal, s = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
b, h = TOKENS // s, HIDDEN // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
ms = median_ms(lambda: flash_attn_func(q, k, v, causal=causal))
print(f"d{d} causal={causal} s={s}: {ms:.3f} ms {flops(b, h, s, d, causal, 'fwd') / ms / 1e9:.1f} TFLOP/s")
