// flash_attn2 public C++ API: torch-free, usable from any CUDA project (CMake: find_package(flash_attn2)).
//
// Tensors are (batch, seqlen, heads, head_dim) with a contiguous last dimension and any other strides
// (in elements, multiples of 8, base pointers 16-byte aligned). With cu_seqlens_q/k set (varlen), q/k/v/out
// are packed (total_tokens, heads, head_dim): batch strides are ignored and sequence b owns rows
// [cu_seqlens[b], cu_seqlens[b + 1]) of the total_q (total_k) rows, as follows. Each pair is clamped to
// the packed tensor: an entry below 0 reads as 0 and one past the end as total; a decreasing pair is an
// empty sequence. Rows outside every sequence (before cu_seqlens[0], after the last sequence) get out 0 and
// lse -inf, and zero gradients. No row outside the tensors is ever read or written. cu_seqlens that
// decrease before their last entry make a later sequence start before an earlier one: rows two sequences
// share get undefined results, and so does every row's dq (still in bounds).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

// Bumped whenever FwdParams or BwdParams change; a caller compiled against another header is refused.
#define FLASH_ATTN2_PARAMS_VERSION 11

namespace flash_attn2 {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// Largest seqlen, max_seqlen and packed total (rows) accepted: keeps every block index in 32 bits.
constexpr int kMaxSeqlen = 0x7fff0000;  // 2^31 - 2^16

// Most key splits a split-KV forward takes (FwdParams::kv_splits).
constexpr int kMaxKvSplits = 128;

struct FwdParams {
  // Filled in by the header the caller compiled against; run_fwd / run_bwd check both.
  uint32_t version = FLASH_ATTN2_PARAMS_VERSION;
  uint32_t size = sizeof(FwdParams);

  const void* q;
  const void* k;
  const void* v;
  void* out;
  // Natural-log sum of exp of the scaled scores per query row (plus exp(sink) with sinks), fp32: (batch, heads,
  // seqlen_q), or (heads, total_q) for varlen. A row that sees no key gets -inf, or its head's sink (its output
  // row is 0).
  float* lse;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;  // lse_batch_stride is unused for varlen

  int batch;
  int num_heads;    // query heads
  int num_heads_k;  // key/value heads; num_heads % num_heads_k == 0 (MQA/GQA)
  int head_dim;     // multiple of 8, <= 256
  // Fixed-length: the sequence lengths. Varlen: a hint, the longest sequence, which sizes the grid; any
  // value >= 0 still computes every row (a smaller one only costs parallelism).
  int seqlen_q;
  int seqlen_k;
  // Rows of q and of k/v: batch * seqlen, or the packed totals for varlen (<= kMaxSeqlen).
  int64_t total_q, total_k;

  const int* cu_seqlens_q;  // (batch + 1) int32 prefix sums on the device, or nullptr
  const int* cu_seqlens_k;

