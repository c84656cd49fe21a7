# Replaces the rows of the given passes in a committed results CSV by a new run's (one or more CSVs of the
# same kind, e.g. bench_bwd's per-head-dim files), keeps the other passes' rows and those of implementations the
# new run did not time (the forward grid stage times no sdpa_flash), and redraws the plot:
#   python benchmarks/dev/merge_results.py grid|models benchmarks/results/<gpu>.csv "bwd fwd_bwd" NEW.csv [...]
import csv, sys
kind, target, passes, new_files = sys.argv[1], sys.argv[2], set(sys.argv[3].split()), sys.argv[4:]
old = list(csv.DictReader(open(target)))
fields = list(old[0].keys())
new = [r for f in new_files for r in csv.DictReader(open(f)) if r["pass"] in passes]
assert new and all(list(r.keys()) == fields for r in new), "new rows missing or with other columns"
replaced = {(r["impl"], r["pass"]) for r in new}
rows = [r for r in old if (r["impl"], r["pass"]) not in replaced] + new
with open(target, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n"); w.writeheader(); w.writerows(rows)
typed = [dict(r, tflops=float(r["tflops"]), hdim=int(r["hdim"]), causal=r["causal"] == "True") for r in rows]
if kind == "grid":
    from flash_attn2.bench.grid import plot
    plot([dict(r, seqlen=int(r["seqlen"])) for r in typed], target[:-4] + ".png")
else:
    from flash_attn2.bench.models import plot
    plot(typed, target[:-4] + ".png")
print(f"{target}: {len(old)} -> {len(rows)} rows, {len(new)} new ({sorted(passes)})")
