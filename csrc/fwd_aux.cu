// The split-KV forward's kernels around the main one, for any head dim and dtype (plain CUDA, the head dim a
// runtime value, like bwd_aux.cu): the combine of the splits' partials, flash_attn_with_kvcache's update
// (new keys and values into the caches, rotary embedding of keys and queries), and the merge of two partial
// results that context parallelism's ring steps make.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "flash_attn2/flash_attn2.h"
#include "common/launch.h"
#include "common/launchers.h"
#include "common/sink.h"
#include "common/split_kv.h"

namespace flash_attn2 {
namespace {

constexpr int kWarps = 8;

__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ inline T from_float(float x);
template <>
__device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One warp per output row (batch entry, head, query row < seqlen_q; varlen: < the sequence's length, the rows
// past a too-small max_seqlen_q hint being written by the split kernel directly): LSE = log sum_s exp(LSE_s), out = sum_s exp(LSE_s - LSE)
// O_s, in fp32, four columns per lane at a time, with the head's sink (if any) in LSE. A row whose splits all saw no
// key gets out 0 and LSE -inf, or the sink (as an unsplit forward gives).
// A batch-1 decode call waits on this kernel's chain of round trips to L2 after the split kernel: every load is
// issued before any of its values is used, kCombineBatch splits at a time (a loop that read split s's LSE, then its
// O, then split s + 1's, serialized 2 round trips a split: 32+ at 16 splits).
constexpr int kCombineBatch = 8;

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) fwd_combine_kernel(const __grid_constant__ FwdParams p, int splits) {
  griddep_wait();  // launched after the split kernel (launch_after): its partials
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;  // (batch, head, query) flattened
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  if (row >= rows) return;
  const int i = int(row % p.seqlen_q), h = int(row / p.seqlen_q % p.num_heads), b = int(row / p.seqlen_q / p.num_heads);
  const SplitSeq seq(p, b);
  if (i >= seq.len_q) return;  // varlen: past this sequence (no partials were written for it)
  const float* accum_lse = p.split_accum + split_lse_offset(p, splits);
  const int64_t split_stride = int64_t(p.batch) * p.num_heads * p.seqlen_q;  // rows per split
  T* out = static_cast<T*>(p.out) + seq.o_offset(p, i, h);
  // Both paths' pieces: the row's LSE with the head's sink (once, here: the partials' LSEs leave it out), written
  // by lane 0; a batch of splits' O columns added with their weights exp(LSE_s - LSE) (a split without keys, LSE_s
  // -inf, is skipped: its O is not read); four columns stored in the output dtype.
  auto finish_lse = [&](float lse) {
    float unused = 1.f;
    add_sink(lse, unused, sink_logit(p, h));
    if (lane == 0) p.lse[seq.lse_offset(p, i, h)] = lse;
    return lse;
  };
  auto add_weighted = [&](float (&acc)[4], const float (&lse_s)[kCombineBatch], const float4 (&o)[kCombineBatch],
                          int s0, float lse) {  // splits s0 .. s0 + kCombineBatch - 1
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      if (s0 + j >= splits || lse_s[j] == -INFINITY) continue;
      const float w = expf(lse_s[j] - lse);
      acc[0] += w * o[j].x, acc[1] += w * o[j].y, acc[2] += w * o[j].z, acc[3] += w * o[j].w;
    }
  };
  auto store4 = [&](int col, const float (&acc)[4]) {
    T vals[4];
    for (int k = 0; k < 4; ++k) vals[k] = from_float<T>(acc[k]);
    *reinterpret_cast<uint2*>(out + col) = *reinterpret_cast<const uint2*>(vals);
  };
  if (splits <= kCombineBatch && p.head_dim <= 128) {
    // Up to kCombineBatch splits and 128 columns (decode's plans): every split's LSE and this lane's four columns
    // of its O in one round trip, the LSE from those in registers (each lane holds all of them), then the sum:
    // one wait on L2 where the general path below takes two (the LSEs, then the O rows they weigh). The same
    // result: LSE's fold in split order, max first (merged_split_lse, common/split_kv.h).
    const int col = lane * 4;
    float lse_s[kCombineBatch];
    float4 o[kCombineBatch];
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const int s = j < splits ? j : splits - 1;  // past the last split: a repeat, not used
      lse_s[j] = accum_lse[s * split_stride + row];
      const float* o_row = p.split_accum + (s * split_stride + row) * p.head_dim;
      o[j] = col < p.head_dim ? *reinterpret_cast<const float4*>(o_row + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float lse = finish_lse(merged_split_lse(lse_s, splits));
    if (col >= p.head_dim) return;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (lse != -INFINITY) add_weighted(acc, lse_s, o, 0, lse);
    store4(col, acc);
    return;
  }
  // LSE: each lane folds its splits' LSEs (s = lane, lane + 32, ...) into a running (max, sum of exp), then the
  // warp merges the lanes' pairs (symmetric: the lanes agree bit for bit). NaN partials as the two-pass form had
  // them: the LSE is NaN if any split's is and another's is finite, -inf if none is finite.
  float m = -INFINITY, sum = 0.f;
  bool nan_seen = false;
  for (int s = lane; s < splits; s += 32) {
    const float x = accum_lse[s * split_stride + row];
    if (x != x) {
      nan_seen = true;
    } else if (x > m) {
      sum = sum * expf(m - x) + 1.f;  // m = -inf: sum is 0
      m = x;
    } else if (x != -INFINITY) {
      sum += expf(x - m);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m_o = __shfl_xor_sync(0xffffffffu, m, offset), sum_o = __shfl_xor_sync(0xffffffffu, sum, offset);
    const float top = fmaxf(m, m_o);
    const float a = m == -INFINITY ? 0.f : expf(m - top), b = m_o == -INFINITY ? 0.f : expf(m_o - top);
    sum = sum * a + sum_o * b;
    m = top;
  }
  const bool any_nan = __any_sync(0xffffffffu, nan_seen);
  const float lse = finish_lse(m == -INFINITY ? -INFINITY : any_nan ? NAN : m + logf(sum));
  for (int col = lane * 4; col < p.head_dim; col += 128) {  // head_dim is a multiple of 8
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (lse != -INFINITY) {
      for (int s0 = 0; s0 < splits; s0 += kCombineBatch) {
        float lse_s[kCombineBatch];
        float4 o[kCombineBatch];
#pragma unroll
        for (int j = 0; j < kCombineBatch; ++j) {  // the batch's loads, all in flight together
          const int s = s0 + j < splits ? s0 + j : splits - 1;  // past the last split: a repeat, not used
          lse_s[j] = accum_lse[s * split_stride + row];
          o[j] = *reinterpret_cast<const float4*>(p.split_accum + (s * split_stride + row) * p.head_dim + col);
        }
        add_weighted(acc, lse_s, o, s0, lse);
      }
    }
    store4(col, acc);
  }
}

// Rotary embedding of one row's first rotary_dim columns at table row `pos`, the rest copied: dst col c from
// src. cos / sin rows hold rotary_dim / 2 entries.
template <typename T>
__device__ __forceinline__ void rotate_row(const T* src, T* dst, int head_dim, int rotary_dim, bool interleaved, const T* cos,
                           const T* sin, int lane, int lanes) {
  for (int c = lane; c < head_dim; c += lanes) {
    float x = to_float(src[c]);
    if (c < rotary_dim) {
      const int half = rotary_dim / 2;
      // Pair (c, partner): c first (x0) or second (x1) of it, and the table entry both use.
      const bool first = interleaved ? c % 2 == 0 : c < half;
      const int partner = interleaved ? (first ? c + 1 : c - 1) : (first ? c + half : c - half);
      const int t = interleaved ? c / 2 : (first ? c : c - half);
      const float y = to_float(src[partner]), co = to_float(cos[t]), si = to_float(sin[t]);
      x = first ? x * co - y * si : x * co + y * si;  // (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)
    }
    dst[c] = from_float<T>(x);
  }
}

// One warp per row: the new keys (rotated) and values into the caches, then q's rows (rotated) into q_out.
// No __launch_bounds__: with it (256 threads) ptxas held the kernel to 40 registers and spilled 16 bytes.
template <typename T>
__global__ void kv_append_kernel(const __grid_constant__ KvAppendParams p) {
  griddep_launch_dependents();  // the split kernel may launch now; it waits for this grid before it reads
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t kv_rows = p.k_new != nullptr ? int64_t(p.batch) * p.seqlen_new * p.num_heads_k : 0;
  const int64_t q_rows = p.q != nullptr ? int64_t(p.batch) * p.seqlen_q * p.num_heads : 0;
  const bool rotary = p.rotary_dim > 0 && p.rotary_cos != nullptr && p.rotary_sin != nullptr;
  auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; };
  if (item < kv_rows) {
    const int h = int(item % p.num_heads_k), j = int(item / p.num_heads_k % p.seqlen_new);
    const int b = int(item / p.num_heads_k / p.seqlen_new);
    const int64_t dst_row = clamp(p.cache_seqlens[b], 0, p.cache_seqlen) + j;
    if (dst_row >= p.cache_seqlen) return;  // past the cache: not written
    // Where logical row dst_row lives: (cache batch entry, row), or through the page table (page, row in it).
    int64_t entry = p.cache_batch_idx != nullptr ? clamp(p.cache_batch_idx[b], 0, p.cache_batch - 1) : b, row = dst_row;
    if (p.page_table != nullptr) {
      entry = clamp(p.page_table[b * p.page_table_batch_stride + dst_row / p.page_size], 0, p.num_pages - 1);
      row = dst_row % p.page_size;
    }
    const T* k = static_cast<const T*>(p.k_new) + b * p.kn_batch_stride + j * p.kn_row_stride + h * p.kn_head_stride;
    const T* v = static_cast<const T*>(p.v_new) + b * p.vn_batch_stride + j * p.vn_row_stride + h * p.vn_head_stride;
    T* kc = static_cast<T*>(p.k_cache) + entry * p.kc_batch_stride + row * p.kc_row_stride + h * p.kc_head_stride;
    T* vc = static_cast<T*>(p.v_cache) + entry * p.vc_batch_stride + row * p.vc_row_stride + h * p.vc_head_stride;
    if (rotary) {
      const int64_t pos = clamp(dst_row, 0, p.seqlen_ro - 1);
      rotate_row(k, kc, p.head_dim, p.rotary_dim, p.interleaved, static_cast<const T*>(p.rotary_cos) + pos * p.cos_row_stride,
                 static_cast<const T*>(p.rotary_sin) + pos * p.sin_row_stride, lane, 32);
    } else {
      for (int c = lane * 8; c < p.head_dim; c += 256) *reinterpret_cast<uint4*>(kc + c) = *reinterpret_cast<const uint4*>(k + c);
    }
    for (int c = lane * 8; c < p.head_dim; c += 256) *reinterpret_cast<uint4*>(vc + c) = *reinterpret_cast<const uint4*>(v + c);
    return;
  }
  if (item - kv_rows >= q_rows) return;
  const int64_t q_item = item - kv_rows;
  const int h = int(q_item % p.num_heads), i = int(q_item / p.num_heads % p.seqlen_q);
  const int b = int(q_item / p.num_heads / p.seqlen_q);
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + int64_t(i) * p.q_row_stride + h * p.q_head_stride;
  T* qo = static_cast<T*>(p.q_out) + b * p.qo_batch_stride + int64_t(i) * p.qo_row_stride + h * p.qo_head_stride;
  const int64_t pos = clamp(clamp(p.cache_seqlens[b], 0, p.cache_seqlen) + (p.q_positions_per_row ? i : 0), 0,
                            p.seqlen_ro - 1);
  rotate_row(q, qo, p.head_dim, rotary ? p.rotary_dim : 0, p.interleaved,
             static_cast<const T*>(p.rotary_cos) + pos * p.cos_row_stride,
             static_cast<const T*>(p.rotary_sin) + pos * p.sin_row_stride, lane, 32);
}

// One warp per (batch entry, row, head) of a ring step's merge (MergeParams): the two LSEs into the merged one and
// each side's weight, then out = out w_a + block w_b four columns a lane. The weights sum to 1 (lse' = log(e^a +
// e^b)), and are 0 for a row neither side has a key for. Every lane reads the row's LSEs before lane 0 writes one.
// kOutInDtype: out in T (MergeParams::out_in_dtype), converted to fp32, merged as fp32 out is, rounded once.
template <typename T, bool kOutInDtype>
__global__ void __launch_bounds__(kWarps * 32) merge_partial_kernel(const __grid_constant__ MergeParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;  // (batch, row, head) flattened
  if (item >= int64_t(p.batch) * p.seqlen * p.heads) return;
  const int h = int(item % p.heads);
  const int64_t row_item = item / p.heads;
  const int s = int(row_item % p.seqlen), b = int(row_item / p.seqlen);
  float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + s * p.lse_row_stride;
  const float l_a = *lse;
  const float l_b = p.block_lse[b * p.block_lse_batch_stride + h * p.block_lse_head_stride + s * p.block_lse_row_stride];
  const float m = fmaxf(l_a, l_b);  // fmaxf drops a NaN: checked below, so that one propagates as the torch ops do
  float w_a = 0.f, w_b = 0.f, merged = -INFINITY;
  if (isnan(l_a) || isnan(l_b)) {
    w_a = w_b = merged = NAN;
  } else if (m != -INFINITY) {
    const float e_a = expf(l_a - m), e_b = expf(l_b - m), sum = e_a + e_b;
    w_a = e_a / sum, w_b = e_b / sum, merged = m + logf(sum);
  }
  const int64_t out_offset = b * p.out_batch_stride + s * p.out_row_stride + h * p.out_head_stride;
  const T* block = static_cast<const T*>(p.block_out) + b * p.block_batch_stride + s * p.block_row_stride +
                   h * p.block_head_stride;
  for (int c = lane * 4; c < p.head_dim; c += 32 * 4) {
    float4 o;
    if constexpr (kOutInDtype) {
      const uint2 held = *reinterpret_cast<const uint2*>(static_cast<const T*>(p.out_in_dtype) + out_offset + c);
      const T* y = reinterpret_cast<const T*>(&held);
      o = make_float4(to_float(y[0]), to_float(y[1]), to_float(y[2]), to_float(y[3]));
    } else {
      o = *reinterpret_cast<const float4*>(p.out + out_offset + c);
    }
    const uint2 raw = *reinterpret_cast<const uint2*>(block + c);  // four 16-bit values
    const T* x = reinterpret_cast<const T*>(&raw);
    o.x = o.x * w_a + to_float(x[0]) * w_b;
    o.y = o.y * w_a + to_float(x[1]) * w_b;
    o.z = o.z * w_a + to_float(x[2]) * w_b;
    o.w = o.w * w_a + to_float(x[3]) * w_b;
    if constexpr (kOutInDtype) {
      uint2 merged_raw;
      T* y = reinterpret_cast<T*>(&merged_raw);
      y[0] = from_float<T>(o.x), y[1] = from_float<T>(o.y), y[2] = from_float<T>(o.z), y[3] = from_float<T>(o.w);
      *reinterpret_cast<uint2*>(static_cast<T*>(p.out_in_dtype) + out_offset + c) = merged_raw;
    } else {
      *reinterpret_cast<float4*>(p.out + out_offset + c) = o;
    }
  }
  __syncwarp();
  if (lane == 0) *lse = merged;
}

}  // namespace

cudaError_t launch_fwd_combine(const FwdParams& p, int splits, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  return launch_after(p.dtype == DType::kFloat16 ? &fwd_combine_kernel<__half> : &fwd_combine_kernel<__nv_bfloat16>,
                      dim3(unsigned(blocks)), dim3(kWarps * 32), 0, stream, p, splits);
}

// A kernel of one warp per item, kWarps items a block, in the dtype's instantiation.
template <class Params>
cudaError_t launch_warp_items(void (*half)(Params), void (*bf16)(Params), DType dtype, int64_t items,
                              cudaStream_t stream, const Params& p) {
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  (dtype == DType::kFloat16 ? half : bf16)<<<unsigned(blocks), kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_merge_partial(const MergeParams& p, cudaStream_t stream) {
  const int64_t items = int64_t(p.batch) * p.seqlen * p.heads;
  if (p.out_in_dtype != nullptr) {
    return launch_warp_items(&merge_partial_kernel<__half, true>, &merge_partial_kernel<__nv_bfloat16, true>, p.dtype,
                             items, stream, p);
  }
  return launch_warp_items(&merge_partial_kernel<__half, false>, &merge_partial_kernel<__nv_bfloat16, false>, p.dtype,
                           items, stream, p);
}

cudaError_t launch_kv_append(const KvAppendParams& p, cudaStream_t stream) {
  const int64_t kv_rows = p.k_new != nullptr ? int64_t(p.batch) * p.seqlen_new * p.num_heads_k : 0;
  const int64_t q_rows = p.q != nullptr ? int64_t(p.batch) * p.seqlen_q * p.num_heads : 0;
  return launch_warp_items(&kv_append_kernel<__half>, &kv_append_kernel<__nv_bfloat16>, p.dtype, kv_rows + q_rows,
                           stream, p);
}

}  // namespace flash_attn2
