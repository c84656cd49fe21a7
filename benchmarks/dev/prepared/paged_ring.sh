#!/bin/bash
# The device call for TUNING 203-204 (prepared in session 19, NOT run on a GPU): the narrow split kernel's paged
# chunks read their page-table entries from a ring per warp in shared memory, staged a window at a time outside the
# chunk loop's body. Q = one-page chunks only (prepared/paged_ring.patch), P = Q and the chunks of rows on their own
# pages (pages of 1, and sizes that are not a multiple of 16; prepared/paged_ring_rows.patch), G = main. Builds on the
# CPU (~5 min each):
#   FLASH_ATTN2_SM80=1 NAME=uG D=128 bash benchmarks/dev/build_so.sh                                  (main)
#   for x in Q:paged_ring P:paged_ring_rows; do git worktree add /tmp/t${x%:*} HEAD && (cd /tmp/t${x%:*} && \
#     git apply $PWD/benchmarks/dev/prepared/${x#*:}.patch) && FLASH_ATTN2_SM80=1 NAME=u${x%:*} D=64,128 \
#     bash benchmarks/dev/build_so.sh /tmp/t${x%:*}; done
# then run(command="bash benchmarks/dev/prepared/paged_ring.sh", carry=[".whl/uG", ".whl/uQ", ".whl/uP"]), ~300 s:
# paged_probe (G Q P G Q P), the kv-cache tests (with test_paged_long_splits) and sanitize_fwd (memcheck, racecheck)
# on Q and P.
# Prediction: pages of 16 at 1 x 4k 1.11 -> ~1.05 of contiguous (Q and P), pages of 64 / 256 at main's or better,
# 1 x 32k pages of 16 not worse than main's 1.075; P: pages of 1 at 1 x 4k 1.33 -> ~1.2 (<= 1.15x pages of 64).
# Land the better of Q / P if pages of 16 (and for P pages of 1) at 1 x 4k are >= 2 % faster in both rounds and no
# cell is >= 1 % slower in both.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/paged_ring.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
for x in G Q P G Q P; do
  el "paged_probe u$x"
  PAGES="16 64 256 1" PYTHONPATH=$R:$R/.whl/u$x timeout 120 python3 benchmarks/dev/paged_probe.py 32,8,128 1,4096 1,1024 8,4096 1,32768 1,131072 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
  PAGES="16 64 1" PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/paged_probe.py 64,8,128 1,4096 64,1024 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
done
for x in Q P; do
  el "tests on u$x"
  PYTHONPATH=$R/.whl/u$x timeout 200 python3 -m pytest tests/test_kvcache.py tests/test_combine.py tests/test_varlen_safety.py tests/test_sinks.py -q -n 12 -p no:cacheprovider 2>&1 | tail -1 | tee -a $L
  for tool in memcheck racecheck; do
    el "$tool of sanitize_fwd (u$x)"
    PYTHONPATH=$R:$R/.whl/u$x timeout 150 compute-sanitizer --tool $tool python3 benchmarks/dev/sanitize_fwd.py 2>&1 | tail -1 | tee -a $L
  done
done
el done
