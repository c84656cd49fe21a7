#!/bin/bash
# Full default build (a wheel, kept under $OUT/wheel), the whole GPU test suite, compute-sanitizer on small
# forward and backward calls; then the FA2 grid forward (flash_attn2, sdpa_cudnn) and the model shapes (with sdpa_flash
# and torch varlen_attn); logs under $OUT. STAGE=test stops after the tests; STAGE=bench skips the build
# and tests and installs a flash_attn2 wheel carried in .whl/ (one call's ten minutes may not fit both);
# STAGE=bench_bwd does the same for the backward and fwd_bwd grid rows (HDIMS) and the HF training step (MODELS=1:
# the model suite's bwd / fwd_bwd rows too), its CSVs and plots packed in $OUT/results.tgz;
# STAGE=retest installs the carried wheel and runs TESTS (pytest node ids or -k ...), for the rest of a suite that
# did not fit one call (PYTEST_S, default 330, bounds pytest). SANITIZE=0/1 turns the sanitizers off in the test
# stage / on in retest (SANITIZE_S, default 90, bounds each of the four runs). AB_WHEELS="wheel ..." with
# CASES: STAGE=test times the new wheel against those (ab_wheels.sh) between the build and the tests.
# FIRST_TESTS: see first_tests below. CPP=1: the C++ consumer (.ci/cpp_build: CMake build of the torch-free library,
# the example run on the GPU) after the tests of the test and retest stages.
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
STAGE=${STAGE:-all}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $OUT/summary.txt
rm -f flash_attn2_cuda*.so
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
sanitize() {
  for script in sanitize_fwd sanitize_bwd; do for tool in memcheck racecheck; do
    echo -n "$script $tool: " | tee -a $OUT/summary.txt
    PYTHONPATH= timeout ${SANITIZE_S:-90} compute-sanitizer --tool $tool python3 benchmarks/dev/$script.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | head -2 | tee -a $OUT/summary.txt
  done; done
}
# FIRST_TESTS (pytest node ids or -k ...): run before the suite under their own timeout (FIRST_S, default 60), so a
# hang-prone test (the deterministic turn waits) cannot take the suite's time with it.
first_tests() {
  [ -z "${FIRST_TESTS:-}" ] && return
  timeout ${FIRST_S:-60} python3 -m pytest $FIRST_TESTS -v -p no:cacheprovider > $OUT/pytest_first.log 2>&1
  echo "first tests rc=$? (124: timed out)" | tee -a $OUT/summary.txt
  grep -E "^(FAILED|ERROR)" $OUT/pytest_first.log | head; tail -1 $OUT/pytest_first.log | tee -a $OUT/summary.txt
}
cpp_build() {
  [ "${CPP:-0}" = 1 ] || return 0
  timeout ${CPP_S:-200} .ci/cpp_build > $OUT/cpp.log 2>&1; echo "cpp_build rc=$?" | tee -a $OUT/summary.txt
  grep -E "ok$|FAIL|SKIP|cpp_build:" $OUT/cpp.log | tail -12 | tee -a $OUT/summary.txt
}
if [ "$STAGE" = retest ]; then
  python3 -m pip install -q --no-deps .whl/flash_attn2-*.whl
  first_tests
  timeout ${PYTEST_S:-330} python3 -m pytest ${TESTS:-tests} -v -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?" | tee -a $OUT/summary.txt
  grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log | tee -a $OUT/summary.txt
  [ "${SANITIZE:-0}" = 1 ] && sanitize
  cpp_build
  exit 0
