"""Does a cuDNN SDPA call slow our later backward in the same process (TUNING 116)? Times our bwd at Qwen2.5-7B 8k
(7 head splits) and Llama-3-8B 8k (none) before and after cuDNN runs, with the context's persisting-L2 limit read
through the driver API, then after empty_cache and after that limit is set to 0."""
import ctypes

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn2 import flash_attn_func
from flash_attn2.benchmark import median_ms, warm_up_gpu

cuda = ctypes.CDLL("libcuda.so.1")
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06


def persisting_l2():
    v = ctypes.c_size_t(0)
    rc = cuda.cuCtxGetLimit(ctypes.byref(v), CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
    return f"{v.value} B (rc {rc})"


def inputs(h, h_kv):
    q = torch.randn(4, 8192, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(4, 8192, h_kv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn_like(q)


shapes = {"qwen 28:4": inputs(28, 4), "llama 32:8": inputs(32, 8)}
ours = {}
for name, (q, k, v, do) in shapes.items():
    out = flash_attn_func(q, k, v, causal=True)
    ours[name] = lambda out=out, q=q, k=k, v=v, do=do: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def report(tag):
    print(f"{tag}: persisting L2 limit {persisting_l2()}; ours bwd "
          + ", ".join(f"{n} {median_ms(fn, reps=20):.3f} ms" for n, fn in ours.items()), flush=True)


warm_up_gpu(2)
report("before cuDNN")
report("before cuDNN, again")
q, k, v, do = shapes["qwen 28:4"]
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(5):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do.transpose(1, 2))
torch.cuda.synchronize()
report("after cuDNN")
report("after cuDNN, again")
torch.cuda.empty_cache()
report("after empty_cache")
print("set limit 0:", cuda.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(0)),
      "reset persisting lines:", cuda.cuCtxResetPersistingL2Cache())
report("after limit 0")
