// Types of the Hopper backward kernels: what both shapes load (BwdLoadTraitsSm90), then per shape the
// warpgroups, wgmma shapes, shared-memory layouts and storage; and the kernel's arguments.
//
// Head dim <= 128 (BwdTraitsSm90): a block owns kBlockN = 128 keys, 64 per consumer warpgroup, and streams
// kBlockM query rows (128 up to head dim 64, where registers allow it, halving the per-step costs per FLOP, but
// in d 64's extended and dropout kernels; else 64: sm90/tile_size.h) past them per step. Each warpgroup computes the transposed products for its keys, S^T = K Q^T
// and dP^T = V dO^T, so that P^T and dS^T sit in registers as the A operands of dV += P^T dO and
// dK += dS^T Q (FA3's swapped S/dP). dQ = dS K contracts over all 128 keys: dS^T goes through shared
// memory, and each warpgroup computes its share of dQ (half the rows with 128-row steps, else half the
// columns), which it stages in shared memory for its writer warp in the producer warpgroup to add to the
// fp32 accumulator with a TMA reduce-add (128-row steps) or a flat bulk reduce of fragments (64-row steps).
// Head dim > 128 (BwdTraitsSm90Wide): see its comment below.
#pragma once

// wgmma N = 80, 112, ... must come before any CuTe header (see fwd_traits.h).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include <cute/tensor.hpp>

#include "common/kernel_kind.h"
#include "common/tile_scheduler.h"  // CausalTileOrder
#include "flash_attn2/flash_attn2.h"
#include "sm90/scheduler.h"  // SlotRing
#include "sm90/tile_size.h"
#include "sm90/tma.h"  // before TmaRows, whose make_tma_copy depends on no template parameter

namespace flash_attn2 {

// What both Hopper backward shapes load: Q (kBlockM rows, with its rows' D and LSE) in a kStages ring, dO
// in a kStagesdO ring, K and V (kBlockN rows) once; their shared-memory layouts and TMA types. kDQCols:
// the dQ columns one consumer warpgroup computes, which K's swizzle atoms must not straddle.
template <int kHeadDim_, typename Element_, int kBlockM_, int kBlockN_, int kStages_, int kDQCols_, int kStagesdO_ = kStages_>
struct BwdLoadTraitsSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kStagesdO = kStagesdO_, kDQCols = kDQCols_;

  using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;

  // Rows of head_dim elements (Q, dO, K, V), K-major: 128-byte swizzle at head dims that are multiples of
  // 64, else 64-byte.
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutdO = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStagesdO>>{}));
  using SmemLayoutV = decltype(cute::tile_to_shape(SmemAtom{}, TileKV{}));
  // K also feeds dQ, whose columns the GEMMs split: a column slice may not end inside a swizzle atom
  // unless that atom is the whole row (d 32, 64). At d 96 (48 columns each) K takes 32-byte atoms, with
  // 32-column slices (d 192, 256) 64-byte ones.
  using SmemAtomK = std::conditional_t<kDQCols % 64 == 0 || kHeadDim <= 64, SmemAtom,
                    std::conditional_t<kDQCols % 32 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
                                       cute::GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutK = decltype(cute::tile_to_shape(SmemAtomK{}, TileKV{}));
  // The (D, M) MN-major views of Q and dO, and the (D, keys) view of K, as wgmma operands.
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutdOt = decltype(cute::composition(
      SmemLayoutdO{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStagesdO>>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                cute::Step<cute::_2, cute::_1>{})));

  using GmemLayout = cute::Layout<cute::Shape<int, int, int, int>, cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using GmemTensorAcc = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const float*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            cute::take<0, 2>(SmemLayoutQ{}), TileQ{}, cute::_1{}));  // also dO
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}, TileKV{}, cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{}, TileKV{}, cute::_1{}));
  // A query block's D and LSE (log2), loaded with Q by 1-D TMA over the preprocess's workspace: a box of
  // kBlockM + 4 from the 16-byte aligned element at or before the block's first row (TMA needs that
  // alignment), kept at kRowsStride per stage (a multiple of 128 bytes, as TMA destinations need).
  static constexpr int kRowsBox = kBlockM + 4, kRowsStride = (kRowsBox + 31) / 32 * 32;
  using SmemLayoutRows = cute::Layout<cute::Shape<cute::Int<kRowsBox>>>;
  using GmemTensorRows = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const float*>(nullptr)),
                                                    cute::Layout<cute::Shape<int>>{}));
  using TmaRows = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorRows{}, SmemLayoutRows{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kRowsBytes = kRowsBox * sizeof(float);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  // What the producer fills; each shape's SharedStorage starts with it.
  struct LoadStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> dout;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    alignas(128) float lse_log2[kStages][kRowsStride];  // per query row of the Q stage
    alignas(128) float dsum[kStages][kRowsStride];
    uint64_t k_full, v_full;  // the wide kernels' K and V both on k_full; the narrow ones' V after K (warp 3)
    uint64_t kv_empty;        // every consumer thread: done with K and V, the next key block may come
    uint64_t q_full[kStages], q_empty[kStages], do_full[kStagesdO], do_empty[kStagesdO];
  };
};

