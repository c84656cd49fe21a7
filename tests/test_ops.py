"""flash_attn2 as a torch op: opcheck, torch.compile (static and dynamic shapes, no graph breaks),
torch.export and CUDA graph capture, each against eager results (GPU); fake-tensor shapes and export on CPU."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn2
from flash_attn2 import _ops

from test_forward import randn, require_kernel, varlen_inputs

BF16 = torch.bfloat16
gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------------
# CPU: the fake implementations and export need no kernel.


@pytest.mark.parametrize("head_dim", [64, 59])
def test_fake_outputs_match_the_op_contract(head_dim):
    with FakeTensorMode():
        q = torch.empty(2, 8, 100, head_dim, device="cuda", dtype=BF16).transpose(1, 2)
        k = torch.empty(2, 8, 50, head_dim, device="cuda", dtype=BF16).transpose(1, 2)[:, :, :2]
        out, lse, rng_state = _ops.fwd(q, k, k, None, None, 100, 50, 0.1, True, -1, -1, 0.0, None, False)
        assert out.shape == q.shape and out.is_contiguous() and out.dtype == BF16
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert rng_state.shape == (0,) and rng_state.dtype == torch.int64
        assert _ops.fwd(q, k, k, None, None, 100, 50, 0.1, True, -1, -1, 0.0, None, False, 0.1)[2].shape == (2,)
        dq, dk, dv, dsink = _ops.bwd(out, q, k, k, out, lse, None, None, 100, 50, 0.1, True, -1, -1, 0.0, None, False)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dk.is_contiguous()
        assert dsink.shape == (0,) and dsink.dtype == torch.float32  # no sinks: empty
        sink = torch.empty(8, device="cuda", dtype=BF16)
        out_s, lse_s, _ = _ops.fwd(q, k, k, None, None, 100, 50, 0.1, True, -1, -1, 0.0, None, False, 0.0, sink)
        assert out_s.shape == q.shape and lse_s.shape == (2, 8, 100)
        dsink = _ops.bwd(out, q, k, k, out, lse, None, None, 100, 50, 0.1, True, -1, -1, 0.0, None, False, 0.0, None,
                         sink)[3]
        assert dsink.shape == (8,) and dsink.dtype == BF16  # in the sink's dtype
        with pytest.raises(ValueError, match="learnable_sink must be"):
            _ops.fwd(q, k, k, None, None, 100, 50, 0.1, True, -1, -1, 0.0, None, False, 0.0, sink[:4])
        # Gradients keep a dense input's strides where its head dim is a multiple of 8 (q, a transposed
        # view); k, a slice of heads, is not dense.
        assert dq.stride() == (q.stride() if head_dim % 8 == 0 else q.contiguous().stride())
        qv = torch.empty(300, 8, head_dim, device="cuda", dtype=BF16)
        cu = torch.empty(4, device="cuda", dtype=torch.int32)
        out, lse, _ = _ops.fwd(qv, qv[:, :4], qv[:, :4], cu, cu, 7, 7, 0.1, False, 3, 2, 0.0, None, False)
        assert out.shape == qv.shape and lse.shape == (8, 300)


def test_fake_gradients_of_a_dim_of_one_with_an_odd_stride():
    """A dense input whose dim of one carries a stride that is not a multiple of 8 (legal: it is never stepped
    along) gets contiguous gradients, as csrc/flash_api.cpp's grad_like gives them (run_bwd checks every stride)."""
    with FakeTensorMode():
        q = torch.empty(64 * 4 * 64, device="cuda", dtype=BF16).as_strided((1, 64, 4, 64), (3, 256, 64, 1))
        out, lse, _ = _ops.fwd(q, q, q, None, None, 64, 64, 0.1, True, -1, -1, 0.0, None, False)
        dq = _ops.bwd(out, q, q, q, out, lse, None, None, 64, 64, 0.1, True, -1, -1, 0.0, None, False)[0]
        assert dq.shape == q.shape and dq.is_contiguous()


@gpu
def test_dim_of_one_with_an_odd_stride_runs():
    """The same input on the GPU: copied for the kernels (aligned() wants every stride a multiple of 8, as run_fwd
    checks), where it used to raise "batch strides must be multiples of 8 elements"; gradients as the fake says."""
    require_kernel(64, BF16)
    q, k, v = (torch.randn(64 * 4 * 64, device="cuda", dtype=BF16).as_strided((1, 64, 4, 64), (3, 256, 64, 1))
               .requires_grad_() for _ in range(3))
    out = flash_attn2.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    ref = flash_attn2.flash_attn_func(*(t.detach().contiguous() for t in (q, k, v)), causal=True)
    assert torch.equal(out, ref) and dq.is_contiguous() and dq.shape == q.shape


