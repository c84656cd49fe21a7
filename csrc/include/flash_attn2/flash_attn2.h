// flash_attn2 public C++ API: torch-free, usable from any CUDA project.
//
// Tensors are (batch, seqlen, heads, head_dim) with a contiguous last dimension and any other strides
// (in elements, multiples of 8, base pointers 16-byte aligned). With cu_seqlens_q/k set (varlen), q/k/v/out
// are packed (total_tokens, heads, head_dim): batch strides are ignored and sequence b owns rows
// [cu_seqlens[b], cu_seqlens[b + 1]).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace flash_attn2 {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  // Natural-log sum of exp of the scaled scores per query row, fp32: (batch, heads, seqlen_q), or
  // (heads, total_q) for varlen. A row that sees no key gets -inf (its output row is 0).
  float* lse;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;  // lse_batch_stride is unused for varlen

  int batch;
  int num_heads;    // query heads
  int num_heads_k;  // key/value heads; num_heads % num_heads_k == 0 (MQA/GQA)
  int head_dim;     // multiple of 8, <= 256
  int seqlen_q;     // for varlen: the maximum over the batch
  int seqlen_k;

  const int* cu_seqlens_q;  // (batch + 1) int32 prefix sums on the device, or nullptr
  const int* cu_seqlens_k;

  float softmax_scale;  // >= 0
  // Causal mask aligned to the bottom-right corner: query i sees key j iff j <= i + seqlen_k - seqlen_q.
  bool causal;
  DType dtype;
};

// The compiled head-dim bucket that serves head_dim (the smallest one >= head_dim), or 0 if none.
int fwd_head_dim_bucket(int head_dim, DType dtype);

// Enqueues the forward pass on stream. Returns cudaErrorNotSupported when no kernel was compiled for
// (head_dim, dtype), cudaErrorInvalidValue for inconsistent params, else the launch's error.
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace flash_attn2
