// Split-KV forward (decode, KV caches): O = softmax(scale * Q K^T) V for one (packed query tile, key split,
// batch entry, head group) block, with SM80 tensor cores (any sm_80+ GPU, Hopper included).
//
// Decode is memory-bound: a step reads one query row per head against the whole cache. So (common/split_kv.h)
// the query heads of a kv head share a tile (GQA packing: each key is read once for all of them), the key range
// is cut into splits that fill the GPU, and K / V stream through kStages buffers with cp.async, kStages - 1
// blocks in flight while one is computed. A split writes an fp32 partial O and its LSE; fwd_combine_kernel
// (csrc/fwd_aux.cu) merges them. One split writes out and lse directly.
//
// The softmax is the training forward's (common/softmax.h); mask, score modifiers and block ranges are the
// shared ones, with the packed row's query index (r / pack) where they take a row.
#pragma once

#include <cute/tensor.hpp>

#include "common/block_range.h"
#include "common/cluster.h"
#include "common/launch.h"
#include "common/mask.h"
#include "common/score_mod.h"
#include "common/softmax.h"
#include "common/split_kv.h"
#include "common/utils.h"
#include "flash_attn2/flash_attn2.h"
#include "sm80/kernel_traits.h"

namespace flash_attn2 {

template <int kHeadDim, typename Element, class Tile>
struct FwdSplitTraits : CommonTraits<kHeadDim, Element, Tile::kNWarps> {
  using Base = CommonTraits<kHeadDim, Element, Tile::kNWarps>;
  static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStages = Tile::kStages;
  static_assert(kBlockM == 16 * Tile::kNWarps, "one 16-row MMA tile of packed rows per warp");
  static_assert(kBlockN % 16 == 0 && kStages >= 2);
  using TiledMma = typename Base::template TiledMmaFor<Tile::kNWarps>;
  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
  using SmemLayoutVt = typename Base::template Transposed<SmemLayoutKV>;  // (D, kBlockN)
  static constexpr int kQSize = cute::cosize(SmemLayoutQ{});
  static constexpr int kKVSize = cute::cosize(SmemLayoutKV{});
  // Q (the output tile reuses it), then kStages K buffers, then kStages V buffers.
  static constexpr int kSmemBytes = int(sizeof(Element)) * (kQSize + 2 * kStages * kKVSize);
  // The cluster combine's O (kBlockM, D) and LSE (kBlockM) of the block's split, over all of it after the mainloop.
  static constexpr int kClusterBytes = kBlockM * kHeadDim * 4 + kBlockM * 4;
  static_assert(kClusterBytes <= kSmemBytes, "the cluster combine reuses the tile's shared memory");
};

// A tensor's layout over another buffer of the same shape: a stage's partition from stage 0's, a paged chunk's from
// the head's first chunk.
template <class Tensor, class Offset>
__device__ __forceinline__ auto at_offset(Tensor const& t, Offset offset) {
  return cute::make_tensor(t.data() + offset, t.layout());
}

// Paged K / V (FwdParams::page_table): key rows [row0, row0 + tile rows) of the sequence into a K and a V stage,
// each thread looking up the pages of its own rows (coord: its copies' tile coordinates; one table read per row,
// K and V sharing it), 16 bytes per cp.async, zeros past len_k and the head dim. The thread's table reads are issued
// together before any of them is used, so a stage waits one table round trip, not one per row (a read behind an
// `if (row < len_k)` made the compiler serialize them: 4 round trips a 16-row chunk per lane, the narrow kernel's
// paged blocks streaming at less than half a contiguous block's rate, TUNING 145). Rows past len_k read the entry of
// row0 (the stage's first row, below len_k whenever a stage is loaded) and copy nothing, so a table's padding (-1)
// is never dereferenced; entries are clamped to the pages (clamp_page).
// (The narrow kernel's chunks that lie on one page take one entry a chunk instead: load_chunk there.)
template <class Element, class DstK, class DstV, class Coord>
__device__ __forceinline__ void load_paged(const FwdParams& p, const SplitSeq& seq, const Element* k, const Element* v,
                                           DstK&& sk, DstV&& sv, Coord const& coord, int row0) {
  using namespace cute;
  constexpr int kRows = decltype(size<1>(sk))::value;
  int entry[kRows], on_page[kRows];
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    const int row = row0 + get<0>(coord(0, m, 0));
    const PageSlot slot = page_slot(p, seq.k_row0 + (row < seq.len_k ? row : row0));
    entry[m] = seq.pages[slot.column];
    on_page[m] = slot.row;
  }
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    const bool row_ok = row0 + get<0>(coord(0, m, 0)) < seq.len_k;
    const int64_t page = clamp_page(p, entry[m]);
    // The row's address once, its columns as offsets from it (the copies' immediates).
    const Element* k_row = k + (page * p.k_batch_stride + on_page[m] * p.k_row_stride);
    const Element* v_row = v + (page * p.v_batch_stride + on_page[m] * p.v_row_stride);
    CUTE_UNROLL
    for (int c = 0; c < size<2>(sk); ++c) {
      const int col = get<1>(coord(0, m, c));
      const bool ok = row_ok && col < p.head_dim;
      SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(k_row + col),
                                                        *reinterpret_cast<uint128_t*>(&sk(0, m, c)), ok);
      SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(v_row + col),
                                                        *reinterpret_cast<uint128_t*>(&sv(0, m, c)), ok);
    }
  }
}

// Both tiles' pieces: Q's gather, a K / V block's load and the mask.

