"""Learnable attention sinks (flash_attn2/_sinks.py): the rescaling of the kernels' out and LSE and the sink's
gradient against a reference whose softmax has the sink's column (CPU, float64), then flash_attn_func /
flash_attn_varlen_func / flash_attn_with_kvcache with sinks against the float32 reference under the 2x rule (GPU)."""

import math

import pytest
import torch

import flash_attn2
from flash_attn2._sinks import apply_sink, sink_grad
from flash_attn2.testing import attention_ref, attention_ref_varlen, max_error, within_tolerance


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(5, 9), (9, 5)])  # with causal, sq > sk leaves rows that see no key
def test_rescaling_and_sink_gradient(causal, seqlens):
    torch.manual_seed(0)
    sq, sk = seqlens
    q = torch.randn(2, sq, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, sk, 2, 8, dtype=torch.float64), torch.randn(2, sk, 2, 8, dtype=torch.float64)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal)  # the kernels' out and LSE, without the sink
    ours, ours_lse = apply_sink(out, lse, sink.detach(), varlen=False)
    ref, ref_lse = attention_ref(q, k, v, causal, sink=sink)
    assert torch.allclose(ours, ref, atol=1e-12) and torch.allclose(ours_lse, ref_lse, atol=1e-12)
    if causal and sq > sk:  # rows that see no key: out 0, lse = the sink
        assert torch.equal(ours[:, 0], torch.zeros_like(ours[:, 0]))
        assert torch.allclose(ours_lse[:, :, 0], sink.detach().view(1, 4).expand(2, 4))
    dout = torch.randn_like(ref)
    (ref_dsink,) = torch.autograd.grad(ref, sink, dout)
    assert torch.allclose(sink_grad(dout, ours, ours_lse, sink.detach(), varlen=False), ref_dsink, atol=1e-10)


def test_varlen_layout():
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 2, 8, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(2, dtype=torch.float64, requires_grad=True)
    out, lse = attention_ref_varlen(q, k, v, cu, cu, True)
    ours, ours_lse = apply_sink(out, lse, sink.detach(), varlen=True)
    ref, ref_lse = attention_ref_varlen(q, k, v, cu, cu, True, sink=sink)
    assert torch.allclose(ours, ref, atol=1e-12) and torch.allclose(ours_lse, ref_lse, atol=1e-12)
    dout = torch.randn_like(ref)
    (ref_dsink,) = torch.autograd.grad(ref, sink, dout)
    assert torch.allclose(sink_grad(dout, ours, ours_lse, sink.detach(), varlen=True), ref_dsink, atol=1e-10)


def test_argument_checks():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"learnable_sink must be \(nheads,\)"):
        flash_attn2.flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    with pytest.raises(TypeError, match="learnable_sink must be float32"):
        flash_attn2.flash_attn_func(q, q, q, s_aux=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        flash_attn2.flash_attn_func(q, q, q, learnable_sink=torch.zeros(2), s_aux=torch.zeros(2))


# ---- GPU ----

def _require(head_dim, dtype):
    if head_dim not in flash_attn2.compiled_head_dims(dtype):
        pytest.skip(f"head dim {head_dim} {dtype} not compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (63, 0), 0.0),
                                                   (False, (-1, -1), 30.0)])
@pytest.mark.parametrize("seqlens", [(1, 300), (257, 513), (513, 257)])
def test_flash_attn_func_with_sink(dtype, sink_dtype, causal, window, softcap, seqlens):
    """FA4's has_learnable_sink in its output test, and its sink backward dtype test: out, lse, dq, dk, dv, dsink."""
    _require(64, dtype)
    sq, sk = seqlens
    q = torch.randn(2, sq, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, sk, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    sink = (torch.randn(8, device="cuda") * 2).to(sink_dtype).requires_grad_()
    out, lse, _ = flash_attn2.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                              learnable_sink=sink, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    refs = []
    for upcast in (True, False):
        leaves = [t.detach().clone().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                  for t in (q, k, v, sink)]
        o, l = attention_ref(*leaves[:3], causal, upcast=upcast, window=window, softcap=softcap, sink=leaves[3])
        refs.append((o, l, *torch.autograd.grad(o, leaves, dout.float() if upcast else dout)))
    (ref, ref_lse, *ref_grads), (lowp, _, *lowp_grads) = refs
    ok, err, err_pt = within_tolerance(out, ref, lowp)
    assert ok, f"out error {err} vs PyTorch's {err_pt}"
    assert max_error(lse, ref_lse) <= 1e-3
    for name, g, r, p in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, lowp_grads):
        assert g.dtype == (sink_dtype if name == "dsink" else dtype)
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-3 if name == "dsink" else 1e-4)
        assert ok, f"{name} error {err} vs PyTorch's {err_pt}"


@pytest.mark.gpu
def test_varlen_sink_backward_with_lse():
    """FA4's varlen sink backward with LSE: empty sequences on either side."""
    _require(64, torch.bfloat16)
    lens_q, lens_k = [0, 17, 1, 300], [5, 0, 33, 300]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, device="cuda", requires_grad=True)
    out, lse, _ = flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=True, learnable_sink=sink,
                                                     return_attn_probs=True)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, sink)]
    ref, ref_lse = attention_ref_varlen(*leaves[:3], cu_q, cu_k, True, sink=leaves[3])
    assert max_error(out, ref) <= 2e-2 and max_error(lse, ref_lse) <= 1e-3
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v, sink), dout)
    r = torch.autograd.grad(ref, leaves, dout.float())
    for a, b in zip(g, r):
        assert max_error(a, b) <= 5e-2 * max(1.0, b.abs().max().item())


@pytest.mark.gpu
def test_kvcache_with_sink():
    _require(128, torch.bfloat16)
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(3, 500, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([0, 7, 500], dtype=torch.int32, device="cuda")
    sink = torch.randn(8, device="cuda")
    out, lse = flash_attn2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, s_aux=sink,
                                                   return_softmax_lse=True, num_splits=3)
    for b, n in enumerate((0, 7, 500)):
        ref, ref_lse = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], sink=sink)
        assert max_error(out[b:b + 1], ref) <= 2e-2 and max_error(lse[b:b + 1], ref_lse) <= 1e-3
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.allclose(lse[0, :, 0], sink)


def test_minus_inf_sink_on_a_row_with_no_key():
    """A -inf sink (no sink) on a row that sees no key: out 0, lse -inf, dsink 0, no NaN."""
    out = torch.zeros(1, 2, 1, 4)
    lse = torch.tensor([[[-math.inf, 0.5]]])
    sink = torch.tensor([-math.inf])
    o, l = apply_sink(out + 1.0, lse, sink, varlen=False)
    assert torch.equal(o[0, 0], torch.zeros(1, 4)) and l[0, 0, 0] == -math.inf and torch.isfinite(o).all()
    assert torch.isfinite(sink_grad(torch.ones_like(o), o, l, sink, varlen=False)).all()
