// Launcher for one (head dim, dtype) split-KV forward (sm80/fwd_split_kernel.h): the grid of common/split_kv.h,
// the plain or the extended kernel (common/kernel_kind.h), then the combine where the keys were split; both with
// programmatic dependent launch on sm_90+ (launch_after), which hides the launch gaps a decode call is made of. Each
// csrc/instantiations/fwd_split_*.cu instantiates one.
#pragma once

#include <climits>

#include "common/launch.h"
#include "common/launchers.h"
#include "common/split_kv.h"
#include "sm80/fwd_split_kernel.h"
#include "sm80/tile_size.h"

namespace flash_attn2 {

// With plan.cluster_combine (dispatch.cpp: 2 to kMaxClusterSplits splits of a fixed-length call on sm_90), a split
// kernel's kCluster variant in clusters of (1, splits, 1) blocks, a tile's splits merging there
// (fwd_split_kernel.h: cluster_combine): one kernel, no partials in global memory. False where it does not apply or
// the launch is refused (a cluster the GPU cannot place: MPS or green contexts holding SMs of a GPC, a cluster of
// 9-16 where the non-portable size is not allowed): the launch error is not sticky; it is cleared, and the caller
// takes the combine kernel.
template <class Kernel>
bool launch_split_cluster(Kernel* clustered, const FwdParams& params, const LaunchPlan& plan, dim3 grid, int threads,
                          int smem, cudaStream_t stream) {
  if (!plan.cluster_combine || plan.kv_splits < 2 || plan.kv_splits > kMaxClusterSplits ||
      params.cu_seqlens_q != nullptr) {
    return false;
  }
  const bool size_ok = plan.kv_splits <= kMaxPortableClusterSplits ||
                       cudaFuncSetAttribute(clustered, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
  if (size_ok && cluster_launchable(clustered) && allow_tile_smem(clustered, smem, plan.device) == cudaSuccess &&
      launch_cluster_after(clustered, grid, dim3(1, grid.y, 1), dim3(threads), smem, stream, params) == cudaSuccess) {
    return true;
  }
  (void)cudaGetLastError();
  return false;
}

// The narrow tile's kernel (decode with at most 16 packed rows, head dim <= 128): one 16-row tile per (split,
// batch entry, head group); with varlen a longer sequence than max_seqlen_q says loops over more.
template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_split_narrow(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  using Traits = FwdSplitNarrowTraits<kHeadDim, ElementOf<kDType>, fwd_split_narrow_stages(kHeadDim)>;
  const bool extended = is_extended(plan.kind);
  constexpr int kSmemBytes = Traits::kSmemBytes;
  const SplitGrid grid = split_grid(params, Traits::kBlockM, plan.kv_splits);
  if (grid.groups == 0) return cudaSuccess;
  if (grid.splits > 65535) return cudaErrorInvalidValue;
  const unsigned z = unsigned(grid.groups < 65535 ? grid.groups : 65535);  // the kernel loops over the rest
  if (launch_split_cluster(extended ? &fwd_split_narrow_kernel<Traits, true, true>
                                    : &fwd_split_narrow_kernel<Traits, false, true>,
                           params, plan, dim3(grid.m_blocks, grid.splits, z), 128, kSmemBytes, stream)) {
    return cudaSuccess;
  }
  auto kernel = extended ? &fwd_split_narrow_kernel<Traits, true> : &fwd_split_narrow_kernel<Traits, false>;
  if (cudaError_t err = allow_tile_smem(kernel, kSmemBytes, plan.device)) return err;
  if (cudaError_t err = launch_after(kernel, dim3(grid.m_blocks, grid.splits, z), dim3(128), kSmemBytes, stream,
                                     params)) {
    return err;
  }
  return plan.kv_splits > 1 ? launch_fwd_combine(params, plan.kv_splits, stream) : cudaSuccess;
}

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_split(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  if constexpr (fwd_split_narrow_stages(kHeadDim) > 0) {
    using Narrow = FwdSplitNarrowTraits<kHeadDim, ElementOf<kDType>, fwd_split_narrow_stages(kHeadDim)>;
    // Where its buffers fit (100 KB at d 128: not the 99 KB of sm_86/89, which take the 64-row tile).
    if (int64_t(params.seqlen_q) * split_pack(params) <= kFwdSplitNarrowRows &&
        Narrow::kSmemBytes <= plan.device.tile_smem_limit) {
      return launch_fwd_split_narrow<kHeadDim, kDType>(params, plan, stream);
    }
  }
  using Traits = FwdSplitTraits<kHeadDim, ElementOf<kDType>, FwdSplitTileFor<kHeadDim>>;
  static_assert(Traits::kBlockM == kFwdSplitBlockM);
  const bool extended = is_extended(plan.kind);
  constexpr int kSmemBytes = Traits::kSmemBytes;
  const SplitGrid grid = split_grid(params, Traits::kBlockM, plan.kv_splits);
  if (grid.groups == 0) return cudaSuccess;
  if (grid.splits > 65535) return cudaErrorInvalidValue;
  const unsigned z = unsigned(grid.groups < 65535 ? grid.groups : 65535);  // the kernel loops over the rest
  if (launch_split_cluster(extended ? &fwd_split_kernel<Traits, true, true> : &fwd_split_kernel<Traits, false, true>,
                           params, plan, dim3(grid.m_blocks, grid.splits, z), Traits::kNThreads, kSmemBytes, stream)) {
    return cudaSuccess;
  }
  auto kernel = extended ? &fwd_split_kernel<Traits, true> : &fwd_split_kernel<Traits, false>;
  if (cudaError_t err = allow_tile_smem(kernel, kSmemBytes, plan.device)) return err;
  if (cudaError_t err = launch_after(kernel, dim3(grid.m_blocks, grid.splits, z), dim3(Traits::kNThreads), kSmemBytes,
                                     stream, params)) {
    return err;
  }
  return plan.kv_splits > 1 ? launch_fwd_combine(params, plan.kv_splits, stream) : cudaSuccess;
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_FWD_SPLIT(HEAD_DIM, DTYPE)                                                  \
  template cudaError_t flash_attn2::launch_fwd_split<HEAD_DIM, flash_attn2::DType::DTYPE>(               \
      const flash_attn2::FwdParams&, const flash_attn2::LaunchPlan&, cudaStream_t);
