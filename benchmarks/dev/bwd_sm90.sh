#!/bin/bash
# First runs of the Hopper backward: reduced build (head dims $D, bf16+fp16, sm_90) of the working tree, the
# backward/varlen/SASS tests, sanitizers on small backward calls, then the backward next to sdpa_cudnn and
# sdpa_flash. OLD_FWD=REF first builds REF's fwd_kernel.h (d 64 bf16) and runs the NaN varlen test on it.
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
ROOT=$PWD; D=${D:-64,128}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps .whl/nvidia_cutlass*.whl
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -n "${OLD_FWD:-}" ]; then
  cp csrc/kernels/sm90/fwd_kernel.h /tmp/fwd_new.h && cp benchmarks/dev/old/fwd_kernel.h csrc/kernels/sm90/
  s=$(date +%s); FLASH_ATTN2_HEAD_DIMS=64 FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 \
    python3 setup.py build_ext --inplace > $OUT/build_old.log 2>&1 || tail -20 $OUT/build_old.log
  echo "old built in $(( $(date +%s) - s )) s"
  timeout 60 python3 -m pytest tests/test_varlen_safety.py -q -p no:cacheprovider -k "untrusted" 2>&1 | tail -4
  cp /tmp/fwd_new.h csrc/kernels/sm90/fwd_kernel.h; rm -rf build flash_attn2_cuda*.so
fi
s=$(date +%s); FLASH_ATTN2_HEAD_DIMS=$D FLASH_ATTN2_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - s )) s"; grep -A1 "bwd_kernel_sm90\|BwdKernelSm90" $OUT/build.log | grep "spill" | sort | uniq -c | head
for dt in float16 bfloat16; do PYTHONPATH=$ROOT timeout 60 compute-sanitizer --tool memcheck python3 -c "
import torch; from flash_attn2 import flash_attn_func
for s in (1, 17, 300):
    q, k, v = (torch.randn(1, s, 2, 64, device='cuda', dtype=torch.$dt, requires_grad=True) for _ in range(3))
    flash_attn_func(q, k, v).sum().backward(); torch.cuda.synchronize(); print('small $dt', s, 'ok')
" 2>&1 | grep -v "^=========     \(Host Frame\|in \)\|^=========$" | head -${SMALL_LINES:-12} | cut -c1-300; done
timeout ${TEST_S:-200} python3 -m pytest ${TESTS:-tests/test_backward.py tests/test_varlen_safety.py tests/test_sass.py} -q --maxfail=10 -p no:cacheprovider > $OUT/pytest.log 2>&1
grep -E "^(FAILED|ERROR)|Error|assert" $OUT/pytest.log | head -20; tail -2 $OUT/pytest.log
if [ -n "${SAN:-}" ]; then
  for script in ${SAN_SCRIPTS:-sanitize_bwd}; do for tool in memcheck racecheck synccheck; do
    echo "$script $tool:"; PYTHONPATH=$PWD timeout 120 compute-sanitizer --tool $tool python3 benchmarks/dev/$script.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small:|Error" | head -5
  done; done
fi
if [ -n "${BENCH:-}" ]; then
cd /tmp && PYTHONPATH=$ROOT timeout 200 python3 -c "import sys; from flash_attn2.bench.grid import main; main(sys.argv[1:])" \
  --impls flash_attn2 sdpa_cudnn sdpa_flash --passes bwd --hdims ${D//,/ } --dtypes bf16 --seqlens ${SEQS:-1024 4096} --rounds 2 --out-dir $OUT 2>&1 | tail -${BENCH_TAIL:-20}
fi
# NCU="D,CAUSAL,S ...": ncu (full set) of the Hopper backward kernel per case; details and the SASS lines
# with the most stall samples printed, the source page kept as CSV.
cd $ROOT
for case in ${NCU:-}; do
  name=bwd_${case//,/_}
  PYTHONPATH=$PWD timeout 150 ncu -k regex:bwd_kernel_sm90 -c 1 --set full -f -o $OUT/$name python3 benchmarks/dev/ncu_bwd.py $case > /dev/null 2>&1
  ncu -i $OUT/$name.ncu-rep --page details 2>&1 | grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Tensor" | head -30
  ncu -i $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/$name.csv 2>&1
  python3 benchmarks/dev/ncu_top.py $OUT/$name.csv 30 2>&1 | head -34
done
