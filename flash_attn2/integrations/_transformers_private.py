"""What flash_attn2.integrations.transformers needs from transformers' private internals, and the state it keeps.

Written against transformers 5.17 (pinned in pyproject.toml's `transformers` extra: >=5.17,<6). Everything
here may need revisiting when transformers changes; the public integration (transformers.py) uses only
AttentionInterface, AttentionMaskInterface, masking_utils.flash_attention_mask and
integrations.flash_attention.get_target_dtype.

Two private transformers functions are wrapped (once, by `install`; the module attribute is replaced, which is
what their callers look up), and the name is added to the `_compatible_flash_implementations` of the models that
restrict flash implementations to a list (gpt-oss: the kernels with attention sinks; without it transformers swaps
"flash_attn2" for a hub kernel there):

- `modeling_flash_attention_utils._lazy_imports`: transformers treats every attn_implementation whose name
  contains "flash" as a flash-attn build (utils.generic.is_flash_attention_requested) and preloads it when a
  model is built or switched to it (_check_and_adjust_attn_implementation -> lazy_import_flash_attention ->
  _lazy_imports). _lazy_imports knows only flash-attn 2/3/4 and hub kernels and raises ValueError for
  "flash_attn2". The wrapper answers that name with our functions and leaves every other name to transformers.
  Without it a model cannot be built or switched to attn_implementation="flash_attn2".
- `masking_utils.find_packed_sequence_indices`: create_causal_mask reads position_ids back (a device sync) to
  find packed sequences when the model holds no KV cache, for every attn_implementation. The wrapper remembers
  which tensor it read and whether it found one sequence per row, so that the attention call of a batch of one
  row can take that answer instead of a second sync (the step's GPU then idled while the host caught up:
  benchmarks/TUNING.md step 60). It saves one device sync per forward, about 0.1-0.2% of an HF training step.

And three module-level caches (weak references: a model, a config or a position_ids tensor is never kept alive
by them), which `packing` consults before looking at position_ids itself (a device sync):

- `_packing_cache`: the answer for the last position_ids tensor seen (every layer gets the same tensor), while
  its version counter is unchanged: one look per forward, not one per layer.
- `_mask_found_no_packing`: the last mask built through the mask hook that found no packing (config, shape):
  the next attention call of that model takes it for its position_ids (no look at all for several rows).
- `_mask_read`: what the wrapped find_packed_sequence_indices last read (see above).
Each new mask (a new forward) drops the answers kept for earlier position_ids. Under torch.compile nothing is
cached: every call looks.

If a transformers release renames or drops either private function, `install` (run when
flash_attn2.integrations.transformers is imported) raises AttributeError naming it, the installed version and
the one written against, and the import fails: the behaviour from before these were gathered here (a bare
AttributeError then), kept. Without _lazy_imports' wrapper the integration could not work; without
find_packed_sequence_indices' it could (attention would look at position_ids itself, one more sync per
forward), but it raises all the same, so that such a change is looked at: the mask hook's use of
allow_is_causal_skip (mask_built) leans on the same create_causal_mask code.
"""

from __future__ import annotations

import functools
import weakref

import torch
import transformers
import transformers.masking_utils as _hf_masking_utils
import transformers.modeling_flash_attention_utils as _hf_flash_utils

WRITTEN_AGAINST = "5.17"

# (weakref to the last position_ids seen, (batch, seq_len, its version), packing's answer)
_packing_cache = (lambda: None, None, None)
# The last mask the model built through the mask hook that found no packing: (weakref to its config,
# (batch, q_len)), or None. The next attention call of that model takes it for its position_ids.
_mask_found_no_packing = None
# The position_ids the model's mask last read for packing (it does without a KV cache), as (weakref, version,
# whether it found one sequence per row): attention on that very tensor takes the answer, with no second sync.
_mask_read = (lambda: None, None, False)


def install(implementation: str, flash_functions) -> None:
    """Wrap the two private functions, once (any number of calls). flash_functions() returns what _lazy_imports
    returns for `implementation`: (flash_fn, flash_varlen_fn, flash_with_kvcache_fn, pad_fn, unpad_fn)."""
    _wrap_once(_hf_flash_utils, "_lazy_imports", lambda original: _answer_flash_preload(original, implementation,
                                                                                         flash_functions))
    _wrap_once(_hf_masking_utils, "find_packed_sequence_indices", _remember_mask_read)
    _allow_on_restricted_models(implementation)


