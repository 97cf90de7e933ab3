"""Long runs and the edges (issue 28): ranks that always agree on the algorithm, a user's communicator that
mpcomm never leaves a pending operation on, communicators that do not leak, buffers of Python objects refused,
bounded bookkeeping, and the edges of the argument checks.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_edges.py`` (any N >= 1).
"""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from conftest import WORLD, in_step, run_gathered
from mpi4py import MPI

import mpcomm
from mpcomm import ANY_SOURCE, CommTimeoutError, Communicator, ConfigError, MpcommError, Status
from mpcomm.mpi_library import library
from mpcomm.p2p import INLINE_BYTES

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def errors_of(fn) -> list:
    """Every rank's (exception type name, message) of ``fn()``, or None where it raised nothing."""

    def run():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - returned for the assertions
            return type(exc).__name__, str(exc), isinstance(exc, MpcommError)
        return None

    return run_gathered(run)


# ------------------------------------------------------------------------------------------ Bad 1: auto agrees
def _differing_sizes(c: Communicator, operation: str, dtype) -> tuple[int, int] | None:
    """Two per-peer element counts whose send buffers auto, deciding from one rank's bytes, would run with
    different algorithms (None if the selector never changes its mind)."""
    itemsize = np.dtype(dtype).itemsize
    counts = sorted({int(x) for x in np.geomspace(1, 2**19, 160)})
    chosen = [c.selector.choose(operation, n * c.size * itemsize, np.dtype(dtype)) for n in counts]
    for i in range(1, len(counts)):
        if chosen[i] != chosen[i - 1]:
            return counts[i - 1], counts[i]
    return None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("validate", [False, True], ids=["plain", "validate"])
def test_auto_all_to_all_v_agrees_when_the_ranks_send_different_sizes(validate):
    """MoE routing: every rank sends its own amount. Rank 0 sends blocks whose bytes alone would make auto pick one
    algorithm, the others blocks that would make it pick another; all must run one algorithm and get numpy's
    answer (before: both timed out, or validate=True blamed algorithms the user never chose)."""
    c = Communicator(WORLD, timeout=10.0, validate=validate)
    try:
        pair = _differing_sizes(c, "all_to_all_v", np.float32)
        if pair is None:
            pytest.skip("the selector picks one all_to_all_v algorithm at every size here")
        for first in pair:  # twice, the other way round: no choice is remembered from one rank's own sizes
            blocks = [first if r == 0 else (pair[0] + pair[1] - first) for r in range(P)]
            send = np.arange(blocks[RANK] * P, dtype=np.float32) + 1000 * RANK
            recv = np.zeros(sum(blocks), dtype=np.float32)
            run_gathered(lambda: c.all_to_all_v(send, [blocks[RANK]] * P, recv, blocks))
            everyone = WORLD.allgather(send)
            want = np.concatenate([everyone[r][RANK * blocks[r] : (RANK + 1) * blocks[r]] for r in range(P)])
            assert np.array_equal(recv, want)
        algorithms = set(c.stats()["all_to_all_v"])
        assert "auto" not in algorithms and algorithms <= set(mpcomm.algorithms.REGISTRY["all_to_all_v"])
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variable, values", [("MPCOMM_NETWORK_PROBE", ("0", "1")),
                                              ("MPCOMM_STAGING_CHUNK", ("64k", "1M"))])
def test_environment_that_decides_algorithms_must_agree(monkeypatch, variable, values):
    """What shapes auto's model (the network probe) or the messages of a staged transfer (its chunk size) is a
    setting all ranks agree on: differing values are a ConfigError on every rank naming the variable."""
    monkeypatch.setenv(variable, values[0] if RANK == 0 else values[1])
    outcomes = errors_of(lambda: Communicator(WORLD, timeout=5.0, ranks_per_node=1).free())
    for name, message, _ in outcomes:
        assert name == "ConfigError" and variable in message, outcomes


# ------------------------------------------------------------------------------------------ Bad 2: the user's comm
@pytest.mark.mpi(min_size=2)
def test_a_late_rank_leaves_the_users_communicator_usable():
    """The last rank reaches the constructor 2.5 s after the others, whose timeout is 1 s: they raise, and so does
    it (the others left). The user's communicator must be untouched: its next collective gives the right answer
    (before: garbage such as [100, 2140472448]) and a new Communicator over it works."""
    user = WORLD.Dup()
    try:
        def construct():
            if RANK == P - 1:
                time.sleep(2.5)
            Communicator(user, timeout=1.0)

        outcomes = errors_of(construct)
        assert all(o is not None and o[2] for o in outcomes), outcomes  # an mpcomm error on every rank
        got = np.zeros(P, dtype=np.int64)
        request = user.Iallgather(np.array([100 + RANK], dtype=np.int64), got)
        deadline = time.monotonic() + 60
        while not request.Test():
            assert time.monotonic() < deadline, "the user's Iallgather never completed"
            time.sleep(0.001)
        assert got.tolist() == [100 + r for r in range(P)]
        c = Communicator(user, timeout=20.0)
        buf = np.full(5, RANK + 1.0)
        run_gathered(lambda: c.allreduce(buf))
        assert (buf == P * (P + 1) / 2).all()
        c.free()
    finally:
        user.Free()


