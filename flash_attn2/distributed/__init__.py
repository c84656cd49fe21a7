"""flash_attn2.distributed: attention over a sequence split across GPUs (context parallelism).

ring-flash-attn 0.1.8's functions on flash_attn2's kernels (`ring.py`): ring_flash_attn_func (contiguous shards),
zigzag_ring_flash_attn_func (zigzag_shard: balanced causal work), stripe_flash_attn_func (stripe_shard), forward and
backward, GQA without expanding K / V, fp32 merges and gradient sums. They share one pure-Python schedule
(`_schedule.py`: which rank computes which (query, key) block with which mask at each ring step) and the -inf-safe
merge (`_merge.py`) with the single-process emulation (tests/test_ring_math.py) and the gloo tests
(tests/test_ring_gloo.py). Status (issue #51): checked on the CPU only; varlen, the all-gather (llama3) form,
windows, overlap of the backward's exchange and torch.compile are not built yet. `import flash_attn2` never imports
this package.
"""

from ._merge import merge_partial
from ._schedule import CAUSAL, CAUSAL_STRICT, FULL, Task, coverage, ring_tasks, shard_indices
from .ring import (ring_flash_attn_func, stripe_flash_attn_func, stripe_shard, unshard, zigzag_ring_flash_attn_func,
                   zigzag_shard)

__all__ = ["CAUSAL", "CAUSAL_STRICT", "FULL", "Task", "coverage", "merge_partial", "ring_flash_attn_func",
           "ring_tasks", "shard_indices", "stripe_flash_attn_func", "stripe_shard", "unshard",
           "zigzag_ring_flash_attn_func", "zigzag_shard"]
