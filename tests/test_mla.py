"""d_v != d_qk (MLA: DeepSeek-V3's d_qk 192 / d_v 128, and the other way round) through flash_attn_func and
flash_attn_varlen_func: forward and backward against the float32 reference (GPU); the padding rule on the CPU."""

import pytest
import torch

import flash_attn2
from flash_attn2.flash_attn_interface import _pad_value_head_dim
from flash_attn2.testing import attention_ref, within_tolerance


def mla_ref(q, k, v, causal, upcast=True):
    """Attention with v's own head dim, from attention_ref's scores (scale from q's head dim)."""
    scale = q.shape[-1] ** -0.5
    pad = max(q.shape[-1], v.shape[-1])
    f = lambda t: torch.nn.functional.pad(t, (0, pad - t.shape[-1]))  # noqa: E731
    out, lse = attention_ref(f(q), f(k), f(v), causal, scale, upcast=upcast)
    return out[..., :v.shape[-1]], lse


def test_padding_rule():
    q, k = torch.zeros(1, 4, 2, 192), torch.zeros(1, 6, 2, 192)
    _, _, vp, cut = _pad_value_head_dim(q, k, torch.zeros(1, 6, 2, 128))
    assert vp.shape[-1] == 192 and cut == 128
    qp, kp, vp, cut = _pad_value_head_dim(q[..., :64], k[..., :64], torch.zeros(1, 6, 2, 128))
    assert qp.shape[-1] == kp.shape[-1] == 128 and cut is None
    assert _pad_value_head_dim(q, k, torch.zeros(1, 5, 2, 128))[3] is None  # a shape error, left to the checks


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


def test_error_names_v_head_dim():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"v's head dim \(v.shape\[-1\]\) must be in 1..256, got 512"):
        flash_attn2.flash_attn_func(q, q, torch.zeros(1, 4, 2, 512, dtype=torch.bfloat16))
