// FlashAttention backward on Hopper (sm_90a): TMA loads, wgmma, warp specialization.
//
// Persistent: one block per SM walks the slots of (key block, batch, kv head) (longest causal key blocks
// first), claiming each next one as it nears the end of a tile, so that one key block's epilogue overlaps
// the next one's first loads. Per key block, warpgroup 0's first warp loads K (and, at head dim > 128, V;
// below, its fourth warp loads V) once and then, for
// every query head of the group and every query block that sees these keys, Q[m] (with its rows' D and
// LSE) and dO[m] into their rings; its next warps, one per consumer warpgroup, add that warpgroup's staged
// dQ shares to the fp32 accumulator (the TMA unit's reduce-add). The further warpgroups consume the ring: at head dim
// <= 128 each owns 64 of the keys (bwd_mainloop.h), above it each owns a slice of the head dim
// (bwd_mainloop_wide.h). dQ leaves through dq_accum, scaled and converted by a second kernel. dK
// and dV of the group's heads sum in registers; with few key blocks (GQA, MQA: bwd_head_splits) a
// group's query heads split over consecutive blocks, which add their dK and dV shares into fp32
// accumulators instead, converted by a third kernel.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/bwd_traits.h"

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "common/launch.h"

#include "sm90/bwd_mainloop.h"
#include "sm90/bwd_mainloop_wide.h"
#include "sm90/bwd_work.h"
#include "sm90/dq_turns.h"

namespace flash_attn2 {

namespace sm90 {

// The block's K or V tile, (N, D), to shared memory by TMA on `full`, whose bytes the caller expects.
template <class Traits, class Tma, class Smem>
__device__ void load_key_block(const Tma& tma, Smem&& sX, uint64_t* full, const BwdParams& p,
                               const BwdWork<Traits>& work) {
  using namespace cute;
  Tensor mX = tma.get_tma_tensor(tma_shape<false>(p));  // (rows, D, heads_k, batch) coordinates
  Tensor gX = local_tile(domain_offset(make_coord(int(work.seq.start_k), _0{}), mX(_, _, work.bidh_k, work.batch_index)),
                         typename Traits::TileKV{}, make_coord(work.n_block, _0{}));  // (N, D)
  auto tX = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
  copy(tma.with(*full), get<0>(tX), get<1>(tX));
}

// Producer warp 0, per key block: Q (with its rows' D and LSE) and dO per step into their rings, and K
// (the wide kernels: and V) once the consumers are done with the last key block's, after the first Q and
// dO, which so load while the last key block's epilogue runs. `loaded`: the steps of the block's earlier key
// blocks, which place this one's in the rings; `key_blocks`: those key blocks (kv_empty's phase). Its 24
// registers hold little across a step: the rings' places are counted, not carried.
template <class Traits>
__device__ void bwd_load(const BwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                         const BwdWork<Traits>& work, int loaded, int key_blocks, bool leader) {
  using namespace cute;
  constexpr int kStages = Traits::kStages;
  const BwdParams& p = args.params;
  const SeqlenInfo& seq = work.seq;
  const int batch_index = work.batch_index;
  Tensor mQ = args.tma_q.get_tma_tensor(tma_shape<true>(p));    // (rows, D, heads, batch) coordinates
  Tensor mdO = args.tma_do.get_tma_tensor(tma_shape<true>(p));  // (rows, D, heads, batch)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});     // (M, D, stages)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdO{});  // (M, D, dO stages)
  auto rows_q = [&](auto& m, int head) {  // (M, D, m) blocks of this sequence's rows of one query head
    return local_tile(domain_offset(make_coord(int(seq.start_q), _0{}), m(_, _, head, batch_index)),
                      typename Traits::TileQ{}, make_coord(_, _0{}));
  };
  Tensor mRows = args.tma_rows.get_tma_tensor(make_shape(args.rows_extent));  // (elements): D, then LSE (log2)
  using RowsLayout = Layout<Shape<Int<Traits::kRowsBox>, Int<kStages>>, Stride<_1, Int<Traits::kRowsStride>>>;
  Tensor sLSE = make_tensor(make_smem_ptr(&smem.lse_log2[0][0]), RowsLayout{});  // (M + 4, stages)
  Tensor sdsum = make_tensor(make_smem_ptr(&smem.dsum[0][0]), RowsLayout{});     // (M + 4, stages)
  auto rows = [&](int first) {  // (M + 4): elements [first, first + M + 4) of the workspace
    return local_tile(domain_offset(make_coord(first), mRows), Shape<Int<Traits::kRowsBox>>{}, make_coord(0));
  };
  auto load_step = [&](int step, int head, int m_block) {  // head, m_block: work.head(step), work.m_block(step)
    const auto state = PipelineState::after<kStages>(loaded + step);
    const auto state_do = PipelineState::after<Traits::kStagesdO>(loaded + step);
    auto tQ = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(rows_q(mQ, head)));
    auto tdO = tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(rows_q(mdO, head)));
    // In 32 bits: the launcher checked that D and LSE's elements fit (TMA coordinates are int).
    const int first = int(work.rows(p, head, m_block)) & ~3;
    // (gmem, smem) pairs of one box each: D, and LSE at the same shift past lse_offset
    auto tdsum = tma_partition(args.tma_rows, _0{}, Layout<_1>{}, sdsum(_, state.stage), rows(first));
    auto tLSE = tma_partition(args.tma_rows, _0{}, Layout<_1>{}, sLSE(_, state.stage),
                              rows(int(bwd_lse_log2_offset(p)) + first));
    barrier_wait(&smem.q_empty[state.stage], state.phase ^ 1);
    if (leader) {
      uint64_t* full = &smem.q_full[state.stage];
      barrier_expect_tx(full, Traits::kQBytes + 2 * Traits::kRowsBytes);
      copy(args.tma_q.with(*full), get<0>(tQ)(_, m_block), get<1>(tQ)(_, state.stage));
      copy(args.tma_rows.with(*full), get<0>(tdsum), get<1>(tdsum));
      copy(args.tma_rows.with(*full), get<0>(tLSE), get<1>(tLSE));
    }
    barrier_wait(&smem.do_empty[state_do.stage], state_do.phase ^ 1);
    if (leader) {
      barrier_expect_tx(&smem.do_full[state_do.stage], Traits::kQBytes);
      copy(args.tma_do.with(smem.do_full[state_do.stage]), get<0>(tdO)(_, m_block), get<1>(tdO)(_, state_do.stage));
    }
  };
  load_step(0, work.head(0), work.m_block(0));
  if (key_blocks > 0) barrier_wait(&smem.kv_empty, (key_blocks - 1) & 1);
  if (leader) {  // the wide kernels: K and V on one barrier (V on its own cost them 4%, TUNING 104-106)
    barrier_expect_tx(&smem.k_full, (Traits::kWide ? 2 : 1) * Traits::kKVBytes);
    load_key_block(args.tma_k, make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{}),
                   &smem.k_full, p, work);
    if constexpr (Traits::kWide) {
      load_key_block(args.tma_v, make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{}),
                     &smem.k_full, p, work);
    }
  }
  if constexpr (!Traits::kWide) named_barrier_arrive(64, int(BwdBarrier::kVAfterK));
  // Heads inner, counted rather than divided out of the step (BwdWork::head, m_block): the division's
  // registers spilled.
  int head = work.head(0), m_block = work.m_block(0);
