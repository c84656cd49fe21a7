// ALiBi: a bias linear in the distance between a query and a key, added to the scores before the mask.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// flash-attn's ALiBi for one (batch, query head): -slope * |i + len_k - len_q - j| on the scaled score of
// query i and key j or, causal without a left window edge, +slope * j (flash-attn's form there: the same
// softmax, its LSE shifted by a constant per row). Kept in the units of the scores the kernels hold, the
// slope over their softmax scale (softcap when softcapped). The distance is summed as (i - len_q) +
// (len_k - j), each term within 32 bits.
struct Alibi {
  float slope;  // 0 without ALiBi
  int len_q, len_k;
  bool key_only;

  __device__ Alibi(const FwdParams& p, int len_q_, int len_k_, int bidb, int bidh)
      : slope(p.alibi_slopes == nullptr ? 0.f
                                        : p.alibi_slopes[bidb * p.alibi_slopes_batch_stride + bidh] /
                                              (p.softcap > 0.f ? p.softcap : p.softmax_scale)),
        len_q(len_q_), len_k(len_k_), key_only(p.causal && p.window_left < 0) {}

  __device__ float bias(int row, int key) const {
    return key_only ? slope * float(key) : -slope * fabsf(float((row - len_q) + (len_k - key)));
  }

  // S and coord: one thread's fragment of a (queries, keys) tile in (row, col) view, coord its tile
  // coordinates; the tile's first query row0, first key col0.
  template <class TensorS, class TensorC>
  __device__ void apply(TensorS& S, TensorC const& coord, int row0, int col0) const {
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(S); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(S); ++c) {
        S(r, c) += bias(row0 + cute::get<0>(coord(r, c)), col0 + cute::get<1>(coord(r, c)));
      }
    }
  }
};

}  // namespace flash_attn2