def test_kvcache_fake_outputs():
    """flash_attn2::fwd_kvcache's fake: out in q's shape, lse (batch, nheads, seqlen_q), or (nheads, total_q) for
    varlen q against a paged cache; its checks run at trace time (a bad block table raises)."""
    with FakeTensorMode():
        q = torch.empty(3, 1, 8, 128, device="cuda", dtype=BF16)
        cache = torch.empty(3, 64, 2, 128, device="cuda", dtype=BF16)
        seqlens = torch.empty(3, device="cuda", dtype=torch.int32)
        out, lse = _ops.fwd_kvcache(q, cache, cache, None, None, None, None, seqlens, None, None, None, None, None, 0,
                                    0.1, True, -1, 0, 0.0, True, None, 0)
        assert out.shape == q.shape and lse.shape == (3, 8, 1) and lse.dtype == torch.float32
        qv = torch.empty(7, 8, 128, device="cuda", dtype=BF16)
        pages = torch.empty(10, 16, 2, 128, device="cuda", dtype=BF16)
        table = torch.empty(3, 4, device="cuda", dtype=torch.int32)
        cu = torch.empty(4, device="cuda", dtype=torch.int32)
        out, lse = _ops.fwd_kvcache(qv, pages, pages, None, None, None, None, seqlens, None, None, table, cu, None, 3,
                                    0.1, True, -1, 0, 0.0, True, None, 0)
        assert out.shape == qv.shape and lse.shape == (8, 7)
        with pytest.raises(TypeError, match="block_table must be int32"):
            _ops.fwd_kvcache(qv, pages, pages, None, None, None, None, seqlens, None, None, table.long(), cu, None, 3,
                             0.1, True, -1, 0, 0.0, True, None, 0)


def test_export_kvcache_decode_step():
    """torch.export of a decode step: one flash_attn2.fwd_kvcache node, the caches' mutation in the graph's
    signature."""
    class Decode(torch.nn.Module):
        def forward(self, q, k, v, k_cache, v_cache, seqlens):
            return flash_attn2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 64, device="cuda", dtype=BF16)
        k, v = (torch.empty(2, 1, 2, 64, device="cuda", dtype=BF16) for _ in range(2))
        k_cache, v_cache = (torch.empty(2, 32, 2, 64, device="cuda", dtype=BF16) for _ in range(2))
        seqlens = torch.empty(2, device="cuda", dtype=torch.int32)
    program = torch.export.export(Decode(), (q, k, v, k_cache, v_cache, seqlens))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert any("fwd_kvcache" in t for t in targets), targets


def test_export_on_fake_inputs():
    """torch.export sees one flash_attn2.fwd node; nothing on the traced path needs a real tensor."""
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flash_attn2.flash_attn_func(q, k, v, causal=True) * 2

    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, device="cuda", dtype=BF16)
        k, v = (torch.empty(2, 50, 2, 64, device="cuda", dtype=BF16) for _ in range(2))
    program = torch.export.export(Attention(), (q, k, v))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "flash_attn2.fwd.default" in targets


