#!/bin/bash
# TUNING 198's premise test (written in session 18, NOT run on a GPU): timing-only probes of the MLA (192, 128)
# backward, results wrong on purpose. P1 = prepared/probe_mla_no_dv.patch (no warpgroup issues dV: the bound on
# hiding dV), P2 = prepared/probe_mla_do_once.patch (dO loaded on a block's first step only: the per-step dO load's
# price), against main (WM). Builds on the CPU first (~4-5 min each, d 192 bf16 sm_90a):
#   NAME=uWM D=192 bash benchmarks/dev/build_so.sh                                                   (main)
#   for x in no_dv:P1 do_once:P2; do git worktree add /tmp/t${x#*:} HEAD && (cd /tmp/t${x#*:} && git apply \
#     $PWD/benchmarks/dev/prepared/probe_mla_${x%:*}.patch) && NAME=u${x#*:} D=192 bash benchmarks/dev/build_so.sh /tmp/t${x#*:}; done
# then run(command="bash benchmarks/dev/prepared/probe_mla.sh", carry=[".whl/uWM", ".whl/uP1", ".whl/uP2"]), ~150 s.
# Decision (TUNING 198): build the deferred dV only if P1 and P2 together take >= 5 % off the MLA backward.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/probe_mla.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
for round in 1 2; do for x in WM P1 P2; do
  el "u$x round $round"
  PYTHONPATH=$R:$R/.whl/u$x timeout 90 python3 benchmarks/dev/mla_bench.py --seqlens 4096 16384 --passes fwd_bwd \
    --rounds 2 2>&1 | grep seqlen | sed "s/^/$x /" | tee -a $L
  PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/bwd_breakdown.py 192,1,8192 2>&1 | grep "per backward" \
    | sed "s/^/$x /" | tee -a $L
done; done
el done
