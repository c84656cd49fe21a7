// The Hopper forward's epilogue (FA3's CollectiveEpilogueFwd pattern): one consumer warpgroup's 64 rows of a
// tile leave through shared memory. store: O normalized by the mainloop's softmax state, staged in the
// warpgroup's slab, the LSE written, then one TMA store of the slab (fixed length: TMA clips the rows past the
// sequence) or 16-byte row stores (varlen: rows past a sequence belong to the next one); the TMA store runs on
// while the warpgroup starts its next tile. store_zero: a tile that sees no key.
#pragma once

// First: it enables CuTe's extended wgmma shapes, which must precede every CuTe include.
#include "sm90/fwd_traits.h"

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"
#include "common/seqlen.h"
#include "common/sink.h"
#include "common/utils.h"
#include "sm90/tma.h"
#include "sm90/wgmma.h"

namespace flash_attn2::sm90 {

template <class Traits>
struct FwdEpilogueSm90 {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;

  const FwdArgsSm90<Traits>& args;
  typename Traits::SharedStorage& smem;
  const SeqlenInfo& seq;
  int bidb, bidh, m_block;
  int thread;     // among all consumer threads
  int warpgroup;  // the consumer warpgroup, warp-uniform

  // This tile's LSE rows (lse) and output rows (out), from its first row.
  __device__ static float* lse_rows(const FwdParams& p, const SeqlenInfo& seq, int bidb, int bidh, int m_block) {
    return p.lse + seq.offset_q(p.lse_batch_stride, 1, bidb) + bidh * p.lse_head_stride + m_block * kBlockM;
  }
  __device__ static Element* out_rows(const FwdParams& p, const SeqlenInfo& seq, int bidb, int bidh, int64_t row0) {
    return static_cast<Element*>(p.out) + seq.offset_q(p.o_batch_stride, p.o_row_stride, bidb) + bidh * p.o_head_stride +
           row0 * p.o_row_stride;
  }

  // softmax: the mainloop's OnlineSoftmax; acc_o its unnormalized O (mma_o's accumulator), scaled by
  // dropout_scale with kDropout; tScS: the thread's S-fragment coordinates in rowcol view (which rows, and whether
  // it holds their column 0: the LSE's writer). Rows that saw no key get O = 0, LSE = -inf (the sink, with one).
  // With O staged over Q (!Traits::kSeparateO), the warpgroup's Q slab is released once the store has read it.
  template <bool kDropout, class Softmax, class AccO, class TiledMmaO, class TensorC>
  __device__ __forceinline__ void store(const Softmax& softmax, AccO& acc_o, const TiledMmaO& mma_o,
                                        const TensorC& tScS, float dropout_scale) const {
    using namespace cute;
    const FwdParams& p = args.params;
    constexpr int kGroups = Traits::kConsumerWarpgroups;
    const bool release_thread = thread % 128 == 0;  // one arrival per warpgroup on the empty barriers
    auto warpgroup_sync = [&] { named_barrier_sync(128, int(Barrier::kWarpgroupSync0) + warpgroup); };
    Tensor sO = make_tensor(make_smem_ptr(Traits::kSeparateO ? smem.o.data() : smem.q.data()),
                            typename Traits::SmemLayoutO{});  // (kBlockM, D_v)
    constexpr int kRows = decltype(size<0>(tScS))::value;

    const bool tma_store = p.cu_seqlens_q == nullptr;
    float row_lse[kRows];
    Tensor O = rowcol_view(acc_o);
    const float sink = sink_logit(p, bidh);
    softmax.finalize(O, row_lse, [sink](int) { return sink; });
    if constexpr (kDropout) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= dropout_scale;
    }
    Tensor rO = convert_fragment<Element>(acc_o);
    if (release_thread) tma_store_wait<0>();  // the last tile's store has read the slab
    warpgroup_sync();  // and so have the row stores, and this tile's S = Q K^T
    // stmatrix: one instruction per four 8 x 8 blocks of O (16 per thread at d 256, against 64 4-byte stores).
    auto smem_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_o);
    auto smem_thr_o = smem_copy_o.get_thread_slice(thread);
    cute::copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

