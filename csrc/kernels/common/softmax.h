// FA2's online softmax over one thread's rows of S, kept in registers (the scores' modifiers: score_mod.h).
//
// O accumulates unnormalized: each new tile rescales O and the running row sums by exp(m_old - m_new)
// once, and O is divided by the row sum only at the end. Scores stay unscaled; exponentials are
// exp2(s * scale * log2(e) - m * scale * log2(e)), one FFMA and one ex2 per element.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "common/sink.h"
#include "common/utils.h"

namespace flash_attn2 {

// finalize's default: no per-row LSE shift.
struct NoLseShift {};

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // of the raw scores seen so far; -inf while a row has seen no visible key
  float row_sum[kRows];  // this thread's partial sums; the quad reduces them in finalize()
  float scale, scale_log2;

  __device__ explicit OnlineSoftmax(float softmax_scale)
      : scale(softmax_scale), scale_log2(softmax_scale * float(M_LOG2E)) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // S, O: (row, col) views. Turns S into P = exp(scale * (S - m_new)) in place and rescales O.
  template <class TensorS, class TensorO>
  __device__ void update(TensorS& S, TensorO& O) {
    float correction[kRows];
    update_scores(S, correction);
    rescale(O, correction);
  }

  // The first half of update(): S -> P and the row sums, and each row's factor for O, which the Hopper
  // kernel applies later (rescale), once the P V product still reading O has finished. kLazy (FA4's
  // conditional rescale): a row's reference max moves only when the new scores pass it by more than
  // kLazyLog2 in exp2's argument, so P stays below 2^kLazyLog2 (far inside fp16 and the fp32 sums) and most
  // tiles leave O alone; O / sum and the LSE carry the same reference, so the result is unchanged. Returns
  // whether any of this thread's rows moved (a correction other than 1).
  static constexpr float kLazyLog2 = 8.f;
  template <bool kLazy = false, class TensorS>
  __device__ bool update_scores(TensorS& S, float (&correction)[kRows]) {
    return update_rows<kLazy, /*kShifted=*/false>(S, correction, nullptr);
  }

  // The same for scores S + shift[r] (ALiBi's split bias, Alibi::apply): the shift enters the row max and
  // exp2's offset, two FADDs per row instead of one per score.
  template <bool kLazy = false, class TensorS>
  __device__ bool update_scores(TensorS& S, float (&correction)[kRows], const float (&shift)[kRows]) {
    return update_rows<kLazy, /*kShifted=*/true>(S, correction, shift);
  }

  template <class TensorO>
  __device__ static void rescale(TensorO& O, const float (&correction)[kRows]) {
    static_assert(decltype(cute::size<0>(O))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(O); ++c) O(r, c) *= correction[r];
    }
  }

  // Normalizes O and returns each row's natural-log LSE; a row that saw no key gets O = 0, LSE = -inf (the sink,
  // with one). sink(r): row r's attention sink (common/sink.h), -inf for none; NoSink emits nothing.
  // lse_shift(r): added to row r's LSE before the sink enters, for scores held shifted by a constant per row
  // (Alibi::pinned; a sink is a logit of the unshifted scores); NoLseShift adds nothing.
  template <class TensorO, class Sink = NoSink, class LseShift = NoLseShift>
  __device__ void finalize(TensorO& O, float (&lse)[kRows], Sink sink = {}, LseShift lse_shift = {}) const {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_allreduce(row_sum[r], [](float a, float b) { return a + b; });
      float inv = sum == 0.f ? 0.f : __fdividef(1.f, sum);
      lse[r] = sum == 0.f ? -INFINITY : row_max[r] * scale + logf(sum);
      if constexpr (!std::is_same_v<LseShift, NoLseShift>) lse[r] += lse_shift(r);  // -inf stays -inf
      add_sink(lse[r], inv, sink(r));
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(O); ++c) O(r, c) *= inv;
    }
  }

 private:
  // update_scores; shift is read only where kShifted.
  template <bool kLazy, bool kShifted, class TensorS>
  __device__ bool update_rows(TensorS& S, float (&correction)[kRows], const float* shift) {
    static_assert(decltype(cute::size<0>(S))::value == kRows);
    bool moved = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = kShifted ? -INFINITY : row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(S); ++c) m = fmaxf(m, S(r, c));
      if constexpr (kShifted) m = fmaxf(row_max[r], m + shift[r]);
      m = quad_allreduce(m, [](float a, float b) { return fmaxf(a, b); });
      if (kLazy && row_max[r] != -INFINITY && (m - row_max[r]) * scale_log2 <= kLazyLog2) m = row_max[r];
      moved |= m != row_max[r];
      // A row that has seen only masked keys keeps m = -inf; shifting by 0 instead keeps exp2 at 0, not NaN.
      const float m_scaled = m == -INFINITY ? 0.f : kLazy ? __fmul_rn(m, scale_log2) : m * scale_log2;
      // 0 on a row's first tile. Lazy: exactly 1 where the reference stayed, both products rounded alike (fused
      // into an FFMA, row_max * scale_log2 - m_scaled left the product's rounding: a factor 1 +- a few ulp that
      // row_sum takes while O, unrescaled, does not; over a long decode's hundreds of chunks a drift of 1e-4 to 1e-3,
      // which a helper's review found).
      const float old_scaled = kLazy ? __fmul_rn(row_max[r], scale_log2) : row_max[r] * scale_log2;
      correction[r] = fast_exp2(old_scaled - m_scaled);
      row_max[r] = m;
      const float offset = kShifted && m != -INFINITY ? fmaf(-shift[r], scale_log2, m_scaled) : m_scaled;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(S); ++c) {
        S(r, c) = fast_exp2(S(r, c) * scale_log2 - offset);
        sum += S(r, c);
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
    return moved;
  }
};

}  // namespace flash_attn2
