"""Attention dropout's random numbers, as the kernels draw them (csrc/kernels/common/dropout.h), regenerated
in PyTorch: for S_dmask (return_attn_probs=True) and for tests.

One Philox4x32-7 call (flash-attn 2's round count) gives 16 bytes, the keep bytes of a unit of 4 query rows x 4 keys:
rows 16 a + 2 i + {0, 1, 8, 9} and keys 16 b + 2 k + {0, 1, 8, 9} (i, k in 0..3) of one (batch, head). That
is the pattern in which an MMA accumulator fragment (mma.sync and wgmma alike) holds scores: a thread holds
half a unit and the lane 4 away the other half, in S as in the backward's S^T, so every kernel draws the
same bits with one call per 16 of its scores.

    counter = (4 b + k, 4 a + i, batch * heads + head, offset / 4 mod 2^32)
    key = (seed mod 2^32 xor 0x706F7244, seed >> 32 xor 0x5F324146)
    word 2 (r >> 3 & 1) + (r & 1) of the output, byte 2 (c >> 3 & 1) + (c & 1) of that word (little-endian)

for query row r and key c (positions within their sequence); the score is kept iff its byte < threshold,
threshold = round((1 - p) * 256) in float32 (flash-attn's 8-bit resolution), and kept probabilities are scaled by
256 / threshold so that the expectation is exact. The key's tag keeps these streams apart from PyTorch's own
Philox users, which key with the bare seed and keep offsets in counter words 0-1.
"""

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_KEY_TAG = (0x706F7244, 0x5F324146)  # dropout.h's dropout_key


def dropout_threshold(p: float) -> int:
    """Bytes below this are kept: keep probability threshold / 256. In float32 and rounded half to even, as
    the kernels compute it from FwdParams::dropout_p."""
    keep = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(p, dtype=torch.float32)
    return int(torch.round(keep * 256))


def dropout_scale(p: float) -> float:
    """What kept probabilities are multiplied by (0 when nothing is kept)."""
    t = dropout_threshold(p)
    return 256.0 / t if t > 0 else 0.0


PHILOX_ROUNDS = 7  # dropout.h's kDropoutPhiloxRounds


def philox4x32(counter, key, rounds=PHILOX_ROUNDS):
    """Philox4x32 (Random123) with `rounds` rounds on int64 tensors holding uint32 values: counter a 4-tuple,
    key a 2-tuple, broadcast against each other; returns the four output words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    for round_ in range(rounds):
        if round_ > 0:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _mulhilo(a, m):
    """(high, low) 32-bit halves of a * m for uint32 a (int64 tensor) and constant m: the product passes
    2^63, so it is taken in 16-bit halves of m."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    low_part = a * m_lo                   # < 2^48
    high_part = a * m_hi                  # < 2^48
    total_lo = low_part + ((high_part & 0xFFFF) << 16)
    lo = total_lo & _MASK32
    hi = ((high_part >> 16) + (total_lo >> 32)) & _MASK32
    return hi, lo


