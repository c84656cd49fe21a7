"""Why our 7-split backward (Qwen2.5-7B 8k) runs 7-8% slower interleaved with cuDNN than alone (TUNING 116): times our
backward when each run follows, back to back on the stream, one run of a filler, and reports the median of our runs
only (CUDA events around ours). Fillers: none; cuDNN's backward (the suite's case); a bf16 matmul of about the same
time (power and clocks, no attention state); a sleep of that time (an idle GPU cools); a 1 GB copy (the L2 flushed,
DRAM busy, low tensor-core power). Llama-3-8B 8k (no splits) as the control. CASES="h,h_kv ..." (b 4, s 8192, d 128).
cuDNN's backward is timed after the same fillers, and nvidia-smi's SM clock and power (50 ms samples) are averaged
over each timing, so that a clock effect shows as both sides moving together.
"""
import os
import statistics
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import median_ms, warm_up_gpu


def time_after(filler, timed, reps=20, warmup=3):
    """timed()'s median time over reps, each run right after one filler()."""
    for _ in range(warmup):
        filler()
        timed()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        filler()
        start.record()
        timed()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


SAMPLES = []  # (time, SM MHz, W)


def sample_clocks():
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    for line in smi.stdout:
        mhz, watts = (float(x) for x in line.split(","))
        SAMPLES.append((time.time(), mhz, watts))


def clocks_during(fn):
    """fn()'s result, with the mean SM clock and power over its run (the fillers' included)."""
    t0 = time.time()
    result = fn()
    window = [(m, w) for t, m, w in SAMPLES if t0 <= t <= time.time()]
    if not window:
        return result, float("nan"), float("nan")
    return result, statistics.mean(m for m, _ in window), statistics.mean(w for _, w in window)


threading.Thread(target=sample_clocks, daemon=True).start()


warm_up_gpu(2)
for case in os.environ.get("CASES", "28,4 32,8").split():
    h, h_kv = (int(x) for x in case.split(","))
    q = torch.randn(4, 8192, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(4, 8192, h_kv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)

    def ours():
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_cudnn = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.autograd.grad(o_cudnn, (q, k, v), dot, retain_graph=True)

    target = median_ms(cudnn, warmup=1, reps=10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmuls = max(1, round(target / median_ms(lambda: a @ a, warmup=1, reps=10)))
    src = torch.empty(2 ** 29, device="cuda", dtype=torch.int16)  # 1 GB
    dst = torch.empty_like(src)
    copies = max(1, round(target / median_ms(lambda: dst.copy_(src), warmup=1, reps=10)))
    cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz: cycles per ms at the nominal clock
    fillers = {
        "none": lambda: None,
        "cudnn bwd": cudnn,
        f"matmul x{matmuls}": lambda: [a @ a for _ in range(matmuls)],
        "sleep": lambda: torch.cuda._sleep(int(target * cycles_per_ms)),
        f"1 GB copy x{copies}": lambda: [dst.copy_(src) for _ in range(copies)],
    }
    for rnd in range(2):  # two rounds, the fillers' order reversed in the second
        names = list(fillers) if rnd == 0 else list(fillers)[::-1]
        for name in names:
            t_ours, mhz_ours, w_ours = clocks_during(lambda: time_after(fillers[name], ours))
            t_cudnn, mhz_cudnn, w_cudnn = clocks_during(lambda: time_after(fillers[name], cudnn))
            print(f"h {h}:{h_kv} round {rnd} after {name:16s}: ours {t_ours:.3f} ms ({mhz_ours:.0f} MHz, {w_ours:.0f} W)"
                  f" cuDNN {t_cudnn:.3f} ms ({mhz_cudnn:.0f} MHz, {w_cudnn:.0f} W) ours/cuDNN time {t_ours / t_cudnn:.3f}",
                  flush=True)
    del q, k, v, do, out, o_cudnn, a, src, dst
    torch.cuda.empty_cache()
