// The roles of one Hopper forward block on one tile: the producer's TMA loads (fwd_produce_tile) and a
// consumer warpgroup's mainloop (fwd_consume_tile), which hands its softmax state and O to the epilogue
// (fwd_epilogue.h). fwd_kernel.h walks the tiles and hands them out; its comment describes the pipeline.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/fwd_traits.h"

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/block_range.h"
#include "common/dropout.h"
#include "common/mask.h"
#include "common/score_mod.h"
#include "common/seqlen.h"
#include "common/softmax.h"
#include "common/utils.h"
#include "sm90/fwd_epilogue.h"
#include "sm90/tma.h"
#include "sm90/wgmma.h"

namespace flash_attn2 {

namespace sm90 {

// The key blocks consumer warpgroup `warpgroup`'s 64 rows of a tile visit: the tile's, less those past
// the window's right edge for its own rows; none for rows past the sequence. Empty when n_max == n_min.
// Blocks before its own rows' left edge stay (the stages go round in order), masked.
template <class Traits, bool kExtended>
__device__ BlockRange warpgroup_block_range(const Window& window, const BlockRange& tile_blocks, int m_block,
                                            int warpgroup) {
  const int row_block = m_block * Traits::kConsumerWarpgroups + warpgroup;  // in units of 64 rows
  if (row_block * 64 >= window.len_q) return {tile_blocks.n_min, tile_blocks.n_min, tile_blocks.n_min, tile_blocks.n_min};
  BlockRange blocks = fwd_block_range<64, Traits::kBlockN, kExtended>(window, row_block);
  blocks.n_min = tile_blocks.n_min;
  blocks.n_max = max(blocks.n_min, min(blocks.n_max, tile_blocks.n_max));
  return blocks;
}

// Issues one tile's loads: K[n_max - 1] first (its stage may free up before Q's), each warpgroup's Q slab
// once that warpgroup is done with its last one, then V[n_max - 1], K[n_max - 2], ... Called by a whole warp;
// `leader` issues. Every consumer warpgroup releases every stage, those it skips too (fwd_consume_tile).
// The pipeline states carry over from tile to tile. kPaged: a paged KV cache's K / V (FwdParams::page_table), an
// instantiation of its own so that the other calls' producer keeps its registers (24 with two consumer warpgroups).
// kLoaders: how many producer warps issue a paged block's boxes (the paged kernel's 2, each calling this with its
// `part`); part 0 alone loads Q and arms K's and V's full barriers with the whole block's bytes. A part-1 box may
// land before part 0's arrival: the transaction count goes below zero, and the phase still waits for the arrival
// (as a cluster's multicast loads do).
template <class Traits, bool kExtended, bool kPaged, int kLoaders = 1>
__device__ void fwd_produce_tile(const FwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                                 const SeqlenInfo& seq, const BlockRange& blocks, int bidb, int bidh, int m_block,
                                 PipelineState& state, uint32_t q_phase, bool leader, int part = 0) {
  using namespace cute;
  static_assert(kLoaders == 1 || (kPaged && kLoaders == 2), "two loader warps share a paged block's boxes only");
  const bool loads_q = kLoaders == 1 || part == 0;  // and arms the full barriers
  const FwdParams& p = args.params;
  const int batch_index = p.cu_seqlens_q != nullptr ? 0 : bidb;
  const int kv_batch_index = p.cu_seqlens_q != nullptr ? 0 : kv_batch_entry(p, bidb);  // a KV cache's kv_batch_idx
  const int bidh_k = bidh / (p.num_heads / p.num_heads_k);
  Tensor mQ = args.tma_q.get_tma_tensor(tma_shape<true>(p));   // (rows, D, heads, batch) coordinates
  Tensor mK = args.tma_k.get_tma_tensor(tma_shape<false>(p));  // (rows, D, heads_k, batch)
  Tensor mV = args.tma_v.get_tma_tensor(tma_shape<false>(p, Traits::head_dim_v(p)));  // (rows, D_v, heads_k, batch)
  Tensor gQ = local_tile(domain_offset(make_coord(int(seq.start_q), _0{}), mQ(_, _, bidh, batch_index)),
                         typename Traits::TileQWarpgroup{},
                         make_coord(_, _0{}));  // (64, D, m) slabs of 64 rows; the tile's from m_block * kGroups
  Tensor gK = local_tile(domain_offset(make_coord(int(seq.start_k), _0{}), mK(_, _, bidh_k, kv_batch_index)),
                         typename Traits::TileKV{}, make_coord(_, _0{}));  // (kBlockN, D, n)
  Tensor gV = local_tile(domain_offset(make_coord(int(seq.start_k), _0{}), mV(_, _, bidh_k, kv_batch_index)),
                         typename Traits::TileV{}, make_coord(_, _0{}));  // (kBlockN, D_v, n)
  Tensor sQ = local_tile(make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{}),
                         typename Traits::TileQWarpgroup{}, make_coord(_, _0{}));  // (64, D, kGroups)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});  // (kBlockN, D, stages)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});  // (kBlockN, D_v, stages)
  auto tQ = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  Tensor tQgQ = get<0>(tQ);  // (TMA, m) coordinates in q
  Tensor tQsQ = get<1>(tQ);  // (TMA, kGroups)
  auto tK = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  Tensor tKgK = get<0>(tK);  // (TMA, n) coordinates in k
  Tensor tKsK = get<1>(tK);  // (TMA, stages)
  auto tV = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
  Tensor tVgV = get<0>(tV);  // (TMA, n) coordinates in v
  Tensor tVsV = get<1>(tV);  // (TMA, stages)

