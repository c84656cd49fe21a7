#!/bin/bash
# Ours beside cuDNN under ncu, backward kernels of one call per case (ncu_bwd.py's cases): launch, speed of
# light, occupancy and warp states of every kernel, one CSV per (impl, case), packed in $OUT/ncu.tgz. Installs
# the wheel carried in .whl/. SOURCE="CASE ...": also our main kernel's full set per case, its SASS lines with
# the most stall samples printed (ncu_top.py) and the source page kept.
#   CASES="64,0,1024 64,1,2048,16,4,4" SOURCE="64,0,1024" bash benchmarks/dev/ncu_cmp.sh
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
ROOT=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT/ncu
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl .whl/flash_attn2-*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee $OUT/summary.txt
cd /tmp  # the installed package, not the source tree's
for impl in ${IMPLS:-flash_attn2 sdpa_cudnn}; do
  for c in ${CASES:-}; do
    name=${impl}_${c//,/_}
    IMPL=$impl timeout ${NCU_S:-150} ncu --section LaunchStats --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --csv --page details python3 $ROOT/benchmarks/dev/ncu_bwd.py $c > $OUT/ncu/$name.csv 2>&1
    echo "$name rc=$?" | tee -a $OUT/summary.txt
  done
done
for c in ${SOURCE:-}; do
  name=src_${c//,/_}
  timeout ${NCU_S:-150} ncu -k regex:bwd_kernel_sm90 -c 1 --set full --import-source no -f -o $OUT/ncu/$name \
    python3 $ROOT/benchmarks/dev/ncu_bwd.py $c > /dev/null 2>&1
  ncu -i $OUT/ncu/$name.ncu-rep --page source --csv --print-source sass > $OUT/ncu/$name.csv 2>&1
  echo "== $c" | tee -a $OUT/summary.txt
  python3 $ROOT/benchmarks/dev/ncu_top.py $OUT/ncu/$name.csv 40 2>&1 | head -44 | tee -a $OUT/summary.txt
  rm -f $OUT/ncu/$name.ncu-rep
done
tar czf $OUT/ncu.tgz -C $OUT ncu && rm -rf $OUT/ncu
