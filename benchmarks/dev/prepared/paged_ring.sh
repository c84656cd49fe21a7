#!/bin/bash
# The device call for TUNING 203 (prepared in session 19, NOT run on a GPU): the narrow split kernel's one-page chunks
# read their page-table entries from a ring per warp in shared memory, staged a 32-chunk window at a time outside the
# chunk loop's body (prepared/paged_ring.patch). G = main's split kernel, Q = the ring. Builds on the CPU (~5 min):
#   FLASH_ATTN2_SM80=1 NAME=uG D=128 bash benchmarks/dev/build_so.sh                                  (main)
#   git worktree add /tmp/tR HEAD && (cd /tmp/tR && git apply $PWD/benchmarks/dev/prepared/paged_ring.patch)
#   FLASH_ATTN2_SM80=1 NAME=uQ D=64,128 bash benchmarks/dev/build_so.sh /tmp/tR
# then run(command="bash benchmarks/dev/prepared/paged_ring.sh", carry=[".whl/uG", ".whl/uQ"]), ~190 s:
# paged_probe (G Q G Q), the kv-cache tests (with test_paged_long_splits) and sanitize_fwd (memcheck, racecheck) on Q.
# Prediction: 1 x 4k pages of 16 1.11 -> ~1.05 of contiguous, pages of 64 / 256 at main's (1.04-1.05) or better,
# 1 x 32k pages of 16 not worse than main's 1.075. Land if pages of 16 at 1 x 4k are >= 2 % faster in both rounds
# and no cell is >= 1 % slower in both.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/paged_ring.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
for x in G Q G Q; do
  el "paged_probe u$x"
  PAGES="16 64 256 1" PYTHONPATH=$R:$R/.whl/u$x timeout 120 python3 benchmarks/dev/paged_probe.py 32,8,128 1,4096 1,1024 8,4096 1,32768 1,131072 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
  PAGES="16 64" PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/paged_probe.py 64,8,128 1,4096 64,1024 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
done
el "tests on uQ"
PYTHONPATH=$R/.whl/uQ timeout 200 python3 -m pytest tests/test_kvcache.py tests/test_combine.py tests/test_varlen_safety.py tests/test_sinks.py -q -n 12 -p no:cacheprovider 2>&1 | tail -1 | tee -a $L
for tool in memcheck racecheck; do
  el "$tool of sanitize_fwd (uQ)"
  PYTHONPATH=$R:$R/.whl/uQ timeout 150 compute-sanitizer --tool $tool python3 benchmarks/dev/sanitize_fwd.py 2>&1 | tail -1 | tee -a $L
done
el done
