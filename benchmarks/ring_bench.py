# Context-parallel attention on N GPUs (issue #51): the zigzag ring (causal, h 32 / h_kv 8, d 128, bf16) at total
# sequence lengths from 32k to 1M, forward and forward + backward, the max over ranks of the median time (CUDA
# events), with:
#   compute_ms  the rank's ring blocks run without communication (its own K / V at every step): the work a perfect
#               overlap would leave; efficiency = compute_ms / ring_ms;
#   single_ms   one GPU's causal attention at S / sqrt(N) tokens (the same number of (query, key) pairs as one rank
#               of the ring, in one kernel call; rescaled for the rounding of S / sqrt(N)); efficiency_1gpu =
#               single_ms / ring_ms (the brief's definition);
#   comm_ms     the ring's transfers alone (K + V world - 1 hops; the backward adds K + V again and world hops of the
#               fp32 dK / dV sums), merge_ms the merges and fp32 accumulations alone: the breakdown;
#   peer_ms     ring-flash-attn 0.1.8's zigzag ring on the same kernels (--peer: its wheel installed, the test-only
#               shim benchmarks/peer_shim on sys.path); speedup = peer_ms / ring_ms.
# One process per GPU:
#   torchrun --nproc_per_node=4 benchmarks/ring_bench.py [--seqlens 32768 131072 524288 1048576] [--peer]
#       [--out results.csv]   (and its plot, results.png; or: python benchmarks/ring_bench.py --plot-only CSV PNG)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
import argparse
import csv
import datetime
import math
import os
import statistics
import sys

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flash_attn2  # noqa: E402
from flash_attn2.distributed import ring  # noqa: E402
from flash_attn2.distributed._merge import merge_partial  # noqa: E402
from flash_attn2.distributed._schedule import ring_tasks  # noqa: E402

HEADS, HEADS_K, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


def time_interleaved(fns, reps, warmup):
    """{name: median ms}: each rep times every fn once, the order rotated from rep to rep (the clocks swing under the
    power cap: no implementation gets all the cool or all the hot ones); every rank starts each call together."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    names, times = list(fns), {name: [] for name in fns}
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def compute_only(q, k, v, world, rank, dout=None):
    """The rank's ring blocks with its own K / V at every step (no exchange, no merge), forward or forward +
    backward."""
    seqlen = q.shape[1] * world
    scale = q.shape[-1] ** -0.5
    for step in range(world):
        for task in ring_tasks("zigzag", seqlen, world, rank, step, True):
            qb, kb, vb, causal, row0, _ = ring._block(task, q, k, v)
            out, lse = ring.KernelBackend.forward(qb, kb, vb, causal, scale)
            if dout is not None:
                ring.KernelBackend.backward(dout[:, row0:task.q[1]], qb, kb, vb, out, lse, causal, scale, False)


def comm_only(k, v, world, backward):
    """The ring's transfers alone, in its order: K + V around (world - 1 hops); with the backward, K + V around again
    and the fp32 dK / dV sums world hops."""
    comm = ring.RingComm(None)
    for _ in ring.KVRing(comm, k, v).steps():
        pass
    if backward:
        sums = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)
        for _ in ring.KVRing(comm, k, v).steps():
            sums = ring._wait(comm.exchange(sums, tag=1))


def merge_only(q, k, world, rank, backward, blocks):
    """The forward's merges (and with the backward, its fp32 accumulations of dq, dk, dv and the sums) on stand-in
    block results of the ring's shapes: `blocks` caches them per row count."""
    seqlen = q.shape[1] * world
    tasks = [(step, task) for step in range(world) for task in ring_tasks("zigzag", seqlen, world, rank, step, True)]
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    if ring._writes_every_row(tasks[0][1], q.shape[1]):  # as the ring: no fills where the first block writes every row
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(lse_shape, device=q.device)
    else:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(lse_shape, float("-inf"), device=q.device)
    first = True
    for _, task in tasks:
        rows = task.q[1] - task.q[0]
        if rows not in blocks:
            blocks[rows] = (torch.randn(q.shape[0], rows, q.shape[2], q.shape[3], device=q.device, dtype=q.dtype),
                            torch.randn(q.shape[0], q.shape[2], rows, device=q.device))
        bout, blse = blocks[rows]
        if first and rows == q.shape[1]:
            out.copy_(bout)
            lse.copy_(blse)
        else:
            merge_partial(out[:, task.q[0]:task.q[1]], lse[:, :, task.q[0]:task.q[1]], bout, blse)
        first = False
    if backward:  # as the ring's backward: the held block's sums zeroed once, then added to in place each step
        dq = torch.zeros_like(out)
        dk, dv = torch.zeros(2, *k.shape, dtype=torch.float32, device=k.device).unbind(0)
        for step in range(world):
            for s, task in tasks:
                if s != step:
                    continue
                bout, _ = blocks[task.q[1] - task.q[0]]
                dq[:, task.q[0]:task.q[1]] += bout
                keys = task.k[1] - task.k[0]
                if ("k", keys) not in blocks:
                    blocks["k", keys] = torch.randn(k.shape[0], keys, *k.shape[2:], device=k.device, dtype=k.dtype)
                dk[:, task.k[0]:task.k[1]] += blocks["k", keys]
                dv[:, task.k[0]:task.k[1]] += blocks["k", keys]


