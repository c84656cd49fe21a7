// run_fwd() / run_bwd(): pick the compiled kernel for (head dim bucket, dtype). Torch-free, like the kernels.
#include <algorithm>

#include "flash_attn2/flash_attn2.h"
#include "registry.h"
#include "tile_sizes.h"

namespace flash_attn2 {
namespace {

constexpr int kBucketStep = 32;
constexpr int kNumBuckets = 256 / kBucketStep;  // head dims 32, 64, ..., 256
// Deterministic backward: at most this many dq accumulators (memory), at least every key block of
// kMinBlockN rows its own split when the heads alone cannot fill the GPU.
constexpr int kMaxSplits = 16;
constexpr int kMinBlockN = 64;

template <class Launcher>
Launcher& slot(int bucket, DType dtype) {
  static Launcher table[2][kNumBuckets] = {};
  return table[int(dtype)][bucket / kBucketStep - 1];
}

bool valid_dtype(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

bool valid_fwd(const FwdParams& p) {
  return p.batch >= 0 && p.num_heads > 0 && p.num_heads_k > 0 && p.num_heads % p.num_heads_k == 0 &&
         p.head_dim > 0 && p.head_dim % 8 == 0 && p.seqlen_q >= 0 && p.seqlen_k >= 0 && p.softmax_scale >= 0.f &&
         (p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr);
}

}  // namespace

bool register_fwd(int head_dim_bucket, DType dtype, FwdLauncher launcher) {
  slot<FwdLauncher>(head_dim_bucket, dtype) = launcher;
  return true;
}

bool register_bwd(int head_dim_bucket, DType dtype, BwdLauncher launcher) {
  slot<BwdLauncher>(head_dim_bucket, dtype) = launcher;
  return true;
}

int fwd_head_dim_bucket(int head_dim, DType dtype) {
  if (!valid_dtype(dtype) || head_dim <= 0) return 0;
  for (int bucket = kBucketStep; bucket <= kNumBuckets * kBucketStep; bucket += kBucketStep) {
    if (bucket >= head_dim && slot<FwdLauncher>(bucket, dtype) != nullptr) return bucket;
  }
  return 0;
}

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  if (!valid_fwd(p)) return cudaErrorInvalidValue;
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0) return cudaErrorNotSupported;
  return slot<FwdLauncher>(bucket, p.dtype)(p, stream);
}

int bwd_deterministic_splits(const BwdParams& p, int num_sms) {
  const int64_t heads = std::max<int64_t>(1, int64_t(p.batch) * p.num_heads_k);  // blocks per key block
  const int64_t fill = (2 * int64_t(num_sms) + heads - 1) / heads;
  const int64_t key_blocks = (int64_t(p.seqlen_k) + kMinBlockN - 1) / kMinBlockN;
  return int(std::max<int64_t>(1, std::min<int64_t>({fill, key_blocks, kMaxSplits})));
}

int64_t bwd_softmax_d_elems(const BwdParams& p) { return int64_t(p.num_heads) * p.total_q; }

int64_t bwd_dq_accum_elems(const BwdParams& p) {
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  const int64_t rows = int64_t(p.total_q) + int64_t(p.batch) * bwd_block_m(bucket);
  return int64_t(std::max(1, p.num_splits)) * p.num_heads * rows * bucket;
}

cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  if (!valid_fwd(p) || p.total_q < 0 || p.num_splits < 0) return cudaErrorInvalidValue;
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0 || slot<BwdLauncher>(bucket, p.dtype) == nullptr) return cudaErrorNotSupported;
  if (p.softmax_d == nullptr || p.dq_accum == nullptr) return cudaErrorInvalidValue;
  if (cudaError_t err = launch_bwd_preprocess(p, stream)) return err;
  return slot<BwdLauncher>(bucket, p.dtype)(p, stream);
}

}  // namespace flash_attn2
