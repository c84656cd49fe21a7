#!/bin/bash
# The SM80 forward on Hopper: a build with FLASH_ATTN2_SM80=1 for head dims $D (bf16, sm_90), the tests that
# force the SM80 path (-k sm80), and flash_attn2.bench.variants on it; logs under $OUT.
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
s=$(date +%s)
FLASH_ATTN2_SM80=1 FLASH_ATTN2_HEAD_DIMS=${D:-64,128} FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 \
  python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - s )) s"
timeout ${PYTEST_S:-200} python3 -m pytest ${TESTS:-tests/test_window.py tests/test_score_mods.py tests/test_forward.py} \
  -k "${K:-sm80}" -q -rf -p no:cacheprovider > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
timeout ${BENCH_S:-150} python3 -m flash_attn2.bench.variants --hdims ${HDIMS:-64 128} --backends flash_attn2_sm80 \
  --warmup-s 1 --out-dir $OUT 2>&1 | grep -v skipped | tee $OUT/variants.log
