#!/bin/bash
# The device call for prepared/alibi_whole_form.patch (TUNING 192; written in session 17, NOT run on a GPU): the SM80
# forward holds causal ALiBi in its whole form and shifts the LSE back to flash-attn's key-only one. Builds on the CPU
# first (stripped; both paths, d 128 / 160, bf16; ~6-8 min each on two cores):
#   FLASH_ATTN2_SM80=1 NAME=uAM D=128,160 bash benchmarks/dev/build_so.sh                          (main)
#   git worktree add /tmp/tA HEAD && (cd /tmp/tA && git apply benchmarks/dev/prepared/alibi_whole_form.patch)
#   FLASH_ATTN2_SM80=1 NAME=uAA D=128,160 bash benchmarks/dev/build_so.sh /tmp/tA
# then run(command="bash benchmarks/dev/prepared/alibi_whole_form.sh", carry=[".whl/uAM", ".whl/uAA"]), ~200 s:
# the LSE probe on both builds (main's SM80 causal errors 0.35-1.4e-3, the patch's should be ~1e-4 or less), the
# score-modifier tests on both paths with the patch (its new steep-slope test fails on main's SM80 path), and the
# SM80 ALiBi forward's time, main / patch interleaved (expected equal: the same per-score code, an FFMA a row more).
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/alibi_whole.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
for x in AM AA; do
  el "LSE probe u$x"
  PYTHONPATH=$R:$R/.whl/u$x timeout 60 python3 benchmarks/dev/alibi_lse_probe.py 128 160 2>&1 | sed "s/^/$x /" | tee -a $L
done
el "score-modifier tests, both paths (uAA; the steep-slope test also on uAM)"
PYTHONPATH=$R/.whl/uAA timeout 150 python3 -m pytest tests/test_score_mods.py -q -n 12 -p no:cacheprovider -rf 2>&1 | grep -E "^FAILED|passed|failed" | tail -8 | tee -a $L
FLASH_ATTN2_BACKEND=sm80 PYTHONPATH=$R/.whl/uAA timeout 150 python3 -m pytest tests/test_score_mods.py tests/test_window.py -q -n 12 -p no:cacheprovider -rf 2>&1 | grep -E "^FAILED|passed|failed" | tail -8 | tee -a $L
PYTHONPATH=$R/.whl/uAM timeout 60 python3 -m pytest tests/test_score_mods.py -k steep -q -n 12 -p no:cacheprovider 2>&1 | tail -1 | sed "s/^/main: /" | tee -a $L
el "SM80 ALiBi forward time (causal, 8k x 2, h 16, d 128), AM AA AM AA"
for x in AM AA AM AA; do
  FLASH_ATTN2_BACKEND=sm80 PYTHONPATH=$R:$R/.whl/u$x timeout 40 python3 - <<'PY' 2>&1 | sed "s/^/$x /" | tee -a $L
import torch, flash_attn2
q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
al = torch.rand(2, 16, device="cuda")
f = lambda: flash_attn2.flash_attn_func(q, k, v, causal=True, alibi_slopes=al)
for _ in range(20): f()
ts = []
for _ in range(30):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
print(f"fwd {sorted(ts)[len(ts) // 2]:.3f} ms")
PY
done
el done
