# One process's Qwen2.5-7B 8k backward level (TUNING 84-85: 9.8 or 10.5 ms per process) and, per kernel, where
# ours spends it (torch.profiler over 5 calls), with cuDNN's beside it. Run it in several fresh processes:
#   for i in 1 2 3 4 5 6; do python benchmarks/dev/qwen_procs.py; done
import collections
import subprocess

import torch

from flash_attn2.benchmark import make_fn, pass_fn, time_interleaved, warm_up_gpu

warm_up_gpu(2)
b, s, h, h_kv, d = 4, 8192, 28, 4, 128
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
dout = torch.randn_like(q)
runs = {impl: pass_fn(make_fn(impl, q, k, v, True), "bwd", (q, k, v), dout) for impl in ("flash_attn2", "sdpa_cudnn")}
t = time_interleaved(runs, reps=10)
smi = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
print(f"ours {t['flash_attn2']:.3f} ms, cudnn {t['sdpa_cudnn']:.3f} ms [{smi}]", flush=True)
for impl, run in runs.items():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time / 5 / 1000
    top = sorted(per.items(), key=lambda kv: -kv[1])[:4]
    print(f"  {impl}: " + "; ".join(f"{n} {ms:.3f}" for n, ms in top), flush=True)
