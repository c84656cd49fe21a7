// run_fwd() / run_bwd(): check the params, then pick the compiled kernel for (head dim bucket, dtype, arch)
// from an explicit table and plan the call (common/launchers.h: its kernel kind, the device, the host
// heuristics' answers). Torch-free, like the kernels.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "flash_attn2/flash_attn2.h"
#include "common/bwd_workspace.h"
#include "common/kernel_kind.h"
#include "common/launchers.h"
#include "common/split_kv.h"
#include "heuristics.h"

// The build names the instantiated kernels (csrc/instantiations/): head-dim buckets and dtypes.
#if !defined(FLASH_ATTN2_COMPILED_HEAD_DIMS) || !defined(FLASH_ATTN2_COMPILED_FP16) || !defined(FLASH_ATTN2_COMPILED_BF16)
#error "the build defines FLASH_ATTN2_COMPILED_HEAD_DIMS (e.g. 64,128), FLASH_ATTN2_COMPILED_FP16 and _BF16 (0 or 1)"
#endif
// ... and which paths, forward and backward: SM80 (mma.sync, any sm_80+ GPU) and Hopper (sm_90a).
#if !defined(FLASH_ATTN2_COMPILED_SM80) || !defined(FLASH_ATTN2_COMPILED_SM90)
#error "the build defines FLASH_ATTN2_COMPILED_SM80 and FLASH_ATTN2_COMPILED_SM90 (0 or 1)"
#endif
// ... and the head dims the Hopper backward has kernels for (tools/build_config.py: BWD_SM90_HEAD_DIMS).
#if !defined(FLASH_ATTN2_SM90_BWD_HEAD_DIMS)
#error "the build defines FLASH_ATTN2_SM90_BWD_HEAD_DIMS (e.g. 32,64,96,128,192,256)"
#endif
// ... and the (Q / K, V / O) head-dim pairs the Hopper forward has kernels for (MLA; build_config.head_dim_pairs),
// flattened, each number followed by a comma: "192,128," or empty.
#if !defined(FLASH_ATTN2_FWD_SM90_PAIRS)
#error "the build defines FLASH_ATTN2_FWD_SM90_PAIRS (e.g. 192,128, or empty)"
#endif

