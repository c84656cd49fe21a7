"""Sliding-window attention: what a window costs against full causal attention, and against PyTorch.

    python -m flash_attn2.bench.window [--seqlens 16384 32768] [--windows 4096 1024] [--passes fwd bwd]

Causal, bf16, 16 query heads on 4 kv heads of head dim 128 (a Mistral-style GQA layer), batch 1. At each
(seqlen, window) flash_attn2 with window_size=(window - 1, 0) (the query's own key and the window - 1 before
it, as transformers passes Mistral's sliding_window) is timed beside flash_attn2 full causal and, where
PyTorch has it, torch.nn.attention.varlen.varlen_attn with the same window (PyTorch's only windowed
attention; k and v repeated over the query-head group for it), in rounds with the order rotated. Prints, per
pass, our window time over our causal time scaled by the fraction of (query, key) pairs the window keeps
(1.0: the window costs exactly its share of the work), and PyTorch's time over ours. Appends to
<out_dir>/<gpu>_window.csv.
"""

from __future__ import annotations

import argparse

import torch

from ..flash_attn_interface import flash_attn_func
from .grid import add_run_args, append_csv, pass_fn, time_interleaved, warm_up_gpu

COLUMNS = ("gpu", "impl", "seqlen", "window", "nheads", "nheads_k", "hdim", "pass", "ms", "visible_fraction")
NHEADS, NHEADS_K, HDIM = 16, 4, 128


def visible_fraction(seqlen: int, window: int) -> float:
    """Pairs a causal window of `window` keys (the query's own included) keeps, over full causal's."""
    causal = seqlen * (seqlen + 1) // 2
    inside = sum(min(i + 1, window) for i in range(seqlen)) if window < seqlen else causal
    return inside / causal


def make_runs(q, k, v, window, pass_, dout):
    """{impl: one timed run} for this point: ours windowed and full causal, PyTorch's varlen_attn if present."""
    fns = {"flash_attn2_window": lambda: flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0)),
           "flash_attn2_causal": lambda: flash_attn_func(q, k, v, causal=True)}
    try:
        from torch.nn.attention.varlen import varlen_attn
        b, s = q.shape[:2]
        cu = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
        group = q.shape[2] // k.shape[2]  # k and v repeated over the group, in case varlen_attn lacks GQA
        packed = [t.repeat_interleave(group if t is not q else 1, dim=2).reshape(b * s, q.shape[2], -1) for t in (q, k, v)]
        fns["torch_varlen_window"] = lambda: varlen_attn(*packed, cu, cu, s, s, window_size=(window - 1, 0)).view(q.shape)
    except ImportError:
        pass
    runs = {}
    for impl, fn in fns.items():
        try:
            run = pass_fn(fn, pass_, (q, k, v), dout)
            run()
            runs[impl] = run
        except (RuntimeError, TypeError, NotImplementedError) as e:  # a PyTorch without windows or this shape
            print(f"  {impl} {pass_} skipped: {str(e).splitlines()[0][:120]}")
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--windows", type=int, nargs="+", default=[4096, 1024])
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    add_run_args(p, reps=10)
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    warm_up_gpu(args.warmup_s)
    rows = []
    for seqlen in args.seqlens:
        make = lambda h: torch.randn(1, seqlen, h, HDIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = make(NHEADS), make(NHEADS_K), make(NHEADS_K)
        dout = torch.randn_like(q)
        for window in args.windows:
            frac = visible_fraction(seqlen, window)
            for pass_ in args.passes:
                times = time_interleaved(make_runs(q, k, v, window, pass_, dout), args.reps, args.rounds,
                                         args.min_round_ms)
                for impl, ms in times.items():
                    rows.append(dict(gpu=gpu, impl=impl, seqlen=seqlen, window=window, nheads=NHEADS,
                                     nheads_k=NHEADS_K, hdim=HDIM, **{"pass": pass_}, ms=f"{ms:.4f}",
                                     visible_fraction=f"{frac:.4f}"))
                ours, causal = times["flash_attn2_window"], times["flash_attn2_causal"]
                line = (f"s={seqlen} window={window} {pass_}: ours {ours:.3f} ms, causal {causal:.3f} ms, "
                        f"window / (causal x {frac:.3f}) = {ours / (causal * frac):.3f}")
                if "torch_varlen_window" in times:
                    line += f", torch varlen_attn / ours = {times['torch_varlen_window'] / ours:.2f}"
                print(line)
    print(f"appended to {append_csv(rows, args.out_dir, '_window.csv', COLUMNS)}")
    return rows


if __name__ == "__main__":
    main()
