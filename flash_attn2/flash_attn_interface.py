"""flash-attn 2.x's Python API on flash_attn2's kernels.

Same names, argument names, order, defaults and returns as flash_attn.flash_attn_interface; tensors
are (batch, seqlen, nheads, headdim), or packed (total_tokens, nheads, headdim) for the varlen calls.
Every function checks the non-tensor arguments here and calls the op torch.ops.flash_attn2.fwd, which
checks the tensors (flash_attn2/_checks.py) and whose autograd formula calls torch.ops.flash_attn2.bwd.
"""

from __future__ import annotations

import math
import operator
import os

import torch

from . import _dropout, _ops
from ._checks import (MAX_HEAD_DIM, MAX_SEQLEN, check_alibi_slopes, check_max_seqlen, check_tensors,
                      check_types)

CHECK_INPUTS_ENV = "FLASH_ATTN2_CHECK_INPUTS"


# ----------------------------------------------------------------------------------------------------
# Checks of the other arguments: each error names the argument and what was expected.


FLOAT32_MIN, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # normal float32 range


def _as_float(x) -> float:
    """x as a float, or NaN where it is none (which every range check below then refuses)."""
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def _positive_float32(value: float) -> bool:
    """A positive value the kernels' float32 holds as itself (not 0 or inf, and not a subnormal)."""
    return FLOAT32_MIN <= value <= FLOAT32_MAX


def _dropout_p(dropout_p) -> float:
    value = _as_float(dropout_p)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"flash_attn2: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return value


def _check_unsupported(block_table=None):
    if block_table is not None:
        raise NotImplementedError("flash_attn2: block_table (paged KV cache) is not supported yet; pass block_table=None")


def _window(causal: bool, window_size, max_seqlen_q: int, max_seqlen_k: int) -> tuple[bool, int, int]:
    """flash-attn's window semantics -> (causal, left, right): a negative side is unbounded (-1), and so is one
    that reaches past every sequence's corner, left >= max_seqlen_k or right >= max_seqlen_q (the kernels' Window
    rule: with the bottom-right alignment, right = r leaves the first seqlen_q - 1 - r rows short of the last key,
    so flash-attn's right >= seqlen_k, which drops the window, would change rows where seqlen_q > seqlen_k + 1);
    causal sets right = 0; a window of (-1, 0) is causal."""
    if type(window_size) is tuple and window_size == (-1, -1):  # the default, on every call
        return causal, -1, -1
    try:
        if isinstance(window_size, torch.Tensor) and window_size.shape == (2,) and not window_size.is_floating_point():
            window_size = window_size.tolist()  # flash-attn's own tests pass torch.randint(0, seqlen_k, (2,))
        if not isinstance(window_size, (tuple, list)):
            raise TypeError
        left, right = (operator.index(w) for w in window_size)  # ints, not floats
    except (TypeError, ValueError):
        raise ValueError(f"flash_attn2: window_size must be a pair of ints (left, right), -1 for unbounded, got "
                         f"{window_size!r}") from None
    left = -1 if left < 0 or left >= max_seqlen_k else left
    right = -1 if right < 0 or right >= max_seqlen_q else right
    if causal:
        right = 0
    return left == -1 and right == 0, left, right


def _widen(*tensors):
    """The tensors with their head dims zero-padded to the widest one's (d_v != d_qk: exact, since zero columns change
    no score nor gradient, and the callers pass the softmax scale)."""
    width = max(t.shape[-1] for t in tensors)
    return [t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors]


def _check_cu_seqlens_values(cu_seqlens, name, total, max_seqlen, max_name):
    """FLASH_ATTN2_CHECK_INPUTS=1: the values inside cu_seqlens, read back to the host (a sync)."""
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"flash_attn2 ({CHECK_INPUTS_ENV}): {name}[0] = {values[0]}, expected 0")
    for b in range(len(values) - 1):
        length = values[b + 1] - values[b]
        if length < 0:
            raise ValueError(f"flash_attn2 ({CHECK_INPUTS_ENV}): {name}[{b + 1}] = {values[b + 1]} is smaller than "
                             f"{name}[{b}] = {values[b]}; cu_seqlens must be non-decreasing")
        if length > max_seqlen:
            raise ValueError(f"flash_attn2 ({CHECK_INPUTS_ENV}): sequence {b} has length {length} "
                             f"({name}[{b + 1}] - {name}[{b}]), more than {max_name} = {max_seqlen}")
    if values[-1] != total:
        raise ValueError(f"flash_attn2 ({CHECK_INPUTS_ENV}): {name}[{len(values) - 1}] = {values[-1]} must equal the "
                         f"packed length {total}")


