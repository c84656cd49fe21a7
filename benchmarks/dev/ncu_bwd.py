# One flash_attn2 backward per case (FA2 grid shapes, bf16), for
#   ncu -k regex:bwd_kernel_sm90 -c N ... python3 benchmarks/dev/ncu_bwd.py D,CAUSAL,S [...]
import sys

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import HIDDEN, TOKENS

for case in sys.argv[1:]:
    d, causal, s = (int(x) for x in case.split(","))
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=bool(causal))
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
print("ncu_bwd: ok")
