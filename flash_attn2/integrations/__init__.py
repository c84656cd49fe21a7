"""Integrations with other libraries; each is an optional import (flash_attn2 itself imports none of them).

- `flash_attn2.integrations.transformers`: `attn_implementation="flash_attn2"` for Hugging Face transformers.
"""
