// Host policy: the device's facts and the choices made from them and the call's shape, before any kernel is
// picked. Host-only and included by dispatch.cpp alone (tests/test_layering.py checks), so that tuning a
// heuristic recompiles no kernel file (FA3's hopper/heuristics.h plays this part).
#pragma once

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include <cuda_runtime_api.h>

#include "flash_attn2/flash_attn2.h"
#include "common/launchers.h"  // DeviceInfo
#include "sm80/tile_size.h"    // fwd_split_tile_sm80
#include "sm90/tile_size.h"    // kBwdBlockNSm90

namespace flash_attn2 {

// ---- The device ----

// The current device's SM count, L2 size and opt-in shared memory per block (cached per device: they do not
// change), and tile_smem_limit: FLASH_ATTN2_SMEM_LIMIT bytes where that is lower than the device's (read on
// every call), so that a big GPU runs and tests the SM80 tiles meant for smaller ones.
inline cudaError_t current_device_info(DeviceInfo* info) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices][3] = {};  // 0: not yet asked
  constexpr cudaDeviceAttr kAttrs[3] = {cudaDevAttrMultiProcessorCount, cudaDevAttrL2CacheSize,
                                        cudaDevAttrMaxSharedMemoryPerBlockOptin};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device)) return err;
  int values[3];
  for (int i = 0; i < 3; ++i) {
    values[i] = device < kMaxDevices ? cached[device][i].load(std::memory_order_relaxed) : 0;
    if (values[i] == 0) {
      if (cudaError_t err = cudaDeviceGetAttribute(&values[i], kAttrs[i], device)) return err;
      if (device < kMaxDevices) cached[device][i].store(values[i], std::memory_order_relaxed);
    }
  }
  info->num_sms = values[0], info->l2_bytes = values[1], info->smem_per_block = values[2];
  info->tile_smem_limit = info->smem_per_block;
  if (const char* env = std::getenv("FLASH_ATTN2_SMEM_LIMIT")) {
    const long forced = std::strtol(env, nullptr, 10);
    if (forced > 0 && forced < info->tile_smem_limit) info->tile_smem_limit = int(forced);
  }
  // FLASH_ATTN2_SM_MARGIN=n (read on every call; FA3's sm_margin): grids and heuristics see n SMs fewer (at least
  // one is left), left to other streams' kernels. A context-parallel ring's NCCL transfer queued beside a persistent
  // Hopper kernel (a block per SM until it ends) finds no SM otherwise, and the peer rank's transfer waits on it.
  // Like FLASH_ATTN2_BACKEND it enters workspace sizes (head splits, key splits): size them under the environment
  // the run sees (flash_attn2.h). The deterministic backward's splits (a grid of its own size) do not use it.
  if (const char* env = std::getenv("FLASH_ATTN2_SM_MARGIN")) {
    const long margin = std::strtol(env, nullptr, 10);
    if (margin > 0) info->num_sms = int(std::max<long>(1, info->num_sms - margin));
  }
  return cudaSuccess;
}

// ---- Backward: head splits ----

constexpr int kMaxHeadSplits = 8;

