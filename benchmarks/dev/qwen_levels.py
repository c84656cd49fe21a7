# Does Qwen2.5-7B 8k's backward level (TUNING 84: 9.8 or 10.5 ms per process) follow the tensors' memory? Each
# trial frees everything, empties the cache, pads the allocator by a random amount and allocates fresh inputs,
# then times ours and cuDNN's backward interleaved: python benchmarks/dev/qwen_levels.py [TRIALS]
import random
import sys

import torch

from flash_attn2.benchmark import make_fn, pass_fn, time_interleaved, warm_up_gpu

warm_up_gpu(2)
b, s, h, h_kv, d = 4, 8192, 28, 4, 128
for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    torch.cuda.empty_cache()
    pad = torch.empty(random.randint(1, 4096) << 20, dtype=torch.uint8, device="cuda")
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    runs = {impl: pass_fn(make_fn(impl, q, k, v, True), "bwd", (q, k, v), dout) for impl in ("flash_attn2", "sdpa_cudnn")}
    t = time_interleaved(runs, reps=10)
    print(f"trial {trial} pad {pad.numel() >> 20} MB q at {q.data_ptr():#x}: ours {t['flash_attn2']:.3f} ms, "
          f"cudnn {t['sdpa_cudnn']:.3f} ms", flush=True)
    del runs, q, k, v, dout, pad