// Q's rows [0, tile_rows) into sQ (rows of a tile belong to different heads: row r is query query_of(r) of head
// head_of(r)), 16 bytes per copy, zeros past the rows and the head dim. Synchronous stores (the 64-row kernel: Q is
// small, and the caller's barrier publishes it), or (kAsync) by cp.async as a commit group of its own, which the
// caller waits for before reading sQ: issued before anything waits on a cache length, Q's round trip overlaps the
// length's and the first K / V copies' instead of preceding them (the narrow kernel: batch-1 decode is a chain of
// round trips).
template <bool kAsync, class Element, int kRows, int kHeadDim, class SmemQ, class QueryOf, class HeadOf>
__device__ __forceinline__ void gather_q(const FwdParams& p, const SplitSeq& seq, SmemQ& sQ, int tile_rows,
                                         QueryOf query_of, HeadOf head_of, int tid, int threads) {
  constexpr int kVecs = kHeadDim / 8;
  for (int idx = tid; idx < kRows * kVecs; idx += threads) {
    const int r = idx / kVecs, c = idx % kVecs;
    const bool ok = r < tile_rows && c * 8 < p.head_dim;
    const Element* q = static_cast<const Element*>(p.q);
    if constexpr (kAsync) {
      const Element* src = q + (ok ? seq.q_offset(p, query_of(r), head_of(r)) + c * 8 : 0);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                                                                    *reinterpret_cast<cute::uint128_t*>(&sQ(r, c * 8)), ok);
    } else {
      uint4 value = {0, 0, 0, 0};
      if (ok) value = *reinterpret_cast<const uint4*>(q + seq.q_offset(p, query_of(r), head_of(r)) + c * 8);
      *reinterpret_cast<uint4*>(&sQ(r, c * 8)) = value;
    }
  }
  if constexpr (kAsync) cute::cp_async_fence();
}

// A stage's key rows of the sequence, from row0, into a K and a V stage: through the page table (load_paged), or
// as one tile, its rows checked against the sequence's end (zeros past len_k: a cache's unused rows, whatever they
// hold, never reach a score or P V).
template <class Element, class Copy, class SrcK, class SrcV, class DstK, class DstV, class Coord>
__device__ __forceinline__ void load_kv_rows(const FwdParams& p, const SplitSeq& seq, int bidh_k, const Copy& copy,
                                             const SrcK& gk, const SrcV& gv, DstK&& sk, DstV&& sv, const Coord& coord,
                                             int row0) {
  const int rows_left = seq.len_k - row0;
  if (seq.pages != nullptr) {
    load_paged(p, seq, static_cast<const Element*>(p.k) + bidh_k * p.k_head_stride,
               static_cast<const Element*>(p.v) + bidh_k * p.v_head_stride, sk, sv, coord, row0);
  } else {
    // Rows always checked: with an unchecked version for whole tiles beside it, the compiler predicated both sets
    // of copies and their addresses into every tile (16 dead cp.async and their address work in each of the narrow
    // kernel's ~430-instruction chunks, 32 in the 64-row kernel's blocks: TUNING 171), where the check costs a
    // compare a row. Measured: no cell slower, 0-1 % faster (TUNING 175).
    load_tile<true>(copy, gk, sk, coord, rows_left, p.head_dim);
    load_tile<true>(copy, gv, sv, coord, rows_left, p.head_dim);
  }
}

// S to -inf where a row's query (query[r]: packed rows map to queries) does not see the key; col0 the block's first
// key. kBothEdges: a window's left edge may cut the block too.
template <bool kBothEdges, int kRows, class TensorS, class Coord>
__device__ __forceinline__ void mask_queries(TensorS& S, const Coord& coord, const int (&query)[kRows],
                                             const Window& window, int col0) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int begin = kBothEdges ? window.key_begin(query[r]) - col0 : 0, end = window.key_end(query[r]) - col0;
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(S); ++c) {
      const int col = cute::get<1>(coord(r, c));
      if (col >= end || (kBothEdges && col < begin)) S(r, c) = -INFINITY;
    }
  }
}

// The row tiles of one (batch entry, head group) that block (blockIdx.x, split) takes, as fn(row0, row_end, direct):
// with several splits, the rows below the hint (seqlen_q: varlen's max_seqlen_q) in tiles that stop at it, each split
// its share of the keys into partials; then the rows past the hint (a varlen sequence longer than the hint says),
// which have no partial rows to go to, by split 0 alone over all keys, written out directly. With one split, every
// row directly. The grid's tiles loop (blockIdx.x, gridDim.x) over what they do not reach at once. kSplitTilesOnly
// (the cluster combine, whose blocks must all meet each tile's cluster barriers): the first loop alone, which is
// every tile of a fixed-length call of 2+ splits (rows is seqlen_q * pack there); the launcher clusters no other.
template <int kBlockM, bool kSplitTilesOnly = false, class Fn>
__device__ __forceinline__ void for_each_split_tile(const FwdParams& p, int64_t rows, int pack, int split, int splits,
                                                    Fn&& fn) {
  const int64_t step = int64_t(gridDim.x) * kBlockM;
  const int64_t hint_rows = splits == 1 ? 0 : min(rows, int64_t(p.seqlen_q) * pack);
  for (int64_t row0 = int64_t(blockIdx.x) * kBlockM; row0 < hint_rows; row0 += step) {
    fn(row0, min(row0 + kBlockM, hint_rows), false);
  }
  if constexpr (!kSplitTilesOnly) {
    if (split != 0) return;
    for (int64_t row0 = hint_rows + int64_t(blockIdx.x) * kBlockM; row0 < rows; row0 += step) {
      fn(row0, min(row0 + kBlockM, rows), true);
    }
  }
}

// Varlen: the rows no sequence covers get out 0 and LSE -inf, by the (split 0, tile 0) blocks of batch entry 0
// (one per head group, each filling its group's heads).
template <class Element>
__device__ void split_zero_uncovered(const FwdParams& p, int bidb, int head0, int pack, int threads) {
  if (p.cu_seqlens_q == nullptr || blockIdx.x != 0 || blockIdx.y != 0 || bidb != 0) return;
  const UncoveredRows uncovered(p.cu_seqlens_q, p.batch, p.total_q);
  for (int h = head0; h < head0 + pack; ++h) {
    uncovered.zero_fill(static_cast<Element*>(p.out) + int64_t(h) * p.o_head_stride, p.o_row_stride, p.head_dim,
                        p.lse + int64_t(h) * p.lse_head_stride, threadIdx.x, threads);
  }
}