// A consumer warpgroup's fp32 dQ share (kRows, kCols) staged for the TMA reduce-add as kCols / 8 slabs of
// (kRows, 8 columns), 32 bytes a row. A wgmma accumulator's pair stores write 8 rows x 32 bytes per instruction,
// 4 rows per half-warp: here each half fills the 32 banks once. With 128-byte rows, whose swizzle keeps 32-byte
// pairs together, rows r and r ^ 1 hit the same banks: 2-way conflicts on every store (ncu, TUNING 120). The
// TMA unit reads the slabs as a 3-D box, so dq_accum keeps its (rows, D) layout. The 128-row steps (d <= 64) gain
// from it (1-4%); at d 128 it was 0.5-2% slower (the TMA unit reads 32-byte rows), and at d 256 (wide, 32-column
// parts) 17-21% slower, which keeps the swizzled rows; the 64-row steps stage fragments instead (below).
template <int kRows, int kCols>
using SmemLayoutdQSlabs = cute::Layout<cute::Shape<cute::Int<kRows>, cute::Shape<cute::_8, cute::Int<kCols / 8>>>,
                                       cute::Stride<cute::_8, cute::Stride<cute::_1, cute::Int<8 * kRows>>>>;

// The TMA reduce-add of staged dQ rows, or nothing for kernels whose writer adds fragments by a bulk copy.
template <bool kFragments, class GmemTensor, class SmemLayout, class Tile>
struct DQReduceTma {
  using type = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, GmemTensor{}, SmemLayout{}, Tile{}, cute::_1{}));
};
template <class GmemTensor, class SmemLayout, class Tile>
struct DQReduceTma<true, GmemTensor, SmemLayout, Tile> {
  struct type {};
};

// Head dim <= 128: keys split over the consumer warpgroups (see the top of this file).
// dQ = dS K splits over the warpgroups by query rows where steps have 128 (each 64 rows x every column: a
// wgmma as wide as D, FA3's split), else by columns (each every row x D / 2).
template <int kHeadDim, int kBlockM>
constexpr int bwd_dq_cols_sm90() { return kBlockM == 128 ? kHeadDim : kHeadDim / 2; }

