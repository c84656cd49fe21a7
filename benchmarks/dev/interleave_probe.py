"""Why our 7-split backward (Qwen2.5-7B 8k) runs 7-8% slower interleaved with cuDNN than alone (TUNING 116): times our
backward when each run follows, back to back on the stream, one run of a filler, and reports the median of our runs
only (CUDA events around ours). Fillers: none; cuDNN's backward (the suite's case); a bf16 matmul of about the same
time (power and clocks, no attention state); a sleep of that time (an idle GPU cools); a 1 GB copy (the L2 flushed,
DRAM busy, low tensor-core power). Llama-3-8B 8k (no splits) as the control. CASES="h,h_kv ..." (b 4, s 8192, d 128).
"""
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import warm_up_gpu


def ours_after(filler, ours, reps=20, warmup=3):
    for _ in range(warmup):
        filler()
        ours()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        filler()
        start.record()
        ours()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def kernel_ms(fn, reps=10):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


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

    target = kernel_ms(cudnn)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmuls = max(1, round(target / kernel_ms(lambda: a @ a)))
    src = torch.empty(2 ** 29, device="cuda", dtype=torch.int16)  # 1 GB
    dst = torch.empty_like(src)
    copies = max(1, round(target / kernel_ms(lambda: dst.copy_(src))))
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
            print(f"h {h}:{h_kv} round {rnd}: ours after {name:16s} {ours_after(fillers[name], ours):.3f} ms "
                  f"(cuDNN bwd alone {target:.3f} ms)", flush=True)
    del q, k, v, do, out, o_cudnn, a, src, dst
    torch.cuda.empty_cache()
