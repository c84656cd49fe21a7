"""attn_implementation="flash_attn2" in Hugging Face transformers (flash_attn2.integrations.transformers).

Each model test runs twice. On CPU the two kernels the integration calls are swapped for float32 reference
attention (after the real API's argument checks), so the integration's own logic is checked: the mask
hook, unpad -> varlen -> pad, position_ids -> cu_seqlens, float32 -> bf16 casts, gradients through all of
it. On CUDA (gpu mark) the real kernels run. Both compare a tiny randomly initialised Llama (GQA) against
sdpa from the same weights, with the repository's rule: our error against an fp32 sdpa run must be at most
twice sdpa-bf16's error against it, plus a small absolute term.
"""

import copy
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed (pip install transformers)")

from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, StaticCache  # noqa: E402
from transformers import modeling_flash_attention_utils as hf_flash_utils  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import flash_attn2  # noqa: E402
from flash_attn2.integrations import transformers as integration  # noqa: E402
from flash_attn2.flash_attn_interface import _window  # noqa: E402
from flash_attn2.testing import attention_ref, attention_ref_varlen, max_error  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "flash_attn2"
CPU_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128)
GPU_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, vocab_size=1000)
# Logits are O(1) (bf16 spacing near 1: 2^-7), losses ~ln(vocab): 5-7. Measured (H100, 12 seeds; CPU reference):
# our errors 1e-3-1e-2 on logits, <= 1.3e-3 on losses (bf16 noise, as large as sdpa-bf16's), while a padding mask
# left out put logits off by 0.6, and detaching the attention output (no gradient into q/k/v) put losses off by
# 6e-3 (CPU) to 4e-2 (H100).
LOGITS_ATOL, LOSS_ATOL = 1e-3, 2e-3


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    """Where the model runs, its dtype, and the kernel calls the integration made: (kind, q dtype, cu_seqlens_q).

    CPU: a float32 model (the integration casts q/k/v to bf16) and reference kernels. CUDA: bf16, real kernels.
    """
    cuda = request.param == "cuda"
    if cuda and 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled (FLASH_ATTN2_HEAD_DIMS / FLASH_ATTN2_DTYPES)")
    calls = []

    def dense(q, k, v, **kwargs):
        calls.append(("dense", q.dtype, None))
        if cuda:
            return flash_attn2.flash_attn_func(q, k, v, **kwargs)
        with pytest.raises(ValueError, match="CUDA tensors"):  # every argument check but the device's passes
            flash_attn2.flash_attn_func(q, k, v, **kwargs)
        causal, window = reference_mask(kwargs, q.shape[1], k.shape[1])
        return attention_ref(q, k, v, causal, kwargs["softmax_scale"], window=window, softcap=kwargs["softcap"],
                             sink=kwargs.get("learnable_sink"))[0]

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append(("varlen", q.dtype, cu_q.tolist()))
        if cuda:
            return flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        with pytest.raises(ValueError, match="CUDA tensors"):
            flash_attn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        assert (max_q, max_k) == (int(cu_q.diff().max()), int(cu_k.diff().max()))
        causal, window = reference_mask(kwargs, max_q, max_k)
        return attention_ref_varlen(q, k, v, cu_q, cu_k, causal, kwargs["softmax_scale"], window=window,
                                    softcap=kwargs["softcap"], sink=kwargs.get("learnable_sink"))[0]

    monkeypatch.setattr(integration, "flash_attn_func", dense)
    monkeypatch.setattr(integration, "flash_attn_varlen_func", varlen)
    return SimpleNamespace(device=request.param, dtype=torch.bfloat16 if cuda else torch.float32,
                           config=GPU_CONFIG if cuda else CPU_CONFIG, seq_len=100 if cuda else 16, calls=calls)


@pytest.fixture
def looked(monkeypatch):
    """(batch, seq_len) of each look for packed sequences (a device sync) the integration makes."""
    calls = []
    find = integration._find_packing
    monkeypatch.setattr(integration, "_find_packing", lambda *args: calls.append(args[1:]) or find(*args))
    return calls


