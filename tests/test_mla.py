"""d_v != d_qk (MLA: DeepSeek-V3's d_qk 192 / d_v 128, and the other way round) through flash_attn_func and
flash_attn_varlen_func: forward and backward against the float32 reference (GPU), on the Hopper pair kernel where the
build has one (FLASH_ATTN2_HEAD_DIM_PAIRS) and padded inside the ops elsewhere; the fake and the checks on the CPU."""

import os

import pytest
import torch

import flash_attn2
from flash_attn2.testing import attention_ref, within_tolerance


def mla_ref(q, k, v, causal, upcast=True):
    """Attention with v's own head dim, from attention_ref's scores (scale from q's head dim)."""
    scale = q.shape[-1] ** -0.5
    pad = max(q.shape[-1], v.shape[-1])
    f = lambda t: torch.nn.functional.pad(t, (0, pad - t.shape[-1]))  # noqa: E731
    out, lse = attention_ref(f(q), f(k), f(v), causal, scale, upcast=upcast)
    return out[..., :v.shape[-1]], lse


def test_fake_out_has_v_head_dim():
    """The op's fake (torch.compile, export): out in v's head dim, lse as usual; the checks take v's own head dim."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flash_attn2 import _ops
    with FakeTensorMode():
        q, k = torch.empty(2, 5, 8, 192, dtype=torch.bfloat16), torch.empty(2, 7, 2, 192, dtype=torch.bfloat16)
        v = torch.empty(2, 7, 2, 128, dtype=torch.bfloat16)
        out, lse, _ = _ops._fwd_fake(q, k, v, None, None, 0, 0, 192 ** -0.5, True, -1, 0, 0.0, None, False)
        assert out.shape == (2, 5, 8, 128) and out.is_contiguous() and lse.shape == (2, 8, 5)
        dq, dk, dv, _ = _ops._bwd_fake(out, q, k, v, out, lse, None, None, 0, 0, 1.0, True, -1, 0, 0.0, None, False)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_v_shape_checks():
    q = torch.zeros(1, 4, 2, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k and v must have the same shape but for the head dim"):
        flash_attn2.flash_attn_func(q, q, torch.zeros(1, 5, 2, 128, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (96, 64), (256, 128), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_mla_head_dims(d_qk, d_v, causal):
    dtype = torch.bfloat16
    bucket = next(b for b in (32, 64, 96, 128, 160, 192, 224, 256) if b >= max(d_qk, d_v))
    if bucket not in flash_attn2.compiled_head_dims(dtype):
        pytest.skip(f"head dim {bucket} not compiled")
    q = torch.randn(2, 300, 8, d_qk, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 517, 2, d_qk, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 517, 2, d_v, device="cuda", dtype=dtype, requires_grad=True)
    out = flash_attn2.flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (2, 300, 8, d_v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = []
    for upcast in (True, False):
        leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                  for t in (q, k, v)]
        o = mla_ref(*leaves, causal, upcast)[0]
        refs.append((o, *torch.autograd.grad(o, leaves, dout.float() if upcast else dout)))
    ok, err, err_pt = within_tolerance(out, refs[0][0], refs[1][0])
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    for name, g, r, p in zip("qkv", grads, refs[0][1:], refs[1][1:]):
        assert g.shape == {"q": q, "k": k, "v": v}[name].shape
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"d{name} error {err} vs PyTorch's {err_pt}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "deterministic", "fixed_fp16"])
def test_mla_backward_reads_v_unpadded(case):
    """On the Hopper backward (192, 128) reads v, out and dout at d_v: no padded copies before it and none of dv after
    it (no copy or fill kernel in the backward's profile; TMA fills dO's and V's columns past d_v with zeros), with
    the reference's gradients under the 2x rule: one GQA causal sequence and varlen (a sequence with queries and no
    keys, one with fewer keys than queries), where GQA's head splits add dV into an fp32 accumulator converted at
    d_v; deterministic (no head splits: dV stored from the block, clipped at d_v);
    fixed length (batch strides) in fp16."""
    dtype = torch.float16 if case == "fixed_fp16" else torch.bfloat16
    if not (torch.cuda.get_device_capability() == (9, 0) and 192 in flash_attn2.compiled_head_dims(dtype)
            and "_90" in str(flash_attn2._ops.ext.built_archs) and os.environ.get("FLASH_ATTN2_BACKEND") != "sm80"):
        pytest.skip("the Hopper backward at head dim 192 (an sm_90 GPU, the build's sm_90 code)")
    torch.manual_seed(0)
    lens_q, lens_k = ((300, 40, 129), (517, 0, 64)) if case == "varlen" else ((300,), (517,))
    q = torch.randn(sum(lens_q), 8, 192, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 192, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    cu = lambda lens: torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)  # noqa: E731
    if case == "fixed_fp16":  # two sequences of (300, 517) as a (2, s, h, d) batch: batch strides
        lens_q, lens_k = (300, 300), (517, 517)
        q, k, v = (torch.randn(2, n, h, d, device="cuda", dtype=dtype).requires_grad_()
                   for n, h, d in ((300, 8, 192), (517, 2, 192), (517, 2, 128)))
        out = flash_attn2.flash_attn_func(q, k, v, causal=True)
    else:
        out = flash_attn2.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                                 causal=True, deterministic=case == "deterministic")
    dout = torch.randn_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("bwd_kernel_sm90" in n for n in names), names
    assert not any("copy" in n.lower() or "fill" in n.lower() or "pad" in n.lower() for n in names), names
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    if case == "fixed_fp16":  # the batch entries as the loop's sequences
        q, k, v, dout = (t.detach().flatten(0, 1) for t in (q, k, v, dout))
        grads = [g.flatten(0, 1) for g in grads]
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(sum(lens_q[:b]), sum(lens_q[:b + 1])), slice(sum(lens_k[:b]), sum(lens_k[:b + 1]))
        if sk == 0:  # queries without keys: out 0, so their gradients are zeros
            assert torch.equal(grads[0][rq], torch.zeros_like(grads[0][rq]))
            continue
        refs = []
        for upcast in (True, False):
            leaves = [t.detach()[r].unsqueeze(0) for t, r in ((q, rq), (k, rk), (v, rk))]
            leaves = [t.float().requires_grad_() if upcast else t.clone().requires_grad_() for t in leaves]
            o = mla_ref(*leaves, True, upcast)[0]
            g_out = dout[rq].unsqueeze(0)
            refs.append(torch.autograd.grad(o, leaves, g_out.float() if upcast else g_out))
        for name, g, r, p in zip("qkv", (grads[0][rq], grads[1][rk], grads[2][rk]), refs[0], refs[1]):
            ok, err, err_pt = within_tolerance(g, r[0], p[0], atol=1e-4)
            assert ok, f"sequence {b} d{name} error {err} vs PyTorch's {err_pt}"


def test_error_names_v_head_dim():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"v's head dim \(v.shape\[-1\]\) must be in 1..256, got 512"):
        flash_attn2.flash_attn_func(q, q, torch.zeros(1, 4, 2, 512, dtype=torch.bfloat16))


def _pair_kernel_ran(fn):
    """Whether the Hopper forward's (192, 128) pair kernel ran (its traits' V head dim in the kernel's name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return any("FwdTraitsSm90<192" in n and ", 128>" in n for n in names), names


