"""Decode benchmark: one new token per sequence against a KV cache of `ctx` tokens, bf16.

    python -m flash_attn2.bench.decode [--shapes 32,8,128 64,8,128 32,32,128] [--batches 1 4 16 64 256]
                                       [--ctxs 1024 4096 16384 32768 131072] [--pages 0 1 16 64 256]
                                       [--impls ...] [--out-dir DIR] [--name decode]

flash_attn2's `flash_attn_with_kvcache` (heuristic splits, and num_splits=1) beside SDPA's cuDNN and flash backends
(`enable_gqa=True`, the same caches as (batch, heads, ctx, d) views), each timed eagerly (launch and Python
included) and as CUDA-graph replay (the kernels alone), a cell's implementations in rounds with their order
rotated. The caches rotate over copies that together pass 256 MB, so no call finds its cache in L2. Per cell: us
per call, GB/s = bytes of K and V read / graph time, and % of the device-to-device copy bandwidth (read + write)
measured in the same run. Cells whose caches pass --max-gb are skipped. --pages: cache layouts, 0 contiguous, else
paged caches of that page size (pages in random order, the table exactly the sequence's pages; SDPA has no paged
form and runs on the contiguous layout only). Writes <out_dir>/<gpu>_<name>.csv (--name, default decode) and, where
matplotlib is installed, .png.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch
import torch.nn.functional as F

from .grid import gpu_slug, save, warm_up_gpu

COLUMNS = ["gpu", "impl", "heads", "heads_k", "hdim", "page", "batch", "ctx", "us_eager", "us_graph", "gbps",
           "pct_copy", "copy_gbps"]
IMPLS = ("flash_attn2", "flash_attn2_splits1", "sdpa_cudnn", "sdpa_flash")
SHAPES = ("32,8,128", "64,8,128", "32,32,128")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, read + write."""
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
    return 2 * a.numel() / (statistics.median(times) * 1e-3) / 1e9


def runner(fn, copies: int, graph: bool):
    """A callable that calls fn(i) for every cache copy i: eagerly, or as one CUDA graph's replay."""
    if not graph:
        def run():
            for i in range(copies):
                fn(i)
        return run
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up allocations outside the capture
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    return g.replay


def time_runs(runs: dict, copies: int, rounds: int = 7) -> dict:
    """{key: median us per call} of the runners, timed in rounds with their order rotated (a round calls each
    runner reps times), so that a cell's implementations see the same clocks and caches."""
    for run in runs.values():
        for _ in range(3):
            run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(3, 200 // copies)
    keys = list(runs)
    times = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            start.record()
            for _ in range(reps):
                runs[k]()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) * 1e3 / reps / copies)
    return {k: statistics.median(t) for k, t in times.items()}


def time_us(fn, copies: int, graph: bool, rounds: int = 7) -> float:
    """Median us per call of fn over rounds (time_runs of one runner)."""
    return time_runs({0: runner(fn, copies, graph)}, copies, rounds)[0]


def paged(k, v, page):
    """(k_pages, v_pages (num_pages, page, h_k, d), table (batch, pages per sequence)): the caches in pages of `page`
    rows, in random order."""
    batch, ctx = k.shape[:2]
    per_seq = -(-ctx // page)
    table = torch.randperm(batch * per_seq, device=k.device).to(torch.int32).view(batch, per_seq)
    out = []
    for cache in (k, v):
        pages = torch.empty(batch * per_seq, page, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
        padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per_seq * page - ctx))
        pages[table.long().flatten()] = padded.reshape(batch * per_seq, page, *cache.shape[2:])
        out.append(pages)
    return out[0], out[1], table


