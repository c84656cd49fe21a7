"""flash_attn_with_kvcache and the split-KV forward against a float32 reference (GPU), and its argument checks.

The grid samples flash-attn's test_flash_attn_kvcache (tests/test_flash_attn.py there): mha / mqa / gqa, new_kv,
alibi, local, causal, seqlen_new_eq_seqlen_q, rotary_interleaved, rotary_fraction 0 / 0.5 / 1, has_leftpad,
has_batch_idx, num_splits, its (seqlen_q, seqlen_k) pairs and head dims (odd ones included); then the split
path through flash_attn_func (forward and backward), empty splits, NaN in unused cache rows, hostile device
values, CUDA-graph replay with changing lengths, torch.compile, and a cache past 2**31 elements.
"""

import itertools
import math
import os
import random
import re

import pytest
import torch

import flash_attn2
from flash_attn2 import flash_attn_func, flash_attn_with_kvcache
from flash_attn2.testing import attention_ref, kvcache_ref, max_error, within_tolerance

HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]
LSE_ATOL = 1e-3
gpu = pytest.mark.gpu


def require_kernel(head_dim, dtype):
    bucket = next(b for b in HEAD_DIMS if b >= head_dim)
    if bucket not in flash_attn2.compiled_head_dims(dtype):
        pytest.skip(f"head dim {bucket} {dtype} not compiled (FLASH_ATTN2_HEAD_DIMS / FLASH_ATTN2_DTYPES)")


def randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


# flash-attn's (seqlen_q, seqlen_k) pairs; (1, 128k) and (16, 128k) sampled less (the reference is slow).
SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000), (128, 128),
           (1, 131072)]
MHA = {"mha": 1, "gqa": 2, "mqa": 6}  # heads 6 over 6 / 3 / 1 kv heads, as flash-attn's test


def _cases(count, seed=0):
    rng = random.Random(seed)
    head_dims = [32, 59, 64, 80, 128, 256, 96, 160, 192, 224]
    cases = []
    for i in range(count):
        sq, sk = SEQLENS[i % len(SEQLENS)]
        cases.append(dict(
            d=head_dims[i % len(head_dims)], dtype=[torch.float16, torch.bfloat16][i // len(head_dims) % 2],
            seqlen_q=sq, seqlen_k=sk, mha=rng.choice(list(MHA)), new_kv=rng.random() < 0.6, causal=rng.random() < 0.5,
            local=rng.random() < 0.25, alibi=rng.random() < 0.2, softcap=rng.choice([0.0, 0.0, 0.0, 30.0]),
            rotary_fraction=rng.choice([0.0, 0.5, 1.0]), interleaved=rng.random() < 0.5,
            seqlen_new_eq_seqlen_q=rng.random() < 0.5, leftpad=rng.random() < 0.3, batch_idx=rng.random() < 0.3,
            num_splits=rng.choice([1, 0, 0, 3]), page_size=rng.choice([None, None, 1, 16, 64, 256, 3])))
    return cases


CASES = _cases(160)


def _params(cases):
    """The (1, 131072) caches with their reference take tens of GB at the wide head dims: conftest's bigmem."""
    return [pytest.param(c, marks=pytest.mark.bigmem) if c["seqlen_k"] >= 131072 else c for c in cases]


def _case_id(c):
    return (f"d{c['d']}-{str(c['dtype'])[6:]}-{c['seqlen_q']}x{c['seqlen_k']}-{c['mha']}"
            f"{'-new' if c['new_kv'] else ''}{'-causal' if c['causal'] else ''}{'-local' if c['local'] else ''}"
            f"{'-alibi' if c['alibi'] else ''}{'-softcap' if c['softcap'] else ''}-rot{c['rotary_fraction']}"
            f"{'i' if c['interleaved'] else ''}{'-leftpad' if c['leftpad'] else ''}{'-bidx' if c['batch_idx'] else ''}"
            f"-splits{c['num_splits']}{'-page' + str(c['page_size']) if c.get('page_size') else ''}")


def to_pages(k_cache, v_cache, page):
    """(k_pages, v_pages (num_pages, page, h_k, d), table (batch, seqlen // page)) holding the contiguous caches:
    three times the pages needed, in random order; the unused pages hold NaN."""
    batch, seqlen = k_cache.shape[:2]
    per_seq = seqlen // page
    num_pages = 3 * batch * per_seq
    table = torch.randperm(num_pages, device="cuda")[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    pages = []
    for cache in (k_cache, v_cache):
        p = torch.full((num_pages, page, *cache.shape[2:]), math.nan, device="cuda", dtype=cache.dtype)
        p[table.long().flatten()] = cache.reshape(batch * per_seq, page, *cache.shape[2:])
        pages.append(p)
    return pages[0], pages[1], table


def from_pages(pages, table):
    """The contiguous (batch, seqlen, h_k, d) cache a table's pages hold."""
    batch, per_seq = table.shape
    return pages[table.long().flatten()].reshape(batch, per_seq * pages.shape[1], *pages.shape[2:])


def padded_table(used, max_pages, num_pages):
    """(len(used), max_pages) int32, as engines pass it: sequence b's first used[b] entries distinct pages of
    num_pages in random order, the rest -1."""
    perm = torch.randperm(num_pages, device="cuda").to(torch.int32)
    table = torch.full((len(used), max_pages), -1, dtype=torch.int32, device="cuda")
    for b, n in enumerate(used):
        table[b, :n] = perm[b * max_pages: b * max_pages + n]
    return table


def _run_case(c, batch=2, heads=6):
    d, dtype, seqlen_q, seqlen_k = c["d"], c["dtype"], c["seqlen_q"], c["seqlen_k"]
    require_kernel(d, dtype)
    if seqlen_q > seqlen_k and c["new_kv"]:
        pytest.skip("seqlen_q > seqlen_k with new_kv (flash-attn's skip)")
    if not c["new_kv"] and c["rotary_fraction"] > 0:
        pytest.skip("rotary needs new_kv (flash-attn's skip)")
    heads_k = heads // MHA[c["mha"]]
    rotary_dim = math.floor(int(c["rotary_fraction"] * d) / 16) * 16
    batch_cache = batch * 2 if c["batch_idx"] else batch
    q = randn(batch, seqlen_q, heads, d, dtype=dtype)
    seqlen_new = seqlen_q if c["seqlen_new_eq_seqlen_q"] else int(torch.randint(1, seqlen_q + 1, (1,)))
    k = randn(batch, seqlen_new, heads_k, d, dtype=dtype) if c["new_kv"] else None
    v = randn(batch, seqlen_new, heads_k, d, dtype=dtype) if c["new_kv"] else None
    k_cache = randn(batch_cache, seqlen_k, heads_k, d, dtype=dtype)
    v_cache = randn(batch_cache, seqlen_k, heads_k, d, dtype=dtype)
    window = (-1, -1)
    if c["local"]:
        window = tuple(int(w) for w in torch.randint(0, seqlen_k, (2,)))
    hi = (seqlen_k - (seqlen_q if (c["causal"] or c["local"]) and rotary_dim > 1 else seqlen_new) + 1
          if c["new_kv"] else seqlen_k + 1)
    cache_seqlens = torch.randint(0 if c["new_kv"] else 1, hi, (batch,), dtype=torch.int32, device="cuda")
    leftpad = None
    if c["leftpad"]:
        leftpad = torch.stack([torch.randint(0, int(n), (), device="cuda") if int(n) > 0 else
                               torch.zeros((), dtype=torch.long, device="cuda") for n in cache_seqlens]).to(torch.int32)
    batch_idx = (torch.randperm(batch_cache, dtype=torch.int32, device="cuda")[:batch] if c["batch_idx"] else None)
    alibi = torch.rand(batch, heads, device="cuda") * 0.3 if c["alibi"] else None
    cos = sin = None
    if rotary_dim > 0:
        angle = torch.rand(seqlen_k, rotary_dim // 2, device="cuda") * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx,
              cache_leftpad=leftpad, causal=c["causal"], alibi_slopes=alibi)
    page = c.get("page_size")
    if page:
        if c["batch_idx"]:
            pytest.skip("cache_batch_idx with a paged cache (flash-attn's skip)")
        if seqlen_k % page:
            pytest.skip("the reference's cache must be whole pages")
    ref = kvcache_ref(q, k_cache, v_cache, k, v, window=window, softcap=c["softcap"],
                      rotary_interleaved=c["interleaved"], **kw)
    ref_lowp = kvcache_ref(q, k_cache, v_cache, k, v, window=window, softcap=c["softcap"],
                           rotary_interleaved=c["interleaved"], upcast=False, **kw)
    if page:  # the same cache in pages, scattered by a random table three times too big (flash-attn's generator)
        k_pages, v_pages, table = to_pages(k_cache, v_cache, page)
        out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, window_size=window, softcap=c["softcap"],
                                           rotary_interleaved=c["interleaved"], num_splits=c["num_splits"],
                                           return_softmax_lse=True, block_table=table, **kw)
        k_cache_ours, v_cache_ours = from_pages(k_pages, table), from_pages(v_pages, table)
    else:
        k_cache_ours, v_cache_ours = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_with_kvcache(q, k_cache_ours, v_cache_ours, k, v, window_size=window,
                                           softcap=c["softcap"], rotary_interleaved=c["interleaved"],
                                           num_splits=c["num_splits"], return_softmax_lse=True, **kw)
    ok, err, err_pt = within_tolerance(out, ref[0], ref_lowp[0])
    # ALiBi's biases grow with the distance: flash-attn allows 5x there, our rule 2x of PyTorch's own error.
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    assert max_error(lse, ref[1]) <= LSE_ATOL, max_error(lse, ref[1])
    # The caches: v copied bitwise; k rotated in fp32 as the reference does (one rounding of the result).
    assert torch.equal(v_cache_ours, ref[3])
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert torch.allclose(k_cache_ours.float(), ref[2].float(), atol=tol, rtol=tol), max_error(k_cache_ours, ref[2])


@gpu
@pytest.mark.parametrize("case", _params(CASES), ids=_case_id)
def test_flash_attn_kvcache(case):
    _run_case(case)


@gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 0, 5])
def test_kvcache_every_head_dim(head_dim, dtype, num_splits):
    """Every compiled head dim and dtype, GQA 8:1 decode with appended rows, rotary and a causal mask."""
    _run_case(dict(d=head_dim, dtype=dtype, seqlen_q=1, seqlen_k=1000, mha="mqa", new_kv=True, causal=True,
                   local=False, alibi=False, softcap=0.0, rotary_fraction=0.5, interleaved=False,
                   seqlen_new_eq_seqlen_q=True, leftpad=False, batch_idx=False, num_splits=num_splits), batch=3)


