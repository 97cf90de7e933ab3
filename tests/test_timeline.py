"""The timeline (mpcomm.trace.timeline): the Chrome-trace JSON it writes passes a strict schema check of the Trace
Event Format, its spans are the times the Communicator measured (stats()), the ranks' spans of one collective
overlap on the aligned clocks, the algorithms' phases nest inside their calls, the engines' spans contain their
collectives; MPCOMM_TIMELINE writes one at exit; mistakes are one error on every rank.

    python -m pytest -q --with-mpi tests/test_timeline.py
    timeout 600 mpiexec -n 3 python -m pytest -q --with-mpi -m mpi tests/test_timeline.py
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import LAUNCHED, WORLD, mpiexec_path

import mpcomm.nn as nn
from mpcomm import Communicator, ConfigError, MpcommError
from mpcomm.parallel.ddp import DistributedDataParallel
from mpcomm.trace.analyze import analyze, load
from mpcomm.trace.chrome import _rows
from mpcomm.workload import Workload

jsonschema = pytest.importorskip("jsonschema")  # (in the test extra: pyproject.toml)

ROOT = Path(__file__).resolve().parent.parent
P = WORLD.Get_size()

# The Trace Event Format's JSON object form, as far as mpcomm writes it: every event a complete span ("X") or a
# name / sort order ("M"), no other keys (a strict check: a typo in a key fails it)
_NUMBER = {"type": "number", "minimum": 0}
SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "additionalProperties": False,
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
        "traceEvents": {"type": "array", "items": {"oneOf": [
            {"type": "object", "additionalProperties": False,
             "required": ["name", "cat", "ph", "ts", "dur", "pid", "tid", "args"],
             "properties": {"name": {"type": "string", "minLength": 1}, "cat": {"type": "string"},
                            "ph": {"const": "X"}, "ts": _NUMBER, "dur": _NUMBER, "pid": {"type": "integer"},
                            "tid": {"type": "integer"}, "args": {"type": "object"}}},
            {"type": "object", "additionalProperties": False,
             "required": ["name", "cat", "ph", "s", "ts", "pid", "tid", "args"],
             "properties": {"name": {"type": "string", "minLength": 1}, "cat": {"type": "string"},
                            "ph": {"const": "i"}, "s": {"enum": ["t", "p", "g"]}, "ts": _NUMBER,
                            "pid": {"type": "integer"}, "tid": {"type": "integer"}, "args": {"type": "object"}}},
            {"type": "object", "additionalProperties": False, "required": ["name", "ph", "pid", "tid", "args"],
             "properties": {"name": {"enum": ["process_name", "process_sort_index", "thread_name",
                                              "thread_sort_index"]},
                            "ph": {"const": "M"}, "pid": {"type": "integer"}, "tid": {"type": "integer"},
                            "args": {"type": "object", "minProperties": 1, "maxProperties": 1,
                                     "properties": {"name": {"type": "string"}, "sort_index": {"type": "integer"}},
                                     "additionalProperties": False}}},
        ]}},
    },
}


def _no_constants(name: str):
    raise ValueError(f"not JSON: {name}")


def load_strictly(path: str) -> dict:
    """The file parsed as strict JSON (no NaN / Infinity) and checked against :data:`SCHEMA`."""
    with open(path) as f:
        data = json.loads(f.read(), parse_constant=_no_constants)
    jsonschema.validate(data, SCHEMA, cls=jsonschema.Draft202012Validator)
    return data


def shared_path(name: str) -> str:
    return WORLD.bcast(os.path.join(tempfile.mkdtemp(prefix="mpcomm-timeline-"), name) if WORLD.Get_rank() == 0
                       else None)


def spans(data: dict) -> list[dict]:
    """The complete events, each with its track's name as ``track``."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    return [dict(e, track=names[e["pid"], e["tid"]]) for e in data["traceEvents"] if e["ph"] == "X"]


