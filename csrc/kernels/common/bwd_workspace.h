// The backward's fp32 workspace: every region, its offset and its size, for both paths. The caller allocates
// it as two buffers (BwdParams::softmax_d and ::dq_accum, sized by bwd_softmax_d_elems / bwd_dq_accum_elems);
// the preprocess (bwd_aux.cu) fills the first and zeroes the second before the main kernel runs.
//
//   softmax_d  | D = rowsum(dO o O)  | pad | LSE * log2(e)       | pad | tile counter |
//              | (heads, total_q)    |     | (heads, total_q)    |     | int, float4  |
//              0                           bwd_lse_log2_offset         bwd_tile_counter_offset
//
//   dq_accum   | dQ accumulator, one of three layouts per kernel            | turn counters (int)  |
//              | Sm80ThreadMajor: (splits, heads, total_q + batch * bwd_block_m, width), thread-major tiles |
//              | Sm90Rows:        (heads, total_q, width) row-major                                          |
//              | Sm90Fragments:   (heads, bwd_dq_slots, 64 x width) in register order                        |
//              0                                           bwd_dq_turns_offset (Hopper, deterministic)
//              | ... | dK accumulator (heads_k, total_k, width) | dV accumulator (same) |   (head splits)
//                    bwd_dkv_accum_offset(kv = 0)            (kv = 1)
//
// The dK / dV accumulators start after the largest dQ layout without deterministic splits (the SM80 one), in the
// row width of the kernel that adds into them (the bucket on SM80; the Hopper kernel's, which pads 160 / 224 to
// 192 / 256); bwd_dq_accum_size covers both. The converters sit with the kernels that read each layout:
// Sm80ThreadMajor's in sm80/dq_accum.h (convert_dq_kernel), the Hopper ones and dK / dV's in bwd_aux.cu.
// Host and device code, no CuTe.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// ---- softmax_d: D, LSE * log2(e), the tile counter ----

// LSE * log2(e) from this offset, a multiple of 4 so that both arrays' rows share their 16-byte alignment (the
// Hopper backward loads them with TMA, whose innermost box start must be 16-byte aligned).
constexpr int64_t bwd_lse_log2_offset(const BwdParams& p) { return (int64_t(p.num_heads) * p.total_q + 3) / 4 * 4; }
// After LSE: the int a persistent Hopper backward claims its key blocks from (zeroed by the preprocess), in a
// float4 of its own.
constexpr int64_t bwd_tile_counter_offset(const BwdParams& p) { return 2 * bwd_lse_log2_offset(p); }
constexpr int64_t bwd_softmax_d_size(const BwdParams& p) { return bwd_tile_counter_offset(p) + 4; }

// ---- dq_accum: the dQ accumulator's layouts ----

// Sm80ThreadMajor: query rows per SM80 backward tile (sm80/tile_size.h builds its tiles with it, and
// sm80/kernel_traits.h asserts they agree). Sequence b
// starts at row start_b + b * bwd_block_m of a head's region, so that its last, partial tile ends before the
// next sequence's first; sm80/dq_accum.h stores each tile thread-major.
constexpr int bwd_block_m(int head_dim) { return head_dim <= 64 ? 128 : 64; }
__host__ __device__ constexpr int64_t bwd_dq_rows_sm80(const BwdParams& p, int block_m) {
  return p.total_q + int64_t(p.batch) * block_m;
}

// Sm90Rows (kernels with 128-row steps or 32-column dQ parts: d 32, d 64's plain and plain-ALiBi kernels, d > 128;
// sm90/tile_size.h: bwd_tile_sm90): where the TMA reduce-add boxes land.
__host__ __device__ inline int64_t bwd_dq_accum_offset_sm90(const BwdParams& p, int width, int head, int64_t packed_row) {
  return (int64_t(head) * p.total_q + packed_row) * width;
}

