// CuTe types for the kernels: the SM80 tensor-core MMA (valid sm_80..sm_90), swizzled shared memory
// layouts, and the copy atoms between global memory, shared memory and registers.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "flash_attn2/flash_attn2.h"
#include "sm80/tile_size.h"
#include "common/utils.h"

namespace flash_attn2 {

// What the forward and backward kernels share for a head dim, an element type and a thread count.
template <int kHeadDim_, typename Element_, int kNWarps_>
struct CommonTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256);

  using Mma = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                 cute::SM80_16x8x16_F32F16F16F32_TN,
                                 cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // kWarpsM x kWarpsN warps; each warp covers 16 x 16 of the tile (two n8 atoms side by side, so B
  // operands load with ldmatrix.x4).
  template <int kWarpsM>
  using TiledMmaFor = cute::TiledMMA<cute::MMA_Atom<Mma>,
                                     cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<kNWarps / kWarpsM>, cute::_1>>,
                                     cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<16 * kNWarps / kWarpsM>, cute::_16>>;

  // A shared-memory row segment of 64 (or 32) elements = 128 (64) bytes, XOR-swizzled so that the eight
  // 16-byte chunks read by one ldmatrix phase hit distinct banks.
  template <int kRowElems>
  using SwizzledAtom = decltype(cute::composition(
      cute::Swizzle<kRowElems == 64 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kRowElems>>, cute::Stride<cute::Int<kRowElems>, cute::_1>>{}));
  static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  using SmemLayoutAtom = SwizzledAtom<kSmemRowElems>;
  template <int kRows>
  using SmemLayoutRows = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>>{}));
  // The (cols, rows) view of a (rows, cols) layout: the B operand of a GEMM that contracts over rows.
  template <class Layout>
  using Transposed = decltype(cute::composition(
      Layout{}, cute::make_layout(cute::Shape<decltype(cute::size<1>(Layout{})), decltype(cute::size<0>(Layout{}))>{},
                                  cute::GenRowMajor{})));

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomC = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: each thread moves 16 bytes (8 elements); a row segment takes kSmemRowElems / 8 threads.
  static constexpr int kGmemThreadsPerRow = kSmemRowElems / 8;
  using GmemLayoutAtom = cute::Layout<cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                                      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemTiledCopyIn = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));
  using GmemTiledCopyOut = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));
};

template <int kHeadDim, typename Element, class Tile>
struct FwdTraits : CommonTraits<kHeadDim, Element, Tile::kNWarps> {
  using Base = CommonTraits<kHeadDim, Element, Tile::kNWarps>;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static_assert(kBlockM % (16 * Tile::kNWarps) == 0, "each warp owns whole 16-row MMA tiles of Q");

  // Warps are stacked along M only: warp w owns rows [16w, 16w + 16) of every 16*kNWarps rows, so the
  // softmax row statistics never leave a warp.
  using TiledMma = typename Base::template TiledMmaFor<Tile::kNWarps>;
  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
  using SmemLayoutVt = typename Base::template Transposed<SmemLayoutKV>;  // (D, kBlockN)

  // Q, then one K and one V buffer; the output tile reuses Q's space.
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * int(cute::cosize(SmemLayoutQ{}) + 2 * cute::cosize(SmemLayoutKV{}));
};

template <int kHeadDim, typename Element, class Tile>
struct BwdTraits : CommonTraits<kHeadDim, Element, Tile::kNWarps> {
  using Base = CommonTraits<kHeadDim, Element, Tile::kNWarps>;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static_assert(kBlockM == bwd_block_m(kHeadDim), "the host sizes the dQ accumulator with bwd_block_m");

  using TiledMmaSdP = typename Base::template TiledMmaFor<Tile::kAtomMSdP>;  // (kBlockM, kBlockN) += (M, D) (N, D)^T
  using TiledMmadKV = typename Base::template TiledMmaFor<Tile::kAtomNdKV>;  // (kBlockN, D) += (M, N)^T (M, D)
  using TiledMmadQ = typename Base::template TiledMmaFor<Tile::kAtomMdQ>;    // (kBlockM, D) += (M, N) (N, D)

  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;   // per stage; also dO
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
  using SmemLayoutQt = typename Base::template Transposed<SmemLayoutQ>;  // (D, kBlockM)
  using SmemLayoutKt = typename Base::template Transposed<SmemLayoutKV>;  // (D, kBlockN)
  static_assert(kBlockN % 64 == 0);
  using SmemLayoutPdS = decltype(cute::tile_to_shape(typename Base::template SwizzledAtom<64>{},
                                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPdSt = typename Base::template Transposed<SmemLayoutPdS>;  // (kBlockN, kBlockM)

  static constexpr int kStages = Tile::kStages;
  static_assert(kStages == 1 || kStages == 2);
  static constexpr int kQSize = cute::cosize(SmemLayoutQ{});
  static constexpr int kKVSize = cute::cosize(SmemLayoutKV{});
  static constexpr int kPdSSize = cute::cosize(SmemLayoutPdS{});
  // kStages x Q, kStages x dO, K, V, P, dS. The dK / dV tiles reuse K and V's space at the end.
  static constexpr int kSmemBytes = int(sizeof(Element)) * (2 * kStages * kQSize + 2 * kKVSize + 2 * kPdSSize);
};

}  // namespace flash_attn2
