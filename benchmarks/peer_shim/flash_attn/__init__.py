"""Test-only stand-in for flash-attn's private entry points on flash_attn2's kernels (see ../README.md)."""

__version__ = "2.8.3+flash_attn2.shim"
