# flash_attn2 / sdpa_cudnn ratios of a grid CSV: python benchmarks/dev/ratios.py benchmarks/results/<gpu>.csv
import csv, collections, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
d = collections.defaultdict(dict)
for r in rows:
    d[(r['dtype'], int(r['hdim']), r['causal'], int(r['seqlen']))][r['impl']] = float(r['tflops'])
def gm(x): return math.exp(sum(map(math.log, x)) / len(x))
by = collections.defaultdict(list); allr = []
for k, v in sorted(d.items()):
    if 'sdpa_cudnn' in v and 'flash_attn2' in v:
        r = v['flash_attn2'] / v['sdpa_cudnn']; by[k[3]].append(r); allr.append((r, k))
print("geomean", round(gm([r for r, _ in allr]), 3), "by seqlen", {s: round(gm(x), 3) for s, x in sorted(by.items())})
print(">=4k geomean", round(gm([r for r, k in allr if k[3] >= 4096]), 3), "min", min((r, k) for r, k in allr if k[3] >= 4096))
print("below 0.9:", [(k, round(r, 3)) for r, k in sorted(allr) if r < 0.9])
