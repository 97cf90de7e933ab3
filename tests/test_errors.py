"""Bad input gives a clear error, never a hang or a silent wrong answer.

* Local errors (dtype, op, algorithm, sizes, ranks, read-only output) must be raised before any
  communication: only ONE rank makes the bad call (on a communicator with a short timeout), so an
  implementation that communicated first would time out instead of raising the expected error.
* validate=True: ranks disagreeing on the arguments all raise CollectiveMismatchError listing every rank's call.
* A rank that never calls: the others raise CommTimeoutError (operation, peers, elapsed) within timeout + 5 s —
  for every collective, algorithm, point-to-point call and Work.wait(timeout) in tests/test_timeouts.py; here,
  what a communicator does after such a timeout.
* Environment: MPCOMM_TIMEOUT and MPCOMM_VALIDATE.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_errors.py``.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import WORLD, run_gathered, without_rank

from mpcomm import CollectiveMismatchError, CommTimeoutError, Communicator, MpcommError

pytestmark = pytest.mark.mpi

P = WORLD.Get_size()
LONELY = P - 1  # the one rank that makes the bad call


@pytest.fixture(scope="module")
def short():
    """A communicator whose blocking calls give up after 5 s (bounds the failure mode of these tests)."""
    c = Communicator(WORLD, timeout=5.0)
    yield c
    c.free()


def readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


# name -> (call on a communicator c, expected exception, substrings the message must contain)
LOCAL_ERRORS = {
    "allreduce-float128": (lambda c: c.allreduce(np.zeros(3, np.longdouble)), TypeError, ["allreduce", "unsupported dtype"]),
    "allreduce-structured": (lambda c: c.allreduce(np.zeros(3, "i4,f4")), TypeError, ["allreduce", "unsupported dtype"]),
    "allreduce-object": (lambda c: c.allreduce(np.zeros(3, object)), TypeError, ["allreduce"]),
    "reduce_scatter-float128": (
        lambda c: c.reduce_scatter(np.zeros(P, np.longdouble), np.zeros(1, np.longdouble)), TypeError, ["reduce_scatter"]),
    "all_gather-structured": (
        lambda c: c.all_gather(np.zeros(2, "i4,f4"), np.zeros(2 * P, "i4,f4")), TypeError, ["all_gather", "unsupported"]),
    "broadcast-float128": (lambda c: c.broadcast(np.zeros(2, np.longdouble)), TypeError, ["broadcast", "unsupported"]),
    "avg-int": (lambda c: c.allreduce(np.zeros(3, np.int32), op="avg"), TypeError, ["allreduce", "avg", "int32"]),
    "avg-int-reduce_scatter": (
        lambda c: c.reduce_scatter(np.zeros(P, np.uint8), np.zeros(1, np.uint8), op="avg"), TypeError, ["avg", "uint8"]),
    "sum-bool": (lambda c: c.allreduce(np.zeros(3, bool), op="sum"), TypeError, ["bool", "sum"]),
    "max-complex": (lambda c: c.allreduce(np.zeros(3, np.complex64), op="max"), TypeError, ["complex64", "max"]),
    "unknown-op": (lambda c: c.allreduce(np.zeros(3), op="xor"), TypeError, ["allreduce", "xor"]),
    "unknown-op-reduce_scatter": (
        lambda c: c.reduce_scatter(np.zeros(P), np.zeros(1), op="median"), TypeError, ["reduce_scatter", "median"]),
    "unknown-algorithm": (lambda c: c.allreduce(np.zeros(3), algorithm="butterfly"), ValueError, ["allreduce", "butterfly", "ring"]),
    "unknown-algorithm-broadcast": (lambda c: c.broadcast(np.zeros(3), algorithm="ring2"), ValueError, ["broadcast", "ring2"]),
    "unknown-algorithm-all_gather": (
        lambda c: c.all_gather(np.zeros(1), np.zeros(P), algorithm="tree9"), ValueError, ["all_gather", "tree9"]),
    "reduce_scatter-size": (
        lambda c: c.reduce_scatter(np.zeros(3 * P + 1), np.zeros(3)), ValueError, ["reduce_scatter", str(3 * P + 1), "3"]),
    "reduce_scatter-recv-too-small": (
        lambda c: c.reduce_scatter(np.zeros(4 * P), np.zeros(3)), ValueError, ["reduce_scatter", str(4 * P)]),
    "all_gather-recv-too-small": (
        lambda c: c.all_gather(np.zeros(4), np.zeros(4 * P - 1)), ValueError, ["all_gather", str(4 * P - 1)]),
    "all_gather-recv-too-large": (
        lambda c: c.all_gather(np.zeros(4), np.zeros(4 * P + 4)), ValueError, ["all_gather", str(4 * P + 4)]),
    "reduce_scatter-dtypes": (
        lambda c: c.reduce_scatter(np.zeros(P, np.float64), np.zeros(1, np.float32)), TypeError, ["float64", "float32"]),
    "all_gather-dtypes": (
        lambda c: c.all_gather(np.zeros(1, np.int32), np.zeros(P, np.int64)), TypeError, ["int32", "int64"]),
    "send-bad-dst": (lambda c: c.send(np.zeros(3), P), ValueError, ["send", "destination", str(P)]),
    "isend-negative-dst": (lambda c: c.isend(np.zeros(3), -1), ValueError, ["send", "-1"]),
    "recv-bad-src": (lambda c: c.recv(np.zeros(3), P + 3), ValueError, ["recv", "source", str(P + 3)]),
    "irecv-negative-src": (lambda c: c.irecv(np.zeros(3), -2), ValueError, ["recv", "-2"]),
    "sendrecv-bad-dst": (lambda c: c.sendrecv(np.zeros(3), P, np.zeros(3), 0), ValueError, ["send", str(P)]),
    "sendrecv-bad-src": (lambda c: c.sendrecv(np.zeros(3), 0, np.zeros(3), P), ValueError, ["recv", str(P)]),
    "readonly-allreduce": (lambda c: c.allreduce(readonly(np.zeros(3))), ValueError, ["allreduce", "read-only"]),
    "readonly-broadcast": (lambda c: c.broadcast(readonly(np.zeros(3))), ValueError, ["broadcast", "read-only"]),
    "readonly-reduce_scatter": (
        lambda c: c.reduce_scatter(np.zeros(P), readonly(np.zeros(1))), ValueError, ["reduce_scatter", "read-only"]),
    "readonly-all_gather": (
        lambda c: c.all_gather(np.zeros(1), readonly(np.zeros(P))), ValueError, ["all_gather", "read-only"]),
    "readonly-recv": (lambda c: c.recv(readonly(np.zeros(3)), 0), ValueError, ["recv", "read-only"]),
    "readonly-bytes": (lambda c: c.allreduce(b"\x01\x02", op="max"), ValueError, ["allreduce", "read-only"]),
    "not-a-buffer": (lambda c: c.allreduce([1.0, 2.0]), TypeError, ["allreduce", "list"]),
}


def assert_lonely_error(c: Communicator, case: str, call, expected, fragments) -> None:
    """Only rank LONELY makes the bad ``call`` on ``c``: it must raise ``expected`` mentioning ``fragments``."""

    def run():
        if c.rank != LONELY:
            return None
        try:
            call(c)
        except Exception as exc:  # noqa: BLE001 - inspected below
            return type(exc).__name__, isinstance(exc, expected), str(exc)
        return "no error", False, ""

    name, matched, message = run_gathered(run)[LONELY]
    assert matched, f"{case}: expected {expected.__name__}, got {name}: {message}"
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{case}: message {message!r} does not mention {missing}"


@pytest.mark.parametrize("case", list(LOCAL_ERRORS))
def test_local_error_before_any_communication(short, case):
    assert_lonely_error(short, case, *LOCAL_ERRORS[case])


# A bad root: raised before any communication too, but the Communicator becomes unusable on that rank (the others
# may be running the collective with their root: tests/test_edges.py), so each on a Communicator of its own.
ROOT_ERRORS = {
    "root-too-large": (lambda c: c.broadcast(np.zeros(3), root=P), ValueError, ["broadcast", "root", str(P)]),
    "root-negative": (lambda c: c.broadcast(np.zeros(3), root=-1), ValueError, ["broadcast", "root", "-1"]),
    "root-not-int": (lambda c: c.broadcast(np.zeros(3), root=0.5), ValueError, ["broadcast", "root"]),
}


@pytest.mark.parametrize("case", list(ROOT_ERRORS))
def test_bad_root_is_raised_before_any_communication(case):
    c = Communicator(WORLD, timeout=5.0)
    try:
        call, expected, fragments = ROOT_ERRORS[case]
        assert_lonely_error(c, case, call, expected, [*fragments, "unusable"])
    finally:
        c.free()


def test_short_communicator_still_works_after_local_errors(short):
    """The local errors above left nothing behind: a normal collective on the same communicator works."""
    buf = np.ones(5)
    run_gathered(lambda: short.allreduce(buf, algorithm="ring"))
    assert (buf == P).all()


def test_readonly_input_is_fine(comm):
    send = readonly(np.full(2 * P, 1.0))
    out = np.zeros(2)
    gathered = np.zeros(2 * P)

    def run():
        comm.reduce_scatter(send, out)
        comm.all_gather(readonly(np.ones(2)), gathered)

    run_gathered(run)
    assert (out == P).all() and (gathered == 1).all()


# ------------------------------------------------------------------------------------------ validate=True
MISMATCHES = {
    # name -> (call(c, differs) where the last rank passes differing arguments, words each rank's record shows)
    "dtype": (lambda c, d: c.allreduce(np.ones(4, np.float32 if d else np.float64)), ["float32", "float64"]),
    "size": (lambda c, d: c.allreduce(np.ones(5 if d else 4)), ["[5]", "[4]"]),
    "shape": (lambda c, d: c.allreduce(np.ones((2, 3) if d else (3, 2))), ["[2, 3]", "[3, 2]"]),
    "op": (lambda c, d: c.allreduce(np.ones(4), op="max" if d else "sum"), ['"max"', '"sum"']),
    "algorithm": (lambda c, d: c.allreduce(np.ones(4), algorithm="tree" if d else "ring"), ['"tree"', '"ring"']),
    "root": (lambda c, d: c.broadcast(np.ones(4), root=1 if d else 0), ['"root": 1', '"root": 0']),
    "reduce_scatter-op": (
        lambda c, d: c.reduce_scatter(np.ones(2 * P), np.ones(2), op="min" if d else "max"), ['"min"', '"max"']),
    "all_gather-size": (lambda c, d: c.all_gather(np.ones(3 if d else 2), np.ones((3 if d else 2) * P)), ["[3]", "[2]"]),
}


@pytest.fixture(scope="module")
def validating():
    c = Communicator(WORLD, validate=True, timeout=10.0)
    yield c
    c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_validate_mismatch_raises_on_every_rank(validating, case):
    call, words = MISMATCHES[case]

    def run():
        try:
            call(validating, validating.rank == P - 1)
        except CollectiveMismatchError as exc:
            message = str(exc)
        else:
            return "no error"
        # still usable after a detected mismatch (the agreement step completed on every rank)
        buf = np.ones(3)
        validating.allreduce(buf)
        return message, buf

    everyone = run_gathered(run)
    for r, result in enumerate(everyone):
        assert result != "no error", f"rank {r} raised nothing"
        message, buf = result
        assert all(f"rank {q}:" in message for q in range(P)), message
        assert all(w in message for w in words), f"{words} not all in {message}"
        assert (buf == P).all()


def test_validate_agreeing_calls_pass(validating):
    buf, out = np.arange(4.0), np.zeros(4 * P)

    def run():
        validating.allreduce(buf)
        validating.all_gather(np.ones(4), out)
        validating.broadcast(np.ones(2), root=P - 1)

    run_gathered(run)
    assert np.array_equal(buf, np.arange(4.0) * P) and (out == 1).all()


# ------------------------------------------------------------------------------------------ timeouts
@pytest.mark.mpi(min_size=2)
def test_collectives_refuse_after_one_stopped_midway():
    """After a collective timed out, messages of it may still be in flight: the next collective on that
    communicator raises at once, naming the failure, instead of matching stale messages (a silently wrong
    result). Rank 0 skips the first all-reduce; then every rank calls a second one: nobody hangs, nobody
    returns a result, and the ranks that saw the timeout refuse without waiting."""
    timeout = 1.0
    c = Communicator(WORLD, timeout=timeout)

    def run():
        if c.rank != 0:
            with pytest.raises(CommTimeoutError):
                c.allreduce(np.ones(8), algorithm="ring")
        WORLD.Barrier()  # rank 0 starts its (only) all-reduce after the others gave up on the first one
        start = time.monotonic()
        try:
            c.allreduce(np.full(8, 2.0), algorithm="ring")
        except MpcommError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        return "completed"

    everyone = run_gathered(run)
    for r, result in enumerate(everyone):
        assert result != "completed", f"rank {r} completed an all-reduce on a broken communicator"
        name, message, wall = result
        if r != 0:
            assert name == "MpcommError" and "unusable" in message and "allreduce[ring]" in message, message
            assert "timed out" in message and wall < 0.5 * timeout, (message, wall)
        else:
            assert wall < timeout + 5.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "rhd"])
def test_size_mismatch_without_validate_raises_everywhere(algorithm):
    """validate=False and the last rank passes more elements: no rank hangs or returns a wrong answer — each
    raises an MpcommError (truncation / byte count, naming the peer) or, if its peer gave up, CommTimeoutError."""
    c = Communicator(WORLD, timeout=1.0)  # may be left unusable: dedicated, never reused

    def run():
        start = time.monotonic()
        try:
            c.allreduce(np.ones(10 + 3 * (c.rank == P - 1)), algorithm=algorithm)
        except MpcommError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        return "completed"

    everyone = run_gathered(run)
    for r, result in enumerate(everyone):
        assert result != "completed", f"rank {r} completed a mismatched allreduce"
        _, message, wall = result
        assert wall < 1.0 + 5.0 and f"allreduce[{algorithm}]" in message and "rank" in message
    assert any(name != "CommTimeoutError" for name, _, _ in everyone), "only timeouts: the mismatch was never named"


@pytest.mark.mpi(min_size=2)
def test_env_timeout_bounds_a_recv(monkeypatch):
    """MPCOMM_TIMEOUT sets the default timeout; a receive from a rank that never sends gives up after it."""
    monkeypatch.setenv("MPCOMM_TIMEOUT", "1.0")
    c = Communicator(WORLD)
    explicit = Communicator(WORLD, timeout=12.5)
    everyone = without_rank(0, lambda: c.recv(np.zeros(4), 0, tag=5))
    explicit.free()
    assert c.timeout == 1.0 and explicit.timeout == 12.5
    for result in everyone[1:]:
        message, wall = result
        assert wall < 1.0 + 5.0
        assert "recv" in message and "from rank 0" in message and "timed out after" in message


def test_env_validate(monkeypatch):
    monkeypatch.setenv("MPCOMM_VALIDATE", "1")
    on, off = Communicator(WORLD), Communicator(WORLD, validate=False)
    monkeypatch.setenv("MPCOMM_VALIDATE", "0")
    default = Communicator(WORLD)

    def run():
        try:
            on.allreduce(np.ones(3), op="max" if on.rank == P - 1 else "min")
        except CollectiveMismatchError:
            return "mismatch"
        return "agreed"

    outcome = run_gathered(run)
    for c in (on, off, default):
        c.free()
    assert on.validate and not off.validate and not default.validate
    assert outcome == ["mismatch" if P > 1 else "agreed"] * P


def test_bad_timeout_value():
    with pytest.raises(ValueError, match="timeout"):
        Communicator(WORLD, timeout=0)
