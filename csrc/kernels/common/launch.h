// What every launcher does around a kernel launch: opting a kernel into its shared memory, and programmatic
// dependent launch for the backward's chain of kernels (preprocess, main kernel, conversions).
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include "common/launchers.h"  // DeviceInfo

namespace flash_attn2 {

// Opts kernel into bytes of dynamic shared memory on the current device, or returns
// cudaErrorLaunchOutOfResources where a block may not have that much (the backward's 208 KB at head
// dim 256 on an A100 without compact tiles). The attribute is per device, so launchers call this on
// every launch.
template <class Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes, const DeviceInfo& device) {
  if (bytes <= 48 * 1024) return cudaSuccess;  // every GPU allows this much without opting in
  if (bytes > device.smem_per_block) return cudaErrorLaunchOutOfResources;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// allow_dynamic_smem for an SM80 tile, which must also fit tile_smem_limit (the limit it was picked for).
template <class Kernel>
cudaError_t allow_tile_smem(Kernel* kernel, int bytes, const DeviceInfo& device) {
  if (bytes > device.tile_smem_limit) return cudaErrorLaunchOutOfResources;
  return allow_dynamic_smem(kernel, bytes, device);
}

// The backward's kernels after the first (preprocess, main kernel, conversions) go with programmatic dependent
// launch on sm_90+: a kernel's blocks may start, and run their prologue, while the previous kernel's last blocks
// still run, which hides the launch gap between kernels (a few us of the HF step's 0.3 ms backward). Such a
// kernel calls griddep_wait() before it touches anything the previous one writes; griddep_launch_dependents()
// lets the next one's blocks be scheduled (as this kernel's blocks retire) before this one ends.
__device__ inline void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ inline void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Whether this kernel's code waits for its predecessor (griddep_wait compiled in: code generated for compute_90
// or newer). A build without sm_90 code that runs on a newer GPU JIT-compiles compute_8x PTX, where the wait is
// absent: such a kernel must not be launched with programmatic serialization. Cached per kernel.
inline bool kernel_waits_for_predecessor(const void* kernel) {
  constexpr int kSlots = 64;
  static std::atomic<const void*> keys[kSlots] = {};
  static std::atomic<int8_t> answers[kSlots] = {};  // 1 no, 2 yes
  const size_t slot = (reinterpret_cast<uintptr_t>(kernel) >> 4) % kSlots;
  if (keys[slot].load(std::memory_order_acquire) == kernel) return answers[slot].load(std::memory_order_relaxed) == 2;
  cudaFuncAttributes attr{};
  const bool waits = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.ptxVersion >= 90;
  answers[slot].store(waits ? 2 : 1, std::memory_order_relaxed);
  keys[slot].store(kernel, std::memory_order_release);
  return waits;
}

// kernel<<<grid, block, smem, stream>>>(args...), programmatically dependent on the stream's previous kernel
// where the device has it (sm_90+) and the kernel's code waits for it (kernel_waits_for_predecessor); in thread
// block clusters of shape `cluster` where that is not 1 x 1 x 1, which needs both (the caller checks:
// cluster_launchable).
template <typename... Params, typename... Args>
cudaError_t launch_cluster_after(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block, size_t smem,
                                 cudaStream_t stream, Args&&... args) {
  int device = 0, major = 0;
  if (cudaError_t err = cudaGetDevice(&device)) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) return err;
  if (major >= 9 && !kernel_waits_for_predecessor(reinterpret_cast<const void*>(kernel))) major = 0;
  const bool clustered = cluster.x * cluster.y * cluster.z > 1;
  if (clustered && major < 9) return cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = cluster.x, attrs[1].val.clusterDim.y = cluster.y, attrs[1].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = major >= 9 ? (clustered ? 2 : 1) : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t launch_after(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         Args&&... args) {
  return launch_cluster_after(kernel, grid, dim3(1, 1, 1), block, smem, stream, std::forward<Args>(args)...);
}

// Whether kernel may be launched in clusters here: an sm_90+ device running the kernel's sm_90+ code (a build
// without it JIT-compiles older PTX, whose cluster code traps: common/cluster.h).
template <class Kernel>
bool cluster_launchable(Kernel* kernel) {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9 && kernel_waits_for_predecessor(reinterpret_cast<const void*>(kernel));
}

}  // namespace flash_attn2
