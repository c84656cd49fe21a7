# The SASS lines with the most warp-stall samples from an ncu source page CSV:
#   python3 benchmarks/dev/ncu_top.py source.csv [N]
import csv
import sys

rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head_i = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
head, body = rows[head_i], rows[head_i + 1:]
src = head.index("Source")
stall = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
extra = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != stall][:0]
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[stall]) for r in body if len(r) > stall)
print(f"total samples {total:.0f}; columns: {head[:8]}")
for r in sorted((r for r in body if len(r) > stall), key=lambda r: -num(r[stall]))[: int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
    print(f"{num(r[stall]) / total * 100:5.1f}%  {r[0]:>6}  {r[src][:110]}")
