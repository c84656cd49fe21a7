#!/bin/bash
# The device call for prepared/bwd_wide_dq_first.patch (TUNING 193; written in session 17, NOT run on a GPU): in the
# wide backward's step tail at d 192 (one dQ part), dQ issued before dK and staged while dK runs, dO released once
# dV is done: 187's tail without its early dV (which 190 measured slower on MLA and d 256). Builds on the CPU first:
#   NAME=uWM D=192,256 bash benchmarks/dev/build_so.sh                                             (main)
#   git worktree add /tmp/tQ HEAD && (cd /tmp/tQ && git apply benchmarks/dev/prepared/bwd_wide_dq_first.patch)
#   NAME=uWT D=192,256 bash benchmarks/dev/build_so.sh /tmp/tQ
# then run(command="bash benchmarks/dev/prepared/bwd_wide_dq_first.sh", carry=[".whl/uWM", ".whl/uWT"]), ~250 s:
# MLA (192, 128) fwd_bwd and the d 192 / 256 backward, M T interleaved twice; tests, memcheck and racecheck on T.
VARIANTS="WM WT" exec bash "$(dirname "$0")/bwd_wide_dq64.sh"
