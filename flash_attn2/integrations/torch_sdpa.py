"""flash_attn2 as PyTorch's SDPA flash backend (torch >= 2.11's flash-attention registry).

    import flash_attn2.integrations.torch_sdpa  # registers "flash_attn2"; activates nothing
    torch.nn.attention.activate_flash_attention_impl("flash_attn2")
    ...  # F.scaled_dot_product_attention under the flash backend, varlen_attn, torch's context parallel
    torch.nn.attention.restore_flash_attention_impl()  # PyTorch's own kernels again

Activation overrides the CUDA kernels of the four aten flash ops, as torch's own FA3 / FA4 adapters do
(torch/nn/attention/_fa3.py): `_scaled_dot_product_flash_attention` (+ backward), which SDPA calls with
(batch, heads, seqlen, head_dim) tensors, and `_flash_attention_forward` / `_backward`, which `varlen_attn` and
the dense SDPA op's PyTorch kernel call with (batch, seqlen, heads, head_dim) or packed (total, heads, head_dim)
ones. SDPA's own eligibility checks still decide when the flash backend runs; the adapter only replaces the
kernels. Inputs pass as strided views (no copy where the strides allow; outputs in the query's strides, as
PyTorch's meta functions say), GQA shapes pass through unexpanded, dropout draws from torch's CUDA generator and
hands back the (seed, offset) pair as SDPA's rng_state, so SDPA's backward contract holds.

A call flash_attn2 cannot serve (a head dim or dtype its build lacks, `seqused_k`, `return_debug_mask=True`) runs
PyTorch's kernel for that op, captured before the override, and is logged once per reason; the backward's fallback
follows the same rule on what it sees, so both halves of a call agree (they differ only in what needs the dropout
mask: `return_debug_mask` with dropout raises). Without dropout, PyTorch's forward and ours compute the same out
and LSE, so either backward serves either forward.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch.library import Library


NAME = "flash_attn2"
logger = logging.getLogger(__name__)

_OPS = ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward")
_logged: set[str] = set()


def _log_fallback(op: str, why: str) -> None:
    if why not in _logged:
        _logged.add(why)
        logger.warning("flash_attn2 SDPA backend: %s runs PyTorch's own kernel (%s); logged once", op, why)


class _Handle:
    """What activate_flash_attention_impl keeps: the override library; remove() drops it (PyTorch's kernels
    return)."""

    def __init__(self, library: Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
        self.library = None


def _ext():
    """The extension module (loaded by the first call's import, cached by Python's import system after)."""
    from .. import _ops

    return _ops.ext


_BUCKETS: dict[tuple[int, torch.dtype], int] = {}  # (head dim, dtype) -> the compiled bucket (0: none)


def _bucket(head_dim: int, dtype: torch.dtype) -> int:
    bucket = _BUCKETS.get((head_dim, dtype))
    if bucket is None:
        bucket = _BUCKETS[head_dim, dtype] = _ext().fwd_head_dim_bucket(head_dim, dtype == torch.bfloat16)
    return bucket


def support_error(q: torch.Tensor, tensors, dtype=None, seqused_k=None, return_debug_mask=False,
                  scale=None) -> str | None:
    """Why flash_attn2 cannot serve a call, or None. q's last dim is the head dim in every layout."""
    if not all(t.is_cuda for t in tensors):
        return "inputs not on a CUDA device"
    if scale is not None and not (0.0 < float(scale) < math.inf):  # SDPA takes any scale; our kernels a positive one
        return f"scale {scale} (flash_attn2's kernels take a positive finite softmax scale)"
    if q.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != q.dtype for t in tensors):
        return f"dtype {q.dtype}: flash_attn2 takes float16 / bfloat16"
    if seqused_k is not None:
        return "seqused_k is not supported yet"
    if return_debug_mask:
        return "return_debug_mask=True"
    head_dim = q.shape[-1]
    if any(t.dim() == q.dim() and t.shape[-1] != head_dim for t in tensors):
        return "head dims differ among q, k, v (PyTorch's flash ops take one)"
    if not 0 < head_dim <= 256 or _bucket(head_dim, q.dtype) == 0:
        return f"head dim {head_dim} in {q.dtype} is not compiled in this flash_attn2 build"
    return None


def _check_debug_mask(return_debug_mask: bool, dropout_p: float) -> None:
    """PyTorch's kernel returns the debug mask, but a backward sees only its (seed, offset), which ours cannot redraw
    from: a forward with dropout served by PyTorch would get our backward's other mask (wrong gradients)."""
    if return_debug_mask and dropout_p > 0:
        raise RuntimeError("flash_attn2 SDPA backend: return_debug_mask=True with dropout_p > 0 is not supported; "
                           "torch.nn.attention.restore_flash_attention_impl() gives PyTorch's kernels back")


