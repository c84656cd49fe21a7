// The compiled kernels and what dispatch.cpp needs to call them, without CUDA device code or CuTe.
//
// launch_fwd / launch_bwd are defined in fwd_launch.h / bwd_launch.h and explicitly instantiated, one
// (head dim, dtype) per file in csrc/instantiations/. dispatch.cpp's table names exactly the instantiated
// ones (the FLASH_ATTN2_COMPILED_* definitions the build passes), so every kernel is reached through a
// symbol reference: a static library keeps them all, which self-registering static initializers would not.
#pragma once

#include <algorithm>
#include <cstdlib>

#include "flash_attn2/flash_attn2.h"
#include "sm80/tile_sizes.h"  // bwd_block_m

namespace flash_attn2 {

using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
// head_splits: bwd_head_splits' count, which run_bwd computes once and sizes the accumulators with.
using BwdLauncher = cudaError_t (*)(const BwdParams&, int head_splits, cudaStream_t);

template <int kHeadDim, DType kDType>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream);
// The Hopper forward (sm_90a: TMA + wgmma), csrc/kernels/sm90/fwd_launch_sm90.h.
template <int kHeadDim, DType kDType>
cudaError_t launch_fwd_sm90(const FwdParams& params, cudaStream_t stream);
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd(const BwdParams& params, int head_splits, cudaStream_t stream);
// The Hopper backward (sm_90a), csrc/kernels/sm90/bwd_launch_sm90.h: built with the Hopper forward, for
// these head dims (_build_config.BWD_SM90_HEAD_DIMS); deterministic mode orders its dQ adds (dq_turns.h).
constexpr bool has_bwd_sm90(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 192 || head_dim == 256;
}
// The Hopper backward kernel that serves a head-dim bucket: its own, or for 160 and 224 the 192 / 256 one on
// zero-padded head dims (TMA fills the columns past head_dim with zeros; the accumulators have the kernel's
// row width, bwd_dq_accum_elems); 0 for none.
constexpr int bwd_sm90_kernel_dim(int bucket) {
  return has_bwd_sm90(bucket) ? bucket : bucket == 160 ? 192 : bucket == 224 ? 256 : 0;
}
template <int kHeadDim, DType kDType>
cudaError_t launch_bwd_sm90(const BwdParams& params, int head_splits, cudaStream_t stream);

// The backward's blocks per (key block, kv head), on either path: a GQA group's query heads split over up to
// 8 blocks (power-of-two divisors of the group) while the grid, counted in 128-key blocks, has fewer than
// one block per SM, or four when causal, whose key blocks range from one step's work to a whole column's:
// the longest-first order balances them only with several per SM (70B slice, 256 key blocks, H100: causal
// 4 splits 7-10% faster than 2; non-causal 1 split 4% faster than 2). Then, when causal, more splits (any
// divisor) while the L2 footprint of a block's heads exceeds twice the L2: causal blocks of a kv head end at
// different times, and those that start later drift over up to one 128-row query block per SM, each
// holding a block's heads' Q and dO (bf16) and dQ accumulator (fp32) rows in L2 (Qwen2.5-7B, group 7,
// 32k causal, H100: 7 x 16.9k rows x 1 KB = 121 MB; 7 splits take the L2 hit rate from 85% to 93% and
// the kernel from 40.0 to 37.3 ms; at 8k, 59 MB, 7 splits were slower). Not in deterministic mode.
// Split blocks add dK and dV into fp32 accumulators after the dQ accumulator (bwd_dkv_accum_offset),
// which bwd_dq_accum_elems sizes from this same answer: a function of p and the current device only.
constexpr int kBwdBlockNSm90 = 128, kMaxHeadSplits = 8;