// The backward's bytes per query row and head that key blocks running together share through L2: Q and dO in
// 16 bits, the dQ accumulator in fp32.
inline int64_t bwd_row_bytes(int head_dim) { return int64_t(8) * head_dim; }

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
// which bwd_dq_accum_elems sizes from this same answer: a function of p, the device and FLASH_ATTN2_SM_MARGIN.
inline int bwd_head_splits(const BwdParams& p, const DeviceInfo& device) {
  int splits = 1;
  const int group = p.num_heads_k > 0 ? p.num_heads / p.num_heads_k : 1;
  if (group == 1 || p.num_splits > 0) return splits;
  // FLASH_ATTN2_BWD_HEAD_SPLITS=n (read on every call; a tuning knob): n splits where n divides the group and is at
  // most kMaxHeadSplits, the rule below otherwise. It enters the dQ accumulator's size like FLASH_ATTN2_SM_MARGIN:
  // size it under the environment the run sees (bwd_dq_accum_elems calls this function too).
  if (const char* env = std::getenv("FLASH_ATTN2_BWD_HEAD_SPLITS")) {
    const long forced = std::strtol(env, nullptr, 10);
    if (forced >= 1 && forced <= kMaxHeadSplits && group % forced == 0) return int(forced);
  }
  const int num_sms = device.num_sms, l2_bytes = device.l2_bytes;
  constexpr int kKeys = kBwdBlockNSm90;
  const int64_t per_head = p.cu_seqlens_k != nullptr ? p.total_k / kKeys + p.batch  // the varlen slots
                                                     : int64_t(p.batch) * ((p.seqlen_k + kKeys - 1) / kKeys);
  const int64_t key_blocks = per_head * p.num_heads_k;
  const int64_t target = (p.causal ? 4 : 1) * int64_t(num_sms);
  while (splits * 2 <= kMaxHeadSplits && group % (splits * 2) == 0 && key_blocks * splits < target) splits *= 2;
  if (p.window_left >= 0) {
    // A window's blocks that run together are about num_sms / splits key blocks of one kv head, whose query
    // rows span those keys plus the window: split while their heads' Q, dO and dQ-accumulator rows exceed
    // half the L2 and a split narrows the span (16:4 heads, d 128, 16k, window 1024 on an H100: 74 MB with
    // one split, L2 hit rate 34%).
    auto rows = [&](int s) {
      return std::min<int64_t>(p.seqlen_q, int64_t(kKeys) * num_sms / s + p.window_left + kKeys);
    };
    for (int next = splits + 1;
         next <= kMaxHeadSplits && rows(splits) * group * bwd_row_bytes(p.head_dim) > l2_bytes / 2; ++next) {
      if (group % next == 0 && rows(next) < rows(splits)) splits = next;
    }
    return splits;
  }
  if (!p.causal) return splits;
  const int64_t spread_rows = std::min<int64_t>(p.seqlen_q, int64_t(kKeys) * num_sms);
  const int64_t bytes_per_head = spread_rows * bwd_row_bytes(p.head_dim);
  // Up to head dim 128 while the rows exceed the L2 (Llama-3-8B 16k / 32k 4% / 1.5% faster than at twice the
  // L2, Qwen2.5-7B 8k unchanged), above it while they exceed twice the L2 (Gemma-2 32k 1.5% slower at once:
  // TUNING 85).
  const int64_t rows_bound = (p.head_dim <= 128 ? 1 : 2) * int64_t(l2_bytes);
  for (int next = splits + 1; next <= kMaxHeadSplits && group / splits * bytes_per_head > rows_bound; ++next) {
    if (group % next == 0) splits = next;
  }
  return splits;
}

// ---- Backward: the causal order of the narrow Hopper kernels ----

// Whether one (batch, kv head) pair's Q, dO and dQ-accumulator rows fit in L2 (kernel_dim: the Hopper kernel's
// head dim): then the last two pairs interleave (GQA at d 64 4% faster, Llama-3-8B 8k 2% with 34 MB a pair;
// Qwen2.5-7B 8k, 59 MB a pair, 0-3% slower: TUNING 84).
inline bool bwd_causal_pair_fits_l2(const BwdParams& p, int kernel_dim, const DeviceInfo& device) {
  const int64_t pair_bytes = int64_t(p.num_heads / p.num_heads_k) * p.seqlen_q * bwd_row_bytes(kernel_dim);
  return pair_bytes <= device.l2_bytes;
}

// ---- Backward: deterministic mode's splits (SM80) ----

// At most this many dq accumulators (memory), at least every key block of kMinBlockN rows its own split when
// the heads alone cannot fill the GPU.
constexpr int kMaxDeterministicSplits = 16, kDeterministicMinBlockN = 64;

