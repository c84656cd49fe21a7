// ALiBi: a bias linear in the distance between a query and a key, added to the scores before the mask.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// flash-attn's ALiBi for one (batch, query head): -slope * |i + len_k - len_q - j| on the scaled score of
// query i and key j or, causal without a left window edge, +slope * j (flash-attn's form there: the same
// softmax, its LSE shifted by a constant per row). Kept in the units of the scores the kernels hold, the
// slope over their softmax scale (softcap when softcapped).
struct Alibi {
  float slope;  // 0 without ALiBi
  int len_q, len_k;
  bool key_only;

  __device__ Alibi(const FwdParams& p, int len_q_, int len_k_, int bidb, int bidh)
      : slope(p.alibi_slopes == nullptr ? 0.f
                                        : p.alibi_slopes[bidb * p.alibi_slopes_batch_stride + bidh] /
                                              (p.softcap > 0.f ? p.softcap : p.softmax_scale)),
        len_q(len_q_), len_k(len_k_), key_only(p.causal && p.window_left < 0) {}

  // The bias over one thread's fragment of a tile, as a function of the fragment's indices: coord its tile
  // coordinates (mode kQueryMode the query's, the other the key's), q0 and k0 the tile's first query and key.
  // Every element's coordinates differ from element (0, 0)'s by a compile-time constant once the loops
  // unroll, so only the base is converted to float: an int-to-float per score runs at MUFU's quarter rate.
  // Both forms are coef * |base + q_coef * dq - dk| (key-only: base -key, q_coef 0, coef +slope), exact while
  // the indices stay below 2^24.
  template <int kQueryMode = 0, class Coord>
  __device__ auto tile(Coord const& coord, int q0, int k0) const {
    constexpr int kKeyMode = 1 - kQueryMode;
    const int q = q0 + cute::get<kQueryMode>(coord(0, 0)), k = k0 + cute::get<kKeyMode>(coord(0, 0));
    const float base = key_only ? -float(k) : float((q - len_q) + (len_k - k));
    const float coef = key_only ? slope : -slope, q_coef = key_only ? 0.f : 1.f;
    return [=, &coord](int r, int c) {
      const int dq = cute::get<kQueryMode>(coord(r, c)) - cute::get<kQueryMode>(coord(0, 0));
      const int dk = cute::get<kKeyMode>(coord(r, c)) - cute::get<kKeyMode>(coord(0, 0));
      return coef * fabsf(fmaf(q_coef, float(dq), base) - float(dk));
    };
  }

  // S and coord: one thread's fragment of a (queries, keys) tile in (row, col) view, coord its tile
  // coordinates; the tile's first query row0, first key col0.
  template <class TensorS, class TensorC>
  __device__ void apply(TensorS& S, TensorC const& coord, int row0, int col0) const {
    const auto bias = tile(coord, row0, col0);
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(S); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(S); ++c) S(r, c) += bias(r, c);
    }
  }
};

}  // namespace flash_attn2
