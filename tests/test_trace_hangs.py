"""The flight recorder on real hangs: a rank that skips a collective (validate=False), a rank stopped with SIGSTOP,
a rank that calls broadcast where the others call all-reduce — at p = 2..4, each a real ``mpiexec`` job.

Every rank that times out (or finds its communicator unusable) must have written its dump within timeout + 5 s of
entering the call; ranks that did not (the straggler) are asked for theirs with SIGUSR1, as a user would. Then
``python -m mpcomm.trace DIR`` must name the right rank and sequence number. This file is also the job itself
(run as a script by each rank).

    python -m pytest -q tests/test_trace_hangs.py                      (serial pass: it launches mpiexec)
    MPCOMM_TEST_REPEAT=10 python -m pytest -q tests/test_trace_hangs.py   (the 10-run check)
"""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 1.0  # the job's communicator timeout
GRACE = 5.0  # a rank that timed out has its dump within TIMEOUT + GRACE of entering the call
CALLS = 6  # collectives per rank; the scenario's fault is at the last one (sequence number CALLS)
SKIPPED = 2  # the iteration the skipping rank leaves out
REPEAT = int(os.environ.get("MPCOMM_TEST_REPEAT", "1"))
SCENARIOS = ("skip", "stop", "broadcast")


# ---------------------------------------------------------------------------------------------- the job (each rank)
def job(scenario: str, work: Path) -> None:
    """Run CALLS all-reduces with the scenario's fault on the last rank; write status/<rank>.json; wait for
    ``release`` (the harness's signal to exit)."""
    import numpy as np

    from mpcomm import Communicator, MpcommError

    comm = Communicator(timeout=TIMEOUT, validate=False)
    odd = comm.size - 1
    (work / "pids").mkdir(exist_ok=True)
    write_atomically(work / "pids" / str(comm.rank), str(os.getpid()))
    buf = np.ones(16, dtype=np.float32)
    status: dict = {"outcome": "completed"}
    for i in range(CALLS):
        if comm.rank == odd and scenario == "skip" and i == SKIPPED:
            continue
        if comm.rank == odd and scenario == "stop" and i == CALLS - 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # the harness continues it once the others have given up
            status = {"outcome": "stopped"}
            break
        entered = time.monotonic()
        try:
            if comm.rank == odd and scenario == "broadcast" and i == CALLS - 1:
                comm.broadcast(buf, root=0)
            else:
                comm.allreduce(buf)
        except MpcommError as exc:
            dump = Path(os.environ["MPCOMM_TRACE_DIR"]) / f"mpcomm_trace_rank_{comm.mpi.Get_rank()}"
            status = {"outcome": type(exc).__name__, "call": i, "dumped": dump.exists(),
                      "seconds": time.monotonic() - entered, "error": str(exc)}
            break
    (work / "status").mkdir(exist_ok=True)
    write_atomically(work / "status" / f"{comm.rank}.json", json.dumps(status))
    deadline = time.monotonic() + 120
    while not (work / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # (the straggler's stack when SIGUSR1 asks it for its dump)


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` as the harness sees it: whole or not at all (it polls for the file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


# ---------------------------------------------------------------------------------------------- the harness
def run_scenario(scenario: str, ranks: int, work: Path, mpiexec: str, *options: str) -> tuple[dict, str]:
    """Launch the job; once every rank has reported (or stopped itself), ask the ranks without a dump for one
    with SIGUSR1 (continuing the stopped rank), release them; return (statuses, the output of the analyzer run
    with ``options``)."""
    dumps, status = work / "dumps", work / "status"
    env = dict(os.environ, MPCOMM_TRACE_DIR=str(dumps), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("MPCOMM_TRACE_BUFFER", None)
    command = ["timeout", "120", mpiexec, "-n", str(ranks), sys.executable, __file__, scenario, str(work)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stopped = ranks - 1 if scenario == "stop" else None
        expected = {r for r in range(ranks) if r != stopped}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if {int(p.stem) for p in status.glob("*.json")} >= expected and (
                    stopped is None or (work / "pids" / str(stopped)).exists()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the job ended early:\n{proc.communicate()[0][-3000:]}"
        statuses = {int(p.stem): json.loads(p.read_text()) for p in status.glob("*.json")}
        assert set(statuses) >= expected, f"ranks {sorted(expected - set(statuses))} never reported: {statuses}"
        pids = {int(p.name): int(p.read_text()) for p in (work / "pids").iterdir() if p.name.isdigit()}
        asked = [r for r in range(ranks) if not (dumps / f"mpcomm_trace_rank_{r}").exists()]
        for rank in asked:
            os.kill(pids[rank], signal.SIGUSR1)
        if stopped is not None:
            os.kill(pids[stopped], signal.SIGCONT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all((dumps / f"mpcomm_trace_rank_{r}").exists() for r in asked):
            time.sleep(0.05)
    finally:
        work.joinpath("release").write_text("")
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    assert proc.returncode == 0, f"rc={proc.returncode}\n{output[-3000:]}"
    analysis = subprocess.run([sys.executable, "-m", "mpcomm.trace", str(dumps), *options], capture_output=True,
                              text=True, timeout=60, env=env)
    assert analysis.returncode == 0, analysis.stderr
    return statuses, analysis.stdout


def named(output: str, kind: str) -> list[tuple[int, list[int]]]:
    """(sequence number, ranks) of the analyzer's lines of ``kind``: "never entered" or "MISMATCH"."""
    found = []
    for line in output.splitlines():
        if kind == "MISMATCH" and (m := re.search(r"MISMATCH #(\d+): rank\(s\) \[([\d, ]+)\] called", line)):
            found.append((int(m.group(1)), [int(r) for r in m.group(2).split(",")]))
        if kind == "never entered" and (m := re.search(r"wait in #(\d+) .*never entered it: (.*)$", line)):
            found.append((int(m.group(1)), [int(r) for r in re.findall(r"rank (\d+) \(", m.group(2))]))
    return found


def check_scenario(scenario: str, ranks: int, work: Path, mpiexec: str) -> None:
    """Run the scenario's job with ``mpiexec`` and check the dumps and what the analyzer names (also run on the
    simulated cluster: tests/cluster/test_jobs.py)."""
    statuses, output = run_scenario(scenario, ranks, work, mpiexec)
    odd = ranks - 1
    detail = f"statuses {statuses}\nanalyzer:\n{output}"
    failed = {r: s for r, s in statuses.items() if s["outcome"] not in ("completed", "stopped")}
    for rank, s in failed.items():  # every rank that timed out or failed dumped, within the timeout + GRACE
        assert s["dumped"] and s["seconds"] <= TIMEOUT + GRACE, f"rank {rank}: {s}\n{detail}"
    if scenario in ("skip", "stop"):
        # the others wait in the last collective, which the odd rank never entered
        assert {r for r, s in failed.items() if s["outcome"] == "CommTimeoutError"} == set(range(odd)), detail
        assert named(output, "never entered") == [(CALLS, [odd])], detail
        assert named(output, "MISMATCH") == [], detail
        assert f"rank {odd} stack (main thread" in output and "in job" in output, detail
    else:
        assert failed, detail  # someone waited in vain, or MPI refused the mixed messages
        assert named(output, "MISMATCH") == [(CALLS, [odd])], detail
        assert "called broadcast [16] float32 root 0 where" in output, detail


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("attempt", range(REPEAT))
def test_dumps_on_timeout_and_the_analyzer_names_the_rank(scenario, ranks, attempt, tmp_path):
    from conftest import LAUNCHED, mpiexec_path

    if LAUNCHED:
        pytest.skip("launches mpiexec itself; run it in the serial pytest pass")
    check_scenario(scenario, ranks, tmp_path, mpiexec_path())


@pytest.mark.parametrize("scenario, expected", [
    ("skip", ["Not all ranks joining collective, sequence number: 6", "missing ranks: {2}"]),
    ("broadcast", ["Collective sequence number: 6 has errors", "Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH"]),
])
def test_torchs_own_analyzer_reads_the_dumps(scenario, expected, tmp_path):
    """torch's fr_trace, unchanged, on the copies ``--for-torch`` writes, names the same rank and number."""
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    from conftest import LAUNCHED, mpiexec_path

    if LAUNCHED:
        pytest.skip("launches mpiexec itself; run it in the serial pytest pass")
    run_scenario(scenario, 3, tmp_path, mpiexec_path(), "--for-torch", str(tmp_path / "torch"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path / "torch")],
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and all(line in output for line in expected), output


def test_dump_files_are_what_the_analyzer_reads(tmp_path):
    """Sanity of the fixture's pieces: a dump is torch's layout (a pickled dict with version, pg_config,
    entries) under mpcomm_trace_rank_<rank>."""
    from mpcomm import Communicator

    comm = Communicator(timeout=5.0)
    path = comm.dump_trace(str(tmp_path))
    assert Path(path).name == f"mpcomm_trace_rank_{comm.mpi.Get_rank()}"
    with open(path, "rb") as f:
        dump = pickle.load(f)
    assert dump["version"] == "2.10" and isinstance(dump["entries"], list) and dump["pg_config"]


if __name__ == "__main__":
    job(sys.argv[1], Path(sys.argv[2]))
