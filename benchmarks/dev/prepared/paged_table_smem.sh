#!/bin/bash
# The device call for prepared/paged_table_smem.patch (TUNING 197; written in session 18, NOT run on a GPU): the
# narrow split kernel takes its page-table entries (one-page chunks and pages of one row alike) from the split's
# slice staged in shared memory (cp.async before the first chunk), not from global loads in the chunk loop. Builds on the CPU first (~4-6 min each):
#   FLASH_ATTN2_SM80=1 NAME=uG D=128 bash benchmarks/dev/build_so.sh                                  (main)
#   git worktree add /tmp/tS HEAD && (cd /tmp/tS && git apply benchmarks/dev/prepared/paged_table_smem.patch)
#   FLASH_ATTN2_SM80=1 NAME=uS D=128 bash benchmarks/dev/build_so.sh /tmp/tS
# then run(command="bash benchmarks/dev/prepared/paged_table_smem.sh", carry=[".whl/uG", ".whl/uS"]), ~150 s:
# paged_probe (G S G S), the kv-cache tests and sanitize_fwd (memcheck, racecheck) on S.
# Prediction: pages of 16 at 32 / 8 1 x 4k 1.11 -> ~1.05-1.07 of contiguous, pages of 1 1.32 -> ~1.2; 64 / 256 +-1 %;
# refuted if pages of 16 are not >= 2 % faster at 1 x 4k in both rounds or any cell is >= 1 % slower in both.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/paged_table_smem.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
for x in G S G S; do
  el "paged_probe u$x"
  PAGES="16 64 256 1" PYTHONPATH=$R:$R/.whl/u$x timeout 120 python3 benchmarks/dev/paged_probe.py 32,8,128 1,4096 1,1024 8,4096 1,32768 1,131072 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
  PAGES="16 64" PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/paged_probe.py 64,8,128 1,4096 64,1024 2>&1 | grep "round 1" | sed "s/^/$x /" | tee -a $L
done
el "tests on uS"
PYTHONPATH=$R/.whl/uS timeout 200 python3 -m pytest tests/test_kvcache.py tests/test_combine.py tests/test_varlen_safety.py tests/test_sinks.py -q -n 12 -p no:cacheprovider 2>&1 | tail -1 | tee -a $L
for tool in memcheck racecheck; do
  el "$tool of sanitize_fwd (uS)"
  PYTHONPATH=$R:$R/.whl/uS timeout 150 compute-sanitizer --tool $tool python3 benchmarks/dev/sanitize_fwd.py 2>&1 | tail -1 | tee -a $L
done
el done