def reference_mask(kwargs, seqlen_q, seqlen_k):
    """(causal, window) for the reference from the kernel call's arguments, by flash-attn's window rules."""
    causal, left, right = _window(kwargs["causal"], kwargs.get("window_size", (-1, -1)), seqlen_q, seqlen_k)
    return causal, (left, right)


def tiny_llama(backend, config_class=LlamaConfig, reference="sdpa", **config):
    """Model under test (flash_attn2), an fp32 copy (the reference) and a bf16 copy on `reference` attention,
    same weights."""
    model = AutoModelForCausalLM.from_config(config_class(**backend.config, **config), attn_implementation=NAME)
    model = model.to(backend.device, backend.dtype).eval()
    ref, lowp = copy.deepcopy(model).float(), copy.deepcopy(model).to(torch.bfloat16)
    for m in (ref, lowp):
        m.set_attn_implementation(reference)
    return model, ref, lowp


def check(ours, ref, lowp, atol, what):
    err, err_lowp = max_error(ours, ref), max_error(lowp, ref)
    assert err <= 2 * err_lowp + atol, f"{what}: error {err:.3e} > 2 x sdpa-bf16's {err_lowp:.3e} + {atol}"


def padded_batch(backend, padding):
    """(input_ids, attention_mask) for 3 rows of lengths L, L-5, L//2+1, padded on the left or right (or not)."""
    L = backend.seq_len
    ids = torch.randint(backend.config["vocab_size"], (3, L), device=backend.device)
    mask = torch.ones(3, L, dtype=torch.long, device=backend.device)
    for row, n in enumerate((L, L - 5, L // 2 + 1) if padding else ()):
        mask[row] = torch.arange(L, device=backend.device) < n
        if padding == "left":
            mask[row] = mask[row].flip(0)
    return ids, mask


def check_prefill_and_decode(backend, models, padding, cache="dynamic"):
    """Prefill logits (at non-padded positions) and one decode step's through the KV cache, ours against the
    fp32 and bf16 sdpa copies."""
    ids, mask = padded_batch(backend, padding)
    next_ids = torch.randint(backend.config["vocab_size"], (3, 1), device=backend.device)
    next_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    logits = []
    with torch.no_grad():
        for m in models:
            past = StaticCache(config=m.config, max_cache_len=ids.shape[1] + 8) if cache == "static" else None
            out = m(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True)
            step = m(input_ids=next_ids, attention_mask=next_mask, past_key_values=out.past_key_values)
            logits.append((out.logits[mask.bool()].float(), step.logits[:, -1].float()))
    (prefill, decode), (prefill_ref, decode_ref), (prefill_lowp, decode_lowp) = logits
    check(prefill, prefill_ref, prefill_lowp, LOGITS_ATOL, "prefill logits")
    check(decode, decode_ref, decode_lowp, LOGITS_ATOL, "decode logits")


# ----------------------------------------------------------------------------------------------------
# Logits and training against sdpa


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_logits_match_sdpa(backend, padding, cache):
    """Prefill (compared at non-padded positions), then one decode step through the KV cache. A static cache
    holds more key slots than the mask covers: the integration must leave the empty ones out."""
    check_prefill_and_decode(backend, tiny_llama(backend), padding, cache)
    # The mask hook hands None when every key slot holds a token (dense kernel), else the 2-D mask (varlen).
    assert {kind for kind, *_ in backend.calls} == {"varlen" if padding or cache == "static" else "dense"}
    assert {dtype for _, dtype, _ in backend.calls} == {torch.bfloat16}


@pytest.mark.parametrize("padding", [None, "left"])
def test_sliding_window_matches_sdpa(backend, padding):
    """A tiny Mistral (sliding window shorter than the sequence): prefill and one decode step through the KV
    cache, against sdpa's sliding-window mask; the kernels get the window transformers' flash path passes."""
    check_prefill_and_decode(backend, tiny_llama(backend, MistralConfig, sliding_window=backend.seq_len // 4), padding)
    assert backend.calls, "the kernels never ran"


@pytest.mark.parametrize("padding", [None, "left"])
def test_gemma2_softcap_matches_eager(backend, padding):
    """A tiny Gemma 2 (logit soft-capping, a sliding window on every other layer) against eager attention,
    which applies the softcap (sdpa does not)."""
    config = dict(attn_logit_softcapping=2.0, sliding_window=backend.seq_len // 4, final_logit_softcapping=None,
                  query_pre_attn_scalar=backend.config["head_dim"])
    check_prefill_and_decode(backend, tiny_llama(backend, Gemma2Config, reference="eager", **config), padding)
    assert backend.calls, "the kernels never ran"


@pytest.mark.parametrize("padding", [None, "left"])
def test_gpt_oss_sinks_match_eager(backend, padding):
    """A tiny gpt-oss (attention sinks, s_aux; a sliding window on every other layer; MoE) against eager attention,
    which applies the sinks: prefill and one decode step."""
    from transformers import GptOssConfig
    layers = backend.config["num_hidden_layers"]
    # Every token routed to all 4 experts: top-k routing is discontinuous, and a bf16-sized change in one hidden
    # state can swap an expert and move a logit by far more than the attention's error (seen on an H200: decode
    # logits 3e-2 off with top-2, where eager-bf16 was 1.1e-2). Routing to all keeps the mixture continuous.
    config = dict(num_local_experts=4, num_experts_per_tok=4, sliding_window=backend.seq_len // 4,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    models = tiny_llama(backend, GptOssConfig, reference="eager", **config)
    with torch.no_grad():  # sinks away from 0, so that a dropped sink would show
        for m in models:
            for layer in m.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
    check_prefill_and_decode(backend, models, padding)
    assert backend.calls, "the kernels never ran"


def tiny_deepseek_v3(backend):
    """A tiny DeepSeek-V3 (MLA: q / k head dim qk_nope + qk_rope, v's v_head_dim: (192, 128) on the GPU, as the
    real model's; (24, 16) on the CPU), every token routed to all 4 experts (a continuous mixture), against sdpa."""
    from transformers import DeepseekV3Config
    cuda = backend.device == "cuda"
    dims = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128) if cuda else \
        dict(qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    config = {key: value for key, value in backend.config.items() if key not in ("head_dim", "num_key_value_heads")}
    config.update(dims, num_key_value_heads=config["num_attention_heads"], kv_lora_rank=64, q_lora_rank=None,
                  n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1,
                  first_k_dense_replace=1, moe_intermediate_size=64, rope_interleave=False)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**config), attn_implementation=NAME)
    model = model.to(backend.device, backend.dtype).eval()
    ref, lowp = copy.deepcopy(model).float(), copy.deepcopy(model).to(torch.bfloat16)
    for m in (ref, lowp):
        m.set_attn_implementation("sdpa")
    return model, ref, lowp


@pytest.mark.parametrize("padding", [None, "left"])
def test_deepseek_v3_mla_matches_sdpa(backend, padding, monkeypatch):
    """MLA's value heads narrower than its query / key heads reach the kernels as they are (no padding in the
    integration): prefill and one decode step against sdpa, and the kernels saw v's own head dim."""
    if backend.device == "cuda" and 192 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 192 bf16 not compiled")
    seen = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        inner = getattr(integration, name)
        monkeypatch.setattr(integration, name, lambda q, k, v, *a, _f=inner, **kw: seen.append(
            (q.shape[-1], v.shape[-1])) or _f(q, k, v, *a, **kw))
    check_prefill_and_decode(backend, tiny_deepseek_v3(backend), padding)
    expected = (192, 128) if backend.device == "cuda" else (24, 16)
    assert seen and set(seen) == {expected}, seen


@pytest.mark.gpu
def test_deepseek_v3_trains_like_sdpa():
    """One training step of the tiny DeepSeek-V3: loss and every gradient against sdpa's (fp32 and bf16)."""
    if 192 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 192 bf16 not compiled")
    backend = SimpleNamespace(device="cuda", dtype=torch.bfloat16, config=GPU_CONFIG, seq_len=128)
    models = tiny_deepseek_v3(backend)
    ids = torch.randint(GPU_CONFIG["vocab_size"], (2, 128), device="cuda")
    losses, grads = [], []
    for m in models:
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
        grads.append(torch.cat([p.grad.float().flatten() for p in m.parameters()]))
    check(losses[0], losses[1], losses[2], LOSS_ATOL, "loss")
    check(grads[0], grads[1], grads[2], 1e-3, "gradients")


@pytest.mark.gpu
def test_gpt_oss_trains_with_sinks():
    """The sinks' gradient flows: one training step's loss, the sinks' gradients and every attention projection's
    against eager's (the 2x rule against the model in bf16 eager: its own low-precision error)."""
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    from transformers import GptOssConfig
    backend = SimpleNamespace(device="cuda", dtype=torch.bfloat16, config=GPU_CONFIG, seq_len=64)
    config = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                  layer_types=["sliding_attention", "full_attention"] * (GPU_CONFIG["num_hidden_layers"] // 2))
    model, ref, lowp = tiny_llama(backend, GptOssConfig, reference="eager", **config)
    ids = torch.randint(GPU_CONFIG["vocab_size"], (2, 64), device="cuda")
    losses, grads, proj = [], [], []
    for m in (model, ref, lowp):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
        grads.append(torch.cat([l.self_attn.sinks.grad.float().flatten() for l in m.model.layers]))
        proj.append(torch.cat([getattr(l.self_attn, name).weight.grad.float().flatten() for l in m.model.layers
                               for name in ("q_proj", "k_proj", "v_proj", "o_proj")]))
    for name, got in (("loss", losses), ("sinks", grads), ("q / k / v / o projections", proj)):
        err, err_lowp = max_error(got[0], got[1]), max_error(got[2], got[1])
        assert err <= 2 * err_lowp + 1e-3, (name, err, err_lowp)


@pytest.mark.parametrize("rows, use_cache", [([[37, 64, 23]], False), ([[37, 64, 23]], True),
                                             ([[37, 64, 23], [50, 74]], False)],
                         ids=["batch1", "batch1_cache", "batch2"])
@pytest.mark.parametrize("given_seqlens", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_sequences_match_separate(backend, rows, use_cache, given_seqlens):
    """Sequences packed into rows, positions restarting at 0, no padding mask, give each sequence's own logits
    (run alone). With given_seqlens the model also gets cu_seq_lens_q/k and max_length_q/k, as
    DataCollatorWithFlattening(return_flash_attn_kwargs=True) provides them. One row is looked at even when
    the model holds a KV cache (use_cache=True), as transformers' flash path does."""
    model, ref, lowp = tiny_llama(backend)
    lengths = [n for row in rows for n in row]
    seqs = [torch.randint(backend.config["vocab_size"], (1, n), device=backend.device) for n in lengths]
    ids = torch.cat(seqs, dim=1).view(len(rows), -1)
    position_ids = torch.cat([torch.arange(n, device=backend.device) for n in lengths]).view(len(rows), -1)
    cu_seqlens = torch.tensor([0] + lengths, device=backend.device).cumsum(0)
    kwargs = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max(lengths),
                  max_length_k=max(lengths)) if given_seqlens else {}
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=position_ids, use_cache=use_cache, **kwargs).logits.float()
        separate_ref, separate_lowp = (torch.cat([m(input_ids=s, use_cache=False).logits.float() for s in seqs], dim=1)
                                       for m in (ref, lowp))
    check(packed.view(1, -1, packed.shape[-1]), separate_ref, separate_lowp, LOGITS_ATOL, "packed logits")
    # every layer: one varlen call with these bounds
    assert backend.calls == [("varlen", torch.bfloat16, cu_seqlens.tolist())] * backend.config["num_hidden_layers"]


@pytest.mark.parametrize("positions, use_cache", [("packed", False), ("packed", True), ("plain", False)],
                         ids=["packed", "packed_cache", "plain"])
def test_packing_looked_for_where_the_models_mask_looks(backend, looked, positions, use_cache):
    """Finding packed rows reads position_ids back (a device sync). For a batch of several rows it runs only
    where the model's own mask found packing (create_causal_mask looks when the model holds no KV cache), so
    ours attends as sdpa does from the same inputs: per sequence, or, with a cache, across the row."""
    model, ref, lowp = tiny_llama(backend)
    L = backend.seq_len
    ids = torch.randint(backend.config["vocab_size"], (2, L), device=backend.device)
    position_ids = torch.arange(L, device=backend.device).repeat(2, 1)
    if positions == "packed":  # two sequences per row
        position_ids = torch.cat([torch.arange(L // 2), torch.arange(L - L // 2)]).to(backend.device).repeat(2, 1)
    with torch.no_grad():
        ours, ours_ref, ours_lowp = (m(input_ids=ids, position_ids=position_ids, use_cache=use_cache).logits.float()
                                     for m in (model, ref, lowp))
    check(ours, ours_ref, ours_lowp, LOGITS_ATOL, f"{positions} logits")
    per_sequence = positions == "packed" and not use_cache
    assert looked == ([(2, L)] if per_sequence else [])  # once per forward, and only when the mask found packing
    kinds = {kind for kind, *_ in backend.calls}
    assert kinds == {"varlen" if per_sequence else "dense"}
    # The same position_ids tensor in a forward whose mask decides the other way: that forward's mask rules.
    backend.calls.clear()
    with torch.no_grad():
        model(input_ids=ids, position_ids=position_ids, use_cache=not use_cache)
    per_sequence = positions == "packed" and use_cache
    assert {kind for kind, *_ in backend.calls} == {"varlen" if per_sequence else "dense"}


@pytest.mark.parametrize("positions, use_cache",
                         [("plain", False), ("plain", True), ("packed", False), ("packed", True)])
def test_one_row_reads_position_ids_once(backend, looked, positions, use_cache):
    """A batch of one row: packed sequences are found as transformers' flash path finds them, cache or not
    (position ids that restart: per sequence). Without a KV cache the model's mask has read position_ids
    already (a device sync); where it found one sequence, attention takes that answer instead of a second sync."""
    model, ref, lowp = tiny_llama(backend)
    L = backend.seq_len
    ids = torch.randint(backend.config["vocab_size"], (1, L), device=backend.device)
    position_ids = torch.arange(L, device=backend.device)[None]
    if positions == "packed":
        position_ids = torch.cat([torch.arange(L // 3), torch.arange(L - L // 3)]).to(backend.device)[None]
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=position_ids, use_cache=use_cache).logits.float()
        ours_ref, ours_lowp = (m(input_ids=ids, position_ids=position_ids, use_cache=False).logits.float()
                               for m in (ref, lowp))  # sdpa: per sequence only without a cache
    check(ours, ours_ref, ours_lowp, LOGITS_ATOL, f"{positions} logits")
    assert looked == ([] if positions == "plain" and not use_cache else [(1, L)])  # at most once per forward
    assert {kind for kind, *_ in backend.calls} == {"varlen" if positions == "packed" else "dense"}
    # The mask's answer holds for the tensor it read only: changed in place, it is looked at again.
    if positions == "plain" and not use_cache:
        looked.clear()
        with torch.no_grad():
            model.model.rotary_emb.register_forward_pre_hook(lambda *_: position_ids.add_(0))
            model(input_ids=ids, position_ids=position_ids, use_cache=False)
        assert looked == [(1, L)]


def test_inference_mode(backend, looked):
    """Tensors made under torch.inference_mode keep no version counter: the packing answers are kept for them by
    identity, for one forward, and sdpa models (whose masks call the function the integration wraps) run too."""
    model, ref, lowp = tiny_llama(backend)
    L = backend.seq_len
    ids = torch.randint(backend.config["vocab_size"], (1, L), device=backend.device)
    with torch.inference_mode():
        for use_cache in (False, True):
            ours, ours_ref, ours_lowp = (m(input_ids=ids, use_cache=use_cache).logits.float()
                                         for m in (model, ref, lowp))
            check(ours, ours_ref, ours_lowp, LOGITS_ATOL, f"use_cache={use_cache} logits")
    assert looked == [(1, L)]  # the mask's answer without a cache; with one, a single look for the forward


def test_training_losses_match_sdpa(backend):
    """5 AdamW steps on right-padded batches (labels -100 at padding) from the same weights: flash_attn2's
    losses stay as close to fp32 sdpa's as sdpa-bf16's do (twice, plus LOSS_ATOL)."""
    model, ref, lowp = tiny_llama(backend)
    batches = [padded_batch(backend, "right") for _ in range(5)]
    losses = []
    for m in (model, ref, lowp):
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        step_losses = []
        for ids, mask in batches:
            loss = m(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(torch.tensor(step_losses))
    check(*losses, LOSS_ATOL, f"losses {[l.tolist() for l in losses]} (flash_attn2, fp32 sdpa, bf16 sdpa)")


@pytest.mark.parametrize("backend", ["cpu"], indirect=True)  # integration logic only; fp16 may not be compiled
@pytest.mark.parametrize("context", ["fp16 module", "autocast"])
def test_float32_inputs_run_in_transformers_target_dtype(backend, context):
    """float32 q/k/v run in the dtype transformers' flash path picks (the module's Linear dtype, or autocast's),
    and the output comes back in float32."""
    model, *_ = tiny_llama(backend)
    attn = model.model.layers[0].self_attn
    q, k, v = (torch.randn(2, n, 8, backend.config["head_dim"], device=backend.device)
               for n in (backend.config["num_attention_heads"], 2, 2))
    if context == "fp16 module":
        attn.half()
        out, weights = integration.flash_attn2_attention_forward(attn, q, k, v, None, scaling=0.5)
    else:
        with torch.autocast(backend.device, dtype=torch.float16):
            out, weights = integration.flash_attn2_attention_forward(attn, q, k, v, None, scaling=0.5)
    assert backend.calls == [("dense", torch.float16, None)]
    assert weights is None and out.dtype == torch.float32 and out.shape == (2, 8, q.shape[1], q.shape[3])
    expected = attention_ref(*(t.transpose(1, 2).half() for t in (q, k, v)), causal=True, softmax_scale=0.5)[0]
    assert max_error(out, expected) < 1e-2


def test_packing_is_found_once_per_position_ids(looked):
    """Every layer gets the same position_ids: the packing answer (a device sync) is computed once for it, and
    again for a new tensor or after an in-place change."""
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])
    for _ in range(3):
        cu_seqlens, max_seqlen = integration._packed_cu_seqlens(packed, 1, 6)
    assert len(looked) == 1 and cu_seqlens.tolist() == [0, 3, 5, 6] and max_seqlen == 3
    packed[0, 3:] = torch.tensor([3, 4, 5])  # one sequence now
    assert integration._packed_cu_seqlens(packed, 1, 6) is None and len(looked) == 2
    assert integration._packed_cu_seqlens(torch.arange(6)[None], 1, 6) is None and len(looked) == 3
    assert integration._packed_cu_seqlens(packed, 2, 6) is None and len(looked) == 4  # another batch size


# ----------------------------------------------------------------------------------------------------
# Registration and imports


def test_registration_is_idempotent_and_accepted_by_models():
    wrapped = hf_flash_utils._lazy_imports  # wrapped once, at import
    integration.register()
    integration.register()
    assert hf_flash_utils._lazy_imports is wrapped
    assert ALL_ATTENTION_FUNCTIONS[NAME] is integration.flash_attn2_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[NAME] is integration.flash_attn2_mask
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CPU_CONFIG), attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation(NAME)
    assert model.config._attn_implementation == NAME


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def test_importing_flash_attn2_does_not_import_transformers():
    result = run_python("import sys, flash_attn2; print(any(m.split('.')[0] == 'transformers' for m in sys.modules))")
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_integration_without_transformers_says_how_to_install():
    result = run_python("import sys; sys.modules['transformers'] = None; import flash_attn2.integrations.transformers")
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "pip install transformers" in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------------
# What flash_attn2 cannot honour raises before any kernel runs (so these run on CPU, real kernels in place)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(output_attentions=True), NotImplementedError, "output_attentions=True"),
    (dict(position_bias=torch.zeros(1, 4, 8, 12)), NotImplementedError, "argument.*position_bias"),
    (dict(attention_mask=torch.ones(1, 1, 8, 12, dtype=torch.bool)), NotImplementedError, "custom 4-D masks"),
    (dict(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])), NotImplementedError, "packed sequences.*KV cache"),
    (dict(cu_seq_lens_q=torch.tensor([0, 8])), ValueError, "cu_seq_lens_q must come as all four"),
], ids=["output_attentions", "unknown_kwarg", "4d_mask",
        "packed_with_cache", "partial_cu_seq_lens"])
def test_unsupported_arguments_raise(kwargs, error, match):
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CPU_CONFIG), attn_implementation=NAME).train()
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    k, v = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    kwargs = {"attention_mask": None, **kwargs}
    with pytest.raises(error, match=match):
        integration.flash_attn2_attention_forward(attn, q, k, v, **kwargs)


