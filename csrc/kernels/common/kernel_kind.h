// Which kernel of a (head dim, dtype) serves a call: one decision for both paths (SM80 and Hopper) and both
// directions. Each kind is a kernel of its own, so that a variant's registers and code never slow the plain
// kernel (benchmarks/TUNING.md steps 44, 53): the plain one does causal and a window's right edge; the
// extended one adds a window's left edge (forward: its blocks mask both edges), softcap and ALiBi behind
// runtime flags; the dropout one is the extended one with dropout. The Hopper backward has a fourth at some
// head dims (sm90/tile_size.h: bwd_kind_sm90): the plain one with ALiBi's bias, for ALiBi alone.
// Host and device code, no CuTe: dispatch.cpp decides, the launchers' tables map kinds to kernels.
#pragma once

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

enum class Kind : int { kPlain = 0, kExtended = 1, kDropout = 2, kPlainAlibi = 3 };

constexpr bool is_extended(Kind kind) { return kind == Kind::kExtended || kind == Kind::kDropout; }

// The forward: a window's left edge needs the extended kernel, as do softcap and ALiBi.
inline Kind fwd_kind(const FwdParams& p) {
  if (p.dropout_p > 0.f) return Kind::kDropout;
  const bool extended = p.window_left >= 0 || p.softcap > 0.f || p.alibi_slopes != nullptr;
  return extended ? Kind::kExtended : Kind::kPlain;
}

// The backward: windows cost its plain kernels nothing measurable (step 44), so they stay plain. ALiBi alone
// (it changes P but not dS = P (dP - D)) is kPlainAlibi, which a path without such a kernel runs as
// kExtended.
inline Kind bwd_kind(const FwdParams& p) {
  if (p.dropout_p > 0.f) return Kind::kDropout;
  if (p.alibi_slopes != nullptr && p.softcap == 0.f) return Kind::kPlainAlibi;
  return p.softcap > 0.f ? Kind::kExtended : Kind::kPlain;
}

}  // namespace flash_attn2
