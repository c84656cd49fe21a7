"""Reference attention and the accuracy rule shared by the tests and `python -m flash_attn2`.

The rule: our fp16/bf16 error against a float32 reference computed from the same inputs must be at most
twice PyTorch's own fp16/bf16 attention error against that reference, plus a tiny absolute term.
"""

from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True, window=(-1, -1), softcap=0.0,
                  alibi_slopes=None, dropout_keep=None, dropout_scale=1.0, sink=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d) in q's dtype, lse (b, h, sq) fp32.

    upcast=True computes in float32 (the reference); False in the inputs' dtype, the way PyTorch's own
    fp16/bf16 attention would. Causal and window=(left, right) (-1: unbounded) are bottom-right aligned:
    query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right, right = 0 when causal. Rows that
    see no key give 0 and -inf. softcap > 0: scaled scores s become softcap * tanh(s / softcap) before the mask.
    alibi_slopes (h,) or (b, h): -slope * |i + sk - sq - j| added after that, or +slope * j when causal without a
    left window edge (flash-attn's form: the same softmax, another LSE). dropout_keep (b, h, sq, sk) bool: the
    probabilities it drops are 0, the others times dropout_scale (the LSE stays the undropped one). sink (h,):
    attention sinks, one more logit per query head in every row's softmax, with no value (a row with no key: out 0,
    lse = the sink).
    """
    dtype = q.dtype
    if upcast:  # to float32, or keep float64
        q, k, v = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q, k, v))
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scores = attention_scores(q, k, causal, softmax_scale, window, softcap, alibi_slopes)
    if sink is not None:  # the sink's column, dropped after the softmax
        column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    attn = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: all -inf -> 0
    if sink is not None:
        attn = attn[..., :-1]
    if dropout_keep is not None:
        attn = attn * dropout_keep.to(attn.dtype) * dropout_scale
    out = torch.einsum("bhts,bshd->bthd", attn.to(v.dtype), v)
    return out.to(dtype), lse


def attention_scores(q, k, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """attention_ref's scores (b, h, sq, sk) in q's dtype, -inf where the mask hides them."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, scores.shape[1], 1, 1)
        i = torch.arange(q.shape[1], device=q.device).view(-1, 1)
        j = torch.arange(k.shape[1], device=q.device).view(1, -1)
        if causal and window[0] < 0:
            scores = scores + slopes * j.to(scores.dtype)
        else:
            scores = scores - slopes * (i + k.shape[1] - q.shape[1] - j).abs().to(scores.dtype)
    sq, sk = q.shape[1], k.shape[1]
    left, right = window
    right = 0 if causal else right
    diag = torch.arange(sq, device=q.device).view(-1, 1) + sk - sq  # row i's diagonal key
    col = torch.arange(sk, device=q.device).view(1, -1)
    if right >= 0:
        scores = scores.masked_fill(col > diag + right, -math.inf)
    if left >= 0:
        scores = scores.masked_fill(col < diag - left, -math.inf)
    return scores


def attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, upcast=True,
                         window=(-1, -1), softcap=0.0, alibi_slopes=None, sink=None):
    """Packed q (total_q, h, d), k/v (total_k, hk, d) -> out (total_q, h, d), lse (h, total_q)."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, l = attention_ref(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                             causal, softmax_scale, upcast, window, softcap,
                             alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes,
                             sink=sink)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


# Gradients sum over a whole sequence, so their absolute term is a little larger than the output's.
GRAD_ATOL = 1e-4


def reference_grads(ref_fn, inputs, dout):
    """[(out, *grads) in float32 (the reference), (out, *grads) in the inputs' dtype (PyTorch's own)] of
    ref_fn(*inputs, upcast) through autograd, with dout as the output's gradient."""
    results = []
    for upcast in (True, False):
        leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                  for t in inputs]
        out = ref_fn(*leaves, upcast)
        out.backward(dout.float() if upcast else dout)
        results.append((out.detach(), *(t.grad for t in leaves)))
    return results


def max_error(x, ref) -> float:
    """Max absolute difference; NaN anywhere (e.g. an unwritten poisoned element) gives inf."""
    x, ref = x.float(), ref.float()
    both_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    diff = torch.where(both_inf, torch.zeros_like(x), (x - ref).abs())
    if diff.numel() == 0:
        return 0.0
    diff = torch.nan_to_num(diff, nan=math.inf)
    return diff.max().item()


def within_tolerance(ours, ref, torch_lowp, atol=1e-5) -> tuple[bool, float, float]:
    """(ok, our error, PyTorch low-precision error) under the 2x rule."""
    err, err_pt = max_error(ours, ref), max_error(torch_lowp, ref)
    return err <= 2 * err_pt + atol, err, err_pt


