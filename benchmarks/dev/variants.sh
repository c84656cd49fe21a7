#!/bin/bash
# Variant directories for ab_sm90.sh from git refs, made here before a device call (the device gets no git
# history): benchmarks/dev/v_<ref with / as _>/ holds the ref's csrc/kernels/sm90/*.h. They are gitignored:
# pass them in the call's carry list. Prints VARIANTS=... Only the sm90 headers travel, unless FULL=1: then
# the ref's whole csrc/ and flash_attn2/ (for refs that change common files, build config or dispatch).
#   bash benchmarks/dev/variants.sh main wip/sm90-bwd-red
#   FULL=1 bash benchmarks/dev/variants.sh main wip/sm80-bwd-gqa-split
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dirs=()
for ref in "$@"; do
  dir=benchmarks/dev/v_${ref//\//_}
  rm -rf "$dir" && mkdir -p "$dir"
  if [ -n "${FULL:-}" ]; then
    git archive "$ref" csrc flash_attn2 | tar -x -C "$dir"
  else
    for f in $(git ls-tree --name-only "$ref" csrc/kernels/sm90/); do git show "$ref:$f" > "$dir/$(basename "$f")"; done
  fi
  dirs+=("$dir")
done
echo "VARIANTS=\"${dirs[*]}\""
