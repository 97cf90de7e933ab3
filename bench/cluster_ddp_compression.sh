#!/usr/bin/env bash
# DDP (or ENGINE=fsdp: FSDP, full_shard) gradient compression across two simulated hosts (ci/cluster.sh 2 1 RATE):
# mpcomm-train --engine ENGINE on the demo model, every --compression mode in MODES for STEPS steps, ROUNDS rounds
# interleaved (mode order rotated each round) inside one cluster; bench/ddp_compression.py writes the step times and
# losses to OUT.
#
#   bench/cluster_ddp_compression.sh                                   # 1gbit, 200 steps, 2 rounds
#   MODES="none auto" ROUNDS=3 bench/cluster_ddp_compression.sh
#   ENGINE=fsdp MODES="none int8 powersgd:4" OUT=bench/results/compression_fsdp.md bench/cluster_ddp_compression.sh
#   LOCAL=1 MODES="none auto" OUT=bench/results/compression_onehost.md bench/cluster_ddp_compression.sh  # one host
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:=bench/results/compression_ddp.md}" "${RATE:=1gbit}" "${ROUNDS:=2}" "${STEPS:=200}" "${ENGINE:=ddp}"
: "${MODES:=none auto int8 int8/no-ef powersgd:4 powersgd:4/no-ef}"
: "${MODEL:=--layers 2 --d-model 512 --d-hidden 2048 --global-batch 8 --dtype float32 --optimizer adam --lr 0.001}"
PY=${PYTHON:-$PWD/.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/run.sh" <<SH
set -e
modes=($MODES)
for round in \$(seq 1 $ROUNDS); do
    for k in \${!modes[@]}; do
        mode=\${modes[(k + round - 1) % \${#modes[@]}]}
        flags=""
        case "\$mode" in none) ;; */no-ef) flags="--compression \${mode%/no-ef} --no-error-feedback" ;;
            *) flags="--compression \$mode" ;; esac
        OMP_NUM_THREADS=1 timeout 900 mpiexec -n 2 $PY -m mpcomm.train --engine $ENGINE --steps $STEPS $MODEL \$flags \\
            --json "$tmp/\${mode//[:\/]/_}.r\$round.json" > /dev/null
        echo "round \$round \$mode done" >&2
    done
done
SH
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
if [ -n "${LOCAL:-}" ]; then
    where="one host"
    PATH="$(dirname "$PY"):$PATH" timeout 3000 bash "$tmp/run.sh"
else
    where="ci/cluster.sh 2 1 $RATE"
    timeout 3000 ci/cluster.sh 2 1 "$RATE" -- bash "$tmp/run.sh"
fi
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
engine_var=""
[ "$ENGINE" = ddp ] || engine_var="ENGINE=$ENGINE "
"$PY" bench/ddp_compression.py --where "$where" --command "${engine_var}MODES=\"$MODES\" ROUNDS=$ROUNDS STEPS=$STEPS \
MODEL=\"$MODEL\"${LOCAL:+ LOCAL=1} RATE=$RATE bench/cluster_ddp_compression.sh" --load-before "$load_before" \
    --load-after "$load_after" --modes "$MODES" "$tmp"/*.json > "$OUT"
cat "$OUT"
