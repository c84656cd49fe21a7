// What every role of a Hopper backward block shares: its work (a key block of one kv head and the steps
// over query heads and query blocks), the named barriers, and the Hopper dQ accumulator's layout.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/bwd_traits.h"

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/block_range.h"
#include "common/bwd_workspace.h"
#include "common/head_dims.h"
#include "common/seqlen.h"
#include "common/tile_scheduler.h"
#include "common/utils.h"
#include "sm90/tma.h"
#include "sm90/wgmma.h"

namespace flash_attn2::sm90 {

// Named barrier ids (the 8 above CUTLASS's reserved ones). kdQFull0 + w / kdQEmpty0 + w pair consumer
// warpgroup w (up to 3) with its dQ writer warp. The wide shape's kdSWritten and kPdSFree share ids with
// the other shape's kStagger and kTail, as the two shapes never meet in one kernel; kEpilogue (every
// consumer thread, after the last step) reuses kTail's.
enum class BwdBarrier : int {
  kdSWritten = 0, kStagger = 0, kTail = 1, kPdSFree = 1, kEpilogue = 1, kdQFull0 = 2, kdQEmpty0 = 5,
  kVAfterK = 7  // the narrow kernels only: their two dQ writers leave it free
};
constexpr int kdQThreads = 128 + 32;  // a consumer warpgroup and the writer warp

// How a consumer warpgroup stages its fp32 dQ share (a 64-row wgmma accumulator) in its buffer `staging`:
// in register order, 16 bytes a thread (Traits::kDQFragments: bwd_dq_fragment_word's layout), else through the
// tiled copy of the accumulator into the buffer's (rows, columns) layout.
template <class Traits, class TiledMma>
__device__ auto dq_stager(const TiledMma& mma_dq, float* staging, int thread) {
  using namespace cute;
  if constexpr (Traits::kDQFragments) {
    static_assert(std::is_same_v<typename TiledMma::Atom::LayoutC_TV, SM90::GMMA::CLayout_64xN<Traits::kDQCols>>,
                  "bwd_dq_fragment_word maps a single 64 x N wgmma accumulator");
    return [staging, thread](const auto& acc) {
      float4* words = reinterpret_cast<float4*>(staging);
      CUTE_UNROLL
      for (int j = 0; j < size(acc) / 4; ++j) {
        words[j * 128 + thread] = make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
      }
    };
  } else {
    auto copy = make_tiled_copy_C(Copy_Atom<SharedStore<uint64_t>, float>{}, mma_dq);
    auto thr = copy.get_thread_slice(thread);
    Tensor dst = thr.partition_D(make_tensor(make_smem_ptr(staging), typename Traits::SmemLayoutdQ{}));  // (CPY, CPY_M, CPY_D)
    return [copy, thr, dst](const auto& acc) mutable { cute::copy(copy, thr.retile_S(acc), dst); };
  }
}

// A consumer warpgroup's side of the dQ hand-off to the writer warp (bwd_write_dq): its share into its staging
// buffer (`stage`, dq_stager's) once the writer has sent the previous one (wait_empty: every share but its
// first), then kdQFull.
template <class Stager, class Acc>
__device__ void stage_dq(Stager& stage, const Acc& acc_dq, int wg, bool wait_empty) {
  if (wait_empty) named_barrier_sync(kdQThreads, int(BwdBarrier::kdQEmpty0) + wg);
  stage(acc_dq);
  cutlass::arch::fence_view_async_shared();  // visible to the TMA unit
  named_barrier_arrive(kdQThreads, int(BwdBarrier::kdQFull0) + wg);
}

// What a consumer warpgroup carries from one tile to the next: its places in the Q and dO rings, the key
// blocks it has had (the phases of k_full, v_full and kv_empty) and its steps so far (the dS buffers' and the
// dQ hand-off's order).
struct BwdConsumerState {
  PipelineState q, dout;
  int key_blocks = 0, steps = 0;
};

// One block's work: a key block of one kv head, and its steps (query block that sees these keys, query
// head of the block's share of the group), taken in the same order by every role. Heads inner: the blocks
// of a kv head then walk its query blocks together, last first, as without GQA, so that what they read
// (Q, dO) and reduce into (dQ) is one query block's rows of the group at a time, a set that stays in L2;
// heads outer let them drift apart over group x seqlen rows, which do not fit.
template <class Traits>
struct BwdWork {
  int bidb, bidh_k, h0, heads, n_block, steps;
  SeqlenInfo seq;
  Window window;
  BwdBlockRange blocks;
  bool varlen;
  int batch_index;  // of the (rows, D, heads, batch) TMA tensors: 0 for varlen

