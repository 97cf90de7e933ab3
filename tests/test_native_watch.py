"""native's all-reduce as the library's blocking call under the watchdog (``native_calls.Watch``), where the library
can revoke a communicator and its fault tolerance is enabled (Open MPI: ``mpiexec --with-ft ulfm``): numpy's results
on every rank for every dtype and op, the timeout kept by the watchdog's revoke, the watch following the timeout and
dropped where the communicator is freed. Elsewhere (MPICH, Open MPI without it, ranks sharing cores) nothing is
watched, which the first test checks.

Run: ``timeout 600 mpiexec --with-ft ulfm -n 2 python -m pytest -q --with-mpi -m mpi tests/test_native_watch.py``
(Open MPI; under any other launch the watched cases skip).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import WORLD, assert_bitwise_equal, assert_reduced
from mpi4py import MPI
from test_exchange import DTYPES, inputs, ops_of
from test_native_wait import reduced
from test_timeouts import SILENT, TIMEOUT, assert_every_waiting_rank_timed_out, with_silent_rank

from mpcomm import Communicator, native_calls
from mpcomm.algorithms import native
from mpcomm.errors import MpcommError

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
COUNTS = [0, 1, 7, 4099, (1 << 16) + 3]


@pytest.fixture
def watched():
    comm = Communicator(WORLD, timeout=30.0)
    if comm.transport.watch is None:
        comm.free()
        pytest.skip("nothing is watched here (Open MPI launched with --with-ft ulfm, a core per rank)")
    yield comm
    comm.free()


def test_a_communicator_watches_exactly_where_the_library_can_revoke():
    """Both transports of a Communicator are watched where the library can revoke and its fault tolerance is on,
    MPI runs threads at once and the ranks have one node and a core each; nowhere else. The watch's deadline is
    the transport's, as it changes; free() drops it."""
    comm = Communicator(WORLD, timeout=12.0)
    transports = (comm._sync, comm._async)
    t = comm.transport
    expected = native_calls.fault_tolerant() and P > 1 and not t.cores_shared and not t.spans_nodes
    try:
        assert [u.watch is not None for u in transports] == [expected] * 2, native_calls.fault_tolerant()
        if expected:
            assert t.watch.timeout == 12.0
            with t.limited(2.5):
                assert t.watch.timeout == 2.5
            assert t.watch.timeout == 12.0
            with t.limited(0):  # (Work.wait(0) of a call run in the waiting thread)
                assert t.watch.timeout == 0
            with pytest.raises(ValueError, match="at least 0"):
                t.watch.timeout = -1.0
            assert native._way(t, 8, native_calls.load()) == native._WATCHED
    finally:
        assert comm.free()
    assert [u.watch for u in transports] == [None, None]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_op_is_numpys_on_every_rank(watched, dtype):
    """Each (op, count) all-reduced twice by native: the first call makes the plan (watched_allreduce from Python),
    the second is its express C call (the same blocking call, bound). Every result numpy's on the gathered inputs
    (NaNs, infinities and signed zeros too) and the same bits on every rank; the express call is the watched one."""
    comm = watched
    cases = [(op, n) for op in ops_of(dtype) for n in COUNTS]
    results = []
    for op, n in cases:
        x = inputs(dtype, op, n, comm.rank)
        results.append((x, comm.allreduce(x.copy(), op, "native"), comm.allreduce(x.copy(), op, "native")))
    bound = comm._planned_allreduce(np.ones(7, dtype), "sum", "native").express.bound
    assert bound[3] is comm.transport.watch, bound
    everyone = WORLD.allgather(results)
    for (op, n), *ranks in zip(cases, *everyone):
        label = f"allreduce[native] {op} {np.dtype(dtype)} x{n}"
        for call in (1, 2):
            assert_bitwise_equal([r[call] for r in ranks], f"{label} (call {call})")
            if np.dtype(dtype).kind == "f":
                np.testing.assert_array_equal(ranks[0][call], reduced([x for x, _, _ in ranks], op),
                                              err_msg=f"{label} (call {call})")
            else:
                assert_reduced(ranks[0][call], [x for x, _, _ in ranks], op, what=f"{label} (call {call})")


