#!/bin/bash
# The device call that measured prepared/bwd_wide_dq64.patch (TUNING 186, landed in 190) and, on top of it,
# prepared/bwd_wide_order.patch (187; measured mixed in 190, not landed). To run the order patch (or a gated version
# of it) against main now: builds on the CPU first (stripped; ~3-5 min each on two cores):
#   NAME=uWM D=192,256 bash benchmarks/dev/build_so.sh                                             (main)
#   git worktree add /tmp/tO HEAD && (cd /tmp/tO && git apply benchmarks/dev/prepared/bwd_wide_order.patch)
#   NAME=uWO D=192,256 bash benchmarks/dev/build_so.sh /tmp/tO
# then run(command="VARIANTS='WM WO' bash benchmarks/dev/prepared/bwd_wide_dq64.sh", carry=[".whl/uWM", ".whl/uWO"]),
# ~250 s: the MLA (192, 128) and plain d 192 backward, interleaved twice, d 256; tests and compute-sanitizer
# (memcheck, racecheck) on the last variant.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/bwd_wide.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
VARIANTS=${VARIANTS:-WM WD WO}; LAST=${VARIANTS##* }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $L
for round in 1 2; do for x in $VARIANTS; do
  el "MLA fwd_bwd $x round $round"
  PYTHONPATH=$R:$R/.whl/u$x timeout 90 python3 benchmarks/dev/mla_bench.py --seqlens 4096 16384 --passes fwd_bwd \
    --rounds 2 2>&1 | grep seqlen | sed "s/^/$x /" | tee -a $L
  el "bwd breakdown $x round $round (d 192 causal 8k, non-causal 4k; d 256 causal 8k where built)"
  PYTHONPATH=$R:$R/.whl/u$x timeout 90 python3 benchmarks/dev/bwd_breakdown.py 192,1,8192 192,0,4096 256,1,8192 2>&1 \
    | grep "per backward" | sed "s/^/$x /" | tee -a $L
done; done
el "tests (u$LAST)"
PYTHONPATH=$R/.whl/u$LAST timeout 240 python3 -m pytest tests/test_mla.py tests/test_backward.py tests/test_sinks.py \
  tests/test_dropout.py -k "192 or 256 or mla" -q -n 12 -p no:cacheprovider 2>&1 | tail -2 | tee -a $L
for tool in memcheck racecheck; do
  el "$tool of the backward (u$LAST)"
  PYTHONPATH=$R:$R/.whl/u$LAST timeout 150 compute-sanitizer --tool $tool python3 benchmarks/dev/sanitize_bwd.py 2>&1 \
    | tail -2 | tee -a $L
done
el done
