# A few small forward calls (fixed and varlen, causal and not) for compute-sanitizer.
import torch
from flash_attn2 import flash_attn_func, flash_attn_varlen_func
for d in (64, 128):
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (40, 7)), (True, (90, 0))):
        q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flash_attn_func(q, k, v, causal=causal, window_size=window)
        cu = torch.tensor([0, 17, 300, 450], device="cuda", dtype=torch.int32)
        qv, kv, vv = (torch.randn(450, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flash_attn_varlen_func(qv, kv, vv, cu, cu, 283, 283, causal=causal, window_size=window)
torch.cuda.synchronize()
print("small: ok")
