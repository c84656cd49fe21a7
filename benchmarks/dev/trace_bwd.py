# Where a Hopper backward block's time goes, from a build with benchmarks/dev/trace_bwd.patch applied (each block
# prints clock64 offsets of its roles' points at its end). The printf at each block's end stretches the gaps
# between blocks (TUNING 101: the kernel ran 3x longer), so only the in-block offsets are to be read; the gap
# and busy lines bound nothing. One case per process:
#   python benchmarks/dev/trace_bwd.py D CAUSAL SEQLEN H H_KV BATCH
# prints the block-level medians and, per SM, the gap between one block's end and the next one's start.
import ctypes
import statistics as st
import subprocess
import sys

if len(sys.argv) > 1 and sys.argv[1] == "run":
    import torch
    from flash_attn2 import flash_attn_func
    d, causal, s, h, hkv, b = (int(x) for x in sys.argv[2:8])
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=bool(causal))
    dout = torch.randn_like(out)
    libc = ctypes.CDLL(None)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        libc.fflush(None)
        print("MARK", flush=True)
    sys.exit(0)

d, causal, s, h, hkv, b = (int(x) for x in sys.argv[1:7])
proc = subprocess.run([sys.executable, __file__, "run", *sys.argv[1:7]], capture_output=True, text=True)
if proc.stdout.count("MARK") < 3:
    sys.exit(f"the traced run failed:\n{proc.stderr[-2000:]}")
last = proc.stdout.split("MARK")[-2]  # the third call's lines
rows = [list(map(int, l.split()[1:])) for l in last.splitlines() if l.startswith("T ")]
print(f"d{d} causal={causal} s={s} h={h}:{hkv} b={b}: {len(rows)} blocks")
if not rows:
    sys.exit(1)
names = ["smid", "blk", "steps", "g0", "gend", "griddep", "kv_issued", "load_end", "writer0_end", "writer1_end",
         "c0_kv", "c0_q0", "c0_step0", "c0_loop", "c0_dq", "c0_end", "c1_kv", "c1_q0", "c1_step0", "c1_loop", "c1_dq",
         "c1_end", "last", "splits", "_"]
R = [dict(zip(names, r)) for r in rows]
med = lambda key, rs=R: st.median(r[key] for r in rs)
full = [r for r in R if r["steps"] > 1]
for key in names[5:23]:
    print(f"  {key:12s} median {med(key, full):9.0f} cycles")
# cycles per step and fixed cost: least squares over blocks of last = a + b * steps
xs = [r["steps"] for r in full]; ys = [r["last"] for r in full]
if len(set(xs)) > 1:
    mx, my = st.mean(xs), st.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"  fit: {slope:.0f} cycles/step + {my - slope * mx:.0f} per block")
per_step = [(r["c0_loop"] - r["c0_step0"]) / (r["steps"] - 1) for r in full]
print(f"  wg0 loop per step after step 0: {st.median(per_step):.0f} cycles; steps median {med('steps', full):.0f}")
print(f"  phases (median cycles): to kv_full {med('c0_kv', full):.0f}, first q {med('c0_q0', full):.0f}, step0 "
      f"{st.median(r['c0_step0'] - r['c0_q0'] for r in full):.0f}, dq drain {st.median(r['c0_dq'] - r['c0_loop'] for r in full):.0f}, "
      f"epilogue {st.median(r['c0_end'] - r['c0_dq'] for r in full):.0f}, after wg0 end {st.median(r['last'] - r['c0_end'] for r in full):.0f}")
# gaps between blocks on one SM (globaltimer ns)
by_sm = {}
for r in R:
    by_sm.setdefault(r["smid"], []).append(r)
gaps = []
for sm, rs in by_sm.items():
    rs.sort(key=lambda r: r["g0"])
    gaps += [b2["g0"] - b1["gend"] for b1, b2 in zip(rs, rs[1:])]
t0 = min(r["g0"] for r in R); t1 = max(r["gend"] for r in R)
busy = sum(r["gend"] - r["g0"] for r in R)
print(f"  kernel span {(t1 - t0) / 1e3:.1f} us on {len(by_sm)} SMs; SM busy {busy / (len(by_sm) * (t1 - t0)):.3f}; "
      f"gap between blocks median {st.median(gaps) if gaps else 0:.0f} ns (p10 {sorted(gaps)[len(gaps) // 10] if gaps else 0}, "
      f"p90 {sorted(gaps)[9 * len(gaps) // 10] if gaps else 0}); block median {st.median(r['gend'] - r['g0'] for r in R) / 1e3:.2f} us")
ends = sorted(max(r["gend"] for r in rs) for rs in by_sm.values())
print(f"  SM last-block ends: first {(ends[0] - t0) / 1e3:.1f} us, median {(ends[len(ends) // 2] - t0) / 1e3:.1f}, last {(ends[-1] - t0) / 1e3:.1f}")
