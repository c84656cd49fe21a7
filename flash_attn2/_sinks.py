"""Learnable attention sinks (gpt-oss; FA4's `learnable_sink`, vLLM's and transformers' `s_aux`): one logit per query
head in every row's softmax denominator, with no value.

    Z = sum_j exp(s_j) + exp(sink_h),  out = sum_j exp(s_j - log Z) v_j,  lse = log Z

The kernels fold the sink into each row once it is finished (csrc/kernels/common/sink.h): lse' = logaddexp(lse,
sink), out' = out exp(lse - lse') (a row with no key: out 0, lse' = sink; split-KV adds it in the combine). The
backward's P = exp(s - lse') and D = rowsum(dO o out') are then the sink's, so dq, dk, dv need nothing else, and
dsink_h = -sum_{b,i} exp(sink_h - lse'_{b,h,i}) D_{b,h,i} (dL/dsink = -P_sink D; with dropout too, D being the
dropped output's) is one small kernel over the backward's D (csrc/bwd_aux.cu), summed in a fixed order. The ops take
it as `learnable_sink` (fwd, fwd_kvcache; bwd returns dsink); this module checks it.
"""

from __future__ import annotations

import torch

from ._checks import require_device


def check_sink(sink, heads: int, q: torch.Tensor) -> None:
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"flash_attn2: learnable_sink must be a torch.Tensor, got {type(sink).__name__}")
    if sink.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"flash_attn2: learnable_sink must be float32, float16 or bfloat16, got {sink.dtype}")
    if tuple(sink.shape) != (heads,):
        raise ValueError(f"flash_attn2: learnable_sink must be (nheads,) = ({heads},), got shape {tuple(sink.shape)}")
    require_device(sink, "learnable_sink", q)