def test_export_with_learnable_sink_on_fake_inputs():
    """torch.export of attention with sinks: one flash_attn2.fwd node that takes the sink (no Python rescaling
    around it)."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sink = torch.nn.Parameter(torch.zeros(8, device="cuda"))

        def forward(self, q, k, v):
            return flash_attn2.flash_attn_func(q, k, v, causal=True, learnable_sink=self.sink)

    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, device="cuda", dtype=BF16)
        k, v = (torch.empty(2, 50, 2, 64, device="cuda", dtype=BF16) for _ in range(2))
        module = Attention()
    program = torch.export.export(module, (q, k, v))
    nodes = [n for n in program.graph.nodes if n.op == "call_function" and "flash_attn2.fwd" in str(n.target)]
    assert len(nodes) == 1 and len(nodes[0].args) == 16, [n.args for n in nodes]


# ----------------------------------------------------------------------------------------------------
# GPU: opcheck runs the op eagerly, under FakeTensor and through AOTAutograd, and compares.


def op_cases():
    """(name, fwd args) covering fixed-length, varlen, causal, GQA and odd head dims."""
    cases = []
    for head_dim in (64, 40, 59):
        for causal in (False, True):
            q = randn(2, 65, 4, head_dim, dtype=BF16)
            k, v = (randn(2, 47, 2, head_dim, dtype=BF16) for _ in range(2))
            cases.append((f"fixed-d{head_dim}-causal{causal}",
                          (q, k, v, None, None, 65, 47, 0.2, causal, -1, -1, 0.0, None, False)))
        cu_q, cu_k, q, k, v = varlen_inputs([17, 0, 40], [30, 5, 40], 4, 2, head_dim, BF16)
        cases.append((f"varlen-d{head_dim}", (q, k, v, cu_q, cu_k, 40, 40, 0.2, True, 9, -1, 0.0, None, True)))
    # (b, h, s, d) memory viewed as (b, s, h, d), as models hand it over: gradients in those strides.
    q = randn(2, 4, 65, 64, dtype=BF16).transpose(1, 2)
    k, v = (randn(2, 2, 47, 64, dtype=BF16).transpose(1, 2) for _ in range(2))
    cases.append(("transposed-d64", (q, k, v, None, None, 65, 47, 0.2, True, -1, -1, 0.0, None, False)))
    q = randn(2, 65, 4, 64, dtype=BF16)
    k, v = (randn(2, 47, 2, 64, dtype=BF16) for _ in range(2))
    cases.append(("window-softcap-d64", (q, k, v, None, None, 65, 47, 0.2, False, 16, 5, 3.0, None, False)))
    slopes = torch.rand(2, 4, device="cuda")
    cases.append(("alibi-d64", (q, k, v, None, None, 65, 47, 0.2, True, -1, -1, 0.0, slopes, False)))
    return cases


@gpu
@pytest.mark.parametrize("case", range(12))
def test_opcheck(case):
    name, args = op_cases()[case]
    require_kernel(args[0].shape[-1], BF16)
    q, k, v = (t.requires_grad_() for t in args[:3])
    torch.library.opcheck(_ops.fwd, (q, k, v, *args[3:]))
    out, lse, _ = _ops.fwd(*args)
    dout = torch.randn_like(out)
    torch.library.opcheck(_ops.bwd, (dout, *(t.detach() for t in (q, k, v, out, lse)), *args[3:]))


@gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_learnable_sink(varlen):
    """learnable_sink through fwd (differentiable: opcheck's autograd checks include dsink) and bwd's fourth output."""
    require_kernel(64, BF16)
    if varlen:
        cu_q, cu_k, q, k, v = varlen_inputs([17, 0, 40], [30, 5, 40], 4, 2, 64, BF16)
        args = (cu_q, cu_k, 40, 40, 0.2, True, -1, -1, 0.0, None, False)
    else:
        q = randn(2, 65, 4, 64, dtype=BF16)
        k, v = (randn(2, 47, 2, 64, dtype=BF16) for _ in range(2))
        args = (None, None, 65, 47, 0.2, True, -1, -1, 0.0, None, False)
    sink = torch.randn(4, device="cuda", dtype=torch.float32, requires_grad=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(_ops.fwd, (q, k, v, *args, 0.0, sink))
    out, lse, _ = _ops.fwd(q, k, v, *args, 0.0, sink)
    dout = torch.randn_like(out)
    torch.library.opcheck(_ops.bwd, (dout, *(t.detach() for t in (q, k, v, out, lse)), *args, 0.0, None,
                                     sink.detach()))


@gpu
@pytest.mark.parametrize("head_dim", [64, 59])
@pytest.mark.parametrize("append", [False, True])
def test_opcheck_kvcache(head_dim, append):
    """flash_attn2::fwd_kvcache: its schema's mutation of k_cache / v_cache (with new k / v) and its fake agree with
    the kernel (opcheck runs it eagerly, under FakeTensor and through AOTAutograd)."""
    require_kernel(head_dim, BF16)
    q = randn(2, 1, 4, head_dim, dtype=BF16)
    k_cache, v_cache = (randn(2, 64, 2, head_dim, dtype=BF16) for _ in range(2))
    k, v = (randn(2, 1, 2, head_dim, dtype=BF16) if append else None for _ in range(2))
    seqlens = torch.tensor([5, 63], dtype=torch.int32, device="cuda")
    angle = torch.rand(64, 16, device="cuda")
    cos, sin = (angle.cos().to(BF16), angle.sin().to(BF16)) if append else (None, None)
    torch.library.opcheck(_ops.fwd_kvcache, (q, k_cache, v_cache, k, v, cos, sin, seqlens, None, None, None, None, None,
                                             0, 0.125, True, -1, 0, 0.0, False, None, 0))


@gpu
def test_opcheck_kvcache_varlen_paged():
    """The op's varlen-q form against a paged cache (SGLang's / vLLM's calls): lse (nheads, total_q)."""
    require_kernel(64, BF16)
    q = randn(7, 4, 64, dtype=BF16)
    k_pages, v_pages = (randn(6, 16, 2, 64, dtype=BF16) for _ in range(2))
    table = torch.tensor([[0, 3], [5, 1], [2, 4]], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 1, 4, 7], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([20, 3, 32], dtype=torch.int32, device="cuda")
    torch.library.opcheck(_ops.fwd_kvcache, (q, k_pages, v_pages, None, None, None, None, seqlens, None, None, table,
                                             cu_q, None, 3, 0.125, True, -1, 0, 0.0, True, None, 0))


def dense(batch, seqlen_q, seqlen_k, heads=4, heads_k=2, head_dim=64):
    q = randn(batch, seqlen_q, heads, head_dim, dtype=BF16)
    k, v = (randn(batch, seqlen_k, heads_k, head_dim, dtype=BF16) for _ in range(2))
    return q, k, v


def fixed_calls():
    """(public function, input builder) for the fixed-length API; the packed variants take one tensor."""
    return {
        "flash_attn_func": (lambda q, k, v: flash_attn2.flash_attn_func(q, k, v, causal=True, deterministic=True),
                            lambda b, sq, sk: dense(b, sq, sk)),
        "flash_attn_kvpacked_func": (
            lambda q, kv: flash_attn2.flash_attn_kvpacked_func(q, kv, causal=True, deterministic=True),
            lambda b, sq, sk: (dense(b, sq, sk)[0], torch.stack(dense(b, sq, sk)[1:], dim=2))),
        "flash_attn_qkvpacked_func": (
            lambda qkv: flash_attn2.flash_attn_qkvpacked_func(qkv, deterministic=True),
            lambda b, sq, sk: (torch.stack(dense(b, sq, sq, 4, 4), dim=2),)),
        "flash_attn_func_learnable_sink": (  # the sink a leaf too: dsink through the compiled graph
            lambda q, k, v, sink: flash_attn2.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                              learnable_sink=sink),
            lambda b, sq, sk: (*dense(b, sq, sk), torch.randn(4, device="cuda"))),  # (heads,): dense's 4
    }


