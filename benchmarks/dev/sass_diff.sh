#!/bin/bash
# On the CPU machine: did a change move the kernels' code? Compiles instantiation TUs from REV's csrc and from the
# working tree's (Hopper TUs for sm_90a, SM80 TUs for sm_80 with the compact tiles, bwd_aux.cu for sm_90a) and
# compares each TU's kernels with sass_compare.py: kernels are matched by body, so renamed types do not count; a
# kernel is identical when its instruction text (registers and operands too, addresses and encodings dropped) and
# its resource line are; else the opcodes that differ are counted (a reordered schedule counts, a renamed register
# does not). TUNING 114: a cold-path helper re-laid the d 64 forward's hot loop (1-3% slower) with no test or spill
# warning to show it; TUNING 126: a helper left to nvcc's inliner, and another forced inline, re-laid whole kernels.
#   bash benchmarks/dev/sass_diff.sh [REV (default HEAD)] [csrc/instantiations/<tu>.cu ...]
#   ALL=1 bash benchmarks/dev/sass_diff.sh aebdf2e     # every TU: about 40 minutes a side on two cores
# Default TUs: the d 64 bf16 Hopper forward and backward and the d 64 bf16 SM80 backward. JOBS (default 2) parallel
# compiles. Needs cuobjdump (the nvidia-cuda-cuobjdump wheel puts it under site-packages/nvidia/cu13/bin).
set -uo pipefail
REV=${1:-HEAD}; shift || true
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SP=$(python3 -c "import cutlass_library, os; print(os.path.dirname(os.path.dirname(cutlass_library.__file__)))")
export PATH=$PATH:$CUDA_HOME/bin:$SP/nvidia/cu13/bin
command -v cuobjdump > /dev/null || { echo "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"; exit 1; }
if [ -n "${ALL:-}" ]; then
  TUS="$(ls csrc/instantiations/*.cu) csrc/bwd_aux.cu"
else
  TUS=${*:-csrc/instantiations/fwd_hdim64_bf16_sm90.cu csrc/instantiations/bwd_hdim64_bf16_sm90.cu csrc/instantiations/bwd_hdim64_bf16.cu}
fi
W=$(mktemp -d /tmp/sass_diff.XXXX)
mkdir -p $W/base $W/tree $W/out_base $W/out_tree
git archive "$REV" csrc | tar -x -C $W/base
cp -r csrc $W/tree/
dump() {  # $1: side, $2: TU; writes out_<side>/<name>.sass and .res
  local side=$1 tu=$2 name arch
  name=$(basename $tu .cu)
  case $tu in *_sm90.cu|*bwd_aux.cu) arch=90a;; *) arch=80;; esac
  [ -f $W/$side/$tu ] || { echo "$side: no $tu"; return 0; }
  (cd $W/$side && $CUDA_HOME/bin/nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG -DFLASH_ATTN2_COMPACT_TILES=1 \
    -gencode=arch=compute_$arch,code=sm_$arch -cubin -Icsrc/include -Icsrc/kernels -Icsrc \
    -I$SP/cutlass_library/source/include -I$SP/nvidia/cu13/include $tu -o $W/out_$side/$name.cubin \
    > $W/out_$side/$name.log 2>&1) || { echo "$side: $tu failed"; tail -5 $W/out_$side/$name.log; return 1; }
  cuobjdump -sass $W/out_$side/$name.cubin > $W/out_$side/$name.sass
  cuobjdump -res-usage $W/out_$side/$name.cubin > $W/out_$side/$name.res
  rm -f $W/out_$side/$name.cubin
}
export -f dump; export W SP CUDA_HOME
for tu in $TUS; do echo "base $tu"; echo "tree $tu"; done | xargs -P ${JOBS:-2} -L 1 bash -c 'dump $0 $1'
python3 "$(dirname "$0")/sass_compare.py" $W/out_base $W/out_tree
rm -rf $W
