// TMA descriptors are encoded on the host on every call. CUTLASS's driver wrapper looks up
// cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion each time (the library must not link
// libcuda, which CPU-only machines lack), and CuTe only prints when encoding fails. This specialization of
// that wrapper, for the argument types CuTe passes, looks the entry point up once and records failures,
// which the launcher turns into an error instead of launching with an empty descriptor.
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cutlass/cuda_host_adapter.hpp>

namespace flash_attn2::sm90 {

// Cleared by the launcher before it builds descriptors; set by a failed encode on this thread.
inline thread_local bool tma_encode_failed = false;

// cuTensorMapEncodeTiled as of CUDA 12.0.
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                      const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<TensorMapEncoder>(fn) : nullptr;
  }();
  return encode;
}

}  // namespace flash_attn2::sm90

namespace cutlass {

template <>
inline CUresult call_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, int rank, void* address,
                                            uint64_t* dims, uint64_t* strides, uint32_t* box, uint32_t* box_strides,
                                            CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                            CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  const auto encode = flash_attn2::sm90::tensor_map_encoder();
  const CUresult result = encode == nullptr ? CUDA_ERROR_NOT_FOUND
                                            : encode(map, type, cuuint32_t(rank), address, dims, strides, box,
                                                     box_strides, interleave, swizzle, l2, oob);
  if (result != CUDA_SUCCESS) flash_attn2::sm90::tma_encode_failed = true;
  return result;
}

}  // namespace cutlass
