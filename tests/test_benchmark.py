"""The benchmarks' bookkeeping on CPU: FLOP counts, the packed batch, the ratio summaries, the HF step's models."""

import math
import os

import pytest
import torch

from flash_attn2.bench import grid, models


def test_fa2_flop_count():
    # 4 * b * h * s^2 * d forward, halved when causal; backward 2.5x, both 3.5x.
    assert grid.flops(2, 3, 5, 7, False, "fwd") == 4 * 2 * 3 * 25 * 7
    assert grid.flops(2, 3, 5, 7, True, "fwd") == 2 * 2 * 3 * 25 * 7
    assert grid.flops(2, 3, 5, 7, True, "fwd_bwd") == 3.5 * 2 * 2 * 3 * 25 * 7


@pytest.mark.parametrize("tokens", [1, 100, 32768, 65536])
def test_packed_batch_fills_the_tokens(tokens):
    lengths = models.packed_lengths(tokens)
    assert sum(lengths) == tokens and all(length > 0 for length in lengths)


def test_model_flops_are_per_sequence_causal():
    # Causal: 2 * h * s^2 * d per sequence, so two sequences of s cost half of one of 2s.
    one = models.causal_flops([2048], 8, 128, "fwd")
    two = models.causal_flops([1024, 1024], 8, 128, "fwd")
    assert one == 2 * 8 * 2048 ** 2 * 128 and two == one / 2
    assert models.causal_flops([64], 1, 64, "fwd_train") == models.causal_flops([64], 1, 64, "fwd")


def test_model_flops_of_mla():
    """v's own head dim (MLA): Q K^T over d_qk, P V over d_v: 2 * h * s^2 * (d_qk + d_v) / 2 causal; the models'
    DeepSeek-V3 shape carries it."""
    assert models.causal_flops([256], 16, 192, "fwd", hdim_v=128) == 2 * 16 * 256 ** 2 * (192 + 128) / 2
    assert models.causal_flops([256], 16, 192, "fwd_bwd", hdim_v=192) == models.causal_flops([256], 16, 192, "fwd_bwd")
    assert models.V_HEAD_DIMS["deepseek-v3-tp8"] == 128 and models.MODELS["deepseek-v3-tp8"] == (16, 16, 192)


def test_model_flops_count_a_window_visible_pairs():
    # A causal window of w keys sees min(i + 1, w) keys at row i: 4 * h * d per pair; none wider than s.
    s, w = 100, 30
    pairs = sum(min(i + 1, w) for i in range(s))
    assert models.causal_flops([s], 2, 64, "fwd", window=w) == 4 * 2 * 64 * pairs
    assert models.causal_flops([s], 2, 64, "fwd", window=s) == models.causal_flops([s], 2, 64, "fwd")


def test_model_features_become_flash_attn_arguments():
    kwargs = models.ours_kwargs(models.FEATURES["gemma2-9b-local"])
    assert kwargs == {"softcap": 50.0, "window_size": (4095, 0)}
    assert models.ours_kwargs({}) == {"softcap": 0.0}


def test_model_summary_geomean_and_min():
    rows = [dict(impl=impl, shape=shape, seqlen=2048, tflops=tflops, **{"pass": "fwd"})
            for impl, shape, tflops in [("flash_attn2", "a", 400.0), ("sdpa_cudnn", "a", 500.0),
                                        ("flash_attn2", "b", 600.0), ("sdpa_cudnn", "b", 480.0)]]
    line = models.summary(rows, bases=("sdpa_cudnn",))
    geomean = math.sqrt(0.8 * 1.25)
    assert f"geomean {geomean:.3f}" in line and "min 0.800 at a s=2048" in line


def test_grid_summary_against_each_backend():
    rows = [dict(impl=impl, dtype="bf16", hdim=128, causal=False, seqlen=s, tflops=t, **{"pass": "fwd"})
            for impl, s, t in [("flash_attn2", 512, 300.0), ("sdpa_cudnn", 512, 400.0), ("sdpa_flash", 512, 200.0),
                               ("flash_attn2", 4096, 600.0), ("sdpa_cudnn", 4096, 500.0)]]
    cudnn, flash = grid.summary(rows).splitlines()
    assert "flash_attn2 / sdpa_cudnn over 2 points" in cudnn and f"geomean {math.sqrt(0.75 * 1.2):.3f}" in cudnn
    assert "min 0.750 at bf16 hdim=128 causal=False seqlen=512" in cudnn
    assert "flash_attn2 / sdpa_flash over 1 points: geomean 1.500" in flash


def test_warm_up_is_opt_out():
    assert grid.parse_args([]).warmup_s == 3.0 and grid.parse_args(["--warmup-s", "0"]).warmup_s == 0
    grid.warm_up_gpu(0)  # no GPU work (and no GPU needed) when turned off


