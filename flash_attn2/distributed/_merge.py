"""The merge of partial attention results over disjoint key sets, in fp32 and safe for rows with no key."""

from __future__ import annotations

import torch


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out, lse <- the attention over both key sets, in place (views are fine): out (batch, seqlen, heads, d) fp32 (or
    fp64), lse (batch, heads, seqlen) of the same dtype; block_out / block_lse one more partial result (any float
    dtype). lse' = logaddexp(lse, block_lse) (-inf with -inf gives -inf, not NaN); out' = out e^(lse - lse') +
    block_out e^(block_lse - lse'), with lse' taken as 0 where it is -inf (both weights then 0).

    On CUDA with fp32 out / lse and an fp16 / bf16 block (a ring step's), one kernel does it in one pass over out
    and the block (csrc/fwd_aux.cu: merge_partial_kernel). Otherwise torch ops: two passes over out (a scale, then a
    fused multiply-add of the block in its own dtype), the per-row weights computed on the small lse tensors, never
    on out-sized temporaries.

    out may also be in the block's fp16 / bf16 (a 2-rank ring's, whose rows merge two blocks): computed in fp32 as
    above and rounded once, what the fp32 out then cast gives (the kernel, or the same torch ops on an fp32 copy)."""
    if _kernel_serves(out, lse, block_out, block_lse) and _merge_kernel(out, lse, block_out, block_lse):
        torch.autograd.graph.increment_version((out, lse))  # written through raw pointers: autograd must know
        return
    if out.dtype in (torch.float16, torch.bfloat16):
        wide = out.to(lse.dtype)
        merge_partial(wide, lse, block_out, block_lse)
        out.copy_(wide)
        return
    block_lse = block_lse.to(lse.dtype)
    new = torch.logaddexp(lse, block_lse)
    shift = new.masked_fill(new == float("-inf"), 0.0)
    a = (lse - shift).exp_().transpose(1, 2).unsqueeze(-1)        # (batch, seqlen, heads, 1)
    b = (block_lse - shift).exp_().transpose(1, 2).unsqueeze(-1)
    out.mul_(a).addcmul_(block_out, b)
    lse.copy_(new)


def _kernel_serves(*tensors) -> bool:
    """The kernel takes plain CUDA tensors outside tracing and outside autograd's view (the ring calls it inside its
    op, no gradient recorded); fake tensors, compile, export and differentiable calls keep the torch ops."""
    if not tensors[0].is_cuda or torch.compiler.is_compiling():
        return False
    if any(type(t) is not torch.Tensor for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _merge_kernel(out, lse, block_out, block_lse) -> bool:
    """The extension's one-kernel merge, where the tensors suit it (False: nothing done)."""
    from .. import _ops

    return _ops.ext.merge_partial_(out, lse, block_out, block_lse)
