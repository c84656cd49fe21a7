"""flash_attn2 as PyTorch's SDPA flash backend (flash_attn2/integrations/torch_sdpa.py): the registry on CPU, and
on the GPU SDPA, varlen_attn and their backward against flash_attn2's direct calls and a float32 reference."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torch.nn.attention._registry", reason="torch >= 2.11 has the flash-attention registry")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention import _registry  # noqa: E402

import flash_attn2  # noqa: E402
from flash_attn2.integrations import torch_sdpa  # noqa: E402
from flash_attn2.testing import attention_ref, max_error, within_tolerance  # noqa: E402

OPS = [f"aten::{name}" for name in torch_sdpa._OPS]


def _cuda_kernel_is_python(op: str) -> bool:
    """Whether the op's CUDA kernel is the adapter's (the dispatch table names the file that registered it)."""
    return "torch_sdpa.py" in [line for line in torch._C._dispatch_dump_table(op).splitlines()
                               if line.startswith("CUDA:")][0]


@pytest.fixture
def active():
    _registry.activate_flash_attention_impl(torch_sdpa.NAME)
    yield
    _registry.restore_flash_attention_impl()


def test_registered_not_activated_on_import():
    assert torch_sdpa.NAME in _registry.list_flash_attention_impls()
    assert _registry.current_flash_attention_impl() != torch_sdpa.NAME
    assert not any(_cuda_kernel_is_python(op) for op in OPS)


def test_activate_and_restore(active):
    assert _registry.current_flash_attention_impl() == torch_sdpa.NAME
    assert all(_cuda_kernel_is_python(op) for op in OPS)
    _registry.restore_flash_attention_impl()
    assert not any(_cuda_kernel_is_python(op) for op in OPS)
    _registry.activate_flash_attention_impl(torch_sdpa.NAME)  # twice in a row: the first is restored first
    _registry.activate_flash_attention_impl(torch_sdpa.NAME)
    assert all(_cuda_kernel_is_python(op) for op in OPS)


def test_support_errors():
    q = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    assert "CUDA" in torch_sdpa.support_error(q, (q,))
    if torch.cuda.is_available():
        qc = q.cuda()
        assert "float16 / bfloat16" in torch_sdpa.support_error(qc.float(), (qc.float(),))
        assert "seqused_k" in torch_sdpa.support_error(qc, (qc,), seqused_k=torch.zeros(1))
        assert "return_debug_mask" in torch_sdpa.support_error(qc, (qc,), return_debug_mask=True)
        for scale in (0.0, -0.5, float("nan"), float("inf")):  # legal in SDPA: PyTorch's kernels serve them
            assert "scale" in torch_sdpa.support_error(qc, (qc,), scale=scale)
        assert torch_sdpa.support_error(qc, (qc,), scale=0.125) is None


def test_arguments_the_backward_loses_are_refused_under_grad():
    """seqused_k and alibi_slopes reach _flash_attention_forward but not its backward: refused where a gradient can be
    asked for (naming the argument), accepted for a forward-only call (CPU: the check runs before any kernel)."""
    q = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16, requires_grad=True)
    for name in ("seqused_k", "alibi_slopes"):
        args = {"seqused_k": None, "alibi_slopes": None, name: torch.zeros(2)}
        with pytest.raises(NotImplementedError, match=f"{name} with gradients"):
            torch_sdpa._check_no_lost_arguments(args["seqused_k"], args["alibi_slopes"], (q,))
        with torch.no_grad():
            torch_sdpa._check_no_lost_arguments(args["seqused_k"], args["alibi_slopes"], (q,))
        torch_sdpa._check_no_lost_arguments(args["seqused_k"], args["alibi_slopes"], (q.detach(),))


# ---- GPU ----

def _inputs(batch, heads, heads_k, seqlen_q, seqlen_k, d, dtype=torch.bfloat16, grad=True):
    q = torch.randn(batch, heads, seqlen_q, d, device="cuda", dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, heads_k, seqlen_k, d, device="cuda", dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, heads_k, seqlen_k, d, device="cuda", dtype=dtype, requires_grad=grad)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_k", [8, 2])
def test_sdpa_flash_matches_direct_and_reference(active, d, causal, heads_k):
    if d not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip(f"head dim {d} bf16 not compiled")
    # SDPA's flash backend takes is_causal only for equal lengths (and aligns it top-left): square when causal.
    seqlen_q, seqlen_k = (300, 300) if causal else (300, 517)
    q, k, v = _inputs(2, 8, heads_k, seqlen_q, seqlen_k, d)
    dout = torch.randn(2, 8, seqlen_q, d, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads_k != 8)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # flash_attn2 called directly on the (batch, seqlen, heads, d) views: the same kernels, bitwise
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    direct = flash_attn2.flash_attn_func(qt, kt, vt, causal=causal)
    direct_grads = torch.autograd.grad(direct, (qt, kt, vt), dout.transpose(1, 2))
    assert torch.equal(out, direct.transpose(1, 2))
    for g, dg in zip(grads, direct_grads):
        assert torch.allclose(g, dg.transpose(1, 2), atol=0, rtol=0) or max_error(g, dg.transpose(1, 2)) <= 1e-2
    ref, _ = attention_ref(qt.float(), kt.float(), vt.float(), causal)
    lowp, _ = attention_ref(qt.detach(), kt.detach(), vt.detach(), causal, upcast=False)
    ok, err, err_pt = within_tolerance(out.transpose(1, 2), ref, lowp)
    assert ok, f"error {err} vs PyTorch's {err_pt}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous_bhsd", "offset_base", "head_dim_40"])
def test_sdpa_layouts_in_place_or_copied(active, layout):
    """The override's C++ body (flash_api.cpp: sdpa_fwd / sdpa_bwd) on SDPA's (b, h, s, d) tensors: in place where
    the kernels can read them (a contiguous (b, h, s, d) tensor, read as a strided view; a head dim below its
    bucket, 40 on the d 64 kernels), through the op and a copy where they cannot (a base 2 bytes off 16; SDPA
    itself pads head dims to a multiple of 8): out and the gradients in their inputs' shapes, out in query's
    strides, equal to the direct call's on contiguous copies."""
    d = 40 if layout == "head_dim_40" else 64
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    if layout == "offset_base":  # every tensor starts one element into its storage: no 16-byte base
        q, k, v = (torch.randn(2 * 4 * 129 * d + 1, device="cuda", dtype=torch.bfloat16)[1:].view(2, 4, 129, d)
                   .requires_grad_() for _ in range(3))
    else:
        q, k, v = _inputs(2, 4, 4, 129, 129, d)
    dout = torch.randn(2, 4, 129, d, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    copies = [e.key for e in prof.key_averages() if "copy" in e.key.lower()]
    assert bool(copies) == (layout == "offset_base"), copies  # in place where the kernels can read the tensors
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride()
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    direct = flash_attn2.flash_attn_func(qt, kt, vt, causal=True)
    direct_grads = torch.autograd.grad(direct, (qt, kt, vt), dout.transpose(1, 2))
    assert torch.equal(out, direct.transpose(1, 2))
    for g, dg, t in zip(grads, direct_grads, (q, k, v)):
        assert g.shape == t.shape
        assert max_error(g, dg.transpose(1, 2)) <= 1e-2


@pytest.mark.gpu
def test_deterministic_backward_bitwise(active):
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    q, k, v = _inputs(2, 4, 4, 257, 257, 64)
    dout = torch.randn_like(q)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            runs.append(torch.autograd.grad(out, (q, k, v), dout))
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
def test_dropout_reproducible_and_backward_consistent(active):
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    q, k, v = _inputs(2, 4, 4, 128, 128, 64)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=0.3))
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(8)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        other = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert not torch.equal(outs[0], other)
    # The backward redraws the forward's mask from SDPA's rng_state: finite-difference-free check through the
    # direct call with the same seed.
    torch.manual_seed(7)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    direct = flash_attn2.flash_attn_func(qt, kt, vt, dropout_p=0.3)
    assert torch.equal(outs[0], direct.transpose(1, 2))
    dout = torch.randn_like(outs[0])
    g = torch.autograd.grad(outs[0], (q, k, v), dout)
    dg = torch.autograd.grad(direct, (qt, kt, vt), dout.transpose(1, 2))
    for a, b in zip(g, dg):
        assert max_error(a, b.transpose(1, 2)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (32, 0), (16, 16)])  # (-1, 0): causal
