// Launcher for one (head dim, dtype) SM80 backward: the main kernel of the call's kind on its tile
// (sm80/tile_size.h), the dQ conversion that shares its tile layout (and, with head splits, dK and dV from their
// fp32 accumulators); each csrc/instantiations/bwd_*.cu instantiates one. The preprocess (D = rowsum(dO o O))
// before them lives in csrc/bwd_aux.cu.
#pragma once

#include <climits>

#include "common/launch.h"
#include "common/launchers.h"
#include "sm80/bwd_kernel.h"

namespace flash_attn2 {

// kDropout: the dropout kernel alone (its own tile); else the plain and extended ones (ALiBi alone runs the
// extended one: this path has no plain ALiBi kernel).
template <class Traits, bool kDropout = false>
cudaError_t launch_bwd_tile(const BwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  auto kernel = [&] {
    if constexpr (kDropout) {
      return &bwd_kernel<Traits, true, true>;
    } else {
      return plan.kind != Kind::kPlain ? &bwd_kernel<Traits, true> : &bwd_kernel<Traits, false>;
    }
  }();
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err = allow_tile_smem(kernel, kSmemBytes, plan.device)) return err;
  const int head_splits = plan.head_splits;
  const int64_t num_blocks =
      int64_t(bwd_num_splits<Traits::kBlockN>(params)) * params.num_heads_k * params.batch * head_splits;
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<unsigned(num_blocks), Traits::kNThreads, kSmemBytes, stream>>>(params, head_splits);
  if (cudaError_t err = cudaGetLastError()) return err;
  if (head_splits > 1) {
    if (cudaError_t err = launch_bwd_convert_dkv(params, Traits::kHeadDim, stream)) return err;
  }

  const int64_t num_convert_blocks = TileScheduler<Traits::kBlockM>::num_blocks(params);
  if (num_convert_blocks == 0) return cudaSuccess;
  if (num_convert_blocks > INT_MAX) return cudaErrorInvalidValue;
  convert_dq_kernel<Traits><<<unsigned(num_convert_blocks), Traits::kNThreads,
                               Traits::kQSize * sizeof(typename Traits::Element), stream>>>(params);
  return cudaGetLastError();
}

// The full tile where the GPU's shared memory per block holds it, else the compact one (one Q / dO buffer)
// where that fits (FLASH_ATTN2_COMPACT_TILES builds).
template <int kHeadDim, DType kDType, bool kDropout>
cudaError_t launch_bwd_fit(const BwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  using Element = ElementOf<kDType>;
  constexpr Kind kTile = kDropout ? Kind::kDropout : Kind::kPlain;  // the other kinds share the plain one's tile
  using Full = BwdTraits<kHeadDim, Element, BwdTileFor<kHeadDim, kTile, /*kCompact=*/false>>;
#if FLASH_ATTN2_COMPACT_TILES
  if (Full::kSmemBytes > plan.device.tile_smem_limit) {
    return launch_bwd_tile<BwdTraits<kHeadDim, Element, BwdTileFor<kHeadDim, kTile, true>>, kDropout>(params, plan, stream);
  }
#endif
  return launch_bwd_tile<Full, kDropout>(params, plan, stream);
}

template <int kHeadDim, DType kDType>
cudaError_t launch_bwd(const BwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  return plan.kind == Kind::kDropout ? launch_bwd_fit<kHeadDim, kDType, true>(params, plan, stream)
                                     : launch_bwd_fit<kHeadDim, kDType, false>(params, plan, stream);
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_BWD(HEAD_DIM, DTYPE)                                                        \
  template cudaError_t flash_attn2::launch_bwd<HEAD_DIM, flash_attn2::DType::DTYPE>(                     \
      const flash_attn2::BwdParams&, const flash_attn2::LaunchPlan&, cudaStream_t);
