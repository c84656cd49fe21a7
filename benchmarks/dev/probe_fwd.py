# Why a point times differently in a loop than alone: flash_attn2 and sdpa_cudnn at one FA2-grid point
# (bf16), cold, after a warm-up, queued back to back and synchronized per call.
#   python benchmarks/dev/probe_fwd.py D,CAUSAL,S
import statistics
import sys
import time

import torch

from flash_attn2.benchmark import HIDDEN, TOKENS, make_fn, median_ms, warm_up_gpu

d, causal, s = (int(x) for x in sys.argv[1].split(","))
b, h = TOKENS // s, HIDDEN // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
fns = {impl: make_fn(impl, q, k, v, bool(causal)) for impl in ("flash_attn2", "sdpa_cudnn")}


def isolated_ms(fn, reps=30):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(label):
    for impl, fn in fns.items():
        print(f"{label:>10} {impl:>12}: loop {median_ms(fn):.4f} ms, isolated {isolated_ms(fn):.4f} ms", flush=True)


report("cold")
warm_up_gpu(3)
report("warm")
time.sleep(2)
report("rested 2s")