@gpu
@pytest.mark.parametrize("profile", ["rising", "falling", "spike", "flat_high"])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_decode_scores_that_move(profile, num_splits):
    """Decode (GQA 8:1, the narrow split kernel) where the scores climb across the keys by far more than the
    conditional rescale's 2^8 (every chunk moves the reference max and rescales O), fall (the first chunk holds
    the max: no later rescale), spike once late, or sit near 60 over 64k keys (a warp's 1024 chunks keep their
    reference: a correction of 1 +- an ulp taken into the row sum but not O drifted the LSE by ~4e-3, so the LSE is
    held to 2e-4 there): out and LSE against the reference (2x rule), no NaN."""
    require_kernel(128, torch.bfloat16)
    dtype, batch, heads, heads_k, d = torch.bfloat16, 2, 8, 1, 128
    seqlen = 65536 if profile == "flat_high" else 1500
    q = torch.ones(batch, 1, heads, d, device="cuda", dtype=dtype)
    k = randn(batch, seqlen, heads_k, d, dtype=dtype) * 0.05
    # The score of key j is q . k_j / sqrt(d) with q all ones: adding c to k_j's entries adds c sqrt(d) to it.
    ramp = torch.linspace(0, 1, seqlen, device="cuda")
    if profile == "rising":
        score = ramp * 60.0  # 60 natural units over the keys: ~87 in exp2's argument, the lazy threshold 8
    elif profile == "falling":
        score = (1 - ramp) * 60.0
    elif profile == "spike":
        score = torch.zeros(seqlen, device="cuda")
        score[1234] = 40.0
    else:
        score = torch.full((seqlen,), 60.0, device="cuda")
    k = (k.float() + (score / math.sqrt(d))[None, :, None, None]).to(dtype)
    v = randn(batch, seqlen, heads_k, d, dtype=dtype)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits, return_softmax_lse=True)
    ref = kvcache_ref(q, k, v, cache_seqlens=seqlens)
    ref_lowp = kvcache_ref(q, k, v, cache_seqlens=seqlens, upcast=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ok, err, err_pt = within_tolerance(out, ref[0], ref_lowp[0])
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    # (LSEs near 60: fp32's rounding of them is ~4e-6)
    lse_tol = 2e-4 if profile == "flat_high" else LSE_ATOL + 2e-5 * float(ref[1].abs().max())
    assert max_error(lse, ref[1]) <= lse_tol, max_error(lse, ref[1])


# ---- The split path through flash_attn_func (flash-attn's test_flash_attn_splitkv): forward and backward ----

@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,heads_k", [(1, 239, 8, 8), (1, 4096, 32, 8), (3, 799, 6, 3),
                                                              (16, 20000, 16, 2), (1, 1, 4, 1), (8, 113, 8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_splitkv(dtype, head_dim, seqlen_q, seqlen_k, heads, heads_k, causal):
    require_kernel(head_dim, dtype)
    batch = 2
    q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype).requires_grad_()
    k = randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype).requires_grad_()
    v = randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref, ref_lse = attention_ref(q.detach(), k.detach(), v.detach(), causal)
    ref_lowp, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal, upcast=False)
    ok, err, err_pt = within_tolerance(out, ref, ref_lowp)
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    assert max_error(lse, ref_lse) <= LSE_ATOL
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(attention_ref(*leaves, causal)[0], leaves, dout.float())
    lowp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lowp_grads = torch.autograd.grad(attention_ref(*lowp, causal, upcast=False)[0], lowp, dout)
    for name, g, r, p in zip("qkv", grads, ref_grads, lowp_grads):
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"d{name} error {err} vs PyTorch's {err_pt}"


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads,heads_k", [(8, 8), (16, 2), (6, 1)])
@pytest.mark.parametrize("hint", ["exact", "short"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_decode_split(head_dim, heads, heads_k, hint, causal):
    """flash_attn_varlen_func with a few query rows per sequence takes the split kernel: forward and backward against
    the reference, empty sequences on either side, rows outside every sequence (0 / -inf), and a max_seqlen_q hint
    shorter than a sequence (its rows past the hint still computed)."""
    dtype = torch.bfloat16
    require_kernel(head_dim, dtype)
    lens_q, lens_k = [1, 2, 0, 1, 5, 1], [300, 0, 17, 4097, 64, 1]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    total_q = int(cu_q[-1]) + 3  # three rows past the last sequence: out 0, lse -inf, zero gradients
    q = randn(total_q, heads, head_dim, dtype=dtype).requires_grad_()
    k = randn(int(cu_k[-1]), heads_k, head_dim, dtype=dtype).requires_grad_()
    v = randn(int(cu_k[-1]), heads_k, head_dim, dtype=dtype).requires_grad_()
    max_q = max(lens_q) if hint == "exact" else 1
    out, lse, _ = flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max(lens_k), causal=causal,
                                                     return_attn_probs=True)
    from flash_attn2.testing import attention_ref_varlen
    n = int(cu_q[-1])
    ref, ref_lse = attention_ref_varlen(q[:n].detach(), k.detach(), v.detach(), cu_q, cu_k, causal)
    ref_lowp, _ = attention_ref_varlen(q[:n].detach(), k.detach(), v.detach(), cu_q, cu_k, causal, upcast=False)
    ok, err, err_pt = within_tolerance(out[:n], ref, ref_lowp)
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    assert max_error(lse[:, :n], ref_lse) <= LSE_ATOL
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and bool((lse[:, n:] == -math.inf).all())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(grads[0][n:], torch.zeros_like(grads[0][n:]))
    refs = []
    for upcast in (True, False):
        leaves = [(t[:n] if t is q else t).detach().clone() for t in (q, k, v)]
        leaves = [t.float().requires_grad_() if upcast else t.requires_grad_() for t in leaves]
        o = attention_ref_varlen(*leaves, cu_q, cu_k, causal, upcast=upcast)[0]
        refs.append(torch.autograd.grad(o, leaves, dout[:n].float() if upcast else dout[:n]))
    for name, g, r, p in zip("qkv", (grads[0][:n], grads[1], grads[2]), *refs):
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"d{name} error {err} vs PyTorch's {err_pt}"


@gpu
@pytest.mark.parametrize("case", _params([c for c in CASES if c["num_splits"] != 1]), ids=_case_id)
def test_flash_attn_kvcache_cluster_combine(case, monkeypatch):
    """The same cases with the splits merged inside a thread block cluster (FLASH_ATTN2_SPLIT_COMBINE=cluster:
    the split kernels' fixed-length calls of 2-16 splits on sm_90; the others keep the combine kernel): the cases'
    head dims, softcap, ALiBi and windows (the extended kernels) where the build has them."""
    if not clusters_run():
        pytest.skip("the cluster combine runs on an sm_90 GPU with the build's sm_90 code")
    monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", "cluster")
    _run_case(case)


def clusters_run():
    """Whether FLASH_ATTN2_SPLIT_COMBINE=cluster can take effect: an sm_90 GPU running the build's sm_90 code (a
    build without it JIT-compiles older PTX, which has no clusters: launch.h's cluster_launchable)."""
    from flash_attn2 import _ops
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and "_90" in str(_ops.ext.built_archs))


