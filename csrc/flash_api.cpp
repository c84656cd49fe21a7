// Torch binding: the ops flash_attn2::fwd and flash_attn2::bwd, with CUDA kernels and the autograd formula
// registered on the op in C++ (their fake-tensor implementations are in flash_attn2/_ops.py), and the
// out-variants the tests use to poison outputs. The Python layer (flash_attn2/flash_attn_interface.py)
// validates arguments with user-facing errors; the checks here guard memory safety for direct callers.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "flash_attn2/flash_attn2.h"

#ifndef FLASH_ATTN2_COMPACT_TILES  // set by setup.py: whether the backward has its compact tiles
#define FLASH_ATTN2_COMPACT_TILES 0
#endif

namespace {

using flash_attn2::DType;
using at::Tensor;
using OptTensor = std::optional<Tensor>;

#ifndef FLASH_ATTN2_BUILT_ARCHS
#error "setup.py defines FLASH_ATTN2_BUILT_ARCHS"
#endif

DType dtype_of(const Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                   "flash_attn2: q must be float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
}

// What Python prints for a dtype and a shape, so that both versions of the checks read the same.
std::string dtype_str(at::ScalarType dtype) { return std::string("torch.") + c10::getDtypeNames(dtype).first; }

std::string tuple_str(at::IntArrayRef values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(values[i]);
  }
  s += values.size() == 1 ? ",)" : ")";
  return s;
}

// Messages are built as one std::string and thrown only on failure, so the passing path formats nothing.
[[noreturn]] void type_error(const std::string& msg) { C10_THROW_ERROR(TypeError, "flash_attn2: " + msg); }
[[noreturn]] void value_error(const std::string& msg) { C10_THROW_ERROR(ValueError, "flash_attn2: " + msg); }

std::string device_str(const c10::Device& device) { return device.str(); }

// flash_attn2/_checks.py's check_tensors for eager calls, in the same order, with the same messages and
// error types (the Python version runs at trace time and for tensors not on a GPU, where Python's cost
// would be a quarter of a small call's host time). tests/test_api_validation.py runs every case through both.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_seqlens_q,
                  const OptTensor& cu_seqlens_k) {
  if (cu_seqlens_q.has_value() != cu_seqlens_k.has_value()) {
    type_error(std::string(cu_seqlens_q.has_value() ? "cu_seqlens_k" : "cu_seqlens_q") +
               " must be a torch.Tensor, got NoneType");
  }
  const bool varlen = cu_seqlens_q.has_value();
  const int64_t ndim = varlen ? 3 : 4;
  const std::string layout = varlen ? "(total_tokens, nheads, headdim)" : "(batch, seqlen, nheads, headdim)";
  const at::ScalarType q_dtype = q.scalar_type();
  const Tensor* qkv[3] = {&q, &k, &v};
  const char* qkv_names[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    const Tensor& t = *qkv[i];
    const std::string name = qkv_names[i];
    const at::ScalarType dtype = t.scalar_type();
    if (dtype != at::kHalf && dtype != at::kBFloat16) {
      type_error(name + " must be float16 or bfloat16, got " + dtype_str(dtype));
    }
    if (dtype != q_dtype) type_error(name + " must have q's dtype " + dtype_str(q_dtype) + ", got " + dtype_str(dtype));
    if (t.dim() != ndim) {
      value_error(name + " must be " + std::to_string(ndim) + "-D " + layout + ", got shape " + tuple_str(t.sizes()));
    }
    if (t.stride(-1) != 1) {
      value_error(name + " must have a contiguous last dimension (stride 1), got strides " + tuple_str(t.strides()));
    }
  }
  const int64_t head_dim = q.size(-1), heads = q.size(-2), heads_k = k.size(-2);
  if (head_dim <= 0 || head_dim > 256) {
    value_error("head dim (q.shape[-1]) must be in 1..256, got " + std::to_string(head_dim));
  }
  if (k.sizes().slice(0, k.dim() - 1) != v.sizes().slice(0, v.dim() - 1)) {
    value_error("k and v must have the same shape but for the head dim, got " + tuple_str(k.sizes()) + " and " +
                tuple_str(v.sizes()));
  }
  if (k.size(-1) != head_dim) {
    value_error("k's head dim must equal q's (" + std::to_string(head_dim) + "), got " + std::to_string(k.size(-1)));
  }
  if (v.size(-1) <= 0 || v.size(-1) > 256) {
    value_error("v's head dim (v.shape[-1]) must be in 1..256, got " + std::to_string(v.size(-1)));
  }
  if (heads_k == 0 || heads == 0 || heads % heads_k != 0) {
    value_error("q's nheads (" + std::to_string(heads) + ") must be a positive multiple of k/v's nheads (" +
                std::to_string(heads_k) + ")");
  }
  if (!varlen) {
    if (q.size(0) == 0) value_error("batch size must be positive, got an empty batch (q.shape[0] == 0)");
    if (k.size(0) != q.size(0)) {
      value_error("k's batch size (" + std::to_string(k.size(0)) + ") must equal q's (" + std::to_string(q.size(0)) +
                  ")");
    }
  }
  for (int i = 1; i < 3; ++i) {  // k, v
    if (qkv[i]->device() != q.device()) {
      value_error(std::string(qkv_names[i]) + " must be on q's device " + device_str(q.device()) + ", got " +
                  device_str(qkv[i]->device()));
    }
  }
  if (!varlen) {
    if (q.size(1) > flash_attn2::kMaxSeqlen || k.size(1) > flash_attn2::kMaxSeqlen) {
      value_error("seqlen_q and seqlen_k must be at most 2**31-2**16, got " + std::to_string(q.size(1)) + " and " +
                  std::to_string(k.size(1)));
    }
    return;
  }
  const Tensor* cus[2] = {&*cu_seqlens_q, &*cu_seqlens_k};
  const char* cu_names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
  for (int i = 0; i < 2; ++i) {
    const Tensor& cu = *cus[i];
    const std::string name = cu_names[i];
    if (cu.scalar_type() != at::kInt) type_error(name + " must be int32, got " + dtype_str(cu.scalar_type()));
    if (cu.dim() != 1 || cu.size(0) < 2) {
      value_error(name + " must be 1-D with batch + 1 >= 2 entries, got shape " + tuple_str(cu.sizes()));
    }
    if (cu.device() != q.device()) {
      value_error(name + " must be on q's device " + device_str(q.device()) + ", got " + device_str(cu.device()));
    }
    if (!cu.is_contiguous()) value_error(name + " must be contiguous, got strides " + tuple_str(cu.strides()));
  }
  if (cu_seqlens_q->size(0) != cu_seqlens_k->size(0)) {
    value_error("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got " +
                std::to_string(cu_seqlens_q->size(0)) + " and " + std::to_string(cu_seqlens_k->size(0)));
  }
  if (q.size(0) > flash_attn2::kMaxSeqlen) {
    value_error("q.shape[0] (total_q) must be at most 2**31-2**16 packed rows, got " + std::to_string(q.size(0)));
  }
  if (k.size(0) > flash_attn2::kMaxSeqlen) {
    value_error("k.shape[0] (total_k) must be at most 2**31-2**16 packed rows, got " + std::to_string(k.size(0)));
  }
}

// The kernels read 16-byte vectors: a contiguous last dim, other strides in multiples of 8 elements, a
// 16-byte aligned base; the Hopper ones by TMA, which takes no zero stride (an expanded tensor) either,
// on the rows (dim -3) even where there is one: its descriptors stand the row stride in for a head or
// batch dim of one.
bool aligned(const Tensor& t) {
  if (t.stride(-1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % 8 != 0) return false;  // run_fwd / run_bwd check every stride, a dim of one's too
    if (t.stride(i) == 0 && (t.size(i) > 1 || i == t.dim() - 3)) return false;
  }
  return true;
}

// The head dim padded with zeros to a multiple of 8 (as flash-attn does), and a copy of a tensor the
// kernels cannot read in place (e.g. an expanded dout).
Tensor kernel_ready(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "flash_attn2: expected a tensor with a head dim, got a scalar");
  Tensor r = t.size(-1) % 8 ? at::constant_pad_nd(t, {0, 8 - t.size(-1) % 8}) : t;
  return aligned(r) ? r : r.clone(at::MemoryFormat::Contiguous);
}

// A gradient's memory: its input's strides where the kernels can write them (a dense tensor whose head dim is
// innermost and a multiple of 8, so every stride of a dim above one is a multiple of 8 too, with the dims of one's
// strides multiples of 8 as well, and whose rows' stride, which TMA takes even for a single row, is nonzero:
// aligned()), else contiguous.
// Models hand over q and k as transposed (batch, heads, seqlen) views; contiguous gradients would make the
// elementwise ops behind them (RoPE's backward) strided. flash_attn2/_ops.py's fake says the same.
Tensor grad_like(const Tensor& t) {
  bool strides_ok = t.dim() >= 3 && t.stride(-3) != 0;  // (a dim of one may carry any stride in a dense tensor)
  for (int64_t i = 0; i + 1 < t.dim(); ++i) strides_ok = strides_ok && t.stride(i) % 8 == 0;
  if (t.size(-1) % 8 == 0 && t.stride(-1) == 1 && strides_ok && t.is_non_overlapping_and_dense()) {
    return at::empty_strided(t.sizes(), t.strides(), t.options());
  }
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes.back() = (sizes.back() + 7) / 8 * 8;  // the kernel-ready head dim; unpadded() cuts it back
  return at::empty(sizes, t.options());
}

