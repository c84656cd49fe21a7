# What a causal forward's event time holds besides its kernel: the benchmark's timing (median_ms, events around
# each call) against the kernels' own durations from the profiler, for flash_attn2 (dynamic tile order: a
# 4-byte cudaMemsetAsync of the tile counter before the kernel; FLASH_ATTN2_TILE_ORDER=static: none) and
# sdpa_cudnn, on FA2 grid points (bf16):
#   python benchmarks/dev/launch_gap.py HEAD_DIM,SEQLEN [...]
import os
import statistics
import sys

import torch

from flash_attn2.benchmark import HIDDEN, TOKENS, make_fn, median_ms, warm_up_gpu


def kernel_us(fn, reps=30):
    """{kernel name: median device us per call} over reps calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(e.name[:60], []).append(e.device_time)
    return {name: statistics.median(t) for name, t in times.items()}


warm_up_gpu(2)
for case in sys.argv[1:]:
    d, s = (int(x) for x in case.split(","))
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, impl, order in (("dynamic", "flash_attn2", None), ("static", "flash_attn2", "static"),
                              ("cudnn", "sdpa_cudnn", None)):
        if order:
            os.environ["FLASH_ATTN2_TILE_ORDER"] = order
        fn = make_fn(impl, q, k, v, True)
        ms = statistics.median(median_ms(fn, reps=50) for _ in range(3))
        kernels = kernel_us(fn)
        os.environ.pop("FLASH_ATTN2_TILE_ORDER", None)
        parts = ", ".join(f"{n} {t:.1f}" for n, t in kernels.items())
        print(f"d{d} causal s={s} {name}: event {ms * 1000:.1f} us; kernels (us): {parts}", flush=True)
