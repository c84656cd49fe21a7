// Attention dropout's keep bytes, drawn where the scores are: one Philox4x32-7 call per 16 of a thread's
// scores. The numbers are a function of (seed, offset, batch x heads + head, query, key) alone, so every
// kernel (forward, backward; mma.sync or wgmma; S or the backward's S^T) draws the same ones; the spec, and
// its PyTorch regeneration for S_dmask and the tests, is flash_attn2/_dropout.py.
//
// A unit is 4 query rows x 4 keys, rows 16 a + 2 i + {0, 1, 8, 9} and keys 16 b + 2 k + {0, 1, 8, 9}: in an
// MMA accumulator fragment (rows g, g + 8 and columns 2 q, 2 q + 1 of each 8-column group for lane
// 4 g + q) a lane holds half a unit and lane ^ 4 the other half, whether the rows are queries (S) or keys
// (S^T). So a lane pair draws two units, one each, and swaps halves with two shuffles.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "flash_attn2/flash_attn2.h"

namespace flash_attn2 {

// Philox4x32 (Random123) with kRounds rounds. The draws use 7, as flash-attn 2 does: Random123 finds 7 rounds
// pass TestU01's BigCrush (10 is its default margin), and the rounds are most of a draw's integer work, which
// the dropout kernels pay on the softmax's issue slots. 10 stays for the known-answer checks.
constexpr int kDropoutPhiloxRounds = 7;

template <int kRounds>
__host__ __device__ inline uint4 philox4x32(uint4 c, uint2 key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      key.x += kW0;
      key.y += kW1;
    }
    const uint64_t p0 = uint64_t(kM0) * c.x, p1 = uint64_t(kM1) * c.z;
    c = make_uint4(uint32_t(p1 >> 32) ^ c.y ^ key.x, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w ^ key.y, uint32_t(p0));
  }
  return c;
}

// Bytes s & 7, s >> 4 & 7, s >> 8 & 7, s >> 12 & 7 of the 8 bytes (hi:lo), as __byte_perm (no sign mode).
__host__ __device__ inline uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(lo, hi, s);
#else
  const uint64_t x = (uint64_t(hi) << 32) | lo;
  uint32_t out = 0;
  for (int j = 0; j < 4; ++j) out |= uint32_t(x >> (8 * ((s >> (4 * j)) & 7)) & 0xFF) << (8 * j);
  return out;
#endif
}

// Philox's key for a seed: the seed with a tag mixed in. PyTorch's own Philox users key with the bare seed and
// keep a call's offset in counter words 0-1, where this layout puts positions; without the tag, the first
// dropout call after seeding would draw numbers that a later torch op draws again (query rows 0, 1, 8, 9).
__host__ __device__ inline uint2 dropout_key(uint64_t seed) {
  return make_uint2(uint32_t(seed) ^ 0x706F7244u, uint32_t(seed >> 32) ^ 0x5F324146u);  // "Drop", "FA2_"
}

// A thread's keep bytes for two 16-row x 16-column blocks of its fragment: words[j][h] for block j and row
// half h (rows g + 8 h), byte c % 4 for the fragment's columns 2 q + {0, 1, 8, 9} in rowcol order.
struct KeepWords {
  uint32_t words[2][2];
};

// The draws of one (batch, head).
struct DropoutRng {
  uint2 key;        // dropout_key(seed)
  uint32_t offset;  // the generator's offset / 4
  uint32_t bh;      // batch x heads + head

  // The unit of query block a, row pair i, key block b, key pair k: word = the row's place in the unit
  // (2 (r >> 3 & 1) + (r & 1)), byte = the key's.
  __host__ __device__ uint4 unit(int a, int i, int b, int k) const {
    const uint4 counter = make_uint4(4u * uint32_t(b) + uint32_t(k), 4u * uint32_t(a) + uint32_t(i), bh, offset);
    return philox4x32<kDropoutPhiloxRounds>(counter, key);
  }
};

// A lane's place in its MMA fragment: rows g and g + 8, columns 2 q, 2 q + 1 of each 8-column group, and which
// of a lane pair (lane, lane ^ 4) it is.
struct FragmentLane {
  uint32_t lane_row, lane_col, parity;  // g, q, g & 1

  __host__ __device__ explicit FragmentLane(int lane)
      : lane_row(uint32_t(lane) >> 2), lane_col(uint32_t(lane) & 3), parity((uint32_t(lane) >> 2) & 1) {}
};

