#!/bin/bash
# Variant directories for ab_sm90.sh from git refs, made here before a device call (the device gets no git
# history): benchmarks/dev/v_<ref with / as _>/ holds the ref's csrc/kernels/sm90/*.h. They are gitignored:
# pass them in the call's carry list. Prints VARIANTS=... Only the sm90 headers travel: a ref that changes
# other files (e.g. wip/sm90-bwd-gqa-split's workspace size in dispatch.cpp) must be the working tree.
#   bash benchmarks/dev/variants.sh main wip/sm90-bwd-red
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dirs=()
for ref in "$@"; do
  dir=benchmarks/dev/v_${ref//\//_}
  rm -rf "$dir" && mkdir -p "$dir"
  for f in $(git ls-tree --name-only "$ref" csrc/kernels/sm90/); do git show "$ref:$f" > "$dir/$(basename "$f")"; done
  dirs+=("$dir")
done
echo "VARIANTS=\"${dirs[*]}\""
