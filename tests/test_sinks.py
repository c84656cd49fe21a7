"""Learnable attention sinks (csrc/kernels/common/sink.h, flash_attn2/_sinks.py): the reference against the definition
(CPU, float64), then flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache with sinks against the float32
reference under the 2x rule, split-KV, -inf sinks, no keys, dsink's determinism (GPU)."""

import math

import pytest
import torch

import flash_attn2
from flash_attn2.testing import attention_ref, attention_ref_varlen, max_error, within_tolerance


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(5, 9), (9, 5)])  # with causal, sq > sk leaves rows that see no key
def test_reference_sink_is_a_value_free_column(causal, seqlens):
    """The GPU tests' reference (testing.attention_ref(sink=)) against the definition: softmax over the scores with one
    more column of logit sink_h whose value is 0; a row with no key gets out 0 and lse = the sink; the gradient of the
    sink is -sum exp(sink - lse) rowsum(dout o out), which the kernels compute from the backward's D."""
    torch.manual_seed(0)
    sq, sk = seqlens
    q = torch.randn(2, sq, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, sk, 2, 8, dtype=torch.float64), torch.randn(2, sk, 2, 8, dtype=torch.float64)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ref, ref_lse = attention_ref(q, k, v, causal, sink=sink)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(8)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
        scores = scores.masked_fill(~visible, -math.inf)
    scores = torch.cat([scores, sink.view(1, 4, 1, 1).expand(2, 4, sq, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :sk], vv)
    assert torch.allclose(ref, out, atol=1e-12)
    assert torch.allclose(ref_lse, torch.logsumexp(scores, dim=-1), atol=1e-12)
    if causal and sq > sk:  # rows that see no key: out 0, lse = the sink
        assert torch.equal(ref[:, 0], torch.zeros_like(ref[:, 0]))
        assert torch.allclose(ref_lse[:, :, 0], sink.detach().view(1, 4).expand(2, 4))
    dout = torch.randn_like(ref)
    (dsink,) = torch.autograd.grad(ref, sink, dout)
    d = (dout * ref).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    assert torch.allclose(dsink, -(torch.exp(sink.detach().view(1, 4, 1) - ref_lse) * d).sum((0, 2)), atol=1e-10)


def test_argument_checks():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"learnable_sink must be \(nheads,\)"):
        flash_attn2.flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    with pytest.raises(TypeError, match="learnable_sink must be float32"):
        flash_attn2.flash_attn_func(q, q, q, s_aux=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        flash_attn2.flash_attn_func(q, q, q, learnable_sink=torch.zeros(2), s_aux=torch.zeros(2))
    # the packed forms take the sink too and pass it on (their checks are flash_attn_func's / the varlen one's)
    qkv = torch.zeros(1, 4, 3, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"learnable_sink must be \(nheads,\)"):
        flash_attn2.flash_attn_qkvpacked_func(qkv, learnable_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="not both"):
        flash_attn2.flash_attn_kvpacked_func(q, qkv[:, :, :2], learnable_sink=torch.zeros(2), s_aux=torch.zeros(2))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"learnable_sink must be \(nheads,\)"):
        flash_attn2.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 4, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match=r"learnable_sink must be \(nheads,\)"):
        flash_attn2.flash_attn_varlen_kvpacked_func(q[0], qkv[0, :, :2], cu, cu, 4, 4, learnable_sink=torch.zeros(3))


# ---- GPU ----

