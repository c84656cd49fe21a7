// Where one batch entry's sequences live and how long they are, for fixed-length and varlen batches.
// Varlen values are untrusted: every row index derived from cu_seqlens is clamped to the packed tensor
// (the semantics are in flash_attn2.h), and the rows no sequence covers are zero-filled.
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// Element offset of query row `row` (of total_q: packed for varlen, batch-major for fixed length) and head
// `head` in a (batch, seqlen_q, heads, ...) or varlen (total_q, heads, ...) tensor with these strides;
// key_row_offset the same over total_k and seqlen_k.
__host__ __device__ inline int64_t packed_row_offset(bool varlen, int seqlen, int64_t row, int head, int64_t batch_stride,
                                                     int64_t row_stride, int64_t head_stride) {
  if (varlen) return row * row_stride + head * head_stride;
  return (row / seqlen) * batch_stride + (row % seqlen) * row_stride + head * head_stride;
}
__host__ __device__ inline int64_t query_row_offset(const FwdParams& p, int64_t row, int head, int64_t batch_stride,
                                                    int64_t row_stride, int64_t head_stride) {
  return packed_row_offset(p.cu_seqlens_q != nullptr, p.seqlen_q, row, head, batch_stride, row_stride, head_stride);
}
__host__ __device__ inline int64_t key_row_offset(const FwdParams& p, int64_t row, int head, int64_t batch_stride,
                                                  int64_t row_stride, int64_t head_stride) {
  return packed_row_offset(p.cu_seqlens_k != nullptr, p.seqlen_k, row, head, batch_stride, row_stride, head_stride);
}

// Rows [begin, end) of sequence b in a packed tensor of `total` rows.
struct RowRange {
  int64_t begin, end;
};

__host__ __device__ inline int64_t clamp_row(int64_t row, int64_t lo, int64_t hi) {
  return row < lo ? lo : row > hi ? hi : row;
}

__device__ inline RowRange packed_rows(const int* cu_seqlens, int b, int64_t total) {
  const int64_t begin = clamp_row(cu_seqlens[b], 0, total);
  return {begin, clamp_row(cu_seqlens[b + 1], begin, total)};
}

// The rows no sequence covers, [0, lead_end) and [tail_begin, total): their outputs are zero-filled.
struct UncoveredRows {
  int64_t lead_end, tail_begin, total;

  __device__ UncoveredRows(const int* cu_seqlens, int batch, int64_t total_rows)
      : lead_end(clamp_row(cu_seqlens[0], 0, total_rows)),
        tail_begin(packed_rows(cu_seqlens, batch - 1, total_rows).end),
        total(total_rows) {}
  __device__ int64_t count() const { return lead_end + (total - tail_begin); }
  __device__ int64_t row(int64_t i) const { return i < lead_end ? i : tail_begin + (i - lead_end); }

  // Zero-fills these rows of one head's (total, head_dim) view, 16 bytes per store, and sets their LSE to
  // -inf where lse is given. The calling threads share the work: this one takes items first, first + stride...
  template <class T>
  __device__ void zero_fill(T* rows_ptr, int64_t row_stride, int head_dim, float* lse, int64_t first,
                            int64_t stride) const {
    static_assert(sizeof(T) == 2);
    const int vecs = head_dim / 8;
    for (int64_t item = first; item < count() * vecs; item += stride) {
      const int64_t r = row(item / vecs);
      *reinterpret_cast<uint4*>(rows_ptr + r * row_stride + item % vecs * 8) = uint4{0, 0, 0, 0};
      if (lse != nullptr && item % vecs == 0) lse[r] = -INFINITY;
    }
  }
};

// Whether a call carries a KV cache's fields (flash_attn2.h): seqused_k, leftpad_k, kv_batch_idx, page_table.
__host__ __device__ inline bool has_kv_cache(const FwdParams& p) {
  return p.seqused_k != nullptr || p.leftpad_k != nullptr || p.kv_batch_idx != nullptr || p.page_table != nullptr;
}

// The key rows batch entry b reads from a KV cache (FwdParams' kv-cache fields, fixed-length q; each device value
// clamped as flash_attn2.h says): the k / v batch entry (kv_batch_idx), the first row (leftpad_k) and how many.
struct CacheRows {
  int kv_bidb, begin, len;
};

// The k / v batch entry batch entry b reads: kv_batch_idx[b] clamped to [0, kv_batch), or b.
__device__ inline int kv_batch_entry(const FwdParams& p, int bidb) {
  if (p.kv_batch_idx == nullptr) return bidb;
  const int idx = p.kv_batch_idx[bidb];
  return idx < 0 ? 0 : idx >= p.kv_batch ? p.kv_batch - 1 : idx;
}

