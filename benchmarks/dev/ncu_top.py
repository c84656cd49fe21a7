# Where the warps of one kernel stall, from an ncu source-page CSV (ncu -i R --page source --csv
# --print-source sass > F):
#   python3 benchmarks/dev/ncu_top.py F [N]
# prints the stall reasons over all samples, the N SASS lines with the most samples (with their top
# reasons), and the opcode mix of the hottest loop (the instructions executed most often, all equally).
import collections
import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head_i = next(i for i, r in enumerate(rows) if "Source" in r)
head, body = rows[head_i], [r for r in rows[head_i + 1:] if len(r) > 2]
col = {c: i for i, c in enumerate(head)}
samples, executed = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
reasons = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
base = int(body[0][0], 16)
total = sum(num(r[samples]) for r in body) or 1.0

by_reason = collections.Counter({c[6:]: sum(num(r[col[c]]) for r in body) for c in reasons})
print("stall reasons: " + ", ".join(f"{c} {v / total * 100:.1f}%" for c, v in by_reason.most_common(10)))
for r in sorted(body, key=lambda r: -num(r[samples]))[: int(sys.argv[2]) if len(sys.argv) > 2 else 30]:
    top = sorted(((num(r[col[c]]), c[6:]) for c in reasons), reverse=True)[:2]
    why = " ".join(f"{c} {v / total * 100:.1f}" for v, c in top if v)
    print(f"{num(r[samples]) / total * 100:5.1f}% {int(r[0], 16) - base:6x}  {r[col['Source']].strip()[:70]:70s} {why}")

hot = max(num(r[executed]) for r in body)
loop = [r for r in body if num(r[executed]) == hot]
ops = collections.Counter(r[col["Source"]].split()[1 if r[col["Source"]].split()[0].startswith("@") else 0].split(".")[0]
                          for r in loop)
print(f"hottest loop: {len(loop)} instructions per warp and pass, {sum(num(r[samples]) for r in loop) / total * 100:.1f}% "
      "of samples; " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