    const int rows_left = seq.len_q - m_block * kBlockM;
    float* lse = lse_rows(p, seq, bidb, bidh, m_block);
    if (get<1>(tScS(0, 0)) == 0) {  // the quad's first thread owns column 0 of its rows
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(tScS(r, 0));
        if (row < rows_left) lse[row] = row_lse[r];
      }
    }
    if (tma_store) {
      cutlass::arch::fence_view_async_shared();  // the slab's writes, visible to the TMA unit
      warpgroup_sync();
      if (release_thread) {
        Tensor mO = args.tma_o.get_tma_tensor(tma_shape<true>(p, Traits::head_dim_v(p)));  // (rows, D_v, heads, batch)
        Tensor gO = local_tile(mO(_, _, bidh, bidb), typename Traits::TileOWarpgroup{}, make_coord(_, _0{}));  // (64, D_v, m)
        Tensor sO_slabs = local_tile(sO, typename Traits::TileOWarpgroup{}, make_coord(_, _0{}));  // (64, D_v, kGroups)
        auto tO = tma_partition(args.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO_slabs), group_modes<0, 2>(gO));
        copy(args.tma_o, get<1>(tO)(_, warpgroup), get<0>(tO)(_, m_block * kGroups + warpgroup));
        tma_store_arrive();
      }
    } else {
      warpgroup_sync();
      const int row0 = m_block * kBlockM + warpgroup * 64;  // this warpgroup's slab
      Element* out = out_rows(p, seq, bidb, bidh, row0);
      Tensor sOw = local_tile(sO, typename Traits::TileOWarpgroup{}, make_coord(warpgroup, _0{}));  // (64, D_v)
      store_rows(sOw, out, p.o_row_stride, rows_left - warpgroup * 64, Traits::head_dim_v(p), thread % 128, 128);
    }
    if constexpr (!Traits::kSeparateO) {  // the slab is Q's: free once read
      if (tma_store) {
        if (release_thread) tma_store_wait<0>();
      } else {
        warpgroup_sync();
      }
      if (release_thread) barrier_arrive(&smem.q_empty[warpgroup]);
    }
  }

  // A tile without visible keys: out 0 and LSE -inf (the sink, with one), stored directly by all consumer threads (shared memory may
  // already hold the next tile's Q).
  __device__ static __forceinline__ void store_zero(const FwdParams& p, const SeqlenInfo& seq, int bidb, int bidh, int m_block,
                                    int thread) {
    constexpr int kVecsPerRow = Traits::kHeadDimV / 8;
    const int rows_left = seq.len_q - m_block * kBlockM;
    Element* out = static_cast<Element*>(p.out) + seq.offset_q(p.o_batch_stride, p.o_row_stride, bidb) +
                   bidh * p.o_head_stride + int64_t(m_block) * kBlockM * p.o_row_stride;
    float* lse = lse_rows(p, seq, bidb, bidh, m_block);
    const float sink = sink_logit(p, bidh);  // a row with no key: lse = the sink (-inf without)
    // Not clear_rows: its runtime row width (a division in the loop) made ptxas lay out the whole plain kernel
    // otherwise, and the d 64 forward ran 1-3% slower (TUNING 114).
    for (int i = thread; i < kBlockM * kVecsPerRow; i += Traits::kConsumerThreads) {
      const int row = i / kVecsPerRow, col = i % kVecsPerRow * 8;
      if (row < rows_left && col < Traits::head_dim_v(p)) *reinterpret_cast<uint4*>(out + row * p.o_row_stride + col) = uint4{0, 0, 0, 0};
      if (row < rows_left && col == 0) lse[row] = sink;
    }
  }
};

}  // namespace flash_attn2::sm90