def test_output_attentions_raises():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CPU_CONFIG), attn_implementation=NAME).eval()
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        model(input_ids=torch.randint(100, (2, 10)), output_attentions=True)


@pytest.mark.gpu
def test_attention_dropout_while_training():
    """config.attention_dropout reaches the kernels while training (torch.manual_seed reproduces a step's loss
    and gradients, another seed changes them) and not in eval mode (logits as without dropout)."""
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**GPU_CONFIG, attention_dropout=0.3),
                                             attn_implementation=NAME).to("cuda", torch.bfloat16)
    plain = copy.deepcopy(model)
    plain.config.attention_dropout = 0.0
    for layer in plain.model.layers:
        layer.self_attn.attention_dropout = 0.0
    ids = torch.randint(GPU_CONFIG["vocab_size"], (2, 100), device="cuda")

    def step(seed):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    model.train()
    (loss_a, grad_a), (loss_b, grad_b), (loss_c, grad_c) = step(1), step(1), step(2)
    # The forward is deterministic; the default backward's dQ atomics are not, so same-seed gradients agree
    # to rounding and another seed's differ by far more.
    rel = lambda a, b: ((a.float() - b.float()).norm() / a.float().norm()).item()  # noqa: E731
    assert torch.isfinite(loss_a) and torch.equal(loss_a, loss_b) and rel(grad_a, grad_b) < 1e-2
    assert not torch.equal(loss_a, loss_c) and rel(grad_a, grad_c) > 5e-2, (rel(grad_a, grad_b), rel(grad_a, grad_c))
    with torch.no_grad():
        plain_loss = plain.train()(input_ids=ids, labels=ids).loss
        assert not torch.equal(loss_a, plain_loss)  # dropout did act while training
        model.eval(), plain.eval()
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_model_mask_functions_raise():
    """A model's own or_mask_function (e.g. bidirectional image tokens) cannot ride on a 2-D padding mask."""
    config = LlamaConfig(**CPU_CONFIG)
    config._attn_implementation = NAME
    with pytest.raises(NotImplementedError, match="or_mask_function"):
        create_causal_mask(config, torch.zeros(1, 8, 64), torch.ones(1, 8, dtype=torch.bool), None,
                           or_mask_function=lambda batch, head, q, kv: q == kv)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_greedy_generation_matches_sdpa(cache, padding):
    """generate() with attn_implementation="flash_attn2" (decode steps on the split-KV kernel: one query row per
    sequence, dense or varlen) gives sdpa's greedy tokens, from the same bf16 weights. Where the two first differ,
    sdpa's own logits must be a near-tie between the two tokens (bf16 noise, not a wrong attention)."""
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled (FLASH_ATTN2_HEAD_DIMS / FLASH_ATTN2_DTYPES)")
    backend = SimpleNamespace(device="cuda", dtype=torch.bfloat16, config=GPU_CONFIG, seq_len=60)
    model, _, lowp = tiny_llama(backend)
    ids, mask = padded_batch(backend, padding)
    kwargs = dict(max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        ours = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        ref = lowp.generate(input_ids=ids, attention_mask=mask, **kwargs)
    new_ours, new_ref = ours.sequences[:, ids.shape[1]:], ref.sequences[:, ids.shape[1]:]
    for row in range(ids.shape[0]):
        differ = (new_ours[row] != new_ref[row]).nonzero()
        if len(differ) == 0:
            continue
        step = int(differ[0])
        logits = ref.scores[step][row].float()
        margin = float(logits[new_ref[row, step]] - logits[new_ours[row, step]])
        assert margin < 0.05, f"row {row} step {step}: sdpa's choice leads ours by {margin:.3f} (not a tie)"


def test_paged_implementation_registered():
    """paged|flash_attn2: transformers' paged attention function, which gets our varlen and kv-cache functions from
    the flash preload."""
    from transformers.modeling_flash_attention_utils import lazy_import_paged_flash_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    integration.register()
    assert "paged|flash_attn2" in functions
    varlen, kvcache = lazy_import_paged_flash_attention("paged|flash_attn2")
    assert varlen is integration.flash_attn_varlen_func and kvcache is flash_attn2.flash_attn_with_kvcache


@pytest.mark.gpu
def test_continuous_batching_matches_paged_sdpa():
    """generate_batch with paged|flash_attn2 (prefill through flash_attn_varlen_func, decode through
    flash_attn_with_kvcache with the cache's block table) gives paged|sdpa's greedy tokens, a first difference being
    a near-tie as in test_greedy_generation_matches_sdpa (no scores here: at most one row may differ, late)."""
    if 64 not in flash_attn2.compiled_head_dims(torch.bfloat16):
        pytest.skip("head dim 64 bf16 not compiled (FLASH_ATTN2_HEAD_DIMS / FLASH_ATTN2_DTYPES)")
    from transformers import GenerationConfig
    backend = SimpleNamespace(device="cuda", dtype=torch.bfloat16, config=GPU_CONFIG, seq_len=40)
    model, _, lowp = tiny_llama(backend)
    prompts = [torch.randint(GPU_CONFIG["vocab_size"], (n,)).tolist() for n in (40, 17, 33, 5)]
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = []
    for m, implementation in ((model, "paged|flash_attn2"), (lowp, "paged|sdpa")):
        m.set_attn_implementation(implementation)
        with torch.no_grad():
            out = m.generate_batch(inputs=prompts, generation_config=config)
        results.append([out[k].generated_tokens for k in sorted(out)])
    differing = [i for i, (a, b) in enumerate(zip(*results)) if a != b]
    assert len(differing) <= 1, differing
    for i in differing:
        first = next(j for j, (x, y) in enumerate(zip(results[0][i], results[1][i])) if x != y)
        assert first >= 4, f"prompt {i}: tokens differ from step {first}"
