#!/bin/bash
# The whole suite on both paths from a full build made on the CPU (session 17's way: no device time spent
# compiling). On the CPU first (~32 min on two cores; 38 MB stripped, fits the carry with the repo):
#   rm -f flash_attn2_cuda*.so && FLASH_ATTN2_SM80=1 FLASH_ATTN2_CUDA_ARCHS=90 MAX_JOBS=2 \
#     /root/.pyenv/versions/3.12.1/bin/python3.12 setup.py build_ext --inplace
#   mkdir -p .whl/uF && cp flash_attn2_cuda.cpython-312-*.so .whl/uF/ && strip --strip-unneeded .whl/uF/*.so
# then two device calls, the second at once after the first (carry [".whl/uF", ".whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl"]):
#   PART=a bash benchmarks/dev/suite_both_paths.sh   (~320 s: Hopper path, -n 12; memcheck and racecheck)
#   PART=b bash benchmarks/dev/suite_both_paths.sh   (~450 s: SM80 path, FLASH_ATTN2_BACKEND=sm80; .ci/cpp_build)
# The device's own compile time (<= 5 min on 16 cores) is measured by full_suite_a.sh, not here.
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PART=${PART:?a or b}; L=$OUT/suite_$PART.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
export PYTHONPATH=$R:$R/.whl/uF
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
python3 -c "import torch, flash_attn2_cuda; print('ext', flash_attn2_cuda.__file__)" 2>&1 | tail -1 | tee -a $L
if [ "$PART" = a ]; then
  el "whole suite, Hopper path"
  timeout ${T1:-330} python3 -m pytest tests -q -n 12 -p no:cacheprovider -rf --ignore=tests/test_ring_nccl.py > $OUT/pytest_sm90.log 2>&1
  echo "pytest rc=$?" | tee -a $L; grep -E "^(FAILED|ERROR)" $OUT/pytest_sm90.log | head -30 | tee -a $L; tail -1 $OUT/pytest_sm90.log | tee -a $L
  for x in "memcheck sanitize_fwd 60" "memcheck sanitize_bwd 60" "racecheck sanitize_fwd 90" "racecheck sanitize_bwd 150"; do set -- $x
    el "$1 $2"
    timeout $3 compute-sanitizer --tool $1 python3 $R/benchmarks/dev/$2.py 2>&1 | grep -E "SUMMARY|: ok$|rror" | tail -8 | tee -a $L
  done
else
  el "whole suite, SM80 path"
  FLASH_ATTN2_BACKEND=sm80 timeout ${T2:-330} python3 -m pytest tests -q -n 12 -p no:cacheprovider -rf --ignore=tests/test_ring_nccl.py > $OUT/pytest_sm80.log 2>&1
  echo "pytest rc=$?" | tee -a $L; grep -E "^(FAILED|ERROR)" $OUT/pytest_sm80.log | head -30 | tee -a $L; tail -1 $OUT/pytest_sm80.log | tee -a $L
  el "cpp"
  python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl 2>&1 | tail -1
  timeout ${CPP_S:-220} .ci/cpp_build > $OUT/cpp.log 2>&1; echo "cpp_build rc=$?" | tee -a $L
  grep -E "ok$|FAIL|SKIP|cpp_build:" $OUT/cpp.log | tail -6 | tee -a $L
fi
el done
