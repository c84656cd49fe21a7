// Each compiled (head dim, dtype) kernel registers its launcher here; run_fwd() / run_bwd() dispatch
// through it. The backward's pre- and post-processing kernels (csrc/bwd_aux.cu) are declared here too.
#pragma once

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);
bool register_fwd(int head_dim_bucket, DType dtype, FwdLauncher launcher);
bool register_bwd(int head_dim_bucket, DType dtype, BwdLauncher launcher);

// softmax_d = rowsum(dout o out) in fp32.
cudaError_t launch_bwd_preprocess(const BwdParams& params, cudaStream_t stream);
// dq = softmax_scale * (sum over splits of dq_accum), in the input dtype.
cudaError_t launch_bwd_convert_dq(const BwdParams& params, int head_dim_bucket, cudaStream_t stream);

}  // namespace flash_attn2
