"""flash_attn2.distributed: attention over a sequence split across GPUs (context parallelism).

Built so far (issue #51, CPU side): the shared schedule (`_schedule.py`: which rank computes which (query, key) block
with which mask at each ring step, for the contiguous, zigzag and stripe layouts) and the -inf-safe merge of partial
results (`_merge.py`), checked by a single-process emulation against a float64 reference (tests/test_ring_math.py).
The NCCL ring drivers are not built yet. `import flash_attn2` never imports this package (nor torch.distributed).
"""

from ._merge import merge_partial
from ._schedule import CAUSAL, CAUSAL_STRICT, FULL, Task, coverage, ring_tasks, shard_indices

__all__ = ["CAUSAL", "CAUSAL_STRICT", "FULL", "Task", "coverage", "merge_partial", "ring_tasks", "shard_indices"]
