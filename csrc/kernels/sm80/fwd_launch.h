// Launcher for one (head dim, dtype) SM80 forward: the tile (sm80/tile_size.h) and the kernel of the call's kind
// (common/kernel_kind.h); each csrc/instantiations/fwd_*.cu instantiates one.
#pragma once

#include <climits>

#include "common/launch.h"
#include "common/launchers.h"
#include "sm80/fwd_kernel.h"

namespace flash_attn2 {

// kWithDropout: this tile also has the dropout kernel (the short tile does not: one kernel fewer to build).
template <class Traits, bool kWithDropout = true>
cudaError_t launch_fwd_tile(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  auto kernel = is_extended(plan.kind) ? &fwd_kernel<Traits, true> : &fwd_kernel<Traits, false>;
  if constexpr (kWithDropout) {
    if (plan.kind == Kind::kDropout) kernel = &fwd_kernel<Traits, true, true>;
  }
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err = allow_tile_smem(kernel, kSmemBytes, plan.device)) return err;
  const int64_t num_blocks = TileScheduler<Traits::kBlockM>::num_blocks(params);
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<unsigned(num_blocks), Traits::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  using Element = ElementOf<kDType>;
  using Long = FwdTraits<kHeadDim, Element, FwdTileFor<kHeadDim, FwdTileFit::kLong>>;
#if FLASH_ATTN2_COMPACT_TILES
  if constexpr (fwd_has_tile(kHeadDim, FwdTileFit::kCompact)) {  // for GPUs with less shared memory per block
    if (Long::kSmemBytes > plan.device.tile_smem_limit) {
      return launch_fwd_tile<FwdTraits<kHeadDim, Element, FwdTileFor<kHeadDim, FwdTileFit::kCompact>>>(params, plan, stream);
    }
  }
#endif
  if constexpr (fwd_has_tile(kHeadDim, FwdTileFit::kShort)) {
    if (params.seqlen_q <= kFwdShortMaxSeqlenQ && plan.kind != Kind::kDropout) {
      return launch_fwd_tile<FwdTraits<kHeadDim, Element, FwdTileFor<kHeadDim, FwdTileFit::kShort>>, false>(params, plan,
                                                                                                            stream);
    }
  }
  return launch_fwd_tile<Long>(params, plan, stream);
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_FWD(HEAD_DIM, DTYPE)                                                        \
  template cudaError_t flash_attn2::launch_fwd<HEAD_DIM, flash_attn2::DType::DTYPE>(                     \
      const flash_attn2::FwdParams&, const flash_attn2::LaunchPlan&, cudaStream_t);
