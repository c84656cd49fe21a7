// Which key blocks a query block visits (forward), or which query blocks a key block visits (backward),
// and which of those need the mask. Blocks past the causal diagonal are never loaded; only the diagonal
// blocks and a partial last key block are masked.
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

// The backward's transpose: which query blocks see key block n_block. Visit m_max - 1 down to m_min;
// blocks >= m_unmasked_min need no mask (every row sees every key), the ones below cross the diagonal.
struct BwdBlockRange {
  int m_min, m_max, m_unmasked_min;
};

template <int kBlockM, int kBlockN>
__device__ BwdBlockRange bwd_block_range(int len_q, int len_k, int n_block, bool causal) {
  const int m_max = cute::ceil_div(len_q, kBlockM);
  // The last key block may run past the sequence: every query block masks those columns.
  const bool keys_cut = (n_block + 1) * kBlockN > len_k;
  if (!causal) return {0, m_max, keys_cut ? m_max : 0};
  // Row i sees key j iff j <= i + diag: the block's first key from row n_block * kBlockN - diag on,
  // all of its keys from row (n_block + 1) * kBlockN - 1 - diag on.
  const int diag = len_k - len_q;
  const int m_min = min(m_max, max(0, n_block * kBlockN - diag) / kBlockM);
  const int m_all = cute::ceil_div(max(0, (n_block + 1) * kBlockN - 1 - diag), kBlockM);
  return {m_min, m_max, keys_cut ? m_max : max(m_min, min(m_max, m_all))};
}

}  // namespace flash_attn2
