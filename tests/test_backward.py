"""Backward kernels against a float32 reference (GPU): gradients through autograd of the reference."""

import contextlib
import os

import pytest
import torch

import flash_attn2
from flash_attn2.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from flash_attn2.testing import GRAD_ATOL, attention_ref, attention_ref_varlen, reference_grads, within_tolerance

from test_forward import (DTYPES, HEAD_DIMS, SEQLENS, VARLEN_SEQLENS, dense_inputs, poisoned, randn,
                          require_kernel, require_sm80, varlen_inputs)

pytestmark = pytest.mark.gpu


def check_grads(grads, ref, ref_pt):
    for name, g, r, r_pt in zip(("dq", "dk", "dv"), grads, ref, ref_pt):
        ok, err, err_pt = within_tolerance(g, r, r_pt, atol=GRAD_ATOL)
        assert ok, f"{name} error {err:.3e} > 2 x PyTorch's {err_pt:.3e} + {GRAD_ATOL}"


def hopper_backward_built(head_dim, dtype):
    """Whether this GPU and build run the Hopper backward at head_dim (a Hopper build holds the kernel serving
    each compiled head dim: 160 and 224 run on the 192 and 256 ones, zero-padded). False under
    FLASH_ATTN2_BACKEND=sm80, which sends every call, the default one included, to the SM80 path."""
    if os.environ.get("FLASH_ATTN2_BACKEND") == "sm80":
        return False
    if torch.cuda.get_device_capability() != (9, 0) or "sm_90a" not in flash_attn2._ops.ext.built_archs.split(";"):
        return False
    return next(d for d in HEAD_DIMS if d >= head_dim) in flash_attn2.compiled_head_dims(dtype)


def require_hopper_backward(head_dim, dtype):
    if os.environ.get("FLASH_ATTN2_BACKEND") == "sm80":
        pytest.skip("FLASH_ATTN2_BACKEND=sm80 sends every call to the SM80 path")
    if not hopper_backward_built(head_dim, dtype):
        pytest.skip(f"needs an sm_90 GPU and the Hopper backward's kernel for head dim {head_dim} {dtype}")


