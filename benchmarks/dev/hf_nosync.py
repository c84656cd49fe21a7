# HF step: sdpa, flash_attn2, and flash_attn2 with the packed-sequence check (one sync per forward) skipped.
import torch
import flash_attn2.integrations.transformers as integ
from flash_attn2.benchmark import time_interleaved, warm_up_gpu
from flash_attn2.benchmark_hf import make_config, make_models, make_step, parse_args
args = parse_args([])
models = make_models(make_config(args))
ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")
steps = {impl: make_step(m, o, ids) for impl, (m, o) in models.items()}
check = integ._packed_cu_seqlens
def nosync():
    integ._packed_cu_seqlens = lambda *a: None
    try:
        return steps["flash_attn2"]()
    finally:
        integ._packed_cu_seqlens = check
steps["flash_attn2_nosync"] = nosync
for s in steps.values(): s()
warm_up_gpu(2)
for rnd in range(2):
    print(time_interleaved(steps, reps=10, rounds=3), flush=True)
