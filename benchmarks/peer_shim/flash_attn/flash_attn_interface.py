"""flash-attn 2.8's private forward / backward functions (the four ring-flash-attn imports), mapped onto flash_attn2.

Forward: (out, softmax_lse, S_dmask None, rng_state None). Backward: writes dq, dk, dv (views allowed) and returns
None where flash-attn returns softmax_d (ring-flash-attn does not read it).
"""

from flash_attn2 import flash_attn_interface as _fa


def _no_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError("flash_attn shim (flash_attn2): dropout_p > 0 is not mapped")


def _window(causal, left, right, seqlen_q, seqlen_k):
    causal, left, right = _fa._window(bool(causal), (left, right), seqlen_q, seqlen_k)
    return causal, (left, right)


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    _no_dropout(dropout_p)
    causal, window = _window(causal, window_size_left, window_size_right, q.shape[1], k.shape[1])
    out, lse = _fa._flash_attn_forward(q, k, v, None, None, 0, 0, softmax_scale, causal, window=window,
                                       softcap=softcap, alibi_slopes=alibi_slopes)
    return out, lse, None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _no_dropout(dropout_p)
    causal, window = _window(causal, window_size_left, window_size_right, q.shape[1], k.shape[1])
    # ring-flash-attn's merged lse is a transposed view (its layout up to TorchScript's fuser); the kernels take it
    # contiguous.
    _fa._flash_attn_backward(dout, q, k, v, out, softmax_lse.contiguous(), None, None, 0, 0, softmax_scale, causal,
                             deterministic, dq=dq, dk=dk, dv=dv, window=window, softcap=softcap,
                             alibi_slopes=alibi_slopes)
    return None


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False):
    _no_dropout(dropout_p)
    if block_table is not None or leftpad_k is not None or seqused_k is not None:
        raise NotImplementedError("flash_attn shim (flash_attn2): block_table / leftpad_k / seqused_k are not mapped")
    causal, window = _window(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k)
    out, lse = _fa._flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       softmax_scale, causal, window=window, softcap=softcap,
                                       alibi_slopes=alibi_slopes)
    return out, lse, None, None


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    _no_dropout(dropout_p)
    causal, window = _window(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k)
    _fa._flash_attn_backward(dout, q, k, v, out, softmax_lse.contiguous(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, softmax_scale, causal, deterministic, dq=dq, dk=dk, dv=dv, window=window,
                             softcap=softcap, alibi_slopes=alibi_slopes)
    return None