def varlen_calls():
    def inputs(lens_q, lens_k):
        cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, 4, 2, 64, BF16)
        return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)

    def self_inputs(lens_q, lens_k):  # qkv-packed: one cu_seqlens
        q, k, v, cu_q, cu_k, max_q, max_k = inputs(lens_q, lens_q)
        return torch.stack((q, *(t.repeat_interleave(2, dim=1) for t in (k, v))), dim=1), cu_q, max_q

    return {
        "flash_attn_varlen_func": (
            lambda q, k, v, cu_q, cu_k, mq, mk: flash_attn2.flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, mq, mk, causal=True, deterministic=True), inputs),
        "flash_attn_varlen_kvpacked_func": (
            lambda q, k, v, cu_q, cu_k, mq, mk: flash_attn2.flash_attn_varlen_kvpacked_func(
                q, torch.stack((k, v), dim=1), cu_q, cu_k, mq, mk, deterministic=True), inputs),
        "flash_attn_varlen_qkvpacked_func": (
            lambda qkv, cu, m: flash_attn2.flash_attn_varlen_qkvpacked_func(qkv, cu, m, causal=True,
                                                                             deterministic=True), self_inputs),
    }


def eager_and_compiled(fn, compiled, args):
    """Forward outputs and input gradients of fn and of its compiled version on the same inputs."""
    results = []
    for f in (fn, compiled):
        leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                  for a in args]
        out = f(*leaves)
        dout = torch.ones_like(out) * 0.5 + torch.arange(out.shape[-1], device=out.device, dtype=out.dtype) / 64
        grads = torch.autograd.grad(out, [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad], dout)
        results.append((out, *grads))
    return results