template <int kHeadDim_, typename Element_, int kBlockM_, bool kPlainAlibi_>
struct BwdTraitsSm90
    : BwdLoadTraitsSm90<kHeadDim_, Element_, kBlockM_, kBwdBlockNSm90, 2, bwd_dq_cols_sm90<kHeadDim_, kBlockM_>()> {
  using Base = BwdLoadTraitsSm90<kHeadDim_, Element_, kBlockM_, kBwdBlockNSm90, 2, bwd_dq_cols_sm90<kHeadDim_, kBlockM_>()>;
  using Element = Element_;
  static constexpr bool kWide = false;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBwdBlockNSm90;
  // A plain kernel that adds ALiBi's bias to S^T (Kind::kPlainAlibi: ALiBi alone at d 64 / 128, where the
  // extended kernel waits for both GEMMs); a kernel of its own, as the bias's registers slowed the plain one
  // (TUNING 73).
  static constexpr bool kPlainAlibi = kPlainAlibi_;
  static constexpr int kConsumerWarpgroups = kBlockN / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  // 128 x 24 + 256 x 240 = 384 x 168, what the block holds from launch: setmaxnreg.inc past it waits forever.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "dK and dV of 64 keys stay in registers up to head dim 128");
  static_assert(Base::kStagesdO == Base::kStages, "Q and dO share one ring (bwd_mainloop.h)");
  static constexpr bool kDQByRows = kBlockM == 128;
  static constexpr int kDQRows = kDQByRows ? 64 : kBlockM, kDQCols = Base::kDQCols;  // one warpgroup's share of dQ
  static constexpr int kDQParts = 1;  // dQ stagings per warpgroup and step
  // With 64-row steps a step's dQ runs in the next step (kDeferDQ), its dS^T handed between the warpgroups
  // by mbarriers over 3 buffers, so that the two warpgroups can run half a step apart (TUNING 35). The
  // 128-row steps at d <= 64 have no room for a third buffer: their dQ runs in its own step, both
  // warpgroups meeting at kdSWritten (two buffers, by step parity).
  static constexpr bool kDeferDQ = kBlockM == 64;
  static constexpr int kDSBuffers = kDeferDQ ? 3 : 2;
  // 128-row steps at d <= 64: a warpgroup's dK and dV (64 x D each) fit its keys' half of a dS^T buffer (64 x
  // kBlockM, one contiguous block: dS's atoms tile M first), where the epilogue stages them instead of in K
  // and V, so that the next key block's K and V load while it runs (bwd_mainloop.h).
  static constexpr bool kDKVInDS = !kDeferDQ && 2 * kHeadDim <= kBlockM;

  using TileSt = cute::Shape<cute::_64, cute::Int<kBlockM>>;  // one warpgroup's S^T: (its keys, queries)
  using TileKVWarpgroup = cute::Shape<cute::_64, cute::Int<kHeadDim>>;
  using TiledQ = cute::Shape<cute::Int<kDQRows>, cute::Int<kDQCols>>;  // one warpgroup's share of dQ
  // With 128-row steps, where warpgroup w's share of a step's dQ lies, in TiledQ tiles of the (rows, D)
  // accumulator (with 64-row steps: column group w of its query block's slot).
  __device__ static auto dq_tile(int m_block, int w, int /*part*/) { return cute::make_coord(m_block * 2 + w, 0); }

  // One warpgroup each (warpgroups run their own GEMMs on their own keys).
  // S^T, dP^T = (64 keys, M) += (64, D) (M, D)^T: both K-major in shared memory.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kBlockM>, cute::Int<kHeadDim>>>()));
  // dV, dK = (64 keys, D) += P^T / dS^T (64, M) from registers, dO / Q as the (D, M) MN-major operand.
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockM>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  // dQ share = (rows, columns) += dS (rows, 128 keys) K (128 keys, columns): dS read MN-major from dS^T, K
  // MN-major.
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::Int<kDQRows>, cute::Int<kDQCols>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
  static_assert(cute::tile_size<1>(TiledMmaSdP{}) == kBlockM && cute::tile_size<1>(TiledMmadKV{}) == kHeadDim &&
                cute::tile_size<1>(TiledMmadQ{}) == kDQCols, "each product must be one wgmma wide");

  // dS as dQ's A operand (M, 128 keys), M-major; the warpgroups write it through the (keys, M) view.
  using SmemLayoutdS = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                    cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutdSt = decltype(cute::composition(
      SmemLayoutdS{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                                cute::Step<cute::_2, cute::_1>{})));

  // With 128-row steps dQ is staged as slabs for a TMA reduce-add over dq_accum as (rows, kHeadDim, heads,
  // 1): rows past a sequence get dS = 0 rows (adding 0), past the tensor the TMA unit drops them. With
  // 64-row steps a warpgroup's share is staged in its accumulator's register order (kDQFragments,
  // bwd_dq_fragment_word) and added by one flat bulk reduce to its query block's slot. With the swizzled
  // rows these kernels had, staging dQ cost 15-25% of their time (TUNING 121).
  static constexpr bool kDQFragments = !kDQByRows;
  static_assert(!kDQFragments || kDQCols * 2 == kHeadDim);
  using SmemLayoutdQ = std::conditional_t<kDQFragments, cute::Layout<cute::Shape<cute::Int<kDQRows * kDQCols>>>,
                                          SmemLayoutdQSlabs<kDQRows, kDQCols>>;
  static constexpr uint32_t kDQBytes = kDQRows * kDQCols * sizeof(float);
  using TmadQ = typename DQReduceTma<kDQFragments, typename Base::GmemTensorAcc, SmemLayoutdQ, TiledQ>::type;

  // The tiles after the first, from the loader to every other warp: the V loader, the dQ writers, the consumers.
  static constexpr int kSlotReaders = 1 + kConsumerWarpgroups + kConsumerThreads / 32;

  struct SharedStorage : Base::LoadStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> ds[kDSBuffers];  // by step % kDSBuffers
    cute::array_aligned<float, cute::cosize_v<SmemLayoutdQ>, 1024> dq[kConsumerWarpgroups];
    uint64_t ds_full[kDSBuffers], ds_empty[kDSBuffers];  // kDeferDQ: every consumer thread arrives
    sm90::SlotRing<2, kSlotReaders> slots;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared memory per block");
};

