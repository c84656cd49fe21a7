"""python -m flash_attn2: a self-check against a float32 reference on this GPU, then the benchmark table.

    python -m flash_attn2 [--check-only] [benchmark options, see benchmarks/benchmark_attention.py --help]
"""

import sys

import torch

from . import compiled_head_dims, flash_attn_func
from .testing import attention_ref, within_tolerance


def self_check() -> bool:
    ok_all = True
    print(f"flash_attn2 self-check on {torch.cuda.get_device_name()}")
    for dtype in (torch.float16, torch.bfloat16):
        for hdim in compiled_head_dims(dtype):
            for causal in (False, True):
                for sq, sk in ((1, 1), (113, 1023), (1023, 113), (512, 512)):
                    q = torch.randn(2, sq, 8, hdim, device="cuda", dtype=dtype)
                    k, v = (torch.randn(2, sk, 2, hdim, device="cuda", dtype=dtype) for _ in range(2))
                    out = flash_attn_func(q, k, v, causal=causal)
                    ok, err, err_pt = within_tolerance(out, attention_ref(q, k, v, causal)[0],
                                                       attention_ref(q, k, v, causal, upcast=False)[0])
                    ok_all &= ok
                    if not ok:
                        print(f"  FAIL {dtype} hdim={hdim} causal={causal} sq={sq} sk={sk}: error {err:.2e} "
                              f"> 2 x PyTorch's {err_pt:.2e}")
            print(f"  {str(dtype):15} hdim={hdim:3d}: {'ok' if ok_all else 'FAILED'}")
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
        from .benchmark import main as benchmark
        benchmark(argv)


if __name__ == "__main__":
    main()
