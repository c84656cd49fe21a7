"""Imports ring-flash-attn 0.1.8 on flash_attn2's kernels: this directory's `flash_attn` shim first on sys.path, and
the one name its transformers adapter imports that transformers 5 no longer has (`is_flash_attn_greater_or_equal_2_10`,
used only by that adapter) supplied beforehand, so that the package imports at all. Test and benchmark use only."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def import_ring_flash_attn():
    """The ring_flash_attn module, or ImportError when it is not installed."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    try:
        import transformers.modeling_flash_attention_utils as utils
        if not hasattr(utils, "is_flash_attn_greater_or_equal_2_10"):
            utils.is_flash_attn_greater_or_equal_2_10 = lambda: True
    except ImportError:
        pass
    import ring_flash_attn
    import flash_attn
    if "flash_attn2" not in getattr(flash_attn, "__version__", ""):
        raise ImportError(f"a real flash_attn ({flash_attn.__file__}) shadows the shim; run without it on sys.path")
    return ring_flash_attn
