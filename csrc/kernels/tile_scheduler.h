// Which (query block, batch, head) tile a thread block computes, and how many blocks the grid has; used
// by the forward and the dQ conversion. One tile per block: a kernel that loops over tiles spilled more
// and ran the forward 6% slower (benchmarks/TUNING.md step 15).
//
// Fixed-length: ceil(seqlen_q / kBlockM) blocks per (batch, head), the query block fastest, so the blocks
// of one head run together and share its K/V through L2; within a head the longest causal rows go first.
//
// Varlen: max_seqlen_q is only a hint, so the grid is sized from the packed length instead. Each head gets
// total_q / kBlockM + batch tile slots: sequence b's tiles take the slots from
// first_slot(b) = start_b / kBlockM + b on, which leaves room for its ceil(len_b / kBlockM) tiles before
// sequence b + 1's first slot (a sequence leaves at most one slot empty). A block finds its sequence by a
// 32-way search over cu_seqlens (two rounds up to 1024 sequences). Skewed batches launch far fewer blocks
// than batch * ceil(max_seqlen / kBlockM) would.
#pragma once

#include <cstdint>

#include "flash_attn2/flash_attn2.h"
#include "seqlen.h"

namespace flash_attn2 {

template <int kBlockM>
struct QueryTileScheduler {
  struct Tile {
    int bidb, bidh, m_block;
    bool valid;       // false: an empty slot, or rows past a short sequence
    int rank, ranks;  // this block among the head's blocks (they share the head's zero-fill work)
  };

  __host__ __device__ static int64_t slots_per_head(const FwdParams& p) {
    return p.cu_seqlens_q != nullptr ? p.total_q / kBlockM + p.batch
                                     : int64_t(p.batch) * ((p.seqlen_q + kBlockM - 1) / kBlockM);
  }

  __host__ __device__ static int64_t num_blocks(const FwdParams& p) { return slots_per_head(p) * p.num_heads; }

  __device__ static Tile get(const FwdParams& p) {
    if (p.cu_seqlens_q == nullptr) {
      const int num_m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
      const int rank = int(blockIdx.x % num_m_blocks);
      const int bidh = int(blockIdx.x / num_m_blocks) % p.num_heads;
      const int bidb = int(blockIdx.x / num_m_blocks) / p.num_heads;
      return {bidb, bidh, num_m_blocks - 1 - rank, true, bidb * num_m_blocks + rank, p.batch * num_m_blocks};
    }
    const int ranks = int(slots_per_head(p));
    const int slot = int(blockIdx.x % ranks);
    const int bidh = int(blockIdx.x / ranks);
    const int bidb = sequence_of_slot(p.cu_seqlens_q, p.batch, p.total_q, slot);
    const RowRange rows = packed_rows(p.cu_seqlens_q, bidb, p.total_q);
    const int num_tiles = int((rows.end - rows.begin + kBlockM - 1) / kBlockM);
    const int j = slot - first_slot(p.cu_seqlens_q, bidb, p.total_q);  // this sequence's j-th slot
    return {bidb, bidh, num_tiles - 1 - j, 0 <= j && j < num_tiles, slot, ranks};
  }

 private:
  __device__ static int first_slot(const int* cu_seqlens, int b, int64_t total) {
    return int(clamp_row(cu_seqlens[b], 0, total) / kBlockM) + b;
  }

  // The last b with first_slot(b) <= slot (0 if none). Every warp searches, 32 candidates per round; all
  // 32 lanes must be active.
  __device__ static int sequence_of_slot(const int* cu_seqlens, int batch, int64_t total, int slot) {
    const int lane = threadIdx.x % 32;
    int lo = 0, span = batch;  // the answer lies in [lo, lo + span)
    while (span > 1) {
      const int stride = (span + 31) / 32;
      const int b = lo + lane * stride;
      const bool at_or_before = b < lo + span && first_slot(cu_seqlens, b, total) <= slot;
      const unsigned ballot = __ballot_sync(0xffffffffu, at_or_before);
      const int k = ballot ? 31 - __clz(ballot) : 0;
      lo += k * stride;
      span = min(stride, span - k * stride);
    }
    return lo;
  }
};

}  // namespace flash_attn2
