// Launcher for one (head dim, dtype) Hopper forward: the kernel of the call's kind on its tile
// (sm90/tile_size.h), its TMA descriptors, the grid (persistent or one block per tile) and the causal tile
// order. Each csrc/instantiations/fwd_*_sm90.cu instantiates one.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "common/launchers.h"
#include "sm90/fwd_kernel.h"
#include "sm90/tma.h"

namespace flash_attn2 {

template <class Traits, Kind kKind>
cudaError_t launch_fwd_sm90_traits(const FwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  const int64_t num_blocks = TileScheduler<Traits::kBlockM>::num_blocks(p);
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = &fwd_kernel_sm90<Traits, is_extended(kKind), kKind == Kind::kDropout>;
  if constexpr (kKind == Kind::kPlain) {  // (a ternary would compile the paged kernel for every kind's tile)
    if (p.page_table != nullptr) kernel = &fwd_kernel_sm90<Traits, false, false, /*kPaged=*/true>;
  }
  if (cudaError_t err = allow_dynamic_smem(kernel, Traits::kSmemBytes, plan.device)) return err;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const auto shape_q = sm90::tma_shape<true>(p), shape_k = sm90::tma_shape_kv(p, p.head_dim);
  const auto shape_v = sm90::tma_shape_kv(p, Traits::head_dim_v(p));
  const auto shape_o = sm90::tma_shape<true>(p, Traits::head_dim_v(p));
  sm90::tma_encode_failed = false;
  using cute::SM90_TMA_LOAD, cute::SM90_TMA_STORE;
  const auto smem_k = cute::take<0, 2>(typename Traits::SmemLayoutKV{});
  const auto smem_v = cute::take<0, 2>(typename Traits::SmemLayoutV{});
  FwdArgsSm90<Traits> args{
      p,
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.q, shape_q, p.q_row_stride, p.q_head_stride,
                                                    p.q_batch_stride, typename Traits::SmemLayoutQWarpgroup{},
                                                    typename Traits::TileQWarpgroup{}),
      sm90::make_tma<Traits, typename Traits::TmaKV>(SM90_TMA_LOAD{}, p.k, shape_k, p.k_row_stride, p.k_head_stride,
                                                     p.k_batch_stride, smem_k, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmaV>(SM90_TMA_LOAD{}, p.v, shape_v, p.v_row_stride, p.v_head_stride,
                                                    p.v_batch_stride, smem_v, typename Traits::TileV{}),
      sm90::make_tma<Traits, typename Traits::TmaO>(SM90_TMA_STORE{}, p.out, shape_o, p.o_row_stride, p.o_head_stride,
                                                    p.o_batch_stride, typename Traits::SmemLayoutOWarpgroup{},
                                                    typename Traits::TileOWarpgroup{}),
      false,
      {},
      nullptr,
      {},
      {},
  };
  if (p.page_table != nullptr) {
    const int box_rows = paged_box_rows_sm90(p.page_size, Traits::kBlockN, Traits::kHeadDim);  // fwd_produce_tile's
    if (!(sm90::make_paged_tma<typename Traits::Element, Traits::kAtomCols>(&args.paged_k, p.k, p, p.head_dim,
                                                                            p.k_row_stride, p.k_head_stride,
                                                                            p.k_batch_stride, box_rows) &&
          sm90::make_paged_tma<typename Traits::Element, Traits::kAtomColsV>(
              &args.paged_v, p.v, p, Traits::head_dim_v(p), p.v_row_stride, p.v_head_stride, p.v_batch_stride,
              box_rows))) {
      return cudaErrorInvalidValue;
    }
  }
  if (sm90::tma_encode_failed) return cudaErrorInvalidValue;
  // Fixed length: a persistent grid, one block per SM (at most one fits) walking the slots
  // (sm90/scheduler.h); causal tiles longest first in L2-sized sections of heads (CausalTileOrder),
  // handed out as blocks free up where the caller gave a tile counter. Varlen: one block per slot, which
  // the hardware hands out as SMs free up (tiles differ in work with the sequences); so does causal above
  // Traits::kPersistentCausalMax (kPersistentCausalMaxStatic without a tile counter).
  const int causal_max = p.tile_counter != nullptr ? Traits::kPersistentCausalMax : Traits::kPersistentCausalMaxStatic;
  // KV-cache calls too (the consumers' V-tail barrier counts differ from tile to tile: fwd_mainloop.h).
  const bool persistent = !varlen && !has_kv_cache(p) && !(p.causal && p.seqlen_q > causal_max);
  int grid = int(num_blocks);
  if (persistent) grid = num_blocks < plan.device.num_sms ? int(num_blocks) : plan.device.num_sms;
  args.causal_order = persistent && p.causal && grid < num_blocks;
  if (args.causal_order) {
    // Sections of about two waves of tiles, at most 16 MB of K and V (a query head's share: its KV head
    // serves the group). 32 MB sections ran d 128 causal 16k at 0.90x the one-block-per-tile grid.
    const int group = p.num_heads / p.num_heads_k;
    const int num_m_blocks = int((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
    const int64_t kv_bytes =
        int64_t(p.seqlen_k) * (p.head_dim + Traits::head_dim_v(p)) * int(sizeof(typename Traits::Element)) / group;
    const int64_t by_l2 = (int64_t(16) << 20) / (kv_bytes > 0 ? kv_bytes : 1);
    const int64_t by_waves = (2 * int64_t(grid) + num_m_blocks - 1) / num_m_blocks;
    // At least a wave of tiles per section: the fixed order gives a block no tile in a section smaller
    // than the grid (d 128 causal 512 x 32k keys would have run on 4 blocks).
    const int64_t min_heads = (int64_t(grid) + num_m_blocks - 1) / num_m_blocks;
    int64_t heads = std::max(std::min(by_waves, by_l2), min_heads);
    // A section divides a query-head group or holds whole groups, so that none reads two KV heads where one
    // would do: with 28:4 heads at 32k, sections of 2 query heads put two 16 MB KV heads in flight in 2 of
    // every 7.
    if (heads <= group) {
      while (group % heads != 0) ++heads;
    } else {
      heads = (heads + group - 1) / group * group;
    }
    heads = std::min(heads, int64_t(p.batch) * p.num_heads);
    args.causal_tiles = {num_m_blocks, int(heads), 0};
  }
  // The counter wherever a block walks more than one slot and the caller passed one: a causal grid's (longest
  // first), and a non-causal one's (the torch op passes one only for "dynamic": the ring's blocks), so that
  // blocks which start late (their SMs held by another stream's kernel) take fewer tiles instead of delaying their
  // fixed share.
  if (persistent && grid < num_blocks && p.tile_counter != nullptr) {
    if (cudaError_t err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream)) return err;
    args.tile_counter = p.tile_counter;
  }
  kernel<<<unsigned(grid), Traits::kNThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// kHeadDimV: V's and O's head dim (MLA's pairs, launch_fwd_sm90_pair); the tile is Q / K's head dim's, whose
// shared memory budget holds the narrower V too.
template <int kHeadDim, DType kDType, Kind kKind, int kHeadDimV = kHeadDim>
cudaError_t launch_fwd_sm90_kind(const FwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  static_assert(kHeadDimV <= kHeadDim, "a pair's V is at most Q / K's head dim wide (the tile is sized for Q / K's)");
  using Element = ElementOf<kDType>;
  if constexpr (kKind == Kind::kPlain && fwd_short_causal_max_seqlen_q_sm90(kHeadDim) > 0) {
    if (p.causal && p.cu_seqlens_q == nullptr && p.seqlen_q <= fwd_short_causal_max_seqlen_q_sm90(kHeadDim)) {
      using Short = FwdTraitsSm90<kHeadDim, Element, FwdTileForSm90<kHeadDim, kKind, /*kShortCausal=*/true>, kHeadDimV>;
      return launch_fwd_sm90_traits<Short, kKind>(p, plan, stream);
    }
  }
  using Traits = FwdTraitsSm90<kHeadDim, Element, FwdTileForSm90<kHeadDim, kKind>, kHeadDimV>;
  return launch_fwd_sm90_traits<Traits, kKind>(p, plan, stream);
}

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_sm90(const FwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  switch (plan.kind) {
    case Kind::kDropout: return launch_fwd_sm90_kind<kHeadDim, kDType, Kind::kDropout>(p, plan, stream);
    case Kind::kExtended: return launch_fwd_sm90_kind<kHeadDim, kDType, Kind::kExtended>(p, plan, stream);
    default: return launch_fwd_sm90_kind<kHeadDim, kDType, Kind::kPlain>(p, plan, stream);
  }
}

// A (Q / K head dim, V / O head dim) pair's forward (FwdParams::head_dim_v = kHeadDimV; MLA's (192, 128)).
template <int kHeadDim, int kHeadDimV, DType kDType>
cudaError_t launch_fwd_sm90_pair(const FwdParams& p, const LaunchPlan& plan, cudaStream_t stream) {
  switch (plan.kind) {
    case Kind::kDropout: return launch_fwd_sm90_kind<kHeadDim, kDType, Kind::kDropout, kHeadDimV>(p, plan, stream);
    case Kind::kExtended: return launch_fwd_sm90_kind<kHeadDim, kDType, Kind::kExtended, kHeadDimV>(p, plan, stream);
    default: return launch_fwd_sm90_kind<kHeadDim, kDType, Kind::kPlain, kHeadDimV>(p, plan, stream);
  }
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_FWD_SM90(HEAD_DIM, DTYPE)                                                   \
  template cudaError_t flash_attn2::launch_fwd_sm90<HEAD_DIM, flash_attn2::DType::DTYPE>(                \
      const flash_attn2::FwdParams&, const flash_attn2::LaunchPlan&, cudaStream_t);

#define FLASH_ATTN2_INSTANTIATE_FWD_SM90_PAIR(HEAD_DIM, HEAD_DIM_V, DTYPE)                                     \
  template cudaError_t flash_attn2::launch_fwd_sm90_pair<HEAD_DIM, HEAD_DIM_V, flash_attn2::DType::DTYPE>(   \
      const flash_attn2::FwdParams&, const flash_attn2::LaunchPlan&, cudaStream_t);
