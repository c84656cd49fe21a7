// Attention sinks (FwdParams::sink; gpt-oss, FA4's learnable_sink): one more logit per query head in every row's
// softmax denominator, with no value:
//
//   Z = sum_j exp(s_j) + exp(sink_h),   out = sum_j exp(s_j - log Z) v_j,   LSE = log Z.
//
// The kernels finish a row as without a sink (out normalized by its own sum, lse = log of it) and then fold the
// sink in once: lse' = logaddexp(lse, sink), out' = out exp(lse - lse'). A row that sees no key gets out 0 and
// LSE = sink. With split-KV the sink enters once, in the combine (fwd_aux.cu), never in a split's partial. The
// backward needs nothing more for dq, dk, dv (their P = exp(s - LSE') and D = rowsum(dO o out') are the sink's),
// and dsink_h = -sum_{b,i} exp(sink_h - LSE'_{b,h,i}) D_{b,h,i} (bwd_aux.cu).
// Device code, no CuTe.
#pragma once

#include <cmath>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// Query head `head`'s sink, or -inf without sinks (a -inf sink is no sink).
__device__ __forceinline__ float sink_logit(const FwdParams& p, int head) {
  return p.sink != nullptr ? p.sink[head] : -INFINITY;
}

// A finished row's (lse, factor on its normalized output) with the sink folded in. The hardware's ex2 / lg2 (about
// 2 ulp, as the softmax's own exponentials; the accurate expf / logf would add ~100 instructions to every
// forward's epilogue). lse -inf (no key): lse' = sink and the factor 0. A +inf or NaN sink gives NaN, as such a
// score would.
__device__ __forceinline__ void add_sink(float& lse, float& factor, float sink) {
  if (sink == -INFINITY) return;
  const float hi = fmaxf(lse, sink);
  const float merged = hi + __logf(__expf(lse - hi) + __expf(sink - hi));
  factor *= __expf(lse - merged);
  lse = merged;
}

// The sink argument of OnlineSoftmax::finalize for kernels without one: constant -inf, so no code is emitted.
struct NoSink {
  __device__ __forceinline__ float operator()(int) const { return -INFINITY; }
};

}  // namespace flash_attn2
