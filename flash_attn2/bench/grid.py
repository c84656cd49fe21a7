"""Times flash_attn2 next to PyTorch's SDPA backends on the FA2 paper's grid, on the same inputs.

    python -m flash_attn2.bench.grid [--dtypes bf16] [--hdims 128] [--seqlens 4096] [--passes fwd bwd fwd_bwd]

Writes <out_dir>/<gpu>.csv (gpu,impl,dtype,hdim,causal,seqlen,batch,nheads,pass,ms,tflops) and a PNG plot
beside it, and prints the geometric-mean and minimum speed ratio of flash_attn2 to each SDPA backend measured
(sdpa_cudnn, the bar on Hopper, and sdpa_flash) per pass. At every point the implementations are timed in
rounds, their order rotated (CUDA events; the median run of a round, the median round).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import re
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..flash_attn_interface import flash_attn_func

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HIDDEN = 2048
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    # SDPA's flash backend with flash_attn2 activated in torch's flash-attention registry (integrations/torch_sdpa.py)
    "sdpa_flash_attn2": SDPBackend.FLASH_ATTENTION,
}
# flash_attn2 on its default path, and on its SM80 one where a build has both (FLASH_ATTN2_SM80=1).
FLASH_ATTN2_BACKENDS = {"flash_attn2": None, "flash_attn2_sm80": "sm80"}
IMPLS = (*FLASH_ATTN2_BACKENDS, *SDPA_BACKENDS)
PASSES = ("fwd", "bwd", "fwd_bwd")
COLUMNS = ("gpu", "impl", "dtype", "hdim", "causal", "seqlen", "batch", "nheads", "pass", "ms", "tflops")


def flops(batch, nheads, seqlen, hdim, causal, pass_):
    """FA2's count: forward 4 * b * h * s^2 * d, halved when causal; backward 2.5x the forward."""
    fwd = 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[pass_]


def warm_up_gpu(seconds):
    """Dense bf16 matmuls for `seconds`, so the timings start at the clock the GPU holds under sustained
    tensor-core load (an H200 at its power cap drops from 1980 to ~1650 MHz), not at a cold burst clock."""
    if seconds <= 0:
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= seconds * 1000:
            return


def rep_times_ms(fn, warmup=5, reps=30):
    """reps CUDA-event timings (ms) after warmup runs.

    The runs are queued back to back and synchronized once, so host-side launch overhead overlaps the
    GPU work (as in a training step) and the events time the kernels.
    """
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def median_ms(fn, warmup=5, reps=30):
    """Median of rep_times_ms."""
    return statistics.median(rep_times_ms(fn, warmup, reps))


def time_interleaved(runs, reps, rounds=3, min_round_ms=0.0):
    """{name: ms} for {name: run}: every run timed in `rounds` rounds (median_ms of `reps` runs each), the
    order rotated from round to round, keeping each one's median round. The SM clock follows the power
    draw for a second or so after a heavy load: on an H100 after 3 s of matmuls at its 700 W cap, whichever
    implementation ran first measured 15-40% slower than when rested (benchmarks/TUNING.md step 24), so a
    fixed order would charge one side. min_round_ms: a run whose round would be shorter (from a first
    estimate of 3 calls) gets more reps, up to 2000: 0.1-0.2 ms calls timed in rounds of a few ms spread
    by up to 2x between runs on an H200 (benchmarks/RESULTS.md, the SDPA grid of the seventh session)."""
    names = list(runs)
    counts = {name: reps for name in names}
    if min_round_ms > 0:
        for name in names:
            with run_context(runs[name]):
                est = statistics.median(rep_times_ms(runs[name], warmup=2, reps=3))
            counts[name] = max(reps, min(2000, math.ceil(min_round_ms / max(est, 1e-3))))
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            with run_context(runs[name]):
                times[name].append(median_ms(runs[name], reps=counts[name]))
    return {name: statistics.median(t) for name, t in times.items()}


@contextlib.contextmanager
def sdpa_flash_attn2():
    """flash_attn2 activated as SDPA's flash implementation for the calls inside, PyTorch's own after."""
    try:
        from torch.nn.attention import _registry

        from ..integrations import torch_sdpa
    except ImportError as e:  # run_grid skips an impl that raises RuntimeError
        raise RuntimeError(f"sdpa_flash_attn2 needs torch's flash-attention registry (torch >= 2.11): {e}") from e
    _registry.activate_flash_attention_impl(torch_sdpa.NAME)
    try:
        yield
    finally:
        _registry.restore_flash_attention_impl()


