#!/bin/bash
# The SM80 tiles for smaller GPUs, forced on the GPU at hand: a reduced build with the compact tiles and
# the SM80 forward (D, default 64,160,256), then tests/test_smem_limits.py (TESTS to narrow it). A native
# crash prints its C++ stack (segv_trace.c, preloaded), resolved with addr2line; logs under $OUT.
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
if ! ls flash_attn2_cuda*.so > /dev/null 2>&1; then
  s=$(date +%s)
  FLASH_ATTN2_HEAD_DIMS=${D:-64,160,256} FLASH_ATTN2_COMPACT_TILES=1 FLASH_ATTN2_SM80=1 FLASH_ATTN2_CUDA_ARCHS=90 \
    python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
  echo "build $(( $(date +%s) - s )) s"; grep -o "libstdc++ from.*" $OUT/build.log | head -1; ldd flash_attn2_cuda*.so | grep stdc
fi
gcc -shared -fPIC -o /tmp/segv_trace.so benchmarks/dev/segv_trace.c
LD_PRELOAD=/tmp/segv_trace.so timeout ${PYTEST_S:-240} python3 -m pytest ${TESTS:-tests/test_smem_limits.py} -v -p no:faulthandler \
  -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -cE "PASSED" $OUT/pytest.log | sed 's/^/passed: /'; grep -E "FAILED|ERROR" $OUT/pytest.log | head
if grep -q "native stack" $OUT/pytest.log; then
  grep -B2 -A40 "native stack" $OUT/pytest.log | head -60
  so=$(ls flash_attn2_cuda*.so)
  grep -oE "flash_attn2_cuda[^(]*\(\+0x[0-9a-f]+\)" $OUT/pytest.log | grep -oE "0x[0-9a-f]+" | xargs -r addr2line -f -C -e $so | paste - -
fi
