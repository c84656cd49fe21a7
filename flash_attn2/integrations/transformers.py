"""Hugging Face transformers integration: `attn_implementation="flash_attn2"`.

    import flash_attn2.integrations.transformers  # registers "flash_attn2"
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="flash_attn2")

Importing this module registers the name (its only purpose); `register()` does the same and may be
called any number of times. Developed against transformers 5.17, whose own flash-attention path
(`integrations/flash_attention.py`, `modeling_flash_attention_utils._flash_attention_forward`) it follows:

- the model hands the attention function a 2-D padding mask or None (the mask hook registered here);
- a padding mask: unpad -> `flash_attn_varlen_func` -> pad; queries shorter than keys (decoding after a
  cache) are the mask's last columns; key slots past the mask (a static cache) are unused;
- no padding mask, and `cu_seq_lens_q/k` + `max_length_q/k` given (e.g. DataCollatorWithFlattening):
  varlen over the flattened batch;
- no padding mask, and position ids that restart inside a row (packed sequences): varlen, a sequence
  starting wherever a position is not the previous one + 1 (the rule transformers' sdpa/eager masks use).
  Finding them reads position_ids back (a device sync), so it runs once per forward, and only where
  transformers looks too: for a batch of one row (as its flash path), else where the model's own mask
  found packing (`create_causal_mask` looks when the model holds no KV cache; with one, sdpa and eager
  attend across the packed rows' sequences, and so does this). Where the mask has read the same
  position_ids and found no packing, its answer is taken (no second sync); a batch of one row with a KV
  cache (a training forward with the default `use_cache`) still syncs once per forward, as transformers'
  flash path does per layer;
- float32 q/k/v (a model left in float32, PEFT's fp32 norms) run in the half dtype transformers' flash
  path picks, bfloat16 where that is float32 too, and the output is cast back;
- GQA/MQA: k/v keep their fewer heads; `scaling` and `is_causal` (kwarg, else the module's) are honoured;
- a sliding window (`sliding_window`, e.g. Mistral) as transformers' flash path passes it: (w - 1, w - 1),
  which causal makes (w - 1, 0); logit soft-capping (`softcap`, Gemma 2);
- attention dropout while training (`dropout`, config.attention_dropout), with the kernels' dropout;
- attention sinks (`s_aux`, gpt-oss), forward and backward (flash_attn2's learnable_sink).

What flash_attn2 cannot honour raises NotImplementedError naming it, before any kernel runs: `output_attentions=True`,
a 4-D (custom) attention mask, a model's own or/and mask functions, packed sequences with a KV cache, and any other non-None keyword argument not listed in
`_NOT_FOR_ATTENTION`.

What this needs from transformers' private internals (two wrapped functions) and the answers it keeps to save
a device sync per forward live in `_transformers_private.py`, with the versions they were written against.
"""

from __future__ import annotations

import os

import torch

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.masking_utils import flash_attention_mask
    from transformers.utils import logging

    from . import _transformers_private as _private
except ImportError as e:
    raise ImportError(f"flash_attn2.integrations.transformers needs Hugging Face transformers 5.x ({e}): "
                      "pip install transformers") from e

from ..bert_padding import pad_input, unpad_input
from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

ATTN_IMPLEMENTATION = "flash_attn2"

logger = logging.get_logger(__name__)

_HALF = (torch.float16, torch.bfloat16)
# Keyword arguments models pass down to every attention function that do not concern attention: caching
# flags, output flags consumed elsewhere, the loss normaliser, and mamba layers' packing index (attention
# reads packing from position_ids or cu_seq_lens).
_NOT_FOR_ATTENTION = frozenset({"use_cache", "num_items_in_batch", "output_hidden_states", "output_router_logits",
                                "seq_idx"})
_USE_INSTEAD = "; use attn_implementation='sdpa' or 'eager' for this model"