// The cluster combine (kCluster): the cluster's blocks are one tile's key splits (block s of the cluster is split
// s), each holding its split's normalized O (rows, D) and LSE (rows) in shared memory; block s merges rows s,
// s + splits, ... of all of them into out and lse, as fwd_combine_kernel does from global memory (csrc/fwd_aux.cu:
// the same NaN and sink rules, merged_split_lse's bits). Batch-1 decode ends in that combine: ~3.3 us after the
// split kernel at 1 x 1k (4 splits) on an H200, of an 11 us call (TUNING 148), a chain of launch, L2 round trips and
// a store that a cluster barrier and a round trip to a neighbour SM replace. Its code runs once a block (~2 us of a
// 7.3 us kernel at 1 x 1k, TUNING 184), so its length is its cost: a warp a row, lane s holding split s's LSE and
// weight (one load, one expf a split, shuffled to the FMAs), the first batch of O columns in flight with the LSEs:
// ~620 SASS instructions where a thread a row's four columns took ~1040, 0.8-0.9 us off batch-1 calls (TUNING 189).
template <class Element, int kHeadDim, class QueryOf, class HeadOf>
__device__ __forceinline__ void cluster_combine(const FwdParams& p, const SplitSeq& seq, const float* cluster_o,
                                                const float* cluster_lse, int tile_rows, int split, int splits,
                                                QueryOf query_of, HeadOf head_of) {
  constexpr int kMaxSplits = kMaxClusterSplits, kBatch = 8;
  static_assert(kMaxSplits <= 32, "a lane holds a split's LSE");
  cluster_barrier();  // every split's result is in its block's shared memory
  const int rows_mine = split < tile_rows ? (tile_rows - split + splits - 1) / splits : 0;
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < rows_mine; r += blockDim.x / 32) {  // a warp a row: r warp-uniform
    const int row = split + r * splits;
    float4 o_b[kBatch];  // a batch of splits' four columns: (col, splits s0 .. s0 + kBatch - 1)
    auto load_batch = [&](int col, int s0) {  // past the last split: a repeat, not used; past head_dim: not read
      CUTE_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        const int s = s0 + j < splits ? s0 + j : splits - 1;
        o_b[j] = col < p.head_dim ? cluster_load4(cluster_o + row * kHeadDim + col, s) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    };
    load_batch(lane * 4, 0);  // in flight with the LSEs: one round trip to the peers where d <= 128 and splits <= 8
    // The row's LSE as merged_split_lse folds it (the same bits): lane s holds split s's; the max over lanes (order-
    // free), then the terms added in split order.
    const float lse_l = lane < splits ? cluster_load(cluster_lse + row, lane) : -INFINITY;
    const bool nan_l = lse_l != lse_l;
    float m = nan_l ? -INFINITY : lse_l;
    CUTE_UNROLL
    for (int x = 16; x > 0; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    const bool any_nan = __any_sync(0xffffffffu, nan_l);
    const float e = lse_l != -INFINITY && !nan_l ? expf(lse_l - m) : 0.f;
    float sum = 0.f;
    CUTE_UNROLL
    for (int s = 0; s < kMaxSplits; ++s) sum += __shfl_sync(0xffffffffu, e, s);  // past `splits`: + 0
    float lse = m == -INFINITY ? -INFINITY : any_nan ? NAN : m + logf(sum);
    float unused = 1.f;
    add_sink(lse, unused, sink_logit(p, head_of(row)));  // once, here: the splits' LSEs leave the sink out
    // Split s's weight exp(LSE_s - LSE), from lane s; a split without keys (LSE_s -inf) is skipped, its O not read.
    const float w_l = expf(lse_l - lse);
    const unsigned live = __ballot_sync(0xffffffffu, lane < splits && lse_l != -INFINITY);
    Element* out = static_cast<Element*>(p.out) + seq.o_offset(p, query_of(row), head_of(row));
    for (int c0 = 0; c0 < p.head_dim; c0 += 128) {  // warp-uniform (the shuffles); four columns a lane
      const int col = c0 + lane * 4;
      const bool in = col < p.head_dim;  // head_dim: a multiple of 8
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      if (lse != -INFINITY) {
#pragma unroll 1
        for (int s0 = 0; s0 < splits; s0 += kBatch) {
          if (c0 > 0 || s0 > 0) load_batch(col, s0);  // the first batch is in already
          CUTE_UNROLL
          for (int j = 0; j < kBatch; ++j) {
            const float g = __shfl_sync(0xffffffffu, w_l, s0 + j < splits ? s0 + j : splits - 1);
            if (s0 + j >= splits || !(live >> (s0 + j) & 1u)) continue;
            o.x += g * o_b[j].x, o.y += g * o_b[j].y, o.z += g * o_b[j].z, o.w += g * o_b[j].w;
          }
        }
      }
      Element vals[4] = {Element(o.x), Element(o.y), Element(o.z), Element(o.w)};
      if (in) *reinterpret_cast<uint2*>(out + col) = *reinterpret_cast<const uint2*>(vals);
    }
    if (lane == 0) p.lse[seq.lse_offset(p, query_of(row), head_of(row))] = lse;
  }
  cluster_barrier_relaxed();  // no block leaves, or reuses its shared memory, while a peer reads it
}

