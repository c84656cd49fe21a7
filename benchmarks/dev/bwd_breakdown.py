# Where a backward's time goes, kernel by kernel (torch.profiler): ours (preprocess, main kernel, dQ
# conversion, ...) beside sdpa_cudnn's on the same FA2-grid inputs (16k tokens, hidden 2048, bf16).
#   python benchmarks/dev/bwd_breakdown.py HEAD_DIM,CAUSAL(0/1),SEQLEN [...]
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn2.benchmark import HIDDEN, TOKENS, make_fn, warm_up_gpu

warm_up_gpu(2)
REPS = 10
for case in sys.argv[1:]:
    d, causal, s = (int(x) for x in case.split(","))
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    for impl in ("flash_attn2", "sdpa_cudnn"):
        out = make_fn(impl, q, k, v, bool(causal))()
        for _ in range(3):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
        per_kernel = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[e.name[:90]] += e.device_time / REPS / 1000  # ms per backward
        total = sum(per_kernel.values())
        print(f"d{d} causal={causal} s={s} {impl}: {total:.3f} ms per backward")
        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {ms:8.3f} ms {100 * ms / total:5.1f}%  {name}")
