"""Learnable attention sinks (gpt-oss; FA4's `learnable_sink`, vLLM's and transformers' `s_aux`): one logit per query
head in every row's softmax denominator, with no value.

    Z = sum_j exp(s_j) + exp(sink_h),  out = sum_j exp(s_j - log Z) v_j,  lse = log Z

Built on the kernels' out and LSE, which hold the same sums without the sink: lse' = logaddexp(lse, sink) and
out' = out exp(lse - lse') (a row with no key: out 0, lse' = sink). The backward runs the kernels on out' and lse'
(their P = exp(s - lse') and D = rowsum(dO o out') are the sink-normalized ones, so dq, dk, dv need nothing else) and
dsink_h = -sum_{b,i} exp(sink_h - lse'_{b,h,i}) D_{b,h,i} (dL/dsink = -P_sink D; with dropout too, D being the
dropped output's). One extra pass over out in each direction: fusing the factor into the kernels' epilogues is
issue #49's next step.
"""

from __future__ import annotations

import torch


def check_sink(sink, heads: int, q: torch.Tensor) -> None:
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"flash_attn2: learnable_sink must be a torch.Tensor, got {type(sink).__name__}")
    if sink.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"flash_attn2: learnable_sink must be float32, float16 or bfloat16, got {sink.dtype}")
    if tuple(sink.shape) != (heads,):
        raise ValueError(f"flash_attn2: learnable_sink must be (nheads,) = ({heads},), got shape {tuple(sink.shape)}")
    if sink.device != q.device:
        raise ValueError(f"flash_attn2: learnable_sink must be on q's device {q.device}, got {sink.device}")


def _rows(lse: torch.Tensor, varlen: bool):
    """lse's layout -> a view that broadcasts a (heads,) vector over it."""
    return (lambda s: s.view(-1, 1)) if varlen else (lambda s: s.view(1, -1, 1))


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, varlen: bool):
    """(out', lse') from the kernels' out (batch, seqlen, heads, d) / (total, heads, d) and lse (batch, heads, seqlen)
    / (heads, total)."""
    per_head = _rows(lse, varlen)(sink.float())
    new = torch.logaddexp(lse, per_head)
    # 0 where lse is -inf (no key); also where the sink is -inf too (both -inf: exp(nan) otherwise)
    factor = torch.where(torch.isinf(new) & (new < 0), torch.zeros_like(new), torch.exp(lse - new))
    factor = factor.transpose(-1, -2) if not varlen else factor.t()  # out's (..., seqlen, heads) order
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, varlen: bool):
    """dsink (heads,) in sink's dtype: -sum over rows of exp(sink - lse') rowsum(dout o out')."""
    d = (dout.float() * out.float()).sum(-1)  # (batch, seqlen, heads) / (total, heads)
    d = d.transpose(-1, -2) if not varlen else d.t()  # lse's layout
    p_sink = torch.exp(_rows(lse, varlen)(sink.float()) - lse)
    p_sink = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(p_sink), p_sink)  # lse' -inf: a -inf sink, no key
    dims = (0, 2) if not varlen else (1,)
    return (-(p_sink * d).sum(dims)).to(sink.dtype)


class SinkAttention(torch.autograd.Function):
    """flash_attn2's ops with a sink: forward (out', lse'), backward (dq, dk, dv, dsink)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, alibi,
                deterministic, dropout_p):
        from . import _ops
        out, lse, rng_state = _ops.fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, alibi,
                                       deterministic, dropout_p)
        varlen = cu_q is not None
        out, lse = apply_sink(out, lse, sink, varlen)
        ctx.save_for_backward(q, k, v, out, lse, sink, cu_q, cu_k, alibi, rng_state)
        ctx.args = (max_q, max_k, scale, causal, left, right, softcap, deterministic, dropout_p, varlen)
        ctx.mark_non_differentiable(lse, rng_state)
        return out, lse, rng_state

    @staticmethod
    def backward(ctx, dout, _dlse, _drng):
        from . import _ops
        q, k, v, out, lse, sink, cu_q, cu_k, alibi, rng_state = ctx.saved_tensors
        max_q, max_k, scale, causal, left, right, softcap, deterministic, dropout_p, varlen = ctx.args
        det = deterministic or torch.are_deterministic_algorithms_enabled()
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = _ops.bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right,
                                  softcap, alibi, det, dropout_p, rng_state)
        dsink = sink_grad(dout, out, lse, sink, varlen) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, *([None] * 12)
