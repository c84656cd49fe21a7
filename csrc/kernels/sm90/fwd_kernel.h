// FlashAttention forward on Hopper (sm_90a): TMA loads, warpgroup MMA (wgmma), warp specialization.
//
// Warpgroup 0 is the producer: one thread issues TMA copies of each consumer's Q slab and of K[n], V[n]
// into a kStages-deep ring of shared-memory buffers guarded by mbarriers. Each further warpgroup is a
// consumer owning 64 query rows: S = Q K^T (both operands in shared memory) -> mask -> online softmax ->
// O += P V (P from registers, V read transposed through the wgmma descriptor), the next block's S issued
// before this block's P V, the warpgroups taking turns at the tensor cores. A consumer visits only the key
// blocks its rows see, and frees its Q slab and stores its O rows (TMA for fixed length) on its own. A
// persistent grid walks the tiles (fixed length), the producer handing each to the consumers
// (sm90/scheduler.h: causal tiles go to blocks as they free up). Block ranges, masks, softmax,
// sequence lengths and the slot-to-tile maps are the SM80 kernel's. It also serves KV-cache calls with tall query
// tiles (dispatch.cpp): a contiguous cache's rows by TMA as any K / V, a paged one's in boxes of 16 rows up to
// a key block (the page size's divisor) through the page table.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/fwd_traits.h"

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_attn2/flash_attn2.h"
#include "common/block_range.h"
#include "common/seqlen.h"
#include "common/tile_scheduler.h"
#include "sm90/fwd_mainloop.h"
#include "sm90/scheduler.h"
#include "sm90/wgmma.h"