// One 64-row tile of packed rows [row0, row_end) (row_end <= row0 + 64) of batch entry bidb's head group head0: split
// `split` of `splits` of its key blocks into fp32 partials, or (direct) all of them into out and lse; kCluster: the
// splits merged in the cluster (cluster_combine) instead of partials.
template <class Traits, bool kExtended, bool kCluster>
__device__ __forceinline__ void fwd_split_tile(const FwdParams& params, const SplitSeq& seq, int bidb, int head0,
                                               int64_t row0, int64_t row_end, int split, int splits, bool direct) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages, kNThreads = Traits::kNThreads;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
  const int tid = threadIdx.x;
  const int pack = split_pack(params);
  const int bidh_k = head0 / (params.num_heads / params.num_heads_k);
  const int tile_rows = int(row_end - row0);  // 1..kBlockM
  const Window window(seq.len_q, seq.len_k, params);
  // The tile's query rows, first and last, bound its key blocks; the split takes its share of them.
  const BlockRange blocks = fwd_block_range_rows<kBlockN, kExtended>(window, int(row0 / pack), int((row_end - 1) / pack));
  const SplitBlocks mine = direct ? SplitBlocks{blocks.n_min, blocks.n_max}
                                  : split_blocks(blocks.n_min, blocks.n_max, split, splits);

  Tensor mK = gmem_rows<kHeadDim>(static_cast<const Element*>(params.k) + seq.k_offset + bidh_k * params.k_head_stride,
                                  seq.len_k, params.k_row_stride);  // (len_k, D)
  Tensor mV = gmem_rows<kHeadDim>(static_cast<const Element*>(params.v) + seq.v_offset + bidh_k * params.v_head_stride,
                                  seq.len_k, params.v_row_stride);  // (len_k, D)
  Tensor gK = local_tile(mK, TileKV{}, make_coord(_, 0));  // (kBlockN, D, n)
  Tensor gV = local_tile(mV, TileKV{}, make_coord(_, 0));  // (kBlockN, D, n)

  extern __shared__ __align__(128) char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (kBlockM, D)
  Tensor sK = make_tensor(sQ.data() + int(Traits::kQSize), typename Traits::SmemLayoutKV{});  // (kBlockN, D), stage 0
  Tensor sV = make_tensor(sK.data() + int(kStages * Traits::kKVSize), typename Traits::SmemLayoutKV{});  // (kBlockN, D), stage 0
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});  // (D, kBlockN), stage 0
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutQ{});    // (kBlockM, D), once Q is done

  // Packed row r of the tile: query row (row0 + r) / pack of head head0 + (row0 + r) % pack.
  auto query_of = [&](int r) { return int((row0 + r) / pack); };
  auto head_of = [&](int r) { return head0 + int((row0 + r) % pack); };

  // Q: the first step's barrier publishes it.
  gather_q</*kAsync=*/false, Element, kBlockM, kHeadDim>(params, seq, sQ, tile_rows, query_of, head_of, tid,
                                                         kNThreads);
  constexpr int kChunks = kHeadDim / 8;

  // Global -> shared for K and V, stage 0's partition; stage s is kKVSize elements on.
  typename Traits::GmemTiledCopyIn gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tKgK = gmem_thr.partition_S(gK);                                // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr.partition_D(sK);                                // (CPY, CPY_N, CPY_D)
  Tensor tVgV = gmem_thr.partition_S(gV);                                // (CPY, CPY_N, CPY_D, n)
  Tensor tVsV = gmem_thr.partition_D(sV);                                // (CPY, CPY_N, CPY_D)
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(TileKV{}));  // (CPY, CPY_N, CPY_D) -> (row, col)
  // Block n into stage n % kStages; the sequence's last block may be cut (zeros past len_k: a cache's unused
  // rows, whatever they hold, never reach a score or P V).
  auto load_kv = [&](int n_block) {  // block n into stage n % kStages
    const int offset = (n_block % kStages) * int(Traits::kKVSize);
    load_kv_rows<Element>(params, seq, bidh_k, gmem_copy, tKgK(_, _, _, n_block), tVgV(_, _, _, n_block),
                          at_offset(tKsK, offset), at_offset(tVsV, offset), tKVcKV, n_block * kBlockN);
  };

  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(
      make_tensor(sV.data(), get_nonswizzle_portion(typename Traits::SmemLayoutVt{})));  // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(mma, TileQ{});  // (MMA, MMA_M, MMA_D)
  clear(acc_o);
  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma);
  Tensor tSsQ = smem_copy_q.get_thread_slice(tid).partition_S(sQ);    // (CPY, CPY_M, CPY_D)
  Tensor tSsK = smem_copy_k.get_thread_slice(tid).partition_S(sK);    // (CPY, CPY_N, CPY_D), stage 0
  Tensor tOsVt = smem_copy_v.get_thread_slice(tid).partition_S(sVt);  // (CPY, CPY_D, CPY_N), stage 0

  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(TileS{})));  // (rows, cols) -> tile coords
  constexpr int kRows = decltype(size<0>(tScS))::value;
  int query[kRows];  // each of this thread's rows' query index
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) query[r] = query_of(get<0>(tScS(r, 0)));
  const ScoreMods mods(params, kExtended);
  // ALiBi only unpacked (split_pack): packed row r is query row0 + r of head0.
  const Alibi alibi = mods.alibi(params, seq.len_q, seq.len_k, bidb, head0);
  OnlineSoftmax<kRows> softmax(mods.scale(params));


  // The pipeline: blocks begin .. begin + kStages - 2 in flight before the first step; one commit group per block
  // (empty past the split's end), so that waiting for all but the newest kStages - 2 groups means block n landed.
  CUTE_UNROLL
  for (int s = 0; s < kStages - 1; ++s) {
    if (mine.begin + s < mine.end) load_kv(mine.begin + s);
    cp_async_fence();
  }
  for (int n_block = mine.begin; n_block < mine.end; ++n_block) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block n has landed for every thread, and every warp is done with block n - 1's stage
    if (n_block + kStages - 1 < mine.end) load_kv(n_block + kStages - 1);  // into block n - 1's stage
    cp_async_fence();
    const int offset = (n_block % kStages) * int(Traits::kKVSize);
    Tensor acc_s = partition_fragment_C(mma, TileS{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    gemm_ss(mma, acc_s, tSrQ, tSsQ, smem_copy_q, tSrK, at_offset(tSsK, offset), smem_copy_k);
    Tensor S = rowcol_view(acc_s);
    if constexpr (kExtended) mods.apply(S, params, alibi, tScS, int(row0), n_block * kBlockN);
    if (n_block >= blocks.n_masked_min || (kExtended && n_block < blocks.n_unmasked_min)) {
      mask_queries<kExtended>(S, tScS, query, window, n_block * kBlockN);  // the window's edges or the sequence's end
    }
    Tensor O = rowcol_view(acc_o);
    softmax.update(S, O);
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));  // (MMA, MMA_M, MMA_N / 2)
    gemm_rs(mma, acc_o, tOrP, tOrVt, at_offset(tOsVt, offset), smem_copy_v);
  }
  cp_async_wait<0>();  // no copy may land in shared memory after the block exits

  // Epilogue. A split with no block (past the range's end, or a row that sees no key) writes O = 0, LSE = -inf. A
  // sink enters where the tile writes out directly (such a row's LSE is then the sink); partials leave it to the
  // combine.
  float row_lse[kRows];
  {
    Tensor O = rowcol_view(acc_o);
    softmax.finalize(O, row_lse, [&](int r) {
      return direct ? sink_logit(params, head_of(get<0>(tScS(r, 0)))) : -INFINITY;
    });
  }
  const bool quad_leader = get<1>(tScS(0, 0)) == 0;  // the quad's first thread owns column 0 of its rows
  if (kCluster || !direct) {  // kCluster: direct is false (the launcher clusters fixed-length calls of 2+ splits)
    // fp32 partials straight from the accumulators (a quad writes 32 contiguous bytes of a row): to split_accum,
    // or (kCluster) to shared memory over Q, K and V for the cluster's merge.
    float* cluster_o = reinterpret_cast<float*>(smem);    // (kBlockM, D)
    float* cluster_lse = cluster_o + kBlockM * kHeadDim;  // (kBlockM)
    if constexpr (kCluster) __syncthreads();              // every warp is done with Q, K and V
    Tensor O = rowcol_view(acc_o);
    Tensor tOcO = rowcol_view(thr_mma.partition_C(make_identity_tensor(TileQ{})));  // (rows, cols) -> tile coords
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int tile_row = get<0>(tOcO(r, 0));
      if (tile_row >= tile_rows) continue;
      const int64_t row = split_row(params, split, bidb, head_of(tile_row), query_of(tile_row));
      float* o_row = kCluster ? cluster_o + tile_row * kHeadDim : params.split_accum + row * params.head_dim;
      if (quad_leader) {
        (kCluster ? cluster_lse[tile_row] : params.split_accum[split_lse_offset(params, splits) + row]) = row_lse[r];
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) {
        const int col = get<1>(tOcO(r, c));
        if (col < params.head_dim) o_row[col] = O(r, c);
      }
    }
    if constexpr (kCluster) {
      cluster_combine<Element, kHeadDim>(params, seq, cluster_o, cluster_lse, tile_rows, split, splits, query_of,
                                         head_of);
    }
    return;
  }
  Tensor rO = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
  // sO is sQ, whose rows every thread stored: with no key block (no barrier in the loop) a late Q store could
  // land on a finished O row.
  __syncthreads();
  cute::copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
  if (quad_leader) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int tile_row = get<0>(tScS(r, 0));
      if (tile_row < tile_rows) params.lse[seq.lse_offset(params, query_of(tile_row), head_of(tile_row))] = row_lse[r];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kBlockM * kChunks; idx += kNThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (r < tile_rows && c * 8 < params.head_dim) {
      *reinterpret_cast<uint4*>(static_cast<Element*>(params.out) + seq.o_offset(params, query_of(r), head_of(r)) +
                                c * 8) = *reinterpret_cast<const uint4*>(&sO(r, c * 8));
    }
  }
}

