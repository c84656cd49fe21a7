"""Padding helpers with flash-attn 2.7+'s conventions: turn a padded (batch, seqlen, ...) batch and
its attention mask into the packed varlen form, and back."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int, 1 = keep.

    unused_mask (batch, seqlen), optional: tokens that are allocated but not attended; they are kept in
    the packed tensor but left out of seqused. Returns (hidden_states (total, ...), indices (total,),
    cu_seqlens (batch + 1,) int32, max_seqlen_in_batch int, seqused (batch,) int32).
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """hidden_states (total, ...), indices (total,) from unpad_input -> (batch, seqlen, ...), zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
