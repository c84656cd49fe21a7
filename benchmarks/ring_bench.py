# Context-parallel attention on N GPUs (issue #51): the zigzag ring (causal, h 32 / h_kv 8, d 128, bf16) at total
# sequence lengths from 32k to 1M, forward and forward + backward; the max over ranks of the median time, beside the
# same rank's blocks run without communication (its own K / V at every step: the compute a perfect overlap would
# leave), whose ratio is the efficiency. One process per GPU:
#   torchrun --nproc_per_node=4 benchmarks/ring_bench.py [--seqlens 32768 131072 524288 1048576] [--out results.csv]
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
import argparse
import csv
import os
import statistics

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flash_attn2.distributed import ring  # noqa: E402
from flash_attn2.distributed._schedule import ring_tasks  # noqa: E402


def time_ms(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compute_only(q, k, v, world, rank, dout=None):
    """The rank's ring blocks with its own K / V at every step (no exchange), forward or forward + backward."""
    seqlen = q.shape[1] * world
    scale = q.shape[-1] ** -0.5
    outs = []
    for step in range(world):
        for task in ring_tasks("zigzag", seqlen, world, rank, step, True):
            qb, kb, vb, causal, row0, _ = ring._block(task, q, k, v)
            out, lse = ring.KernelBackend.forward(qb, kb, vb, causal, scale)
            if dout is not None:
                ring.KernelBackend.backward(dout[:, row0:task.q[1]], qb, kb, vb, out, lse, causal, scale, False)
            outs.append(out)
    return outs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", nargs="+", type=int, default=[32768, 131072, 524288, 1048576])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    for seqlen in args.seqlens:
        local = seqlen // world
        q = torch.randn(1, local, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, local, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        for pass_ in ("fwd", "fwd_bwd"):
            if pass_ == "fwd":
                def run():
                    with torch.no_grad():
                        ring.zigzag_ring_flash_attn_func(q, k, v, causal=True)

                def alone():
                    with torch.no_grad():
                        compute_only(q, k, v, world, rank)
            else:
                def run():
                    out = ring.zigzag_ring_flash_attn_func(q, k, v, causal=True)
                    torch.autograd.grad(out, (q, k, v), dout)

                def alone():
                    with torch.no_grad():
                        compute_only(q, k, v, world, rank, dout)
            t_ring, t_alone = time_ms(run), time_ms(alone)
            both = torch.tensor([t_ring, t_alone], device="cuda")
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            t_ring, t_alone = both.tolist()
            row = dict(gpu=torch.cuda.get_device_name(), world=world, seqlen=seqlen, pass_=pass_, ring_ms=round(t_ring, 3),
                       compute_ms=round(t_alone, 3), efficiency=round(t_alone / t_ring, 3))
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