#pragma unroll 1  // unrolled, its 24 registers spilled in the loop
  for (int step = 1; step < work.steps; ++step) {
    if (++head == work.h0 + work.heads) head = work.h0, --m_block;
    load_step(step, head, m_block);
  }
}

// Producer warp 3 of the narrow kernels, per key block: V once the loader has issued K, so that the first
// S^T = K Q^T waits for K and Q only (TUNING 104-106). Its own warp: the loader's 24 registers spill when it
// keeps V's coordinates across its loop.
template <class Traits>
__device__ void bwd_load_v(const BwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                           const BwdWork<Traits>& work) {
  using namespace cute;
  named_barrier_sync(64, int(BwdBarrier::kVAfterK));  // after the loader's kv_empty wait
  if (cute::elect_one_sync()) {
    barrier_expect_tx(&smem.v_full, Traits::kKVBytes);
    load_key_block(args.tma_v, make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{}),
                   &smem.v_full, args.params, work);
  }
}

// Producer warp 1 + w: consumer warpgroup w's dQ shares (kDQParts per step), added to dq_accum by the TMA
// unit once staged. One writer per warpgroup, so that no warpgroup waits for another's share to
// get its staging buffer back (the warpgroups run out of phase: TUNING 36). Deterministic mode: in
// key-block order (dq_turns.h).
// `owed`: the consumers' last share of the previous key block was sent, its buffer not yet handed back (that
// waits for a next share, so that no arrival is left pending when the block ends).
template <class Traits, int w>
__device__ void bwd_write_dq(const BwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                             const BwdWork<Traits>& work, bool& owed) {
  using namespace cute;
  constexpr int kHeadDim = Traits::kHeadDim, kParts = Traits::kDQParts;
  const BwdParams& p = args.params;
  const int first_row = int(work.seq.offset_q(p.seqlen_q, 1, work.bidb));
  const DQTurns<Traits::kBlockM, Traits::kBlockN> turns(p, w, kHeadDim, work.bidb, first_row, work.n_block, work.window);
  const bool issuer = cute::elect_one_sync();  // one lane: a bulk async-group belongs to its thread
  // Where the staged shares go: the TMA reduce-add's (rows, D, heads, 1) coordinates and the (M, part)
  // staging, or (kDQFragments) the first slot of the sequence's query blocks.
  const auto target = [&] {
    if constexpr (Traits::kDQFragments) {
      return bwd_dq_slot(first_row, work.bidb);
    } else {
      return cute::make_tuple(args.tma_dq.get_tma_tensor(make_shape(int(p.total_q), kHeadDim, p.num_heads, 1)),
                              make_tensor(make_smem_ptr(smem.dq[w].data()), typename Traits::SmemLayoutdQ{}));
    }
  }();
  // The staged share of (head, m_block, part) to dq_accum: a TMA reduce-add box of rows, or the warpgroup's
  // fragments of its query block's slot in one bulk reduce.
  auto add_share = [&](int head, int m_block, int part) {
    if constexpr (Traits::kDQFragments) {
      float* gdQ = p.dq_accum + bwd_dq_fragment_offset(p, kHeadDim, head, target + m_block) +
                   w * Traits::kDQRows * Traits::kDQCols;
      bulk_reduce_add(gdQ, smem.dq[w].data(), Traits::kDQBytes);
    } else {
      const auto& [mdQ, sdQ] = target;
      Tensor gdQ = local_tile(domain_offset(make_coord(first_row, _0{}), mdQ(_, _, head, 0)),
                              typename Traits::TiledQ{}, Traits::dq_tile(m_block, w, part));  // (rows, columns)
      auto tdQ = tma_partition(args.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sdQ), group_modes<0, 2>(gdQ));
      copy(args.tma_dq, get<1>(tdQ), get<0>(tdQ));
    }
  };
  if (owed) named_barrier_arrive(kdQThreads, int(BwdBarrier::kdQEmpty0) + w);