namespace flash_attn2 {

// kDropout: the extended kernel with dropout, a kernel of its own so that softcap, ALiBi and windows keep
// their registers (its draws cost the d 64 / d 256 extended kernels 56 / 172 B of spills: TUNING 53).
// kPaged: the plain kernel for a paged cache, whose producer warps 0 and 1 each issue half of a block's TMA boxes
// (a box is a request of its own: one warp issuing a block's 16 K and 16 V boxes at pages of 16 left the consumers
// waiting for K; TUNING 178-179). The extended kinds keep one producer warp for paged caches too.
template <class Traits, bool kExtended, bool kDropout = false, bool kPaged = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel_sm90(const __grid_constant__ FwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace sm90;
  using Scheduler = TileScheduler<Traits::kBlockM>;
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const FwdParams& p = args.params;
  const int warpgroup = __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    CUTE_UNROLL
    for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) {
      barrier_init(&smem.q_full[w], 1);
      barrier_init(&smem.q_empty[w], 1);
    }
    CUTE_UNROLL
    for (int s = 0; s < Traits::kStages; ++s) {
      barrier_init(&smem.k_full[s], 1);
      barrier_init(&smem.v_full[s], 1);
      barrier_init(&smem.k_empty[s], Traits::kConsumerWarpgroups);
      barrier_init(&smem.v_empty[s], Traits::kConsumerWarpgroups);
    }
    smem.slots.init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // The producer walks the slots (SlotWalk) and hands each but the first (which the consumers know) to the
  // consumers through smem.slots with its tile, then one past the last. Causal slots are sorted longest first.
  const int num_slots = int(Scheduler::num_blocks(p));
  const SlotWalk first_walk{num_slots, args.causal_order ? args.causal_tiles.section_slots() : num_slots,
                            int(gridDim.x), int(blockIdx.x), args.tile_counter};
  auto slot_tile = [&](int slot) -> SlotTile {
    if (slot >= num_slots) return {slot, WorkTile{}};
    return {slot, args.causal_order ? args.causal_tiles.get(p, slot) : Scheduler::get(p, slot)};
  };
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    static_assert(!kPaged || !kExtended, "the paged kernel is the plain kind's");
    constexpr int kLoaders = kPaged ? 2 : 1;
    // The loader's index from a shuffle, so that the loop below branches on a uniform register: as threadIdx.x / 32,
    // the paged kernel's producer (24 registers) spilled its slot walk and pipeline states (~250 B).
    int warp = 0;
    if constexpr (kPaged) {
      warp = __shfl_sync(0xffffffff, int(threadIdx.x) / 32, 0);
      if (warp >= kLoaders) return;
    } else {
      if (threadIdx.x / 32 != 0) return;
    }
    const bool leader = cute::elect_one_sync();
    if (leader && warp == 0) {
      cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
      if (p.page_table != nullptr) {
        cute::prefetch_tma_descriptor(&args.paged_k);
        cute::prefetch_tma_descriptor(&args.paged_v);
      }
    }
    SlotWalk walk = first_walk;
    // Both loaders walk the same slots: the static walk (a paged call's grid is one block per tile, fwd_launch.h,
    // and has no tile counter; two warps claiming from one would each take different tiles).
    if constexpr (kPaged) walk.counter = nullptr;
    PipelineState state, slot_state;
    uint32_t q_phase = 0;
    for (SlotTile next = slot_tile(walk.first()); next.slot < num_slots;) {
      const int claimed = walk.claim();
      const WorkTile& tile = next.tile;
      if (tile.valid) {
        const SeqlenInfo seq(p, tile.bidb, SeqlenInfo::WithCache{});
        const BlockRange blocks =
            fwd_block_range<Traits::kBlockM, Traits::kBlockN, kExtended>(Window(seq.len_q, seq.len_k, p), tile.block);
        if (blocks.n_max > blocks.n_min) {
          if constexpr (kPaged) {
            fwd_produce_tile<Traits, kExtended, true, kLoaders>(args, smem, seq, blocks, tile.bidb, tile.bidh,
                                                                tile.block, state, q_phase, leader, warp);
          } else if (p.page_table != nullptr) {
            fwd_produce_tile<Traits, kExtended, true>(args, smem, seq, blocks, tile.bidb, tile.bidh, tile.block, state,
                                                      q_phase, leader);
          } else {
            fwd_produce_tile<Traits, kExtended, false>(args, smem, seq, blocks, tile.bidb, tile.bidh, tile.block, state,
                                                       q_phase, leader);
          }
          q_phase ^= 1;
        }
      }
      next = slot_tile(walk.next(claimed));
      if (warp == 0) smem.slots.publish(next, slot_state, leader);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread = int(threadIdx.x) - 128;
    if (kDropout && blockIdx.x == 0 && thread == 0) Dropout::record(p);
    PipelineState k_state, v_state;
    uint32_t q_phase = 0;
    if (Traits::kPingPong && warpgroup == Traits::kConsumerWarpgroups) {  // the last one: warpgroup 0 goes first
      named_barrier_arrive(256, int(Barrier::kWarpgroup0));
    }
    PipelineState slot_state;
    SlotWalk walk = first_walk;
    for (SlotTile next = slot_tile(walk.first()); next.slot < num_slots; next = smem.slots.receive(slot_state)) {
      const WorkTile& tile = next.tile;
      if (p.cu_seqlens_q != nullptr && tile.owns_slot) {  // rows outside every sequence, shared by the head's slots
        const UncoveredRows uncovered(p.cu_seqlens_q, p.batch, p.total_q);
        uncovered.zero_fill(static_cast<typename Traits::Element*>(p.out) + tile.bidh * p.o_head_stride,
                            p.o_row_stride, Traits::head_dim_v(p), p.lse + tile.bidh * p.lse_head_stride,
                            int64_t(tile.rank) * Traits::kConsumerThreads + thread,
                            int64_t(tile.ranks) * Traits::kConsumerThreads);
      }
      if (!tile.valid) continue;
      const SeqlenInfo seq(p, tile.bidb, SeqlenInfo::WithCache{});
      const BlockRange blocks =
          fwd_block_range<Traits::kBlockM, Traits::kBlockN, kExtended>(Window(seq.len_q, seq.len_k, p), tile.block);
      if (blocks.n_max <= blocks.n_min) {
        FwdEpilogueSm90<Traits>::store_zero(p, seq, tile.bidb, tile.bidh, tile.block, thread);
        continue;
      }
      fwd_consume_tile<Traits, kExtended, kDropout>(args, smem, seq, blocks, tile.bidb, tile.bidh, tile.block, thread, k_state, v_state, q_phase);
      q_phase ^= 1;
    }
    if (thread % 128 == 0) cute::tma_store_wait<0>();  // shared memory must outlive the last O store's reads
  }
#endif
}

}  // namespace flash_attn2
