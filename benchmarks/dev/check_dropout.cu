// Host checks of common/dropout.h before any GPU runs it: Philox4x32-10 against Random123's known answers,
// and a simulated warp's lane-pair exchange (forward S and the backward's S^T fragments) against the
// spec's byte for every score. Prints a few spec bytes for flash_attn2/_dropout.py to compare:
//   nvcc -std=c++17 --expt-relaxed-constexpr -Icsrc/include -Icsrc/kernels -I$SP/cutlass_library/source/include \
//     benchmarks/dev/check_dropout.cu -o /tmp/check_dropout && /tmp/check_dropout
#include <cstdio>
#include <cuda_runtime.h>

#include "common/dropout.h"

using namespace flash_attn2;

// The spec, written from flash_attn2/_dropout.py's formula, not from the lane logic.
uint32_t spec_byte(const DropoutRng& rng, int row, int col) {
  const uint4 u = rng.unit(row >> 4, (row & 7) >> 1, col >> 4, (col & 7) >> 1);
  const int word = 2 * ((row >> 3) & 1) + (row & 1), byte = 2 * ((col >> 3) & 1) + (col & 1);
  const uint32_t w = word == 0 ? u.x : word == 1 ? u.y : word == 2 ? u.z : u.w;
  return (w >> (8 * byte)) & 0xFF;
}

template <bool kTransposed>
int check_warp(const DropoutRng& rng, int row_block, int block0, int block1) {
  uint4 drawn[32];
  uint2 sent[32];
  for (int lane = 0; lane < 32; ++lane) {
    const KeepPair<kTransposed> pair(lane);
    drawn[lane] = pair.draw(rng, row_block, block0, block1);
    sent[lane] = pair.send(drawn[lane]);
  }
  int failures = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const KeepWords k = KeepPair<kTransposed>(lane).combine(drawn[lane], sent[lane ^ 4]);
    const int g = lane >> 2, q = lane & 3;
    for (int j = 0; j < 2; ++j) {
      for (int h = 0; h < 2; ++h) {
        for (int byte = 0; byte < 4; ++byte) {
          const int fragment_row = 16 * row_block + g + 8 * h;
          const int fragment_col = 16 * (j == 0 ? block0 : block1) + 2 * q + (byte & 1) + 8 * (byte >> 1);
          // Fragment rows are queries (S) or keys (S^T).
          const uint32_t want = kTransposed ? spec_byte(rng, fragment_col, fragment_row) : spec_byte(rng, fragment_row, fragment_col);
          const uint32_t got = (k.words[j][h] >> (8 * byte)) & 0xFF;
          if (got != want && ++failures <= 5) {
            std::printf("FAIL transposed %d lane %d block %d half %d byte %d: %u != %u\n", int(kTransposed), lane, j, h,
                        byte, got, want);
          }
        }
      }
    }
  }
  return failures;
}

// KeepHalfPair: two arbitrary 8-key groups of one 16-row tile per lane pair.
int check_halves(const DropoutRng& rng, int row_block, int key0, int key1) {
  uint4 drawn[32];
  uint32_t sent[32];
  for (int lane = 0; lane < 32; ++lane) {
    const KeepHalfPair pair(lane);
    drawn[lane] = pair.draw(rng, row_block, key0, key1);
    sent[lane] = pair.send(drawn[lane], key0, key1);
  }
  int failures = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const KeepHalves k = KeepHalfPair(lane).combine(drawn[lane], sent[lane ^ 4], key0, key1);
    const int g = lane >> 2, q = lane & 3;
    for (int j = 0; j < 2; ++j) {
      for (int h = 0; h < 2; ++h) {
        for (int e = 0; e < 2; ++e) {
          const int row = 16 * row_block + g + 8 * h, col = (j == 0 ? key0 : key1) + 2 * q + e;
          const uint32_t got = (k.words[j] >> (8 * (2 * h + e))) & 0xFF, want = spec_byte(rng, row, col);
          if (got != want && ++failures <= 5) {
            std::printf("FAIL halves lane %d group %d half %d col %d: %u != %u\n", lane, j, h, e, got, want);
          }
        }
      }
    }
  }
  return failures;
}

int main() {
  struct Kat { uint4 c; uint2 k; uint4 want; };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  int failures = 0;
  for (const Kat& t : kats) {
    const uint4 got = philox4x32_10(t.c, t.k);
    if (got.x != t.want.x || got.y != t.want.y || got.z != t.want.z || got.w != t.want.w) {
      std::printf("FAIL philox known answer\n");
      ++failures;
    }
  }
  const DropoutRng rng{dropout_key(0x9abcdef012345678ull), 77u, 5u};
  int warps = 0;
  for (int row_block = 0; row_block < 6; ++row_block) {
    for (int b0 = 0; b0 < 6; ++b0) {
      for (int b1 = b0; b1 < 6; ++b1) {
        failures += check_warp<false>(rng, row_block, b0, b1) + check_warp<true>(rng, row_block, b0, b1);
        warps += 2;
      }
    }
  }
  for (int row_block = 0; row_block < 4; ++row_block) {
    for (int key0 = 0; key0 < 96; key0 += 8) {
      for (int key1 = key0; key1 < 96; key1 += 8) {
        failures += check_halves(rng, row_block, key0, key1);
        ++warps;
      }
    }
  }
  std::printf("%d simulated warps, %d failures\n", warps, failures);
  // For flash_attn2/_dropout.py: seed 0x9abcdef012345678, offset 4 * 77, bh 5.
  std::printf("spec bytes (row, col): ");
  const int points[][2] = {{0, 0}, {1, 9}, {17, 3}, {100, 77}, {1023, 4095}, {40000, 12345}};
  for (const auto& pt : points) std::printf("(%d, %d) %u  ", pt[0], pt[1], spec_byte(rng, pt[0], pt[1]));
  std::printf("\n");
  return failures != 0;
}
