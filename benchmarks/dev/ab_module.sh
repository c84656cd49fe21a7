#!/bin/bash
# A/B of a benchmark module: A = a carried wheel ($WHEEL), B = the working tree built for head dims $D (bf16,
# sm_90); TESTS (pytest paths) run on B first; then `python -m $MODULE` (e.g. "flash_attn2.benchmark_variants
# --hdims 128") for A and B in turn, ROUNDS times, the order rotated; logs under $OUT.
#   WHEEL=.whl/all/*.whl D=64,128 TESTS=tests/test_alibi.py MODULE="flash_attn2.benchmark_variants --hdims 64 128" \
#     bash benchmarks/dev/ab_module.sh
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
rm -rf /tmp/ab_A /tmp/ab_B && mkdir -p /tmp/ab_A /tmp/ab_B
wheel=$(readlink -f $(ls $WHEEL)) && (cd /tmp/ab_A && python3 -m zipfile -e "$wheel" .) || exit 1
cp flash_attn2/benchmark*.py /tmp/ab_A/flash_attn2/  # the tree's benchmark modules on both sides
s=$(date +%s)
FLASH_ATTN2_HEAD_DIMS=${D:-128} FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace \
  > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "B built in $(( $(date +%s) - s )) s"; grep "spill stores" $OUT/build.log | grep -v " 0 bytes spill" | sort | uniq -c | cut -c1-300
cp -r flash_attn2 flash_attn2_cuda*.so /tmp/ab_B/
if [ -n "${TESTS:-}" ]; then
  timeout ${PYTEST_S:-200} python3 -m pytest $TESTS -q -rf -p no:cacheprovider > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
fi
cd /tmp
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
  for x in $([ $((round % 2)) = 0 ] && echo "A B" || echo "B A"); do
    echo "== $x round $round"; PYTHONPATH=/tmp/ab_$x timeout ${MODULE_S:-150} python3 -m $MODULE --out-dir $OUT/$x 2>&1 | grep -v "skipped\|appended"
  done
done | tee $OUT/ab.log
