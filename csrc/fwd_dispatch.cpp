// run_fwd(): picks the compiled kernel for (head dim bucket, dtype). Torch-free, like the kernels.
#include "flash_attn2/flash_attn2.h"
#include "registry.h"

namespace flash_attn2 {
namespace {

constexpr int kBucketStep = 32;
constexpr int kNumBuckets = 256 / kBucketStep;  // head dims 32, 64, ..., 256

FwdLauncher& slot(int bucket, DType dtype) {
  static FwdLauncher table[2][kNumBuckets] = {};
  return table[int(dtype)][bucket / kBucketStep - 1];
}

bool valid_dtype(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

}  // namespace

bool register_fwd(int head_dim_bucket, DType dtype, FwdLauncher launcher) {
  slot(head_dim_bucket, dtype) = launcher;
  return true;
}

int fwd_head_dim_bucket(int head_dim, DType dtype) {
  if (!valid_dtype(dtype) || head_dim <= 0) return 0;
  for (int bucket = kBucketStep; bucket <= kNumBuckets * kBucketStep; bucket += kBucketStep) {
    if (bucket >= head_dim && slot(bucket, dtype) != nullptr) return bucket;
  }
  return 0;
}

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  const bool valid = p.batch >= 0 && p.num_heads > 0 && p.num_heads_k > 0 &&
                     p.num_heads % p.num_heads_k == 0 && p.head_dim > 0 && p.head_dim % 8 == 0 &&
                     p.seqlen_q >= 0 && p.seqlen_k >= 0 && p.softmax_scale >= 0.f &&
                     (p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr);
  if (!valid) return cudaErrorInvalidValue;
  const int bucket = fwd_head_dim_bucket(p.head_dim, p.dtype);
  if (bucket == 0) return cudaErrorNotSupported;
  return slot(bucket, p.dtype)(p, stream);
}

}  // namespace flash_attn2