def register() -> None:
    """Make `attn_implementation="flash_attn2"` available to every transformers model, and "paged|flash_attn2" to
    continuous batching (`generate_batch`: transformers' own paged attention function, which calls our
    flash_attn_varlen_func and flash_attn_with_kvcache with a block table). Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, flash_attn2_attention_forward)
    AttentionInterface.register(f"paged|{ATTN_IMPLEMENTATION}", _paged_attention_forward())
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attn2_mask)
    # transformers preloads every "flash" implementation through a private function; answered with these
    _private.install(ATTN_IMPLEMENTATION, _flash_functions)


def _paged_attention_forward():
    from transformers.integrations.flash_paged import paged_attention_forward
    return paged_attention_forward


def _flash_functions():
    """What transformers' flash-attention preload (_lazy_imports) returns for "flash_attn2": (flash_fn,
    flash_varlen_fn, flash_with_kvcache_fn, pad_fn, unpad_fn)."""
    return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input


def flash_attn2_mask(*args, use_vmap=False, **kwargs):
    """transformers' flash-attention mask: the 2-D (batch, kv_len) padding mask, or None if nothing is padded."""
    # create_*_mask sets use_vmap exactly when the model adds its own or_mask_function / and_mask_function
    # (e.g. bidirectional attention over image tokens): a pattern a 2-D padding mask cannot carry, which
    # transformers' flash path drops without a word.
    if use_vmap:
        raise NotImplementedError("flash_attn2: this model adds its own mask function (or_mask_function / "
                                  "and_mask_function) to the causal mask, which flash_attn2 cannot apply"
                                  + _USE_INSTEAD)
    # A new mask is a new forward: whether it found packing is noted for the attention calls that follow, and
    # the packing answers kept for earlier position_ids no longer hold.
    _private.mask_built(kwargs)
    return flash_attention_mask(*args, **kwargs)


def flash_attn2_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  sliding_window=None, softcap=None, is_causal=None, s_aux=None, position_ids=None,
                                  cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                                  deterministic=None, output_attentions=False, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seq_q, head_dim), key/value
    (batch, kv_heads, seq_k, head_dim) -> (output (batch, seq_q, heads, head_dim) in query's dtype, None)."""
    _check_supported(attention_mask, output_attentions, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # flash layout (batch, seq, heads, dim), views
    # MLA's value heads (d_v != d_qk) go as they are: the kernels take both head dims (a pair kernel, or padding
    # inside the op where the build has none for the call); out has v's head dim.
    half = _half_dtype(query, module)
    q, k, v = (t.to(half) for t in (q, k, v))
    flash_kwargs = {
        "softmax_scale": scaling,
        # is_causal as a kwarg overrides the module's (decoders used as encoders); sdpa's default
        "causal": getattr(module, "is_causal", True) if is_causal is None else bool(is_causal),
        # transformers' flash path: sliding_window counts the query's own key; causal makes it (w - 1, 0)
        "window_size": (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1),
        "softcap": 0.0 if softcap is None else softcap,  # Gemma 2's attn_logit_softcapping
        # attention dropout only while training, as in eager attention
        "dropout_p": float(dropout) if module.training else 0.0,
        # transformers' flash path reads the same variable
        "deterministic": (os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1" if deterministic is None
                          else bool(deterministic)),
    }
    if s_aux is not None:  # attention sinks (gpt-oss): one logit per query head, flash_attn2/_sinks.py
        flash_kwargs["learnable_sink"] = s_aux
    seqlen_kwargs = {"cu_seq_lens_q": cu_seq_lens_q, "cu_seq_lens_k": cu_seq_lens_k, "max_length_q": max_length_q,
                     "max_length_k": max_length_k}
    given = [name for name, arg in seqlen_kwargs.items() if arg is not None]
    if given and (attention_mask is not None or len(given) < 4):
        raise ValueError(f"flash_attn2: {', '.join(given)} must come as all four of {', '.join(seqlen_kwargs)} and "
                         "without a padding attention_mask (they describe the sequences themselves)")

    if attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, flash_kwargs)
    elif given:
        out = _flat_varlen(q, k, v, cu_seq_lens_q.to(device=q.device, dtype=torch.int32),
                           cu_seq_lens_k.to(device=q.device, dtype=torch.int32), int(max_length_q), int(max_length_k),
                           flash_kwargs)
    elif (packed := _packed_cu_seqlens(position_ids, *q.shape[:2], getattr(module, "config", None))) is not None:
        if k.shape[1] != q.shape[1]:
            raise NotImplementedError(f"flash_attn2: packed sequences (position_ids restarting inside a row) with a "
                                      f"KV cache ({k.shape[1]} keys for {q.shape[1]} queries) are not supported")
        cu_seqlens, max_seqlen = packed
        out = _flat_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, flash_kwargs)
    else:
        out = flash_attn_func(q, k, v, **flash_kwargs)
    return out.to(query.dtype), None