// kCluster: as fwd_split_narrow_kernel's.
template <class Traits, bool kExtended, bool kCluster = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_split_kernel(const __grid_constant__ FwdParams params) {
  // Launched after the kernel before it (launch_after: flash_attn_with_kvcache's update writes the q and the cache
  // rows read here), and lets the combine's blocks launch once every block here has started.
  griddep_wait();
  griddep_launch_dependents();
  const int split = blockIdx.y, splits = gridDim.y;
  const int pack = split_pack(params), groups = params.num_heads / pack;
  // (batch entry, head group) pairs: blockIdx.z, then gridDim.z on (the grid holds at most 65535).
  for (int64_t z = blockIdx.z; z < int64_t(params.batch) * groups; z += gridDim.z) {
    const int bidb = int(z / groups), head0 = int(z % groups) * pack;
    split_zero_uncovered<typename Traits::Element>(params, bidb, head0, pack, Traits::kNThreads);
    const SplitSeq seq(params, bidb);
    for_each_split_tile<Traits::kBlockM, kCluster>(params, int64_t(seq.len_q) * pack, pack, split, splits,
                                                   [&](int64_t row0, int64_t row_end, bool direct) {
      __syncthreads();  // the previous tile's epilogue is done with shared memory
      fwd_split_tile<Traits, kExtended, kCluster>(params, seq, bidb, head0, row0, row_end, split, splits, direct);
    });
  }
}

// ---- The narrow tile: decode with at most 16 packed rows (GQA 8:1 or less at one query row, MHA) ----
//
// A 64-row tile would hold 1-8 real rows and make every warp read the whole K / V block from shared memory:
// issue-bound at ~85 % of cuDNN (TUNING 128). Here the tile is 16 rows and the four warps split the keys
// instead: warp w takes key chunks w, w + 4, w + 8, ... (16 keys each) of the split's range and is an FA2
// decoder of its own: its own cp.async pipeline into its own buffers (no block barrier in the main loop), Q in
// registers, its own softmax state. The four states merge once, through shared memory, at the end.
template <int kHeadDim, typename Element, int kStages_>
struct FwdSplitNarrowTraits : CommonTraits<kHeadDim, Element, 4> {
  using Base = CommonTraits<kHeadDim, Element, 4>;
  static constexpr int kBlockM = 16, kChunk = 16, kStages = kStages_;
  static_assert(kStages >= 2);
  // One warp's MMA: 16 rows x 16 columns per step (two n8 atoms, B operands by ldmatrix.x4).
  using WarpMma = cute::TiledMMA<cute::MMA_Atom<typename Base::Mma>, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>,
                                 cute::Tile<cute::_16, cute::_16, cute::_16>>;
  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;   // (16, D)
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kChunk>;  // (16, D): one warp's chunk
  using SmemLayoutVt = typename Base::template Transposed<SmemLayoutKV>;  // (D, 16)
  // 32 threads, 16 bytes each, over a (16, D) chunk.
  using WarpGmemCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
      cute::Layout<cute::Shape<cute::Int<32 / Base::kGmemThreadsPerRow>, cute::Int<Base::kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<Base::kGmemThreadsPerRow>, cute::_1>>{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));
  static constexpr int kQSize = cute::cosize(SmemLayoutQ{});
  static constexpr int kChunkSize = cute::cosize(SmemLayoutKV{});
  // Q, then per warp kStages K chunks and kStages V chunks. The merge's fp32 partials (4 x 16 x D) and row
  // statistics reuse the K / V space once every warp is done.
  static constexpr int kKVBytes = int(sizeof(Element)) * 4 * 2 * kStages * kChunkSize;
  // The partials' rows 8 floats apart beyond D where that fits: the MMA fragment's stores (8 rows x 4 column pairs a
  // warp instruction) then reach 32 distinct banks a half-warp; at D floats apart all 8 rows hit the same 8 banks
  // (6.5-way conflicts over the merge's 10.5k stores at batch-1 decode, ncu: TUNING 161).
  static constexpr int kMergeStridePadded = kHeadDim + 8;
  static constexpr int kClusterBytes = kBlockM * kHeadDim * 4 + kBlockM * 4;
  static constexpr bool kMergePadded =
      4 * kBlockM * kMergeStridePadded * 4 + 2 * 4 * kBlockM * 4 + kClusterBytes <= int(sizeof(Element)) * 4 * 2 * kStages * kChunkSize;
  static constexpr int kMergeStride = kMergePadded ? kMergeStridePadded : kHeadDim;
  static constexpr int kMergeBytes = 4 * kBlockM * kMergeStride * 4 + 2 * 4 * kBlockM * 4;
  // The cluster combine's O (16, D) and LSE (16) of the block's split, past the merge's buffers (kClusterBytes).
  static_assert(kMergeBytes + kClusterBytes <= kKVBytes, "the merge and the cluster combine reuse the K / V buffers");
  static constexpr int kSmemBytes = int(sizeof(Element)) * kQSize + kKVBytes;
};

