# A few small forward calls (fixed and varlen; causal, windows, softcap, ALiBi) for compute-sanitizer.
import torch
from flash_attn2 import flash_attn_func, flash_attn_varlen_func
for d in (64, 128):
    for causal, window, softcap, alibi in ((False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False),
                                           (False, (40, 7), 0.0, False), (True, (90, 0), 0.0, False),
                                           (False, (-1, -1), 30.0, False), (True, (-1, -1), 0.0, True),
                                           (False, (40, 7), 30.0, True)):
        extra = dict(softcap=softcap, alibi_slopes=torch.rand(4, device="cuda") if alibi else None)
        q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flash_attn_func(q, k, v, causal=causal, window_size=window, **extra)
        cu = torch.tensor([0, 17, 300, 450], device="cuda", dtype=torch.int32)
        qv, kv, vv = (torch.randn(450, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flash_attn_varlen_func(qv, kv, vv, cu, cu, 283, 283, causal=causal, window_size=window, **extra)
torch.cuda.synchronize()
print("small: ok")
