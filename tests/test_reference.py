"""The reference and the padding helpers themselves (CPU, float64)."""

import math

import torch

import flash_attn2
from flash_attn2.testing import attention_ref, attention_ref_varlen, max_error, within_tolerance


def naive(q, k, v, causal, scale, window=(-1, -1)):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((b, h, sq), -math.inf, dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                left, right = window[0], 0 if causal else window[1]
                keys = [j for j in range(sk) if (right < 0 or j <= i + sk - sq + right) and
                        (left < 0 or j >= i + sk - sq - left)]
                if not keys:
                    continue
                s = torch.stack([(q[bi, i, hi] * k[bi, j, hi // (h // hk)]).sum() * scale for j in keys])
                p = torch.softmax(s, 0)
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                out[bi, i, hi] = sum(p[n] * v[bi, j, hi // (h // hk)] for n, j in enumerate(keys))
    return out, lse


def test_reference_matches_naive_bottom_right_causal():
    for sq, sk, causal in [(5, 7, True), (7, 5, True), (6, 6, False), (1, 4, True)]:
        q = torch.randn(2, sq, 4, 8, dtype=torch.float64)
        k = torch.randn(2, sk, 2, 8, dtype=torch.float64)
        v = torch.randn(2, sk, 2, 8, dtype=torch.float64)
        out, lse = attention_ref(q, k, v, causal, 0.5)
        out_n, lse_n = naive(q, k, v, causal, 0.5)
        torch.testing.assert_close(out, out_n)
        torch.testing.assert_close(lse, lse_n)
    # sq > sk, causal: the first sq - sk rows see no key -> 0 and -inf.
    out, lse = attention_ref(*(torch.randn(1, n, 1, 8, dtype=torch.float64) for n in (7, 5, 5)), causal=True)
    assert (out[0, :2] == 0).all() and (lse[0, 0, :2] == -math.inf).all() and lse[0, 0, 2:].isfinite().all()


def test_reference_alibi():
    """ALiBi's bias against a loop: -slope * |i + sk - sq - j|, or +slope * j when causal (the same output)."""
    q, k, v = (torch.randn(2, n, 4, 8, dtype=torch.float64) for n in (5, 7, 7))
    slopes = torch.rand(2, 4, dtype=torch.float64)
    for causal in (False, True):
        out, lse = attention_ref(q, k, v, causal, 0.5, alibi_slopes=slopes)
        scores = torch.einsum("bthd,bshd->bhts", q * 0.5, k)
        for b in range(2):
            for h in range(4):
                for i in range(5):
                    for j in range(7):
                        visible = not causal or j <= i + 2
                        bias = slopes[b, h] * j if causal else -slopes[b, h] * abs(i + 2 - j)
                        scores[b, h, i, j] = scores[b, h, i, j] + bias if visible else -math.inf
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
        torch.testing.assert_close(out, torch.einsum("bhts,bshd->bthd", torch.softmax(scores, -1), v))
    # The causal form shifts each row by a constant: the same output as the |i - j| form under a causal mask.
    out_abs, _ = attention_ref(q, k, v, True, 0.5, window=(100, 0), alibi_slopes=slopes)
    torch.testing.assert_close(attention_ref(q, k, v, True, 0.5, alibi_slopes=slopes)[0], out_abs)


def test_reference_matches_naive_window():
    """Sliding windows, bottom-right aligned, with and without causal; sq != sk both ways (rows that see no
    key among them)."""
    for sq, sk, causal, window in [(6, 9, False, (2, 1)), (9, 6, False, (0, 0)), (7, 7, True, (3, -1)),
                                   (5, 8, False, (-1, 2)), (8, 5, False, (1, -1)), (4, 4, False, (0, 5))]:
        q = torch.randn(2, sq, 4, 8, dtype=torch.float64)
        k = torch.randn(2, sk, 2, 8, dtype=torch.float64)
        v = torch.randn(2, sk, 2, 8, dtype=torch.float64)
        out, lse = attention_ref(q, k, v, causal, 0.5, window=window)
        out_n, lse_n = naive(q, k, v, causal, 0.5, window)
        torch.testing.assert_close(out, out_n)
        torch.testing.assert_close(lse, lse_n)


def test_varlen_reference_is_per_sequence():
    q = torch.randn(9, 2, 8, dtype=torch.float64)
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 3, 5, 6])
    out, lse = attention_ref_varlen(q, k, k, cu_q, cu_k, causal=True)
    assert out.shape == q.shape and lse.shape == (2, 9)
    o, l = attention_ref(q[None, 4:9], k[None, 5:6], k[None, 5:6], True)
    torch.testing.assert_close(out[4:9], o[0])
    torch.testing.assert_close(lse[:, 4:9], l[0])


def test_tolerance_rule_catches_nan_and_large_errors():
    ref = torch.randn(100)
    lowp = ref + 1e-3 * torch.randn(100)
    assert within_tolerance(ref + 1e-4, ref, lowp)[0]
    assert not within_tolerance(ref + 0.1, ref, lowp)[0]
    poisoned = ref.clone()
    poisoned[17] = math.nan
    assert max_error(poisoned, ref) == math.inf and not within_tolerance(poisoned, ref, lowp)[0]
    assert max_error(torch.tensor([-math.inf]), torch.tensor([-math.inf])) == 0.0


def test_unpad_pad_roundtrip():
    x = torch.randn(3, 5, 2, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    x_unpad, indices, cu, max_s, used = flash_attn2.unpad_input(x, mask)
    assert x_unpad.shape == (8, 2, 4) and cu.tolist() == [0, 3, 8, 8] and max_s == 5 and used.tolist() == [3, 5, 0]
    assert cu.dtype == torch.int32 and used.dtype == torch.int32
    back = flash_attn2.pad_input(x_unpad, indices, 3, 5)
    torch.testing.assert_close(back, x * mask[..., None, None])


def test_bert_padding_helpers_of_flash_attn():
    """flash-attn's other bert_padding helpers (transformers 4.x imports index_first_axis): gather and scatter on the
    first axis with their gradients, and the concatenated-sequences unpadding against its definition."""
    from flash_attn2.bert_padding import index_first_axis, index_put_first_axis, unpad_input_for_concatenated_sequences
    x = torch.randn(7, 3, 2, requires_grad=True)
    idx = torch.tensor([5, 0, 3])
    got = index_first_axis(x, idx)
    assert torch.equal(got, x.detach()[idx])
    (g,) = torch.autograd.grad(got, x, torch.ones_like(got))
    assert torch.equal(g.sum((1, 2)), torch.tensor([6.0, 0, 0, 6, 0, 6, 0]))
    v = torch.randn(3, 3, 2, requires_grad=True)
    put = index_put_first_axis(v, idx, 7)
    assert put.shape == (7, 3, 2) and torch.equal(put[idx], v.detach()) and torch.equal(put[[1, 2, 4, 6]],
                                                                                       torch.zeros(4, 3, 2))
    (gv,) = torch.autograd.grad(put, v, torch.ones_like(put))
    assert torch.equal(gv, torch.ones_like(v))
    # two rows: [a sequence of 2, one of 3] and [one of 4]; row length 6
    h = torch.randn(2, 6, 5)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]])
    packed, indices, cu, max_s = unpad_input_for_concatenated_sequences(h, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9] and cu.tolist() == [0, 2, 5, 9] and max_s == 4
    assert cu.dtype == torch.int32 and torch.equal(packed, h.reshape(12, 5)[indices])
