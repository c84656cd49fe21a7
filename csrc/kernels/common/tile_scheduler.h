// Which tile a thread block computes, and how many slots there are: (query block, batch, head) for the forward
// and the dQ conversion, (key block, batch, kv head) for the Hopper backward (kKeys). The SM80 kernels take one
// tile per block (a loop over tiles spilled more and ran 6% slower, benchmarks/TUNING.md step 15); the Hopper
// kernels are persistent: one block per SM walks the slots blockIdx.x, blockIdx.x + gridDim.x, ... (or claims
// them from a counter: sm90/scheduler.h).
//
// Fixed-length: ceil(seqlen / kBlock) blocks per (batch, head), the block index fastest, so the blocks
// of one head run together and share its K/V through L2; within a head the longest causal rows go first.
//
// Varlen: max_seqlen is only a hint, so the grid is sized from the packed length instead. Each head gets
// total / kBlock + batch tile slots: sequence b's tiles take the slots from
// first_slot(b) = start_b / kBlock + b on, which leaves room for its ceil(len_b / kBlock) tiles before
// sequence b + 1's first slot (a sequence leaves at most one slot empty). Blocks go sequence by sequence,
// then head by head, the tile fastest, as for fixed length: the longest sequence's heavy tiles
// start first. A block finds its sequence by a 32-way search over cu_seqlens (two rounds up to 1024
// sequences). Skewed batches launch far fewer blocks than batch * ceil(max_seqlen / kBlock) would.
#pragma once

#include <cstdint>

#include "flash_attn2/flash_attn2.h"
#include "common/seqlen.h"

namespace flash_attn2 {

struct WorkTile {
  int bidb, bidh, block;  // block: the query block (the Hopper backward: the key block, and bidh the kv head)
  bool valid;       // a tile to compute (not an empty slot)
  bool owns_slot;   // slot `rank` of head bidh: a share of that head's zero-fill work
  int rank, ranks;  // this block's slot among the head's `ranks` slots
};

// kBlockM rows per tile. kKeys: the same over key rows and kv heads (cu_seqlens_k, total_k, num_heads_k,
// seqlen_k), for the Hopper backward's key blocks.
template <int kBlockM, bool kKeys = false>
struct TileScheduler {

  __host__ __device__ static const int* cu_seqlens(const FwdParams& p) { return kKeys ? p.cu_seqlens_k : p.cu_seqlens_q; }
  __host__ __device__ static int64_t total(const FwdParams& p) { return kKeys ? p.total_k : p.total_q; }
  __host__ __device__ static int heads(const FwdParams& p) { return kKeys ? p.num_heads_k : p.num_heads; }
  __host__ __device__ static int seqlen(const FwdParams& p) { return kKeys ? p.seqlen_k : p.seqlen_q; }

  __host__ __device__ static int64_t slots_per_head(const FwdParams& p) {
    return cu_seqlens(p) != nullptr ? total(p) / kBlockM + p.batch
                                    : int64_t(p.batch) * ((seqlen(p) + kBlockM - 1) / kBlockM);
  }

  __host__ __device__ static int64_t num_blocks(const FwdParams& p) { return slots_per_head(p) * heads(p); }

  __device__ static WorkTile get(const FwdParams& p) { return get(p, int(blockIdx.x)); }

