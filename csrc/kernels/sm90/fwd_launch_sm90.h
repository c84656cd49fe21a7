// Launcher for one (head dim, dtype) Hopper forward kernel: builds the TMA descriptors on the host, picks
// the grid (persistent or one block per tile) and the causal tile order, then launches. Each
// csrc/instantiations/fwd_*_sm90.cu instantiates one.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/registry.h"
#include "sm90/fwd_kernel_sm90.h"
#include "sm90/tma.h"

namespace flash_attn2 {

// A (head dim, dtype)'s three kernels, as bits: which one a call runs (fwd_kind), and which a tile's traits
// build (all, or where the tiles differ, FwdShortTileSm90 and FwdDropoutTileSm90, the ones they serve).
enum FwdKernels : int { kFwdPlain = 1, kFwdExtended = 2, kFwdDropout = 4, kFwdAll = 7 };

inline FwdKernels fwd_kind(const FwdParams& p) {
  return p.dropout_p > 0.f ? kFwdDropout : fwd_extended(p) ? kFwdExtended : kFwdPlain;
}

template <class Traits, int kKernels = kFwdAll>
cudaError_t launch_fwd_sm90_traits(const FwdParams& p, FwdKernels kind, cudaStream_t stream) {
  const int64_t num_blocks = QueryTileScheduler<Traits::kBlockM>::num_blocks(p);
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;
  decltype(&fwd_kernel_sm90<Traits, false>) kernel = nullptr;
  if constexpr ((kKernels & kFwdDropout) != 0) {
    if (kind == kFwdDropout) kernel = &fwd_kernel_sm90<Traits, true, true>;
  }
  if constexpr ((kKernels & kFwdExtended) != 0) {
    if (kind == kFwdExtended) kernel = &fwd_kernel_sm90<Traits, true>;
  }
  if constexpr ((kKernels & kFwdPlain) != 0) {
    if (kind == kFwdPlain) kernel = &fwd_kernel_sm90<Traits, false>;
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;  // a caller's mistake: this tile does not build it
  if (cudaError_t err = allow_dynamic_smem(kernel, Traits::kSmemBytes)) return err;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const auto shape_q = sm90::tma_shape<true>(p), shape_k = sm90::tma_shape<false>(p);
  sm90::tma_encode_failed = false;
  using cute::SM90_TMA_LOAD, cute::SM90_TMA_STORE;
  const auto smem_kv = cute::take<0, 2>(typename Traits::SmemLayoutKV{});
  FwdArgsSm90<Traits> args{
      p,
      sm90::make_tma<Traits, typename Traits::TmaQ>(SM90_TMA_LOAD{}, p.q, shape_q, p.q_row_stride, p.q_head_stride,
                                                    p.q_batch_stride, typename Traits::SmemLayoutQWarpgroup{},
                                                    typename Traits::TileQWarpgroup{}),
      sm90::make_tma<Traits, typename Traits::TmaKV>(SM90_TMA_LOAD{}, p.k, shape_k, p.k_row_stride, p.k_head_stride,
                                                     p.k_batch_stride, smem_kv, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmaKV>(SM90_TMA_LOAD{}, p.v, shape_k, p.v_row_stride, p.v_head_stride,
                                                     p.v_batch_stride, smem_kv, typename Traits::TileKV{}),
      sm90::make_tma<Traits, typename Traits::TmaO>(SM90_TMA_STORE{}, p.out, shape_q, p.o_row_stride, p.o_head_stride,
                                                    p.o_batch_stride, typename Traits::SmemLayoutQWarpgroup{},
                                                    typename Traits::TileQWarpgroup{}),
      false,
      {},
      nullptr,
  };
  if (sm90::tma_encode_failed) return cudaErrorInvalidValue;
  // Fixed length: a persistent grid, one block per SM (at most one fits) walking the slots
  // (sm90/scheduler_sm90.h); causal tiles longest first in L2-sized sections of heads (CausalTileOrder),
  // handed out as blocks free up where the caller gave a tile counter. Varlen: one block per slot, which
  // the hardware hands out as SMs free up (tiles differ in work with the sequences); so does causal above
  // Traits::kPersistentCausalMax (kPersistentCausalMaxStatic without a tile counter).
  const int causal_max = p.tile_counter != nullptr ? Traits::kPersistentCausalMax : Traits::kPersistentCausalMaxStatic;
  const bool persistent = !varlen && !(p.causal && p.seqlen_q > causal_max);
  int grid = int(num_blocks);
  if (persistent) {
    int num_sms = 0;
    if (cudaError_t err = device_sm_count(&num_sms)) return err;
    grid = num_blocks < num_sms ? int(num_blocks) : num_sms;
  }
  args.causal_order = persistent && p.causal && grid < num_blocks;
  if (args.causal_order) {
    // Sections of about two waves of tiles, at most 16 MB of K and V (a query head's share: its KV head
    // serves the group). 32 MB sections ran d 128 causal 16k at 0.90x the one-block-per-tile grid.
    const int group = p.num_heads / p.num_heads_k;
    const int num_m_blocks = int((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
    const int64_t kv_bytes = int64_t(p.seqlen_k) * p.head_dim * 2 * int(sizeof(typename Traits::Element)) / group;
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
    if (p.tile_counter != nullptr) {
      if (cudaError_t err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream)) return err;
      args.tile_counter = p.tile_counter;
    }
  }
  kernel<<<unsigned(grid), Traits::kNThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using Element = ElementOf<kDType>;
  using Main = FwdTraitsSm90<kHeadDim, Element, typename FwdTileSm90<kHeadDim>::type>;
  using Short = FwdShortTileSm90<kHeadDim>;
  const FwdKernels kind = fwd_kind(p);
  if constexpr (!std::is_void_v<typename Short::type>) {
    if (kind == kFwdPlain && p.causal && p.cu_seqlens_q == nullptr && p.seqlen_q <= Short::kMaxSeqlenQ) {
      using ShortTraits = FwdTraitsSm90<kHeadDim, Element, typename Short::type>;
      return launch_fwd_sm90_traits<ShortTraits, kFwdPlain>(p, kind, stream);
    }
  }
  using DropoutTile = typename FwdDropoutTileSm90<kHeadDim>::type;
  if constexpr (!std::is_void_v<DropoutTile>) {
    if (kind == kFwdDropout) {
      using DropoutTraits = FwdTraitsSm90<kHeadDim, Element, DropoutTile>;
      return launch_fwd_sm90_traits<DropoutTraits, kFwdDropout>(p, kind, stream);
    }
    return launch_fwd_sm90_traits<Main, kFwdPlain | kFwdExtended>(p, kind, stream);
  } else {
    return launch_fwd_sm90_traits<Main>(p, kind, stream);
  }
}

}  // namespace flash_attn2

#define FLASH_ATTN2_INSTANTIATE_FWD_SM90(HEAD_DIM, DTYPE) \
  template cudaError_t flash_attn2::launch_fwd_sm90<HEAD_DIM, flash_attn2::DType::DTYPE>(const flash_attn2::FwdParams&, cudaStream_t);