__device__ inline CacheRows cache_rows(const FwdParams& p, int bidb) {
  const int kv_bidb = kv_batch_entry(p, bidb);
  int64_t end = p.seqlen_k;
  if (p.seqused_k != nullptr) {
    const int used = p.seqused_k[bidb];
    end = int64_t(used < 0 ? 0 : used > p.seqlen_k ? p.seqlen_k : used) + p.seqused_k_add;
    end = end > p.seqlen_k ? p.seqlen_k : end;
  }
  int begin = p.leftpad_k != nullptr ? p.leftpad_k[bidb] : 0;
  begin = begin < 0 ? 0 : begin > end ? int(end) : begin;
  return {kv_bidb, begin, int(end) - begin};
}

// A paged cache's logical key row `row` (below the sequence's length: a table's -1 padding past it is never read)
// through its batch entry's row of the page table: the page, its entry clamped to [0, num_pages) so that a hostile
// entry reads a page of the cache and nothing outside it, and the row on that page.
struct PagedRow {
  int page, row;
};
__device__ inline int clamp_page(const FwdParams& p, int entry) {
  return entry < 0 ? 0 : entry >= p.num_pages ? p.num_pages - 1 : entry;
}
// A logical key row's column of the page table and its row on that page. Page sizes are powers of two in practice
// (vLLM's 16, SGLang's 1, 64-256: a shift), any other size a division (32-bit, by a value the compiler cannot know:
// ~20 instructions and a MUFU round trip, once per row a copy loop reads).
struct PageSlot {
  int column, row;
};
__device__ __forceinline__ PageSlot page_slot(const FwdParams& p, int row) {
  const int size = p.page_size;
#if defined(__CUDA_ARCH__)
  const int shift = __ffs(size) - 1;
#else  // host compilers see this header too (dispatch.cpp through the tile scheduler); the body is never run there
  const int shift = __builtin_ctz(static_cast<unsigned>(size));
#endif
  const int column = (size & (size - 1)) == 0 ? row >> shift : row / size;
  return {column, row - column * size};
}
// (The Hopper producer's per-box lookup keeps the division: one a 16-row box, and a shift there moved the d 224
// kernels' register allocation, +12 / +8 B of spills.)
__device__ inline PagedRow paged_row(const FwdParams& p, const int* table_row, int row) {
  return {clamp_page(p, table_row[row / p.page_size]), row % p.page_size};
}

// Varlen q against a paged cache: sequence b's key count, seqused_k[b] or else cu_seqlens_k's length, clamped to
// the table's capacity (seqlen_k).
__device__ inline int paged_varlen_keys(const FwdParams& p, int bidb) {
  int64_t len = 0;
  if (p.seqused_k != nullptr) {
    len = p.seqused_k[bidb];
  } else {
    len = int64_t(p.cu_seqlens_k[bidb + 1]) - p.cu_seqlens_k[bidb];
  }
  return int(len < 0 ? 0 : len > p.seqlen_k ? p.seqlen_k : len);
}

struct SeqlenInfo {
  int len_q, len_k;
  int64_t start_q, start_k;  // first row in the packed tensors (varlen; a cache's leftpad_k row), else 0
  bool varlen_q, varlen_k;

  __device__ SeqlenInfo(const FwdParams& p, int bidb)
      : varlen_q(p.cu_seqlens_q != nullptr), varlen_k(p.cu_seqlens_k != nullptr) {
    const RowRange q = varlen_q ? packed_rows(p.cu_seqlens_q, bidb, p.total_q) : RowRange{0, p.seqlen_q};
    const RowRange k = varlen_k ? packed_rows(p.cu_seqlens_k, bidb, p.total_k) : RowRange{0, p.seqlen_k};
    start_q = q.begin, len_q = int(q.end - q.begin);
    start_k = k.begin, len_k = int(k.end - k.begin);
  }

  // The same, and a KV cache's fields (flash_attn2.h) where set: the kernels that serve kv-cache calls (the Hopper
  // forward) construct it so; the others never see those fields (dispatch.cpp). Paged keys are logical rows
  // [0, len_k) through the batch entry's row of the page table (start_k 0; leftpad_k is not taken with pages
  // here); a contiguous cache's from row start_k (leftpad_k) of k / v batch entry kv_batch_entry(p, b).
  struct WithCache {};
  __device__ SeqlenInfo(const FwdParams& p, int bidb, WithCache) : SeqlenInfo(p, bidb) {
    if (!has_kv_cache(p)) return;
    if (p.page_table != nullptr) {
      varlen_k = false, start_k = 0;
      len_k = varlen_q ? paged_varlen_keys(p, bidb) : cache_rows(p, bidb).len;
    } else if (!varlen_q) {
      const CacheRows rows = cache_rows(p, bidb);
      start_k = rows.begin, len_k = rows.len;
    }
  }

  // Element offset of this batch entry's first row.
  __device__ int64_t offset_q(int64_t batch_stride, int64_t row_stride, int bidb) const {
    return varlen_q ? start_q * row_stride : bidb * batch_stride;
  }
  __device__ int64_t offset_k(int64_t batch_stride, int64_t row_stride, int bidb) const {
    return varlen_k ? start_k * row_stride : bidb * batch_stride;
  }
};

}  // namespace flash_attn2
