#!/bin/bash
# The device call for prepared/bwd_wide_dq64.patch (#49, TUNING 186; written in session 16, NOT run on a GPU): the
# d 192 wide backward's dQ in one 64-column GEMM and one hand-off a step. Builds on the CPU first (stripped, ~4 MB
# each; ~5 min each on two cores):
#   NAME=uM192 D=192 bash benchmarks/dev/build_so.sh                                              (main)
#   git worktree add /tmp/tD HEAD && (cd /tmp/tD && git apply benchmarks/dev/prepared/bwd_wide_dq64.patch)
#   NAME=uD192 D=192 bash benchmarks/dev/build_so.sh /tmp/tD
# then run(command="bash benchmarks/dev/prepared/bwd_wide_dq64.sh", carry=[".whl/uM192", ".whl/uD192"]), ~250 s:
# the MLA (192, 128) and plain d 192 backward A/B (M D M D), its tests, compute-sanitizer on d 192's backward.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/bwd_wide_dq64.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $L
for round in 1 2; do for x in M192 D192; do
  el "MLA fwd_bwd $x round $round"
  PYTHONPATH=$R:$R/.whl/u$x timeout 90 python3 benchmarks/dev/mla_bench.py --seqlens 4096 16384 --passes fwd_bwd \
    --rounds 2 2>&1 | grep seqlen | sed "s/^/$x /" | tee -a $L
  el "d 192 bwd breakdown $x round $round (causal 8k, non-causal 4k)"
  PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/bwd_breakdown.py 192,1,8192 192,0,4096 2>&1 | grep "per backward" \
    | sed "s/^/$x /" | tee -a $L
done; done
el "tests (uD192)"
PYTHONPATH=$R/.whl/uD192 timeout 200 python3 -m pytest tests/test_mla.py tests/test_backward.py tests/test_sinks.py \
  -k "192 or mla" -q -n 12 -p no:cacheprovider 2>&1 | tail -2 | tee -a $L
el "memcheck / racecheck of the backward (uD192: d 192 only)"
PYTHONPATH=$R:$R/.whl/uD192 timeout 120 compute-sanitizer --tool memcheck python3 benchmarks/dev/sanitize_bwd.py 2>&1 | tail -2 | tee -a $L
PYTHONPATH=$R:$R/.whl/uD192 timeout 120 compute-sanitizer --tool racecheck python3 benchmarks/dev/sanitize_bwd.py 2>&1 | tail -2 | tee -a $L
el done
