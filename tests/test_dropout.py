"""Attention dropout (GPU) against a float32 reference built from the mask that flash_attn2/_dropout.py
regenerates: both forwards and both backwards, every score modifier with it, varlen, deterministic mode, the
public API (S_dmask, torch.manual_seed) and CUDA graph replays."""

import pytest
import torch

import flash_attn2
from flash_attn2 import _dropout
from flash_attn2.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from flash_attn2.testing import attention_ref, attention_scores, max_error, reference_grads, within_tolerance

from test_backward import backward_on, check_grads, hopper_backward_built, ran_kernel
from test_forward import DTYPES, LSE_ATOL, dense_inputs, poisoned, randn, require_kernel, require_sm80, varlen_inputs

pytestmark = pytest.mark.gpu

SEED, OFFSET = 0x1234_5678_9ABC, 4 * 1000


def rng_state(seed=SEED, offset=OFFSET):
    return torch.tensor([seed, offset], dtype=torch.int64, device="cuda")


def forward(q, k, v, causal, p, state, cu_q=None, cu_k=None, max_q=0, max_k=0, **mods):
    """Our forward into NaN-poisoned out and LSE."""
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if cu_q is not None else (q.shape[0], heads, q.shape[1])
    out, lse = poisoned(q.shape, q.dtype), poisoned(lse_shape, torch.float32)
    return _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal, out, lse,
                               dropout_p=p, rng_state=state, **mods)


def dense_ref(q, k, causal, p, seed=SEED, offset=OFFSET, **mods):
    """ref(q, k, v, upcast) -> (out, lse): attention with the dropout mask of a call on q's and k's shapes."""
    keep = _dropout.keep_mask(seed, offset, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1], device="cuda")
    return lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up, dropout_keep=keep,
                                             dropout_scale=_dropout.dropout_scale(p), **mods)


def check_out(out, lse, q, k, v, ref):
    (out_ref, lse_ref), (out_pt, _) = ref(q, k, v, True), ref(q, k, v, False)
    ok, err, err_pt = within_tolerance(out, out_ref, out_pt)
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
    assert max_error(lse, lse_ref) <= LSE_ATOL  # the undropped softmax's


@pytest.mark.parametrize("backend", ["default", "sm80"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 17), (113, 203), (1023, 300), (300, 1023)])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_fwd_dropout(p, seqlen_q, seqlen_k, causal, head_dim, dtype, backend, monkeypatch):
    """GQA 8:2, both forwards; the Hopper forward's 80-key tiles at d 256 hold an odd count of 16-key blocks."""
    require_kernel(head_dim, dtype)
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, 4, head_dim, dtype)
    if backend == "sm80":
        require_sm80()
        monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
    out, lse = forward(q, k, v, causal, p, rng_state())
    check_out(out, lse, q, k, v, dense_ref(q, k, causal, p))


@pytest.mark.parametrize("backend", ["default", "sm80"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 17), (113, 203), (1023, 300), (300, 1023)])
def test_bwd_dropout(seqlen_q, seqlen_k, causal, head_dim, dtype, backend):
    """Both backwards redraw the forward's mask (the Hopper one on S^T at head dim <= 128 and, above it, on
    S by warpgroups of 40 / 32 keys; the SM80 one by 8-key halves): gradients against autograd of the
    reference built from the regenerated mask. The default must run the Hopper kernel wherever it is built."""
    require_kernel(head_dim, dtype)
    p = 0.3
    q, k, v = dense_inputs(2, seqlen_q, seqlen_k, 8, 4, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype)
    out, lse = forward(q, k, v, causal, p, rng_state())
    grads = [poisoned(t.shape, t.dtype) for t in (q, k, v)]
    with backward_on(backend):
        _, ran = ran_kernel(lambda: _flash_attn_backward(
            dout, q, k, v, out, lse, None, None, 0, 0, q.shape[-1] ** -0.5, causal, False, *grads, dropout_p=p,
            rng_state=rng_state()), "bwd_kernel_sm90")
    assert ran == (backend == "default" and hopper_backward_built(head_dim, dtype)), "ran the wrong backward"
    ref = dense_ref(q, k, causal, p)
    refs, refs_pt = reference_grads(lambda q, k, v, up: ref(q, k, v, up)[0], (q, k, v), dout)
    check_grads(grads, refs[1:], refs_pt[1:])