inline int deterministic_splits(const BwdParams& p, int num_sms) {
  const int64_t heads = std::max<int64_t>(1, int64_t(p.batch) * p.num_heads_k);  // blocks per key block
  const int64_t fill = (2 * int64_t(num_sms) + heads - 1) / heads;
  const int64_t key_blocks = (int64_t(p.seqlen_k) + kDeterministicMinBlockN - 1) / kDeterministicMinBlockN;
  return int(std::max<int64_t>(1, std::min<int64_t>({fill, key_blocks, kMaxDeterministicSplits})));
}

// ---- The split-KV forward ----

// Key splits for a split-KV call of `tiles` (query tile, head group) blocks over `n_blocks` key blocks:
// kv_splits where the caller set it, else one wave and no longer than the square root of the key blocks. None when
// the tiles alone nearly fill the GPU or there are at most 4 key blocks (FA3's guard). The kernel is memory-bound,
// so the plan wants every SM streaming once (a second block per SM adds no bandwidth, only a split's fixed cost);
// below one wave a call is latency-bound, and its time is about a * splits + b * n_blocks / splits (the combine
// and each split's pipeline fill and partial, against each block's load), least at sqrt(b / a * n_blocks): every
// head dim's key block is 8K elements (sm80/tile_size.h), and on the H200 b / a is about 1 (TUNING 135: at batch 1,
// h 32 / h_k 8, d 128, the best counts were 4, 8, 16, 16 at 1k, 4k, 32k, 128k against 16, 32, 29, 29 from FA2's
// wave rule on two blocks per SM). Of the counts with the same blocks per split, the fewest. From the shapes alone
// (seqlen_k: a cache's capacity), never from device values, so that it needs no sync and a captured graph keeps
// its plan. With pages of fewer than kPagedWaveRows rows the wave, the no-split guard's included, is two blocks per
// SM (the narrow kernel's occupancy): such a block reads a table entry per key row, and one block per SM leaves its
// loads waiting on the table (H200, h 32 / 8, d 128, page 1, forced splits: 8 x 32k 312-332 us at 2 splits against
// 250-258 at 4: TUNING 148). Pages of 64 rows and more (a d-128 key block, or more, per table entry) plan as
// contiguous caches do: the wave plan against the two-block one (TUNING 152), pages of 256: 1 x 1k / 4k 1.00,
// 1 x 32k 0.91, 8 x 1k 0.92, 8 x 4k 0.97, 8 x 32k 0.98, batch 64 1.00. Pages of 16 stay on two blocks: there the
// one-block plan was mixed (1 x 32k 0.96, 8 x 1k 0.95, 8 x 32k 1.03: 261 against 254 us at 2 splits for 4). Pages
// of 64 are between: measured in the decode grid only, not in that A/B. Where the narrow kernel fits one block per SM (an A100's 164 KB
// at d 128) the table-bound plan is two waves: not measured there.
// narrow: the narrow kernel takes the call. Its pages of a size that is not a multiple of its 16-key chunks (page 1:
// SGLang's) cost a table lookup a key row instead of one a chunk (fwd_split_kernel.h: one_page_chunks), so b / a
// is larger and the latency optimum twice the count: H200, h 32 / 8, d 128, page 1, forced splits (TUNING 180): 1 x 4k
// 14.09 us at 16 against 14.92 at the plan's 8, 1 x 16k 28.10 at 32 against 29.28 at 16, 1 x 1k unchanged (the
// cluster's count, 8), batch 8 unchanged (a wave's count, 4).
constexpr int kPagedWaveRows = 64;

