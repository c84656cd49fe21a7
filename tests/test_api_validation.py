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


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5, float("nan"), "x", None])
def test_bad_dropout_p(dropout_p):
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        flash_attn2.flash_attn_func(*qkv(), dropout_p=dropout_p)


def test_extension_errors_format_numbers():
    """The extension's own checks, past the Python ones, raise with numbers in their messages: built with a
    compiler that has only a static libstdc++, they crashed the process here instead (setup.py now links
    torch's shared one)."""
    q = torch.randn(2, 16, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="q must have 4 dimensions, got 3"):
        flash_attn2._ops.ext.fwd_out(q, q, q, q.clone(), torch.empty(2, 16), None, None, 16, 16, 0.125, False, -1, -1,
                                     0.0, None, 0.0, None, False, None)


@pytest.mark.parametrize("slopes,error,match", [
    ([0.5] * 4, TypeError, "alibi_slopes must be a torch.Tensor, got list"),
    (torch.ones(4, dtype=torch.float16), TypeError, "alibi_slopes must be float32, got torch.float16"),
    (torch.ones(3), ValueError,
     r"alibi_slopes must be \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\), got shape \(3,\)"),
    (torch.ones(2, 8)[:, ::2], ValueError, "alibi_slopes must have a contiguous last dimension"),
])
def test_bad_alibi_slopes(slopes, error, match):
    with pytest.raises(error, match=match):
        flash_attn2.flash_attn_func(*qkv(), alibi_slopes=slopes)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf"), "x", None, 1e-46, 1e39, 10 ** 400])
def test_bad_softcap(softcap):
    """Values float32 would turn into 0 (softcap off) or inf are refused too."""
    with pytest.raises(ValueError, match=r"softcap must be 0 \(off\) or a positive finite float32"):
        flash_attn2.flash_attn_func(*qkv(), softcap=softcap)


@pytest.mark.parametrize("window_size", [(8,), (1, 2, 3), "ab", (None, 0), 5, (2.7, 0), (float("inf"), 0), {1, 2},
                                         ("3", "4"), torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3])])
def test_bad_window_size(window_size):
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        flash_attn2.flash_attn_func(*qkv(), window_size=window_size)


def test_window_size_as_an_int_tensor():
    """flash-attn's own tests pass torch.randint(0, seqlen_k, (2,)): a pair of ints as a tensor."""
    from flash_attn2.flash_attn_interface import _window
    assert _window(False, torch.tensor([3, 1]), 8, 8) == (False, 3, 1)
    assert _window(False, torch.tensor([-1, 0]), 8, 8) == (True, -1, 0)


