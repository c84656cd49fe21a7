// Hopper forward tiles per head dim: kBlockM query rows (64 per consumer warpgroup) and kBlockN key rows
// per K/V pipeline stage. kBlockN is as large as 227 KB of shared memory allows for Q plus two stages of K
// and V (FA3's choices, hopper/tile_size.h, on our buckets); not yet tuned here.
#pragma once

namespace flash_attn2 {

template <int kBlockM_, int kBlockN_, int kStages_ = 2>
struct TileSm90 {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
};

template <int kHeadDim> struct FwdTileSm90;
template <> struct FwdTileSm90<32>  { using type = TileSm90<128, 128>; };
template <> struct FwdTileSm90<64>  { using type = TileSm90<192, 128>; };  // 3 consumer warpgroups
template <> struct FwdTileSm90<96>  { using type = TileSm90<128, 128>; };
template <> struct FwdTileSm90<128> { using type = TileSm90<128, 128>; };
template <> struct FwdTileSm90<160> { using type = TileSm90<128, 112>; };
template <> struct FwdTileSm90<192> { using type = TileSm90<128, 96>; };
template <> struct FwdTileSm90<224> { using type = TileSm90<128, 80>; };
template <> struct FwdTileSm90<256> { using type = TileSm90<128, 80>; };

}  // namespace flash_attn2
