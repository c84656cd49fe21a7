// Small CuTe building blocks shared by the kernels: fragment views, warp reductions, tile copies and
// the two GEMM shapes of attention (both operands from shared memory, or A from registers).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// The CUTLASS element type of a public DType.
template <DType kDType>
using ElementOf = std::conditional_t<kDType == DType::kFloat16, cutlass::half_t, cutlass::bfloat16_t>;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// x, hidden from the optimizer: what derives from it is computed where it is used, not hoisted out of a
// persistent kernel's tile loop and held in registers across it (the Hopper backward's consumers spilled
// 172 B at d 128 without it).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Fire-and-forget fp32 adds of v[0..3] to ptr[0..3] (16-byte aligned) in global memory: one vector
// reduction on sm_90, four scalar ones before. Spelled out because atomicAdd on a pointer the compiler
// cannot prove global becomes a generic atomic with a compare-and-swap fallback.
__device__ __forceinline__ void red_add_global_x4(float* ptr, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr + 1), "f"(b) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr + 2), "f"(c) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr + 3), "f"(d) : "memory");
#endif
}

// The same for two values (8-byte aligned).
__device__ __forceinline__ void red_add_global_x2(float* ptr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr + 1), "f"(b) : "memory");
#endif
}

// An m16n8 accumulator row is spread over the 4 threads of a quad.
template <class Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  return op(x, __shfl_xor_sync(0xffffffff, x, 1));
}

// Accumulator layout -> ((2, MMA_M), (2, MMA_N)) or, for a Hopper warpgroup accumulator
// ((2, 2, N / 8), MMA_M, MMA_N), ((2, MMA_M), (2, N / 8, MMA_N)): rows, then columns. Either way a thread
// holds 2 rows per M tile, each spread over the 4 threads of a quad.
template <class Layout>
__device__ constexpr auto rowcol(Layout const& acc) {
  using namespace cute;
  static_assert(decltype(size<0, 0>(acc))::value == 2 && decltype(size<0, 1>(acc))::value == 2);
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                       make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
  } else {
    static_assert(decltype(rank<0>(acc))::value == 2);
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
  }
}

template <class Tensor>
__device__ auto rowcol_view(Tensor&& t) {
  return cute::make_tensor(t.data(), rowcol(t.layout()));
}

// The C fragments of two adjacent n8 MMA tiles hold exactly the A fragment of one k16 tile, so
// P = softmax(S) feeds O += P V straight from registers: ((2, 2), M, N) -> ((2, 2, 2), M, N / 2), or for
// a Hopper accumulator ((2, 2, N / 8), M, N') -> ((2, 2, 2), M, (N / 16, N')).
template <class Layout>
__device__ constexpr auto acc_as_operand_a(Layout const& acc) {
  using namespace cute;
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
    auto n = logical_divide(layout<0, 2>(acc), Shape<_2>{});  // ((2, N / 16))
    return make_layout(make_layout(layout<0, 0>(acc), layout<0, 1>(acc), layout<0, 0>(n)), layout<1>(acc),
                       make_layout(layout<0, 1>(n), layout<2>(acc)));
  } else {
    static_assert(decltype(size<2>(acc))::value % 2 == 0);
    auto n = logical_divide(layout<2>(acc), Shape<_2>{});  // ((2, N / 2))
    return make_layout(make_layout(layout<0>(acc), layout<0, 0>(n)), layout<1>(acc), layout<0, 1>(n));
  }
}

// dst = src converted elementwise, into an existing fragment of the same size.
template <class EngineS, class LayoutS, class EngineD, class LayoutD>
__device__ void convert_fragment_into(cute::Tensor<EngineS, LayoutS> const& src, cute::Tensor<EngineD, LayoutD>& dst) {
  using From = typename EngineS::value_type;
  using To = typename EngineD::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  static_assert(decltype(cute::size(dst))::value == N);
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
}

