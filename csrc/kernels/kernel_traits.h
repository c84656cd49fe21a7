// CuTe types for one forward kernel: the SM80 tensor-core MMA (valid sm_80..sm_90), swizzled shared
// memory layouts, and the copy atoms between global memory, shared memory and registers.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "tile_sizes.h"

namespace flash_attn2 {

template <int kHeadDim_, typename Element_, class Tile>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kNWarps = Tile::kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256);
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles of Q");

  using Mma = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                 cute::SM80_16x8x16_F32F16F16F32_TN,
                                 cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // Warps are stacked along M only: warp w owns rows [16w, 16w + 16) of every 16*kNWarps rows, so the
  // softmax row statistics never leave a warp. N = 16 pairs two n8 atoms so B loads use ldmatrix.x4.
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<Mma>,
                                  cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  // A shared-memory row segment of 64 (or 32) elements = 128 (64) bytes, XOR-swizzled so that the eight
  // 16-byte chunks read by one ldmatrix phase hit distinct banks.
  static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowElems == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzleBits, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kSmemRowElems>>, cute::Stride<cute::Int<kSmemRowElems>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V viewed as (head_dim, kBlockN): the B operand of O += P V, read with transposing ldmatrix.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: each thread moves 16 bytes (8 elements); a row segment takes kSmemRowElems / 8 threads.
  static constexpr int kGmemThreadsPerRow = kSmemRowElems / 8;
  using GmemLayoutAtom = cute::Layout<cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                                      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));
  using GmemTiledCopyO = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));

  // Q, then one K and one V buffer; the output tile reuses Q's space.
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * int(cute::cosize(SmemLayoutQ{}) + 2 * cute::cosize(SmemLayoutKV{}));
};

}  // namespace flash_attn2
