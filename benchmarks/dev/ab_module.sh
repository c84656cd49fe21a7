#!/bin/bash
# A/B of a benchmark module: A = a carried wheel ($WHEEL) or a variant directory holding csrc/ and flash_attn2/
# (variants.sh with FULL=1; built like B), B = the working tree built for head dims $D (bf16, sm_90; the build
# knobs exported around the call, e.g. FLASH_ATTN2_SM80=1, apply to both); TESTS (pytest paths) run on B
# first; then `python -m $MODULE` (e.g. "flash_attn2.bench.variants --hdims 128") for A and B in turn,
# ROUNDS times, the order rotated; logs under $OUT.
#   WHEEL=.whl/all/*.whl D=64,128 TESTS=tests/test_score_mods.py MODULE="flash_attn2.bench.variants --hdims 64 128" \
#     bash benchmarks/dev/ab_module.sh
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
rm -rf /tmp/ab_A /tmp/ab_B && mkdir -p /tmp/ab_A /tmp/ab_B
build() {  # $1: A or B, from the csrc/ and flash_attn2/ in the current directory
  local s=$(date +%s)
  FLASH_ATTN2_HEAD_DIMS=${D:-128} FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace \
    > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }
  echo "$1 built in $(( $(date +%s) - s )) s"; grep "spill stores" $OUT/build_$1.log | grep -v " 0 bytes spill" | sort | uniq -c | cut -c1-300
  cp -r flash_attn2 flash_attn2_cuda*.so /tmp/ab_$1/
}
if [ -d "$WHEEL/csrc" ]; then
  rm -rf /tmp/tree && mkdir /tmp/tree && cp -r csrc flash_attn2 /tmp/tree/
  rm -rf csrc flash_attn2 && cp -r $WHEEL/csrc $WHEEL/flash_attn2 . && build A
  rm -rf csrc flash_attn2 flash_attn2_cuda*.so && cp -r /tmp/tree/csrc /tmp/tree/flash_attn2 .
else
  wheel=$(readlink -f $(ls $WHEEL)) && (cd /tmp/ab_A && python3 -m zipfile -e "$wheel" .) || exit 1
fi
mkdir -p /tmp/ab_A/flash_attn2/bench && cp flash_attn2/bench/*.py /tmp/ab_A/flash_attn2/bench/  # the tree's benchmark modules on both sides
build B
if [ -n "${TESTS:-}" ]; then
  timeout ${PYTEST_S:-200} python3 -m pytest $TESTS -q -rf -p no:cacheprovider > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
fi
cd /tmp
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
  for x in $([ $((round % 2)) = 0 ] && echo "A B" || echo "B A"); do
    echo "== $x round $round"; PYTHONPATH=/tmp/ab_$x timeout ${MODULE_S:-150} python3 -m $MODULE --out-dir $OUT/$x 2>&1 | grep -v "skipped\|appended"
  done
done | tee $OUT/ab.log
