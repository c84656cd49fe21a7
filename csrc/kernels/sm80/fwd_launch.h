// Launcher for one (head dim, dtype) forward kernel; each csrc/instantiations/fwd_*.cu instantiates one.
#pragma once

#include <climits>

#include "sm80/fwd_kernel.h"
#include "common/registry.h"

namespace flash_attn2 {

// kWithDropout: this tile also has the dropout kernel (the short tile does not: one kernel fewer to build).
template <class Traits, bool kWithDropout = true>
cudaError_t launch_fwd_tile(const FwdParams& params, cudaStream_t stream) {
  auto kernel = fwd_extended(params) ? &fwd_kernel<Traits, true> : &fwd_kernel<Traits, false>;
  if constexpr (kWithDropout) {
    if (params.dropout_p > 0.f) kernel = &fwd_kernel<Traits, true, true>;
  }
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err = allow_tile_smem(kernel, kSmemBytes)) return err;
  const int64_t num_blocks = QueryTileScheduler<Traits::kBlockM>::num_blocks(params);
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<unsigned(num_blocks), Traits::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream) {
  using Element = ElementOf<kDType>;
  using Tiles = FwdTiles<kHeadDim>;
  using Long = FwdTraits<kHeadDim, Element, typename Tiles::Long>;
#if FLASH_ATTN2_COMPACT_TILES
  if constexpr (HasCompactTile<Tiles>::value) {  // for GPUs with less shared memory per block
    int limit = 0;
    if (cudaError_t err = tile_smem_limit(&limit)) return err;
    if (Long::kSmemBytes > limit) {
      return launch_fwd_tile<FwdTraits<kHeadDim, Element, typename Tiles::Compact>>(params, stream);
    }
  }
#endif
  if constexpr (HasShortTile<Tiles>::value) {
    if (params.seqlen_q <= Tiles::kShortMaxSeqlenQ && params.dropout_p == 0.f) {
      return launch_fwd_tile<FwdTraits<kHeadDim, Element, typename Tiles::Short>, false>(params, stream);
    }
  }
  return launch_fwd_tile<Long>(params, stream);
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_FWD(HEAD_DIM, DTYPE) \
  template cudaError_t flash_attn2::launch_fwd<HEAD_DIM, flash_attn2::DType::DTYPE>(const flash_attn2::FwdParams&, cudaStream_t);
