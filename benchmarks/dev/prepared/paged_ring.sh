#!/bin/bash
# The device call of TUNING 205 (measured in session 20: Q 5 % faster at 1 x 4k on pages of 16, 4-5 % slower at
# 1 x 32k, 1.2-1.4 % at 1 x 1k; not landed): the narrow split kernel's paged chunks read their page-table entries
# from a ring per warp in shared memory, staged a window at a time outside the chunk loop's body. Q = one-page
# chunks (prepared/paged_ring.patch), G = main. (P, Q plus the chunks of rows on their own pages, measured no faster
# on pages of 1 and retired: paged_ring_rows.patch in git history, 03b386c.) Builds on the CPU (~5 min each):
#   FLASH_ATTN2_SM80=1 NAME=uG D=128 bash benchmarks/dev/build_so.sh                                  (main)
#   for x in Q:paged_ring; do git worktree add /tmp/t${x%:*} HEAD && (cd /tmp/t${x%:*} && \
#     git apply $PWD/benchmarks/dev/prepared/${x#*:}.patch) && FLASH_ATTN2_SM80=1 NAME=u${x%:*} D=64,128 \
#     bash benchmarks/dev/build_so.sh /tmp/t${x%:*}; done
# then run(command="bash benchmarks/dev/prepared/paged_ring.sh", carry=[".whl/uG", ".whl/uQ"]), ~200 s:
# paged_probe (G Q G Q), the kv-cache tests (with test_paged_long_splits) and sanitize_fwd (memcheck, racecheck) on Q.
# Session 20's rule: land Q if pages of 16 at 1 x 4k are >= 2 % faster in both rounds and no cell is >= 1 % slower
# in both (it was not: 1 x 32k pages of 16, 1 x 1k every paged layout).
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/paged_ring.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
for x in G Q G Q; do
  el "paged_probe u$x"
  PAGES="16 64 256 1" PYTHONPATH=$R:$R/.whl/u$x timeout 120 python3 benchmarks/dev/paged_probe.py 32,8,128 1,4096 1,1024 8,4096 1,32768 1,131072 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
  PAGES="16 64 1" PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/paged_probe.py 64,8,128 1,4096 64,1024 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
done
for x in Q; do
  el "tests on u$x"
  PYTHONPATH=$R/.whl/u$x timeout 200 python3 -m pytest tests/test_kvcache.py tests/test_combine.py tests/test_varlen_safety.py tests/test_sinks.py -q -n 12 -p no:cacheprovider 2>&1 | tail -1 | tee -a $L
  for tool in memcheck racecheck; do
    el "$tool of sanitize_fwd (u$x)"
    PYTHONPATH=$R:$R/.whl/u$x timeout 150 compute-sanitizer --tool $tool python3 benchmarks/dev/sanitize_fwd.py 2>&1 | tail -1 | tee -a $L
  done
done
el done