def _check_supported(attention_mask, output_attentions, kwargs):
    """Raise for what flash_attn2 cannot honour, before any tensor work (so it also raises on CPU)."""
    if output_attentions:
        raise NotImplementedError("flash_attn2: output_attentions=True is not supported: flash attention never "
                                  "forms the attention weights; use attn_implementation='eager'")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"flash_attn2: attention_mask must be the 2-D (batch, kv_len) padding mask, got "
                                  f"shape {tuple(attention_mask.shape)}: custom 4-D masks are not supported"
                                  + _USE_INSTEAD)
    unknown = sorted(name for name, arg in kwargs.items() if arg is not None and name not in _NOT_FOR_ATTENTION)
    if unknown:
        raise NotImplementedError(f"flash_attn2: attention argument(s) {', '.join(unknown)} are not supported"
                                  + _USE_INSTEAD)


def _half_dtype(query, module) -> torch.dtype:
    """fp16/bf16 inputs run as they are. float32 runs in transformers' flash-path choice (get_target_dtype:
    the autocast dtype, a quantized model's dtype, else the module's first Linear weight's dtype) and, where
    that is float32 too (a model left in float32), in bfloat16: it keeps float32's exponent range."""
    if query.dtype != torch.float32:
        return query.dtype  # half, or a dtype the kernels reject with a message naming it
    target = get_target_dtype(query, module)
    target = target if target in _HALF else torch.bfloat16
    logger.warning_once(f"flash_attn2: float32 q/k/v run in {target} (the kernels take fp16/bf16); the attention "
                        "output is cast back to float32")
    return target


def _padded_attention(q, k, v, mask, flash_kwargs):
    """Unpad -> varlen -> pad. mask (batch, kv_len), True/1 = token; outputs at padded queries are 0."""
    batch, q_len = q.shape[:2]
    kv_len = mask.shape[1]
    if kv_len > k.shape[1] or q_len > kv_len:
        raise ValueError(f"flash_attn2: attention_mask covers {kv_len} key positions; expected at most the "
                         f"{k.shape[1]} keys and at least the {q_len} queries")
    # A static cache holds more key slots than the mask covers; the slots past it are unused.
    k, v = k[:, :kv_len], v[:, :kv_len]
    k, indices_k, cu_seqlens_k, max_seqlen_k, _ = unpad_input(k, mask)
    v = v.reshape(-1, *v.shape[2:])[indices_k]
    if q_len == kv_len:
        q, indices_q = q.reshape(-1, *q.shape[2:])[indices_k], indices_k
        cu_seqlens_q, max_seqlen_q = cu_seqlens_k, max_seqlen_k
    else:  # the queries are the last q_len positions (decoding after a cache; padding is on the left)
        q, indices_q, cu_seqlens_q, max_seqlen_q, _ = unpad_input(q, mask[:, -q_len:])
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **flash_kwargs)
    return pad_input(out, indices_q, batch, q_len)


def _flat_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, flash_kwargs):
    """Sequences laid end to end over the flattened batch (no padding)."""
    batch = q.shape[0]
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **flash_kwargs)
    return out.view(batch, -1, *out.shape[1:])


def _packed_cu_seqlens(position_ids, batch: int, seq_len: int, config=None):
    """(cu_seqlens int32 over the flattened batch * seq_len tokens, max_seqlen) when position ids restart
    inside a row, else None. A sequence starts at each row's first token and wherever a position is not the
    previous one + 1, as in transformers' masks for sdpa/eager (masking_utils.find_packed_sequence_indices).
    A batch of several rows whose model's mask (`config`'s, just built) found no packing is not looked at, nor
    any position_ids the mask has read and found unpacked (no KV cache)."""
    if position_ids is None or seq_len == 1:
        return None
    if position_ids.dim() != 2 or position_ids.shape[1] != seq_len:
        raise ValueError(f"flash_attn2: position_ids must be (batch, {seq_len}) to detect packed sequences, got "
                         f"shape {tuple(position_ids.shape)}")
    # The answer needs the values on the host (a device sync): _find_packing, unless an answer kept for this
    # forward holds (at most one look per forward; _transformers_private.packing).
    return _private.packing(position_ids, batch, seq_len, config, _find_packing)


def _find_packing(position_ids, batch: int, seq_len: int):
    pos = position_ids.expand(batch, -1)  # models often pass (1, seq_len) for the whole batch
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not starts[:, 1:].any():
        return None
    cu_seqlens = torch.cat([starts.flatten().nonzero().flatten(), starts.new_tensor([pos.numel()], dtype=torch.long)])
    cu_seqlens = cu_seqlens.to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


register()
