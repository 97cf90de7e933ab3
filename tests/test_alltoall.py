"""all_to_all (equal blocks) and all_to_all_v (per-peer counts, zeros included) against numpy on the gathered
inputs, for every registered algorithm (pairwise, bruck, native) and auto; count checks; a silent rank.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_alltoall.py`` (any N >= 1).
Ordering rule (as in test_collectives): all communication first, then assertions on data every rank has.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import ALL_DTYPES, BFLOAT16, BOOL, WORLD, assert_bitwise_equal, dtype_id, make_input, run_gathered

from mpcomm import CollectiveMismatchError, CommTimeoutError, Communicator, MpcommError
from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
ALGORITHMS = sorted(REGISTRY["all_to_all"]) + ["auto"]
ALGORITHMS_V = sorted(REGISTRY["all_to_all_v"]) + ["auto"]
LARGE = 2**16 + 3


def expected_blocks(sends: list[np.ndarray], counts: np.ndarray, receiver: int) -> np.ndarray:
    """What ``receiver`` must hold: block ``receiver`` of every rank's send buffer, in rank order (numpy only)."""
    starts = np.concatenate([np.zeros((len(sends), 1), np.int64), np.cumsum(counts, axis=1)], axis=1)
    return np.concatenate([sends[i][starts[i, receiver] : starts[i, receiver + 1]] for i in range(len(sends))])


def count_matrix(pattern: str) -> np.ndarray:
    """counts[i, j]: elements rank i sends to rank j (the same matrix on every rank)."""
    i, j = np.indices((P, P))
    return {
        "uneven": (3 * i + 5 * j + 1) % 7,  # includes zeros
        "zeros": np.zeros((P, P), np.int64),
        "one-sender": np.where(i == P - 1, 1000 + j, 0),
        "diagonal-only": np.where(i == j, 4, 0),
        "large": (i + 1) * 1000 + j * LARGE // P,
    }[pattern].astype(np.int64)


