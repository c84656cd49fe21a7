"""flash-attn 2.x's `flash_attn_with_kvcache` on flash_attn2's split-KV forward, and its op's fake.

The op `flash_attn2::fwd_kvcache` (csrc/flash_api.cpp) writes the new k / v into the caches (its schema marks
k_cache and v_cache mutated), rotates them and q where rotary tables are given, then runs the split-KV forward
(csrc/kernels/sm80/fwd_split_kernel.h). The checks below run in the wrapper and in the fake, so torch.compile
sees the same errors as an eager call.
"""

from __future__ import annotations

import operator

import torch

from . import _ops
from ._checks import (DTYPES, MAX_HEAD_DIM, MAX_SEQLEN, check_alibi_slopes, check_cu_seqlens, require_device,
                      require_last_dim_contiguous, require_tensor)
# Imported at the end of flash_attn_interface, after these are defined there.
from .flash_attn_interface import _softcap, _softmax_scale, _window

MAX_SPLITS = 128  # flash_attn2.h: kMaxKvSplits


def _int_rows(t, name, batch, q):
    """An optional (batch,) int32 tensor on q's device."""
    if t is None:
        return
    require_tensor(t, name)
    if t.dtype != torch.int32:
        raise TypeError(f"flash_attn2: {name} must be int32, got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"flash_attn2: {name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    require_device(t, name, q)


def check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  alibi_slopes, num_splits, block_table=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0):
    """Every tensor argument of flash_attn_with_kvcache (metadata only: no value is read). With cu_seqlens_q, q is
    (total_q, nheads, headdim), checked as a batch of one row whose sequences cu_seqlens_q delimits."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_tensor(t, name)
    if cu_seqlens_q is not None:
        _check_varlen_q(q, k, rotary_cos, cache_seqlens, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q)
        q = q[None]  # (1, total_q, nheads, headdim): the checks below, batch counted from cu_seqlens_q
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None:
            continue
        require_tensor(t, name)
        if t.dtype not in DTYPES:
            raise TypeError(f"flash_attn2: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"flash_attn2: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"flash_attn2: {name} must be 4-D (batch, seqlen, nheads, headdim), got shape "
                             f"{tuple(t.shape)}")
        require_last_dim_contiguous(t, name)
        require_device(t, name, q)
    batch, seqlen_q, heads, head_dim = q.shape
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
    if batch == 0:
        raise ValueError("flash_attn2: batch size must be positive, got an empty batch (q.shape[0] == 0)")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attn2: head dim (q.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if k_cache.shape[:-1] == v_cache.shape[:-1] and k_cache.shape[-1] != v_cache.shape[-1]:
        raise NotImplementedError(f"flash_attn2: v_cache's head dim ({v_cache.shape[-1]}) other than k_cache's "
                                  f"({k_cache.shape[-1]}) (MLA) is not supported by flash_attn_with_kvcache yet; "
                                  "flash_attn_func and flash_attn_varlen_func take it")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"flash_attn2: k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch_cache, seqlen_cache, heads_k, head_dim_k = k_cache.shape
    if block_table is not None:  # k_cache: (num_pages, page_size, nheads_k, headdim); capacity: max_pages * page_size
        require_tensor(block_table, "block_table")
        if block_table.dtype != torch.int32:
            raise TypeError(f"flash_attn2: block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"flash_attn2: block_table must be (batch, max_pages) = ({batch}, max_pages >= 1), got "
                             f"shape {tuple(block_table.shape)}")
        if block_table.stride(-1) != 1:
            raise ValueError(f"flash_attn2: block_table must have contiguous rows (stride 1), got strides "
                             f"{tuple(block_table.stride())}")
        require_device(block_table, "block_table", q)
        if cache_batch_idx is not None:
            raise ValueError("flash_attn2: cache_batch_idx cannot be combined with block_table (a paged cache)")
        if seqlen_cache == 0 or batch_cache == 0:
            raise ValueError(f"flash_attn2: a paged k_cache must be (num_pages >= 1, page_size >= 1, nheads_k, headdim),"
                             f" got {tuple(k_cache.shape)}")
        seqlen_cache *= block_table.shape[1]
    if head_dim_k != head_dim:
        raise ValueError(f"flash_attn2: k_cache's head dim must equal q's ({head_dim}), got {head_dim_k}")
    if heads_k == 0 or heads % heads_k != 0:
        raise ValueError(f"flash_attn2: q's nheads ({heads}) must be a positive multiple of k_cache's nheads "
                         f"({heads_k})")
    if cache_batch_idx is None and block_table is None and batch_cache != batch:
        raise ValueError(f"flash_attn2: k_cache's batch size ({batch_cache}) must equal q's ({batch}) without "
                         f"cache_batch_idx")
    if batch_cache == 0:
        raise ValueError("flash_attn2: k_cache must have at least one batch entry")
    if (k is None) != (v is None):
        raise ValueError("flash_attn2: pass both k and v (new keys and values), or neither")
    if k is not None:
        if k.shape != v.shape:
            raise ValueError(f"flash_attn2: k and v must have the same shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.shape[0] != batch or k.shape[2] != heads_k or k.shape[3] != head_dim:
            raise ValueError(f"flash_attn2: k must be (batch, seqlen_new, nheads_k, headdim) = ({batch}, seqlen_new, "
                             f"{heads_k}, {head_dim}), got {tuple(k.shape)}")
        if k.shape[1] > seqlen_cache:
            raise ValueError(f"flash_attn2: k's seqlen_new ({k.shape[1]}) must fit the cache (seqlen_cache "
                             f"{seqlen_cache})")
        if cache_seqlens is None:
            raise ValueError("flash_attn2: k and v need cache_seqlens (where each sequence's new rows go)")
    _int_rows(cache_seqlens, "cache_seqlens", batch, q)
    _int_rows(cache_batch_idx, "cache_batch_idx", batch, q)
    _int_rows(cache_leftpad, "cache_leftpad", batch, q)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flash_attn2: pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("flash_attn2: rotary_cos / rotary_sin need k and v (the rotary embedding is applied to "
                             "the new keys and to q)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            require_tensor(t, name)
            if t.dtype != q.dtype:
                raise TypeError(f"flash_attn2: {name} must have q's dtype {q.dtype}, got {t.dtype}")
            if t.dim() != 2 or t.stride(-1) != 1:
                raise ValueError(f"flash_attn2: {name} must be 2-D (seqlen_ro, rotary_dim / 2) with a contiguous "
                                 f"last dimension, got shape {tuple(t.shape)}")
            require_device(t, name, q)
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"flash_attn2: rotary_cos and rotary_sin must have the same shape, got "
                             f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim == 0 or rotary_dim > head_dim or rotary_dim % 16 != 0:
            raise ValueError(f"flash_attn2: rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be a positive "
                             f"multiple of 16 and at most the head dim ({head_dim})")
        if rotary_cos.shape[0] < seqlen_cache:
            raise ValueError(f"flash_attn2: rotary_cos / rotary_sin must have at least seqlen_cache ({seqlen_cache}) "
                             f"rows, got {rotary_cos.shape[0]}")
    check_alibi_slopes(alibi_slopes, q[0] if cu_seqlens_q is not None else q, cu_seqlens_q)
    if seqlen_cache > MAX_SEQLEN:
        raise ValueError(f"flash_attn2: the cache's capacity must be at most 2**31-2**16 rows, got {seqlen_cache}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"flash_attn2: num_splits must be an int in 0..{MAX_SPLITS} (0: heuristic), got "
                         f"{num_splits!r}")


def _check_varlen_q(q, k, rotary_cos, cache_seqlens, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q):
    """Varlen q against a paged cache (FA3's cu_seqlens_q: SGLang's call; vLLM's flash_attn_varlen_func)."""
    if q.dim() != 3:
        raise ValueError(f"flash_attn2: with cu_seqlens_q, q must be 3-D (total_q, nheads, headdim), got shape "
                         f"{tuple(q.shape)}")
    if block_table is None:
        raise NotImplementedError("flash_attn2: cu_seqlens_q (varlen q) is supported against a paged cache only "
                                  "(block_table); pass a block table, or call flash_attn_varlen_func")
    if k is not None or rotary_cos is not None or cache_leftpad is not None:
        raise NotImplementedError("flash_attn2: cu_seqlens_q (varlen q) with new k / v, rotary tables or cache_leftpad "
                                  "is not supported yet")
    if cache_seqlens is None and cu_seqlens_k is None:
        raise ValueError("flash_attn2: varlen q needs cache_seqlens (seqused_k) or cu_seqlens_k: each sequence's keys")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            continue
        require_tensor(cu, name)
        check_cu_seqlens(cu, name, q, entries=cu_seqlens_q.shape[0])
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, torch.SymInt)) or not 0 <= max_seqlen_q <= MAX_SEQLEN:
        raise ValueError(f"flash_attn2: max_seqlen_q must be an int in 0..2**31-2**16, got {max_seqlen_q!r}")


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                           qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                           cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
                           attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    """FA3's get_scheduler_metadata: the split plan of a kv-cache / paged call, computed once per step and passed as
    scheduler_metadata=. flash_attn2's plan is a function of the shapes alone (never of the lengths on the device), so
    a captured graph keeps it anyway; this returns it as a (1,) int32 CPU tensor, the split count, which a call reads
    without touching the device (0 where the call must choose: varlen q of more than 64 rows, whose kernel depends
    on the batch's total rows). max_seqlen_k: the cache's capacity (paged: max_pages * page_size). causal,
    window_size and has_softcap do not change the plan (it is the same for every mask); the query heads of a kv head
    are always packed into one tile (pack_gqa None or True; False raises), and new keys come as fixed-length k / v
    (cu_seqlens_k_new raises: flash_attn_with_kvcache takes no varlen k / v)."""
    if cu_seqlens_k_new is not None:
        raise NotImplementedError("flash_attn2: cu_seqlens_k_new is not supported (flash_attn_with_kvcache takes "
                                  "fixed-length k / v)")
    if qkv_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"flash_attn2: qkv_dtype must be torch.float16 or torch.bfloat16, got {qkv_dtype}")
    if pack_gqa is not None and not pack_gqa:
        raise NotImplementedError("flash_attn2: pack_gqa=False is not supported (the split kernel always packs the "
                                  "query heads of a kv head)")
    if headdim_v is not None and headdim_v != headdim:
        raise NotImplementedError("flash_attn2: headdim_v != headdim is not supported yet")
    if attention_chunk:
        raise NotImplementedError("flash_attn2: attention_chunk is not supported")
    if sm_margin:
        raise NotImplementedError("flash_attn2: sm_margin in get_scheduler_metadata is not supported; "
                                  "FLASH_ATTN2_SM_MARGIN=n (read on every call) leaves n SMs to other kernels")
    from . import _ops
    splits = _ops.ext.kvcache_num_splits(int(batch_size), int(max_seqlen_q), int(max_seqlen_k) + int(max_seqlen_k_new),
                                         int(num_heads_q), int(num_heads_kv), int(headdim),
                                         qkv_dtype == torch.bfloat16, False, int(num_splits), int(page_size or 0),
                                         cache_leftpad is not None, cu_seqlens_q is not None)
    return torch.tensor([splits], dtype=torch.int32)


