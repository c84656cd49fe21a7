// Which tile slots (common/tile_scheduler.h) a persistent Hopper block computes, and how its producer warp
// tells the other warps: all know the block's first slot; the producer walks on and publishes each next slot
// (then one past the last) with its tile in a small shared-memory ring. The forward walks with SlotWalk; the
// backward claims its slots itself (bwd_kernel.h) and shares the ring.
#pragma once

#include <cstring>
#include <type_traits>

#include "common/tile_scheduler.h"
#include "sm90/wgmma.h"

namespace flash_attn2::sm90 {

// A block's slots. Static: each section of per_section slots (CausalTileOrder's L2-sized sections, else all
// slots) in a zig-zag (block, 2 grid - 1 - block, 2 grid + block, ...), pairing a long causal tile with a
// short one. Dynamic (counter set, zeroed before the launch): the block's own index first, then the next
// unclaimed slot, claimed as the producer starts a tile's loads (one tile ahead of the consumers), so with
// slots sorted longest first the tiles go out greedily, longest first, however uneven they are. first()
// may be called by any thread; claim() and next() by the producer's whole warp.
struct SlotWalk {
  int num_slots, per_section, grid, block;
  int* counter;
  int section = 0, k = 0;

  __device__ int first() { return counter != nullptr ? block : static_slot(); }

  // Dynamic: claims a slot (lane 0's atomic; the result is read by next(), so the tile's loads hide its latency).
  __device__ int claim() {
    int claimed = 0;
    if (counter != nullptr && threadIdx.x % 32 == 0) claimed = atomicAdd(counter, 1);
    return claimed;
  }

  // The slot after this one (num_slots or more when done).
  __device__ int next(int claimed) {
    if (counter != nullptr) return grid + __shfl_sync(0xffffffffu, claimed, 0);
    ++k;
    return static_slot();
  }

 private:
  __device__ int static_slot() {
    for (; section < num_slots; section += per_section, k = 0) {
      const int j = k * grid + (k % 2 == 0 ? block : grid - 1 - block);
      if (j < min(per_section, num_slots - section)) return section + j;
    }
    return num_slots;
  }
};

// A slot and its tile (invalid past the last slot).
struct SlotTile {
  int slot;
  WorkTile tile;
};

// The producer's slots on their way to the consumer warpgroups, each with its tile: the slot-to-tile maps
// divide (and varlen's searches cu_seqlens), which the producer does once for all consumer warps, ahead of
// them. Written by the producer's leader, read by whole reader warps, each lane releasing the entry once it has
// it (one arrival per warp after __syncwarp is enough by the memory model, but compute-sanitizer's racecheck
// sees only the arriving lane's reads ordered before the next write).
template <int kStages, int kReaderWarps>
struct SlotRing {
  static constexpr int kWords = int(sizeof(SlotTile) / sizeof(int));
  static_assert(sizeof(SlotTile) % sizeof(int) == 0 && std::is_trivially_copyable_v<SlotTile>);
  int entry[kStages][kWords];
  uint64_t full[kStages], empty[kStages];

  __device__ void init() {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], 32 * kReaderWarps);
    }
  }

  // Where the n-th entry goes: for a producer that counts its entries instead of carrying a state.
  __device__ static PipelineState position(int n) { return PipelineState::after<kStages>(n); }

  // CUTLASS's barrier asm has no memory clobber: the compiler fences keep the entry's stores and loads
  // between the wait (acquire) and the arrive (release).
  __device__ void publish(const SlotTile& value, PipelineState& state, bool leader) {
    barrier_wait(&empty[state.stage], state.phase ^ 1);
    if (leader) {
      int words[kWords];
      memcpy(words, &value, sizeof(SlotTile));
      asm volatile("" ::: "memory");
      CUTE_UNROLL
      for (int i = 0; i < kWords; ++i) static_cast<volatile int*>(entry[state.stage])[i] = words[i];
      asm volatile("" ::: "memory");
      barrier_arrive(&full[state.stage]);
    }
    state.template advance<kStages>();
  }

  __device__ SlotTile receive(PipelineState& state) {
    barrier_wait(&full[state.stage], state.phase);
    asm volatile("" ::: "memory");
    int words[kWords];
    CUTE_UNROLL
    for (int i = 0; i < kWords; ++i) words[i] = static_cast<volatile int*>(entry[state.stage])[i];
    // Not needed for the ordering, but without it ptxas lays out the forward's tile loop otherwise: the d 256
    // forward spilled 232 B instead of 64 and ran 9-15% slower (TUNING 110).
    __syncwarp();
    barrier_arrive(&empty[state.stage]);
    state.template advance<kStages>();
    SlotTile value;
    memcpy(&value, words, sizeof(SlotTile));
    return value;
  }
};

}  // namespace flash_attn2::sm90