def _pair_expected(dtype=torch.bfloat16):
    """Whether this build and GPU run (192, 128) on its pair kernel: built (ext.head_dim_pairs, which
    FLASH_ATTN2_HEAD_DIM_PAIRS decides), an sm_90 GPU, the dtype compiled, FLASH_ATTN2_BACKEND not sm80."""
    pairs = list(flash_attn2._ops.ext.head_dim_pairs)
    built = (192, 128) in zip(pairs[::2], pairs[1::2])
    return (built and torch.cuda.get_device_capability() == (9, 0) and 192 in flash_attn2.compiled_head_dims(dtype)
            and os.environ.get("FLASH_ATTN2_BACKEND", "auto") != "sm80")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen_window", "dropout", "decode"])
def test_mla_pair_kernel_and_fallback(case, monkeypatch):
    """(192, 128) on the pair kernel where it serves the call (Hopper, more than 64 packed query rows), padded inside
    the op where it does not (decode shapes: the split-KV kernel; FLASH_ATTN2_BACKEND=sm80 builds): the same answer
    under the 2x rule either way, forward and backward; varlen with a window, GQA and dropout's keep pattern."""
    if 192 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 192 not compiled")
    from flash_attn2.testing import attention_ref_varlen
    dtype = torch.bfloat16
    sq = 1 if case == "decode" else 300
    q = torch.randn(2, sq, 8, 192, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 517, 2, 192, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 517, 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    if case == "varlen_window":
        lens_q, lens_k = [300, 0, 17], [517, 5, 300]
        cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
        qv = q.detach().reshape(-1, 8, 192)[:sum(lens_q)].clone().requires_grad_()
        kv_, vv = (t.detach().reshape(-1, 2, t.shape[-1])[:sum(lens_k)].clone().requires_grad_() for t in (k, v))
        call = lambda: flash_attn2.flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 300, 517, causal=True,  # noqa: E731
                                                          window_size=(100, 0))
        leaves = (qv, kv_, vv)
        pad = lambda t: torch.nn.functional.pad(t, (0, 192 - t.shape[-1]))  # noqa: E731
        ref_fn = lambda a, b, c, up: attention_ref_varlen(  # noqa: E731
            a.float() if up else a, b.float() if up else b, pad(c.float() if up else c), cu_q, cu_k, True,
            None, up, window=(100, 0))[0][..., :128]
    else:
        drop = 0.17 if case == "dropout" else 0.0
        call = lambda: flash_attn2.flash_attn_func(q, k, v, dropout_p=drop, causal=True)  # noqa: E731
        leaves = (q, k, v)
        ref_fn = lambda a, b, c, up: mla_ref(a.float() if up else a, b.float() if up else b,  # noqa: E731
                                             c.float() if up else c, True, up)[0]
    ran, names = _pair_kernel_ran(call)
    assert ran == (_pair_expected() and case != "decode"), names
    if case == "dense" and flash_attn2._ops.ext.sm80_built:  # the SM80 path pads: the same answer, checked below
        monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
        assert not _pair_kernel_ran(call)[0]
    if case == "dropout":  # the keep pattern is checked against padding: same seed, same bits
        torch.manual_seed(5)
        out = call()
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
        torch.manual_seed(5)
        wide = flash_attn2.flash_attn_func(q, k, torch.nn.functional.pad(v, (0, 64)), dropout_p=0.17, causal=True)
        assert (out.float() - wide[..., :128].float()).abs().max() <= 1e-2  # another keep pattern: O(1) apart
        wide_grads = torch.autograd.grad(wide[..., :128], leaves, dout)
        for g, w in zip(grads, wide_grads):
            assert torch.allclose(g.float(), w.float(), atol=2e-2, rtol=0)
        return
    out = call()
    assert out.shape[-1] == 128
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    refs = []
    for up in (True, False):
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        o = ref_fn(*ref_leaves, up)
        refs.append((o, *torch.autograd.grad(o, ref_leaves, dout.float() if up else dout)))
    ok, err, err_pt = within_tolerance(out, refs[0][0], refs[1][0])
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    for name, g, r, p in zip("qkv", grads, refs[0][1:], refs[1][1:]):
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"d{name} error {err} vs PyTorch's {err_pt}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (176, 112), (192, 100)])  # partial buckets on the pair kernel
@pytest.mark.parametrize("variant", ["plain", "softcap_alibi", "sink"])
def test_mla_pair_variants(dtype, d_qk, d_v, variant):
    """The pair kernel's forward with head dims inside its buckets (V / O columns past d_v, Q / K past d_qk: zero
    filled and never stored; d_v 100 is padded to 104 by the op), fp16 and bf16, softcap with ALiBi (the extended
    kernel) and a sink, against the float32 reference under the 2x rule; then the backward's dq, dk, dv (the
    variants' backward with d_v != d_qk, unpadded or padded as the path takes it)."""
    if 192 not in flash_attn2.compiled_head_dims(dtype):
        pytest.skip(f"head dim 192 {dtype} not compiled")
    q = torch.randn(2, 257, 8, d_qk, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 300, 2, d_qk, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 300, 2, d_v, device="cuda", dtype=dtype, requires_grad=True)
    extra = {}
    if variant == "softcap_alibi":
        extra = dict(softcap=20.0, alibi_slopes=torch.rand(8, device="cuda"))
    elif variant == "sink":
        extra = dict(learnable_sink=torch.randn(8, device="cuda"))
    call = lambda: flash_attn2.flash_attn_func(q, k, v, causal=True, **extra)  # noqa: E731
    ran, names = _pair_kernel_ran(call)
    assert ran == _pair_expected(dtype), names
    out = call()
    assert out.shape == (2, 257, 8, d_v)
    pad = lambda t: torch.nn.functional.pad(t, (0, d_qk - d_v))  # noqa: E731
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = []
    for up in (True, False):
        leaves = [(t.detach().float() if up else t.detach().clone()).requires_grad_() for t in (q, k, v)]
        o = attention_ref(leaves[0], leaves[1], pad(leaves[2]), True, upcast=up, softcap=extra.get("softcap", 0.0),
                          alibi_slopes=extra.get("alibi_slopes"), sink=extra.get("learnable_sink"))[0][..., :d_v]
        refs.append((o, *torch.autograd.grad(o, leaves, dout.float() if up else dout)))
    ok, err, err_pt = within_tolerance(out, refs[0][0], refs[1][0])
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    for name, g, r, p in zip("qkv", grads, refs[0][1:], refs[1][1:]):
        assert g.shape == {"q": q, "k": k, "v": v}[name].shape
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"d{name} error {err} vs PyTorch's {err_pt}"


