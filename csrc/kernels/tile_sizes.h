// Forward tile sizes per head dim: kBlockM query rows, kBlockN key rows, kNWarps warps. Each warp owns
// kBlockM / kNWarps query rows (split-Q). Starting points are FA2's SM80 choices; head dims 64, 128 and 256
// were measured on H200 (benchmarks/TUNING.md), the others not yet. A head dim may add a second, smaller
// tile for short sequences, where more and lighter blocks fill the GPU better.
#pragma once

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
template <> struct FwdTiles<224> { using Long = Tile<128, 64, 8>; };
template <> struct FwdTiles<256> {
  using Long = Tile<128, 64, 8>;   // one 128 KB block per SM
  using Short = Tile<64, 64, 4>;   // two 96 KB blocks per SM
  static constexpr int kShortMaxSeqlenQ = 2048;
};

// Short tile for seqlen_q <= kShortMaxSeqlenQ, when a head dim has one.
template <class Tiles, class = void> struct HasShortTile { static constexpr bool value = false; };
template <class Tiles> struct HasShortTile<Tiles, decltype(void(Tiles::kShortMaxSeqlenQ))> {
  static constexpr bool value = true;
};

}  // namespace flash_attn2