def metadata_splits(scheduler_metadata, num_splits):
    """num_splits, or where it is 0 the split count get_scheduler_metadata returned. A copy of the metadata on the
    device (an engine's persistent buffer under CUDA graphs) is not read (a sync): the call then chooses the same plan
    itself, which depends on the shapes alone."""
    if scheduler_metadata is None:
        return num_splits
    if not (isinstance(scheduler_metadata, torch.Tensor) and tuple(scheduler_metadata.shape) == (1,) and
            scheduler_metadata.dtype == torch.int32):
        raise ValueError("flash_attn2: scheduler_metadata must be what flash_attn2.get_scheduler_metadata returned (a "
                         "(1,) int32 tensor); FA3's buffers do not carry over")
    if num_splits or scheduler_metadata.device.type != "cpu":
        return num_splits
    return int(scheduler_metadata[0])


@torch.library.register_fake("flash_attn2::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal,
                      window_left, window_right, softcap, rotary_interleaved, alibi_slopes, num_splits,
                      learnable_sink=None):
    check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  alibi_slopes, num_splits, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    if learnable_sink is not None:
        from ._sinks import check_sink
        check_sink(learnable_sink, q.shape[-2], q)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if cu_seqlens_q is not None:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            page_table=None, cu_seqlens_q=None, max_seqlen_q=None, learnable_sink=None, s_aux=None,
                            scheduler_metadata=None):
    """flash-attn 2.x's decode / chunked-prefill call against a KV cache; forward only.

    q (batch, seqlen_q, nheads, headdim); k_cache, v_cache (batch_cache, seqlen_cache, nheads_k, headdim), any
    strides but a contiguous last dim. k, v (batch, seqlen_new, nheads_k, headdim), optional: written in place into
    the caches at rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (rows that would fall past the cache
    are not written), then attended in the same call. cache_seqlens: an int or a (batch,) int32 tensor, the rows
    in use before this call (None: the whole cache). cache_batch_idx (batch,) int32: row b of q uses cache entry
    cache_batch_idx[b]. cache_leftpad (batch,) int32: each sequence's first valid cache row. Sequence b attends
    keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new); causal and window_size are aligned to its bottom-right
    corner, as in flash_attn_func. rotary_cos / rotary_sin (seqlen_ro >= seqlen_cache, rotary_dim / 2): the new
    keys are rotated at their cache rows, q at cache_seqlens (+ its row index when causal or windowed);
    rotary_interleaved pairs dims (0, 1), (2, 3)..., else (i, i + rotary_dim / 2) (GPT-NeoX).
    num_splits: 0 chooses from the shapes and the GPU, 1 does not split the keys, n > 1 splits them in n
    (at most 128). Device values (cache_seqlens, cache_batch_idx, cache_leftpad) are clamped to the cache, never
    checked with a sync: an entry past the cache reads as the cache's end. A row that sees no key gets out 0 and
    softmax_lse -inf (flash-attn 2.x gives +inf there on its non-split path).

    block_table (alias page_table, FA3's name) (batch, max_pages) int32: a paged cache, k_cache / v_cache
    (num_pages, page_size, nheads_k, headdim) with any page_size >= 1 and any page / row / head strides; sequence b's
    cache row j is row j % page_size of page block_table[b, j // page_size]. The capacity is max_pages * page_size;
    entries past a sequence's rows (cache_seqlens) are never read (-1 padding is fine; without cache_seqlens every
    entry is a sequence's), entries out of range are clamped to the pages.
    Not with cache_batch_idx.

    cu_seqlens_q (batch + 1,) int32 and max_seqlen_q (FA3's keywords; SGLang's call): q is (total_q, nheads, headdim)
    with sequence b's queries at rows cu_seqlens_q[b]:cu_seqlens_q[b + 1], against a paged cache (block_table) whose
    sequence b holds cache_seqlens[b] keys; softmax_lse is then (nheads, total_q). Not with k / v, rotary or
    cache_leftpad yet.

    learnable_sink (alias s_aux): attention sinks as in flash_attn_func (this call has no backward). scheduler_metadata: what
    get_scheduler_metadata returned (FA3's keyword), its split count taken where num_splits is 0.

    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse (batch, nheads, seqlen_q) fp32) with
    return_softmax_lse.
    """
    if learnable_sink is not None and s_aux is not None:
        raise ValueError("flash_attn2: pass learnable_sink or its alias s_aux, not both")
    learnable_sink = learnable_sink if learnable_sink is not None else s_aux
    num_splits = metadata_splits(scheduler_metadata, num_splits)
    if page_table is not None:
        if block_table is not None:
            raise ValueError("flash_attn2: pass block_table or its alias page_table, not both")
        block_table = page_table
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        require_tensor(q, "q")
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if cu_seqlens_q is not None and max_seqlen_q is None:
        raise ValueError("flash_attn2: cu_seqlens_q needs max_seqlen_q (the longest sequence's queries, a hint)")
    max_seqlen_q = 0 if cu_seqlens_q is None else max_seqlen_q
    def call():
        return _kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, None, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                             window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
                             learnable_sink)
    from .flash_attn_interface import _forward_only
    return _forward_only(call, "flash_attn_with_kvcache", q, k_cache, v_cache, k, v, learnable_sink)


