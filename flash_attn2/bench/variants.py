"""What softcap, ALiBi, dropout and attention sinks cost against plain attention, per path, beside SDPA's dropout.

    python -m flash_attn2.bench.variants [--hdims 64 128 256] [--seqlens 4096 16384] [--passes fwd bwd]
                                         [--backends flash_attn2 flash_attn2_sm80 sdpa_flash sdpa_cudnn]

bf16, the FA2 grid's shapes (16k tokens per batch, 2048 / hdim heads), causal and not. At each point
flash_attn2 is timed plain, with softcap=50 (Gemma 2's), with ALiBi (MPT's slopes 2^(-8 (i + 1) / h)), with
both, with dropout_p=0.1, and with a learnable sink per head (trained: its gradient too), in rounds with the order
rotated; flash_attn2_sm80 runs forward and backward on
the SM80 path (skipped where this build or GPU lacks it); SDPA's flash and cuDNN backends run plain and with
dropout (skipped where they cannot). Prints each variant's time over plain's on the same path and appends to
<out_dir>/<gpu>_variants.csv.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..flash_attn_interface import flash_attn_func
from .grid import (FLASH_ATTN2_BACKENDS, HIDDEN, SDPA_BACKENDS, TOKENS, add_run_args, append_csv, on_path,
                   pass_fn, time_interleaved, warm_up_gpu)

COLUMNS = ("gpu", "impl", "variant", "hdim", "causal", "seqlen", "batch", "nheads", "pass", "ms")
SOFTCAP = 50.0
DROPOUT = 0.1
BACKENDS = (*FLASH_ATTN2_BACKENDS, "sdpa_flash", "sdpa_cudnn")


def variant_kwargs(nheads, impl):
    if impl in SDPA_BACKENDS:  # what SDPA has of them
        return {"plain": {}, "dropout": {"dropout_p": DROPOUT}}
    slopes = torch.tensor([2 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device="cuda")
    sinks = torch.randn(nheads, device="cuda", requires_grad=True)  # gpt-oss's: one trained logit per head
    return {"plain": {}, "softcap": {"softcap": SOFTCAP}, "alibi": {"alibi_slopes": slopes},
            "softcap_alibi": {"softcap": SOFTCAP, "alibi_slopes": slopes}, "dropout": {"dropout_p": DROPOUT},
            "sink": {"learnable_sink": sinks}}


def make_run(impl, q, k, v, dout, causal, kwargs, pass_):
    """One timed run of pass_ on impl's path (the backward too) or SDPA backend."""
    if impl in SDPA_BACKENDS:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (b, h, s, d) view of the same memory

        def fn():
            with sdpa_kernel(SDPA_BACKENDS[impl]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kwargs).transpose(1, 2)
    else:
        fn = lambda: flash_attn_func(q, k, v, causal=causal, **kwargs)  # noqa: E731
    return on_path(impl, lambda: pass_fn(fn, pass_, (q, k, v), dout))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    add_run_args(p, reps=10)
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    warm_up_gpu(args.warmup_s)
    rows = []
    for hdim in args.hdims:
        for causal in (c == "true" for c in args.causal):
            for seqlen in args.seqlens:
                batch, nheads = TOKENS // seqlen, HIDDEN // hdim
                q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16,
                                             requires_grad=i < 3) for i in range(4))
                for impl in args.backends:
                    for pass_ in args.passes:
                        runs = {}
                        for name, kwargs in variant_kwargs(nheads, impl).items():
                            try:
                                runs[name] = make_run(impl, q, k, v, dout, causal, kwargs, pass_)
                                runs[name]()
                            except (RuntimeError, NotImplementedError) as e:  # a path this build or GPU lacks
                                runs.pop(name, None)
                                print(f"  {impl} {name} {pass_} skipped: {str(e).splitlines()[0][:120]}")
                        if "plain" not in runs:
                            continue
                        times = time_interleaved(runs, args.reps, args.rounds, args.min_round_ms)
                        for name, ms in times.items():
                            rows.append(dict(gpu=gpu, impl=impl, variant=name, hdim=hdim, causal=causal, seqlen=seqlen,
                                             batch=batch, nheads=nheads, **{"pass": pass_}, ms=f"{ms:.4f}"))
                        plain = times["plain"]
                        print(f"{impl} d={hdim} causal={causal!s:5} s={seqlen:5d} {pass_}: plain {plain:.3f} ms, " +
                              ", ".join(f"{n} x{ms / plain:.3f}" for n, ms in times.items() if n != "plain"))
                del q, k, v, dout
    print(f"appended to {append_csv(rows, args.out_dir, '_variants.csv', COLUMNS)}")
    return rows


if __name__ == "__main__":
    main()
