// Forward tile sizes per head dim: kBlockM query rows, kBlockN key rows, kNWarps warps. Each warp owns
// kBlockM / kNWarps query rows (split-Q). Starting points are FA2's SM80 choices; head dims 64, 128 and 256
// were measured on H200 (benchmarks/TUNING.md), the others not yet. A head dim may add a second, smaller
// tile for short sequences, where more and lighter blocks fill the GPU better.
#pragma once

#include <type_traits>

namespace flash_attn2 {

template <int kBlockM_, int kBlockN_, int kNWarps_>
struct Tile {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
};

template <int kHeadDim> struct FwdTiles;
template <> struct FwdTiles<32>  { using Long = Tile<128, 128, 4>; };
template <> struct FwdTiles<64>  { using Long = Tile<128, 128, 4>; };
template <> struct FwdTiles<96>  { using Long = Tile<128, 64, 4>; };
template <> struct FwdTiles<128> { using Long = Tile<128, 64, 4>; };
template <> struct FwdTiles<160> { using Long = Tile<128, 32, 4>; };
template <> struct FwdTiles<192> { using Long = Tile<128, 64, 8>; };
template <> struct FwdTiles<224> {
  using Long = Tile<128, 64, 8>;     // 112 KB
  using Compact = Tile<64, 64, 4>;   // 84 KB, for GPUs with less shared memory per block (sm_86/89: 99 KB)
};
template <> struct FwdTiles<256> {
  using Long = Tile<128, 64, 8>;   // one 128 KB block per SM
  using Short = Tile<64, 64, 4>;   // two 96 KB blocks per SM
  using Compact = Short;
  static constexpr int kShortMaxSeqlenQ = 2048;
};

// Backward tiles: kBlockM query rows stream past kBlockN resident key rows. The three GEMM shapes
// spread the 8 warps differently, each warp grid given as (rows x 8 / rows): S and dP (kBlockM x
// kBlockN) over kAtomMSdP rows of warps, dK and dV (kBlockN x D) over kAtomNdKV, dQ (kBlockM x D) over
// kAtomMdQ. Q and dO have kStages buffers: with two, the next query block loads during this one's dV,
// dQ and dK GEMMs.
template <int kBlockM_, int kBlockN_, int kAtomMSdP_, int kAtomNdKV_, int kAtomMdQ_, int kStages_ = 2>
struct BwdTile {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = 8, kStages = kStages_;
  static constexpr int kAtomMSdP = kAtomMSdP_, kAtomNdKV = kAtomNdKV_, kAtomMdQ = kAtomMdQ_;
};

// Query rows per backward tile; the host sizes the dQ accumulator with it (dq_accum.h).
constexpr int bwd_block_m(int head_dim) { return head_dim <= 64 ? 128 : 64; }

// FA2's SM80 tile shapes, measured on H200 (benchmarks/TUNING.md steps 6-13). Shared memory: 160 KB up
// to head dim 128; above, 48 KB per 64 columns of head dim plus 16 KB: 184 KB at 224 and 208 KB at 256,
// more than A100's 163 KB.
template <int kHeadDim, int kM = bwd_block_m(kHeadDim)>
using BwdTileFor = std::conditional_t<(kHeadDim <= 64), BwdTile<kM, 128, 4, 4, 4>,
                   std::conditional_t<(kHeadDim <= 128), BwdTile<kM, 128, 2, 4, kHeadDim % 64 == 0 ? 2 : 4>,
                                      BwdTile<kM, 64, 4, kHeadDim % 64 == 0 ? 2 : 4, kHeadDim % 64 == 0 ? 2 : 4>>>;

// For GPUs with less shared memory per block: one Q / dO buffer (and 64 keys up to head dim 128), the
// same query rows and dQ layout. 96 KB at head dim 32, 80 KB at 64-128 and 96 KB at 160 fit sm_86/89's
// 99 KB; 112-144 KB at 192-256 fit A100's 163 KB.
template <int kHeadDim, int kM = bwd_block_m(kHeadDim)>
using BwdCompactTileFor = std::conditional_t<(kHeadDim <= 32), BwdTile<kM, 128, 4, 4, 4, 1>,
                          std::conditional_t<(kHeadDim <= 64), BwdTile<kM, 64, 4, 4, 4, 1>,
                          std::conditional_t<(kHeadDim <= 128), BwdTile<kM, 64, 4, 4, kHeadDim % 64 == 0 ? 2 : 4, 1>,
                                             BwdTile<kM, 64, 4, kHeadDim % 64 == 0 ? 2 : 4, kHeadDim % 64 == 0 ? 2 : 4, 1>>>>;

// The dropout kernel's tile: 64 keys (its keep bits and draws do not fit beside a 128-key tile's S and dP: at
// head dim 64, 2064 B of spills in 128 x 128, none in 128 x 64), the full tile's two stages; the compact
// tile (one stage) where that does not fit. Above head dim 128 the full tile already has 64 keys.
template <int kHeadDim, int kM = bwd_block_m(kHeadDim)>
using BwdDropoutTileFor =
    std::conditional_t<(kHeadDim <= 64), BwdTile<kM, 64, 4, 4, 4>,
    std::conditional_t<(kHeadDim <= 128), BwdTile<kM, 64, 4, 4, kHeadDim % 64 == 0 ? 2 : 4>, BwdTileFor<kHeadDim>>>;

// Short tile for seqlen_q <= kShortMaxSeqlenQ, when a head dim has one.
template <class Tiles, class = void> struct HasShortTile { static constexpr bool value = false; };
template <class Tiles> struct HasShortTile<Tiles, decltype(void(Tiles::kShortMaxSeqlenQ))> {
  static constexpr bool value = true;
};

// Compact tile for GPUs whose shared memory per block does not hold the Long one, when a head dim has one.
template <class Tiles, class = void> struct HasCompactTile { static constexpr bool value = false; };
template <class Tiles> struct HasCompactTile<Tiles, std::void_t<typename Tiles::Compact>> {
  static constexpr bool value = true;
};

}  // namespace flash_attn2