def ran_kernel(fn, name):
    """fn()'s result, and whether a kernel whose name holds `name` ran in it (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, any(name in e.key for e in prof.key_averages())


@contextlib.contextmanager
def backward_on(backend):
    """FLASH_ATTN2_BACKEND=backend ("default": unset) for the backward alone (the variable is read on every
    call); "sm80" skips the test where the build has no SM80 path."""
    if backend == "sm80":
        require_sm80()
    with pytest.MonkeyPatch.context() as patch:
        if backend != "default":
            patch.setenv("FLASH_ATTN2_BACKEND", backend)
        yield


def run_backward(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, deterministic=False, before_backward=None,
                 **mods):
    """Our forward + backward through the internal entry points, every output poisoned first;
    before_backward() runs between the two (e.g. to set the backward's environment); mods (window, softcap)
    go to both."""
    out, lse = _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal, **mods)
    if before_backward is not None:
        before_backward()
    dq, dk, dv = (poisoned(t.shape, t.dtype) for t in (q, k, v))
    return _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal,
                                deterministic, dq, dk, dv, **mods)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_bwd(seqlen_q, seqlen_k, group, causal, head_dim, dtype):
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, group, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype)
    grads = run_backward(q, k, v, dout, None, None, seqlen_q, seqlen_k, causal)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up)[0], (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("seqlens", VARLEN_SEQLENS)
def test_bwd_varlen(seqlens, group, causal, head_dim, dtype):
    require_kernel(head_dim, dtype)
    lens_q, lens_k = seqlens
    cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 8, group, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype)
    grads = run_backward(q, k, v, dout, cu_q, cu_k, max(lens_q), max(lens_k), causal)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up)[0],
                            (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_sm80_backward_head_splits(causal, varlen, head_dim, monkeypatch):
    """GQA 8:1 with few key blocks on the SM80 backward (forced; sm_90 takes the Hopper one at these head
    dims): the query heads split over several blocks per key block, dK / dV through fp32 accumulators."""
    dtype = torch.bfloat16
    require_kernel(head_dim, dtype)
    require_sm80()

    def sm80_backward():
        monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")

    if varlen:
        lens = [1, 300, 0, 129]
        cu_q, cu_k, q, k, v = varlen_inputs(lens, lens, 8, 8, head_dim, dtype)
        dout = randn(*q.shape, dtype=dtype)
        grads = run_backward(q, k, v, dout, cu_q, cu_k, max(lens), max(lens), causal, before_backward=sm80_backward)
        ref, ref_pt = reference_grads(
            lambda q, k, v, up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up)[0], (q, k, v), dout)
    else:
        q, k, v = dense_inputs(2, 300, 257, 8, 8, head_dim, dtype)
        dout = randn(*q.shape, dtype=dtype)
        grads = run_backward(q, k, v, dout, None, None, 300, 257, causal, before_backward=sm80_backward)
        ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up)[0], (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("backend", ["default", "sm80"])
def test_bwd_l2_head_splits(backend, monkeypatch):
    """GQA 7:1 (no power-of-two split), causal, head dim 256, 10k rows: a block's heads would hold
    7 x 10000 x 2 KB = 143 MB of Q, dO and dQ-accumulator rows, more than twice the L2 (50 MB on an H100), so
    the query heads split 7 ways (csrc/heuristics.h: bwd_head_splits); the profiler shows the split blocks' dK / dV
    conversion running."""
    dtype, seqlen = torch.bfloat16, 10000
    require_kernel(256, dtype)
    if backend == "sm80":
        require_sm80()

    def set_backend():
        if backend != "default":
            monkeypatch.setenv("FLASH_ATTN2_BACKEND", backend)

    q, k, v = dense_inputs(1, seqlen, seqlen, 7, 7, 256, dtype)
    dout = randn(*q.shape, dtype=dtype)
    grads, split = ran_kernel(
        lambda: run_backward(q, k, v, dout, None, None, seqlen, seqlen, True, before_backward=set_backend), "convert_dkv")
    assert split, "the backward did not split the query heads"
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, True, upcast=up)[0], (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("splits", ["2", "4", "3"])
def test_bwd_head_splits_knob(splits, monkeypatch):
    """FLASH_ATTN2_BWD_HEAD_SPLITS forces the query-head splits of a GQA backward (a tuning knob; the ring's long
    non-causal blocks, TUNING 165): 8:2 heads, batch 3, non-causal 4k (192 key blocks: the rule takes one split); 2
    and 4 split (the profiler shows the split blocks' dK / dV conversion), 3 does not divide the group of 4 and
    leaves the rule's.
    Gradients against the reference either way, with the workspace sized under the same environment."""
    dtype = torch.bfloat16
    require_kernel(128, dtype)
    q, k, v = dense_inputs(3, 4096, 4096, 8, 4, 128, dtype)  # 8 query heads, groups of 4
    dout = randn(*q.shape, dtype=dtype)

    def set_knob():
        monkeypatch.setenv("FLASH_ATTN2_BWD_HEAD_SPLITS", splits)

    grads, split = ran_kernel(
        lambda: run_backward(q, k, v, dout, None, None, 4096, 4096, False, before_backward=set_knob), "convert_dkv")
    assert split == (splits != "3"), splits
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, False, upcast=up)[0], (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [8, 40, 59, 100, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_public_api(head_dim, causal, dtype):
    """Gradients through flash_attn_func: head dims between buckets or padded in Python, GQA, a custom
    softmax_scale, and an expanded (stride-0) dout from out.sum()."""
    require_kernel(head_dim, dtype)
    q = randn(3, 113, 4, head_dim, dtype=dtype).requires_grad_()
    k, v = (randn(3, 97, 2, head_dim, dtype=dtype).requires_grad_() for _ in range(2))
    out = flash_attn2.flash_attn_func(q, k, v, softmax_scale=0.2, causal=causal)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, 0.2, upcast=up)[0], (q, k, v), dout)
    check_grads((q.grad, k.grad, v.grad), ref[1:], ref_pt[1:])
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flash_attn2.flash_attn_func(q, k, v, softmax_scale=0.2, causal=causal).sum().backward()
    ones = torch.ones_like(dout)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, 0.2, upcast=up)[0], (q, k, v), ones)
    check_grads((q.grad, k.grad, v.grad), ref[1:], ref_pt[1:])
    assert not any(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("seqlen_q", [1, 113])
def test_zero_stride_inputs(seqlen_q):
    """Expanded inputs (zero strides, which TMA cannot take; the op copies them): k and v shared by every head,
    a dout expanded over the heads, and with one query row, q's rows at stride 0 too. Output and gradients
    (to the unexpanded tensors) against the reference on the same views."""
    dtype = torch.bfloat16
    require_kernel(64, dtype)
    qb = randn(2, seqlen_q, 4, 64, dtype=dtype).requires_grad_()
    kb, vb = (randn(2, 97, 1, 64, dtype=dtype).requires_grad_() for _ in range(2))

    def views(qb, kb, vb):
        q = qb.as_strided(qb.shape, (qb.stride(0), 0, 64, 1)) if seqlen_q == 1 else qb
        return q, kb.expand(2, 97, 4, 64), vb.expand(2, 97, 4, 64)
    dout = randn(2, seqlen_q, 1, 64, dtype=dtype).expand(2, seqlen_q, 4, 64)
    out = flash_attn2.flash_attn_func(*views(qb, kb, vb), causal=True)
    grads = torch.autograd.grad(out, (qb, kb, vb), dout)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(*views(q, k, v), True, upcast=up)[0], (qb, kb, vb),
                                  dout)
    ok, err, err_pt = within_tolerance(out, ref[0], ref_pt[0])
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
    check_grads(grads, ref[1:], ref_pt[1:])


def test_autograd_packed_and_strided():
    """qkvpacked gradients land in the packed tensor; (b, h, s, d) memory viewed as (b, s, h, d) works."""
    require_kernel(64, torch.bfloat16)
    qkv = randn(2, 200, 3, 4, 64, dtype=torch.bfloat16).requires_grad_()
    out = flash_attn2.flash_attn_qkvpacked_func(qkv, causal=True)
    dout = randn(2, 4, 200, 64, dtype=torch.bfloat16).transpose(1, 2)  # non-contiguous dout
    out.backward(dout)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, True, upcast=up)[0], qkv.unbind(2), dout)
    check_grads(qkv.grad.unbind(2), ref[1:], ref_pt[1:])

    q, k, v = (randn(2, 4, 150, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    dout = randn(2, 150, 4, 64, dtype=torch.bfloat16)
    flash_attn2.flash_attn_func(q, k, v).backward(dout)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, False, upcast=up)[0], (q, k, v), dout)
    check_grads((q.grad, k.grad, v.grad), ref[1:], ref_pt[1:])
    # The op's own gradients (autograd.grad hands them over unchanged) come in their inputs' strides.
    grads = torch.autograd.grad(flash_attn2.flash_attn_func(q, k, v), (q, k, v), dout)
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]
    check_grads(grads, ref[1:], ref_pt[1:])


def test_varlen_autograd_matches_internal():
    require_kernel(128, torch.float16)
    cu = torch.tensor([0, 100, 100, 357], device="cuda", dtype=torch.int32)
    q, k, v = (randn(357, 4, 128, dtype=torch.float16).requires_grad_() for _ in range(3))
    dout = randn(357, 4, 128, dtype=torch.float16)
    flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True).backward(dout)
    dq, dk, dv = run_backward(q.detach(), k.detach(), v.detach(), dout, cu, cu, 257, 257, True, deterministic=True)
    for ours, theirs in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)


def test_double_backward_raises():
    require_kernel(64, torch.bfloat16)
    q, k, v = (randn(1, 16, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    out = flash_attn2.flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="flash_attn2: double backward"):
        dq.sum().backward()


@pytest.mark.parametrize("backend", ["default", "sm80"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_deterministic_bitwise(group, causal, backend):
    """deterministic=True: 20 runs give bitwise-equal gradients. Few heads, so the SM80 backward's key blocks
    split (on Hopper the default is the Hopper backward's ordered adds; sm80 forces the split accumulators)."""
    require_kernel(128, torch.bfloat16)
    q = randn(1, 1000, 4, 128, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(1, 1000, 4 // group, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dout = randn(1, 1000, 4, 128, dtype=torch.bfloat16)
    first = None
    for _ in range(20):
        out = flash_attn2.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        with backward_on(backend):
            grads = torch.autograd.grad(out, (q, k, v), dout)
        if first is None:
            first = grads
            ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up)[0], (q, k, v), dout)
            check_grads(grads, ref[1:], ref_pt[1:])
        assert all(torch.equal(a, b) for a, b in zip(grads, first))


@pytest.mark.parametrize("head_dim", [64, 128, 160, 256])
@pytest.mark.parametrize("case", ["causal", "gqa", "window", "softcap", "varlen"])
def test_deterministic_sm90(case, head_dim):
    """On Hopper deterministic mode runs the Hopper backward, whose key blocks add their dQ shares in
    key-block order (dq_turns.h): the profiler shows its kernel, four runs give bitwise-equal
    gradients, and they match the reference. Head dims 64 / 128 / 160 / 256 cover its four step shapes
    (128 and 64 query rows, 3 and 2 wide warpgroups); the cases its masks, windows, extended kernel and
    varlen query slots. A wrong turn would hang: run under a timeout."""
    dtype = torch.bfloat16
    require_kernel(head_dim, dtype)
    require_hopper_backward(head_dim, dtype)
    causal, mods, cu_q = case != "gqa", {}, None
    if case == "varlen":
        lens_q, lens_k = [0, 17, 700, 1, 300], [5, 0, 1000, 33, 300]
        cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 4, 2, head_dim, dtype)
        max_q, max_k = max(lens_q), max(lens_k)
        ref_fn = lambda q, k, v, up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up)[0]  # noqa: E731
    else:
        max_q, max_k = 700, 1000
        q, k, v = dense_inputs(1, max_q, max_k, 4, 4 if case == "gqa" else 1, head_dim, dtype)
        cu_k = None
        mods = {"window": (200, 0)} if case == "window" else {"softcap": 5.0} if case == "softcap" else {}
        ref_fn = lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, **mods)[0]  # noqa: E731
    dout = randn(*q.shape, dtype=dtype)
    runs, ran = ran_kernel(lambda: [run_backward(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, deterministic=True,
                                                 **mods) for _ in range(4)], "bwd_kernel_sm90")
    assert ran, "the Hopper backward did not run"
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, runs[0])), "gradients differ between runs"
    ref, ref_pt = reference_grads(ref_fn, (q, k, v), dout)
    check_grads(runs[0], ref[1:], ref_pt[1:])