// A lane pair's two blocks, as halves: draw() is this lane's unit, send() what its partner (lane ^ 4) needs
// of it, combine() its KeepWords from its own unit and what the partner sent. kTransposed: the fragment's
// rows are keys (the backward's S^T), so the blocks are query blocks a0, a1 of key block b; else rows are
// queries and the blocks key blocks b0, b1 of query block a. The two blocks may be one (an odd count of
// blocks in a tile): then no swap is needed, but the same code serves.
template <bool kTransposed>
struct KeepPair : FragmentLane {
  using FragmentLane::FragmentLane;

  // Forward: the row block and the two column blocks; transposed: the key block (rows) and two query blocks.
  __host__ __device__ uint4 draw(const DropoutRng& rng, int row_block, int col_block0, int col_block1) const {
    const int col_block = parity ? col_block1 : col_block0;
    if constexpr (kTransposed) return rng.unit(col_block, int(lane_col), row_block, int(lane_row >> 1));
    else return rng.unit(row_block, int(lane_row >> 1), col_block, int(lane_col));
  }

  // Row half h's 4 bytes for rows of place p in the unit, in column order (byte c % 4).
  __host__ __device__ static uint32_t half(const uint4& u, uint32_t p, int h) {
    const uint32_t place = p + 2 * uint32_t(h);
    if constexpr (kTransposed) {
      // Rows are keys: byte `place` of each word (words are query places, i.e. columns).
      const uint32_t s = place | ((place + 4) << 4);
      return byte_perm(byte_perm(u.x, u.y, s), byte_perm(u.z, u.w, s), 0x5410);
    } else {
      return place == 0 ? u.x : place == 1 ? u.y : place == 2 ? u.z : u.w;
    }
  }

  __host__ __device__ uint2 send(const uint4& u) const { return make_uint2(half(u, 1 - parity, 0), half(u, 1 - parity, 1)); }

  __host__ __device__ KeepWords combine(const uint4& u, uint2 received) const {
    // Block `parity` is the one this lane drew (selects, not an index: registers, not local memory).
    const uint32_t own0 = half(u, parity, 0), own1 = half(u, parity, 1);
    KeepWords k;
    k.words[0][0] = parity ? received.x : own0;
    k.words[0][1] = parity ? received.y : own1;
    k.words[1][0] = parity ? own0 : received.x;
    k.words[1][1] = parity ? own1 : received.y;
    return k;
  }
};

// The same for fragments whose warps hold 8-key halves of the 16-key blocks (the SM80 backward's N-tiled
// warps): a lane pair's two 8-key groups, any two (their first keys, multiples of 8), of one 16-row tile.
// The pair draws one unit per group, each lane keeps the 4 bytes of its rows and sends the 4 of its
// partner's: one call per 8 of a thread's scores. words[j] byte 2 h + e: row half h, the group's column e.
struct KeepHalves {
  uint32_t words[2];
};
struct KeepHalfPair : FragmentLane {
  using FragmentLane::FragmentLane;

  __host__ __device__ int key(int key0, int key1) const { return parity ? key1 : key0; }
  __host__ __device__ uint4 draw(const DropoutRng& rng, int row_block, int key0, int key1) const {
    return rng.unit(row_block, int(lane_row >> 1), key(key0, key1) >> 4, int(lane_col));
  }
  // Rows of place p and p + 2 in the unit, the group's half of the keys (bytes 2 half, 2 half + 1).
  __host__ __device__ static uint32_t half(const uint4& u, uint32_t p, int key) {
    const uint32_t lo = 2 * ((uint32_t(key) >> 3) & 1);
    return byte_perm(p == 0 ? u.x : u.y, p == 0 ? u.z : u.w, lo | ((lo + 1) << 4) | ((lo + 4) << 8) | ((lo + 5) << 12));
  }
  __host__ __device__ uint32_t send(const uint4& u, int key0, int key1) const {
    return half(u, 1 - parity, key(key0, key1));
  }
  __host__ __device__ KeepHalves combine(const uint4& u, uint32_t received, int key0, int key1) const {
    const uint32_t own = half(u, parity, key(key0, key1));
    return {{parity ? received : own, parity ? own : received}};
  }
};

