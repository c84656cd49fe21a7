// The compiled kernels and what dispatch.cpp needs to call them, without CUDA device code or CuTe.
//
// launch_fwd / launch_bwd are defined in fwd_launch.h / bwd_launch.h and explicitly instantiated, one
// (head dim, dtype) per file in csrc/instantiations/. dispatch.cpp's table names exactly the instantiated
// ones (the FLASH_ATTN2_COMPILED_* definitions the build passes), so every kernel is reached through a
// symbol reference: a static library keeps them all, which self-registering static initializers would not.
#pragma once

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream);
// The Hopper forward (sm_90a: TMA + wgmma), csrc/kernels/sm90/fwd_launch_sm90.h.
template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_sm90(const FwdParams& params, cudaStream_t stream);
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream);

// softmax_d = rowsum(dout o out) in fp32 before the main kernel; also clears the dq accumulator and the
// gradient rows outside every varlen sequence.
cudaError_t launch_bwd_preprocess(const BwdParams& params, cudaStream_t stream);

// Opts kernel into bytes of dynamic shared memory on the current device, or returns
// cudaErrorLaunchOutOfResources where a block may not have that much (the backward's 208 KB at head
// dim 256 on an A100). The attribute is per device, so launchers call this on every launch.
template <class Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;  // every GPU allows this much without opting in
  int device = 0, limit = 0;
  if (cudaError_t err = cudaGetDevice(&device)) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) return err;
  if (bytes > limit) return cudaErrorLaunchOutOfResources;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

}  // namespace flash_attn2
