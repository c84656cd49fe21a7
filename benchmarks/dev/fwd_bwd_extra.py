# Why ours pays 0.3-0.9 ms more in fwd_bwd than fwd_train + bwd at 8k-32k (cuDNN about 0): per pass, event time
# per call against the sum of its kernels' times (torch.profiler), kernel by kernel; an SM-clock read after each.
#   python benchmarks/dev/fwd_bwd_extra.py [b s h h_kv d]
# The default shape is Qwen2.5-7B 8k's: run in several fresh processes it also shows a process's level (TUNING 89).
import subprocess
import sys

import torch

from bwd_breakdown import kernel_ms  # this directory is the script's: on sys.path
from flash_attn2.bench.grid import make_fn, median_ms, pass_fn, warm_up_gpu

b, s, h, h_kv, d = (int(x) for x in sys.argv[1:6]) if len(sys.argv) > 5 else (4, 8192, 28, 4, 128)
warm_up_gpu(2)
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
dout = torch.randn_like(q)


def clock():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


for rnd in range(2):
    for impl in ("flash_attn2", "sdpa_cudnn"):
        fn = make_fn(impl, q, k, v, True)
        for pass_ in ("fwd_train", "bwd", "fwd_bwd"):
            run = fn if pass_ == "fwd_train" else pass_fn(fn, pass_, (q, k, v), dout)
            ms = median_ms(run, reps=10)
            per = kernel_ms(run, 5, width=48)
            total = sum(per.values())
            top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
            print(f"{impl:12s} {pass_:9s} event {ms:7.3f} kernels {total:7.3f} [{clock()}] :: "
                  + "; ".join(f"{n} {t:.3f}" for n, t in top), flush=True)
