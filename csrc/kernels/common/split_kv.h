// The split-KV forward's shared rules (host and device, no CuTe): GQA packing, the grid, the rows one batch
// entry reads from a KV cache, each split's key blocks and where its partials live. dispatch.cpp plans with the
// same functions the kernel runs, so that grid and kernel cannot disagree.
//
// GQA packing: the query heads of one kv head (pack of them) share a tile, packed row r being query row r / pack
// of head head0 + r % pack, so a tile reads each key once for all of them. ALiBi gives every head its own bias
// (Alibi holds one slope): with it, pack is 1.
#pragma once

#include <cstdint>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

__host__ __device__ inline int split_pack(const FwdParams& p) {
  return p.alibi_slopes == nullptr ? p.num_heads / p.num_heads_k : 1;
}

// Grid: x the packed query tiles, y the splits, z (batch, head group).
struct SplitGrid {
  int m_blocks, splits, groups;  // groups: batch * num_heads / pack
};

__host__ __device__ inline SplitGrid split_grid(const FwdParams& p, int block_m, int splits) {
  const int pack = split_pack(p);
  const int64_t rows = int64_t(p.seqlen_q) * pack;
  return {int((rows + block_m - 1) / block_m), splits, p.batch * (p.num_heads / pack)};
}

// The key blocks of split `split` of `splits` over blocks [n_min, n_max): equal shares of ceil(n / splits),
// so the last splits may be empty (begin >= end).
struct SplitBlocks {
  int begin, end;
};

__host__ __device__ inline SplitBlocks split_blocks(int n_min, int n_max, int split, int splits) {
  const int per = (n_max - n_min + splits - 1) / splits;
  const int begin = n_min + split * per;
  return {begin, begin + per < n_max ? begin + per : n_max};
}

// Element offsets into split_accum (flash_attn2.h): the partial output row and the partial LSE of (split, batch
// entry, head, query row).
__host__ __device__ inline int64_t split_row(const FwdParams& p, int split, int bidb, int head, int row) {
  return ((int64_t(split) * p.batch + bidb) * p.num_heads + head) * p.seqlen_q + row;
}
__host__ __device__ inline int64_t split_lse_offset(const FwdParams& p, int splits) {
  return int64_t(splits) * p.batch * p.num_heads * p.seqlen_q * p.head_dim;
}

#ifdef __CUDACC__
// The k / v rows batch entry bidb reads (flash_attn2.h's kv-cache fields, each clamped): k / v batch entry
// kv_bidb, rows [start, start + len_k).
struct KvRows {
  int kv_bidb;
  int start, len_k;

  __device__ KvRows(const FwdParams& p, int bidb) {
    kv_bidb = bidb;
    if (p.kv_batch_idx != nullptr) {
      const int idx = p.kv_batch_idx[bidb];
      kv_bidb = idx < 0 ? 0 : idx >= p.kv_batch ? p.kv_batch - 1 : idx;
    }
    int64_t end = p.seqlen_k;
    if (p.seqused_k != nullptr) {
      const int used = p.seqused_k[bidb];
      end = int64_t(used < 0 ? 0 : used > p.seqlen_k ? p.seqlen_k : used) + p.seqused_k_add;
      end = end > p.seqlen_k ? p.seqlen_k : end;
    }
    int begin = p.leftpad_k != nullptr ? p.leftpad_k[bidb] : 0;
    begin = begin < 0 ? 0 : begin > end ? int(end) : begin;
    start = begin, len_k = int(end) - begin;
  }
};
#endif

}  // namespace flash_attn2