  // A fresh barrier counts as having completed the phase before 0, so the first waits on "empty" pass.
  // K or V block n_block into the current stage, behind that tensor's empty / full barriers. K and V are read
  // by the (batch, head)'s other tiles too: kept in L2 first; Q once: evicted first.
  auto load_kv = [&](const auto& tma, const auto& tXgX, const auto& tXsX, uint64_t* full, uint64_t* empty, int n_block,
                     uint32_t bytes) {
    barrier_wait(&empty[state.stage], state.phase ^ 1);
    if (leader) {
      barrier_expect_tx(&full[state.stage], bytes);
      copy(tma.with(full[state.stage], 0, TMA::CacheHintSm90::EVICT_LAST), tXgX(_, n_block), tXsX(_, state.stage));
    }
  };
  // A paged cache: block n_block's rows in boxes of box_rows rows (16 up to the block: the page size's power-of-two
  // divisor, sm90/tile_size.h, as the launcher encoded the descriptors) by one column atom (fwd_traits.h), each
  // box through its page-table entry (clamped to the pages; boxes past the sequence read page 0; rows past it are
  // masked, their V rows zeroed: fwd_consume_tile), the lanes taking a box each. Part 0's leader's expect_tx comes
  // before its own warp's boxes; the other loader's boxes may land before it (see above). Plain offsets into the
  // stage (fwd_traits.h asserts the layout): the producer has 24 registers.
  // (Blocks that allow only 16-row boxes keep them compile-time; the others' counts are a shift: box_rows is a
  // power of two.)
  constexpr int kMaxBoxes = Traits::kBlockN / kPagedRows;  // 16-row boxes
  constexpr bool kFixedBoxes = paged_max_box_rows_sm90(Traits::kBlockN, Traits::kHeadDim) == kPagedRows;
  const int box_rows = kFixedBoxes ? kPagedRows : paged_box_rows_sm90(p.page_size, Traits::kBlockN, Traits::kHeadDim);
  const int boxes = kFixedBoxes ? kMaxBoxes : Traits::kBlockN >> (__ffs(box_rows) - 1);
  auto load_paged = [&](const CUtensorMap* desc, typename Traits::Element* stage0, auto cols, auto atom_cols, uint64_t* full,
                        uint64_t* empty, int n_block, uint32_t bytes) {
    constexpr int kCols = decltype(cols)::value, kAtomCols = decltype(atom_cols)::value;
    constexpr int kAtoms = kCols / kAtomCols, kMaxTotal = kMaxBoxes * kAtoms;
    barrier_wait(&empty[state.stage], state.phase ^ 1);
    if (leader && loads_q) barrier_expect_tx(&full[state.stage], bytes);
    __syncwarp();
    typename Traits::Element* stage_base = stage0 + state.stage * (Traits::kBlockN * kCols);
    CUTE_UNROLL
    for (int i = 0; i < (kMaxTotal + 32 * kLoaders - 1) / (32 * kLoaders); ++i) {
      // Interleaved between the loaders (at d 128 each takes one column atom of every row box).
      const int box = part + kLoaders * (int(threadIdx.x % 32) + 32 * i);
      if (box < boxes * kAtoms) {
        const int rows = box / kAtoms, atom = box % kAtoms;
        const int row = n_block * Traits::kBlockN + rows * box_rows;  // logical key row
        const PagedRow at = row < seq.len_k ? paged_row(p, p.page_table + bidb * p.page_table_batch_stride, row)
                                             : PagedRow{0, 0};
        SM90_TMA_LOAD_4D::copy(desc, &full[state.stage], uint64_t(TMA::CacheHintSm90::EVICT_LAST),
                               stage_base + atom * (Traits::kBlockN * kAtomCols) + rows * (box_rows * kAtomCols),
                               atom * kAtomCols, at.row, bidh_k, at.page);
      }
    }
  };
  auto load_k = [&](int n_block) {
    if constexpr (kPaged) {
      load_paged(&args.paged_k, smem.k.data(), Int<Traits::kHeadDim>{}, Int<Traits::kAtomCols>{}, smem.k_full,
                 smem.k_empty, n_block, Traits::kKVBytes);
    } else {
      load_kv(args.tma_k, tKgK, tKsK, smem.k_full, smem.k_empty, n_block, Traits::kKVBytes);
    }
  };
  auto load_v = [&](int n_block) {
    if constexpr (kPaged) {
      load_paged(&args.paged_v, smem.v.data(), Int<Traits::kHeadDimV>{}, Int<Traits::kAtomColsV>{}, smem.v_full,
                 smem.v_empty, n_block, Traits::kVBytes);
    } else {
      load_kv(args.tma_v, tVgV, tVsV, smem.v_full, smem.v_empty, n_block, Traits::kVBytes);
    }
    state.template advance<Traits::kStages>();
  };
  // The loads below wait for this tile's stages and slabs to free up; until then the tile's first bytes
  // move from DRAM into L2 (short causal tiles spend much of their time at tile boundaries: TUNING 55).
  if (leader && loads_q) {
    CUTE_UNROLL
    for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) {
      prefetch(args.tma_q, tQgQ(_, m_block * Traits::kConsumerWarpgroups + w));
    }
    if constexpr (!kPaged) {
      prefetch(args.tma_k, tKgK(_, blocks.n_max - 1));
      prefetch(args.tma_v, tVgV(_, blocks.n_max - 1));
    }
  }
  load_k(blocks.n_max - 1);
  if (loads_q) {
    CUTE_UNROLL
    for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) {  // in the order the warpgroups free their slabs
      barrier_wait(&smem.q_empty[w], q_phase ^ 1);
      if (leader) {
        barrier_expect_tx(&smem.q_full[w], Traits::kQBytes);
        copy(args.tma_q.with(smem.q_full[w], 0, TMA::CacheHintSm90::EVICT_FIRST),
             tQgQ(_, m_block * Traits::kConsumerWarpgroups + w), tQsQ(_, w));
      }
    }
  }
  load_v(blocks.n_max - 1);
  for (int n_block = blocks.n_max - 2; n_block >= blocks.n_min; --n_block) {
    load_k(n_block);
    load_v(n_block);
  }
}

