// Score modifiers: what turns a raw score s = q . k (the kernels hold S unscaled) into the score the softmax
// sees, stated once for every kernel (forward and backward, both paths).
//
//   plain:    softmax over scale * s
//   softcap:  t = tanh(s * scale / softcap), softmax over softcap * t: softcap replaces the softmax scale, and
//             the backward's dS = P (dP - D) picks up the derivative's 1 - t^2 (its other factor, scale, goes on
//             at the end as without softcap: dK = scale dS^T Q, dQ = scale dS K)
//   ALiBi:    + bias (Alibi), kept in the units of the scores the kernels hold: the slope over the softmax's
//             scale (so over softcap when softcapped), added after softcap
//
// Only the extended kernels (kernel_kind.h) modify scores; in the others every modifier folds away at compile
// time. The mask (mask.h) applies after the modifiers, dropout (dropout.h) after the softmax.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/utils.h"

namespace flash_attn2 {

// flash-attn's ALiBi for one (batch, query head): -slope * |i + len_k - len_q - j| on the scaled score of
// query i and key j or, causal without a left window edge, +slope * j (flash-attn's form there: the same
// softmax, its LSE shifted by a constant per row). Kept in the units of the scores the kernels hold: the slope
// over their softmax scale, softcap where softcapped (ScoreMods::scale; only the extended kernels, where the
// call's softcap is the kernel's, use it). ScoreMods::alibi builds it.
struct Alibi {
  float slope;  // 0 without ALiBi
  int len_q, len_k;
  bool key_only;
  int key_pin = 0;  // the key-only form's keys counted from here (pinned())

  __device__ Alibi(const FwdParams& p, int len_q_, int len_k_, int bidb, int bidh)
      : slope(p.alibi_slopes == nullptr ? 0.f
                                        : call_slope(p, bidb, bidh) / (p.softcap > 0.f ? p.softcap : p.softmax_scale)),
        len_q(len_q_), len_k(len_k_), key_only(p.causal && p.window_left < 0) {}

  // The call's slope of (batch bidb, query head bidh), as passed (natural units); 0 without ALiBi.
  __device__ static float call_slope(const FwdParams& p, int bidb, int bidh) {
    return p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[bidb * p.alibi_slopes_batch_stride + bidh];
  }

  // The key-only form pinned at key `pin`: slope (j - pin) instead of slope j, the same softmax, each row's LSE
  // lower by slope x pin (natural units, the call's slope; the kernel adds it back). Valid for keys j <= pin: a
  // tile's visible keys when pin is the last diagonal of its rows. Held scores then lie near 0 where a row's weight
  // is (its diagonal) instead of near slope x len_k: there the online softmax's rescales, one a key block, each
  // rounded at ulp(row max), had cost the SM80 forward's LSE up to 1.4e-3 at |LSE| ~ 900 (d 160, 32-key blocks;
  // TUNING 191 / 194). Stated as -slope |j - pin| (tile()'s |.| form: the slope negated, the keys shifted), so
  // the per-score code is the unpinned one's; for tile() / apply(S, coord, row0, col0) only (not the Hopper
  // forward's split form below). Nothing changes where the bias is not key-only.
  __device__ Alibi pinned(int pin) const {
    Alibi a = *this;
    if (key_only) a.slope = -slope, a.key_pin = pin;
    return a;
  }

