# The model suite's backward rows with every timed rep logged (not only the median) and the caching allocator's
# retries / device mallocs around each timing: is a shape's fwd_bwd extra (TUNING 89, 102) in every rep or in a
# few, and does the allocator free and re-malloc under it?
#   python benchmarks/dev/suite_reps.py [model ...]   (default: the whole suite)
import statistics
import sys

import torch

from flash_attn2 import benchmark_models as bm

WATCH = {("qwen2.5-7b", 8192), ("llama3-70b-tp8", 32768), ("gemma2-9b", 8192)}
current = {}


def logged_median(fn, warmup=5, reps=30):
    s0 = torch.cuda.memory_stats()
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    ts = [start.elapsed_time(end) for start, end in events]
    s1 = torch.cuda.memory_stats()
    if (current.get("shape"), current.get("seqlen")) in WATCH:
        print(f"  reps {current.get('impl', '?')}: " + " ".join(f"{t:.2f}" for t in ts)
              + f" | retries +{s1.get('num_alloc_retries', 0) - s0.get('num_alloc_retries', 0)}"
              f" device mallocs +{s1.get('num_device_alloc', 0) - s0.get('num_device_alloc', 0)}"
              f" reserved {s1.get('reserved_bytes.all.current', 0) / 2**30:.1f} GiB", flush=True)
    return statistics.median(ts)


def interleaved(runs, reps, rounds=3):
    names = list(runs)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            current["impl"] = name
            times[name].append(logged_median(runs[name], reps=reps))
    return {name: statistics.median(t) for name, t in times.items()}


bm.time_interleaved = interleaved
orig_dense, orig_varlen = bm.dense_fn, bm.varlen_fn


def dense(impl, q, *args):
    current["seqlen"] = q.shape[1]
    return orig_dense(impl, q, *args)


def varlen(*args):
    current["seqlen"] = "packed"
    return orig_varlen(*args)


bm.dense_fn, bm.varlen_fn = dense, varlen


def log(msg):
    print(msg, flush=True)


models = sys.argv[1:] or list(bm.MODELS)
for shape in models:
    current["shape"] = shape
    bm.run_models([shape], [2048, 8192, 32768], 32768, ["flash_attn2", "sdpa_cudnn", "sdpa_flash"], ["bwd", "fwd_bwd"],
                  10, log=log)
