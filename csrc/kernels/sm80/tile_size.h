// The SM80 path's tiles: one constexpr table per direction, (head dim, which tile) -> a small struct, and the
// CuTe-free tile types the traits take (kernel_traits.h). Starting points were FA2's SM80 choices; head dims
// 64, 128 and 256 were measured on H200 (benchmarks/TUNING.md steps 1-5 for the forward, 6-13 for the backward).
#pragma once

#include "common/bwd_workspace.h"  // bwd_block_m
#include "common/kernel_kind.h"

namespace flash_attn2 {

// ---- Forward: kBlockM query rows, kBlockN key rows, kNWarps warps ----
// Each warp owns kBlockM / kNWarps query rows (split-Q).

template <int kBlockM_, int kBlockN_, int kNWarps_>
struct Tile {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
};

struct FwdTileSize {
  int block_m, block_n, warps;
};

// kLong: the default. kShort: for seqlen_q <= kFwdShortMaxSeqlenQ without dropout, where more and lighter blocks
// fill the GPU better (d 256: two 96 KB blocks per SM instead of one of 128 KB). kCompact: for GPUs whose
// shared memory per block does not hold the long tile (sm_86/89: 99 KB; FLASH_ATTN2_COMPACT_TILES builds).
// A head dim without a short or compact tile answers {0, 0, 0} (fwd_has_tile).
enum class FwdTileFit { kLong, kShort, kCompact };
constexpr int kFwdShortMaxSeqlenQ = 2048;

constexpr FwdTileSize fwd_tile_sm80(int head_dim, FwdTileFit fit) {
  switch (fit) {
    case FwdTileFit::kShort:
      return head_dim == 256 ? FwdTileSize{64, 64, 4} : FwdTileSize{0, 0, 0};
    case FwdTileFit::kCompact:  // d 224: 84 KB; d 256: the short tile, 96 KB
      return head_dim == 224 || head_dim == 256 ? FwdTileSize{64, 64, 4} : FwdTileSize{0, 0, 0};
    default:
      return head_dim <= 64    ? FwdTileSize{128, 128, 4}
             : head_dim <= 128 ? FwdTileSize{128, 64, 4}
             : head_dim <= 160 ? FwdTileSize{128, 32, 4}
                               : FwdTileSize{128, 64, 8};  // 192-256: 112-128 KB, one block per SM
  }
}
constexpr bool fwd_has_tile(int head_dim, FwdTileFit fit) { return fwd_tile_sm80(head_dim, fit).block_m > 0; }

template <int kHeadDim, FwdTileFit kFit>
using FwdTileFor = Tile<fwd_tile_sm80(kHeadDim, kFit).block_m, fwd_tile_sm80(kHeadDim, kFit).block_n,
                        fwd_tile_sm80(kHeadDim, kFit).warps>;

// ---- Backward: kBlockM query rows stream past kBlockN resident key rows, 8 warps ----
// The three GEMM shapes spread the warps differently, each warp grid given as (rows x 8 / rows): S and dP
// (kBlockM x kBlockN) over kAtomMSdP rows of warps, dK and dV (kBlockN x D) over kAtomNdKV, dQ (kBlockM x D)
// over kAtomMdQ. Q and dO have kStages buffers: with two, the next query block loads during this one's dV, dQ
// and dK GEMMs. kBlockM is bwd_block_m (the dQ accumulator's layout: bwd_workspace.h) in every tile.

template <int kBlockM_, int kBlockN_, int kAtomMSdP_, int kAtomNdKV_, int kAtomMdQ_, int kStages_ = 2>
struct BwdTile {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = 8, kStages = kStages_;
  static constexpr int kAtomMSdP = kAtomMSdP_, kAtomNdKV = kAtomNdKV_, kAtomMdQ = kAtomMdQ_;
};

struct BwdTileSize {
  int block_m, block_n, atom_sdp, atom_dkv, atom_dq, stages;
};

// The tile of a kernel kind: FA2's shapes (160 KB of shared memory up to head dim 128; above, 48 KB per 64
// columns of head dim plus 16 KB: 184 KB at 224 and 208 KB at 256, more than A100's 163 KB). The dropout
// kernel takes 64 keys (its keep bits and draws do not fit beside a 128-key tile's S and dP: at head dim 64,
// 2064 B of spills in 128 x 128, none in 128 x 64); above head dim 128 the full tile already has 64 keys.
// compact: for GPUs with less shared memory per block, one Q / dO buffer (and 64 keys up to head dim 128), the
// same query rows: 96 KB at head dim 32, 80 KB at 64-128 and 96 KB at 160 fit sm_86/89's 99 KB; 112-144 KB at
// 192-256 fit A100's 163 KB. The plain, ALiBi and extended kernels share the full tile.
constexpr BwdTileSize bwd_tile_sm80(int head_dim, Kind kind, bool compact) {
  const int m = bwd_block_m(head_dim), atom = head_dim % 64 == 0 ? 2 : 4;
  if (compact) {
    return head_dim <= 32    ? BwdTileSize{m, 128, 4, 4, 4, 1}
           : head_dim <= 64  ? BwdTileSize{m, 64, 4, 4, 4, 1}
           : head_dim <= 128 ? BwdTileSize{m, 64, 4, 4, atom, 1}
                             : BwdTileSize{m, 64, 4, atom, atom, 1};
  }
  if (kind == Kind::kDropout && head_dim <= 128) {
    return head_dim <= 64 ? BwdTileSize{m, 64, 4, 4, 4, 2} : BwdTileSize{m, 64, 4, 4, atom, 2};
  }
  return head_dim <= 64    ? BwdTileSize{m, 128, 4, 4, 4, 2}
         : head_dim <= 128 ? BwdTileSize{m, 128, 2, 4, atom, 2}
                           : BwdTileSize{m, 64, 4, atom, atom, 2};
}

template <int kHeadDim, Kind kKind, bool kCompact>
using BwdTileFor = BwdTile<bwd_tile_sm80(kHeadDim, kKind, kCompact).block_m, bwd_tile_sm80(kHeadDim, kKind, kCompact).block_n,
                           bwd_tile_sm80(kHeadDim, kKind, kCompact).atom_sdp, bwd_tile_sm80(kHeadDim, kKind, kCompact).atom_dkv,
                           bwd_tile_sm80(kHeadDim, kKind, kCompact).atom_dq, bwd_tile_sm80(kHeadDim, kKind, kCompact).stages>;

}  // namespace flash_attn2

