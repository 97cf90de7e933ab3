#!/usr/bin/env bash
# Reproduces bench/results/: mpcomm-bench all-reduce sweeps (float32, sum, every registered algorithm + auto,
# native as the vs_native baseline, --check on) at p=2 and p=4, plus p=4 as 2 simulated nodes of 2 ranks.
# Writes <name>.json (rows), <name>.png (busbw vs size), <name>.txt (the table) and README.md.
#
#   bench/sweep.sh                 # uses the mpiexec on PATH (the venv's MPICH wheel)
#   MPIEXEC="mpirun" bench/sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
# -n is an upper bound: each point runs at most 200 timed calls within --budget seconds (>= 1 call)
COMMON=(--op allreduce -b 8 -e 64M -f 4 -w 5 -n 200 --budget 0.5 --rounds 5 --dtype float32 --redop sum --check)

load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
commands=()
run() {  # run NAME P [extra flags...]
  local name=$1 p=$2; shift 2
  local cmd=("$MPIEXEC" -n "$p" "$PYTHON" -m mpcomm.bench "${COMMON[@]}" "$@" --json "$OUT/$name.json" --plot "$OUT/$name.png")
  commands+=("timeout 900 ${cmd[*]}")
  echo "+ ${cmd[*]}" >&2
  timeout 900 "${cmd[@]}" | tee "$OUT/$name.txt"
}

run allreduce_p2 2
run allreduce_p2_tuned 2 --tune
run allreduce_p4 4
run allreduce_p4_2nodes 4 --ranks-per-node 2
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

{
  echo "# mpcomm-bench results"
  echo
  echo "Reproduce with \`bench/sweep.sh\` (from the repository root, venv active). Generated $(date -u '+%Y-%m-%d %H:%M UTC')."
  echo
  echo "Machine: $(nproc) cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), $(uname -sr)."
  echo "p=2 uses both cores; **p=4 oversubscribes them (2 ranks per core)**, and the \"2 nodes\" run only"
  echo "simulates nodes (\`--ranks-per-node 2\`) on the same shared memory. These numbers check that the harness"
  echo "works and show relative costs on this box; they say nothing about a real cluster's links."
  echo "Load average (1/5/15 min) before: $load_before, after: $load_after; a load above the core count means"
  echo "other jobs shared the cores, which inflates and scatters the times, small sizes most."
  echo
  echo "Commands:"
  echo
  echo '```'
  printf '%s\n' "${commands[@]}"
  echo '```'
  echo
  echo "## auto vs the best fixed algorithm (\`python bench/auto_vs_best.py\`)"
  echo
  "$PYTHON" bench/auto_vs_best.py "$OUT"/allreduce_p2.json "$OUT"/allreduce_p2_tuned.json "$OUT"/allreduce_p4.json \
    "$OUT"/allreduce_p4_2nodes.json
  for name in allreduce_p2 allreduce_p2_tuned allreduce_p4 allreduce_p4_2nodes; do
    echo
    echo "## $name"
    echo
    echo "![busbw vs size]($name.png)  rows: [$name.json]($name.json)"
    echo
    echo '```'
    cat "$OUT/$name.txt"
    echo '```'
  done
} > "$OUT/README.md"
echo "wrote $OUT/README.md" >&2
