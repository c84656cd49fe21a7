// The backward's preprocess, D = rowsum(dO o O) (less dLSE where the loss uses the LSE) in fp32 and LSE in log2
// next to it (in one (heads, total_q) layout for every batch mode), which also zero-fills the dQ accumulator (and
// the Hopper backward's tile counter) and, for varlen, the gradient rows outside every sequence, or with no query
// or no key rows all gradients (one launch instead of memsets);
// and after the main kernels, the conversions from fp32 accumulators: the Hopper dQ, and dK and dV after a
// backward with head splits; and the attention sinks' gradient.
// Memory-bound plain CUDA with the head dim a runtime value, so one small file serves every head dim and
// both dtypes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "flash_attn2/flash_attn2.h"
#include "common/launch.h"
#include "common/bwd_workspace.h"
#include "common/head_dims.h"
#include "common/launchers.h"
#include "common/seqlen.h"

namespace flash_attn2 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per 16-byte access
constexpr int kPreprocessLanes = 8;
constexpr int kMaxFragmentWidth = 128;  // the widest Hopper kernel that keeps dQ in fragments (d 128)

// Vector i of a (kinds, heads, rows) grid of gradient rows, vecs_per_row 8-element vectors each, rows
// innermost: the order in which the zero fill and the conversions walk dQ (one kind) and dK / dV (two).
struct RowVec {
  int64_t row;
  int head, kind, col;
};
__device__ inline RowVec row_vec(int64_t i, int vecs_per_row, int64_t rows, int heads) {
  const int64_t r = i / vecs_per_row;
  return {r % rows, int(r / rows % heads), int(r / rows / heads), int(i % vecs_per_row) * kVec};
}
template <typename T>
__device__ inline T* dq_row(const BwdParams& p, int64_t row, int head) {
  return static_cast<T*>(p.dq) + query_row_offset(p, row, head, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
}
template <typename T>
__device__ inline T* dkv_row(const BwdParams& p, int kind, int64_t row, int head_k) {  // kind 0: dK, 1: dV
  return kind == 0
             ? static_cast<T*>(p.dk) + key_row_offset(p, row, head_k, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride)
             : static_cast<T*>(p.dv) + key_row_offset(p, row, head_k, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
}

__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// A block per (kRows query rows, head, batch; varlen: packed rows, batch 0), kLanes threads per row, each
// reading 16 bytes of dO and O at a time: D and LSE, head-major, are read and written in order, and no
// thread divides by the head count or the sequence length. Then the grid clears the accum_vec4 16-byte
// words of the dQ accumulator. At most 48 registers (5 blocks per SM, as before; 6 spill).
template <typename T>
__global__ void __launch_bounds__(kThreads, 5) preprocess_kernel(const __grid_constant__ BwdParams p, int64_t accum_vec4) {
  griddep_launch_dependents();  // the main kernel's blocks may take SMs this grid leaves (they wait for it)
  constexpr int kLanes = kPreprocessLanes, kRows = kThreads / kLanes;
  const int head = int(blockIdx.y), lane = int(threadIdx.x) % kLanes;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t seq_rows = varlen ? p.total_q : p.seqlen_q, batches = varlen ? 1 : p.batch;  // rows per batch
  const int64_t r = int64_t(blockIdx.x) * kRows + threadIdx.x / kLanes;
  for (int64_t b = blockIdx.z; b < batches; b += gridDim.z) {  // batch strides are 0 for varlen
    float sum = 0.f;
    if (r < seq_rows) {
      const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + r * p.do_row_stride + head * p.do_head_stride;
      const T* out = static_cast<const T*>(p.out) + b * p.o_batch_stride + r * p.o_row_stride + head * p.o_head_stride;
      for (int col = lane * kVec; col < value_head_dim(p); col += kLanes * kVec) {  // dout and out: d_v wide
        const uint4 x = *reinterpret_cast<const uint4*>(dout + col);
        const uint4 y = *reinterpret_cast<const uint4*>(out + col);
        const T* xs = reinterpret_cast<const T*>(&x);
        const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
        for (int i = 0; i < kVec; ++i) sum += to_float(xs[i]) * to_float(ys[i]);
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (r < seq_rows && lane == 0) {
      const int64_t at = head * int64_t(p.total_q) + b * seq_rows + r;
      const int64_t lse_at = b * p.lse_batch_stride + head * p.lse_head_stride + r;
      const float lse = p.lse[lse_at];
      p.softmax_d[at] = p.dlse != nullptr ? sum - p.dlse[lse_at] : sum;  // D, less the loss's own lse gradient
      p.softmax_d[bwd_lse_log2_offset(p) + at] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
    }
  }

  const int64_t block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t first = block * kThreads + threadIdx.x, stride = int64_t(gridDim.x) * gridDim.y * gridDim.z * kThreads;
  float4* accum = reinterpret_cast<float4*>(p.dq_accum);
  for (int64_t i = first; i < accum_vec4; i += stride) accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (first == 0) *reinterpret_cast<int*>(p.softmax_d + bwd_tile_counter_offset(p)) = 0;

  // Rows outside every sequence take no part in the loss: zero gradients. (The kernels write the rest.)
  if (p.cu_seqlens_q != nullptr) {
    const UncoveredRows rows(p.cu_seqlens_q, p.batch, p.total_q);
    for (int h = 0; h < p.num_heads; ++h) {
      rows.zero_fill(static_cast<T*>(p.dq) + h * p.dq_head_stride, p.dq_row_stride, p.head_dim, nullptr, first, stride);
    }
  }
  // No query or no key rows (run_bwd launches no main kernel then): every gradient row is zero. dQ and dK
  // rows are head_dim wide, dV rows value_head_dim: walked as dQ, dK, dV.
  if (p.total_q == 0 || p.total_k == 0) {
    const int vecs_per_row = p.head_dim / kVec, v_vecs_per_row = value_head_dim(p) / kVec;
    const int64_t q_vecs = int64_t(p.num_heads) * p.total_q * vecs_per_row;
    const int64_t k_vecs = int64_t(p.num_heads_k) * p.total_k * vecs_per_row;
    const int64_t vecs = q_vecs + k_vecs + int64_t(p.num_heads_k) * p.total_k * v_vecs_per_row;
    for (int64_t i = first; i < vecs; i += stride) {
      T* row;
      int col;
      if (i < q_vecs) {
        const RowVec v = row_vec(i, vecs_per_row, p.total_q, p.num_heads);
        row = dq_row<T>(p, v.row, v.head), col = v.col;
      } else if (i < q_vecs + k_vecs) {
        const RowVec v = row_vec(i - q_vecs, vecs_per_row, p.total_k, p.num_heads_k);
        row = dkv_row<T>(p, 0, v.row, v.head), col = v.col;
      } else {
        const RowVec v = row_vec(i - q_vecs - k_vecs, v_vecs_per_row, p.total_k, p.num_heads_k);
        row = dkv_row<T>(p, 1, v.row, v.head), col = v.col;
      }
      *reinterpret_cast<uint4*>(row + col) = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  if (p.cu_seqlens_k != nullptr) {
    const UncoveredRows rows(p.cu_seqlens_k, p.batch, p.total_k);
    for (int h = 0; h < p.num_heads_k; ++h) {
      rows.zero_fill(static_cast<T*>(p.dk) + h * p.dk_head_stride, p.dk_row_stride, p.head_dim, nullptr, first, stride);
      rows.zero_fill(static_cast<T*>(p.dv) + h * p.dv_head_stride, p.dv_row_stride, value_head_dim(p), nullptr, first,
                     stride);
    }
  }
}

// dL/dsink_h = -sum_{b, i} exp(sink_h - LSE_{b,h,i}) D_{b,h,i} (common/sink.h), after the main kernel, from the
// preprocess's D and the forward's LSE (which holds the sink): one block per head over the rows the sequences
// cover (varlen: UncoveredRows' complement, so that rows outside them, whose dout may hold anything, never enter),
// one flat strided loop (no per-sequence round trips), each thread's sum then a fixed tree: the same bits every
// run. A -inf LSE (a -inf sink and no key) adds nothing. The loop is latency-bound (a few heads' blocks on the
// GPU): 1024 threads, each with kSinkUnroll rows' loads in flight before it adds them, so that 16k rows are four
// round trips to memory, not the 64 of 256 threads one row at a time (5-8 % of a 2k backward: TUNING 136).
constexpr int kSinkThreads = 1024, kSinkUnroll = 4;

__global__ void __launch_bounds__(kSinkThreads) sink_grad_kernel(const __grid_constant__ BwdParams p) {
  const int h = int(blockIdx.x);
  const float sink = p.sink[h];
  const bool varlen = p.cu_seqlens_q != nullptr;
  const float* d = p.softmax_d + int64_t(h) * p.total_q;  // D of head h, (total_q) packed rows
  const float* lse = p.lse + h * p.lse_head_stride;
  float acc = 0.f;
  if (sink != -INFINITY && p.batch > 0) {
    int64_t begin = 0, end = p.total_q;
    if (varlen) {
      const UncoveredRows uncovered(p.cu_seqlens_q, p.batch, p.total_q);
      begin = uncovered.lead_end, end = uncovered.tail_begin;
    }
    for (int64_t first = begin + threadIdx.x; first < end; first += int64_t(kSinkThreads) * kSinkUnroll) {
      float l[kSinkUnroll], dr[kSinkUnroll];
#pragma unroll
      for (int u = 0; u < kSinkUnroll; ++u) {
        const int64_t r = first + int64_t(u) * kSinkThreads;
        l[u] = -INFINITY, dr[u] = 0.f;
        if (r < end) {
          // LSE: (heads, total_q) for varlen, indexed by the packed row; (batch, heads, seqlen_q) for fixed length.
          l[u] = varlen ? lse[r] : lse[r / p.seqlen_q * p.lse_batch_stride + r % p.seqlen_q];
          dr[u] = d[r];
        }
      }
#pragma unroll
      for (int u = 0; u < kSinkUnroll; ++u) {
        if (l[u] != -INFINITY) acc += expf(sink - l[u]) * dr[u];
      }
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  __shared__ float warp_sums[kSinkThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kSinkThreads / 32; ++w) total += warp_sums[w];
    p.dsink[h] = 0.f - total;
  }
}

int64_t grid_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

__device__ inline void from_float(float x, __half* y) { *y = __float2half_rn(x); }
__device__ inline void from_float(float x, __nv_bfloat16* y) { *y = __float2bfloat16_rn(x); }

// dst[0..8) = scale * src[0..8) in T: two 16-byte loads, one 16-byte store.
template <typename T>
__device__ inline void convert8(const float* src, float scale, T* dst) {
  const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
  const float v[kVec] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  alignas(16) T out[kVec];
  for (int j = 0; j < kVec; ++j) from_float(v[j] * scale, &out[j]);
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
}

// Hopper kernels that add dQ rows (bwd_dq_accum_offset_sm90): dQ = softmax_scale * accumulator, 8 elements per
// thread and step.
template <typename T>
__global__ void __launch_bounds__(kThreads) convert_dq_sm90_kernel(const __grid_constant__ BwdParams p, int bucket) {
  griddep_wait();  // for the main kernel's dq_accum
  griddep_launch_dependents();
  const int vecs_per_row = bucket / kVec;
  const int64_t vecs = int64_t(p.num_heads) * p.total_q * vecs_per_row;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * kThreads) {
    const RowVec v = row_vec(i, vecs_per_row, p.total_q, p.num_heads);
    if (v.col >= p.head_dim) continue;
    convert8(p.dq_accum + bwd_dq_accum_offset_sm90(p, bucket, v.head, v.row) + v.col, p.softmax_scale,
             dq_row<T>(p, v.row, v.head) + v.col);
  }
}

// The query block that fills dQ slot `slot` (bwd_dq_slot): of the last sequence whose first slot is at or before
// it (binary search; the starts ascend unless cu_seqlens_q decreases somewhere, whose rows are undefined), and
// m_block past that; rows 0 for a slot past the sequence's blocks.
struct SlotBlock {
  int64_t start;  // the sequence's first packed row
  int m_block, rows;  // rows of the block inside the sequence
};
__device__ inline SlotBlock slot_block(const BwdParams& p, int64_t slot) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  auto start = [&](int b) { return varlen ? clamp_row(p.cu_seqlens_q[b], 0, p.total_q) : int64_t(b) * p.seqlen_q; };
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (bwd_dq_slot(start(mid), mid) <= slot) lo = mid; else hi = mid - 1;
  }
  const int64_t first = start(lo), m_block = slot - bwd_dq_slot(first, lo);
  const int64_t len = varlen ? packed_rows(p.cu_seqlens_q, lo, p.total_q).end - first : p.seqlen_q;
  const int64_t rows = m_block < 0 ? 0 : std::clamp<int64_t>(len - m_block * 64, 0, 64);
  return {first, int(m_block), int(rows)};
}

// Hopper kernels with 64-row steps: dQ = softmax_scale * accumulator from the slots' fragments
// (bwd_dq_fragment_word), a block per (head, slot) at a time, through shared memory so that dQ leaves in
// 16-byte row stores.
template <typename T>
__global__ void __launch_bounds__(kThreads) convert_dq_fragments_kernel(const __grid_constant__ BwdParams p, int width) {
  __shared__ alignas(16) float tile[64][kMaxFragmentWidth + 8];  // +8: a half-warp's pair stores (4 rows) in 4 bank octets
  griddep_wait();  // for the main kernel's dq_accum
  griddep_launch_dependents();
  const int64_t slots = bwd_dq_slots(p);
  const int words = 16 * width, vecs_per_row = width / kVec;
  for (int64_t item = blockIdx.x; item < slots * p.num_heads; item += gridDim.x) {
    const int64_t slot = item % slots;
    const int head = int(item / slots);
    const SlotBlock block = slot_block(p, slot);
    if (block.rows == 0) continue;  // the same for every thread: no barrier is skipped by some
    const float4* words_in = reinterpret_cast<const float4*>(p.dq_accum + bwd_dq_fragment_offset(p, width, head, slot));
    for (int word = threadIdx.x; word < words; word += kThreads) {
      const DQFragmentWord at = bwd_dq_fragment_word(word, width / 2);
      const float4 v = words_in[word];
      *reinterpret_cast<float2*>(&tile[at.row][at.col]) = make_float2(v.x, v.y);
      *reinterpret_cast<float2*>(&tile[at.row + 8][at.col]) = make_float2(v.z, v.w);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < block.rows * vecs_per_row; i += kThreads) {
      const int row = i / vecs_per_row, col = i % vecs_per_row * kVec;
      if (col < p.head_dim) {
        convert8(&tile[row][col], p.softmax_scale, dq_row<T>(p, block.start + block.m_block * 64 + row, head) + col);
      }
    }
    __syncthreads();  // the tile is read before the next slot overwrites it
  }
}

// With head splits: dK = softmax_scale * accumulator and dV = accumulator, 8 elements per thread and step,
// for every key row (rows outside every sequence get the zeros their accumulators hold).
template <typename T>
__global__ void __launch_bounds__(kThreads) convert_dkv_kernel(const __grid_constant__ BwdParams p, int bucket) {
  griddep_wait();  // for the main kernel's dK / dV accumulators
  griddep_launch_dependents();
  const int vecs_per_row = bucket / kVec;
  const int64_t vecs = 2 * int64_t(p.num_heads_k) * p.total_k * vecs_per_row;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * kThreads) {
    const RowVec v = row_vec(i, vecs_per_row, p.total_k, p.num_heads_k);
    if (v.col >= (v.kind == 0 ? p.head_dim : value_head_dim(p))) continue;  // dV: d_v wide
    convert8(p.dq_accum + bwd_dkv_accum_offset(p, bucket, v.kind, v.head, v.row) + v.col,
             v.kind == 0 ? p.softmax_scale : 1.f, dkv_row<T>(p, v.kind, v.row, v.head) + v.col);
  }
}

// A grid-stride conversion of `vecs` 8-element vectors (at most 65536 blocks), in the input dtype, launched
// after the kernel before it (launch_after).
using ConvertKernel = void (*)(BwdParams, int);
cudaError_t launch_convert(ConvertKernel half, ConvertKernel bf16, int64_t vecs, const BwdParams& p, int bucket,
                           cudaStream_t stream) {
  if (vecs == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(grid_for(vecs), 65536);
  return launch_after(p.dtype == DType::kFloat16 ? half : bf16, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, p,
                      bucket);
}

}  // namespace

cudaError_t launch_bwd_preprocess(const BwdParams& p, int64_t accum_elems, cudaStream_t stream) {
  // At least one block: with no query rows there may still be key rows to zero-fill.
  constexpr int kRows = kThreads / kPreprocessLanes;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t seq_rows = varlen ? p.total_q : p.seqlen_q;
  const int64_t row_blocks = std::max<int64_t>(1, (seq_rows + kRows - 1) / kRows);
  if (row_blocks > INT_MAX || p.num_heads > 65535) return cudaErrorInvalidValue;
  const dim3 grid(unsigned(row_blocks), unsigned(std::max(1, p.num_heads)),
                  unsigned(varlen ? 1 : std::clamp(p.batch, 1, 65535)));
  auto kernel = p.dtype == DType::kFloat16 ? &preprocess_kernel<__half> : &preprocess_kernel<__nv_bfloat16>;
  kernel<<<grid, kThreads, 0, stream>>>(p, accum_elems / 4);
  return cudaGetLastError();
}

cudaError_t launch_bwd_sink_grad(const BwdParams& p, cudaStream_t stream) {
  if (p.num_heads > INT_MAX) return cudaErrorInvalidValue;
  sink_grad_kernel<<<dim3(unsigned(p.num_heads)), kSinkThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_bwd_convert_dq_sm90(const BwdParams& p, int bucket, bool fragments, cudaStream_t stream) {
  if (!fragments) {
    return launch_convert(&convert_dq_sm90_kernel<__half>, &convert_dq_sm90_kernel<__nv_bfloat16>,
                          int64_t(p.num_heads) * p.total_q * (bucket / kVec), p, bucket, stream);
  }
  if (bucket > kMaxFragmentWidth || bucket % 16 != 0) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>(bwd_dq_slots(p) * p.num_heads, 65536);
  auto kernel = p.dtype == DType::kFloat16 ? &convert_dq_fragments_kernel<__half> : &convert_dq_fragments_kernel<__nv_bfloat16>;
  return launch_after(kernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, p, bucket);
}

cudaError_t launch_bwd_convert_dkv(const BwdParams& p, int bucket, cudaStream_t stream) {
  return launch_convert(&convert_dkv_kernel<__half>, &convert_dkv_kernel<__nv_bfloat16>,
                        2 * int64_t(p.num_heads_k) * p.total_k * (bucket / kVec), p, bucket, stream);
}

}  // namespace flash_attn2
