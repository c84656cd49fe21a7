"""flash_attn2: FlashAttention-2 CUDA kernels (CuTe) with flash-attn 2.x's Python API."""

__version__ = "0.1.0"

from ._combine import flash_attn_combine
from .bert_padding import pad_input, unpad_input
from .flash_attn_interface import (
    compiled_head_dims,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from ._kvcache import get_scheduler_metadata  # after flash_attn_interface, which _kvcache imports from

__all__ = [
    "compiled_head_dims",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "pad_input",
    "unpad_input",
]
