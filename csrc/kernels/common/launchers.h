// What dispatch.cpp hands the kernel translation units: the plan of a call (its kernel kind, the device's
// facts, the host heuristics' answers) and the launchers' declarations. No CUDA device code, no CuTe, no
// heuristics: those live in csrc/heuristics.h, which dispatch.cpp alone includes, so that changing one
// recompiles no kernel file.
//
// launch_fwd / launch_bwd (SM80) and launch_fwd_sm90 / launch_bwd_sm90 (Hopper) are defined in the arch folders'
// *_launch.h and explicitly instantiated, one (head dim, dtype) per file in csrc/instantiations/. dispatch.cpp's
// table names exactly the instantiated ones (the FLASH_ATTN2_COMPILED_* definitions the build passes), so every
// kernel is reached through a symbol reference: a static library keeps them all, which self-registering static
// initializers would not.
#pragma once

#include "flash_attn2/flash_attn2.h"
#include "common/kernel_kind.h"

namespace flash_attn2 {

// The current device, as the launchers need it (dispatch.cpp queries it once per device).
struct DeviceInfo {
  int num_sms = 0, l2_bytes = 0;
  int smem_per_block = 0;   // the opt-in limit of dynamic shared memory per block (227 KB on H100, 163 KB on A100)
  int tile_smem_limit = 0;  // what the SM80 tiles are picked for: smem_per_block, or FLASH_ATTN2_SMEM_LIMIT if lower
};

struct LaunchPlan {
  Kind kind = Kind::kPlain;  // fwd_kind / bwd_kind of the call
  DeviceInfo device;
  // Backward: blocks per (key block, kv head), each taking group / head_splits of the query heads (above 1 they
  // add dK and dV into fp32 accumulators: bwd_workspace.h); heuristics.h's bwd_head_splits.
  int head_splits = 1;
  // Hopper backward, fixed-length causal, narrow kernels: whether one (batch, kv head) pair's Q, dO and dQ
  // accumulator rows fit in L2, which lets the last two pairs interleave (bwd_launch.h).
  bool causal_pair_fits_l2 = false;
  // Split-KV forward: the key splits (heuristics.h's fwd_kv_splits; 1: none), and whether the split kernels may
  // merge them in a thread block cluster instead of the combine kernel (dispatch.cpp).
  int kv_splits = 1;
  bool cluster_combine = false;
};

using FwdLauncher = cudaError_t (*)(const FwdParams&, const LaunchPlan&, cudaStream_t);
using BwdLauncher = cudaError_t (*)(const BwdParams&, const LaunchPlan&, cudaStream_t);

// The SM80 path (mma.sync, any sm_80+ GPU): sm80/fwd_launch.h, sm80/bwd_launch.h.
template <int kHeadDim, DType kDType>
cudaError_t launch_fwd(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream);
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd(const BwdParams& params, const LaunchPlan& plan, cudaStream_t stream);
// The Hopper path (sm_90a: TMA + wgmma): sm90/fwd_launch.h, sm90/bwd_launch.h. The backward is built for the
// head dims the build names (FLASH_ATTN2_SM90_BWD_HEAD_DIMS); 160 and 224 run the 192 / 256 kernels.
template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_sm90(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream);
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd_sm90(const BwdParams& params, const LaunchPlan& plan, cudaStream_t stream);
// A (Q / K head dim, V / O head dim) pair's Hopper forward (FwdParams::head_dim_v; MLA), for the pairs the build
// names (FLASH_ATTN2_FWD_SM90_PAIRS).
template <int kHeadDim, int kHeadDimV, DType kDType>
cudaError_t launch_fwd_sm90_pair(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream);

// The split-KV forward (sm80/fwd_split_launch.h; SM80 tensor cores, built for every target, Hopper included):
// decode and KV-cache calls (dispatch.cpp: uses_split_kernel).
template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_split(const FwdParams& params, const LaunchPlan& plan, cudaStream_t stream);

// fwd_aux.cu: out and lse from the splits' partials in split_accum, after a split forward.
cudaError_t launch_fwd_combine(const FwdParams& params, int splits, cudaStream_t stream);
// fwd_aux.cu: flash_attn_with_kvcache's update (flash_attn2.h: KvAppendParams).
cudaError_t launch_kv_append(const KvAppendParams& params, cudaStream_t stream);
cudaError_t launch_merge_partial(const MergeParams& params, cudaStream_t stream);

// bwd_aux.cu: the backward's kernels around the main one, for any head dim and dtype.
// D = rowsum(dout o out) and LSE * log2(e) into softmax_d before the main kernel; also zeroes accum_elems of the
// dq accumulator and the gradient rows outside every varlen sequence.
cudaError_t launch_bwd_preprocess(const BwdParams& params, int64_t accum_elems, cudaStream_t stream);
// After the Hopper backward: dQ = softmax_scale * its accumulator, in the input dtype, from either Hopper layout
// (fragments: Traits::kDQFragments).
cudaError_t launch_bwd_convert_dq_sm90(const BwdParams& params, int bucket, bool fragments, cudaStream_t stream);
// dK = softmax_scale * accumulator and dV = accumulator in the input dtype, after a backward with head splits.
cudaError_t launch_bwd_convert_dkv(const BwdParams& params, int bucket, cudaStream_t stream);
// dsink from D and the LSE (BwdParams::dsink; with FwdParams::sink), after the main kernel.
cudaError_t launch_bwd_sink_grad(const BwdParams& params, cudaStream_t stream);

}  // namespace flash_attn2
