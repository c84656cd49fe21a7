"""flash_attn2 vs PyTorch SDPA (flash, cudnn, efficient) on the FA2 paper grid; see flash_attn2/bench/grid.py.

    python benchmarks/benchmark_attention.py [--dtypes bf16] [--hdims 128] [--seqlens 4096] ...
"""

from flash_attn2.bench.grid import main

if __name__ == "__main__":
    main()