@gpu
@pytest.mark.parametrize("splits", [2, 3, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("heads,heads_k,seqlen_q", [(32, 8, 1), (8, 8, 1), (16, 2, 2), (6, 1, 2), (32, 8, 5), (8, 1, 8)])
def test_cluster_combine(splits, heads, heads_k, seqlen_q, monkeypatch):
    """The cluster combine runs where it should (no combine kernel: 2-16 splits on sm_90, 9-16 in clusters past the
    portable size; 17 takes the kernel), with
    the combine kernel's answers: a row without keys (cache length 0) gets 0 and -inf, or the sink and 0; splits
    without keys (length 5) drop out; every output finite; packed rows 1-16 a tile (the narrow kernel) and 20 / 64
    (the 64-row kernel)."""
    require_kernel(128, torch.bfloat16)
    torch.manual_seed(splits * 100 + heads + seqlen_q)
    q = randn(3, seqlen_q, heads, 128, dtype=torch.bfloat16)
    k_cache, v_cache = randn(3, 1000, heads_k, 128, dtype=torch.bfloat16), randn(3, 1000, heads_k, 128, dtype=torch.bfloat16)
    lens = (0, 5, 1000)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for sink in (None, torch.randn(heads, device="cuda") * 3):
        def call():
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits,
                                           learnable_sink=sink, return_softmax_lse=True)
        monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", "kernel")
        (out_k, lse_k), names_k = kernels_run(call)
        assert "fwd_combine_kernel" in names_k and ", true>" not in names_k, names_k
        monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", "cluster")
        (out, lse), names = kernels_run(call)
        clustered = clusters_run() and splits <= 16
        assert ("fwd_combine_kernel" in names) != clustered, names
        assert bool(re.search(r"fwd_split_(narrow_)?kernel<[^()]*, (true|false), true>", names)) == clustered, names
        for b, n in enumerate(lens):
            ref, ref_lse = attention_ref(q[b:b + 1].float(), k_cache[b:b + 1, :n].float(), v_cache[b:b + 1, :n].float(),
                                         sink=sink)
            assert max_error(out[b:b + 1], ref) <= 2e-2 and max_error(lse[b:b + 1], ref_lse) <= LSE_ATOL, (b, n)
        assert torch.isfinite(out).all() and torch.equal(out[0], torch.zeros_like(out[0]))
        assert bool((lse[0] == -math.inf).all()) if sink is None else torch.allclose(lse[0, :, 0], sink)
        assert max_error(lse, lse_k) <= 1e-5 and max_error(out, out_k) <= 1e-2  # the kernel's answer, to rounding


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_splits_forced_and_empty(dtype):
    """128 splits over a short cache leave most splits empty; rows with no key (cache_seqlens 0) get 0 and -inf."""
    require_kernel(128, dtype)
    q = randn(3, 1, 16, 128, dtype=dtype)
    k_cache, v_cache = randn(3, 300, 2, 128, dtype=dtype), randn(3, 300, 2, 128, dtype=dtype)
    seqlens = torch.tensor([0, 5, 300], dtype=torch.int32, device="cuda")
    for splits in (1, 2, 7, 128):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits,
                                           return_softmax_lse=True)
        ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())
        assert max_error(out, ref) <= 2e-2 and max_error(lse, ref_lse) <= LSE_ATOL, splits


@gpu
@pytest.mark.parametrize("num_splits", [1, 0, 4])
def test_nan_in_unused_cache_rows(num_splits):
    """NaN / Inf in rows past a sequence's length and before its left pad never reach the output."""
    require_kernel(128, torch.float16)
    q = randn(2, 2, 8, 128, dtype=torch.float16)
    k_cache, v_cache = randn(2, 700, 2, 128, dtype=torch.float16), randn(2, 700, 2, 128, dtype=torch.float16)
    seqlens = torch.tensor([100, 333], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([7, 0], dtype=torch.int32, device="cuda")
    clean = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad, causal=True)
    for b, (n, lp) in enumerate(zip((100, 333), (7, 0))):
        k_cache[b, n:], v_cache[b, n:] = math.nan, math.inf
        k_cache[b, :lp], v_cache[b, :lp] = math.nan, math.nan
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad, causal=True,
                                  num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert max_error(out, clean[0]) <= 1e-2


@gpu
def test_hostile_device_values():
    """Out-of-range cache_seqlens, cache_batch_idx and cache_leftpad are clamped (flash_attn_with_kvcache's
    docstring), never read or written outside the caches (compute-sanitizer runs this in sanitize_fwd.py)."""
    require_kernel(64, torch.bfloat16)
    dtype = torch.bfloat16
    q = randn(4, 1, 4, 64, dtype=dtype)
    k, v = randn(4, 1, 2, 64, dtype=dtype), randn(4, 1, 2, 64, dtype=dtype)
    k_cache, v_cache = randn(3, 50, 2, 64, dtype=dtype), randn(3, 50, 2, 64, dtype=dtype)
    seqlens = torch.tensor([-5, 49, 50, 2**31 - 1], dtype=torch.int32, device="cuda")
    batch_idx = torch.tensor([-1, 0, 2, 99], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([3, -2, 60, 2**30], dtype=torch.int32, device="cuda")
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                       cache_leftpad=leftpad, return_softmax_lse=True)
    torch.cuda.synchronize()
    # q entries 0 and 1 share cache entry 0 (idx -1 -> 0) but write different rows (0 and 49), and entries 2 and
    # 3 write nothing (their rows fall past the cache): the reference's batch-order writes are the kernel's.
    ref = kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                      cache_leftpad=leftpad)
    assert torch.isfinite(out).all()
    assert max_error(out, ref[0]) <= 2e-2 and max_error(lse, ref[1]) <= LSE_ATOL
    assert torch.equal(kc, ref[2]) and torch.equal(vc, ref[3])
    assert torch.equal(out[2:], torch.zeros_like(out[2:])) and bool((lse[2:] == -math.inf).all())  # no key left