@pytest.mark.parametrize("head_dim", [64, 128, 160, 256])
@pytest.mark.parametrize("case", ["causal", "gqa", "empty_key_blocks", "empty_key_blocks_gqa", "softcap", "varlen"])
def test_bwd_persistent(case, head_dim):
    """The Hopper backward runs one block per SM, each walking many key blocks: K / V reloaded per key block
    while the last one's epilogue runs, the rings' phases, dS buffers and dQ hand-offs carried across key
    blocks, and key blocks no query sees (a narrow window far from the last keys, zero-length query
    sequences) among them, whose dK / dV are zeros (without head splits written by the block itself).
    Shapes with several times more key blocks than any Hopper GPU has SMs."""
    dtype = torch.bfloat16
    require_kernel(head_dim, dtype)
    require_hopper_backward(head_dim, dtype)
    causal, mods, cu_q = case in ("causal", "gqa", "softcap", "varlen"), {}, None
    if case == "varlen":
        lens_q, lens_k = [0, 300, 5, 1000, 0, 77, 640, 1] * 6, [40, 300, 0, 900, 17, 77, 1000, 1] * 6
        cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 8, 2, head_dim, dtype)
        max_q, max_k = max(lens_q), max(lens_k)
        ref_fn = lambda q, k, v, up: attention_ref_varlen(q, k, v, cu_q, cu_k, causal, upcast=up)[0]  # noqa: E731
    else:
        batch, max_q, max_k, heads, group = {
            "causal": (3, 1500, 1500, 16, 1), "gqa": (4, 700, 700, 16, 8), "softcap": (3, 1100, 1100, 16, 1),
            "empty_key_blocks": (4, 200, 2000, 16, 1), "empty_key_blocks_gqa": (4, 200, 2000, 16, 4)}[case]
        q, k, v = dense_inputs(batch, max_q, max_k, heads, group, head_dim, dtype)
        cu_k = None
        mods = ({"window": (50, 50)} if case.startswith("empty") else {"softcap": 5.0} if case == "softcap" else {})
        ref_fn = lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, **mods)[0]  # noqa: E731
    dout = randn(*q.shape, dtype=dtype)
    grads, ran = ran_kernel(lambda: run_backward(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, **mods),
                            "bwd_kernel_sm90")
    assert ran, "the Hopper backward did not run"
    ref, ref_pt = reference_grads(ref_fn, (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


def test_torch_deterministic_flag_is_honoured():
    """torch.use_deterministic_algorithms(True) turns on the deterministic backward, seen in the SM80 one's
    memory: with two heads the key blocks split 16 ways, each split with its own dq accumulator."""
    require_kernel(64, torch.bfloat16)
    q, k, v = (randn(1, 4096, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    accumulator = q.numel() * 4  # one fp32 dq accumulator

    def backward_peak():
        out = flash_attn2.flash_attn_func(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with backward_on("sm80"):
            out.sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    default = backward_peak()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = backward_peak()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert deterministic - default >= 8 * accumulator, (default, deterministic)


def test_grads_over_2_31_elements():
    """dq/dk/dv of more than 2**31 elements each (64-bit offsets)."""
    require_kernel(64, torch.bfloat16)
    batch, seqlen, heads, head_dim = 8200, 256, 16, 64
    if torch.cuda.get_device_properties(0).total_memory < 70 * 2**30:
        pytest.skip("needs 70 GiB of GPU memory")
    assert batch * seqlen * heads * head_dim > 2**31
    q, k, v, dout = (randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16) for _ in range(4))
    dq, dk, dv = run_backward(q, k, v, dout, None, None, seqlen, seqlen, True)
    for b in (0, batch - 1):
        sl = slice(b, b + 1)
        ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, True, upcast=up)[0],
                                (q[sl], k[sl], v[sl]), dout[sl])
        check_grads((dq[sl], dk[sl], dv[sl]), ref[1:], ref_pt[1:])
    del q, k, v
    assert not any(t.isnan().any() for t in (dq, dk, dv))


@pytest.mark.parametrize("deterministic", [False, True])
def test_long_sequence_memory_is_linear(deterministic):
    """seqlen 64k, one head: the backward's extra memory stays O(seqlen * d), far from seqlen^2."""
    require_kernel(128, torch.bfloat16)
    seqlen, head_dim = 65536, 128
    q, k, v = (randn(1, seqlen, 1, head_dim, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = randn(1, seqlen, 1, head_dim, dtype=torch.bfloat16)
    out = flash_attn2.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    tensor_bytes = q.numel() * q.element_size()
    # dq, dk, dv (3x), the fp32 dq accumulator(s) (2x each, up to 16 when deterministic), small scratch.
    bound = (3 + 2 * (16 if deterministic else 1) + 1) * tensor_bytes
    assert extra <= bound, f"backward used {extra / 2**20:.1f} MiB extra, bound {bound / 2**20:.1f} MiB"
    assert bound < 2 * seqlen * seqlen  # so a bf16 (seqlen x seqlen) buffer could not pass
    assert all(not g.isnan().any() for g in grads)
    # dq of the last 256 query rows (which see every key) depends on those rows alone: check it.
    rows = slice(seqlen - 256, seqlen)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, True, upcast=up)[0],
                            (q[:, rows], k, v), dout[:, rows])
    ok, err, err_pt = within_tolerance(grads[0][:, rows], ref[1], ref_pt[1], atol=GRAD_ATOL)
    assert ok, f"dq error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
