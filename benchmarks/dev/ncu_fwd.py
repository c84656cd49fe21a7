# One flash_attn2 and one sdpa_cudnn forward per case (FA2 grid shapes, bf16) inside the profiler range, for
#   ncu --profile-from-start off --section SpeedOfLight ... python3 benchmarks/dev/ncu_fwd.py D,CAUSAL,S [...]
# DROPOUT=p: flash_attn2 with dropout_p=p instead of sdpa_cudnn.
import os
import sys

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.bench.grid import HIDDEN, TOKENS, make_fn

DROPOUT = float(os.environ.get("DROPOUT", "0"))

for case in sys.argv[1:]:
    d, causal, s = (int(x) for x in case.split(","))
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for impl in ("flash_attn2", "dropout" if DROPOUT else "sdpa_cudnn"):
        fn = (make_fn(impl, q, k, v, bool(causal)) if impl != "dropout" else
              lambda: flash_attn_func(q, k, v, dropout_p=DROPOUT, causal=bool(causal)))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
print("ncu_fwd: ok")
