# Decode timing of a few cells (flash_attn2.bench.decode's method, no CSV): one new token per sequence against a
# KV cache, bf16; graph replay and eager us, GB/s and % of the device copy measured in the same run.
#   python benchmarks/dev/decode_time.py [h,h_k,d] [b,ctx ...]     IMPLS=flash_attn2,sdpa_cudnn: only those;
#   PAGES="0 16 1": the layouts (0 contiguous, n pages of n rows)
import os
import sys

from flash_attn2.bench.decode import IMPLS, run_decode, summary
from flash_attn2.bench.grid import warm_up_gpu

shape = sys.argv[1] if len(sys.argv) > 1 else "32,8,128"
cells = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or [
    (1, 1024), (1, 4096), (1, 32768), (1, 131072), (8, 8192), (32, 8192), (64, 4096), (128, 2048), (16, 32768)]
impls = os.environ["IMPLS"].split(",") if os.environ.get("IMPLS") else list(IMPLS)
warm_up_gpu(1)
rows = []
for batch, ctx in cells:
    rows += run_decode([shape], [batch], [ctx], impls, max_gb=60.0,
                       pages=[int(p) for p in os.environ.get("PAGES", "0").split()])
print(summary(rows))