// Each forward comes in two kernels per (head dim, dtype): the plain one (causal, a window's right edge)
// and the extended one, which adds a window's left edge (MaskBoth steps), softcap and ALiBi behind runtime
// flags, so that the plain one keeps its code and registers (benchmarks/TUNING.md step 44). The Hopper
// forward has a third, the extended one with dropout (step 53).
inline bool fwd_extended(const FwdParams& p) {
  return p.window_left >= 0 || p.softcap > 0.f || p.alibi_slopes != nullptr || p.dropout_p > 0.f;
}
// The backward likewise, for softcap, ALiBi and dropout (windows cost its plain kernels nothing measurable:
// step 44).
inline bool bwd_extended(const FwdParams& p) {
  return p.softcap > 0.f || p.alibi_slopes != nullptr || p.dropout_p > 0.f;
}
// The current device's attribute (the launchers' SM count, L2 size).
inline cudaError_t device_attribute(cudaDeviceAttr attr, int* value) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device)) return err;
  return cudaDeviceGetAttribute(value, attr, device);
}
inline cudaError_t device_l2_bytes(int* bytes) { return device_attribute(cudaDevAttrL2CacheSize, bytes); }
inline cudaError_t device_sm_count(int* sms) { return device_attribute(cudaDevAttrMultiProcessorCount, sms); }
// The backward's bytes per query row and head that key blocks running together share through L2: Q and dO in
// 16 bits, the dQ accumulator in fp32.
inline int64_t bwd_row_bytes(int head_dim) { return int64_t(8) * head_dim; }
inline cudaError_t bwd_head_splits(const BwdParams& p, int* splits) {
  *splits = 1;
  const int group = p.num_heads_k > 0 ? p.num_heads / p.num_heads_k : 1;
  if (group == 1 || p.num_splits > 0) return cudaSuccess;
  int num_sms = 0, l2_bytes = 0;
  if (cudaError_t err = device_sm_count(&num_sms)) return err;
  if (cudaError_t err = device_l2_bytes(&l2_bytes)) return err;
  constexpr int kKeys = kBwdBlockNSm90;
  const int64_t per_head = p.cu_seqlens_k != nullptr ? p.total_k / kKeys + p.batch  // the varlen slots
                                                     : int64_t(p.batch) * ((p.seqlen_k + kKeys - 1) / kKeys);
  const int64_t key_blocks = per_head * p.num_heads_k;
  const int64_t target = (p.causal ? 4 : 1) * int64_t(num_sms);
  while (*splits * 2 <= kMaxHeadSplits && group % (*splits * 2) == 0 && key_blocks * *splits < target) {
    *splits *= 2;
  }
  if (p.window_left >= 0) {
    // A window's blocks that run together are about num_sms / splits key blocks of one kv head, whose query
    // rows span those keys plus the window: split while their heads' Q, dO and dQ-accumulator rows exceed
    // half the L2 and a split narrows the span (16:4 heads, d 128, 16k, window 1024 on an H100: 74 MB with
    // one split, L2 hit rate 34%).
    auto rows = [&](int s) {
      return std::min<int64_t>(p.seqlen_q, int64_t(kKeys) * num_sms / s + p.window_left + kKeys);
    };
    for (int next = *splits + 1;
         next <= kMaxHeadSplits && rows(*splits) * group * bwd_row_bytes(p.head_dim) > l2_bytes / 2; ++next) {
      if (group % next == 0 && rows(next) < rows(*splits)) *splits = next;
    }
    return cudaSuccess;
  }
  if (!p.causal) return cudaSuccess;
  const int64_t spread_rows = std::min<int64_t>(p.seqlen_q, int64_t(kKeys) * num_sms);
  const int64_t bytes_per_head = spread_rows * bwd_row_bytes(p.head_dim);
  // Up to head dim 128 while the rows exceed the L2 (Llama-3-8B 16k / 32k 4% / 1.5% faster than at twice the
  // L2, Qwen2.5-7B 8k unchanged), above it while they exceed twice the L2 (Gemma-2 32k 1.5% slower at once:
  // TUNING 85).
  const int64_t rows_bound = (p.head_dim <= 128 ? 1 : 2) * int64_t(l2_bytes);
  for (int next = *splits + 1; next <= kMaxHeadSplits && group / *splits * bytes_per_head > rows_bound; ++next) {
    if (group % next == 0) *splits = next;
  }
  return cudaSuccess;
}

// Where dK (kv = 0) and dV (kv = 1) accumulate with head splits: (heads_k, total_k rows, bucket) row-major
// each, after the largest dQ accumulator layout without deterministic splits (the SM80 one, rows padded by
// bwd_block_m per sequence).
__host__ __device__ inline int64_t bwd_dkv_accum_offset(const BwdParams& p, int bucket, int kv, int head_k,
                                                        int64_t packed_row) {
  const int64_t dq = int64_t(p.num_heads) * (p.total_q + int64_t(p.batch) * bwd_block_m(bucket)) * bucket;
  return dq + ((int64_t(kv) * p.num_heads_k + head_k) * p.total_k + packed_row) * bucket;
}

