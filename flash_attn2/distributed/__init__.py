"""flash_attn2.distributed: attention over a sequence split across GPUs (context parallelism).

ring-flash-attn 0.1.8's functions on flash_attn2's kernels (`ring.py`): ring_flash_attn_func (contiguous shards),
zigzag_ring_flash_attn_func (zigzag_shard: balanced causal work), stripe_flash_attn_func (stripe_shard), forward and
backward, GQA without expanding K / V, fp32 merges and gradient sums (on 2 ranks the sums stay in the inputs'
dtype: at most two contributions a row or key, bitwise the fp32 sum rounded once). They share one pure-Python schedule
(`_schedule.py`: which rank computes which (query, key) block with which mask at each ring step) and the -inf-safe
merge (`_merge.py`) with the single-process emulation (tests/test_ring_math.py) and the gloo tests
(tests/test_ring_gloo.py). The all-gather form (`llama3.py`: llama3_flash_attn_varlen_func with its prepare step)
takes packed documents of any length, GQA and causal windows; `ring_varlen.py` the ring and zigzag over packed
documents (each split over the ranks, local cu_seqlens); `packed.py` every function's qkv- and kv-packed form.
Communication overlaps compute in both directions; the dense rings are torch custom ops (torch.compile traces through
them). A rank whose own checks refuse a call tells its peers in their shape agreement (ring.refuse_with_peers), so
that every rank raises instead of one waiting in the ring. Status (issue #51): the CPU tests (emulation, gloo) and
the NCCL tests on 2 and 4 H200s pass; benchmarks/ring_bench.py's rows are in benchmarks/results.
`import flash_attn2` never imports this package.
"""

from ._merge import merge_partial
from ._schedule import CAUSAL, CAUSAL_STRICT, FULL, Task, coverage, ring_tasks, shard_indices
from .llama3 import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func
from .packed import (llama3_flash_attn_varlen_kvpacked_func, llama3_flash_attn_varlen_qkvpacked_func,
                     ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func,
                     ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func,
                     stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func,
                     zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func,
                     zigzag_ring_flash_attn_varlen_kvpacked_func, zigzag_ring_flash_attn_varlen_qkvpacked_func)
from .ring import (ring_flash_attn_func, stripe_flash_attn_func, stripe_shard, unshard, zigzag_ring_flash_attn_func,
                   zigzag_shard)
from .ring_varlen import ring_flash_attn_varlen_func, varlen_shard, zigzag_ring_flash_attn_varlen_func

__all__ = ["CAUSAL", "CAUSAL_STRICT", "FULL", "Task", "coverage", "llama3_flash_attn_prepare_cu_seqlens",
           "llama3_flash_attn_varlen_func", "merge_partial", "ring_flash_attn_func",
           "ring_flash_attn_varlen_func", "ring_tasks", "shard_indices", "stripe_flash_attn_func", "stripe_shard",
           "unshard", "varlen_shard", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_varlen_func",
           "zigzag_shard", "ring_flash_attn_qkvpacked_func", "ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_kvpacked_func",
           "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_kvpacked_func",
           "ring_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_varlen_kvpacked_func",
           "zigzag_ring_flash_attn_varlen_qkvpacked_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
           "llama3_flash_attn_varlen_qkvpacked_func", "llama3_flash_attn_varlen_kvpacked_func"]
