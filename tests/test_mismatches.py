"""Ranks that pass different arguments to one collective: validate=True catches every mismatch on every algorithm
(and tells the others why one rank rejected its arguments); without it mpcomm's own algorithms still catch size
mismatches, never returning a wrong result; what validation cannot see (a skipped identical call) is caught at the
next different call.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_mismatches.py`` (N >= 2; skips at 1).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm import CollectiveMismatchError, Communicator, MpcommError
from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
ALLREDUCE = sorted(REGISTRY["allreduce"]) + ["auto"]


MISMATCHES = {  # name -> this rank's buffer: the last rank differs
    "size": lambda last: np.ones(1001 if last else 1000, np.float32),
    "dtype-equal-bytes": lambda last: np.ones(1000, np.int32 if last else np.float32),
    "dtype-equal-bytes-64": lambda last: np.ones(3, np.int64 if last else np.float64),
    "shape-same-size": lambda last: np.ones((20, 50) if last else (50, 20), np.float32),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_validate_catches_every_mismatch_on_every_algorithm(algorithm, case):
    """validate=True: CollectiveMismatchError on every rank (native and auto included), and the communicator
    stays usable (the ranks stopped before any data moved)."""
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    c = Communicator(WORLD, timeout=10.0, validate=True)

    def run():
        with pytest.raises(CollectiveMismatchError) as info:
            c.allreduce(MISMATCHES[case](RANK == P - 1), algorithm=algorithm)
        ok = c.allreduce(np.ones(4), algorithm=algorithm)
        return str(info.value), ok

    try:
        outcomes = run_gathered(run)
    finally:
        c.free()
    for message, ok in outcomes:
        assert f"rank {P - 1}:" in message and "ranks disagree" in message, message
        assert (ok == P).all()


def _mismatched_call(c: Communicator, operation: str, algorithm: str, n: int):
    """``operation`` with ``n`` elements per rank's block; returns this rank's output (None: a rooted sender)."""
    kw = {"algorithm": algorithm}
    one = np.full(n, RANK + 1.0, np.float32)
    if operation == "allreduce":
        return c.allreduce(one, **kw)
    if operation == "reduce_scatter":
        return c.reduce_scatter(np.ones(n * P, np.float32), np.empty(n, np.float32), **kw)
    if operation == "all_gather":
        return c.all_gather(one, np.empty(n * P, np.float32), **kw)
    if operation == "broadcast":
        return c.broadcast(np.full(n, 7.0, np.float32) if RANK == 0 else np.zeros(n, np.float32), root=0, **kw)
    if operation == "reduce":
        return c.reduce(one, np.empty(n, np.float32) if RANK == 0 else None, root=0, **kw)
    if operation == "gather":
        return c.gather(one, np.empty(n * P, np.float32) if RANK == 0 else None, root=0, **kw)
    if operation == "scatter":
        return c.scatter(np.ones(n * P, np.float32) if RANK == 0 else None, np.empty(n, np.float32), root=0, **kw)
    send, out = np.ones(n * P, np.float32), np.empty(n * P, np.float32)
    if operation == "all_to_all":
        return c.all_to_all(send, out, **kw)
    return c.all_to_all_v(send, [n] * P, out, [n] * P, **kw)


def _is_right(operation: str, n: int, out) -> bool:
    """Whether ``out`` is what this rank gets when every rank passes ``n`` elements (None: a rooted sender)."""
    if out is None:
        return True
    blocks = operation in ("all_gather", "gather", "all_to_all", "all_to_all_v")
    if out.size != (n * P if blocks else n):
        return False
    if operation in ("all_gather", "gather"):  # block q holds q + 1
        return bool((out == np.repeat(np.arange(1.0, P + 1), n)).all())
    want = {"allreduce": P * (P + 1) / 2, "reduce": P * (P + 1) / 2, "reduce_scatter": P, "broadcast": 7.0,
            "scatter": 1.0, "all_to_all": 1.0, "all_to_all_v": 1.0}[operation]
    return bool((out == want).all())


OWN = [(op, alg) for op in REGISTRY for alg in sorted(REGISTRY[op]) if alg != "native"]


@pytest.mark.parametrize("operation, algorithm", OWN, ids=[f"{o}-{a}" for o, a in OWN])
def test_own_algorithms_catch_size_mismatch_without_validate(operation, algorithm):
    """validate=False: every collective's own algorithms notice that the last rank passes one element more per
    block (1001 vs 1000). Every rank raises (an MpcommError: a byte-count error, or the timeout of a peer that
    stopped; Bruck's count exchange: ValueError) within timeout + 5 s, or — a rank whose output does not depend on
    the mismatched one, e.g. a rooted collective's sender — returns the right result; never a wrong one, and the
    mismatch is named somewhere (not only timeouts)."""
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    timeout, n = 1.5, 1000
    c = Communicator(WORLD, timeout=timeout, ranks_per_node=1 if algorithm == "hierarchical" else None)

    def run():
        start = time.monotonic()
        try:
            out = _mismatched_call(c, operation, algorithm, n + (RANK == P - 1))
        except (MpcommError, ValueError) as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        return ("right" if _is_right(operation, n, out) else "WRONG"), "", time.monotonic() - start

    try:
        outcomes = run_gathered(run)
    finally:
        c.free()
    for r, (outcome, message, elapsed) in enumerate(outcomes):
        assert outcome != "WRONG", f"rank {r} returned a wrong result of a mismatched {operation}[{algorithm}]"
        assert elapsed < timeout + 5, (r, outcome, elapsed, message)
    assert outcomes[P - 1][0] != "right" or operation in ("reduce", "gather"), outcomes
    assert any(o not in ("right", "CommTimeoutError") for o, _, _ in outcomes), \
        f"only timeouts: the mismatch was never named: {outcomes}"


# ------------------------------------------------------------------------------------------ validate=True gaps
def test_skipped_call_is_caught_at_the_next_different_call():
    """A rank skips the last of three identical all-reduces and goes on to barrier(): the barrier takes part in
    validation, so every rank raises CollectiveMismatchError there instead of timing out. (The skipped call
    itself cannot be seen: identical calls are indistinguishable — see docs/safety.md.)"""
    if P < 2:
        pytest.skip("needs two ranks")
    c = Communicator(WORLD, timeout=10.0, validate=True)

    def run():
        with pytest.raises(CollectiveMismatchError) as info:
            for i in range(3):
                if not (RANK == P - 1 and i == 2):
                    c.allreduce(np.ones(8))
            c.barrier()
        return str(info.value)

    try:
        messages = run_gathered(run)
    finally:
        c.free()
    assert all('"operation": "barrier"' in m and '"operation": "allreduce"' in m for m in messages), messages


@pytest.mark.parametrize("operation", ["allreduce", "gather", "all_to_all_v", "iallreduce"])
def test_validate_tells_the_others_why_one_rank_rejected_its_arguments(operation):
    """validate=True: the last rank passes a dtype mpcomm does not support and raises TypeError; the others,
    already comparing calls, raise CollectiveMismatchError naming that rank and its error at once — not a
    CommTimeoutError after the timeout (30 s here)."""
    if P < 2:
        pytest.skip("needs a rank whose arguments are fine")
    c = Communicator(WORLD, timeout=30.0, validate=True)
    dtype = np.longdouble if RANK == P - 1 else np.float64
    calls = {
        "allreduce": lambda: c.allreduce(np.ones(4, dtype)),
        "gather": lambda: c.gather(np.ones(4, dtype), np.ones(4 * P, dtype) if RANK == 0 else None),
        "all_to_all_v": lambda: c.all_to_all_v(np.ones(P, dtype), [1] * P, np.ones(P, dtype), [1] * P),
        "iallreduce": lambda: c.iallreduce(np.ones(4, dtype)).wait(),
    }

    def run():
        start = time.monotonic()
        with pytest.raises((TypeError, CollectiveMismatchError)) as info:
            calls[operation]()
        return type(info.value).__name__, str(info.value), time.monotonic() - start

    try:
        outcomes = run_gathered(run)
    finally:
        c.free()
    assert outcomes[-1][0] == "TypeError" and "unsupported dtype" in outcomes[-1][1]
    for kind, message, elapsed in outcomes[:-1]:
        assert kind == "CollectiveMismatchError", message
        assert f"rank {P - 1}:" in message and "rejected its arguments" in message and "unsupported dtype" in message
        assert elapsed < 10


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="needs 64 dimensions (numpy 1.x allows 32, "
                    "a signature shorter than 256 bytes)")
def test_long_signatures_are_compared_whole():
    """Shapes of 64 dimensions that differ only in the last two: the whole signature is compared (a digest),
    not its first 256 bytes."""
    if P < 2:
        pytest.skip("needs two ranks")
    c = Communicator(WORLD, timeout=10.0, validate=True)
    shape = (1,) * 62 + ((3, 2) if RANK == P - 1 else (2, 3))

    def run():
        with pytest.raises(CollectiveMismatchError, match="ranks disagree"):
            c.allreduce(np.ones(shape, np.float32))

    try:
        run_gathered(run)
    finally:
        c.free()
