# Decode timing (one new token per sequence against a KV cache), the issue #47 cells: flash_attn_with_kvcache
# (heuristic splits and num_splits=1) beside SDPA cuDNN and flash (enable_gqa), bf16. The caches are rotated over
# copies that together pass 256 MB, so L2 holds none of them; each implementation is timed eagerly (launch
# included) and as CUDA-graph replay (the kernels alone), medians over rounds; % of copy: bytes of K + V read
# over the time, against a device copy's read + write bandwidth measured in the same run.
#   python benchmarks/dev/decode_time.py [h,h_k,d] [b,ctx ...]     IMPLS=ours,sdpa_cudnn: only those
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn2 import flash_attn_with_kvcache
from flash_attn2.bench.grid import warm_up_gpu

h, h_k, d = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32,8,128").split(","))
CELLS = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or [
    (1, 1024), (1, 4096), (1, 32768), (1, 131072), (8, 8192), (32, 8192), (64, 4096), (128, 2048), (16, 32768)]
dtype = torch.bfloat16


def copy_bandwidth():
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * a.numel() / (statistics.median(times) * 1e-3) / 1e9  # GB/s, read + write


def timed(fn, copies, graph):
    """Median us per call over rounds; each round runs fn(i) once per copy."""
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(copies):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for i in range(copies):
                fn(i)
        run = g.replay
    else:
        def run():
            for i in range(copies):
                fn(i)
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    reps = max(3, 200 // copies)
    for _ in range(7):
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps / copies)
    return statistics.median(times)


warm_up_gpu(1)
bw = copy_bandwidth()
print(f"# {torch.cuda.get_device_name()}, h {h} h_k {h_k} d {d} bf16; copy {bw:.0f} GB/s (read + write)")
print("impl,batch,ctx,us_eager,us_graph,GB/s,pct_copy")
for batch, ctx in CELLS:
    kv_bytes = 2 * batch * ctx * h_k * d * 2
    copies = max(1, math.ceil(256e6 / kv_bytes))
    if kv_bytes * copies > 60e9:
        continue
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=dtype)
    caches = [(torch.randn(batch, ctx, h_k, d, device="cuda", dtype=dtype),
               torch.randn(batch, ctx, h_k, d, device="cuda", dtype=dtype)) for _ in range(copies)]
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qt = q.transpose(1, 2)
    impls = {
        "ours": lambda i: flash_attn_with_kvcache(q, *caches[i], cache_seqlens=seqlens, causal=True),
        "ours_splits1": lambda i: flash_attn_with_kvcache(q, *caches[i], cache_seqlens=seqlens, causal=True,
                                                          num_splits=1),
    }
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(i, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, caches[i][0].transpose(1, 2), caches[i][1].transpose(1, 2),
                                                      enable_gqa=True)
        try:
            sdpa(0)
            impls[name] = sdpa
        except RuntimeError as e:
            print(f"# {name} b={batch} ctx={ctx}: {str(e).splitlines()[0][:100]}")
    for name, fn in impls.items():
        if os.environ.get("IMPLS") and name not in os.environ["IMPLS"].split(","):
            continue
        try:
            eager = timed(fn, copies, False)
            graph = timed(fn, copies, True)
        except RuntimeError as e:
            print(f"# {name} b={batch} ctx={ctx}: {str(e).splitlines()[0][:100]}")
            continue
        gbs = kv_bytes / (graph * 1e-6) / 1e9
        print(f"{name},{batch},{ctx},{eager:.1f},{graph:.1f},{gbs:.0f},{100 * gbs / bw:.0f}", flush=True)
    del caches
    torch.cuda.empty_cache()
