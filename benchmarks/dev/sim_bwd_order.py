# The causal Hopper backward's grid as a list scheduler: 132 SMs, one block each, every block taking
# (query heads per block) x (query blocks that see its keys) steps plus a fixed overhead, blocks dispatched in
# the grid's order as SMs free up. Prints each order's makespan over the ideal (total work / SMs), to predict
# what a key-block order (TUNING 41, "Next" 1) can gain from its tail before a GPU run.
#   python benchmarks/dev/sim_bwd_order.py
import heapq

SMS, BLOCK_N, OVERHEAD_STEPS = 132, 128, 3


def makespan(order, steps):
    free = [(0.0, sm) for sm in range(SMS)]
    end = 0.0
    for block in order:
        t, sm = heapq.heappop(free)
        end = max(end, t + steps[block])
        heapq.heappush(free, (t + steps[block], sm))
    return end


def orders(pairs, key_blocks, splits):
    """Block lists (pair, key-block rank, split) in each order; rank 0 is the longest key block."""
    pair_major = [(p, r, s) for p in range(pairs) for r in range(key_blocks) for s in range(splits)]
    out = {"pair-major (main)": pair_major}
    for size in (2, 4):
        out[f"sections of {size}"] = [(p, r, s) for first in range(0, pairs, size) for r in range(key_blocks)
                                      for p in range(first, min(pairs, first + size)) for s in range(splits)]
    out["rank-major"] = [(p, r, s) for r in range(key_blocks) for p in range(pairs) for s in range(splits)]
    return out


def case(name, batch, heads_k, group, seqlen, splits=1):
    key_blocks = seqlen // BLOCK_N
    all_orders = orders(batch * heads_k, key_blocks, splits)
    steps = {b: group // splits * (key_blocks - b[1]) + OVERHEAD_STEPS for b in all_orders["rank-major"]}
    ideal = sum(steps.values()) / SMS
    ratios = ", ".join(f"{k} {makespan(v, steps) / ideal:.3f}" for k, v in all_orders.items())
    print(f"{name}: {ratios}")


case("Qwen2.5-7B 8k (4 x 28:4)", 4, 4, 7, 8192)
case("Qwen2.5-7B 32k (1 x 28:4)", 1, 4, 7, 32768)
case("Llama-3-8B 8k (4 x 32:8)", 4, 8, 4, 8192)
case("70B slice 2k (16 x 8:1, 4 splits)", 16, 1, 8, 2048, splits=4)
case("70B slice 32k (1 x 8:1, 4 splits)", 1, 1, 8, 32768, splits=4)
case("grid d 128 causal 2k (8 x 16)", 8, 16, 1, 2048)
case("grid d 128 causal 16k (1 x 16)", 1, 16, 1, 16384)