def _softcap(softcap) -> float:
    value = _as_float(softcap)
    if not (value == 0.0 or _positive_float32(value)):
        raise ValueError(f"flash_attn2: softcap must be 0 (off) or a positive finite float32 "
                         f"({FLOAT32_MIN:.3g}..{FLOAT32_MAX:.3g}), got {softcap!r}")
    return value


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** (-0.5) if head_dim > 0 else 1.0  # the tensor checks refuse a head dim of 0
    scale = _as_float(softmax_scale)
    if not _positive_float32(scale):
        raise ValueError(f"flash_attn2: softmax_scale must be a positive finite float32 "
                         f"({FLOAT32_MIN:.3g}..{FLOAT32_MAX:.3g}), got {softmax_scale!r}")
    return scale


def _checking_inputs() -> bool:
    """FLASH_ATTN2_CHECK_INPUTS=1, in eager mode: the check syncs, which neither a traced graph nor a CUDA
    graph capture can do."""
    return not torch.compiler.is_compiling() and os.environ.get(CHECK_INPUTS_ENV, "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------------
# Internal entry points of flash-attn's names; the tests pass preallocated outputs to poison them.


def _flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        out=None, softmax_lse=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                        rng_state=None, learnable_sink=None):
    """Checked inputs -> (out, softmax_lse), written into out / softmax_lse when given (head dim a multiple of 8);
    window: (left, right) as the kernels take it (-1 unbounded; causal sets right to 0). dropout_p > 0 draws
    with rng_state's (seed, offset), an int64 CUDA tensor of 2 (flash_attn2/_dropout.py regenerates the mask)."""
    if out is None and dropout_p == 0.0:
        return _ops.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *window,
                        softcap, alibi_slopes, False, 0.0, learnable_sink)[:2]
    if v.shape[-1] != q.shape[-1]:  # MLA into given memory or with given dropout state: on padded tensors
        wide, lse = _flash_attn_forward(*_widen(q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, causal, None, softmax_lse, window, softcap, alibi_slopes,
                                        dropout_p, rng_state, learnable_sink)
        wide = wide[..., :v.shape[-1]]
        if softmax_lse is not None and lse is not softmax_lse:  # the padded call may have made its own
            lse = softmax_lse.copy_(lse)
        return (wide.contiguous() if out is None else out.copy_(wide)), lse
    if out is None:
        out = torch.empty_like(q)
        softmax_lse = q.new_empty(_ops.lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    _ops.ext.fwd_out(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, *window, softcap, alibi_slopes, dropout_p, rng_state, False, learnable_sink)
    return out, softmax_lse


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, deterministic, dq=None, dk=None, dv=None, window=(-1, -1),
                         softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    """The forward's tensors and dout -> (dq, dk, dv), written into dq / dk / dv when given; dropout_p and
    rng_state as the forward's."""
    if dq is None and dropout_p == 0.0:
        return _ops.bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, *window, softcap, alibi_slopes, deterministic)[:3]
    if v.shape[-1] != q.shape[-1]:  # MLA: on padded tensors (zero columns change no gradient), cut back
        grads = _flash_attn_backward(*_widen(dout, q, k, v, out), softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic,
                                     window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                     rng_state=rng_state)
        cut = [g[..., :t.shape[-1]] for g, t in zip(grads, (q, k, v))]
        if dq is None:
            return tuple(g.contiguous() for g in cut)
        for into, g in zip((dq, dk, dv), cut):
            into.copy_(g)
        return dq, dk, dv
    if dq is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _ops.ext.bwd_out(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, *window, softcap, alibi_slopes, deterministic, dropout_p,
                     rng_state, None, None, None)
    return dq, dk, dv


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None,
               learnable_sink=None, return_lse=False):
    _check_unsupported(block_table)
    dropout_p = _dropout_p(dropout_p)
    softcap = _softcap(softcap)
    check_types(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    if learnable_sink is not None:
        from ._sinks import check_sink
        check_sink(learnable_sink, q.shape[-2] if q.dim() >= 2 else 0, q)
    varlen = cu_seqlens_q is not None
    if varlen:
        check_max_seqlen(max_seqlen_q, max_seqlen_k)
    else:
        max_seqlen_q = max_seqlen_k = 0  # unused: the shapes give the lengths
    # No sequence is longer than q's / k's rows (dim -3 of valid tensors, fixed-length or varlen): a side at
    # least that wide is no window.
    causal, left, right = _window(bool(causal), window_size, q.shape[-3] if q.dim() >= 3 else 0,
                                  k.shape[-3] if k.dim() >= 3 else 0)
    scale = _softmax_scale(softmax_scale, q.shape[-1] if q.dim() else 1)
    # v's head dim may differ from q / k's (MLA): the ops run a pair kernel where the build has one for the call
    # (the Hopper forward), else pad the narrower side with zeros inside; out has v's head dim.
    checking_values = varlen and _checking_inputs()
    if not q.is_cuda or checking_values:
        # The op checks CUDA tensors itself; others get the same checks before the device error.
        check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_alibi_slopes(alibi_slopes, q, cu_seqlens_q)
        if checking_values:
            _check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
            _check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")
        if not q.is_cuda:
            raise ValueError(f"flash_attn2: q, k, v must be CUDA tensors, got device {q.device}")
    # learnable_sink: the kernels fold it into each row's softmax (csrc/kernels/common/sink.h); its gradient comes
    # from the backward's D (flash_attn2/_sinks.py has the math).
    out, softmax_lse, rng_state = _ops.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                           causal, left, right, softcap, alibi_slopes, bool(deterministic), dropout_p,
                                           learnable_sink)
    if not return_attn_probs:  # (return_lse: FA3's / vLLM's (out, lse), without dropout's S_dmask)
        return (out, softmax_lse) if return_lse else out
    # S_dmask carries the dropout pattern, as in flash-attn; without dropout it is None there too.
    s_dmask = None
    if dropout_p > 0.0:
        s_dmask = _dropout.s_dmask(q, k, rng_state, dropout_p, causal, scale, (left, right), softcap, alibi_slopes,
                                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, learnable_sink)
    return out, softmax_lse, s_dmask


