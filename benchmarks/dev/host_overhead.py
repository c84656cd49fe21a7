# Host time per attention call (the HF step is host-bound, TUNING 43): flash_attn_func against SDPA (cuDNN and
# flash backends) on a shape small enough that the GPU keeps up with the host, forward alone and forward +
# backward through autograd; the mean over N calls after warm-up, one sync at the end. Then torch.profiler's
# CPU self time by op for one flash_attn2 forward + backward.
#   python benchmarks/dev/host_overhead.py [N]
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn2 import flash_attn_func

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
b, s, h, hk, d = 1, 128, 16, 4, 64
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)


def ours():
    return flash_attn_func(q, k, v, causal=True)


def sdpa(backend):
    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)
    return run


for name, fn in (("flash_attn2", ours), ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
                 ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION))):
    for mode in ("fwd", "fwd+bwd"):
        def call():
            out = fn()
            if mode == "fwd+bwd":
                out.backward(dout)
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(N):
            call()
        host = (time.perf_counter() - t) / N * 1e6
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / N * 1e6
        print(f"{name:12s} {mode:8s} host {host:6.1f} us/call, with the GPU {total:6.1f} us/call")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        ours().backward(dout)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
