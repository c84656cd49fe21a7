#!/bin/bash
# If paged_ring.sh refutes Q again (TUNING 203-205; ran in session 20, TUNING 205): where the
# shared-memory entries' flat cost and 1 x 32k's pages-of-16 loss come from. One profiled narrow split launch a
# layout (benchmarks/dev/paged_ncu_one.py: two warm calls, then the profiled one), main (G) against the ring (Q):
# duration, executed instructions, issue-slot use and the warp states, then the per-source stall counters of the
# chunk loop (`--page source --csv`, the SASS lines most stalled).
#   run(command="bash benchmarks/dev/prepared/paged_ring_ncu.sh", carry=[".whl/uG", ".whl/uQ"]), ~150 s.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/paged_ring_ncu.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
SECTIONS="--section SpeedOfLight --section LaunchStats --section InstructionStats --section WarpStateStats"
for cell in "4096 contig" "4096 ident64" "4096 ident16" "32768 ident64" "32768 ident16"; do set -- $cell
  for x in G Q; do
    el "u$x CTX=$1 LAYOUT=$2"
    CTX=$1 LAYOUT=$2 PYTHONPATH=$R:$R/.whl/u$x timeout 60 ncu $SECTIONS -k regex:fwd_split_narrow --launch-skip 2 \
      --launch-count 1 python3 benchmarks/dev/paged_ncu_one.py 2>&1 \
      | grep -E "^ +(Duration|Executed Instructions |Issue Slots Busy|Warp Cycles Per Issued|Stall [A-Z][a-z ]+ +[a-z]|Registers Per|Dynamic Shared)" \
      | sed "s/^/$x $1 $2 /" | tee -a $L
  done
done
for x in G Q; do  # the chunk loop's most stalled SASS lines at 1 x 32k pages of 16
  el "u$x source counters, 1 x 32k ident16"
  CTX=32768 LAYOUT=ident16 PYTHONPATH=$R:$R/.whl/u$x timeout 90 ncu --set none --section SourceCounters \
    --section WarpStateStats -k regex:fwd_split_narrow --launch-skip 2 --launch-count 1 --import-source no \
    --page source --csv --print-source sass python3 benchmarks/dev/paged_ncu_one.py > $OUT/src_$x.csv 2>&1
  python3 - $OUT/src_$x.csv <<'PY' | sed "s/^/$x /" | tee -a $L
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 5]
head = next((i for i, r in enumerate(rows) if "Source" in r), None)
if head is None:
    print("no source page:", open(sys.argv[1], errors="replace").read()[-400:]); sys.exit()
cols = rows[head]; data = rows[head + 1:]
key = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
if key is None:
    print("columns:", cols[:12]); sys.exit()
k = cols.index(key); s = cols.index("Source")
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return 0.0
for r in sorted(data, key=lambda r: -num(r[k]))[:15]:
    print(f"{num(r[k]):8.0f}  {r[s][:90]}")
PY
done
el done
