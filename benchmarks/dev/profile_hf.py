# Where the HF training step's time goes, sdpa against flash_attn2: torch.profiler over a few steps of
# flash_attn2.benchmark_hf's model; the top GPU kernels and CPU ops of each, and the step's GPU idle time.
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn2.benchmark_hf import make_config, make_models, make_step, parse_args

args = parse_args(sys.argv[1:])
models = make_models(make_config(args))
ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")
for impl, (model, opt) in models.items():
    step = make_step(model, opt, ids)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70)
    print(f"===== {impl}\n{table}")
    syncs = [e for e in prof.key_averages() if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")]
    print("syncs:", [(e.key, e.count) for e in syncs])