def _kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, cu_seqlens_k, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size, softcap,
                  rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, learnable_sink=None):
    """flash_attn_with_kvcache's and the paged flash_attn_varlen_func's common part: checks, then the op. The
    per-sequence int32 rows may come strided (a view), as flash-attn takes them: made contiguous here."""
    cache_seqlens, cache_batch_idx, cache_leftpad = (
        t.contiguous() if isinstance(t, torch.Tensor) else t for t in (cache_seqlens, cache_batch_idx, cache_leftpad))
    check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  alibi_slopes, num_splits, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    if learnable_sink is not None:  # before the op, which writes the caches
        from ._sinks import check_sink
        check_sink(learnable_sink, q.shape[-2], q)
    softcap = _softcap(softcap)
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    seqlen_k = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)  # the capacity
    # flash-attn's kvcache rule: a side at least as wide as the cache is no window. (The kernels' masks treat a right
    # side >= seqlen_q as unbounded anyway; kept as given, it still makes the call windowed, which places q's rotary
    # positions per row, as flash-attn does.)
    causal, left, right = _window(bool(causal), window_size, seqlen_k, seqlen_k)
    if not q.is_cuda:
        raise ValueError(f"flash_attn2: q, k_cache, v_cache must be CUDA tensors, got device {q.device}")
    out, lse = _ops.fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal, left,
                                right, softcap, bool(rotary_interleaved), alibi_slopes, operator.index(num_splits),
                                learnable_sink)
    return (out, lse) if return_softmax_lse else out