#if defined(__CUDACC__)
// The whole exchange, for every lane of the warp.
template <bool kTransposed>
__device__ inline KeepWords draw_keep_words(const DropoutRng& rng, int row_block, int col_block0, int col_block1) {
  const KeepPair<kTransposed> pair(int(threadIdx.x) % 32);
  const uint4 u = pair.draw(rng, row_block, col_block0, col_block1);
  const uint2 out = pair.send(u);
  const uint2 in = make_uint2(__shfl_xor_sync(0xffffffffu, out.x, 4), __shfl_xor_sync(0xffffffffu, out.y, 4));
  return pair.combine(u, in);
}

__device__ inline KeepHalves draw_keep_halves(const DropoutRng& rng, int row_block, int key0, int key1) {
  const KeepHalfPair pair(int(threadIdx.x) % 32);
  const uint4 u = pair.draw(rng, row_block, key0, key1);
  return pair.combine(u, __shfl_xor_sync(0xffffffffu, pair.send(u, key0, key1), 4), key0, key1);
}
#endif

// Kept iff the score's byte is below the threshold (dropout_threshold: round((1 - p) 256), up to 256).
__host__ __device__ inline bool keep_byte(uint32_t word, int byte, uint32_t threshold) {
  return ((word >> (8 * byte)) & 0xFFu) < threshold;
}

// A word's four keep decisions as bits 0-3 in byte order: byte <= limit, the threshold less one in every byte
// (0 when the threshold is 0: nothing is kept then, by the scale).
__host__ __device__ inline uint32_t keep_nibble(uint32_t word, uint32_t limit) {
#if defined(__CUDA_ARCH__)
  return ((__vcmpleu4(word, limit) & 0x80808080u) * 0x00204081u) >> 28;  // each byte's top bit, gathered
#else
  uint32_t n = 0;
  for (int b = 0; b < 4; ++b) n |= uint32_t(((word >> (8 * b)) & 0xFFu) <= ((limit >> (8 * b)) & 0xFFu)) << b;
  return n;
#endif
}
__host__ __device__ inline uint32_t keep_limit(uint32_t threshold) {
  return (threshold > 0 ? threshold - 1 : 0) * 0x01010101u;
}

// The keep bits of one 16-row tile (rows as queries) whose kGroups 8-key groups start at key0, a multiple of 8
// but not always of 16 (the wide Hopper backward's warpgroups own 40 keys): bit 4 g + 2 h + e for group g, row
// half h, column e. Whole 16-key blocks are drawn two at a time (KeepPair: one call per 16 of a thread's
// scores), and with an odd kGroups the group left over, first or last as key0 falls, by KeepHalfPair (one call
// per 8). An even kGroups must start on a 16-key block. The draws are the caller's (they exchange within a
// lane pair); this is what to draw and how to place it, shared with the host check.
template <int kGroups>
struct GroupBits {
  static_assert(kGroups <= 8, "4 bits a group in one word");
  static constexpr int kWhole = kGroups / 2, kPairs = (kWhole + 1) / 2;
  int lone;    // the group outside the whole blocks, or -1
  int first;   // the first whole block's first group
  int block0;  // its 16-key block

  __host__ __device__ explicit GroupBits(int key0)
      : lone(kGroups % 2 == 0 ? -1 : (key0 & 8) ? 0 : kGroups - 1),
        first(kGroups % 2 == 1 && (key0 & 8) ? 1 : 0),
        block0((key0 >> 4) + ((key0 & 8) ? 1 : 0)) {}

  // Pair i's two blocks (the same one twice for an odd count) and the lone group's first key.
  __host__ __device__ int pair_block(int i, int which) const {
    const int j = 2 * i + which;
    return block0 + (j < kWhole ? j : 2 * i);
  }
  __host__ __device__ int lone_key(int key0) const { return key0 + 8 * lone; }

  __host__ __device__ uint32_t place(const KeepWords (&pairs)[kPairs], uint32_t lone_word, uint32_t limit) const {
    uint32_t bits = 0;
    CUTE_UNROLL
    for (int j = 0; j < kWhole; ++j) {
      const int group = first + 2 * j;
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {  // bytes 2 sub + e: sub-group 0's two columns, then sub-group 1's
        const uint32_t n = keep_nibble(pairs[j / 2].words[j % 2][h], limit);
        bits |= ((n & 3u) << (4 * group + 2 * h)) | ((n >> 2) << (4 * (group + 1) + 2 * h));
      }
    }
    if constexpr (kGroups % 2 == 1) bits |= keep_nibble(lone_word, limit) << (4 * lone);  // byte 2 h + e
    return bits;
  }
  __host__ __device__ static bool kept(uint32_t bits, int group, int h, int e) {
    return (bits >> (4 * group + 2 * h + e)) & 1u;
  }
};