# ----------------------------------------------------------------------------------------------------
# Public API (flash-attn 2.x signatures).


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                    s_aux=None):
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.

    causal aligns the mask to the bottom-right corner: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    window_size=(left, right), aligned the same way: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded; causal sets right
    to 0); only key blocks inside the window are computed. softcap > 0 caps the scaled scores s to
    softcap * tanh(s / softcap) before the softmax. alibi_slopes, fp32 (nheads,) or (batch, nheads), adds
    -slope * |i + seqlen_k - seqlen_q - j| to the scaled scores (with causal, +slope * j: the same softmax, as
    flash-attn). A query row that sees no key gets output 0 and softmax_lse -inf. Returns out (batch, seqlen_q,
    nheads, headdim); with return_attn_probs, (out, softmax_lse (batch, nheads, seqlen_q) fp32, None).
    learnable_sink (alias s_aux; FA4's and gpt-oss's attention sinks): (nheads,) fp32 / bf16 / fp16, one logit per
    query head in every row's softmax denominator with no value (a row with no key: out 0, softmax_lse = the sink);
    differentiable (dsink), forward and backward.
    """
    return _attention(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink=_sink_arg(learnable_sink, s_aux))


def _sink_arg(learnable_sink, s_aux):
    if learnable_sink is not None and s_aux is not None:
        raise ValueError("flash_attn2: pass learnable_sink or its alias s_aux, not both")
    return learnable_sink if learnable_sink is not None else s_aux


def _packed(t, name: str, dim: int, count: int, layout: str):
    """The count tensors packed in t along dim, or an error naming t and its expected layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn2: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != layout.count(",") + 1 or t.shape[dim] != count:
        raise ValueError(f"flash_attn2: {name} must be {layout}, got shape {tuple(t.shape)}")
    return t.unbind(dim=dim)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *,
                           seqused_k=None, num_splits=0, learnable_sink=None, s_aux=None, scheduler_metadata=None,
                           out=None, return_softmax_lse=False):
    """q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim); sequence b owns rows
    cu_seqlens[b]:cu_seqlens[b + 1] (int32, on q's device), clamped to the packed tensors: a decreasing pair is
    an empty sequence, rows outside every sequence get output 0 (and zero gradients). max_seqlen_q/k are hints
    (the longest sequence) that size the grid; any value >= 0 still computes every row.
    FLASH_ATTN2_CHECK_INPUTS=1 checks the values (eager mode; one sync) and names the first bad entry.

    Zero-length sequences are allowed. With return_attn_probs, (out, softmax_lse, None); with return_softmax_lse
    (FA3's and vLLM's keyword), (out, softmax_lse); softmax_lse is (nheads, total_q) fp32. cu_seqlens_k,
    max_seqlen_q and max_seqlen_k default to None so that vLLM's keyword call (block_table with seqused_k, no
    cu_seqlens_k) binds; without block_table each is required (a TypeError names it). v may have its own head dim
    (d_v, MLA: out has v's); learnable_sink (alias s_aux): (nheads,) one logit per head, as flash_attn_func's.

    block_table (batch, max_pages) int32: k / v are a paged cache (num_pages, page_size, nheads_k, headdim), any
    page_size >= 1, sequence b's keys the first seqused_k[b] (seqused_k: (batch,) int32, vLLM's call) or
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows through its table row (cu_seqlens_k may be None with seqused_k),
    clamped on the device to [0, the table's capacity max_pages * page_size] (no sync; a decreasing cu_seqlens_k pair
    is an empty sequence); table entries past a sequence's pages are never read (-1 padding is fine), others are
    clamped to the pages. Forward only (a backward raises), no dropout; num_splits and scheduler_metadata as
    flash_attn_with_kvcache's; out= gets the result.
    """
    learnable_sink = _sink_arg(learnable_sink, s_aux)
    if block_table is not None:
        from ._kvcache import metadata_splits
        if max_seqlen_q is None:
            raise TypeError("flash_attn2: flash_attn_varlen_func needs max_seqlen_q")
        num_splits = metadata_splits(scheduler_metadata, num_splits)
        result = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                               window_size, softcap, alibi_slopes, return_attn_probs or return_softmax_lse,
                               block_table, seqused_k, num_splits, learnable_sink, out)
        return result if return_attn_probs or not return_softmax_lse else result[:2]
    if seqused_k is not None or scheduler_metadata is not None or out is not None:
        raise NotImplementedError("flash_attn2: seqused_k, scheduler_metadata and out are supported with block_table (a "
                                  "paged cache) only")
    if num_splits:
        raise NotImplementedError("flash_attn2: num_splits is supported with block_table (a paged cache) only; "
                                  "flash_attn_with_kvcache takes it for a contiguous cache")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):  # None would make the call a fixed-length one
            raise TypeError(f"flash_attn2: {name} must be a torch.Tensor, got {type(cu).__name__}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if n is None:
            raise TypeError(f"flash_attn2: flash_attn_varlen_func needs {name}")
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                      learnable_sink, return_lse=return_softmax_lse)


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, block_table, seqused_k, num_splits,
                  learnable_sink=None, out=None):
    """flash_attn_varlen_func against a paged cache: the kv-cache op with varlen q; `out` (vLLM's keyword) gets a copy
    of the result (not yet written in place)."""
    from ._kvcache import _kvcache_call

    if _dropout_p(dropout_p) > 0.0:
        raise NotImplementedError("flash_attn2: dropout_p > 0 with block_table (a paged cache) is not supported")
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"flash_attn2: cu_seqlens_q must be a torch.Tensor, got {type(cu_seqlens_q).__name__}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or
                            out.device != q.device):
        raise ValueError(f"flash_attn2: out must be a tensor of q's shape {tuple(q.shape)}, dtype {q.dtype} and "
                         f"device {q.device}")

    def call():
        try:
            result, lse = _kvcache_call(q, k_cache, v_cache, None, None, None, None, seqused_k, None, None,
                                        block_table, cu_seqlens_k, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                                        window_size, softcap, True, alibi_slopes, num_splits, True, learnable_sink)
        except (TypeError, ValueError, NotImplementedError) as error:
            raise _in_callers_names(error) from error
        return (out.copy_(result) if out is not None else result), lse

    # flash-attn's own tests call it with q requiring grad: the forward runs, a backward raises
    result, lse = _forward_only(call, "the paged forward (block_table)", q, k_cache, v_cache, learnable_sink)
    return (result, lse, None) if return_attn_probs else result