fi
if [ "$STAGE" != bench ] && [ "$STAGE" != bench_bwd ]; then
  # NVCC_MEM=1: each nvcc job's peak memory and time in $OUT/nvcc_mem.log (benchmarks/dev/nvcc_mem.py)
  [ "${NVCC_MEM:-0}" = 1 ] && export PYTORCH_NVCC="python3 $PWD/benchmarks/dev/nvcc_mem.py" NVCC_MEM_LOG=$OUT/nvcc_mem.log
  s=$(date +%s); python3 -m pip wheel --no-build-isolation --no-deps -v -w $OUT/wheel . > $OUT/build.log 2>&1; rc=$?
  echo "build rc=$rc in $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt
  [ -f $OUT/nvcc_mem.log ] && sort -n $OUT/nvcc_mem.log | tail -3 | tee -a $OUT/summary.txt
  grep "spill stores" $OUT/build.log | grep -v " 0 bytes spill" | grep fwd_kernel_sm90 | tee -a $OUT/summary.txt
  # ptxas C7510: a wgmma pipeline crossing a call (a helper left out of line), serialized: always a regression.
  grep "C7510" $OUT/build.log | sed 's/.*function .\(_Z[^ ]*\).*/C7510 in \1/' | sort -u | tee -a $OUT/summary.txt
  [ $rc -eq 0 ] || { tail -30 $OUT/build.log; exit 1; }
  python3 -m pip install -q --no-deps $OUT/wheel/flash_attn2-*.whl
  if [ -n "${AB_WHEELS:-}" ]; then  # the new wheel timed against carried ones (last letter) before the tests
    WHEELS="$AB_WHEELS $(ls $OUT/wheel/flash_attn2-*.whl)" timeout ${AB_S:-200} bash benchmarks/dev/ab_wheels.sh 2>&1 | tee $OUT/ab.log
  fi
  first_tests
  timeout ${PYTEST_S:-330} python3 -m pytest ${TESTS:-tests} -v -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?" | tee -a $OUT/summary.txt
  grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log | tee -a $OUT/summary.txt
  [ "${SANITIZE:-1}" = 1 ] && sanitize
  cpp_build
else
  python3 -m pip install -q --no-deps .whl/flash_attn2-*.whl
fi
[ "$STAGE" = test ] && exit 0
cd /tmp
if [ "$STAGE" = bench_bwd ]; then  # the backward rows (#10), one process (and CSV under $OUT/d<hdim>) per head dim
  for d in ${HDIMS:-64 128 256}; do  # about 50-60 s each on an H100
    timeout 185 python3 -c "import sys; from flash_attn2.bench.grid import main; main(sys.argv[1:])" --impls flash_attn2 sdpa_cudnn sdpa_flash \
      --passes bwd fwd_bwd --hdims $d --reps 10 --warmup-s 2 --out-dir $OUT/d$d > $OUT/bench_bwd_d$d.log 2>&1; tail -3 $OUT/bench_bwd_d$d.log
  done
  timeout 150 python3 -m flash_attn2.bench.hf --out-dir $OUT 2>&1 | tail -4
  if [ -n "${MODELS:-}" ]; then  # the model suite's backward rows too (about 150 s)
    timeout 250 python3 -m flash_attn2.bench.models --impls flash_attn2 sdpa_cudnn sdpa_flash --passes bwd fwd_bwd \
      --reps 10 --out-dir $OUT/models > $OUT/models.log 2>&1; tail -4 $OUT/models.log
  fi
  # At most 8 files come back from $OUT: the CSVs and plots travel as one archive.
  (cd $OUT && tar czf results.tgz $(ls -d d[0-9]* models *.csv 2>/dev/null) && rm -rf d[0-9]* models *.csv)
  exit 0
fi
timeout 260 python3 -c "import sys; from flash_attn2.bench.grid import main; main(sys.argv[1:])" --impls flash_attn2 sdpa_cudnn --passes fwd --out-dir $OUT 2>&1 > $OUT/bench.log; tail -4 $OUT/bench.log
timeout 300 python3 -m flash_attn2.bench.models --impls flash_attn2 sdpa_cudnn sdpa_flash torch_varlen --passes fwd fwd_train --reps 10 --out-dir $OUT > $OUT/models.log 2>&1; tail -8 $OUT/models.log