// Sm90Fragments (the narrow kernels with 64-row steps, Traits::kDQFragments): each query block's dQ whole in
// slot bwd_dq_slot(...) + m_block, 64 x width floats in the dQ GEMMs' register order (bwd_dq_fragment_word).
// Query slots per head for blocks of block_m rows (64: the fragment slots; the kernel's kBlockM: deterministic
// mode's turn counters): a sequence's blocks take slots from start / block_m + b on (start: its first packed
// row; fixed length: b x seqlen_q), as the tile scheduler counts them, so that each sequence's slots follow the
// last one's and stay inside the region for any clamped cu_seqlens; where a sequence starts before an earlier
// one (cu_seqlens decreasing before its last entry), its slots may meet the earlier one's, whose dq
// flash_attn2.h then leaves undefined.
__host__ __device__ inline int64_t bwd_dq_slots(const BwdParams& p, int block_m = 64) {
  return p.total_q / block_m + p.batch;
}
__host__ __device__ inline int64_t bwd_dq_slot(int64_t packed_q_start, int bidb, int block_m = 64) {
  return packed_q_start / block_m + bidb;
}
__host__ __device__ inline int64_t bwd_dq_fragment_offset(const BwdParams& p, int width, int head, int64_t slot) {
  return (int64_t(head) * bwd_dq_slots(p) + slot) * 64 * width;
}
// A slot in fragments: narrow warpgroup w computed columns [w cols, (w + 1) cols) (cols = width / 2) as a 64 x cols
// wgmma accumulator, whose thread t holds, for each 8 columns j, rows r and r + 8 (r = 16 (t / 32) + t % 32 / 4)
// at columns 8 j + 2 (t % 4) + {0, 1} (CuTe's GMMA CLayout_64xN), in that order: one 16-byte word, the
// warpgroup's words of one j in thread order, so that its staging stores are whole 512-byte warp rows (no
// bank conflicts) and the writer adds the staged share to the slot in one bulk copy. Word `word` of a slot
// holds (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1).
struct DQFragmentWord {
  int row, col;
};
__host__ __device__ inline DQFragmentWord bwd_dq_fragment_word(int word, int cols) {
  const int w = word / (16 * cols), j = word / 128 % (cols / 8), t = word % 128;
  return {16 * (t / 32) + t % 32 / 4, w * cols + 8 * j + 2 * (t % 4)};
}

// Deterministic mode's dQ turn counters on the Hopper backward (sm90/dq_turns.h): int32, after its dQ
// accumulator, (writer warp, head, query slot) for up to kMaxDQWriters writer warps and bwd_dq_slots(p,
// kBlockM) query slots per head.
constexpr int kMaxDQWriters = 3;
__host__ __device__ inline int64_t bwd_dq_turns_offset(const BwdParams& p, int width) {
  return int64_t(p.num_heads) * bwd_dq_slots(p) * 64 * width;
}

// ---- dq_accum: dK and dV with head splits ----

// Where dK (kv = 0) and dV (kv = 1) accumulate with head splits: (heads_k, total_k rows, bucket) row-major
// each, after the largest dQ accumulator layout without deterministic splits (the SM80 one, rows padded by
// bwd_block_m per sequence).
__host__ __device__ inline int64_t bwd_dkv_accum_offset(const BwdParams& p, int bucket, int kv, int head_k,
                                                        int64_t packed_row) {
  const int64_t dq = int64_t(p.num_heads) * bwd_dq_rows_sm80(p, bwd_block_m(bucket)) * bucket;
  return dq + ((int64_t(kv) * p.num_heads_k + head_k) * p.total_k + packed_row) * bucket;
}

// ---- dq_accum's size ----

// The elements dq_accum needs for the head-dim bucket when the backward runs on the Hopper path (on_sm90) or the
// SM80 one: the larger of the two paths' dQ layouts (sm90_width: the row width of the Hopper kernel serving the
// bucket, which pads 160 and 224; 0 for none), with head_splits blocks per key block (the dK / dV regions above 1).
inline int64_t bwd_dq_accum_size(const BwdParams& p, int bucket, int sm90_width, bool on_sm90, int head_splits) {
  // Deterministic mode's split accumulators only where the SM80 backward will run them.
  const int64_t sm80 =
      int64_t(on_sm90 ? 1 : std::max(1, p.num_splits)) * p.num_heads * bwd_dq_rows_sm80(p, bwd_block_m(bucket)) * bucket;
  // The Hopper backward's (heads, bwd_dq_slots x 64 rows) in its kernel's row width.
  const int width = std::max(bucket, sm90_width);
  int64_t sm90 = bwd_dq_turns_offset(p, width);
  if (p.num_splits > 0) {  // deterministic: the turn counters after it, for the smallest query blocks (64 rows)
    sm90 += (kMaxDQWriters * p.num_heads * bwd_dq_slots(p) + 3) / 4 * 4;  // zeroed as float4s
  }
  // Then, with head splits, dK and dV (bwd_dkv_accum_offset), in the row width of whichever path runs.
  if (head_splits == 1) return std::max(sm80, sm90);
  return std::max({sm80, sm90, bwd_dkv_accum_offset(p, bucket, 2, 0, 0), bwd_dkv_accum_offset(p, width, 2, 0, 0)});
}

}  // namespace flash_attn2
