// Torch bindings. The Python layer (flash_attn2/flash_attn_interface.py) validates arguments with
// user-facing errors and allocates outputs; the checks here only guard memory safety for direct callers.
#include <cstdint>
#include <string>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "flash_attn2/flash_attn2.h"

namespace {

using flash_attn2::DType;

#ifndef FLASH_ATTN2_BUILT_ARCHS
#error "setup.py defines FLASH_ATTN2_BUILT_ARCHS"
#endif

DType dtype_of(const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                   "flash_attn2: q must be float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
}

void check_tensor(const at::Tensor& t, const char* name, int64_t dim, const at::Tensor& q, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == dim, "flash_attn2: ", name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), "flash_attn2: ", name, " must be on ", q.device());
  TORCH_CHECK(t.scalar_type() == dtype, "flash_attn2: ", name, " must be ", dtype, ", got ", t.scalar_type());
  if (dtype == at::kFloat) return;
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn2: ", name, " must have a contiguous last dimension");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_attn2: ", name, " must be 16-byte aligned");
  for (int64_t i = 0; i + 1 < dim; ++i) {
    TORCH_CHECK(t.stride(i) % 8 == 0 || t.size(i) == 1, "flash_attn2: ", name, " strides must be multiples of 8");
  }
}

// Fills p's FwdParams fields from the forward's tensors after checking what memory safety needs.
void set_fwd_params(flash_attn2::FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& cu_seqlens_q,
                    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                    double softmax_scale, bool causal) {
  const bool varlen = cu_seqlens_q.has_value();
  TORCH_CHECK(varlen == cu_seqlens_k.has_value(), "flash_attn2: pass both cu_seqlens_q and cu_seqlens_k, or neither");
  const int64_t dim = varlen ? 3 : 4;
  const DType dtype = dtype_of(q);
  check_tensor(q, "q", dim, q, q.scalar_type());
  check_tensor(k, "k", dim, q, q.scalar_type());
  check_tensor(v, "v", dim, q, q.scalar_type());
  check_tensor(out, "out", dim, q, q.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn2: out must have q's shape");
  TORCH_CHECK(k.sizes() == v.sizes(), "flash_attn2: k and v must have the same shape");
  const int64_t head_dim = q.size(-1), heads = q.size(-2), heads_k = k.size(-2);
  TORCH_CHECK(k.size(-1) == head_dim, "flash_attn2: k's head dim must equal q's");
  TORCH_CHECK(heads_k > 0 && heads % heads_k == 0, "flash_attn2: q's heads must be a multiple of k's");

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  const int row = varlen ? 0 : 1;  // dimension of the sequence rows
  p.q_batch_stride = varlen ? 0 : q.stride(0);
  p.k_batch_stride = varlen ? 0 : k.stride(0);
  p.v_batch_stride = varlen ? 0 : v.stride(0);
  p.o_batch_stride = varlen ? 0 : out.stride(0);
  p.q_row_stride = q.stride(row), p.k_row_stride = k.stride(row), p.v_row_stride = v.stride(row);
  p.o_row_stride = out.stride(row);
  p.q_head_stride = q.stride(-2), p.k_head_stride = k.stride(-2), p.v_head_stride = v.stride(-2);
  p.o_head_stride = out.stride(-2);
  p.num_heads = int(heads);
  p.num_heads_k = int(heads_k);
  p.head_dim = int(head_dim);
  p.softmax_scale = float(softmax_scale);
  p.causal = causal;
  p.dtype = dtype;
  if (varlen) {
    for (const at::Tensor* cu : {&*cu_seqlens_q, &*cu_seqlens_k}) {
      check_tensor(*cu, "cu_seqlens", 1, q, at::kInt);
      TORCH_CHECK(cu->is_contiguous(), "flash_attn2: cu_seqlens must be contiguous");
    }
    TORCH_CHECK(cu_seqlens_q->numel() >= 2 && cu_seqlens_k->numel() == cu_seqlens_q->numel(),
                "flash_attn2: cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries");
    p.batch = int(cu_seqlens_q->numel() - 1);
    p.seqlen_q = int(max_seqlen_q);
    p.seqlen_k = int(max_seqlen_k);
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
    p.cu_seqlens_k = cu_seqlens_k->data_ptr<int>();
    check_tensor(lse, "softmax_lse", 2, q, at::kFloat);
    TORCH_CHECK(lse.size(0) == heads && lse.size(1) == q.size(0) && lse.stride(1) == 1,
                "flash_attn2: softmax_lse must be (nheads, total_q) with unit row stride");
    p.lse_batch_stride = 0;
    p.lse_head_stride = lse.stride(0);
  } else {
    TORCH_CHECK(k.size(0) == q.size(0), "flash_attn2: q and k must have the same batch size");
    p.batch = int(q.size(0));
    p.seqlen_q = int(q.size(1));
    p.seqlen_k = int(k.size(1));
    check_tensor(lse, "softmax_lse", 3, q, at::kFloat);
    TORCH_CHECK(lse.size(0) == q.size(0) && lse.size(1) == heads && lse.size(2) == q.size(1) && lse.stride(2) == 1,
                "flash_attn2: softmax_lse must be (batch, nheads, seqlen_q) with unit row stride");
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
  }
  p.lse = lse.data_ptr<float>();
}

void check_launch(cudaError_t err, const at::Tensor& q, const char* direction) {
  TORCH_CHECK_NOT_IMPLEMENTED(err != cudaErrorNotSupported, "flash_attn2: no ", direction,
                              " kernel was compiled for head dim ", q.size(-1), " and ", q.scalar_type(),
                              "; rebuild with FLASH_ATTN2_HEAD_DIMS / FLASH_ATTN2_DTYPES covering it");
  TORCH_CHECK(err != cudaErrorNoKernelImageForDevice && err != cudaErrorInvalidDeviceFunction,
              "flash_attn2 was built for ", FLASH_ATTN2_BUILT_ARCHS, ", which cannot run on ",
              q.device(), "; rebuild with FLASH_ATTN2_CUDA_ARCHS set to this GPU's compute capability");
  TORCH_CHECK(err != cudaErrorLaunchOutOfResources, "flash_attn2: the ", direction, " kernel for head dim ",
              q.size(-1), " needs more shared memory per block than ", q.device(),
              " offers (the backward at head dims 224 and 256 needs an H100/H200-class GPU)");
  C10_CUDA_CHECK(err);
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
         int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal) {
  flash_attn2::FwdParams p{};
  set_fwd_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal);
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(flash_attn2::run_fwd(p, c10::cuda::getCurrentCUDAStream().stream()), q, "forward");
}

