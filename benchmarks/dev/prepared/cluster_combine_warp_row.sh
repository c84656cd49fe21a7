#!/bin/bash
# The device call for prepared/cluster_combine_warp_row.patch (W; written in session 16, which had no device time
# left to run it). Builds on the CPU first, each carried stripped (~3 MB a d 128 build):
#   NAME=uK D=128 bash benchmarks/dev/build_so.sh                       (main)
#   git worktree add /tmp/tW HEAD && (cd /tmp/tW && git apply benchmarks/dev/prepared/cluster_combine_warp_row.patch)
#   NAME=uW D=128 bash benchmarks/dev/build_so.sh /tmp/tW; NAME=uV D=64,160,224,256 bash benchmarks/dev/build_so.sh /tmp/tW
# then run(command="bash benchmarks/dev/prepared/cluster_combine_warp_row.sh", carry=[".whl/uK", ".whl/uW", ".whl/uV"]),
# ~200 s: W's decode A/B against main (K W K W), then its tests at d 128 and at d 64 / 160 / 224 / 256 (with
# test_paged_prefill_many_tiles, extended to d 160-256 in session 15 and not yet run), and every head dim with the
# cluster combine forced.
export PYTHONUNBUFFERED=1; R=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; L=$OUT/callG.log
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $L
for round in 1 2; do for x in K W; do for shape in 32,8,128 64,8,128; do
  el "decode $shape $x round $round"
  PYTHONPATH=$R:$R/.whl/u$x IMPLS=flash_attn2 timeout 60 python3 benchmarks/dev/decode_time.py $shape 1,1024 1,2048 1,4096 4,1024 8,1024 2>&1 | grep -v "^#\|^gpu\|no cell" | sed "s/^/$x /" | tee -a $L
done; done; done
el "tests uW (d 128)"
PYTHONPATH=$R/.whl/uW timeout 100 python3 -m pytest tests/test_combine.py tests/test_kvcache.py tests/test_sinks.py -k "combine or cluster or splits or paged_prefill_many" -q -n 12 -p no:cacheprovider 2>&1 | tail -2 | tee -a $L
el "tests uV (d 64, 160, 224, 256)"
PYTHONPATH=$R/.whl/uV timeout 200 python3 -m pytest tests/test_combine.py tests/test_kvcache.py tests/test_sinks.py -k "combine or cluster or splits or paged_prefill_many or every_head_dim" -q -n 12 -p no:cacheprovider 2>&1 | tail -2 | tee -a $L
el "every head dim with the cluster combine forced (uV, uW)"
for x in V W; do FLASH_ATTN2_SPLIT_COMBINE=cluster PYTHONPATH=$R/.whl/u$x timeout 100 python3 -m pytest tests/test_kvcache.py -k "every_head_dim or decode_scores" -q -n 12 -p no:cacheprovider 2>&1 | tail -1 | tee -a $L; done
el done
