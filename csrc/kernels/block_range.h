// Which key blocks a query block visits, and which of those need the mask. Key blocks past the
// causal diagonal are never loaded; only the diagonal blocks and a partial last block are masked.
#pragma once

#include <cute/int_tuple.hpp>

namespace flash_attn2 {

struct BlockRange {
  int n_min, n_max;  // visit key blocks n_max - 1 down to n_min
  int n_masked_min;  // blocks >= this one need the mask
};

template <int kBlockM, int kBlockN>
__device__ BlockRange fwd_block_range(int len_q, int len_k, int m_block, bool causal) {
  int n_max = cute::ceil_div(len_k, kBlockN);
  int n_masked_min = len_k % kBlockN == 0 ? n_max : n_max - 1;
  if (causal) {
    // Bottom-right alignment: query row i sees keys j <= i + len_k - len_q.
    const int diag = len_k - len_q;
    const int rows_end = min((m_block + 1) * kBlockM, len_q);
    n_max = min(n_max, cute::ceil_div(max(0, rows_end + diag), kBlockN));
    const int first_hidden_key = m_block * kBlockM + diag + 1;  // for the block's first row
    n_masked_min = min(n_masked_min, max(0, first_hidden_key) / kBlockN);
  }
  return {0, n_max, n_masked_min};
}

}  // namespace flash_attn2
