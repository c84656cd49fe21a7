// The value side's head dim: V's, out's, dout's and dv's, where it differs from q's and k's (MLA: d_v < d_qk;
// FwdParams::head_dim_v), else head_dim. The kernels' tiles keep the q / k head dim's bucket; the value-side tensors
// are read through extents of this width (TMA fills the columns past it with zeros) and written clipped to it.
#pragma once

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

__host__ __device__ inline int value_head_dim(const FwdParams& p) {
  return p.head_dim_v > 0 ? p.head_dim_v : p.head_dim;
}

}  // namespace flash_attn2