@gpu
@pytest.mark.parametrize("page", [1, 16, 48, 24])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_paged_table_padding_and_strides(page, num_splits):
    """A -1-padded table (entries past each sequence's pages are never read), appends through the table, and a
    cache in vLLM's HND layout (a stride permutation of the same pages). Pages of 24: the split kernel's 16-row
    chunks alternate between one page (one entry) and two (an entry a row)."""
    require_kernel(128, torch.bfloat16)
    dtype = torch.bfloat16
    batch, heads, heads_k, d, max_pages = 3, 8, 2, 128, 12
    num_pages = batch * max_pages + 5
    k_hnd = randn(num_pages, heads_k, page, d, dtype=dtype)  # (pages, heads, page rows, d): HND
    v_hnd = randn(num_pages, heads_k, page, d, dtype=dtype)
    k_pages, v_pages = k_hnd.transpose(1, 2), v_hnd.transpose(1, 2)  # the kernels' (pages, rows, heads, d) view
    lens = [0, 5 * page - 1, 9 * page + 1]  # rows in use before the call; one new row each
    table = padded_table([(n + 1 + page - 1) // page for n in lens], max_pages, num_pages)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = randn(batch, 1, heads, d, dtype=dtype)
    k, v = randn(batch, 1, heads_k, d, dtype=dtype), randn(batch, 1, heads_k, d, dtype=dtype)
    dense_k, dense_v = from_pages(k_pages, table.clamp(min=0)), from_pages(v_pages, table.clamp(min=0))
    ref = kvcache_ref(q, dense_k, dense_v, k, v, cache_seqlens=seqlens, causal=True)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens, causal=True, page_table=table,
                                  num_splits=num_splits)
    assert max_error(out, ref[0]) <= 2e-2
    for b, n in enumerate(lens):  # the appended row landed in the right page
        page_id = int(table[b, n // page])
        assert torch.equal(k_pages[page_id, n % page], k[b, 0]) and torch.equal(v_pages[page_id, n % page], v[b, 0])


@gpu
@pytest.mark.parametrize("page", [16, 32, 64, 1, 7])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_long_splits(page, num_splits):
    """Splits of thousands of keys (9000 keys in one split: 141 chunks a warp of the narrow kernel), a long chunk
    loop on one table, where any read-ahead of the table (as the entry rings of TUNING 200-205) wraps many times.
    Randomly permuted pages, a -1-padded table, lengths that end mid-page."""
    require_kernel(128, torch.bfloat16)
    batch, heads, heads_k, d = 3, 4, 2, 128
    lens = [9000, 33, 4100 + page // 2]
    max_pages = (max(lens) + page - 1) // page + 2
    num_pages = batch * max_pages + 3
    k_pages = randn(num_pages, page, heads_k, d, dtype=torch.bfloat16)
    v_pages = randn(num_pages, page, heads_k, d, dtype=torch.bfloat16)
    table = padded_table([(n + page - 1) // page for n in lens], max_pages, num_pages)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = randn(batch, 1, heads, d, dtype=torch.bfloat16)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                  num_splits=num_splits)
    dense_k, dense_v = from_pages(k_pages, table.clamp(min=0)), from_pages(v_pages, table.clamp(min=0))
    for b, n in enumerate(lens):
        ref = attention_ref(q[b:b + 1], dense_k[b:b + 1, :n], dense_v[b:b + 1, :n])[0]
        assert max_error(out[b:b + 1], ref) <= 2e-2, (b, n)


@gpu
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("call", ["vllm", "vllm_cu_seqlens_k", "sglang"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits,hint", [(0, "exact"), (1, "exact"), (3, "exact"), (3, "short"), ("meta", "exact")])
def test_varlen_q_against_paged_cache(page, call, causal, num_splits, hint):
    """vLLM's call (flash_attn_varlen_func with seqused_k and block_table, cu_seqlens_k None) and SGLang's
    (flash_attn_with_kvcache with cu_seqlens_q, cache_seqlens and page_table, softmax_lse returned): a mixed batch
    of decode rows and short chunks, an empty sequence, against each sequence's own reference. FA3's grid: num_splits
    1 / 3 / 0, and 0 with precomputed metadata (get_scheduler_metadata's plan passed as scheduler_metadata)."""
    require_kernel(128, torch.bfloat16)
    dtype = torch.bfloat16
    heads, heads_k, d, max_pages = 8, 2, 128, 24
    lens_q, lens_k = [1, 3, 0, 5, 1], [100, 5, 0, 300, 1]
    num_pages = len(lens_q) * max_pages
    k_pages, v_pages = randn(num_pages, page, heads_k, d, dtype=dtype), randn(num_pages, page, heads_k, d, dtype=dtype)
    # page 1: a capacity of 24 rows, which clamps the longer sequences' lengths (the reference clamps them too)
    table = torch.randperm(num_pages, device="cuda").to(torch.int32).view(len(lens_q), max_pages)
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    seqused = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    q = randn(int(cu_q[-1]), heads, d, dtype=dtype)
    max_q = max(lens_q) if hint == "exact" else 1  # a short hint: the rows past it still computed
    meta = None
    if num_splits == "meta":
        meta = flash_attn2.get_scheduler_metadata(len(lens_q), max_q, max_pages * page, heads, heads_k, d, seqused,
                                                  qkv_dtype=dtype, cu_seqlens_q=cu_q, page_size=page, causal=causal)
        num_splits = 0
    if call == "vllm":  # with out= (vLLM's memory planning)
        given = torch.full_like(q, math.nan)
        out, lse, _ = flash_attn2.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, None, max_q, max(lens_k),
                                                         causal=causal, block_table=table, seqused_k=seqused,
                                                         num_splits=num_splits, return_attn_probs=True, out=given,
                                                         scheduler_metadata=meta)
        assert out is given
    elif call == "vllm_cu_seqlens_k":  # lengths from cu_seqlens_k, no seqused_k
        cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
        out, lse, _ = flash_attn2.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max(lens_k),
                                                         causal=causal, block_table=table, num_splits=num_splits,
                                                         return_attn_probs=True, scheduler_metadata=meta)
    else:
        out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqused, page_table=table,
                                           cu_seqlens_q=cu_q, max_seqlen_q=max_q, causal=causal,
                                           num_splits=num_splits, return_softmax_lse=True, scheduler_metadata=meta)
    dense_k, dense_v = from_pages(k_pages, table), from_pages(v_pages, table)
    capacity = dense_k.shape[1]
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        if n_q == 0:
            continue
        n_k = min(n_k, capacity)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, ref_lse = attention_ref(q[None, rows], dense_k[b:b + 1, :n_k], dense_v[b:b + 1, :n_k], causal)
        assert max_error(out[rows], ref[0]) <= 2e-2, b
        assert max_error(lse[:, rows], ref_lse[0]) <= LSE_ATOL, b


def kernels_run(fn):
    """fn()'s result and the names of the kernels it ran (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, " ".join(e.key for e in prof.key_averages())


def hopper_serves(page):
    """Whether the Hopper forward takes a kv-cache call of more than 64 query rows per head (the tests' shapes;
    dispatch.cpp: hopper_serves_kv_cache): an sm_90 GPU and a build with the Hopper forward, the default backend,
    and a contiguous cache or pages of a multiple of 16 rows."""
    from flash_attn2 import _ops
    return (torch.cuda.get_device_capability() == (9, 0) and "90a" in _ops.ext.built_archs
            and os.environ.get("FLASH_ATTN2_BACKEND", "auto") != "sm80" and (page is None or page % 16 == 0))


@gpu
@pytest.mark.parametrize("page", [None, 16, 32, 48, 64, 256, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 192])
def test_prefill_against_cache(page, causal, dtype, head_dim):
    """Chunked prefill against a cache (seqlen_q x the GQA group past the split kernel's 64-row tile): the Hopper
    forward where it serves (a contiguous cache, pages of a multiple of 16 rows), the split kernel otherwise (page
    8); new rows appended in the call; every cache row past a sequence's length NaN and every table entry past its
    pages -1 (never read); out and LSE against the reference. The Hopper forward's boxes (sm90/tile_size.h:
    paged_box_rows_sm90) of 16 (pages of 16 and 48), 32 (pages of 32; 64 and 256 at d 192's 96-key blocks), 64
    (pages of 64) and a whole 128-key block (pages of 256): boxes past a sequence's end in a page that is in use,
    and whole boxes past it."""
    require_kernel(head_dim, dtype)
    batch, heads, heads_k, seqlen_q, seqlen_new = 3, 8, 2, 97, 31
    capacity = 768 if page is None else (768 + page - 1) // page * page
    lens = torch.tensor([0, 257, capacity - seqlen_new], dtype=torch.int32, device="cuda")  # before the append
    q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k_new, v_new = (randn(batch, seqlen_new, heads_k, head_dim, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (randn(batch, capacity, heads_k, head_dim, dtype=dtype) for _ in range(2))
    for b, n in enumerate(lens.tolist()):  # past the rows the call will use: NaN / Inf
        k_cache[b, n + seqlen_new:], v_cache[b, n + seqlen_new:] = math.nan, math.inf
    ref = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=causal)
    if page is None:
        kc, vc = k_cache.clone(), v_cache.clone()
        (out, lse), names = kernels_run(lambda: flash_attn_with_kvcache(
            q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=causal, return_softmax_lse=True))
        assert torch.equal(vc, ref[3])
    else:
        k_pages, v_pages, table = to_pages(k_cache, v_cache, page)
        for b, n in enumerate(lens.tolist()):  # entries past the pages in use: -1
            table[b, (n + seqlen_new + page - 1) // page:] = -1
        (out, lse), names = kernels_run(lambda: flash_attn_with_kvcache(
            q, k_pages, v_pages, k_new, v_new, cache_seqlens=lens, causal=causal, block_table=table,
            return_softmax_lse=True))
    ref_lowp = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=causal, upcast=False)
    assert ("fwd_kernel_sm90" in names) == hopper_serves(page), names
    assert torch.isfinite(out).all()
    ok, err, err_pt = within_tolerance(out, ref[0], ref_lowp[0])
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    assert max_error(lse, ref[1]) <= LSE_ATOL, max_error(lse, ref[1])


@gpu
@pytest.mark.parametrize("extra", ["leftpad", "batch_idx", "window_softcap", "alibi", "sink"])
def test_prefill_against_cache_variants(extra):
    """The Hopper forward's kv-cache rows with leftpad_k (the cache's first row per sequence), cache_batch_idx (another
    batch entry's cache), a window with softcap (the extended kernel), ALiBi and a learnable sink, against the
    reference; rows before a left pad and past a length hold NaN."""
    require_kernel(128, torch.bfloat16)
    dtype = torch.bfloat16
    batch, heads, heads_k, d, seqlen_q, capacity = 3, 8, 2, 128, 80, 600
    q = randn(batch, seqlen_q, heads, d, dtype=dtype)
    batch_cache = batch + 2 if extra == "batch_idx" else batch
    k_cache, v_cache = (randn(batch_cache, capacity, heads_k, d, dtype=dtype) for _ in range(2))
    lens = torch.tensor([600, 91, 333], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=lens, causal=extra != "window_softcap")
    if extra == "leftpad":
        kw["cache_leftpad"] = torch.tensor([17, 0, 250], dtype=torch.int32, device="cuda")
    if extra == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    if extra == "alibi":
        kw["alibi_slopes"] = torch.rand(batch, heads, device="cuda") * 0.3
    ref_kw = dict(kw)
    call_kw = dict(kw)
    if extra == "window_softcap":
        ref_kw.update(window=(100, 7), softcap=20.0)
        call_kw.update(window_size=(100, 7), softcap=20.0)
    sink = None
    if extra == "sink":
        sink = torch.randn(heads, device="cuda")
        call_kw["learnable_sink"] = sink
    clean = (k_cache.clone(), v_cache.clone())
    for i in range(batch):  # poison the rows the call never reads
        b = int(kw["cache_batch_idx"][i]) if extra == "batch_idx" else i
        lp = int(kw["cache_leftpad"][i]) if extra == "leftpad" else 0
        n = int(lens[i])
        k_cache[b, n:], v_cache[b, n:] = math.nan, math.nan
        k_cache[b, :lp], v_cache[b, :lp] = math.nan, math.nan
    ref = kvcache_ref(q, *clean, **ref_kw)
    ref_lowp = kvcache_ref(q, *clean, upcast=False, **ref_kw)
    (out, lse), names = kernels_run(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True,
                                                                    **call_kw))
    assert ("fwd_kernel_sm90" in names) == hopper_serves(None), names
    assert torch.isfinite(out).all()
    if sink is not None:  # the sink joins every row's denominator: out scales by exp(lse) / (exp(lse) + exp(sink))
        ref_lse = ref[1].float()
        lse_sink = torch.logaddexp(ref_lse, sink.float()[None, :, None])
        scale = torch.exp(ref_lse - lse_sink).transpose(1, 2)[..., None]
        ref = ((ref[0].float() * scale).to(dtype), lse_sink)
        ref_lowp = ((ref_lowp[0].float() * scale).to(dtype), lse_sink)
    ok, err, err_pt = within_tolerance(out, ref[0], ref_lowp[0])
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    assert max_error(lse, ref[1]) <= LSE_ATOL, max_error(lse, ref[1])


@gpu
@pytest.mark.parametrize("page", [16, 64, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_prefill_varlen_paged(page, causal):
    """SGLang's and vLLM's mixed batches with a long chunk (max_seqlen_q x the group past 64 rows): varlen q
    against a paged cache on the Hopper forward (pages of a multiple of 16) or the split kernel (page 1); decode
    rows, an empty sequence and a chunk longer than its keys' share; NaN in every unused page."""
    require_kernel(128, torch.bfloat16)
    dtype = torch.bfloat16
    heads, heads_k, d = 8, 2, 128
    lens_q, lens_k = [100, 1, 0, 37, 250], [300, 50, 0, 37, 700]  # 77.6 rows a sequence: the Hopper forward's
    max_pages = (max(lens_k) + page - 1) // page
    k_dense, v_dense = (randn(len(lens_q), max_pages * page, heads_k, d, dtype=dtype) for _ in range(2))
    for b, n in enumerate(lens_k):  # rows past each length (in its last page too): NaN / Inf
        k_dense[b, n:], v_dense[b, n:] = math.nan, math.inf
    k_pages, v_pages, table = to_pages(k_dense, v_dense, page)
    used = set(table.flatten().tolist())
    spare = next(i for i in range(k_pages.shape[0]) if i not in used)
    if 0 in used:  # physical page 0 (where boxes past a length read) an unused NaN page
        table[table == 0] = spare
        k_pages[spare], v_pages[spare] = k_pages[0].clone(), v_pages[0].clone()
        k_pages[0], v_pages[0] = math.nan, math.nan
    for b, n in enumerate(lens_k):
        table[b, (n + page - 1) // page:] = -1
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    seqused = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    q = randn(int(cu_q[-1]), heads, d, dtype=dtype)
    (out, lse), names = kernels_run(lambda: flash_attn_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=seqused, page_table=table, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q),
        causal=causal, return_softmax_lse=True))
    assert ("fwd_kernel_sm90" in names) == hopper_serves(page), names
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        if n_q == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, ref_lse = attention_ref(q[None, rows], k_dense[b:b + 1, :n_k], v_dense[b:b + 1, :n_k], causal)
        ref_lowp, _ = attention_ref(q[None, rows], k_dense[b:b + 1, :n_k], v_dense[b:b + 1, :n_k], causal, upcast=False)
        assert torch.isfinite(out[rows]).all(), b
        ok, err, err_pt = within_tolerance(out[None, rows], ref, ref_lowp)
        assert ok, (b, err, err_pt)
        assert max_error(lse[:, rows], ref_lse[0]) <= LSE_ATOL, b


@gpu
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [700, 300])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 160, 224, 256])
def test_paged_prefill_many_tiles(page, causal, seqlen_q, head_dim):
    """The paged plain kernel (fwd_kernel_sm90's kPaged: two producer warps share each block's TMA boxes) over a
    few hundred tiles of different lengths: out and LSE bitwise equal to the same call on a contiguous cache (the
    consumers' code is the plain kernel's; only who issues the loads differs), and each call ran the kernel it
    should; every forward head dim's tile (d 160: 112-key blocks, 224 / 256: 80, boxes of 16 rows), and d 256's
    short causal tile (64-key blocks, seqlen_q 300)."""
    require_kernel(head_dim, torch.bfloat16)
    if not hopper_serves(page):
        pytest.skip("the Hopper forward's paged kernel: an sm_90 GPU and a build with sm_90a code")
    torch.manual_seed(page + head_dim + causal + seqlen_q)
    dtype = torch.bfloat16
    batch, heads, heads_k, capacity = 3, 16, 4, 3072
    lens = torch.tensor([3072, 1111, 2049], dtype=torch.int32, device="cuda")
    q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, heads_k, head_dim, dtype=dtype) for _ in range(2))
    k_pages, v_pages, table = to_pages(k_cache, v_cache, page)
    (out, lse), names = kernels_run(lambda: flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, causal=causal, return_softmax_lse=True))
    assert re.search(r"fwd_kernel_sm90<[^()]*, false, false, false>\(", names), names
    (out_p, lse_p), names_p = kernels_run(lambda: flash_attn_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=lens, causal=causal, block_table=table, return_softmax_lse=True))
    assert re.search(r"fwd_kernel_sm90<[^()]*, false, false, true>\(", names_p), names_p
    assert torch.isfinite(out_p).all()
    assert torch.equal(out_p, out), max_error(out_p, out)
    assert torch.equal(lse_p, lse), max_error(lse_p, lse)


