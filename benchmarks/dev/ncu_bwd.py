# One flash_attn2 backward per case (bf16; FA2 grid shapes, or a GQA shape; WINDOW > 0: causal with
# window_size=(WINDOW - 1, 0)); IMPL=sdpa_cudnn (or another benchmark impl): that one's instead, windows aside; SK:
# keys of another length than the queries' (the ring's tall blocks: SK=65536 with S 131072); for
#   ncu -k regex:bwd_kernel_sm90 -c N ... python3 benchmarks/dev/ncu_bwd.py D,CAUSAL,S[,H,H_KV,BATCH[,WINDOW]] [...]
import os
import sys

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.bench.grid import HIDDEN, TOKENS, make_fn

for case in sys.argv[1:]:
    fields = [int(x) for x in case.split(",")]
    d, causal, s = fields[:3]
    h, h_kv, b = fields[3:6] if len(fields) > 3 else (HIDDEN // d, HIDDEN // d, TOKENS // s)
    window = (fields[6] - 1, 0) if len(fields) > 6 else (-1, -1)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sk = int(os.environ.get("SK", s))
    k, v = (torch.randn(b, sk, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    impl = os.environ.get("IMPL", "flash_attn2")
    if impl == "flash_attn2":
        out = flash_attn_func(q, k, v, causal=bool(causal), window_size=window)
    else:
        out = make_fn(impl, q, k, v, bool(causal))()
    out.backward(torch.randn_like(out))