// alibi_slopes: fp32 (nheads,) or (batch, nheads), its last dimension contiguous, on q's device; the same
// checks and messages as flash_attn2/_checks.py's check_alibi_slopes.
void check_alibi_slopes(const OptTensor& alibi_slopes, const Tensor& q, const OptTensor& cu_seqlens_q) {
  if (!alibi_slopes.has_value()) return;
  const Tensor& a = *alibi_slopes;
  if (a.scalar_type() != at::kFloat) type_error("alibi_slopes must be float32, got " + dtype_str(a.scalar_type()));
  const int64_t heads = q.size(-2), batch = cu_seqlens_q.has_value() ? cu_seqlens_q->size(0) - 1 : q.size(0);
  const bool per_head = a.dim() == 1 && a.size(0) == heads;
  const bool per_batch = a.dim() == 2 && a.size(0) == batch && a.size(1) == heads;
  if (!per_head && !per_batch) {
    value_error("alibi_slopes must be (nheads,) = (" + std::to_string(heads) + ",) or (batch, nheads) = (" +
                std::to_string(batch) + ", " + std::to_string(heads) + "), got shape " + tuple_str(a.sizes()));
  }
  if (a.stride(-1) != 1) {
    value_error("alibi_slopes must have a contiguous last dimension (stride 1), got strides " + tuple_str(a.strides()));
  }
  if (a.device() != q.device()) {
    value_error("alibi_slopes must be on q's device " + device_str(q.device()) + ", got " + device_str(a.device()));
  }
}

// The first head_dim columns of a kernel-ready result, contiguous as the fake implementations promise.
Tensor unpadded(const Tensor& t, int64_t head_dim) {
  return t.size(-1) == head_dim ? t : t.narrow(-1, 0, head_dim).contiguous();
}

void check_tensor(const Tensor& t, const char* name, int64_t dim, const Tensor& q, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == dim, "flash_attn2: ", name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), "flash_attn2: ", name, " must be on ", q.device());
  TORCH_CHECK(t.scalar_type() == dtype, "flash_attn2: ", name, " must be ", dtype, ", got ", t.scalar_type());
  if (dtype != at::kFloat) TORCH_CHECK(aligned(t), "flash_attn2: ", name, " must be 16-byte aligned (kernel_ready)");
}

// Fills p's FwdParams fields from the forward's kernel-ready tensors after checking what memory safety needs.
void set_fwd_params(flash_attn2::FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                    int64_t window_left, int64_t window_right,
                    double softcap, const OptTensor& alibi_slopes, bool kv_batch_free = false) {
  const bool varlen = cu_seqlens_q.has_value();
  TORCH_CHECK(varlen == cu_seqlens_k.has_value(), "flash_attn2: pass both cu_seqlens_q and cu_seqlens_k, or neither");
  const int64_t dim = varlen ? 3 : 4;
  p.dtype = dtype_of(q);
  check_tensor(q, "q", dim, q, q.scalar_type());
  check_tensor(k, "k", dim, q, q.scalar_type());
  check_tensor(v, "v", dim, q, q.scalar_type());
  check_tensor(out, "out", dim, q, q.scalar_type());
  TORCH_CHECK(out.sizes().slice(0, dim - 1) == q.sizes().slice(0, dim - 1) && out.size(-1) == v.size(-1),
              "flash_attn2: out must have q's shape with v's head dim");
  TORCH_CHECK(k.sizes().slice(0, dim - 1) == v.sizes().slice(0, dim - 1),
              "flash_attn2: k and v must have the same shape but for the head dim");
  TORCH_CHECK(k.size(-1) == q.size(-1), "flash_attn2: k's head dim must equal q's");

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
  p.num_heads = int(q.size(-2));
  p.num_heads_k = int(k.size(-2));
  p.head_dim = int(q.size(-1));
  p.head_dim_v = v.size(-1) == q.size(-1) ? 0 : int(v.size(-1));  // run_fwd serves it on a pair kernel or refuses
  p.softmax_scale = float(softmax_scale);
  p.causal = causal;
  // Any negative side is unbounded, as in flash-attn; a side wider than any sequence is too (Window clamps).
  auto side = [](int64_t w) { return w < 0 ? -1 : int(std::min<int64_t>(w, flash_attn2::kMaxSeqlen)); };
  p.window_left = side(window_left);
  p.window_right = side(window_right);
  p.softcap = float(softcap);
  if (alibi_slopes.has_value()) {
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_slopes_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  // Lengths past kMaxSeqlen are refused by run_fwd; clamping first keeps the int fields from wrapping.
  auto rows = [](int64_t n) { return int(std::min<int64_t>(n, flash_attn2::kMaxSeqlen + int64_t(1))); };
  if (varlen) {
    for (const Tensor* cu : {&*cu_seqlens_q, &*cu_seqlens_k}) {
      check_tensor(*cu, "cu_seqlens", 1, q, at::kInt);
      TORCH_CHECK(cu->is_contiguous(), "flash_attn2: cu_seqlens must be contiguous");
    }
    TORCH_CHECK(cu_seqlens_q->numel() >= 2 && cu_seqlens_k->numel() == cu_seqlens_q->numel(),
                "flash_attn2: cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries");
    TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "flash_attn2: max_seqlen_q and max_seqlen_k must be >= 0");
    p.batch = int(cu_seqlens_q->numel() - 1);
    p.seqlen_q = rows(max_seqlen_q);
    p.seqlen_k = rows(max_seqlen_k);
    p.total_q = q.size(0);
    p.total_k = k.size(0);
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
    p.cu_seqlens_k = cu_seqlens_k->data_ptr<int>();
    check_tensor(lse, "softmax_lse", 2, q, at::kFloat);
    TORCH_CHECK(lse.size(0) == q.size(1) && lse.size(1) == q.size(0) && lse.stride(1) == 1,
                "flash_attn2: softmax_lse must be (nheads, total_q) with unit row stride");
    p.lse_batch_stride = 0;
    p.lse_head_stride = lse.stride(0);
  } else {
    TORCH_CHECK(kv_batch_free || k.size(0) == q.size(0), "flash_attn2: q and k must have the same batch size");
    TORCH_CHECK(q.size(0) <= std::numeric_limits<int>::max(), "flash_attn2: batch must be < 2**31");
    p.batch = int(q.size(0));
    p.seqlen_q = rows(q.size(1));
    p.seqlen_k = rows(k.size(1));
    p.total_q = int64_t(p.batch) * p.seqlen_q;
    p.total_k = k.size(0) * p.seqlen_k;
    check_tensor(lse, "softmax_lse", 3, q, at::kFloat);
    TORCH_CHECK(lse.size(0) == q.size(0) && lse.size(1) == q.size(2) && lse.size(2) == q.size(1) && lse.stride(2) == 1,
                "flash_attn2: softmax_lse must be (batch, nheads, seqlen_q) with unit row stride");
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
  }
  p.lse = lse.data_ptr<float>();
}

// Attention sinks (learnable_sink): (nheads,) fp32 / fp16 / bf16 on q's device; flash_attn2/_sinks.py's check_sink,
// in its order, with its messages and error types.
void check_sink(const OptTensor& sink, const Tensor& q) {
  if (!sink.has_value()) return;
  const auto dtype = sink->scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
    type_error("learnable_sink must be float32, float16 or bfloat16, got " + dtype_str(dtype));
  }
  if (sink->dim() != 1 || sink->size(0) != q.size(-2)) {
    value_error("learnable_sink must be (nheads,) = (" + std::to_string(q.size(-2)) + ",), got shape " +
                tuple_str(sink->sizes()));
  }
  if (sink->device() != q.device()) {
    value_error("learnable_sink must be on q's device " + device_str(q.device()) + ", got " +
                device_str(sink->device()));
  }
}

// The sinks as fp32 for the kernels; the returned tensor keeps that copy alive until the launch is queued.
Tensor set_sink(flash_attn2::FwdParams& p, const OptTensor& sink, const Tensor& q) {
  if (!sink.has_value()) return {};
  check_sink(sink, q);
  Tensor sink32 = sink->to(at::kFloat).contiguous();
  p.sink = sink32.data_ptr<float>();
  return sink32;
}

// lse when no row sees a key: each row's head's sink (-inf without sinks), except varlen rows outside every sequence
// (before cu_seqlens_q[0], after the last sequence's end, as the kernels' UncoveredRows), which keep -inf. Device
// tensor ops: no sync on cu_seqlens.
void fill_empty_lse(Tensor& lse, const OptTensor& sink, const OptTensor& cu_seqlens_q) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  if (!sink.has_value()) {
    lse.fill_(minus_inf);
    return;
  }
  const Tensor per_head = sink->to(at::kFloat);
  if (!cu_seqlens_q.has_value()) {  // (batch, nheads, seqlen_q)
    lse.copy_(per_head.view({1, -1, 1}).expand_as(lse));
    return;
  }
  const int64_t total = lse.size(1), batch = cu_seqlens_q->numel() - 1;  // lse (nheads, total_q)
  const Tensor cu = cu_seqlens_q->to(at::kLong);
  const Tensor lead_end = cu[0].clamp(0, total);
  const Tensor tail_begin = at::minimum(at::maximum(cu[batch], cu[batch - 1].clamp(0, total)), cu.new_full({}, total));
  const Tensor rows = at::arange(total, cu.options());
  const Tensor covered = (rows >= lead_end).logical_and(rows < tail_begin);
  lse.copy_(at::where(covered.view({1, -1}), per_head.view({-1, 1}), at::full({}, minus_inf, lse.options())));
}