def check_compiled(fn, build, shapes, dynamic):
    """fullgraph compile (a graph break raises), bitwise equal to eager (deterministic backward), and with
    dynamic=True one compilation for every shape."""
    # The count is about this compile: a worker's earlier compiles of the same code objects (the other
    # parametrizations' lambdas) leave dynamo state behind, so dynamo is reset first (TUNING 202). From a fresh
    # state dynamic=True duck-sizes: two sizes equal in the first shape (batch 2 and nheads_k 2, max_seqlen_q ==
    # max_seqlen_k, batch + 1 == nheads 4) share one symbol, and the next shape that tells them apart recompiles
    # (TUNING 206). So each test's first shape has every size distinct from the others and none is 0 or 1.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=dynamic)
    for shape in shapes:
        eager, ours = eager_and_compiled(fn, compiled, build(*shape))
        for a, b in zip(eager, ours):
            assert torch.equal(a, b), f"compiled result differs from eager at {shape}"
    if dynamic:
        assert counter.frame_count == 1, f"{counter.frame_count} compilations for {len(shapes)} shapes"


@gpu
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", sorted(fixed_calls()))
def test_compile_fixed_length(name, dynamic):
    require_kernel(64, BF16)
    fn, build = fixed_calls()[name]
    check_compiled(fn, build, [(5, 128, 97), (3, 200, 250), (2, 77, 300)], dynamic)  # 5: not 2, 3, 4, 64


@gpu
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", sorted(varlen_calls()))
def test_compile_varlen(name, dynamic):
    require_kernel(64, BF16)
    fn, build = varlen_calls()[name]
    # The first shape: 4 sequences (cu_seqlens of 5: not 2, 3 or 4), max_seqlen_q 40 != max_seqlen_k 41.
    shapes = [([17, 0, 40, 9], [30, 5, 41, 12]), ([100, 3], [64, 90]), ([33, 2, 9, 120], [7, 50, 9, 2])]
    check_compiled(fn, build, shapes, dynamic)


@gpu
def test_export_and_run():
    require_kernel(64, BF16)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, cu_q, cu_k):
            return flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True).float().square()

    cu_q, cu_k, q, k, v = varlen_inputs([17, 0, 40], [30, 5, 40], 4, 2, 64, BF16)
    total = torch.export.Dim("total_q", min=2, max=2**20)
    shapes = {"q": {0: total}, "k": None, "v": None, "cu_q": None, "cu_k": None}
    program = torch.export.export(Attention(), (q, k, v, cu_q, cu_k), dynamic_shapes=shapes)
    assert "flash_attn2.fwd.default" in [str(n.target) for n in program.graph.nodes]
    assert torch.equal(program.module()(q, k, v, cu_q, cu_k), Attention()(q, k, v, cu_q, cu_k))
    cu_q2 = torch.tensor([0, 20, 20, 50], device="cuda", dtype=torch.int32)
    q2 = randn(50, 4, 64, dtype=BF16)
    assert torch.equal(program.module()(q2, k, v, cu_q2, cu_k), Attention()(q2, k, v, cu_q2, cu_k))


def capture(fn, static_inputs):
    """Captures fn(*static_inputs) -> (out, grads) in a CUDA graph after a warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = fn(*static_inputs)
    return graph, static_outputs


@gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_graph_forward_and_backward(varlen):
    """Capture forward + backward once, replay on new values (varlen: new sequence lengths under the same
    max_seqlen hint, even lengths above it), compare with eager."""
    require_kernel(64, BF16)
    heads, heads_k, d = 4, 2, 64

    def step(q, k, v, dout, cu_q, cu_k):
        if varlen:
            out = flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 96, 96, causal=True, deterministic=True)
        else:
            out = flash_attn2.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    def inputs(lens_q, lens_k):
        if varlen:
            cu_q, cu_k, q, k, v = varlen_inputs(lens_q, lens_k, heads, heads // heads_k, d, BF16)
        else:
            (q, k, v), cu_q, cu_k = dense(2, 150, 190, heads, heads_k, d), None, None
        return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), torch.randn_like(q), cu_q, cu_k]

    static = inputs([50, 96, 4], [60, 90, 50])
    graph, static_out = capture(step, static)
    for lens_q, lens_k in (([96, 10, 44], [20, 120, 60]), ([1, 1, 148], [70, 70, 60])):
        fresh = inputs(lens_q, lens_k)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                if s is not None:
                    s.copy_(f)
        graph.replay()
        expected = step(*fresh)
        for a, b in zip(static_out, expected):
            assert torch.equal(a, b)