def keep_bytes(seed: int, offset: int, bh: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The keep byte (0..255, int64) of every (bh, row, col) broadcast together: bh = batch * heads + head,
    rows and cols positions within the sequence."""
    a, i = rows >> 4, (rows & 7) >> 1
    b, k = cols >> 4, (cols & 7) >> 1
    counter = (4 * b + k, 4 * a + i, bh, torch.tensor((offset >> 2) & _MASK32))
    words = philox4x32(counter, (torch.tensor((seed & _MASK32) ^ _KEY_TAG[0]),
                                 torch.tensor(((seed >> 32) & _MASK32) ^ _KEY_TAG[1])))
    word = 2 * ((rows >> 3) & 1) + (rows & 1)
    byte = 2 * ((cols >> 3) & 1) + (cols & 1)
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=0)
    chosen = stacked.gather(0, word.expand_as(stacked[0]).unsqueeze(0)).squeeze(0)
    return (chosen >> (8 * byte)) & 0xFF


def keep_mask(seed: int, offset: int, p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
              device=None) -> torch.Tensor:
    """Which scores dropout keeps: bool (batch, heads, seqlen_q, seqlen_k); for varlen, call per sequence
    with batch the sequence's index (batch=b, as one) through keep_mask_one."""
    bh = torch.arange(batch * heads, device=device).view(batch, heads, 1, 1)
    return _keep(seed, offset, p, bh, seqlen_q, seqlen_k, device)


def keep_mask_one(seed: int, offset: int, p: float, b: int, heads: int, seqlen_q: int, seqlen_k: int,
                  device=None) -> torch.Tensor:
    """keep_mask of batch entry (or varlen sequence) b alone: bool (heads, seqlen_q, seqlen_k)."""
    bh = (b * heads + torch.arange(heads, device=device)).view(heads, 1, 1)
    return _keep(seed, offset, p, bh, seqlen_q, seqlen_k, device)


def _keep(seed, offset, p, bh, seqlen_q, seqlen_k, device):
    rows = torch.arange(seqlen_q, device=device).view(-1, 1)
    cols = torch.arange(seqlen_k, device=device).view(1, -1)
    return keep_bytes(seed, offset, bh, rows, cols) < dropout_threshold(p)


def s_dmask(q, k, rng_state, p, causal, softmax_scale, window, softcap, alibi_slopes, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, sink=None):
    """flash-attn's S_dmask (return_attn_probs=True with dropout): the softmax probabilities (batch, nheads,
    seqlen_q, seqlen_k) in q's dtype, negated where dropout dropped them; varlen pads each sequence with zeros
    to (max_seqlen_q, max_seqlen_k), or to the longest sequence where that is longer than its hint. Recomputed
    here in O(seqlen^2) memory from the seed and offset the forward drew with (a device-to-host read): for
    tests and inspection, as in flash-attn. With attention sinks (sink, (nheads,)) the softmax has their column
    too, which the probabilities leave out (as the kernels' P)."""
    seed, offset = (int(x) & 0xFFFFFFFFFFFFFFFF for x in rng_state.tolist())
    with torch.no_grad():  # a returned tensor, not part of the graph
        return _s_dmask(q, k, seed, offset, p, causal, softmax_scale, window, softcap, alibi_slopes, cu_seqlens_q,
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink)


def _s_dmask(q, k, seed, offset, p, causal, softmax_scale, window, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q, max_seqlen_k, sink=None):
    from .testing import attention_scores  # the reference's scores: one definition of the score modifiers

    threshold = dropout_threshold(p)

    def one(qb, kb, b, slopes):
        scores = attention_scores(qb.float(), kb.float(), causal, softmax_scale, window, softcap, slopes)
        if sink is not None:  # the sink's column joins the softmax, then leaves (it has no value)
            column = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat([scores, column], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[0]  # (heads, sq, sk)
        if sink is not None:
            probs = probs[..., :-1]
        keep = keep_mask_one(seed, offset, p, b, qb.shape[2], qb.shape[1], kb.shape[1], device=q.device)
        return torch.where(keep & (threshold > 0), probs, -probs).to(q.dtype)

    if cu_seqlens_q is None:
        return torch.stack([one(q[b:b + 1], k[b:b + 1], b, alibi_slopes[b] if alibi_slopes is not None
                                and alibi_slopes.dim() == 2 else alibi_slopes) for b in range(q.shape[0])])
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch = len(starts_q) - 1
    # max_seqlen is a hint (the kernels compute longer sequences too): pad to whichever is longer.
    rows = max([max_seqlen_q] + [starts_q[b + 1] - starts_q[b] for b in range(batch)])
    cols = max([max_seqlen_k] + [starts_k[b + 1] - starts_k[b] for b in range(batch)])
    result = q.new_zeros((batch, q.shape[1], rows, cols))
    for b in range(batch):
        qb = q[None, starts_q[b]:starts_q[b + 1]]
        kb = k[None, starts_k[b]:starts_k[b + 1]]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        result[b, :, :qb.shape[1], :kb.shape[1]] = one(qb, kb, b, slopes)
    return result
