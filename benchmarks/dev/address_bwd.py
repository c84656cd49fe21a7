# Does one backward's time depend on where its tensors land? The same shape timed after holding a
# padding allocation of 0, 2, 4, ... MB (fresh q/k/v/dout and workspaces each time, so every tensor moves).
#   python3 benchmarks/dev/address_bwd.py D,CAUSAL,S,H,H_KV,B [PADS_MB...]
import sys

import torch

from flash_attn2.benchmark import make_fn, median_ms, pass_fn, warm_up_gpu

d, causal, s, h, h_kv, b = (int(x) for x in sys.argv[1].split(","))
pads = [int(x) for x in sys.argv[2:]] or [0, 2, 6, 14, 30, 62, 126, 254]
warm_up_gpu(2)
held = []
for pad in pads:
    held.append(torch.empty(pad << 20, dtype=torch.uint8, device="cuda"))
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    runs = {impl: pass_fn(make_fn(impl, q, k, v, bool(causal)), "bwd", (q, k, v), dout)
            for impl in ("flash_attn2", "sdpa_cudnn")}
    times = {impl: sorted(median_ms(run, reps=20) for _ in range(3)) for impl, run in runs.items()}
    print(f"pad {pad:4d} MB  q at {q.data_ptr() % (1 << 30) >> 20:5d} MB mod 1 GB: "
          + "  ".join(f"{impl} {' '.join(f'{t:.3f}' for t in ts)}" for impl, ts in times.items()))
    del q, k, v, dout, runs
