"""Rooted collectives (reduce, gather, scatter) against numpy on the gathered inputs: every registered algorithm
(from ``mpcomm.algorithms.REGISTRY``) x dtype (x op) x size x root; strided buffers; in-place reduce; the root's
buffer checks; a silent rank.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_rooted.py`` (any N >= 1).
Ordering rule (as in test_collectives): all communication first, then assertions on data every rank has.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    BFLOAT16,
    BOOL,
    WORLD,
    assert_bitwise_equal,
    assert_reduced,
    dtype_id,
    dtype_op_pairs,
    make_input,
    run_gathered,
)

from mpcomm import CommTimeoutError, Communicator, MpcommError
from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
ALGORITHMS = {op: sorted(REGISTRY[op]) + ["auto"] for op in ("reduce", "gather", "scatter")}
LARGE = 2**16 + 3
PAIRS = dtype_op_pairs()
ROOTS = sorted({0, P - 1})


def sizes() -> list[int]:
    return sorted({0, 1, 7, P - 1, 1000})


def pair_id(pair) -> str:
    return f"{dtype_id(pair[0])}-{pair[1]}"


# ------------------------------------------------------------------------------------------ reduce
def check_reduce(comm, algorithm, dtype, op, counts, roots, seed=0):
    cases = [(root, n) for root in roots for n in counts]

    def run():
        out = []
        for i, (root, n) in enumerate(cases):
            x = make_input(dtype, op, (n,), comm.rank, seed + i)
            send = x.copy()
            recv = np.full(n, 7, dtype=x.dtype) if comm.rank == root else None
            returned = comm.reduce(send, recv, op=op, root=root, algorithm=algorithm)
            out.append((x, recv, returned is recv, send.tobytes() == x.tobytes()))
        return out

    everyone = run_gathered(run)
    for i, (root, n) in enumerate(cases):
        label = f"reduce[{algorithm}] {op} {np.dtype(dtype)} n={n} root={root}"
        assert all(c[i][2] and c[i][3] for c in everyone), f"{label}: did not return recvbuf, or changed sendbuf"
        assert all(c[i][1] is None for r, c in enumerate(everyone) if r != root)
        assert_reduced(everyone[root][i][1], [c[i][0] for c in everyone], op, what=label)


@pytest.mark.parametrize("dtype,op", PAIRS, ids=map(pair_id, PAIRS))
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce"])
def test_reduce(comm, algorithm, dtype, op):
    check_reduce(comm, algorithm, dtype, op, sizes(), ROOTS)


@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (BFLOAT16, "avg"), (np.int64, "max"), (np.complex128, "prod")],
                         ids=map(pair_id, [(np.float32, "sum"), (BFLOAT16, "avg"), (np.int64, "max"),
                                           (np.complex128, "prod")]))
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce"])
def test_reduce_large_every_root(comm, algorithm, dtype, op):
    check_reduce(comm, algorithm, dtype, op, [LARGE], range(comm.size), seed=50)


@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce"])
def test_reduce_in_place_and_strided(comm, algorithm):
    """recvbuf may be sendbuf on the root; strided (non-contiguous) buffers are handled."""
    root = comm.size - 1

    def run():
        x = make_input(np.float64, "sum", (40, 3), comm.rank, seed=8)
        buf = x.copy()
        comm.reduce(buf, buf if comm.rank == root else None, root=root, algorithm=algorithm)  # in place
        base = np.zeros((40, 3))
        strided_in = x[::2, 1]
        comm.reduce(strided_in, base[::2, 2] if comm.rank == root else None, root=root, algorithm=algorithm)
        return x, buf, base

    everyone = run_gathered(run)
    inputs = [c[0] for c in everyone]
    assert_reduced(everyone[root][1], inputs, "sum", what=f"in-place reduce[{algorithm}]")
    result = everyone[root][2]
    assert_reduced(result[::2, 2], [x[::2, 1] for x in inputs], "sum", what=f"strided reduce[{algorithm}]")
    untouched = np.ones((40, 3), dtype=bool)
    untouched[::2, 2] = False
    assert not result[untouched].any()


# ------------------------------------------------------------------------------------------ gather / scatter
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("algorithm", ALGORITHMS["gather"])
def test_gather(comm, algorithm, dtype):
    counts = sizes() + ([LARGE] if dtype in (np.float64, BOOL) else [])
    cases = [(root, n) for root in range(comm.size) for n in counts]

    def run():
        out = []
        for root, n in cases:
            x = make_input(dtype, "max", (n,), comm.rank, seed=n + root)
            recv = np.zeros(comm.size * n, dtype=x.dtype) if comm.rank == root else None
            returned = comm.gather(x, recv, root=root, algorithm=algorithm)
            out.append((x, recv, returned is recv))
        return out

    everyone = run_gathered(run)
    for i, (root, n) in enumerate(cases):
        label = f"gather[{algorithm}] {np.dtype(dtype)} n={n} root={root}"
        assert all(c[i][2] for c in everyone), label
        assert_bitwise_equal([everyone[root][i][1], np.concatenate([c[i][0] for c in everyone])], label)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("algorithm", ALGORITHMS["scatter"])
def test_scatter(comm, algorithm, dtype):
    counts = sizes() + ([LARGE] if dtype in (np.float32, BFLOAT16) else [])
    cases = [(root, n) for root in range(comm.size) for n in counts]

    def run():
        out = []
        for root, n in cases:
            x = make_input(dtype, "max", (comm.size * n,), comm.rank, seed=n + root)
            recv = np.zeros(n, dtype=x.dtype)
            returned = comm.scatter(x.copy() if comm.rank == root else None, recv, root=root, algorithm=algorithm)
            out.append((x, recv, returned is recv))
        return out

    everyone = run_gathered(run)
    for i, (root, n) in enumerate(cases):
        label = f"scatter[{algorithm}] {np.dtype(dtype)} n={n} root={root}"
        assert all(c[i][2] for c in everyone), label
        source = everyone[root][i][0]
        assert_bitwise_equal([np.concatenate([c[i][1] for c in everyone]), source], label)


@pytest.mark.parametrize("algorithm", ALGORITHMS["gather"])
def test_gather_scatter_multidimensional_and_strided(comm, algorithm):
    """Rank-major layout: gather of (3, 4) slabs gives (p, 3, 4) on the root; scatter of a strided (p, 3, 4)
    view hands rank r slab r; the scatter reaches a strided output."""
    root = 0

    def run():
        slab = make_input(np.int32, "sum", (3, 4), comm.rank, seed=9)
        stacked = np.zeros((comm.size, 3, 4), np.int32) if comm.rank == root else None
        comm.gather(slab, stacked, root=root, algorithm=algorithm)
        source = np.arange(comm.size * 3 * 8, dtype=np.int32).reshape(comm.size, 3, 8)
        out = np.zeros((3, 4, 2), np.int32)
        comm.scatter(source[:, :, ::2] if comm.rank == root else None, out[:, :, 1], root=root, algorithm=algorithm)
        return slab, stacked, out

    everyone = run_gathered(run)
    assert np.array_equal(everyone[root][1], np.stack([c[0] for c in everyone]))
    source = np.arange(P * 3 * 8, dtype=np.int32).reshape(P, 3, 8)[:, :, ::2]
    for r, (_, _, out) in enumerate(everyone):
        assert np.array_equal(out[:, :, 1], source[r]) and not out[:, :, 0].any()


# ------------------------------------------------------------------------------------------ errors
ROOT_ERRORS = {  # name -> (call on communicator c by every rank, exception, substrings); raised before communicating
    "reduce-root-out-of-range": (lambda c: c.reduce(np.ones(3), np.ones(3), root=c.size), ValueError, ["reduce", "root"]),
    "reduce-root-bool": (lambda c: c.reduce(np.ones(3), np.ones(3), root=True), ValueError, ["root", "True"]),
    "gather-root-float": (lambda c: c.gather(np.ones(3), np.ones(3 * c.size), root=0.0), ValueError, ["root", "0.0"]),
    "scatter-unknown-algorithm": (lambda c: c.scatter(np.ones(3 * c.size), np.ones(3), algorithm="ring"),
                                  ValueError, ["scatter", "ring", "tree"]),
    "reduce-avg-int": (lambda c: c.reduce(np.ones(3, np.int8), np.ones(3, np.int8), op="avg"), TypeError, ["avg"]),
}


@pytest.mark.parametrize("case", list(ROOT_ERRORS))
def test_bad_arguments_raise_before_communicating(case):
    call, exc_type, words = ROOT_ERRORS[case]
    c = Communicator(WORLD, timeout=5.0)

    def run():
        with pytest.raises(exc_type) as info:
            call(c)
        return str(info.value)

    try:
        messages = run_gathered(run)
    finally:
        c.free()
    for message in messages:
        assert all(w in message for w in words), message


def test_root_buffer_checked_on_the_root():
    """The root's buffer is checked there (None, wrong size, wrong dtype) before any communication: only the
    root calls, and it raises at once instead of waiting for peers."""
    root = P - 1
    c = Communicator(WORLD, timeout=5.0)
    bad = [
        (lambda: c.gather(np.ones(3), None, root=root), ValueError, "None on the root"),
        (lambda: c.gather(np.ones(3), np.ones(3 * P + 1), root=root), ValueError, "needs"),
        (lambda: c.reduce(np.ones(3), np.ones(3, np.float32), root=root), TypeError, "float32"),
        (lambda: c.scatter(None, np.ones(3), root=root), ValueError, "sendbuf is None"),
    ]

    def run():
        if RANK == root:
            for call, exc_type, words in bad:
                with pytest.raises(exc_type, match=words):
                    call()

    try:
        run_gathered(run)
    finally:
        c.free()


@pytest.mark.parametrize("operation,algorithm", [(op, a) for op in ("reduce", "gather", "scatter")
                                                 for a in sorted(REGISTRY[op])])
def test_silent_rank_times_out_the_others(operation, algorithm):
    """The last rank never calls: the ranks that need it (the root of a reduce or gather; whoever forwards to it in
    a scatter) raise CommTimeoutError naming the operation within timeout + 5 s; every other rank does too or
    completes — no rank hangs. Messages of 1 MiB, so no send completes by buffering alone; in a scatter the silent
    rank stays out of MPI until the others have timed out (a library may take a message of any size into its own
    buffers while the receiving process is inside MPI: Intel MPI does)."""
    if P < 2:
        pytest.skip("needs a silent rank and a waiting one")
    timeout = 1.5
    c = Communicator(WORLD, timeout=timeout)
    n = 2**17
    calls = {
        "reduce": lambda: c.reduce(np.ones(n), np.ones(n) if c.rank == 0 else None, root=0, algorithm=algorithm),
        "gather": lambda: c.gather(np.ones(n), np.ones(n * P) if c.rank == 0 else None, root=0, algorithm=algorithm),
        "scatter": lambda: c.scatter(np.ones(n * P) if c.rank == 0 else None, np.ones(n), root=0, algorithm=algorithm),
    }

    def run():
        if RANK == P - 1:
            if operation == "scatter":
                time.sleep(timeout + 1.0)
            return None
        start = time.monotonic()
        try:
            calls[operation]()
        except CommTimeoutError as exc:
            return str(exc), time.monotonic() - start
        except MpcommError as exc:  # reported below
            return f"wrong error {type(exc).__name__}: {exc}", time.monotonic() - start
        return "completed", time.monotonic() - start

    try:
        outcomes = run_gathered(run)
    finally:
        c.free()
    timed_out = [r for r, outcome in enumerate(outcomes[:-1]) if "timed out" in outcome[0]]
    assert timed_out, f"no rank noticed the silent one: {outcomes}"
    if operation != "scatter":  # the root needs the silent rank's data (in a scatter, whoever forwards to it)
        assert 0 in timed_out, f"root: {outcomes[0][0]}"
    for r, (message, elapsed) in enumerate(outcomes[:-1]):
        assert message == "completed" or (operation in message and "timed out" in message), f"rank {r}: {message}"
        assert elapsed < timeout + 5, f"rank {r} took {elapsed:.1f} s"
