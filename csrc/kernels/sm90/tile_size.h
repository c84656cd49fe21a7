// The Hopper path's tiles: one constexpr table per direction, (head dim, kernel kind, ...) -> a small struct,
// and the CuTe-free tile type the forward traits take (fwd_traits.h). Host code (dispatch.cpp's heuristics)
// reads these too.
#pragma once

#include "common/kernel_kind.h"

namespace flash_attn2 {

// ---- Forward: kBlockM query rows (64 per consumer warpgroup), kBlockN key rows per K / V pipeline stage ----

template <int kBlockM_, int kBlockN_, int kStages_ = 2>
struct TileSm90 {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
};

struct FwdTileSizeSm90 {
  int block_m, block_n;
};

// Causal calls with seqlen_q up to this (fixed length, plain kernel) take the short tile at d 256 (0: none).
constexpr int fwd_short_causal_max_seqlen_q_sm90(int head_dim) { return head_dim == 256 ? 512 : 0; }

// kBlockN is as large as 227 KB of shared memory allows for Q plus two stages of K and V (FA3's choices,
// hopper/tile_size.h, on our buckets); d 64 runs three consumer warpgroups. short_causal
// (fwd_short_causal_max_seqlen_q_sm90, plain kernel): at d 256 the 80-key blocks overshoot the 128-row tiles'
// diagonals (2 / 4 / 5 / 7 blocks for 128..512 keys, 14% more keys than 64-key blocks read at 512). Dropout at
// d 64: two warpgroups with 240 registers each instead of three with 160, so that the keep bits are drawn under
// the GEMMs without spilling (180 bytes before): 7-13% faster; the same tile made softcap, ALiBi and windows
// 5-17% slower (TUNING 72).
constexpr FwdTileSizeSm90 fwd_tile_sm90(int head_dim, Kind kind, bool short_causal) {
  if (short_causal && kind == Kind::kPlain && fwd_short_causal_max_seqlen_q_sm90(head_dim) > 0) return {128, 64};
  if (kind == Kind::kDropout && head_dim == 64) return {128, 128};
  return head_dim == 64    ? FwdTileSizeSm90{192, 128}
         : head_dim <= 128 ? FwdTileSizeSm90{128, 128}
         : head_dim == 160 ? FwdTileSizeSm90{128, 112}
         : head_dim == 192 ? FwdTileSizeSm90{128, 96}
                           : FwdTileSizeSm90{128, 80};  // 224, 256
}

template <int kHeadDim, Kind kKind, bool kShortCausal = false>
using FwdTileForSm90 = TileSm90<fwd_tile_sm90(kHeadDim, kKind, kShortCausal).block_m,
                                fwd_tile_sm90(kHeadDim, kKind, kShortCausal).block_n>;

// A paged KV cache's rows reach the forward in TMA boxes of one shared-memory swizzle atom's columns, each box
// through its own page-table entry: page sizes that are multiples of kPagedRowsSm90 never split a box across
// pages (dispatch.cpp routes the others, SGLang's page 1 among them, to the split-KV kernel). 16: vLLM's page
// size, and two 8-row swizzle atoms.
constexpr int kPagedRowsSm90 = 16;

// The most rows a paged box may take in a kernel: the largest power of two that divides its key block (128 at
// d <= 128, 32 at d 192's 96 keys), but 16 at 80 / 112 keys and at d above 192, whose kernels keep compile-time
// 16-row boxes (d 256's short causal tile, 64 keys, spilled 12 B more with the rows computed). The launcher and
// the producer both compute a call's rows from its page size (paged_box_rows_sm90).
constexpr int paged_max_box_rows_sm90(int block_n, int head_dim) {
  return head_dim > 192 ? kPagedRowsSm90 : block_n & -block_n;
}
// The rows of those boxes for a page size: the most, a power of two from 16 up to that, that divide the page (so
// that no box crosses a page). Pages of 16 take 16-row boxes (8 a block at d 128, each a 2 KB TMA request per
// swizzle atom); pages of 64 take 64; pages of 128 and up a block's rows in one box per atom at d <= 128, as a
// contiguous cache's TMA copies them (FA3 takes TMA for pages that are a multiple of its block, cp.async
// otherwise). kPagedRowsSm90 for a page size that is a multiple of it and of no larger power of two.
constexpr int paged_box_rows_sm90(int page_size, int block_n, int head_dim) {
  int rows = paged_max_box_rows_sm90(block_n, head_dim);
  while (rows > kPagedRowsSm90 && (page_size & (rows - 1)) != 0) rows /= 2;  // rows: a power of two
  return rows;
}
static_assert(paged_box_rows_sm90(16, 128, 128) == 16 && paged_box_rows_sm90(48, 128, 64) == 16 &&
              paged_box_rows_sm90(32, 128, 128) == 32 && paged_box_rows_sm90(64, 128, 128) == 64 &&
              paged_box_rows_sm90(256, 128, 128) == 128 && paged_box_rows_sm90(256, 96, 192) == 32 &&
              paged_box_rows_sm90(48, 96, 192) == 16 && paged_box_rows_sm90(256, 80, 256) == 16 &&
              paged_box_rows_sm90(256, 64, 256) == 16 && paged_box_rows_sm90(256, 112, 160) == 16);

// ---- Backward ----

// Keys per block of the narrow kernels (head dim <= 128): 64 per consumer warpgroup. The host's head-split
// heuristic counts key blocks in these units on either path.
constexpr int kBwdBlockNSm90 = 128;

// The kernel kind that serves `kind` at a head dim: ALiBi alone has a plain kernel with the bias at d 64 and
// 128, where the extended kernel waits for both GEMMs before one pass over P and dS while the plain pipeline
// forms P^T as dP^T runs (9-16% faster, TUNING 74-75); elsewhere the extended kernel serves it.
constexpr Kind bwd_kind_sm90(int head_dim, Kind kind) {
  return kind == Kind::kPlainAlibi && head_dim != 64 && head_dim != 128 ? Kind::kExtended : kind;
}

// Narrow (head dim <= 128): block_m query rows per step past kBwdBlockNSm90 keys; 128 rows up to d 64, where
// registers allow it (halving the per-step costs per FLOP), but in d 64's extended and dropout kernels, whose
// softcap / ALiBi registers spilled 344 B with 128 (the plain kernel 156). Wide (d 192 / 256): `groups`
// consumer warpgroups of `keys` keys each, 64 query rows per step (FA3's shape; bwd_traits.h says why).
struct BwdTileSizeSm90 {
  bool wide;
  int block_m;
  int groups, keys;  // wide only
};

constexpr BwdTileSizeSm90 bwd_tile_sm90(int head_dim, Kind kind) {
  if (head_dim > 128) return {true, 64, head_dim == 192 ? 3 : 2, head_dim == 192 ? 32 : 40};
  return {false, head_dim == 64 && is_extended(kind) ? 64 : head_dim <= 64 ? 128 : 64, 0, 0};
}

}  // namespace flash_attn2
