# #49's MLA target: DeepSeek-V3 attention (d_qk 192, d_v 128; 128 heads split over 8 GPUs: 16 per GPU, MHA),
# causal, bf16, batch = tokens / seqlen. Beside flash_attn2 (the Hopper pair kernel where built; the backward pads):
# flash_attn2 on v zero-padded to 192 (what ran before the pair kernel), SDPA's cuDNN and memory-efficient
# backends (both take d_v != d_qk). TFLOP/s count MLA's FLOPs: 2 h s^2 (d_qk + d_v) per causal forward (FA2's
# halving), backward 2.5x.
#   python benchmarks/dev/mla_bench.py [--seqlens 4096 8192 16384 32768] [--tokens 32768] [--passes fwd fwd_bwd]
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn2
from flash_attn2.bench.grid import pass_fn, time_interleaved, warm_up_gpu

HEADS, D_QK, D_V = 16, 192, 128


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--passes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    warm_up_gpu(2)
    print(f"# {torch.cuda.get_device_name()}: MLA h {HEADS}, d_qk {D_QK}, d_v {D_V}, causal, bf16; ms and TFLOP/s")
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        q = torch.randn(batch, seqlen, HEADS, D_QK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, seqlen, HEADS, D_QK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(batch, seqlen, HEADS, D_V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(batch, seqlen, HEADS, D_V, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # SDPA's (b, h, s, d)
        dout_t = dout.transpose(1, 2)

        def sdpa(backend):
            def fn():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            return fn

        impls = {
            "flash_attn2": (lambda: flash_attn2.flash_attn_func(q, k, v, causal=True), (q, k, v), dout),
            "flash_attn2_padded": (lambda: flash_attn2.flash_attn_func(q, k, F.pad(v, (0, D_QK - D_V)),
                                                                      causal=True)[..., :D_V], (q, k, v), dout),
            "sdpa_cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), (qt, kt, vt), dout_t),
            "sdpa_efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION), (qt, kt, vt), dout_t),
        }
        for pass_ in args.passes:
            runs = {}
            for name, (fn, inputs, d) in impls.items():
                try:
                    fn()  # an unsupported backend raises here; it sits the point out
                    runs[name] = pass_fn(fn, pass_, inputs, d)
                except RuntimeError as e:
                    print(f"  {name} skipped: {str(e).splitlines()[0][:100]}")
            times = time_interleaved(runs, args.reps, args.rounds)
            flops = 2 * batch * HEADS * seqlen * seqlen * (D_QK + D_V) / 2 * (1.0 if pass_ == "fwd" else 3.5)
            row = "  ".join(f"{n} {t:.3f} ms {flops / t / 1e9:.0f} TF" for n, t in times.items())
            base = times.get("sdpa_cudnn")
            ratio = f"  ours/cudnn {base / times['flash_attn2']:.3f}x" if base and "flash_attn2" in times else ""
            pad = times.get("flash_attn2_padded")
            ratio += f"  ours/padded {pad / times['flash_attn2']:.3f}x" if pad and "flash_attn2" in times else ""
            print(f"seqlen {seqlen} batch {batch} {pass_}: {row}{ratio}", flush=True)
        del q, k, v, dout, qt, kt, vt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
