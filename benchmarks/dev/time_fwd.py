# Points of the FA2 grid (16k tokens, hidden 2048, bf16), timed as the benchmark times them (rounds, order
# rotated) in one process; CUDNN=1 adds sdpa_cudnn on the same inputs; PASS=bwd or fwd_bwd times that pass:
#   python benchmarks/dev/time_fwd.py HEAD_DIM,CAUSAL(0/1),SEQLEN [...]
import os
import sys

import torch

from flash_attn2.benchmark import HIDDEN, TOKENS, flops, make_fn, pass_fn, time_interleaved, warm_up_gpu

warm_up_gpu(2)
pass_ = os.environ.get("PASS", "fwd")
impls = ["flash_attn2"] + (["sdpa_cudnn"] if os.environ.get("CUDNN") else [])
for case in sys.argv[1:]:
    d, causal, s = (int(x) for x in case.split(","))
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=pass_ != "fwd")
               for _ in range(3))
    dout = torch.randn_like(q)
    runs = {impl: pass_fn(make_fn(impl, q, k, v, bool(causal)), pass_, (q, k, v), dout) for impl in impls}
    times = time_interleaved(runs, reps=20)
    for impl, ms in times.items():
        tflops = flops(b, h, s, d, bool(causal), pass_) / ms / 1e9
        name = "" if impl == "flash_attn2" else f" {impl}"
        print(f"d{d} causal={causal} s={s} {pass_}{name}: {ms:.3f} ms {tflops:.1f} TFLOP/s", flush=True)