def _require(head_dim, dtype):
    if head_dim not in flash_attn2.compiled_head_dims(dtype):
        pytest.skip(f"head dim {head_dim} {dtype} not compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16, torch.float16])
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
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert g.dtype == dtype
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"{name} error {err} vs PyTorch's {err_pt}"
    check_dsink(grads[3], ref_grads[3], lowp_grads[3], sink, ref_lse, dout, out)


def check_dsink(dsink, ref, lowp, sink, lse, dout, out):
    """dsink = -sum_rows exp(sink - lse) D, D = rowsum(dout o out) from the stored (fp16 / bf16) out, as every flash
    backward takes it: rounding out moves D by ~2^-9 relative over d terms, where PyTorch's bf16 autograd sums p dp
    over the keys, so this part of the error can exceed twice PyTorch's (3x at sk 513, d 64 on an H200). The bound
    is FA4's (check_dsink_vs_ref: 2x PyTorch's error + 2 ulps of the sink's dtype) plus that rounding's own effect,
    measured in float32; and dsink from the stored out is checked tightly."""
    assert dsink.dtype == sink.dtype
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (b, h, sq), from the stored out
    from_stored = -(torch.exp(sink.detach().float().view(1, -1, 1) - lse) * d).sum((0, 2))
    r = ref.detach().abs().to(sink.dtype)  # ulps of the sink's dtype
    ulp = (torch.nextafter(r, torch.full_like(r, math.inf)) - r).float()
    err, err_pt = (dsink.float() - ref.float()).abs(), (lowp.float() - ref.float()).abs().max()
    rounding = (from_stored - ref.float()).abs()
    assert torch.all(err <= 2 * err_pt + 2 * ulp + rounding + 1e-4), f"dsink error {err} vs PyTorch's {err_pt}, " \
        f"out's rounding {rounding}"
    tight = (dsink.float() - from_stored).abs()
    assert torch.all(tight <= 2e-3 * from_stored.abs() + 2 * ulp + 1e-4), f"dsink vs from the stored out: {tight}"


@pytest.mark.gpu
@pytest.mark.parametrize("sink_dtype", [None, torch.float32, torch.bfloat16, torch.float16])  # None: no sink
def test_flash_attn_varlen_learnable_sink_backward_with_lse(sink_dtype):
    """FA4's varlen sink backward with LSE: a loss through out and softmax_lse both (BwdParams::dlse: the backward's
    D less dLSE), empty sequences on either side; dq, dk, dv under the 2x rule, dsink against the float32 reference
    and tightly against its formula from the stored out, -sum exp(sink - lse) (rowsum(dout o out) - dlse)."""
    _require(64, torch.bfloat16)
    torch.manual_seed(0)
    lens_q, lens_k = [0, 17, 1, 300], [5, 0, 33, 300]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    inputs = [q, k, v]
    if sink_dtype is not None:
        inputs.append(torch.randn(4, device="cuda").to(sink_dtype).requires_grad_())
    sink = inputs[3] if sink_dtype is not None else None
    out, lse, _ = flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=True, learnable_sink=sink,
                                                     return_attn_probs=True)
    assert lse.requires_grad
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), inputs, (dout, dlse))
    refs = []
    for upcast in (True, False):
        leaves = [t.detach().clone().float() if upcast else t.detach().clone() for t in inputs]
        leaves = [t.requires_grad_() for t in leaves]
        o, l = attention_ref_varlen(*leaves[:3], cu_q, cu_k, True, upcast=upcast,
                                    sink=leaves[3] if sink is not None else None)
        refs.append((o, l, *torch.autograd.grad((o, l), leaves, (dout.float() if upcast else dout, dlse))))
    (ref, ref_lse, *ref_grads), (_, _, *lowp_grads) = refs
    assert max_error(lse, ref_lse) <= 1e-3
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"{name} error {err} vs PyTorch's {err_pt}"
    if sink is not None:
        dsink = grads[3]
        assert dsink.dtype == sink.dtype
        d = (dout.float() * out.float()).sum(-1).t() - dlse  # (heads, total_q): D less dLSE, from the stored out
        from_stored = -(torch.exp(sink.detach().float().view(-1, 1) - lse.detach()) * d).sum(1)
        r = ref_grads[3].detach().abs().to(sink.dtype)
        ulp = (torch.nextafter(r, torch.full_like(r, math.inf)) - r).float()
        err, err_pt = (dsink.float() - ref_grads[3]).abs(), (lowp_grads[3].float() - ref_grads[3]).abs().max()
        rounding = (from_stored - ref_grads[3]).abs()
        assert torch.all(err <= 2 * err_pt + 2 * ulp + rounding + 1e-4), f"dsink error {err} vs PyTorch's {err_pt}"
        tight = (dsink.float() - from_stored).abs()
        assert torch.all(tight <= 2e-3 * from_stored.abs() + 2 * ulp + 1e-4), f"dsink vs its formula: {tight}"


