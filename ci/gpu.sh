#!/usr/bin/env bash
# The GPU check: run on a machine with a CUDA GPU, from anywhere (it cds to the repository root):
#
#     bash ci/gpu.sh
#
# Written for the lent GPU image: Python 3.12 (python3, which holds CuPy), system Open MPI 4.1 that is NOT
# CUDA-aware, cupy-cuda13x, mpi4py, numpy, ml_dtypes and pytest preinstalled, no internet. mpcomm runs from
# the source tree (PYTHONPATH); nothing is installed except pytest-mpi from wheels/ when it is carried there
# (pip download -d wheels pytest-mpi). Without pytest-mpi the tests still run (selected with -m mpi).
#
# 1. which MPI, and what mpcomm.cuda_aware() detected (and why);
# 2. tests/test_cuda.py at p = 2, 4, 8: CuPy buffers through every registered algorithm of every collective,
#    float16/bfloat16/float32, compared bit for bit with the numpy path, p2p and non-blocking with CuPy;
# 3. bench/gpu_staging.py at p = 2 and 4: host-staged CuPy all-reduce vs host numpy all-reduce, >= 16 MiB.
#
# Environment: PYTHON (default python3), MPIRUN (default mpirun), RANKS (default "2 4 8"),
# MPI_TIMEOUT seconds per mpirun (default 900), OUT (results folder, default bench/results),
# REQUIRE_GPU=0 to let the CuPy tests skip (to try this script's plumbing on a machine without a GPU),
# FULL=1 to also run the whole multi-rank suite (host buffers) on this MPI at each p.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
MPIRUN=${MPIRUN:-mpirun}
RANKS=${RANKS:-"2 4 8"}
MPI_TIMEOUT=${MPI_TIMEOUT:-900}
OUT=${OUT:-bench/results}
REQUIRE_GPU=${REQUIRE_GPU:-1}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

# Open MPI in a container, as root, more ranks than it counts slots: allow all three; no CMA (ptrace is
# usually blocked in containers). Harmless for MPICH's mpiexec, which ignores OMPI_* variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

echo "== environment"
"$PY" - <<EOF
import sys
import numpy, mpi4py, ml_dtypes, pytest
from mpi4py import MPI
import mpcomm
print("python", sys.version.split()[0], "| numpy", numpy.__version__, "| mpi4py", mpi4py.__version__)
print("MPI:", MPI.Get_library_version().splitlines()[0].strip())
print("cuda_aware:", mpcomm.cuda_aware(explain=True))
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    print("cupy", cupy.__version__, "|", n, "GPU(s):", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
except Exception as exc:
    print("no usable CuPy/GPU:", exc)
    if "$REQUIRE_GPU" == "1":
        sys.exit("ci/gpu.sh needs CuPy and a GPU (REQUIRE_GPU=0 to run anyway)")
EOF

if ! "$PY" -c "import pytest_mpi" 2>/dev/null; then
    if compgen -G "wheels/pytest_mpi-*.whl" >/dev/null; then
        "$PY" -m pip install --quiet --no-index --no-deps wheels/pytest_mpi-*.whl
    fi
fi
WITH_MPI=()
if "$PY" -c "import pytest_mpi" 2>/dev/null; then WITH_MPI=(--with-mpi); else echo "(pytest-mpi absent: running -m mpi without it)"; fi

status=0
for n in $RANKS; do
    echo "== CuPy collectives, $n ranks"
    timeout "$MPI_TIMEOUT" "$MPIRUN" -n "$n" "$PY" -m pytest -q "${WITH_MPI[@]}" -m mpi -p no:cacheprovider \
        tests/test_cuda.py -rs 2>&1 | tee "$OUT/gpu_tests_p$n.log" | grep -E "passed|failed|error|FAILED|SKIPPED.*GPU" \
        || true
    grep -qE "[0-9]+ failed|[0-9]+ error" "$OUT/gpu_tests_p$n.log" && status=1
    grep -qE "[0-9]+ passed" "$OUT/gpu_tests_p$n.log" || status=1
    if [ "$REQUIRE_GPU" = "1" ] && grep -q "needs CuPy and a CUDA GPU" "$OUT/gpu_tests_p$n.log"; then
        echo "CuPy tests were skipped although a GPU is required"; status=1
    fi
    if [ "${FULL:-0}" = "1" ]; then
        echo "== whole multi-rank suite (host buffers), $n ranks"
        timeout "$MPI_TIMEOUT" "$MPIRUN" -n "$n" "$PY" -m pytest -q "${WITH_MPI[@]}" -m mpi -p no:cacheprovider tests \
            > "$OUT/gpu_suite_p$n.log" 2>&1 || status=1
        tail -n 1 "$OUT/gpu_suite_p$n.log"
    fi
done

if [ "$REQUIRE_GPU" = "1" ]; then
    for n in 2 4; do
        echo "== staged vs host all-reduce, $n ranks"
        timeout "$MPI_TIMEOUT" "$MPIRUN" -n "$n" "$PY" bench/gpu_staging.py --sizes 16M,64M,256M \
            --algorithms ring,rhd,native --json "$OUT/gpu_staging_p$n.json" || status=1
    done
fi
echo "== ci/gpu.sh: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
