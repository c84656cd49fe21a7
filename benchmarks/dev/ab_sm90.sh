#!/bin/bash
# A/B of the Hopper forward: the sm90 headers in $OLD (A) against the working tree (B), bf16 head dims $D; timed
# interleaved (CASES="d,causal,seqlen ..."), tests on B, SAN=1 adds memcheck/racecheck.
# $OLD must lie in the working tree (untracked) to reach the device, e.g. for f in fwd_kernel_sm90.h fwd_launch_sm90.h
# fwd_traits_sm90.h wgmma.h; do git show REF:csrc/kernels/sm90/$f > benchmarks/dev/old/$f; done
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
D=${D:-256}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/*.whl
build() {  # $1: dir
  FLASH_ATTN2_HEAD_DIMS=$D FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }
  mkdir -p /tmp/$1 && cp -r flash_attn2 flash_attn2_cuda*.so /tmp/$1/
}
mkdir -p /tmp/new_h && cp csrc/kernels/sm90/{fwd_kernel_sm90.h,fwd_launch_sm90.h,fwd_traits_sm90.h,wgmma.h} /tmp/new_h/
cp ${OLD:-benchmarks/dev/old}/*.h csrc/kernels/sm90/ && s=$(date +%s) && build A && echo "A built in $(( $(date +%s) - s )) s"
cp /tmp/new_h/*.h csrc/kernels/sm90/ && s=$(date +%s) && build B && echo "B built in $(( $(date +%s) - s )) s"
timeout 150 python3 -m pytest tests/test_forward.py tests/test_varlen_safety.py -q -x -p no:cacheprovider 2>&1 | tail -2
if [ -n "${SAN:-}" ]; then
  for tool in memcheck racecheck; do
    PYTHONPATH=/tmp/B timeout 120 compute-sanitizer --tool $tool python3 benchmarks/dev/sanitize_fwd.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small:|Error" | head -5
  done
fi
for c in ${CASES:-128,0,2048}; do
  for x in A B A B; do echo -n "$x "; PYTHONPATH=/tmp/$x python3 benchmarks/dev/time_fwd.py ${c//,/ }; done
done
