// flash_attn2 from C++ (flash_attn2/flash_attn2.h): forward and backward on the GPU, checked against a
// float64 CPU reference. Causal (bottom-right aligned) with seqlen_q < seqlen_k and seqlen_q > seqlen_k,
// GQA (4 query heads over 2 kv heads), head dim 64; the backward with atomic dq and deterministic (run
// twice, bitwise equal); params that must be refused (wrong header version, NaN softmax_scale); and decode
// against a KV cache (run_kv_append, then run_fwd with seqused_k and key splits).
// Exit status: 0 passed, 1 failed, 77 skipped (no CUDA device of compute capability 8.0 or newer).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <flash_attn2/flash_attn2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

namespace fa = flash_attn2;

#define CUDA_CHECK(call)                                                                                     \
  do {                                                                                                       \
    const cudaError_t err_ = (call);                                                                         \
    if (err_ != cudaSuccess) {                                                                               \
      std::printf("FAILED %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));           \
      std::exit(1);                                                                                          \
    }                                                                                                        \
  } while (0)

// run_fwd / run_bwd return a cudaError_t; last_error_message() says why.
#define FA_CHECK(call)                                                                                       \
  do {                                                                                                       \
    const cudaError_t err_ = (call);                                                                         \
    if (err_ != cudaSuccess) {                                                                               \
      std::printf("FAILED %s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorName(err_),          \
                  fa::last_error_message());                                                                 \
      std::exit(1);                                                                                          \
    }                                                                                                        \
  } while (0)

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Tolerances: max |result - reference| <= tol * max |reference| per tensor. The kernels round P and dS to
// the input dtype before their tensor-core products, and the results at the end: a few units of roundoff
// (bf16 2^-8, fp16 2^-11) relative to the largest value. lse is fp32 throughout: absolute error.
struct Tolerance {
  double out, grad;
};
constexpr Tolerance kBf16Tol{1e-2, 2e-2}, kFp16Tol{2e-3, 4e-3};
constexpr double kLseTol = 1e-3;

uint16_t to_bits(float x, fa::DType t) {
  if (t == fa::DType::kBFloat16) return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
  return __half_raw(__float2half_rn(x)).x;
}

float from_bits(uint16_t bits, fa::DType t) {
  if (t == fa::DType::kBFloat16) return __bfloat162float(__nv_bfloat16(__nv_bfloat16_raw{bits}));
  return __half2float(__half(__half_raw{bits}));
}

// A device buffer, freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes;
  explicit DeviceBuffer(size_t n) : bytes(std::max<size_t>(n, 1)) { CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  template <class T>
  T* as() const { return static_cast<T*>(ptr); }
  void poison() const { CUDA_CHECK(cudaMemset(ptr, 0xff, bytes)); }  // NaN in fp32, fp16 and bf16
  template <class T>
  std::vector<T> download(size_t n) const {
    std::vector<T> host(n);
    CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

struct Case {
  int batch, seqlen_q, seqlen_k, heads, heads_k, head_dim;
  bool causal;
};

// Random 16-bit values in [-1, 1) from a fixed-seed LCG: the same inputs on every platform.
std::vector<uint16_t> random_tensor(size_t n, uint64_t seed, fa::DType t) {
  std::vector<uint16_t> bits(n);
  for (auto& b : bits) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    b = to_bits(float(double(seed >> 40) / double(1 << 23) - 1.0), t);
  }
  return bits;
}

std::vector<double> to_double(const std::vector<uint16_t>& bits, fa::DType t) {
  std::vector<double> x(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) x[i] = from_bits(bits[i], t);
  return x;
}

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

// Softmax attention and its gradients in float64. Query row i of a sequence sees keys j <= i + seqlen_k -
// seqlen_q (causal, bottom-right); query head h reads kv head h / (heads / heads_k).
Reference reference(const Case& c, double scale, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout) {
  const int d = c.head_dim, group = c.heads / c.heads_k;
  Reference r{std::vector<double>(q.size()), std::vector<double>(size_t(c.batch) * c.heads * c.seqlen_q, -kInf),
              std::vector<double>(q.size()), std::vector<double>(k.size()), std::vector<double>(v.size())};
  std::vector<double> p(c.seqlen_k);
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads; ++h) {
      for (int i = 0; i < c.seqlen_q; ++i) {
        const int last = c.causal ? std::min(c.seqlen_k - 1, i + c.seqlen_k - c.seqlen_q) : c.seqlen_k - 1;
        if (last < 0) continue;  // sees no key: out 0, lse -inf, no gradient
        const size_t qi = ((size_t(b) * c.seqlen_q + i) * c.heads + h) * d;
        auto kv = [&](int j) { return ((size_t(b) * c.seqlen_k + j) * c.heads_k + h / group) * d; };
        double max_s = -kInf;
        for (int j = 0; j <= last; ++j) {
          double s = 0;
          for (int x = 0; x < d; ++x) s += q[qi + x] * k[kv(j) + x];
          p[j] = s * scale;
          max_s = std::max(max_s, p[j]);
        }
        double sum = 0;
        for (int j = 0; j <= last; ++j) sum += std::exp(p[j] - max_s);
        const double lse = max_s + std::log(sum);
        r.lse[(size_t(b) * c.heads + h) * c.seqlen_q + i] = lse;
        for (int j = 0; j <= last; ++j) {
          p[j] = std::exp(p[j] - lse);
          for (int x = 0; x < d; ++x) r.out[qi + x] += p[j] * v[kv(j) + x];
        }
        double delta = 0;  // rowsum(dP * P) = dout . out
        for (int x = 0; x < d; ++x) delta += dout[qi + x] * r.out[qi + x];
        for (int j = 0; j <= last; ++j) {
          double dp = 0;
          for (int x = 0; x < d; ++x) dp += dout[qi + x] * v[kv(j) + x];
          const double ds = p[j] * (dp - delta) * scale;
          for (int x = 0; x < d; ++x) {
            r.dq[qi + x] += ds * k[kv(j) + x];
            r.dk[kv(j) + x] += ds * q[qi + x];
            r.dv[kv(j) + x] += p[j] * dout[qi + x];
          }
        }
      }
    }
  }
  return r;
}

bool check(const char* what, const std::vector<double>& ref, const DeviceBuffer& got_dev, fa::DType t, double tol) {
  const std::vector<uint16_t> got = got_dev.download<uint16_t>(ref.size());
  double err = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(from_bits(got[i], t) - ref[i]);
    err = std::isnan(e) ? kInf : std::max(err, e);
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  const bool ok = err <= tol * max_ref;
  std::printf("    %-4s max|err| %.2e  max|ref| %.2e  ratio %.2e <= %.0e  %s\n", what, err, max_ref,
              max_ref > 0 ? err / max_ref : err, tol, ok ? "ok" : "FAIL");
  return ok;
}

bool check_lse(const std::vector<double>& ref, const DeviceBuffer& got_dev) {
  const std::vector<float> got = got_dev.download<float>(ref.size());
  double err = 0;
  int no_key_rows = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (ref[i] == -kInf) {
      ++no_key_rows;
      if (got[i] != -std::numeric_limits<float>::infinity()) err = kInf;
    } else {
      const double e = std::fabs(got[i] - ref[i]);
      err = std::isnan(e) ? kInf : std::max(err, e);
    }
  }
  const bool ok = err <= kLseTol;
  std::printf("    lse  max|err| %.2e <= %.0e, -inf on the %d rows that see no key  %s\n", err, kLseTol, no_key_rows,
              ok ? "ok" : "FAIL");
  return ok;
}

bool bitwise_equal(const DeviceBuffer& a, const std::vector<uint16_t>& b) {
  return a.download<uint16_t>(b.size()) == b;
}

// A refused call: cudaErrorInvalidValue and a last_error_message() that mentions `topic`.
bool check_refused(const char* what, cudaError_t err, const char* topic) {
  const char* message = fa::last_error_message();
  const bool ok = err == cudaErrorInvalidValue && std::strstr(message, topic) != nullptr;
  std::printf("    %s: %s, \"%s\"  %s\n", what, cudaGetErrorName(err), message, ok ? "ok" : "FAIL");
  return ok;
}

bool run_case(const Case& c, fa::DType t, const Tolerance& tol, int num_sms, cudaStream_t stream, bool refusals) {
  std::printf("  batch %d, seqlen_q %d, seqlen_k %d, heads %d, heads_k %d, head dim %d, %s\n", c.batch, c.seqlen_q,
              c.seqlen_k, c.heads, c.heads_k, c.head_dim, c.causal ? "causal" : "not causal");
  const size_t nq = size_t(c.batch) * c.seqlen_q * c.heads * c.head_dim;
  const size_t nk = size_t(c.batch) * c.seqlen_k * c.heads_k * c.head_dim;
  const size_t nlse = size_t(c.batch) * c.heads * c.seqlen_q;
  const std::vector<uint16_t> q = random_tensor(nq, 1, t), k = random_tensor(nk, 2, t), v = random_tensor(nk, 3, t),
                              dout = random_tensor(nq, 4, t);
  DeviceBuffer q_dev(nq * 2), k_dev(nk * 2), v_dev(nk * 2), out_dev(nq * 2), lse_dev(nlse * 4), dout_dev(nq * 2),
      dq_dev(nq * 2), dk_dev(nk * 2), dv_dev(nk * 2);
  auto upload = [](const DeviceBuffer& dev, const std::vector<uint16_t>& host) {
    CUDA_CHECK(cudaMemcpy(dev.ptr, host.data(), host.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  };
  upload(q_dev, q);
  upload(k_dev, k);
  upload(v_dev, v);
  upload(dout_dev, dout);

  // (batch, seqlen, heads, head_dim), contiguous: strides in elements.
  const int64_t q_row = int64_t(c.heads) * c.head_dim, k_row = int64_t(c.heads_k) * c.head_dim;
  fa::FwdParams p{};  // {} sets version and size from this header and zeroes the rest
  p.q = q_dev.ptr;
  p.k = k_dev.ptr;
  p.v = v_dev.ptr;
  p.out = out_dev.ptr;
  p.lse = lse_dev.as<float>();
  p.q_batch_stride = p.o_batch_stride = c.seqlen_q * q_row;
  p.q_row_stride = p.o_row_stride = q_row;
  p.q_head_stride = p.o_head_stride = c.head_dim;
  p.k_batch_stride = p.v_batch_stride = c.seqlen_k * k_row;
  p.k_row_stride = p.v_row_stride = k_row;
  p.k_head_stride = p.v_head_stride = c.head_dim;
  p.lse_batch_stride = int64_t(c.heads) * c.seqlen_q;  // lse is (batch, heads, seqlen_q)
  p.lse_head_stride = c.seqlen_q;
  p.batch = c.batch;
  p.num_heads = c.heads;
  p.num_heads_k = c.heads_k;
  p.head_dim = c.head_dim;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.total_q = int64_t(c.batch) * c.seqlen_q;
  p.total_k = int64_t(c.batch) * c.seqlen_k;
  p.cu_seqlens_q = p.cu_seqlens_k = nullptr;  // fixed length
  p.softmax_scale = 1.0f / std::sqrt(float(c.head_dim));
  p.causal = c.causal;
  p.dtype = t;

  out_dev.poison();
  lse_dev.poison();
  FA_CHECK(fa::run_fwd(p, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  const Reference ref = reference(c, p.softmax_scale, to_double(q, t), to_double(k, t), to_double(v, t),
                                  to_double(dout, t));
  std::printf("   forward\n");
  bool ok = check("out", ref.out, out_dev, t, tol.out);
  ok &= check_lse(ref.lse, lse_dev);

  fa::BwdParams g{};
  static_cast<fa::FwdParams&>(g) = p;  // the forward's params, with out and lse now inputs
  g.dout = dout_dev.ptr;
  g.dq = dq_dev.ptr;
  g.dk = dk_dev.ptr;
  g.dv = dv_dev.ptr;
  g.do_batch_stride = g.dq_batch_stride = p.q_batch_stride;
  g.do_row_stride = g.dq_row_stride = p.q_row_stride;
  g.do_head_stride = g.dq_head_stride = p.q_head_stride;
  g.dk_batch_stride = g.dv_batch_stride = p.k_batch_stride;
  g.dk_row_stride = g.dv_row_stride = p.k_row_stride;
  g.dk_head_stride = g.dv_head_stride = p.k_head_stride;

  std::vector<uint16_t> first[3];
  for (int run = 0; run < 3; ++run) {  // atomic dq; then deterministic twice
    g.num_splits = run == 0 ? 0 : fa::bwd_deterministic_splits(g, num_sms);
    // Workspace: fp32, sized by the library for these params (num_splits included).
    DeviceBuffer softmax_d(fa::bwd_softmax_d_elems(g) * sizeof(float)), dq_accum(fa::bwd_dq_accum_elems(g) * sizeof(float));
    g.softmax_d = softmax_d.as<float>();
    g.dq_accum = dq_accum.as<float>();
    dq_dev.poison();
    dk_dev.poison();
    dv_dev.poison();
    FA_CHECK(fa::run_bwd(g, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    if (run < 2) {
      std::printf("   backward, %s\n", run == 0 ? "atomic dq" : "deterministic");
      if (run == 1) std::printf("    num_splits %d\n", g.num_splits);
      ok &= check("dq", ref.dq, dq_dev, t, tol.grad);
      ok &= check("dk", ref.dk, dk_dev, t, tol.grad);
      ok &= check("dv", ref.dv, dv_dev, t, tol.grad);
      if (run == 1) {
        first[0] = dq_dev.download<uint16_t>(nq);
        first[1] = dk_dev.download<uint16_t>(nk);
        first[2] = dv_dev.download<uint16_t>(nk);
      }
    } else {
      const bool same = bitwise_equal(dq_dev, first[0]) && bitwise_equal(dk_dev, first[1]) && bitwise_equal(dv_dev, first[2]);
      std::printf("    second deterministic run bitwise equal  %s\n", same ? "ok" : "FAIL");
      ok &= same;
    }
  }

  if (!refusals) return ok;
  // Attention sinks (FwdParams::sink, BwdParams::dsink): out and lse against the reference with the sink folded in
  // (lse' = logaddexp(lse, sink), out' = out exp(lse - lse')), dsink against -sum exp(sink - lse') rowsum(dout o out').
  {
    std::vector<float> sink(c.heads);
    for (int h = 0; h < c.heads; ++h) sink[h] = 0.75f * float(h) - 1.f;
    DeviceBuffer sink_dev(c.heads * sizeof(float)), dsink_dev(c.heads * sizeof(float));
    CUDA_CHECK(cudaMemcpy(sink_dev.ptr, sink.data(), c.heads * sizeof(float), cudaMemcpyHostToDevice));
    const std::vector<double> dout_d = to_double(dout, t);
    std::vector<double> out_s(ref.out.size()), lse_s(ref.lse.size()), dsink_ref(c.heads, 0.0);
    for (int b = 0; b < c.batch; ++b) {
      for (int h = 0; h < c.heads; ++h) {
        for (int i = 0; i < c.seqlen_q; ++i) {
          const size_t row = (size_t(b) * c.heads + h) * c.seqlen_q + i;
          const double l = ref.lse[row], s = sink[h], hi = std::max(l, s);
          const double merged = hi + std::log(std::exp(l - hi) + std::exp(s - hi));
          lse_s[row] = merged;
          double d = 0;
          for (int x = 0; x < c.head_dim; ++x) {
            const size_t at = ((size_t(b) * c.seqlen_q + i) * c.heads + h) * c.head_dim + x;
            out_s[at] = ref.out[at] * std::exp(l - merged);
            d += dout_d[at] * out_s[at];
          }
          dsink_ref[h] -= std::exp(s - merged) * d;
        }
      }
    }
    fa::FwdParams ps = p;
    ps.sink = sink_dev.as<float>();
    out_dev.poison();
    lse_dev.poison();
    FA_CHECK(fa::run_fwd(ps, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::printf("   attention sinks\n");
    ok &= check("out", out_s, out_dev, t, tol.out);
    ok &= check_lse(lse_s, lse_dev);
    fa::BwdParams gs = g;
    gs.sink = ps.sink;
    gs.dsink = dsink_dev.as<float>();
    gs.num_splits = 0;
    DeviceBuffer softmax_d(fa::bwd_softmax_d_elems(gs) * sizeof(float)), dq_accum(fa::bwd_dq_accum_elems(gs) * sizeof(float));
    gs.softmax_d = softmax_d.as<float>();
    gs.dq_accum = dq_accum.as<float>();
    dsink_dev.poison();
    FA_CHECK(fa::run_bwd(gs, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> dsink = dsink_dev.download<float>(c.heads);
    double err = 0, max_ref = 0;
    for (int h = 0; h < c.heads; ++h) {
      const double e = std::fabs(dsink[h] - dsink_ref[h]);
      err = std::isnan(e) ? kInf : std::max(err, e);
      max_ref = std::max(max_ref, std::fabs(dsink_ref[h]));
    }
    const bool dsink_ok = err <= tol.grad * std::max(max_ref, 1.0);
    std::printf("    dsink max|err| %.2e  max|ref| %.2e  %s\n", err, max_ref, dsink_ok ? "ok" : "FAIL");
    ok &= dsink_ok;
  }
  // No query rows, or no key rows: nothing flows, and no main kernel can run (TMA wants nonzero extents); the
  // other side's gradients are zero.
  for (const bool no_queries : {true, false}) {
    fa::BwdParams empty = g;
    (no_queries ? empty.seqlen_q : empty.seqlen_k) = 0;
    (no_queries ? empty.total_q : empty.total_k) = 0;
    empty.num_splits = 0;
    DeviceBuffer softmax_d(fa::bwd_softmax_d_elems(empty) * sizeof(float)), dq_accum(fa::bwd_dq_accum_elems(empty) * sizeof(float));
    empty.softmax_d = softmax_d.as<float>();
    empty.dq_accum = dq_accum.as<float>();
    for (const DeviceBuffer* grad : {&dq_dev, &dk_dev, &dv_dev}) grad->poison();
    FA_CHECK(fa::run_bwd(empty, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    bool zero = true;
    for (const DeviceBuffer* grad : no_queries ? std::initializer_list<const DeviceBuffer*>{&dk_dev, &dv_dev}
                                               : std::initializer_list<const DeviceBuffer*>{&dq_dev}) {
      for (uint16_t bits : grad->download<uint16_t>(no_queries ? nk : nq)) zero &= bits == 0;
    }
    std::printf("   no %s rows: %s zero  %s\n", no_queries ? "query" : "key", no_queries ? "dk and dv" : "dq",
                zero ? "ok" : "FAIL");
    ok &= zero;
  }
  std::printf("   refused params\n");
  fa::FwdParams bad = p;
  bad.version = FLASH_ATTN2_PARAMS_VERSION + 1;  // as if compiled against another flash_attn2.h
  ok &= check_refused("run_fwd, version + 1", fa::run_fwd(bad, stream), "version");
  fa::BwdParams bad_bwd = g;
  bad_bwd.version = FLASH_ATTN2_PARAMS_VERSION + 1;
  ok &= check_refused("run_bwd, version + 1", fa::run_bwd(bad_bwd, stream), "version");
  {  // dout with a zero row stride (expanded; the torch op copies it): the Hopper backward's TMA cannot read it.
     // A library with the SM80 path runs that one; one without refuses, naming dout.
    fa::BwdParams expanded = g;
    expanded.do_row_stride = 0;
    DeviceBuffer softmax_d(fa::bwd_softmax_d_elems(expanded) * sizeof(float));
    DeviceBuffer dq_accum(fa::bwd_dq_accum_elems(expanded) * sizeof(float));
    expanded.softmax_d = softmax_d.as<float>();
    expanded.dq_accum = dq_accum.as<float>();
    const cudaError_t err = fa::run_bwd(expanded, stream);
    if (err == cudaSuccess) {
      CUDA_CHECK(cudaStreamSynchronize(stream));
      std::printf("    run_bwd, dout row stride 0: ran on the SM80 path  ok\n");
    } else {
      ok &= check_refused("run_bwd, dout row stride 0", err, "dout");
    }
  }
  bad = p;
  bad.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  ok &= check_refused("run_fwd, softmax_scale NaN", fa::run_fwd(bad, stream), "softmax_scale");
  bad = p;
  bad.window_left = -2;  // -1 is unbounded; below that is no window
  ok &= check_refused("run_fwd, window_left -2", fa::run_fwd(bad, stream), "window_left");
  {  // d_v != d_qk (FwdParams::head_dim_v, MLA): v's first head_dim / 2 columns as the values, at v's strides. Where
     // a pair kernel serves it (fwd_serves_head_dim_v), out's first d_v columns are the plain call's (each column of
     // out is P times that column of v) and lse is unchanged; elsewhere run_fwd refuses it, naming the knob.
    fa::FwdParams mla = p;
    mla.head_dim_v = c.head_dim / 2;
    if (fa::fwd_serves_head_dim_v(mla)) {
      out_dev.poison();
      lse_dev.poison();
      FA_CHECK(fa::run_fwd(mla, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<double> got = to_double(out_dev.download<uint16_t>(ref.out.size()), t);
      double err = 0, max_ref = 0;
      for (size_t i = 0; i < ref.out.size(); ++i) {
        if (int(i % c.head_dim) >= mla.head_dim_v) continue;  // out's columns past d_v: not written
        const double e = std::fabs(got[i] - ref.out[i]);
        err = std::isnan(e) ? kInf : std::max(err, e);
        max_ref = std::max(max_ref, std::fabs(ref.out[i]));
      }
      const bool good = err <= tol.out * max_ref;
      std::printf("    run_fwd, head_dim_v %d: out's first columns max|err| %.2e  %s\n", mla.head_dim_v, err,
                  good ? "ok" : "FAIL");
      ok &= good && check_lse(ref.lse, lse_dev);
    } else {  // not a bad argument but a missing kernel: cudaErrorNotSupported
      const cudaError_t err = fa::run_fwd(mla, stream);
      const bool refused = err == cudaErrorNotSupported &&
                           std::strstr(fa::last_error_message(), "FLASH_ATTN2_HEAD_DIM_PAIRS") != nullptr;
      std::printf("    run_fwd, head_dim_v %d (no pair kernel): %s  %s\n", mla.head_dim_v, cudaGetErrorName(err),
                  refused ? "ok" : "FAIL");
      ok &= refused;
    }
  }
  FA_CHECK(fa::run_fwd(p, stream));  // a success clears the message
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const bool cleared = fa::last_error_message()[0] == '\0';
  std::printf("    last_error_message() empty after a success  %s\n", cleared ? "ok" : "FAIL");
  return ok && cleared;
}

// Decode against a KV cache: run_kv_append writes one new key / value row per sequence at its length (a device
// array), then run_fwd attends q (one row) to the rows in use, with seqused_k and 4 key splits (split_accum sized by
// fwd_split_accum_elems). Checked against the float64 reference of each sequence's used rows.
bool run_kvcache_case(fa::DType t, const Tolerance& tol, cudaStream_t stream) {
  const int batch = 2, capacity = 300, heads = 4, heads_k = 2, d = 64;
  const int lens[batch] = {37, 250};  // rows in use before the call; each gets one more
  std::printf("  kv cache: batch %d, capacity %d, lengths %d / %d + 1 appended, heads %d, heads_k %d, head dim %d, "
              "4 splits\n", batch, capacity, lens[0], lens[1], heads, heads_k, d);
  const size_t nq = size_t(batch) * heads * d, nnew = size_t(batch) * heads_k * d;
  const size_t ncache = size_t(batch) * capacity * heads_k * d;
  std::vector<uint16_t> q = random_tensor(nq, 11, t), kn = random_tensor(nnew, 12, t), vn = random_tensor(nnew, 13, t);
  std::vector<uint16_t> kc = random_tensor(ncache, 14, t), vc = random_tensor(ncache, 15, t);
  DeviceBuffer dq_(nq * 2), dkn(nnew * 2), dvn(nnew * 2), dkc(ncache * 2), dvc(ncache * 2), dout(nq * 2);
  DeviceBuffer dlse(size_t(batch) * heads * 4), dlens(batch * 4);
  CUDA_CHECK(cudaMemcpy(dq_.ptr, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dkn.ptr, kn.data(), nnew * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dvn.ptr, vn.data(), nnew * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dkc.ptr, kc.data(), ncache * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dvc.ptr, vc.data(), ncache * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dlens.ptr, lens, batch * 4, cudaMemcpyHostToDevice));
  dout.poison();

  fa::KvAppendParams a{};
  a.dtype = t, a.batch = batch, a.num_heads_k = heads_k, a.head_dim = d;
  a.k_new = dkn.ptr, a.v_new = dvn.ptr, a.seqlen_new = 1;
  a.kn_batch_stride = a.vn_batch_stride = int64_t(heads_k) * d, a.kn_row_stride = a.vn_row_stride = int64_t(heads_k) * d;
  a.kn_head_stride = a.vn_head_stride = d;
  a.k_cache = dkc.ptr, a.v_cache = dvc.ptr, a.cache_batch = batch, a.cache_seqlen = capacity;
  a.kc_batch_stride = a.vc_batch_stride = int64_t(capacity) * heads_k * d;
  a.kc_row_stride = a.vc_row_stride = int64_t(heads_k) * d, a.kc_head_stride = a.vc_head_stride = d;
  a.cache_seqlens = dlens.as<int>();
  FA_CHECK(fa::run_kv_append(a, stream));

  fa::FwdParams p{};
  p.q = dq_.ptr, p.k = dkc.ptr, p.v = dvc.ptr, p.out = dout.ptr, p.lse = dlse.as<float>();
  p.q_batch_stride = p.o_batch_stride = int64_t(heads) * d, p.q_row_stride = p.o_row_stride = int64_t(heads) * d;
  p.q_head_stride = p.o_head_stride = d;
  p.k_batch_stride = p.v_batch_stride = a.kc_batch_stride, p.k_row_stride = p.v_row_stride = a.kc_row_stride;
  p.k_head_stride = p.v_head_stride = d;
  p.lse_batch_stride = heads, p.lse_head_stride = 1;
  p.batch = batch, p.num_heads = heads, p.num_heads_k = heads_k, p.head_dim = d;
  p.seqlen_q = 1, p.seqlen_k = capacity, p.total_q = batch, p.total_k = int64_t(batch) * capacity;
  p.softmax_scale = float(1.0 / std::sqrt(double(d)));
  p.causal = true, p.dtype = t;
  p.seqused_k = dlens.as<int>(), p.seqused_k_add = 1;
  p.kv_splits = 4;
  DeviceBuffer accum(size_t(fa::fwd_split_accum_elems(p, 4)) * 4);
  p.split_accum = accum.as<float>();
  FA_CHECK(fa::run_fwd(p, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  // The reference: the cache with the new rows written, each sequence's first lens[b] + 1 rows.
  for (int b = 0; b < batch; ++b) {
    for (int x = 0; x < heads_k * d; ++x) {
      kc[(size_t(b) * capacity + lens[b]) * heads_k * d + x] = kn[size_t(b) * heads_k * d + x];
      vc[(size_t(b) * capacity + lens[b]) * heads_k * d + x] = vn[size_t(b) * heads_k * d + x];
    }
  }
  bool ok = bitwise_equal(dkc, kc) && bitwise_equal(dvc, vc);
  std::printf("    caches: the appended rows written, nothing else  %s\n", ok ? "ok" : "FAIL");
  std::vector<double> ref_out, ref_lse;
  for (int b = 0; b < batch; ++b) {
    const Case c{1, 1, lens[b] + 1, heads, heads_k, d, true};
    const auto rows = [&](const std::vector<uint16_t>& x, size_t first, size_t n) {
      return to_double(std::vector<uint16_t>(x.begin() + first, x.begin() + first + n), t);
    };
    const size_t kv_first = size_t(b) * capacity * heads_k * d, kv_n = size_t(lens[b] + 1) * heads_k * d;
    const Reference r = reference(c, p.softmax_scale, rows(q, size_t(b) * heads * d, size_t(heads) * d),
                                  rows(kc, kv_first, kv_n), rows(vc, kv_first, kv_n),
                                  std::vector<double>(size_t(heads) * d, 0.0));
    ref_out.insert(ref_out.end(), r.out.begin(), r.out.end());
    ref_lse.insert(ref_lse.end(), r.lse.begin(), r.lse.end());
  }
  ok &= check("out", ref_out, dout, t, tol.out);
  ok &= check_lse(ref_lse, dlse);
  return ok;
}

}  // namespace

int main() {
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe == cudaErrorNoDevice || probe == cudaErrorInsufficientDriver || (probe == cudaSuccess && devices == 0)) {
    std::printf("SKIPPED: no CUDA device (%s)\n", probe == cudaSuccess ? "none found" : cudaGetErrorString(probe));
    return 77;
  }
  CUDA_CHECK(probe);
  CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 8) {
    std::printf("SKIPPED: %s is sm_%d%d; flash_attn2 needs sm_80 or newer\n", prop.name, prop.major, prop.minor);
    return 77;
  }

  const int head_dim = 64;
  const fa::DType t = fa::fwd_head_dim_bucket(head_dim, fa::DType::kBFloat16) ? fa::DType::kBFloat16 : fa::DType::kFloat16;
  if (fa::fwd_head_dim_bucket(head_dim, t) == 0) {
    std::printf("FAILED: this flash_attn2 has no kernel for head dim %d (FLASH_ATTN2_HEAD_DIMS)\n", head_dim);
    return 1;
  }
  std::printf("flash_attn2 C++ example: %s (sm_%d%d, %d SMs), %s, params version %d\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, t == fa::DType::kBFloat16 ? "bf16" : "fp16",
              FLASH_ATTN2_PARAMS_VERSION);

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  const Tolerance tol = t == fa::DType::kBFloat16 ? kBf16Tol : kFp16Tol;
  // seqlen_q < seqlen_k, then seqlen_q > seqlen_k (its first 54 query rows see no key).
  bool ok = run_case(Case{2, 77, 131, 4, 2, head_dim, true}, t, tol, prop.multiProcessorCount, stream, true);
  ok &= run_case(Case{2, 131, 77, 4, 2, head_dim, true}, t, tol, prop.multiProcessorCount, stream, false);
  ok &= run_kvcache_case(t, tol, stream);
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf(ok ? "PASSED\n" : "FAILED\n");
  return ok ? 0 : 1;
}
