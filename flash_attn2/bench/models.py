"""flash_attn2 against PyTorch on the attention of real models: causal, GQA, bf16, and packed varlen batches.

    python -m flash_attn2.bench.models [--seqlens 2048 8192 32768] [--tokens 32768] [--passes fwd fwd_train]

Each (model, seqlen) point runs batch = tokens // seqlen sequences; a "packed" point runs documents of mixed
lengths summing to `tokens`, as one varlen batch (PyTorch's own varlen attention beside it where it runs).
SDPA gets (b, h, s, d) views of the same tensors and enable_gqa=True (a backend that rejects it runs on k/v
repeated to q's heads beforehand, outside the timing; the log says so). `fwd` times the forward with grad
disabled; `fwd_train` with grad enabled (SDPA's kernels then also write the LSE, as ours always do).
At every point the implementations are timed in rounds, their order rotated (CUDA events; the median run of
a round, the median round).
Writes <out_dir>/<gpu>_models.csv (the FA2 grid's columns plus shape and nheads_k) and a PNG plot.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from .grid import (FLASH_ATTN2_BACKENDS, SDPA_BACKENDS, add_run_args, on_path, pass_fn, run_context, save,
                   time_interleaved, warm_up_gpu)

# name: (query heads, key/value heads, head dim)
MODELS = {
    "llama3.2-1b": (32, 8, 64),
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "llama3-70b-tp8": (8, 1, 128),
    "gemma2-9b": (16, 8, 256),
    "mistral-7b": (32, 8, 128),
    "gemma2-9b-local": (16, 8, 256),
    "gemma2-9b-global": (16, 8, 256),
    "deepseek-v3-tp8": (16, 16, 192),  # MLA: 128 heads over 8 GPUs; v's head dim in V_HEAD_DIMS
}
# Models whose value heads are narrower than their query / key heads (MLA: DeepSeek-V3 trains with 192 / 128).
V_HEAD_DIMS = {"deepseek-v3-tp8": 128}
# The models' other attention features: Mistral's sliding window; Gemma 2's logit softcap on every layer and
# its 4096-key window on alternate (local) layers. PyTorch has no softcap; only its varlen attention takes a
# window, so SDPA sits these out (and varlen_attn the softcapped ones).
FEATURES = {
    "mistral-7b": dict(window=4096),
    "gemma2-9b-local": dict(window=4096, softcap=50.0),
    "gemma2-9b-global": dict(softcap=50.0),
}
SEQLENS = (2048, 8192, 32768)
TOKENS = 32768
# Document lengths of one packed batch (a fixed mix of long and short), repeated or cut to `tokens`.
PACKED_DOCS = (8192, 1000, 3000, 517, 4096, 64, 2500, 7000, 1200, 300, 2048, 900, 1011, 140)
PASSES = ("fwd", "fwd_train", "bwd", "fwd_bwd")
IMPLS = (*FLASH_ATTN2_BACKENDS, *SDPA_BACKENDS, "torch_varlen")
COLUMNS = ("gpu", "impl", "shape", "dtype", "hdim", "causal", "seqlen", "batch", "nheads", "nheads_k", "pass", "ms",
           "tflops")


def packed_lengths(tokens: int) -> list[int]:
    lengths, total = [], 0
    while total < tokens:
        length = min(PACKED_DOCS[len(lengths) % len(PACKED_DOCS)], tokens - total)
        lengths.append(length)
        total += length
    return lengths


def causal_flops(lengths, nheads, hdim, pass_, window=None, hdim_v=None):
    """FA2's count, halved for causal: 4 * h * s^2 * d / 2 per sequence (a causal window of w keys: 4 * h * d
    per visible pair); backward 2.5x. With v's own head dim, 2 * h * s^2 * (d + d_v) / 2 (Q K^T and P V)."""
    def pairs2(s):  # twice the visible pairs, s^2 for plain causal as FA2 counts it
        return s * s if window is None or window >= s else 2 * (window * (window + 1) // 2 + (s - window) * window)
    width = hdim if hdim_v is None else (hdim + hdim_v) / 2
    fwd = sum(2 * nheads * pairs2(s) * width for s in lengths)
    return {"fwd": fwd, "fwd_train": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[pass_]


def make_run(impl, fn, inputs, pass_, dout):
    """What one timed run does for `pass_`: the grid's passes, plus the forward with grad enabled; on impl's
    path, the backward too."""
    return on_path(impl, lambda: fn if pass_ == "fwd_train" else pass_fn(fn, pass_, inputs, dout))


def causal_window(features):
    """window_size for a model's FEATURES under causal: a window of w keys is (w - 1, 0), none (-1, 0)."""
    return (features["window"] - 1 if "window" in features else -1, 0)


def ours_kwargs(features):
    """flash_attn2's arguments for a model's FEATURES."""
    kwargs = {"softcap": features.get("softcap", 0.0)}
    if "window" in features:
        kwargs["window_size"] = causal_window(features)
    return kwargs


def dense_fn(impl, q, k, v, expand_kv=False, features=None):
    """(fn, the tensors to differentiate), or None. expand_kv: SDPA on k/v repeated to q's heads beforehand
    (outside the timing), for a backend that rejects enable_gqa."""
    features = features or {}
    if impl in FLASH_ATTN2_BACKENDS:
        kwargs = ours_kwargs(features)  # its path: make_run
        return (lambda: flash_attn_func(q, k, v, causal=True, **kwargs)), (q, k, v)
    if impl == "torch_varlen" and features and "softcap" not in features:  # a window: varlen_attn on the batch
        b, s = q.shape[:2]
        cu = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
        made = varlen_fn(impl, *(t.flatten(0, 1) for t in (q, k, v)), cu, s, features)
        return None if made is None else ((lambda: made[0]().view(q.shape)), (q, k, v))
    if impl not in SDPA_BACKENDS or features:
        return None
    if expand_kv:
        group = q.shape[2] // k.shape[2]
        k, v = (t.detach().repeat_interleave(group, dim=2).requires_grad_(t.requires_grad) for t in (k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPA_BACKENDS[impl]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=not expand_kv).transpose(1, 2)
    return sdpa, (q, k, v)


def varlen_fn(impl, q, k, v, cu, max_len, features=None):
    features = features or {}
    if impl in FLASH_ATTN2_BACKENDS:
        kwargs = ours_kwargs(features)  # its path: make_run
        return (lambda: flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, **kwargs)), (q, k, v)
    if impl == "torch_varlen" and "softcap" not in features and v.shape[-1] == q.shape[-1]:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        window = causal_window(features)
        return (lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window)), (q, k, v)
    return None


def run_models(models, seqlens, tokens, impls, passes, reps, rounds=3, log=print, min_round_ms=0.0):
    gpu = torch.cuda.get_device_name()
    dtype = torch.bfloat16
    rows = []
    for shape in models:
        nheads, nheads_k, hdim = MODELS[shape]
        hdim_v = V_HEAD_DIMS.get(shape, hdim)
        features = FEATURES.get(shape, {})
        points = [(s, [s] * max(1, tokens // s)) for s in seqlens] + [("packed", packed_lengths(tokens))]
        for seqlen, lengths in points:
            grad = any(p in ("bwd", "fwd_bwd") for p in passes)
            packed = seqlen == "packed"
            total, batch = sum(lengths), len(lengths)
            make = lambda h, *lead, d=hdim: torch.randn(*lead, h, d, device="cuda", dtype=dtype, requires_grad=grad)
            if packed:
                q, k, v = make(nheads, total), make(nheads_k, total), make(nheads_k, total, d=hdim_v)
                cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
            else:
                q, k = make(nheads, batch, seqlen), make(nheads_k, batch, seqlen)
                v = make(nheads_k, batch, seqlen, d=hdim_v)
            dout = torch.randn(*q.shape[:-1], hdim_v, device="cuda", dtype=dtype)  # out has v's head dim
            line = []
            for pass_ in passes:
                runs = {}
                for impl in impls:
                    for expand_kv in (False, True):  # SDPA with enable_gqa, else on repeated k/v
                        made = (varlen_fn(impl, q, k, v, cu, max(lengths), features) if packed
                                else dense_fn(impl, q, k, v, expand_kv, features))
                        if made is None:
                            break
                        try:
                            runs[impl] = make_run(impl, *made, pass_, dout)
                            with run_context(runs[impl]):
                                runs[impl]()
                            break
                        except RuntimeError as e:  # a backend that does not take this shape
                            runs.pop(impl, None)
                            log(f"  {impl} {pass_} {'(k/v repeated) ' if expand_kv else ''}skipped at {shape} "
                                f"s={seqlen}: {str(e).splitlines()[0][:120]}")
                            if packed or impl not in SDPA_BACKENDS:
                                break
                for impl, ms in time_interleaved(runs, reps, rounds, min_round_ms).items():
                    tflops = causal_flops(lengths, nheads, hdim, pass_, features.get("window"), hdim_v) / ms / 1e9
                    rows.append(dict(gpu=gpu, impl=impl, shape=shape, dtype="bf16", hdim=hdim, causal=True,
                                     seqlen=seqlen, batch=batch, nheads=nheads, nheads_k=nheads_k, **{"pass": pass_},
                                     ms=round(ms, 5), tflops=round(tflops, 2)))
                    line.append(f"{pass_} {impl} {tflops:6.1f}")
            log(f"{shape:15} s={seqlen!s:>6} b={batch:3d}: " + " | ".join(line))
            del q, k, v, dout
    return rows


def summary(rows, impl="flash_attn2", bases=("sdpa_cudnn", "sdpa_flash", "torch_varlen")) -> str:
    lines = []
    key = lambda r: (r["pass"], r["shape"], str(r["seqlen"]))
    ours = {key(r): r["tflops"] for r in rows if r["impl"] == impl}
    for base in bases:
        theirs = {key(r): r["tflops"] for r in rows if r["impl"] == base}
        for pass_ in sorted({k[0] for k in ours}):
            pairs = [(ours[k] / theirs[k], k) for k in ours if k in theirs and k[0] == pass_]
            if pairs:
                geomean = math.exp(sum(math.log(r) for r, _ in pairs) / len(pairs))
                worst, at = min(pairs)
                lines.append(f"{pass_}: {impl} / {base} over {len(pairs)} points: geomean {geomean:.3f}, "
                             f"min {worst:.3f} at {at[1]} s={at[2]}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = sorted({r["pass"] for r in rows})
    order = lambda p: (list(MODELS).index(p[0]), int(p[1]) if p[1].isdigit() else 1 << 40)  # packed last
    points = sorted({(r["shape"], str(r["seqlen"])) for r in rows}, key=order)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(8, 0.9 * len(points)), 3.4 * len(passes)), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, pass_ in zip(axes.flat, passes):
        for i, impl in enumerate(impls):
            values = {(r["shape"], str(r["seqlen"])): r["tflops"] for r in rows if (r["impl"], r["pass"]) == (impl, pass_)}
            xs = [j + i * width for j, p in enumerate(points) if p in values]
            ax.bar(xs, [values[p] for p in points if p in values], width, label=impl, color=f"C{i}")  # same in every pass
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))])
        ax.set_xticklabels([f"{s}\n{n}" for s, n in points], fontsize=7)
        ax.set_ylabel("TFLOPs/s")
        ax.set_title(f"{pass_}, causal, bf16", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch  # an impl missing from a pass still gets its colour in the legend
    fig.legend(handles=[Patch(color=f"C{i}", label=impl) for i, impl in enumerate(impls)], fontsize=7, ncol=len(impls),
               loc="upper right")
    fig.suptitle(f"{rows[0]['gpu']}: model attention shapes, {TOKENS} tokens per batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--passes", nargs="+", default=["fwd", "fwd_train"], choices=list(PASSES))
    add_run_args(p, reps=15)
    args = p.parse_args(argv)
    warm_up_gpu(args.warmup_s)
    rows = run_models(args.models, args.seqlens, args.tokens, args.impls, args.passes, args.reps,
                      args.rounds, min_round_ms=args.min_round_ms)
    save(rows, args.out_dir, "_models", COLUMNS, plot)
    print(summary(rows))
    return rows


if __name__ == "__main__":
    main()