namespace flash_attn2 {
namespace {

constexpr int kBucketStep = 32;
constexpr int kNumBuckets = 256 / kBucketStep;  // head dims 32, 64, ..., 256
constexpr int kCompiledHeadDims[] = {FLASH_ATTN2_COMPILED_HEAD_DIMS};
constexpr int kSm90BwdHeadDims[] = {FLASH_ATTN2_SM90_BWD_HEAD_DIMS};  // ascending

// The Hopper backward kernel that serves a head-dim bucket: its own, or the next wider one on zero-padded head
// dims (160 and 224 run the 192 / 256 kernels: TMA fills the columns past head_dim with zeros, and the
// accumulators have the kernel's row width); 0 for none.
constexpr int bwd_sm90_kernel_dim(int bucket) {
  for (int d : kSm90BwdHeadDims) {
    if (d >= bucket) return d;
  }
  return 0;
}

constexpr bool compiled(int head_dim, DType dtype) {
  if (!(dtype == DType::kFloat16 ? FLASH_ATTN2_COMPILED_FP16 : FLASH_ATTN2_COMPILED_BF16)) return false;
  for (int d : kCompiledHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

struct Kernels {
  FwdLauncher fwd_sm80 = nullptr;
  FwdLauncher fwd_sm90 = nullptr;
  BwdLauncher bwd_sm80 = nullptr;
  BwdLauncher bwd_sm90 = nullptr;
  FwdLauncher fwd_split = nullptr;  // the split-KV forward (every path's build has it)
};

// Naming launch_fwd<D, T> instantiates nothing here: the reference binds to the explicit instantiation
// in csrc/instantiations/, and only compiled pairs are named (a Hopper build holds the backward kernel
// serving each compiled head dim: bwd_sm90_kernel_dim).
template <int kHeadDim, DType kDType>
constexpr Kernels kernels_for() {
  Kernels k;
  if constexpr (compiled(kHeadDim, kDType) && FLASH_ATTN2_COMPILED_SM80) {
    k.fwd_sm80 = &launch_fwd<kHeadDim, kDType>;
    k.bwd_sm80 = &launch_bwd<kHeadDim, kDType>;
  }
  if constexpr (compiled(kHeadDim, kDType)) k.fwd_split = &launch_fwd_split<kHeadDim, kDType>;
  if constexpr (compiled(kHeadDim, kDType) && FLASH_ATTN2_COMPILED_SM90) {
    k.fwd_sm90 = &launch_fwd_sm90<kHeadDim, kDType>;
    k.bwd_sm90 = &launch_bwd_sm90<bwd_sm90_kernel_dim(kHeadDim), kDType>;
  }
  return k;
}

// ---- Head-dim pairs (d_qk, d_v): the Hopper forward's kernels for V / O narrower than Q / K (MLA) ----

constexpr int kFwdSm90Pairs[] = {FLASH_ATTN2_FWD_SM90_PAIRS 0};  // (d_qk, d_v) flattened, then a 0

constexpr bool pair_compiled(int head_dim, int head_dim_v, DType dtype) {
  if (!FLASH_ATTN2_COMPILED_SM90 || !(dtype == DType::kFloat16 ? FLASH_ATTN2_COMPILED_FP16 : FLASH_ATTN2_COMPILED_BF16)) {
    return false;
  }
  for (size_t i = 0; i + 1 < sizeof(kFwdSm90Pairs) / sizeof(int); i += 2) {
    if (kFwdSm90Pairs[i] == head_dim && kFwdSm90Pairs[i + 1] == head_dim_v) return true;
  }
  return false;
}

struct PairKernels {
  int head_dim, head_dim_v;  // buckets
  FwdLauncher fwd_sm90[2];   // by DType
};

// Every pair a build may name (tools/build_config.py: PAIRS); the compiled ones get their launchers.
template <int kHeadDim, int kHeadDimV>
constexpr PairKernels pair_kernels_for() {
  PairKernels k{kHeadDim, kHeadDimV, {nullptr, nullptr}};
  if constexpr (pair_compiled(kHeadDim, kHeadDimV, DType::kFloat16)) {
    k.fwd_sm90[int(DType::kFloat16)] = &launch_fwd_sm90_pair<kHeadDim, kHeadDimV, DType::kFloat16>;
  }
  if constexpr (pair_compiled(kHeadDim, kHeadDimV, DType::kBFloat16)) {
    k.fwd_sm90[int(DType::kBFloat16)] = &launch_fwd_sm90_pair<kHeadDim, kHeadDimV, DType::kBFloat16>;
  }
  return k;
}

constexpr PairKernels kPairTable[] = {pair_kernels_for<192, 128>()};

constexpr int round_up_bucket(int head_dim) { return (head_dim + kBucketStep - 1) / kBucketStep * kBucketStep; }

// The pair kernel serving (head_dim, head_dim_v) (each rounded up to its 32-wide bucket, as the single head dims
// are), or nullptr.
FwdLauncher pair_launcher(int head_dim, int head_dim_v, DType dtype) {
  for (const PairKernels& k : kPairTable) {
    if (k.head_dim == round_up_bucket(head_dim) && k.head_dim_v == round_up_bucket(head_dim_v)) {
      return k.fwd_sm90[int(dtype)];
    }
  }
  return nullptr;
}

template <DType kDType, size_t... kBucket>
constexpr std::array<Kernels, kNumBuckets> kernel_row(std::index_sequence<kBucket...>) {
  return {kernels_for<kBucketStep * (int(kBucket) + 1), kDType>()...};
}

constexpr std::array<std::array<Kernels, kNumBuckets>, 2> kTable = {
    kernel_row<DType::kFloat16>(std::make_index_sequence<kNumBuckets>{}),
    kernel_row<DType::kBFloat16>(std::make_index_sequence<kNumBuckets>{}),
};

const Kernels& kernels(int bucket, DType dtype) { return kTable[int(dtype)][bucket / kBucketStep - 1]; }

thread_local std::string last_error;

// Whether the current device runs sm_90a code (compute capability 9.0 exactly), cached per device.
bool device_is_sm90() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> cached[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && cached[device].load(std::memory_order_relaxed) != 0) {
    return cached[device].load(std::memory_order_relaxed) == 2;
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  const bool sm90 = major == 9 && minor == 0;
  if (device < kMaxDevices) cached[device].store(sm90 ? 2 : 1, std::memory_order_relaxed);
  return sm90;
}

cudaError_t fail(cudaError_t err, std::string message) {
  last_error = std::move(message);
  return err;
}

// A knob read on every call: environment variable `name` as one of `a` or `b`, or "" for unset or "auto"; false,
// with last_error saying so, for any other value.
bool requested_choice(const char* name, const char* a, const char* b, std::string* value) {
  const char* env = std::getenv(name);
  *value = env == nullptr || std::string(env) == "auto" ? "" : env;
  if (value->empty() || *value == a || *value == b) return true;
  fail(cudaErrorInvalidValue, std::string(name) + " must be " + a + ", " + b + ", auto or unset, got '" + *value + "'");
  return false;
}

// FLASH_ATTN2_BACKEND: "sm80" or "sm90" insists on a path.
bool requested_backend(std::string* backend) { return requested_choice("FLASH_ATTN2_BACKEND", "sm80", "sm90", backend); }

constexpr const char* kNoSm80Path = "FLASH_ATTN2_BACKEND=sm80, but the SM80 path was not built (FLASH_ATTN2_SM80=1)";

// The forward kernel for this call: the Hopper one on an sm_90 GPU when built, else the SM80 one;
// FLASH_ATTN2_BACKEND=sm80 or sm90 insists on one. nullptr when none can serve the call, with last_error
// saying why and *err the code.
FwdLauncher pick_fwd(const Kernels& k, cudaError_t* err) {
  std::string backend;
  *err = cudaErrorInvalidValue;
  if (!requested_backend(&backend)) return nullptr;
  const bool sm90_ok = k.fwd_sm90 != nullptr && device_is_sm90();
  FwdLauncher fwd = nullptr;
  std::string why = "no forward kernel for this GPU";
  *err = cudaErrorNotSupported;
  if (backend.empty()) {
    fwd = sm90_ok ? k.fwd_sm90 : k.fwd_sm80;
  } else if (backend == "sm90") {
    fwd = sm90_ok ? k.fwd_sm90 : nullptr;
    why = "FLASH_ATTN2_BACKEND=sm90, but the Hopper forward was not built or the GPU is not sm_90";
  } else {
    fwd = k.fwd_sm80;
    why = kNoSm80Path;
  }
  if (fwd == nullptr) fail(*err, std::move(why));
  return fwd;
}

// Whether the Hopper backward serves p: on an sm_90 GPU where built, unless FLASH_ATTN2_BACKEND=sm80 or
// dout's strides are ones TMA cannot take (a zero row stride, or a zero head / batch stride over more than
// one: an expanded dout; the torch op copies such a dout). Dropout and deterministic mode stay on it: 1.40x
// faster than the SM80 backward's dropout at head dim 256 (TUNING step 56); its key-block-ordered dQ adds
// cost 1.06-1.6x the default, the SM80 one's split accumulators 1.4-7x (step 54).
bool bwd_on_sm90(const Kernels& k, const BwdParams& p, const std::string& backend) {
  const bool tma_strides = p.do_row_stride > 0 && (p.num_heads == 1 || p.do_head_stride > 0) &&
                           (p.batch == 1 || p.cu_seqlens_q != nullptr || p.do_batch_stride > 0);
  return k.bwd_sm90 != nullptr && backend != "sm80" && tma_strides && device_is_sm90();
}

// The backward kernel for this call (backend: requested_backend's): the Hopper one where bwd_on_sm90, else
// the SM80 one. nullptr when neither can serve it, with last_error saying why and *err the code.
BwdLauncher pick_bwd(const Kernels& k, const BwdParams& p, const std::string& backend, cudaError_t* err) {
  if (bwd_on_sm90(k, p, backend)) return k.bwd_sm90;
  if (k.bwd_sm80 != nullptr) return k.bwd_sm80;
  if (backend == "sm80" || k.bwd_sm90 == nullptr || !device_is_sm90()) {
    *err = cudaErrorNotSupported;
    fail(*err, backend == "sm80" ? kNoSm80Path : "no backward kernel for this GPU");
  } else {
    *err = cudaErrorInvalidValue;
    fail(*err, "dout's row stride, and its head and batch strides where it has more than one head or batch "
               "entry, must be nonzero: the Hopper backward reads it by TMA, and this build has no SM80 backward");
  }
  return nullptr;
}

// Why p cannot be run, or "" when it can.
std::string fwd_params_problem(const FwdParams& p) {
  if (p.version != FLASH_ATTN2_PARAMS_VERSION || p.size != sizeof(FwdParams)) {
    return "params come from another flash_attn2.h (version " + std::to_string(p.version) + ", " +
           std::to_string(p.size) + " bytes; this library: version " + std::to_string(FLASH_ATTN2_PARAMS_VERSION) +
           ", " + std::to_string(sizeof(FwdParams)) + " bytes): rebuild against this library's header";
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return "dtype must be kFloat16 or kBFloat16";
  if (!p.q || !p.k || !p.v || !p.out || !p.lse) return "q, k, v, out and lse must be set";
  if (p.batch < 0 || p.num_heads <= 0 || p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0) {
    return "batch must be >= 0 and num_heads a positive multiple of num_heads_k > 0";
  }
  if (p.head_dim <= 0 || p.head_dim > 256 || p.head_dim % 8 != 0) return "head_dim must be a multiple of 8 in 8..256";
  if (p.head_dim_v != 0 && (p.head_dim_v < 0 || p.head_dim_v > p.head_dim || p.head_dim_v % 8 != 0)) {
    return "head_dim_v must be 0 (head_dim) or a multiple of 8 in 8..head_dim";
  }
  // Both paths move 16-byte vectors (cp.async, TMA): every base 16-byte aligned, strides whole vectors.
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "q, k, v and out must be 16-byte aligned";
  }
  for (int64_t stride : {p.q_row_stride, p.q_head_stride, p.k_row_stride, p.k_head_stride, p.v_row_stride,
                         p.v_head_stride, p.o_row_stride, p.o_head_stride}) {
    if (stride % 8 != 0) return "row and head strides must be multiples of 8 elements";
  }
  if (p.cu_seqlens_q == nullptr) {
    for (int64_t stride : {p.q_batch_stride, p.k_batch_stride, p.v_batch_stride, p.o_batch_stride}) {
      if (stride % 8 != 0) return "batch strides must be multiples of 8 elements";
    }
  }
  if (p.seqlen_q < 0 || p.seqlen_k < 0 || p.seqlen_q > kMaxSeqlen || p.seqlen_k > kMaxSeqlen) {
    return "seqlen_q and seqlen_k must be in 0..kMaxSeqlen";
  }
  if (!(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.f)) return "softmax_scale must be positive and finite";
  if (p.window_left < -1 || p.window_right < -1) return "window_left and window_right must be >= -1 (-1: unbounded)";
  if (!(std::isfinite(p.softcap) && p.softcap >= 0.f)) return "softcap must be finite and >= 0 (0: off)";
  if (!(p.dropout_p >= 0.f && p.dropout_p < 1.f)) return "dropout_p must be in [0, 1)";
  const bool paged_seqused = p.page_table != nullptr && p.seqused_k != nullptr;  // varlen paged: no cu_seqlens_k needed
  if ((p.cu_seqlens_q == nullptr) != (p.cu_seqlens_k == nullptr) && !(p.cu_seqlens_q != nullptr && paged_seqused)) {
    return "set both cu_seqlens_q and cu_seqlens_k, or neither (cu_seqlens_k may be left out with page_table and seqused_k)";
  }
  const bool varlen = p.cu_seqlens_q != nullptr;
  const bool kv_cache = has_kv_cache(p);
  if (varlen && (p.leftpad_k != nullptr || p.kv_batch_idx != nullptr || (p.seqused_k != nullptr && !p.page_table))) {
    return "with varlen q (cu_seqlens_q), leftpad_k and kv_batch_idx are not supported, and seqused_k needs page_table";
  }
  if (p.page_table != nullptr && (p.page_size < 1 || p.num_pages < 1 || p.kv_batch_idx != nullptr)) {
    return "page_table needs page_size >= 1 and num_pages >= 1, and no kv_batch_idx";
  }
  if (p.page_table != nullptr && (p.k_batch_stride % 8 != 0 || p.v_batch_stride % 8 != 0)) {
    return "with page_table, the k / v page strides (k/v_batch_stride) must be multiples of 8 elements";
  }
  if (p.dropout_p > 0.f && (kv_cache || p.kv_splits > 1)) return "dropout_p must be 0 with a KV cache or kv_splits > 1";
  if (p.kv_splits < 0 || p.kv_splits > kMaxKvSplits) return "kv_splits must be in 0..kMaxKvSplits (128)";
  if (reinterpret_cast<uintptr_t>(p.split_accum) % 16 != 0) return "split_accum must be 16-byte aligned";
  if (p.seqused_k_add < 0) return "seqused_k_add must be >= 0";
  if (p.kv_batch_idx != nullptr && p.kv_batch < 1) return "kv_batch must be >= 1 with kv_batch_idx";
  if (varlen && p.batch < 1) return "varlen needs batch >= 1 (cu_seqlens of batch + 1 >= 2 entries)";
  if (varlen && p.page_table != nullptr && p.total_k != int64_t(p.num_pages) * p.page_size) {
    return "total_k must be num_pages * page_size with page_table";
  }
  if (varlen ? (p.total_q < 0 || p.total_k < 0 || p.total_q > kMaxSeqlen || (p.total_k > kMaxSeqlen && !p.page_table))
             : (p.total_q != int64_t(p.batch) * p.seqlen_q ||
                p.total_k != (p.page_table != nullptr ? int64_t(p.num_pages) * p.page_size
                                                      : int64_t(p.kv_batch_idx != nullptr ? p.kv_batch : p.batch) *
                                                            p.seqlen_k))) {
    return varlen ? "total_q and total_k must be in 0..kMaxSeqlen"
                  : "total_q and total_k must be batch * seqlen_q and batch * seqlen_k (kv_batch * seqlen_k with "
                    "kv_batch_idx, num_pages * page_size with page_table)";
  }
  return "";
}

// Whether the Hopper forward serves a call with a KV cache's fields: more query rows per head than the split
// kernel's tile (prefill and chunked prefill against a cache, long verification windows), where the split kernel's
// mma.sync tiles ran chunked prefill at 280 TFLOP/s (TUNING 137). Rows per head, not packed rows: the Hopper
// forward neither packs a kv head's query heads nor splits the keys, so a few rows a head (9-token verification at
// 8:1 GQA) would leave its tiles nearly empty and read each kv head once per query head. Varlen (a serving batch:
// a few chunks among many decode rows) also on the mean rows per sequence, total_q / batch: decode-heavy batches
// stay on the split kernel, which packs them. A contiguous cache, or pages of a multiple of kPagedRowsSm90 rows
// without leftpad_k (its TMA boxes, 16 rows or a larger power of two dividing the page, never straddle one);
// strides TMA takes; an sm_90 GPU whose build has the Hopper forward for the head dim, unless
// FLASH_ATTN2_BACKEND=sm80. From the shapes, the build and the device alone, so the workspace plan needs no device
// values.
bool hopper_serves_kv_cache(const FwdParams& p) {
  if (p.seqlen_q <= kFwdSplitBlockM) return false;  // varlen: max_seqlen_q, the hint
  if (p.cu_seqlens_q != nullptr && p.total_q <= int64_t(kFwdSplitBlockM) * p.batch) return false;
  if (p.page_table != nullptr && (p.page_size % kPagedRowsSm90 != 0 || p.leftpad_k != nullptr)) return false;
  // TMA takes no zero stride over an extent above one (an expanded cache; the torch layer copies those).
  // (Varlen q reaches here with a page table only: fwd_params_problem refuses its other kv-cache fields.)
  const bool many_kv_entries = p.page_table != nullptr ? p.num_pages > 1
                               : p.kv_batch_idx != nullptr ? p.kv_batch > 1 : p.batch > 1;
  if (p.k_row_stride == 0 || p.v_row_stride == 0) return false;
  if (p.num_heads_k > 1 && (p.k_head_stride == 0 || p.v_head_stride == 0)) return false;
  if (many_kv_entries && (p.k_batch_stride == 0 || p.v_batch_stride == 0)) return false;
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0 || kernels(bucket, p.dtype).fwd_sm90 == nullptr || !device_is_sm90()) return false;
  std::string backend;
  if (!requested_backend(&backend)) {
    last_error.clear();  // the split path's own check says it
    return false;
  }
  return backend != "sm80";
}

// Whether the split-KV forward serves p: forced splits, calls with a KV cache's fields the Hopper forward does not
// take, and fixed-length calls without dropout whose packed query rows fit one tile (decode: a few query rows per
// kv head), where the training kernels would fill a 128-row tile with one row per head and read each key once per
// query head.
bool uses_split_kernel(const FwdParams& p) {
  if (p.kv_splits > 1) return true;
  if (has_kv_cache(p)) return !hopper_serves_kv_cache(p);
  if (p.dropout_p > 0.f) return false;
  return int64_t(p.seqlen_q) * split_pack(p) <= kFwdSplitBlockM;  // varlen: max_seqlen_q, the hint
}

// FLASH_ATTN2_SPLIT_COMBINE: "cluster" merges a split call's splits inside a thread block cluster wherever that can
// run, "kernel" always in the combine kernel, "" as cluster_combine_pays (heuristics.h) says.
bool requested_split_combine(std::string* mode) {
  return requested_choice("FLASH_ATTN2_SPLIT_COMBINE", "cluster", "kernel", mode);
}

// What a split-KV call's plan depends on (heuristics.h): its (query tile, head group) blocks, its key blocks (of the
// kernel's key block for the head-dim bucket), and whether the narrow kernel takes it.
struct SplitShape {
  int64_t tiles;
  int n_blocks;
  bool narrow;
};

SplitShape split_shape(const FwdParams& p, int bucket) {
  const SplitGrid grid = split_grid(p, kFwdSplitBlockM, 1);
  const int block_n = fwd_split_tile_sm80(bucket).block_n;
  return {int64_t(grid.m_blocks) * grid.groups, (p.seqlen_k + block_n - 1) / block_n,
          fwd_split_narrow_stages(bucket) > 0 && int64_t(p.seqlen_q) * split_pack(p) <= kFwdSplitNarrowRows};
}

// Whether a split call's kernel merges its splits inside a thread block cluster (launch_split_cluster) rather than
// in the combine kernel: on sm_90, for fixed-length calls of 2 to kMaxClusterSplits (16) splits, as mode
// (requested_split_combine's) says.
bool cluster_combine_wanted(const FwdParams& p, const SplitShape& shape, int splits, const std::string& mode,
                            const DeviceInfo& device) {
  if (splits < 2 || splits > kMaxClusterSplits || p.cu_seqlens_q != nullptr || !device_is_sm90()) return false;
  if (!mode.empty()) return mode == "cluster";
  return cluster_combine_pays(shape.tiles, splits, shape.n_blocks, device.num_sms, shape.narrow);
}

// The split plan of a split-KV call (heuristics.h); more splits where the cluster combine takes the call
// (cluster_kv_splits) and still would at the new count.
int split_count(const FwdParams& p, const SplitShape& shape, const std::string& mode, const DeviceInfo& device) {
  const int splits = fwd_kv_splits(p, device, shape.tiles, shape.n_blocks, shape.narrow);
  if (p.kv_splits > 0 || !cluster_combine_wanted(p, shape, splits, mode, device)) return splits;
  const int more = cluster_kv_splits(shape.tiles, splits, shape.n_blocks, device.num_sms, kMaxClusterSplits);
  return cluster_combine_wanted(p, shape, more, mode, device) ? more : splits;
}

// cudaErrorNotSupported with what is missing; the torch op raises it as NotImplementedError.
cudaError_t no_kernel(const FwdParams& p, const char* direction) {
  return fail(cudaErrorNotSupported, std::string("no ") + direction + " kernel was compiled for head_dim " +
                                         std::to_string(p.head_dim) + " and " +
                                         (p.dtype == DType::kBFloat16 ? "bf16" : "fp16") +
                                         "; rebuild with FLASH_ATTN2_HEAD_DIMS / FLASH_ATTN2_DTYPES covering it");
}

// dq_accum's size (bwd_workspace.h) when the backward runs on the Hopper path (on_sm90) or the SM80 one.
int64_t dq_accum_elems(const BwdParams& p, int bucket, bool on_sm90, int head_splits) {
  return bwd_dq_accum_size(p, bucket, bwd_sm90_kernel_dim(bucket), on_sm90, head_splits);
}

}  // namespace

const char* last_error_message() { return last_error.c_str(); }

int fwd_head_dim_bucket(int head_dim, DType dtype) {
  if ((dtype != DType::kFloat16 && dtype != DType::kBFloat16) || head_dim <= 0) return 0;
  for (int bucket = kBucketStep; bucket <= kNumBuckets * kBucketStep; bucket += kBucketStep) {
    if (bucket >= head_dim && compiled(bucket, dtype)) return bucket;
  }
  return 0;
}

// An error some earlier launch of the caller's left pending would surface as this call's launch error.
cudaError_t pending_error() {
  const cudaError_t err = cudaPeekAtLastError();
  if (err != cudaSuccess) fail(err, std::string("a CUDA error was pending before the call: ") + cudaGetErrorString(err));
  return err;
}

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  last_error.clear();
  const std::string problem = fwd_params_problem(p);
  if (!problem.empty()) return fail(cudaErrorInvalidValue, problem);
  if (cudaError_t err = pending_error()) return err;
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0) return no_kernel(p, "forward");
  cudaError_t err = cudaSuccess;
  LaunchPlan plan;
  plan.kind = fwd_kind(p);
  FwdLauncher fwd = nullptr;
  if (p.head_dim_v != 0 && p.head_dim_v != p.head_dim) {  // a head-dim pair: its Hopper kernel, or nothing
    std::string backend;
    if (!requested_backend(&backend)) return cudaErrorInvalidValue;
    if (!fwd_serves_head_dim_v(p)) {
      return fail(cudaErrorNotSupported,
                  "no forward kernel for head dims (" + std::to_string(p.head_dim) + ", " +
                      std::to_string(p.head_dim_v) + ") (q / k, v / out) with this call's shape, dtype and GPU: the "
                      "pairs FLASH_ATTN2_HEAD_DIM_PAIRS builds run on the Hopper path (sm_90), for calls without a "
                      "KV cache and with more than 64 packed query rows; pad v to q's head dim otherwise");
    }
    fwd = pair_launcher(p.head_dim, p.head_dim_v, p.dtype);
    if ((err = current_device_info(&plan.device)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
    if ((err = fwd(p, plan, stream)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
    return cudaSuccess;
  }
  if (uses_split_kernel(p)) {
    std::string backend, combine;
    if (!requested_backend(&backend) || !requested_split_combine(&combine)) return cudaErrorInvalidValue;
    if ((fwd = kernels(bucket, p.dtype).fwd_split) == nullptr) return no_kernel(p, "split-KV forward");
    if ((err = current_device_info(&plan.device)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
    const SplitShape shape = split_shape(p, bucket);
    plan.kv_splits = split_count(p, shape, combine, plan.device);
    // No partial rows (varlen with a max_seqlen_q hint of 0): every tile runs whole on split 0 anyway.
    if (fwd_split_accum_elems(p, plan.kv_splits) == 0) plan.kv_splits = 1;
    if (plan.kv_splits > 1 && p.split_accum == nullptr) {
      if (p.kv_splits > 1) return fail(cudaErrorInvalidValue, "kv_splits > 1 needs split_accum (fwd_split_accum_elems)");
      plan.kv_splits = 1;
    }
    plan.cluster_combine = cluster_combine_wanted(p, shape, plan.kv_splits, combine, plan.device);
    if ((err = fwd(p, plan, stream)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
    return cudaSuccess;
  }
  if ((fwd = pick_fwd(kernels(bucket, p.dtype), &err)) == nullptr) return err;
  if ((err = current_device_info(&plan.device)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
  if ((err = fwd(p, plan, stream)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
  return cudaSuccess;
}

bool bwd_serves_head_dim_v(const BwdParams& p) {
  if (p.head_dim_v == 0 || p.head_dim_v == p.head_dim) return true;
  if ((p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) || p.head_dim <= 0 || p.head_dim > 256 ||
      p.head_dim % 8 != 0 || p.head_dim_v < 0 || p.head_dim_v > p.head_dim || p.head_dim_v % 8 != 0) {
    return false;  // what run_bwd refuses (fwd_params_problem)
  }
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0) return false;
  std::string backend;
  if (!requested_backend(&backend)) {
    last_error.clear();  // run_bwd says it
    return false;
  }
  // The Hopper backward reads dO and V through d_v-wide TMA extents (sm90/bwd_launch.h); the SM80 one takes one
  // head dim. With no query or no key rows the preprocess alone runs, which takes both.
  return p.total_q == 0 || p.total_k == 0 || bwd_on_sm90(kernels(bucket, p.dtype), p, backend);
}

bool fwd_serves_head_dim_v(const FwdParams& p) {
  if (p.head_dim_v == 0 || p.head_dim_v == p.head_dim) return true;
  if ((p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) || p.head_dim <= 0 || p.head_dim > 256 ||
      p.head_dim % 8 != 0 || p.head_dim_v < 0 || p.head_dim_v > p.head_dim || p.head_dim_v % 8 != 0) {
    return false;  // what run_fwd refuses (fwd_params_problem)
  }
  if (has_kv_cache(p) || uses_split_kernel(p) || !device_is_sm90()) return false;
  std::string backend;
  if (!requested_backend(&backend)) {
    last_error.clear();  // run_fwd says it
    return false;
  }
  return backend != "sm80" && pair_launcher(p.head_dim, p.head_dim_v, p.dtype) != nullptr;
}

int fwd_num_splits(const FwdParams& p) {
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  DeviceInfo device;
  if (bucket == 0 || !uses_split_kernel(p) || current_device_info(&device) != cudaSuccess) return 1;
  std::string combine;
  if (!requested_split_combine(&combine)) {  // run_fwd says it; the plan is the combine kernel's meanwhile
    last_error.clear();
    combine = "kernel";
  }
  return split_count(p, split_shape(p, bucket), combine, device);
}

int64_t fwd_split_accum_elems(const FwdParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  return int64_t(num_splits) * p.batch * p.num_heads * p.seqlen_q * (int64_t(p.head_dim) + 1);
}

cudaError_t run_merge_partial(const MergeParams& p, cudaStream_t stream) {
  last_error.clear();
  if (p.version != FLASH_ATTN2_PARAMS_VERSION || p.size != sizeof(MergeParams)) {
    return fail(cudaErrorInvalidValue, "MergeParams come from another flash_attn2.h: rebuild against this library's header");
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return fail(cudaErrorInvalidValue, "dtype must be kFloat16 or kBFloat16");
  if (p.batch < 0 || p.seqlen < 0 || p.heads < 0 || p.head_dim <= 0 || p.head_dim % 4 != 0) {
    return fail(cudaErrorInvalidValue, "batch, seqlen and heads must be >= 0, head_dim a positive multiple of 4");
  }
  if (int64_t(p.batch) * p.seqlen * p.heads == 0) return cudaSuccess;  // no row: the pointers may be null
  if (!(p.out != nullptr) == !(p.out_in_dtype != nullptr) || !p.lse || !p.block_out || !p.block_lse) {
    return fail(cudaErrorInvalidValue, "one of out and out_in_dtype, and lse, block_out and block_lse must be set");
  }
  if (!merge_layout_supported(p)) {
    return fail(cudaErrorInvalidValue, "out's and block_out's strides must be multiples of 4 elements, out 16-byte (in "
                                       "dtype 8-byte) and block_out 8-byte aligned");
  }
  if (cudaError_t err = pending_error()) return err;
  if (cudaError_t err = launch_merge_partial(p, stream)) return fail(err, cudaGetErrorString(err));
  return cudaSuccess;
}

cudaError_t run_kv_append(const KvAppendParams& p, cudaStream_t stream) {
  last_error.clear();
  if (p.version != FLASH_ATTN2_PARAMS_VERSION || p.size != sizeof(KvAppendParams)) {
    return fail(cudaErrorInvalidValue, "KvAppendParams come from another flash_attn2.h: rebuild against this library's header");
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return fail(cudaErrorInvalidValue, "dtype must be kFloat16 or kBFloat16");
  if (p.batch < 0 || p.num_heads_k <= 0 || p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim > 256) {
    return fail(cudaErrorInvalidValue, "batch must be >= 0, num_heads_k > 0, head_dim a multiple of 8 in 8..256");
  }
  if (p.cache_seqlens == nullptr) return fail(cudaErrorInvalidValue, "cache_seqlens must be set");
  if (p.k_new != nullptr && (p.v_new == nullptr || p.k_cache == nullptr || p.v_cache == nullptr || p.seqlen_new < 0 ||
                             p.cache_seqlen < 0 || (p.cache_batch_idx != nullptr && p.cache_batch < 1))) {
    return fail(cudaErrorInvalidValue, "k_new needs v_new, k_cache, v_cache, seqlen_new >= 0, cache_seqlen >= 0 and, "
                                       "with cache_batch_idx, cache_batch >= 1");
  }
  if (p.page_table != nullptr && (p.page_size < 1 || p.num_pages < 1 || p.cache_batch_idx != nullptr)) {
    return fail(cudaErrorInvalidValue, "page_table needs page_size >= 1 and num_pages >= 1, and no cache_batch_idx");
  }
  const bool rotary = p.rotary_dim > 0;
  if (rotary && (p.rotary_cos == nullptr || p.rotary_sin == nullptr || p.rotary_dim % 2 != 0 ||
                 p.rotary_dim > p.head_dim || p.seqlen_ro < 1)) {
    return fail(cudaErrorInvalidValue, "rotary_dim > 0 needs rotary_cos, rotary_sin, seqlen_ro >= 1 and an even "
                                       "rotary_dim <= head_dim");
  }
  if (p.q != nullptr && (p.q_out == nullptr || !rotary || p.seqlen_q < 0 || p.num_heads <= 0)) {
    return fail(cudaErrorInvalidValue, "q needs q_out, rotary tables, seqlen_q >= 0 and num_heads > 0");
  }
  if (cudaError_t err = pending_error()) return err;
  if (cudaError_t err = launch_kv_append(p, stream)) return fail(err, cudaGetErrorString(err));
  return cudaSuccess;
}

int bwd_deterministic_splits(const BwdParams& p, int num_sms) { return deterministic_splits(p, num_sms); }

int64_t bwd_softmax_d_elems(const BwdParams& p) { return bwd_softmax_d_size(p); }

int64_t bwd_dq_accum_elems(const BwdParams& p) {
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  std::string backend;
  const bool on_sm90 = bucket > 0 && requested_backend(&backend) && bwd_on_sm90(kernels(bucket, p.dtype), p, backend);
  DeviceInfo device;
  // Without the device's facts, one head split; run_bwd meets the error and says it.
  const int head_splits = current_device_info(&device) == cudaSuccess ? bwd_head_splits(p, device) : 1;
  return dq_accum_elems(p, bucket, on_sm90, head_splits);
}

cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  last_error.clear();
  std::string problem = fwd_params_problem(p);
  if (problem.empty() && p.bwd_size != sizeof(BwdParams)) {
    problem = "BwdParams come from another flash_attn2.h (" + std::to_string(p.bwd_size) + " bytes; this library: " +
              std::to_string(sizeof(BwdParams)) + "): rebuild against this library's header";
  }
  if (problem.empty() && (!p.dout || !p.dq || !p.dk || !p.dv || !p.softmax_d || !p.dq_accum)) {
    problem = "dout, dq, dk, dv, softmax_d and dq_accum must be set";
  }
  if (problem.empty() && p.num_splits < 0) problem = "num_splits must be >= 0";
  if (problem.empty() && (has_kv_cache(p) || p.kv_splits > 1)) {
    problem = "the backward takes no KV-cache fields (seqused_k, leftpad_k, kv_batch_idx, page_table) or kv_splits";
  }
  if (problem.empty() && p.dsink != nullptr && p.sink == nullptr) problem = "dsink needs sink (the forward's sinks)";
  if (!problem.empty()) return fail(cudaErrorInvalidValue, problem);
  if (cudaError_t err = pending_error()) return err;
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0) return no_kernel(p, "backward");
  std::string backend;
  if (!requested_backend(&backend)) return cudaErrorInvalidValue;  // its own error, before the head dims'
  if (!bwd_serves_head_dim_v(p)) {
    return fail(cudaErrorNotSupported,
                "head_dim_v " + std::to_string(p.head_dim_v) + " with head_dim " + std::to_string(p.head_dim) +
                    ": the Hopper backward (sm_90) takes a narrower v; elsewhere pad v, out and dout to q's head dim "
                    "(the zero columns change no gradient; cut dv's off)");
  }
  // With no query or no key rows the preprocess alone writes the (zero) gradients: TMA descriptors need
  // nonzero extents.
  BwdLauncher bwd = nullptr;
  cudaError_t err = cudaSuccess;
  const Kernels& k = kernels(bucket, p.dtype);
  if (p.total_q > 0 && p.total_k > 0 && (bwd = pick_bwd(k, p, backend, &err)) == nullptr) return err;
  LaunchPlan plan;
  if (bwd != nullptr) {
    if ((err = current_device_info(&plan.device)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
    plan.kind = bwd_kind(p);
    plan.head_splits = bwd_head_splits(p, plan.device);
    plan.causal_pair_fits_l2 = bwd_causal_pair_fits_l2(p, bwd_sm90_kernel_dim(bucket), plan.device);
  }
  // The accumulator the picked kernel adds into (as bwd_dq_accum_elems sized it), zeroed by the preprocess.
  const int64_t accum_elems = bwd == nullptr ? 0 : dq_accum_elems(p, bucket, bwd == k.bwd_sm90, plan.head_splits);
  if ((err = launch_bwd_preprocess(p, accum_elems, stream)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
  if (bwd != nullptr && (err = bwd(p, plan, stream)) != cudaSuccess) return fail(err, cudaGetErrorString(err));
  if (p.dsink != nullptr && (err = launch_bwd_sink_grad(p, stream)) != cudaSuccess) {
    return fail(err, cudaGetErrorString(err));
  }
  return cudaSuccess;
}

}  // namespace flash_attn2
