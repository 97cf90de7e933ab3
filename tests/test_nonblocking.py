"""Non-blocking collectives: several in flight, issue order, mixing with blocking calls, errors through wait(),
on the progress thread and in progress-on-wait mode (what an MPI without THREAD_MULTIPLE gets); and by default,
progress while the caller computes without waiting.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_nonblocking.py`` (any N >= 1).
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from conftest import WORLD, assert_identical_across_ranks, assert_reduced, gather, in_step, make_input
from mpi4py import MPI

import mpcomm.work
from mpcomm import Communicator

pytestmark = pytest.mark.mpi

P = WORLD.Get_size()


@pytest.fixture(params=["thread", "wait"])
def nb(request, monkeypatch):
    """A fresh Communicator whose non-blocking collectives run on the progress thread or on wait()."""
    monkeypatch.setenv("MPCOMM_PROGRESS", request.param)
    comm = Communicator(WORLD)
    yield comm
    comm.free()


def test_several_in_flight_waited_in_reverse(nb):
    inputs = [make_input(np.float32, "sum", (n,), nb.rank, seed=n) for n in (0, 5, 1000, 70_001)]
    outputs = [x.copy() for x in inputs]
    algorithms = ["ring", "rhd", "tree", "ring_pipelined"]
    works = [nb.iallreduce(y, algorithm=a) for y, a in zip(outputs, algorithms)]
    results = in_step(lambda: [w.wait() for w in reversed(works)])
    assert all(r is y for r, y in zip(results, reversed(outputs)))  # wait() returns the buffer
    assert all(w.is_completed() for w in works)
    for x, y in zip(inputs, outputs):
        assert_identical_across_ranks(y)
        assert_reduced(y, gather(x), "sum")


def test_completion_in_issue_order(nb):
    """When a later operation is complete, every earlier one is too (one FIFO worker / a FIFO queue)."""
    bufs = [np.full(20_000, nb.rank, np.float64) for _ in range(5)]
    works = [nb.iallreduce(b) for b in bufs]
    in_step(works[-1].wait)
    assert [w.is_completed() for w in works] == [True] * 5
    assert all((b == P * (P - 1) / 2).all() for b in bufs)


def test_mixed_with_blocking_calls_in_rank_dependent_order(nb):
    """Odd ranks run blocking collectives before waiting, even ranks wait first: collectives still run in
    issue order on every rank, so nothing deadlocks and every result is right."""
    a = make_input(np.float64, "sum", (3001,), nb.rank, seed=1)
    b = make_input(np.float64, "max", (17,), nb.rank, seed=2)
    send = make_input(np.int32, "sum", (4 * P,), nb.rank, seed=3)
    mine = make_input(np.int64, "sum", (3,), nb.rank, seed=4)
    ya, yb, recv, gathered = a.copy(), b.copy(), np.empty(4, np.int32), np.empty(3 * P, np.int64)

    def body():
        first = nb.iallreduce(ya)
        second = nb.ireduce_scatter(send, recv)
        if nb.rank % 2:
            nb.allreduce(yb, op="max")
            nb.barrier()
            first.wait()
        else:
            first.wait()
            nb.allreduce(yb, op="max")
            nb.barrier()
        third = nb.iall_gather(mine, gathered)
        third.wait()
        second.wait()

    in_step(body)
    assert_reduced(ya, gather(a), "sum")
    assert_reduced(yb, gather(b), "max")
    sends = gather(send)
    assert_reduced(recv, [s[4 * nb.rank : 4 * nb.rank + 4] for s in sends], "sum")
    assert (gathered == np.concatenate(gather(mine))).all()


def test_starting_does_not_wait_for_other_ranks(nb):
    """Rank r starts its first iallreduce before rank r+1 has started its own (a chain of messages on
    COMM_WORLD orders them): starting must not block on the other ranks (a regression would hang here)."""
    y = np.ones(1000)
    if nb.rank > 0:
        WORLD.recv(source=nb.rank - 1, tag=77)
    work = nb.iallreduce(y)
    if nb.rank < P - 1:
        WORLD.send("started", dest=nb.rank + 1, tag=77)
    in_step(work.wait)
    assert (y == P).all()


def test_errors_propagate_through_wait(nb):
    """A bad argument raises (at the call or at wait) and the communicator stays usable."""
    with pytest.raises(TypeError, match="avg"):
        nb.iallreduce(np.ones(4, np.int32), op="avg").wait()
    with pytest.raises(TypeError, match="unsupported dtype"):
        nb.iallreduce(np.array(["a", "b"])).wait()
    with pytest.raises(ValueError, match="unknown algorithm"):
        nb.iallreduce(np.ones(4), algorithm="warp").wait()
    with pytest.raises(ValueError, match="elements"):
        nb.ireduce_scatter(np.ones(P + 1), np.ones(1)).wait()
    y = np.ones(9)
    in_step(nb.iallreduce(y).wait)
    assert (y == P).all()


def start_collective(comm: Communicator, name: str, n: int):
    """Start non-blocking collective ``name``: (its Work, a function telling whether this rank's output already
    holds the right result; True where this rank has no output, e.g. a non-root of igather)."""
    p, r, last = comm.size, comm.rank, comm.size - 1
    blocks = np.repeat(np.arange(p, dtype=np.float64) + 1, n)  # block q holds q + 1
    if name == "iallreduce":
        out = np.ones(n * p)
        return comm.iallreduce(out), lambda: bool((out == p).all())
    if name == "ireduce_scatter":
        out = np.zeros(n)
        return comm.ireduce_scatter(np.ones(n * p), out), lambda: bool((out == p).all())
    if name == "iall_gather":
        out = np.zeros(n * p)
        return comm.iall_gather(np.full(n, r + 1.0), out), lambda: bool((out == blocks).all())
    if name == "ibroadcast":
        out = np.full(n, 7.0) if r == 0 else np.zeros(n)
        return comm.ibroadcast(out, root=0), lambda: bool((out == 7.0).all())
    if name == "igather":
        out = np.zeros(n * p) if r == last else None
        return comm.igather(np.full(n, r + 1.0), out, root=last), lambda: out is None or bool((out == blocks).all())
    if name == "iscatter":
        out = np.zeros(n)
        return comm.iscatter(blocks if r == 0 else None, out, root=0), lambda: bool((out == r + 1.0).all())
    if name == "ireduce":
        out = np.zeros(n) if r == last else None
        return comm.ireduce(np.ones(n), out, root=last), lambda: out is None or bool((out == p).all())
    if name == "iall_to_all":  # block j of rank r's input goes to rank j: rank r receives 10 j + r from rank j
        out = np.zeros(n * p)
        want = np.repeat(np.arange(p, dtype=np.float64) * 10 + r, n)
        return (comm.iall_to_all(np.repeat(np.arange(p, dtype=np.float64) + 10 * r, n), out),
                lambda: bool((out == want).all()))
    raise ValueError(name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("start", ["iallreduce", "ireduce_scatter", "iall_gather", "ibroadcast", "igather",
                                   "iscatter", "ireduce", "iall_to_all"])
def test_progress_while_the_caller_computes(monkeypatch, start):
    """By default a non-blocking collective completes while the caller computes, touching neither the Work nor
    mpcomm (what DDP's overlap rests on): its result appears in the output buffer before any wait() or
    is_completed() — each of which would run the operation itself in progress-on-wait mode."""
    monkeypatch.delenv("MPCOMM_PROGRESS", raising=False)
    comm = Communicator(WORLD)
    work, arrived_now = start_collective(comm, start, 50_000)
    deadline = time.monotonic() + 30.0
    matrix, steps = np.eye(64), 0
    while not arrived_now() and time.monotonic() < deadline:
        matrix = np.tanh(matrix @ matrix + 1.0)  # the caller's computation: numpy only, no mpcomm call
        steps += 1
    arrived = arrived_now()
    in_step(work.wait)  # every rank finishes the operation, whatever happened above
    comm.free()
    everyone = WORLD.allgather((arrived, steps, arrived_now()))
    assert all(right for _, _, right in everyone), f"wrong result after wait(): {everyone}"
    assert all(a for a, _, _ in everyone), (
        "the result did not arrive while the caller computed for 30 s without waiting; (rank, arrived, steps): "
        f"{[(r, a, s) for r, (a, s, _) in enumerate(everyone)]}")


def test_thread_level_below_multiple_warns_once_and_falls_back(monkeypatch):
    monkeypatch.delenv("MPCOMM_PROGRESS", raising=False)
    monkeypatch.setattr(mpcomm.work.MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    monkeypatch.setattr(mpcomm.work, "_warned_thread_level", False)
    first, second = Communicator(WORLD), Communicator(WORLD)
    with pytest.warns(RuntimeWarning, match="THREAD_SERIALIZED.*inside wait"):
        w1 = first.iallreduce(np.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w2 = second.iallreduce(y2 := np.ones(3))
    assert first._executor is None and second._executor is None
    in_step(lambda: (w2.wait(), w1.wait()))
    assert (y2 == P).all()
    first.free()
    second.free()


# Every non-blocking form against its blocking form, on the progress thread and in progress-on-wait mode, with a
# root that is not rank 0.
def _pairs(comm: Communicator, seed: int):
    """name -> (start the non-blocking call, run the blocking one): each returns the output it wrote."""
    p, r, root = comm.size, comm.rank, comm.size - 1
    x = make_input(np.float64, "sum", (5 * p,), r, seed=seed)
    counts = [(r + j) % 3 for j in range(p)]  # rank r sends (r + j) % 3 elements to rank j
    recv_counts = [(j + r) % 3 for j in range(p)]
    sendv = make_input(np.float32, "sum", (sum(counts),), r, seed=seed + 1)

    def out(n):
        return np.full(n, -1.0)

    return {
        "broadcast": (lambda: (lambda b: (comm.ibroadcast(b, root=root), b))(x.copy()),
                      lambda: (lambda b: (comm.broadcast(b, root=root), b)[1])(x.copy())),
        "reduce": (lambda: (lambda o: (comm.ireduce(x, o, root=root), o))(out(5 * p)),
                   lambda: (lambda o: (comm.reduce(x, o, root=root), o)[1])(out(5 * p))),
        "gather": (lambda: (lambda o: (comm.igather(x[:5], o, root=root), o))(out(5 * p)),
                   lambda: (lambda o: (comm.gather(x[:5], o, root=root), o)[1])(out(5 * p))),
        "scatter": (lambda: (lambda o: (comm.iscatter(x, o, root=root), o))(out(5)),
                    lambda: (lambda o: (comm.scatter(x, o, root=root), o)[1])(out(5))),
        "all_to_all": (lambda: (lambda o: (comm.iall_to_all(x, o), o))(out(5 * p)),
                       lambda: (lambda o: (comm.all_to_all(x, o), o)[1])(out(5 * p))),
        "all_to_all_v": (lambda: (lambda o: (comm.iall_to_all_v(sendv, counts, o, recv_counts), o))(
                             np.full(sum(recv_counts), -1, np.float32)),
                         lambda: (lambda o: (comm.all_to_all_v(sendv, counts, o, recv_counts), o)[1])(
                             np.full(sum(recv_counts), -1, np.float32))),
        "barrier": (lambda: (comm.ibarrier(), np.zeros(0)), lambda: (comm.barrier(), np.zeros(0))[1]),
    }


@pytest.mark.parametrize("name", ["broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_v",
                                  "barrier"])
def test_every_nonblocking_collective_equals_its_blocking_form(nb, name):
    """(``nb``: this file's fixture, progress thread and progress on wait.) Several in flight, waited in reverse."""
    pairs = _pairs(nb, seed=len(name))
    started = [pairs[name][0]() for _ in range(3)]
    in_step(lambda: [work.wait() for work, _ in reversed(started)])
    assert all(work.is_completed() for work, _ in started)
    want = in_step(pairs[name][1])
    root = nb.size - 1
    for _, got in started:
        if name in ("reduce", "gather") and nb.rank != root:
            continue  # only the root's output is defined
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, nb.rank, got, want)


def test_the_progress_thread_polls_without_sleeping_while_the_caller_waits(monkeypatch):
    """A wait on a background thread sleeps between its polls (so the caller's compute keeps its core), but not
    while the caller waits for that very operation: the progress thread's transport, and its node / cross-node
    parts, count the waiting thread (mpcomm.transport.Waiters), and count nobody once the wait returns.
    Assumes a progress thread, which needs MPI_THREAD_MULTIPLE (else wait() runs the probe itself)."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip(f"no progress thread: MPI provides thread level {MPI.Query_thread()}, not MULTIPLE")
    monkeypatch.setenv("MPCOMM_PROGRESS", "thread")
    comm = Communicator(WORLD)

    def seen_while_waited_on(t):
        shared = t.node.waiters is t.waiters and t.cross.waiters is t.waiters
        deadline = time.monotonic() + 30
        while not t.waiters.count and time.monotonic() < deadline:
            time.sleep(1e-3)
        return shared, t.waiters.count

    work = comm._submit("progress probe", seen_while_waited_on)
    assert in_step(work.wait) == (True, 1)
    assert comm._async.waiters.count == 0
    comm.free()