void check_launch(cudaError_t err, const Tensor& q, const char* direction) {
  // Not compiled: the head dim or dtype, or the path FLASH_ATTN2_BACKEND insists on; the library says which.
  if (err == cudaErrorNotSupported) {
    C10_THROW_ERROR(NotImplementedError, std::string("flash_attn2: ") + flash_attn2::last_error_message());
  }
  TORCH_CHECK(err != cudaErrorNoKernelImageForDevice && err != cudaErrorInvalidDeviceFunction,
              "flash_attn2 was built for ", FLASH_ATTN2_BUILT_ARCHS, ", which cannot run on ",
              q.device(), "; rebuild with FLASH_ATTN2_CUDA_ARCHS set to this GPU's compute capability");
  TORCH_CHECK(err != cudaErrorLaunchOutOfResources, "flash_attn2: the ", direction, " kernel for head dim ",
              q.size(-1), " needs more shared memory per block than ", q.device(), " offers",
              std::getenv("FLASH_ATTN2_SMEM_LIMIT") ? " under FLASH_ATTN2_SMEM_LIMIT" : "",
              FLASH_ATTN2_COMPACT_TILES ? " (the backward above head dim 160 needs an A100's 163 KB)"
                                        : " (this build has no compact tiles: FLASH_ATTN2_COMPACT_TILES=1 adds them)");
  TORCH_CHECK(err == cudaSuccess, "flash_attn2: ", direction, " failed: ", flash_attn2::last_error_message());
}

// Dropout's fields. new_seed false: drawn with the (seed, offset) that rng_state (2 contiguous int64 on q's
// device: the backward's, or a test's) holds, read by the kernels themselves. new_seed true: from torch's
// default CUDA generator of q's device (torch.manual_seed reproduces it), advanced by one call's worth;
// under CUDA graph capture its captured state's device pointers, which each replay advances. The forward
// kernel then records the pair it used into rng_state for the backward.
void set_dropout(flash_attn2::FwdParams& p, double dropout_p, const OptTensor& rng_state, bool new_seed,
                 const Tensor& q) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "flash_attn2: dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p == 0.0) return;
  TORCH_CHECK(rng_state && rng_state->device() == q.device() && rng_state->scalar_type() == at::kLong &&
                  rng_state->numel() == 2 && rng_state->is_contiguous(),
              "flash_attn2: dropout_p > 0 needs rng_state, 2 contiguous int64 (seed, offset) on q's device");
  p.dropout_p = float(dropout_p);
  auto* state = reinterpret_cast<uint64_t*>(rng_state->data_ptr<int64_t>());
  if (!new_seed) {
    p.philox_seed_ptr = state;
    p.philox_offset_ptr = state + 1;
    return;
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(q.device().index()));
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(4);  // the kernels count by offset / 4: one call, one step
  }
  if (philox.captured_) {
    p.philox_seed_ptr = reinterpret_cast<const uint64_t*>(philox.seed_.ptr);
    p.philox_offset_ptr = reinterpret_cast<const uint64_t*>(philox.offset_.ptr);
    p.philox_offset = philox.offset_intragraph_;
  } else {
    p.philox_seed = philox.seed_.val;
    p.philox_offset = philox.offset_.val;
  }
  p.rng_state = state;
}

// run_fwd, with the split-KV workspace where the forward splits the keys (its size depends on shapes alone, so
// a captured graph replays with the same plan).
void run_fwd_with_splits(flash_attn2::FwdParams& p, const Tensor& q) {
  const int splits = flash_attn2::fwd_num_splits(p);
  Tensor split_accum;
  if (splits > 1) {
    split_accum = at::empty({flash_attn2::fwd_split_accum_elems(p, splits)}, q.options().dtype(at::kFloat));
    p.split_accum = split_accum.data_ptr<float>();
  }
  check_launch(flash_attn2::run_fwd(p, c10::cuda::getCurrentCUDAStream().stream()), q, "forward");
}

// The tile order this thread's forwards take when FLASH_ATTN2_TILE_ORDER is unset or empty: "" (the default below),
// "static" or "dynamic". The ring's forward asks for "dynamic" around its blocks (flash_attn2/distributed/ring.py,
// through _ops.tile_order): they run beside NCCL's kernels, and a persistent grid whose blocks start late behind them
// finishes late with static slots (4 H200s, 128k: 67.3 -> 57.1 ms; TUNING 148). Thread-local: the dispatcher runs an
// op on its caller's thread, and another thread's calls keep theirs.
thread_local std::string tile_order_request;

std::string set_tile_order(const std::string& order) {
  TORCH_CHECK(order.empty() || order == "static" || order == "dynamic",
              "flash_attn2: tile order must be '', 'static' or 'dynamic', got '", order, "'");
  std::string previous = tile_order_request;
  tile_order_request = order;
  return previous;
}

// Forward into preallocated out and softmax_lse; q, k, v, out kernel-ready; dropout as set_dropout.
void fwd_out(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, const OptTensor& cu_seqlens_q,
             const OptTensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
             bool causal, int64_t window_left, int64_t window_right, double softcap,
             const OptTensor& alibi_slopes, double dropout_p, const OptTensor& rng_state, bool new_seed,
             const OptTensor& sink) {
  check_sink(sink, q);
  if (q.numel() == 0) return;
  if (k.numel() == 0) {  // no keys at all: every row sees nothing
    out.zero_();
    fill_empty_lse(lse, sink, cu_seqlens_q);
    return;
  }
  flash_attn2::FwdParams p{};
  set_fwd_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_left, window_right, softcap, alibi_slopes);
  const Tensor sink32 = set_sink(p, sink, q);
  const c10::cuda::CUDAGuard guard(q.device());
  set_dropout(p, dropout_p, rng_state, new_seed, q);
  // A causal Hopper forward hands tiles to its blocks as they free up through this counter (it lives until
  // the launch is queued; the allocator keeps it for this stream's work). FLASH_ATTN2_TILE_ORDER (read on every
  // call, like FLASH_ATTN2_BACKEND: a getenv is cheap next to a launch), else this thread's request
  // (set_tile_order): "static" keeps the fixed order, for tests and comparison; "dynamic" hands non-causal tiles
  // out as blocks free up too, for blocks that start late behind NCCL's kernels on their SMs (a ring's; TUNING 145,
  // 148). Not the default for non-causal calls alone: unmeasured on the single-GPU grid. SM80 and one-block-per-tile
  // launches leave the counter unused.
  Tensor tile_counter;
  const char* order_env = std::getenv("FLASH_ATTN2_TILE_ORDER");
  const std::string env_order = order_env != nullptr && std::string(order_env) != "auto" ? order_env : "";
  TORCH_CHECK(env_order.empty() || env_order == "static" || env_order == "dynamic",
              "flash_attn2: FLASH_ATTN2_TILE_ORDER must be static, dynamic, auto or unset, got '", env_order, "'");
  const std::string order = !env_order.empty() ? env_order : tile_order_request;
  if (!cu_seqlens_q && order != "static" && (causal || order == "dynamic")) {
    tile_counter = at::empty({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
  }
  run_fwd_with_splits(p, q);
}

// Gradients into preallocated dq (q's shape), dk (k's) and dv (v's; dout has out's): every tensor but lse
// kernel-ready. v, out and dout narrower than q and k (MLA) where run_bwd takes them (bwd_serves_head_dim_v).
void bwd_out(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
             Tensor& dq, Tensor& dk, Tensor& dv, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
             int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
             int64_t window_right, double softcap, const OptTensor& alibi_slopes, bool deterministic,
             double dropout_p, const OptTensor& rng_state, const OptTensor& sink, const OptTensor& dsink,
             const OptTensor& dlse) {
  TORCH_CHECK(!dsink.has_value() || (sink.has_value() && dsink->scalar_type() == at::kFloat && dsink->is_contiguous() &&
                                     dsink->numel() == q.size(-2) && dsink->device() == q.device()),
              "flash_attn2: dsink must be a contiguous fp32 (nheads,) tensor on q's device, with learnable_sink");
  TORCH_CHECK(!dlse.has_value() || (dlse->sizes() == lse.sizes() && dlse->device() == q.device()),
              "flash_attn2: dlse (the gradient of softmax_lse) must have softmax_lse's shape, on q's device");
  if (q.numel() == 0 || k.numel() == 0) {  // no queries or no keys: nothing flows through out (it is 0, so is D)
    dq.zero_(), dk.zero_(), dv.zero_();
    if (dsink.has_value()) {
      Tensor& ds = const_cast<Tensor&>(*dsink);
      if (dlse.has_value() && q.numel() > 0) {
        // lse is the sink on the rows the sequences cover (-inf elsewhere: fill_empty_lse), so dL/dsink_h sums
        // dlse over the rows whose lse is the sink: exp(sink_h - lse) is 1 there, 0 on the uncovered rows. lse is
        // (nheads, total_q) for varlen, else (batch, nheads, seqlen_q).
        const Tensor per_row = dlse->to(at::kFloat) * lse.ne(-std::numeric_limits<float>::infinity());
        ds.copy_(per_row.sum(cu_seqlens_q.has_value() ? at::IntArrayRef{1} : at::IntArrayRef{0, 2}));
      } else {
        ds.zero_();
      }
    }
    return;
  }
  flash_attn2::BwdParams p{};
  set_fwd_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_left, window_right, softcap, alibi_slopes);
  const Tensor sink32 = set_sink(p, sink, q);
  if (dsink.has_value()) p.dsink = dsink->data_ptr<float>();
  set_dropout(p, dropout_p, rng_state, /*new_seed=*/false, q);
  const bool varlen = cu_seqlens_q.has_value();
  const int64_t dim = varlen ? 3 : 4;
  check_tensor(dout, "dout", dim, q, q.scalar_type());
  check_tensor(dq, "dq", dim, q, q.scalar_type());
  check_tensor(dk, "dk", dim, q, q.scalar_type());
  check_tensor(dv, "dv", dim, q, q.scalar_type());
  TORCH_CHECK(dout.sizes() == out.sizes() && dq.sizes() == q.sizes(),
              "flash_attn2: dout must have out's shape and dq q's");
  TORCH_CHECK(dk.sizes() == k.sizes() && dv.sizes() == v.sizes(), "flash_attn2: dk and dv must have k's and v's shapes");
  TORCH_CHECK(lse.is_contiguous(), "flash_attn2: softmax_lse must be contiguous");
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor dlse32;  // fp32 in lse's (contiguous) layout, alive until run_bwd has queued the preprocess that reads it
  if (dlse.has_value()) {
    dlse32 = dlse->to(at::kFloat).contiguous();  // dlse itself where it already is
    p.dlse = dlse32.data_ptr<float>();
  }

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
  if (deterministic) {
    int num_sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.device().index()));
    p.num_splits = flash_attn2::bwd_deterministic_splits(p, num_sms);
  }
  Tensor softmax_d = at::empty({flash_attn2::bwd_softmax_d_elems(p)}, q.options().dtype(at::kFloat));
  Tensor dq_accum = at::empty({flash_attn2::bwd_dq_accum_elems(p)}, q.options().dtype(at::kFloat));
  p.softmax_d = softmax_d.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  check_launch(flash_attn2::run_bwd(p, c10::cuda::getCurrentCUDAStream().stream()), q, "backward");
}

