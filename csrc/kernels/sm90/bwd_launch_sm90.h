// Launcher for one (head dim, dtype) Hopper backward: TMA descriptors, the main kernel, then dQ from its
// fp32 accumulator (and, with head splits, dK and dV from theirs). The preprocess (D = rowsum(dO o O) and
// LSE * log2(e) side by side, zeroed dq_accum) runs before, as for SM80.
#pragma once

#include <algorithm>
#include <climits>

#include "common/registry.h"
#include "sm90/bwd_kernel_sm90.h"
#include "sm90/fwd_launch_sm90.h"  // make_tma
#include "sm90/tma_encode.h"

namespace flash_attn2 {

// dst[0..8) = scale * src[0..8) in the input dtype: one 16-byte store from two 16-byte loads.
template <typename Element>
__device__ __forceinline__ void convert8(const float* src, float scale, Element* dst) {
  const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
  const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  cutlass::Array<Element, 8> out;
  CUTE_UNROLL
  for (int j = 0; j < 8; ++j) out[j] = Element(v[j] * scale);
  *reinterpret_cast<cutlass::Array<Element, 8>*>(dst) = out;
}

// Grid-stride blocks of 256 threads for `vecs` 8-element conversions (at most 65536; 0 for none).
inline int64_t convert_blocks(int64_t vecs) { return vecs > 0 ? std::min<int64_t>((vecs + 255) / 256, 65536) : 0; }

// dQ = softmax_scale * accumulator, in the input dtype: 8 elements (16 bytes out) per thread and step.
template <int kHeadDim, typename Element>
__global__ void convert_dq_kernel_sm90(const __grid_constant__ BwdParams p) {
  constexpr int kVecsPerRow = kHeadDim / 8;
  const int64_t vecs = int64_t(p.num_heads) * p.total_q * kVecsPerRow;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x) {
    const int col = int(i % kVecsPerRow) * 8;
    const int64_t packed_row = i / kVecsPerRow % p.total_q;
    const int head = int(i / kVecsPerRow / p.total_q);
    if (col >= p.head_dim) continue;
    const int64_t at = query_row_offset(p, packed_row, head, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
    convert8(p.dq_accum + sm90::dq_accum_offset_sm90<kHeadDim>(p, head, packed_row) + col, p.softmax_scale,
             static_cast<Element*>(p.dq) + at + col);
  }
}

// A 1-D TMA over `elements` floats (D and LSE), read in boxes of kRowsBox (traits).
template <class Traits>
typename Traits::TmaRows make_tma_rows(const float* ptr, int64_t elements) {
  using namespace cute;
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(int(elements))));
  return make_tma_copy(SM90_TMA_LOAD{}, t, typename Traits::SmemLayoutRows{});
}

template <int kHeadDim, DType kDType>
cudaError_t launch_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Traits = BwdTraitsSm90For<kHeadDim, ElementOf<kDType>>;
  if (p.num_splits > 0) return cudaErrorNotSupported;  // deterministic mode: the SM80 backward
  const int64_t key_blocks = QueryTileScheduler<Traits::kBlockN, /*kKeys=*/true>::num_blocks(p);
  if (key_blocks == 0) return cudaSuccess;
  int head_splits = 1;
  if (cudaError_t err = bwd_head_splits(p, &head_splits)) return err;
  const int64_t num_blocks = key_blocks * head_splits;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = &bwd_kernel_sm90<Traits>;
  if (cudaError_t err = allow_dynamic_smem(kernel, Traits::kSmemBytes)) return err;
  const auto shape_q = sm90::tma_shape<true>(p), shape_k = sm90::tma_shape<false>(p);
  const int64_t rows_extent = bwd_softmax_d_elems(p);
  if (rows_extent > INT_MAX) return cudaErrorInvalidValue;  // TMA coordinates are int
  sm90::tma_encode_failed = false;
  using cute::SM90_TMA_LOAD;
  const auto smem_q = cute::take<0, 2>(typename Traits::SmemLayoutQ{});
  BwdArgsSm90<Traits> args{
      p,
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.q, shape_q, p.q_row_stride, p.q_head_stride,
                                                    p.q_batch_stride, smem_q, typename Traits::TileQ{}),
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.dout, shape_q, p.do_row_stride, p.do_head_stride,
                                                    p.do_batch_stride, smem_q, typename Traits::TileQ{}),
      sm90::make_tma<Traits, typename Traits::TmaK>(SM90_TMA_LOAD{}, p.k, shape_k, p.k_row_stride, p.k_head_stride,
                                                    p.k_batch_stride, typename Traits::SmemLayoutK{}, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmaV>(SM90_TMA_LOAD{}, p.v, shape_k, p.v_row_stride, p.v_head_stride,
                                                     p.v_batch_stride, typename Traits::SmemLayoutV{}, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmadQ, float>(
          cute::SM90_TMA_REDUCE_ADD{}, p.dq_accum, cute::make_shape(int(p.total_q), kHeadDim, p.num_heads, 1), kHeadDim,
          p.total_q * kHeadDim, 0, typename Traits::SmemLayoutdQ{}, typename Traits::TiledQ{}),
      make_tma_rows<Traits>(p.softmax_d, rows_extent),
      int(rows_extent),
      head_splits,
  };
  if (sm90::tma_encode_failed) return cudaErrorInvalidValue;
  kernel<<<unsigned(num_blocks), Traits::kNThreads, Traits::kSmemBytes, stream>>>(args);
  if (cudaError_t err = cudaGetLastError()) return err;

  if (const int64_t blocks = convert_blocks(int64_t(p.num_heads) * p.total_q * (kHeadDim / 8))) {
    convert_dq_kernel_sm90<kHeadDim, typename Traits::Element><<<unsigned(blocks), 256, 0, stream>>>(p);
  }
  if (head_splits > 1) {
    if (cudaError_t err = cudaGetLastError()) return err;
    return launch_bwd_convert_dkv(p, kHeadDim, stream);
  }
  return cudaGetLastError();
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_BWD_SM90(HEAD_DIM, DTYPE) \
  template cudaError_t flash_attn2::launch_bwd_sm90<HEAD_DIM, flash_attn2::DType::DTYPE>(const flash_attn2::BwdParams&, cudaStream_t);
