"""ci/cluster.sh itself, run from the host by ``make test-cluster`` (tests/cluster/run.sh sets MPCOMM_TEST_CLUSTER_SH=1):
the exit status passes through, nodes have their own names and a shaped NIC, bad arguments are one line and
status 2, and whatever ends a run (SIGTERM, SIGINT, SIGKILL of the launcher, timeout) takes every process of the
cluster with it and leaves nothing on the host.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "ci" / "cluster.sh")
pytestmark = pytest.mark.skipif(os.environ.get("MPCOMM_TEST_CLUSTER_SH") != "1",
                                reason="builds namespaces on the host: run by make test-cluster")


def cluster(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *argv], capture_output=True, text=True, timeout=timeout)


def _processes_with(token: str) -> list[str]:
    """Command lines on the host that contain ``token`` (each run uses a fresh one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if token in line:
                found.append(f"{entry.name}: {line}")
    return found


def test_exit_status_passes_through():
    assert cluster("2", "1", "1gbit", "--", "sh", "-c", "exit 7").returncode == 7
    assert cluster("2", "1", "1gbit", "--", "true").returncode == 0
    assert cluster("1", "1", "1gbit", "--", "no-such-command-here").returncode == 127


def test_nodes_have_names_addresses_and_shaped_links():
    out = cluster("3", "2", "100mbit", "--", "sh", "-c",
                  'hostname; $MPCOMM_CLUSTER_EXEC node2 hostname; echo "$MPCOMM_CLUSTER_NODES|$MPIEXEC";'
                  'command -v mpiexec; getent hosts node1; tc qdisc show dev nic0')
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["node0", "node2"]
    nodes, mpiexec = lines[2].split("|")
    assert nodes == "node0 node1 node2" and lines[3] == mpiexec
    assert "node1" in lines[4] and "tbf" in lines[5] and "100Mbit" in lines[5], out.stdout


@pytest.mark.parametrize("argv", [["2", "1", "1gbit", "true"], ["0", "1", "1gbit", "--", "true"],
                                  ["2", "x", "1gbit", "--", "true"], ["2", "1", "fast", "--", "true"]])
def test_bad_arguments_are_one_line_and_status_2(argv):
    out = cluster(*argv)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL", "timeout"])
def test_whatever_ends_the_run_takes_the_cluster_with_it(tmp_path, how):
    token = f"mpcomm-cluster-test-{uuid.uuid4().hex}"
    ready = tmp_path / "ready"
    # a process on node1 and one on node0, both carrying the token in their command lines, then wait "forever"
    sleeper = f"{sys.executable} -c 'import sys, time; open(sys.argv[1], \"w\").close(); time.sleep(600)'"
    body = f"$MPCOMM_CLUSTER_EXEC node1 \"{sleeper} /dev/null {token}\" & {sleeper} {ready} {token}"
    argv = [SCRIPT, "2", "1", "1gbit", "--", "sh", "-c", body]
    if how == "timeout":
        argv = ["timeout", "5", *argv]
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "the cluster never started"
        time.sleep(0.05)
    time.sleep(0.3)
    assert len(_processes_with(token)) >= 2
    if how != "timeout":
        launcher.send_signal(getattr(signal, how))
    status = launcher.wait(timeout=30)
    expected = {"SIGTERM": 128 + 15, "SIGINT": 128 + 2, "SIGKILL": -9, "timeout": 124}[how]
    assert status == expected
    deadline = time.monotonic() + 10
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_with(token), f"left behind after {how}: {_processes_with(token)}"
    assert not Path("/run/mpcomm-cluster").exists() and not Path("/run/netns/node0").exists()


def test_probe_says_yes_here():
    out = cluster("--probe")
    assert out.returncode == 0, out.stderr
