// The Hopper backward's consumer warpgroups above head dim 128 (BwdTraitsSm90Wide): dK and dV of the
// block's keys split over the warpgroups by head-dim rows, since one warpgroup's registers cannot hold
// them for all of D. Per step, warpgroup w:
//   S = Q K_w^T, dP = dO V_w^T (its kKeys keys) -> mask -> P = exp2(S scale log2e - LSE log2e),
//   dS = P o (dP - D) -> shared memory (all warpgroups' keys side by side),
//   dV^T[w] += dO^T[w] P, dK^T[w] += Q^T[w] dS (its kDRows rows of the head dim, all keys),
//   dQ[:, w] = dS K[:, w], kDQPart columns at a time (d 192: its 64 at once; d 256: 32) -> shared memory ->
//   dq_accum (the writer warp's TMA reduce-add of rows; scaled and converted afterwards).
#pragma once

#include "sm90/bwd_work.h"

#include "common/dropout.h"
#include "common/score_mod.h"
#include "sm90/bwd_epilogue.h"

namespace flash_attn2::sm90 {

// kDropout (with kExtended): dropout's keep bits drawn while S and dP run.
template <class Traits, bool kExtended, bool kDropout>
__device__ void bwd_consume_wide(const BwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                                 const BwdWork<Traits>& work, int warpgroup, BwdConsumerState& carried) {
  using namespace cute;
  const int wg = opaque(warpgroup);  // opaque (and thread below): the per-tile setup stays in the tile loop
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages, kKeys = Traits::kKeys, kDRows = Traits::kDRows;
  constexpr int kThreads = Traits::kConsumerThreads;
  const BwdParams& p = args.params;
  const SeqlenInfo& seq = work.seq;
  const int steps = work.steps, n_block = work.n_block;
  const int thread = opaque(int(threadIdx.x) % 128);
  if (steps == 0) {  // no query sees these keys
    work.template clear_dkv<kBlockN, Element>(p, n_block * kBlockN, args.head_splits, wg * 128 + thread, kThreads);
    return;
  }

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});       // (M, D, stages)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdO{});  // (M, D, dO stages)
  // Its head-dim rows of Q^T and dO^T.
  Tensor sQt = local_tile(make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{}),
                          Shape<Int<kDRows>, Int<kBlockM>, Int<kStages>>{}, make_coord(wg, _0{}, _0{}));   // (D_w, M, stages)
  Tensor sdOt = local_tile(make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdOt{}),
                           Shape<Int<kDRows>, Int<kBlockM>, Int<Traits::kStagesdO>>{},
                           make_coord(wg, _0{}, _0{}));  // (D_w, M, dO stages)
  Tensor sKw = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));         // (kKeys, D): own keys
  Tensor sVw = local_tile(make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));         // (kKeys, D)
  constexpr int kDQParts = Traits::kDQParts, kDQPart = Traits::kDQPart;
  Tensor sKt = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{}),
                          Shape<Int<kDQPart>, Int<kBlockN>>{}, make_coord(_, _0{}));  // (D_part, N, parts of D)
  Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdS{});     // (M, N)
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdS{});   // (M, N)
  Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdSt{});   // (N, M)
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdSt{}); // (N, M)

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dkv = mma_dkv.get_thread_slice(thread);
  auto thr_dq = mma_dq.get_thread_slice(thread);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);     // (MMA, MMA_M, MMA_D, stages) descriptors
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);  // (MMA, MMA_M, MMA_D, stages)
  Tensor tSrK = thr_sdp.partition_fragment_B(sKw);    // (MMA, MMA_N, MMA_D)
  Tensor tdPrV = thr_sdp.partition_fragment_B(sVw);   // (MMA, MMA_N, MMA_D)
  Tensor tdVrdO = thr_dkv.partition_fragment_A(sdOt);  // (MMA, MMA_DW, MMA_M, stages)
  Tensor tdKrQ = thr_dkv.partition_fragment_A(sQt);    // (MMA, MMA_DW, MMA_M, stages)
  Tensor tdVrP = thr_dkv.partition_fragment_B(sPt);    // (MMA, MMA_NK, MMA_M)
  Tensor tdKrdS = thr_dkv.partition_fragment_B(sdSt);  // (MMA, MMA_NK, MMA_M)
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);    // (MMA, MMA_M, MMA_NK)
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);     // (MMA, MMA_DP, MMA_NK, parts of D)
  Tensor acc_dkt = partition_fragment_C(mma_dkv, typename Traits::TiledKVt{});  // (MMA, D_w / 64, 1)
  Tensor acc_dvt = partition_fragment_C(mma_dkv, typename Traits::TiledKVt{});  // (MMA, D_w / 64, 1)

  Tensor tScS = rowcol_view(thr_sdp.partition_C(make_identity_tensor(typename Traits::TileS{})));  // (queries, keys) -> coords
  constexpr int kRows = decltype(size<0>(tScS))::value, kCols = decltype(size<1>(tScS))::value;
  const ScoreMods scores(p, kExtended);
  const float scale_log2 = scores.scale_log2;
  static_assert(kExtended || !kDropout);
  static_assert(kKeys % 8 == 0 && (kKeys % 16 == 0 || (kKeys / 8) % 2 == 1) && Traits::kBlockN % 16 == 0,
                "a warpgroup's keys: whole 16-key blocks, or an odd count of 8-key groups");
  const Dropout dropout_batch(p, work.bidb, 0);
  // stmatrix: four 8x8 blocks per instruction where a warpgroup's keys allow (kKeys 40 at d 256: two)
  using StsmPdS = std::conditional_t<kKeys % 16 == 0, SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>;
  auto smem_copy_pds = make_tiled_copy_C(Copy_Atom<StsmPdS, Element>{}, mma_sdp);
  auto smem_thr_pds = smem_copy_pds.get_thread_slice(thread);
  Tensor tPsP = smem_thr_pds.partition_D(local_tile(sP, typename Traits::TileS{}, make_coord(_0{}, wg)));
  Tensor tdSsdS = smem_thr_pds.partition_D(local_tile(sdS, typename Traits::TileS{}, make_coord(_0{}, wg)));
  auto stage_dq_share = dq_stager<Traits>(mma_dq, smem.dq[wg].data(), thread);
  const bool release_thread = thread == 0;

  PipelineState &state = carried.q, &state_do = carried.dout;
  const bool first_share = carried.steps == 0;  // of the block: no dQ share of a last key block to wait for
  const int key0 = n_block * kBlockN + wg * kKeys;  // this warpgroup's first key
  // V at most 128 wide on a kernel of head dim > 128 (MLA, TUNING 151-152 and 157; also a build that serves head dim
  // 128 on its d 192 kernel): V's and dO's columns past value_head_dim arrive as TMA's zeros, so dP = dO V^T contracts
  // over the first 128 (kVSteps of the k blocks), and dV^T's rows past value_head_dim stay zero: the warpgroups that
  // own only such rows skip dV's GEMM (their accumulator stays cleared; the store clips it).
  constexpr int kVSteps = 128 / 16;
  const bool narrow_v = kHeadDim > 128 && value_head_dim(p) <= 128;
  const bool own_dv = wg * kDRows < value_head_dim(p);
  clear(acc_dkt);
  clear(acc_dvt);
  barrier_wait(&smem.k_full, carried.key_blocks & 1);  // K and V
  // Varlen: K rows past the sequence (the next one's, or rows outside every sequence) to zero, since
  // dQ = dS K would carry 0 x NaN; each warpgroup zeroes its own keys, dQ runs after kdSWritten.
  if (work.varlen && key0 + kKeys > seq.len_k) zero_rows(sKw, max(0, seq.len_k - key0), thread, 128);
  for (int step = 0; step < steps; ++step) {
    const int m_block = work.m_block(step), row0 = m_block * kBlockM, stage = state.stage, stage_do = state_do.stage;
    // Where the step's rows start in the staged D and LSE.
    const int rows_shift = int(work.rows(p, work.head(step), m_block) & 3);
    barrier_wait(&smem.q_full[stage], state.phase);
    Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileS{});   // ((2, 2, kKeys / 8), 1, 1)
    Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileS{});  // ((2, 2, kKeys / 8), 1, 1)
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrQ(_, _, _, stage), tSrK, acc_s);
    barrier_wait(&smem.do_full[stage_do], state_do.phase);
    if (narrow_v) {
      wgmma</*kZeroInit=*/true, /*kWait=*/-1, kVSteps>(mma_sdp, tdPrdO(_, _, _, stage_do), tdPrV, acc_dp);
    } else {
      wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tdPrdO(_, _, _, stage_do), tdPrV, acc_dp);
    }
    Tensor S = rowcol_view(acc_s);    // (queries, keys)
    Tensor dP = rowcol_view(acc_dp);  // (queries, keys)
    // P = exp2(S scale log2e - LSE log2e) while dP runs (plain kernels), then dS = P o (dP - D); where a pair
    // may be hidden (masked steps) both are set, not multiplied, to 0, as S and dP there may be anything.
    const auto bias = scores.alibi(p, seq.len_q, seq.len_k, work.bidb, work.head(step)).tile(tScS, row0, key0);
    auto softmax = [&](auto masked, auto extended) {  // extended: softcap and ALiBi, each where set
      // Query row r sees keys [keys_begin[r], keys_end[r]) of the block (none past the sequence).
      int keys_begin[kRows], keys_end[kRows];
      if constexpr (decltype(masked)::value) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const Span keys = work.window.template span</*kTransposed=*/false>(row0 + get<0>(tScS(r, 0)), key0, seq.len_q);
          keys_begin[r] = keys.begin, keys_end[r] = keys.end;
        }
      }
      auto keep = [&](int r, int c) {
        if constexpr (decltype(masked)::value) {
          const int key = get<1>(tScS(r, c));
          return key >= keys_begin[r] && key < keys_end[r];
        } else {
          return true;
        }
      };
      if constexpr (decltype(extended)::value) {
        // Dropout: the forward's keep bits, drawn for this warpgroup's keys while the GEMMs run.
        static_assert(kRows == 2, "one 16-row tile per warp");
        const Dropout dropout = dropout_batch.with_head(p, work.bidb, work.head(step));
        uint32_t drop_bits = 0;
        if constexpr (kDropout) drop_bits = dropout.draw_group_bits<kKeys / 8>((row0 + get<0>(tScS(0, 0))) >> 4, key0);
        // Softcap's derivative 1 - t^2 wants t = tanh(S scale / softcap) beside dP: both GEMMs first, then
        // one pass, so that t neither waits in a register for dP nor is recomputed from P with a log (a third
        // MUFU op per score, and registers the extended kernels do not have).
        warpgroup_wait<0>();
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = rows_shift + get<0>(tScS(r, 0));
          const float lse_log2 = smem.lse_log2[stage][row], dsum = smem.dsum[stage][row];
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const float zscale =
                !kDropout ? 1.f : GroupBits<kKeys / 8>::kept(drop_bits, c / 2, r, c % 2) ? dropout.scale : 0.f;
            scores.p_and_ds(S(r, c), dP(r, c), bias(r, c), lse_log2, dsum, keep(r, c), zscale);
          }
        }
      } else {
        warpgroup_wait<1>();
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const float lse_log2 = smem.lse_log2[stage][rows_shift + get<0>(tScS(r, 0))];  // +inf for a row that saw no key
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const float pv = fast_exp2(S(r, c) * scale_log2 - lse_log2);
            S(r, c) = keep(r, c) ? pv : 0.f;
          }
        }
        warpgroup_wait<0>();
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const float dsum = smem.dsum[stage][rows_shift + get<0>(tScS(r, 0))];
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const float ds = S(r, c) * (dP(r, c) - dsum);
            dP(r, c) = keep(r, c) ? ds : 0.f;
          }
        }
      }
    };
    const bool masked = m_block < work.blocks.m_unmasked_min || m_block >= work.blocks.m_unmasked_max ||
                        row0 + kBlockM > seq.len_q || key0 + kKeys > seq.len_k;
    if (masked) {
      softmax(std::true_type{}, std::bool_constant<kExtended>{});
    } else {
      softmax(std::false_type{}, std::bool_constant<kExtended>{});
    }
    // P and dS to shared memory once every warpgroup's last GEMMs are done with them (and, for varlen,
    // with Q and dO's rows past the sequence, zeroed here: their P and dS rows are 0, but 0 x NaN is not).
    named_barrier_sync(kThreads, int(BwdBarrier::kPdSFree));
    if (work.varlen && row0 + kBlockM > seq.len_q) {
      const int valid = max(0, seq.len_q - row0);
      zero_rows(sQ(_, _, stage), valid, wg * 128 + thread, kThreads);
      zero_rows(sdO(_, _, stage_do), valid, wg * 128 + thread, kThreads);
    }
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    cute::copy(smem_copy_pds, smem_thr_pds.retile_S(rP), tPsP);
    cute::copy(smem_copy_pds, smem_thr_pds.retile_S(rdS), tdSsdS);
    cutlass::arch::fence_view_async_shared();  // visible to the wgmma (async proxy)
    named_barrier_sync(kThreads, int(BwdBarrier::kdSWritten));

    // dV^T += dO^T P and dK^T += Q^T dS for this warpgroup's head-dim rows; then its dQ columns, kDQPart at a
    // time (d 192: all 64 at once; d 256: 32), each part's GEMM issued before the last part is staged for the
    // writer warp (wgmma groups complete in issue order).
    // (Without dV's batch the waits below count one batch fewer ahead of dQ's: still dK's and dQ's in issue order.)
    if (own_dv) wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdVrdO(_, _, _, stage_do), tdVrP, acc_dvt);
    wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdKrQ(_, _, _, stage), tdKrdS, acc_dkt);
    Tensor acc_dq0 = partition_fragment_C(mma_dq, typename Traits::TiledQ{});  // ((2, 2, 4), 1, 1)
    Tensor acc_dq1 = partition_fragment_C(mma_dq, typename Traits::TiledQ{});  // ((2, 2, 4), 1, 1)
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS, tdQrK(_, _, _, wg * kDQParts), acc_dq0);
    cute::for_each(make_int_sequence<kDQParts>{}, [&](auto part) {
      constexpr int kPart = decltype(part)::value;
      auto& acc_dq = kPart % 2 == 0 ? acc_dq0 : acc_dq1;
      if constexpr (kPart + 1 < kDQParts) {
        wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS, tdQrK(_, _, _, wg * kDQParts + kPart + 1),
                                                 kPart % 2 == 0 ? acc_dq1 : acc_dq0);
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
      }
      if constexpr (kPart == 0) {  // dV^T and dK^T are done: Q[m] and dO[m] may go
        if (release_thread) {
          barrier_arrive(&smem.q_empty[stage]);
          barrier_arrive(&smem.do_empty[stage_do]);
        }
      }
      // Staged once the writer warp has sent the last part.
      stage_dq(stage_dq_share, acc_dq, wg, /*wait_empty=*/!first_share || step > 0 || kPart > 0);
    });
    state.template advance<kStages>();
    state_do.template advance<Traits::kStagesdO>();
  }
  carried.key_blocks += 1;
  carried.steps += steps;

  // dK and dV from registers: element (d, key) of dK^T / dV^T is dK / dV (key, d); keys past the sequence
  // and columns past head_dim clipped. With head splits this block's fp32 share (scaled and converted
  // afterwards), added element by element.
  Tensor dKt = rowcol_view(acc_dkt);  // (D_w, keys)
  Tensor dVt = rowcol_view(acc_dvt);  // (D_w, keys)
  Tensor tdKcdK = rowcol_view(thr_dkv.partition_C(make_identity_tensor(typename Traits::TiledKVt{})));  // (D_w, keys) -> coords
  if (args.head_splits > 1) {
    float* dk_acc = work.dkv_accum(p, 0);
    float* dv_acc = work.dkv_accum(p, 1);
    barrier_arrive(&smem.kv_empty);  // the last dQ part was waited for: K and V are free
    add_dkv_shares</*kTransposed=*/true, kHeadDim>(dKt, dVt, tdKcdK, n_block * kBlockN, wg * kDRows, seq.len_k,
                                                   p.head_dim, value_head_dim(p), dk_acc, dv_acc);
    return;
  }
  // Else dK = scale dS^T Q and dV in the input dtype, through shared memory for coalesced 16-byte row
  // stores: each warpgroup writes its head-dim columns of every key into K and V with transposing
  // stmatrix (its accumulators hold dK^T and dV^T), once every warpgroup's GEMMs are done with them.
  const auto [rdKt, rdVt] = dkv_in_dtype<Element>(acc_dkt, acc_dvt, p.softmax_scale);
  auto own_columns = [&](Element* base, auto layout) {  // (D_w, N): this warpgroup's columns of K or V, transposed
    auto transposed = composition(layout, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{}));
    return local_tile(make_tensor(make_smem_ptr(base), transposed), typename Traits::TiledKVt{}, make_coord(wg, _0{}));
  };
  named_barrier_sync(kThreads, int(BwdBarrier::kEpilogue));
  stage_dkv<SM90_U16x8_STSM_T>(mma_dkv, thread, rdKt, rdVt, own_columns(smem.k.data(), typename Traits::SmemLayoutK{}),
                               own_columns(smem.v.data(), typename Traits::SmemLayoutV{}));
  named_barrier_sync(kThreads, int(BwdBarrier::kEpilogue));
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});  // (N, D)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});  // (N, D)
  const int first_key = n_block * kBlockN, rows = seq.len_k - first_key;
  store_dkv_rows<Element>(p, work, sK, sV, first_key, rows, wg * 128 + thread, kThreads);
  cutlass::arch::fence_view_async_shared();  // the reads above before the next key block's TMA writes
  barrier_arrive(&smem.kv_empty);
}

}  // namespace flash_attn2::sm90
