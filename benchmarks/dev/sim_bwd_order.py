# The causal Hopper backward's grid as a list scheduler: 132 SMs, one block each, every block taking
# (query heads per block) x (query blocks that see its keys) steps plus a fixed overhead, blocks dispatched in
# the grid's order as SMs free up. Prints each order's makespan over the ideal (total work / SMs): sections
# of at least S (batch, kv head) pairs (pairs // S balanced sections), longest key block first within each
# (S = 1: main's pair-by-pair order; "auto": about two waves of key blocks per section, FA2_DEV_SECTION=0 on
# wip/dev-splits), and pair by pair with only the last T pairs interleaved (T2, T3, T6: the prepared
# bwd_tail_pairs.patch's FA2_DEV_TAIL). It ignores L2, which sank the all-pairs order (TUNING 41); it
# predicts what a tail can give back before a GPU run.
#   python benchmarks/dev/sim_bwd_order.py
import heapq
import math

SMS, OVERHEAD_STEPS = 132, 3


def makespan(order, steps):
    free = [(0.0, sm) for sm in range(SMS)]
    end = 0.0
    for block in order:
        t, sm = heapq.heappop(free)
        end = max(end, t + steps[block])
        heapq.heappush(free, (t + steps[block], sm))
    return end


def sections(pairs, key_blocks, size, splits):
    """pairs // size sections (at least one) of balanced sizes, at least `size` pairs each."""
    count = max(1, pairs // size)
    bounds = [i * pairs // count for i in range(count + 1)]
    return [(p, n, s) for first, end in zip(bounds, bounds[1:]) for n in range(key_blocks)
            for p in range(first, end) for s in range(splits)]


def tail(pairs, key_blocks, size, splits):
    """Pair by pair, but the last `size` pairs' key blocks interleaved, longest first across them."""
    first = pairs - size
    return ([(p, n, s) for p in range(first) for n in range(key_blocks) for s in range(splits)] +
            [(p, n, s) for n in range(key_blocks) for p in range(first, pairs) for s in range(splits)])


def case(name, batch, heads_k, group, seqlen, block_m=128, block_n=128, splits=1):
    pairs, key_blocks, query_blocks = batch * heads_k, math.ceil(seqlen / block_n), math.ceil(seqlen / block_m)
    steps = {(p, n, s): group // splits * (query_blocks - n * block_n // block_m) + OVERHEAD_STEPS
             for p in range(pairs) for n in range(key_blocks) for s in range(splits)}
    ideal = sum(steps.values()) / SMS
    sizes = {f"S{size}": size for size in (1, 2, 4, 8, 16)}
    sizes["auto"] = math.ceil(2 * SMS / key_blocks)
    ratios = " ".join(f"{k} {makespan(sections(pairs, key_blocks, v, splits), steps) / ideal:.3f}"
                      for k, v in sizes.items())
    ratios += "".join(f" T{t} {makespan(tail(pairs, key_blocks, t, splits), steps) / ideal:.3f}"
                      for t in (2, 3, 6) if t <= pairs)
    print(f"{name} ({pairs} pairs x {key_blocks} key blocks): {ratios}")


case("Qwen2.5-7B 8k (4 x 28:4)", 4, 4, 7, 8192)
case("Qwen2.5-7B 32k (1 x 28:4)", 1, 4, 7, 32768)
case("Llama-3-8B 8k (4 x 32:8)", 4, 8, 4, 8192)
case("70B slice 2k (16 x 8:1, 4 splits)", 16, 1, 8, 2048, splits=4)
for seqlen in (1024, 2048, 4096, 8192):
    case(f"grid d 128 causal {seqlen}", 16384 // seqlen, 16, 1, seqlen)
    case(f"grid d 256 causal {seqlen}", 16384 // seqlen, 8, 1, seqlen, block_m=64, block_n=80)