@pytest.mark.mpi
def test_the_json_is_valid_and_its_spans_are_the_measured_call_times():
    comm = Communicator(WORLD, timeout=60.0, validate=False)
    path = shared_path("calls.json")
    walls = []
    with comm.timeline(path) as timeline:
        comm.reset_stats()
        for algorithm, count in (("ring", 7919), ("hierarchical", 1000), ("native", 2), ("rhd", 3)):
            before = time.perf_counter()
            comm.allreduce(np.ones(count, dtype=np.float32), algorithm=algorithm)
            walls.append(time.perf_counter() - before)
        comm.broadcast(np.zeros(5, dtype=np.int64), root=P - 1)
        comm.reduce_scatter(np.ones(3 * P), np.empty(3))
        comm.all_gather(np.ones(2), np.empty(2 * P))
        comm.iallreduce(np.ones(11)).wait()
        comm.barrier()
        stats = comm.stats()
    written = timeline.stop()  # (again: returns what the first stop wrote)
    assert written == (path if comm.rank == 0 else None)
    data = WORLD.bcast(load_strictly(path) if comm.rank == 0 else None)
    lane = comm._trace.name
    events = spans(data)
    assert {e["pid"] for e in events} == set(range(P))
    calls = [e for e in events if e["cat"] == "collective" and e["pid"] == WORLD.Get_rank()
             and e["track"] in (lane, lane + ".async")]
    # the spans are stats()'s measurements (validate=False: the same clock readings), to rounding
    assert len(calls) == sum(r["calls"] for ops in stats.values() for r in ops.values())
    measured = sum(r["seconds"] for ops in stats.values() for r in ops.values()) * 1e6
    assert sum(e["dur"] for e in calls) == pytest.approx(measured, abs=0.01 * len(calls))
    blocking = sorted((e for e in calls if e["track"] == lane), key=lambda e: e["ts"])
    for span, wall in zip(blocking, walls):  # and no span is longer than the call as its caller timed it
        assert span["dur"] <= wall * 1e6 + 0.01, (span, wall)
    assert [(e["name"], e["args"]["algorithm"]) for e in blocking[:4]] == [
        ("allreduce", "ring"), ("allreduce", "hierarchical"), ("allreduce", "native"), ("allreduce", "rhd")]
    # the phases nest inside their call, one after the other
    for span, phases in ((blocking[0], ["reduce-scatter", "all-gather"]), (blocking[1], [
            "reduce-scatter (in the node)", "all-reduce (between nodes)", "all-gather (in the node)"])):
        inside = sorted((e for e in events if e["cat"] == "phase" and e["pid"] == span["pid"]
                         and e["tid"] == span["tid"] and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]),
                        key=lambda e: e["ts"])
        if span["args"]["algorithm"] == "hierarchical" and comm.num_nodes * max(comm.node_sizes) != P:
            continue  # (nodes of unequal size take the leader variant: other phases)
        assert [e["name"] for e in inside] == phases
        for first, second in zip(inside, inside[1:]):
            assert first["ts"] + first["dur"] <= second["ts"] + 0.01
        assert inside[-1]["ts"] + inside[-1]["dur"] <= span["ts"] + span["dur"] + 0.01
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_the_ranks_clocks_are_aligned_one_collective_overlaps_on_every_rank():
    """No rank leaves an all-reduce before every rank entered it: on the aligned clocks every rank's span of one
    call overlaps every other's, to the measured error."""
    comm = Communicator(WORLD, timeout=60.0, validate=False)
    path = shared_path("aligned.json")
    with comm.timeline(path):
        for i in range(20):
            if comm.rank == i % P:
                time.sleep(0.002)  # (a different late rank each call)
            comm.allreduce(np.ones(4))
    if comm.rank == 0:
        data = load_strictly(path)
        error = {o["rank"]: o["error_us"] for o in data["otherData"]["clock_offsets"]}
        lane = comm._trace.name
        by_seq: dict = {}
        for e in spans(data):
            if e["track"] == lane and e["name"] == "allreduce":
                by_seq.setdefault(e["args"]["seq"], []).append(e)
        assert len(by_seq) == 20 and all(len(v) == P for v in by_seq.values())
        for seq, calls in by_seq.items():
            for a in calls:
                for b in calls:
                    slack = error[a["pid"]] + error[b["pid"]] + 0.01
                    assert a["ts"] <= b["ts"] + b["dur"] + slack, (seq, a, b)
    comm.free()


def workload() -> Workload:
    return Workload(num_layers=3, d_model=8, d_hidden=16, global_batch=24, seed=3, dtype="float64")


@pytest.mark.mpi
def test_ddp_buckets_are_spans_around_their_all_reduce():
    comm = Communicator(WORLD, timeout=60.0, validate=False)
    wl = workload()
    ddp = DistributedDataParallel(wl.model(), comm, bucket_cap_mb=1e-4)
    path = shared_path("ddp.json")
    with comm.timeline(path):
        xs, ys = wl.local_batch(0, comm.rank, comm.size)
        pred, ctx = ddp.forward(xs)
        ddp.backward(nn.mse_loss(pred, ys)[1], ctx)
    data = WORLD.bcast(load_strictly(path) if comm.rank == 0 else None)
    mine = [e for e in spans(data) if e["pid"] == WORLD.Get_rank()]
    buckets = sorted((e for e in mine if e["cat"] == "engine"), key=lambda e: e["ts"])
    reductions = sorted((e for e in mine if e["track"] == comm._trace.name + ".async" and e["cat"] == "collective"),
                        key=lambda e: e["ts"])
    assert len(ddp.buckets) > 1 and [e["name"] for e in buckets] == [f"ddp bucket {b.index}" for b in ddp.buckets]
    assert len(reductions) == len(buckets)
    for bucket, reduction in zip(buckets, reductions):
        assert bucket["ts"] <= reduction["ts"] and reduction["ts"] + reduction["dur"] <= bucket["ts"] + bucket["dur"]
    comm.free()


