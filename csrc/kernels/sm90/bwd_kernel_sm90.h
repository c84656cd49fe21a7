// FlashAttention backward on Hopper (sm_90a), head dim <= 128: TMA loads, wgmma, warp specialization.
//
// One block per (128-key block, batch, kv head). Warpgroup 0's first warp loads K and V once and then, for
// every query head of the group and every query block that sees these keys, Q[m] (with its rows' D and
// LSE) and dO[m] into a kStages ring; its second warp adds each step's dQ shares to the fp32 accumulator
// (TMA reduce-add).
// Each further warpgroup owns 64 of the keys:
//   S^T = K Q^T, dP^T = V dO^T -> mask -> P^T = exp2(S^T scale log2e - LSE log2e), dS^T = P^T o (dP^T - D)
//   dV += P^T dO, dK += dS^T Q (P^T and dS^T from registers), dS^T -> shared memory,
//   dQ[:, own half of D] = dS K -> shared memory -> dq_accum (scaled and converted by a second kernel).
// dK and dV of the group's heads sum in registers; dK is scaled at the end. With few key blocks (GQA, MQA:
// bwd_head_splits) a group's query heads split over consecutive blocks, which add their dK and dV
// shares into fp32 accumulators instead, converted by a third kernel.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/bwd_traits_sm90.h"

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_attn2/flash_attn2.h"
#include "common/block_range.h"
#include "common/registry.h"  // bwd_lse_log2_offset
#include "common/seqlen.h"
#include "common/tile_scheduler.h"
#include "common/utils.h"
#include "sm90/fwd_kernel_sm90.h"  // tma_shape
#include "sm90/wgmma.h"

namespace flash_attn2 {

namespace sm90 {

// Named barrier ids (above CUTLASS's reserved ones). kdQFull0 + w / kdQEmpty0 + w pair consumer warpgroup
// w with the dQ writer warp.
enum class BwdBarrier : int { kdSWritten = 0, kTail = 1, kdQFull0 = 2, kdQEmpty0 = 4 };
constexpr int kdQThreads = 128 + 32;  // a consumer warpgroup and the writer warp

// The Hopper dQ accumulator: fp32, (heads, total_q rows, kHeadDim) row-major, zeroed by the preprocess
// (bwd_dq_accum_elems sizes it for the SM80 layout, which is larger).
template <int kHeadDim>
__host__ __device__ inline int64_t dq_accum_offset_sm90(const BwdParams& p, int head, int64_t packed_row) {
  return (int64_t(head) * p.total_q + packed_row) * kHeadDim;
}

}  // namespace sm90

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel_sm90(const __grid_constant__ BwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using namespace sm90;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages, kGroups = Traits::kConsumerWarpgroups;
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const BwdParams& p = args.params;

  // One key block per block: the key-side tile slots (sized from the packed length for varlen, so no
  // max_seqlen_k hint can leave keys out).
  // With head splits, consecutive blocks share a key block, each with its part of the query-head group.
  const QueryTile tile = QueryTileScheduler<kBlockN, /*kKeys=*/true>::get(p, int(blockIdx.x) / args.head_splits);
  if (!tile.valid) return;  // an empty slot; dK / dV rows outside every sequence are the preprocess's
  const int bidh_k = tile.bidh, bidb = tile.bidb;
  const int group = p.num_heads / p.num_heads_k / args.head_splits;  // query heads of this block
  const int h0 = bidh_k * group * args.head_splits + int(blockIdx.x) % args.head_splits * group;
  const SeqlenInfo seq(p, bidb);
  // The slots hand out each head's blocks last first (the forward's longest causal tiles); for keys the
  // first block is seen by the most query rows, so the order is reversed: longest work first.
  const int n_block = (seq.len_k + kBlockN - 1) / kBlockN - 1 - tile.m_block;
  const BwdBlockRange blocks = bwd_block_range<kBlockM, kBlockN>(seq.len_q, seq.len_k, n_block, p.causal);
  const int warpgroup = __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0);

