"""A rank that never calls: every other rank raises CommTimeoutError within timeout + 5 s — for every algorithm
of every collective, barrier, point-to-point, the non-blocking collectives and ``Work.wait(timeout)``.

Rank 0 is the silent rank: it does not make the call while the others wait for it. Each call is the first on
its communicator, so for hierarchical it also makes the node and cross-node communicators. Only when a rank is still
waiting timeout + 6 s after the start (a timeout that never fired) does rank 0 make the matching call, to let it
out, so that a broken timeout fails the test instead of hanging the run. A collective that timed out leaves its
communicator unusable (tests/test_errors.py), so every case has a communicator of its own, freed at the end.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_timeouts.py`` (N >= 2).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi(min_size=2)

P = WORLD.Get_size()
SILENT = 0
TIMEOUT = 1.0  # the communicator's (or the wait's) timeout in every case
GRACE = 5.0  # every waiting rank must have given up within TIMEOUT + GRACE
BIG = 1 << 19  # float64 elements (4 MiB): above any eager limit, so a send cannot complete without its receiver
COUNT = 8


@dataclass
class Outcome:
    """What a waiting rank saw: the exception (type name, message, peers, elapsed) or None, and its wall time."""

    error: str | None
    message: str
    peers: tuple
    elapsed: float
    wall: float


@dataclass
class Silence:
    """Every rank's outcome (rank 0's is None) and whether rank 0 had to make the call to release a waiting rank."""

    outcomes: list[Outcome | None]
    released: bool
    state: dict = field(default_factory=dict)  # what the call left behind on this rank (e.g. its Work)


def with_silent_rank(comm: Communicator, call: Callable[[Communicator, dict], Any],
                     release: Callable[[Communicator], Any] | None = None, quiet: float = 0.0) -> Silence:
    """Collective over WORLD: every rank but SILENT runs ``call(comm, state)``; SILENT waits (not calling) until all
    have finished, or until TIMEOUT + GRACE + 1 s have passed, and then runs ``release(comm)`` (default: the same
    call) so that ranks whose timeout never fired are let out. For its first ``quiet`` seconds SILENT makes no MPI
    call at all: while a process is inside MPI, even polling, a library may take a message of any size into its own
    buffers (Intel MPI does), which would let a send to SILENT complete."""
    start = time.monotonic()
    state: dict = {}
    outcome = None
    if WORLD.Get_rank() != SILENT:
        try:
            call(comm, state)
            outcome = (None, "", (), 0.0, time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            outcome = (type(exc).__name__, str(exc), tuple(getattr(exc, "peers", ())),
                       float(getattr(exc, "elapsed", 0.0)), time.monotonic() - start)
    if WORLD.Get_rank() == SILENT:
        time.sleep(quiet)
    finished = WORLD.Ibarrier()  # "I am done": SILENT posts it at once, the others when their call has returned
    released = False
    if WORLD.Get_rank() == SILENT:
        deadline = start + TIMEOUT + GRACE + 1.0
        while not finished.Test():
            if time.monotonic() > deadline:
                released = True
                try:
                    (release or (lambda c: call(c, {})))(comm)
                except Exception:  # noqa: BLE001 - only a way out for ranks whose timeout never fired
                    pass
                break
            time.sleep(0.01)
    finished.Wait()
    everyone = WORLD.allgather((outcome, released))
    return Silence([None if o is None else Outcome(*o) for o, _ in everyone], any(r for _, r in everyone), state)


def assert_every_waiting_rank_timed_out(silence: Silence, words: list[str], timeout: float = TIMEOUT,
                                        waiting=None) -> None:
    """Each rank in ``waiting`` (default: all but SILENT) raised CommTimeoutError naming the call (``words``), its
    peers and the time, within timeout + GRACE; any other rank but SILENT finished or did the same."""
    assert not silence.released, (
        f"rank {SILENT} had to make the call after {TIMEOUT + GRACE + 1:.0f} s to let out ranks still waiting for it: "
        f"{[(r, o) for r, o in enumerate(silence.outcomes)][1:]}")
    waiting = range(1, P) if waiting is None else waiting
    for r, o in enumerate(silence.outcomes):
        if r == SILENT:
            continue
        assert o.wall < timeout + GRACE, f"rank {r} took {o.wall:.1f} s to give up: {o.message}"
        if o.error is None and r not in waiting:
            continue
        assert o.error is not None, f"rank {r} completed without rank {SILENT} (after {o.wall:.2f} s)"
        assert o.error == "CommTimeoutError", f"rank {r}: {o.error}: {o.message}"
        assert o.elapsed >= timeout, f"rank {r} reports {o.elapsed} s < timeout {timeout}: {o.message}"
        assert o.peers and set(o.peers) <= set(range(P)) - {r}, f"rank {r}: peers {o.peers}: {o.message}"
        assert "timed out after" in o.message and f"peer rank(s) {list(o.peers)}" in o.message, o.message
        missing = [w for w in words if w not in o.message]
        assert not missing, f"rank {r}: {missing} not in {o.message!r}"


@pytest.fixture
def fresh():
    """A communicator of this case alone (a timed-out collective leaves it unusable), with the short timeout."""
    comm = Communicator(WORLD, timeout=TIMEOUT)
    yield comm
    comm.free()


# ------------------------------------------------------------------------------------------ blocking collectives
ROOT = P - 1  # reduce and gather: the root needs rank 0's part (a rank that only sends may finish without it)


def _collective_call(operation: str, algorithm: str) -> Callable[[Communicator], Any]:
    """The call of ``operation`` that leaves every rank but 0 waiting for rank 0 (reduce, gather: the root)."""
    kw = {"algorithm": algorithm}
    calls = {
        "allreduce": lambda c: c.allreduce(np.ones(COUNT), **kw),
        "reduce_scatter": lambda c: c.reduce_scatter(np.ones(COUNT * P), np.empty(COUNT), **kw),
        "all_gather": lambda c: c.all_gather(np.ones(COUNT), np.empty(COUNT * P), **kw),
        "broadcast": lambda c: c.broadcast(np.ones(COUNT), root=SILENT, **kw),
        "reduce": lambda c: c.reduce(np.ones(COUNT), np.empty(COUNT), root=ROOT, **kw),
        "gather": lambda c: c.gather(np.ones(COUNT), np.empty(COUNT * P), root=ROOT, **kw),
        "scatter": lambda c: c.scatter(np.ones(COUNT * P), np.empty(COUNT), root=SILENT, **kw),
        "all_to_all": lambda c: c.all_to_all(np.ones(COUNT * P), np.empty(COUNT * P), **kw),
        "all_to_all_v": lambda c: c.all_to_all_v(np.ones(COUNT * P), [COUNT] * P, np.empty(COUNT * P), [COUNT] * P,
                                                 **kw),
    }
    return calls[operation]


# (operation, algorithm, warm): auto runs one of these algorithms. warm: one call completes first, so that the
# silent rank is met inside hierarchical's node and cross-node levels, not while they are being made.
COLLECTIVES = [(op, alg, False) for op in REGISTRY for alg in sorted(REGISTRY[op])] + [("allreduce", "hierarchical",
                                                                                        True)]


@pytest.mark.parametrize("operation, algorithm, warm", COLLECTIVES,
                         ids=[f"{o}-{a}{'-warm' if w else ''}" for o, a, w in COLLECTIVES])
def test_collective_with_a_silent_rank_times_out(operation, algorithm, warm):
    """ranks_per_node=1 gives hierarchical a real two-level layout. reduce and gather: the root must time out, the
    other ranks may also finish (their part sent), but none may wait longer."""
    comm = Communicator(WORLD, timeout=TIMEOUT, ranks_per_node=1 if algorithm == "hierarchical" else None)
    call = _collective_call(operation, algorithm)
    try:
        if warm:
            call(comm)
        silence = with_silent_rank(comm, lambda c, _: call(c))
    finally:
        comm.free()
    waiting = [ROOT] if operation in ("reduce", "gather") else range(1, P)
    assert_every_waiting_rank_timed_out(silence, [f"{operation}[{algorithm}]"], waiting=waiting)


def test_barrier_with_a_silent_rank_times_out(fresh):
    assert_every_waiting_rank_timed_out(with_silent_rank(fresh, lambda c, _: c.barrier()), ["barrier"])


def test_split_with_a_silent_rank_times_out(fresh):
    """MPI_Comm_split has no non-blocking form: the ranks meet with the deadline first, so the others do not stay
    inside the split until rank 0 comes (they did: released only by rank 0's late call)."""
    subs = []
    silence = with_silent_rank(fresh, lambda c, _: subs.append(c.split(0)), lambda c: subs.append(c.split(0)))
    for sub in subs:  # only where a broken deadline let the split through
        sub.free()
    assert_every_waiting_rank_timed_out(silence, ["split"])


# ------------------------------------------------------------------------------------------ point to point
def _release_sends(c: Communicator) -> None:
    for r in range(1, P):
        c.recv(np.empty(BIG), r)


def _release_recvs(c: Communicator) -> None:
    for r in range(1, P):
        c.send(np.ones(COUNT), r)


def _release_sendrecvs(c: Communicator) -> None:
    for r in range(1, P):
        c.sendrecv(np.ones(COUNT), r, np.empty(COUNT), r)


# name -> (call on a waiting rank, rank 0's release, words of the error, timeout of the communicator)
P2P = {
    "send": (lambda c, _: c.send(np.ones(BIG), SILENT), _release_sends, ["send", f"to rank {SILENT}"], TIMEOUT),
    "isend-wait": (lambda c, _: c.isend(np.ones(BIG), SILENT).wait(), _release_sends, ["send", f"to rank {SILENT}"],
                   TIMEOUT),
    "isend-wait-timeout": (lambda c, _: c.isend(np.ones(BIG), SILENT).wait(timeout=TIMEOUT), _release_sends,
                           ["send", f"to rank {SILENT}"], 60.0),
    "recv": (lambda c, _: c.recv(np.empty(COUNT), SILENT), _release_recvs, ["recv", f"from rank {SILENT}"], TIMEOUT),
    "irecv-wait": (lambda c, _: c.irecv(np.empty(COUNT), SILENT).wait(), _release_recvs,
                   ["recv", f"from rank {SILENT}"], TIMEOUT),
    "irecv-wait-timeout": (lambda c, _: c.irecv(np.empty(COUNT), SILENT).wait(timeout=TIMEOUT), _release_recvs,
                           ["recv", f"from rank {SILENT}"], 60.0),
    "sendrecv": (lambda c, _: c.sendrecv(np.ones(COUNT), SILENT, np.empty(COUNT), SILENT), _release_sendrecvs,
                 ["recv", f"from rank {SILENT}"], TIMEOUT),
}

SENDS = ("send", "isend-wait", "isend-wait-timeout")


@pytest.mark.parametrize("case", list(P2P))
def test_point_to_point_with_a_silent_rank_times_out(case):
    """Sends are rendezvous-sized (a small one may complete into MPI's buffers with nobody receiving, as MPI
    allows), and SILENT stays out of MPI while they wait. ``…-wait-timeout``: the communicator's timeout is 60 s,
    the one given to ``wait`` bounds the wait."""
    call, release, words, comm_timeout = P2P[case]
    comm = Communicator(WORLD, timeout=comm_timeout)
    try:
        silence = with_silent_rank(comm, call, release, quiet=TIMEOUT + 1.0 if case in SENDS else 0.0)
    finally:
        comm.free()
    assert_every_waiting_rank_timed_out(silence, words)


# ------------------------------------------------------------------------------------------ non-blocking collectives
NONBLOCKING = {  # name -> (start of the call, the operation its error names, ranks that must time out: None =
    # every rank but SILENT; a rooted collective's other senders may finish without SILENT)
    "iallreduce": (lambda c: c.iallreduce(np.ones(COUNT)), "allreduce", None),
    "ireduce_scatter": (lambda c: c.ireduce_scatter(np.ones(COUNT * P), np.empty(COUNT)), "reduce_scatter", None),
    "iall_gather": (lambda c: c.iall_gather(np.ones(COUNT), np.empty(COUNT * P)), "all_gather", None),
    "ibroadcast": (lambda c: c.ibroadcast(np.ones(COUNT), root=SILENT), "broadcast", None),
    "ireduce": (lambda c: c.ireduce(np.ones(COUNT), np.empty(COUNT), root=ROOT), "reduce", [ROOT]),
    "igather": (lambda c: c.igather(np.ones(COUNT), np.empty(COUNT * P), root=ROOT), "gather", [ROOT]),
    "iscatter": (lambda c: c.iscatter(np.ones(COUNT * P), np.empty(COUNT), root=SILENT), "scatter", None),
    "iall_to_all": (lambda c: c.iall_to_all(np.ones(COUNT * P), np.empty(COUNT * P)), "all_to_all", None),
    "iall_to_all_v": (lambda c: c.iall_to_all_v(np.ones(COUNT * P), [COUNT] * P, np.empty(COUNT * P), [COUNT] * P),
                      "all_to_all_v", None),
    "ibarrier": (lambda c: c.ibarrier(), "barrier", None),
}


@pytest.mark.parametrize("progress", ["thread", "wait"])
@pytest.mark.parametrize("case", list(NONBLOCKING))
def test_nonblocking_collective_with_a_silent_rank_times_out(monkeypatch, case, progress):
    """``wait()`` raises the operation's own timeout, on the progress thread and in progress-on-wait mode."""
    monkeypatch.setenv("MPCOMM_PROGRESS", progress)
    start, operation, waiting = NONBLOCKING[case]
    comm = Communicator(WORLD, timeout=TIMEOUT)
    try:
        silence = with_silent_rank(comm, lambda c, _: start(c).wait(), lambda c: start(c).wait())
    finally:
        comm.free()
    assert_every_waiting_rank_timed_out(silence, [operation], waiting=waiting)


def test_work_wait_timeout_bounds_the_wait_and_the_operation_goes_on(monkeypatch):
    """``Work.wait(timeout)`` of a collective on the progress thread gives up after ``timeout`` (the communicator's
    own is 60 s) without stopping the operation: once rank 0 joins, a second ``wait()`` returns the sum."""
    monkeypatch.setenv("MPCOMM_PROGRESS", "thread")
    comm = Communicator(WORLD, timeout=60.0)
    y = np.ones(COUNT)

    def start_and_wait(c, state):
        state["work"] = c.iallreduce(y)
        state["work"].wait(timeout=TIMEOUT)

    try:
        silence = with_silent_rank(comm, start_and_wait, lambda c: c.iallreduce(y).wait())
        if not silence.released:  # rank 0 joins now: everyone's operation completes
            work = comm.iallreduce(y) if comm.rank == SILENT else silence.state["work"]
            run_gathered(lambda: work.wait(timeout=30.0))
        summed = WORLD.allgather(y.copy())
    finally:
        comm.free()
    assert_every_waiting_rank_timed_out(silence, ["allreduce"])
    for r, got in enumerate(summed):
        assert (got == P).all(), f"rank {r}: {got} after the late join (expected {P})"


def test_work_wait_timeout_bounds_the_wait_in_progress_on_wait_mode(monkeypatch):
    monkeypatch.setenv("MPCOMM_PROGRESS", "wait")
    comm = Communicator(WORLD, timeout=TIMEOUT + GRACE + 0.5)  # a wait bounded only by this one takes too long
    try:
        silence = with_silent_rank(comm, lambda c, _: c.iallreduce(np.ones(COUNT)).wait(timeout=TIMEOUT))
    finally:
        comm.free()
    assert_every_waiting_rank_timed_out(silence, ["allreduce"])
