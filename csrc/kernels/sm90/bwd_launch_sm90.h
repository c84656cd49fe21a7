// Launcher for one (head dim, dtype) Hopper backward: TMA descriptors, the main kernel, then dQ from its
// fp32 accumulator (and, with head splits, dK and dV from theirs; bwd_aux.cu converts both). The
// preprocess (D = rowsum(dO o O) and LSE * log2(e) side by side, zeroed dq_accum) runs before, as for SM80.
#pragma once

#include <algorithm>
#include <climits>
#include <type_traits>

#include "common/launch.h"
#include "common/registry.h"
#include "sm90/bwd_kernel_sm90.h"
#include "sm90/tma.h"

namespace flash_attn2 {

// A 1-D TMA over `elements` floats (D and LSE), read in boxes of kRowsBox (traits).
template <class Traits>
typename Traits::TmaRows make_tma_rows(const float* ptr, int64_t elements) {
  using namespace cute;
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(int(elements))));
  return make_tma_copy(SM90_TMA_LOAD{}, t, typename Traits::SmemLayoutRows{});
}

template <class Traits, bool kExtended, bool kDropout = false>
cudaError_t launch_bwd_sm90_traits(const BwdParams& p, int head_splits, cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  const int64_t key_blocks = QueryTileScheduler<Traits::kBlockN, /*kKeys=*/true>::num_blocks(p);
  if (key_blocks == 0) return cudaSuccess;
  const int64_t num_blocks = key_blocks * head_splits;
  if (num_blocks > INT_MAX / 2) return cudaErrorInvalidValue;  // the blocks' last claims run past it by a grid
  auto kernel = &bwd_kernel_sm90<Traits, kExtended, kDropout>;
  if (cudaError_t err = allow_dynamic_smem(kernel, Traits::kSmemBytes)) return err;
  const auto shape_q = sm90::tma_shape<true>(p), shape_k = sm90::tma_shape<false>(p);
  const int64_t rows_extent = bwd_tile_counter_offset(p);  // D and LSE
  if (rows_extent > INT_MAX) return cudaErrorInvalidValue;  // TMA coordinates are int
  sm90::tma_encode_failed = false;
  using cute::SM90_TMA_LOAD;
  const auto smem_q = cute::take<0, 2>(typename Traits::SmemLayoutQ{});
  const auto tma_dq = [&] {  // dq_accum's rows (bwd_dq_accum_offset_sm90), or none for fragments (bulk reduce)
    if constexpr (Traits::kDQFragments) {
      return typename Traits::TmadQ{};
    } else {
      return sm90::make_tma<Traits, typename Traits::TmadQ, float>(
          cute::SM90_TMA_REDUCE_ADD{}, p.dq_accum, cute::make_shape(int(p.total_q), kHeadDim, p.num_heads, 1), kHeadDim,
          p.total_q * kHeadDim, 0, typename Traits::SmemLayoutdQ{}, typename Traits::TiledQ{});
    }
  }();
  BwdArgsSm90<Traits> args{
      p,
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.q, shape_q, p.q_row_stride, p.q_head_stride,
                                                    p.q_batch_stride, smem_q, typename Traits::TileQ{}),
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.dout, shape_q, p.do_row_stride, p.do_head_stride,
                                                    p.do_batch_stride, smem_q, typename Traits::TileQ{}),
      sm90::make_tma<Traits, typename Traits::TmaK>(SM90_TMA_LOAD{}, p.k, shape_k, p.k_row_stride, p.k_head_stride,
                                                    p.k_batch_stride, typename Traits::SmemLayoutK{}, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmaV>(SM90_TMA_LOAD{}, p.v, shape_k, p.v_row_stride, p.v_head_stride,
                                                     p.v_batch_stride, typename Traits::SmemLayoutV{}, typename Traits::TileKV{}),
      tma_dq,
      make_tma_rows<Traits>(p.softmax_d, rows_extent),
      int(rows_extent),
      head_splits,
      {},
      reinterpret_cast<int*>(p.softmax_d + bwd_tile_counter_offset(p)),
  };
  // Causal key blocks longest first. At the wide shape (head dim > 128), MHA: in sections of 8 pairs, not
  // pair by pair, so that the long key blocks of the last pairs do not start last (d 256 causal 1k-8k, H100:
  // 3-15% faster, 512 unchanged; with GQA (Gemma-2, group 2) 1-3% slower, and d 128 measured either way in
  // two runs: TUNING 42). At least two sections: a single one is the rank-major order that loses L2
  // (TUNING 41). The narrow shape goes pair by pair but for the last two pairs, interleaved, where one pair's
  // Q, dO and dQ-accumulator rows fit in L2: GQA at d 64 4% faster, Llama-3-8B 8k 2% (34 MB a pair);
  // Qwen2.5-7B 8k (59 MB a pair) 0-3% slower, and 5% with three pairs (TUNING 84).
  constexpr int kWideCausalSection = 8, kNarrowCausalTail = 2;
  const int pairs = p.batch * p.num_heads_k;
  const int key_blocks_per_pair = int((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  if (p.causal && p.cu_seqlens_k == nullptr) {
    if constexpr (Traits::kWide) {
      if (p.num_heads == p.num_heads_k && pairs >= 2 * kWideCausalSection) {
        args.causal_keys = {key_blocks_per_pair, kWideCausalSection, 0};
      }
    } else {
      int l2_bytes = 0;
      if (cudaError_t err = device_l2_bytes(&l2_bytes)) return err;
      const int64_t pair_bytes = int64_t(p.num_heads / p.num_heads_k) * p.seqlen_q * bwd_row_bytes(kHeadDim);
      if (pairs >= kNarrowCausalTail && pair_bytes <= l2_bytes) {
        args.causal_keys = {key_blocks_per_pair, 1, kNarrowCausalTail};
      }
    }
  }
  if (sm90::tma_encode_failed) return cudaErrorInvalidValue;
  // Persistent: one block per SM (one fits), claiming slots as it frees up. Deterministic mode keeps one block
  // per slot: its dQ turns wait only for lower-numbered blocks, which start first (dq_turns.h).
  int grid = int(num_blocks);
  if (p.num_splits == 0) {
    int num_sms = 0;
    if (cudaError_t err = device_sm_count(&num_sms)) return err;
    grid = int(std::min<int64_t>(num_blocks, num_sms));
  }
  if (cudaError_t err = launch_after(kernel, dim3(unsigned(grid)), dim3(Traits::kNThreads), Traits::kSmemBytes,
                                     stream, args)) {
    return err;
  }

  if (cudaError_t err = launch_bwd_convert_dq_sm90(p, kHeadDim, Traits::kDQFragments, stream)) return err;
  return head_splits > 1 ? launch_bwd_convert_dkv(p, kHeadDim, stream) : cudaSuccess;
}

// The extended kernel at d 64 takes 64 query rows per step: with 128 its softcap / ALiBi registers spilled
// 344 B (the plain kernel 156). And it waits for both GEMMs before one pass over P and dS, where the plain
// pipeline forms P^T while dP^T runs. So ALiBi alone, which changes P but not dS = P (dP - D), gets a fourth
// kernel at d 64 and 128: the plain one with the bias added to S^T, 9-16% faster (TUNING 74-75).
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd_sm90(const BwdParams& p, int head_splits, cudaStream_t stream) {
  using Element = ElementOf<kDType>;
  using Traits = BwdTraitsSm90For<kHeadDim, Element>;
  using TraitsExtended = std::conditional_t<kHeadDim == 64, BwdTraitsSm90<64, Element, 64>, Traits>;
  if (p.dropout_p > 0.f) return launch_bwd_sm90_traits<TraitsExtended, true, true>(p, head_splits, stream);
  if constexpr (kHeadDim == 64 || kHeadDim == 128) {
    if (p.alibi_slopes != nullptr && p.softcap == 0.f) {
      using TraitsAlibi = BwdTraitsSm90<kHeadDim, Element, Traits::kBlockM, /*kPlainAlibi=*/true>;
      return launch_bwd_sm90_traits<TraitsAlibi, false>(p, head_splits, stream);
    }
  }
  return bwd_extended(p) ? launch_bwd_sm90_traits<TraitsExtended, true>(p, head_splits, stream)
                         : launch_bwd_sm90_traits<Traits, false>(p, head_splits, stream);
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_BWD_SM90(HEAD_DIM, DTYPE) \
  template cudaError_t flash_attn2::launch_bwd_sm90<HEAD_DIM, flash_attn2::DType::DTYPE>(const flash_attn2::BwdParams&, int, cudaStream_t);