def _check_no_lost_arguments(seqused_k, alibi_slopes, inputs) -> None:
    """aten::_flash_attention_forward takes seqused_k and alibi_slopes, but its backward (PyTorch's derivative
    formula) is called without them: gradients would silently leave them out, on our kernels or PyTorch's. Refused
    where a gradient can be asked for; forward-only calls are served."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return
    for name, value in (("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise NotImplementedError(f"flash_attn2 SDPA backend: {name} with gradients is not supported (PyTorch's "
                                      f"backward of _flash_attention_forward does not receive it)")


def _window(left, right) -> tuple[int, int]:
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def _scale(scale, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def _rng_input(philox_seed: torch.Tensor, dropout_p: float):
    """Our rng_state (2,) int64 from SDPA's philox_seed, where the forward had dropout."""
    return philox_seed.view(torch.int64) if dropout_p > 0 and philox_seed.numel() == 2 else None


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, window, rng_state):
    from .. import _ops

    left, right = window
    return _ops.bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, 0.0, None,
                    torch.are_deterministic_algorithms_enabled(), dropout_p, rng_state)[:3]


def _register() -> _Handle:
    """register_fn of the registry: captures PyTorch's kernels (for the fallback), then overrides them."""
    from .. import _ops  # noqa: F401  (loads the extension: fails here, not at the first call, if it cannot)

    original = {name: torch.library.get_kernel(f"aten::{name}", "CUDA") for name in _OPS}

    def flash_forward(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                      return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                      seqused_k=None, alibi_slopes=None):
        _check_debug_mask(return_debug_mask, dropout_p)
        _check_no_lost_arguments(seqused_k, alibi_slopes, (query, key, value))
        why = support_error(query, (query, key, value), seqused_k=seqused_k, return_debug_mask=return_debug_mask,
                            scale=scale)
        if why is not None:
            _log_fallback("_flash_attention_forward", why)
            return original["_flash_attention_forward"].call_boxed(
                keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, scale=scale, window_size_left=window_size_left,
                window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes)
        # One C++ call (csrc/flash_api.cpp: flash_fwd): out in query's strides (the meta function's), lse, SDPA's
        # philox outputs, the empty debug mask.
        varlen = cum_seq_q is not None and cum_seq_q.numel() > 0
        return _ext().flash_fwd(query, key, value, cum_seq_q if varlen else None, cum_seq_k if varlen else None,
                                int(max_q), int(max_k), dropout_p, is_causal, _scale(scale, query.shape[-1]),
                                *_window(window_size_left, window_size_right), alibi_slopes)

    def flash_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                       window_size_right=None):
        why = support_error(query, (grad_out, query, key, value, out), scale=scale)
        if why is not None:
            _log_fallback("_flash_attention_backward", why)
            return original["_flash_attention_backward"].call_boxed(
                keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, rng_state, unused, scale=scale, window_size_left=window_size_left,
                window_size_right=window_size_right)
        varlen = cum_seq_q is not None and cum_seq_q.numel() > 0
        return _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q if varlen else None,
                         cum_seq_k if varlen else None, int(max_q), int(max_k), dropout_p, is_causal,
                         _scale(scale, query.shape[-1]), _window(window_size_left, window_size_right),
                         _rng_input(rng_state, dropout_p))

    def sdpa_forward(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                     scale=None):
        _check_debug_mask(return_debug_mask, dropout_p)
        why = support_error(query, (query, key, value), return_debug_mask=return_debug_mask, scale=scale)
        if why is not None:
            _log_fallback("_scaled_dot_product_flash_attention", why)
            return original["_scaled_dot_product_flash_attention"].call_boxed(
                keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
        # One C++ call (csrc/flash_api.cpp: sdpa_fwd): the kernels' (batch, seqlen, heads, d) views of SDPA's
        # (batch, heads, seqlen, d) tensors, out in query's strides, SDPA's philox outputs, the empty debug mask.
        out, lse, seed, offset, debug_mask = _ext().sdpa_fwd(query, key, value, dropout_p, is_causal,
                                                             _scale(scale, query.shape[-1]))
        return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask

    def sdpa_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                      dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        why = support_error(query, (grad_out, query, key, value, out), scale=scale)
        if why is not None:
            _log_fallback("_scaled_dot_product_flash_attention_backward", why)
            return original["_scaled_dot_product_flash_attention_backward"].call_boxed(
                keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, philox_seed, philox_offset, scale=scale)
        return _ext().sdpa_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                               _scale(scale, query.shape[-1]), philox_seed)

    lib = Library("aten", "IMPL", "CUDA")  # noqa: TOR901
    with warnings.catch_warnings():  # overriding PyTorch's kernels is the point
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name, fn in zip(_OPS, (flash_forward, flash_backward, sdpa_forward, sdpa_backward)):
            lib.impl(name, fn, "CUDA", with_keyset=True)
    return _Handle(lib)


def register() -> None:
    """Make "flash_attn2" available to torch.nn.attention.activate_flash_attention_impl. Idempotent; activates
    nothing."""
    from torch.nn.attention import _registry

    _registry.register_flash_attention_impl(NAME, register_fn=_register)


register()
