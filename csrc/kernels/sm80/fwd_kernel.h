// FlashAttention-2 forward: O = softmax(scale * Q K^T) V for one (kBlockM query rows, batch, head) block.
//
// Q stays in shared memory; K and V tiles stream through one buffer each with cp.async so the load of
// V[n] overlaps S = Q K[n]^T and the load of K[n - 1] overlaps the softmax and O += P V[n]. Warps split
// Q's rows, so the softmax statistics of a row live in one quad of one warp.
#pragma once

#include <cute/tensor.hpp>

#include "common/block_range.h"
#include "common/dropout.h"
#include "flash_attn2/flash_attn2.h"
#include "sm80/kernel_traits.h"
#include "common/mask.h"
#include "common/score_mod.h"
#include "common/seqlen.h"
#include "common/softmax.h"
#include "common/tile_scheduler.h"
#include "common/utils.h"

namespace flash_attn2 {

// One (kBlockM query rows, batch, head) tile: S = Q K^T -> mask -> online softmax -> O += P V over the
// visible key blocks, then O and the LSE. m_block * kBlockM < seq.len_q. kExtended (kernel_kind.h): a
// window's left edge, whose blocks mask both edges, softcap and ALiBi; with kDropout (a kernel of its
// own, as on Hopper) also dropout.
template <class Traits, bool kExtended, bool kDropout>
__device__ __forceinline__ void fwd_tile(const FwdParams& params, const SeqlenInfo& seq, int bidb, int bidh,
                                         int m_block) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
  const int tid = threadIdx.x;
  const int bidh_k = bidh / (params.num_heads / params.num_heads_k);
  const Window window(seq.len_q, seq.len_k, params);
  const BlockRange blocks = fwd_block_range<kBlockM, kBlockN, kExtended>(window, m_block);
  const int rows_left = seq.len_q - m_block * kBlockM;

  Tensor mQ = gmem_rows<kHeadDim>(static_cast<const Element*>(params.q) + seq.offset_q(params.q_batch_stride, params.q_row_stride, bidb) +
                          bidh * params.q_head_stride,
                      seq.len_q, params.q_row_stride);  // (len_q, D)
  Tensor mK = gmem_rows<kHeadDim>(static_cast<const Element*>(params.k) + seq.offset_k(params.k_batch_stride, params.k_row_stride, bidb) +
                          bidh_k * params.k_head_stride,
                      seq.len_k, params.k_row_stride);  // (len_k, D)
  Tensor mV = gmem_rows<kHeadDim>(static_cast<const Element*>(params.v) + seq.offset_k(params.v_batch_stride, params.v_row_stride, bidb) +
                          bidh_k * params.v_head_stride,
                      seq.len_k, params.v_row_stride);  // (len_k, D)
  Tensor mO = gmem_rows<kHeadDim>(static_cast<Element*>(params.out) + seq.offset_q(params.o_batch_stride, params.o_row_stride, bidb) +
                          bidh * params.o_head_stride,
                      seq.len_q, params.o_row_stride);  // (len_q, D)
  Tensor gQ = local_tile(mQ, TileQ{}, make_coord(m_block, 0));   // (kBlockM, D)
  Tensor gK = local_tile(mK, TileKV{}, make_coord(_, 0));        // (kBlockN, D, n)
  Tensor gV = local_tile(mV, TileKV{}, make_coord(_, 0));        // (kBlockN, D, n)
  Tensor gO = local_tile(mO, TileQ{}, make_coord(m_block, 0));   // (kBlockM, D)
  float* lse = params.lse + seq.offset_q(params.lse_batch_stride, 1, bidb) + bidh * params.lse_head_stride +
               m_block * kBlockM;