def test_rounds_rotate_the_order(monkeypatch):
    # Each round starts with the next implementation; each keeps its median round.
    calls, fake_ms = [], {"a": iter([1.0, 9.0, 2.0]), "b": iter([5.0, 4.0, 3.0])}
    monkeypatch.setattr(grid, "median_ms", lambda run, reps: (calls.append(run()), next(fake_ms[calls[-1]]))[1])
    ms = grid.time_interleaved({"a": lambda: "a", "b": lambda: "b"}, reps=1, rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"] and ms == {"a": 2.0, "b": 4.0}


def test_short_runs_get_rounds_of_min_round_ms(monkeypatch):
    # A run estimated at 0.1 ms a call gets 250 reps for 25 ms rounds, a 10 ms one keeps --reps, a near-zero one is
    # capped at 2000; min_round_ms=0 (the default of the function) times exactly reps.
    estimates = {"short": 0.1, "long": 10.0, "empty": 0.0}
    monkeypatch.setattr(grid, "rep_times_ms", lambda run, warmup, reps: [estimates[run()]] * reps)
    used = {}
    monkeypatch.setattr(grid, "median_ms", lambda run, reps: used.setdefault(run(), reps) and 1.0)
    runs = {name: (lambda name=name: name) for name in estimates}
    grid.time_interleaved(runs, reps=20, rounds=2, min_round_ms=25.0)
    assert used == {"short": 250, "long": 20, "empty": 2000}
    used.clear()
    grid.time_interleaved(runs, reps=20, rounds=1)
    assert used == {"short": 20, "long": 20, "empty": 20}
    assert grid.parse_args([]).min_round_ms == 25.0 and grid.parse_args(["--min-round-ms", "0"]).min_round_ms == 0


def test_sm80_rows_run_the_whole_pass_on_its_path(monkeypatch):
    """flash_attn2_sm80's run is made (a bwd run's forward) and timed (its backward reads the variable when it
    runs) with FLASH_ATTN2_BACKEND=sm80; the default rows leave it alone."""
    monkeypatch.delenv("FLASH_ATTN2_BACKEND", raising=False)
    made, seen = [], []

    def make():
        made.append(os.environ.get("FLASH_ATTN2_BACKEND"))
        return lambda: seen.append(os.environ.get("FLASH_ATTN2_BACKEND"))
    for impl in ("flash_attn2_sm80", "flash_attn2", "sdpa_cudnn"):
        grid.on_path(impl, make)()
    assert made == seen == ["sm80", None, None] and "FLASH_ATTN2_BACKEND" not in os.environ


def test_hf_step_models_share_weights():
    """The training-step benchmark's two models: the config it asks for, the same weights, each its attention."""
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    from flash_attn2.bench import hf

    args = hf.parse_args(["--layers", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                          "--intermediate", "32", "--vocab", "64", "--seqlen", "32"])
    config = hf.make_config(args)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 4, 2, 16)
    built = hf.make_models(config, device="cpu")
    (sdpa, _), (ours, _) = built["sdpa"], built["flash_attn2"]
    assert sdpa.config._attn_implementation == "sdpa" and ours.config._attn_implementation == "flash_attn2"
    for a, b in zip(sdpa.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())


def test_decode_summary_against_cudnn():
    from flash_attn2.bench import decode
    cell = dict(heads=32, heads_k=8, hdim=128, batch=1, ctx=1024)
    rows = [dict(cell, impl="flash_attn2", us_graph=10.0), dict(cell, impl="sdpa_cudnn", us_graph=8.0),
            dict(cell, ctx=4096, impl="flash_attn2", us_graph=20.0), dict(cell, ctx=4096, impl="sdpa_cudnn", us_graph=40.0)]
    text = decode.summary(rows)
    assert "geomean 1.265 over 2 cells" in text and "min 0.800" in text and "ctx 1024" in text
    assert "no cell" in decode.summary(rows[:1])


def test_decode_name_is_a_file_name(capsys):
    """--name picks the results' file (<gpu>_<name>.csv), so a paged grid and the default suite can sit side by side;
    a name that is not a plain file name is refused before any GPU work."""
    from flash_attn2.bench import decode
    for bad in ("a/b", "", "../x"):
        with pytest.raises(SystemExit) as info:
            decode.main(["--name", bad])
        assert info.value.code == 2 and "--name" in capsys.readouterr().err


def test_decode_rounds_rotate_the_implementations(monkeypatch):
    """bench.decode times a cell's runners in rounds with their order rotated (each starts a round in turn), and
    reports each runner's median: CUDA events replaced by a clock that the runners advance."""
    from flash_attn2.bench import decode
    clock, order = [0.0], []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    cost = {"a": 1e-3, "b": 2e-3, "c": 4e-3}  # ms a call

    def runner(key):
        def run():
            order.append(key)
            clock[0] += cost[key]
        return run

    timed = decode.time_runs({k: runner(k) for k in cost}, copies=100, rounds=3)
    reps = 3  # max(3, 200 // copies); a runner's call stands for its 100 copies' calls
    assert timed == pytest.approx({k: c * 1e3 / 100 for k, c in cost.items()})
    firsts = [order[3 * 3 + r * 3 * reps] for r in range(3)]  # after the 3 warm-up calls of each runner
    assert firsts == ["a", "b", "c"]


def test_sdpa_flash_attn2_runs_inside_its_activation():
    from torch.nn.attention import _registry
    seen = []
    run = grid.on_path("sdpa_flash_attn2", lambda: (lambda: seen.append(_registry.current_flash_attention_impl())))
    assert _registry.current_flash_attention_impl() is None  # made inside the context, restored after
    with grid.run_context(run):
        run()
    run()  # outside its context: PyTorch's own (what time_interleaved never does)
    assert seen == ["flash_attn2", None] and _registry.current_flash_attention_impl() is None