// One consumer warpgroup's share of a tile, its 64 query rows (thread: index among all consumer threads):
// the mainloop, whose softmax state and O the epilogue then stores (FwdEpilogueSm90::store). Warpgroups run on their own but for the
// ping-pong turns: each visits only the key blocks its rows see (causal rows near the diagonal see fewer
// than the tile, rows past the sequence none) and passes the others by. The pipeline states carry over.
// kExtended (kernel_kind.h): a window's left edge, whose blocks mask both edges, softcap and ALiBi; with
// kDropout also dropout.
template <class Traits, bool kExtended, bool kDropout>
__device__ void fwd_consume_tile(const FwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                                 const SeqlenInfo& seq, const BlockRange& tile_blocks, int bidb, int bidh,
                                 int m_block, int thread, PipelineState& k_state, PipelineState& v_state,
                                 uint32_t q_phase) {
  using namespace cute;
  const FwdParams& p = args.params;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kGroups = Traits::kConsumerWarpgroups;
  const int warpgroup = __shfl_sync(0xffffffff, thread / 128, 0);  // warp-uniform: a uniform register
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});    // (kBlockM, D)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});   // (kBlockN, D, stages)
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});  // (D_v, kBlockN, stages)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});    // (kBlockN, D_v, stages)
  // O and the LSE leave through this warpgroup's slab of shared memory (after the mainloop).
  const FwdEpilogueSm90<Traits> epilogue{args, smem, seq, bidb, bidh, m_block, thread, warpgroup};

  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(thread);
  auto thr_o = mma_o.get_thread_slice(thread);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_D) descriptors of this warpgroup's slab
  Tensor tSrK = thr_s.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_D, stages)
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_D_v, MMA_N, stages)
  Tensor acc_o = partition_fragment_C(mma_o, typename Traits::TileO{});  // ((2, 2, D_v / 8), MMA_M, MMA_D_v)
  clear(acc_o);

  Tensor tScS = rowcol_view(thr_s.partition_C(make_identity_tensor(typename Traits::TileS{})));  // (rows, cols) -> tile coords
  constexpr int kRows = decltype(size<0>(tScS))::value;
  const Window window(seq.len_q, seq.len_k, p);
  const Mask mask{window};
  const ScoreMods mods(p, kExtended);
  const Alibi alibi = mods.alibi(p, seq.len_q, seq.len_k, bidb, bidh);
  static_assert(kExtended || !kDropout);
  const Dropout dropout(p, bidb, bidh);
  OnlineSoftmax<kRows> softmax(mods.scale(p));
  const bool release_thread = thread % 128 == 0;  // one arrival per warpgroup on the empty barriers

  // S = Q K[n]^T of the next block is issued before O += P V[n + 1] of the current one, so the softmax of
  // S overlaps the P V product (FA3's intra-warpgroup overlap); O is rescaled once that product is done.
  Tensor acc_s = partition_fragment_C(mma_s, typename Traits::TileS{});  // ((2, 2, kBlockN / 8), MMA_M, MMA_N)
  Tensor rP = make_fragment_like<Element>(acc_s);
  Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));  // ((2, 2, 2), MMA_M, kBlockN / 16)
  Tensor S = rowcol_view(acc_s);
  Tensor O = rowcol_view(acc_o);
  float correction[kRows];
  auto issue_qk = [&] {
    barrier_wait(&smem.k_full[k_state.stage], k_state.phase);
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_s, tSrQ, tSrK(_, _, _, k_state.stage), acc_s);
  };
  auto issue_pv = [&] {
    barrier_wait(&smem.v_full[v_state.stage], v_state.phase);
    wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_o, tOrP, tOrVt(_, _, _, v_state.stage), acc_o);
  };
  // Varlen: a sequence's last key block reaches past its end into rows of the packed tensor that may hold
  // anything (the next sequence's, or rows outside every sequence). Those keys are masked (P = 0), but
  // 0 x NaN is NaN, so their V rows are zeroed before any P V reads them: by the last warpgroup that
  // reads the block, while the others that read it wait at a barrier. Fixed length gets zeros from TMA's
  // out-of-bounds fill; a KV cache's rows past a sequence's keys are zeroed too. Called after the first
  // S = Q K^T, outside the ping-pong turns. The barrier's count changes from tile to tile: safe because varlen
  // and kv-cache grids are one block per tile (fwd_launch.h), so no
  // warpgroup can reach it for the next tile while others wait in this one.
  auto zero_v_tail = [&](int tail) {
    int readers = 0, zeroer = 0;
    CUTE_UNROLL
    for (int w = 0; w < kGroups; ++w) {
      const BlockRange r = warpgroup_block_range<Traits, kExtended>(window, tile_blocks, m_block, w);
      if (r.n_max == tile_blocks.n_max && r.n_max > r.n_min) ++readers, zeroer = w;
    }
    if (warpgroup == zeroer) {
      barrier_wait(&smem.v_full[v_state.stage], v_state.phase);
      zero_rows(sV(_, _, v_state.stage), kBlockN - tail, thread % 128, 128);
    }
    named_barrier_sync(128 * readers, int(Barrier::kVTail));
  };
  auto release = [&](uint64_t* empty, PipelineState& state) {
    if (release_thread) barrier_arrive(&empty[state.stage]);
    state.template advance<Traits::kStages>();
  };
  // Ping-pong: a warpgroup issues its GEMMs only between its turn's start (the previous warpgroup's arrival
  // on its barrier) and its own arrival on the next one's; the chain runs on from tile to tile. Every
  // warpgroup takes (tile blocks + 1) turns per tile, empty ones for blocks it passes by.
  auto turn_begin = [&] {
    if constexpr (Traits::kPingPong) named_barrier_sync(256, int(Barrier::kWarpgroup0) + warpgroup);
  };
  auto turn_end = [&] {
    if constexpr (Traits::kPingPong) named_barrier_arrive(256, int(Barrier::kWarpgroup0) + (warpgroup + 1) % kGroups);
  };
  // Dropout's keep bits for block n, one per score, drawn after the block's GEMMs are issued and before
  // waiting for S: the Philox rounds run while the tensor cores do, off the softmax's critical path. Only
  // where registers allow: three consumer warpgroups or O's 96-128 registers (d >= 192) spill more and lose
  // to the draw after the row sums (TUNING 57); d 64's dropout kernel has two (sm90/tile_size.h).
  constexpr bool kDrawEarly = kDropout && Traits::kConsumerWarpgroups == 2 && Traits::kHeadDim <= 128;
  constexpr int kKeyBlocks = kBlockN / 16, kBitWords = (kKeyBlocks + 3) / 4;
  static_assert(kBlockN % 16 == 0 && decltype(size<0>(S))::value == 2, "one 16-row tile per warp, whole 16-key blocks");
  uint32_t keep_bits[kBitWords];
  auto draw_keep_bits = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
    if constexpr (kDrawEarly) {
      dropout.draw_bits</*kTransposed=*/false, kKeyBlocks>(keep_bits, (m_block * kBlockM + get<0>(tScS(0, 0))) >> 4,
                                                           n_block * kBlockN / 16);
    }
  };
  auto softmax_step = [&](int n_block, auto edges) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kSplitAlibi = kExtended && !kDropout;
    float alibi_shift[kRows] = {};  // the scores are S + alibi_shift[r]
    if constexpr (kExtended) {  // ScoreMods::apply's order, with ALiBi's split form where it pays (Alibi::apply)
      mods.cap(S, p);
      if (alibi.slope != 0.f) {
        if constexpr (kSplitAlibi) alibi.apply(S, tScS, m_block * kBlockM, n_block * kBlockN, alibi_shift);
        else alibi.apply(S, tScS, m_block * kBlockM, n_block * kBlockN);
      }
    }
    mask.apply(edges, S, tScS, m_block * kBlockM, n_block * kBlockN);
    // Lazy above d 128, where O's rescale is 96-128 multiplies a thread and no ping-pong hides it (TUNING 69).
    constexpr bool kLazy = Traits::kHeadDim > 128;
    const bool moved = kSplitAlibi ? softmax.template update_scores<kLazy>(S, correction, alibi_shift)
                                   : softmax.template update_scores<kLazy>(S, correction);
    // Dropout after the row sums: they, and so the LSE, are the undropped softmax's.
    if constexpr (kDrawEarly) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) S(h, c) = Dropout::kept_bit<kKeyBlocks>(keep_bits, c / 4, h, c % 4) ? S(h, c) : 0.f;
      }
    } else if constexpr (kDropout) {
      dropout.apply(S, tScS, m_block * kBlockM, n_block * kBlockN);
    }
    return moved;
  };
  // One iteration over key block n: S = Q K[n]^T and O += P V[n + 1] -> mask -> online softmax -> rescale O
  // (where a row's reference max moved: OnlineSoftmax's kLazy).
  auto step = [&](int n_block, auto edges) CUTLASS_LAMBDA_FUNC_INLINE {
    turn_begin();
    issue_qk();
    issue_pv();
    turn_end();
    draw_keep_bits(n_block);
    warpgroup_wait<1>();  // S is done
    release(smem.k_empty, k_state);
    // Both edges want two bounds per row: P V goes first, so that P's registers are free for them.
    if constexpr (decltype(edges)::value == MaskBoth::value) warpgroup_wait<0>();
    const bool moved = softmax_step(n_block, edges);
    warpgroup_wait<0>();  // P V is done: P's registers and O are free
    release(smem.v_empty, v_state);
    if (__any_sync(0xffffffffu, moved)) softmax.rescale(O, correction);  // warp-uniform: mostly skipped
    convert_fragment_into(acc_s, rP);
  };
  auto release_q = [&] {
    if (release_thread) barrier_arrive(&smem.q_empty[warpgroup]);
  };

  // This warpgroup's four warps (the epilogue's slab hand-offs, and releases outside a wgmma). Barriers are
  // waited by parity, so every warp must see every phase of a barrier it waits on, and a stage may be
  // released only once all four warps have: otherwise the stage's next load can land first, and a late warp
  // takes that phase for the one it missed (reading the wrong block) or waits for a phase that needs its
  // own release. Behind a wgmma (which all four warps issue) that holds by itself; elsewhere it takes this.
  auto warpgroup_sync = [&] { named_barrier_sync(128, int(Barrier::kWarpgroupSync0) + warpgroup); };
  // The blocks this warpgroup skips come first; it waits for each to land, then releases it.
  const BlockRange blocks = warpgroup_block_range<Traits, kExtended>(window, tile_blocks, m_block, warpgroup);
  const int own = blocks.n_max - blocks.n_min, skipped = tile_blocks.n_max - blocks.n_max;
  #pragma unroll 1
  for (int i = 0; i < skipped; ++i) {
    turn_begin();
    turn_end();
    barrier_wait(&smem.k_full[k_state.stage], k_state.phase);
    barrier_wait(&smem.v_full[v_state.stage], v_state.phase);
    warpgroup_sync();
    release(smem.k_empty, k_state);
    release(smem.v_empty, v_state);
  }
  if (own == 0) {
    turn_begin();
    turn_end();
  }
  barrier_wait(&smem.q_full[warpgroup], q_phase);
  if (own > 0) {
    int n_block = blocks.n_max - 1;
    turn_begin();
    issue_qk();
    turn_end();
    draw_keep_bits(n_block);
    warpgroup_wait<0>();
    release(smem.k_empty, k_state);
    if (n_block >= blocks.n_masked_min) {
      softmax_step(n_block, MaskRight{});
    } else if (kExtended && n_block < blocks.n_unmasked_min) {
      if constexpr (kExtended) softmax_step(n_block, MaskBoth{});
    } else {
      softmax_step(n_block, MaskNone{});
    }
    convert_fragment_into(acc_s, rP);  // O is still 0: no rescale
    const int key_tail = blocks.n_max * kBlockN - seq.len_k;  // rows of the sequence's last block past its end
    // Rows past the keys hold anything in a packed varlen tensor or a KV cache (fixed length reads TMA's zeros).
    if (key_tail > 0 && (p.cu_seqlens_k != nullptr || p.seqused_k != nullptr || p.page_table != nullptr)) {
      zero_v_tail(key_tail);  // (only its readers get here)
    }
    for (--n_block; n_block >= blocks.n_masked_min; --n_block) step(n_block, MaskRight{});
    if constexpr (kExtended) {
      for (; n_block >= blocks.n_unmasked_min; --n_block) step(n_block, MaskNone{});
      for (; n_block >= blocks.n_min; --n_block) step(n_block, MaskBoth{});
    } else {
      for (; n_block >= blocks.n_min; --n_block) step(n_block, MaskNone{});
    }
    if (Traits::kSeparateO) release_q();  // the last S = Q K^T is done: the next tile's Q may load
    turn_begin();
    issue_pv();
    turn_end();
    warpgroup_wait<0>();
    release(smem.v_empty, v_state);
  } else if (Traits::kSeparateO) {
    warpgroup_sync();
    release_q();
  }

  epilogue.template store<kDropout>(softmax, acc_o, mma_o, tScS, dropout.scale);
}

}  // namespace sm90

}  // namespace flash_attn2
