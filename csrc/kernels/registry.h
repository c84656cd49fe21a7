// Each compiled (head dim, dtype) kernel registers its launcher here; run_fwd() dispatches through it.
#pragma once

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
bool register_fwd(int head_dim_bucket, DType dtype, FwdLauncher launcher);

}  // namespace flash_attn2
