"""flash_attn_combine against FA3's reference (hopper/test_flash_attn.py: attention_combine_ref), on CPU and GPU."""

import pytest
import torch

from flash_attn2 import flash_attn_combine


def combine_ref(out_partial, lse_partial):
    lse = torch.logsumexp(lse_partial, dim=0)
    scale = torch.exp(lse_partial - lse)
    scale = torch.where(torch.isinf(scale) | torch.isnan(scale), torch.zeros_like(scale), scale)
    return (scale.unsqueeze(-1) * out_partial).sum(0), lse


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 17, 55, 133])
@pytest.mark.parametrize("seqlen,d", [(1, 64), (113, 128), (3, 256)])
def test_flash_attn_combine(device, dtype, num_splits, seqlen, d):
    """FA3's test grid (sampled): non-contiguous partials, the later half of the splits -inf for a third of the batch."""
    batch, nheads = 5, 16
    if device == "cpu" and num_splits * seqlen * d > 150_000:
        pytest.skip("the largest cases run on the GPU (CPU CI time and memory)")
    out_partial = torch.randn(num_splits * 2, batch, nheads, seqlen, d, device=device).transpose(2, 3)[:num_splits]
    lse_partial = torch.randn(num_splits, batch, nheads * 2, seqlen, device=device).transpose(-1, -2)[..., :nheads]
    lse_partial[num_splits // 2:, :batch // 3] = -torch.inf
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    out_ref, lse_ref = combine_ref(out_partial, lse_partial)
    assert torch.allclose(lse, lse_ref, atol=1e-5, rtol=1e-5)
    out_pt = out_ref.to(dtype)
    err, err_pt = (out.float() - out_ref).abs().max().item(), (out_pt.float() - out_ref).abs().max().item()
    assert err <= 2 * err_pt or torch.allclose(out.float(), out_pt.float(), atol=1e-5, rtol=1e-5)
    assert out.dtype == dtype and out.shape == (batch, seqlen, nheads, d)


def test_all_splits_empty_and_out_argument():
    out_partial = torch.randn(4, 2, 3, 2, 8)
    lse_partial = torch.full((4, 2, 3, 2), -torch.inf)
    lse_partial[:, 1] = torch.randn(4, 3, 2)
    out = torch.empty(2, 3, 2, 8, dtype=torch.bfloat16)
    got, lse = flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=torch.bfloat16)
    assert got is out and torch.equal(out[0].float(), torch.zeros(3, 2, 8)) and bool((lse[0] == -torch.inf).all())
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(out_partial=torch.zeros(2, 3, 4, 8, dtype=torch.float16)), TypeError, "out_partial must be float32"),
    (dict(lse_partial=torch.zeros(2, 3, 5)), ValueError, "lse_partial its shape without headdim"),
    (dict(out_partial=torch.zeros(257, 3, 4, 8), lse_partial=torch.zeros(257, 3, 4)), ValueError, "num_splits"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    (dict(out=torch.zeros(3, 4, 7)), ValueError, "out must be"),
])
def test_argument_errors(kwargs, error, match):
    args = dict(out_partial=torch.zeros(2, 3, 4, 8), lse_partial=torch.zeros(2, 3, 4))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        flash_attn_combine(**args)


def test_empty_splits_may_hold_nan():
    """FA3's combine skips splits with no key, whose partial output may be unwritten: NaN there never reaches out."""
    out_partial = torch.randn(3, 1, 2, 2, 8)
    lse_partial = torch.randn(3, 1, 2, 2)
    out_partial[1] = torch.nan
    lse_partial[1] = -torch.inf
    out, lse = flash_attn_combine(out_partial, lse_partial)
    ref, ref_lse = combine_ref(out_partial[[0, 2]], lse_partial[[0, 2]])
    assert torch.isfinite(out).all() and torch.allclose(out, ref) and torch.allclose(lse, ref_lse)
