#!/usr/bin/env bash
# The all-reduce sweep on simulated clusters (ci/cluster.sh), with the link-bound column: for each shape, the
# payload rate of one node's link (bench/cluster_link.py, raw mpi4py), then mpcomm-bench over every algorithm
# + native + auto (no tune(): auto decides from its cost model and the network it measured), --check on.
# bench/cluster_report.py turns the rows into bench/results/cluster_allreduce.md (auto vs best, best vs link).
#
#   bench/cluster_sweep.sh                   # 2x2 and 4x1 at 1gbit
#   SHAPES="2x2" RATE=1gbit bench/cluster_sweep.sh
#   TAG=_quiet bench/cluster_sweep.sh        # another set of result files (cluster_allreduce_2x2_quiet.json, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
RATE=${RATE:-1gbit}
SHAPES=${SHAPES:-"2x2 4x1"}
TAG=${TAG:-}
PY=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$OUT"
# Each point: >= 2 warm-up calls, then 3 round-robin rounds of blocks of at most 20 calls / 3 s of calls.
BENCH=(--op allreduce --algorithms ring,ring_pipelined,tree,rhd,hierarchical,native,auto -b 64K -e 64M -f 4
       -w 2 -n 20 --budget 3 --rounds 3 --dtype float32 --redop sum --check)
inputs=()
for shape in $SHAPES; do
    nodes=${shape%x*} rpn=${shape#*x}
    name=cluster_allreduce_${shape}${TAG}
    cmd="ci/cluster.sh $nodes $rpn $RATE -- sh -c 'mpiexec -n $((nodes * rpn)) $PY bench/cluster_link.py --json $OUT/$name.link.json && mpiexec -n $((nodes * rpn)) $PY -m mpcomm.bench ${BENCH[*]} --json $OUT/$name.json'"
    echo "+ $cmd" >&2
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    timeout 3000 bash -c "$cmd" | tee "$OUT/$name.txt"
    load_after=$(cut -d' ' -f1-3 /proc/loadavg)
    printf '# command: %s\n# load average (1/5/15 min) before: %s, after: %s; %s cores\n' "$cmd" "$load_before" \
        "$load_after" "$(nproc)" >> "$OUT/$name.txt"
    inputs+=("$OUT/$name.json")
done
"$PY" bench/cluster_report.py "${inputs[@]}"