@gpu
def test_scheduler_metadata_follows_the_kernel():
    """get_scheduler_metadata's split count is the call's: 1 where the Hopper forward takes a chunked prefill (no
    split workspace), the split plan for pages it does not take."""
    require_kernel(128, torch.bfloat16)
    args = dict(batch_size=1, max_seqlen_q=80, max_seqlen_k=32768, num_heads_q=32, num_heads_kv=8, headdim=128,
                cache_seqlens=torch.zeros(1, dtype=torch.int32, device="cuda"))
    hopper = flash_attn2.get_scheduler_metadata(page_size=16, **args)
    split = flash_attn2.get_scheduler_metadata(page_size=8, **args)
    assert int(hopper[0]) == (1 if hopper_serves(16) else int(split[0]))
    assert int(split[0]) > 1  # 80 rows x 4 heads a kv head: 5 tiles x 8 kv heads, far from filling the GPU
    # Varlen q of more than 64 rows: the kernel depends on the batch's total rows, which the metadata does not see:
    # 0, the call chooses (as it does without metadata).
    cu = torch.tensor([0, 80], dtype=torch.int32, device="cuda")
    assert int(flash_attn2.get_scheduler_metadata(page_size=16, cu_seqlens_q=cu, **args)[0]) == 0


@gpu
@pytest.mark.parametrize("batch,seqlen_k,page,clustered", [
    (1, 1024, None, True), (1, 1024, 16, True), (1, 4096, None, True),  # 4 / 8 splits on 32 / 64 blocks
    (1, 32768, None, False),  # splits of 32 key blocks
    (8, 1024, None, False),  # 4 splits on 256 blocks
])
def test_cluster_combine_default(batch, seqlen_k, page, clustered, monkeypatch):
    """Unset, FLASH_ATTN2_SPLIT_COMBINE leaves the choice to heuristics.h's cluster_combine_pays: short calls of the
    narrow kernel (batch-1 decode up to 4k at 32 / 8 heads, d 128) merge in a cluster, long splits and full grids in
    the combine kernel (TUNING 152); "auto" is the same, "kernel" refuses the cluster, anything else raises naming
    the variable. 128-159 SMs (the plans' split counts), sm_90."""
    require_cluster_plans()
    torch.manual_seed(batch + seqlen_k)
    q = randn(batch, 1, 32, 128, dtype=torch.bfloat16)
    if page is None:
        k_cache, v_cache = (randn(batch, seqlen_k, 8, 128, dtype=torch.bfloat16) for _ in range(2))
        table = None
    else:
        k_cache, v_cache = (randn(batch * seqlen_k // page, page, 8, 128, dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(batch * seqlen_k // page, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), seqlen_k - 3, dtype=torch.int32, device="cuda")

    def call():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    ref = call_with_env(monkeypatch, "kernel", call)
    for mode in (None, "auto"):
        if mode is None:
            monkeypatch.delenv("FLASH_ATTN2_SPLIT_COMBINE", raising=False)
        else:
            monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", mode)
        out, names = kernels_run(call)
        assert ("fwd_combine_kernel" not in names) == clustered, (mode, names)
        assert max_error(out, ref) <= 1e-2
    monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", "clusters")
    with pytest.raises(RuntimeError, match="FLASH_ATTN2_SPLIT_COMBINE must be cluster, kernel, auto or unset"):
        call()


@gpu
def test_cluster_split_plan(monkeypatch):
    """Where the cluster combine takes a call its plan has more splits (heuristics.h: cluster_kv_splits): batch 1 x
    1k at 32 / 8 heads, d 128 (16 key blocks, 8 tiles) plans 8 splits instead of the combine kernel's 4; 1 x 4k
    keeps 8 (half the SMs over 8 tiles); FLASH_ATTN2_SPLIT_COMBINE=kernel plans as before. 128-159 SMs, sm_90."""
    require_cluster_plans()

    def plan(ctx):
        return int(flash_attn2.get_scheduler_metadata(1, 1, ctx, 32, 8, 128,
                                                      torch.zeros(1, dtype=torch.int32, device="cuda"))[0])
    monkeypatch.delenv("FLASH_ATTN2_SPLIT_COMBINE", raising=False)
    assert (plan(1024), plan(4096)) == (8, 8)
    monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", "kernel")
    assert (plan(1024), plan(4096)) == (4, 8)


def require_cluster_plans():
    """Skips unless the plans the cluster tests expect can run: d 128 bf16 built, the cluster combine (clusters_run)
    and 128-159 SMs (H100, H200: the split counts)."""
    require_kernel(128, torch.bfloat16)
    if not clusters_run():
        pytest.skip("the cluster combine runs on an sm_90 GPU with the build's sm_90 code")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 128 <= sms < 160:
        pytest.skip(f"the expected plans are for 128-159 SMs ({sms} here)")


def call_with_env(monkeypatch, value, fn):
    monkeypatch.setenv("FLASH_ATTN2_SPLIT_COMBINE", value)
    out, names = kernels_run(fn)
    assert "fwd_split" in names and ", true>" not in names, names
    return out


@gpu
def test_paged_decode_plans():
    """Pages of fewer than 64 rows plan two blocks per SM where contiguous caches and larger pages plan one
    (heuristics.h: kPagedWaveRows; TUNING 148, 152): 8 sequences of 32k at 32 / 8 heads are 64 tiles, 2 splits a
    wave contiguous and with pages of 64 / 256, 4 with pages of 1 / 16 rows, on a GPU of 128-159 SMs (H100, H200:
    132); one sequence of 32k (8 tiles): a wave's SMs / 8 splits, at most the square root of its 512 key blocks
    (23), which pages of 16 rows reach; pages of 1 row (a table lookup a key row) twice that root within the
    two-block wave (TUNING 180), in splits of equal key blocks."""
    require_kernel(128, torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 128 <= sms < 160:
        pytest.skip(f"the expected counts are for 128-159 SMs ({sms} here)")
    args = dict(batch_size=8, max_seqlen_q=1, max_seqlen_k=32768, num_heads_q=32, num_heads_kv=8, headdim=128,
                cache_seqlens=torch.zeros(8, dtype=torch.int32, device="cuda"))
    plans = [int(flash_attn2.get_scheduler_metadata(page_size=page, **args)[0]) for page in (None, 64, 256, 16, 1)]
    assert plans == [2, 2, 2, 4, 4], plans
    args.update(batch_size=1, cache_seqlens=torch.zeros(1, dtype=torch.int32, device="cuda"))
    plans = [int(flash_attn2.get_scheduler_metadata(page_size=page, **args)[0]) for page in (None, 256, 16, 1)]
    one_wave = min(sms // 8, 23)
    per_row = min(2 * sms // 8, 46)
    per_row = -(-512 // -(-512 // per_row))  # the fewest splits with the same key blocks a split
    assert plans == [one_wave, one_wave, 23, per_row], plans


@gpu
def test_short_query_rows_stay_packed():
    """Few rows per head (speculative verification: 9 tokens at 8:1 GQA, 72 packed rows) stay on the split kernel,
    which packs the group into one tile, even where the Hopper forward could take the call."""
    require_kernel(128, torch.bfloat16)
    dtype = torch.bfloat16
    q = randn(2, 9, 64, 128, dtype=dtype)
    k_cache, v_cache = (randn(2, 1024, 8, 128, dtype=dtype) for _ in range(2))
    lens = torch.tensor([1000, 517], dtype=torch.int32, device="cuda")
    out, names = kernels_run(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True))
    assert "fwd_kernel_sm90" not in names and "fwd_split" in names, names
    ref = kvcache_ref(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    ref_lowp = kvcache_ref(q, k_cache, v_cache, cache_seqlens=lens, causal=True, upcast=False)
    ok, err, err_pt = within_tolerance(out, ref[0], ref_lowp[0])
    assert ok, (err, err_pt)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("swap_sq_sk", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (3, 799), (127, 513), (113, 203), (108, 256), (1023, 1024)])
@pytest.mark.parametrize("page", [1, 16, 256, 512])
def test_flash_attn_varlen_causal_paged(dtype, d, local, swap_sq_sk, seqlen_q, seqlen_k, page):
    """flash-attn's test_flash_attn_varlen_causal with paged_kv_block_size (its pages 256 / 512, and 1 / 16, which
    it cannot take): random padding masks make the sequences, the keys live in randomly placed pages of a cache,
    cu_seqlens_k gives each sequence's key count, a window drawn as flash-attn draws it (a 2-element tensor); q
    requires grad as there (the forward runs; the paged path has no backward, which raises if asked)."""
    require_kernel(d, dtype)
    if swap_sq_sk:
        seqlen_q, seqlen_k = seqlen_k, seqlen_q
    torch.manual_seed(0)
    batch, heads = 8, 9
    window = (-1, -1) if not local else torch.randint(0, seqlen_k, (2,))
    pages_per_seq = -(-seqlen_k // page)
    num_pages = 3 * batch * pages_per_seq  # flash-attn's generator: a cache three times the need, pages permuted
    k_pages, v_pages = randn(num_pages, page, heads, d, dtype=dtype), randn(num_pages, page, heads, d, dtype=dtype)
    table = torch.randperm(num_pages, device="cuda")[:batch * pages_per_seq].to(torch.int32).view(batch, pages_per_seq)
    lens_q = torch.randint(max(1, seqlen_q // 2), seqlen_q + 1, (batch,)).tolist()  # flash-attn's "random" masks
    lens_k = torch.randint(max(1, seqlen_k // 2), seqlen_k + 1, (batch,)).tolist()
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = randn(int(cu_q[-1]), heads, d, dtype=dtype).requires_grad_()
    out = flash_attn2.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k), 0.0,
                                             causal=True, window_size=window, block_table=table)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="paged forward"):
        out.sum().backward()
    dense_k, dense_v = from_pages(k_pages, table), from_pages(v_pages, table)
    win = (-1, -1) if not local else tuple(int(w) for w in window)
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        qb = q.detach()[None, rows]
        ref, _ = attention_ref(qb.float(), dense_k[b:b + 1, :n_k].float(), dense_v[b:b + 1, :n_k].float(), True,
                               window=win)
        lowp, _ = attention_ref(qb, dense_k[b:b + 1, :n_k], dense_v[b:b + 1, :n_k], True, window=win, upcast=False)
        ok, err, err_pt = within_tolerance(out.detach()[None, rows], ref, lowp)
        assert ok, f"sequence {b}: error {err} vs PyTorch's {err_pt}"


@gpu
def test_cuda_graph_replay_with_changing_lengths():
    require_kernel(128, torch.bfloat16)
    dtype = torch.bfloat16
    batch, heads, heads_k, d, cap = 4, 32, 8, 128, 4096
    q = randn(batch, 1, heads, d, dtype=dtype)
    k, v = randn(batch, 1, heads_k, d, dtype=dtype), randn(batch, 1, heads_k, d, dtype=dtype)
    k_cache, v_cache = randn(batch, cap, heads_k, d, dtype=dtype), randn(batch, cap, heads_k, d, dtype=dtype)
    seqlens = torch.tensor([10, 1000, 2000, 4000], dtype=torch.int32, device="cuda")
    static = dict(cache_seqlens=seqlens, causal=True, num_splits=0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **static)  # warm-up (allocations)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **static)
    for lens in ([1, 2, 3, 4], [4095, 17, 0, 2048], [100, 200, 300, 400]):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        before_k, before_v = k_cache.clone(), v_cache.clone()
        graph.replay()
        ref = kvcache_ref(q, before_k, before_v, k, v, cache_seqlens=seqlens, causal=True)
        assert max_error(out, ref[0]) <= 2e-2, lens
        assert torch.equal(v_cache, ref[3])


@gpu
def test_compile_fullgraph():
    require_kernel(64, torch.float16)
    dtype = torch.float16
    q = randn(2, 1, 8, 64, dtype=dtype)
    k, v = randn(2, 1, 2, 64, dtype=dtype), randn(2, 1, 2, 64, dtype=dtype)
    k_cache, v_cache = randn(2, 256, 2, 64, dtype=dtype), randn(2, 256, 2, 64, dtype=dtype)
    seqlens = torch.tensor([3, 200], dtype=torch.int32, device="cuda")

    def step(q, k, v, kc, vc, seqlens):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True) * 2

    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    expected = step(q, k, v, kc_ref, vc_ref, seqlens)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, k, v, k_cache, v_cache, seqlens)
    assert torch.equal(got, expected)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)  # the mutation survived compilation


@gpu
@pytest.mark.bigmem
def test_cache_past_2_31_elements():
    """64-bit offsets: cache entry 2 starts at element 2**31 (flash-attn #772)."""
    require_kernel(128, torch.bfloat16)
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 13 GB of GPU memory")
    dtype = torch.bfloat16
    k_cache = torch.zeros(3, 2**20, 8, 128, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[2, :300].normal_(), v_cache[2, :300].normal_()
    q = randn(1, 1, 16, 128, dtype=dtype)
    seqlens = torch.tensor([300], dtype=torch.int32, device="cuda")
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=idx)
    ref = attention_ref(q, k_cache[2:3, :300], v_cache[2:3, :300])[0]
    assert max_error(out, ref) <= 2e-2


# ---- Argument checks (CPU: they run before any GPU work) ----

def _args(**over):
    a = dict(q=torch.zeros(2, 1, 4, 64, dtype=torch.float16), k_cache=torch.zeros(2, 16, 2, 64, dtype=torch.float16),
             v_cache=torch.zeros(2, 16, 2, 64, dtype=torch.float16))
    a.update(over)
    return a


@pytest.mark.parametrize("over,error,match", [
    (dict(q=torch.zeros(2, 1, 4, 64)), TypeError, "q must be float16 or bfloat16"),
    (dict(k_cache=torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)), TypeError, "k_cache must have q's dtype"),
    (dict(k_cache=torch.zeros(2, 16, 3, 64, dtype=torch.float16)), ValueError, "k_cache and v_cache must have the same shape"),
    (dict(k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.float16), v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.float16)),
     ValueError, "k_cache's batch size"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=torch.float16)), ValueError, "pass both k and v"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=torch.float16), v=torch.zeros(2, 1, 2, 64, dtype=torch.float16)),
     ValueError, "need cache_seqlens"),
    (dict(k=torch.zeros(2, 17, 2, 64, dtype=torch.float16), v=torch.zeros(2, 17, 2, 64, dtype=torch.float16),
          cache_seqlens=0), ValueError, "must fit the cache"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, r"cache_seqlens must have shape \(batch,\)"),
    (dict(cache_leftpad=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "cache_leftpad must have shape"),
    (dict(rotary_cos=torch.zeros(16, 16, dtype=torch.float16), rotary_sin=torch.zeros(16, 16, dtype=torch.float16)),
     ValueError, "rotary_cos / rotary_sin need k and v"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=torch.float16), v=torch.zeros(2, 1, 2, 64, dtype=torch.float16),
          cache_seqlens=1, rotary_cos=torch.zeros(8, 16, dtype=torch.float16),
          rotary_sin=torch.zeros(8, 16, dtype=torch.float16)), ValueError, "at least seqlen_cache"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=torch.float16), v=torch.zeros(2, 1, 2, 64, dtype=torch.float16),
          cache_seqlens=1, rotary_cos=torch.zeros(16, 4, dtype=torch.float16),
          rotary_sin=torch.zeros(16, 4, dtype=torch.float16)), ValueError, "multiple of 16"),
    (dict(num_splits=129), ValueError, "num_splits must be an int in 0..128"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError, r"block_table must be \(batch, max_pages\)"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32), cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
     ValueError, "cannot be combined with block_table"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32), page_table=torch.zeros(2, 1, dtype=torch.int32)),
     ValueError, "not both"),
    (dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes must be"),
    (dict(softcap=-1.0), ValueError, "softcap"),
])
def test_argument_errors(over, error, match):
    with pytest.raises(error, match=match):
        flash_attn_with_kvcache(**_args(**over))


