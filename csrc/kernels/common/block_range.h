// Which key blocks a query block visits (forward), or which query blocks a key block visits (backward),
// and which of those need the mask. Blocks outside the window (past the causal diagonal, before a sliding
// window's left edge) are never loaded; only the blocks its edges cross and a partial last block are masked.
#pragma once

#include <cute/int_tuple.hpp>

#include "common/mask.h"

namespace flash_attn2 {

// Visit key blocks n_max - 1 down to n_min: those in [n_masked_min, n_max) mask the right edge (MaskRight),
// those in [n_unmasked_min, n_masked_min) nothing, those in [n_min, n_unmasked_min) both edges (MaskBoth).
struct BlockRange {
  int n_min, n_max, n_masked_min, n_unmasked_min;
};

// Whole key blocks below key `key` (>= 0), and blocks that reach it: unsigned, so that they are shifts.
template <int kBlockN>
__host__ __device__ int blocks_below(int key) { return int(unsigned(key) / kBlockN); }
template <int kBlockN>
__host__ __device__ int blocks_to(int key) { return int((unsigned(key) + kBlockN - 1) / kBlockN); }

// Query block m_block: rows [m_block * kBlockM, min((m_block + 1) * kBlockM, len_q)), not empty. Without a
// left edge (kLeftEdge false: the plain kernels') the blocks start at 0 and none masks both edges.
template <int kBlockM, int kBlockN, bool kLeftEdge>
__device__ BlockRange fwd_block_range(const Window& w, int m_block) {
  const int row_first = m_block * kBlockM, row_last = min(row_first + kBlockM, w.len_q) - 1;
  // The first row sees the fewest keys on the right, the last row the fewest on the left.
  const int n_max = blocks_to<kBlockN>(max(0, w.key_end(row_last)));
  if constexpr (!kLeftEdge) return {0, n_max, min(n_max, blocks_below<kBlockN>(max(0, w.key_end(row_first)))), 0};
  const int n_min = min(n_max, blocks_below<kBlockN>(w.key_begin(row_first)));
  auto clamp = [&](int n) { return max(n_min, min(n_max, n)); };
  const int n_unmasked_min = clamp(blocks_to<kBlockN>(w.key_begin(row_last)));
  // Blocks both edges cross (a window narrower than a block) are the left edge's: they mask both.
  const int n_masked_min = max(n_unmasked_min, clamp(blocks_below<kBlockN>(max(0, w.key_end(row_first)))));
  return {n_min, n_max, n_masked_min, n_unmasked_min};
}

// The same for query rows [row_first, row_last] of any tile (the split-KV forward's packed tiles: several
// heads' rows of a few queries). A copy of fwd_block_range's arithmetic rather than its body: routing the
// training kernels through this one is left for a SASS comparison.
template <int kBlockN, bool kLeftEdge>
__device__ BlockRange fwd_block_range_rows(const Window& w, int row_first, int row_last) {
  const int n_max = blocks_to<kBlockN>(max(0, w.key_end(row_last)));
  if constexpr (!kLeftEdge) return {0, n_max, min(n_max, blocks_below<kBlockN>(max(0, w.key_end(row_first)))), 0};
  const int n_min = min(n_max, blocks_below<kBlockN>(w.key_begin(row_first)));
  auto clamp = [&](int n) { return max(n_min, min(n_max, n)); };
  const int n_unmasked_min = clamp(blocks_to<kBlockN>(w.key_begin(row_last)));
  const int n_masked_min = max(n_unmasked_min, clamp(blocks_below<kBlockN>(max(0, w.key_end(row_first)))));
  return {n_min, n_max, n_masked_min, n_unmasked_min};
}

// The backward's transpose: visit query blocks m_max - 1 down to m_min: those in [m_unmasked_max, m_max) mask
// both edges (MaskBoth: the left one crosses them), those in [m_unmasked_min, m_unmasked_max) nothing, those
// in [m_min, m_unmasked_min) the right edge (MaskRight: the causal diagonal, or keys past the sequence).
struct BwdBlockRange {
  int m_min, m_max, m_unmasked_min, m_unmasked_max;
};

// Key block n_block: keys [n_block * kBlockN, min((n_block + 1) * kBlockN, len_k)), not empty.
template <int kBlockM, int kBlockN>
__host__ __device__ BwdBlockRange bwd_block_range(const Window& w, int n_block) {
  const int key_first = n_block * kBlockN, key_last = min(key_first + kBlockN, w.len_k) - 1;
  const int m_max = cute::ceil_div(w.row_end(key_last), kBlockM);
  const int m_min = min(m_max, w.row_begin(key_first) / kBlockM);
  auto clamp = [&](int m) { return max(m_min, min(m_max, m)); };
  // Rows below row_end(key_first) see the block's first key (rows past the sequence are each kernel's to
  // handle, as without a window); blocks from the first that crosses the left edge on mask both edges.
  const int first_key_end = w.row_end(key_first);
  const int m_unmasked_max = first_key_end == w.len_q ? m_max : clamp(first_key_end / kBlockM);
  // The last key block may run past the sequence: every query block masks those columns.
  if (key_first + kBlockN > w.len_k) return {m_min, m_max, m_unmasked_max, m_unmasked_max};
  // Rows from row_begin(key_last) on see the block's last key.
  const int m_unmasked_min = min(m_unmasked_max, clamp(cute::ceil_div(w.row_begin(key_last), kBlockM)));
  return {m_min, m_max, m_unmasked_min, m_unmasked_max};
}

// The first key block that visits query block m_block, given a key block n_block that does. As n rises,
// neither m_min nor m_max falls, so the key blocks visiting a query block are consecutive and the first is
// the lowest whose m_max passes m_block: a bisection over [0, n_block]. Deterministic mode orders the dQ
// adds by it (sm90/dq_turns.h); host code checks it by brute force (benchmarks/dev/check_dq_turns.cu).
template <int kBlockM, int kBlockN>
__host__ __device__ int bwd_first_key_block(const Window& w, int m_block, int n_block) {
  int lo = 0, hi = n_block;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (bwd_block_range<kBlockM, kBlockN>(w, mid).m_max > m_block) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

}  // namespace flash_attn2