def test_varlen_attn_matches_direct(active, window):
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    from torch.nn.attention.varlen import varlen_attn
    lens = [17, 300, 1, 64]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window)
    direct = flash_attn2.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), window_size=window)
    assert max_error(out, direct) <= 1e-2 if not torch.equal(out, direct) else True
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    dg = torch.autograd.grad(direct, (q, k, v), dout)
    for a, b in zip(g, dg):
        assert max_error(a, b) <= 1e-2


@pytest.mark.gpu
def test_restore_gives_pytorch_kernels_back():
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    q, k, v = _inputs(1, 2, 2, 64, 64, 64, grad=False)
    _registry.activate_flash_attention_impl(torch_sdpa.NAME)
    _registry.restore_flash_attention_impl()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "flash_attn2" not in names
    _registry.activate_flash_attention_impl(torch_sdpa.NAME)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize()
    finally:
        _registry.restore_flash_attention_impl()
    names = " ".join(e.name for e in prof.events())
    assert "flash_attn2" in names and "pytorch_flash" not in names


@pytest.mark.gpu
def test_compile_and_graph_capture_under_activation(active):
    """torch.compile(fullgraph=True) of SDPA (inductor keeps the aten flash op, whose CUDA kernel is ours) and CUDA
    graph capture: the same results as eager."""
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    q, k, v = _inputs(2, 4, 4, 256, 256, 64, grad=False)

    def attn(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
    eager = attn(q, k, v)
    compiled = torch.compile(attn, fullgraph=True)(q, k, v)
    assert max_error(compiled, eager) <= 1e-2
    static = [t.clone() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attn(*static)
    for t, src in zip(static, (q, k, v)):
        t.copy_(src * 0.5)
    graph.replay()
    assert max_error(captured, attn(q * 0.5, k * 0.5, v * 0.5)) <= 1e-2


@pytest.mark.gpu
def test_hf_llama_on_sdpa_trains_like_flash_attn2(active):
    """A tiny Llama with attn_implementation="sdpa" and flash_attn2 activated as SDPA's flash backend: one training
    step's loss and gradients match the same model on attn_implementation="flash_attn2" (the same kernels)."""
    transformers = pytest.importorskip("transformers")
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    import copy
    import importlib
    importlib.import_module("flash_attn2.integrations.transformers")  # registers "flash_attn2" (an `import
    # flash_attn2.…` here would make flash_attn2 a local name, unbound at the head-dim check above)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=64, vocab_size=1000)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().to(torch.bfloat16)
    other = copy.deepcopy(model)
    other.set_attn_implementation("flash_attn2")
    ids = torch.randint(1000, (2, 128), device="cuda")
    results = []
    for m in (model, other):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.float().flatten() for p in m.parameters()])))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-3)
    assert max_error(results[0][1], results[1][1]) <= 1e-2 * results[1][1].abs().max().item()


@pytest.mark.gpu
def test_profiler_shows_flash_attn2_kernels(active):
    """Under the activated backend the profiler's CUDA kernels are flash_attn2's, forward and backward; none is
    PyTorch's own flash kernel (pytorch_flash::)."""
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    q, k, v = _inputs(2, 4, 4, 256, 256, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [n for n in names if "flash_attn2" in n]
    assert len(ours) >= 2, names  # a forward and a backward kernel at least
    assert not any("pytorch_flash" in n for n in names), names