// Gradients into dq (q's shape), dk and dv (k's shape).
void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
         int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic) {
  flash_attn2::BwdParams p{};
  set_fwd_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal);
  const bool varlen = cu_seqlens_q.has_value();
  const int64_t dim = varlen ? 3 : 4;
  check_tensor(dout, "dout", dim, q, q.scalar_type());
  check_tensor(dq, "dq", dim, q, q.scalar_type());
  check_tensor(dk, "dk", dim, q, q.scalar_type());
  check_tensor(dv, "dv", dim, q, q.scalar_type());
  TORCH_CHECK(dout.sizes() == q.sizes() && dq.sizes() == q.sizes(), "flash_attn2: dout and dq must have q's shape");
  TORCH_CHECK(dk.sizes() == k.sizes() && dv.sizes() == k.sizes(), "flash_attn2: dk and dv must have k's shape");
  TORCH_CHECK(lse.is_contiguous(), "flash_attn2: softmax_lse must be contiguous");
  const c10::cuda::CUDAGuard guard(q.device());

  const int row = varlen ? 0 : 1;
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.do_batch_stride = varlen ? 0 : dout.stride(0);
  p.dq_batch_stride = varlen ? 0 : dq.stride(0);
  p.dk_batch_stride = varlen ? 0 : dk.stride(0);
  p.dv_batch_stride = varlen ? 0 : dv.stride(0);
  p.do_row_stride = dout.stride(row), p.dq_row_stride = dq.stride(row);
  p.dk_row_stride = dk.stride(row), p.dv_row_stride = dv.stride(row);
  p.do_head_stride = dout.stride(-2), p.dq_head_stride = dq.stride(-2);
  p.dk_head_stride = dk.stride(-2), p.dv_head_stride = dv.stride(-2);
  p.total_q = int(varlen ? q.size(0) : q.size(0) * q.size(1));
  TORCH_CHECK(varlen ? q.size(0) <= INT32_MAX : q.size(0) * q.size(1) <= INT32_MAX,
              "flash_attn2: at most 2**31 - 1 query rows in total");
  if (deterministic) {
    int num_sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.device().index()));
    p.num_splits = flash_attn2::bwd_deterministic_splits(p, num_sms);
  }
  at::Tensor softmax_d = at::empty({flash_attn2::bwd_softmax_d_elems(p)}, q.options().dtype(at::kFloat));
  at::Tensor dq_accum = at::empty({flash_attn2::bwd_dq_accum_elems(p)}, q.options().dtype(at::kFloat));
  p.softmax_d = softmax_d.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();

  check_launch(flash_attn2::run_bwd(p, c10::cuda::getCurrentCUDAStream().stream()), q, "backward");
}

int64_t fwd_head_dim_bucket(int64_t head_dim, bool bf16) {
  return flash_attn2::fwd_head_dim_bucket(int(head_dim), bf16 ? DType::kBFloat16 : DType::kFloat16);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn2 CUDA kernels";
  m.def("fwd", &fwd, "FlashAttention-2 forward into preallocated out and softmax_lse");
  m.def("bwd", &bwd, "FlashAttention-2 backward into preallocated dq, dk and dv");
  m.def("fwd_head_dim_bucket", &fwd_head_dim_bucket,
        "The compiled head-dim bucket serving head_dim for the dtype, or 0");
  m.attr("built_archs") = std::string(FLASH_ATTN2_BUILT_ARCHS);
}
