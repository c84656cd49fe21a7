#!/bin/bash
# A/B/... timing of whole wheels, no build: WHEELS="path ..." (carried in .whl/ or just built under $OUT/wheel), each
# unpacked into /tmp/ab_<i> and named A, B, ... in that order; CASES as time_fwd.py takes them; ROUNDS processes
# each, the order rotated. Run from the repository root; prints the sorted timings.
#   WHEELS=".whl/adb87eb/*.whl $OUT/wheel/*.whl" CASES="128,0,512,bwd 64,1,2048,bwd" bash benchmarks/dev/ab_wheels.sh
set -uo pipefail
root=$(pwd); names=()
for w in ${WHEELS:?}; do
  w=$(readlink -f "$w")  # unpacked from inside /tmp/ab_<name>: a relative path would name nothing there
  name=$(printf "\\x$(printf %x $((65 + ${#names[@]})))")
  rm -rf /tmp/ab_$name && mkdir -p /tmp/ab_$name && (cd /tmp/ab_$name && python3 -m zipfile -e "$w" .) || exit 1
  # The tree's benchmark modules on every side: time_fwd.py imports them, and a wheel from before #46 has none.
  rm -rf /tmp/ab_$name/flash_attn2/bench && cp -r flash_attn2/bench /tmp/ab_$name/flash_attn2/
  echo "$name = $w"; names+=($name)
done
cd /tmp  # the repository root would shadow the unpacked packages
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
  for i in "${!names[@]}"; do
    x=${names[$(( (i + round) % ${#names[@]} ))]}
    PYTHONPATH=/tmp/ab_$x python3 $root/benchmarks/dev/time_fwd.py ${CASES:-128,0,2048} | sed "s/^/$x /"
  done
done | sort -s -k2,4
