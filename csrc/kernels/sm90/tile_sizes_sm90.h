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

// A narrower tile for short causal sequences, plain kernel only (fwd_launch_sm90.h): at d 256 the 80-key
// blocks overshoot the 128-row tiles' diagonals (2 / 4 / 5 / 7 blocks for 128..512 keys, 14% more keys
// than 64-key blocks read at 512). type void: none.
template <int kHeadDim> struct FwdShortTileSm90 { using type = void; };
template <> struct FwdShortTileSm90<256> {
  using type = TileSm90<128, 64>;
  static constexpr int kMaxSeqlenQ = 512;
};

// The dropout kernel's tile where it is not the plain one's. d 64: two warpgroups with 240 registers each
// instead of three with 160, so that the keep bits are drawn under the GEMMs without spilling (180 bytes
// before): 7-13% faster; the same tile made softcap, ALiBi and windows 5-17% slower (TUNING 72). type void:
// the plain tile.
template <int kHeadDim> struct FwdDropoutTileSm90 { using type = void; };
template <> struct FwdDropoutTileSm90<64> { using type = TileSm90<128, 128>; };

}  // namespace flash_attn2