def test_cpu_tensors_refused():
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        flash_attn_with_kvcache(**_args())


def test_signature_matches_flash_attn():
    import inspect
    params = inspect.signature(flash_attn_with_kvcache).parameters
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                          "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size",
                          "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse"]
    # FA3's keywords: page_table (block_table's name there), varlen q
    assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == ["page_table", "cu_seqlens_q", "max_seqlen_q",
                                                                          "learnable_sink", "s_aux",
                                                                          "scheduler_metadata"]
    from flash_attn2.flash_attn_interface import flash_attn_with_kvcache as same
    assert same is flash_attn_with_kvcache


def test_scheduler_metadata_argument():
    with pytest.raises(ValueError, match="scheduler_metadata must be what flash_attn2.get_scheduler_metadata returned"):
        flash_attn_with_kvcache(**_args(scheduler_metadata=torch.zeros(4, dtype=torch.int32)))
    from flash_attn2._kvcache import metadata_splits
    assert metadata_splits(torch.tensor([7], dtype=torch.int32), 0) == 7
    assert metadata_splits(torch.tensor([7], dtype=torch.int32), 2) == 2 and metadata_splits(None, 3) == 3


@gpu
def test_get_scheduler_metadata_is_the_calls_plan():
    """The metadata's split count is the one the call would choose; passing it gives the same result."""
    require_kernel(128, torch.bfloat16)
    meta = flash_attn2.get_scheduler_metadata(1, 1, 32768, 32, 8, 128, None)
    assert meta.dtype == torch.int32 and meta.device.type == "cpu" and 1 <= int(meta[0]) <= 128
    assert int(flash_attn2.get_scheduler_metadata(1, 1, 32768, 32, 8, 128, None, num_splits=5)[0]) == 5
    q = randn(1, 1, 32, 128, dtype=torch.bfloat16)
    kc, vc = randn(1, 32768, 8, 128, dtype=torch.bfloat16), randn(1, 32768, 8, 128, dtype=torch.bfloat16)
    seqlens = torch.tensor([30000], dtype=torch.int32, device="cuda")
    plain = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    given = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, scheduler_metadata=meta)
    assert torch.equal(plain, given)


