"""Host overhead of one attention call, Python included: flash_attn2 next to PyTorch's SDPA backends.

    python benchmarks/host_overhead.py [--calls 100] [--repeats 50] [--seqlen 128]

On a tiny shape (default b=1, s=128, h=8, d=64, bf16) the kernels take a few microseconds, so back-to-back
calls timed with a host clock measure what the host spends per call: argument checks, dispatch, autograd
bookkeeping, allocation and the launch. Each row is the median over `repeats` loops of `calls` calls (the
device is synchronized between loops, outside the timing), with the GPU time per call from CUDA events
beside it: while the GPU time stays below the host time, the host time is the overhead.

SDPA is called as a user holding flash-attn's (batch, seqlen, heads, dim) tensors would (transposed views),
and on native (batch, heads, seqlen, dim) tensors; flash_attn2 takes (batch, seqlen, heads, dim).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def per_call(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(median host microseconds per call, median GPU microseconds per call)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) / calls * 1e6)
        gpu.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(host), statistics.median(gpu)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)

    from flash_attn2 import flash_attn_func

    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    dout = torch.randn_like(q)
    calls = {
        "flash_attn2": lambda q, k, v: flash_attn_func(q, k, v),
        "sdpa (b,s,h,d) views": lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
        "sdpa (b,h,s,d) native": F.scaled_dot_product_attention,
    }
    native = {"sdpa (b,h,s,d) native"}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape (b, s, h, d) = {shape} bf16; "
          f"median of {args.repeats} x {args.calls} calls, microseconds per call (host / GPU)")
    print(f"{'call':24} {'backend':8} {'forward, no grad':>18} {'forward, grad':>18} {'forward+backward':>18}")
    for backend in ("flash", "cudnn"):
        sdpa_backend = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
        for name, fn in calls.items():
            if name == "flash_attn2" and backend != "flash":
                continue
            inputs = (qn, kn, vn) if name in native else (q, k, v)
            leaves = [t.detach().requires_grad_() for t in inputs]
            grad_out = dout.transpose(1, 2).contiguous() if name in native else dout

            def no_grad():
                with torch.no_grad():
                    fn(*inputs)

            def train_forward():
                fn(*leaves)

            def train_step():
                fn(*leaves).backward(grad_out)

            cells = []
            with sdpa_kernel(sdpa_backend):
                for step in (no_grad, train_forward, train_step):
                    host, gpu = per_call(step, args.calls, args.repeats)
                    cells.append(f"{host:8.1f} / {gpu:6.1f}")
            label = "-" if name == "flash_attn2" else backend
            print(f"{name:24} {label:8} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}")


if __name__ == "__main__":
    main()
