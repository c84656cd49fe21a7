"""Benchmarks: flash_attn2 timed next to PyTorch on a CUDA GPU (each module's --help lists its options).

- `grid`: the FA2 paper's grid (head dims 64/128/256, causal and not, 512-16k tokens per sequence) against
  SDPA's backends, and the timing helpers the other suites share (rounds with a rotated order, warm-up,
  CSV/PNG output). `python -m flash_attn2.bench.grid`; `python -m flash_attn2` runs it after its self-check.
- `models`: the attention of real models (GQA, windows, softcap, packed varlen batches).
  `python -m flash_attn2.bench.models`
- `hf`: a Hugging Face transformers training step, end to end, flash_attn2 against sdpa.
  `python -m flash_attn2.bench.hf`
- `variants`: what softcap, ALiBi and dropout cost against plain attention, per path.
  `python -m flash_attn2.bench.variants`
- `window`: sliding-window attention against full causal attention and PyTorch's varlen_attn.
  `python -m flash_attn2.bench.window`

Under --out-dir (default benchmarks/results): grid writes <gpu>.csv and .png, models <gpu>_models.csv and .png;
hf, variants and window append to <gpu>_hf_step.csv, <gpu>_variants.csv and <gpu>_window.csv.
"""