  // Slot `block` of the grid's order; a persistent kernel walks several.
  __device__ static WorkTile get(const FwdParams& p, int block) {
    if (cu_seqlens(p) == nullptr) {
      const int num_m_blocks = (seqlen(p) + kBlockM - 1) / kBlockM;
      const int rank = block % num_m_blocks;
      const int bidh = block / num_m_blocks % heads(p);
      const int bidb = block / num_m_blocks / heads(p);
      return {bidb, bidh, num_m_blocks - 1 - rank, true, true, bidb * num_m_blocks + rank, p.batch * num_m_blocks};
    }
    // Sequence b's blocks are [heads * first_slot(b), heads * first_slot(b + 1)), head-major; b = -1 and
    // b = batch stand for the empty slots before the first sequence and after the last.
    const int ranks = int(slots_per_head(p));
    const int bidb = sequence_of_block(p, block);
    const int first = bidb < 0 ? 0 : first_slot(p, bidb);
    const int slots = (bidb == p.batch ? ranks : first_slot(p, bidb + 1)) - first;  // < 1: bad cu_seqlens
    const int r = block - heads(p) * first;
    const int bidh = slots > 0 ? r / slots : -1, j = slots > 0 ? r % slots : -1;  // this sequence's j-th slot
    int num_tiles = 0;
    if (0 <= bidb && bidb < p.batch) {
      const RowRange rows = packed_rows(cu_seqlens(p), bidb, total(p));
      num_tiles = int((rows.end - rows.begin + kBlockM - 1) / kBlockM);
    }
    const bool owns_slot = 0 <= bidh && bidh < heads(p) && first + j < ranks;
    return {bidb, bidh, num_tiles - 1 - j, owns_slot && j < num_tiles, owns_slot, first + j, ranks};
  }

 private:
  __device__ static int first_slot(const FwdParams& p, int b) {
    return int(clamp_row(cu_seqlens(p)[b], 0, total(p)) / kBlockM) + b;
  }

  // The last b in 0..batch with heads * first_slot(b) <= block, or -1. Every warp searches, 32
  // candidates per round; all 32 lanes must be active.
  __device__ static int sequence_of_block(const FwdParams& p, int block) {
    const int lane = threadIdx.x % 32;
    int lo = 0, span = p.batch + 1;  // the answer lies in [lo, lo + span), or is -1
    while (span > 1) {
      const int stride = (span + 31) / 32;
      const int b = lo + lane * stride;
      const bool at_or_before = b < lo + span && int64_t(heads(p)) * first_slot(p, b) <= block;
      const unsigned ballot = __ballot_sync(0xffffffffu, at_or_before);
      const int k = ballot ? 31 - __clz(ballot) : 0;
      lo += k * stride;
      span = min(stride, span - k * stride);
    }
    return int64_t(heads(p)) * first_slot(p, lo) <= block ? lo : -1;
  }
};

// Fixed-length causal tiles for a persistent grid: tile work falls with the query block, so the slots go
// longest first (every head's last query block, then the next-to-last, ...). To keep K/V in L2, the
// (batch, head) pairs are cut into sections of `section_heads` that run one after the other, longest first
// within each; the direction alternates from round to round. The last `tail_heads` pairs (0: none) make one
// section of their own, so that pair-by-pair sections (section_heads 1) can still interleave the last
// pairs, whose long tiles would otherwise start last. kKeys: the same over key blocks and kv heads (the
// Hopper backward, whose first key block is the longest).
template <bool kKeys = false>
struct CausalTileOrder {
  int num_m_blocks, section_heads, tail_heads;

  __host__ __device__ int section_slots() const { return section_heads * num_m_blocks; }

  __device__ WorkTile get(const FwdParams& p, int slot) const {
    const int heads_per_batch = kKeys ? p.num_heads_k : p.num_heads;
    const int tail_first = p.batch * heads_per_batch - tail_heads;  // the tail section's first pair
    int first, heads;  // this section's first pair and its number of pairs
    if (tail_heads > 0 && slot >= tail_first * num_m_blocks) {
      first = tail_first, heads = tail_heads;
    } else {
      first = slot / section_slots() * section_heads, heads = min(section_heads, tail_first - first);
    }
    const int r = slot - first * num_m_blocks;
    const int round = r / heads, i = r % heads;
    const int pair = first + (round % 2 == 0 ? i : heads - 1 - i);
    return {pair / heads_per_batch, pair % heads_per_batch, num_m_blocks - 1 - round, true, false, 0, 1};
  }
};

}  // namespace flash_attn2
