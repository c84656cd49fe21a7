// The Hopper backward's consumer warpgroups at head dim <= 128: keys split over the warpgroups, 64 each.
//   S^T = K Q^T, dP^T = V dO^T -> mask -> P^T = exp2(S^T scale log2e - LSE log2e), dS^T = P^T o (dP^T - D)
//   dV += P^T dO, dK += dS^T Q (P^T and dS^T from registers), dS^T -> shared memory,
//   dQ[:, own half of D] = dS K -> shared memory -> dq_accum (the producer's writer warp adds it); with
//   64-row steps one step later, so that the two warpgroups need not meet every step (Traits::kDeferDQ).
// After the last step dK and dV go through shared memory for coalesced row stores (bwd_epilogue.h): with
// 128-row steps (Traits::kDKVInDS) through the next step's dS^T buffer, with the next key block's K and V already
// loading; else through the warpgroup's own rows of K and V, after which kv_empty lets those in.
#pragma once

#include "sm90/bwd_work.h"

#include "common/dropout.h"
#include "common/score_mod.h"
#include "sm90/bwd_epilogue.h"

namespace flash_attn2::sm90 {

// Warpgroup wg (0-based among the consumers) owns keys [64 wg, 64 wg + 64) of the tile's key block.
template <class Traits, bool kExtended, bool kDropout>
__device__ void bwd_consume(const BwdArgsSm90<Traits>& args, typename Traits::SharedStorage& smem,
                            const BwdWork<Traits>& work, int warpgroup, BwdConsumerState& carried) {
  using namespace cute;
  const int wg = opaque(warpgroup);  // opaque (and thread below): the per-tile setup stays in the tile loop
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  const BwdParams& p = args.params;
  const SeqlenInfo& seq = work.seq;
  const int steps = work.steps, n_block = work.n_block;
  const bool varlen = work.varlen;
  const int thread = opaque(int(threadIdx.x) % 128);
  const int key0 = n_block * kBlockN + wg * 64;  // this warpgroup's first key
  if (steps == 0) {  // no query sees these keys
    work.template clear_dkv<64, Element>(p, key0, args.head_splits, thread, 128);
    return;
  }
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});      // (M, D, stages)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});  // (M, D, stages)
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});    // (D, M, stages)
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});  // (D, M, stages)
  Tensor sKw = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));  // (64, D): own keys
  Tensor sVw = local_tile(make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{}),
                          typename Traits::TileKVWarpgroup{}, make_coord(wg, _0{}));  // (64, D)
  constexpr bool kDQByRows = Traits::kDQByRows;
  Tensor sKt = local_tile(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{}),
                          Shape<Int<Traits::kDQCols>, Int<kBlockN>>{},
                          make_coord(kDQByRows ? 0 : wg, _0{}));  // (columns, N): own dQ columns

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
  const ScoreMods scores(p, kExtended);
  const float scale_log2 = scores.scale_log2;
  static_assert(kExtended || !kDropout);
  const Dropout dropout_batch(p, work.bidb, 0);
  constexpr int kQueryBlocks = kCols / 4;  // 16-query blocks of a step in a thread's columns
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto smem_thr_ds = smem_copy_ds.get_thread_slice(thread);
  auto stage_dq_share = dq_stager<Traits>(mma_dq, smem.dq[wg].data(), thread);
  const bool release_thread = thread == 0;

  constexpr int kDSBuffers = Traits::kDSBuffers;
  constexpr bool kDeferDQ = Traits::kDeferDQ;
  // Steps count on from the last key block's (j below): the dS buffers and the dQ hand-off go on in order.
  const int step0 = carried.steps;
  // dQ[:, own half] = dS K for step j, once both warpgroups' dS^T of that step is in its buffer.
  auto issue_dq = [&](int j, auto& acc_dq) {
    const int b = j % kDSBuffers;
    if constexpr (kDeferDQ) {
      barrier_wait(&smem.ds_full[b], (j / kDSBuffers) & 1);
    } else {
      named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kdSWritten));
    }
    Tensor sdS = local_tile(make_tensor(make_smem_ptr(smem.ds[b].data()), typename Traits::SmemLayoutdS{}),
                            Shape<Int<Traits::kDQRows>, Int<kBlockN>>{},
                            make_coord(kDQByRows ? wg : 0, _0{}));  // (rows, N): own dQ rows
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_N)
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS, tdQrK, acc_dq);
  };
  // Its buffer released, and the share staged for the writer warp once it has sent the last one.
  auto finish_dq = [&](int j, auto& acc_dq) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dq);  // read only after the wgmma that writes it is done
    if constexpr (kDeferDQ) barrier_arrive(&smem.ds_empty[j % kDSBuffers]);
    stage_dq(stage_dq_share, acc_dq, wg, /*wait_empty=*/j > 0);
  };
  PipelineState& state = carried.q;
  const uint32_t kv_phase = carried.key_blocks & 1;
  clear(acc_dk);
  clear(acc_dv);
  barrier_wait(&smem.k_full, kv_phase);
  // Varlen: K rows past the sequence (the next one's, or rows outside every sequence) to zero, since
  // dQ = dS K would carry 0 x NaN; each warpgroup zeroes its own slab, the first dQ waits on both.
  if (varlen && key0 + 64 > seq.len_k) zero_rows(sKw, max(0, seq.len_k - key0), thread, 128);
  for (int step = 0; step < steps; ++step) {
    const int m_block = work.m_block(step), row0 = m_block * kBlockM, stage = state.stage;
    // Where the step's rows start in the staged D and LSE.
    const int rows_shift = int(work.rows(p, work.head(step), m_block) & 3);
    // S^T = K Q^T and dP^T = V dO^T, the softmax of S^T while dP^T runs (plain kernels).
    // Warpgroup 1 starts once warpgroup 0 has formed its first P^T, to set the two out of phase.
    if (kDeferDQ && step == 0 && wg == 1) named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kStagger));
    barrier_wait(&smem.q_full[stage], state.phase);
    Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileSt{});   // ((2, 2, M / 8), 1, 1)
    Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileSt{});  // ((2, 2, M / 8), 1, 1)
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    barrier_wait(&smem.v_full, kv_phase);  // V comes after K (bwd_load_v): a no-op after the first step
    barrier_wait(&smem.do_full[stage], state.phase);
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    Tensor St = rowcol_view(acc_s);    // (keys, queries)
    Tensor dPt = rowcol_view(acc_dp);  // (keys, queries)
    // P^T = exp2(S^T scale log2e - LSE log2e) while dP^T runs (plain kernels), then dS^T = P^T o (dP^T - D).
    // Where a pair may be hidden (masked steps) both are set, not multiplied, to 0: S^T and dP^T there may be
    // anything (rows past the sequence: another sequence's or NaN; keys past it: LSE is not theirs).
    const auto bias =
        scores.alibi(p, seq.len_q, seq.len_k, work.bidb, work.head(step)).tile</*kQueryMode=*/1>(tScS, row0, key0);
    auto softmax = [&](auto masked, auto extended) {  // extended: softcap and ALiBi, each where set
      // Key r is seen by query rows [rows_begin[r], rows_end[r]) of the block (none past the sequence).
      int rows_begin[size<0>(St)], rows_end[size<0>(St)];
      if constexpr (decltype(masked)::value) {
        CUTE_UNROLL
        for (int r = 0; r < size<0>(St); ++r) {
          const Span rows = work.window.template span</*kTransposed=*/true>(key0 + get<0>(tScS(r, 0)), row0, seq.len_k);
          rows_begin[r] = rows.begin, rows_end[r] = rows.end;
        }
      }
      auto keep = [&](int r, int c) {
        if constexpr (decltype(masked)::value) {
          const int row = get<1>(tScS(r, c));
          return row >= rows_begin[r] && row < rows_end[r];
        } else {
          return true;
        }
      };
      if constexpr (decltype(extended)::value) {
        // Dropout: the forward's keep bits, drawn for S^T (rows keys, columns queries: the same draws) while
        // the GEMMs run, held as one bit per score.
        static_assert(decltype(size<0>(St))::value == 2, "one 16-key tile per warp");
        const Dropout dropout = dropout_batch.with_head(p, work.bidb, work.head(step));
        uint32_t drop_bits[(kQueryBlocks + 3) / 4];
        if constexpr (kDropout) {
          dropout.draw_bits</*kTransposed=*/true, kQueryBlocks>(drop_bits, (key0 + get<0>(tScS(0, 0))) >> 4, row0 >> 4);
        }
        // Softcap's derivative 1 - t^2 wants t = tanh(S scale / softcap) beside dP: both GEMMs first, then
        // one pass, so that t neither waits in a register for dP nor is recomputed from P with a log (a third
        // MUFU op per score, and registers the extended kernels do not have).
        warpgroup_wait<0>();
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const int row = rows_shift + get<1>(tScS(0, c));
          const float lse_log2 = smem.lse_log2[stage][row], dsum = smem.dsum[stage][row];
          CUTE_UNROLL
          for (int r = 0; r < size<0>(St); ++r) {
            const float zscale =
                !kDropout ? 1.f : Dropout::kept_bit<kQueryBlocks>(drop_bits, c / 4, r, c % 4) ? dropout.scale : 0.f;
            scores.p_and_ds(St(r, c), dPt(r, c), bias(r, c), lse_log2, dsum, keep(r, c), zscale);
          }
        }
      } else {
        // Traits::kPlainAlibi adds ALiBi's bias: it changes P but not dS = P (dP - D), so P^T still forms
        // while dP^T runs.
        warpgroup_wait<1>();
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const float lse_log2 = smem.lse_log2[stage][rows_shift + get<1>(tScS(0, c))];  // +inf for a row that saw no key: P = 0
          CUTE_UNROLL
          for (int r = 0; r < size<0>(St); ++r) {
            const float s = Traits::kPlainAlibi ? St(r, c) + bias(r, c) : St(r, c);
            const float pt = fast_exp2(s * scale_log2 - lse_log2);
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
      }
    };
    const bool masked =
        m_block < work.blocks.m_unmasked_min || m_block >= work.blocks.m_unmasked_max || row0 + kBlockM > seq.len_q;
    if (masked) {
      softmax(std::true_type{}, std::bool_constant<kExtended>{});
    } else {
      softmax(std::false_type{}, std::bool_constant<kExtended>{});
    }
    if (kDeferDQ && step == 0 && wg == 0) named_barrier_arrive(Traits::kConsumerThreads, int(BwdBarrier::kStagger));
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
    // dS^T rotates through kDSBuffers buffers. Deferred dQ: each buffer comes back by ds_empty once both
    // warpgroups' dQ read it. Else this one was last read by dQ two steps ago, which both warpgroups had
    // waited for before last step's kdSWritten.
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));     // ((2, 2, 2), 1, M / 16)
    Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));  // ((2, 2, 2), 1, M / 16)
    wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    const int buf = (step0 + step) % kDSBuffers;
    if (kDeferDQ && step0 + step >= kDSBuffers) {
      barrier_wait(&smem.ds_empty[buf], ((step0 + step) / kDSBuffers - 1) & 1);
    }
    Tensor sdStw = local_tile(make_tensor(make_smem_ptr(smem.ds[buf].data()), typename Traits::SmemLayoutdSt{}),
                              Shape<_64, Int<kBlockM>>{}, make_coord(wg, _0{}));  // (64, M): own keys' rows of dS^T
    cute::copy(smem_copy_ds, smem_thr_ds.retile_S(rdS), smem_thr_ds.partition_D(sdStw));
    cutlass::arch::fence_view_async_shared();  // visible to the wgmma (async proxy)
    if constexpr (kDeferDQ) barrier_arrive(&smem.ds_full[buf]);
    wgmma</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);
    auto release = [&] {
      if (release_thread) {
        barrier_arrive(&smem.q_empty[stage]);
        barrier_arrive(&smem.do_empty[stage]);
      }
      state.template advance<kStages>();
    };
    // Deferred: the previous step's dQ, whose dS both warpgroups have long written, so that neither waits
    // for the other's softmax and the two run out of phase, one's softmax under the other's GEMMs.
    const int dq_step = kDeferDQ ? step - 1 : step;
    if (dq_step >= 0) {
      Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::TiledQ{});  // ((2, 2, D / 16), 1, 1)
      issue_dq(step0 + dq_step, acc_dq);
      warpgroup_wait<1>();  // dV and dK are done: Q[m] and dO[m] may go
      release();
      finish_dq(step0 + dq_step, acc_dq);
    } else {
      warpgroup_wait<0>();
      release();
    }
  }
  if constexpr (kDeferDQ) {
    Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::TiledQ{});  // ((2, 2, D / 16), 1, 1)
    issue_dq(step0 + steps - 1, acc_dq);
    finish_dq(step0 + steps - 1, acc_dq);
  }
  carried.key_blocks += 1;
  carried.steps += steps;

  if (args.head_splits > 1) {
    // dK and dV leave from registers as this block's fp32 share (scaled and converted afterwards), two
    // elements at a time, keys past the sequence clipped.
    Tensor dK = rowcol_view(acc_dk);  // (keys, D)
    Tensor dV = rowcol_view(acc_dv);  // (keys, D)
    Tensor tdKcdK = rowcol_view(thr_dkv.partition_C(make_identity_tensor(typename Traits::TileKVWarpgroup{})));  // (keys, D) -> coords
    float* dk_acc = work.dkv_accum(p, 0);
    float* dv_acc = work.dkv_accum(p, 1);
    barrier_arrive(&smem.kv_empty);  // the last dQ = dS K is done with K (finish_dq waited for it)
    add_dkv_shares</*kTransposed=*/false, kHeadDim>(dK, dV, tdKcdK, key0, 0, seq.len_k, p.head_dim, value_head_dim(p), dk_acc,
                                                     dv_acc);
    return;
  }
  // Else dK = scale dS^T Q and dV in the input dtype, through shared memory for coalesced 16-byte row
  // stores, each warpgroup its own keys. Traits::kDKVInDS: in the warpgroup's half of the dS^T buffer the
  // next step takes, which no dQ reads any more (the last was two steps back, before the last kdSWritten),
  // and K and V go at once, so that the next key block's loads overlap this epilogue. Else in the
  // warpgroup's own rows of K and V, once every warpgroup's last dQ = dS K (which reads all of K) is done.
  const auto [rdK, rdV] = dkv_in_dtype<Element>(acc_dk, acc_dv, p.softmax_scale);
  auto [sdK, sdV] = [&] {  // (64, D) each: where dK and dV stage
    if constexpr (Traits::kDKVInDS) {
      barrier_arrive(&smem.kv_empty);  // the last dQ = dS K is done with K (finish_dq waited for it)
      Element* half = smem.ds[(step0 + steps) % kDSBuffers].data() + wg * 64 * kBlockM;
      auto own = [&](Element* at, auto layout) {  // (64, D) at `at`, laid out as a warpgroup's rows of K or V
        return local_tile(make_tensor(make_smem_ptr(at), layout), typename Traits::TileKVWarpgroup{}, make_coord(0, 0));
      };
      return cute::make_tuple(own(half, typename Traits::SmemLayoutK{}), own(half + 64 * kHeadDim, typename Traits::SmemLayoutV{}));
    } else {
      named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kEpilogue));
      return cute::make_tuple(sKw, sVw);
    }
  }();
  stage_dkv<SM90_U32x4_STSM_N>(mma_dkv, thread, rdK, rdV, sdK, sdV);
  named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kEpilogue));
  store_dkv_rows<Element>(p, work, sdK, sdV, key0, seq.len_k - key0, thread, 128);
  if constexpr (Traits::kDKVInDS) {
    // Every warp's reads above before the next tile's first dS^T writes, which map warps to other rows.
    named_barrier_sync(Traits::kConsumerThreads, int(BwdBarrier::kEpilogue));
  } else {
    cutlass::arch::fence_view_async_shared();  // the reads above before the next key block's TMA writes
    barrier_arrive(&smem.kv_empty);
  }
}

}  // namespace flash_attn2::sm90
