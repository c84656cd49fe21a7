#!/bin/bash
# A/B/... of the Hopper kernels: each directory in $VARIANTS (default benchmarks/dev/old) holds a set of sm90
# headers, built in turn as A, B, ...; the working tree is built last. bf16, head dims $D; timed interleaved
# (CASES="d,causal,seqlen ...", ROUNDS processes each, the order rotated; PASS=bwd or fwd_bwd for the
# backward); tests on the working tree (TESTS=...); SAN=1 adds memcheck/racecheck (SAN_SCRIPTS, default
# sanitize_fwd). TEST_S bounds pytest and CASE_S each timing process, so that a hang cannot take the call.
# The variants build at once, each in its own copy of the tree.
# A directory holding csrc/ (variants.sh with FULL=1) replaces the whole csrc/ and flash_attn2/ instead; a
# .patch file (e.g. benchmarks/dev/prepared/*.patch, paths from the repository root) is applied to the tree.
# The directories must lie in the working tree (untracked) to reach the device, e.g.
#   mkdir -p benchmarks/dev/old && for f in fwd_kernel.h fwd_launch.h fwd_traits.h wgmma.h; do
#     git show REF:csrc/kernels/sm90/$f > benchmarks/dev/old/$f; done
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
D=${D:-256}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
build() {  # $1: name; each variant builds in its own copy of the tree, all at once
  (cd /tmp/src_$1 && FLASH_ATTN2_HEAD_DIMS=$D FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 \
    python3 setup.py build_ext --inplace > $OUT/build_$1.log 2>&1) || { tail -30 $OUT/build_$1.log; return 1; }
  rm -rf /tmp/$1 && mkdir -p /tmp/$1 && cp -r /tmp/src_$1/flash_attn2 /tmp/src_$1/flash_attn2_cuda*.so /tmp/$1/
}
mkdir -p /tmp/tree_h && cp csrc/kernels/sm90/*.h /tmp/tree_h/
names=()
s=$(date +%s)
for dir in ${VARIANTS:-benchmarks/dev/old} /tmp/tree_h; do
  name=$(printf "\\x$(printf %x $((65 + ${#names[@]})))")
  rm -rf /tmp/src_$name && mkdir -p /tmp/src_$name && cp -r setup.py pyproject.toml csrc flash_attn2 /tmp/src_$name/
  [ -f MANIFEST.in ] && cp MANIFEST.in /tmp/src_$name/
  if [ "${dir%.patch}" != "$dir" ]; then
    (cd /tmp/src_$name && patch -p1 --quiet) < $dir || { echo "$dir does not apply"; exit 1; }
  elif [ -d $dir/csrc ]; then
    rm -rf /tmp/src_$name/csrc /tmp/src_$name/flash_attn2 && cp -r $dir/csrc $dir/flash_attn2 /tmp/src_$name/
  else
    cp $dir/*.h /tmp/src_$name/csrc/kernels/sm90/
  fi
  echo "$name: $dir"
  build $name &
  names+=($name)
done
wait
for name in "${names[@]}"; do [ -f /tmp/$name/flash_attn2_cuda*.so ] || { echo "$name did not build"; exit 1; }; done
echo "built in $(( $(date +%s) - s )) s"
cp /tmp/${names[-1]}/flash_attn2_cuda*.so .  # the tests import the working tree's package from the root
timeout ${TEST_S:-150} python3 -m pytest ${TESTS:-tests/test_forward.py tests/test_varlen_safety.py} -q -x -rf -p no:cacheprovider 2>&1 | tail -4
if [ -n "${SAN:-}" ]; then
  for script in ${SAN_SCRIPTS:-sanitize_fwd}; do for tool in memcheck racecheck; do
    echo -n "$script $tool: "
    PYTHONPATH=/tmp/${names[-1]} timeout 120 compute-sanitizer --tool $tool python3 benchmarks/dev/$script.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small:|Error" | head -5
  done; done
fi
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do  # the variants' order rotated from round to round
  for i in "${!names[@]}"; do
    x=${names[$(( (i + round) % ${#names[@]} ))]}
    PYTHONPATH=/tmp/$x timeout ${CASE_S:-120} python3 benchmarks/dev/time_fwd.py ${CASES:-128,0,2048} | sed "s/^/$x /"
    [ ${PIPESTATUS[0]} = 124 ] && echo "$x round $round: timed out (CASE_S=${CASE_S:-120})"
  done
done | sort -s -k2,4
