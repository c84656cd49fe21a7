// Which keys each query row sees and which rows each key is seen by (Window: the one predicate every kernel masks
// with; Window::span for S and the backward's S^T), and S set to -inf where a row does not see a key (Mask::apply).
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// What one line of a tile sees of the other index, in tile columns: [begin, end).
struct Span {
  int begin, end;
};

// flash-attn's window, aligned to the bottom-right corner like causal: row i sees key j < len_k iff
// i + diag - left <= j <= i + diag + right, diag = len_k - len_q; causal is right = 0. A side at least as
// wide as the sequences (left >= len_k, right >= len_q, or -1) is unbounded. Kept as the two rows where the
// edges meet the sequence's corners, so that no sum below leaves 32 bits for lengths up to kMaxSeqlen.
struct Window {
  int len_q, len_k;
  int right_row;  // len_q - 1 - right: rows from here on see the last key (-1 when unbounded)
  int left_row;   // len_q - len_k + left: rows up to here see the first key (len_q when unbounded)

  __host__ __device__ Window(int len_q_, int len_k_, const FwdParams& p)
      : len_q(len_q_), len_k(len_k_),
        right_row(p.causal ? len_q_ - 1
                           : (p.window_right < 0 || p.window_right >= len_q_ ? -1 : len_q_ - 1 - p.window_right)),
        left_row(p.window_left < 0 || p.window_left >= len_k_ ? len_q_ : len_q_ - len_k_ + p.window_left) {}

  // Row i sees keys [key_begin(i), key_end(i)); empty when key_begin >= key_end.
  __host__ __device__ int key_begin(int row) const { return max(0, row - left_row); }
  __host__ __device__ int key_end(int row) const { return len_k - max(0, right_row - row); }
  // Key j is seen by rows [row_begin(j), row_end(j)) (j < len_k).
  __host__ __device__ int row_begin(int key) const { return max(0, (key - len_k + 1) + right_row); }
  __host__ __device__ int row_end(int key) const { return len_q - max(0, (len_q - 1 - left_row) - key); }

  // Line `line` of a tile whose first column is col0: a query row of S sees keys [begin, end); kTransposed, a key
  // row of S^T is seen by queries [begin, end). A line at or past `lines` (its sequence's end: len_q for query
  // rows, len_k for keys) sees nothing: the backward's lines past the sequence hold whatever the packed tensors
  // have there. (Mask::apply, the forward's, computes the same bounds itself: through span the SM80 backward's
  // code moved, TUNING 126.)
  template <bool kTransposed>
  __host__ __device__ Span span(int line, int col0, int lines) const {
    if constexpr (kTransposed) return {row_begin(line) - col0, line < lines ? row_end(line) - col0 : 0};
    else return {key_begin(line) - col0, line < lines ? key_end(line) - col0 : 0};
  }
};

// Which edges a step masks: none (blocks inside the window), the right one (the causal diagonal or the
// window's right edge, and the sequence end), or both (blocks a left window edge crosses). Only the last
// compares twice per element, so only steps that need it pay for it in registers.
using MaskNone = std::integral_constant<int, 0>;
using MaskRight = std::integral_constant<int, 1>;
using MaskBoth = std::integral_constant<int, 2>;

struct Mask {
  Window window;

  // The forward's mask: S to -inf where a query row does not see the key. S and coord are one thread's fragment
  // of the S tile in (row, col) view; coord holds tile coordinates. Edges: which of the span's ends can cut
  // the tile (MaskRight: the end alone).
  template <class Edges, class TensorS, class TensorC>
  __device__ void apply(Edges, TensorS& S, TensorC const& coord, int row0, int col0) const {
    static_assert(decltype(cute::rank(S))::value == 2);
    if constexpr (Edges::value != MaskNone::value) {
      CUTE_UNROLL
      for (int r = 0; r < cute::size<0>(S); ++r) {
        // The row's visible keys in tile columns, [begin, end) (span's; begin only where the left edge may cut).
        const int row = row0 + cute::get<0>(coord(r, 0));
        const int begin = Edges::value == MaskBoth::value ? window.key_begin(row) - col0 : 0;
        const int end = window.key_end(row) - col0;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(S); ++c) {
          const int col = cute::get<1>(coord(r, c));
          if (col >= end || (Edges::value == MaskBoth::value && col < begin)) S(r, c) = -INFINITY;
        }
      }
    }
  }
};

}  // namespace flash_attn2
