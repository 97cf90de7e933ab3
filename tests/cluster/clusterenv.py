"""What ci/cluster.sh tells the command it runs on node0 (environment), for the multi-node tests.

The tests in this folder run only on that simulated cluster (``make test-cluster``); anywhere else they skip.
"""
from __future__ import annotations

import os
import shutil

import pytest

NODES: list[str] = os.environ.get("MPCOMM_CLUSTER_NODES", "").split()  # node0 node1 ...
RANKS_PER_NODE = int(os.environ.get("MPCOMM_CLUSTER_RANKS_PER_NODE", "0") or 0)
EXEC = os.environ.get("MPCOMM_CLUSTER_EXEC", "")  # `EXEC nodeK command...` runs a command on node K
RATE = os.environ.get("MPCOMM_CLUSTER_RATE", "")

only_on_cluster = pytest.mark.skipif(
    not NODES, reason="multi-node test: runs on the simulated cluster of ci/cluster.sh (make test-cluster)")


def cluster_mpiexec() -> str:
    """The cluster-wide mpiexec (ci/cluster.sh puts it first on PATH and names it in $MPIEXEC), not the venv's."""
    found = shutil.which("mpiexec")
    assert found and found == os.environ.get("MPIEXEC"), f"mpiexec on PATH is {found}, not the cluster's"
    return found
