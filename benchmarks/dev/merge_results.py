# Replaces the rows of the given passes in a committed results CSV by a new run's (one or more CSVs of the
# same kind, e.g. bench_bwd's per-head-dim files), keeps the other passes' rows and those of implementations the
# new run did not time (the forward grid stage times no sdpa_flash), and redraws the plot:
#   python benchmarks/dev/merge_results.py grid|models benchmarks/results/<gpu>.csv "bwd fwd_bwd" NEW.csv [...]
# decode: a decode suite run in parts (flash_attn2.bench.decode by --shapes, each part its own --name): the parts'
# rows replace the target's rows of the same cell (impl, heads, layout, batch, ctx); the target may not exist yet;
# the plot redrawn and the summary printed:
#   python benchmarks/dev/merge_results.py decode benchmarks/results/<gpu>_decode_suite.csv - PART.csv [...]
import csv, os, sys
kind, target, passes, new_files = sys.argv[1], sys.argv[2], set(sys.argv[3].split()), sys.argv[4:]
if kind == "decode":
    from flash_attn2.bench.decode import plot, summary
    key_cols = ("impl", "heads", "heads_k", "hdim", "page", "batch", "ctx")
    old = list(csv.DictReader(open(target))) if os.path.exists(target) else []
    new = [r for f in new_files for r in csv.DictReader(open(f))]
    fields = list((old or new)[0].keys())
    assert new and all(list(r.keys()) == fields for r in new), "new rows missing or with other columns"
    replaced = {tuple(r[c] for c in key_cols) for r in new}
    rows = [r for r in old if tuple(r[c] for c in key_cols) not in replaced] + new
    with open(target, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n"); w.writeheader(); w.writerows(rows)
    ints, floats = ("heads", "heads_k", "hdim", "page", "batch", "ctx"), ("us_eager", "us_graph", "gbps", "pct_copy")
    typed = [dict(r, **{c: int(r[c]) for c in ints}, **{c: float(r[c]) for c in floats}) for r in rows]
    try:
        plot(typed, target[:-4] + ".png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(summary(typed))
    print(f"{target}: {len(old)} -> {len(rows)} rows, {len(new)} new")
    sys.exit(0)
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
