# A few small backward calls (fixed and varlen, causal, windows, softcap, ALiBi, dropout, sinks; GQA 8:2, whose few key
# blocks split the query heads over 4 blocks on the Hopper path; more key blocks than SMs) for compute-sanitizer;
# deterministic mode and dropout on the default backward (the Hopper one on sm_90) and, on Hopper builds with
# FLASH_ATTN2_SM80=1, on the SM80 one too (FLASH_ATTN2_BACKEND=sm80 for the backward alone).
import torch
from flash_attn2 import _ops, flash_attn_func, flash_attn_varlen_func
from flash_attn2.bench.grid import forward_backend
hopper = torch.cuda.get_device_capability() == (9, 0)
for d in (32, 64, 128, 160, 192, 256):  # the narrow and wide Hopper backward (d 192 three warpgroups, d 256 two), the
    # SM80 one's dropout tiles
    try:  # head dims this build lacks
        flash_attn_func(*(torch.randn(1, 1, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
    except NotImplementedError:
        continue
    for causal, window, softcap, alibi, p, det in (
            (False, (-1, -1), 0.0, False, 0.0, False), (True, (-1, -1), 0.0, False, 0.0, False),
            (False, (40, 7), 0.0, False, 0.0, False), (True, (90, 0), 0.0, False, 0.0, False),
            (False, (-1, -1), 30.0, False, 0.0, False), (True, (-1, -1), 0.0, True, 0.0, False),
            (False, (40, 7), 30.0, True, 0.0, False), (True, (-1, -1), 0.0, False, 0.2, False),
            (False, (40, 7), 30.0, True, 0.3, False), (True, (-1, -1), 0.0, False, 0.0, True),
            (False, (40, 7), 0.0, False, 0.0, True)):
        def extra(heads):
            return dict(softcap=softcap, dropout_p=p, deterministic=det,
                        alibi_slopes=torch.rand(heads, device="cuda") if alibi else None)
        for backend in ((None, "sm80") if (det or p > 0) and hopper and _ops.ext.sm80_built else (None,)):
            q = torch.randn(2, 300, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, 300, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            out = flash_attn_func(q, k, v, causal=causal, window_size=window, **extra(8))
            with forward_backend(backend):
                out.sum().backward()
            cu = torch.tensor([0, 17, 300, 450], device="cuda", dtype=torch.int32)
            qv, kv, vv = (torch.randn(450, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(3))
            out = flash_attn_varlen_func(qv, kv, vv, cu, cu, 283, 283, causal=causal, window_size=window, **extra(4))
            with forward_backend(backend):
                out.sum().backward()
    # Attention sinks: the dsink kernel after the backward, deterministic and not; varlen with empty sequences.
    for det in (False, True):
        sink = torch.randn(8, device="cuda", requires_grad=True)
        q = torch.randn(2, 300, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 200, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        flash_attn_func(q, k, v, causal=True, deterministic=det, learnable_sink=sink).sum().backward()
        cu = torch.tensor([0, 0, 300, 300, 450], device="cuda", dtype=torch.int32)
        qv, kv, vv = (torch.randn(450, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        flash_attn_varlen_func(qv, kv, vv, cu, cu, 300, 300, causal=True, deterministic=det,
                               learnable_sink=sink).sum().backward()
    # Many key blocks per persistent block (the Hopper backward walks 160 slots here on 132 SMs at most), with
    # key blocks no query sees (the window) among them.
    for window in ((-1, -1), (20, 20)):
        q = torch.randn(5, 64, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(5, 256, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        flash_attn_func(q, k, v, window_size=window).sum().backward()
torch.cuda.synchronize()
print("small: ok")
# MLA (192, 128): the Hopper backward reads v, out and dout at d_v (TMA's zero fill past it; dV clipped at it), GQA
# with head splits, varlen with a sequence without keys, deterministic; where the build has head dim 192.
if _ops.ext.fwd_head_dim_bucket(192, True) == 192:
    for det in (False, True):
        q = torch.randn(2, 150, 8, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 200, 2, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 200, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        flash_attn_func(q, k, v, causal=True, deterministic=det).sum().backward()
        cu_q = torch.tensor([0, 100, 140, 150], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, 120, 120, 200], device="cuda", dtype=torch.int32)
        qv = q.detach()[0].clone().requires_grad_()
        kv, vv = k.detach()[0].clone().requires_grad_(), v.detach()[0].clone().requires_grad_()
        flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 100, 120, causal=True, deterministic=det).sum().backward()
    torch.cuda.synchronize()
    print("mla: ok")