// gemm_rs for one warp's MMA: the copy's thread is the lane.
template <class Mma, class Acc, class RegA, class RegB, class SmemB, class CopyB>
__device__ __forceinline__ void warp_gemm_rs(Mma const& mma, Acc& acc, RegA const& rA, RegB& rB, SmemB const& sB,
                                             CopyB const& copy_b, int lane) {
  using namespace cute;
  Tensor rB_view = copy_b.get_thread_slice(lane).retile_D(rB);
  cute::copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) cute::copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// One 16-row tile of packed rows [row0, row_end) (fwd_split_tile's arguments). kCluster: the splits merge in the
// cluster (cluster_combine) instead of writing partials.
template <class Traits, bool kExtended, bool kCluster>
__device__ __forceinline__ void fwd_split_narrow_tile(const FwdParams& params, const SplitSeq& seq, int bidb, int head0,
                                                      int64_t row0, int64_t row_end, int split, int splits,
                                                      bool direct) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kChunk = Traits::kChunk, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages, kWarps = 4;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kChunk>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kChunk>>;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int pack = split_pack(params);
  const int bidh_k = head0 / (params.num_heads / params.num_heads_k);
  const int tile_rows = int(row_end - row0);  // 1..16
  auto query_of = [&](int r) { return int((row0 + r) / pack); };
  auto head_of = [&](int r) { return head0 + int((row0 + r) % pack); };
  extern __shared__ __align__(128) char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (16, D)
  // Q first, asynchronously: the oldest commit group, waited for before the main loop.
  gather_q</*kAsync=*/true, Element, kBlockM, kHeadDim>(params, seq, sQ, tile_rows, query_of, head_of, tid, 128);
  const Window window(seq.len_q, seq.len_k, params);
  const BlockRange blocks = fwd_block_range_rows<kChunk, kExtended>(window, int(row0 / pack), int((row_end - 1) / pack));
  const SplitBlocks mine = direct ? SplitBlocks{blocks.n_min, blocks.n_max}
                                  : split_blocks(blocks.n_min, blocks.n_max, split, splits);

  Tensor mK = gmem_rows<kHeadDim>(static_cast<const Element*>(params.k) + seq.k_offset + bidh_k * params.k_head_stride,
                                  seq.len_k, params.k_row_stride);  // (len_k, D)
  Tensor mV = gmem_rows<kHeadDim>(static_cast<const Element*>(params.v) + seq.v_offset + bidh_k * params.v_head_stride,
                                  seq.len_k, params.v_row_stride);  // (len_k, D)
  Tensor gK = local_tile(mK, TileKV{}, make_coord(_, 0));  // (16, D, n)
  Tensor gV = local_tile(mV, TileKV{}, make_coord(_, 0));  // (16, D, n)

  // This warp's chunk buffers: K stages, then V stages.
  Element* kv_base = sQ.data().get() + int(Traits::kQSize) + warp * 2 * kStages * int(Traits::kChunkSize);
  Tensor sK = make_tensor(make_smem_ptr(kv_base), typename Traits::SmemLayoutKV{});  // (16, D), stage 0
  Tensor sV = make_tensor(make_smem_ptr(kv_base + kStages * int(Traits::kChunkSize)), typename Traits::SmemLayoutKV{});  // (16, D)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});  // (D, 16), stage 0

  typename Traits::WarpGmemCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(lane);
  Tensor tKgK = gmem_thr.partition_S(gK);                                // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr.partition_D(sK);                                // (CPY, CPY_N, CPY_D)
  Tensor tVgV = gmem_thr.partition_S(gV);                                // (CPY, CPY_N, CPY_D, n)
  Tensor tVsV = gmem_thr.partition_D(sV);                                // (CPY, CPY_N, CPY_D)
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(TileKV{}));  // (CPY, CPY_N, CPY_D) -> (row, col)
  // This warp's i-th chunk of the split, into stage i % kStages; the sequence's last chunk may be cut (zeros).
  auto chunk_of = [&](int i) { return mine.begin + warp + kWarps * i; };
  // one_page: every chunk lies on one page (pages of a multiple of 16 rows, the keys starting on a 16-row boundary
  // of one): one table entry a chunk, and the chunk's copies are the contiguous cache's (the head's first chunk,
  // tKgK(_, _, _, 0): seq.k_offset is 0 when paged) moved to the page's rows: one 64-bit base a tensor, each row's
  // address a register and its columns in the copies' immediates. Paged batch-1 decode had paid ~0.2 us a chunk over
  // contiguous (TUNING 155 / 164) in each copy's own 64-bit address (r x row stride + col, then scaled: 5
  // instructions a copy, 16 copies: +15 % of the kernel's instructions at 1 x 4k, TUNING 194). The loads and the
  // chunk loop are compiled once for each answer, so that the other paths carry none of its instructions (tested
  // chunk by chunk, the compiler predicated the one-page copies into every paged chunk's path and pages of one row
  // ran 4-7 % slower: TUNING 169).
  const bool one_page_chunks = seq.pages != nullptr && params.page_size % kChunk == 0 && seq.k_row0 % kChunk == 0;
  auto load_chunk = [&](int i, auto one_page) {
    const int n = chunk_of(i), offset = (i % kStages) * int(Traits::kChunkSize);
    if constexpr (decltype(one_page)::value) {
      // The chunk's first row and its page (first.row + kChunk <= page_size); rows past len_k copy nothing.
      const PageSlot first = page_slot(params, seq.k_row0 + n * kChunk);
      const int64_t page = clamp_page(params, seq.pages[first.column]);
      const int rows_left = seq.len_k - n * kChunk;
      load_tile<true>(gmem_copy,
                      at_offset(tKgK(_, _, _, 0), page * params.k_batch_stride + first.row * params.k_row_stride),
                      at_offset(tKsK, offset), tKVcKV, rows_left, params.head_dim);
      load_tile<true>(gmem_copy,
                      at_offset(tVgV(_, _, _, 0), page * params.v_batch_stride + first.row * params.v_row_stride),
                      at_offset(tVsV, offset), tKVcKV, rows_left, params.head_dim);
    } else {
      load_kv_rows<Element>(params, seq, bidh_k, gmem_copy, tKgK(_, _, _, n), tVgV(_, _, _, n),
                            at_offset(tKsK, offset), at_offset(tVsV, offset), tKVcKV, n * kChunk);
    }
  };
  auto prologue = [&](auto one_page) {
    CUTE_UNROLL
    for (int s = 0; s < kStages - 1; ++s) {  // one commit group per chunk, empty past the range's end
      if (chunk_of(s) < mine.end) load_chunk(s, one_page);
      cp_async_fence();
    }
  };
  if (one_page_chunks) prologue(cute::true_type{}); else prologue(cute::false_type{});

  typename Traits::WarpMma mma;
  auto thr_mma = mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);  // (MMA, 1, D / 16)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);  // (MMA, 2, D / 16)
  Tensor tOrVt = thr_mma.partition_fragment_B(
      make_tensor(sV.data(), get_nonswizzle_portion(typename Traits::SmemLayoutVt{})));  // (MMA, D / 8, 1)
  Tensor acc_o = partition_fragment_C(mma, TileQ{});  // (MMA, 1, D / 8)
  clear(acc_o);
  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma);
  Tensor tSsK = smem_copy_k.get_thread_slice(lane).partition_S(sK);    // (CPY, CPY_N, CPY_D), stage 0
  Tensor tOsVt = smem_copy_v.get_thread_slice(lane).partition_S(sVt);  // (CPY, CPY_D, CPY_N), stage 0
  cp_async_wait<kStages - 1>();  // Q's group, the oldest (the prologue's kStages - 1 chunks may still be in flight)
  __syncthreads();  // Q is in shared memory
  cute::copy(smem_copy_q, smem_copy_q.get_thread_slice(lane).partition_S(sQ),
             smem_copy_q.get_thread_slice(lane).retile_D(tSrQ));  // Q stays in registers

  Tensor tScS = rowcol_view(thr_mma.partition_C(make_identity_tensor(TileS{})));  // (rows, cols) -> tile coords
  constexpr int kRows = decltype(size<0>(tScS))::value;
  int query[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) query[r] = query_of(get<0>(tScS(r, 0)));
  const ScoreMods mods(params, kExtended);
  const Alibi alibi = mods.alibi(params, seq.len_q, seq.len_k, bidb, head0);  // unpacked with ALiBi
  OnlineSoftmax<kRows> softmax(mods.scale(params));

  auto chunk_loop = [&](auto one_page) {
    for (int i = 0; chunk_of(i) < mine.end; ++i) {
      cp_async_wait<kStages - 2>();
      __syncwarp();  // chunk i has landed for every lane, and every lane is done with chunk i - 1's stage
      if (chunk_of(i + kStages - 1) < mine.end) load_chunk(i + kStages - 1, one_page);
      cp_async_fence();
      const int n = chunk_of(i), offset = (i % kStages) * int(Traits::kChunkSize);
      Tensor acc_s = partition_fragment_C(mma, TileS{});  // (MMA, 1, 2)
      clear(acc_s);
      warp_gemm_rs(mma, acc_s, tSrQ, tSrK, at_offset(tSsK, offset), smem_copy_k, lane);
      Tensor S = rowcol_view(acc_s);
      if constexpr (kExtended) mods.apply(S, params, alibi, tScS, int(row0), n * kChunk);
      if (n >= blocks.n_masked_min || (kExtended && n < blocks.n_unmasked_min)) {
        mask_queries<kExtended>(S, tScS, query, window, n * kChunk);
      }
      Tensor O = rowcol_view(acc_o);
      // FA4's conditional rescale (OnlineSoftmax's kLazy): a warp's 16-key chunks rescale O (64 accumulators a
      // thread) only when a row's max passes its reference by more than 2^8, which after a sequence's first chunks is
      // rare. Taken when the decode kernel read as instruction-bound (64 x 1k: 15.3M instructions against cuDNN's
      // 11.0M, TUNING 166); ptxas predicates the skipped FMULs into every chunk all the same (TUNING 169), and
      // forcing a real branch made no call faster: the chunk loop is latency-bound (TUNING 175).
      float correction[kRows];
      if (__any_sync(0xffffffffu, softmax.template update_scores</*kLazy=*/true>(S, correction))) {
        OnlineSoftmax<kRows>::rescale(O, correction);  // warp-uniform
      }
      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));  // (MMA, 1, 1)
      warp_gemm_rs(mma, acc_o, tOrP, tOrVt, at_offset(tOsVt, offset), smem_copy_v, lane);
    }
  };
  if (one_page_chunks) chunk_loop(cute::true_type{}); else chunk_loop(cute::false_type{});
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its K / V buffers: the merge reuses them

  // Merge: warp w's unnormalized O_w, row max m_w (raw scores) and row sum l_w; with M the rows' max over
  // warps and f_w = exp2((m_w - M) scale log2e): O = sum_w f_w O_w / sum_w f_w l_w, LSE = M scale + log(sum).
  // A row's weights f_w / sum and its LSE are computed once, by one thread a row, then every element is four
  // FMAs (4 columns a thread): computed per element, the exps, the division and the log made the merge a chain
  // that grew with the packed rows (TUNING 180).
  constexpr int kMergeStride = Traits::kMergeStride;  // (floats between rows)
  float* merge_o = reinterpret_cast<float*>(kv_base - warp * 2 * kStages * int(Traits::kChunkSize));  // (4, 16, D)
  float* merge_m = merge_o + kWarps * kBlockM * kMergeStride;  // (4, 16): m_w, then the weights
  float* merge_l = merge_m + kWarps * kBlockM;              // (4, 16): l_w, then (row 0's) the LSE
  {
    Tensor O = rowcol_view(acc_o);
    Tensor tOcO = rowcol_view(thr_mma.partition_C(make_identity_tensor(TileQ{})));  // (rows, cols) -> tile coords
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(tOcO(r, 0));
      const float sum = quad_allreduce(softmax.row_sum[r], [](float a, float b) { return a + b; });
      if (row >= tile_rows) continue;  // (decode's 1-8 rows: half the stores)
      if (get<1>(tOcO(r, 0)) == 0) {
        merge_m[warp * kBlockM + row] = softmax.row_max[r];
        merge_l[warp * kBlockM + row] = sum;
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) merge_o[(warp * kBlockM + row) * kMergeStride + get<1>(tOcO(r, c))] = O(r, c);
    }
  }
  __syncthreads();
  const bool to_accum = !direct;
  if (tid < tile_rows) {  // row tid's weights and LSE, over its m_w / l_w (this thread alone reads and writes them)
    const int row = tid;
    float m_w[kWarps], f[kWarps], m = -INFINITY;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) m_w[w] = merge_m[w * kBlockM + row], m = fmaxf(m, m_w[w]);
    float sum = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      f[w] = m == -INFINITY || m_w[w] == -INFINITY ? 0.f : fast_exp2((m_w[w] - m) * softmax.scale_log2);
      sum += f[w] * merge_l[w * kBlockM + row];
    }
    float lse = sum == 0.f ? -INFINITY : m * softmax.scale + logf(sum);
    float scale = sum == 0.f ? 0.f : 1.f / sum;
    if (!kCluster && !to_accum) add_sink(lse, scale, sink_logit(params, head_of(row)));  // out directly: the sink
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) merge_m[w * kBlockM + row] = f[w] * scale;
    merge_l[row] = lse;
  }
  __syncthreads();
  float* cluster_o = merge_l + kWarps * kBlockM;       // (16, D): kCluster's result of this split
  float* cluster_lse = cluster_o + kBlockM * kHeadDim;  // (16)
  float* accum_o = params.split_accum;
  float* accum_lse = params.split_accum + (to_accum ? split_lse_offset(params, splits) : 0);
  constexpr int kVecs = kHeadDim / 4;  // float4s a row (head dims are multiples of 8)
  for (int idx = tid; idx < tile_rows * kVecs; idx += 128) {
    const int row = idx / kVecs, col = idx % kVecs * 4;
    if (col >= params.head_dim) continue;
    float4 o = {0.f, 0.f, 0.f, 0.f};
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      const float g = merge_m[w * kBlockM + row];
      const float4 x = *reinterpret_cast<const float4*>(merge_o + (w * kBlockM + row) * kMergeStride + col);
      o.x += g * x.x, o.y += g * x.y, o.z += g * x.z, o.w += g * x.w;
    }
    const float lse = merge_l[row];
    if constexpr (kCluster) {  // direct is false here: the launcher clusters fixed-length calls of 2+ splits only
      *reinterpret_cast<float4*>(cluster_o + row * kHeadDim + col) = o;
      if (col == 0) cluster_lse[row] = lse;
      continue;
    }
    if (to_accum) {
      const int64_t out_row = split_row(params, split, bidb, head_of(row), query_of(row));
      *reinterpret_cast<float4*>(accum_o + out_row * params.head_dim + col) = o;
      if (col == 0) accum_lse[out_row] = lse;
    } else {
      Element* dst = static_cast<Element*>(params.out) + seq.o_offset(params, query_of(row), head_of(row)) + col;
      dst[0] = Element(o.x), dst[1] = Element(o.y), dst[2] = Element(o.z), dst[3] = Element(o.w);
      if (col == 0) params.lse[seq.lse_offset(params, query_of(row), head_of(row))] = lse;
    }
  }
  if constexpr (kCluster) {
    cluster_combine<Element, kHeadDim>(params, seq, cluster_o, cluster_lse, tile_rows, split, splits, query_of,
                                       head_of);
  }
}

