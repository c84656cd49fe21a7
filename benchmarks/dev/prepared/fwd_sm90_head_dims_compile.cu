// Compile test of the Hopper forward with two head dims (issue #49, MLA's (d_qk, d_v) = (192, 128)), bf16, plain
// and extended kinds: FwdTraitsSm90's fourth argument. Not part of any build and not dispatched (run_fwd refuses
// FwdParams::head_dim_v != head_dim): the kernels compile, at 168 registers, no stack, no spills (local nvcc 13.0).
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG -DFLASH_ATTN2_COMPACT_TILES=0 \
//     -gencode=arch=compute_90a,code=sm_90a -cubin -Icsrc/include -Icsrc/kernels -Icsrc -I<cutlass>/include \
//     benchmarks/dev/prepared/fwd_sm90_head_dims_compile.cu -o /tmp/mla.cubin -Xptxas -warn-spills
// Left to wire: a pair's tile (sm90/tile_size.h), its instantiation behind a build knob, dispatch, the ops' shapes
// (out in v's head dim) and the backward (padded inside the bwd op first); docs/DESIGN.md has the plan.
#include "sm90/fwd_launch.h"

namespace flash_attn2 {
using MlaTraits = FwdTraitsSm90<192, cutlass::bfloat16_t, TileSm90<128, 96>, 128>;
static_assert(MlaTraits::kSeparateO, "(192, 128) at 128 x 96 keeps O apart from Q");
template cudaError_t launch_fwd_sm90_traits<MlaTraits, Kind::kPlain>(const FwdParams&, const LaunchPlan&, cudaStream_t);
template cudaError_t launch_fwd_sm90_traits<MlaTraits, Kind::kExtended>(const FwdParams&, const LaunchPlan&,
                                                                        cudaStream_t);
}  // namespace flash_attn2
