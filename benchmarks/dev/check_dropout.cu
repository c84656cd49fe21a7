// Host checks of common/dropout.h before any GPU runs it: Philox4x32-7 and -10 against Random123's known answers,
// and a simulated warp's lane-pair exchange (forward S and the backward's S^T fragments, 8-key halves, and
// the wide Hopper backward's GroupBits) against the spec's byte for every score. Prints a few spec bytes for
// flash_attn2/_dropout.py to compare:
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

// A simulated warp's exchange: lane's KeepWords (KeepPair) or KeepHalves (KeepHalfPair) for its fragment.
KeepWords warp_words(const DropoutRng& rng, int lane, int row_block, int block0, int block1) {
  const KeepPair<false> pair(lane), partner(lane ^ 4);
  return pair.combine(pair.draw(rng, row_block, block0, block1),
                      partner.send(partner.draw(rng, row_block, block0, block1)));
}
KeepHalves warp_halves(const DropoutRng& rng, int lane, int row_block, int key0, int key1) {
  const KeepHalfPair pair(lane), partner(lane ^ 4);
  return pair.combine(pair.draw(rng, row_block, key0, key1),
                      partner.send(partner.draw(rng, row_block, key0, key1), key0, key1), key0, key1);
}

// GroupBits (the wide Hopper backward's warpgroups of kGroups 8-key groups from key0) against the spec's keep
// decision for every lane's scores, as Dropout::draw_group_bits draws and places them.
template <int kGroups>
int check_group_bits(const DropoutRng& rng, uint32_t threshold, int row_block, int key0) {
  using Layout = GroupBits<kGroups>;
  const Layout layout(key0);
  int failures = 0;
  for (int lane = 0; lane < 32; ++lane) {
    KeepWords pairs[Layout::kPairs];
    for (int i = 0; i < Layout::kPairs; ++i) {
      pairs[i] = warp_words(rng, lane, row_block, layout.pair_block(i, 0), layout.pair_block(i, 1));
    }
    uint32_t lone_word = 0;
    if (kGroups % 2 == 1) {
      const int key = layout.lone_key(key0);
      lone_word = warp_halves(rng, lane, row_block, key, key).words[0];
    }
    const uint32_t bits = layout.place(pairs, lone_word, keep_limit(threshold));
    const int g = lane >> 2, q = lane & 3;
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 2 * kGroups; ++c) {
        const int row = 16 * row_block + g + 8 * h, key = key0 + 8 * (c / 2) + 2 * q + c % 2;
        // Threshold 0 keeps nothing through the scale (0); the bits are not asked then.
        const bool want = spec_byte(rng, row, key) < threshold, got = Layout::kept(bits, c / 2, h, c % 2);
        if (threshold > 0 && got != want && ++failures <= 5) {
          std::printf("FAIL groups %d key0 %d lane %d half %d col %d: %d != %d\n", kGroups, key0, lane, h, c, got, want);
        }
      }
    }
  }
  return failures;
}

int main() {
  struct Kat { uint4 c; uint2 k; uint4 want7, want10; };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48},
       {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}, {0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
       {0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a}, {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  auto same = [](uint4 a, uint4 b) { return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w; };
  int failures = 0;
  for (const Kat& t : kats) {
    if (!same(philox4x32<7>(t.c, t.k), t.want7) || !same(philox4x32<10>(t.c, t.k), t.want10)) {
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
  for (uint32_t threshold : {1u, 26u, 128u, 230u, 256u}) {
    for (int row_block = 0; row_block < 3; ++row_block) {
      for (int n_block = 0; n_block < 5; ++n_block) {
        for (int wg = 0; wg < 3; ++wg) {
          if (wg < 2) failures += check_group_bits<5>(rng, threshold, row_block, n_block * 80 + wg * 40);  // d 256
          failures += check_group_bits<4>(rng, threshold, row_block, n_block * 96 + wg * 32);             // d 192
          failures += check_group_bits<3>(rng, threshold, row_block, n_block * 48 + wg * 24);             // odd, 3 WGs
          warps += wg < 2 ? 3 : 2;
        }
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