  // The bias over one thread's fragment of a tile, as a function of the fragment's indices: coord its tile
  // coordinates (mode kQueryMode the query's, the other the key's), q0 and k0 the tile's first query and key.
  // Every element's coordinates differ from element (0, 0)'s by a compile-time constant once the loops
  // unroll, so only the base is converted to float: an int-to-float per score runs at MUFU's quarter rate.
  // Both forms are coef * |base + q_coef * dq - dk| (key-only: base -(key - key_pin), q_coef 0, coef +slope, or
  // -slope pinned), exact while the indices stay below 2^24.
  template <int kQueryMode = 0, class Coord>
  __device__ auto tile(Coord const& coord, int q0, int k0) const {
    constexpr int kKeyMode = 1 - kQueryMode;
    const int q = q0 + cute::get<kQueryMode>(coord(0, 0)), k = k0 + cute::get<kKeyMode>(coord(0, 0));
    const float base = key_only ? -float(k - key_pin) : float((q - len_q) + (len_k - k));
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

  // The Hopper forward's form (unpinned only: it reads neither key_pin nor a pinned slope's sign), the bias split
  // as S + bias = S' + shift[r]: where a warp's scores all lie on
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

// Logit soft-capping: S (raw scores) -> tanh(S * scale / softcap), in place.
template <class TensorS>
__device__ void softcap_scores(TensorS& S, float scale_over_softcap) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(S); ++i) S(i) = fast_tanh(S(i) * scale_over_softcap);
}

// The softcap's derivative, 1 - t^2, for t = tanh(...) of a score (0 where t is -inf: a masked score).
__device__ __forceinline__ float softcap_grad(float t) { return fmaxf(0.f, 1.f - t * t); }

// The modifiers of one call in one kernel (extended: the kernel has them), built once per kernel and tile. The
// forwards and the SM80 backward compute softcap's factors where they use them, from the call's params p (passed
// in, not held: read through a held reference, the SM80 d 128 backward's code moved, TUNING 126); the Hopper
// backward's p_and_ds reads copies made once (scale_log2, scale_over_softcap), which it holds across its steps.
struct ScoreMods {
  bool softcap;              // the kernel is extended and the call sets softcap
  float scale_log2;          // scale() * log2(e), exp2's
  float scale_over_softcap;  // tanh's argument per raw score (0 without softcap)

  __device__ ScoreMods(const FwdParams& params, bool extended)
      : softcap(extended && params.softcap > 0.f),
        scale_log2((softcap ? params.softcap : params.softmax_scale) * float(M_LOG2E)),
        scale_over_softcap(softcap ? params.softmax_scale / params.softcap : 0.f) {}

  // The softmax's scale over the held scores: softcap replaces softmax_scale where the scores are capped.
  __device__ float scale(const FwdParams& p) const { return softcap ? p.softcap : p.softmax_scale; }

  // The ALiBi bias of (batch bidb, query head bidh) in the held scores' units (slope 0 without ALiBi).
  __device__ Alibi alibi(const FwdParams& p, int len_q, int len_k, int bidb, int bidh) const {
    return Alibi(p, len_q, len_k, bidb, bidh);
  }

  // Raw scores -> softcap's t, in place (nothing without softcap).
  template <class TensorS>
  __device__ __forceinline__ void cap(TensorS& S, const FwdParams& p) const {
    if (softcap) softcap_scores(S, p.softmax_scale / p.softcap);
  }

  // Raw scores -> held scores before the mask: softcap's t, then ALiBi's bias (coord: the fragment's tile
  // coordinates, row0 / col0 the tile's first query / key).
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply(TensorS& S, const FwdParams& p, const Alibi& alibi, const TensorC& coord, int row0,
                                        int col0) const {
    cap(S, p);
    if (alibi.slope != 0.f) alibi.apply(S, coord, row0, col0);
  }
  // The factor softcap puts on dS: 1 - t^2 for a held score t (1 without softcap).
  __device__ __forceinline__ float grad(float t) const { return softcap ? softcap_grad(t) : 1.f; }

  // The backward's P and dS of one raw score, in place (the Hopper backward's extended kernels, which take both
  // GEMMs first): s becomes P = exp2((t + bias) scale log2e - LSE log2e), dp (dP) becomes
  // dS = P (dP - D) (1 - t^2); a hidden pair (kept false) gets 0 for both. Dropout: zscale is the dropout
  // scale where the pair is kept, 0 where dropped; P (for dV) becomes the dropped, scaled one and
  // dS = P (zscale dP - D), D = rowsum(dO o O) being the dropped forward's.
  __device__ __forceinline__ void p_and_ds(float& s, float& dp, float bias, float lse_log2, float dsum,
                                           bool kept, float zscale = 1.f) const {
    float g = 1.f;
    if (softcap) {
      s = fast_tanh(s * scale_over_softcap);
      g = softcap_grad(s);
    }
    const float prob = fast_exp2((s + bias) * scale_log2 - lse_log2);
    s = kept ? prob * zscale : 0.f;
    dp = kept ? prob * (dp * zscale - dsum) * g : 0.f;
  }
};

}  // namespace flash_attn2
