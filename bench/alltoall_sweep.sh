#!/usr/bin/env bash
# all-to-all (equal blocks) sweeps of mpcomm-bench: pairwise vs bruck vs native, auto and the raw mpi4py Alltoall,
# float32, --check on, at p=2 and p=4, 8 B .. 64 MiB (x4); then per size every algorithm's time, what auto chose
# and its ratio to the best fixed algorithm (bench/auto_vs_best.py --times).
# Writes $OUT/alltoall_p<P>.json (rows), .png (busbw vs size), .txt (the table) and $OUT/alltoall.md.
#
#   bench/alltoall_sweep.sh                                 # the timed sweep (run it alone on a quiet machine)
#   OUT=/tmp/a2a MAXBYTES=1K RANKS="2" bench/alltoall_sweep.sh   # a toy run that only checks that it works
#   MPIEXEC="mpirun" bench/alltoall_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
MINBYTES=${MINBYTES:-8}
MAXBYTES=${MAXBYTES:-64M}
RANKS=${RANKS:-2 4}
mkdir -p "$OUT"
# every registered algorithm + auto is mpcomm-bench's default; -n is an upper bound (blocks of 10 ms or 200 calls)
COMMON=(--op alltoall -b "$MINBYTES" -e "$MAXBYTES" -f 4 -w 5 -n 200 --budget 0.5 --rounds 5 --dtype float32 --check)

load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
commands=() names=() files=()
for p in $RANKS; do
  name=alltoall_p$p
  cmd=("$MPIEXEC" -n "$p" "$PYTHON" -m mpcomm.bench "${COMMON[@]}" --json "$OUT/$name.json")
  "$PYTHON" -c "import matplotlib" 2>/dev/null && cmd+=(--plot "$OUT/$name.png")
  commands+=("timeout 1800 ${cmd[*]}")
  names+=("$name")
  files+=("$OUT/$name.json")
  echo "+ ${cmd[*]}" >&2
  timeout 1800 "${cmd[@]}" | tee "$OUT/$name.txt"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

{
  echo "# mpcomm-bench alltoall: pairwise vs bruck vs native, and what auto picks"
  echo
  echo "Reproduce with \`bench/alltoall_sweep.sh\` (repository root, venv active). Generated $(date -u '+%Y-%m-%d %H:%M UTC')."
  echo
  echo "Machine: $(nproc) cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), $(uname -sr)."
  echo "Load average (1/5/15 min) before: $load_before, after: $load_after (the sweep's own ranks count; a load above"
  echo "the core count before it means other jobs shared the cores). More ranks than cores oversubscribe them."
  echo "size: one rank's send buffer (p blocks); busbw = algbw * (p-1)/p, as nccl-tests' alltoall_perf."
  echo
  echo "Commands:"
  echo
  echo '```'
  printf '%s\n' "${commands[@]}"
  echo '```'
  echo
  echo "## Time per call (us) per algorithm, auto's choice and auto / best fixed (\`python bench/auto_vs_best.py --times\`)"
  echo
  "$PYTHON" bench/auto_vs_best.py --times "${files[@]}"
  for name in "${names[@]}"; do
    echo
    echo "## $name"
    echo
    echo "rows: [$name.json]($name.json)"
    echo
    echo '```'
    cat "$OUT/$name.txt"
    echo '```'
  done
} > "$OUT/alltoall.md"
echo "wrote $OUT/alltoall.md" >&2
