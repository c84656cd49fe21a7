"""The HF training step's CUDA kernels per implementation (torch.profiler, 3 steps after warm-up), the largest
differences first: where a step-time difference between sdpa and flash_attn2 comes from (hf_layout.py times
the attention alone).
    python benchmarks/dev/hf_profile.py [--batch 1] [--seqlen 8192]"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn2.benchmark import warm_up_gpu
from flash_attn2.benchmark_hf import make_config, make_models, make_step, parse_args

args = parse_args(sys.argv[1:])
config = make_config(args)
models = make_models(config)
ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")
steps = {impl: make_step(model, opt, ids) for impl, (model, opt) in models.items()}
warm_up_gpu(2)
per_step = {}  # impl -> {kernel: (us per step, calls per step)}
for impl, step in steps.items():
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    per_step[impl] = {e.key: (e.device_time_total / 3, e.count / 3)
                      for e in prof.key_averages() if e.device_time_total > 0}
    print(f"{impl}: {sum(t for t, _ in per_step[impl].values()) / 1e3:.3f} ms of kernels per step")
names = set().union(*per_step.values())
diff = sorted(names, key=lambda n: -abs(per_step["flash_attn2"].get(n, (0, 0))[0] - per_step["sdpa"].get(n, (0, 0))[0]))
print("kernels per step, the largest differences first: sdpa us (calls) | flash_attn2 us (calls)")
for n in diff[:16]:
    (ts, cs), (tf, cf) = per_step["sdpa"].get(n, (0, 0)), per_step["flash_attn2"].get(n, (0, 0))
    print(f"  {ts:8.1f} ({cs:4.0f}) | {tf:8.1f} ({cf:4.0f})  {n[:100]}")