# Implementations that run inside a context (entered once around a run's timing, not per call: activating the
# SDPA registry costs more host time than a small call).
IMPL_CONTEXTS = {"sdpa_flash_attn2": sdpa_flash_attn2}


def run_context(run):
    """The context a run is made, warmed up and timed in (on_path attaches it), or none."""
    return getattr(run, "context", contextlib.nullcontext)()


@contextlib.contextmanager
def forward_backend(name):
    """FLASH_ATTN2_BACKEND=name (None: the default) for the calls inside."""
    old = os.environ.get("FLASH_ATTN2_BACKEND")
    if name is not None:
        os.environ["FLASH_ATTN2_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASH_ATTN2_BACKEND", None)
        else:
            os.environ["FLASH_ATTN2_BACKEND"] = old


def make_fn(impl, q, k, v, causal):
    if impl in FLASH_ATTN2_BACKENDS:  # its path: on_path
        return lambda: flash_attn_func(q, k, v, causal=causal)
    backend = SDPA_BACKENDS[impl]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (b, h, s, d) view of the same memory
    gqa = k.shape[2] != q.shape[2]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)
    return run


def on_path(impl, make_run):
    """make_run()'s run, made and timed with flash_attn2's path for impl set (FLASH_ATTN2_BACKEND): a bwd run's
    forward happens as it is made, and the backward reads the variable each time it runs."""
    if impl in IMPL_CONTEXTS:
        with IMPL_CONTEXTS[impl]():
            run = make_run()

        def in_context():
            return run()
        in_context.context = IMPL_CONTEXTS[impl]
        return in_context
    backend = FLASH_ATTN2_BACKENDS.get(impl)
    if backend is None:
        return make_run()
    with forward_backend(backend):
        run = make_run()

    def on_backend():
        with forward_backend(backend):
            return run()
    return on_backend


def pass_fn(fn, pass_, inputs, dout):
    """What one timed run does: the forward alone (no graph), the backward of one saved forward, or both."""
    if pass_ == "fwd":
        def run():
            with torch.no_grad():
                fn()
        return run
    if pass_ == "bwd":
        out = fn()
        return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)
    return lambda: torch.autograd.grad(fn(), inputs, dout)


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run_grid(dtypes, head_dims, seqlens, causals, impls, passes, reps, rounds=3, log=print, min_round_ms=0.0):
    gpu = torch.cuda.get_device_name()
    rows = []
    for dtype_name in dtypes:
        for hdim in head_dims:
            for causal in causals:
                for seqlen in seqlens:
                    batch, nheads = TOKENS // seqlen, HIDDEN // hdim
                    grad = any(p != "fwd" for p in passes)
                    q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=DTYPES[dtype_name],
                                                 requires_grad=grad and i < 3) for i in range(4))
                    line = []
                    for pass_ in passes:
                        runs = {}
                        for impl in impls:
                            try:
                                fn = make_fn(impl, q, k, v, causal)
                                runs[impl] = on_path(impl, lambda: pass_fn(fn, pass_, (q, k, v), dout))
                                with run_context(runs[impl]):
                                    runs[impl]()
                            except RuntimeError as e:  # a backend that does not support this shape
                                runs.pop(impl, None)
                                log(f"  {impl} {pass_} skipped at {dtype_name} d={hdim} causal={causal} s={seqlen}: "
                                    f"{str(e).splitlines()[0][:120]}")
                        for impl, ms in time_interleaved(runs, reps, rounds, min_round_ms).items():
                            tflops = flops(batch, nheads, seqlen, hdim, causal, pass_) / ms / 1e9
                            rows.append(dict(gpu=gpu, impl=impl, dtype=dtype_name, hdim=hdim, causal=causal,
                                             seqlen=seqlen, batch=batch, nheads=nheads, **{"pass": pass_},
                                             ms=round(ms, 5), tflops=round(tflops, 2)))
                            line.append(f"{pass_} {impl} {tflops:6.1f}")
                    log(f"{dtype_name} d={hdim:3d} causal={causal!s:5} s={seqlen:5d}: " + " | ".join(line))
                    del q, k, v, dout
    return rows


