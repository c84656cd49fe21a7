// Sets S to -inf where a key is past the sequence end or (causal) above the bottom-right diagonal.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flash_attn2 {

struct Mask {
  int len_q, len_k;
  bool causal;

  // S and coord are one thread's fragment of the S tile in (row, col) view; coord holds tile coordinates.
  template <class TensorS, class TensorC>
  __device__ void apply(TensorS& S, TensorC const& coord, int row0, int col0) const {
    static_assert(decltype(cute::rank(S))::value == 2);
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(S); ++r) {
      const int row = row0 + cute::get<0>(coord(r, 0));
      const int col_end = causal ? min(len_k, row + 1 + len_k - len_q) : len_k;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(S); ++c) {
        if (col0 + cute::get<1>(coord(r, c)) >= col_end) S(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace flash_attn2
