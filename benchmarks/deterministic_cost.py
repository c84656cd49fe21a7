"""The deterministic backward's cost: its time over the default's, bf16, on the benchmark grid's shapes
(batch * seqlen = 16k tokens, hidden 2048) plus a few-heads case where the splits cannot fill the GPU.

    python benchmarks/deterministic_cost.py
"""

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import HEAD_DIMS, HIDDEN, TOKENS, median_ms, pass_fn


def shapes():
    for hdim in HEAD_DIMS:
        for causal in (False, True):
            for seqlen in (1024, 4096, 16384):
                yield TOKENS // seqlen, seqlen, HIDDEN // hdim, hdim, causal
    for causal in (False, True):
        yield 1, 16384, 2, 128, causal


def main():
    for batch, seqlen, nheads, hdim, causal in shapes():
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16,
                                     requires_grad=i < 3) for i in range(4))
        ms = {}
        for deterministic in (False, True):
            fn = lambda: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
            ms[deterministic] = median_ms(pass_fn(fn, "bwd", (q, k, v), dout), reps=20)
        print(f"b={batch} s={seqlen} h={nheads} d={hdim} causal={causal}: default {ms[False]:.3f} ms, "
              f"deterministic {ms[True]:.3f} ms, x{ms[True] / ms[False]:.2f}")


if __name__ == "__main__":
    main()
