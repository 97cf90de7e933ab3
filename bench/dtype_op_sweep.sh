#!/usr/bin/env bash
# Every dtype and reduction op of the all-reduce (mpcomm-bench --dtype all --redop all), every algorithm + auto, raw
# mpi4py and native as baselines, --check on, at p=2 and p=4: 8 B .. 16 MiB (x8) and 64 MiB. Then, per (dtype, op)
# and size, auto / the best fixed algorithm and the best time / float32 sum's (bench/dtype_op_sweep.py).
# Writes $OUT/dtype_op_p<P>.json and _64M.json (rows), .txt (the tables) and $OUT/dtype_op.md.
#
#   flock /tmp/bench.lock bench/dtype_op_sweep.sh              # the timed sweep (alone on the machine)
#   OUT=/tmp/d MAXBYTES=1K BIG= RANKS="2" bench/dtype_op_sweep.sh  # a toy run that only checks that it works
#   RANKS=4 STEP=16 BIG_DTYPES=float16,bfloat16,float32,float64 ... # coarser sizes, 64 MiB for the floats only
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
MAXBYTES=${MAXBYTES:-16M}
BIG=${BIG-64M}
RANKS=${RANKS:-2 4}
STEP=${STEP:-8}
BIG_DTYPES=${BIG_DTYPES:-all}
mkdir -p "$OUT"
COMMON=(--op allreduce -w 2 -n 100 --budget 0.15 --rounds 3 --redop all --check)

load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
commands=()
run() {  # run NAME P [range flags...]
  local name=$1 p=$2; shift 2
  local cmd=("$MPIEXEC" -n "$p" "$PYTHON" -m mpcomm.bench "${COMMON[@]}" "$@" --json "$OUT/$name.json")
  commands+=("timeout 3000 ${cmd[*]}")
  echo "+ ${cmd[*]}" >&2
  timeout 3000 "${cmd[@]}" > "$OUT/$name.txt"
}
for p in $RANKS; do
  run "dtype_op_p$p" "$p" --dtype all -b 8 -e "$MAXBYTES" -f "$STEP"
  [ -n "$BIG" ] && run "dtype_op_p${p}_$BIG" "$p" --dtype "$BIG_DTYPES" -b "$BIG" -e "$BIG"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

{
  echo "# Every dtype and op of the all-reduce: auto against the best fixed algorithm, and time against float32 sum"
  echo
  echo "Reproduce with \`flock /tmp/bench.lock bench/dtype_op_sweep.sh\` (repository root, venv active). Generated"
  echo "$(date -u '+%Y-%m-%d %H:%M UTC') with $("$PYTHON" -c 'import mpcomm.info as i; print(i.describe())' 2>/dev/null || echo '?')."
  echo
  echo "Machine: $(nproc) cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), $(uname -sr)."
  echo "Load average (1/5/15 min) before: $load_before, after: $load_after (a load above the core count means other"
  echo "jobs shared the cores: times are inflated and scattered, small sizes most). p = 4 oversubscribes the 2 cores."
  printf '\nCommands:\n\n```\n%s\n```\n' "$(printf '%s\n' "${commands[@]}")"
  for p in $RANKS; do
    echo
    echo "## p = $p"
    echo
    files=("$OUT/dtype_op_p$p.json")
    [ -n "$BIG" ] && files+=("$OUT/dtype_op_p${p}_$BIG.json")
    "$PYTHON" bench/dtype_op_sweep.py "${files[@]}"
  done
} > "$OUT/dtype_op.md"
echo "wrote $OUT/dtype_op.md" >&2
