# Where a backward's time goes, kernel by kernel (torch.profiler): ours (preprocess, main kernel, dQ
# conversion, ...) beside sdpa_cudnn's on the same inputs, bf16: the FA2 grid's (16k tokens, hidden 2048), or
# a given batch and heads (GQA). WINDOW=w: ours with window_size=(w - 1, 0) beside ours without (cuDNN takes no
# window), to split a windowed backward's cost into the main kernel and the passes that scale with seqlen. LAYOUT=hf lays q and k out as a Hugging Face Llama hands them over after RoPE
# (contiguous as (b, h, s, d), seen as (b, s, h, d)).
#   python benchmarks/dev/bwd_breakdown.py HEAD_DIM,CAUSAL(0/1),SEQLEN[,BATCH,HEADS,KV_HEADS] [...]
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn2 import flash_attn_func
from flash_attn2.bench.grid import HIDDEN, TOKENS, make_fn, warm_up_gpu


def inputs(b, s, heads, d):
    t = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16)
    if os.environ.get("LAYOUT") == "hf":
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.requires_grad_()


def kernel_ms(run, reps, width=90):
    """{kernel name (its first `width` characters): ms per call} over `reps` calls of run, under torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:width]] += e.device_time / reps / 1000
    return per_kernel


if __name__ == "__main__":
    warm_up_gpu(2)
    REPS = 10
    for case in sys.argv[1:]:
        d, causal, s, *shape = (int(x) for x in case.split(","))
        b, h, hk = shape if shape else (TOKENS // s, HIDDEN // d, HIDDEN // d)
        q, k = inputs(b, s, h, d), inputs(b, s, hk, d)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)
        window = int(os.environ.get("WINDOW", "0"))
        for impl in ("flash_attn2_window", "flash_attn2") if window else ("flash_attn2", "sdpa_cudnn"):
            if impl == "flash_attn2_window":
                out = flash_attn_func(q, k, v, causal=bool(causal), window_size=(window - 1, 0))
            else:
                out = make_fn(impl, q, k, v, bool(causal))()
            for _ in range(3):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
            per_kernel = kernel_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), REPS)
            total = sum(per_kernel.values())
            print(f"d{d} causal={causal} s={s} b={b} h={h}:{hk} {impl}: {total:.3f} ms per backward")
            for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]:
                print(f"    {ms:8.3f} ms {100 * ms / total:5.1f}%  {name}")
