"""ring-flash-attn's packed forms (flash_attn2/distributed/packed.py): each splits qkv / kv into views of the packed
tensor and hands them, with every other argument in ring-flash-attn 0.1.8's order, to the unpacked function (checked
by recording the call); gradients reach the packed tensor through the views (a gloo run with the reference blocks:
packed equals unpacked bitwise, forward and backward). CPU."""

import inspect

import pytest
import torch
import torch.distributed as dist

from flash_attn2.distributed import packed
from flash_attn2.testing import run_ranks

FORMS = {  # packed function -> (unpacked function's name in packed.py, packing, varlen, leading extra args)
    "ring_flash_attn_qkvpacked_func": ("ring_flash_attn_func", "qkv", False, ()),
    "ring_flash_attn_kvpacked_func": ("ring_flash_attn_func", "kv", False, ()),
    "zigzag_ring_flash_attn_qkvpacked_func": ("zigzag_ring_flash_attn_func", "qkv", False, ()),
    "zigzag_ring_flash_attn_kvpacked_func": ("zigzag_ring_flash_attn_func", "kv", False, ()),
    "stripe_flash_attn_qkvpacked_func": ("stripe_flash_attn_func", "qkv", False, ()),
    "stripe_flash_attn_kvpacked_func": ("stripe_flash_attn_func", "kv", False, ()),
    "ring_flash_attn_varlen_qkvpacked_func": ("ring_flash_attn_varlen_func", "qkv", True, ("cu", 7)),
    "ring_flash_attn_varlen_kvpacked_func": ("ring_flash_attn_varlen_func", "kv", True, ("cu", 7)),
    "zigzag_ring_flash_attn_varlen_qkvpacked_func": ("zigzag_ring_flash_attn_varlen_func", "qkv", True, ("cu", 7)),
    "zigzag_ring_flash_attn_varlen_kvpacked_func": ("zigzag_ring_flash_attn_varlen_func", "kv", True, ("cu", 7)),
    "llama3_flash_attn_varlen_qkvpacked_func": ("llama3_flash_attn_varlen_func", "qkv", True,
                                                ("cu_q", "cu_k", 5, 6, 1, slice(0, 3))),
    "llama3_flash_attn_varlen_kvpacked_func": ("llama3_flash_attn_varlen_func", "kv", True,
                                               ("cu_q", "cu_k", 5, 6, 1, slice(0, 3))),
}
TAIL = (0.0, 0.25, True, (-1, -1), None, True, True, "group")  # dropout_p .. group, distinctive values


@pytest.mark.parametrize("name", sorted(FORMS))
def test_packed_forms_forward_views_and_arguments(name, monkeypatch):
    target, packing, varlen, extra = FORMS[name]
    calls = []
    monkeypatch.setattr(packed, target, lambda *args: calls.append(args) or "out")
    shape = (10, 3, 4, 8) if varlen else (2, 5, 3, 4, 8)
    dim = 1 if varlen else 2
    qkv = torch.randn(shape)
    q = torch.randn(shape[:dim] + shape[dim + 1:])
    kv = qkv.narrow(dim, 0, 2)
    args = (qkv,) if packing == "qkv" else (q, kv)
    assert getattr(packed, name)(*args, *extra, *TAIL) == "out"
    (got,) = calls
    views = list(qkv.unbind(dim)) if packing == "qkv" else [q, *kv.unbind(dim)]
    for mine, view in zip(got[:3], views):
        assert mine.data_ptr() == view.data_ptr() and mine.stride() == view.stride()  # views, no copies
    assert got[3:] == (*extra, *TAIL)
    # ring-flash-attn's keyword names and defaults, after the packed tensors and the extra arguments
    params = list(inspect.signature(getattr(packed, name)).parameters)
    assert params[-8:] == ["dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes", "deterministic",
                           "return_attn_probs", "group"]


def test_packed_shape_errors():
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, heads, d\)"):
        packed.ring_flash_attn_qkvpacked_func(torch.zeros(2, 4, 2, 3, 8))
    with pytest.raises(ValueError, match=r"kv must be \(total, 2, heads, d\)"):
        packed.ring_flash_attn_varlen_kvpacked_func(torch.zeros(4, 3, 8), torch.zeros(4, 3, 3, 8), None, 4)


def _worker(rank, world, store_path, results):
    from flash_attn2.distributed import ring
    ring._BACKENDS["kernel"] = ring.ReferenceBackend  # the reference blocks on the CPU
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        qkv = torch.randn(2, 4 * world, 3, 2, 8, dtype=torch.float64)
        local = ring.zigzag_shard(qkv, rank, world).requires_grad_()
        dout = torch.randn(2, 2 * world, 2, 8, dtype=torch.float64)
        out = packed.zigzag_ring_flash_attn_qkvpacked_func(local, causal=True)
        (grad,) = torch.autograd.grad(out, local, dout)
        leaves = [t.detach().clone().requires_grad_() for t in local.unbind(2)]
        ref = ring.zigzag_ring_flash_attn_func(*leaves, causal=True)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        results[rank] = torch.equal(out, ref) and torch.equal(grad, torch.stack(ref_grads, 2))
    finally:
        dist.destroy_process_group()


def test_qkvpacked_gradients_over_gloo():
    assert run_ranks(_worker, 2) == {0: True, 1: True}


def test_every_ring_flash_attn_function_is_here_with_its_arguments():
    """ring-flash-attn 0.1.8's public attention functions (its __init__, less the Hugging Face adapter), each with
    its parameter names in its order (read from 0.1.8's source), so that code switches by changing the import."""
    import flash_attn2.distributed as cp
    tail = ["dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes", "deterministic",
            "return_attn_probs", "group"]
    dense = {"": ["q", "k", "v"], "_kvpacked": ["q", "kv"], "_qkvpacked": ["qkv"]}
    expected = {"llama3_flash_attn_prepare_cu_seqlens": ["cu_seqlens", "causal", "rank", "world_size"]}
    for packing, head in dense.items():
        for base in ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn"):
            expected[f"{base}{packing}_func"] = head + tail
        for base in ("ring_flash_attn_varlen", "zigzag_ring_flash_attn_varlen"):
            expected[f"{base}{packing}_func"] = head + ["cu_seqlens", "max_seqlen"] + tail
        expected[f"llama3_flash_attn_varlen{packing}_func"] = head + [
            "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "heads_k_stride", "local_k_slice"] + tail
    for name, params in expected.items():
        assert hasattr(cp, name), name
        ours = [p for p in inspect.signature(getattr(cp, name)).parameters if not p.startswith("_")]
        assert ours == params, (name, ours)