namespace flash_attn2 {

// ---- Split-KV forward (decode): 64 packed query rows, 4 warps, kStages K / V buffers in flight ----
// Memory-bound: every K / V stage is 32 KB (kBlockN * head dim = 8K elements; 32-row minimum at d > 128), and
// kStages - 1 of them load while one is computed. Three stages (112 KB at d 128) leave two blocks per SM on
// H100 / A100; GPUs with 99 KB per block (FLASH_ATTN2_COMPACT_TILES builds) take two.
struct FwdSplitTileSize {
  int block_m, block_n, warps, stages;
};

constexpr FwdSplitTileSize fwd_split_tile_sm80(int head_dim) {
#if FLASH_ATTN2_COMPACT_TILES
  constexpr int kStages = 2;
#else
  constexpr int kStages = 3;
#endif
  return head_dim <= 64    ? FwdSplitTileSize{64, 128, 4, kStages}
         : head_dim <= 128 ? FwdSplitTileSize{64, 64, 4, kStages}
                           : FwdSplitTileSize{64, 32, 4, 2};
}
constexpr int kFwdSplitBlockM = 64;  // every head dim's: dispatch.cpp sizes the grid with it

// The narrow tile (decode with at most kFwdSplitNarrowRows packed rows: sm80/fwd_split_kernel.h): 16 rows, each
// of the 4 warps streaming its own 16-key chunks through kStages buffers (4 KB per K or V chunk at d 128: 100 KB
// and two blocks per SM with three stages). 0 stages: no narrow tile (head dims above 128, whose merge and
// buffers would leave one block per SM, keep the 64-row tile).
constexpr int kFwdSplitNarrowRows = 16;
constexpr int fwd_split_narrow_stages(int head_dim) { return head_dim <= 64 ? 4 : head_dim <= 128 ? 3 : 0; }

template <int kBlockM_, int kBlockN_, int kNWarps_, int kStages_>
struct SplitTile {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_, kStages = kStages_;
};

template <int kHeadDim>
using FwdSplitTileFor = SplitTile<fwd_split_tile_sm80(kHeadDim).block_m, fwd_split_tile_sm80(kHeadDim).block_n,
                                  fwd_split_tile_sm80(kHeadDim).warps, fwd_split_tile_sm80(kHeadDim).stages>;
static_assert(fwd_split_tile_sm80(32).block_m == kFwdSplitBlockM && fwd_split_tile_sm80(256).block_m == kFwdSplitBlockM);

}  // namespace flash_attn2