// Whether the forward runs q / k and v of different head dims as they are (a Hopper pair kernel: flash_attn2.h's
// fwd_serves_head_dim_v, from the fields it reads), rather than with the narrower side zero-padded.
bool head_dims_served(const Tensor& q, const Tensor& k, int64_t head_dim_v, const OptTensor& cu_seqlens_q,
                      int64_t max_seqlen_q, const OptTensor& alibi_slopes, double dropout_p) {
  auto round8 = [](int64_t d) { return (d + 7) / 8 * 8; };
  if (round8(head_dim_v) >= round8(q.size(-1))) return false;
  flash_attn2::FwdParams p{};
  p.dtype = dtype_of(q);
  p.head_dim = int(round8(q.size(-1)));
  p.head_dim_v = int(round8(head_dim_v));
  p.num_heads = int(q.size(-2));
  p.num_heads_k = int(k.size(-2));
  p.seqlen_q = int(std::min<int64_t>(cu_seqlens_q.has_value() ? max_seqlen_q : q.size(1), flash_attn2::kMaxSeqlen));
  if (cu_seqlens_q.has_value()) p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
  if (alibi_slopes.has_value()) p.alibi_slopes = alibi_slopes->data_ptr<float>();
  p.dropout_p = float(dropout_p);
  const c10::cuda::CUDAGuard guard(q.device());
  return flash_attn2::fwd_serves_head_dim_v(p);
}

// ---------------------------------------------------------------------------------------------------
// The ops, in the inputs' head dim: out and lse contiguous, the gradients as grad_like says (and so does
// flash_attn2/_ops.py's fake versions).

std::tuple<Tensor, Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       const OptTensor& alibi_slopes, bool /*deterministic: the backward's*/,
                                       double dropout_p, const OptTensor& learnable_sink) {
  check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k);
  check_alibi_slopes(alibi_slopes, q, cu_seqlens_q);
  const int64_t head_dim = q.size(-1), head_dim_v = v.size(-1);
  if (head_dim_v != head_dim && !head_dims_served(q, k, head_dim_v, cu_seqlens_q, max_seqlen_q, alibi_slopes, dropout_p)) {
    // No pair kernel for this call: the narrower side zero-padded to the other's head dim, which changes no score
    // (softmax_scale is given) and no output column but the padded ones, cut off.
    if (head_dim_v < head_dim) {
      auto [out, lse, rng_state] = fwd(q, k, at::constant_pad_nd(v, {0, head_dim - head_dim_v}), cu_seqlens_q,
                                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                                       window_right, softcap, alibi_slopes, false, dropout_p, learnable_sink);
      return {out.narrow(-1, 0, head_dim_v).contiguous(), lse, rng_state};
    }
    const std::vector<int64_t> widen = {0, head_dim_v - head_dim};
    return fwd(at::constant_pad_nd(q, widen), at::constant_pad_nd(k, widen), v, cu_seqlens_q, cu_seqlens_k,
               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               false, dropout_p, learnable_sink);
  }
  const Tensor qr = kernel_ready(q), vr = kernel_ready(v);
  std::vector<int64_t> out_sizes = qr.sizes().vec();
  out_sizes.back() = vr.size(-1);
  Tensor out = at::empty(out_sizes, qr.options());
  Tensor lse = at::empty(cu_seqlens_q ? at::IntArrayRef{q.size(1), q.size(0)} : at::IntArrayRef{q.size(0), q.size(2), q.size(1)},
                         q.options().dtype(at::kFloat));
  // The (seed, offset) dropout used, for the backward; without dropout empty (no memory, no fill).
  Tensor rng_state = at::empty({dropout_p > 0.0 ? 2 : 0}, q.options().dtype(at::kLong));
  fwd_out(qr, kernel_ready(k), vr, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
          softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
          /*new_seed=*/true, learnable_sink);
  return {unpadded(out, head_dim_v), lse, rng_state};
}

// Whether the backward takes v, out and dout at their own head dim (narrower than q's: MLA) without padding them:
// the Hopper backward (dispatch.cpp: bwd_serves_head_dim_v, from the fields it reads), d_v a multiple of 8 (TMA's
// 16-byte rows: both head dims as kernel_ready rounds them up to 8), and dout's strides as kernel_ready leaves them
// readable by TMA (its own where aligned, else a contiguous copy's). On q's device, as run_bwd will ask.
bool bwd_takes_head_dim_v(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                          const OptTensor& cu_seqlens_q) {
  auto round8 = [](int64_t d) { return (d + 7) / 8 * 8; };
  const int64_t head_dim = round8(q.size(-1)), head_dim_v = round8(v.size(-1));
  const bool varlen = cu_seqlens_q.has_value();
  if (head_dim_v >= head_dim || dout.dim() != (varlen ? 3 : 4)) return false;
  // kernel_ready's dout: dout itself where aligned, else a contiguous copy (head dim head_dim_v).
  const bool as_is = dout.size(-1) % 8 == 0 && aligned(dout);
  const int64_t heads = dout.size(-2), rows = varlen ? dout.size(0) : dout.size(1);
  const int64_t head_stride = as_is ? dout.stride(-2) : head_dim_v;
  const int64_t row_stride = as_is ? dout.stride(varlen ? 0 : 1) : heads * head_dim_v;
  const int64_t batch_stride = varlen ? 0 : as_is ? dout.stride(0) : rows * heads * head_dim_v;
  static const int kAnyCuSeqlens = 0;  // only compared with nullptr (run_bwd reads the real one)
  const c10::cuda::CUDAGuard guard(q.device());
  flash_attn2::BwdParams p{};
  p.dtype = q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  p.batch = varlen ? int(cu_seqlens_q->numel() - 1) : int(q.size(0));
  p.num_heads = int(q.size(-2)), p.num_heads_k = int(k.size(-2));
  p.head_dim = int(head_dim), p.head_dim_v = int(head_dim_v);
  p.total_q = varlen ? q.size(0) : int64_t(q.size(0)) * q.size(1);
  p.total_k = varlen ? k.size(0) : int64_t(k.size(0)) * k.size(1);
  p.cu_seqlens_q = varlen ? &kAnyCuSeqlens : nullptr;
  p.do_row_stride = row_stride, p.do_head_stride = head_stride, p.do_batch_stride = batch_stride;
  return flash_attn2::bwd_serves_head_dim_v(p);
}