def test_varlen_needs_cu_seqlens():
    """Both cu_seqlens None would make flash_attn_varlen_func a fixed-length call, its max_seqlen unread."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor, got NoneType"):
        flash_attn2.flash_attn_varlen_func(q, k, v, None, None, -5, "junk")


@pytest.mark.parametrize("call, args, match", [
    ("flash_attn_qkvpacked_func", lambda: (torch.randn(2, 16, 2, 4, 64, dtype=BF16),),
     r"qkv must be \(batch, seqlen, 3, nheads, headdim\), got shape \(2, 16, 2, 4, 64\)"),
    ("flash_attn_qkvpacked_func", lambda: (torch.randn(16, 3, 4, 64, dtype=BF16),),
     r"qkv must be \(batch, seqlen, 3, nheads, headdim\), got shape \(16, 3, 4, 64\)"),
    ("flash_attn_kvpacked_func", lambda: (qkv()[0], torch.randn(2, 16, 3, 4, 64, dtype=BF16)),
     r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)"),
    ("flash_attn_varlen_qkvpacked_func", lambda: (torch.randn(10, 2, 4, 64, dtype=BF16), varlen_args()[3], 6),
     r"qkv must be \(total, 3, nheads, headdim\)"),
    ("flash_attn_varlen_kvpacked_func", lambda: (varlen_args()[0], [1, 2], *varlen_args()[3:]),
     "kv must be a torch.Tensor, got list"),
])
def test_bad_packed_tensors(call, args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        getattr(flash_attn2, call)(*args())


def test_window_normalization_rules():
    """A side is dropped (-1) only where it reaches past every row's corner: left >= seqlen_k, right >= seqlen_q
    (bottom-right alignment: with seqlen_q > seqlen_k + 1 a right edge of seqlen_k still hides keys from the
    first rows, which flash-attn's right >= seqlen_k rule would show them)."""
    window = flash_attn2.flash_attn_interface._window
    assert window(False, (-1, 2), 8, 2) == (False, -1, 2)
    assert window(False, (-1, 8), 8, 2) == (False, -1, -1)
    assert window(False, (2, -1), 8, 2) == (False, -1, -1) and window(False, (1, 3), 8, 2) == (False, 1, 3)
    assert window(False, (-1, 0), 4, 4) == (True, -1, 0) and window(True, (9, 5), 4, 4) == (True, -1, 0)
    assert window(False, [3, 1], 4, 4) == (False, 3, 1)


def test_block_table_checks():
    """flash_attn_varlen_func(block_table=) is the paged path (tests/test_kvcache.py on the GPU): its arguments are
    checked before any GPU work, and what it lacks raises NotImplementedError naming it."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args()
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="q, k, v must be CUDA tensors"):  # every other check passed
        flash_attn2.flash_attn_varlen_func(q, k[None], v[None], cu_q, cu_k, max_q, max_k, block_table=table)
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with block_table"):
        flash_attn2.flash_attn_varlen_func(q, k[None], v[None], cu_q, cu_k, max_q, max_k, 0.1, block_table=table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        flash_attn2.flash_attn_varlen_func(q, k[None], v[None], cu_q, cu_k, max_q, max_k,
                                           block_table=table.long())
    with pytest.raises(NotImplementedError, match="seqused_k, scheduler_metadata and out are supported with block_table"):
        flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=torch.zeros(2, dtype=torch.int32))


# (make(device) -> q, k, v, exception, message). On CUDA tensors the op checks them in C++
# (csrc/flash_api.cpp check_inputs), elsewhere and at trace time Python does (flash_attn2/_checks.py).
TENSOR_CASES = [
    (lambda d: qkv(dtype=torch.float32, device=d), TypeError, "q must be float16 or bfloat16"),
    (lambda d: (*qkv(device=d)[:2], qkv(dtype=torch.float16, device=d)[2]), TypeError, "v must have q's dtype"),
    (lambda d: (qkv(device=d)[0][0], *qkv(device=d)[1:]), ValueError,
     r"q must be 4-D \(batch, seqlen, nheads, headdim\)"),
    (lambda d: (qkv(device=d)[0], *qkv(d=32, device=d)[1:]), ValueError, r"k's head dim must equal q's \(64\), got 32"),
    (lambda d: (qkv(device=d)[0][..., ::2], *qkv(d=32, device=d)[1:]), ValueError,
     "q must have a contiguous last dimension"),
    (lambda d: qkv(d=264, device=d), ValueError, r"head dim \(q.shape\[-1\]\) must be in 1..256"),
    (lambda d: qkv(d=0, device=d), ValueError, r"head dim \(q.shape\[-1\]\) must be in 1..256"),
    (lambda d: qkv(h=6, hk=4, device=d), ValueError,
     r"q's nheads \(6\) must be a positive multiple of k/v's nheads \(4\)"),
    (lambda d: (*qkv(device=d)[:2], qkv(sk=17, device=d)[2]), ValueError, "k and v must have the same shape"),
    (lambda d: qkv(b=0, device=d), ValueError, "batch size must be positive"),
    (lambda d: (qkv(b=3, device=d)[0], *qkv(device=d)[1:]), ValueError, r"k's batch size \(2\) must equal q's \(3\)"),
    (lambda d: (qkv(device=d)[0], "k", qkv(device=d)[2]), TypeError, "k must be a torch.Tensor"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(TENSOR_CASES)))
def test_bad_tensors(case, device):
    make, exc, match = TENSOR_CASES[case]
    with pytest.raises(exc, match=match):
        flash_attn2.flash_attn_func(*make(device))


def test_cpu_tensors_reach_the_device_check_last():
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        flash_attn2.flash_attn_func(*qkv())


@pytest.mark.parametrize("scale", [-1.0, 0.0, float("nan"), float("inf"), "x", [1.0], 1j, 1e-46, 1e39])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite float32"):
        flash_attn2.flash_attn_func(*qkv(), softmax_scale=scale)


# (edit(args, device), exception, message) on varlen_args(device).
VARLEN_CASES = [
    (lambda a, d: a.__setitem__(3, a[3].long()), TypeError, "cu_seqlens_q must be int32"),
    (lambda a, d: a.__setitem__(4, a[4][None]), ValueError, "cu_seqlens_k must be 1-D with batch \\+ 1 >= 2 entries"),
    (lambda a, d: a.__setitem__(3, a[3][:1]), ValueError, "cu_seqlens_q must be 1-D with batch \\+ 1 >= 2 entries"),
    (lambda a, d: a.__setitem__(4, torch.tensor([0, 4, 8, 10], dtype=torch.int32, device=d)), ValueError,
     "same length"),
    (lambda a, d: a.__setitem__(5, -1), ValueError, "max_seqlen_q must be an int"),
    (lambda a, d: a.__setitem__(6, 2.5), ValueError, "max_seqlen_k must be an int"),
    (lambda a, d: a.__setitem__(0, a[0][None]), ValueError, r"q must be 3-D \(total_tokens, nheads, headdim\)"),
    (lambda a, d: a.__setitem__(3, [0, 4, 10]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (lambda a, d: a.__setitem__(4, None), TypeError, "cu_seqlens_k must be a torch.Tensor, got NoneType"),
    (lambda a, d: a.__setitem__(3, torch.tensor([0, 0, 4, 0, 10, 0], dtype=torch.int32, device=d)[::2]), ValueError,
     r"cu_seqlens_q must be contiguous, got strides \(2,\)"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_bad_varlen_args(case, device):
    edit, exc, match = VARLEN_CASES[case]
    args = list(varlen_args(device))
    edit(args, device)
    with pytest.raises(exc, match=match):
        flash_attn2.flash_attn_varlen_func(*args)


@pytest.mark.gpu
def test_eager_checks_say_what_the_python_checks_say():
    """The C++ checks of CUDA tensors and the Python ones raise the same exception with the same message."""
    def error(call):
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        return type(info.value), str(info.value)

    for make, _, _ in TENSOR_CASES:
        cpu, cuda = (error(lambda d=d: flash_attn2.flash_attn_func(*make(d))) for d in ("cpu", "cuda"))
        assert cpu == cuda
    for edit, _, _ in VARLEN_CASES:
        results = []
        for d in ("cpu", "cuda"):
            args = list(varlen_args(d))
            edit(args, d)
            results.append(error(lambda: flash_attn2.flash_attn_varlen_func(*args)))
        assert results[0] == results[1]


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
                           "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *, "
                           "learnable_sink=None, s_aux=None",
        # flash-attn's names and order; cu_seqlens_k / max_seqlen_q / max_seqlen_k with defaults (vLLM's keyword
        # call omits cu_seqlens_k), then FA3's / vLLM's keywords
        "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, "
                                  "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                  "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, "
                                  "*, seqused_k=None, num_splits=0, learnable_sink=None, s_aux=None, "
                                  "scheduler_metadata=None, out=None, return_softmax_lse=False",
    }
    for name, params in expected.items():
        assert str(inspect.signature(getattr(flash_attn2, name))) == f"({params})"


@pytest.mark.gpu
def test_forward_backend_knob(monkeypatch):
    """FLASH_ATTN2_BACKEND picks the path per call; a path this build or GPU cannot serve raises
    NotImplementedError naming the knob, a bad value RuntimeError; every path computes the same output.
    Decode-shaped calls run the split-KV kernel, which both paths share, under any valid value."""
    dtype = torch.bfloat16 if flash_attn2.compiled_head_dims(torch.bfloat16) else torch.float16
    head_dim = flash_attn2.compiled_head_dims(dtype)[0]
    # 97 query rows: more than the split-KV kernel's 64-row tile, so the training kernels serve it
    q, k, v = (torch.randn(2, 97, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    default = flash_attn2.flash_attn_func(q, k, v, causal=True)
    decode_q = q[:, :1].contiguous()
    decode = flash_attn2.flash_attn_func(decode_q, k, v)
    monkeypatch.setenv("FLASH_ATTN2_BACKEND", "bogus")
    with pytest.raises(RuntimeError, match="FLASH_ATTN2_BACKEND must be sm80, sm90, auto or unset, got 'bogus'"):
        flash_attn2.flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="FLASH_ATTN2_BACKEND must be sm80, sm90, auto or unset, got 'bogus'"):
        flash_attn2.flash_attn_func(decode_q, k, v)
    for backend in ("sm80", "sm90"):  # the shared split-KV kernel: the same bits under either
        monkeypatch.setenv("FLASH_ATTN2_BACKEND", backend)
        assert torch.equal(flash_attn2.flash_attn_func(decode_q, k, v), decode)
    sm90_served = torch.cuda.get_device_capability() == (9, 0) and "sm_90a" in flash_attn2._ops.ext.built_archs.split(";")
    for backend in ("sm80", "sm90", "auto"):
        monkeypatch.setenv("FLASH_ATTN2_BACKEND", backend)
        if backend == "sm90" and not sm90_served:
            with pytest.raises(NotImplementedError, match="FLASH_ATTN2_BACKEND=sm90"):
                flash_attn2.flash_attn_func(q, k, v, causal=True)
            continue
        if backend == "sm80" and not flash_attn2._ops.ext.sm80_built:  # sm_90 builds without FLASH_ATTN2_SM80
            with pytest.raises(NotImplementedError, match=r"FLASH_ATTN2_BACKEND=sm80, .*FLASH_ATTN2_SM80=1"):
                flash_attn2.flash_attn_func(q, k, v, causal=True)
            monkeypatch.delenv("FLASH_ATTN2_BACKEND")
            out = flash_attn2.flash_attn_func(q.clone().requires_grad_(), k, v, causal=True)
            monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
            with pytest.raises(NotImplementedError, match=r"FLASH_ATTN2_BACKEND=sm80, .*FLASH_ATTN2_SM80=1"):
                out.sum().backward()
            continue
        out = flash_attn2.flash_attn_func(q, k, v, causal=True)
        torch.testing.assert_close(out, default, atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_head_dim_not_compiled():
    """A head dim whose bucket this build left out raises NotImplementedError naming it and the knob that
    adds it (the library's message, for forward and backward alike)."""
    from build_config import HEAD_DIMS  # tools/build_config.py
    missing = [(d, t) for t in (torch.bfloat16, torch.float16) for d in HEAD_DIMS  # no bucket >= d compiled
               if all(c < d for c in flash_attn2.compiled_head_dims(t))]
    if not missing:
        pytest.skip("every head-dim bucket is compiled (a reduced FLASH_ATTN2_HEAD_DIMS build exercises this)")
    head_dim, dtype = missing[0]
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    q, k, v = (torch.randn(1, 8, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    with pytest.raises(NotImplementedError, match=f"no forward kernel was compiled for head_dim {head_dim} and {name}; "
                                                  "rebuild with FLASH_ATTN2_HEAD_DIMS"):
        flash_attn2.flash_attn_func(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("sink,error", [(torch.zeros(4, dtype=torch.float64), TypeError), (torch.zeros(3), ValueError),
                                        (torch.zeros(2, 2), ValueError)])
def test_sink_checks_of_the_op_say_what_python_says(sink, error):
    """A bad learnable_sink given to the op directly (csrc/flash_api.cpp check_sink) raises what the wrappers' check
    (flash_attn2/_sinks.py) raises, with the same message."""
    from flash_attn2._sinks import check_sink
    q = torch.randn(1, 8, 4, 64, device="cuda", dtype=BF16)
    sink = sink.cuda()
    with pytest.raises(error) as python:
        check_sink(sink, 4, q)
    with pytest.raises(error) as op:
        flash_attn2._ops.fwd(q, q, q, None, None, 8, 8, 0.125, False, -1, -1, 0.0, None, False, 0.0, sink)
    assert str(op.value).splitlines()[0] == str(python.value)


def test_varlen_keywords_of_the_engines():
    """vLLM's keyword call binds without cu_seqlens_k (it passes seqused_k with block_table); without block_table each
    of cu_seqlens_k / max_seqlen_q / max_seqlen_k is required and a missing one is named; num_splits without
    block_table is refused, not ignored."""
    q, k, v, cu, cu_k, mq, mk = varlen_args()
    table = torch.zeros(2, 1, dtype=torch.int32)
    pages = torch.randn(1, 16, 4, 64, dtype=BF16)
    # binds (then fails on the CPU tensors, after the arguments are accepted)
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn2.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu, max_seqlen_q=mq,
                                           seqused_k=torch.tensor([4, 6], dtype=torch.int32), max_seqlen_k=16,
                                           block_table=table, num_splits=0, return_softmax_lse=True)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        flash_attn2.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu, block_table=table,
                                           seqused_k=torch.tensor([4, 6], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        flash_attn2.flash_attn_varlen_func(q, k, v, cu, max_seqlen_q=mq, max_seqlen_k=mk)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu_k, mq)
    with pytest.raises(NotImplementedError, match="num_splits"):
        flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu_k, mq, mk, num_splits=2)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_varlen_return_softmax_lse():
    """return_softmax_lse (FA3's and vLLM's keyword): (out, lse), the same tensors as return_attn_probs's first two."""
    q, k, v, cu, cu_k, mq, mk = (t.cuda() if isinstance(t, torch.Tensor) else t for t in varlen_args())
    out, lse = flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu_k, mq, mk, causal=True, return_softmax_lse=True)
    out2, lse2, _ = flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu_k, mq, mk, causal=True, return_attn_probs=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and lse.shape == (4, 10)


def test_paged_varlen_errors_name_the_callers_arguments():
    """flash_attn_varlen_func with block_table runs the kv-cache call: its argument errors name seqused_k and k / v,
    what the caller passed, not cache_seqlens and the caches."""
    q, _, _, cu, _, mq, _ = varlen_args()
    pages = torch.randn(1, 16, 4, 64, dtype=BF16)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"seqused_k must be int32") as info:
        flash_attn2.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu, max_seqlen_q=mq, block_table=table,
                                           seqused_k=torch.tensor([4, 6]))
    assert "cache_seqlens" not in str(info.value)
    with pytest.raises(ValueError, match=r"\bk and v must have the same shape") as info:
        flash_attn2.flash_attn_varlen_func(q, pages, pages[:, :8], cu_seqlens_q=cu, max_seqlen_q=mq,
                                           block_table=table, seqused_k=torch.tensor([4, 6], dtype=torch.int32))
    assert "k_cache" not in str(info.value)
