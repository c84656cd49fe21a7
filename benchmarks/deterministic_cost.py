"""The deterministic backward's cost: its time over the default's, bf16, on the benchmark grid's shapes
(batch * seqlen = 16k tokens, hidden 2048), a few-heads case where the SM80 splits cannot fill the GPU, and
two GQA model shapes at 8k. Deterministic mode on the default path (on an sm_90 GPU the Hopper backward's
key-block-ordered dQ adds) and, on an sm_90 GPU, on the SM80 backward too (FLASH_ATTN2_BACKEND=sm80, its split
dQ accumulators).

    python benchmarks/deterministic_cost.py
"""

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.bench.grid import HEAD_DIMS, HIDDEN, TOKENS, forward_backend, median_ms, pass_fn


def shapes():
    """(batch, seqlen, heads, kv heads, head dim, causal)."""
    for hdim in HEAD_DIMS:
        for causal in (False, True):
            for seqlen in (1024, 4096, 16384):
                yield TOKENS // seqlen, seqlen, HIDDEN // hdim, HIDDEN // hdim, hdim, causal
    for causal in (False, True):
        yield 1, 16384, 2, 2, 128, causal
    yield 1, 8192, 32, 8, 128, True  # Llama-3-8B
    yield 1, 8192, 28, 4, 128, True  # Qwen2.5-7B


def main():
    hopper = torch.cuda.get_device_capability() == (9, 0)
    modes = [("default", False, None), ("deterministic", True, None)]
    if hopper:
        modes.append(("deterministic sm80", True, "sm80"))
    for batch, seqlen, heads, heads_k, hdim, causal in shapes():
        q, k, v, dout = (torch.randn(batch, seqlen, heads if i in (0, 3) else heads_k, hdim, device="cuda",
                                     dtype=torch.bfloat16, requires_grad=i < 3) for i in range(4))
        ms = {}
        for mode in list(modes):
            name, deterministic, backend = mode
            with forward_backend(backend):  # read by the backward too; the caller's setting comes back after
                fn = lambda: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)  # noqa: E731
                try:
                    ms[name] = median_ms(pass_fn(fn, "bwd", (q, k, v), dout), reps=20)
                except NotImplementedError as e:  # the SM80 path left out of a default build
                    print(f"{name}: skipped ({e})")
                    modes.remove(mode)
        times = ", ".join(f"{name} {t:.3f} ms (x{t / ms['default']:.2f})" for name, t in ms.items())
        print(f"b={batch} s={seqlen} h={heads}:{heads_k} d={hdim} causal={causal}: {times}")


if __name__ == "__main__":
    main()
