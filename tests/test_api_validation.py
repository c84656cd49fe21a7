"""Bad inputs raise clear errors naming the argument, before any GPU work (runs on CPU in CI)."""

import pytest
import torch

import flash_attn2

BF16 = torch.bfloat16


def qkv(b=2, sq=16, sk=16, h=4, hk=4, d=64, dtype=BF16, device="cpu"):
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    k = torch.randn(b, sk, hk, d, dtype=dtype, device=device)
    v = torch.randn(b, sk, hk, d, dtype=dtype, device=device)
    return q, k, v


def varlen_args(device="cpu"):
    q = torch.randn(10, 4, 64, dtype=BF16, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    return q, q.clone(), q.clone(), cu, cu.clone(), 6, 6


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(window_size=(8, 8)), "window_size"),
    (dict(window_size=(-1, 4)), "window_size"),
    (dict(window_size=(3, 0), causal=True), "window_size"),
])
def test_unsupported_options_raise_not_implemented(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        flash_attn2.flash_attn_func(*qkv(), **kwargs)


def test_block_table_not_implemented():
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn2.flash_attn_varlen_func(*varlen_args(), block_table=torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("make,exc,match", [
    (lambda: qkv(dtype=torch.float32), TypeError, "q must be float16 or bfloat16"),
    (lambda: (*qkv()[:2], qkv(dtype=torch.float16)[2]), TypeError, "v must have q's dtype"),
    (lambda: (qkv()[0][0], *qkv()[1:]), ValueError, r"q must be 4-D \(batch, seqlen, nheads, headdim\)"),
    (lambda: (qkv()[0], *qkv(d=32)[1:]), ValueError, r"k's head dim must equal q's \(64\), got 32"),
    (lambda: (qkv()[0][..., ::2], *qkv(d=32)[1:]), ValueError, "q must have a contiguous last dimension"),
    (lambda: qkv(d=264), ValueError, r"head dim \(q.shape\[-1\]\) must be in 1..256"),
    (lambda: qkv(h=6, hk=4), ValueError, r"q's nheads \(6\) must be a positive multiple of k/v's nheads \(4\)"),
    (lambda: (*qkv()[:2], qkv(sk=17)[2]), ValueError, "k and v must have the same shape"),
    (lambda: qkv(b=0), ValueError, "batch size must be positive"),
    (lambda: (qkv(b=3)[0], *qkv()[1:]), ValueError, r"k's batch size \(2\) must equal q's \(3\)"),
    (lambda: (qkv()[0], "k", qkv()[2]), TypeError, "k must be a torch.Tensor"),
    (lambda: qkv(), ValueError, "must be CUDA tensors"),
])
def test_bad_tensors(make, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn2.flash_attn_func(*make())


@pytest.mark.parametrize("scale", [-1.0, 0.0, float("nan"), float("inf")])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite float"):
        flash_attn2.flash_attn_func(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("edit,exc,match", [
    (lambda a: a.__setitem__(3, a[3].long()), TypeError, "cu_seqlens_q must be int32"),
    (lambda a: a.__setitem__(4, a[4][None]), ValueError, "cu_seqlens_k must be 1-D with batch \\+ 1 >= 2 entries"),
    (lambda a: a.__setitem__(3, a[3][:1]), ValueError, "cu_seqlens_q must be 1-D with batch \\+ 1 >= 2 entries"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 4, 8, 10], dtype=torch.int32)), ValueError, "same length"),
    (lambda a: a.__setitem__(5, -1), ValueError, "max_seqlen_q must be an int"),
    (lambda a: a.__setitem__(6, 2.5), ValueError, "max_seqlen_k must be an int"),
    (lambda a: a.__setitem__(0, a[0][None]), ValueError, r"q must be 3-D \(total_tokens, nheads, headdim\)"),
    (lambda a: a.__setitem__(3, [0, 4, 10]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
])
def test_bad_varlen_args(edit, exc, match):
    args = list(varlen_args())
    edit(args)
    with pytest.raises(exc, match=match):
        flash_attn2.flash_attn_varlen_func(*args)


@pytest.mark.parametrize("cu_q,cu_k,max_q,match", [
    ([0, 4, 3], [0, 4, 10], 6, r"cu_seqlens_q\[2\] = 3 is smaller than cu_seqlens_q\[1\] = 4"),
    ([0, 4, 10], [0, 5, 11], 6, r"cu_seqlens_k\[2\] = 11 must equal the packed length 10"),
    ([0, 4, 9], [0, 4, 10], 6, r"cu_seqlens_q\[2\] = 9 must equal the packed length 10"),
    ([0, 4, 10], [0, 4, 10], 5, r"sequence 1 has length 6 \(cu_seqlens_q\[2\] - cu_seqlens_q\[1\]\), more than max_seqlen_q = 5"),
    ([2, 4, 10], [0, 4, 10], 6, r"cu_seqlens_q\[0\] = 2, expected 0"),
])
def test_check_inputs_names_the_first_bad_entry(monkeypatch, cu_q, cu_k, max_q, match):
    """FLASH_ATTN2_CHECK_INPUTS=1 reads cu_seqlens back and names the first bad entry (off: not read)."""
    q, k, v, *_ = varlen_args()
    args = (q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), max_q, 6)
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        flash_attn2.flash_attn_varlen_func(*args)
    monkeypatch.setenv("FLASH_ATTN2_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match="FLASH_ATTN2_CHECK_INPUTS.*" + match):
        flash_attn2.flash_attn_varlen_func(*args)


def test_lengths_past_the_32_bit_limit():
    """Every block index stays in 32 bits: longer sequences and packed lengths get a clear error."""
    limit = flash_attn2.flash_attn_interface.MAX_SEQLEN
    row = torch.zeros(1, 1, 1, 8, dtype=BF16)
    long = row.expand(1, limit + 1, 1, 8)  # stride 0: no memory
    with pytest.raises(ValueError, match=r"seqlen_q and seqlen_k must be at most 2\*\*31-2\*\*16"):
        flash_attn2.flash_attn_func(long, row, row)
    packed = row[0].expand(limit + 1, 1, 8)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k.shape\[0\] \(total_k\) must be at most 2\*\*31-2\*\*16 packed rows"):
        flash_attn2.flash_attn_varlen_func(row[0], packed, packed, cu, cu, 1, 1)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int in 0..2\*\*31-2\*\*16"):
        flash_attn2.flash_attn_varlen_func(row[0], row[0], row[0], cu, cu, limit + 1, 1)


def test_varlen_reaches_the_device_check_last():
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        flash_attn2.flash_attn_varlen_func(*varlen_args())


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU for a mixed-device call")
def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k must be on q's device"):
        flash_attn2.flash_attn_func(q.cuda(), k, v.cuda())
    args = list(varlen_args("cuda"))
    args[3] = args[3].cpu()
    with pytest.raises(ValueError, match="cu_seqlens_q must be on q's device"):
        flash_attn2.flash_attn_varlen_func(*args)


def test_signatures_match_flash_attn():
    import inspect
    expected = {
        "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                           "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
        "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                                  "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                  "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None",
    }
    for name, params in expected.items():
        assert str(inspect.signature(getattr(flash_attn2, name))) == f"({params})"
