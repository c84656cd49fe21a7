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


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input (first, ...) -> input[indices] (len(indices), ...), differentiable (flash-attn's name; its gradient
    scatters back into zeros of input's shape, which plain indexing's does too)."""
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """values (len(indices), ...) -> (first_axis_dim, ...) zeros with values at rows indices, differentiable."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    out[indices] = values
    return out


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Packed rows of several sequences each, flash-attn's form: attention_mask_in_length (batch, seqlen) int holds,
    per row, the lengths of the sequences concatenated in it from position 0, then zeros (e.g. [2, 3, 0, 0, 0]: a
    sequence of 2 then one of 3). Returns (hidden_states (total, ...), indices (total,) into the flattened rows,
    cu_seqlens (sequences + 1,) int32, max_seqlen_in_batch int) for the varlen functions: every sequence its own."""
    lengths = attention_mask_in_length.flatten()
    seqlens = lengths[lengths > 0].to(torch.int32)  # the sequences, in row order
    row_tokens = attention_mask_in_length.sum(dim=-1)  # each row's tokens: its first row_tokens positions
    positions = torch.arange(attention_mask_in_length.shape[-1], device=row_tokens.device)
    kept = positions.unsqueeze(0) < row_tokens.unsqueeze(1)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch
