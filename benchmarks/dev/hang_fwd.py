"""Finds where a hanging Hopper forward waits. With benchmarks/dev/hang_debug.patch applied (never committed to
csrc/), barrier_wait writes (barrier offset in shared memory, phase, the producer's and each consumer warpgroup's
tile as m_block * 1e6 + batch * 1e3 + head) to pinned host memory for every warp stuck more than ~0.5 s; this
script runs the case until a launch does not finish within 5 s and prints those records (readable while the kernel
still hangs: no CUDA call needed). Map offsets to barriers with the SharedStorage layout (fwd_traits_sm90.h).
Found the skipped-block hang of step 62: D=256 bash benchmarks/dev/quick.sh, then
PYTHONPATH=$PWD python3 benchmarks/dev/hang_fwd.py [STATIC=1]."""
import math, os, sys, time
import torch
buf = torch.zeros(4096 * 16 * 8, dtype=torch.int32).pin_memory()
os.environ["FA2_HANG_PTR"] = str(buf.data_ptr())
from flash_attn2.flash_attn_interface import _flash_attn_forward
sq, sk, d = 1023, 300, 256
if os.environ.get("STATIC"): os.environ["FLASH_ATTN2_TILE_ORDER"] = "static"
b, h, g = 3, 48, 4
q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, sk, h // g, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, sk, h // g, d, device="cuda", dtype=torch.bfloat16)
for i in range(int(os.environ.get("ITERS", 3000))):
    out = torch.full_like(q, math.nan); lse = torch.full((b, h, sq), math.nan, device="cuda")
    _flash_attn_forward(q, k, v, None, None, sq, sk, d**-0.5, True, out, lse)
    ev = torch.cuda.Event(); ev.record()
    t = time.time()
    while not ev.query():
        if time.time() - t > 5:
            r = buf.view(-1, 8)
            hung = r[:, 0].nonzero().flatten().tolist()
            print(f"iter {i}: {len(hung)} warps report a hang; offsets {os.environ.get('OFFS', '')}", flush=True)
            for j in hung[:40]:
                x = r[j].tolist()
                print(f"  block {j // 16} warp {j % 16}: bar +{x[1]} phase {x[2]} tiles producer {x[3]} wg0 {x[4]} wg1 {x[5]} slot {x[6]}", flush=True)
            os._exit(1)
        time.sleep(0.01)
print("no hang", flush=True)
