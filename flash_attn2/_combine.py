"""flash_attn_combine: FA3's merge of partial attention results (split keys, cascade / shared-prefix attention).

A composition of torch ops (so it runs on any device, compiles and graph-captures as they do), not a fused kernel;
the split-KV forward merges its own splits with its own kernel (csrc/fwd_aux.cu).
"""

from __future__ import annotations

import torch

MAX_SPLITS = 256


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge attention computed over disjoint key sets: out = sum_s exp(lse_s - lse) out_s, lse = log sum_s exp(lse_s).

    out_partial (num_splits, batch, seqlen, nheads, headdim) fp32 and lse_partial (num_splits, batch, seqlen, nheads)
    fp32, as FA3's flash_attn_combine takes them (any strides); also the varlen forms (num_splits, total, nheads,
    headdim) and (num_splits, total, nheads). A row whose splits all have lse -inf (no key) gets out 0 and lse -inf.
    Returns (out (batch, seqlen, nheads, headdim) in out_dtype, default out_partial's; written into `out` where
    given), lse (batch, seqlen, nheads) fp32).
    """
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn2: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"flash_attn2: {name} must be float32, got {t.dtype}")
    if out_partial.dim() not in (4, 5) or tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"flash_attn2: out_partial must be (num_splits, batch, seqlen, nheads, headdim) or (num_splits, "
                         f"total, nheads, headdim) and lse_partial its shape without headdim; got "
                         f"{tuple(out_partial.shape)} and {tuple(lse_partial.shape)}")
    if not 1 <= out_partial.shape[0] <= MAX_SPLITS:
        raise ValueError(f"flash_attn2: num_splits (out_partial.shape[0]) must be in 1..{MAX_SPLITS}, got "
                         f"{out_partial.shape[0]}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"flash_attn2: lse_partial must be on out_partial's device {out_partial.device}, got "
                         f"{lse_partial.device}")
    out_dtype = out_partial.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"flash_attn2: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if out is not None and (tuple(out.shape) != tuple(out_partial.shape[1:]) or out.dtype != out_dtype):
        raise ValueError(f"flash_attn2: out must be {tuple(out_partial.shape[1:])} in {out_dtype}, got "
                         f"{tuple(out.shape)} in {out.dtype}")
    lse_max = lse_partial.amax(0)
    finite_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)  # all -inf: weights 0
    weights = torch.exp(lse_partial - finite_max)
    total = weights.sum(0)
    lse = torch.where(total > 0, torch.log(total) + finite_max, torch.full_like(total, -torch.inf))
    weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    # A split with weight 0 (no key) may hold anything, NaN included (FA3's kernel skips it): never multiplied in.
    weights = weights.unsqueeze(-1)
    merged = torch.where(weights > 0, weights * out_partial, torch.zeros_like(out_partial)).sum(0).to(out_dtype)
    if out is not None:
        out.copy_(merged)
        merged = out
    return merged, lse
