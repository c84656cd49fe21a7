"""Attention on the memory layouts a Hugging Face Llama hands over (q, k after RoPE contiguous as (b, h, s, d);
v a (b, s, h, d) tensor seen as (b, h, s, d); dout (b, s, h, d)) against contiguous (b, s, h, d) tensors:
flash_attn2 and SDPA-cuDNN, fwd / bwd ms, and each kernel's time per call under the profiler.
    python benchmarks/dev/hf_layout.py [b s h hk d]"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import median_ms, warm_up_gpu

b, s, h, hk, d = (int(x) for x in sys.argv[1:6]) if len(sys.argv) > 5 else (4, 2048, 16, 4, 64)


def inputs(layout):
    def make(heads, hf_rope):
        t = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16)
        if layout == "hf" and hf_rope:  # RoPE's output: contiguous (b, h, s, d), seen as (b, s, h, d)
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        return t.requires_grad_()
    return make(h, True), make(hk, True), make(hk, False)


warm_up_gpu(2)
for layout in ("bshd", "hf"):
    q, k, v = inputs(layout)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)
    for name, fn in (("flash_attn2", lambda: flash_attn_func(q, k, v, causal=True)), ("sdpa_cudnn", cudnn)):
        out = fn()
        bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        def fwd():
            with torch.no_grad():
                fn()
        print(f"{layout:5s} {name:12s} ({b}, {s}, {h}:{hk}, {d}) causal: fwd {median_ms(fwd, reps=30):.3f} "
              f"bwd {median_ms(bwd, reps=30):.3f} ms")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                bwd()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total > 0:
                print(f"      {e.device_time_total / 10:8.1f} us per bwd  {e.key[:90]}")
