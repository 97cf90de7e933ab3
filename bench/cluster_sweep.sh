#!/usr/bin/env bash
# Benchmarks on simulated clusters (ci/cluster.sh), written to bench/results/cluster.md with their commands:
#  1. the payload rate of one node's link (bench/cluster_link.py, raw mpi4py, both directions at once);
#  2. the all-reduce sweep: mpcomm-bench over every algorithm + native + auto (no tune(): auto decides from its
#     cost model and the network its communicator measured), --check on; bench/cluster_report.py adds the
#     link-bound column (the time the NIC alone needs for the 2(N-1)/N n bytes each node must send);
#  3. auto's choice against the best, every algorithm timed call by call, interleaved (bench/cluster_auto_check.py);
#  4. bytes per NIC of FSDP full_shard against hybrid_shard (bench/cluster_fsdp_bytes.py).
#
#   bench/cluster_sweep.sh                   # 2x2 and 4x1 at 1gbit (~25 min on 2 cores)
#   SHAPES="2x2" RATE=1gbit REPS=30 bench/cluster_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
RATE=${RATE:-1gbit}
SHAPES=${SHAPES:-"2x2 4x1"}
REPS=${REPS:-20}
PY=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$OUT"
# Each point: >= 2 warm-up calls, then 3 round-robin rounds of blocks of at most 20 calls / 1 s of calls.
BENCH=(--op allreduce --algorithms ring,ring_pipelined,tree,rhd,hierarchical,native,auto -b 64K -e 64M -f 4
       -w 2 -n 20 --budget 3 --rounds 3 --dtype float32 --redop sum --check)
commands=() sweeps=() checks=() fsdp=()
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for shape in $SHAPES; do
    nodes=${shape%x*} rpn=${shape#*x} p=$((${shape%x*} * ${shape#*x}))
    name=cluster_allreduce_$shape
    run=(ci/cluster.sh "$nodes" "$rpn" "$RATE" --)
    steps=(
        "mpiexec -n $p $PY bench/cluster_link.py --json $OUT/$name.link.json"
        "mpiexec -n $p $PY -m mpcomm.bench ${BENCH[*]} --json $OUT/$name.json | tee $OUT/$name.txt"
        "mpiexec -n $p $PY bench/cluster_auto_check.py --reps $REPS --out $OUT/cluster_auto_check_$shape.md"
        "mpiexec -n $p $PY bench/cluster_fsdp_bytes.py --out $OUT/cluster_fsdp_bytes_$shape.md"
    )
    for step in "${steps[@]}"; do
        commands+=("timeout 3000 ${run[*]} bash -o pipefail -c '$step'")
        echo "+ ${commands[-1]}" >&2
        timeout 3000 "${run[@]}" bash -o pipefail -c "$step"
    done
    sweeps+=("$OUT/$name.json") checks+=("$OUT/cluster_auto_check_$shape.md") fsdp+=("$OUT/cluster_fsdp_bytes_$shape.md")
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

{
    echo "# mpcomm on a simulated cluster (ci/cluster.sh)"
    echo
    echo "Reproduce with \`bench/cluster_sweep.sh\` (repository root). Generated $(date -u '+%Y-%m-%d %H:%M UTC') on"
    echo "$(nproc) cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), $(uname -sr); links $RATE."
    echo "Load average (1/5/15 min) before: $load_before, after: $load_after, on $(nproc) cores (the cluster's own"
    echo "busy-polling ranks count too; a load above the core count before the run means other jobs shared the"
    echo "cores). Every rank of every node runs on these cores: on a loaded machine each step of an all-reduce waits"
    echo "for the scheduler, which swamps the sizes that need well under a millisecond of CPU (64 KiB-1 MiB; at load"
    echo "9-12 the same algorithm timed twice there differed by up to 2x). Below 128 KiB a message fits in the tbf"
    echo "burst allowance of the link and passes at the veth's own speed, so the smallest sizes are latency-bound."
    echo
    echo "Commands:"
    echo
    echo '```'
    printf '%s\n' "${commands[@]}"
    echo '```'
    echo
    echo "## All-reduce sweeps (mpcomm-bench), link bound"
    echo
    "$PY" bench/cluster_report.py "${sweeps[@]}"
    echo "## auto's choice against the best (interleaved calls, min / median)"
    for f in "${checks[@]}"; do echo; echo "### $(basename "$f" .md)"; echo; cat "$f"; done
    echo
    echo "## FSDP: bytes per NIC, full_shard against hybrid_shard"
    for f in "${fsdp[@]}"; do echo; echo "### $(basename "$f" .md)"; echo; cat "$f"; done
} > "$OUT/cluster.md"
echo "wrote $OUT/cluster.md" >&2
