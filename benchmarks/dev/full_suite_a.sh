#!/bin/bash
# The whole suite in two device calls (each under 600 s; gpu_full.sh's one call does not fit both), call a:
# Full default build of the tree (wheel installed into site-packages, kept in /tmp/wheel), then the kv-cache,
# combine, sinks, MLA, validation, varlen-safety, ring-math and SASS tests (-n 12).
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/full_suite_a.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
rm -f flash_attn2_cuda*.so
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
el build; nproc | tee -a $L
s=$(date +%s); timeout 330 python3 -m pip wheel --no-build-isolation --no-deps -v -w /tmp/wheel . > $OUT/build.log 2>&1; rc=$?
el "build rc=$rc in $(( $(date +%s) - s )) s"
grep "flash_attn2 build:" $OUT/build.log | cut -c1-300 | tee -a $L
grep "spill stores" $OUT/build.log | grep -v " 0 bytes spill" | sed -E 's/.*function .(_Z[^ ]*)..*, ([0-9]+ bytes spill stores).*/\2 \1/' | cut -c1-200 | sort | uniq -c | sort -rn | head -40 > $OUT/spills.txt
grep -c "C7510" $OUT/build.log | sed 's/^/C7510 lines: /' | tee -a $L
[ $rc -eq 0 ] || { tail -30 $OUT/build.log | tee -a $L; exit 1; }
python3 -m pip install -q --no-deps --force-reinstall /tmp/wheel/flash_attn2-*.whl 2>&1 | tail -2
el "tests group 1"
timeout ${T1:-240} python3 -m pytest tests/test_kvcache.py tests/test_combine.py tests/test_sinks.py tests/test_mla.py \
  tests/test_api_validation.py tests/test_varlen_safety.py tests/test_ring_math.py tests/test_sass.py \
  -q -n 12 -p no:cacheprovider -rf > $OUT/pytest1.log 2>&1; echo "pytest rc=$?" | tee -a $L
grep -E "^(FAILED|ERROR)" $OUT/pytest1.log | head -20 | tee -a $L; tail -1 $OUT/pytest1.log | tee -a $L
el done