#pragma unroll 1  // unrolled, its 24 registers spilled in the loop
  for (int step = 0; step < work.steps; ++step) {
    const int head = work.head(step), m_block = work.m_block(step);
    if (turns.ordered()) {
      if (issuer) turns.wait(head, m_block);
      __syncwarp();  // the named barriers below want the whole warp
    }
    for (int part = 0; part < kParts; ++part) {
      named_barrier_sync(kdQThreads, int(BwdBarrier::kdQFull0) + w);
      if (issuer) {
        add_share(head, m_block, part);
        tma_store_arrive();
        tma_store_wait<0>();  // the share is read: the warpgroup may refill it
      }
      __syncwarp();
      if (step + 1 < work.steps || part + 1 < kParts) named_barrier_arrive(kdQThreads, int(BwdBarrier::kdQEmpty0) + w);
    }
    if (turns.ordered() && issuer) turns.pass(head, m_block);
  }
  owed = true;
}

}  // namespace sm90

// kExtended (kernel_kind.h): softcap and ALiBi, behind runtime flags; kDropout adds dropout in a kernel of its
// own, so that softcap and ALiBi keep their registers (its draws cost the d 128 extended kernel 64 B of
// spills: TUNING 53).
template <class Traits, bool kExtended, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel_sm90(const __grid_constant__ BwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace sm90;
  constexpr int kStages = Traits::kStages, kGroups = Traits::kConsumerWarpgroups;
  static_assert(kGroups <= 3, "the producer warpgroup has a loader warp and one dQ writer warp per consumer warpgroup");
  static_assert(int(BwdBarrier::kdQEmpty0) + kGroups <= 8, "named barrier ids: 8 of the 16 are CUTLASS's");
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const BwdParams& p = args.params;

  if (threadIdx.x == 0) {
    barrier_init(&smem.k_full, 1);
    if constexpr (!Traits::kWide) barrier_init(&smem.v_full, 1);
    barrier_init(&smem.kv_empty, Traits::kConsumerThreads);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&smem.q_full[s], 1);
      barrier_init(&smem.q_empty[s], kGroups);
    }
    CUTE_UNROLL
    for (int s = 0; s < Traits::kStagesdO; ++s) {
      barrier_init(&smem.do_full[s], 1);
      barrier_init(&smem.do_empty[s], kGroups);
    }
    if constexpr (!Traits::kWide) {
      if constexpr (Traits::kDeferDQ) {
        CUTE_UNROLL
        for (int b = 0; b < Traits::kDSBuffers; ++b) {
          barrier_init(&smem.ds_full[b], Traits::kConsumerThreads);
          barrier_init(&smem.ds_empty[b], Traits::kConsumerThreads);
        }
      }
    }
    smem.slots.init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  griddep_wait();  // launched after the preprocess (launch_after): its D, LSE, zeroed accumulators and counter
  griddep_launch_dependents();

  // The slots: key-side tiles (sized from the packed length for varlen, so no max_seqlen_k hint can leave
  // keys out), head_splits consecutive slots per tile, in the order the launcher set (causal: longest
  // first). Each block starts at its own index and claims the next slots from the counter the preprocess
  // zeroed (with one block per slot, as in deterministic mode, every claim lands past the end): the loader
  // claims one after each tile's loads and publishes it (smem.slots) to the other warps, then one past the
  // last. Every role maps slots to tiles itself, from opaque inputs: what the compiler could share between
  // the roles it would compute before they part and hold in the producer's 24 registers through its loops.
  using Slots = TileScheduler<Traits::kBlockN, /*kKeys=*/true>;
  auto slot_tile = [&](int slot) -> SlotTile {  // slot -1: past the last
    const int splits = opaque(args.head_splits);
    if (slot >= int(Slots::num_blocks(p)) * splits) return {-1, WorkTile{}};
    return {slot, args.causal_keys.section_heads > 0  // fixed-length causal (bwd_launch.h)
                      ? args.causal_keys.get(p, slot / splits)
                      : Slots::get(p, slot / splits)};
  };
  auto work_of = [&](const SlotTile& t) {
    const int splits = opaque(args.head_splits);
    return BwdWork<Traits>(p, t.tile, splits, t.slot % splits);
  };
  // Calls f(work) for each of the block's tiles (empty slots skipped; dK / dV rows outside every sequence
  // are the preprocess's); the warps other than the loader receive the tiles after their first.
  auto for_each_tile = [&](auto&& f) {
    PipelineState slot_state;
    for (SlotTile t = slot_tile(opaque(int(blockIdx.x))); t.slot >= 0; t = smem.slots.receive(slot_state)) {
      if (t.tile.valid) f(work_of(t));
    }
  };
  const int warpgroup = __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0);

  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int warp = int(threadIdx.x) / 32;
    if (warp == 0) {
      const bool leader = cute::elect_one_sync();
      int loaded = 0, key_blocks = 0, published = 0;
      for (SlotTile t = slot_tile(opaque(int(blockIdx.x))); t.slot >= 0;) {
        if (t.tile.valid) {
          const BwdWork<Traits> work = work_of(t);
          if (work.steps > 0) {
            bwd_load(args, smem, work, loaded, key_blocks++, leader);
            loaded += work.steps;
          }
        }
        // The next slot, claimed once this tile's last loads are issued (the consumers' last two steps and the
        // epilogue hide the atomic), not as it starts: a block that claimed a slot while starting a long causal
        // tile would hold it while others ran dry at the end.
        const int claimed = threadIdx.x % 32 == 0 ? atomicAdd(args.tile_counter, 1) : 0;
        t = slot_tile(int(gridDim.x) + __shfl_sync(0xffffffffu, claimed, 0));
        PipelineState slot_state = smem.slots.position(published++);
        smem.slots.publish(t, slot_state, leader);
      }
    }
    cute::for_each(cute::make_int_sequence<kGroups>{}, [&](auto w) {
      if (warp == 1 + w) {
        bool owed = false;
        for_each_tile([&](const BwdWork<Traits>& work) {
          if (work.steps > 0) bwd_write_dq<Traits, decltype(w)::value>(args, smem, work, owed);
        });
      }
    });
    if constexpr (!Traits::kWide) {
      static_assert(kGroups == 2 && int(BwdBarrier::kdQEmpty0) + kGroups == int(BwdBarrier::kVAfterK));
      if (warp == 3) {
        for_each_tile([&](const BwdWork<Traits>& work) {
          if (work.steps > 0) bwd_load_v(args, smem, work);
        });
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  BwdConsumerState state;
  for_each_tile([&](const BwdWork<Traits>& work) {
    if constexpr (Traits::kWide) {
      bwd_consume_wide<Traits, kExtended, kDropout>(args, smem, work, warpgroup - 1, state);
    } else {
      bwd_consume<Traits, kExtended, kDropout>(args, smem, work, warpgroup - 1, state);
    }
  });
#endif
}

}  // namespace flash_attn2