  float softmax_scale;  // positive and finite
  // Causal mask aligned to the bottom-right corner: query i sees key j iff j <= i + seqlen_k - seqlen_q.
  bool causal;
  DType dtype;
  // Sliding window (flash-attn's window_size), aligned like causal: query i sees key j iff
  // i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right (per sequence for
  // varlen). -1: unbounded on that side; causal sets window_right to 0.
  int window_left = -1, window_right = -1;
  // Logit soft-capping (Gemma 2): > 0 turns the scaled scores into softcap * tanh(scaled score / softcap)
  // before the softmax (and the mask); 0: off. Finite and >= 0.
  float softcap = 0.f;
  // ALiBi (flash-attn's alibi_slopes): fp32 slope of (batch b, query head h) at
  // alibi_slopes[b * alibi_slopes_batch_stride + h] (stride 0: one slope per head), or nullptr. Adds
  // -slope * |i + seqlen_k - seqlen_q - j| to the scaled score of query i and key j (per sequence for varlen);
  // with causal, +slope * j, which differs from it by a constant per row (flash-attn's form: its softmax is
  // the same, its LSE is not).
  const float* alibi_slopes = nullptr;
  int64_t alibi_slopes_batch_stride = 0;
  // Attention sinks (gpt-oss; flash-attn 4's learnable_sink): fp32 (num_heads,), or nullptr. Head h's logit joins
  // every row's softmax denominator with no value: Z = sum_j exp(scaled score_j) + exp(sink[h]), lse = log Z, so a
  // row that sees no key gets out 0 and lse = sink[h] (rows outside every varlen sequence keep lse -inf). -inf is no
  // sink. A sink must be -inf or finite with |sink| < 1e38 (its LSE times log2(e) stays finite in the backward):
  // +inf, NaN or larger gives undefined rows of that head (NaN or inf). Split-KV adds it once, in the combine.
  const float* sink = nullptr;
  // Attention dropout (flash-attn's dropout_p, in [0, 1)): each probability is kept iff a Philox byte is
  // below round((1 - dropout_p) * 256) (flash-attn's 8-bit resolution) and kept ones are scaled by 256 over
  // that threshold, so the expectation is exact; the LSE stays the undropped one. The bytes are a function
  // of (seed, offset, batch, head, query, key) alone (flash_attn2/_dropout.py), so the backward redraws the
  // forward's. Seed and offset are each the value here plus, where the pointer is set, the uint64 it points
  // to (a CUDA graph's captured generator state). A forward with dropout writes the (seed, offset) it used
  // to rng_state (2 x uint64 of device memory) where set; a backward reads them back through the pointers.
  float dropout_p = 0.f;
  uint64_t philox_seed = 0, philox_offset = 0;
  const uint64_t* philox_seed_ptr = nullptr;
  const uint64_t* philox_offset_ptr = nullptr;
  uint64_t* rng_state = nullptr;

  // Optional: one int of device memory a fixed-length forward on Hopper uses to hand query tiles to its
  // persistent blocks as they free up, instead of in a fixed order, wherever a block walks more than one
  // tile: causal calls (up to ~10% faster where tiles differ in work) and non-causal ones alike (the torch
  // op passes one for those only under FLASH_ATTN2_TILE_ORDER=dynamic or a thread's "dynamic" request, as the
  // ring's forward blocks make: they start late behind NCCL's kernels). run_fwd zeroes it on `stream` when it uses it, so its contents
  // are the library's; it must stay valid until the work queued on `stream` is done, and no two forwards
  // that may run at the same time (other streams, graphs) may share one. nullptr: fixed order. run_bwd
  // ignores it.
  int* tile_counter = nullptr;

  // ---- KV cache (flash_attn_with_kvcache; fixed-length calls only) and split-KV (any call without dropout) ----
  // These are device values the kernels do not trust; each is clamped as said, so that no row outside k / v
  // is read. A call with any of them runs the split-KV kernel, but where the Hopper forward serves it: more than 64
  // query rows per head (chunked prefill; varlen: also total_q > 64 x batch), on an sm_90 GPU with the Hopper
  // forward built (not FLASH_ATTN2_BACKEND=sm80), a contiguous cache or pages of a multiple of 16 rows without
  // leftpad_k, strides TMA takes (no zero stride over an extent above one). run_bwd takes none of them.
  // seqused_k: (batch,) int32; batch entry b uses key rows [leftpad_k[b], seqused_k[b] + seqused_k_add) of its
  // k / v rows (seqlen_k of them: a cache's capacity), seqused_k[b] clamped to [0, seqlen_k] (as run_kv_append
  // clamps cache_seqlens) and the end to seqlen_k, the start to [0, end]; seqused_k nullptr: the end is seqlen_k. seqused_k_add: rows appended by this call (flash_attn_with_kvcache's
  // new k / v), >= 0. Causal masks, windows and ALiBi are aligned to the used rows: key row leftpad_k[b] + j is
  // key j of a sequence of end - start keys.
  const int* seqused_k = nullptr;
  int seqused_k_add = 0;
  const int* leftpad_k = nullptr;
  // kv_batch_idx: (batch,) int32; batch entry b reads k / v batch entry kv_batch_idx[b], clamped to
  // [0, kv_batch); nullptr: entry b. k / v then have kv_batch entries (kv_batch >= 1), q / out batch.
  const int* kv_batch_idx = nullptr;
  int kv_batch = 0;
  // Split-KV: the key range of each (query tile, kv head) is cut into kv_splits parts run by separate blocks,
  // which write fp32 partial outputs and LSEs into split_accum (fwd_split_accum_elems), merged by a second
  // kernel. 0: run_fwd chooses (fwd_num_splits; 1 where split_accum is nullptr), 1: no split, n: n (at most
  // kMaxKvSplits). The splits change the order of the sums: results differ from the unsplit ones in the last
  // bits. Rows of a kv head's query heads share one tile (GQA packing) where the call has no ALiBi.
  int kv_splits = 0;
  float* split_accum = nullptr;  // 16-byte aligned
  // Paged K / V (block_table; without kv_batch_idx): k and v are (num_pages, page_size, num_heads_k, head_dim)
  // pages, k/v_batch_stride the page stride; batch entry b's key row j (counted from its leftpad_k) is row
  // j % page_size of page page_table[b * page_table_batch_stride + j / page_size], each entry clamped to
  // [0, num_pages) (a -1 padding entry is never read for a row in use). seqlen_k is the table's capacity
  // (max_pages * page_size), total_k the pages' rows (num_pages * page_size). Any page_size >= 1. With varlen q
  // (cu_seqlens_q; no leftpad_k), sequence b has seqused_k[b] keys (seqused_k_add ignored) or, without seqused_k,
  // cu_seqlens_k[b + 1] - cu_seqlens_k[b], either clamped to [0, seqlen_k]; cu_seqlens_k may be nullptr then.
  const int* page_table = nullptr;
  int64_t page_table_batch_stride = 0;
  int page_size = 0, num_pages = 0;