// src converted elementwise into a new register fragment of the same layout.
template <typename To, class Engine, class Layout>
__device__ auto convert_fragment(cute::Tensor<Engine, Layout> const& src) {
  auto dst = cute::make_tensor<To>(src.layout());
  convert_fragment_into(src, dst);
  return dst;
}

// A (rows, kCols) row-major view of global memory with a runtime row stride and contiguous columns.
template <int kCols, class T>
__device__ auto gmem_rows(T* ptr, int rows, int64_t row_stride) {
  return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_shape(rows, cute::Int<kCols>{}),
                           cute::make_stride(row_stride, cute::_1{}));
}

// Global -> shared with cp.async. Rows >= max_rows (tested only when kCheckRows) and columns >= max_cols
// are zero-filled instead, so padding keys and head-dim columns add nothing to either GEMM. The copy is
// the ZFILL cp.async: a false predicate reads no bytes, so the code stays branch-free.
template <bool kCheckRows, class TiledCopy, class Src, class Dst, class Coord>
__device__ void load_tile(TiledCopy const& copy, Src const& src, Dst&& dst, Coord const& coord, int max_rows,
                          int max_cols) {
  using namespace cute;
  CUTE_STATIC_ASSERT_V(rank(src) == Int<3>{} && size<1>(src) == size<1>(dst) && size<2>(src) == size<2>(dst));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    const bool row_ok = !kCheckRows || get<0>(coord(0, m, 0)) < max_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      cute::copy(copy.with(row_ok && get<1>(coord(0, m, k)) < max_cols), src(_, m, k), dst(_, m, k));
    }
  }
}

// Registers -> global, skipping rows >= max_rows and columns >= max_cols.
template <class TiledCopy, class Src, class Dst, class Coord>
__device__ void store_tile(TiledCopy const& copy, Src const& src, Dst&& dst, Coord const& coord, int max_rows,
                           int max_cols) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    if (get<0>(coord(0, m, 0)) >= max_rows) continue;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      if (get<1>(coord(0, m, k)) < max_cols) cute::copy(copy, src(_, m, k), dst(_, m, k));
    }
  }
}

// acc += A B over the k mode, with A and B read from shared memory by ldmatrix; the fragments of
// k-slice i + 1 load while the MMAs of slice i run. sA, sB: partitioned by the copies' thread slices.
// Forced inline: nvcc kept the SM80 backward's five calls out of line, its accumulators then passed
// through local memory (d 128, sm_80: 773 LDL / 588 STL in the kernel, 45 / 22 inlined).
template <class TiledMma, class Acc, class RegA, class SmemA, class CopyA, class RegB, class SmemB, class CopyB>
__device__ __forceinline__ void gemm_ss(TiledMma const& mma, Acc& acc, RegA& rA, SmemA const& sA, CopyA const& copy_a, RegB& rB,
                        SmemB const& sB, CopyB const& copy_b) {
  using namespace cute;
  CUTE_STATIC_ASSERT_V(size<1>(rA) == size<1>(acc) && size<1>(rB) == size<2>(acc) && size<2>(rA) == size<2>(rB));
  Tensor rA_view = copy_a.get_thread_slice(threadIdx.x).retile_D(rA);
  Tensor rB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(rB);
  CUTE_STATIC_ASSERT_V(size<1>(sA) == size<1>(rA_view) && size<1>(sB) == size<1>(rB_view));
  cute::copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  cute::copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      cute::copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      cute::copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A B with A already in registers (P) and B from shared memory.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemB, class CopyB>
__device__ __forceinline__ void gemm_rs(TiledMma const& mma, Acc& acc, RegA const& rA, RegB& rB, SmemB const& sB,
                        CopyB const& copy_b) {
  using namespace cute;
  CUTE_STATIC_ASSERT_V(size<1>(rA) == size<1>(acc) && size<1>(rB) == size<2>(acc) && size<2>(rA) == size<2>(rB));
  Tensor rB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(rB);
  cute::copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) cute::copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace flash_attn2
