#!/bin/bash
# The whole suite in two device calls, call b (after full_suite_a.sh in the same warm machine: its installed wheel):
# The rest of the suite on the wheel full_suite_a.sh installed (site-packages), the sanitizers, the C++ consumer.
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/full_suite_b.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
python3 -c "import flash_attn2_cuda, flash_attn2; print('installed', flash_attn2_cuda.__file__)" 2>&1 | tail -1 | tee -a $L
el "tests group 2"
timeout ${T2:-400} python3 -m pytest tests -q -n 12 -p no:cacheprovider -rf --ignore=tests/test_ring_nccl.py \
  --ignore=tests/test_kvcache.py --ignore=tests/test_combine.py --ignore=tests/test_sinks.py --ignore=tests/test_mla.py \
  --ignore=tests/test_api_validation.py --ignore=tests/test_varlen_safety.py --ignore=tests/test_ring_math.py \
  --ignore=tests/test_sass.py > $OUT/pytest2.log 2>&1; echo "pytest rc=$?" | tee -a $L
grep -E "^(FAILED|ERROR)" $OUT/pytest2.log | head -20 | tee -a $L; tail -1 $OUT/pytest2.log | tee -a $L
for script in sanitize_fwd sanitize_bwd; do
  el "$script memcheck"
  timeout ${SAN_S:-70} compute-sanitizer --tool memcheck python3 benchmarks/dev/$script.py 2>&1 | grep -E "ERROR SUMMARY|: ok$" | tail -6 | tee -a $L
done
el "cpp"
timeout ${CPP_S:-100} .ci/cpp_build > $OUT/cpp.log 2>&1; echo "cpp_build rc=$?" | tee -a $L
grep -E "ok$|FAIL|SKIP|cpp_build:" $OUT/cpp.log | tail -6 | tee -a $L
el done
