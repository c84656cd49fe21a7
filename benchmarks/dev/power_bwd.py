# Clocks and power while one backward runs back to back (flash_attn2, then sdpa_cudnn, then flash_attn2
# again), sampled by nvidia-smi: whether a pass is slower under the power cap than in short timings.
#   python3 benchmarks/dev/power_bwd.py D,CAUSAL,S,H,H_KV,B [SECONDS]
import statistics
import subprocess
import sys
import time

import torch

from flash_attn2.benchmark import make_fn, pass_fn, warm_up_gpu

d, causal, s, h, h_kv, b = (int(x) for x in sys.argv[1].split(","))
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
dout = torch.randn_like(q)
warm_up_gpu(2)
for impl in ("flash_attn2", "sdpa_cudnn", "flash_attn2"):
    run = pass_fn(make_fn(impl, q, k, v, bool(causal)), "bwd", (q, k, v), dout)
    run()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    start, calls = time.time(), 0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.time() - start < seconds:
        for _ in range(10):
            run()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    samples = [tuple(float(x) for x in line.split(",")) for line in smi.communicate()[0].splitlines()[5:] if line]
    print(f"{impl:12s} {begin.elapsed_time(end) / calls:.3f} ms per bwd over {calls} calls; SM clock median "
          f"{statistics.median(c for c, _ in samples):.0f} MHz, power median {statistics.median(p for _, p in samples):.0f} W")
