// Types of one Hopper forward kernel: tiles and warpgroups, the two wgmma shapes, shared-memory layouts
// and storage, TMA descriptors, and the kernel's arguments.
#pragma once

// wgmma N = 80, 112, 160, 224 (standard: powers of two, 96, 192). Must come before any CuTe header; the
// static_asserts below catch an include order that loses it (d 160-256 then fell back to N = 16 wgmmas,
// which re-read Q from shared memory once per 16 keys: d 256 ran at 0.65x).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include <climits>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "flash_attn2/flash_attn2.h"
#include "common/tile_scheduler.h"
#include "sm90/scheduler.h"
#include "sm90/tile_size.h"

namespace flash_attn2 {

// kHeadDimV_: V's and O's head dim where it differs from Q's and K's (MLA's d_v < d_qk); the default, the same,
// gives the same types as a traits without it.
template <int kHeadDim_, typename Element_, class Tile, int kHeadDimV_ = kHeadDim_>
struct FwdTraitsSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kSameHeadDims = kHeadDimV == kHeadDim;
  // The call's head dim of V and O (FwdParams::head_dim_v; 0: q's), read only where the dims differ.
  __host__ __device__ static int head_dim_v(const FwdParams& p) {
    if constexpr (kSameHeadDims) {
      return p.head_dim;
    } else {
      return p.head_dim_v > 0 ? p.head_dim_v : p.head_dim;
    }
  }
  static constexpr int kStages = Tile::kStages;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  // setmaxnreg budgets: the producer keeps few registers, the consumers share the rest of the block's, which is
  // what ptxas gives each thread at launch (65536 / threads, rounded down to 8) times the threads: 168 x 384 with
  // two consumer warpgroups. A budget past it can hang the consumers' setmaxnreg.inc (CUTLASS issue 2007).
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0 && kHeadDimV % 16 == 0);
  static_assert(kConsumerWarpgroups <= 3, "named barrier ids: two per consumer warpgroup");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536 / kNThreads / 8 * 8 * kNThreads,
                "setmaxnreg budgets past the block's registers");
  // The consumer warpgroups take turns issuing their GEMMs, so one's softmax runs under the others': +5-10%
  // at head dim 128, neutral at 64 (benchmarks/TUNING.md step 18); off above 128, where it measured 3-4% slower
  // at d 192 and neutral at d 256 (step 68).
  static constexpr bool kPingPong = kConsumerWarpgroups >= 2 && kHeadDim <= 128;

  using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  using TileQWarpgroup = cute::Shape<cute::_64, cute::Int<kHeadDim>>;  // one consumer warpgroup's rows
  using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;   // K's tile
  using TileV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>;
  using TileO = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>;
  using TileOWarpgroup = cute::Shape<cute::_64, cute::Int<kHeadDimV>>;  // one consumer warpgroup's rows of O
  using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>;
  // One 64-row wgmma atom per consumer warpgroup, stacked along M.
  using AtomLayout = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      AtomLayout{}));
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      AtomLayout{}));
  static_assert(cute::tile_size<1>(TiledMmaS{}) == kBlockN, "S = Q K^T must be one wgmma wide (N = kBlockN)");
  static_assert(cute::tile_size<1>(TiledMmaO{}) == kHeadDimV, "O += P V must be one wgmma wide (N = V's head dim)");

  // Rows of head_dim elements, K-major for S = Q K^T: 128-byte swizzle when head_dim is a multiple of 64,
  // else 64-byte. V keeps K's layout; O += P V reads it as the MN-major (D, kBlockN) operand.
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemAtomV = std::conditional_t<kHeadDimV % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                       cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, TileQ{}));
  // One consumer warpgroup's 64 rows of Q (at offset 64 * warpgroup rows): each has its own TMA load and
  // barriers, so a warpgroup's next Q loads as soon as it is done with its last S = Q K^T. Each 64-column
  // atom's rows stay contiguous, so a slab is D / 64 TMA boxes (rows-outermost would make it 8-row boxes:
  // 4x the copies, which cost d 256 a third of its speed).
  using SmemLayoutQWarpgroup = decltype(cute::composition(
      SmemLayoutQ{}, cute::Layout<TileQWarpgroup, cute::Stride<cute::_1, cute::Int<kBlockM>>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutV = decltype(cute::tile_to_shape(
      SmemAtomV{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>, cute::Int<kStages>>{}));
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // O staged in shared memory (over Q, or in its own buffer) before its store: Q's layout at V's head dim.
  using SmemLayoutO = decltype(cute::tile_to_shape(SmemAtomV{}, TileO{}));
  using SmemLayoutOWarpgroup = decltype(cute::composition(
      SmemLayoutO{}, cute::Layout<TileOWarpgroup, cute::Stride<cute::_1, cute::Int<kBlockM>>>{}));

  // TMA descriptors over (rows, head_dim, heads, batch) views; varlen uses batch 1 and row offsets.
  using GmemLayout = cute::Layout<cute::Shape<int, int, int, int>, cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQWarpgroup{},
                                            TileQWarpgroup{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                             cute::take<0, 2>(SmemLayoutKV{}), TileKV{}, cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            cute::take<0, 2>(SmemLayoutV{}), TileV{}, cute::_1{}));
  // O leaves per warpgroup slab too: staged in shared memory, stored by TMA (fixed-length batches).
  using TmaO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutOWarpgroup{},
                                            TileOWarpgroup{}, cute::_1{}));
  // A paged cache's K / V arrive in boxes of 16 to kBlockN rows (paged_box_rows_sm90) by one swizzle atom's
  // columns (fwd_mainloop.h: fwd_produce_tile). Each box's rows must be one contiguous, atom-aligned run of a
  // stage's shared memory: the layouts stack the atoms along the rows first (a whole block's rows of one atom
  // contiguous), then along the columns, then the stages.
  static constexpr int kAtomCols = cute::size<1>(SmemAtom{}), kAtomColsV = cute::size<1>(SmemAtomV{});
  static_assert(kBlockN % 16 == 0 && kHeadDim % kAtomCols == 0 && kHeadDimV % kAtomColsV == 0);
  // (On the layout without its swizzle: the swizzle permutes 16-byte chunks within each 8-row atom, as TMA's
  // swizzle mode writes them.)
  template <class SwizzledLayout, int kCols, int kAtom>
  static constexpr bool boxes_contiguous() {
    constexpr auto layout = cute::get_nonswizzle_portion(SwizzledLayout{});
    return layout(16, 0, 0) == 16 * kAtom && layout(kBlockN - 1, 0, 0) == (kBlockN - 1) * kAtom &&
           (kCols == kAtom || layout(0, kAtom, 0) == kBlockN * kAtom) &&
           (kStages == 1 || layout(0, 0, 1) == kBlockN * kCols) && layout(1, 0, 0) == kAtom;
  }
  static_assert(boxes_contiguous<SmemLayoutKV, kHeadDim, kAtomCols>(), "a paged box of K: a block's rows of one atom, contiguous");
  static_assert(boxes_contiguous<SmemLayoutV, kHeadDimV, kAtomColsV>(), "a paged box of V: a block's rows of one atom, contiguous");
  static constexpr uint32_t kQBytes = 64 * kHeadDim * sizeof(Element);  // one warpgroup's slab
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);  // a block of K
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);

  // Fixed-length grids are persistent (the next tile's loads overlap this one's epilogue), but for causal
  // above this seqlen_q, where one block per tile in hardware order measured faster (d 256 causal 8k / 16k:
  // 4% / 11%, benchmarks/TUNING.md step 26). Without a tile counter (fixed order) persistent causal was
  // measured up to 8k only (step 23).
  static constexpr int kPersistentCausalMax = kHeadDim <= 128 ? INT_MAX : 4096;
  static constexpr int kPersistentCausalMaxStatic = kPersistentCausalMax < 8192 ? kPersistentCausalMax : 8192;
  // O gets its own buffer where it fits, so the next tile's Q can load during this tile's epilogue;
  // else it is staged over Q.
  static constexpr int kTileBytes = int(sizeof(Element)) * (cute::cosize_v<SmemLayoutQ> + cute::cosize_v<SmemLayoutO> +
                                                            cute::cosize_v<SmemLayoutKV> + cute::cosize_v<SmemLayoutV>);
  static constexpr bool kSeparateO = kTileBytes + 2048 <= 227 * 1024;
  static_assert(kSeparateO || cute::cosize_v<SmemLayoutO> <= cute::cosize_v<SmemLayoutQ>, "O staged over Q must fit");

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, kSeparateO ? cute::cosize_v<SmemLayoutO> : 8, 1024> o;
    // Per consumer warpgroup: its Q slab landed; the slab (and O staged over it) no longer read.
    uint64_t q_full[kConsumerWarpgroups], q_empty[kConsumerWarpgroups];
    uint64_t k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];
    sm90::SlotRing<2, kConsumerThreads / 32> slots;  // the tiles' slots, producer to consumers
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

namespace sm90 {
// Named barriers of the forward (ids above CUTLASS's reserved ones). Per consumer warpgroup (at most 3): its
// ping-pong turn, its own 128 threads; then the zeroed V tail (varlen).
enum class Barrier : int { kWarpgroup0 = 0, kWarpgroupSync0 = 3, kVTail = 6 };
}  // namespace sm90

template <class Traits>
struct FwdArgsSm90 {
  FwdParams params;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;  // fixed length only: varlen rows past a sequence belong to the next one
  bool causal_order;  // walk the slots in causal_tiles' order (a persistent grid, fixed-length causal)
  CausalTileOrder<> causal_tiles;
  int* tile_counter;  // zeroed: the blocks claim slots as they free up (causal, or non-causal by request); nullptr: static
  // A paged cache's K and V (FwdParams::page_table): sm90::make_paged_tma's boxes (paged_box_rows_sm90 rows,
  // which the producer computes from the page size too); unused (zero) otherwise.
  CUtensorMap paged_k, paged_v;
};

}  // namespace flash_attn2
