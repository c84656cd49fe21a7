# One flash_attn2 and one sdpa_cudnn forward per case (FA2 grid shapes, bf16) inside the profiler range, for
#   ncu --profile-from-start off --section SpeedOfLight ... python3 benchmarks/dev/ncu_fwd.py D,CAUSAL,S [...]
import sys

import torch

from flash_attn2.benchmark import HIDDEN, TOKENS, make_fn

for case in sys.argv[1:]:
    d, causal, s = (int(x) for x in case.split(","))
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for impl in ("flash_attn2", "sdpa_cudnn"):
        fn = make_fn(impl, q, k, v, bool(causal))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
print("ncu_fwd: ok")
