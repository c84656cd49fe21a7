"""Host overhead of one attention call, Python included: flash_attn2 next to PyTorch's SDPA backends.

    python benchmarks/host_overhead.py [--calls 100] [--repeats 50] [--seqlen 128]

On a tiny shape (default b=1, s=128, h=8, d=64, bf16) the kernels take a few microseconds, so back-to-back
calls timed with a host clock measure what the host spends per call: argument checks, dispatch, autograd
bookkeeping, allocation and the launch. Each cell is the median over `repeats` loops of `calls` calls, the
loops of all rows alternating (the device is synchronized between loops, outside the timing), with the GPU
time per call from CUDA events beside it: the GPU waits for the host while the two are equal.

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


def time_loop(fn, backend, calls: int) -> tuple[float, float]:
    """(host microseconds per call, GPU microseconds per call) of one loop of `calls` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with sdpa_kernel(backend):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6, start.elapsed_time(end) / calls * 1e3


def per_call(fns: dict, calls: int, repeats: int) -> dict:
    """name -> (median host us per call, median GPU us per call) for fns: name -> (fn, SDPA backend). The
    loops of all fns alternate, so a drift of the host's speed during the run reaches every row alike."""
    for fn, backend in fns.values():
        time_loop(fn, backend, 10)
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, backend) in fns.items():
            samples[name].append(time_loop(fn, backend, calls))
    return {name: (statistics.median(h for h, _ in s), statistics.median(g for _, g in s)) for name, s in samples.items()}


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
    rows = {}  # (name, backend) -> {step: fn}
    for backend, sdpa_backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for name, fn in calls.items():
            if name == "flash_attn2" and backend != "flash":
                continue
            inputs = (qn, kn, vn) if name in native else (q, k, v)
            leaves = [t.detach().requires_grad_() for t in inputs]
            grad_out = dout.transpose(1, 2).contiguous() if name in native else dout

            def no_grad(fn=fn, inputs=inputs):
                with torch.no_grad():
                    fn(*inputs)

            rows[(name, backend)] = {
                "no_grad": (no_grad, sdpa_backend),
                "grad": (lambda fn=fn, leaves=leaves: fn(*leaves), sdpa_backend),
                "step": (lambda fn=fn, leaves=leaves, g=grad_out: fn(*leaves).backward(g), sdpa_backend),
            }
    results = {step: per_call({key: row[step] for key, row in rows.items()}, args.calls, args.repeats)
               for step in ("no_grad", "grad", "step")}
    for key in rows:
        cells = [f"{results[step][key][0]:8.1f} / {results[step][key][1]:6.1f}" for step in ("no_grad", "grad", "step")]
        label = "-" if key[0] == "flash_attn2" else key[1]
        print(f"{key[0]:24} {label:8} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}")


if __name__ == "__main__":
    main()
