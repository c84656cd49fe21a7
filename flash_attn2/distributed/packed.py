"""ring-flash-attn 0.1.8's packed forms: qkv (batch, seqlen, 3, heads, d) or kv (batch, seqlen, 2, heads_k, d), and
the varlen ones (total, 3, heads, d) / (total, 2, heads_k, d), split into views and handed to the unpacked function
(gradients flow back into the packed tensor through the views). Same arguments and returns otherwise."""

from __future__ import annotations

from .llama3 import llama3_flash_attn_varlen_func
from .ring import refuse_with_peers, ring_flash_attn_func, stripe_flash_attn_func, zigzag_ring_flash_attn_func
from .ring_varlen import ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_func


def _split(packed, count, name, varlen, group):
    dim = 1 if varlen else 2
    if packed.dim() != (4 if varlen else 5) or packed.shape[dim] != count:
        form = "(total, {n}, heads, d)" if varlen else "(batch, seqlen, {n}, heads, d)"
        # a refusal its peers hear of (ring.refuse_with_peers), not one rank raising while the others wait
        refuse_with_peers(group, ValueError(f"flash_attn2.distributed: {name} must be {form.format(n=count)}, got "
                                            f"shape {tuple(packed.shape)}"))
    return packed.unbind(dim)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    return ring_flash_attn_func(*_split(qkv, 3, "qkv", False, group), dropout_p, softmax_scale, causal, window_size,
                                alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    return ring_flash_attn_func(q, *_split(kv, 2, "kv", False, group), dropout_p, softmax_scale, causal, window_size,
                                alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                          alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    return zigzag_ring_flash_attn_func(*_split(qkv, 3, "qkv", False, group), dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    return zigzag_ring_flash_attn_func(q, *_split(kv, 2, "kv", False, group), dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group)


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    return stripe_flash_attn_func(*_split(qkv, 3, "qkv", False, group), dropout_p, softmax_scale, causal, window_size,
                                  alibi_slopes, deterministic, return_attn_probs, group)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    return stripe_flash_attn_func(q, *_split(kv, 2, "kv", False, group), dropout_p, softmax_scale, causal, window_size,
                                  alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None):
    return ring_flash_attn_varlen_func(*_split(qkv, 3, "qkv", True, group), cu_seqlens, max_seqlen, dropout_p,
                                       softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                       return_attn_probs, group)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None):
    return ring_flash_attn_varlen_func(q, *_split(kv, 2, "kv", True, group), cu_seqlens, max_seqlen, dropout_p,
                                       softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                       return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None):
    return zigzag_ring_flash_attn_varlen_func(*_split(qkv, 3, "qkv", True, group), cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                              return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None):
    return zigzag_ring_flash_attn_varlen_func(q, *_split(kv, 2, "kv", True, group), cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                              return_attn_probs, group)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None):
    return llama3_flash_attn_varlen_func(*_split(qkv, 3, "qkv", True, group), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None):
    return llama3_flash_attn_varlen_func(q, *_split(kv, 2, "kv", True, group), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group)