def test_dropout_with_window_softcap_alibi():
    """Dropout with every score modifier, forward and backward (the dropout kernels are the extended ones)."""
    require_kernel(128, torch.bfloat16)
    dtype, p = torch.bfloat16, 0.3
    q, k, v = dense_inputs(2, 500, 700, 4, 2, 128, dtype)
    mods = {"window": (250, 0), "softcap": 20.0, "alibi_slopes": torch.rand(2, 4, device="cuda") * 0.3}
    ref = dense_ref(q, k, True, p, **mods)
    out, lse = forward(q, k, v, True, p, rng_state(), **mods)
    check_out(out, lse, q, k, v, ref)
    dout = randn(*q.shape, dtype=dtype)
    grads = _flash_attn_backward(dout, q, k, v, out, lse, None, None, 0, 0, q.shape[-1] ** -0.5, True, False,
                                 dropout_p=p, rng_state=rng_state(), **mods)
    refs, refs_pt = reference_grads(lambda q, k, v, up: ref(q, k, v, up)[0], (q, k, v), dout)
    check_grads(grads, refs[1:], refs_pt[1:])


def test_dropout_varlen():
    """Varlen draws by (sequence, head) and positions within the sequence: each sequence against a dense
    reference of its own, output and gradients."""
    require_kernel(128, torch.bfloat16)
    dtype, p = torch.bfloat16, 0.25
    lens_q, lens_k = [0, 17, 300, 1, 129], [5, 0, 400, 33, 129]
    cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 4, 2, 128, dtype)
    max_q, max_k = max(lens_q), max(lens_k)
    out, lse = forward(q, k, v, True, p, rng_state(), cu_q, cu_k, max_q, max_k)
    dout = randn(*q.shape, dtype=dtype)
    grads = _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, True,
                                 False, dropout_p=p, rng_state=rng_state())
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        qb, kb, vb, dob = q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0), dout[rows].unsqueeze(0)
        keep = _dropout.keep_mask_one(SEED, OFFSET, p, b, 4, lq, lk, device="cuda").unsqueeze(0)
        ref = lambda q, k, v, up: attention_ref(q, k, v, True, upcast=up, dropout_keep=keep,  # noqa: E731
                                                dropout_scale=_dropout.dropout_scale(p))[0]
        ok, err, err_pt = within_tolerance(out[rows].unsqueeze(0), ref(qb, kb, vb, True), ref(qb, kb, vb, False))
        assert ok, f"sequence {b}: out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
        if lk > 0:
            refs, refs_pt = reference_grads(ref, (qb, kb, vb), dob)
            ours = (grads[0][rows].unsqueeze(0), grads[1][keys].unsqueeze(0), grads[2][keys].unsqueeze(0))
            check_grads(ours, refs[1:], refs_pt[1:])


def test_dropout_reproducible():
    """The same (seed, offset) gives bitwise the same output and gradients; another seed or offset another
    mask; a dropout_p that rounds to threshold 256 keeps everything."""
    require_kernel(64, torch.bfloat16)
    q, k, v = dense_inputs(1, 256, 256, 4, 1, 64, torch.bfloat16)
    first, lse = forward(q, k, v, False, 0.5, rng_state(3, 0))
    again, _ = forward(q, k, v, False, 0.5, rng_state(3, 0))
    assert torch.equal(first, again)
    for state in (rng_state(4, 0), rng_state(3, 4)):
        other, _ = forward(q, k, v, False, 0.5, state)
        assert not torch.equal(first, other)
    kept_all, _ = forward(q, k, v, False, 1 / 1024, rng_state(3, 0))
    ok, err, err_pt = within_tolerance(kept_all, attention_ref(q, k, v)[0], attention_ref(q, k, v, upcast=False)[0])
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"