def cell_impls(impls, q, caches, seqlens, tables=None):
    """{name: fn(copy index)} for one cell; tables: the page tables of paged caches (then SDPA does not run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import flash_attn_with_kvcache

    runs = {}
    table = (lambda i: tables[i]) if tables is not None else (lambda i: None)
    if "flash_attn2" in impls:
        runs["flash_attn2"] = lambda i: flash_attn_with_kvcache(q, *caches[i], cache_seqlens=seqlens, causal=True,
                                                                block_table=table(i))
    if "flash_attn2_splits1" in impls:
        runs["flash_attn2_splits1"] = lambda i: flash_attn_with_kvcache(q, *caches[i], cache_seqlens=seqlens,
                                                                        causal=True, num_splits=1, block_table=table(i))
    if tables is not None:
        return runs
    qt = q.transpose(1, 2)
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        if name not in impls:
            continue

        def sdpa(i, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, caches[i][0].transpose(1, 2), caches[i][1].transpose(1, 2),
                                                      enable_gqa=True)
        runs[name] = sdpa
    return runs


def run_decode(shapes, batches, ctxs, impls, max_gb, pages=(0,), log=print):
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    log(f"# {gpu}: device copy {bw:.0f} GB/s (read + write)")
    rows = []
    for shape in shapes:
        heads, heads_k, d = (int(x) for x in shape.split(","))
        for batch in batches:
            for ctx in ctxs:
                kv_bytes = 2 * batch * ctx * heads_k * d * 2
                copies = max(1, math.ceil(256e6 / kv_bytes))
                if kv_bytes * copies > max_gb * 1e9:
                    continue
                q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
                seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                for page in pages:
                    rows += time_cell(gpu, bw, impls, heads, heads_k, d, batch, ctx, page, q, seqlens, copies,
                                      kv_bytes, log)
    return rows


def time_cell(gpu, bw, impls, heads, heads_k, d, batch, ctx, page, q, seqlens, copies, kv_bytes, log):
    """The rows of one (shape, batch, ctx, layout) cell: page 0 contiguous caches, else paged ones."""
    caches = [tuple(torch.randn(batch, ctx, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(copies)]
    tables = None
    if page:
        made = [paged(k, v, page) for k, v in caches]
        caches, tables = [(k, v) for k, v, _ in made], [t for _, _, t in made]
    rows = []
    runs = {}
    for name, fn in cell_impls(impls, q, caches, seqlens, tables).items():
        try:  # the graph's warm-up calls fn eagerly: a backend that does not take the shape raises there
            runs[(name, True)] = runner(fn, copies, True)
        except RuntimeError as e:
            log(f"# {name} h {heads}/{heads_k} b {batch} ctx {ctx} page {page}: {str(e).splitlines()[0][:120]}")
            continue
        runs[(name, False)] = runner(fn, copies, False)
    timed = time_runs(runs, copies) if runs else {}
    for name in dict.fromkeys(n for n, _ in runs):
        eager, graph = timed[(name, False)], timed[(name, True)]
        gbps = kv_bytes / (graph * 1e-6) / 1e9
        row = dict(gpu=gpu, impl=name, heads=heads, heads_k=heads_k, hdim=d, page=page, batch=batch, ctx=ctx,
                   us_eager=round(eager, 2), us_graph=round(graph, 2), gbps=round(gbps),
                   pct_copy=round(100 * gbps / bw, 1), copy_gbps=round(bw))
        rows.append(row)
        log(",".join(str(row[c]) for c in COLUMNS))
    del caches, tables
    torch.cuda.empty_cache()
    return rows


def summary(rows, impl="flash_attn2", base="sdpa_cudnn") -> str:
    """Graph-time ratios base / impl (> 1: impl faster) over the cells both ran."""
    times = {(r["impl"], r["heads"], r["heads_k"], r["batch"], r["ctx"]): r["us_graph"] for r in rows
             if not r.get("page")}
    ratios = [(times[(base, *k[1:])] / t, k[1:]) for k, t in times.items() if k[0] == impl and (base, *k[1:]) in times]
    if not ratios:
        return f"no cell with both {impl} and {base}"
    lo = min(ratios)
    return (f"{impl} vs {base} (speed, graph replay): geomean {statistics.geometric_mean(r for r, _ in ratios):.3f} "
            f"over {len(ratios)} cells, min {lo[0]:.3f} (h/h_k {lo[1][0]}/{lo[1][1]}, batch {lo[1][2]}, ctx {lo[1][3]})")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["heads"], r["heads_k"], r["hdim"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (h, hk, d) in zip(axes[0], shapes):
        cells = sorted({(r["batch"], r["ctx"]) for r in rows if (r["heads"], r["heads_k"], r["hdim"]) == (h, hk, d)})
        for impl, page in sorted({(r["impl"], r.get("page", 0)) for r in rows}):
            ys = {(r["batch"], r["ctx"]): r["gbps"] for r in rows
                  if (r["impl"], r.get("page", 0)) == (impl, page) and (r["heads"], r["heads_k"], r["hdim"]) == (h, hk, d)}
            if ys:
                ax.plot(range(len(cells)), [ys.get(c, float("nan")) for c in cells], marker="o",
                        label=impl + (f" page {page}" if page else ""))
        ax.set_xticks(range(len(cells)), [f"{b}x{c // 1024}k" for b, c in cells], rotation=60, fontsize=7)
        ax.set_title(f"h {h} / h_kv {hk}, d {d}")
        ax.set_ylabel("GB/s of K + V (graph replay)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"decode, bf16, {rows[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="heads,heads_kv,head_dim")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--ctxs", nargs="+", type=int, default=[1024, 4096, 16384, 32768, 131072])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--pages", nargs="+", type=int, default=[0], help="0: contiguous caches; n: pages of n rows")
    p.add_argument("--max-gb", type=float, default=40.0, help="skip cells whose rotated caches pass this")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    p.add_argument("--name", default="decode", help="the results' name: <out-dir>/<gpu>_<name>.csv / .png")
    args = p.parse_args(argv)
    if not args.name or not all(c.isalnum() or c in "_-" for c in args.name):
        p.error(f"--name must be letters, digits, '_' or '-', got {args.name!r}")
    if not torch.cuda.is_available():
        raise SystemExit("the decode benchmark needs a CUDA GPU")
    warm_up_gpu(args.warmup_s)
    rows = run_decode(args.shapes, args.batches, args.ctxs, args.impls, args.max_gb, args.pages)
    if rows:
        print(summary(rows))
        save(rows, args.out_dir, "_" + args.name, COLUMNS, plot)


if __name__ == "__main__":
    main()
