// The Hopper backward's dK / dV epilogue, shared by both consumer shapes (bwd_mainloop.h: keys split over the
// warpgroups, accumulators (keys, D); bwd_mainloop_wide.h: the head dim split, accumulators (D, keys), i.e.
// transposed). A key block's dK and dV leave a warpgroup's accumulators either as fp32 shares added into the
// head-split accumulators (bwd_workspace.h: dK / dV regions), or scaled, converted, staged in shared memory
// with stmatrix and stored as 16-byte rows. The barriers between the stages are the mainloops' (what the
// staging buffer is, and who else reads it, differs).
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/bwd_traits.h"

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/head_dims.h"
#include "common/utils.h"
#include "sm90/tma.h"

namespace flash_attn2::sm90 {

// With head splits: this warpgroup's shares (rowcol views dK, dV of its accumulators; coord their coordinates)
// added into the fp32 accumulators dk_acc / dv_acc, rows of kHeadDim from the key block's first key. Keys at
// or past `keys` (those left in the sequence) are clipped. (keys, D) accumulators add two columns per
// reduction; transposed ones (D, keys) one element per atomic (consecutive keys are a row apart), columns
// from col0, past head_dim (dK) and head_dim_v (dV) clipped. (The (keys, D) accumulators' rows are kHeadDim wide
// whatever the head dims; the conversion reads the columns it writes.)
template <bool kTransposed, int kHeadDim, class TensorK, class TensorV, class TensorC>
__device__ __forceinline__ void add_dkv_shares(const TensorK& dK, const TensorV& dV, const TensorC& coord, int key0, int col0,
                               int len_k, int head_dim, int head_dim_v, float* dk_acc, float* dv_acc) {
  using namespace cute;
  if constexpr (!kTransposed) {
    CUTE_UNROLL
    for (int r = 0; r < size<0>(dK); ++r) {
      const int key = key0 + get<0>(coord(r, 0));
      if (key >= len_k) continue;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dK); c += 2) {
        const int64_t at = int64_t(key) * kHeadDim + get<1>(coord(r, c));
        red_add_global_x2(dk_acc + at, dK(r, c), dK(r, c + 1));
        red_add_global_x2(dv_acc + at, dV(r, c), dV(r, c + 1));
      }
    }
  } else {
    CUTE_UNROLL
    for (int r = 0; r < size<0>(dK); ++r) {
      const int col = col0 + get<0>(coord(r, 0));
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dK); ++c) {
        const int key = key0 + get<1>(coord(r, c));
        if (key < len_k && col < head_dim) atomicAdd(dk_acc + int64_t(key) * kHeadDim + col, dK(r, c));
        if (key < len_k && col < head_dim_v) atomicAdd(dv_acc + int64_t(key) * kHeadDim + col, dV(r, c));
      }
    }
  }
}

// Else dK = scale dS^T Q (acc_dk times softmax_scale) and dV in the input dtype, as register fragments.
template <class Element, class AccK, class AccV>
__device__ __forceinline__ auto dkv_in_dtype(AccK& acc_dk, const AccV& acc_dv, float softmax_scale) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc_dk); ++i) acc_dk(i) *= softmax_scale;
  return cute::make_tuple(convert_fragment<Element>(acc_dk), convert_fragment<Element>(acc_dv));
}

// Those fragments (of mma's accumulators) into shared memory sdK / sdV with stmatrix: StsmAtom SM90_U32x4_STSM_N
// for (keys, D) accumulators, the transposing SM90_U16x8_STSM_T for (D, keys) ones.
template <class StsmAtom, class TiledMma, class RegK, class RegV, class SmemK, class SmemV>
__device__ __forceinline__ void stage_dkv(const TiledMma& mma, int thread, const RegK& rdK, const RegV& rdV, SmemK&& sdK, SmemV&& sdV) {
  using namespace cute;
  using Element = typename RegK::value_type;
  auto copy = make_tiled_copy_C(Copy_Atom<StsmAtom, Element>{}, mma);
  auto thr = copy.get_thread_slice(thread);
  cute::copy(copy, thr.retile_S(rdK), thr.partition_D(sdK));
  cute::copy(copy, thr.retile_S(rdV), thr.partition_D(sdV));
}

// The staged rows (sdK, sdV: (keys, D) from first_key, `rows` of them left in the sequence) to dK and dV as
// 16-byte row stores by `threads` threads, keys past the sequence and columns past head_dim (dV: the value side's,
// common/head_dims.h) clipped.
template <class Element, class Work, class SmemK, class SmemV>
__device__ __forceinline__ void store_dkv_rows(const BwdParams& p, const Work& work, const SmemK& sdK, const SmemV& sdV,
                                               int first_key, int rows, int thread, int threads) {
  store_rows(sdK, work.template dkv_out<Element>(p, 0) + int64_t(first_key) * p.dk_row_stride, p.dk_row_stride, rows,
             p.head_dim, thread, threads);
  store_rows(sdV, work.template dkv_out<Element>(p, 1) + int64_t(first_key) * p.dv_row_stride, p.dv_row_stride, rows,
             value_head_dim(p), thread, threads);
}

}  // namespace flash_attn2::sm90
