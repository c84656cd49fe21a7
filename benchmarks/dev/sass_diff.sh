#!/bin/bash
# On the CPU machine: did a change move the Hopper kernels' code? Compiles instantiation TUs (default: the d 64 bf16
# forward and the d 128 bf16 backward) from REV's csrc and from the working tree's, for sm_90a, and prints per kernel
# the instruction counts, how many opcodes of the sequence differ (predicates and operands dropped, so a changed
# register or address does not count, a reordered schedule does) and the stack frames. TUNING 114: a cold-path helper
# re-laid the d 64 forward's hot loop (1-3% slower) with no test or spill warning to show it; 0 differing opcodes in
# the plain kernels means the change cannot have moved their timing.
#   bash benchmarks/dev/sass_diff.sh [REV (default HEAD)] [csrc/instantiations/<tu>.cu ...]
# About 3 minutes per TU on two cores (the two trees' compiles run at once). Needs cuobjdump (the
# nvidia-cuda-cuobjdump wheel puts it under site-packages/nvidia/cu13/bin, searched below).
set -euo pipefail
REV=${1:-HEAD}; shift || true
TUS=${*:-csrc/instantiations/fwd_hdim64_bf16_sm90.cu csrc/instantiations/bwd_hdim128_bf16_sm90.cu}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SP=$(python3 -c "import cutlass_library, os; print(os.path.dirname(os.path.dirname(cutlass_library.__file__)))")
export PATH=$PATH:$CUDA_HOME/bin:$SP/nvidia/cu13/bin
command -v cuobjdump > /dev/null || { echo "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"; exit 1; }
W=$(mktemp -d /tmp/sass_diff.XXXX)
mkdir -p $W/base $W/tree
git archive "$REV" csrc | tar -x -C $W/base
cp -r csrc $W/tree/
compile() {  # $1: tree dir, $2: TU
  (cd $1 && $CUDA_HOME/bin/nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG -gencode=arch=compute_90a,code=sm_90a \
    -Icsrc/include -Icsrc/kernels -Icsrc -I$SP/cutlass_library/source/include -I$SP/nvidia/cu13/include \
    -c $2 -o $(basename $2 .cu).o > $(basename $2 .cu).log 2>&1) || { tail -20 $1/$(basename $2 .cu).log; return 1; }
}
for tu in $TUS; do
  compile $W/base $tu & compile $W/tree $tu & wait
  o=$(basename $tu .cu).o
  for side in base tree; do
    cuobjdump -sass $W/$side/$o > $W/$side/$o.sass
    cuobjdump -res-usage $W/$side/$o > $W/$side/$o.res
  done
  python3 - "$W" "$o" <<'EOF'
import difflib, re, sys
w, o = sys.argv[1:]
def kernels(side):
    out, name = {}, None
    for line in open(f"{w}/{side}/{o}.sass"):
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1); out[name] = []
        elif name and re.match(r"\s+/\*[0-9a-f]+\*/", line):
            ins = re.sub(r"^\s+/\*[0-9a-f]+\*/\s*", "", line).split(";")[0].split()
            if ins:
                out[name].append(ins[1] if ins[0].startswith("@") and len(ins) > 1 else ins[0])
    return out
def stacks(side):
    text = open(f"{w}/{side}/{o}.res").read()
    return dict(re.findall(r"Function (\S+):\s*\n\s*REG:\d+ STACK:(\d+)", text))
base, tree, sb, st = kernels("base"), kernels("tree"), stacks("base"), stacks("tree")
print(f"== {o}")
for name in sorted(set(base) | set(tree)):
    short = re.sub(r"EEEvNS_\d+\w+ArgsSm90IT_EE$", "", re.sub(r"^_ZN11flash_attn2\d+", "", name))[-80:]
    if name not in base or name not in tree:
        print(f"  only in {'tree' if name in tree else 'base'}: {short}"); continue
    sm = difflib.SequenceMatcher(None, base[name], tree[name], autojunk=False)
    moved = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal")
    print(f"  {len(base[name]):6d} -> {len(tree[name]):6d} instructions, {moved:5d} opcodes differ, "
          f"stack {sb.get(name, '?')} -> {st.get(name, '?')} B: {short}")
EOF
done
rm -rf $W
