"""The flight recorder (mpcomm.trace): what it records for every collective and point-to-point call, alike on every
rank; its ring; turning it off; the SIGUSR1 dump that never replaces a program's handler; the analyzer's CLI errors.
The hangs it is for (a rank that skips, stops or calls another collective): tests/test_trace_hangs.py.

    python -m pytest -q --with-mpi tests/test_trace.py
    timeout 600 mpiexec -n 3 python -m pytest -q --with-mpi -m mpi tests/test_trace.py
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import WORLD, run_gathered, serial_only

from mpcomm import CommTimeoutError, Communicator, ConfigError, MpcommError
from mpcomm.trace import FlightRecorder
from mpcomm.trace.analyze import analyze

ROOT = Path(__file__).resolve().parent.parent
P = WORLD.Get_size()


def shared_dir() -> str:
    """A new directory every rank names alike (rank 0 makes it)."""
    return WORLD.bcast(tempfile.mkdtemp(prefix="mpcomm-trace-") if WORLD.Get_rank() == 0 else None)


def own_entries(path: str, group: str) -> list[dict]:
    with open(path, "rb") as f:
        return [e for e in pickle.load(f)["entries"] if e["process_group"][0] == group]


def comparable(entry: dict) -> tuple:
    """What must be the same on every rank for one collective."""
    return (entry["collective_seq_id"], entry["profiling_name"], entry["operation"], entry["algorithm"],
            entry["input_sizes"], entry["output_sizes"], entry["input_dtypes"], entry["bytes"], entry.get("root"),
            entry.get("op"), entry["state"], entry["process_group"])


@pytest.mark.mpi
def test_every_collective_is_recorded_alike_on_every_rank():
    comm = Communicator(WORLD, timeout=30.0)
    directory = shared_dir()
    if comm.rank == 0:  # a dump is local: one rank alone writes its own and returns
        comm.dump_trace(directory)
    prime = np.ones(7, dtype=np.float64)
    comm.allreduce(np.ones(2, dtype=np.float32))
    comm.allreduce(prime, op="max", algorithm="ring")
    comm.broadcast(np.zeros((3, 5), dtype=np.int32), root=P - 1)
    comm.reduce_scatter(np.ones(3 * P, dtype=np.float32), np.empty(3, dtype=np.float32))
    comm.all_gather(np.ones(4, dtype=np.int64), np.empty(4 * P, dtype=np.int64))
    comm.barrier()
    sub = comm.split(comm.rank % 2)
    sub.allreduce(np.ones(1, dtype=np.float32))
    stats = comm.stats()
    path = comm.dump_trace(directory)
    mine = own_entries(path, comm._trace.name)
    entries = run_gathered(lambda: [comparable(e) for e in mine])
    assert all(e == entries[0] for e in entries), entries  # the same calls, numbers and names on every rank
    assert [e["collective_seq_id"] for e in mine] == list(range(1, 8))
    assert [e["profiling_name"] for e in mine] == ["mpcomm:" + n for n in (
        "all_reduce", "all_reduce", "broadcast", "reduce_scatter", "all_gather", "barrier", "split")]
    first, ring, bcast, rs, ag = mine[:5]
    assert first["algorithm"] in stats["allreduce"] and stats["allreduce"][first["algorithm"]]["bytes"] >= 8
    assert (ring["algorithm"], ring["op"], ring["bytes"], ring["input_sizes"]) == ("ring", "max", 56, [[7]])
    assert (bcast["root"], bcast["input_sizes"], bcast["input_dtypes"]) == (P - 1, [[3, 5]], ["int32"])
    assert (rs["input_sizes"], rs["output_sizes"]) == ([[3 * P]], [[3]])
    assert (ag["input_sizes"], ag["output_sizes"]) == ([[4]], [[4 * P]])
    assert all(e["state"] == "completed" and e["duration_ms"] >= 0 and e["timeout_ms"] == 30000 for e in mine)
    members = sorted(r for r in range(P) if r % 2 == comm.rank % 2)
    with open(path, "rb") as f:
        config = pickle.load(f)["pg_config"]
    assert config[sub._trace.name]["ranks"] == str(members) and sub._trace.name != comm._trace.name
    sub_entries = own_entries(path, sub._trace.name)
    assert [(e["collective_seq_id"], e["profiling_name"]) for e in sub_entries] == [(1, "mpcomm:all_reduce")]
    WORLD.Barrier()
    from mpcomm.trace.analyze import load

    # every dump read together: nothing behind, nothing diverging (the process's other Communicators, of earlier
    # tests, are in the dumps too)
    mine = {comm._trace.name, sub._trace.name}
    assert [f.text for f in analyze(load(directory)).findings if f.group in mine] == []
    WORLD.Barrier()
    sub.free()
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_a_call_refused_by_validate_is_a_mismatch_not_a_wait():
    """validate=True: ranks that passed different shapes all raise and go on; the dumps show where they differed,
    and nobody waiting."""
    from mpcomm import CollectiveMismatchError
    from mpcomm.trace.analyze import load

    comm = Communicator(WORLD, timeout=30.0, validate=True)
    directory = shared_dir()
    with pytest.raises(CollectiveMismatchError):
        comm.allreduce(np.ones(2 + (comm.rank == P - 1)))
    comm.allreduce(np.ones(2))
    comm.dump_trace(directory)
    WORLD.Barrier()
    findings = [(f.kind, f.group, f.seq, f.ranks) for f in analyze(load(directory)).findings
                if f.group == comm._trace.name]
    assert findings == [("mismatch", comm._trace.name, 1, [P - 1])], findings
    WORLD.Barrier()
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_point_to_point_is_recorded():
    comm = Communicator(WORLD, timeout=30.0)
    peer = (comm.rank + 1) % P
    source = (comm.rank - 1) % P
    out = np.empty(5, dtype=np.float32)
    comm.barrier()  # (the point-to-point calls after it carry collective_seq_id 1, as torch numbers them)
    comm.sendrecv(np.ones(5, dtype=np.float32), peer, out, source)
    pending = comm.irecv(np.empty(3, dtype=np.int16), source, tag=4)
    comm.send(np.ones(3, dtype=np.int16), peer, tag=4)
    started_only = comm.irecv(np.empty(2), source, tag=9)  # never sent: still in flight in the dump
    pending.wait()
    mine = own_entries(comm.dump_trace(shared_dir()), comm._trace.name)
    assert all(e["collective_seq_id"] == 1 for e in mine) and mine[0]["p2p_seq_id"] == 0, mine
    described = [(e["profiling_name"], e["p2p_seq_id"], e["state"], e["input_sizes"], e["output_sizes"])
                 for e in mine if e["is_p2p"]]
    assert described == [
        (f"mpcomm:recv {comm.rank}<-{source}", 1, "completed", [], [[5]]),
        (f"mpcomm:send {comm.rank}->{peer}", 2, "completed", [[5]], []),
        (f"mpcomm:recv {comm.rank}<-{source}", 3, "completed", [], [[3]]),
        (f"mpcomm:send {comm.rank}->{peer}", 4, "completed", [[3]], []),
        (f"mpcomm:recv {comm.rank}<-{source}", 5, "started", [], [[2]]),
    ], described
    comm.send(np.ones(2), peer, tag=9)
    started_only.wait()
    comm.free()


@pytest.mark.mpi
def test_a_non_blocking_receive_whose_wait_times_out_dumps(monkeypatch):
    directory = shared_dir()
    monkeypatch.setenv("MPCOMM_TRACE_DIR", directory)
    comm = Communicator(WORLD, timeout=30.0)
    never = comm.irecv(np.empty(2), comm.rank, tag=11)  # nobody sends it
    with pytest.raises(CommTimeoutError):
        never.wait(timeout=0.2)
    with open(os.path.join(directory, f"mpcomm_trace_rank_{WORLD.Get_rank()}"), "rb") as f:
        dump = pickle.load(f)
    assert dump["mpcomm"]["reason"].startswith("CommTimeoutError in recv"), dump["mpcomm"]["reason"]
    assert dump["entries"][-1]["profiling_name"] == f"mpcomm:recv {comm.rank}<-{comm.rank}"
    comm.free(failed=True)


@pytest.mark.mpi
def test_the_ring_keeps_the_last_calls_and_the_stack_of_the_one_in_flight(comm):
    recorder = FlightRecorder(4)
    trace, = recorder.communicator(comm.mpi, comm.timeout, ("",))
    plan = comm.plan("allreduce", np.ones(3, dtype=np.float32), "sum")
    for i in range(10):  # (``trace`` and ``slot``, as Dispatcher.run names them: how the dump finds the thread)
        slot = trace.started(plan, float(i + 1))
        if i < 9:
            trace.completed(slot, i + 1.5)
    entries = recorder.snapshot("test")["entries"]
    assert [e["record_id"] for e in entries] == [6, 7, 8, 9]
    assert [e["collective_seq_id"] for e in entries] == [7, 8, 9, 10]
    assert [e["state"] for e in entries] == ["completed"] * 3 + ["started"]
    assert entries[0]["duration_ms"] == pytest.approx(500.0)
    # the stack of the thread that runs it (here the caller of snapshot()), innermost first
    assert entries[-1]["frames"][0]["name"] == "test_the_ring_keeps_the_last_calls_and_the_stack_of_the_one_in_flight"
    assert entries[-1]["frames"][0]["filename"] == __file__


@pytest.mark.mpi
@pytest.mark.parametrize("variable, value", [("MPCOMM_TRACE_BUFFER", "-1"), ("MPCOMM_TRACE_BUFFER", "many"),
                                             ("MPCOMM_TRACE_BUFFER", "1.5"), ("MPCOMM_STRAGGLER", "-1"),
                                             ("MPCOMM_STRAGGLER", "soon"), ("MPCOMM_STRAGGLER", "inf")])
def test_a_bad_buffer_size_or_straggler_threshold_is_one_error_on_every_rank(variable, value, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"{variable}={value!r}"):
        Communicator(WORLD, timeout=10.0)


@pytest.mark.mpi
def test_buffer_zero_turns_it_off(monkeypatch):
    monkeypatch.setenv("MPCOMM_TRACE_BUFFER", "0")
    comm = Communicator(WORLD, timeout=10.0)
    comm.allreduce(np.ones(2))
    with pytest.raises(MpcommError, match="MPCOMM_TRACE_BUFFER=0"):
        comm.dump_trace(tempfile.gettempdir())
    comm.free()


_SIGNALS = """
import os, pickle, signal, sys
mode, directory = sys.argv[1], sys.argv[2]
seen = []
if mode == "own":
    signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
