// FlashAttention backward on Hopper (sm_90a), head dim <= 128: TMA loads, wgmma, warp specialization.
// Draft: compiled, not yet run on a GPU.
//
// One block per (128-key block, batch, kv head). Warpgroup 0's first warp loads K and V once and then, for
// every query head of the group and every query block that sees these keys, Q[m] and dO[m] into a
// two-stage ring. Each further warpgroup owns 64 of the keys:
//   S^T = K Q^T, dP^T = V dO^T -> mask -> P^T = exp2(S^T scale log2e - LSE log2e), dS^T = P^T o (dP^T - D)
//   dV += P^T dO, dK += dS^T Q (P^T and dS^T from registers), dS^T -> shared memory,
//   dQ[:, own half of D] = dS K (fp32 reductions into dq_accum, scaled and converted by a second kernel).
// dK and dV of the group's heads sum in registers; dK is scaled at the end.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/bwd_traits_sm90.h"

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_attn2/flash_attn2.h"
#include "common/block_range.h"
#include "common/seqlen.h"
#include "common/utils.h"
#include "sm90/fwd_kernel_sm90.h"  // tma_shape
#include "sm90/wgmma.h"

namespace flash_attn2 {

namespace sm90 {

// Named barrier ids (above CUTLASS's reserved ones and the forward's).
enum class BwdBarrier : int { kdSWritten = 6, kdSRead = 7 };

// The Hopper dQ accumulator: fp32, (heads, total_q rows, kHeadDim) row-major, zeroed by the preprocess
// (bwd_dq_accum_elems sizes it for the SM80 layout, which is larger).
template <int kHeadDim>
__host__ __device__ inline int64_t dq_accum_offset_sm90(const BwdParams& p, int head, int64_t packed_row) {
  return (int64_t(head) * p.total_q + packed_row) * kHeadDim;
}

// Rows [first, rows) of a (rows, D) shared-memory tile to zero, 16 bytes per store (the swizzle keeps
// each 8-element chunk contiguous), by `threads` threads; then fenced for the wgmma (async proxy).
template <class Tensor>
__device__ void zero_rows(Tensor&& t, int first, int thread, int threads) {
  constexpr int kRows = decltype(cute::size<0>(t))::value, kChunks = decltype(cute::size<1>(t))::value / 8;
  for (int i = thread; i < (kRows - first) * kChunks; i += threads) {
    *reinterpret_cast<uint4*>(cute::raw_pointer_cast(&t(first + i / kChunks, i % kChunks * 8))) = uint4{0, 0, 0, 0};
  }
  cutlass::arch::fence_view_async_shared();
}

__device__ __forceinline__ void red_add_global_x2(float* ptr, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(a), "f"(b) : "memory");
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
  const QueryTile tile = QueryTileScheduler<kBlockN, /*kKeys=*/true>::get(p, int(blockIdx.x));
  if (!tile.valid) return;  // an empty slot; dK / dV rows outside every sequence are the preprocess's
  const int n_block = tile.m_block, bidh_k = tile.bidh, bidb = tile.bidb;
  const int group = p.num_heads / p.num_heads_k;
  const int h0 = bidh_k * group;
  const SeqlenInfo seq(p, bidb);
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

  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x / 32 != 0) return;
    const bool leader = cute::elect_one_sync();
    Tensor mQ = args.tma_q.get_tma_tensor(tma_shape<true>(p));    // (rows, D, heads, batch) coordinates
    Tensor mdO = args.tma_do.get_tma_tensor(tma_shape<true>(p));  // (rows, D, heads, batch)
    Tensor mK = args.tma_k.get_tma_tensor(tma_shape<false>(p));   // (rows, D, heads_k, batch)
    Tensor mV = args.tma_v.get_tma_tensor(tma_shape<false>(p));   // (rows, D, heads_k, batch)
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});     // (M, D, stages)
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});  // (M, D, stages)
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});     // (N, D)
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});     // (N, D)
    auto rows_q = [&](auto& m, int head) {  // (M, D, m) blocks of this sequence's rows of one query head
      return local_tile(domain_offset(make_coord(int(seq.start_q), _0{}), m(_, _, head, batch_index)),
                        typename Traits::TileQ{}, make_coord(_, _0{}));
    };
    PipelineState state;
    if (blocks.m_max <= blocks.m_min) return;  // no query sees these keys: the consumers store zeros
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
    for (int dh = 0; dh < group; ++dh) {
      Tensor gQ = rows_q(mQ, h0 + dh);    // (M, D, m)
      Tensor gdO = rows_q(mdO, h0 + dh);  // (M, D, m)
      auto tQ = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto tdO = tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      const int head = h0 + dh;
      const float* lse = p.lse + seq.offset_q(p.lse_batch_stride, 1, bidb) + int64_t(head) * p.lse_head_stride;
      const float* dsum = p.softmax_d + int64_t(head) * p.total_q + seq.offset_q(p.seqlen_q, 1, bidb);
      for (int m_block = blocks.m_max - 1; m_block >= blocks.m_min; --m_block) {
        barrier_wait(&smem.q_empty[state.stage], state.phase ^ 1);
        // The block's LSE (as log2; +inf for rows past the sequence or that saw no key, so P = 0 there) and
        // D, staged with Q: kept in registers through the GEMMs they cost d 128 its spills.
        for (int i = int(threadIdx.x) % 32; i < kBlockM; i += 32) {
          const int row = m_block * kBlockM + i;
          const float l = row < seq.len_q ? lse[row] : INFINITY;
          smem.lse_log2[state.stage][i] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
          smem.dsum[state.stage][i] = row < seq.len_q ? dsum[row] : 0.f;
        }
        __syncwarp();  // every lane's values before the leader's arrive (release) on q_full
        if (leader) {
          barrier_expect_tx(&smem.q_full[state.stage], Traits::kQBytes);
          copy(args.tma_q.with(smem.q_full[state.stage]), get<0>(tQ)(_, m_block), get<1>(tQ)(_, state.stage));
        }
        barrier_wait(&smem.do_empty[state.stage], state.phase ^ 1);
        if (leader) {
          barrier_expect_tx(&smem.do_full[state.stage], Traits::kQBytes);
          copy(args.tma_do.with(smem.do_full[state.stage]), get<0>(tdO)(_, m_block), get<1>(tdO)(_, state.stage));
        }
        state.template advance<kStages>();
      }
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
  Tensor sKw = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));  // (64, D): own keys
  Tensor sVw = local_tile(make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));  // (64, D)
  Tensor sKt = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{}),
                          Shape<Int<Traits::kHalfD>, Int<kBlockN>>{}, make_coord(wg, _0{}));  // (D / 2, N): own dQ columns
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdS{});   // (M, N)
  Tensor sdStw = local_tile(make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdSt{}),
                            Shape<_64, Int<kBlockM>>{}, make_coord(wg, _0{}));  // (64, M): own keys' rows of dS^T

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
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);    // (MMA, MMA_M, MMA_N)
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);     // (MMA, MMA_D / 2, MMA_N)
  Tensor acc_dk = partition_fragment_C(mma_dkv, typename Traits::TileKVWarpgroup{});  // (MMA, 1, MMA_D)
  Tensor acc_dv = partition_fragment_C(mma_dkv, typename Traits::TileKVWarpgroup{});  // (MMA, 1, MMA_D)

  Tensor tScS = rowcol_view(thr_sdp.partition_C(make_identity_tensor(typename Traits::TileSt{})));  // (keys, queries) -> coords
  constexpr int kCols = decltype(size<1>(tScS))::value;
  const float scale_log2 = p.softmax_scale * float(M_LOG2E);
  const int diag = seq.len_k - seq.len_q;
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>{}, mma_sdp);
  auto smem_thr_ds = smem_copy_ds.get_thread_slice(thread);
  Tensor tdSsdS = smem_thr_ds.partition_D(sdStw);  // (CPY, CPY_N, CPY_M)
  const bool release_thread = thread == 0;
  const int dq_col0 = wg * Traits::kHalfD;

  PipelineState state;
  const int key0 = n_block * kBlockN + wg * 64;  // this warpgroup's first key
  clear(acc_dk);
  clear(acc_dv);
  if (blocks.m_max > blocks.m_min) {
    barrier_wait(&smem.kv_full, 0);
    // Varlen: K rows past the sequence (the next one's, or rows outside every sequence) to zero, since
    // dQ = dS K would carry 0 x NaN; each warpgroup zeroes its own slab, the first dQ waits on both.
    if (varlen && key0 + 64 > seq.len_k) zero_rows(sKw, max(0, seq.len_k - key0), thread, 128);
  }
  for (int dh = 0; dh < group; ++dh) {  // (no query block when none sees these keys)
    const int head = h0 + dh;
    for (int m_block = blocks.m_max - 1; m_block >= blocks.m_min; --m_block) {
      const int row0 = m_block * kBlockM;
      barrier_wait(&smem.q_full[state.stage], state.phase);
      Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileSt{});   // ((2, 2, M / 8), 1, 1)
      Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileSt{});  // ((2, 2, M / 8), 1, 1)
      wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, state.stage), acc_s);
      barrier_wait(&smem.do_full[state.stage], state.phase);
      wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tdPrV, tdPrdO(_, _, _, state.stage), acc_dp);
      warpgroup_wait<0>();

      Tensor St = rowcol_view(acc_s);    // (keys, queries)
      Tensor dPt = rowcol_view(acc_dp);  // (keys, queries)
      const bool masked = m_block < blocks.m_unmasked_min;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(St); ++r) {
        const int key = key0 + get<0>(tScS(r, 0));
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const int row = row0 + get<1>(tScS(r, c));
          // Rows past the sequence too: S^T and dP^T there may be NaN (varlen rows after the last
          // sequence), which 0 x NaN would carry on.
          const bool hidden = row >= seq.len_q || (masked && (key >= seq.len_k || (p.causal && key > row + diag)));
          const int i = get<1>(tScS(r, c));
          const float pt = hidden ? 0.f : fast_exp2(St(r, c) * scale_log2 - smem.lse_log2[state.stage][i]);
          St(r, c) = pt;                                                        // P^T
          dPt(r, c) = hidden ? 0.f : pt * (dPt(r, c) - smem.dsum[state.stage][i]);  // dS^T
        }
      }
      // Varlen: Q and dO rows past the sequence to zero before dK += dS^T Q and dV += P^T dO read them
    // (their S^T and dP^T columns are already 0); both warpgroups share the work, kdSRead orders it.
    if (varlen && row0 + kBlockM > seq.len_q) {
      const int valid = max(0, seq.len_q - row0);
      zero_rows(sQ(_, _, state.stage), valid, wg * 128 + thread, Traits::kConsumerThreads);
      zero_rows(sdO(_, _, state.stage), valid, wg * 128 + thread, Traits::kConsumerThreads);
    }
    Tensor rP = convert_fragment<Element>(acc_s);
      Tensor rdS = convert_fragment<Element>(acc_dp);
      Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));     // ((2, 2, 2), 1, M / 16)
      Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));  // ((2, 2, 2), 1, M / 16)

      // dS^T into shared memory for dQ, once the last step's dQ GEMMs of both warpgroups have read it.
      named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kdSRead));
      cute::copy(smem_copy_ds, smem_thr_ds.retile_S(rdS), tdSsdS);
      cutlass::arch::fence_view_async_shared();  // visible to the wgmma (async proxy)

      wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdVrP, tdVrdO(_, _, _, state.stage), acc_dv);
      wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, state.stage), acc_dk);
      named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kdSWritten));
      Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::TiledQ{});  // ((2, 2, D / 16), 1, 1)
      wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS, tdQrK, acc_dq);
      warpgroup_wait<0>();  // dV, dK and dQ are done: Q[m] and dO[m] may go
      if (release_thread) {
        barrier_arrive(&smem.q_empty[state.stage]);
        barrier_arrive(&smem.do_empty[state.stage]);
      }
      state.template advance<kStages>();

      // dQ += this block's share (fp32 reductions; the conversion scales by softmax_scale).
      Tensor dQ = rowcol_view(acc_dq);  // (queries, D / 2 columns)
      Tensor tdQcdQ = rowcol_view(thr_dq.partition_C(make_identity_tensor(typename Traits::TiledQ{})));
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dQ); ++r) {
        const int row = row0 + get<0>(tdQcdQ(r, 0));
        if (row >= seq.len_q) continue;
        float* dq_row = p.dq_accum + dq_accum_offset_sm90<kHeadDim>(p, head, seq.offset_q(p.seqlen_q, 1, bidb) + row) + dq_col0;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dQ); c += 2) {
          const int col = get<1>(tdQcdQ(r, c));
          if (dq_col0 + col < p.head_dim) red_add_global_x2(dq_row + col, dQ(r, c), dQ(r, c + 1));
        }
      }
    }
  }

  // dK = scale dS^T Q; both leave from registers, two elements per store, rows and columns clipped.
  Tensor dK = rowcol_view(acc_dk);  // (keys, D)
  Tensor dV = rowcol_view(acc_dv);  // (keys, D)
  Tensor tdKcdK = rowcol_view(thr_dkv.partition_C(make_identity_tensor(typename Traits::TileKVWarpgroup{})));
  Element* dk = static_cast<Element*>(p.dk) + seq.offset_k(p.dk_batch_stride, p.dk_row_stride, bidb) + bidh_k * p.dk_head_stride;
  Element* dv = static_cast<Element*>(p.dv) + seq.offset_k(p.dv_batch_stride, p.dv_row_stride, bidb) + bidh_k * p.dv_head_stride;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(dK); ++r) {
    const int key = key0 + get<0>(tdKcdK(r, 0));
    if (key >= seq.len_k) continue;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(dK); c += 2) {
      const int col = get<1>(tdKcdK(r, c));
      if (col >= p.head_dim) continue;
      using Pair = cutlass::Array<Element, 2>;
      Pair k2, v2;
      k2[0] = Element(dK(r, c) * p.softmax_scale), k2[1] = Element(dK(r, c + 1) * p.softmax_scale);
      v2[0] = Element(dV(r, c)), v2[1] = Element(dV(r, c + 1));
      *reinterpret_cast<Pair*>(dk + int64_t(key) * p.dk_row_stride + col) = k2;
      *reinterpret_cast<Pair*>(dv + int64_t(key) * p.dv_row_stride + col) = v2;
    }
  }
#endif
}

}  // namespace flash_attn2
