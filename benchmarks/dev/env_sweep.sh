#!/bin/bash
# One build of the working tree (bf16, head dims $D, sm_90), then time_fwd.py CASES under each setting in
# SETTINGS (space-separated; each a comma-separated list of VAR=value, or "-" for none), one process per
# setting and round, the order rotated: for dev-only runtime knobs (e.g. the wip/dev-splits branch's
# FA2_DEV_SPLITS and FA2_DEV_SECTION) that would otherwise take one build per value.
# TESTS (pytest arguments) run on the build first, under TEST_SETTING if given.
#   D="128" SETTINGS="- FA2_DEV_SECTION=2 FA2_DEV_SECTION=0" CASES="128,1,8192,bwd,28,4,4" bash benchmarks/dev/env_sweep.sh
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
s=$(date +%s)
FLASH_ATTN2_HEAD_DIMS="${D:-128}" FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace \
  > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - s )) s"
rm -rf /tmp/sweep && mkdir -p /tmp/sweep && cp -r flash_attn2 flash_attn2_cuda*.so /tmp/sweep/
if [ -n "${TESTS:-}" ]; then  # under TEST_SETTING (same form as a setting), e.g. the order being swept
  test_env=(); [ -n "${TEST_SETTING:-}" ] && IFS=, read -r -a test_env <<< "$TEST_SETTING"
  env "${test_env[@]}" timeout 150 python3 -m pytest $TESTS -q -x -p no:cacheprovider 2>&1 | tail -2
fi
root=$(pwd); cd /tmp  # the repository root would shadow the build
read -r -a settings <<< "${SETTINGS:--}"
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
  for i in "${!settings[@]}"; do
    setting=${settings[$(( (i + round) % ${#settings[@]} ))]}
    env_args=(); [ "$setting" != "-" ] && IFS=, read -r -a env_args <<< "$setting"
    env "${env_args[@]}" PYTHONPATH=/tmp/sweep python3 $root/benchmarks/dev/time_fwd.py ${CASES:-128,1,2048,bwd} | sed "s/^/[$setting] /"
  done
done | sort -s -k2,4