// The Hopper dQ accumulator: fp32, zeroed by the preprocess, one region per query head of
// bwd_dq_slots(p) x 64 rows in the kernel's row width (bwd_dq_accum_elems takes the larger of this and the
// SM80 layout). Kernels with 128-row steps or 32-column dQ parts (d <= 64 without dropout,
// d > 128) add into (heads, total_q rows, width) row-major, which their TMA reduce-add boxes address; the
// narrow kernels with 64-row steps (Traits::kDQFragments) keep each query block's dQ whole in slot
// bwd_dq_slot(...) + m_block, 64 x width floats in the dQ GEMMs' register order (bwd_dq_fragment_word).
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
__host__ __device__ inline int64_t bwd_dq_accum_offset_sm90(const BwdParams& p, int width, int head, int64_t packed_row) {
  return (int64_t(head) * p.total_q + packed_row) * width;
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

// After the Hopper backward: dQ = softmax_scale * its accumulator, in the input dtype, from either layout
// (fragments: Traits::kDQFragments).
cudaError_t launch_bwd_convert_dq_sm90(const BwdParams& params, int bucket, bool fragments, cudaStream_t stream);

// dK = softmax_scale * accumulator and dV = accumulator in the input dtype, after a backward with head splits.
cudaError_t launch_bwd_convert_dkv(const BwdParams& params, int bucket, cudaStream_t stream);

// softmax_d = rowsum(dout o out) in fp32, and LSE * log2(e) after it (bwd_lse_log2_offset), before the
// main kernel; also clears the dq accumulator and the gradient rows outside every varlen sequence.
cudaError_t launch_bwd_preprocess(const BwdParams& params, int64_t accum_elems, cudaStream_t stream);

// The backward's softmax_d workspace: D as (heads, total_q), then LSE * log2(e) in the same layout from
// this offset, a multiple of 4 so that both arrays' rows share their 16-byte alignment (the Hopper backward
// loads them with TMA, whose innermost box start must be 16-byte aligned).
constexpr int64_t bwd_lse_log2_offset(const BwdParams& p) { return (int64_t(p.num_heads) * p.total_q + 3) / 4 * 4; }
// After LSE: the int a persistent Hopper backward claims its key blocks from (zeroed by the preprocess), in a
// float4 of its own.
constexpr int64_t bwd_tile_counter_offset(const BwdParams& p) { return 2 * bwd_lse_log2_offset(p); }

// Shared memory a block may use on the current device (opt-in limit: 227 KB on H100, 163 KB on A100,
// 99 KB on sm_86/89).
inline cudaError_t device_smem_limit(int* bytes) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device)) return err;
  return cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

// What the SM80 launchers pick their tiles for: the device's limit, or FLASH_ATTN2_SMEM_LIMIT bytes where
// that is lower (read on every call), so that a big GPU runs and tests the tiles meant for smaller ones.
inline cudaError_t tile_smem_limit(int* bytes) {
  if (cudaError_t err = device_smem_limit(bytes)) return err;
  if (const char* env = std::getenv("FLASH_ATTN2_SMEM_LIMIT")) {
    const long forced = std::strtol(env, nullptr, 10);
    if (forced > 0 && forced < *bytes) *bytes = int(forced);
  }
  return cudaSuccess;
}

// Opts kernel into bytes of dynamic shared memory on the current device, or returns
// cudaErrorLaunchOutOfResources where a block may not have that much (the backward's 208 KB at head
// dim 256 on an A100 without compact tiles). The attribute is per device, so launchers call this on
// every launch.
template <class Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;  // every GPU allows this much without opting in
  int limit = 0;
  if (cudaError_t err = device_smem_limit(&limit)) return err;
  if (bytes > limit) return cudaErrorLaunchOutOfResources;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// allow_dynamic_smem for an SM80 tile, which must also fit tile_smem_limit (the limit it was picked for).
template <class Kernel>
cudaError_t allow_tile_smem(Kernel* kernel, int bytes) {
  int limit = 0;
  if (cudaError_t err = tile_smem_limit(&limit)) return err;
  if (bytes > limit) return cudaErrorLaunchOutOfResources;
  return allow_dynamic_smem(kernel, bytes);
}

}  // namespace flash_attn2