@pytest.mark.parametrize("timeout", [1e-9, 1e-4])
def test_a_timeout_too_small_to_mean_anything_is_refused(timeout):
    outcomes = errors_of(lambda: Communicator(WORLD, timeout=timeout))
    for name, message, _ in outcomes:
        assert name == "ConfigError" and "timeout" in message and "at least" in message, outcomes


def test_the_constructor_leaves_nothing_on_the_users_communicator():
    """Everything mpcomm sends goes over communicators it made: a message the user left for itself on its own
    communicator is the first thing a receive there sees after constructing, splitting and freeing."""
    user = WORLD.Dup()
    try:
        message = np.array([7], dtype=np.int64)
        sending = user.Isend(message, RANK, tag=3)  # (to itself: completes once received below)
        c = Communicator(user, timeout=20.0)
        sub = c.split(RANK % 2)
        run_gathered(lambda: (sub.barrier(), sub.free(), c.free()))
        status = MPI.Status()
        assert user.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) and status.Get_tag() == 3
        got = np.zeros(1, dtype=np.int64)
        user.Recv(got, RANK, 3)
        sending.Wait()
        assert got[0] == 7 and not user.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        run_gathered(lambda: user.Barrier())
    finally:
        user.Free()


# ------------------------------------------------------------------------------------------ Bad 3: communicators
def test_free_releases_the_communicator_split_made(comm):
    sub = comm.split(0)
    made = sub.mpi
    run_gathered(lambda: sub.free())
    assert made == MPI.COMM_NULL, "free() left the MPI communicator split() made allocated"


def test_split_with_undefined_color_gives_none(comm):
    """MPI.UNDEFINED: this rank joins no group (MPI returns COMM_NULL); the others get their Communicator."""
    mine = in_step(lambda: comm.split(MPI.UNDEFINED if RANK == 0 else 1))
    if RANK == 0:
        assert mine is None
    else:
        assert isinstance(mine, Communicator) and mine.size == P - 1
        mine.free()


def test_split_takes_a_timeout_of_its_own(comm):
    """``timeout``: the new Communicator's deadline (torch's split_group passes its child's); default the parent's."""
    given, inherited = in_step(lambda: comm.split(0, timeout=7.5)), in_step(lambda: comm.split(0))
    assert (given.timeout, inherited.timeout) == (7.5, comm.timeout)
    run_gathered(lambda: (given.free(), inherited.free()))


def test_split_refuses_a_bad_timeout_on_every_rank(comm):
    outcomes = errors_of(lambda: comm.split(0, timeout=-1.0 if RANK == 0 else 5.0))
    for name, message, _ in outcomes:
        assert name == "ConfigError" and "timeout" in message, outcomes


@pytest.mark.parametrize("color", [-5, 1.5, "a"])
def test_split_refuses_a_bad_color(comm, color):
    outcomes = errors_of(lambda: comm.split(color))
    for name, message, _ in outcomes:
        assert name == "ValueError" and "color" in message, outcomes


def _mpich_release() -> tuple[int, ...]:
    found = re.search(r"MPICH Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", MPI.Get_library_version())
    return tuple(int(part or 0) for part in found.groups()) if found else ()


@pytest.mark.skipif(library().name != "mpich", reason="needs MPICH's limit of 2048 communicators per process "
                    "(Open MPI's is far larger: 1200 Communicators fit)")
@pytest.mark.skipif(_mpich_release() < (5, 0, 2), reason="MPICH before 5.0.2 waits forever in MPI_Comm_idup once "
                    "a process has no communicator left (docs/mpi.md)")