  // V's and out's head dim where it differs from q's and k's (MLA: d_v < d_qk; a multiple of 8), or 0 for
  // head_dim. The forward runs it where fwd_serves_head_dim_v says so (the Hopper path's pair kernels that the build
  // names: FLASH_ATTN2_HEAD_DIM_PAIRS) and refuses it elsewhere; the backward (dout and dv d_v wide too) where
  // bwd_serves_head_dim_v says so (the Hopper backward) and refuses it elsewhere (there, pad v, out and dout to
  // head_dim: the zero columns change no gradient, and dv's are cut off).
  int head_dim_v = 0;
};

// Backward pass: dq, dk, dv from dout and the forward's out and lse (all fields of FwdParams, with
// `out` read, not written). dout/dq have q's shape, dk/dv k's; for MQA/GQA each kv head's gradient
// sums over its group of query heads.
struct BwdParams : FwdParams {
  uint32_t bwd_size = sizeof(BwdParams);  // checked like FwdParams::size

  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // fp32 workspace, contiguous and 16-byte aligned, filled by run_bwd: rowsum(dout * out) as
  // (num_heads, total_q) followed by lse * log2(e) in the same layout (+inf where lse is -inf) and
  // the Hopper backward's tile counter, and the dq accumulator (its layout is the kernels' own). Sizes:
  // bwd_*_elems().
  float* softmax_d;
  float* dq_accum;
  // 0: key blocks add dq with unordered atomics (fastest). > 0 (deterministic): on the SM80 backward key
  // blocks are dealt round-robin to num_splits blocks per head, each with its own dq accumulator, summed in
  // a fixed order; the Hopper backward adds in key-block order instead.
  int num_splits;
  // With FwdParams::sink (the forward's): fp32 (num_heads,) written with dL/dsink_h = -sum over rows of
  // exp(sink_h - lse) * rowsum(dout * out), summed in a fixed order (bitwise repeatable). nullptr: not computed.
  float* dsink = nullptr;
  // Optional: the loss's gradient with respect to the forward's lse, fp32 in lse's layout and strides (a loss that
  // uses lse too). The backward then takes D = rowsum(dout * out) - dlse, which adds dlse_i * P_ij to each dS_ij
  // (d lse_i / d s_ij = P_ij) and, with sinks, dlse_i * exp(sink_h - lse_i) to dsink_h. nullptr: no such term.
  const float* dlse = nullptr;
};

// num_splits for a deterministic backward on a GPU with num_sms multiprocessors.
int bwd_deterministic_splits(const BwdParams& params, int num_sms);

// fp32 elements of workspace needed by softmax_d and dq_accum for these params. dq_accum's size depends
// on the kernel the backward will pick (its GPU, FLASH_ATTN2_BACKEND, FLASH_ATTN2_SM_MARGIN; in deterministic
// mode the SM80 backward needs num_splits accumulators, the Hopper one one): ask with the params, device and
// environment that run_bwd will see.
int64_t bwd_softmax_d_elems(const BwdParams& params);
int64_t bwd_dq_accum_elems(const BwdParams& params);

// The compiled head-dim bucket that serves head_dim (the smallest one >= head_dim), or 0 if none. The
// backward is compiled for the same buckets.
int fwd_head_dim_bucket(int head_dim, DType dtype);

// Whether run_fwd runs params' head_dim_v (true where it is 0 or head_dim): a pair kernel is compiled for the
// head dims' buckets and dtype, the call takes the Hopper forward (an sm_90 GPU, FLASH_ATTN2_BACKEND not sm80)
// and not the split-KV one (no KV cache fields, more than 64 packed query rows or dropout).
bool fwd_serves_head_dim_v(const FwdParams& params);

// Whether run_bwd runs params' head_dim_v (true where it is 0 or head_dim): the call takes the Hopper backward (an
// sm_90 GPU, the build's Hopper backward for the head dim's bucket, FLASH_ATTN2_BACKEND not sm80, TMA-readable dout
// strides), or has no query or no key rows.
bool bwd_serves_head_dim_v(const BwdParams& params);

// The key splits run_fwd will use for params given a split_accum (>= 1; 1: no split): kv_splits, or where it is
// 0 a choice from the shapes and the current device's SM count less FLASH_ATTN2_SM_MARGIN (never from device
// values): ask under the environment run_fwd will see. Where it is 0 and split_accum is nullptr, run_fwd does not
// split.
int fwd_num_splits(const FwdParams& params);
// fp32 elements of split_accum for num_splits splits: partial outputs (num_splits, batch, num_heads, seqlen_q,
// head_dim), then partial LSEs (num_splits, batch, num_heads, seqlen_q). 0 for num_splits <= 1.
int64_t fwd_split_accum_elems(const FwdParams& params, int num_splits);

// flash_attn_with_kvcache's update before its forward: the new keys and values written into the caches (keys
// rotated), and q rotated into q_out. Rotary embedding (rotary_dim > 0) rotates the first rotary_dim columns
// of a row at position pos by cos / sin row pos (tables of (seqlen_ro, rotary_dim / 2), dtype's elements):
// interleaved pairs (2i, 2i + 1), else the halves (i, i + rotary_dim / 2). New row j of batch entry b goes to
// cache row cache_seqlens[b] + j of cache batch entry cache_batch_idx[b] (clamped to [0, cache_batch); nullptr:
// b) at position cache_seqlens[b] + j; rows that would land at or past cache_seqlen are not written, and
// cache_seqlens below 0 read as 0. q's row i sits at position cache_seqlens[b] + i where q_positions_per_row
// (causal or windowed calls), else at cache_seqlens[b]; positions clamp to seqlen_ro - 1.
struct KvAppendParams {
  uint32_t version = FLASH_ATTN2_PARAMS_VERSION;
  uint32_t size = sizeof(KvAppendParams);
  DType dtype;
  int batch, num_heads_k, head_dim;  // head_dim a multiple of 8
  // New keys and values (batch, seqlen_new, num_heads_k, head_dim), or nullptr (seqlen_new 0) for none.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int seqlen_new = 0;
  int64_t kn_batch_stride = 0, kn_row_stride = 0, kn_head_stride = 0;
  int64_t vn_batch_stride = 0, vn_row_stride = 0, vn_head_stride = 0;
  void* k_cache = nullptr;  // (cache_batch, cache_seqlen, num_heads_k, head_dim)
  void* v_cache = nullptr;
  int cache_batch = 0, cache_seqlen = 0;
  int64_t kc_batch_stride = 0, kc_row_stride = 0, kc_head_stride = 0;
  int64_t vc_batch_stride = 0, vc_row_stride = 0, vc_head_stride = 0;
  const int* cache_seqlens = nullptr;  // (batch,) int32 on the device; required
  const int* cache_batch_idx = nullptr;
  // Paged caches (FwdParams' page fields): (num_pages, page_size, num_heads_k, head_dim), cache_seqlen the table's
  // capacity; new row j of batch entry b goes to logical row cache_seqlens[b] + j through the table.
  const int* page_table = nullptr;
  int64_t page_table_batch_stride = 0;
  int page_size = 0, num_pages = 0;
  // Rotary tables, or nullptr / rotary_dim 0 for none; rotary_dim even, <= head_dim.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t cos_row_stride = 0, sin_row_stride = 0;
  int seqlen_ro = 0, rotary_dim = 0;
  bool interleaved = true;
  // q (batch, seqlen_q, num_heads, head_dim) rotated into q_out (same shape), or nullptr for neither.
  const void* q = nullptr;
  void* q_out = nullptr;
  int seqlen_q = 0, num_heads = 0;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t qo_batch_stride = 0, qo_row_stride = 0, qo_head_stride = 0;
  bool q_positions_per_row = false;
};

// Enqueues the update (one kernel). Errors as for run_fwd.
cudaError_t run_kv_append(const KvAppendParams& params, cudaStream_t stream);

// ---- Merging two partial results over disjoint key sets (context parallelism's ring steps) ----
// out, lse <- the attention over both key sets, in place: lse' = log(e^lse + e^block_lse) (-inf where both are),
// out' = out e^(lse - lse') + block_out e^(block_lse - lse') (0 where lse' is -inf). out (batch, seqlen, heads,
// head_dim) fp32 and lse (batch, heads, seqlen) fp32; block_out of out's shape in dtype, block_lse fp32 of lse's.
// Strides in elements; out's and block_out's head_dim unit-strided, every other out stride a multiple of 4 and
// block_out's of 4, out 16-byte and block_out 8-byte aligned, head_dim a multiple of 4 (one float4 a lane).
struct MergeParams {
  uint32_t version = FLASH_ATTN2_PARAMS_VERSION;
  uint32_t size = sizeof(MergeParams);
  DType dtype;  // block_out's
  int batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  float* out = nullptr;
  float* lse = nullptr;
  // Instead of out (which stays null): the result so far in dtype, read and written in place, the merge computed in
  // fp32 and rounded once (a ring of 2 ranks, whose rows merge two blocks: the fp32 merge cast once, bitwise).
  void* out_in_dtype = nullptr;
  const void* block_out = nullptr;
  const float* block_lse = nullptr;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 0;
  int64_t block_batch_stride = 0, block_row_stride = 0, block_head_stride = 0;
  int64_t block_lse_batch_stride = 0, block_lse_head_stride = 0, block_lse_row_stride = 0;
};

// Whether out's and block_out's strides and alignments are the ones the merge kernel takes (above): run_merge_partial
// refuses others; a caller with a fallback of its own tests this first.
inline bool merge_layout_supported(const MergeParams& p) {
  const uintptr_t out = p.out != nullptr ? reinterpret_cast<uintptr_t>(p.out) : reinterpret_cast<uintptr_t>(p.out_in_dtype);
  return p.out_batch_stride % 4 == 0 && p.out_row_stride % 4 == 0 && p.out_head_stride % 4 == 0 &&
         p.block_batch_stride % 4 == 0 && p.block_row_stride % 4 == 0 && p.block_head_stride % 4 == 0 &&
         out % (p.out != nullptr ? 16 : 8) == 0 && reinterpret_cast<uintptr_t>(p.block_out) % 8 == 0;
}

// Enqueues the merge (one kernel, one warp per (batch, row, head), one pass over out and block_out). Errors as
// for run_fwd.
cudaError_t run_merge_partial(const MergeParams& params, cudaStream_t stream);

// Enqueues the forward pass on stream. Returns cudaErrorNotSupported when no kernel was compiled for
// (head_dim, dtype) or for the forward path FLASH_ATTN2_BACKEND insists on, cudaErrorInvalidValue for
// params that are inconsistent or from another header version (or a bad FLASH_ATTN2_BACKEND), else the
// launch's error; last_error_message() says which.
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

// Enqueues the backward pass (three kernels, a fourth for dsink) on stream; softmax_d and dq_accum must point to workspace
// of the sizes above (any contents). Errors as for run_fwd.
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);

// Why the last run_fwd / run_bwd on this thread failed ("" after a success).
const char* last_error_message();

}  // namespace flash_attn2
