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
#include "common/seqlen.h"

namespace flash_attn2 {

__host__ __device__ inline int split_pack(const FwdParams& p) {
  return p.alibi_slopes == nullptr ? p.num_heads / p.num_heads_k : 1;
}

// The most splits the split kernels merge inside a thread block cluster (sm80/fwd_split_kernel.h:
// cluster_combine): sm_90's portable cluster size is 8, H100 / H200 allow 16 by opting in (the launcher does; a GPU
// that refuses takes the combine kernel); more splits take the combine kernel.
constexpr int kMaxClusterSplits = 16, kMaxPortableClusterSplits = 8;

// Grid: x the packed query tiles, y the splits, z (batch, head group).
struct SplitGrid {
  int m_blocks, splits;
  int64_t groups;  // batch * num_heads / pack; the grid's z holds at most 65535 of them, the kernels loop over the rest
};

__host__ __device__ inline SplitGrid split_grid(const FwdParams& p, int block_m, int splits) {
  const int pack = split_pack(p);
  const int64_t rows = int64_t(p.seqlen_q) * pack;
  // At least one tile: with varlen, seqlen_q is a hint (0 allowed) and the tiles loop over the rows past it.
  const int64_t m_blocks = (rows + block_m - 1) / block_m, max_x = 0x7fffffff;  // the kernels loop past the grid's x
  return {int(m_blocks < 1 ? 1 : m_blocks > max_x ? max_x : m_blocks), splits, int64_t(p.batch) * (p.num_heads / pack)};
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
// One batch entry's rows, for fixed-length, varlen and KV-cache calls (each device value clamped: seqlen.h for
// cu_seqlens, flash_attn2.h's kv-cache fields): query rows [0, len_q) and key rows [0, len_k), and where they are.
struct SplitSeq {
  int len_q, len_k;
  int64_t q_rows;   // varlen: the sequence's first packed query row (q, out, lse); fixed length: 0
  int64_t q_batch;  // fixed length: the batch entry (q, out, lse); varlen: 0
  int64_t k_offset, v_offset;  // elements to the sequence's first key row (head 0); paged: 0
  const int* pages;            // paged: this batch entry's row of the page table, else nullptr (load_paged)
  int k_row0;                  // paged: the logical row of key 0 (leftpad_k)

  __device__ SplitSeq(const FwdParams& p, int bidb) {
    if (p.cu_seqlens_q != nullptr) {  // varlen q (dispatch.cpp refuses leftpad_k and kv_batch_idx here)
      const RowRange q = packed_rows(p.cu_seqlens_q, bidb, p.total_q);
      len_q = int(q.end - q.begin), q_rows = q.begin, q_batch = 0;
      if (p.page_table != nullptr) {  // a paged cache: seqused_k[b] rows (clamped), or cu_seqlens_k's length
        len_k = paged_varlen_keys(p, bidb);
        pages = p.page_table + bidb * p.page_table_batch_stride, k_row0 = 0;
        k_offset = v_offset = 0;
        return;
      }
      const RowRange k = packed_rows(p.cu_seqlens_k, bidb, p.total_k);
      len_k = int(k.end - k.begin);
      k_offset = k.begin * p.k_row_stride, v_offset = k.begin * p.v_row_stride;
      pages = nullptr, k_row0 = 0;
      return;
    }
    len_q = p.seqlen_q, q_rows = 0, q_batch = bidb;
    const CacheRows rows = cache_rows(p, bidb);
    len_k = rows.len;
    if (p.page_table != nullptr) {  // rows through the table (kernels: load_paged); no kv_batch_idx
      pages = p.page_table + bidb * p.page_table_batch_stride, k_row0 = rows.begin;
      k_offset = v_offset = 0;
      return;
    }
    pages = nullptr, k_row0 = 0;
    k_offset = rows.kv_bidb * p.k_batch_stride + rows.begin * p.k_row_stride;
    v_offset = rows.kv_bidb * p.v_batch_stride + rows.begin * p.v_row_stride;
  }

  // Element offsets of query row i of head h in q and out, and its LSE.
  __device__ int64_t q_offset(const FwdParams& p, int i, int h) const {
    return q_batch * p.q_batch_stride + (q_rows + i) * p.q_row_stride + int64_t(h) * p.q_head_stride;
  }
  __device__ int64_t o_offset(const FwdParams& p, int i, int h) const {
    return q_batch * p.o_batch_stride + (q_rows + i) * p.o_row_stride + int64_t(h) * p.o_head_stride;
  }
  __device__ int64_t lse_offset(const FwdParams& p, int i, int h) const {
    return q_batch * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + q_rows + i;
  }
};
#endif

// ---- Merging split partials (fwd_combine_kernel's one-trip path, fwd_aux.cu; the cluster combine,
// sm80/fwd_split_kernel.h, folds the same way across a warp's lanes) ----

// The LSE of `count` splits' partial results (lse_s[0, count); entries past it ignored): log sum_s exp(lse_s), NaN if
// a split's is NaN and another's finite, -inf if none is finite (no key anywhere). The fold goes in split order, the
// max first, so that every caller gets the same bits.
template <int kMax>
__device__ __forceinline__ float merged_split_lse(const float (&lse_s)[kMax], int count) {
  float m = -INFINITY;
  bool nan_seen = false;
#pragma unroll
  for (int s = 0; s < kMax; ++s) {
    if (s >= count) continue;
    if (lse_s[s] != lse_s[s]) nan_seen = true;
    else m = fmaxf(m, lse_s[s]);
  }
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < kMax; ++s) {
    if (s < count && lse_s[s] != -INFINITY && lse_s[s] == lse_s[s]) sum += expf(lse_s[s] - m);
  }
  return m == -INFINITY ? -INFINITY : nan_seen ? NAN : m + logf(sum);
}

}  // namespace flash_attn2