def test_running_out_of_mpi_communicators_is_an_mpcomm_error():
    """Communicators never freed: MPI runs out of communicators (MPICH: 2048 contexts). The error is mpcomm's,
    on every rank, says what ran out and what to do; freeing them makes room again."""
    made, error = [], None
    try:
        for _ in range(1200):
            try:
                made.append(Communicator(WORLD, timeout=30.0))
            except MpcommError as exc:
                error = exc
                break
        messages = WORLD.allgather(None if error is None else str(error))
        assert all(m is not None for m in messages), "no rank ran out within 1200 Communicators"
        for m in messages:
            assert "communicators" in m and "free()" in m, m
    finally:
        for c in made:
            c.free()
    c = Communicator(WORLD, timeout=30.0)
    buf = np.ones(3)
    c.allreduce(buf)
    c.free()
    assert (buf == P).all()


# ------------------------------------------------------------------------------------------ Bad 4: object dtypes
OBJECT_CALLS = {
    "send-small": lambda c: c.send(np.array([1, "a"], dtype=object), RANK),
    "send-large": lambda c: c.send(np.empty(INLINE_BYTES, dtype=object), RANK),
    "isend": lambda c: c.isend(np.empty(3, dtype=object), RANK),
    "recv": lambda c: c.recv(np.empty(3, dtype=object), RANK),
    "irecv-large": lambda c: c.irecv(np.empty(INLINE_BYTES, dtype=object), RANK),
    "sendrecv": lambda c: c.sendrecv(np.empty(3, dtype=object), RANK, np.empty(3, dtype=object), RANK),
    "structured-with-object": lambda c: c.send(np.zeros(2, dtype=[("a", "f8"), ("b", object)]), RANK),
    "allreduce": lambda c: c.allreduce(np.empty(3, dtype=object)),
    "all_gather": lambda c: c.all_gather(np.empty(1, dtype=object), np.empty(P, dtype=object)),
    "broadcast": lambda c: c.broadcast(np.empty(3, dtype=object)),
}


@pytest.mark.parametrize("case", list(OBJECT_CALLS))
def test_object_dtypes_are_refused_everywhere_with_one_error(comm, case):
    outcomes = errors_of(lambda: OBJECT_CALLS[case](comm))
    for name, message, _ in outcomes:
        assert name == "TypeError" and "Python objects" in message, outcomes
    run_gathered(lambda: comm.barrier())
    assert not comm._p2p.envelopes.mpi.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG), "a message was left in flight"


def test_a_structured_dtype_is_named_in_p2p_errors(comm):
    """A plain structured dtype travels as bytes; a mismatch names it (before: ``dtype#3598913878``)."""
    pair = np.dtype([("a", "i4"), ("b", "f4")])

    def run():
        comm.isend(np.zeros(3, dtype=pair), RANK, tag=9)
        comm.recv(np.zeros(3, dtype=np.float64), RANK, tag=9)

    for name, message, _ in errors_of(run):
        assert name == "ValueError" and "dtype#" not in message and "structured" in message, message


# ------------------------------------------------------------------------------------------ bounded bookkeeping
def test_stats_and_caches_stay_bounded_with_varying_shapes():
    """A job whose shapes vary (MoE, dynamic batching): 1500 distinct sizes keep the stats table at one entry per
    (operation, algorithm) and the plan and choice caches bounded; the totals stay exact."""
    c = Communicator(WORLD, timeout=20.0)
    try:
        sizes = range(1, 1501)

        def run():
            for n in sizes:
                c.allreduce(np.ones(n, dtype=np.float32), algorithm="ring" if n % 2 else "auto")

        run_gathered(run)
        tables = [len(c._sync.records), len(c._async.records)]
        stats = c.stats()["allreduce"]
        assert sum(r["calls"] for r in stats.values()) == len(sizes)
        assert sum(r["bytes"] for r in stats.values()) == 4 * sum(sizes)
        assert tables[0] <= len(stats), tables
        assert len(c._plans) <= 1024 and len(c.selector._decided) <= 1024
        c.reset_stats()
        assert c.stats() == {} and len(c._sync.records) == tables[0]  # (zeroed in place: plans count into them)
        assert all(calls == 0 for calls, _, _ in c._sync.records.values()), c._sync.records
    finally:
        c.free()


# ------------------------------------------------------------------------------------------ Weak: errors and edges
def test_an_mpi_failure_that_is_not_about_sizes_points_at_the_peer():
    """A peer that died mid-transfer shows up as an MPI error (e.g. process_vm_readv failed); the hint must say the
    peer may have died or stalled, not "do all ranks pass the same sizes and dtypes?", which stays for truncation."""
    from mpcomm.transport import Transport

    t = Transport(WORLD, 5.0)
    t.operation = "allreduce[ring]"
    other = str(t._mpi_error(MPI.Exception(MPI.ERR_OTHER), [], [1]))
    truncated = str(t._mpi_error(MPI.Exception(MPI.ERR_TRUNCATE), [], [1]))
    assert "sizes and dtypes" not in other and "died or stalled" in other, other
    assert "sizes and dtypes" in truncated, truncated