// dsink: (nheads,) in learnable_sink's dtype with one, else empty fp32.
std::tuple<Tensor, Tensor, Tensor, Tensor> bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out, const Tensor& lse, const OptTensor& cu_seqlens_q,
                                               const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                                               int64_t max_seqlen_k, double softmax_scale, bool causal,
                                               int64_t window_left, int64_t window_right, double softcap,
                                               const OptTensor& alibi_slopes, bool deterministic, double dropout_p,
                                               const OptTensor& rng_state, const OptTensor& learnable_sink,
                                               const OptTensor& dlse) {
  const int64_t head_dim = q.size(-1), head_dim_v = v.size(-1);
  if (head_dim_v != head_dim && !bwd_takes_head_dim_v(dout, q, k, v, cu_seqlens_q)) {
    // Elsewhere the backward takes one head dim: the narrower side zero-padded (the forward's pair kernel or padding
    // gave the same out), the padded columns' gradients cut off into gradients laid out as grad_like says.
    const int64_t wide = std::max(head_dim, head_dim_v);
    auto widen = [wide](const Tensor& t) { return t.size(-1) == wide ? t : at::constant_pad_nd(t, {0, wide - t.size(-1)}); };
    auto [dq, dk, dv, dsink] = bwd(widen(dout), widen(q), widen(k), widen(v), widen(out), lse, cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                                   window_right, softcap, alibi_slopes, deterministic, dropout_p, rng_state,
                                   learnable_sink, dlse);
    auto cut = [](const Tensor& grad, const Tensor& like) {
      const int64_t d = like.size(-1);
      if (grad.size(-1) == d) return grad;
      Tensor r = grad_like(like);  // like's strides, or contiguous with the head dim rounded up to 8
      r.narrow(-1, 0, d).copy_(grad.narrow(-1, 0, d));
      return unpadded(r, d);
    };
    return {cut(dq, q), cut(dk, k), cut(dv, v), dsink};
  }
  const Tensor qr = kernel_ready(q), kr = kernel_ready(k);
  Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  OptTensor dsink;
  if (learnable_sink.has_value()) dsink = at::empty({q.size(-2)}, q.options().dtype(at::kFloat));
  bwd_out(kernel_ready(dout), qr, kr, kernel_ready(v), kernel_ready(out), lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
          max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
          deterministic, dropout_p, rng_state, learnable_sink, dsink, dlse);
  return {unpadded(dq, head_dim), unpadded(dk, head_dim), unpadded(dv, head_dim_v),
          dsink.has_value() ? dsink->to(learnable_sink->scalar_type()) : at::empty({0}, q.options().dtype(at::kFloat))};
}

// ---------------------------------------------------------------------------------------------------
// flash_attn_with_kvcache: the update (new rows into the caches, rotary) and the split-KV forward. The Python
// wrapper (flash_attn2/_kvcache.py) checks the arguments with user-facing errors; the checks here guard memory.

void check_int_rows(const OptTensor& t, const char* name, int64_t batch, const Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == batch && t->is_contiguous() &&
                  t->device() == q.device(),
              "flash_attn2: ", name, " must be a contiguous (batch,) int32 tensor on q's device");
}

std::tuple<Tensor, Tensor> fwd_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const OptTensor& k,
                                       const OptTensor& v, const OptTensor& rotary_cos, const OptTensor& rotary_sin,
                                       const OptTensor& cache_seqlens, const OptTensor& cache_batch_idx,
                                       const OptTensor& cache_leftpad, const OptTensor& block_table,
                                       const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, double softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       bool rotary_interleaved, const OptTensor& alibi_slopes, int64_t num_splits,
                                       const OptTensor& learnable_sink) {
  check_sink(learnable_sink, q);
  // Varlen q (cu_seqlens_q: vLLM's and SGLang's calls) against a paged cache: q (total_q, nheads, headdim) runs as a
  // batch of one row of sequences (below), its per-sequence key counts from cache_seqlens (seqused_k) or cu_seqlens_k.
  const bool varlen = cu_seqlens_q.has_value();
  if (varlen) {
    TORCH_CHECK(block_table.has_value() && !k.has_value() && !rotary_cos.has_value() && !cache_leftpad.has_value(),
                "flash_attn2: varlen q (cu_seqlens_q) needs block_table, and takes no k / v, rotary or cache_leftpad");
    TORCH_CHECK(q.dim() == 3, "flash_attn2: with cu_seqlens_q, q must be (total_q, nheads, headdim)");
    TORCH_CHECK(cache_seqlens.has_value() || cu_seqlens_k.has_value(),
                "flash_attn2: varlen q needs cache_seqlens (seqused_k) or cu_seqlens_k");
    for (const OptTensor* cu : {&cu_seqlens_q, &cu_seqlens_k}) {
      if (!cu->has_value()) continue;
      TORCH_CHECK((*cu)->scalar_type() == at::kInt && (*cu)->dim() == 1 && (*cu)->is_contiguous() &&
                      (*cu)->device() == q.device() && (*cu)->size(0) == cu_seqlens_q->size(0) && (*cu)->size(0) >= 2,
                  "flash_attn2: cu_seqlens_q / cu_seqlens_k must be contiguous int32 (batch + 1,) on q's device");
    }
    TORCH_CHECK(max_seqlen_q >= 0, "flash_attn2: max_seqlen_q must be >= 0");
  }
  const Tensor q4 = varlen ? q.unsqueeze(0) : q;  // (1, total_q, nheads, headdim): the fixed-length layout
  TORCH_CHECK(q4.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, "flash_attn2: q, k_cache and v_cache must be 4-D");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "flash_attn2: k_cache and v_cache must have the same shape");
  const int64_t batch = varlen ? cu_seqlens_q->size(0) - 1 : q.size(0), head_dim = q4.size(3);
  TORCH_CHECK(k_cache.size(2) > 0 && k_cache.size(3) == head_dim && q4.size(2) % k_cache.size(2) == 0 && batch > 0,
              "flash_attn2: k_cache must be (batch_cache, seqlen_cache, nheads_k, headdim) with q's headdim");
  const bool paged = block_table.has_value();
  TORCH_CHECK(paged || cache_batch_idx.has_value() || k_cache.size(0) == batch,
              "flash_attn2: k_cache's batch must be q's without cache_batch_idx or block_table");
  if (paged) {
    TORCH_CHECK(!cache_batch_idx.has_value(), "flash_attn2: block_table and cache_batch_idx exclude each other");
    TORCH_CHECK(block_table->scalar_type() == at::kInt && block_table->dim() == 2 && block_table->size(0) == batch &&
                    block_table->size(1) > 0 && block_table->stride(1) == 1 && block_table->device() == q.device(),
                "flash_attn2: block_table must be a (batch, max_pages) int32 tensor on q's device, rows contiguous");
    TORCH_CHECK(k_cache.size(0) > 0 && k_cache.size(1) > 0, "flash_attn2: a paged cache needs pages of >= 1 row");
    TORCH_CHECK(block_table->size(1) * k_cache.size(1) <= flash_attn2::kMaxSeqlen,
                "flash_attn2: block_table's capacity (max_pages * page_size) must be at most 2**31-2**16 rows");
  }
  for (const Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device() && t->stride(-1) == 1,
                "flash_attn2: k_cache / v_cache must have q's dtype and device and a contiguous last dim");
  }
  check_int_rows(cache_seqlens, "cache_seqlens", batch, q);  // (with varlen: one per sequence)
  check_int_rows(cache_batch_idx, "cache_batch_idx", batch, q);
  check_int_rows(cache_leftpad, "cache_leftpad", batch, q);
  check_alibi_slopes(alibi_slopes, q, cu_seqlens_q);
  TORCH_CHECK(num_splits >= 0 && num_splits <= flash_attn2::kMaxKvSplits, "flash_attn2: num_splits must be in 0..128");
  const c10::cuda::CUDAGuard guard(q.device());
  const DType dtype = dtype_of(q);
  Tensor qr = kernel_ready(q4);
  // The kernels' caches: the caller's, or a padded / aligned copy whose appended rows are copied back at the end.
  Tensor kc = kernel_ready(k_cache), vc = kernel_ready(v_cache);
  const int64_t seqlen_new = k.has_value() ? k->size(1) : 0;
  if (k.has_value()) {
    TORCH_CHECK(v.has_value() && cache_seqlens.has_value(), "flash_attn2: k needs v and cache_seqlens");
    TORCH_CHECK(k->dim() == 4 && k->sizes() == v->sizes() && k->size(0) == batch && k->size(2) == k_cache.size(2) &&
                    k->size(3) == head_dim && k->scalar_type() == q.scalar_type() && v->scalar_type() == q.scalar_type() &&
                    k->device() == q.device() && v->device() == q.device(),
                "flash_attn2: k and v must be (batch, seqlen_new, nheads_k, headdim) in q's dtype and device");
    const Tensor kn = kernel_ready(*k), vn = kernel_ready(*v);
    flash_attn2::KvAppendParams a{};
    a.dtype = dtype;
    a.batch = int(batch), a.num_heads_k = int(kc.size(2)), a.head_dim = int(kc.size(3));
    a.k_new = kn.data_ptr(), a.v_new = vn.data_ptr(), a.seqlen_new = int(seqlen_new);
    a.kn_batch_stride = kn.stride(0), a.kn_row_stride = kn.stride(1), a.kn_head_stride = kn.stride(2);
    a.vn_batch_stride = vn.stride(0), a.vn_row_stride = vn.stride(1), a.vn_head_stride = vn.stride(2);
    a.k_cache = kc.data_ptr(), a.v_cache = vc.data_ptr();
    a.cache_batch = int(kc.size(0)), a.cache_seqlen = int(std::min<int64_t>(kc.size(1), flash_attn2::kMaxSeqlen));
    a.kc_batch_stride = kc.stride(0), a.kc_row_stride = kc.stride(1), a.kc_head_stride = kc.stride(2);
    a.vc_batch_stride = vc.stride(0), a.vc_row_stride = vc.stride(1), a.vc_head_stride = vc.stride(2);
    a.cache_seqlens = cache_seqlens->data_ptr<int>();
    a.cache_batch_idx = cache_batch_idx.has_value() ? cache_batch_idx->data_ptr<int>() : nullptr;
    if (paged) {
      a.page_table = block_table->data_ptr<int>(), a.page_table_batch_stride = block_table->stride(0);
      a.page_size = int(kc.size(1)), a.num_pages = int(std::min<int64_t>(kc.size(0), INT32_MAX));
      a.cache_seqlen = int(block_table->size(1) * kc.size(1));
    }
    Tensor q_rot;
    if (rotary_cos.has_value()) {
      TORCH_CHECK(rotary_sin.has_value() && rotary_cos->dim() == 2 && rotary_sin->sizes() == rotary_cos->sizes() &&
                      rotary_cos->scalar_type() == q.scalar_type() && rotary_sin->scalar_type() == q.scalar_type() &&
                      rotary_cos->device() == q.device() && rotary_sin->device() == q.device() &&
                      rotary_cos->stride(1) == 1 && rotary_sin->stride(1) == 1 && rotary_cos->size(0) >= 1 &&
                      2 * rotary_cos->size(1) <= head_dim,
                  "flash_attn2: rotary_cos / rotary_sin must be (seqlen_ro, rotary_dim / 2) in q's dtype and device");
      a.rotary_cos = rotary_cos->data_ptr(), a.rotary_sin = rotary_sin->data_ptr();
      a.cos_row_stride = rotary_cos->stride(0), a.sin_row_stride = rotary_sin->stride(0);
      a.seqlen_ro = int(std::min<int64_t>(rotary_cos->size(0), INT32_MAX));
      a.rotary_dim = int(2 * rotary_cos->size(1));
      a.interleaved = rotary_interleaved;
      q_rot = at::empty(qr.sizes(), qr.options());
      a.q = qr.data_ptr(), a.q_out = q_rot.data_ptr();
      a.seqlen_q = int(qr.size(1)), a.num_heads = int(qr.size(2));
      a.q_batch_stride = qr.stride(0), a.q_row_stride = qr.stride(1), a.q_head_stride = qr.stride(2);
      a.qo_batch_stride = q_rot.stride(0), a.qo_row_stride = q_rot.stride(1), a.qo_head_stride = q_rot.stride(2);
      a.q_positions_per_row = causal || window_left >= 0 || window_right >= 0;
    }
    check_launch(flash_attn2::run_kv_append(a, c10::cuda::getCurrentCUDAStream().stream()), q, "kv-cache update");
    if (q_rot.defined()) qr = q_rot;
  }
  Tensor out = at::empty(qr.sizes(), qr.options());
  // (batch, nheads, seqlen_q), or varlen's (nheads, total_q) seen as (1, nheads, total_q)
  Tensor lse = varlen ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat)).unsqueeze(0)
                      : at::empty({batch, q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.numel() > 0 && kc.size(1) == 0) {  // a cache with no rows: every query sees nothing
    out.zero_();
    // (batch, nheads, seqlen_q), or varlen's (nheads, total_q) with its cu_seqlens_q
    Tensor rows = varlen ? lse.squeeze(0) : lse;
    fill_empty_lse(rows, learnable_sink, varlen ? cu_seqlens_q : OptTensor());
  } else if (q.numel() > 0) {
    flash_attn2::FwdParams p{};
    set_fwd_params(p, qr, kc, vc, out, lse, std::nullopt, std::nullopt, 0, 0, softmax_scale, causal, window_left,
                   window_right, softcap, alibi_slopes, /*kv_batch_free=*/true);
    const Tensor sink32 = set_sink(p, learnable_sink, q);
    if (cache_seqlens.has_value()) p.seqused_k = cache_seqlens->data_ptr<int>();
    p.seqused_k_add = int(seqlen_new);
    if (cache_leftpad.has_value()) p.leftpad_k = cache_leftpad->data_ptr<int>();
    if (cache_batch_idx.has_value()) {
      p.kv_batch_idx = cache_batch_idx->data_ptr<int>();
      p.kv_batch = int(kc.size(0));
    }
    if (paged) {  // k / v are pages; the table's capacity is the sequences' length bound
      p.page_table = block_table->data_ptr<int>(), p.page_table_batch_stride = block_table->stride(0);
      p.page_size = int(kc.size(1)), p.num_pages = int(std::min<int64_t>(kc.size(0), INT32_MAX));
      p.seqlen_k = int(block_table->size(1) * kc.size(1));
      p.total_k = int64_t(p.num_pages) * p.page_size;
    }
    if (varlen) {  // the sequences of q's one row; lse stays (nheads, total_q)
      p.batch = int(batch), p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
      p.cu_seqlens_k = cu_seqlens_k.has_value() ? cu_seqlens_k->data_ptr<int>() : nullptr;
      p.seqlen_q = int(std::min<int64_t>(max_seqlen_q, flash_attn2::kMaxSeqlen + int64_t(1)));
      p.total_q = q.size(0);
      p.q_batch_stride = p.o_batch_stride = p.lse_batch_stride = 0;
      if (alibi_slopes.has_value()) p.alibi_slopes_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
    }
    p.kv_splits = int(num_splits);
    run_fwd_with_splits(p, q);
  }
  if (k.has_value()) {  // the caller's caches get the appended rows where the kernels wrote into a copy
    if (kc.data_ptr() != k_cache.data_ptr()) const_cast<Tensor&>(k_cache).copy_(kc.narrow(-1, 0, head_dim));
    if (vc.data_ptr() != v_cache.data_ptr()) const_cast<Tensor&>(v_cache).copy_(vc.narrow(-1, 0, head_dim));
  }
  out = unpadded(out, head_dim);
  return {varlen ? out.squeeze(0) : out, varlen ? lse.squeeze(0) : lse};
}