inline int fwd_kv_splits(const FwdParams& p, const DeviceInfo& device, int64_t tiles, int n_blocks,
                         bool narrow = false) {
  if (p.kv_splits > 0) return std::min(p.kv_splits, kMaxKvSplits);
  const bool table_bound = p.page_table != nullptr && p.page_size < kPagedWaveRows;
  const int64_t slots = (table_bound ? 2 : 1) * int64_t(std::max(device.num_sms, 1));  // a wave's blocks
  if (tiles >= (slots * 4) / 5 || n_blocks <= 4) return 1;
  const int64_t one_wave = slots / std::max<int64_t>(tiles, 1);
  const bool per_row_table = narrow && p.page_table != nullptr && p.page_size % 16 != 0;
  const int64_t latency_best = std::llround(std::sqrt(double(n_blocks))) * (per_row_table ? 2 : 1);
  const int splits = int(std::max<int64_t>(1, std::min<int64_t>({one_wave, latency_best, kMaxKvSplits, n_blocks})));
  const int blocks_per_split = (n_blocks + splits - 1) / splits;
  return (n_blocks + blocks_per_split - 1) / blocks_per_split;
}

// Whether a split call of `tiles` (query tile, head group) blocks, `splits` key splits over `n_blocks` key blocks
// merges its splits inside a thread block cluster (sm80/fwd_split_launch.h: launch_split_cluster; dispatch.cpp asks
// only for sm_90 and fixed-length calls) rather than in the combine kernel. The cluster saves the combine's launch
// and the partials' round trip through global memory, a fixed microsecond or two that pays where the call is short:
// the narrow kernel's (at most 16 packed rows, head dim <= 128), at least 4 splits of at most 8 key blocks each,
// on at most half the SMs. H200, h 32 / h_k 8, d 128, cluster over combine kernel (TUNING 152): batch 1 x 1k at
// 4 / 8 / 16 splits 0.87 / 0.84 / 0.90 (pages of 16: 0.86 / 0.84 / 0.90), 1 x 4k at 8 splits 0.92 (4: 0.97;
// 16, on 128 blocks: 1.02); slower at 2 splits (1.06-1.10), at 16k and 32k (splits of 16-128 blocks: 1.04-1.16),
// at batch 8 (4 splits on 256 blocks: 1.26) and in the 64-row kernel (5 query rows: 1.05-1.50). Why long splits
// lose is not measured yet.
inline bool cluster_combine_pays(int64_t tiles, int splits, int n_blocks, int num_sms, bool narrow) {
  if (!narrow || splits < 4) return false;
  const int blocks_per_split = (n_blocks + splits - 1) / splits;
  return tiles * splits <= num_sms / 2 && blocks_per_split <= 8;
}

// The split count of a call the cluster combine takes (cluster_combine_pays at fwd_kv_splits's count). Without
// partials in global memory or a combine kernel a split costs less, so the latency model's optimum (fwd_kv_splits:
// sqrt(b / a * n_blocks)) moves to more splits: at 1 x 1k, h 32 / 8, d 128 (16 key blocks), 8 splits took 8.6 us
// against the plan's 4 at 9.6 and 16 at 9.9 (TUNING 152), a / b about 1/4. So sqrt(4 n_blocks), within what the
// cluster combine pays for: at least 2 key blocks a split, tiles * splits <= SMs / 2, max_splits (the cluster's
// cap); never fewer than `splits`. H200, d 128, batch 1-2 x 512-8k, heads 32 / 8, 64 / 8, 32 / 32, 16 / 2,
// contiguous and pages of 16 (TUNING 153): where the count changes, 0.735-0.902 of the time at the old count.
inline int cluster_kv_splits(int64_t tiles, int splits, int n_blocks, int num_sms, int max_splits) {
  const int64_t latency_best = std::llround(std::sqrt(4.0 * double(n_blocks)));
  const int64_t cap = std::min<int64_t>({latency_best, (num_sms / 2) / std::max<int64_t>(tiles, 1), max_splits,
                                         n_blocks / 2});
  if (cap <= splits) return splits;
  const int blocks_per_split = int((n_blocks + cap - 1) / cap);  // of the counts with these blocks a split, the fewest
  return (n_blocks + blocks_per_split - 1) / blocks_per_split;
}

}  // namespace flash_attn2