@pytest.mark.parametrize("backend", ["default", "sm80"])
def test_deterministic_dropout(backend):
    """deterministic=True with dropout: bitwise-equal gradients run to run (on Hopper by default the Hopper
    backward's ordered adds, its kernel seen by the profiler; FLASH_ATTN2_BACKEND=sm80 the SM80 backward's split
    accumulators), and against the reference."""
    require_kernel(64, torch.bfloat16)
    hopper = backend == "default" and hopper_backward_built(64, torch.bfloat16)
    p = 0.4
    q, k, v = dense_inputs(1, 700, 1000, 4, 2, 64, torch.bfloat16)
    out, lse = forward(q, k, v, True, p, rng_state())
    dout = randn(*q.shape, dtype=q.dtype)

    def backward():
        with backward_on(backend):
            return _flash_attn_backward(dout, q, k, v, out, lse, None, None, 0, 0, 0.125, True, True, dropout_p=p,
                                        rng_state=rng_state())
    first, ran = ran_kernel(backward, "bwd_kernel_sm90")
    assert ran == hopper, "the Hopper backward ran" if ran else "the Hopper backward did not run"
    assert all(torch.equal(a, b) for a, b in zip(first, backward()))
    ref = dense_ref(q, k, True, p)
    refs, refs_pt = reference_grads(lambda q, k, v, up: ref(q, k, v, up)[0], (q, k, v), dout)
    check_grads(first, refs[1:], refs_pt[1:])


@pytest.mark.parametrize("varlen", [False, True])
def test_public_api(varlen):
    """flash_attn_func / flash_attn_varlen_func with dropout_p: S_dmask's signs are the mask the output used,
    gradients through autograd match the reference built from them, torch.manual_seed reproduces a call
    bitwise and the generator moves on between calls."""
    dtype, p = torch.bfloat16, 0.2
    require_kernel(64, dtype)
    if varlen:
        lens = [100, 0, 37]
        cu, _, q, k, v = varlen_inputs(lens, lens, 4, 2, 64, dtype)
        call = lambda **kw: flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu, 100, 100, dropout_p=p,  # noqa: E731
                                                               causal=True, **kw)
    else:
        q, k, v = dense_inputs(2, 100, 130, 4, 2, 64, dtype)
        call = lambda **kw: flash_attn2.flash_attn_func(q, k, v, dropout_p=p, causal=True, **kw)  # noqa: E731
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(7)
    out, _, s_dmask = call(return_attn_probs=True)
    torch.manual_seed(7)
    assert torch.equal(call(), out)
    assert not torch.equal(call(), out)
    if varlen:
        return  # the per-sequence masks: test_dropout_varlen
    keep = ~torch.signbit(s_dmask)
    ref = lambda q, k, v, up: attention_ref(q, k, v, True, upcast=up, dropout_keep=keep,  # noqa: E731
                                            dropout_scale=_dropout.dropout_scale(p))[0]
    ok, err, err_pt = within_tolerance(out, ref(q, k, v, True), ref(q, k, v, False))
    assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
    probs = torch.softmax(attention_scores(q.detach().float(), k.detach().float(), True), dim=-1)
    torch.testing.assert_close(s_dmask.abs().float(), probs, atol=1e-2, rtol=0)  # magnitudes: the softmax
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    refs, refs_pt = reference_grads(ref, (q, k, v), dout)
    check_grads((q.grad, k.grad, v.grad), refs[1:], refs_pt[1:])


def test_cuda_graph_replays_draw_new_masks():
    """Under CUDA graph capture the kernels read the generator's captured seed and offset: each replay draws
    a new mask and records the pair it used in rng_state, which regenerates it."""
    dtype, p = torch.bfloat16, 0.3
    require_kernel(64, dtype)
    q, k, v = dense_inputs(1, 128, 128, 2, 1, 64, dtype)
    args = (None, None, 0, 0, 0.125, False, -1, -1, 0.0, None, False, p)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flash_attn2._ops.fwd(q, k, v, *args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, state = flash_attn2._ops.fwd(q, k, v, *args)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        seed, offset = (x & 0xFFFFFFFFFFFFFFFF for x in state.tolist())
        keep = _dropout.keep_mask(seed, offset, p, 1, 2, 128, 128, device="cuda")
        ref = lambda up: attention_ref(q, k, v, False, 0.125, upcast=up, dropout_keep=keep,  # noqa: E731
                                       dropout_scale=_dropout.dropout_scale(p))[0]
        ok, err, err_pt = within_tolerance(out, ref(True), ref(False))
        assert ok, f"out error {err:.3e} > 2 x PyTorch's {err_pt:.3e}"
        results.append((out.clone(), (seed, offset)))
    assert results[0][1] != results[1][1] and not torch.equal(results[0][0], results[1][0])