#if defined(__CUDACC__)
// One (batch, head)'s dropout: its draws, the threshold, and the scale of what is kept.
struct Dropout {
  DropoutRng rng;
  uint32_t threshold;  // 0..256
  float scale;         // 256 / threshold, 0 when nothing is kept

  // Seed and offset: each the value in the params plus, where set, what its pointer holds.
  __device__ static uint64_t seed(const FwdParams& p) {
    return p.philox_seed + (p.philox_seed_ptr != nullptr ? *p.philox_seed_ptr : 0);
  }
  __device__ static uint64_t offset(const FwdParams& p) {
    return p.philox_offset + (p.philox_offset_ptr != nullptr ? *p.philox_offset_ptr : 0);
  }

  __device__ Dropout(const FwdParams& p, int bidb, int bidh) {
    rng = {dropout_key(seed(p)), uint32_t(offset(p) >> 2),
           uint32_t(bidb) * uint32_t(p.num_heads) + uint32_t(bidh)};
    threshold = uint32_t(__float2int_rn((1.f - p.dropout_p) * 256.f));
    scale = threshold > 0 ? 256.f / float(threshold) : 0.f;
  }

  // The forward's record of what it drew with, for the backward (one thread of the grid calls it).
  __device__ static void record(const FwdParams& p) {
    if (p.rng_state == nullptr) return;
    p.rng_state[0] = seed(p);
    p.rng_state[1] = offset(p);
  }

  // Another head of the same batch entry (the Hopper backward's steps walk a group's heads).
  __device__ Dropout with_head(const FwdParams& p, int bidb, int bidh) const {
    Dropout d = *this;
    d.rng.bh = uint32_t(bidb) * uint32_t(p.num_heads) + uint32_t(bidh);
    return d;
  }

  // A thread's keep words for kBlocks consecutive 16-column blocks from col_block0 of one 16-row tile
  // (row_block), in a fragment laid out as the MMA accumulators are (rows g, g + 8; columns 2 q, 2 q + 1 of
  // each 8-column group, groups in order): block j's row half h is keep[j / 2].words[j % 2][h], byte c % 4 for
  // its fragment column c. kTransposed: rows are keys and columns queries (S^T). The whole warp must call it.
  template <bool kTransposed, int kBlocks>
  __device__ void draw(KeepWords (&keep)[(kBlocks + 1) / 2], int row_block, int col_block0) const {
    CUTE_UNROLL
    for (int j = 0; j < kBlocks; j += 2) {
      const int j1 = j + 1 < kBlocks ? j + 1 : j;  // an odd count: the last block twice
      keep[j / 2] = draw_keep_words<kTransposed>(rng, row_block, col_block0 + j, col_block0 + j1);
    }
  }
  template <int kBlocks>
  __device__ bool kept(const KeepWords (&keep)[(kBlocks + 1) / 2], int j, int h, int byte) const {
    return keep_byte(keep[j / 2].words[j % 2][h], byte, threshold);
  }

