"""A Hugging Face training step with flash_attn2 against the model's default SDPA attention, end to end.

    python -m flash_attn2.bench.hf [--batch 4] [--seqlen 2048] [--layers 4] [--heads 16] [--kv-heads 4] [--no-cache]

One randomly initialised Llama-architecture model (no download), bf16 weights, copied so that both runs start
from the same weights: one copy on attn_implementation="sdpa", one on "flash_attn2". A step is forward, the
causal-LM loss on random token ids, backward, and a fused AdamW step. The two are timed in rounds, their order
rotated (CUDA events; the median step of a round, the median round), as the kernel suites time theirs; the
first step's losses are printed side by side as a check that both run the same model. The model's config
keeps use_cache on, so each training forward builds a KV cache as a default Trainer run does; --no-cache
passes use_cache=False (as gradient checkpointing does), where the model's mask reads position_ids (a sync).
Appends to <out_dir>/<gpu>_hf_step.csv.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from .grid import add_run_args, append_csv, time_interleaved, warm_up_gpu

IMPLS = ("sdpa", "flash_attn2")
COLUMNS = ("gpu", "impl", "batch", "seqlen", "layers", "hidden", "heads", "kv_heads", "head_dim", "vocab",
           "use_cache", "ms", "loss")


def make_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.heads * args.head_dim, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab,
                       max_position_embeddings=max(args.seqlen, 2048))


def make_models(config, device="cuda"):
    """{impl: (model, optimizer)} with identical bf16 weights."""
    from transformers import AutoModelForCausalLM

    from ..integrations import transformers as _  # noqa: F401  (registers "flash_attn2")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, torch.bfloat16).train()
    models = {}
    for impl in IMPLS:
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        models[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda"))
    return models


def make_step(model, optimizer, ids, use_cache=None):
    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def host_ms(step, reps=10):
    """Median host time of one step issued after a sync: the launch work (Python, dispatch, any sync inside),
    which the step's GPU time hides only while it is the shorter of the two."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--no-cache", action="store_true", help="use_cache=False in the steps (no KV cache built)")
    add_run_args(p, reps=10)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = make_config(args)
    models = make_models(config)
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")
    use_cache = False if args.no_cache else None  # None: the config's (True)
    steps = {impl: make_step(model, opt, ids, use_cache) for impl, (model, opt) in models.items()}
    first_loss = {impl: step().item() for impl, step in steps.items()}  # the same weights: the same loss
    print("first-step loss: " + ", ".join(f"{impl} {loss:.4f}" for impl, loss in first_loss.items()))
    warm_up_gpu(args.warmup_s)
    times = time_interleaved(steps, reps=args.reps, rounds=args.rounds, min_round_ms=args.min_round_ms)
    gpu = torch.cuda.get_device_name()
    rows = [dict(gpu=gpu, impl=impl, batch=args.batch, seqlen=args.seqlen, layers=args.layers,
                 hidden=config.hidden_size, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 vocab=args.vocab, use_cache=not args.no_cache, ms=f"{ms:.3f}", loss=f"{first_loss[impl]:.4f}")
            for impl, ms in times.items()]
    host = {impl: host_ms(step) for impl, step in steps.items()}
    for row in rows:
        print(f"{row['impl']:12s} {row['ms']} ms per step (host {host[row['impl']]:.3f} ms)")
    print(f"flash_attn2 / sdpa step time: {times['flash_attn2'] / times['sdpa']:.3f} "
          f"({args.batch} x {args.seqlen} tokens, {args.layers} layers, GQA {args.heads}:{args.kv_heads}, "
          f"d {args.head_dim}, use_cache {not args.no_cache}; {gpu})")
    print(f"appended to {append_csv(rows, args.out_dir, '_hf_step.csv', COLUMNS)}")
    return rows


if __name__ == "__main__":
    main()
