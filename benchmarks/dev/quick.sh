#!/bin/bash
# A restricted build of the working tree (head dims $D, bf16, sm_90, in place), TESTS, then MODULE (python -m); logs under $OUT.
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
s=$(date +%s)
FLASH_ATTN2_HEAD_DIMS=${D:-128} FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace \
  > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - s )) s"; grep "spill stores" $OUT/build.log | grep -v " 0 bytes spill" | sort | uniq -c | cut -c1-300
grep "C7510" $OUT/build.log | sed 's/.*function .\(_Z[^ ]*\).*/C7510 (wgmma serialized across a call) in \1/' | sort -u
timeout ${PYTEST_S:-200} python3 -m pytest ${TESTS:-tests/test_forward.py} -q -rf -p no:cacheprovider > $OUT/pytest.log 2>&1
grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head -20; tail -2 $OUT/pytest.log
[ -n "${MODULE:-}" ] && timeout ${MODULE_S:-200} python3 -m $MODULE --out-dir $OUT 2>&1 | grep -v "skipped\|appended" | tee $OUT/module.log
exit 0