// kCluster: launched in clusters of (1, splits, 1) blocks, every block of a cluster walking the same tiles (fixed
// length: no direct tiles), so that each tile's two cluster barriers are met by all of them.
template <class Traits, bool kExtended, bool kCluster = false>
__global__ void __launch_bounds__(128, 2) fwd_split_narrow_kernel(const __grid_constant__ FwdParams params) {
  griddep_wait();  // as fwd_split_kernel
  griddep_launch_dependents();
  const int split = blockIdx.y, splits = gridDim.y;
  const int pack = split_pack(params), groups = params.num_heads / pack;
  for (int64_t z = blockIdx.z; z < int64_t(params.batch) * groups; z += gridDim.z) {  // as fwd_split_kernel
    const int bidb = int(z / groups), head0 = int(z % groups) * pack;
    split_zero_uncovered<typename Traits::Element>(params, bidb, head0, pack, 128);
    const SplitSeq seq(params, bidb);
    for_each_split_tile<Traits::kBlockM, kCluster>(params, int64_t(seq.len_q) * pack, pack, split, splits,
                                                   [&](int64_t row0, int64_t row_end, bool direct) {
      __syncthreads();  // the previous tile's merge is done with shared memory
      fwd_split_narrow_tile<Traits, kExtended, kCluster>(params, seq, bidb, head0, row0, row_end, split, splits, direct);
    });
  }
}

}  // namespace flash_attn2
