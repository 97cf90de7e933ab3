"""Whole MPI jobs on the simulated cluster, driven from node0 by one serial pytest (make test-cluster):

    ci/cluster.sh 2 2 1gbit -- .venv/bin/python -m pytest -q tests/cluster/test_jobs.py

- 3D training across nodes (``mpcomm-train --engine 3d``, tp inside a node) gives the losses and parameters of
  ``mpcomm-train --engine single``;
- a node's link taken down in the middle of an all-reduce (``ip link set nic0 down`` on that node, from outside
  the MPI job) ends the call on every rank with ``CommTimeoutError`` within the timeout: no hang;
- the flight recorder's hangs (tests/test_trace_hangs.py: a rank that skips a collective, stops, or calls
  broadcast): the dumps and the analyzer name the rank, with the ranks on several nodes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from clusterenv import EXEC, NODES, RANKS_PER_NODE, cluster_mpiexec, only_on_cluster
from test_trace_hangs import SCENARIOS, check_scenario

ROOT = Path(__file__).resolve().parents[2]
P = len(NODES) * RANKS_PER_NODE
pytestmark = [
    only_on_cluster,
    pytest.mark.skipif(any(k.startswith(("PMI_", "HYDRA_")) for k in os.environ),
                       reason="launches mpiexec itself: run it serially on node0, not under mpiexec"),
]
TRAIN = ["--steps", "3", "--global-batch", "16", "--layers", "4", "--d-model", "8", "--d-hidden", "16", "--seed", "7"]


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _layouts() -> list[tuple[int, int, int]]:
    """(dp, tp, pp) layouts of this cluster: tp = ranks per node (inside a node), the rest across nodes."""
    nodes, tp = len(NODES), RANKS_PER_NODE
    if tp > 1:
        return [(1, tp, nodes), (nodes, tp, 1)]
    return [(2, 1, nodes // 2), (1, 1, nodes)] if nodes % 2 == 0 else [(1, 1, nodes)]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "single.json"
    _run([sys.executable, "-m", "mpcomm.train", "--engine", "single", "--json", str(out), *TRAIN], timeout=120)
    return json.loads(out.read_text())


@pytest.mark.parametrize("dp, tp, pp", _layouts())
def test_3d_training_across_nodes_equals_single(tmp_path, single, dp, tp, pp):
    out = tmp_path / "3d.json"
    _run(["timeout", "240", cluster_mpiexec(), "-n", str(P), sys.executable, "-m", "mpcomm.train", "--engine", "3d",
          "--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--schedule", "1f1b", "--json", str(out), *TRAIN],
         timeout=300)
    got = json.loads(out.read_text())
    assert (got["world"], got["dp"], got["tp"], got["pp"]) == (P, dp, tp, pp)
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=1e-10)
    np.testing.assert_allclose(got["param_checksum"], single["param_checksum"], rtol=1e-10)


def _on_node(node: str, *command: str) -> None:
    subprocess.run([EXEC, node, *command], check=True, timeout=30)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "native"])
def test_link_down_mid_collective_times_out_on_every_rank(tmp_path, algorithm):
    timeout = 4.0
    victim = NODES[-1]
    job = subprocess.Popen(["timeout", "120", cluster_mpiexec(), "-n", str(P), sys.executable,
                            str(ROOT / "tests/cluster/link_down_job.py"), str(tmp_path), str(timeout), algorithm],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert job.poll() is None and time.monotonic() < deadline, f"the job never started:\n{job.stdout.read()}"
            time.sleep(0.05)
        time.sleep(0.5)  # several all-reduces in: the link goes down in the middle of one
        _on_node(victim, "ip", "link", "set", "nic0", "down")
        down_at = time.monotonic()
        while len(results) < P and time.monotonic() < down_at + timeout + 30:
            for r in range(P):
                path = tmp_path / f"rank{r}.json"
                if r not in results and path.exists():
                    results[r] = json.loads(path.read_text())
            time.sleep(0.05)
        seconds_to_report = time.monotonic() - down_at
    finally:
        _on_node(victim, "ip", "link", "set", "nic0", "up")  # lets the job (and the later tests) finish
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
    missing = sorted(set(range(P)) - set(results))
    assert not missing, f"ranks {missing} never reported within {timeout + 30:.0f} s of the link going down"
    for r, result in sorted(results.items()):
        assert result["error"] == "CommTimeoutError", f"rank {r}: {result}"
        assert result["calls"] >= 1, f"rank {r} failed in its first call, before the link went down: {result}"
        assert f"allreduce[{algorithm}]" in result["message"] and "timed out" in result["message"], result
        assert result["seconds_in_call"] < timeout + 10, f"rank {r}: the failing call took too long: {result}"
    assert seconds_to_report < timeout + 30
    print(f"{algorithm}: every rank reported CommTimeoutError {seconds_to_report:.1f} s after the link went down; "
          f"seconds in the failing call: {[round(results[r]['seconds_in_call'], 2) for r in range(P)]}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_flight_recorder_names_the_rank_across_nodes(scenario, tmp_path):
    check_scenario(scenario, P, tmp_path, cluster_mpiexec())