// ---------------------------------------------------------------------------------------------------
// PyTorch's SDPA flash ops (flash_attn2/integrations/torch_sdpa.py overrides them): the whole forward or backward of
// `_scaled_dot_product_flash_attention` in one call, on SDPA's (batch, heads, seqlen, head_dim) tensors seen as the
// kernels' (batch, seqlen, heads, head_dim) views. A dozen Python tensor calls per call made a small SDPA call
// host-bound (0.59-0.80x the direct call at seqlen 512 on an H200).

// Our forward into `out` (kernel views of the caller's tensors; fixed length or varlen), in place where every tensor
// is kernel-ready, else through the op and a copy: (lse, rng_state).
std::tuple<Tensor, Tensor> fwd_into(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                    const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                                    int64_t max_seqlen_k, double dropout_p, bool causal, double softmax_scale,
                                    int64_t window_left, int64_t window_right, const OptTensor& alibi_slopes) {
  if (q.size(-1) % 8 == 0 && v.size(-1) == q.size(-1) && aligned(q) && aligned(k) && aligned(v) && aligned(out)) {
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k);  // (the op below checks them itself)
    check_alibi_slopes(alibi_slopes, q, cu_seqlens_q);
    Tensor lse = at::empty(cu_seqlens_q ? at::IntArrayRef{q.size(1), q.size(0)}
                                        : at::IntArrayRef{q.size(0), q.size(2), q.size(1)},
                           q.options().dtype(at::kFloat));
    Tensor rng_state = at::empty({dropout_p > 0.0 ? 2 : 0}, q.options().dtype(at::kLong));
    fwd_out(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_left, window_right, 0.0, alibi_slopes, dropout_p, rng_state, /*new_seed=*/true, std::nullopt);
    return {lse, rng_state};
  }
  auto [o, lse, rng_state] = fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                 window_left, window_right, 0.0, alibi_slopes, false, dropout_p, std::nullopt);
  out.copy_(o);
  return {lse, rng_state};
}

// SDPA's (philox_seed (2,) uint64, philox_offset () uint64) and empty debug mask: our (seed, offset) pair and 0 with
// dropout, unset without (as PyTorch's own kernels leave them).
std::tuple<Tensor, Tensor, Tensor> philox_outputs(const Tensor& rng_state, const Tensor& q) {
  const auto u64 = q.options().dtype(at::kUInt64);
  const bool dropout = rng_state.numel() == 2;
  return {dropout ? rng_state.view(at::kUInt64) : at::empty({2}, u64), dropout ? at::zeros({}, u64) : at::empty({}, u64),
          at::empty({0}, q.options())};
}

// `_scaled_dot_product_flash_attention`: out in query's strides, as PyTorch's meta function says; lse (batch, heads,
// seqlen_q); the philox outputs and debug mask.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sdpa_fwd(const Tensor& query, const Tensor& key, const Tensor& value,
                                                            double dropout_p, bool causal, double softmax_scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "flash_attn2: SDPA's query, key and value are (batch, heads, seqlen, head_dim)");
  Tensor out_bhsd = at::empty_like(query);
  Tensor out = out_bhsd.transpose(1, 2);
  auto [lse, rng_state] = fwd_into(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), out,
                                   std::nullopt, std::nullopt, query.size(2), key.size(2), dropout_p, causal,
                                   softmax_scale, -1, -1, std::nullopt);
  auto [seed, offset, debug_mask] = philox_outputs(rng_state, query);
  return {out_bhsd, lse, seed, offset, debug_mask};
}