  // draw's keep bits, one per score: bit 8 j + 4 h + byte of bits[0 .. kBlocks / 4), for a thread that must
  // hold them across a GEMM (a word holds 4 bytes, a bit 1: the Hopper backward's registers).
  template <bool kTransposed, int kBlocks>
  __device__ void draw_bits(uint32_t (&bits)[(kBlocks + 3) / 4], int row_block, int col_block0) const {
    KeepWords keep[(kBlocks + 1) / 2];
    draw<kTransposed, kBlocks>(keep, row_block, col_block0);
    const uint32_t limit = keep_limit(threshold);
    CUTE_UNROLL
    for (int i = 0; i < (kBlocks + 3) / 4; ++i) bits[i] = 0;
    CUTE_UNROLL
    for (int j = 0; j < kBlocks; ++j) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        bits[j / 4] |= keep_nibble(keep[j / 2].words[j % 2][h], limit) << (8 * (j % 4) + 4 * h);
      }
    }
  }
  template <int kBlocks>
  __device__ static bool kept_bit(const uint32_t (&bits)[(kBlocks + 3) / 4], int j, int h, int byte) {
    return (bits[j / 4] >> (8 * (j % 4) + 4 * h + byte)) & 1u;
  }

  // GroupBits' keep bits for the thread's fragment of one 16-row tile (row_block) from key0. The whole warp
  // must call it.
  template <int kGroups>
  __device__ uint32_t draw_group_bits(int row_block, int key0) const {
    using Layout = GroupBits<kGroups>;
    const Layout layout(key0);
    KeepWords pairs[Layout::kPairs];
    CUTE_UNROLL
    for (int i = 0; i < Layout::kPairs; ++i) {
      pairs[i] = draw_keep_words</*kTransposed=*/false>(rng, row_block, layout.pair_block(i, 0), layout.pair_block(i, 1));
    }
    uint32_t lone_word = 0;
    if constexpr (kGroups % 2 == 1) {
      const int key = layout.lone_key(key0);
      lone_word = draw_keep_halves(rng, row_block, key, key).words[0];
    }
    return layout.place(pairs, lone_word, keep_limit(threshold));
  }

  // The keep bits of a thread's kRows x kCols fragment of S (queries x keys, rowcol view) whose warps hold 8-key
  // halves of the 16-key blocks (the SM80 backward's N-tiled warps): bit r kCols + c for score (r, c), drawn by
  // halves, a pair of 8-key groups per call (an odd count draws the last group twice). coord holds the
  // fragment's tile coordinates, row0 / key0 the tile's first query / key. The whole warp must call it.
  template <int kRows, int kCols, class TensorC>
  __device__ void draw_half_bits(uint32_t (&bits)[(kRows * kCols + 31) / 32], const TensorC& coord, int row0,
                                 int key0) const {
    using namespace cute;
    constexpr int kGroups = kCols / 2;
    CUTE_UNROLL
    for (int i = 0; i < (kRows * kCols + 31) / 32; ++i) bits[i] = 0;
    CUTE_UNROLL
    for (int m = 0; m < kRows / 2; ++m) {
      const int row_block = (row0 + get<0>(coord(2 * m, 0))) >> 4;
      auto group_key = [&](int g) { return (key0 + get<1>(coord(0, 2 * g))) & ~7; };
      KeepHalves keep;
      CUTE_UNROLL
      for (int n = 0; n < kGroups; ++n) {
        if (n % 2 == 0) keep = draw_keep_halves(rng, row_block, group_key(n), group_key(n + 1 < kGroups ? n + 1 : n));
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {  // byte 2 h + e: row half h, column e
          const int bit = (2 * m + i / 2) * kCols + 2 * n + i % 2;
          bits[bit / 32] |= uint32_t(keep_byte(keep.words[n % 2], i, threshold)) << (bit % 32);
        }
      }
    }
  }
  template <int kCols, int kWords>
  __device__ static bool kept_half_bit(const uint32_t (&bits)[kWords], int r, int c) {
    return (bits[(r * kCols + c) / 32] >> ((r * kCols + c) % 32)) & 1u;
  }

  // Zeroes the dropped entries of a thread's fragment of P (queries x keys) in rowcol view; coord holds the
  // tile coordinates, row0 / col0 the tile's first query / key in its sequence (col0 a multiple of 16).
  template <class TensorS, class TensorC>
  __device__ void apply(TensorS& S, const TensorC& coord, int row0, int col0) const {
    using namespace cute;
    constexpr int kRowTiles = decltype(size<0>(S))::value / 2, kBlocks = decltype(size<1>(S))::value / 4;
    static_assert(decltype(size<1>(S))::value % 4 == 0, "whole 16-key blocks per thread");
    CUTE_UNROLL
    for (int m = 0; m < kRowTiles; ++m) {
      KeepWords keep[(kBlocks + 1) / 2];
      draw</*kTransposed=*/false, kBlocks>(keep, (row0 + get<0>(coord(2 * m, 0))) >> 4, (col0 + get<1>(coord(0, 0))) >> 4);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          float& s = S(2 * m + h, c);
          s = kept<kBlocks>(keep, c / 4, h, c % 4) ? s : 0.f;
        }
      }
    }
  }
};
#endif

}  // namespace flash_attn2