  if (threadIdx.x == 0) {
    barrier_init(&smem.kv_full, 1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&smem.q_full[s], 1);
      barrier_init(&smem.do_full[s], 1);
      barrier_init(&smem.q_empty[s], kGroups);
      barrier_init(&smem.do_empty[s], kGroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const bool varlen = p.cu_seqlens_q != nullptr;
  const int batch_index = varlen ? 0 : bidb;

  // The steps: (query head of the group, query block that sees these keys), in the same order for all roles.
  const int m_count = max(0, blocks.m_max - blocks.m_min), steps = group * m_count;
  auto step_head = [&](int step) { return h0 + step / m_count; };
  auto step_m_block = [&](int step) { return blocks.m_max - 1 - step % m_count; };
  auto step_rows = [&](int step) {  // the step's first row in the (heads, total_q) layout of D and LSE
    return int64_t(step_head(step)) * p.total_q + seq.offset_q(p.seqlen_q, 1, bidb) + step_m_block(step) * kBlockM;
  };
  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int warp = int(threadIdx.x) / 32;
    if (warp == 1) {  // dQ writer: each step's two shares, added to dq_accum once staged
      Tensor mdQ = args.tma_dq.get_tma_tensor(make_shape(int(p.total_q), kHeadDim, p.num_heads, 1));  // (rows, D, heads, 1)
      const int first_row = int(seq.offset_q(p.seqlen_q, 1, bidb));
      const bool issuer = cute::elect_one_sync();  // one lane: a bulk async-group belongs to its thread
      for (int step = 0; step < steps; ++step) {
        const int head = step_head(step), m_block = step_m_block(step);
        CUTE_UNROLL
        for (int w = 0; w < kGroups; ++w) {
          Tensor sdQ = make_tensor(make_smem_ptr(smem.dq[w].data()), typename Traits::SmemLayoutdQ{});  // (M, D / 2)
          Tensor gdQ = local_tile(domain_offset(make_coord(first_row, _0{}), mdQ(_, _, head, 0)),
                                  typename Traits::TiledQ{}, make_coord(m_block, w));  // (M, D / 2)
          auto tdQ = tma_partition(args.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sdQ), group_modes<0, 2>(gdQ));
          named_barrier_sync(kdQThreads, int(BwdBarrier::kdQFull0) + w);
          if (issuer) {
            copy(args.tma_dq, get<1>(tdQ), get<0>(tdQ));
            tma_store_arrive();
          }
        }
        if (issuer) tma_store_wait<0>();  // the shares are read: the warpgroups may refill them
        __syncwarp();
        if (step + 1 < steps) {
          CUTE_UNROLL
          for (int w = 0; w < kGroups; ++w) named_barrier_arrive(kdQThreads, int(BwdBarrier::kdQEmpty0) + w);
        }
      }
      return;
    }
    if (warp != 0) return;
    const bool leader = cute::elect_one_sync();
    Tensor mQ = args.tma_q.get_tma_tensor(tma_shape<true>(p));    // (rows, D, heads, batch) coordinates
    Tensor mdO = args.tma_do.get_tma_tensor(tma_shape<true>(p));  // (rows, D, heads, batch)
    Tensor mK = args.tma_k.get_tma_tensor(tma_shape<false>(p));   // (rows, D, heads_k, batch)
    Tensor mV = args.tma_v.get_tma_tensor(tma_shape<false>(p));   // (rows, D, heads_k, batch)
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});     // (M, D, stages)
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});  // (M, D, stages)
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});      // (N, D)
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});     // (N, D)
    auto rows_q = [&](auto& m, int head) {  // (M, D, m) blocks of this sequence's rows of one query head
      return local_tile(domain_offset(make_coord(int(seq.start_q), _0{}), m(_, _, head, batch_index)),
                        typename Traits::TileQ{}, make_coord(_, _0{}));
    };
    PipelineState state;
    if (steps == 0) return;  // no query sees these keys: the consumers store zeros
    Tensor gK = local_tile(domain_offset(make_coord(int(seq.start_k), _0{}), mK(_, _, bidh_k, batch_index)),
                           typename Traits::TileKV{}, make_coord(n_block, _0{}));  // (N, D)
    Tensor gV = local_tile(domain_offset(make_coord(int(seq.start_k), _0{}), mV(_, _, bidh_k, batch_index)),
                           typename Traits::TileKV{}, make_coord(n_block, _0{}));  // (N, D)
    if (leader) {
      auto tK = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto tV = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      barrier_expect_tx(&smem.kv_full, 2 * Traits::kKVBytes);
      copy(args.tma_k.with(smem.kv_full), get<0>(tK), get<1>(tK));
      copy(args.tma_v.with(smem.kv_full), get<0>(tV), get<1>(tV));
    }
    Tensor mRows = args.tma_rows.get_tma_tensor(make_shape(args.rows_extent));  // (elements): D, then LSE (log2)
    using RowsLayout = Layout<Shape<Int<Traits::kRowsBox>, Int<kStages>>, Stride<_1, Int<Traits::kRowsStride>>>;
    Tensor sLSE = make_tensor(make_smem_ptr(&smem.lse_log2[0][0]), RowsLayout{});  // (M + 4, stages)
    Tensor sdsum = make_tensor(make_smem_ptr(&smem.dsum[0][0]), RowsLayout{});     // (M + 4, stages)
    auto rows = [&](int64_t first) {  // (M + 4): elements [first, first + M + 4) of the workspace
      return local_tile(domain_offset(make_coord(int(first)), mRows), Shape<Int<Traits::kRowsBox>>{}, make_coord(0));
    };
    const int64_t lse_offset = bwd_lse_log2_offset(p);
    for (int step = 0; step < steps; ++step) {
      const int head = step_head(step), m_block = step_m_block(step);
      auto tQ = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(rows_q(mQ, head)));
      auto tdO = tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(rows_q(mdO, head)));
      const int64_t first = step_rows(step) & ~int64_t(3);
      // (gmem, smem) pairs of one box each: D, and LSE at the same shift past lse_offset
      auto tdsum = tma_partition(args.tma_rows, _0{}, Layout<_1>{}, sdsum(_, state.stage), rows(first));
      auto tLSE = tma_partition(args.tma_rows, _0{}, Layout<_1>{}, sLSE(_, state.stage), rows(lse_offset + first));
      barrier_wait(&smem.q_empty[state.stage], state.phase ^ 1);
      if (leader) {
        uint64_t* full = &smem.q_full[state.stage];
        barrier_expect_tx(full, Traits::kQBytes + 2 * Traits::kRowsBytes);
        copy(args.tma_q.with(*full), get<0>(tQ)(_, m_block), get<1>(tQ)(_, state.stage));
        copy(args.tma_rows.with(*full), get<0>(tdsum), get<1>(tdsum));
        copy(args.tma_rows.with(*full), get<0>(tLSE), get<1>(tLSE));
      }
      barrier_wait(&smem.do_empty[state.stage], state.phase ^ 1);
      if (leader) {
        barrier_expect_tx(&smem.do_full[state.stage], Traits::kQBytes);
        copy(args.tma_do.with(smem.do_full[state.stage]), get<0>(tdO)(_, m_block), get<1>(tdO)(_, state.stage));
      }
      state.template advance<kStages>();
    }
    return;
  }

  // Consumers: warpgroup w (1-based here) owns keys [64 (w - 1), 64 w) of each key block.
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = warpgroup - 1;
  const int thread = int(threadIdx.x) % 128;
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});      // (M, D, stages)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});  // (M, D, stages)
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});    // (D, M, stages)
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});  // (D, M, stages)
  Tensor sKw = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));  // (64, D): own keys
  Tensor sVw = local_tile(make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));  // (64, D)
  Tensor sKt = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{}),
                          Shape<Int<Traits::kHalfD>, Int<kBlockN>>{}, make_coord(wg, _0{}));  // (D / 2, N): own dQ columns
  Tensor sdQ = make_tensor(make_smem_ptr(smem.dq[wg].data()), typename Traits::SmemLayoutdQ{});  // (M, D / 2)

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dkv = mma_dkv.get_thread_slice(thread);
  auto thr_dq = mma_dq.get_thread_slice(thread);
  Tensor tSrK = thr_sdp.partition_fragment_A(sKw);    // (MMA, MMA_N, MMA_D) descriptors
  Tensor tdPrV = thr_sdp.partition_fragment_A(sVw);   // (MMA, MMA_N, MMA_D)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, MMA_M, MMA_D, stages)
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);  // (MMA, MMA_M, MMA_D, stages)
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_M, stages)
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);    // (MMA, MMA_D, MMA_M, stages)
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);     // (MMA, MMA_D / 2, MMA_N)
  Tensor acc_dk = partition_fragment_C(mma_dkv, typename Traits::TileKVWarpgroup{});  // (MMA, 1, MMA_D)
  Tensor acc_dv = partition_fragment_C(mma_dkv, typename Traits::TileKVWarpgroup{});  // (MMA, 1, MMA_D)

  Tensor tScS = rowcol_view(thr_sdp.partition_C(make_identity_tensor(typename Traits::TileSt{})));  // (keys, queries) -> coords
  constexpr int kCols = decltype(size<1>(tScS))::value;
  const float scale_log2 = p.softmax_scale * float(M_LOG2E);
  const int diag = seq.len_k - seq.len_q;
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SharedStore<uint32_t>, Element>{}, mma_sdp);
  auto smem_thr_ds = smem_copy_ds.get_thread_slice(thread);
  auto smem_copy_dq = make_tiled_copy_C(Copy_Atom<SharedStore<uint64_t>, float>{}, mma_dq);
  auto smem_thr_dq = smem_copy_dq.get_thread_slice(thread);
  Tensor tdQsdQ = smem_thr_dq.partition_D(sdQ);  // (CPY, CPY_M, CPY_D)
  const bool release_thread = thread == 0;

  PipelineState state;
  const int key0 = n_block * kBlockN + wg * 64;  // this warpgroup's first key
  clear(acc_dk);
  clear(acc_dv);
  if (steps > 0) {
    barrier_wait(&smem.kv_full, 0);
    // Varlen: K rows past the sequence (the next one's, or rows outside every sequence) to zero, since
    // dQ = dS K would carry 0 x NaN; each warpgroup zeroes its own slab, the first dQ waits on both.
    if (varlen && key0 + 64 > seq.len_k) zero_rows(sKw, max(0, seq.len_k - key0), thread, 128);
  }
  for (int step = 0; step < steps; ++step) {
    const int m_block = step_m_block(step), row0 = m_block * kBlockM, stage = state.stage;
    const int rows_shift = int(step_rows(step) & 3);  // where the block's rows start in the staged D and LSE
    // S^T = K Q^T and dP^T = V dO^T, the softmax of S^T while dP^T runs.
    barrier_wait(&smem.q_full[stage], state.phase);
    Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileSt{});   // ((2, 2, M / 8), 1, 1)
    Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileSt{});  // ((2, 2, M / 8), 1, 1)
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    barrier_wait(&smem.do_full[stage], state.phase);
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    Tensor St = rowcol_view(acc_s);    // (keys, queries)
    Tensor dPt = rowcol_view(acc_dp);  // (keys, queries)
    // P^T = exp2(S^T scale log2e - LSE log2e) while dP^T runs, then dS^T = P^T o (dP^T - D). Where a pair
    // may be hidden (masked steps) both are set, not multiplied, to 0: S^T and dP^T there may be anything
    // (rows past the sequence: another sequence's or NaN; keys past it: LSE is not theirs).
    auto softmax = [&](auto masked) {
      auto keep = [&](int r, int c) {
        if constexpr (decltype(masked)::value) {
          const int key = key0 + get<0>(tScS(r, 0)), row = row0 + get<1>(tScS(r, c));
          return row < seq.len_q && key < seq.len_k && !(p.causal && key > row + diag);
        } else {
          return true;
        }
      };
      warpgroup_wait<1>();
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float lse_log2 = smem.lse_log2[stage][rows_shift + get<1>(tScS(0, c))];  // +inf for a row that saw no key: P = 0
        CUTE_UNROLL
        for (int r = 0; r < size<0>(St); ++r) {
          const float pt = fast_exp2(St(r, c) * scale_log2 - lse_log2);
          St(r, c) = keep(r, c) ? pt : 0.f;
        }
      }
      warpgroup_wait<0>();
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float dsum = smem.dsum[stage][rows_shift + get<1>(tScS(0, c))];
        CUTE_UNROLL
        for (int r = 0; r < size<0>(St); ++r) {
          const float ds = St(r, c) * (dPt(r, c) - dsum);
          dPt(r, c) = keep(r, c) ? ds : 0.f;
        }
      }
    };
    if (m_block < blocks.m_unmasked_min || row0 + kBlockM > seq.len_q) {
      softmax(std::true_type{});
    } else {
      softmax(std::false_type{});
    }
    // Varlen: Q and dO rows past the sequence to zero before dK += dS^T Q and dV += P^T dO read them (their
    // P^T and dS^T columns are 0), once both warpgroups' S^T and dP^T are done with them.
    if (varlen && row0 + kBlockM > seq.len_q) {
      const int valid = max(0, seq.len_q - row0);
      named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kTail));
      zero_rows(sQ(_, _, stage), valid, wg * 128 + thread, Traits::kConsumerThreads);
      zero_rows(sdO(_, _, stage), valid, wg * 128 + thread, Traits::kConsumerThreads);
      named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kTail));
    }

    // dV += P^T dO from registers while dS^T goes to shared memory for dQ = dS K; then dK += dS^T Q, whose
    // GEMM must come after the store (a wgmma's register operands are not to be touched until waited for).
    // This step's dS^T buffer was last read by dQ two steps ago, which both warpgroups had waited for
    // before last step's kdSWritten.
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));     // ((2, 2, 2), 1, M / 16)
    Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));  // ((2, 2, 2), 1, M / 16)
    wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds[step & 1].data()), typename Traits::SmemLayoutdS{});  // (M, N)
    Tensor sdStw = local_tile(make_tensor(make_smem_ptr(smem.ds[step & 1].data()), typename Traits::SmemLayoutdSt{}),
                              Shape<_64, Int<kBlockM>>{}, make_coord(wg, _0{}));  // (64, M): own keys' rows of dS^T
    cute::copy(smem_copy_ds, smem_thr_ds.retile_S(rdS), smem_thr_ds.partition_D(sdStw));
    cutlass::arch::fence_view_async_shared();  // visible to the wgmma (async proxy)
    wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);
    named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kdSWritten));
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_N)
    Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::TiledQ{});  // ((2, 2, D / 16), 1, 1)
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS, tdQrK, acc_dq);
    warpgroup_wait<1>();  // dV and dK are done: Q[m] and dO[m] may go
    if (release_thread) {
      barrier_arrive(&smem.q_empty[stage]);
      barrier_arrive(&smem.do_empty[stage]);
    }
    state.template advance<kStages>();
    warpgroup_wait<0>();

    // This step's dQ share to shared memory once the writer warp has sent the last one.
    if (step > 0) named_barrier_sync(kdQThreads, int(BwdBarrier::kdQEmpty0) + wg);
    cute::copy(smem_copy_dq, smem_thr_dq.retile_S(acc_dq), tdQsdQ);
    cutlass::arch::fence_view_async_shared();  // visible to the TMA unit
    named_barrier_arrive(kdQThreads, int(BwdBarrier::kdQFull0) + wg);
  }

  // dK and dV leave from registers, two elements at a time, keys past the sequence clipped: with head
  // splits this block's fp32 share (scaled and converted afterwards), else dK = scale dS^T Q and dV.
  Tensor dK = rowcol_view(acc_dk);  // (keys, D)
  Tensor dV = rowcol_view(acc_dv);  // (keys, D)
  Tensor tdKcdK = rowcol_view(thr_dkv.partition_C(make_identity_tensor(typename Traits::TileKVWarpgroup{})));  // (keys, D) -> coords
  auto for_each_pair = [&](auto&& f) {  // f(key, column, r, c) for the pairs (r, c), (r, c + 1)
    CUTE_UNROLL
    for (int r = 0; r < size<0>(dK); ++r) {
      const int key = key0 + get<0>(tdKcdK(r, 0));
      if (key >= seq.len_k) continue;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dK); c += 2) f(key, get<1>(tdKcdK(r, c)), r, c);
    }
  };
  if (args.head_splits > 1) {
    const int64_t first_key = seq.offset_k(p.seqlen_k, 1, bidb);
    float* dk_acc = p.dq_accum + bwd_dkv_accum_offset(p, kHeadDim, 0, bidh_k, first_key);
    float* dv_acc = p.dq_accum + bwd_dkv_accum_offset(p, kHeadDim, 1, bidh_k, first_key);
    for_each_pair([&](int key, int col, int r, int c) {
      const int64_t at = int64_t(key) * kHeadDim + col;
      red_add_global_x2(dk_acc + at, dK(r, c), dK(r, c + 1));
      red_add_global_x2(dv_acc + at, dV(r, c), dV(r, c + 1));
    });
    return;
  }
  Element* dk = static_cast<Element*>(p.dk) + seq.offset_k(p.dk_batch_stride, p.dk_row_stride, bidb) + bidh_k * p.dk_head_stride;
  Element* dv = static_cast<Element*>(p.dv) + seq.offset_k(p.dv_batch_stride, p.dv_row_stride, bidb) + bidh_k * p.dv_head_stride;
  for_each_pair([&](int key, int col, int r, int c) {
    if (col >= p.head_dim) return;
    using Pair = cutlass::Array<Element, 2>;
    Pair k2, v2;
    k2[0] = Element(dK(r, c) * p.softmax_scale), k2[1] = Element(dK(r, c + 1) * p.softmax_scale);
    v2[0] = Element(dV(r, c)), v2[1] = Element(dV(r, c + 1));
    *reinterpret_cast<Pair*>(dk + int64_t(key) * p.dk_row_stride + col) = k2;
    *reinterpret_cast<Pair*>(dv + int64_t(key) * p.dv_row_stride + col) = v2;
  });
#endif
}

}  // namespace flash_attn2