// Head dim > 128 (FA3's shape for d 192 / 256): dK and dV of a block's keys no longer fit one warpgroup's
// registers, so the warpgroups split the head dim instead. Each computes S = Q K^T and dP = dO V^T for
// its kKeys of the keys (rows along queries, as in the forward) and writes P and dS to shared memory; then
// dV^T += dO^T P and dK^T += Q^T dS for its kDRows rows of the head dim (all keys), and dQ = dS K for its
// kDRows columns, bwd_wide_dq_part at a time (below), staged for a TMA reduce-add into dq_accum. One dO stage
// at both head dims: 80 keys per block at d 256 (96 at d 192) leave room for no more (FA3's choice): fewer Q / dO
// loads and dQ reductions per FLOP, which bound the 64-key version (L2 at 76% of its throughput).
// dQ columns per GEMM and staging of the wide shape: d 192's 64 (a warpgroup's whole share: one hand-off to the writer
// warp a step, as FA3; 16 KB of staging a warpgroup, which d 192's 96-key blocks leave room for), d 256's 32 (two
// hand-offs a step: its shared memory is full).
constexpr int bwd_wide_dq_part(int head_dim) { return head_dim == 192 ? 64 : 32; }

template <int kHeadDim_, typename Element_, int kGroups_, int kKeys_>
struct BwdTraitsSm90Wide
    : BwdLoadTraitsSm90<kHeadDim_, Element_, 64, kKeys_ * kGroups_, 2, bwd_wide_dq_part(kHeadDim_), /*kStagesdO=*/1> {
  static constexpr int kConsumerWarpgroups = kGroups_;
  using Base = BwdLoadTraitsSm90<kHeadDim_, Element_, 64, kKeys_ * kGroups_, 2, bwd_wide_dq_part(kHeadDim_), 1>;
  using Element = Element_;
  static constexpr bool kWide = true, kPlainAlibi = false, kDQFragments = false;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kBlockN = kKeys_ * kConsumerWarpgroups;
  static constexpr int kKeys = kKeys_, kDRows = kHeadDim / kConsumerWarpgroups;  // per consumer warpgroup
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 24, kConsumerRegs = kConsumerWarpgroups == 3 ? 160 : 240;
  static_assert(kDRows % 64 == 0, "each warpgroup's share of the head dim is whole wgmma rows");

  using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kKeys>>;               // one warpgroup's S: (queries, its keys)
  using TileKVWarpgroup = cute::Shape<cute::Int<kKeys>, cute::Int<kHeadDim>>;    // its keys of K, V
  using TiledKVt = cute::Shape<cute::Int<kDRows>, cute::Int<kBlockN>>;           // its rows of dK^T, dV^T
  // dQ = dS K for its kDRows columns in GEMMs of kDQPart columns, each staged in shared memory (d 256: 8 KB per
  // warpgroup, the room left; d 192: 16 KB, its whole share) for the producer's writer warp to add to dq_accum (TMA
  // reduce-add). Two parts share one staging buffer, so the second waits, inside the step, for the writer to have
  // sent the first (TUNING 186).
  static constexpr int kDQPart = Base::kDQCols, kDQParts = kDRows / kDQPart;
  static_assert(kDRows % kDQPart == 0);
  using TiledQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kDQPart>>;  // one part of its dQ columns
  __device__ static auto dq_tile(int m_block, int w, int part) { return cute::make_coord(m_block, w * kDQParts + part); }

  // S, dP = (M, 32 keys) += Q / dO (M, D) K / V (32, D)^T: both K-major.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::Int<kBlockM>, cute::Int<kKeys>, cute::Int<kHeadDim>>>()));
  // dV^T, dK^T = (kDRows, N) += dO^T / Q^T (kDRows, M) P / dS (M, N): both MN-major views.
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kBlockM>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
  // dQ part = (M, kDQPart) += dS (M, N keys) K (N, kDQPart): dS K-major, K MN-major.
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::Int<kBlockM>, cute::Int<kDQPart>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  static_assert(cute::tile_size<1>(TiledMmaSdP{}) == kKeys && cute::tile_size<1>(TiledMmadKV{}) == kBlockN &&
                cute::tile_size<1>(TiledMmadQ{}) == kDQPart, "each product must be one wgmma wide");

  // P and dS, (M, N) with the keys contiguous: dQ's K-major A operand, and through the (N, M) view the
  // MN-major B operand of dV^T and dK^T.
  // Each warpgroup writes its kKeys columns: a swizzle atom may not straddle two warpgroups' columns.
  using SmemAtomPdS = std::conditional_t<kKeys % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                      std::conditional_t<kKeys % 32 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
                      std::conditional_t<kKeys % 16 == 0, cute::GMMA::Layout_K_SW32_Atom<Element>,
                                         cute::GMMA::Layout_K_INTER_Atom<Element>>>>;
  using SmemLayoutPdS = decltype(cute::tile_to_shape(SmemAtomPdS{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                                 cute::Step<cute::_2, cute::_1>{})));
  using SmemLayoutdQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{}, TiledQ{}));
  using TmadQ = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, typename Base::GmemTensorAcc{}, SmemLayoutdQ{},
                                             TiledQ{}, cute::_1{}));

  static constexpr int kSlotReaders = kConsumerWarpgroups + kConsumerThreads / 32;  // the dQ writers, the consumers

  struct SharedStorage : Base::LoadStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutPdS>, 1024> p;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutPdS>, 1024> ds;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutdQ>, 1024> dq[kConsumerWarpgroups];
    sm90::SlotRing<2, kSlotReaders> slots;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared memory per block");
};