@pytest.mark.gpu
def test_loss_through_lse_alone():
    """A loss that uses softmax_lse but not out: the backward runs with dout zero (its node gets no out gradient) and
    gives lse's gradient, P dlse per score, against the float32 reference."""
    _require(64, torch.bfloat16)
    torch.manual_seed(1)
    q = torch.randn(2, 113, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 97, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    _, lse, _ = flash_attn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dlse = torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad(lse, (q, k, v), dlse, allow_unused=True)
    refs = []
    for upcast in (True, False):
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k)]
        _, ref_lse = attention_ref(*leaves, v.detach(), True, upcast=upcast)
        refs.append(torch.autograd.grad(ref_lse, leaves, dlse))
    assert dv is not None and torch.equal(dv, torch.zeros_like(dv))  # v takes no part in lse
    for name, g, r, p in zip(("dq", "dk"), (dq, dk), refs[0], refs[1]):
        ok, err, err_pt = within_tolerance(g, r, p, atol=1e-4)
        assert ok, f"{name} error {err} vs PyTorch's {err_pt}"


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
        one = (q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n])
        ref, ref_lse = attention_ref(*(t.float() for t in one), sink=sink)
        lowp = attention_ref(*one, upcast=False, sink=sink)[0]
        ok, err, err_pt = within_tolerance(out[b:b + 1], ref, lowp)
        assert ok and max_error(lse[b:b + 1], ref_lse) <= 1e-3, (b, err, err_pt)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.allclose(lse[0, :, 0], sink)



@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [1, 16])  # packed rows 4 (the narrow tile) and 64 (the 64-row tile)
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_split_kv_sink_enters_once(seqlen_q, num_splits):
    """Split-KV: the sink in the combine (num_splits 3, and 0's heuristic), or in the tile that writes out directly
    (1 split); the same answer as the reference each way, and a cache length 0 gives out 0, lse = the sink."""
    _require(128, torch.bfloat16)
    torch.manual_seed(seqlen_q + num_splits)
    q = torch.randn(3, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(3, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = (0, 33, 1000)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sink = torch.randn(8, device="cuda") * 3
    out, lse = flash_attn2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, learnable_sink=sink,
                                                   causal=True, return_softmax_lse=True, num_splits=num_splits)
    for b, n in enumerate(lens):
        one = (q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n])
        ref, ref_lse = attention_ref(*(t.float() for t in one), True, sink=sink)
        lowp = attention_ref(*one, True, upcast=False, sink=sink)[0]
        ok, err, err_pt = within_tolerance(out[b:b + 1], ref, lowp)
        assert ok and max_error(lse[b:b + 1], ref_lse) <= 1e-3, (b, n, err, err_pt)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.gpu
def test_minus_inf_sink_is_no_sink_and_dsink_is_repeatable():
    """A -inf sink gives the bits of a call without one (out, lse, dq, dk, dv) and dsink 0; and dsink (a fixed-order
    sum) is bitwise the same run to run."""
    _require(64, torch.bfloat16)
    torch.manual_seed(5)
    q = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    plain = flash_attn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, deterministic=True)
    plain_grads = torch.autograd.grad(plain[0], (q, k, v), dout)
    none = torch.full((4,), -math.inf, device="cuda", requires_grad=True)
    sunk = flash_attn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=none,
                                       deterministic=True)
    sunk_grads = torch.autograd.grad(sunk[0], (q, k, v, none), dout)
    assert torch.equal(plain[0], sunk[0]) and torch.equal(plain[1], sunk[1])
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, sunk_grads[:3]))
    assert torch.equal(sunk_grads[3], torch.zeros(4, device="cuda"))
    sink = torch.randn(4, device="cuda", requires_grad=True)
    runs = []
    for _ in range(2):
        out = flash_attn2.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v, sink), dout))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
