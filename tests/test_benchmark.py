"""The benchmarks' bookkeeping on CPU: FLOP counts, the packed batch, and the ratio summaries."""

import math

import pytest

from flash_attn2 import benchmark, benchmark_models


def test_fa2_flop_count():
    # 4 * b * h * s^2 * d forward, halved when causal; backward 2.5x, both 3.5x.
    assert benchmark.flops(2, 3, 5, 7, False, "fwd") == 4 * 2 * 3 * 25 * 7
    assert benchmark.flops(2, 3, 5, 7, True, "fwd") == 2 * 2 * 3 * 25 * 7
    assert benchmark.flops(2, 3, 5, 7, True, "fwd_bwd") == 3.5 * 2 * 2 * 3 * 25 * 7


@pytest.mark.parametrize("tokens", [1, 100, 32768, 65536])
def test_packed_batch_fills_the_tokens(tokens):
    lengths = benchmark_models.packed_lengths(tokens)
    assert sum(lengths) == tokens and all(length > 0 for length in lengths)


def test_model_flops_are_per_sequence_causal():
    # Causal: 2 * h * s^2 * d per sequence, so two sequences of s cost half of one of 2s.
    one = benchmark_models.causal_flops([2048], 8, 128, "fwd")
    two = benchmark_models.causal_flops([1024, 1024], 8, 128, "fwd")
    assert one == 2 * 8 * 2048 ** 2 * 128 and two == one / 2
    assert benchmark_models.causal_flops([64], 1, 64, "fwd_train") == benchmark_models.causal_flops([64], 1, 64, "fwd")


def test_model_summary_geomean_and_min():
    rows = [dict(impl=impl, shape=shape, seqlen=2048, tflops=tflops, **{"pass": "fwd"})
            for impl, shape, tflops in [("flash_attn2", "a", 400.0), ("sdpa_cudnn", "a", 500.0),
                                        ("flash_attn2", "b", 600.0), ("sdpa_cudnn", "b", 480.0)]]
    line = benchmark_models.summary(rows, bases=("sdpa_cudnn",))
    geomean = math.sqrt(0.8 * 1.25)
    assert f"geomean {geomean:.3f}" in line and "min 0.800 at a s=2048" in line