def test_a_timeout_names_each_peer_once():
    err = CommTimeoutError("send", [1, 1, 2, 1], 1.0, 1.0, rank=0)
    assert "[1, 2]" in str(err)


@pytest.mark.mpi(min_size=2)
def test_wait_with_zero_timeout_is_a_poll_in_progress_on_wait_mode(monkeypatch):
    """MPCOMM_PROGRESS=wait runs an operation inside wait(); wait(timeout=0) must only ask whether it is done, not
    run it against a zero deadline (before: the communicator was killed and the peers saw process_vm_readv
    errors)."""
    monkeypatch.setenv("MPCOMM_PROGRESS", "wait")
    c = Communicator(WORLD, timeout=20.0)
    try:
        def run():
            work = c.iallreduce(np.full(1 << 16, 1.0))
            if RANK == 0:
                with pytest.raises(CommTimeoutError, match="still"):
                    work.wait(timeout=0)
            return work.wait(), c.allreduce(np.ones(2))

        for result, again in run_gathered(run):
            assert (result == P).all() and (again == P).all()
    finally:
        c.free()


@pytest.mark.parametrize("progress", ["thread", "wait"])
def test_wait_with_a_huge_timeout_is_no_overflow(monkeypatch, progress):
    monkeypatch.setenv("MPCOMM_PROGRESS", progress)
    c = Communicator(WORLD, timeout=20.0)
    try:
        right, left = (RANK + 1) % P, (RANK - 1) % P

        def run():
            receiving = c.irecv(np.zeros(1 << 12), left)
            c.isend(np.ones(1 << 12), right).wait(timeout=2**40)
            return c.iallreduce(np.ones(3)).wait(timeout=2**40), receiving.wait(timeout=2**40)

        out = run_gathered(run)
        assert all((r[0] == P).all() and (r[1] == 1).all() for r in out)
    finally:
        c.free()


ROOTED = {
    "broadcast": lambda c, root: c.broadcast(np.ones(3), root=root),
    "reduce": lambda c, root: c.reduce(np.ones(3), np.ones(3), root=root),
    "gather": lambda c, root: c.gather(np.ones(3), np.ones(3 * P), root=root),
    "scatter": lambda c, root: c.scatter(np.ones(3 * P), np.ones(3), root=root),
}


@pytest.mark.parametrize("operation", list(ROOTED))
def test_root_none_is_a_clear_error(operation):
    c = Communicator(WORLD, timeout=10.0)
    try:
        for name, message, _ in errors_of(lambda: ROOTED[operation](c, None)):
            assert name == "ValueError" and "root None" in message and operation in message, message
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["tree", "native"])
def test_a_root_out_of_range_on_one_rank_never_gives_a_wrong_answer_later(algorithm):
    """Rank 1 passes root 99 to a scatter the others run with root 0. Rank 1 raises at once; whatever the root sent
    it must never be taken for a later call's data (before: rank 1's next broadcast returned the scatter's block):
    rank 1's next collective is refused (its communicator is unusable), and no rank gets a wrong result."""
    c = Communicator(WORLD, timeout=2.0)
    try:
        def run():
            out = np.zeros(4)
            try:
                c.scatter(np.arange(4.0 * P) if RANK == 0 else None, out, root=99 if RANK == 1 else 0,
                          algorithm=algorithm)
            except ValueError as exc:
                first = ("ValueError", str(exc))
            else:
                first = None
            buf = np.full(4, 10.0)
            try:
                c.broadcast(buf, root=0, algorithm=algorithm)
            except MpcommError as exc:
                return first, type(exc).__name__, None
            return first, None, buf.tolist()

        outcomes = run_gathered(run)
        assert outcomes[1][0] is not None and "root 99" in outcomes[1][0][1]
        assert outcomes[1][1] == "MpcommError"
        for r, (_, error, result) in enumerate(outcomes):
            assert error is not None or result == [10.0] * 4, f"rank {r} got a wrong result: {result}"
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
def test_recv_from_any_source_into_a_too_small_buffer_names_the_sender():
    c = Communicator(WORLD, timeout=10.0)
    try:
        def run():
            if RANK == 1:
                c.send(np.arange(20.0), 0, tag=4)
            elif RANK == 0:
                c.recv(np.zeros(3), ANY_SOURCE, 4)

        outcomes = errors_of(run)
        name, message, _ = outcomes[0]
        assert name == "ValueError" and "rank 1, tag 4" in message and "20 elements" in message, message
        assert all(o is None for o in outcomes[1:]), outcomes
    finally:
        c.free()
