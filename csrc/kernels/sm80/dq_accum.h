// The backward's fp32 dQ accumulator: where the main kernel's tiles go, and the kernel that sums the
// splits, scales and converts them to dQ in the input dtype.
#pragma once

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/bwd_workspace.h"
#include "sm80/kernel_traits.h"
#include "common/seqlen.h"
#include "common/tile_scheduler.h"
#include "common/utils.h"

namespace flash_attn2 {

// The fp32 dQ accumulator's SM80 layout (Sm80ThreadMajor in bwd_workspace.h), per (split, head): a
// row space in which sequence b starts at row start_b + b * kBlockM, so its last, partial kBlockM-row tile ends
// before the next sequence's first.
// A tile is stored thread-major: value j of thread t's dQ fragment at (j / 4 * kNThreads + t) * 4 + j % 4,
// so one warp's 16-byte reductions cover 512 contiguous bytes (4 L2 lines) instead of touching 8 rows
// each. This returns thread tid's base; its values j .. j + 3 (j % 4 == 0) follow at dq_accum_offset(j),
// a compile-time offset that folds into the instruction.
template <class Traits>
__device__ float* dq_accum_thread(const BwdParams& p, const SeqlenInfo& seq, int bidb, int split, int head, int m_block,
                                  int tid) {
  const int64_t rows = bwd_dq_rows_sm80(p, Traits::kBlockM);
  const int64_t row0 = seq.offset_q(p.seqlen_q, 1, bidb) + (int64_t(bidb) + m_block) * Traits::kBlockM;
  return p.dq_accum + ((int64_t(split) * p.num_heads + head) * rows + row0) * Traits::kHeadDim + tid * 4;
}

template <class Traits>
__device__ constexpr int dq_accum_offset(int j) {
  return j / 4 * Traits::kNThreads * 4;
}

// dQ = softmax_scale * (sum over splits of the accumulator) for one (query block, batch, head), in the
// input dtype. The same thread layout as the main kernel's dQ MMA reads the thread-major tiles back, and
// shared memory turns the fragments into 16-byte row stores.
template <class Traits>
__device__ __forceinline__ void convert_dq_tile(const BwdParams& p, const SeqlenInfo& seq, int bidb, int bidh,
                                                int m_block) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  const int tid = threadIdx.x;
  typename Traits::TiledMmadQ mma_dq;
  Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});  // (MMA, MMA_M, MMA_D)
  clear(acc_dq);
  for (int split = 0; split < max(1, p.num_splits); ++split) {
    const float* thr = dq_accum_thread<Traits>(p, seq, bidb, split, bidh, m_block, tid);
    CUTE_UNROLL
    for (int j = 0; j < size(acc_dq); j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(thr + dq_accum_offset<Traits>(j));
      acc_dq(j) += v.x, acc_dq(j + 1) += v.y, acc_dq(j + 2) += v.z, acc_dq(j + 3) += v.w;
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= p.softmax_scale;

  extern __shared__ __align__(128) char smem[];
  Tensor sdQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (kBlockM, D)
  auto smem_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma_dq);
  auto smem_thr = smem_copy.get_thread_slice(tid);
  cute::copy(smem_copy, smem_thr.retile_S(convert_fragment<Element>(acc_dq)), smem_thr.partition_D(sdQ));
  __syncthreads();
  Tensor mdQ = gmem_rows<kHeadDim>(static_cast<Element*>(p.dq) + seq.offset_q(p.dq_batch_stride, p.dq_row_stride, bidb) +
                                       bidh * p.dq_head_stride,
                                   seq.len_q, p.dq_row_stride);  // (len_q, D)
  Tensor gdQ = local_tile(mdQ, TileQ{}, make_coord(m_block, 0));  // (kBlockM, D)
  typename Traits::GmemTiledCopyOut gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tdQsdQ = gmem_thr.partition_S(sdQ);                           // (CPY, CPY_M, CPY_D)
  Tensor tdQcdQ = gmem_thr.partition_D(make_identity_tensor(TileQ{}));  // (CPY, CPY_M, CPY_D) -> (row, col)
  Tensor tdQrdQ = make_fragment_like(tdQsdQ);
  cute::copy(gmem_copy, tdQsdQ, tdQrdQ);
  store_tile(gmem_copy, tdQrdQ, gmem_thr.partition_D(gdQ), tdQcdQ, seq.len_q - m_block * kBlockM, p.head_dim);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) convert_dq_kernel(const __grid_constant__ BwdParams params) {
  const auto tile = TileScheduler<Traits::kBlockM>::get(params);
  if (tile.valid) convert_dq_tile<Traits>(params, SeqlenInfo(params, tile.bidb), tile.bidb, tile.bidh, tile.block);
}

}  // namespace flash_attn2