def test_auto_gives_two_ranks_small_all_reduces_to_native_where_it_blocks_under_the_watchdog():
    """Where native is the library's blocking call under the watchdog, auto's model has no exchange for rhd (that
    call took 0.97-1.03x raw Allreduce at 8 B-16 KiB, the exchange 1.0-1.4x; openmpi.md, "Stop 62"), so two ranks'
    small all-reduces are native's; elsewhere rhd's exchange stays priced, and auto gives it the smallest."""
    comm = Communicator(WORLD)
    try:
        watched, model = comm.transport.watch is not None, comm.selector.model
        chosen = [comm.selector.choose("allreduce", n, np.float32, "sum") for n in (8, 512, 4096)]
    finally:
        comm.free()
    assert (model.alpha_exchange is None) == watched, model.alpha_exchange
    if watched:
        assert chosen == ["native"] * 3, chosen
    elif P == 2 and native_calls.load() is not None:
        assert chosen[0] == "rhd", chosen


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("planned", [False, True], ids=["from Python", "the express call"])
def test_a_silent_rank_is_a_timeout_when_the_watchdog_revokes(planned):
    """A rank that never comes: every waiting rank's blocking call is let out by a revoke (its own watchdog's at the
    deadline, or another's) within the deadline and the watchdog's second, as CommTimeoutError naming the call and
    the revoke; the communicator is unusable after it."""
    comm = Communicator(WORLD, timeout=TIMEOUT)
    if comm.transport.watch is None:
        comm.free()
        pytest.skip("nothing is watched here")
    try:
        if planned:
            comm.allreduce(np.ones(8), algorithm="native")
        silence = with_silent_rank(comm, lambda c, _: c.allreduce(np.ones(8), algorithm="native"))
        unusable = comm._unusable
    finally:
        assert not comm.free()
    assert_every_waiting_rank_timed_out(silence, ["allreduce[native]", "revoked"])
    if RANK != SILENT:
        assert unusable is not None and "stopped midway" in unusable, unusable


@pytest.mark.mpi(min_size=2)
def test_a_rank_late_past_the_deadline_gets_the_sum_or_an_error_never_a_wrong_result():
    """The last rank comes after the others' deadline: they time out; it gets the right sum (the others' values had
    arrived before the revoke) or an error at once; never a wrong result, never a hang."""
    comm = Communicator(WORLD, timeout=TIMEOUT)
    if comm.transport.watch is None:
        comm.free()
        pytest.skip("nothing is watched here")
    comm.allreduce(np.ones(8), algorithm="native")
    WORLD.Barrier()
    start = time.monotonic()
    try:
        if RANK == P - 1:
            time.sleep(TIMEOUT + 1.5)
        outcome = "sum", comm.allreduce(np.full(8, RANK + 1.0), algorithm="native")
    except MpcommError as exc:
        outcome = type(exc).__name__, str(exc)
    elapsed = time.monotonic() - start
    comm.free()
    everyone = WORLD.allgather((outcome, elapsed))
    for rank, ((kind, value), seconds) in enumerate(everyone[:-1]):
        assert kind == "CommTimeoutError" and "revoked" in value, (rank, kind, value)
        assert seconds < TIMEOUT + 2.5, (rank, seconds)
    (kind, value), seconds = everyone[-1]
    assert seconds < TIMEOUT + 1.5 + 2.5, seconds
    if kind == "sum":
        np.testing.assert_array_equal(value, np.full(8, P * (P + 1) / 2))
    else:
        assert kind == "CommTimeoutError" and "revoked" in value, value


def test_a_library_that_cannot_revoke_makes_no_watch():
    """Built against a library without ULFM's revoke (MPICH's wheel), Watch refuses to be made, naming why (native
    never asks there: fault_tolerant() is False first)."""
    calls = native_calls.load()
    if calls is None or "Open MPI" in MPI.Get_library_version():
        pytest.skip("an extension built against a library without ULFM (MPICH)")
    assert not calls.fault_tolerant()
    with pytest.raises(NotImplementedError, match="cannot revoke"):
        calls.Watch(WORLD.py2f(), 1.0)
