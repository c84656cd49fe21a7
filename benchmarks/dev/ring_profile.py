# Where a ring's time goes, ours beside ring-flash-attn's (on our kernels through benchmarks/peer_shim): one profiled
# call of each (after warm-up), per rank, the CUDA kernels' intervals summed by kind (attention forward / backward,
# NCCL, the rest: merges, casts, copies), the NCCL kernels' time while an attention kernel ran, and the span.
# The question it answers (TUNING 133): our zigzag ring ran at 0.87-0.94x the peer's speed on 2 H200s although its
# compute, communication and merges alone add up to about the peer's time. Each rank's timeline starts at its own
# first kernel; a line per call then puts the ranks on one clock (the host's, which Kineto's GPU timestamps use):
# when each rank's host left the barrier and returned from the call, and its first and last kernels, in ms after
# the earliest rank left the barrier (a rank that starts late holds the others' NCCL kernels on their SMs).
#   torchrun --standalone --nproc_per_node=2 benchmarks/dev/ring_profile.py [--seqlens 32768 131072] [--bwd]
#       [--csv-dir DIR]  (each rank's kernel intervals as CSV)
import argparse
import csv
import os
import sys
import time

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from ring_bench import HEADS, HEADS_K, HEAD_DIM, DTYPE, peer_zigzag  # noqa: E402

from flash_attn2.distributed import ring  # noqa: E402


def kind(name):
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "flash_attn2" in low and ("bwd" in low or "backward" in low):
        return "attn_bwd"
    if "flash_attn2" in low:
        return "attn_fwd"
    return "other"


def union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def overlap(xs, ys):
    """Time (us) in both interval sets."""
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def profile(fn, label, rank, csv_dir):
    """(the rank's summary line, its clock: host left the barrier, host returned from fn, first kernel start, last
    kernel end, in us on the host's clock)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        host0 = time.time_ns() / 1e3
        fn()
        host1 = time.time_ns() / 1e3
        torch.cuda.synchronize()
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    if not events:
        return f"{label}: no CUDA events", None
    t0 = min(e.time_range.start for e in events)
    base = prof.profiler.kineto_results.trace_start_ns() / 1e3  # the events' times are relative to this
    clock = (host0, host1, base + t0, base + max(e.time_range.end for e in events))
    rows = [(kind(e.name), e.name[:90], e.time_range.start - t0, e.time_range.end - t0) for e in events]
    if csv_dir:
        with open(os.path.join(csv_dir, f"{label}_rank{rank}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kind", "name", "start_us", "end_us"])
            w.writerows(rows)
    by = {}
    for k, _, a, b in rows:
        by.setdefault(k, []).append((a, b))
    span = max(b for *_, b in rows)
    attn = by.get("attn_fwd", []) + by.get("attn_bwd", [])
    parts = [f"{label} rank {rank}: span {span / 1e3:.3f} ms"]
    for k in ("attn_fwd", "attn_bwd", "nccl", "other"):
        if k in by:
            parts.append(f"{k} {union(by[k]) / 1e3:.3f} ms ({len(by[k])})")
    if "nccl" in by:
        parts.append(f"nccl beside attention {overlap(by['nccl'], attn) / 1e3:.3f} ms")
        first = min(a for a, _ in by["nccl"])
        parts.append(f"first nccl at {first / 1e3:.3f} ms")
    others = sorted(((b - a, n) for k, n, a, b in rows if k == "other"), reverse=True)[:4]
    parts.append("top other: " + ", ".join(f"{n[:40]} {d / 1e3:.3f}" for d, n in others))
    return "; ".join(parts), clock


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", nargs="+", type=int, default=[32768, 131072])
    p.add_argument("--bwd", action="store_true", help="forward + backward (default: forward)")
    p.add_argument("--csv-dir", default=None)
    args = p.parse_args()
    if args.csv_dir:
        os.makedirs(args.csv_dir, exist_ok=True)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    peer = peer_zigzag()
    impls = {"ours": ring.zigzag_ring_flash_attn_func}
    if peer is not None:
        impls["peer"] = peer
    for seqlen in args.seqlens:
        local = seqlen // world
        torch.manual_seed(rank)
        q = torch.randn(1, local, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=args.bwd)
        k, v = (torch.randn(1, local, HEADS_K, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=args.bwd)
                for _ in range(2))
        dout = torch.randn_like(q)
        for name, fn in impls.items():
            def call(fn=fn):
                if args.bwd:
                    out = fn(q, k, v, causal=True)
                    torch.autograd.grad(out, (q, k, v), dout)
                else:
                    with torch.no_grad():
                        fn(q, k, v, causal=True)
            for _ in range(3):
                call()
            label = f"{name}_{seqlen}_{'fwd_bwd' if args.bwd else 'fwd'}"
            line, clock = profile(call, label, rank, args.csv_dir)
            lines, clocks = [None] * world, [None] * world
            dist.all_gather_object(lines, line)
            dist.all_gather_object(clocks, clock)
            if rank == 0:
                print("\n".join(lines), flush=True)
                if all(c is not None for c in clocks):
                    zero = min(c[0] for c in clocks)
                    print(f"{label} one clock (ms after the first rank left the barrier): " + "; ".join(
                        f"rank {r}: left {(c[0] - zero) / 1e3:.3f} / host done {(c[1] - zero) / 1e3:.3f} / first kernel "
                        f"{(c[2] - zero) / 1e3:.3f} / last end {(c[3] - zero) / 1e3:.3f}" for r, c in enumerate(clocks)),
                        flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