def _in_callers_names(error):
    """The kv-cache call's argument error in the paged varlen call's names (flash_attn_varlen_func passes seqused_k as
    cache_seqlens and k / v as the caches): the error a vLLM caller can act on."""
    import re
    message = str(error).replace("cache_seqlens (seqused_k)", "seqused_k")
    for ours, theirs in (("cache_seqlens", "seqused_k"), ("k_cache", "k"), ("v_cache", "v"),
                         ("flash_attn_with_kvcache", "flash_attn_varlen_func with block_table")):
        message = re.sub(rf"\b{ours}\b", theirs, message)
    return type(error)(message)


def _forward_only(call, what, *inputs):
    """call()'s result (a tensor or a tuple of them) from a call with no backward kernel. Where a gradient can be
    asked for (grad mode, an input requiring grad) it runs without grad and each tensor gets a node whose backward
    raises NotImplementedError naming `what`, instead of its inputs silently getting no gradient; elsewhere as it is
    (no grad context around the op, so that an exported graph keeps the op at the top level)."""
    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return call()
    with torch.no_grad():
        result = call()
    if isinstance(result, torch.Tensor):
        return _NoBackward.apply(result, what, *inputs)
    return tuple(_NoBackward.apply(t, what, *inputs) for t in result)


class _NoBackward(torch.autograd.Function):
    """A forward-only call's output under grad mode (the paged varlen call, flash_attn_with_kvcache): the same tensor,
    whose backward raises (no backward kernel serves it) instead of silently giving its inputs no gradient."""

    @staticmethod
    def forward(ctx, result, what, *inputs):
        ctx.what = what
        return result.view_as(result)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(f"flash_attn2: {ctx.what} has no backward; gradients through it are not supported")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None, s_aux=None):
    """qkv (batch, seqlen, 3, nheads, headdim); learnable_sink (alias s_aux) as flash_attn_func's."""
    q, k, v = _packed(qkv, "qkv", 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink=learnable_sink, s_aux=s_aux)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None, s_aux=None):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim); learnable_sink (alias
    s_aux) as flash_attn_func's."""
    k, v = _packed(kv, "kv", 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink=learnable_sink, s_aux=s_aux)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None, s_aux=None):
    """qkv (total, 3, nheads, headdim); learnable_sink (alias s_aux) as flash_attn_func's."""
    q, k, v = _packed(qkv, "qkv", 1, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink, s_aux=s_aux)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    learnable_sink=None, s_aux=None):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim); learnable_sink (alias s_aux) as
    flash_attn_func's."""
    k, v = _packed(kv, "kv", 1, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink, s_aux=s_aux)


def compiled_head_dims(dtype: torch.dtype) -> list[int]:
    """Head-dim buckets with a compiled forward kernel for dtype."""
    return [d for d in range(32, MAX_HEAD_DIM + 1, 32) if _ops.ext.fwd_head_dim_bucket(d, dtype == torch.bfloat16) == d]


# flash_attn_with_kvcache lives with its op's fake; flash-attn exports it from this module.
from ._kvcache import flash_attn_with_kvcache  # noqa: E402