def test_sink_with_no_keys_at_all():
    """k with no rows: out 0, lse = the sink, every gradient 0 (dsink too: D = rowsum(dout o 0))."""
    _require(64, torch.bfloat16)
    q = torch.randn(2, 5, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(4, device="cuda", requires_grad=True)
    out, lse, _ = flash_attn2.flash_attn_func(q, k, k, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sink.detach().view(1, 4, 1).expand(2, 4, 5))
    grads = torch.autograd.grad(out, (q, sink), torch.randn_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # a loss through lse too: lse is the sink on every row, so dsink_h sums dlse over the head's rows (dq still 0)
    dlse = torch.randn_like(lse)
    out, lse, _ = flash_attn2.flash_attn_func(q, k, k, learnable_sink=sink, return_attn_probs=True)
    dq, dsink = torch.autograd.grad((out, lse), (q, sink), (torch.randn_like(out), dlse))
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.allclose(dsink, dlse.sum((0, 2)), atol=1e-5)


@pytest.mark.gpu
def test_dropout_probabilities_leave_the_sink_out():
    """return_attn_probs with dropout and a sink: S_dmask's magnitudes are the softmax with the sink's column, without
    it: each row's probabilities sum to 1 - exp(sink - lse)."""
    _require(64, torch.bfloat16)
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 65, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sink = torch.randn(4, device="cuda") + 2.0
    _, lse, s_dmask = flash_attn2.flash_attn_func(q, k, v, dropout_p=0.2, learnable_sink=sink, return_attn_probs=True)
    row_sums = s_dmask.abs().float().sum(-1)  # (batch, heads, seqlen_q)
    torch.testing.assert_close(row_sums, 1 - torch.exp(sink.view(1, 4, 1) - lse), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_varlen_sink_without_keys_keeps_uncovered_rows_at_minus_inf():
    """k with no rows, varlen: rows inside the sequences get lse = the sink, rows outside every sequence -inf."""
    _require(64, torch.bfloat16)
    q = torch.randn(10, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(0, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([2, 5, 8], device="cuda", dtype=torch.int32)
    cu_k = torch.zeros(3, device="cuda", dtype=torch.int32)
    sink = torch.randn(4, device="cuda")
    out, lse, _ = flash_attn2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 0, learnable_sink=sink,
                                                     return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    expected = torch.full((4, 10), -math.inf, device="cuda")
    expected[:, 2:8] = sink.view(4, 1)
    assert torch.equal(lse, expected)


@pytest.mark.gpu
def test_one_autograd_node_with_the_sink_edge():
    """With a sink the output's grad_fn is still the one C++ node (no Python rescaling around it), with four edges."""
    _require(64, torch.bfloat16)
    q, k, v = (torch.randn(1, 33, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, device="cuda", requires_grad=True)
    out = flash_attn2.flash_attn_func(q, k, v, learnable_sink=sink)
    assert out.grad_fn.name() == "FlashAttnBackward" and len(out.grad_fn.next_functions) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_packed_forms_with_sink(varlen):
    """The qkv- and kv-packed forms pass learnable_sink / s_aux on: out, lse and every gradient (the sink's too) bitwise
    those of the unpacked call on the same tensors (deterministic=True: the backward's sums in a fixed order)."""
    _require(64, torch.bfloat16)
    torch.manual_seed(0)
    qkv = torch.randn(2, 97, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(4, device="cuda")
    dout = torch.randn(2, 97, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 97, 194], device="cuda", dtype=torch.int32)

    def run(packing):
        leaves = [qkv.clone().requires_grad_(), sink.clone().requires_grad_()]
        x, s = leaves
        flat = (lambda t: t.reshape(-1, *t.shape[2:])) if varlen else (lambda t: t)  # noqa: E731
        q, kv = flat(x[:, :, 0]), flat(x[:, :, 1:])
        if packing == "qkv":
            args = (flat(x), cu, 97) if varlen else (x,)
            fn = flash_attn2.flash_attn_varlen_qkvpacked_func if varlen else flash_attn2.flash_attn_qkvpacked_func
            out, lse, _ = fn(*args, causal=True, deterministic=True, return_attn_probs=True, s_aux=s)
        elif packing == "kv":
            args = (q, kv, cu, cu, 97, 97) if varlen else (q, kv)
            fn = flash_attn2.flash_attn_varlen_kvpacked_func if varlen else flash_attn2.flash_attn_kvpacked_func
            out, lse, _ = fn(*args, causal=True, deterministic=True, return_attn_probs=True, learnable_sink=s)
        else:
            k, v = kv.unbind(-3)
            args = (q, k, v, cu, cu, 97, 97) if varlen else (q, k, v)
            fn = flash_attn2.flash_attn_varlen_func if varlen else flash_attn2.flash_attn_func
            out, lse, _ = fn(*args, causal=True, deterministic=True, return_attn_probs=True, learnable_sink=s)
        return (out, lse, *torch.autograd.grad(out, leaves, flat(dout)))

    plain = run("none")
    for packing in ("qkv", "kv"):
        assert all(torch.equal(a, b) for a, b in zip(run(packing), plain)), packing