  // With head splits, consecutive slots share a key block, split s of them taking part s of the query-head
  // group.
  __device__ BwdWork(const BwdParams& p, const WorkTile& tile, int head_splits, int split)
      : bidb(tile.bidb), bidh_k(tile.bidh), seq(p, tile.bidb), window(seq.len_q, seq.len_k, p),
        varlen(p.cu_seqlens_q != nullptr) {
    constexpr int kBlockN = Traits::kBlockN;
    heads = p.num_heads / p.num_heads_k / head_splits;  // query heads of this block
    h0 = (bidh_k * head_splits + split) * heads;
    // The slots hand out each head's blocks last first (the forward's longest causal tiles); for keys the
    // first block is seen by the most query rows, so the order is reversed: longest work first.
    n_block = (seq.len_k + kBlockN - 1) / kBlockN - 1 - tile.block;
    blocks = bwd_block_range<Traits::kBlockM, kBlockN>(window, n_block);
    steps = heads * max(0, blocks.m_max - blocks.m_min);
    batch_index = varlen ? 0 : bidb;
  }
  __device__ int head(int step) const { return h0 + step % heads; }
  __device__ int m_block(int step) const { return blocks.m_max - 1 - step / heads; }
  // The first row of a step (query head, query block) in the (heads, total_q) layout of D and LSE.
  __device__ int64_t rows(const BwdParams& p, int head, int m_block) const {
    return int64_t(head) * p.total_q + seq.offset_q(p.seqlen_q, 1, bidb) + m_block * Traits::kBlockM;
  }
  // Where the sequence's dK (kv = 0) or dV (kv = 1) rows of kv head bidh_k start: with head splits in the
  // fp32 accumulators (rows of kHeadDim), else in the output.
  __device__ float* dkv_accum(const BwdParams& p, int kv) const {
    return p.dq_accum + bwd_dkv_accum_offset(p, Traits::kHeadDim, kv, bidh_k, seq.offset_k(p.seqlen_k, 1, bidb));
  }
  template <typename Element>
  __device__ Element* dkv_out(const BwdParams& p, int kv) const {
    return kv == 0 ? static_cast<Element*>(p.dk) + seq.offset_k(p.dk_batch_stride, p.dk_row_stride, bidb) + bidh_k * p.dk_head_stride
                   : static_cast<Element*>(p.dv) + seq.offset_k(p.dv_batch_stride, p.dv_row_stride, bidb) + bidh_k * p.dv_head_stride;
  }
  // A key block no query sees: its dK and dV rows [first_key, first_key + kRows) to zero, straight to global
  // memory (K and V's shared memory may already hold the next key block's); with head splits the preprocess's
  // zeroed accumulators stand.
  template <int kRows, typename Element>
  __device__ void clear_dkv(const BwdParams& p, int first_key, int head_splits, int thread, int threads) const {
    if (head_splits > 1) return;
    clear_rows<kRows>(dkv_out<Element>(p, 0) + int64_t(first_key) * p.dk_row_stride, p.dk_row_stride,
                      seq.len_k - first_key, p.head_dim, thread, threads);
    clear_rows<kRows>(dkv_out<Element>(p, 1) + int64_t(first_key) * p.dv_row_stride, p.dv_row_stride,
                      seq.len_k - first_key, value_head_dim(p), thread, threads);
  }
};

}  // namespace flash_attn2::sm90