@pytest.mark.gpu
def test_internal_entry_points_take_mla():
    """flash-attn's private _flash_attn_forward / _backward (the peer shim's, and callers that pass out= or dropout's
    rng_state) with d_v != d_qk: on padded tensors, into the given memory."""
    if 192 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 192 not compiled")
    from flash_attn2.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    q = torch.randn(1, 130, 4, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 130, 4, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 130, 4, 128, device="cuda", dtype=torch.bfloat16)
    scale = 192 ** -0.5
    ref, ref_lse = _flash_attn_forward(q, k, v, None, None, 0, 0, scale, True)
    out = torch.full_like(ref, float("nan"))
    given_lse = torch.full_like(ref_lse, float("nan"))
    got, lse = _flash_attn_forward(q, k, v, None, None, 0, 0, scale, True, out=out, softmax_lse=given_lse)
    assert got is out and (out.float() - ref.float()).abs().max() <= 1e-2 and torch.allclose(lse, ref_lse, atol=1e-3)
    assert lse is given_lse  # written into the given memory, as out
    dout = torch.randn_like(ref)
    grads = _flash_attn_backward(dout, q, k, v, ref, ref_lse, None, None, 0, 0, scale, True, False)
    given = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    _flash_attn_backward(dout, q, k, v, ref, ref_lse, None, None, 0, 0, scale, True, False, *given)
    for g, r in zip(given, grads):
        assert g.shape == r.shape and (g.float() - r.float()).abs().max() <= 1e-2
    rng = torch.tensor([7, 0], device="cuda", dtype=torch.int64)  # dropout with a given (seed, offset)
    a = _flash_attn_forward(q, k, v, None, None, 0, 0, scale, True, dropout_p=0.1, rng_state=rng)[0]
    b = _flash_attn_forward(q, k, v, None, None, 0, 0, scale, True, dropout_p=0.1, rng_state=rng)[0]
    assert a.shape == ref.shape and torch.equal(a, b)


