// Deterministic mode on the Hopper backward: the key blocks of a query block add their dQ shares to
// dq_accum in key-block order, so that every element sums in the same order run after run.
//
// A turn counter per (dQ writer warp, query head, query slot), zeroed with the accumulator
// (bwd_dq_turns_offset). Key block n adds its share of query block m once the counter equals
// n - bwd_first_key_block(m), and counts itself once its adds have landed. A block waits only for
// lower-numbered blocks of its (batch, kv head), which the scheduler places at lower block indices: blocks
// start in index order (observed, not promised by CUDA; FA3's semaphore relies on it too), so a waited-for
// block is running or done, and no wait is circular. Head splits are off in this mode (bwd_head_splits), so
// one block holds a query head's whole share of a key block.
#pragma once

#include "flash_attn2/flash_attn2.h"
#include "common/block_range.h"
#include "common/bwd_workspace.h"  // bwd_dq_turns_offset, bwd_dq_slots, bwd_dq_slot

namespace flash_attn2::sm90 {

template <int kBlockM, int kBlockN>
struct DQTurns {
  int* counters;  // this writer's (heads, slots); nullptr out of deterministic mode: any order
  int slots, first_slot, n_block;
  Window window;

  // Writer warp `writer` of the block whose key block is n_block of batch entry bidb.
  __device__ DQTurns(const BwdParams& p, int writer, int kernel_head_dim, int bidb, int64_t packed_q_start,
                     int n_block_, const Window& window_)
      : counters(nullptr), slots(int(bwd_dq_slots(p, kBlockM))),
        first_slot(int(bwd_dq_slot(packed_q_start, bidb, kBlockM))),
        n_block(n_block_), window(window_) {
    if (p.num_splits > 0) {
      counters = reinterpret_cast<int*>(p.dq_accum + bwd_dq_turns_offset(p, kernel_head_dim)) +
                 int64_t(writer) * p.num_heads * slots;
    }
  }

  __device__ bool ordered() const { return counters != nullptr; }
  __device__ int* counter(int head, int m_block) const {
    return counters + int64_t(head) * slots + first_slot + m_block;
  }

  // One lane, before the step's first add.
  __device__ void wait(int head, int m_block) const {
    const int turn = n_block - bwd_first_key_block<kBlockM, kBlockN>(window, m_block, n_block);
    const int* c = counter(head, m_block);
    int seen;
    do {
      asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
    } while (seen - turn < 0);  // >=, not ==: sequences that overlap (bad cu_seqlens) share counters, and a
                                 // counter past this block's turn must not hang it (their rows are undefined)
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the adds (async proxy) after the acquire
  }

  // The lane that issued the step's adds, after the last: wait until they are done in global memory, not
  // only read from shared memory (tma_store_wait's .read), then count this block.
  __device__ void pass(int head, int m_block) const {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter(head, m_block)) : "memory");
  }
};

}  // namespace flash_attn2::sm90