# Models that list the flash implementations they accept (`_compatible_flash_implementations`) and that transformers
# otherwise switches away from any other flash-named implementation (to a hub kernel): gpt-oss lists the kernels
# with attention sinks, which flash_attn2 has (learnable_sink).
_RESTRICTED_MODELS = (("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssPreTrainedModel"),)


def _allow_on_restricted_models(implementation: str) -> None:
    import importlib
    for module_name, class_name in _RESTRICTED_MODELS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # a transformers without that model
            continue
        allowed = getattr(cls, "_compatible_flash_implementations", None)
        if allowed is not None and implementation not in allowed:
            cls._compatible_flash_implementations = [*allowed, implementation]


def _wrap_once(module, name: str, wrap) -> None:
    """module.name = wrap(module.name), unless it is ours already (install() may run any number of times)."""
    try:
        original = getattr(module, name)
    except AttributeError as e:
        raise AttributeError(
            f"flash_attn2.integrations.transformers: {module.__name__}.{name}, a private transformers function it "
            f"wraps, is missing in transformers {transformers.__version__} (written against {WRITTEN_AGAINST}; see "
            f"flash_attn2/integrations/_transformers_private.py)") from e
    if not getattr(original, "_flash_attn2", False):
        wrapped = wrap(original)
        wrapped._flash_attn2 = True
        setattr(module, name, wrapped)


def _answer_flash_preload(original, ours, flash_functions):
    # See the module docstring: _lazy_imports raises ValueError for a name it does not know.
    @functools.wraps(original)
    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in (ours, f"paged|{ours}"):  # continuous batching asks with the paged prefix
            return flash_functions()
        return original(implementation, *args, **kwargs)
    return _lazy_imports


def _remember_mask_read(original):
    # Same rule as the integration's own look: a sequence starts wherever a position is not the previous one + 1.
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        found = original(position_ids, *args, **kwargs)
        if not torch.compiler.is_compiling():
            global _mask_read
            _mask_read = (weakref.ref(position_ids), _version(position_ids), found is None)
        return found
    return find_packed_sequence_indices


def mask_built(mask_kwargs: dict) -> None:
    """The mask hook's part: remember whether this model's new mask found packing, and drop the answers kept for
    earlier position_ids (a new mask is a new forward)."""
    # create_causal_mask keeps allow_is_causal_skip only for a plain causal mask: it sets it False when it
    # found packed sequences (and for block overlays and compiled decoding), so True means no packing; it
    # looks for packing only without a padding mask and a KV cache.
    global _mask_found_no_packing, _packing_cache
    config = mask_kwargs.get("config")
    if not torch.compiler.is_compiling():
        plain = mask_kwargs.get("allow_is_causal_skip") and config is not None
        _mask_found_no_packing = ((weakref.ref(config), (mask_kwargs.get("batch_size"), mask_kwargs.get("q_length")))
                                  if plain else None)
        _packing_cache = (lambda: None, None, None)


def packing(position_ids, batch: int, seq_len: int, config, find):
    """find(position_ids, batch, seq_len) (a device sync), unless an answer kept here holds for these
    position_ids: the last one for this very tensor (unmodified), the mask's read of it that found one sequence
    per row, or, for several rows, this model's (`config`'s) just-built mask that found no packing."""
    # A model hands every layer the same position_ids tensor, so the answer is kept for it (while unmodified):
    # one sync per forward, not one per layer, which left the GPU idle between layers (HF step 4 x 2k tokens,
    # 4 layers: 22.4 -> see TUNING). And none at all for several rows whose mask found no packing (mask_built).
    global _packing_cache, _mask_found_no_packing
    if torch.compiler.is_compiling():
        return find(position_ids, batch, seq_len)
    key = (batch, seq_len, _version(position_ids))
    cached_ref, cached_key, cached = _packing_cache
    if cached_ref() is position_ids and cached_key == key:
        return cached
    decided, _mask_found_no_packing = _mask_found_no_packing, None  # one forward's mask, for its position_ids
    mask_config, mask_shape = decided or (lambda: None, None)
    read_ref, read_version, read_none = _mask_read
    if read_none and read_ref() is position_ids and read_version == key[2]:
        answer = None  # the mask has read these very ids and found one sequence per row
    elif batch > 1 and mask_shape == (batch, seq_len) and config is not None and mask_config() is config:
        answer = None
    else:
        answer = find(position_ids, batch, seq_len)
    _packing_cache = (weakref.ref(position_ids), key, answer)
    return answer


def _version(t: torch.Tensor) -> int:
    # An inference tensor (made under torch.inference_mode) has no version counter: -1, so the answers kept
    # for it go by identity alone, for one forward (each new mask, mask_built, drops them).
    return -1 if t.is_inference() else t._version
