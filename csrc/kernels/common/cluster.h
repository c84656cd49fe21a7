// Thread block clusters (sm_90+): barriers over a cluster's blocks and loads from a peer block's shared memory
// (distributed shared memory). The split-KV kernels' cluster combine uses them (sm80/fwd_split_kernel.h):
// a cluster's blocks are one tile's key splits, and they merge their partial results in shared memory instead of
// writing them to global memory for a second kernel. Code generated for older archs traps: its launcher launches
// a cluster only where the kernel's code is sm_90's (kernel_waits_for_predecessor, common/launch.h).
#pragma once

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>  // set_block_rank (mapa)

namespace flash_attn2 {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASH_ATTN2_CLUSTERS 1
#endif

// (The barriers are ours, not CuTe's cluster_arrive / cluster_wait: theirs carry no "memory" clobber, which the
// shared-memory stores before the barrier and the peers' loads after it need.)

// Every thread of every block in the cluster arrives (release: its shared-memory writes before it are visible to
// the peers' loads after their wait) and waits (acquire). ptxas makes the release a MEMBAR.ALL.GPU: the arrive
// waits for the thread's outstanding global stores too.
__device__ __forceinline__ void cluster_barrier() {
#ifdef FLASH_ATTN2_CLUSTERS
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// The same without the release, for a barrier that orders no writes: one that keeps a block's shared memory until
// its peers are done reading it (their loads' values are used before they arrive), which need not wait for the
// global stores before it.
__device__ __forceinline__ void cluster_barrier_relaxed() {
#ifdef FLASH_ATTN2_CLUSTERS
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// The float at `local` (an address in this block's shared memory) in block `rank`'s shared memory.
__device__ __forceinline__ float cluster_load(const float* local, int rank) {
#ifdef FLASH_ATTN2_CLUSTERS
  const uint32_t remote = cute::set_block_rank(static_cast<uint32_t>(__cvta_generic_to_shared(local)), uint32_t(rank));
  float value;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(remote) : "memory");
  return value;
#else
  __trap();
  return 0.f;
#endif
}

// The four floats at `local` (16-byte aligned, in this block's shared memory) in block `rank`'s shared memory.
__device__ __forceinline__ float4 cluster_load4(const float* local, int rank) {
#ifdef FLASH_ATTN2_CLUSTERS
  const uint32_t remote = cute::set_block_rank(static_cast<uint32_t>(__cvta_generic_to_shared(local)), uint32_t(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
#else
  __trap();
  return make_float4(0.f, 0.f, 0.f, 0.f);
#endif
}

}  // namespace flash_attn2
