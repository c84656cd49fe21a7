"""nvcc wrapper that logs each job's peak memory and wall time: PYTORCH_NVCC="python3 benchmarks/dev/nvcc_mem.py"
with NVCC_MEM_LOG=<file> (gpu_full.sh does both with NVCC_MEM=1). The peak is the largest process nvcc ran
(cicc, ptxas run one after another), as /usr/bin/time reports it."""
import os
import subprocess
import sys
import time

nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
start = time.time()
proc = subprocess.Popen([nvcc, *sys.argv[1:]])
_, status, usage = os.wait4(proc.pid, 0)
out = sys.argv[sys.argv.index("-o") + 1] if "-o" in sys.argv else "?"
with open(os.environ.get("NVCC_MEM_LOG", "/tmp/nvcc_mem.log"), "a") as f:
    f.write(f"{usage.ru_maxrss / 1024:.0f} MB {time.time() - start:.0f} s {os.path.basename(out)}\n")
sys.exit(os.waitstatus_to_exitcode(status))
