// Where one batch entry's sequences live and how long they are, for fixed-length and varlen batches.
#pragma once

#include <cstdint>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

struct SeqlenInfo {
  int len_q, len_k;
  int64_t start_q, start_k;  // first row in the packed tensors (varlen), else 0
  bool varlen_q, varlen_k;

  __device__ SeqlenInfo(const FwdParams& p, int bidb)
      : varlen_q(p.cu_seqlens_q != nullptr), varlen_k(p.cu_seqlens_k != nullptr) {
    start_q = varlen_q ? p.cu_seqlens_q[bidb] : 0;
    start_k = varlen_k ? p.cu_seqlens_k[bidb] : 0;
    // A non-monotonic cu_seqlens gives an empty sequence rather than a negative length.
    len_q = varlen_q ? max(0, p.cu_seqlens_q[bidb + 1] - int(start_q)) : p.seqlen_q;
    len_k = varlen_k ? max(0, p.cu_seqlens_k[bidb + 1] - int(start_k)) : p.seqlen_k;
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
