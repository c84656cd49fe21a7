"""Dropout's random numbers as the PyTorch side regenerates them (flash_attn2/_dropout.py; CPU): Philox4x32-7
and -10 against Random123's known answers, the keep fraction, and what the seed, offset and position change. The C++
draws (csrc/kernels/common/dropout.h) are checked against the same spec by benchmarks/dev/check_dropout.cu."""

import math

import pytest
import torch

from flash_attn2 import _dropout


_KAT_INPUTS = [((0, 0, 0, 0), (0, 0)), ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))]
# Random123's kat_vectors, philox4x32 with 7 and 10 rounds, for the inputs above.
_KAT_OUTPUTS = {7: [(0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662),
                    (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)],
                10: [(0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
                     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)]}


@pytest.mark.parametrize("rounds", [7, 10])
@pytest.mark.parametrize("case", range(len(_KAT_INPUTS)))
def test_philox_known_answers(rounds, case):
    counter, key = _KAT_INPUTS[case]
    assert tuple(int(w) for w in _dropout.philox4x32(counter, key, rounds)) == _KAT_OUTPUTS[rounds][case]


def test_spec_bytes_match_the_cpp_draws():
    """Bytes that benchmarks/dev/check_dropout.cu printed from the C++ spec for seed 0x9abcdef012345678,
    offset 4 x 77, bh 5."""
    points = [(0, 0, 0), (1, 9, 253), (17, 3, 231), (100, 77, 117), (1023, 4095, 11), (40000, 12345, 206)]
    for row, col, want in points:
        got = _dropout.keep_bytes(0x9ABCDEF012345678, 4 * 77, torch.tensor(5), torch.tensor(row), torch.tensor(col))
        assert int(got) == want, (row, col)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    """The keep fraction is threshold / 256 within 6 sigma, and kept scores scaled by 256 / threshold keep
    the expectation at exactly 1."""
    mask = _dropout.keep_mask(1234, 0, p, 2, 4, 300, 257)
    n, keep = mask.numel(), _dropout.dropout_threshold(p) / 256
    assert abs(mask.double().mean().item() - keep) <= 6 * math.sqrt(keep * (1 - keep) / n)
    assert abs(keep * _dropout.dropout_scale(p) - 1.0) < 1e-12
    assert abs(keep - (1 - p)) <= 1 / 512


def test_seed_offset_and_position_change_the_mask():
    base = _dropout.keep_mask(7, 8, 0.5, 1, 2, 64, 64)
    assert torch.equal(base, _dropout.keep_mask(7, 8, 0.5, 1, 2, 64, 64))
    for other in (_dropout.keep_mask(8, 8, 0.5, 1, 2, 64, 64), _dropout.keep_mask(7, 12, 0.5, 1, 2, 64, 64)):
        assert (other != base).double().mean() > 0.4  # independent masks differ in about half the places
    assert (base[0, 0] != base[0, 1]).double().mean() > 0.4  # heads draw independently
    assert (base[0, 0, :32] != base[0, 0, 32:]).double().mean() > 0.4  # so do rows
    one = _dropout.keep_mask_one(7, 8, 0.5, 0, 2, 64, 64)
    assert torch.equal(one, base[0])


def test_streams_apart_from_torchs_philox(monkeypatch):
    """PyTorch's Philox users key with the bare seed and count offsets in counter words 0-1; the key's tag
    keeps a first call after seeding (offset 0: counter word 3 is 0) from drawing their numbers for rows 0,
    1, 8, 9, which the bare seed would give."""
    draw = lambda: _dropout.keep_bytes(0x0123456789ABCDEF, 0, torch.tensor(3), torch.tensor(0), torch.arange(16))  # noqa: E731
    tagged = draw()
    monkeypatch.setattr(_dropout, "_KEY_TAG", (0, 0))
    assert not torch.equal(tagged, draw())


def test_extreme_probabilities():
    assert _dropout.keep_mask(1, 0, 1 / 1024, 1, 1, 32, 32).all()  # rounds to threshold 256: nothing dropped
    assert _dropout.dropout_scale(0.999) == 0.0  # threshold 0: nothing kept
    assert not _dropout.keep_mask(1, 0, 0.999, 1, 1, 32, 32).any()


def test_s_dmask_varlen_longer_than_its_hint():
    """max_seqlen is a hint (the kernels compute longer sequences too): S_dmask pads to the longest sequence
    where that is longer, each sequence's block holding its own probabilities, dropped ones negated."""
    torch.manual_seed(0)
    lens_q, lens_k, heads, d, p = [5, 0, 19], [7, 3, 23], 2, 16, 0.3
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32) for lens in (lens_q, lens_k))
    q, k = torch.randn(sum(lens_q), heads, d), torch.randn(sum(lens_k), heads, d)
    rng_state = torch.tensor([11, 8], dtype=torch.int64)
    got = _dropout.s_dmask(q, k, rng_state, p, True, 0.25, (-1, 0), 0.0, None, cu_q, cu_k, 8, 8)
    assert got.shape == (3, heads, 19, 23)
    for b in range(3):
        qb, kb = q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]]
        dense = _dropout._s_dmask(qb, kb, 11, 8, p, True, 0.25, (-1, 0), 0.0, None, None, None, 0, 0)[0]
        # The probabilities are the sequence's own; the signs its batch entry's draws.
        keep = _dropout.keep_mask_one(11, 8, p, b, heads, lens_q[b], lens_k[b])
        assert torch.equal(got[b, :, :lens_q[b], :lens_k[b]].abs(), dense.abs())
        assert torch.equal(got[b, :, :lens_q[b], :lens_k[b]] >= 0, keep | (dense == 0))
        assert not got[b, :, lens_q[b]:].any() and not got[b, :, :, lens_k[b]:].any()
