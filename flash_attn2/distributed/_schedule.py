"""The ring's schedule, pure Python: which (query rows, key rows) blocks a rank computes at each step, with which mask.

A sequence of `seqlen` tokens is split over `world` ranks in one of three layouts (shard_indices):
- "contiguous": rank r holds tokens [r L, (r + 1) L), L = seqlen / world;
- "zigzag": 2 world chunks of C = seqlen / (2 world) tokens; rank r holds chunks r and 2 world - 1 - r (the head-tail
  order of PyTorch's _HeadTailLoadBalancer and ring-flash-attn's zigzag), which gives every rank the same causal work;
- "stripe": rank r holds tokens r, r + world, r + 2 world, ... (striped attention).
At ring step s rank r holds the keys and values of rank src = (r - s) mod world and computes ring_tasks(...): blocks
of its local query rows against src's local key rows, each with a mask the kernels take as is:
- FULL: every query row sees every key row (causal=False);
- CAUSAL: equal-length blocks on the diagonal, row i sees keys <= i (causal=True, bottom-right aligned);
- CAUSAL_STRICT: row i sees keys < i (stripe's blocks from a later rank): the kernels run it as rows [1:) against keys
  [:-1) with causal=True, row 0 seeing nothing.
The GPU drivers and the CPU emulation (tests/test_ring_math.py) run the same tasks; `coverage` checks that every
visible (query, key) pair is computed exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, CAUSAL, CAUSAL_STRICT = "full", "causal", "causal_strict"
LAYOUTS = ("contiguous", "zigzag", "stripe")


@dataclass(frozen=True)
class Task:
    q: tuple[int, int]  # [begin, end) of the rank's local query rows
    k: tuple[int, int]  # [begin, end) of the source rank's local key rows
    mask: str           # FULL, CAUSAL or CAUSAL_STRICT


def check_layout(layout: str, seqlen: int, world: int) -> None:
    """Raises ValueError unless `layout` is known and `seqlen` splits into its shards for `world` ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"flash_attn2.distributed: layout must be one of {LAYOUTS}, got {layout!r}")
    if world < 1:
        raise ValueError(f"flash_attn2.distributed: world size must be >= 1, got {world}")
    parts = 2 * world if layout == "zigzag" else world
    if seqlen % parts:
        raise ValueError(f"flash_attn2.distributed: the {layout} layout needs a sequence length divisible by {parts} "
                         f"({'2 x ' if layout == 'zigzag' else ''}world size {world}), got {seqlen}")


def _chunks(layout: str, rank: int, world: int) -> list[int]:
    """The global chunk indices rank holds, in local order (contiguous and zigzag)."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def shard_ranges(layout: str, seqlen: int, world: int, rank: int) -> list[range]:
    """The global token positions rank `rank` holds, in its local order, as one or two ranges (the ring's shard /
    unshard helpers turn them into index tensors without listing every position)."""
    check_layout(layout, seqlen, world)
    if layout == "stripe":
        return [range(rank, seqlen, world)]
    chunk = seqlen // (world if layout == "contiguous" else 2 * world)
    return [range(c * chunk, (c + 1) * chunk) for c in _chunks(layout, rank, world)]


def shard_indices(layout: str, seqlen: int, world: int, rank: int) -> list[int]:
    """The global token positions rank `rank` holds, in its local order."""
    return [i for r in shard_ranges(layout, seqlen, world, rank) for i in r]


def ring_tasks(layout: str, seqlen: int, world: int, rank: int, step: int, causal: bool) -> list[Task]:
    """The blocks rank computes at ring step `step` (keys from rank (rank - step) mod world), adjacent ones coalesced
    into fewer, larger kernel calls."""
    check_layout(layout, seqlen, world)
    src = (rank - step) % world
    local = seqlen // world
    if not causal:
        return [Task((0, local), (0, local), FULL)]
    if src == rank:
        # The rank's own keys: every layout keeps a rank's tokens in increasing position, so its whole diagonal block
        # is one causal call (zigzag's two chunks too: the second sees all of the first), with no merge.
        return [Task((0, local), (0, local), CAUSAL)]
    if layout == "stripe":
        return [Task((0, local), (0, local), CAUSAL if src <= rank else CAUSAL_STRICT)]
    size = seqlen // len(_chunks(layout, rank, world)) // world  # tokens per chunk
    tasks = []
    for qi, qc in enumerate(_chunks(layout, rank, world)):
        for ki, kc in enumerate(_chunks(layout, src, world)):
            if kc < qc:
                tasks.append(Task((qi * size, (qi + 1) * size), (ki * size, (ki + 1) * size), FULL))
            elif kc == qc:
                tasks.append(Task((qi * size, (qi + 1) * size), (ki * size, (ki + 1) * size), CAUSAL))
    return _coalesce(tasks)


def _coalesce(tasks: list[Task]) -> list[Task]:
    """FULL tasks that share one range and abut in the other become one."""
    changed = True
    while changed:
        changed = False
        for a in range(len(tasks)):
            for b in range(len(tasks)):
                ta, tb = tasks[a], tasks[b]
                if a == b or ta.mask != FULL or tb.mask != FULL:
                    continue
                if ta.k == tb.k and ta.q[1] == tb.q[0]:
                    merged = Task((ta.q[0], tb.q[1]), ta.k, FULL)
                elif ta.q == tb.q and ta.k[1] == tb.k[0]:
                    merged = Task(ta.q, (ta.k[0], tb.k[1]), FULL)
                else:
                    continue
                tasks = [t for i, t in enumerate(tasks) if i not in (a, b)] + [merged]
                changed = True
                break
            if changed:
                break
    return sorted(tasks, key=lambda t: (t.q, t.k))


def coverage(layout: str, seqlen: int, world: int, causal: bool) -> dict[tuple[int, int], int]:
    """{(query position, key position): how many tasks compute it} over all ranks and steps (global positions)."""
    counts: dict[tuple[int, int], int] = {}
    for rank in range(world):
        q_pos = shard_indices(layout, seqlen, world, rank)
        for step in range(world):
            src = (rank - step) % world
            k_pos = shard_indices(layout, seqlen, world, src)
            for t in ring_tasks(layout, seqlen, world, rank, step, causal):
                for i in range(t.q[0], t.q[1]):
                    for j in range(t.k[0], t.k[1]):
                        li, lj = i - t.q[0], j - t.k[0]
                        if t.mask == CAUSAL and lj > li:
                            continue
                        if t.mask == CAUSAL_STRICT and lj >= li:
                            continue
                        key = (q_pos[i], k_pos[j])
                        counts[key] = counts.get(key, 0) + 1
    return counts