  extern __shared__ __align__(128) char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (kBlockM, D)
  Tensor sK = make_tensor(sQ.data() + cosize(typename Traits::SmemLayoutQ{}), typename Traits::SmemLayoutKV{});  // (kBlockN, D)
  Tensor sV = make_tensor(sK.data() + cosize(typename Traits::SmemLayoutKV{}), typename Traits::SmemLayoutKV{});  // (kBlockN, D)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});  // (D, kBlockN)
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutQ{});    // (kBlockM, D), once Q is done

  // Global -> shared.
  typename Traits::GmemTiledCopyIn gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);                           // (CPY, CPY_M, CPY_D)
  Tensor tQsQ = gmem_thr.partition_D(sQ);                           // (CPY, CPY_M, CPY_D)
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(TileQ{}));  // (CPY, CPY_M, CPY_D) -> (row, col)
  Tensor tKgK = gmem_thr.partition_S(gK);                           // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr.partition_D(sK);                           // (CPY, CPY_N, CPY_D)
  Tensor tVgV = gmem_thr.partition_S(gV);                           // (CPY, CPY_N, CPY_D, n)
  Tensor tVsV = gmem_thr.partition_D(sV);                           // (CPY, CPY_N, CPY_D)
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(TileKV{}));  // (CPY, CPY_N, CPY_D) -> (row, col)
  auto load_k = [&](int n_block, auto check_rows) {
    load_tile<decltype(check_rows)::value>(gmem_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV,
                                           seq.len_k - n_block * kBlockN, params.head_dim);
  };
  auto load_v = [&](int n_block, auto check_rows) {
    load_tile<decltype(check_rows)::value>(gmem_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV,
                                           seq.len_k - n_block * kBlockN, params.head_dim);
  };

  // Tensor cores: S = Q K^T and O += P V, operands staged through registers by ldmatrix.
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(
      make_tensor(sV.data(), get_nonswizzle_portion(typename Traits::SmemLayoutVt{})));  // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(mma, TileQ{});  // (MMA, MMA_M, MMA_D)
  clear(acc_o);
  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma);
  Tensor tSsQ = smem_copy_q.get_thread_slice(tid).partition_S(sQ);   // (CPY, CPY_M, CPY_D)
  Tensor tSsK = smem_copy_k.get_thread_slice(tid).partition_S(sK);   // (CPY, CPY_N, CPY_D)
  Tensor tOsVt = smem_copy_v.get_thread_slice(tid).partition_S(sVt);  // (CPY, CPY_D, CPY_N)

  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(TileS{})));  // (rows, cols) -> tile coords
  const Mask mask{window};
  const ScoreMods mods(params, kExtended);
  // Causal ALiBi's key-only form pinned at the tile's last diagonal (Alibi::pinned): its LSE shift goes back on in
  // the epilogue. Not with dropout: pinned, the d 128 dropout kernel's spills grew (SASS local accesses 128 -> 154)
  // and it ran 7 % slower (TUNING 195); it keeps the key-only form and its LSE error (<= ~1.4e-3 at slope 1).
  const int alibi_pin = (m_block * kBlockM + kBlockM - 1 - seq.len_q) + seq.len_k;  // no sum past 32 bits (mask.h)
  const Alibi unpinned_alibi = mods.alibi(params, seq.len_q, seq.len_k, bidb, bidh);
  const Alibi alibi = kDropout ? unpinned_alibi : unpinned_alibi.pinned(alibi_pin);
  static_assert(kExtended || !kDropout);
  const Dropout dropout(params, bidb, bidh);
  OnlineSoftmax<decltype(size<0>(tScS))::value> softmax(mods.scale(params));

  // One iteration over key block n: S = Q K^T -> mask -> online softmax -> O += P V.
  auto step = [&](int n_block, auto edges) CUTLASS_LAMBDA_FUNC_INLINE {
    Tensor acc_s = partition_fragment_C(mma, TileS{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K[n] has landed, and every warp is done reading V[n + 1]
    load_v(n_block, bool_constant<decltype(edges)::value != MaskNone::value>{});  // the last block may be cut
    cp_async_fence();
    gemm_ss(mma, acc_s, tSrQ, tSsQ, smem_copy_q, tSrK, tSsK, smem_copy_k);
    Tensor S = rowcol_view(acc_s);
    if constexpr (kExtended) mods.apply(S, params, alibi, tScS, m_block * kBlockM, n_block * kBlockN);
    mask.apply(edges, S, tScS, m_block * kBlockM, n_block * kBlockN);
    cp_async_wait<0>();
    __syncthreads();  // V[n] has landed, and every warp is done reading K[n]
    if (n_block > blocks.n_min) {
      load_k(n_block - 1, false_type{});
      cp_async_fence();
    }
    Tensor O = rowcol_view(acc_o);
    softmax.update(S, O);
    // Dropout after the row sums: they, and so the LSE, are the undropped softmax's.
    if constexpr (kDropout) dropout.apply(S, tScS, m_block * kBlockM, n_block * kBlockN);
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));  // (MMA, MMA_M, MMA_N / 2)
    gemm_rs(mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v);
  };

  if (blocks.n_max > blocks.n_min) {
    load_tile<true>(gmem_copy, tQgQ, tQsQ, tQcQ, rows_left, params.head_dim);
    load_k(blocks.n_max - 1, true_type{});
    cp_async_fence();
  }
  int n_block = blocks.n_max - 1;
  if constexpr (kExtended) {  // one loop and one masked step for both edges: fewer copies, fewer spills
    for (; n_block >= blocks.n_min; --n_block) {
      if (n_block >= blocks.n_masked_min || n_block < blocks.n_unmasked_min) {
        step(n_block, MaskBoth{});
      } else {
        step(n_block, MaskNone{});
      }
    }
  } else {
    for (; n_block >= blocks.n_masked_min; --n_block) step(n_block, MaskRight{});
    for (; n_block >= blocks.n_min; --n_block) step(n_block, MaskNone{});
  }

  // Epilogue: normalize (with the head's sink, if any), stage O through shared memory for 16-byte stores, write
  // the LSE.
  float row_lse[decltype(size<0>(tScS))::value];
  {
    Tensor O = rowcol_view(acc_o);
    const float sink = sink_logit(params, bidh);
    if constexpr (kExtended && !kDropout) {
      // slope x pin, with the call's slope (read again: the held one is over the scale, and negated).
      const float shift = params.alibi_slopes == nullptr || !alibi.key_only
                              ? 0.f
                              : Alibi::call_slope(params, bidb, bidh) * float(alibi_pin);
      softmax.finalize(O, row_lse, [sink](int) { return sink; }, [shift](int) { return shift; });
    } else {
      softmax.finalize(O, row_lse, [sink](int) { return sink; });
    }
  }
  if constexpr (kDropout) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= dropout.scale;
  }
  Tensor rO = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
  cute::copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

  if (get<1>(tScS(0, 0)) == 0) {  // the quad's first thread owns column 0 of its rows
    CUTE_UNROLL
    for (int r = 0; r < size<0>(tScS); ++r) {
      const int row = get<0>(tScS(r, 0));
      if (row < rows_left) lse[row] = row_lse[r];
    }
  }
  __syncthreads();
  typename Traits::GmemTiledCopyOut gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(tid);
  Tensor tOsO = gmem_thr_o.partition_S(sO);                           // (CPY, CPY_M, CPY_D)
  Tensor tOgO = gmem_thr_o.partition_D(gO);                           // (CPY, CPY_M, CPY_D)
  Tensor tOcO = gmem_thr_o.partition_D(make_identity_tensor(TileQ{}));  // (CPY, CPY_M, CPY_D) -> (row, col)
  Tensor tOrO = make_fragment_like(tOsO);
  cute::copy(gmem_copy_o, tOsO, tOrO);
  store_tile(gmem_copy_o, tOrO, tOgO, tOcO, rows_left, params.head_dim);
}

template <class Traits, bool kExtended, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const __grid_constant__ FwdParams params) {
  if (kDropout && blockIdx.x == 0 && threadIdx.x == 0) Dropout::record(params);
  const auto tile = TileScheduler<Traits::kBlockM>::get(params);
  if (params.cu_seqlens_q != nullptr && tile.owns_slot) {  // rows outside every sequence, shared by the head's blocks
    const UncoveredRows uncovered(params.cu_seqlens_q, params.batch, params.total_q);
    uncovered.zero_fill(static_cast<typename Traits::Element*>(params.out) + tile.bidh * params.o_head_stride,
                        params.o_row_stride, params.head_dim, params.lse + tile.bidh * params.lse_head_stride,
                        int64_t(tile.rank) * Traits::kNThreads + threadIdx.x, int64_t(tile.ranks) * Traits::kNThreads);
  }
  if (tile.valid) fwd_tile<Traits, kExtended, kDropout>(params, SeqlenInfo(params, tile.bidb), tile.bidb, tile.bidh, tile.block);
}

}  // namespace flash_attn2
