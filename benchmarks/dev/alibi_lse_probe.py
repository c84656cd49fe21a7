# python3 benchmarks/dev/alibi_lse_probe.py [head dims] (repo root; TUNING 191). Prints, per path, head dim and causal / full,
# the max LSE error of ours and of the fp32 reference against a float64 one, and |LSE| where ours errs most, six seeds.
# The SM80 path's LSE error with per-batch ALiBi (test_mod_fwd[alibi_per_batch-True-1023-1023-160-bf16]
# failed at 1.28e-3 > 1e-3 under FLASH_ATTN2_BACKEND=sm80). Ours and the fp32 reference against a float64 one.
import os, sys, torch
import flash_attn2
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from flash_attn2.testing import attention_ref
from test_score_mods import mod_inputs
from test_window import forward
for backend in ["sm90", "sm80"]:
    os.environ["FLASH_ATTN2_BACKEND"] = backend
    for d in [int(x) for x in (sys.argv[1:] or [128, 160, 192, 256])]:
        if d not in flash_attn2.compiled_head_dims(torch.bfloat16):
            continue
        for causal in [True, False]:
            errs = []
            for seed in range(6):
                torch.manual_seed(seed)
                q, k, v, kw = mod_inputs("alibi_per_batch", 1023, 1023, 2, d, torch.bfloat16)
                out, lse = forward(q, k, v, None, None, 1023, 1023, causal, (-1, -1), **kw)
                _, l32 = attention_ref(q, k, v, causal, upcast=True, **kw)
                kw64 = {"alibi_slopes": kw["alibi_slopes"].double()}
                _, l64 = attention_ref(q.double(), k.double(), v.double(), causal, upcast=True, **kw64)
                e = (lse.double() - l64).abs(); e32 = (l32.double() - l64).abs()
                i = e.argmax()
                errs.append(f"{e.max():.1e}/{e32.max():.1e}@|{l64.flatten()[i]:.0f}|")
            print(backend, d, "causal" if causal else "full", "ours/ref32 vs fp64:", " ".join(errs), flush=True)
