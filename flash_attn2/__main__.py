"""python -m flash_attn2: a self-check against a float32 reference on this GPU, then the benchmark table.

    python -m flash_attn2 [--check-only] [benchmark options, see python -m flash_attn2.bench.grid --help]
"""

import sys

import torch

from . import compiled_head_dims, flash_attn_func
from .testing import GRAD_ATOL, attention_ref, reference_grads, within_tolerance


def self_check() -> bool:
    """Forward output and dq/dk/dv of every compiled kernel under the 2x rule, GQA, causal and not."""
    ok_all = True
    print(f"flash_attn2 self-check on {torch.cuda.get_device_name()}")
    for dtype in (torch.float16, torch.bfloat16):
        for hdim in compiled_head_dims(dtype):
            ok_dim = True
            for causal in (False, True):
                # (1, 1023) and (4, 2000): decode shapes, on the split-KV kernel
                for sq, sk in ((1, 1), (1, 1023), (4, 2000), (113, 1023), (1023, 113), (512, 512)):
                    q = torch.randn(2, sq, 8, hdim, device="cuda", dtype=dtype, requires_grad=True)
                    k, v = (torch.randn(2, sk, 2, hdim, device="cuda", dtype=dtype, requires_grad=True)
                            for _ in range(2))
                    dout = torch.randn_like(q)
                    out = flash_attn_func(q, k, v, causal=causal)
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up)[0],
                                                  (q, k, v), dout)
                    for name, ours, r, r_pt in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, ref_pt):
                        ok, err, err_pt = within_tolerance(ours, r, r_pt, atol=1e-5 if name == "out" else GRAD_ATOL)
                        ok_dim &= ok
                        if not ok:
                            print(f"  FAIL {dtype} hdim={hdim} causal={causal} sq={sq} sk={sk} {name}: error "
                                  f"{err:.2e} > 2 x PyTorch's {err_pt:.2e}")
            print(f"  {str(dtype):15} hdim={hdim:3d}: forward + backward {'ok' if ok_dim else 'FAILED'}")
            ok_all &= ok_dim
    print("self-check:", "PASSED" if ok_all else "FAILED")
    return ok_all


def main():
    if not torch.cuda.is_available():
        sys.exit("python -m flash_attn2 needs a CUDA GPU")
    argv = sys.argv[1:]
    check_only = "--check-only" in argv
    if not self_check():
        sys.exit(1)
    if not check_only:
        from .bench.grid import main as benchmark
        benchmark(argv)


if __name__ == "__main__":
    main()