def rotary_ref(x, cos, sin, positions, interleaved):
    """x (..., d) rotated at table rows positions (x's shape without d, long) in float32, back in x's dtype:
    the first rotary_dim = 2 * cos.shape[1] dims, in pairs (2i, 2i + 1) when interleaved, else (i, i + rd / 2)."""
    rd = 2 * cos.shape[1]
    c, s = cos.float()[positions], sin.float()[positions]  # (..., rd / 2)
    xf = x.float()
    if interleaved:
        x0, x1 = xf[..., 0:rd:2], xf[..., 1:rd:2]
    else:
        x0, x1 = xf[..., : rd // 2], xf[..., rd // 2: rd]
    y0, y1 = x0 * c - x1 * s, x1 * c + x0 * s
    out = xf.clone()
    if interleaved:
        out[..., 0:rd:2], out[..., 1:rd:2] = y0, y1
    else:
        out[..., : rd // 2], out[..., rd // 2: rd] = y0, y1
    return out.to(x.dtype)


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                cache_batch_idx=None, cache_leftpad=None, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                rotary_interleaved=True, softmax_scale=None, upcast=True):
    """flash_attn_with_kvcache's result from its definition (flash_attn2/_kvcache.py), device values clamped as the
    kernels clamp them: (out, lse, k_cache', v_cache') with the caches as the call leaves them (new copies)."""
    batch, seqlen_q = q.shape[:2]
    cache_b, seqlen_cache = k_cache.shape[:2]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    s_new = 0 if k is None else k.shape[1]
    lens = (cache_seqlens.long().clamp(0, seqlen_cache) if cache_seqlens is not None
            else torch.full((batch,), seqlen_cache, device=q.device))
    idx = (cache_batch_idx.long().clamp(0, cache_b - 1) if cache_batch_idx is not None
           else torch.arange(batch, device=q.device))
    rotary = rotary_cos is not None
    if k is not None:
        for b in range(batch):
            for j in range(s_new):
                row = int(lens[b]) + j
                if row >= seqlen_cache:
                    continue
                pos = torch.tensor([min(row, rotary_cos.shape[0] - 1)], device=q.device) if rotary else None
                kb = rotary_ref(k[b, j][None], rotary_cos, rotary_sin, pos[:, None].expand(1, k.shape[2]),
                                rotary_interleaved)[0] if rotary else k[b, j]
                k_cache[idx[b], row] = kb
                v_cache[idx[b], row] = v[b, j]
    outs, lses = [], []
    for b in range(batch):
        end = min(int(lens[b]) + s_new, seqlen_cache) if cache_seqlens is not None else seqlen_cache
        start = min(max(int(cache_leftpad[b]), 0), end) if cache_leftpad is not None else 0
        qb = q[b:b + 1]
        if rotary:
            per_row = causal or window[0] >= 0 or window[1] >= 0
            pos = (int(lens[b]) + (torch.arange(seqlen_q, device=q.device) if per_row else torch.zeros(
                seqlen_q, dtype=torch.long, device=q.device))).clamp(max=rotary_cos.shape[0] - 1)
            qb = rotary_ref(qb, rotary_cos, rotary_sin, pos[None, :, None].expand(1, seqlen_q, q.shape[2]),
                            rotary_interleaved)
        kb, vb = k_cache[idx[b], start:end][None], v_cache[idx[b], start:end][None]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l = attention_ref(qb, kb, vb, causal, softmax_scale, upcast, window, softcap, slopes)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


def attention_bwd_ref(q, k, v, out, lse, dout, causal=False, softmax_scale=None, dlse=None):
    """The attention backward of one block from the whole row's out and lse (what a ring's block backward computes):
    P = exp(scale S - lse), D = rowsum(dO o O) (less dlse, lse's gradient, where given), dS = P (dP - D); returns
    (dq, dk, dv), dk / dv summed over each kv head's query heads (GQA). q (b, sq, h, d), k / v (b, sk, hk, d),
    out / dout like q, lse and dlse (b, h, sq); float64 works."""
    group = q.shape[2] // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kx) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        diag = torch.arange(sq, device=q.device).view(-1, 1) + sk - sq
        s = s.masked_fill(torch.arange(sk, device=q.device).view(1, -1) > diag, -math.inf)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - finite_lse.unsqueeze(-1))
    p = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(p), p)
    dv = torch.einsum("bhts,bthd->bshd", p, dout)
    dp = torch.einsum("bthd,bshd->bhts", dout, vx)
    d_row = (dout * out).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        d_row = d_row - dlse.to(d_row.dtype)
    ds = p * (dp - d_row.unsqueeze(-1))
    dq = torch.einsum("bhts,bshd->bthd", ds, kx) * scale
    dk = torch.einsum("bhts,bthd->bshd", ds, q) * scale
    fold = lambda t: t.view(t.shape[0], t.shape[1], k.shape[2], group, t.shape[3]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def run_ranks(worker, world, *args):
    """{key: value} that worker(rank, world, store_path, *args, results) put into the shared dict `results`, run in
    `world` spawned processes (store_path: a file store in a temporary directory for init_process_group; gloo or NCCL
    as the worker chooses)."""
    import os
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), *args, results), nprocs=world, join=True)
        return dict(results)