// The traits of the kernel of kind kKind (bwd_kind_sm90's answer) at a head dim, from the tile table.
template <int kHeadDim, typename Element, Kind kKind>
using BwdTraitsSm90For = std::conditional_t<
    bwd_tile_sm90(kHeadDim, kKind).wide,
    BwdTraitsSm90Wide<kHeadDim, Element, bwd_tile_sm90(kHeadDim, kKind).groups, bwd_tile_sm90(kHeadDim, kKind).keys>,
    BwdTraitsSm90<kHeadDim, Element, bwd_tile_sm90(kHeadDim, kKind).block_m, kKind == Kind::kPlainAlibi>>;

template <class Traits>
struct BwdArgsSm90 {
  BwdParams params;
  typename Traits::TmaQ tma_q, tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmadQ tma_dq;
  typename Traits::TmaRows tma_rows;  // over softmax_d: D, then LSE (log2)
  int rows_extent;
  // Blocks per (key block, kv head), each taking group / head_splits of the query heads; above 1 they add
  // dK and dV into fp32 accumulators after dq_accum's region (bwd_dkv_accum_offset), converted afterwards.
  int head_splits;
  // Causal key blocks longest first in sections of (batch, kv head) pairs (bwd_launch.h says how);
  // section_heads 0: pair by pair (TileScheduler's order).
  CausalTileOrder<true> causal_keys;
  int* tile_counter;  // the slots claimed so far past the grid's first (bwd_kernel.h)
};

}  // namespace flash_attn2