@gpu
def test_heuristic_splits_with_paging_never_nan():
    """torchtitan #3235 (pytorch #179760): flash-attn's heuristic splits with a paged cache gave NaN in ~1 % of decode
    steps. 100 seeds of random lengths, tables and page sizes, heuristic splits: every output finite and right."""
    require_kernel(128, torch.bfloat16)
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        page = [1, 16, 64, 256, 7][seed % 5]
        batch, heads, heads_k, max_pages = 1 + seed % 4, 8, 2, 1 + 4096 // page
        num_pages = batch * max_pages
        k_pages = torch.randn(num_pages, page, heads_k, 128, generator=g).to("cuda", torch.bfloat16)
        v_pages = torch.randn(num_pages, page, heads_k, 128, generator=g).to("cuda", torch.bfloat16)
        table = torch.randperm(num_pages, generator=g).to(torch.int32).view(batch, max_pages).cuda()
        lens = torch.randint(0, max_pages * page + 1, (batch,), generator=g).to(torch.int32).cuda()
        q = torch.randn(batch, 1, heads, 128, generator=g).to("cuda", torch.bfloat16)
        out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)
        assert torch.isfinite(out).all(), seed
        dense_k, dense_v = from_pages(k_pages, table), from_pages(v_pages, table)
        for b in range(batch):
            n = int(lens[b])
            ref = attention_ref(q[b:b + 1], dense_k[b:b + 1, :n], dense_v[b:b + 1, :n])[0]
            assert max_error(out[b:b + 1], ref) <= 2e-2, (seed, b)