@pytest.mark.mpi
def test_mistakes_are_one_error_on_every_rank(monkeypatch):
    comm = Communicator(WORLD, timeout=30.0)
    missing = os.path.join(tempfile.gettempdir(), "no-such-dir-mpcomm", "t.json")
    with pytest.raises(MpcommError, match="timeline.*no-such-dir-mpcomm.*there is no directory"):
        comm.timeline(missing)
    path = shared_path("twice.json")
    with comm.timeline(path):
        with pytest.raises(MpcommError, match="a timeline is already recording in this process"):
            comm.timeline(path + ".2")
    monkeypatch.setenv("MPCOMM_TIMELINE", path)
    monkeypatch.setenv("MPCOMM_TRACE_BUFFER", "0")
    with pytest.raises(ConfigError, match="MPCOMM_TIMELINE=.* needs the flight recorder"):
        Communicator(WORLD, timeout=10.0)
    monkeypatch.delenv("MPCOMM_TIMELINE")
    off = Communicator(WORLD, timeout=10.0)
    with pytest.raises(MpcommError, match="the flight recorder is off"):
        off.timeline(path)
    for c in (off, comm):
        c.free()


_AT_EXIT = """
import numpy as np
from mpcomm import Communicator
comm = Communicator(timeout=30.0)
for _ in range(3):
    comm.allreduce(np.ones(8))
"""


@pytest.mark.skipif(LAUNCHED, reason="launches mpiexec itself; run it in the serial pytest pass")
def test_mpcomm_timeline_writes_the_file_at_exit(tmp_path):
    path = tmp_path / "exit.json"
    proc = subprocess.run(["timeout", "120", mpiexec_path(), "-n", "2", sys.executable, "-c", _AT_EXIT],
                          capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), MPCOMM_TIMELINE=str(path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [e for e in spans(load_strictly(str(path))) if e["name"] == "allreduce" and e["args"]["input"] == [[8]]]
    assert sorted(e["pid"] for e in calls) == [0, 0, 0, 1, 1, 1], calls


def test_spans_that_overlap_without_nesting_go_on_rows_of_their_own():
    #        [0, 10) holds [1, 3) and [4, 9) holds [5, 6); [8, 12) overlaps [4, 9) and [0, 10) partly
    assert _rows([(0, 10), (1, 3), (4, 9), (5, 6), (8, 12), (11, 13), (12, 14)]) == [0, 0, 0, 0, 1, 0, 1]


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_comes_late_is_reported_in_the_stats_the_dump_and_the_timeline(monkeypatch):
    monkeypatch.setenv("MPCOMM_STRAGGLER", "0.1")
    comm = Communicator(WORLD, timeout=60.0, validate=False)
    late, path, directory = P - 1, shared_path("late.json"), shared_path("dumps")
    with comm.timeline(path):
        for i in range(6):
            if comm.rank == late and i == 3:
                time.sleep(0.4)
            comm.allreduce(np.ones(4))
    seq = comm._trace.collectives - 2  # the fourth of the six
    found = comm.stragglers()
    mine = [r for r in found["reports"] if r["rank"] == late and r["seq"] == seq]
    assert len(mine) == 1 and 0.2 < mine[0]["late_s"] < 5 and mine[0]["operation"] == "allreduce", found
    assert found["late_calls"][late] >= 1 and found["threshold_s"] == 0.1
    everyone = WORLD.allgather([(r["rank"], r["seq"]) for r in found["reports"]])
    assert all(reports == everyone[0] for reports in everyone)  # the same reports on every rank
    with open(comm.dump_trace(directory), "rb") as f:
        reports = pickle.load(f)["mpcomm"]["stragglers"][comm._trace.name]
    assert any(r["rank"] == late and r["seq"] == seq for r in reports)
    WORLD.Barrier()  # (every rank's dump written)
    if comm.rank == 0:
        said = "\n".join(analyze(load(directory)).lines)
        assert f"rank {late} came " in said and f" after the others to #{seq} allreduce[" in said, said
        print(said)
    if comm.rank == 0:
        moments = [e for e in load_strictly(path)["traceEvents"] if e["ph"] == "i"]
        assert {e["pid"] for e in moments if e["args"]["rank"] == late and e["args"]["seq"] == seq} == set(range(P))
    comm.free()

