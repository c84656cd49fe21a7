"""sass_compare.py BASE TREE [TU ...]: per TU (the NAME.sass / NAME.res pairs cuobjdump wrote into both directories,
sass_diff.sh's), are the kernels' SASS identical? Kernels are matched by body (instruction text, addresses and
encodings dropped) and resource line, so renamed types do not count. For the kernels left unmatched, paired by name
order, the opcodes that differ (a reordered schedule counts, a renamed register does not) and both resource lines."""
import collections, difflib, hashlib, os, re, sys
base, tree = sys.argv[1:3]
tus = sys.argv[3:] or sorted(f[:-5] for f in os.listdir(tree) if f.endswith(".sass"))
def kernels(path):
    out, name = {}, None
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1); out[name] = []
        elif name and re.match(r"\s+/\*[0-9a-f]+\*/", line):
            ins = re.sub(r"^\s+/\*[0-9a-f]+\*/\s*", "", line)
            ins = re.sub(r"/\*.*?\*/", "", ins).strip()
            if ins:
                out[name].append(ins)
    return out
def res(path):
    text = open(path).read()
    return {m.group(1): re.sub(r"\s+", " ", m.group(2)) for m in re.finditer(r"Function (\S+):\s*\n(.*)", text)}
total_same = total = 0
for tu in tus:
    if not os.path.exists(f"{base}/{tu}.sass"):
        print(f"{tu}: no base"); continue
    b, t = kernels(f"{base}/{tu}.sass"), kernels(f"{tree}/{tu}.sass")
    rb, rt = res(f"{base}/{tu}.res"), res(f"{tree}/{tu}.res")
    h = lambda body: hashlib.sha1("\n".join(body).encode()).hexdigest()
    bb = collections.Counter((h(v), rb.get(k)) for k, v in b.items())
    tt = collections.Counter((h(v), rt.get(k)) for k, v in t.items())
    same = sum((bb & tt).values())
    total_same += same; total += len(b)
    status = "identical" if bb == tt else "DIFFERENT"
    print(f"{tu}: {len(b)} -> {len(t)} kernels, {same} identical (body and resources): {status}")
    if bb != tt:
        # pair the unmatched by name order and show opcode-level differences
        ub = [k for k in b if (h(b[k]), rb.get(k)) not in tt]
        ut = [k for k in t if (h(t[k]), rt.get(k)) not in bb]
        for kb, kt in zip(sorted(ub), sorted(ut)):
            ob = [i.split()[0] if not i.startswith("@") else i.split()[1] for i in b[kb]]
            ot = [i.split()[0] if not i.startswith("@") else i.split()[1] for i in t[kt]]
            sm = difflib.SequenceMatcher(None, ob, ot, autojunk=False)
            moved = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal")
            print(f"   {len(ob)} -> {len(ot)} instructions, {moved} opcodes differ; {rb.get(kb)} -> {rt.get(kt)}\n     {kb[:150]}")
print(f"total: {total_same} of {total} base kernels identical")