def test_scheduler_metadata_refuses_what_it_would_ignore():
    """FA3's get_scheduler_metadata arguments flash_attn2's plan cannot follow raise, naming them (CPU: before the
    extension is asked)."""
    args = dict(batch_size=2, max_seqlen_q=1, max_seqlen_k=1024, num_heads_q=32, num_heads_kv=8, headdim=128,
                cache_seqlens=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="cu_seqlens_k_new"):
        flash_attn2.get_scheduler_metadata(cu_seqlens_k_new=torch.zeros(3, dtype=torch.int32), **args)
    with pytest.raises(NotImplementedError, match="pack_gqa=False"):
        flash_attn2.get_scheduler_metadata(pack_gqa=False, **args)


@pytest.mark.gpu
def test_kvcache_call_has_no_silent_gradient():
    """flash_attn_with_kvcache is forward only: under grad mode with q (or the sink) requiring grad the forward runs and
    a backward raises NotImplementedError naming the call, instead of leaving the inputs without a gradient."""
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_cache, v_cache = (torch.randn(2, 40, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([7, 40], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_softmax_lse=True)
    with torch.no_grad():
        plain = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert torch.equal(out, plain) and out.requires_grad
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache has no backward"):
        out.sum().backward()


@gpu
def test_vllm_step_captured_and_replayed():
    """vLLM's call as it makes it (keywords, cu_seqlens_k omitted; a -1-padded block_table; out=; scheduler_metadata
    from get_scheduler_metadata), captured once in a CUDA graph with the metadata's split count and replayed the way a
    serving loop does: new q, longer seqused_k, a table growing into its -1 entries, every unused row of a page and
    every unused page NaN. Each replay against each sequence's reference."""
    require_kernel(128, torch.bfloat16)
    dtype, heads, heads_k, d, page, max_pages = torch.bfloat16, 8, 2, 128, 16, 8
    lens_q = [1, 1, 4]  # decode rows and a short chunk
    batch, capacity = len(lens_q), max_pages * page
    num_pages = batch * max_pages + 5
    dense_k, dense_v = (randn(batch, capacity, heads_k, d, dtype=dtype) for _ in range(2))
    phys = torch.randperm(num_pages, device="cuda")[:batch * max_pages].to(torch.int32).view(batch, max_pages)
    k_pages, v_pages = (torch.full((num_pages, page, heads_k, d), math.nan, device="cuda", dtype=dtype)
                        for _ in range(2))
    table = torch.full((batch, max_pages), -1, dtype=torch.int32, device="cuda")
    seqused = torch.zeros(batch, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    q = randn(int(cu_q[-1]), heads, d, dtype=dtype)
    out = torch.full_like(q, math.nan)

    def load(lens):  # the step's cache: rows past each length NaN, table entries past its pages -1
        k_pages.fill_(math.nan), v_pages.fill_(math.nan), table.fill_(-1)
        for b, n in enumerate(lens):
            for j in range(-(-n // page)):
                rows = min(page, n - j * page)
                table[b, j] = phys[b, j]
                k_pages[phys[b, j], :rows] = dense_k[b, j * page:j * page + rows]
                v_pages[phys[b, j], :rows] = dense_v[b, j * page:j * page + rows]
        seqused.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))

    meta = flash_attn2.get_scheduler_metadata(batch, max(lens_q), capacity, heads, heads_k, d, seqused, qkv_dtype=dtype,
                                              cu_seqlens_q=cu_q, page_size=page, causal=True)

    def step():
        flash_attn2.flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q),
                                           seqused_k=seqused, max_seqlen_k=capacity, block_table=table, out=out,
                                           num_splits=0, scheduler_metadata=meta, causal=True)

    steps = [[5, 40, 17], [6, 41, 21], [100, capacity, 60], [1, 16, 4]]
    load(steps[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in steps:
        load(lens)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), lens
        for b, (n_q, n_k) in enumerate(zip(lens_q, lens)):
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            ref, _ = attention_ref(q[None, rows], dense_k[b:b + 1, :n_k], dense_v[b:b + 1, :n_k], True)
            assert max_error(out[rows], ref[0]) <= 2e-2, (lens, b)


@gpu
def test_sglang_call_with_lse_and_combine():
    """SGLang's call (flash_attn_with_kvcache, page 1, cu_seqlens_q, return_softmax_lse) over a sequence's keys split in
    two (a shared prefix's pages and the rest, as cascade attention runs them), merged by flash_attn_combine: the
    single call's out and lse."""
    require_kernel(128, torch.bfloat16)
    dtype, heads, heads_k, d = torch.bfloat16, 8, 2, 128
    lens_q, lens_k, prefix = [1, 3, 1, 2], [50, 9, 300, 64], [20, 4, 128, 64]  # the last: nothing past its prefix
    batch, max_rows = len(lens_q), max(lens_k)
    num_pages = batch * max_rows + 7
    k_pages, v_pages = (randn(num_pages, 1, heads_k, d, dtype=dtype) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda")[:batch * max_rows].to(torch.int32).view(batch, max_rows)
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    q = randn(int(cu_q[-1]), heads, d, dtype=dtype)

    def call(tab, lens):
        return flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                                                        device="cuda"),
                                       page_table=tab, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q),
                                       return_softmax_lse=True)
    full, full_lse = call(table, lens_k)
    rest_table = torch.zeros_like(table)
    for b, p in enumerate(prefix):
        rest_table[b, :max_rows - p] = table[b, p:]
    parts = [call(table, prefix), call(rest_table, [n - p for n, p in zip(lens_k, prefix)])]
    out_partial = torch.stack([o.float() for o, _ in parts])  # (2, total_q, heads, d)
    lse_partial = torch.stack([lse.t() for _, lse in parts])  # (2, total_q, heads)
    out, lse = flash_attn2.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    assert max_error(out, full) <= 2e-2
    assert max_error(lse, full_lse.t()) <= LSE_ATOL