# ------------------------------------------------------------------------------------------ equal blocks
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_to_all(comm, algorithm, dtype):
    blocks = sorted({0, 1, 7, P - 1, 1000}) + ([LARGE // P + 1] if dtype in (np.float64, BFLOAT16, BOOL) else [])

    def run():
        out = []
        for block in blocks:
            x = make_input(dtype, "max", (P * block,), comm.rank, seed=block)
            recv = np.zeros(P * block, dtype=x.dtype)
            returned = comm.all_to_all(x.copy(), recv, algorithm=algorithm)
            out.append((x, recv, returned is recv))
        return out

    everyone = run_gathered(run)
    for k, block in enumerate(blocks):
        sends = [c[k][0] for c in everyone]
        counts = np.full((P, P), block)
        for r, c in enumerate(everyone):
            label = f"all_to_all[{algorithm}] {np.dtype(dtype)} block={block} rank {r}"
            assert c[k][2], label
            assert_bitwise_equal([c[k][1], expected_blocks(sends, counts, r)], label)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_to_all_multidimensional_and_strided(comm, algorithm):
    """A (p, 3, 2) send buffer: slab j goes to rank j; a strided output view is filled, the rest untouched."""

    def run():
        x = (np.arange(P * 6, dtype=np.int64).reshape(P, 3, 2) + 1000 * comm.rank)
        base = np.zeros((P, 3, 4), np.int64)
        comm.all_to_all(x[:, :, ::-1], base[:, :, ::2], algorithm=algorithm)
        return x, base

    everyone = run_gathered(run)
    for r, (_, base) in enumerate(everyone):
        want = np.stack([everyone[i][0][r, :, ::-1] for i in range(P)])
        assert np.array_equal(base[:, :, ::2], want) and not base[:, :, 1::2].any()


# ------------------------------------------------------------------------------------------ per-peer counts
V_CASES = [(algorithm, np.dtype(dtype), pattern) for algorithm in ALGORITHMS_V
           for dtype in (np.float32, BFLOAT16, np.int64, np.complex128, BOOL)
           for pattern in ("uneven", "zeros", "one-sender", "diagonal-only", "large")
           if pattern != "large" or dtype in (np.float32, BOOL)]  # the large pattern on two dtypes (time)


@pytest.mark.parametrize("algorithm, dtype, pattern", V_CASES,
                         ids=[f"{a}-{dtype_id(d)}-{p}" for a, d, p in V_CASES])
def test_all_to_all_v(comm, algorithm, dtype, pattern):
    counts = count_matrix(pattern)
    send_counts, recv_counts = counts[RANK].tolist(), counts[:, RANK].tolist()

    def run():
        x = make_input(dtype, "max", (sum(send_counts),), comm.rank, seed=7)
        recv = np.zeros(sum(recv_counts), dtype=x.dtype)
        returned = comm.all_to_all_v(x, send_counts, recv, recv_counts, algorithm=algorithm)
        return x, recv, returned is recv

    everyone = run_gathered(run)
    sends = [c[0] for c in everyone]
    for r, (_, recv, returned) in enumerate(everyone):
        label = f"all_to_all_v[{algorithm}] {np.dtype(dtype)} {pattern} rank {r}"
        assert returned, label
        assert_bitwise_equal([recv, expected_blocks(sends, counts, r)], label)


@pytest.mark.parametrize("algorithm", ["bruck", "pairwise", "native"])
def test_inconsistent_counts_raise_with_validate(algorithm):
    """validate=True: a rank expecting another count than its peer sends is a CollectiveMismatchError on every
    rank naming both ranks and counts, before any data moves."""
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    c = Communicator(WORLD, timeout=10.0, validate=True)
    counts = count_matrix("uneven") + 1
    send_counts, recv_counts = counts[RANK].tolist(), counts[:, RANK].tolist()
    if RANK == 1:
        recv_counts[0] += 1  # rank 1 expects one element more from rank 0 than rank 0 sends

    def run():
        with pytest.raises(CollectiveMismatchError) as info:
            c.all_to_all_v(np.zeros(sum(send_counts)), send_counts, np.zeros(sum(recv_counts)), recv_counts,
                           algorithm=algorithm)
        c.barrier()  # clean failure: the communicator still works
        return str(info.value)

    try:
        messages = run_gathered(run)
    finally:
        c.free()
    for message in messages:
        assert f"rank 0 sends {counts[0, 1]} elements to rank 1, which expects {counts[0, 1] + 1}" in message


def test_bruck_checks_counts_without_validate():
    """Bruck exchanges the counts anyway (a forwarding rank must know every block's size): inconsistent counts are
    a ValueError on every rank, and the communicator stays usable."""
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    c = Communicator(WORLD, timeout=10.0)
    counts = count_matrix("uneven")
    send_counts, recv_counts = counts[RANK].tolist(), counts[:, RANK].tolist()
    if RANK == 0:
        send_counts[1] += 2
    sendbuf, recvbuf = np.zeros(sum(send_counts)), np.zeros(sum(recv_counts))

    def run():
        with pytest.raises(ValueError, match="rank 0 sends .* to rank 1, which expects"):
            c.all_to_all_v(sendbuf, send_counts, recvbuf, recv_counts, algorithm="bruck")
        c.barrier()

    try:
        run_gathered(run)
    finally:
        c.free()


BAD_COUNTS = {  # name -> (send_counts, message) on every rank: ValueError/TypeError before communicating
    "not-a-multiple": "all_to_all",
    "wrong-length": ([1] * (P + 1), "send_counts must be"),
    "negative": ([-1] + [1] * (P - 1), "send_counts must be"),
    "fraction": ([1.5] + [1] * (P - 1), "send_counts must be"),
    "sum-mismatch": ([2] * P, "add up to"),
}


@pytest.mark.parametrize("case", list(BAD_COUNTS))
def test_bad_counts_raise_before_communicating(case):
    if case == "not-a-multiple" and P == 1:
        pytest.skip("every size is a multiple of 1")
    c = Communicator(WORLD, timeout=5.0)

    def run():
        if case == "not-a-multiple":
            with pytest.raises(ValueError, match="not a multiple"):
                c.all_to_all(np.zeros(P + 1), np.zeros(P + 1))
            return
        counts, words = BAD_COUNTS[case]
        with pytest.raises((ValueError, TypeError), match=words):
            c.all_to_all_v(np.zeros(P), counts, np.zeros(P), [1] * P)

    try:
        run_gathered(run)
    finally:
        c.free()


@pytest.mark.parametrize("algorithm", sorted(REGISTRY["all_to_all"]))
def test_silent_rank_times_out_the_others(algorithm):
    """The last rank never calls: every other rank (each needs a block from it) raises CommTimeoutError naming
    all_to_all within timeout + 5 s."""
    if P < 2:
        pytest.skip("needs a silent rank")
    timeout = 1.5
    c = Communicator(WORLD, timeout=timeout)
    block = 2**15

    def run():
        if RANK == P - 1:
            return None
        start = time.monotonic()
        try:
            c.all_to_all(np.ones(P * block), np.ones(P * block), algorithm=algorithm)
        except CommTimeoutError as exc:
            return str(exc), time.monotonic() - start
        except MpcommError as exc:
            return f"wrong error {type(exc).__name__}: {exc}", 0.0
        return "completed without the silent rank", 0.0

    try:
        outcomes = run_gathered(run)
    finally:
        c.free()
    for r, (message, elapsed) in enumerate(outcomes[:-1]):
        assert "all_to_all" in message and "timed out" in message, f"rank {r}: {message}"
        assert elapsed < timeout + 5, f"rank {r} took {elapsed:.1f} s"
