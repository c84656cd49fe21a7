# Where the HF training step's time goes, sdpa against flash_attn2: torch.profiler over a few steps of
# flash_attn2.bench.hf's model; the top GPU kernels and CPU ops of each, its device syncs, or
# (DIFF=1) every op or kernel whose GPU time per step differs between the two by more than 2 us.
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn2.bench.hf import make_config, make_models, make_step, parse_args

STEPS = 3
args = parse_args(sys.argv[1:])
models = make_models(make_config(args))
ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")
per_step = {}
for impl, (model, opt) in models.items():
    step = make_step(model, opt, ids)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    per_step[impl] = {e.key: (e.self_device_time_total / STEPS, e.count // STEPS) for e in averages
                      if e.self_device_time_total > 0}
    if not os.environ.get("DIFF"):
        print(f"===== {impl}\n" + averages.table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
    syncs = [e for e in averages if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")]
    print(f"{impl}: syncs {[(e.key, e.count) for e in syncs]}")
if os.environ.get("DIFF"):
    a, b = (per_step[impl] for impl in ("sdpa", "flash_attn2"))
    rows = sorted(((b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0], k) for k in set(a) | set(b)), key=lambda r: r[0])
    print(f"{'ours - sdpa (us/step)':>22}  {'sdpa us (n)':>14}  {'ours us (n)':>14}  name")
    for diff, k in rows:
        if abs(diff) > 2:
            sa, sb = a.get(k, (0, 0)), b.get(k, (0, 0))
            print(f"{diff:22.1f}  {sa[0]:9.1f} ({sa[1]:2d})  {sb[0]:9.1f} ({sb[1]:2d})  {k[:110]}")
