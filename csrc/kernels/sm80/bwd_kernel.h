// FlashAttention-2 backward for one (key block, batch, kv head): dK and dV of kBlockN keys, and their
// share of dQ.
//
// K and V stay in shared memory while the query blocks that can see them stream past, for every query
// head that shares this kv head (so MQA/GQA sum dK and dV in fp32 registers, not in memory). Each step
// recomputes P from the forward's LSE instead of storing it:
//   S = Q K^T -> mask -> P = exp(scale S - LSE);  dP = dO V^T;  dS = P o (dP - D),  D = rowsum(dO o O)
//   dV += P^T dO;  dK += dS^T Q;  dQ += dS K (fp32 atomics; scale applied at the end).
// P and dS pass through shared memory, since dV and dK contract over the query rows.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/block_range.h"
#include "common/dropout.h"
#include "sm80/dq_accum.h"
#include "flash_attn2/flash_attn2.h"
#include "sm80/kernel_traits.h"
#include "common/mask.h"
#include "common/bwd_workspace.h"  // bwd_dkv_accum_offset
#include "common/seqlen.h"
#include "common/score_mod.h"
#include "common/utils.h"

namespace flash_attn2 {

// Blocks per (batch, kv head): num_splits when deterministic, else one per key block of the max_seqlen_k
// hint (clamped to the packed length, at least one). A block takes key blocks split, split + num_splits,
// ... while its sequence has them, so a hint that is too small costs parallelism, never keys.
template <int kBlockN>
__host__ __device__ inline int bwd_num_splits(const BwdParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  const int64_t keys = p.cu_seqlens_k != nullptr ? clamp_row(p.seqlen_k, 0, p.total_k) : p.seqlen_k;
  return keys > 0 ? int((keys + kBlockN - 1) / kBlockN) : 1;
}

// head_splits (heuristics.h: bwd_head_splits) consecutive blocks share a key block, each with its share of the
// query-head group; above 1 they add dK and dV into fp32 accumulators instead of storing them.
// kExtended (kernel_kind.h; this path runs ALiBi alone on it too): softcap and ALiBi, behind runtime flags;
// kDropout adds dropout, in a kernel of its own as on the other paths.
template <class Traits, bool kExtended, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const __grid_constant__ BwdParams params,
                                                                   int head_splits) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
  const int tid = threadIdx.x;

  // Blocks of one head run together and share its Q / dO through L2. Each owns key blocks split,
  // split + num_splits, ... in order.
  const int num_splits = bwd_num_splits<kBlockN>(params);
  const int head_split = int(blockIdx.x % head_splits), block = int(blockIdx.x / head_splits);
  const int split = block % num_splits;
  const int bidh_k = block / num_splits % params.num_heads_k;
  const int bidb = block / num_splits / params.num_heads_k;
  const int group = params.num_heads / params.num_heads_k / head_splits;  // query heads of this block
  const int h0 = (bidh_k * head_splits + head_split) * group;  // query heads h0 .. h0 + group - 1 read this kv head
  const SeqlenInfo seq(params, bidb);

  auto q_rows = [&](auto* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return gmem_rows<kHeadDim>(ptr + seq.offset_q(batch_stride, row_stride, bidb) + h0 * head_stride, seq.len_q, row_stride);
  };
  auto k_rows = [&](auto* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return gmem_rows<kHeadDim>(ptr + seq.offset_k(batch_stride, row_stride, bidb) + bidh_k * head_stride, seq.len_k, row_stride);
  };
  const auto& p = params;
  // Query-side tensors start at head h0; head h adds (h - h0) head strides.
  Tensor mQ = q_rows(static_cast<const Element*>(p.q), p.q_batch_stride, p.q_row_stride, p.q_head_stride);  // (len_q, D)
  Tensor mdO = q_rows(static_cast<const Element*>(p.dout), p.do_batch_stride, p.do_row_stride, p.do_head_stride);  // (len_q, D)
  Tensor mK = k_rows(static_cast<const Element*>(p.k), p.k_batch_stride, p.k_row_stride, p.k_head_stride);  // (len_k, D)
  Tensor mV = k_rows(static_cast<const Element*>(p.v), p.v_batch_stride, p.v_row_stride, p.v_head_stride);  // (len_k, D)
  Tensor mdK = k_rows(static_cast<Element*>(p.dk), p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);  // (len_k, D)
  Tensor mdV = k_rows(static_cast<Element*>(p.dv), p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);  // (len_k, D)
  const int dq_split = p.num_splits > 0 ? split : 0;
  const float* lse = p.lse + seq.offset_q(p.lse_batch_stride, 1, bidb) + h0 * p.lse_head_stride;
  const float* softmax_d = p.softmax_d + int64_t(h0) * p.total_q + seq.offset_q(p.seqlen_q, 1, bidb);
  Tensor gQ = local_tile(mQ, TileQ{}, make_coord(_, 0));    // (kBlockM, D, m)
  Tensor gdO = local_tile(mdO, TileQ{}, make_coord(_, 0));  // (kBlockM, D, m)
  auto at_head = [](auto const& t, int dh, int64_t head_stride) {
    return make_tensor(t.data() + dh * head_stride, t.layout());
  };

  extern __shared__ __align__(128) char smem[];
  constexpr int kQSize = Traits::kQSize, kKVSize = Traits::kKVSize, kPdSSize = Traits::kPdSSize;
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (kBlockM, D), stage 0
  constexpr int kStages = Traits::kStages;
  Tensor sdO = make_tensor(sQ.data() + kStages * kQSize, typename Traits::SmemLayoutQ{});       // (kBlockM, D), stage 0
  Tensor sK = make_tensor(sdO.data() + kStages * kQSize, typename Traits::SmemLayoutKV{});      // (kBlockN, D)
  Tensor sV = make_tensor(sK.data() + kKVSize, typename Traits::SmemLayoutKV{});        // (kBlockN, D)
  Tensor sP = make_tensor(sV.data() + kKVSize, typename Traits::SmemLayoutPdS{});       // (kBlockM, kBlockN)
  Tensor sdS = make_tensor(sP.data() + kPdSSize, typename Traits::SmemLayoutPdS{});     // (kBlockM, kBlockN)
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});       // (D, kBlockM)
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});     // (D, kBlockM)
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});       // (D, kBlockN)
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});     // (kBlockN, kBlockM)
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});   // (kBlockN, kBlockM)
  // Unswizzled shapes of the transposed operands, for sizing their register fragments.
  Tensor sPt_frag = make_tensor(sP.data(), get_nonswizzle_portion(typename Traits::SmemLayoutPdSt{}));  // (kBlockN, kBlockM)
  Tensor sQt_frag = make_tensor(sQ.data(), get_nonswizzle_portion(typename Traits::SmemLayoutQt{}));    // (D, kBlockM)
  Tensor sKt_frag = make_tensor(sK.data(), get_nonswizzle_portion(typename Traits::SmemLayoutKt{}));    // (D, kBlockN)
  // Stage s (0 or 1, alternating by step) of a partitioned Q / dO buffer; one buffer serves both when kStages == 1.
  auto stage = [](auto const& t, int s) { return make_tensor(t.data() + (kStages == 2 ? s : 0) * kQSize, t.layout()); };

  // Global -> shared.
  typename Traits::GmemTiledCopyIn gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);     // (CPY, CPY_M, CPY_D, m)
  Tensor tQsQ = gmem_thr.partition_D(sQ);     // (CPY, CPY_M, CPY_D)
  Tensor tdOgdO = gmem_thr.partition_S(gdO);  // (CPY, CPY_M, CPY_D, m)
  Tensor tdOsdO = gmem_thr.partition_D(sdO);  // (CPY, CPY_M, CPY_D)
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(TileQ{}));     // (CPY, CPY_M, CPY_D) -> (row, col)
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(TileKV{}));  // (CPY, CPY_N, CPY_D) -> (row, col)
  // Query block m of head h0 + dh into stage s, zero-filling rows past the sequence when check_rows.
  auto load_rows = [&](auto const& tSgS, auto const& tSsS, int64_t head_stride, int dh, int m_block, int s,
                       bool check_rows) {
    const int rows = seq.len_q - m_block * kBlockM;
    auto src = at_head(tSgS(_, _, _, m_block), dh, head_stride);
    if (check_rows) {
      load_tile<true>(gmem_copy, src, stage(tSsS, s), tQcQ, rows, p.head_dim);
    } else {
      load_tile<false>(gmem_copy, src, stage(tSsS, s), tQcQ, rows, p.head_dim);
    }
  };

  // S = Q K^T and dP = dO V^T share one MMA layout, so P and dP pair up element by element.
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto smem_copy_a_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto smem_copy_b_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  Tensor tSsQ = smem_copy_a_sdp.get_thread_slice(tid).partition_S(sQ);     // (CPY, CPY_M, CPY_D)
  Tensor tdPsdO = smem_copy_a_sdp.get_thread_slice(tid).partition_S(sdO);  // (CPY, CPY_M, CPY_D)
  Tensor tSsK = smem_copy_b_sdp.get_thread_slice(tid).partition_S(sK);     // (CPY, CPY_N, CPY_D)
  Tensor tdPsV = smem_copy_b_sdp.get_thread_slice(tid).partition_S(sV);    // (CPY, CPY_N, CPY_D)
  auto smem_copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma_sdp);
  auto smem_thr_pds = smem_copy_pds.get_thread_slice(tid);
  Tensor tPsP = smem_thr_pds.partition_D(sP);     // (CPY, CPY_M, CPY_N)
  Tensor tdSsdS = smem_thr_pds.partition_D(sdS);  // (CPY, CPY_M, CPY_N)
  Tensor tScS = rowcol_view(thr_sdp.partition_C(make_identity_tensor(TileS{})));  // (rows, cols) -> tile coords
  constexpr int kRows = decltype(size<0>(tScS))::value;

  // dV += P^T dO and dK += dS^T Q: both operands transposed out of shared memory. (Register fragments
  // are declared where they are used: kept at this scope, the big head dims' ones went to local memory.)
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto smem_copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto smem_copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  Tensor tdVsPt = smem_copy_a_dkv.get_thread_slice(tid).partition_S(sPt);    // (CPY, CPY_N, CPY_M)
  Tensor tdKsdSt = smem_copy_a_dkv.get_thread_slice(tid).partition_S(sdSt);  // (CPY, CPY_N, CPY_M)
  Tensor tdVsdOt = smem_copy_b_dkv.get_thread_slice(tid).partition_S(sdOt);  // (CPY, CPY_D, CPY_M)
  Tensor tdKsQt = smem_copy_b_dkv.get_thread_slice(tid).partition_S(sQt);    // (CPY, CPY_D, CPY_M)
  Tensor acc_dk = partition_fragment_C(mma_dkv, TileKV{});  // (MMA, MMA_N, MMA_D)
  Tensor acc_dv = partition_fragment_C(mma_dkv, TileKV{});  // (MMA, MMA_N, MMA_D)

  // dQ += dS K: dS as stored, K transposed.
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  auto smem_copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
  auto smem_copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
  Tensor tdQsdS = smem_copy_a_dq.get_thread_slice(tid).partition_S(sdS);  // (CPY, CPY_M, CPY_N)
  Tensor tdQsKt = smem_copy_b_dq.get_thread_slice(tid).partition_S(sKt);  // (CPY, CPY_D, CPY_N)

  const Window window(seq.len_q, seq.len_k, p);
  const Mask mask{window};
  // Softcap: the scores become t = tanh(S scale / softcap), whose softmax has softcap as its scale; dS picks
  // up the factor 1 - t^2 (score_mod.h).
  const ScoreMods mods(p, kExtended);
  const float scale_log2 = mods.scale_log2;
  static_assert(kExtended || !kDropout);
  const Dropout dropout_batch(p, bidb, 0);

  for (int n_block = split; n_block * kBlockN < seq.len_k; n_block += num_splits) {
    const BwdBlockRange blocks = bwd_block_range<kBlockM, kBlockN>(window, n_block);
    Tensor gK = local_tile(mK, TileKV{}, make_coord(n_block, 0));  // (kBlockN, D)
    Tensor gV = local_tile(mV, TileKV{}, make_coord(n_block, 0));  // (kBlockN, D)
    const int keys_left = seq.len_k - n_block * kBlockN;
    clear(acc_dk);
    clear(acc_dv);

    // Query blocks in visiting order: m_max - 1 down to m_min for head h0, then for h0 + 1, ...
    struct QueryBlock { int dh, m_block; };
    auto next_block = [&](int dh, int m_block) {
      return m_block > blocks.m_min ? QueryBlock{dh, m_block - 1} : QueryBlock{dh + 1, blocks.m_max - 1};
    };
    auto load_q = [&](int dh, int m_block, int s) {
      load_rows(tQgQ, tQsQ, p.q_head_stride, dh, m_block, s, m_block == blocks.m_max - 1);
    };
    auto load_do = [&](int dh, int m_block, int s) {
      load_rows(tdOgdO, tdOsdO, p.do_head_stride, dh, m_block, s, m_block == blocks.m_max - 1);
    };

    // One query block of head h0 + dh: S, dP -> P, dS -> dV, dK, dQ. Q[m] and dO[m] sit in stage s.
    auto step = [&](int dh, int m_block, int s, auto edges) CUTLASS_LAMBDA_FUNC_INLINE {
      const int row0 = m_block * kBlockM;
      const QueryBlock next = next_block(dh, m_block);
      const bool has_next = next.dh < group;
      // Rows past the sequence, and rows that saw no key (LSE -inf), get P = 0 through LSE = +inf.
      float lse_log2[kRows], dsum[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(tScS(r, 0));
        const float l = row < seq.len_q ? lse[dh * p.lse_head_stride + row] : INFINITY;
        lse_log2[r] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
        dsum[r] = row < seq.len_q ? softmax_d[dh * int64_t(p.total_q) + row] : 0.f;
      }
      // Dropout's keep bits, one per score, drawn before the GEMMs while few registers are live (by halves: the
      // warps hold 8-key halves of the 16-key blocks).
      constexpr int kCols = decltype(size<1>(tScS))::value;
      uint32_t kept_bits[(kRows * kCols + 31) / 32];
      const Dropout dropout = dropout_batch.with_head(p, bidb, h0 + dh);
      if constexpr (kDropout) dropout.draw_half_bits<kRows, kCols>(kept_bits, tScS, row0, n_block * kBlockN);
      cp_async_wait<0>();
      __syncthreads();  // Q, dO[m] have landed; every warp is done with the other stages, P and dS
      Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});   // (MMA, MMA_M, MMA_N)
      Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});  // (MMA, MMA_M, MMA_N)
      clear(acc_s);
      clear(acc_dp);
      {
        Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_D)
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_D)
        gemm_ss(mma_sdp, acc_s, tSrQ, stage(tSsQ, s), smem_copy_a_sdp, tSrK, tSsK, smem_copy_b_sdp);
      }
      {
        Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);  // (MMA, MMA_M, MMA_D)
        Tensor tdPrV = thr_sdp.partition_fragment_B(sV);    // (MMA, MMA_N, MMA_D)
        gemm_ss(mma_sdp, acc_dp, tdPrdO, stage(tdPsdO, s), smem_copy_a_sdp, tdPrV, tdPsV, smem_copy_b_sdp);
      }
      Tensor S = rowcol_view(acc_s);
      Tensor dP = rowcol_view(acc_dp);
      mods.cap(S, p);  // ALiBi's bias goes on below, once the softcap's derivative is taken
      mask.apply(edges, S, tScS, row0, n_block * kBlockN);
      // Dropout: dP of the dropped pairs to 0 and of the kept ones times the scale, so that dS = P (Z dP s - D);
      // P itself after.
      auto kept = [&](int r, int c) { return Dropout::kept_half_bit<kCols>(kept_bits, r, c); };
      if constexpr (kDropout) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) dP(r, c) = kept(r, c) ? dP(r, c) * dropout.scale : 0.f;
        }
      }
      // ALiBi's bias goes on after the softcap's derivative is taken (it does not change it).
      const auto alibi = mods.alibi(p, seq.len_q, seq.len_k, bidb, h0 + dh).tile(tScS, row0, n_block * kBlockN);
      auto probs = [&](auto extended) {  // extended: softcap and ALiBi, each where set
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(S); ++c) {
            float s = S(r, c), grad = 1.f;  // the plain kernel adds no bias: x + 0.f is an FADD per score
            if constexpr (decltype(extended)::value) {
              grad = mods.grad(s);
              s += alibi(r, c);  // 0 without
            }
            S(r, c) = fast_exp2(s * scale_log2 - lse_log2[r]);  // P
            dP(r, c) = S(r, c) * (dP(r, c) - dsum[r]) * grad;  // dS
          }
        }
      };
      probs(bool_constant<kExtended>{});
      if constexpr (kDropout) {  // P for dV: the dropped, scaled one
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) S(r, c) = kept(r, c) ? S(r, c) * dropout.scale : 0.f;
        }
      }
      cute::copy(smem_copy_pds, smem_thr_pds.retile_S(convert_fragment<Element>(acc_s)), tPsP);
      cute::copy(smem_copy_pds, smem_thr_pds.retile_S(convert_fragment<Element>(acc_dp)), tdSsdS);
      // The next block's loads go out only now, so that their shared-memory writes stay out of the S
      // and dP GEMMs (bwd +3% at d 64, +5% at d 256: benchmarks/TUNING.md steps 12-13).
      if (kStages == 2 && has_next) {
        load_q(next.dh, next.m_block, s ^ 1);
        load_do(next.dh, next.m_block, s ^ 1);
        cp_async_fence();
      }
      __syncthreads();  // P and dS are visible to every warp
      {
        Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt_frag);    // (MMA, MMA_N, MMA_M)
        Tensor tdVrdOt = thr_dkv.partition_fragment_B(sQt_frag);   // (MMA, MMA_D, MMA_M)
        gemm_ss(mma_dkv, acc_dv, tdVrPt, tdVsPt, smem_copy_a_dkv, tdVrdOt, stage(tdVsdOt, s), smem_copy_b_dkv);
      }
      // dQ before dK: its reductions then drain while dK's MMAs run, instead of queueing in front of
      // the next step's loads (2-4% on the backward, benchmarks/TUNING.md step 11).
      Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});  // (MMA, MMA_M, MMA_D)
      static_assert(decltype(size(acc_dq))::value % 4 == 0);
      clear(acc_dq);
      {
        Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);       // (MMA, MMA_M, MMA_N)
        Tensor tdQrKt = thr_dq.partition_fragment_B(sKt_frag);  // (MMA, MMA_D, MMA_N)
        gemm_ss(mma_dq, acc_dq, tdQrdS, tdQsdS, smem_copy_a_dq, tdQrKt, tdQsKt, smem_copy_b_dq);
      }
      float* dq_thr = dq_accum_thread<Traits>(p, seq, bidb, dq_split, h0 + dh, m_block, tid);
      CUTE_UNROLL
      for (int j = 0; j < size(acc_dq); j += 4) {
        red_add_global_x4(dq_thr + dq_accum_offset<Traits>(j), acc_dq(j), acc_dq(j + 1), acc_dq(j + 2), acc_dq(j + 3));
      }
      {
        Tensor tdKrdSt = thr_dkv.partition_fragment_A(sPt_frag);  // (MMA, MMA_N, MMA_M)
        Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt_frag);   // (MMA, MMA_D, MMA_M)
        gemm_ss(mma_dkv, acc_dk, tdKrdSt, tdKsdSt, smem_copy_a_dkv, tdKrQt, stage(tdKsQt, s), smem_copy_b_dkv);
      }
      if (kStages == 1 && has_next) {  // one buffer: the next block loads once every warp is done with this one
        __syncthreads();
        load_q(next.dh, next.m_block, s ^ 1);
        load_do(next.dh, next.m_block, s ^ 1);
        cp_async_fence();
      }
    };

    if (blocks.m_max > blocks.m_min) {
      load_tile<true>(gmem_copy, gmem_thr.partition_S(gK), gmem_thr.partition_D(sK), tKVcKV, keys_left, p.head_dim);
      load_tile<true>(gmem_copy, gmem_thr.partition_S(gV), gmem_thr.partition_D(sV), tKVcKV, keys_left, p.head_dim);
      load_q(0, blocks.m_max - 1, 0);
      load_do(0, blocks.m_max - 1, 0);
      cp_async_fence();
    }
    int s = 0;
    for (int dh = 0; dh < group; ++dh) {
      int m_block = blocks.m_max - 1;
      for (; m_block >= blocks.m_unmasked_max; --m_block, s ^= 1) step(dh, m_block, s, MaskBoth{});
      for (; m_block >= blocks.m_unmasked_min; --m_block, s ^= 1) step(dh, m_block, s, MaskNone{});
      for (; m_block >= blocks.m_min; --m_block, s ^= 1) step(dh, m_block, s, MaskRight{});
    }

    if (head_splits > 1) {  // this block's share: fp32 pair reductions (scaled and converted afterwards)
      Tensor tdKVcdKV = thr_dkv.partition_C(make_identity_tensor(TileKV{}));  // (MMA, MMA_N, MMA_D) -> (row, col)
      const int64_t first_key = seq.offset_k(p.seqlen_k, 1, bidb) + int64_t(n_block) * kBlockN;
      float* dk_acc = p.dq_accum + bwd_dkv_accum_offset(p, kHeadDim, 0, bidh_k, first_key);
      float* dv_acc = p.dq_accum + bwd_dkv_accum_offset(p, kHeadDim, 1, bidh_k, first_key);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dk); i += 2) {  // an m16n8 fragment's pairs are (row, col), (row, col + 1)
        const int row = get<0>(tdKVcdKV(i)), col = get<1>(tdKVcdKV(i));
        if (row < keys_left) {
          red_add_global_x2(dk_acc + int64_t(row) * kHeadDim + col, acc_dk(i), acc_dk(i + 1));
          red_add_global_x2(dv_acc + int64_t(row) * kHeadDim + col, acc_dv(i), acc_dv(i + 1));
        }
      }
      __syncthreads();  // the next key block's loads overwrite K and V
      continue;
    }
    // Epilogue: dK = scale dS^T Q; stage dK and dV through K and V's shared memory for 16-byte stores.
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
    auto smem_copy_dkv = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma_dkv);
    auto smem_thr_dkv = smem_copy_dkv.get_thread_slice(tid);
    __syncthreads();  // every warp is done reading K and V
    cute::copy(smem_copy_dkv, smem_thr_dkv.retile_S(convert_fragment<Element>(acc_dk)), smem_thr_dkv.partition_D(sK));
    cute::copy(smem_copy_dkv, smem_thr_dkv.retile_S(convert_fragment<Element>(acc_dv)), smem_thr_dkv.partition_D(sV));
    __syncthreads();
    typename Traits::GmemTiledCopyOut gmem_copy_out;
    auto gmem_thr_out = gmem_copy_out.get_thread_slice(tid);
    Tensor tdKsdK = gmem_thr_out.partition_S(sK);  // (CPY, CPY_N, CPY_D)
    Tensor tdVsdV = gmem_thr_out.partition_S(sV);  // (CPY, CPY_N, CPY_D)
    Tensor tdKVcdKV = gmem_thr_out.partition_D(make_identity_tensor(TileKV{}));  // (CPY, CPY_N, CPY_D) -> (row, col)
    Tensor tdKrdK = make_fragment_like(tdKsdK);
    Tensor tdVrdV = make_fragment_like(tdVsdV);
    cute::copy(gmem_copy_out, tdKsdK, tdKrdK);
    cute::copy(gmem_copy_out, tdVsdV, tdVrdV);
    Tensor gdK = local_tile(mdK, TileKV{}, make_coord(n_block, 0));  // (kBlockN, D)
    Tensor gdV = local_tile(mdV, TileKV{}, make_coord(n_block, 0));  // (kBlockN, D)
    store_tile(gmem_copy_out, tdKrdK, gmem_thr_out.partition_D(gdK), tdKVcdKV, keys_left, p.head_dim);
    store_tile(gmem_copy_out, tdVrdV, gmem_thr_out.partition_D(gdV), tdKVcdKV, keys_left, p.head_dim);
    __syncthreads();  // the next key block's loads overwrite K and V
  }
}

}  // namespace flash_attn2
