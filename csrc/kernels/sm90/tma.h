// TMA on Hopper, for both directions: the (rows, head_dim, heads, batch) view of q / k / v / out / dout
// (tma_shape, make_tma), and the host-side encoding of its descriptors. Descriptors are encoded on every
// call. CUTLASS's driver wrapper looks up cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion
// each time (the library must not link libcuda, which CPU-only machines lack), and CuTe only prints when
// encoding fails. This specialization of that wrapper, for the argument types CuTe passes, looks the entry
// point up once and records failures, which the launcher turns into an error instead of launching with an
// empty descriptor.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/cuda_host_adapter.hpp>

#include "flash_attn2/flash_attn2.h"
#include "sm90/tile_size.h"

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

namespace flash_attn2::sm90 {

// The (rows, head_dim, heads, batch) extents of the q-side (kIsQ) or k-side tensors' descriptors; head_dim V's and
// O's where it differs from q's (FwdTraitsSm90::head_dim_v).
template <bool kIsQ>
__host__ __device__ inline auto tma_shape(const FwdParams& p, int head_dim) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t rows = kIsQ ? (varlen ? p.total_q : p.seqlen_q) : (varlen ? p.total_k : p.seqlen_k);
  return cute::make_shape(int(rows > 0 ? rows : 1), head_dim, kIsQ ? p.num_heads : p.num_heads_k,
                          varlen ? 1 : (p.batch > 0 ? p.batch : 1));
}

// The K / V descriptors' extents on the host (the launcher): tma_shape's, but for a KV cache (the forward only)
// kv_batch entries with kv_batch_idx, and a paged cache as (page_size rows, head_dim, heads, num_pages), its batch
// stride the page stride (the producer loads its rows through the table with make_paged_tma's descriptors; this
// view keeps the CuTe descriptors valid). The kernels' coordinate tensors keep tma_shape's extents: coordinates
// past them are never bounds-checked there, the descriptors' extents are what TMA clips to.
inline auto tma_shape_kv(const FwdParams& p, int head_dim) {
  auto shape = tma_shape<false>(p, head_dim);
  if (p.page_table != nullptr) {
    return cute::make_shape(p.page_size > 0 ? p.page_size : 1, head_dim, p.num_heads_k, p.num_pages > 0 ? p.num_pages : 1);
  }
  if (p.cu_seqlens_q == nullptr && p.kv_batch_idx != nullptr) {
    return cute::make_shape(cute::get<0>(shape), head_dim, p.num_heads_k, p.kv_batch > 0 ? p.kv_batch : 1);
  }
  return shape;
}

template <bool kIsQ>
__host__ __device__ inline auto tma_shape(const FwdParams& p) {
  return tma_shape<kIsQ>(p, p.head_dim);
}

// A TMA descriptor over one of q / k / v as (rows, head_dim, heads, batch). Varlen tensors are one packed
// batch entry (sequences are row offsets); a stride that the view never steps along is set to the row
// stride, since TMA wants every stride a nonzero multiple of 16 bytes.
template <class Traits, class Tma, class Element = typename Traits::Element, class CopyOp, class SmemLayout, class TileShape>
Tma make_tma(CopyOp op, const void* ptr, cute::Shape<int, int, int, int> shape, int64_t row_stride,
             int64_t head_stride, int64_t batch_stride, SmemLayout smem, TileShape tile) {
  using namespace cute;
  auto layout = make_layout(shape, make_stride(row_stride, _1{}, get<2>(shape) > 1 ? head_stride : row_stride,
                                               get<3>(shape) > 1 ? batch_stride : row_stride));
  Tensor t = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), layout);
  return make_tma_copy(op, t, smem, tile, _1{});
}

// Rows per TMA box of a paged cache's loads (sm90/tile_size.h).
constexpr int kPagedRows = kPagedRowsSm90;

// A descriptor over a paged cache's (head_dim, page rows, heads_k, pages) in boxes of box_rows rows
// (paged_box_rows_sm90: a divisor of the page size) by kAtomCols columns (one 128- or 64-byte swizzle atom's width,
// as the K / V shared-memory tiles are laid out). False where the encoding fails (the launcher then returns an
// error instead of launching).
template <class Element, int kAtomCols>
bool make_paged_tma(CUtensorMap* map, const void* ptr, const FwdParams& p, int head_dim, int64_t row_stride,
                    int64_t head_stride, int64_t page_stride, int box_rows) {
  static_assert(sizeof(Element) == 2 && (kAtomCols * 2 == 128 || kAtomCols * 2 == 64), "16-bit, 128 / 64-byte atoms");
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  constexpr int64_t kBytes = sizeof(Element);
  // A stride over an extent of 1 is never stepped along; TMA still wants it a nonzero multiple of 16 bytes.
  const int64_t heads_stride = p.num_heads_k > 1 ? head_stride : row_stride;
  const int64_t pages_stride = p.num_pages > 1 ? page_stride : row_stride;
  cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(p.page_size), cuuint64_t(p.num_heads_k), cuuint64_t(p.num_pages)};
  cuuint64_t strides[3] = {cuuint64_t(row_stride * kBytes), cuuint64_t(heads_stride * kBytes),
                           cuuint64_t(pages_stride * kBytes)};
  cuuint32_t box[4] = {cuuint32_t(kAtomCols), cuuint32_t(box_rows), 1, 1};
  cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same_v<Element, cutlass::bfloat16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                                : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                kAtomCols * kBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace flash_attn2::sm90
