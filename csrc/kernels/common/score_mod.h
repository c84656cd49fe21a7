// Score modifiers: what turns a raw score s = q . k (the kernels hold S unscaled) into the score the softmax
// sees, stated once for every kernel (forward and backward, both paths).
//
//   plain:    softmax over scale * s
//   softcap:  t = tanh(s * scale / softcap), softmax over softcap * t: softcap replaces the softmax scale, and
//             the backward's dS = P (dP - D) picks up the derivative's 1 - t^2 (its other factor, scale, goes on
//             at the end as without softcap: dK = scale dS^T Q, dQ = scale dS K)
//   ALiBi:    + bias (alibi.h), kept in the units of the scores the kernels hold: the slope over the softmax's
//             scale (so over softcap when softcapped), added after softcap
//
// Only the extended kernels (kernel_kind.h) modify scores; in the others every modifier folds away at compile
// time. The mask (mask.h) applies after the modifiers, dropout (dropout.h) after the softmax.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/alibi.h"
#include "common/utils.h"

namespace flash_attn2 {

// Logit soft-capping: S (raw scores) -> tanh(S * scale / softcap), in place.
template <class TensorS>
__device__ void softcap_scores(TensorS& S, float scale_over_softcap) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(S); ++i) S(i) = fast_tanh(S(i) * scale_over_softcap);
}

// The softcap's derivative, 1 - t^2, for t = tanh(...) of a score (0 where t is -inf: a masked score).
__device__ __forceinline__ float softcap_grad(float t) { return fmaxf(0.f, 1.f - t * t); }

// The modifiers of one call in one kernel (extended: the kernel has them), built once per kernel and tile.
struct ScoreMods {
  bool softcap;              // the kernel is extended and the call sets softcap
  float scale;               // the softmax's scale over the held scores: softcap when softcapped
  float scale_log2;          // scale * log2(e), exp2's
  float scale_over_softcap;  // tanh's argument per raw score (0 without softcap)

  __device__ ScoreMods(const FwdParams& p, bool extended)
      : softcap(extended && p.softcap > 0.f),
        scale(softcap ? p.softcap : p.softmax_scale),
        scale_log2(scale * float(M_LOG2E)),
        scale_over_softcap(softcap ? p.softmax_scale / p.softcap : 0.f) {}

  // The ALiBi bias of (batch bidb, query head bidh) in the held scores' units (slope 0 without ALiBi).
  __device__ Alibi alibi(const FwdParams& p, int len_q, int len_k, int bidb, int bidh) const {
    return Alibi(p, scale, len_q, len_k, bidb, bidh);
  }

  // Raw scores -> softcap's t, in place (nothing without softcap).
  template <class TensorS>
  __device__ void cap(TensorS& S) const {
    if (softcap) softcap_scores(S, scale_over_softcap);
  }

  // Raw scores -> held scores before the mask: softcap's t, then ALiBi's bias (coord: the fragment's tile
  // coordinates, row0 / col0 the tile's first query / key).
  template <class TensorS, class TensorC>
  __device__ void apply(TensorS& S, const Alibi& alibi, const TensorC& coord, int row0, int col0) const {
    cap(S);
    if (alibi.slope != 0.f) alibi.apply(S, coord, row0, col0);
  }
  // The same with ALiBi split off into a per-row shift (Alibi::apply's split form, the Hopper forward): the
  // scores are then S + shift[r].
  template <class TensorS, class TensorC, int kRows>
  __device__ void apply(TensorS& S, const Alibi& alibi, const TensorC& coord, int row0, int col0,
                        float (&shift)[kRows]) const {
    cap(S);
    if (alibi.slope != 0.f) alibi.apply(S, coord, row0, col0, shift);
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
