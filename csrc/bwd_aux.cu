// The backward's preprocess, D = rowsum(dO o O) in fp32, which also zero-fills the dQ accumulator (one
// launch instead of a separate memset): memory-bound plain CUDA with the head dim a runtime value, so
// one small file serves every head dim and both dtypes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "flash_attn2/flash_attn2.h"
#include "registry.h"

namespace flash_attn2 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per 16-byte access
constexpr int kPreprocessLanes = 8;

__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Element offset of row `row` (of total_q) and head `head` in a (batch, seqlen, heads, d) or varlen
// (total, heads, d) tensor.
__device__ inline int64_t row_offset(const BwdParams& p, int64_t row, int head, int64_t batch_stride,
                                     int64_t row_stride, int64_t head_stride) {
  if (p.cu_seqlens_q != nullptr) return row * row_stride + head * head_stride;
  return (row / p.seqlen_q) * batch_stride + (row % p.seqlen_q) * row_stride + head * head_stride;
}

// One group of kLanes threads per (row, head); each thread reads 16 bytes of dO and O at a time. Then
// the grid clears the accum_vec4 16-byte words of the dQ accumulator.
template <typename T>
__global__ void __launch_bounds__(kThreads) preprocess_kernel(const __grid_constant__ BwdParams p, int64_t accum_vec4) {
  constexpr int kLanes = kPreprocessLanes;
  const int64_t item = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kLanes;  // row * num_heads + head
  const int lane = threadIdx.x % kLanes;
  const bool valid = item < int64_t(p.num_heads) * p.total_q;
  const int head = int(item % p.num_heads);
  const int64_t row = item / p.num_heads;
  float sum = 0.f;
  if (valid) {
    const T* dout = static_cast<const T*>(p.dout) + row_offset(p, row, head, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
    const T* out = static_cast<const T*>(p.out) + row_offset(p, row, head, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    for (int col = lane * kVec; col < p.head_dim; col += kLanes * kVec) {
      const uint4 a = *reinterpret_cast<const uint4*>(dout + col);
      const uint4 b = *reinterpret_cast<const uint4*>(out + col);
      const T* x = reinterpret_cast<const T*>(&a);
      const T* y = reinterpret_cast<const T*>(&b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum += to_float(x[i]) * to_float(y[i]);
    }
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (valid && lane == 0) p.softmax_d[head * int64_t(p.total_q) + row] = sum;

  float4* accum = reinterpret_cast<float4*>(p.dq_accum);
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < accum_vec4; i += int64_t(gridDim.x) * kThreads) {
    accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

int64_t grid_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

}  // namespace

cudaError_t launch_bwd_preprocess(const BwdParams& p, cudaStream_t stream) {
  const int64_t blocks = grid_for(int64_t(p.num_heads) * p.total_q * kPreprocessLanes);
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = p.dtype == DType::kFloat16 ? &preprocess_kernel<__half> : &preprocess_kernel<__nv_bfloat16>;
  kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p, bwd_dq_accum_elems(p) / 4);
  return cudaGetLastError();
}

}  // namespace flash_attn2
