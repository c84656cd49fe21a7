#!/bin/bash
# CPU machine, before a device call: a reduced build of TREE (default: the working tree) for the GPU machine's
# Python, its extension copied to .whl/<NAME>/ (carried; .whl/ is ignored), so that the device call spends no time
# building. The GPU machine runs python3.12 and torch 2.11.0+cu130: the extension must be built against the same
# (pybind11 refuses a module built for another Python), so PY names a python3.12 with torch==2.11.0 and
# nvidia-cutlass==4.2.0.0 installed (`pyenv`'s 3.12: `$PY -m pip install torch==2.11.0 nvidia-cutlass==4.2.0.0
# ninja`). Head dims D (default 128), bf16, sm_90a; about 4-6 minutes a tree on two cores for d 128 / 192; the
# extension stripped (a d 128 build ~7 MB), so that several fit the device call's 64 MiB carry.
#   NAME=uA D=128,192 bash benchmarks/dev/build_so.sh [TREE]
#   then on the GPU machine: PYTHONPATH=$PWD:$PWD/.whl/uA python3 ...   (carry [".whl"]; 64 MiB in all)
set -uo pipefail
ROOT=$(pwd); TREE=${1:-$ROOT}; NAME=${NAME:?name of the .whl/ folder}
PY=${PY:-$(ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
[ -x "$PY" ] || { echo "no python3.12 (PY=...)"; exit 1; }
$PY -c "import torch, cutlass_library; assert torch.__version__.startswith('2.11.0'), torch.__version__" || exit 1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
s=$(date +%s)
(cd $TREE && rm -f flash_attn2_cuda*.so && FLASH_ATTN2_HEAD_DIMS=${D:-128} FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=90 \
  $PY setup.py build_ext --inplace > /tmp/build_so_$NAME.log 2>&1) || { tail -20 /tmp/build_so_$NAME.log; exit 1; }
rm -rf $ROOT/.whl/$NAME && mkdir -p $ROOT/.whl/$NAME && cp $TREE/flash_attn2_cuda.cpython-312-*.so $ROOT/.whl/$NAME/
# The host symbol tables are most of the file (d 64-256: 24 -> 8 MB); the kernels (the fatbin) and their names in a
# profile stay. STRIP=0 keeps them.
[ "${STRIP:-1}" = 1 ] && strip --strip-unneeded $ROOT/.whl/$NAME/flash_attn2_cuda.cpython-312-*.so
echo "$TREE -> .whl/$NAME in $(( $(date +%s) - s )) s ($(du -sh $ROOT/.whl/$NAME | cut -f1))"
