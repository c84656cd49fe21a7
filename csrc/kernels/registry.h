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

}  // namespace flash_attn2
