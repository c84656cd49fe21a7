// Launcher for one (head dim, dtype) Hopper backward: the kernel of the call's kind on its tile
// (sm90/tile_size.h), its TMA descriptors and grid, then dQ from its fp32 accumulator (and, with head splits,
// dK and dV from theirs; bwd_aux.cu converts both). The preprocess (D = rowsum(dO o O) and LSE * log2(e) side
// by side, zeroed dq_accum) runs before, as for SM80.
#pragma once

#include <algorithm>
#include <climits>
#include <type_traits>

#include "common/bwd_workspace.h"
#include "common/head_dims.h"
#include "common/launch.h"
#include "common/launchers.h"
#include "sm90/bwd_kernel.h"
#include "sm90/tma.h"

namespace flash_attn2 {

// A 1-D TMA over `elements` floats (D and LSE), read in boxes of kRowsBox (traits).
template <class Traits>
typename Traits::TmaRows make_tma_rows(const float* ptr, int64_t elements) {
  using namespace cute;
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(int(elements))));
  return make_tma_copy(SM90_TMA_LOAD{}, t, typename Traits::SmemLayoutRows{});
}

template <class Traits, bool kExtended, bool kDropout>
cudaError_t launch_bwd_sm90_traits(const BwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  const int head_splits = plan.head_splits;
  const int64_t key_blocks = TileScheduler<Traits::kBlockN, /*kKeys=*/true>::num_blocks(p);
  if (key_blocks == 0) return cudaSuccess;
  const int64_t num_blocks = key_blocks * head_splits;
  if (num_blocks > INT_MAX / 2) return cudaErrorInvalidValue;  // the blocks' last claims run past it by a grid
  auto kernel = &bwd_kernel_sm90<Traits, kExtended, kDropout>;
  if (cudaError_t err = allow_dynamic_smem(kernel, Traits::kSmemBytes, plan.device)) return err;
  const auto shape_q = sm90::tma_shape<true>(p), shape_k = sm90::tma_shape<false>(p);
  // dO and V through extents of the value side's head dim (MLA: d_v < d_qk, common/head_dims.h): the tiles stay
  // kHeadDim wide and TMA fills the columns past d_v with zeros, which add nothing to dP = dO V^T and give dV
  // columns of zeros that the epilogue clips; no padded copies of v, out and dout.
  const int head_dim_v = value_head_dim(p);
  const auto shape_do = sm90::tma_shape<true>(p, head_dim_v), shape_v = sm90::tma_shape<false>(p, head_dim_v);
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
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.dout, shape_do, p.do_row_stride, p.do_head_stride,
                                                    p.do_batch_stride, smem_q, typename Traits::TileQ{}),
      sm90::make_tma<Traits, typename Traits::TmaK>(SM90_TMA_LOAD{}, p.k, shape_k, p.k_row_stride, p.k_head_stride,
                                                    p.k_batch_stride, typename Traits::SmemLayoutK{}, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmaV>(SM90_TMA_LOAD{}, p.v, shape_v, p.v_row_stride, p.v_head_stride,
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
  // Q, dO and dQ-accumulator rows fit in L2 (heuristics.h: bwd_causal_pair_fits_l2; three pairs were 5% slower
  // at Qwen2.5-7B 8k, TUNING 84).
  constexpr int kWideCausalSection = 8, kNarrowCausalTail = 2;
  const int pairs = p.batch * p.num_heads_k;
  const int key_blocks_per_pair = int((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  if (p.causal && p.cu_seqlens_k == nullptr) {
    if constexpr (Traits::kWide) {
      if (p.num_heads == p.num_heads_k && pairs >= 2 * kWideCausalSection) {
        args.causal_keys = {key_blocks_per_pair, kWideCausalSection, 0};
      }
    } else {
      if (pairs >= kNarrowCausalTail && plan.causal_pair_fits_l2) {
        args.causal_keys = {key_blocks_per_pair, 1, kNarrowCausalTail};
      }
    }
  }
  if (sm90::tma_encode_failed) return cudaErrorInvalidValue;
  // Persistent: one block per SM (one fits), claiming slots as it frees up. Deterministic mode keeps one block
  // per slot: its dQ turns wait only for lower-numbered blocks, which start first (dq_turns.h).
  int grid = int(num_blocks);
  if (p.num_splits == 0) grid = int(std::min<int64_t>(num_blocks, plan.device.num_sms));
  if (cudaError_t err = launch_after(kernel, dim3(unsigned(grid)), dim3(Traits::kNThreads), Traits::kSmemBytes,
                                     stream, args)) {
    return err;
  }

  if (cudaError_t err = launch_bwd_convert_dq_sm90(p, kHeadDim, Traits::kDQFragments, stream)) return err;
  return head_splits > 1 ? launch_bwd_convert_dkv(p, kHeadDim, stream) : cudaSuccess;
}

template <int kHeadDim, DType kDType, Kind kKind>
cudaError_t launch_bwd_sm90_kind(const BwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  using Traits = BwdTraitsSm90For<kHeadDim, ElementOf<kDType>, kKind>;
  return launch_bwd_sm90_traits<Traits, is_extended(kKind), kKind == Kind::kDropout>(p, plan, stream);
}

// The kernel of the call's kind at this head dim (bwd_kind_sm90: ALiBi alone has a plain kernel at d 64 / 128).
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd_sm90(const BwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  switch (bwd_kind_sm90(kHeadDim, plan.kind)) {
    case Kind::kDropout: return launch_bwd_sm90_kind<kHeadDim, kDType, Kind::kDropout>(p, plan, stream);
    case Kind::kExtended: return launch_bwd_sm90_kind<kHeadDim, kDType, Kind::kExtended>(p, plan, stream);
    case Kind::kPlainAlibi:
      if constexpr (bwd_kind_sm90(kHeadDim, Kind::kPlainAlibi) == Kind::kPlainAlibi) {
        return launch_bwd_sm90_kind<kHeadDim, kDType, Kind::kPlainAlibi>(p, plan, stream);
      }
      return cudaErrorInvalidValue;  // not reached: bwd_kind_sm90 maps it to kExtended here
    default: return launch_bwd_sm90_kind<kHeadDim, kDType, Kind::kPlain>(p, plan, stream);
  }
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_BWD_SM90(HEAD_DIM, DTYPE)                                                   \
  template cudaError_t flash_attn2::launch_bwd_sm90<HEAD_DIM, flash_attn2::DType::DTYPE>(                \
      const flash_attn2::BwdParams&, const flash_attn2::LaunchPlan&, cudaStream_t);
