// Forward tile sizes per head dim: (kBlockM query rows, kBlockN key rows, warps). Each warp owns
// kBlockM / kNWarps query rows (split-Q). Starting points follow FA2's SM80 choices; the measured
// choices on H100 are recorded in benchmarks/TUNING.md.
#pragma once

namespace flash_attn2 {

template <int kHeadDim> struct FwdTileSize;
//                                      kBlockM       kBlockN       kNWarps
template <> struct FwdTileSize<32>  { static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4; };
template <> struct FwdTileSize<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4; };
template <> struct FwdTileSize<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4; };
template <> struct FwdTileSize<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4; };
template <> struct FwdTileSize<160> { static constexpr int kBlockM = 128, kBlockN = 32,  kNWarps = 4; };
template <> struct FwdTileSize<192> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8; };
template <> struct FwdTileSize<224> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8; };
template <> struct FwdTileSize<256> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8; };

}  // namespace flash_attn2
