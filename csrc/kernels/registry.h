// Each compiled (head dim, dtype) kernel registers its launcher here; run_fwd() / run_bwd() dispatch
// through it. The backward's preprocess kernel (csrc/bwd_aux.cu) is declared here too.
#pragma once

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);
bool register_fwd(int head_dim_bucket, DType dtype, FwdLauncher launcher);
bool register_bwd(int head_dim_bucket, DType dtype, BwdLauncher launcher);

// softmax_d = rowsum(dout o out) in fp32, before the main kernel.
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
