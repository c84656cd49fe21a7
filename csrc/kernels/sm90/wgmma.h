// Hopper building blocks: warpgroup MMA issue, mbarrier and named-barrier helpers. Everything here needs
// sm_90a; callers compile it only where __CUDA_ARCH_FEAT_SM90_ALL is defined.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace flash_attn2::sm90 {

// acc (+)= A B over the k mode, issued by the whole warpgroup as one batch; waits for the batch only when
// kWait >= 0 (wgmma.wait_group kWait). A is shared memory (a GMMA descriptor tensor) or registers. kKSteps > 0:
// the first kKSteps k blocks only (operands whose columns past them are zeros: MLA's V and dO in the d 192 kernel).
template <bool kZeroInit, int kWait, int kKSteps = 0, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void wgmma(TiledMma& mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& acc) {
  using namespace cute;
  constexpr bool kARegisters =
      !std::is_base_of_v<GMMA::DescriptorIterator, typename TensorA::engine_type::iterator>;
  CUTE_STATIC_ASSERT_V(size<2>(tCrA) == size<2>(tCrB));
  constexpr int kSteps = kKSteps > 0 ? kKSteps : int(decltype(size<2>(tCrA))::value);
  static_assert(kSteps <= int(decltype(size<2>(tCrA))::value));
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < kSteps; ++k) {
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(acc);
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
}

// One smem mbarrier per pipeline stage and direction. A "full" barrier completes when the producer's TMA
// bytes have landed; an "empty" one when every consumer warpgroup has released the stage.
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ void advance() {
    if (++stage == kStages) { stage = 0; phase ^= 1; }
  }
  // The state after n advances from the start: one register to carry where four are scarce (the loader warps).
  template <int kStages>
  __device__ static PipelineState after(int n) { return {n % kStages, uint32_t(n / kStages) & 1}; }
};

__device__ __forceinline__ void barrier_init(uint64_t* bar, int count) { cutlass::arch::ClusterBarrier::init(bar, count); }
#if !defined(FLASH_ATTN2_DEBUG_HANG)
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t phase) { cutlass::arch::ClusterBarrier::wait(bar, phase); }
#else
// Debug builds (FLASH_ATTN2_DEBUG_HANG=<cycles>, a build knob): a wait still open after that many cycles (2e9: about a
// second) prints its block, warp, barrier (shared-memory address) and phase, then traps, so that a hang ends as a
// launch failure that says where it waited (TUNING 62 found its hang this way: one warp of four still waiting on a
// stage the other three had released).
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t phase) {
  const long long start = clock64();
  while (!cutlass::arch::ClusterBarrier::try_wait(bar, phase)) {
    if (clock64() - start > (long long)(FLASH_ATTN2_DEBUG_HANG)) {
      if (int(threadIdx.x % 32) == __ffs(__activemask()) - 1) {
        printf("flash_attn2 hang: block %d warp %d waits on barrier 0x%x, phase %u\n", int(blockIdx.x),
               int(threadIdx.x / 32), unsigned(cute::cast_smem_ptr_to_uint(bar)), phase);
      }
      __trap();
    }
  }
}
#endif
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) { cutlass::arch::ClusterBarrier::arrive(bar); }
__device__ __forceinline__ void barrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, bytes);
}

// bar.sync on a hardware barrier id above the ones CUTLASS reserves, among num_threads threads.
__device__ __forceinline__ void named_barrier_sync(int num_threads, int id) {
  cutlass::arch::NamedBarrier::sync(num_threads, id);
}
__device__ __forceinline__ void named_barrier_arrive(int num_threads, int id) {
  cutlass::arch::NamedBarrier::arrive(num_threads, id);
}

// gmem[0, bytes / 4) += smem[0, bytes / 4) in fp32 by the TMA unit, as one flat bulk copy (16-byte aligned,
// a multiple of 16 bytes), in the issuing thread's bulk async-group (tma_store_arrive / tma_store_wait).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes) : "memory");
}

// Rows [first, rows) of a (rows, D) shared-memory tile to zero, 16 bytes per store (the swizzle keeps
// each 8-element chunk contiguous), by `threads` threads; then fenced for the wgmma (async proxy).
template <class Tensor>
__device__ void zero_rows(Tensor&& t, int first, int thread, int threads) {
  constexpr int kRows = decltype(cute::size<0>(t))::value, kChunks = decltype(cute::size<1>(t))::value / 8;
  for (int i = thread; i < (kRows - first) * kChunks; i += threads) {
    *reinterpret_cast<uint4*>(cute::raw_pointer_cast(&t(first + i / kChunks, i % kChunks * 8))) = uint4{0, 0, 0, 0};
  }
  cutlass::arch::fence_view_async_shared();
}

// Rows [0, rows) of a (R, D) shared-memory tile to out + row * row_stride, columns below `columns`, 16
// bytes per load and store (coalesced rows; the swizzle keeps each 8-element chunk contiguous), by
// `threads` threads: the row-store epilogue where TMA cannot clip (varlen, whose next rows belong to
// another sequence).
template <class Tensor, typename Element>
__device__ void store_rows(const Tensor& t, Element* out, int64_t row_stride, int rows, int columns, int thread,
                           int threads) {
  constexpr int kRows = decltype(cute::size<0>(t))::value, kChunks = decltype(cute::size<1>(t))::value / 8;
  for (int i = thread; i < kRows * kChunks; i += threads) {
    const int row = i / kChunks, col = i % kChunks * 8;
    if (row < rows && col < columns) {
      *reinterpret_cast<uint4*>(out + row * row_stride + col) =
          *reinterpret_cast<const uint4*>(cute::raw_pointer_cast(&t(row, col)));
    }
  }
}

// Rows [0, rows) of a kRows-row block at out to zero, columns below `columns` (a multiple of 8), 16 bytes per
// store, by `threads` threads.
template <int kRows, typename Element>
__device__ void clear_rows(Element* out, int64_t row_stride, int rows, int columns, int thread, int threads) {
  const int chunks = columns / 8;
  for (int i = thread; i < min(rows, kRows) * chunks; i += threads) {
    *reinterpret_cast<uint4*>(out + i / chunks * row_stride + i % chunks * 8) = uint4{0, 0, 0, 0};
  }
}

// A copy op for CuTe's copy(): st.shared of one T (32 or 64 bits). CuTe's swizzled shared-memory pointers
// round-trip through integers, which loses the address space: plain copies compiled to scalar generic
// stores (ST.E with 64-bit addresses, benchmarks/TUNING.md step 27).
template <class T>
struct SharedStore {
  using SRegisters = T[1];
  using DRegisters = T[1];
  CUTE_DEVICE static void copy(T const& src, T& dst) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8);
    const uint32_t addr = cute::cast_smem_ptr_to_uint(&dst);
    if constexpr (sizeof(T) == 4) {
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(src) : "memory");
    } else {
      asm volatile("st.shared.b64 [%0], %1;" ::"r"(addr), "l"(src) : "memory");
    }
  }
};

}  // namespace flash_attn2::sm90

namespace cute {
template <class T>
struct Copy_Traits<flash_attn2::sm90::SharedStore<T>> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, Int<sizeof_bits<T>::value>>>;
  using DstLayout = SrcLayout;
  using RefLayout = SrcLayout;
};
}  // namespace cute