// `_flash_attention_forward` (varlen_attn, and dense calls in the kernels' own layout): out in query's strides.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> flash_fwd(const Tensor& query, const Tensor& key, const Tensor& value,
                                                             const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                                             int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
                                                             bool causal, double softmax_scale, int64_t window_left,
                                                             int64_t window_right, const OptTensor& alibi_slopes) {
  Tensor out = at::empty_like(query);
  auto [lse, rng_state] = fwd_into(query, key, value, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p, causal, softmax_scale, window_left, window_right, alibi_slopes);
  auto [seed, offset, debug_mask] = philox_outputs(rng_state, query);
  return {out, lse, seed, offset, debug_mask};
}

// dq, dk, dv in SDPA's layout (each in its input's strides where the kernels can write them: grad_like).
std::tuple<Tensor, Tensor, Tensor> sdpa_bwd(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                                            const Tensor& value, const Tensor& out, const Tensor& lse,
                                            double dropout_p, bool causal, double softmax_scale,
                                            const Tensor& philox_seed) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && grad_out.dim() == 4 && out.dim() == 4,
              "flash_attn2: SDPA's tensors are (batch, heads, seqlen, head_dim)");
  const Tensor q = query.transpose(1, 2), k = key.transpose(1, 2);
  const OptTensor rng_state = dropout_p > 0.0 && philox_seed.numel() == 2 ? OptTensor(philox_seed.view(at::kLong))
                                                                          : OptTensor();
  auto [dq, dk, dv, dsink] = bwd(grad_out.transpose(1, 2), q, k, value.transpose(1, 2), out.transpose(1, 2), lse,
                                 std::nullopt, std::nullopt, q.size(1), k.size(1), softmax_scale, causal, -1, -1, 0.0,
                                 std::nullopt, at::globalContext().deterministicAlgorithms(), dropout_p, rng_state,
                                 std::nullopt, std::nullopt);
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

// ---------------------------------------------------------------------------------------------------
// flash_attn2/distributed/_merge.py's merge_partial in one kernel (run_merge_partial) where the tensors suit it: out
// (batch, seqlen, heads, d) fp32 or in block_out's dtype (MergeParams::out_in_dtype) and lse (batch, heads, seqlen)
// fp32 on one CUDA device, block_out of out's shape in fp16 / bf16, block_lse fp32 of lse's; d a multiple of 4, unit
// last strides, the alignments the kernel takes. False (nothing done) otherwise: the caller merges with torch ops.
bool merge_partial_(Tensor& out, Tensor& lse, const Tensor& block_out, const Tensor& block_lse) {
  // A stride of 0 over more than one element would have warps write one row at once (the torch ops refuse it).
  auto no_overlap = [](const Tensor& t) {
    for (int64_t i = 0; i < t.dim(); ++i) {
      if (t.size(i) > 1 && t.stride(i) == 0) return false;
    }
    return true;
  };
  const bool out_in_dtype = out.scalar_type() == block_out.scalar_type();
  if (!out.is_cuda() || !no_overlap(out) || !no_overlap(lse) || (out.scalar_type() != at::kFloat && !out_in_dtype) ||
      lse.scalar_type() != at::kFloat ||
      block_lse.scalar_type() != at::kFloat ||
      (block_out.scalar_type() != at::kHalf && block_out.scalar_type() != at::kBFloat16) || out.dim() != 4 ||
      lse.dim() != 3 || block_out.sizes() != out.sizes() || block_lse.sizes() != lse.sizes() ||
      lse.size(0) != out.size(0) || lse.size(1) != out.size(2) || lse.size(2) != out.size(1) ||
      lse.device() != out.device() || block_out.device() != out.device() || block_lse.device() != out.device() ||
      out.stride(3) != 1 || block_out.stride(3) != 1 || out.size(3) % 4 != 0 ||
      out.size(0) > INT32_MAX || out.size(1) > INT32_MAX || out.size(2) > INT32_MAX || out.size(3) > INT32_MAX) {
    return false;
  }
  if (out.numel() == 0) return true;  // nothing to merge (an empty block's tensors may have no memory at all)
  flash_attn2::MergeParams p{};
  p.dtype = block_out.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
  p.batch = int(out.size(0)), p.seqlen = int(out.size(1)), p.heads = int(out.size(2)), p.head_dim = int(out.size(3));
  if (out_in_dtype) {
    p.out_in_dtype = out.data_ptr();
  } else {
    p.out = out.data_ptr<float>();
  }
  p.lse = lse.data_ptr<float>();
  p.block_out = block_out.data_ptr(), p.block_lse = block_lse.data_ptr<float>();
  p.out_batch_stride = out.stride(0), p.out_row_stride = out.stride(1), p.out_head_stride = out.stride(2);
  p.lse_batch_stride = lse.stride(0), p.lse_head_stride = lse.stride(1), p.lse_row_stride = lse.stride(2);
  p.block_batch_stride = block_out.stride(0), p.block_row_stride = block_out.stride(1);
  p.block_head_stride = block_out.stride(2);
  p.block_lse_batch_stride = block_lse.stride(0), p.block_lse_head_stride = block_lse.stride(1);
  p.block_lse_row_stride = block_lse.stride(2);
  if (!flash_attn2::merge_layout_supported(p)) return false;
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(flash_attn2::run_merge_partial(p, c10::cuda::getCurrentCUDAStream().stream()), out, "merge");
  return true;
}

// ---------------------------------------------------------------------------------------------------
// Autograd, registered on the ops: one C++ node, so an eager call costs no Python beyond the wrapper's checks.

using torch::autograd::variable_list;

const auto& fwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flash_attn2::fwd", "").typed<
      std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                         const OptTensor&, c10::SymInt, c10::SymInt, double, bool, int64_t, int64_t,
                                         double, const OptTensor&, bool, double, const OptTensor&)>();
  return op;
}

const auto& bwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flash_attn2::bwd", "").typed<
      std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                                 c10::SymInt, c10::SymInt, double, bool, int64_t, int64_t, double,
                                                 const OptTensor&, bool, double, const OptTensor&, const OptTensor&,
                                                 const OptTensor&)>();
  return op;
}

// The backward node of one forward call, built as PyTorch's generated autograd code builds its own: a
// torch::autograd::Function costs more host time per call (its context map of saved values, output wrapping).
struct FlashAttnBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable q, k, v, out, lse, sink;  // sink: learnable_sink, or undefined
  OptTensor cu_seqlens_q, cu_seqlens_k, alibi_slopes;  // never differentiated
  c10::SymInt max_seqlen_q, max_seqlen_k;
  double softmax_scale = 0;
  bool causal = false, deterministic = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0, dropout_p = 0;
  Tensor rng_state;  // the forward's dropout seed and offset (an output of it, never differentiated)

  std::string name() const override { return "FlashAttnBackward"; }

  variable_list apply(variable_list&& grads) override {
    variable_list result(num_outputs_for_inputs);  // one per next edge: q, k, v (and learnable_sink)
    // grads: out's and softmax_lse's (either undefined where it took no part in the loss)
    if (!grads[0].defined() && !grads[1].defined()) return result;
    const bool det = deterministic || at::globalContext().deterministicAlgorithms();
    const Tensor s = sink.unpack(), o = out.unpack(shared_from_this());
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(o);  // a loss through lse alone
    auto [dq, dk, dv, dsink] = bwd_op().call(dout, q.unpack(), k.unpack(), v.unpack(), o,
                                             lse.unpack(shared_from_this()), cu_seqlens_q,
                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                             window_left, window_right, softcap, alibi_slopes, det, dropout_p,
                                             rng_state, s.defined() ? OptTensor(s) : OptTensor(),
                                             grads[1].defined() ? OptTensor(grads[1]) : OptTensor());
    result[0] = std::move(dq), result[1] = std::move(dk), result[2] = std::move(dv);
    if (num_outputs_for_inputs == 4) result[3] = std::move(dsink);
    return result;
  }

  size_t num_outputs_for_inputs = 3;

  void release_variables() override {
    for (auto* saved : {&q, &k, &v, &out, &lse, &sink}) saved->reset_data();
  }
};

std::tuple<Tensor, Tensor, Tensor> fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                                c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                                                double softmax_scale, bool causal, int64_t window_left,
                                                int64_t window_right, double softcap, const OptTensor& alibi_slopes,
                                                bool deterministic, double dropout_p,
                                                const OptTensor& learnable_sink) {
  const bool sink_grad = learnable_sink.has_value() && learnable_sink->requires_grad();
  const bool needs_grad = torch::autograd::GradMode::is_enabled() &&
                          (q.requires_grad() || k.requires_grad() || v.requires_grad() || sink_grad);
  Tensor out, lse, rng_state;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(out, lse, rng_state) =
        fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_left, window_right, softcap, alibi_slopes, deterministic, dropout_p, learnable_sink);
  }
  if (!needs_grad) return {out, lse, rng_state};  // inference: no node to build
  auto node = std::shared_ptr<FlashAttnBackward>(new FlashAttnBackward(), torch::autograd::deleteNode);
  if (learnable_sink.has_value()) {
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v, *learnable_sink));
    node->num_outputs_for_inputs = 4;
    node->sink = torch::autograd::SavedVariable(*learnable_sink, false);
  } else {
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  }
  torch::autograd::set_history(out, node);  // the node's input 0
  torch::autograd::set_history(lse, node);  // input 1: a loss may use softmax_lse too (BwdParams::dlse)
  node->q = torch::autograd::SavedVariable(q, false);
  node->k = torch::autograd::SavedVariable(k, false);
  node->v = torch::autograd::SavedVariable(v, false);
  node->out = torch::autograd::SavedVariable(out, true);
  node->lse = torch::autograd::SavedVariable(lse, true);  // an output of the node, as out (no reference cycle)
  node->cu_seqlens_q = cu_seqlens_q;
  node->cu_seqlens_k = cu_seqlens_k;
  node->max_seqlen_q = std::move(max_seqlen_q);
  node->max_seqlen_k = std::move(max_seqlen_k);
  node->softmax_scale = softmax_scale;
  node->causal = causal;
  node->window_left = window_left;
  node->window_right = window_right;
  node->softcap = softcap;
  node->alibi_slopes = alibi_slopes;
  node->deterministic = deterministic;
  node->dropout_p = dropout_p;
  node->rng_state = rng_state;
  return {out, lse, rng_state};
}