def single_gpu(seqlen, world, backward):
    """One GPU's causal call at S / sqrt(N) tokens (rounded to 256), and the factor that rescales its time to exactly
    S^2 / (2 N) (query, key) pairs."""
    exact = seqlen / math.sqrt(world)
    tokens = max(256, int(round(exact / 256)) * 256)
    q = torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=backward)
    k, v = (torch.randn(1, tokens, HEADS_K, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=backward)
            for _ in range(2))
    dout = torch.randn_like(q) if backward else None

    def run():
        if backward:
            out = flash_attn2.flash_attn_func(q, k, v, causal=True)
            torch.autograd.grad(out, (q, k, v), dout)
        else:
            with torch.no_grad():
                flash_attn2.flash_attn_func(q, k, v, causal=True)
    return run, (exact / tokens) ** 2


def peer_zigzag():
    """ring-flash-attn's zigzag_ring_flash_attn_func on flash_attn2's kernels (the test-only shim), or None."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_shim"))
    from ring_flash_attn_peer import import_ring_flash_attn
    try:
        zigzag_ring_flash_attn_func = import_ring_flash_attn().zigzag_ring_flash_attn_func
    except ImportError as e:
        print(f"--peer: ring_flash_attn is not importable ({e}); pip install .whl/ring_flash_attn-0.1.8-*.whl",
              file=sys.stderr)
        return None
    return zigzag_ring_flash_attn_func


def plot(csv_path, png_path):
    """One panel per pass: the ring's and the peer's times against the sequence length (one line per world size),
    and the efficiency on a second axis; from the CSV this script writes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    passes = sorted({r["pass"] for r in rows})
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4), squeeze=False)
    for ax, pass_ in zip(axes.flat, passes):
        eff = ax.twinx()
        for i, world in enumerate(sorted({int(r["world"]) for r in rows})):
            pts = sorted((int(r["seqlen"]), r) for r in rows if r["pass"] == pass_ and int(r["world"]) == world)
            x = [s for s, _ in pts]
            ax.plot(x, [float(r["ring_ms"]) for _, r in pts], marker="o", color=f"C{i}", label=f"flash_attn2, {world} GPUs")
            if all(r.get("peer_ms") for _, r in pts):
                ax.plot(x, [float(r["peer_ms"]) for _, r in pts], marker="x", ls="--", color=f"C{i}",
                        label=f"ring-flash-attn, {world} GPUs")
            eff.plot(x, [float(r["efficiency"]) for _, r in pts], marker=".", ls=":", color=f"C{i}", alpha=0.6,
                     label=f"efficiency, {world} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("total tokens")
        ax.set_ylabel("ms (max over ranks)")
        eff.set_ylabel("efficiency (compute alone / ring)")
        eff.set_ylim(0, 1.05)
        ax.set_title(f"{pass_}: zigzag causal, h {HEADS} / {HEADS_K}, d {HEAD_DIM}", fontsize=9)
        ax.grid(alpha=0.3)
        lines = ax.get_legend_handles_labels()
        more = eff.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
    fig.suptitle(rows[0]["gpu"] if rows else "")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--plot-only":  # python ring_bench.py --plot-only results.csv out.png
        plot(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", nargs="+", type=int, default=[32768, 131072, 524288, 1048576])
    p.add_argument("--passes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peer", action="store_true", help="also time ring-flash-attn 0.1.8 through benchmarks/peer_shim")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU reference call")
    p.add_argument("--out", default=None, help="CSV, a row appended (and flushed) as each point finishes; its plot "
                   "beside it (.png) at the end")
    args = p.parse_args()
    # A rank that fails alone (out of memory, say) stops the others after 3 minutes, not NCCL's default 10.
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    peer = peer_zigzag() if args.peer else None
    fields = ["gpu", "world", "seqlen", "pass", "ring_ms", "compute_ms", "comm_ms", "merge_ms", "peer_ms", "single_ms",
              "efficiency", "efficiency_1gpu", "speedup_vs_peer"]
    if rank == 0 and args.out:
        with open(args.out, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=fields).writeheader()
    for seqlen in args.seqlens:
        local = seqlen // world
        torch.manual_seed(rank)
        q = torch.randn(1, local, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
        k, v = (torch.randn(1, local, HEADS_K, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                for _ in range(2))
        dout = torch.randn_like(q)
        blocks = {}
        for pass_ in args.passes:
            backward = pass_ == "fwd_bwd"

            def ring_call(fn):
                def run():
                    if backward:
                        out = fn(q, k, v, causal=True)
                        torch.autograd.grad(out, (q, k, v), dout)
                    else:
                        with torch.no_grad():
                            fn(q, k, v, causal=True)
                return run

            def alone():
                with torch.no_grad():
                    compute_only(q, k, v, world, rank, dout if backward else None)

            fns = {"ring_ms": ring_call(ring.zigzag_ring_flash_attn_func), "compute_ms": alone,
                   "comm_ms": lambda: comm_only(k.detach(), v.detach(), world, backward),
                   "merge_ms": lambda: merge_only(q.detach(), k.detach(), world, rank, backward, blocks)}
            if peer is not None:
                fns["peer_ms"] = ring_call(peer)
            factor = 1.0
            if not args.no_single:
                fns["single_ms"], factor = single_gpu(seqlen, world, backward)
            times = time_interleaved(fns, args.reps, warmup=1 if seqlen >= 524288 else 2)
            if "single_ms" in times:
                times["single_ms"] *= factor
            del fns
            names = list(times)
            both = torch.tensor([times[n] for n in names], device="cuda")
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            times = dict(zip(names, both.tolist()))
            row = dict(gpu=torch.cuda.get_device_name(), world=world, seqlen=seqlen, **{"pass": pass_},
                       **{n: round(t, 3) for n, t in times.items()},
                       efficiency=round(times["compute_ms"] / times["ring_ms"], 3))
            if "single_ms" in times:
                row["efficiency_1gpu"] = round(times["single_ms"] / times["ring_ms"], 3)
            if "peer_ms" in times:
                row["speedup_vs_peer"] = round(times["peer_ms"] / times["ring_ms"], 3)
            if rank == 0:
                print(row, flush=True)
                if args.out:
                    with open(args.out, "a", newline="") as f:
                        csv.DictWriter(f, fieldnames=fields).writerow(row)
            torch.cuda.empty_cache()
        del q, k, v, dout, blocks
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    if rank == 0 and args.out:
        plot(args.out, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
