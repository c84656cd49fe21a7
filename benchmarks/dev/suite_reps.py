# The model suite's backward rows with every timed rep logged (not only the median) and the caching allocator's
# retries / device mallocs around each timing: is a shape's fwd_bwd extra (TUNING 89, 102) in every rep or in a
# few, and does the allocator free and re-malloc under it?
#   python benchmarks/dev/suite_reps.py [model ...]   (default: the whole suite)
import statistics
import sys

import torch

import flash_attn2.bench.grid as bench
from flash_attn2.bench import models as bm

WATCH = {("qwen2.5-7b", 8192), ("llama3-70b-tp8", 32768), ("gemma2-9b", 8192)}
current = {}  # the shape and seqlen being run
impl_of = {}
orig_make_run, orig_dense, orig_varlen = bm.make_run, bm.dense_fn, bm.varlen_fn


def make_run(impl, *args):
    run = orig_make_run(impl, *args)
    impl_of[run] = impl
    return run


def dense(impl, q, *args):
    current["seqlen"] = q.shape[1]
    return orig_dense(impl, q, *args)


def varlen(*args):
    current["seqlen"] = "packed"
    return orig_varlen(*args)


def logged_median(fn, warmup=5, reps=30):
    """The suite's median_ms (time_interleaved calls it by name), each rep and the allocator's counters logged."""
    s0 = torch.cuda.memory_stats()
    ts = bench.rep_times_ms(fn, warmup, reps)
    s1 = torch.cuda.memory_stats()
    if (current.get("shape"), current.get("seqlen")) in WATCH:
        grew = lambda key: s1.get(key, 0) - s0.get(key, 0)
        print(f"  reps {impl_of.get(fn, '?')}: " + " ".join(f"{t:.2f}" for t in ts)
              + f" | retries +{grew('num_alloc_retries')} device mallocs +{grew('num_device_alloc')}"
              f" reserved {s1.get('reserved_bytes.all.current', 0) / 2**30:.1f} GiB", flush=True)
    return statistics.median(ts)


bm.make_run, bm.dense_fn, bm.varlen_fn = make_run, dense, varlen
bench.median_ms = logged_median


def log(msg):
    print(msg, flush=True)


models = sys.argv[1:] or list(bm.MODELS)
for shape in models:
    current["shape"] = shape
    bm.run_models([shape], [2048, 8192, 32768], 32768, ["flash_attn2", "sdpa_cudnn", "sdpa_flash"], ["bwd", "fwd_bwd"],
                  10, log=log)
