# A model of the Hopper forward's K ring, Q slabs, ping-pong turns and dropout's keep ring
# (prepared/producer_draws.patch) under random interleavings: mbarriers as phase counters with
# try_wait.parity's rule (a wait for parity p passes while the current phase's parity differs from p, so a
# use two ahead looks done), warpgroups that skip a tile's first blocks (as many as the kernel's tiles allow)
# or all of them (rows past the sequence), draws that lag by up to DRAW_STEPS scheduling steps. Checks that
# every consumer reads the K block and the keep bits of its own (tile, block) and that nothing deadlocks.
# TAKE_AFTER_RELEASE=1 models the patch's first version (bits taken after K's release), which a review
# thought racy: here the Q slabs' order (a warpgroup's next Q is issued only once the previous warpgroup's
# slab is free, after its last S = Q K^T and so its bits) keeps it exact too. With skips beyond what the
# tiles allow, the K ring itself would fail: that bound is part of why it is exact.
#   python benchmarks/dev/sim_fwd_keep.py [runs]
import os
import random
import sys

STAGES = 2
TAKE_AFTER_RELEASE = os.environ.get("TAKE_AFTER_RELEASE") == "1"
DRAW_STEPS = int(os.environ.get("DRAW_STEPS", "12"))  # a draw takes 1..DRAW_STEPS scheduling steps


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0  # phase: completed phases

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def ready(self, parity):  # try_wait.parity
        return (self.phase & 1) != parity


class State:
    def __init__(self):
        self.stage, self.phase = 0, 0

    def advance(self, n=1):
        for _ in range(n):
            self.stage += 1
            if self.stage == STAGES:
                self.stage, self.phase = 0, self.phase ^ 1

    def copy(self):
        s = State()
        s.stage, s.phase = self.stage, self.phase
        return s


def make_tiles(rng, groups, n_tiles, max_skip):
    """Tiles as the kernel meets them: later rows see at least the blocks earlier ones do (causal), a valid
    warpgroup skips at most max_skip of the tile's first blocks (64 rows against kBlockN: 2 with 192-row tiles
    and 128-key blocks, 1 at d > 128), the last valid one none; warpgroups past the sequence see nothing."""
    tiles = []
    for t in range(n_tiles):
        n_min, n_max = 0, rng.randint(1, 6)
        valid = rng.choice([groups] * 3 + list(range(1, groups + 1)))
        skips = sorted((rng.randint(0, min(max_skip, n_max - 1)) for _ in range(valid - 1)), reverse=True) + [0]
        wg = [n_max - k for k in skips] + [n_min] * (groups - valid)
        tiles.append((t, n_min, n_max, wg))
    return tiles


def run(seed, groups, pingpong):
    rng = random.Random(seed)
    tiles = make_tiles(rng, groups, rng.randint(1, 12), 2 if pingpong else 1)
    k_full = [Barrier(1) for _ in range(STAGES)]
    k_empty = [Barrier(groups) for _ in range(STAGES)]
    keep_full = [Barrier(1) for _ in range(STAGES)]
    keep_empty = [Barrier(groups) for _ in range(STAGES)]
    q_full = [Barrier(1) for _ in range(groups)]
    q_empty = [Barrier(1) for _ in range(groups)]
    k_data, keep_data = [None] * STAGES, [None] * STAGES
    turns_done = [0] * groups

    def producer():  # K[n_max - 1], each warpgroup's Q once its slab is free, then the other K blocks
        s = State()
        for tile, (t, n_min, n_max, wg) in enumerate(tiles):
            for n in range(n_max - 1, n_min - 1, -1):
                yield lambda s=s: k_empty[s.stage].ready(s.phase ^ 1)
                k_data[s.stage] = (t, n)
                k_full[s.stage].arrive()  # TMA landed (modelled as at once)
                for w in range(groups):
                    if n >= wg[w]:
                        k_empty[s.stage].arrive()
                s.advance()
                if n == n_max - 1:
                    for w in range(groups):
                        yield lambda w=w, q=tile & 1: q_empty[w].ready(q ^ 1)
                        q_full[w].arrive()

    def drawer():
        s = State()
        for t, n_min, n_max, wg in tiles:
            for n in range(n_max - 1, n_min - 1, -1):
                yield lambda s=s: keep_empty[s.stage].ready(s.phase ^ 1)
                keep_data[s.stage] = None  # being drawn, for a random while (the draw warps may lag)
                for _ in range(rng.randint(1, DRAW_STEPS)):
                    yield lambda: True
                keep_data[s.stage] = (t, n)
                keep_full[s.stage].arrive()
                for w in range(groups):
                    if n >= wg[w]:
                        keep_empty[s.stage].arrive()
                s.advance()

    def consumer(w):
        k = State()
        turn = 0

        def turn_begin():  # warpgroup w's k-th turn follows w - 1's k-th (warpgroup 0's, the last one's k - 1-th)
            nonlocal turn
            if pingpong:
                yield (lambda: turns_done[w - 1] >= turn + 1) if w > 0 else (lambda: turns_done[groups - 1] >= turn)
            turn += 1

        def turn_end():
            turns_done[w] += 1
            yield lambda: True

        def take(n, t):
            yield lambda: keep_full[k.stage].ready(k.phase)
            assert keep_data[k.stage] == (t, n), f"seed {seed}: wg {w} read {keep_data[k.stage]} for {(t, n)}"
            keep_empty[k.stage].arrive()

        for tile, (t, n_min, n_max, wg) in enumerate(tiles):
            own = wg[w] - n_min
            skipped = n_max - wg[w]
            k.advance(skipped)
            for _ in range(skipped + (own == 0)):
                yield from turn_begin()
                yield from turn_end()
            yield lambda q=tile & 1: q_full[w].ready(q)
            if own == 0:
                q_empty[w].arrive()
            for n in range(wg[w] - 1, n_min - 1, -1):
                yield from turn_begin()
                yield lambda: k_full[k.stage].ready(k.phase)
                assert k_data[k.stage] == (t, n), f"seed {seed}: wg {w} K {k_data[k.stage]} for {(t, n)}"
                yield from turn_end()
                if not TAKE_AFTER_RELEASE:
                    yield from take(n, t)
                stage_taken = k.copy()
                k_empty[k.stage].arrive()
                k.advance()
                if TAKE_AFTER_RELEASE:
                    saved = k
                    k = stage_taken
                    yield from take(n, t)
                    k = saved
            if own > 0:
                q_empty[w].arrive()  # the last S = Q K^T is done
                yield from turn_begin()
                yield from turn_end()

    actors = [producer(), drawer()] + [consumer(w) for w in range(groups)]
    waits = [lambda: True] * len(actors)
    alive = list(range(len(actors)))
    while alive:
        ready = [i for i in alive if waits[i]()]
        if not ready:
            return f"seed {seed}: deadlock (groups {groups}, pingpong {pingpong})"
        i = rng.choice(ready)
        try:
            waits[i] = next(actors[i])
        except StopIteration:
            alive.remove(i)
        except AssertionError as e:
            return str(e)
    return None


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    failures = 0
    for seed in range(runs):
        for groups, pingpong in ((2, True), (3, True), (2, False)):
            err = run(seed, groups, pingpong)
            if err:
                failures += 1
                if failures <= 5:
                    print(err)
    print(f"{runs} runs x 3 configurations: {failures} failures")
