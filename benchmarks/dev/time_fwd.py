# Points of the FA2 grid (16k tokens, hidden 2048, bf16), timed as the benchmark times them (rounds, order
# rotated) in one process; CUDNN=1 adds sdpa_cudnn on the same inputs, DROPOUT=p ours with dropout_p=p,
# ALIBI=1 ours with ALiBi (BLOOM's slopes), SOFTCAP=c with softcap=c, WINDOW=w with window_size=(w - 1, w - 1)
# (causal: (w - 1, 0)), DETERMINISTIC=1 our deterministic backward, SINK=1 a learnable sink per head (its gradient
# too), SM80_BWD=1 the SM80 backward of a default forward (PASS=bwd; a build without the SM80 forward can still run
# it); PASS=bwd or fwd_bwd times that pass.
# A case may name its own pass and a GQA shape (heads, kv heads, batch) instead of the grid's:
#   python benchmarks/dev/time_fwd.py HEAD_DIM,CAUSAL(0/1),SEQLEN[,PASS[,H,H_KV,BATCH]] [...]
import os
import sys

import torch

from flash_attn2 import flash_attn_func
from flash_attn2.bench.grid import (HIDDEN, TOKENS, flops, forward_backend, make_fn, pass_fn, time_interleaved,
                                   warm_up_gpu)

warm_up_gpu(2)
impls = ["flash_attn2"] + (["sdpa_cudnn"] if os.environ.get("CUDNN") else [])
for case in sys.argv[1:]:
    fields = case.split(",")
    d, causal, s = (int(x) for x in fields[:3])
    pass_ = fields[3] if len(fields) > 3 else os.environ.get("PASS", "fwd")
    h, h_kv, b = (int(x) for x in fields[4:7]) if len(fields) > 4 else (HIDDEN // d, HIDDEN // d, TOKENS // s)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=pass_ != "fwd")
    k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=pass_ != "fwd")
            for _ in range(2))
    dout = torch.randn_like(q)
    runs = {impl: pass_fn(make_fn(impl, q, k, v, bool(causal)), pass_, (q, k, v), dout) for impl in impls}
    # flash_attn2 with one option each, beside its plain run: (env variable, run name, its arguments from the value)
    variants = (("DROPOUT", "dropout", lambda x: dict(dropout_p=float(x))),
                ("ALIBI", "alibi", lambda x: dict(alibi_slopes=torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)],
                                                                            device="cuda"))),
                ("SOFTCAP", "softcap", lambda x: dict(softcap=float(x))),
                ("WINDOW", "window", lambda x: dict(window_size=(int(x) - 1, 0 if causal else int(x) - 1))),
                ("DETERMINISTIC", "deterministic", lambda x: dict(deterministic=True)),
                ("SINK", "sink", lambda x: dict(learnable_sink=torch.randn(h, device="cuda", requires_grad=True))))
    for var, name, kwargs in variants:
        if os.environ.get(var):
            kw = kwargs(os.environ[var])
            runs[name] = pass_fn(lambda kw=kw: flash_attn_func(q, k, v, causal=bool(causal), **kw), pass_, (q, k, v), dout)
    if os.environ.get("SM80_BWD") and pass_ == "bwd":
        out = flash_attn_func(q, k, v, causal=bool(causal))

        def sm80_bwd():
            with forward_backend("sm80"):
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        runs["sm80_bwd"] = sm80_bwd
    times = time_interleaved(runs, reps=20)
    for impl, ms in times.items():
        tflops = flops(b, h, s, d, bool(causal), pass_) / ms / 1e9
        name = "" if impl == "flash_attn2" else f" {impl}"
        shape = f" b={b} h={h}:{h_kv}" if h != h_kv else ""
        print(f"d{d} causal={causal} s={s}{shape} {pass_}{name}: {ms:.3f} ms {tflops:.1f} TFLOP/s", flush=True)