def test_distributed_forms_refuse_mla():
    """The ring and all-gather forms raise NotImplementedError naming v's head dim (before any collective)."""
    from flash_attn2.distributed import llama3, ring, ring_varlen
    q, v = torch.zeros(1, 8, 2, 192), torch.zeros(1, 8, 2, 128)
    with pytest.raises(NotImplementedError, match=r"v's head dim \(128\) other than q's \(192\)"):
        ring.zigzag_ring_flash_attn_func(q, q, v, causal=True)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="MLA"):
        ring_varlen.zigzag_ring_flash_attn_varlen_func(q[0], q[0], v[0], cu, 8, causal=True)
    with pytest.raises(NotImplementedError, match="MLA"):
        llama3.llama3_flash_attn_varlen_func(q[0], q[0], v[0], cu, cu, 8, 8, 1, slice(0, 8), causal=True)


def test_kvcache_refuses_mla():
    """flash_attn_with_kvcache with a narrower v_cache: NotImplementedError naming it (not a shape error)."""
    q = torch.zeros(1, 1, 2, 192, dtype=torch.bfloat16)
    k_cache, v_cache = torch.zeros(1, 8, 2, 192, dtype=torch.bfloat16), torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"v_cache's head dim \(128\) other than k_cache's \(192\) \(MLA\)"):
        flash_attn2.flash_attn_with_kvcache(q, k_cache, v_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("d_v", [128, 100, 200])  # on the pair kernel, padded to 104 first, q / k padded to 200
def test_opcheck_mla(d_v):
    """The ops with v's own head dim: opcheck (eager, FakeTensor, AOTAutograd; the fake's out in v's head dim, the
    backward's dv in v's shape) and torch.compile(fullgraph=True) giving the eager bits."""
    if 192 not in flash_attn2.compiled_head_dims(torch.bfloat16) or (d_v > 192 and 224 not in
                                                                    flash_attn2.compiled_head_dims(torch.bfloat16)):
        pytest.skip("head dim 192 (and 224 for d_v 200) not compiled")
    from flash_attn2 import _ops
    q = torch.randn(2, 97, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 80, 2, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 80, 2, d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    args = (None, None, 97, 80, 192 ** -0.5, True, -1, -1, 0.0, None, False)
    torch.library.opcheck(_ops.fwd, (q, k, v, *args))
    out, lse, _ = _ops.fwd(q, k, v, *args)
    assert out.shape == (2, 97, 4, d_v)
    dout = torch.randn_like(out)
    torch.library.opcheck(_ops.bwd, (dout, *(t.detach() for t in (q, k, v, out, lse)), *args))
    compiled = torch.compile(lambda a, b, c: flash_attn2.flash_attn_func(a, b, c, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), flash_attn2.flash_attn_func(q, k, v, causal=True))
