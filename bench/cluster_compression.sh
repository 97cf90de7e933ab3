#!/usr/bin/env bash
# Compressed all-reduce (issue 29) on the simulated cluster at RATE (default 1gbit), written to bench/results/:
#  1. per shape (2x1, 2x2): the link's payload rate (bench/cluster_link.py), then REPS runs of a 64 MiB float32
#     all-reduce, float32 (auto, native, raw mpi4py) and --wire bf16,fp16,int8 interleaved in every run, --check on;
#  2. 2x1: a size sweep 16 KiB..16 MiB of the same rows (where a wire starts to pay);
#  3. one host, p = 2, no cluster: the same 64 MiB rows (what a wire costs where nothing crosses a network).
# bench/compression_report.py makes the tables. Run the whole script under the timing lock (one timing job at a time):
#   flock /tmp/bench.lock bench/cluster_compression.sh            # ~10 min on 2 quiet cores
# PARTS picks the steps (default "shapes sweep onehost"), NAME the files' prefix (default compression), e.g. the
# 64 MiB points only, 3 repeats, into bench/results/pipelined_2x1_1.json ...:
#   flock /tmp/bench.lock env PARTS=shapes NAME=pipelined bench/cluster_compression.sh     # ~2 min
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
RATE=${RATE:-1gbit}
REPS=${REPS:-3}
PARTS=${PARTS:-shapes sweep onehost}
NAME=${NAME:-compression}
PY=${PYTHON:-$PWD/.venv/bin/python}
ROWS=(--op allreduce --algorithms auto --wire bf16,fp16,int8 -w 1 -n 5 --budget 3 --rounds 3 --check)
run() { echo "+ $*" >&2; echo "    uptime: $(uptime)" >&2; timeout 900 "$@"; }
for shape in $([[ $PARTS == *shapes* ]] && echo 2x1 2x2); do
    nodes=${shape%x*} rpn=${shape#*x} p=$((${shape%x*} * ${shape#*x}))
    cluster=(ci/cluster.sh "$nodes" "$rpn" "$RATE" --)
    run "${cluster[@]}" bash -c "mpiexec -n $p $PY bench/cluster_link.py --json $OUT/${NAME}_$shape.link.json"
    for rep in $(seq "$REPS"); do
        run "${cluster[@]}" bash -o pipefail -c "mpiexec -n $p $PY -m mpcomm.bench ${ROWS[*]} -b 64M -e 64M \
            --json $OUT/${NAME}_${shape}_$rep.json"
    done
done
[[ $PARTS == *sweep* ]] && run ci/cluster.sh 2 1 "$RATE" -- bash -o pipefail -c "mpiexec -n 2 $PY -m mpcomm.bench ${ROWS[*]} -b 16K -e 16M -f 4 \
    --json $OUT/${NAME}_2x1_sweep.json"
for rep in $([[ $PARTS == *onehost* ]] && seq "$REPS"); do
    run .venv/bin/mpiexec -n 2 "$PY" -m mpcomm.bench "${ROWS[@]}" -b 64M -e 64M --json "$OUT/${NAME}_onehost_$rep.json"
done
echo "    uptime: $(uptime)" >&2