os.environ["MPCOMM_TRACE_DIR"] = directory
import numpy as np
from mpcomm import Communicator
comm = Communicator(timeout=10.0)
comm.allreduce(np.ones(3))

def waiting_here():
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(100):  # (the handler runs at the next bytecode)
        pass

waiting_here()
path = os.path.join(directory, "mpcomm_trace_rank_0")
if mode == "own":
    assert seen == [1] and not os.path.exists(path), "mpcomm replaced the program's SIGUSR1 handler"
else:
    dump = pickle.load(open(path, "rb"))
    assert dump["mpcomm"]["reason"] == "SIGUSR1", dump["mpcomm"]
    assert any(f["name"] == "waiting_here" for f in dump["mpcomm"]["stacks"]["MainThread"])
    assert [e["profiling_name"] for e in dump["entries"]][-1] == "mpcomm:all_reduce"
print("ok")
"""


@serial_only
@pytest.mark.parametrize("mode", ["default", "own"])
def test_sigusr1_dumps_unless_the_program_has_its_own_handler(mode, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _SIGNALS, mode, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpcomm.trace", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@serial_only
def test_analyzer_mistakes_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "mpcomm_trace_rank_1").write_bytes(b"not a pickle")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mpcomm_trace_rank_0").write_bytes(pickle.dumps({"something": "else"}))
    cases = {(str(tmp_path / "missing"),): "is not a directory",
             (str(tmp_path / "empty"),): "holds no flight-recorder dumps",
             (str(tmp_path / "corrupt"),):
                 f"{tmp_path / 'corrupt' / 'mpcomm_trace_rank_1'}: not a flight-recorder dump",
             (str(tmp_path / "other"),): f"{tmp_path / 'other' / 'mpcomm_trace_rank_0'}: not a flight-recorder dump",
             (): "the following arguments are required: DIR"}
    for args, fragment in cases.items():
        proc = cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], (args, proc.stderr)
        assert lines[0].startswith("mpcomm-trace: error: ") and proc.stdout == "", proc.stderr