// The backward op is not differentiable. Under create_graph=True its results carry a node that raises
// when differentiated, instead of silently acting as constants (what torch's @once_differentiable does).
std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_autograd(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    const OptTensor& alibi_slopes, bool deterministic, double dropout_p, const OptTensor& rng_state,
    const OptTensor& learnable_sink, const OptTensor& dlse) {
  Tensor dq, dk, dv, dsink;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(dq, dk, dv, dsink) =
        bwd_op().call(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                      std::move(max_seqlen_k), softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                      deterministic, dropout_p, rng_state, learnable_sink, dlse);
  }
  const bool differentiable = dout.requires_grad() || q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                              out.requires_grad() || (learnable_sink.has_value() && learnable_sink->requires_grad()) ||
                              (dlse.has_value() && dlse->requires_grad());
  if (!torch::autograd::GradMode::is_enabled() || !differentiable) return {dq, dk, dv, dsink};
  auto error = std::make_shared<torch::autograd::DelayedError>(
      "flash_attn2: double backward (differentiating through flash_attn2's gradients, e.g. with "
      "create_graph=True) is not supported", 4);
  variable_list wrapped = error->apply({dq.detach().requires_grad_(), dk.detach().requires_grad_(),
                                       dv.detach().requires_grad_(), dsink.detach().requires_grad_()});
  return {wrapped[0], wrapped[1], wrapped[2], wrapped[3]};
}

// The key splits a kv-cache forward of these shapes takes on the current device (get_scheduler_metadata): the plan
// is a function of the shapes alone (flash_attn2.h: fwd_num_splits); 1 where the Hopper forward serves them.
// page_size 0: a contiguous cache.
int64_t kvcache_num_splits(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads, int64_t heads_k,
                           int64_t head_dim, bool bf16, bool alibi, int64_t num_splits, int64_t page_size,
                           bool leftpad, bool varlen) {
  TORCH_CHECK(batch > 0 && seqlen_q >= 0 && seqlen_k >= 0 && heads > 0 && heads_k > 0 && heads % heads_k == 0 &&
                  head_dim > 0 && head_dim <= 256 && num_splits >= 0 && num_splits <= flash_attn2::kMaxKvSplits &&
                  page_size >= 0 && page_size <= flash_attn2::kMaxSeqlen,
              "flash_attn2: get_scheduler_metadata: inconsistent shapes");
  // Varlen q past the split kernel's 64-row tile: the kernel depends on the batch's mean rows a sequence
  // (dispatch.cpp: hopper_serves_kv_cache), which these shapes do not carry. 0: the call chooses (metadata_splits).
  constexpr int64_t kSplitTileRows = 64;  // dispatch.cpp's kFwdSplitBlockM
  if (varlen && seqlen_q > kSplitTileRows && num_splits == 0) return 0;
  static const int kAnyLength = 0;  // only its addresses: mark the call's kv-cache fields, never read here
  static const int kAnyPage = 0;
  static const float kAnySlope = 0.f;
  flash_attn2::FwdParams p{};
  p.batch = int(batch), p.seqlen_q = int(std::min<int64_t>(seqlen_q, flash_attn2::kMaxSeqlen));
  p.seqlen_k = int(std::min<int64_t>(seqlen_k, flash_attn2::kMaxSeqlen));
  p.num_heads = int(heads), p.num_heads_k = int(heads_k), p.head_dim = int((head_dim + 7) / 8 * 8);
  p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat16;
  p.seqused_k = &kAnyLength;
  // A contiguous (batch, seqlen, heads_k, head_dim) cache's strides (the plan asks only that TMA could take them).
  p.k_head_stride = p.v_head_stride = p.head_dim;
  p.k_row_stride = p.v_row_stride = int64_t(p.num_heads_k) * p.head_dim;
  p.k_batch_stride = p.v_batch_stride = std::max<int64_t>(1, p.seqlen_k) * p.k_row_stride;
  if (leftpad) p.leftpad_k = &kAnyLength;
  if (page_size > 0) {  // the plan depends on whether the pages suit the Hopper forward (dispatch.cpp)
    p.page_table = &kAnyPage, p.page_size = int(page_size), p.num_pages = 1;
  }
  if (alibi) p.alibi_slopes = &kAnySlope;
  p.kv_splits = int(num_splits);
  return flash_attn2::fwd_num_splits(p);
}

int64_t fwd_head_dim_bucket(int64_t head_dim, bool bf16) {
  return flash_attn2::fwd_head_dim_bucket(int(head_dim), bf16 ? DType::kBFloat16 : DType::kFloat16);
}

}  // namespace

TORCH_LIBRARY(flash_attn2, m) {
  // deterministic is the backward's (saved by the autograd formula); max_seqlen_q/k are hints for varlen
  // and ignored for fixed-length calls. fwd draws dropout's seed from torch's CUDA generator and returns it
  // in rng_state (2 int64: seed, offset; empty without dropout), which bwd takes back:
  // nondeterministic_seeded, so that a compiler neither merges two calls nor drops one. learnable_sink: attention
  // sinks (nheads,) in any float dtype, differentiable; bwd returns dsink in its dtype (empty without). softmax_lse
  // is differentiable too: bwd's dlse, its gradient, enters D (flash_attn2.h: BwdParams::dlse).
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "Tensor? alibi_slopes, bool deterministic, float dropout_p=0.0, Tensor? learnable_sink=None) "
        "-> (Tensor out, Tensor softmax_lse, Tensor rng_state)",
        {at::Tag::nondeterministic_seeded});
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, Tensor? alibi_slopes, bool deterministic, "
        "float dropout_p=0.0, Tensor? rng_state=None, Tensor? learnable_sink=None, Tensor? dlse=None) "
        "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dsink)");
  // flash_attn_with_kvcache (forward only): writes k / v into k_cache / v_cache at cache_seqlens, then attends.
  m.def("fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? rotary_cos, "
        "Tensor? rotary_sin, Tensor? cache_seqlens, Tensor? cache_batch_idx, Tensor? cache_leftpad, "
        "Tensor? block_table, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, float softmax_scale, bool causal, int window_left, int window_right, float softcap, bool rotary_interleaved, "
        "Tensor? alibi_slopes, int num_splits, Tensor? learnable_sink=None) -> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attn2, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
  m.impl("fwd_kvcache", &fwd_kvcache);
}

TORCH_LIBRARY_IMPL(flash_attn2, Autograd, m) {
  m.impl("fwd", &fwd_autograd);
  m.impl("bwd", &bwd_autograd);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn2 CUDA kernels; the ops are torch.ops.flash_attn2.fwd / .bwd";
  m.def("fwd_out", &fwd_out, "Forward into preallocated out and softmax_lse (kernel-ready tensors)");
  m.def("bwd_out", &bwd_out, "Backward into preallocated dq, dk and dv (kernel-ready tensors)");
  m.def("kvcache_num_splits", &kvcache_num_splits, "The key splits of a kv-cache forward of these shapes");
  m.def("sdpa_fwd", &sdpa_fwd, "SDPA's flash forward on (batch, heads, seqlen, head_dim) tensors, in one call");
  m.def("sdpa_bwd", &sdpa_bwd, "SDPA's flash backward on (batch, heads, seqlen, head_dim) tensors, in one call");
  m.def("flash_fwd", &flash_fwd, "aten::_flash_attention_forward's body (varlen_attn), in one call");
  m.def("merge_partial_", &merge_partial_,
        "out, lse <- the merge with one more partial result, in one kernel; False (nothing done) where it cannot");
  m.def("set_tile_order", &set_tile_order,
        "This thread's tile order where FLASH_ATTN2_TILE_ORDER is unset ('', 'static', 'dynamic'); returns the previous");
  m.def("fwd_head_dim_bucket", &fwd_head_dim_bucket,
        "The compiled head-dim bucket serving head_dim for the dtype, or 0");
  m.attr("built_archs") = std::string(FLASH_ATTN2_BUILT_ARCHS);
  m.attr("compact_tiles") = bool(FLASH_ATTN2_COMPACT_TILES);
  m.attr("sm80_built") = bool(FLASH_ATTN2_COMPILED_SM80);  // the SM80 path (FLASH_ATTN2_SM80=1 on sm_90 builds)
  // The Hopper forward's (d_qk, d_v) pair kernels, flattened (FLASH_ATTN2_HEAD_DIM_PAIRS; empty without the path).
  m.attr("head_dim_pairs") = std::vector<int>{FLASH_ATTN2_FWD_SM90_PAIRS};
}
