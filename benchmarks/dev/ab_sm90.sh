#!/bin/bash
# A/B/... of the Hopper kernels: each directory in $VARIANTS (default benchmarks/dev/old) holds a set of sm90
# headers, built in turn as A, B, ...; the working tree is built last. bf16, head dims $D; timed interleaved
# (CASES="d,causal,seqlen ...", ROUNDS processes each, the order rotated; PASS=bwd or fwd_bwd for the
# backward); tests on the working tree (TESTS=...); SAN=1 adds memcheck/racecheck.
# A directory holding csrc/ (variants.sh with FULL=1) replaces the whole csrc/ and flash_attn2/ instead; a
# .patch file (e.g. benchmarks/dev/prepared/*.patch, paths from the repository root) is applied to the tree.
# The directories must lie in the working tree (untracked) to reach the device, e.g.
#   mkdir -p benchmarks/dev/old && for f in fwd_kernel_sm90.h fwd_launch_sm90.h fwd_traits_sm90.h wgmma.h; do
#     git show REF:csrc/kernels/sm90/$f > benchmarks/dev/old/$f; done
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
D=${D:-256}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
build() {  # $1: name
  FLASH_ATTN2_HEAD_DIMS=$D FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }
  mkdir -p /tmp/$1 && cp -r flash_attn2 flash_attn2_cuda*.so /tmp/$1/
}
mkdir -p /tmp/tree_h && cp csrc/kernels/sm90/*.h /tmp/tree_h/
rm -rf /tmp/tree_full && mkdir -p /tmp/tree_full && cp -r csrc flash_attn2 /tmp/tree_full/
names=()
for dir in ${VARIANTS:-benchmarks/dev/old} /tmp/tree_h; do
  name=$(printf "\\x$(printf %x $((65 + ${#names[@]})))")
  rm -rf csrc flash_attn2 && cp -r /tmp/tree_full/csrc /tmp/tree_full/flash_attn2 .
  if [ "${dir%.patch}" != "$dir" ]; then
    patch -p1 --quiet < $dir || { echo "$dir does not apply"; exit 1; }
  elif [ -d $dir/csrc ]; then
    rm -rf csrc flash_attn2 && cp -r $dir/csrc $dir/flash_attn2 .
  else
    cp $dir/*.h csrc/kernels/sm90/
  fi
  s=$(date +%s) && build $name && echo "$name ($dir) built in $(( $(date +%s) - s )) s"
  names+=($name)
done
timeout 150 python3 -m pytest ${TESTS:-tests/test_forward.py tests/test_varlen_safety.py} -q -x -rf -p no:cacheprovider 2>&1 | tail -4
if [ -n "${SAN:-}" ]; then
  for tool in memcheck racecheck; do
    PYTHONPATH=/tmp/${names[-1]} timeout 120 compute-sanitizer --tool $tool python3 benchmarks/dev/${SAN_SCRIPT:-sanitize_fwd}.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small:|Error" | head -5
  done
fi
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do  # the variants' order rotated from round to round
  for i in "${!names[@]}"; do
    x=${names[$(( (i + round) % ${#names[@]} ))]}
    PYTHONPATH=/tmp/$x python3 benchmarks/dev/time_fwd.py ${CASES:-128,0,2048} | sed "s/^/$x /"
  done
done | sort -s -k2,4
