#!/usr/bin/env bash
# DDP overlap across two simulated hosts (ci/cluster.sh 2 1 RATE): one rank per node, so the gradient all-reduce
# is wire time on the shaped link, not CPU copies on the cores backward uses. bench/ddp_overlap.py at several
# batch sizes (compute from well under to well over the communication), every report appended to
# bench/results/cluster_ddp_overlap.md with its command.
#
#   bench/cluster_ddp_overlap.sh                          # 1gbit, batches 128 256 384 512 (~5 min on 2 cores)
#   RATE=1gbit BATCHES="256 512" ITERS=20 bench/cluster_ddp_overlap.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/cluster_ddp_overlap.md}
RATE=${RATE:-1gbit}
BATCHES=${BATCHES:-"128 256 384 512"}
ITERS=${ITERS:-15}
WIDTH=${WIDTH:-1024}
PY=${PYTHON:-$PWD/.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
{
    echo "# DDP overlap across two hosts (simulated cluster, 2 nodes x 1 rank, $RATE)"
    echo
    echo "Reproduce with \`bench/cluster_ddp_overlap.sh\` (RATE=$RATE BATCHES=\"$BATCHES\" ITERS=$ITERS WIDTH=$WIDTH)."
    echo "Generated $(date -u '+%Y-%m-%d %H:%M UTC') on $(nproc) cores, $(uname -sr); load average before:"
    echo "$(cut -d' ' -f1-3 /proc/loadavg). Each section below is one run of bench/ddp_overlap.py, its command first."
} > "$tmp/report.md"
for batch in $BATCHES; do
    step="OMP_NUM_THREADS=1 mpiexec -n 2 $PY bench/ddp_overlap.py --width $WIDTH --batch $batch --iters $ITERS --out $tmp/run.md"
    echo "+ ci/cluster.sh 2 1 $RATE -- bash -c '$step'" >&2
    timeout 1200 ci/cluster.sh 2 1 "$RATE" -- bash -c "$step" >/dev/null
    {
        echo
        echo "## batch $batch rows per rank"
        echo
        echo "Command: \`ci/cluster.sh 2 1 $RATE -- bash -c '${step% --out *}'\`"
        echo
        sed -e '1,/^Command:/d' "$tmp/run.md"
    } >> "$tmp/report.md"
done
echo >> "$tmp/report.md"
echo "Load average after: $(cut -d' ' -f1-3 /proc/loadavg)." >> "$tmp/report.md"
mkdir -p "$(dirname "$OUT")"
cp "$tmp/report.md" "$OUT"
cat "$OUT"
