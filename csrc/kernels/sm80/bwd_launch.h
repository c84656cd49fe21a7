// Launcher for one (head dim, dtype) backward: the main kernel, the dQ conversion that shares its tile
// layout (and, with head splits, dK and dV from their fp32 accumulators); each csrc/instantiations/bwd_*.cu
// instantiates one. The preprocess (D = rowsum(dO o O)) before them lives in csrc/bwd_aux.cu.
#pragma once

#include <climits>

#include "sm80/bwd_kernel.h"
#include "common/registry.h"

namespace flash_attn2 {

// kDropout: the dropout kernel alone (its own tile); else the plain and extended ones.
template <class Traits, bool kDropout = false>
cudaError_t launch_bwd_tile(const BwdParams& params, int head_splits, cudaStream_t stream) {
  auto kernel = [&] {
    if constexpr (kDropout) {
      return &bwd_kernel<Traits, true, true>;
    } else {
      return bwd_extended(params) ? &bwd_kernel<Traits, true> : &bwd_kernel<Traits, false>;
    }
  }();
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err = allow_tile_smem(kernel, kSmemBytes)) return err;
  const int64_t num_blocks =
      int64_t(bwd_num_splits<Traits::kBlockN>(params)) * params.num_heads_k * params.batch * head_splits;
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<unsigned(num_blocks), Traits::kNThreads, kSmemBytes, stream>>>(params, head_splits);
  if (cudaError_t err = cudaGetLastError()) return err;
  if (head_splits > 1) {
    if (cudaError_t err = launch_bwd_convert_dkv(params, Traits::kHeadDim, stream)) return err;
  }

  const int64_t num_convert_blocks = QueryTileScheduler<Traits::kBlockM>::num_blocks(params);
  if (num_convert_blocks == 0) return cudaSuccess;
  if (num_convert_blocks > INT_MAX) return cudaErrorInvalidValue;
  convert_dq_kernel<Traits><<<unsigned(num_convert_blocks), Traits::kNThreads,
                               Traits::kQSize * sizeof(typename Traits::Element), stream>>>(params);
  return cudaGetLastError();
}

// The full tile where the GPU's shared memory per block holds it, else the compact one (one Q / dO
// buffer) where that fits (FLASH_ATTN2_COMPACT_TILES builds).
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd(const BwdParams& params, int head_splits, cudaStream_t stream) {
  using Element = ElementOf<kDType>;
  using Full = BwdTraits<kHeadDim, Element, BwdTileFor<kHeadDim>>;
  using Dropout = BwdTraits<kHeadDim, Element, BwdDropoutTileFor<kHeadDim>>;
  const bool dropout = params.dropout_p > 0.f;
#if FLASH_ATTN2_COMPACT_TILES
  int limit = 0;
  if (cudaError_t err = tile_smem_limit(&limit)) return err;
  if ((dropout ? Dropout::kSmemBytes : Full::kSmemBytes) > limit) {
    using Compact = BwdTraits<kHeadDim, Element, BwdCompactTileFor<kHeadDim>>;
    return dropout ? launch_bwd_tile<Compact, true>(params, head_splits, stream)
                   : launch_bwd_tile<Compact>(params, head_splits, stream);
  }
#endif
  return dropout ? launch_bwd_tile<Dropout, true>(params, head_splits, stream)
                 : launch_bwd_tile<Full>(params, head_splits, stream);
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_BWD(HEAD_DIM, DTYPE) \
  template cudaError_t flash_attn2::launch_bwd<HEAD_DIM, flash_attn2::DType::DTYPE>(const flash_attn2::BwdParams&, int, cudaStream_t);
