// ALiBi: a bias linear in the distance between a query and a key, added to the scores before the mask.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// flash-attn's ALiBi for one (batch, query head): -slope * |i + len_k - len_q - j| on the scaled score of
// query i and key j or, causal without a left window edge, +slope * j (flash-attn's form there: the same
// softmax, its LSE shifted by a constant per row). Kept in the units of the scores the kernels hold: the
// slope over their softmax scale (score_mod.h: ScoreMods::alibi builds it).
struct Alibi {
  float slope;  // 0 without ALiBi
  int len_q, len_k;
  bool key_only;

  // scale: the softmax's scale over the held scores (ScoreMods::scale).
  __device__ Alibi(const FwdParams& p, float scale, int len_q_, int len_k_, int bidb, int bidh)
      : slope(p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[bidb * p.alibi_slopes_batch_stride + bidh] / scale),
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

  // The Hopper forward's form, the bias split as S + bias = S' + shift[r]: where a warp's scores all lie on
  // one side of the diagonal (always, key-only), coef |x| = sgn (x_r - dk) is linear, x_r = base + q_coef dq
  // the row's part, so S' = S - sgn dk costs one FFMA per score and shift[r] = sgn x_r goes into the online
  // softmax's row max and exp2 offset (OnlineSoftmax::update_scores), instead of the bias's FADD, FMUL and
  // FADD per score. Near the diagonal: the whole bias, shift 0. ALiBi 2-4% faster (TUNING 76); the dropout
  // kernel keeps the whole bias, as the split's registers slowed its dropout by 3-11%.
  template <class TensorS, class TensorC, int kRows>
  __device__ void apply(TensorS& S, TensorC const& coord, int row0, int col0, float (&shift)[kRows]) const {
    static_assert(decltype(cute::size<0>(S))::value == kRows);
    const int q = row0 + cute::get<0>(coord(0, 0)), k = col0 + cute::get<1>(coord(0, 0));
    const int base = key_only ? -k : (q - len_q) + (len_k - k);
    // Offsets from element (0, 0): compile-time constants once unrolled, so the extremes fold.
    int dq_min = 0, dq_max = 0, dk_min = 0, dk_max = 0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int dq = key_only ? 0 : cute::get<0>(coord(r, 0)) - cute::get<0>(coord(0, 0));
      dq_min = min(dq_min, dq), dq_max = max(dq_max, dq);
    }
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(S); ++c) {
      const int dk = cute::get<1>(coord(0, c)) - cute::get<1>(coord(0, 0));
      dk_min = min(dk_min, dk), dk_max = max(dk_max, dk);
    }
    const bool nonneg = base + dq_min - dk_max >= 0, nonpos = base + dq_max - dk_min <= 0;
    if (key_only || __all_sync(0xffffffffu, nonneg || nonpos)) {  // warp-uniform
      const float coef = key_only ? slope : -slope, sgn = nonneg ? coef : -coef;  // key-only: x = -k <= 0
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int dq = key_only ? 0 : cute::get<0>(coord(r, 0)) - cute::get<0>(coord(0, 0));
        shift[r] = sgn * float(base + dq);
      }
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(S); ++c) {
          S(r, c) = fmaf(-sgn, float(cute::get<1>(coord(r, c)) - cute::get<1>(coord(0, 0))), S(r, c));
        }
      }
    } else {
      apply(S, coord, row0, col0);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) shift[r] = 0.f;
    }
  }
};

}  // namespace flash_attn2