def ratios(rows, impl="flash_attn2", base="sdpa_flash"):
    """{pass: [(ratio, row key)]} of impl's TFLOPs/s over base's at each grid point both measured."""
    key = lambda r: (r["pass"], r["dtype"], r["hdim"], r["causal"], r["seqlen"])
    ours = {key(r): r["tflops"] for r in rows if r["impl"] == impl}
    theirs = {key(r): r["tflops"] for r in rows if r["impl"] == base}
    out = {}
    for k in sorted(set(ours) & set(theirs), key=str):
        out.setdefault(k[0], []).append((ours[k] / theirs[k], k))
    return out


def summary(rows, bases=("sdpa_cudnn", "sdpa_flash")) -> str:
    """flash_attn2 against each SDPA backend the run measured (on Hopper the bar is sdpa_cudnn)."""
    lines = []
    for base in bases:
        for pass_, pairs in ratios(rows, base=base).items():
            values = [r for r, _ in pairs]
            geomean = math.exp(sum(map(math.log, values)) / len(values))
            worst, at = min(pairs)
            lines.append(f"{pass_}: flash_attn2 / {base} over {len(values)} points: geomean {geomean:.3f}, "
                         f"min {worst:.3f} at {at[1]} hdim={at[2]} causal={at[3]} seqlen={at[4]}")
    return "\n".join(lines)


def write_csv(rows, path, columns=COLUMNS):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def append_csv(rows, out_dir, suffix, columns) -> str:
    """Appends rows to <out_dir>/<gpu><suffix>.csv (its header first if new); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, gpu_slug(torch.cuda.get_device_name()) + suffix)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return path


def save(rows, out_dir, suffix, columns, plot_fn):
    """<out_dir>/<gpu><suffix>.csv and, where matplotlib is installed, .png."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, gpu_slug(torch.cuda.get_device_name()) + suffix)
    write_csv(rows, base + ".csv", columns)
    try:
        plot_fn(rows, base + ".png")
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(f"wrote {base}.csv and .png")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["pass"], r["dtype"], r["causal"], r["hdim"]) for r in rows}, key=str)
    cols = len({p[3] for p in panels})
    nrows = math.ceil(len(panels) / cols)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (pass_, dtype, causal, hdim) in zip(axes.flat, panels):
        for i, impl in enumerate(impls):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows if (r["impl"], r["pass"], r["dtype"], r["causal"],
                                                                     r["hdim"]) == (impl, pass_, dtype, causal, hdim))
            if pts:  # an impl's colour is the same in every panel, whichever others it has
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pass_} {dtype} hdim={hdim}{' causal' if causal else ''}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOPs/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    from matplotlib.lines import Line2D  # one legend for the figure: a panel may lack an impl
    fig.legend(handles=[Line2D([], [], color=f"C{i}", marker="o", label=impl) for i, impl in enumerate(impls)],
               fontsize=7, ncol=len(impls), loc="upper right")
    fig.suptitle(f"{rows[0]['gpu']}: batch x seqlen = {TOKENS} tokens, hidden {HIDDEN}")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))  # the top half inch: title and legend
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--hdims", nargs="+", type=int, default=list(HEAD_DIMS))
    p.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    p.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=list(PASSES))
    add_run_args(p, reps=20)
    return p.parse_args(argv)


def add_run_args(p, reps):
    """The options both suites share: timed runs per point, warm-up, where results go."""
    p.add_argument("--reps", type=int, default=reps, help="timed runs per implementation, point and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per point, the implementations' order rotated")
    p.add_argument("--warmup-s", type=float, default=3.0, help="seconds of matmuls before the first timing")
    p.add_argument("--min-round-ms", type=float, default=25.0,
                   help="more reps where an implementation's round would be shorter (0: exactly --reps)")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main(argv=None):
    args = parse_args(argv)
    warm_up_gpu(args.warmup_s)
    rows = run_grid(args.dtypes, args.hdims, args.seqlens, [c == "true" for c in args.causal], args.impls, args.passes,
                    args.reps, args.rounds, min_round_ms=args.min_round_ms)
    save(rows, args.out_dir, "", COLUMNS, plot)
    print(summary(rows))
    return rows


if __name__ == "__main__":
    main()
