"""Collectives against independent references: every registered algorithm (iterated from
``mpcomm.algorithms.REGISTRY``, so newly registered ones are covered) x op x dtype x size; results bitwise
identical across ranks; strided and multi-dimensional buffers; other buffer-protocol objects; stats().

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_collectives.py`` (any N >= 1).

Ordering rule that keeps ranks in step: every test first does all its communication (the call under test,
then gathering inputs/results), and only then asserts on data that is the same on every rank, so all ranks
pass or fail each assertion together.
"""
from __future__ import annotations

import array
import time

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    BFLOAT16,
    BOOL,
    WORLD,
    assert_bitwise_equal,
    assert_identical_across_ranks,
    assert_reduced,
    dtype_id,
    dtype_op_pairs,
    gather,
    in_step,
    make_input,
    run_gathered,
)

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi
P = WORLD.Get_size()

ALGORITHMS = {operation: sorted(algs) + ["auto"] for operation, algs in REGISTRY.items()}
LARGE = 2**16 + 3
# The large size runs on a representative subset: each wire path (low precision -> float32, bool -> uint8,
# native dtype), each op, integers and complex.
LARGE_CASES = [
    (np.dtype(np.float32), "sum"),
    (BFLOAT16, "sum"),
    (np.dtype(np.float16), "avg"),
    (np.dtype(np.float64), "prod"),
    (np.dtype(np.int64), "sum"),
    (np.dtype(np.int8), "min"),
    (np.dtype(np.uint16), "max"),
    (np.dtype(np.complex128), "sum"),
    (BOOL, "max"),
]
PAIRS = dtype_op_pairs()


def small_sizes(p: int) -> list[int]:
    return sorted({0, 1, 7, p - 1, 1000})


def pair_id(pair) -> str:
    return f"{dtype_id(pair[0])}-{pair[1]}"


# ------------------------------------------------------------------------------------------ allreduce
def check_allreduce(comm: Communicator, algorithm: str, dtype, op: str, shapes, seed: int = 0) -> None:
    """Allreduce one input per shape, then check all of them from a single gather of inputs and results."""

    def run():
        cases = []
        for i, shape in enumerate(shapes):
            x = make_input(dtype, op, shape, comm.rank, seed + i)
            buf = x.copy()
            returned = comm.allreduce(buf, op=op, algorithm=algorithm)
            cases.append((x, buf, returned is buf))
        return cases

    everyone = run_gathered(run)
    for i, shape in enumerate(shapes):
        inputs, results = [c[i][0] for c in everyone], [c[i][1] for c in everyone]
        label = f"allreduce[{algorithm}] {op} {np.dtype(dtype)} shape {shape}"
        assert all(c[i][2] for c in everyone), f"{label}: did not return its buffer"
        assert results[0].dtype == inputs[0].dtype and results[0].shape == inputs[0].shape, label
        assert_bitwise_equal(results, label)
        assert_reduced(results[0], inputs, op, what=label)


@pytest.mark.parametrize("dtype,op", PAIRS, ids=map(pair_id, PAIRS))
@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_allreduce(comm, algorithm, dtype, op):
    check_allreduce(comm, algorithm, dtype, op, [(n,) for n in small_sizes(comm.size)])


@pytest.mark.parametrize("dtype,op", LARGE_CASES, ids=map(pair_id, LARGE_CASES))
@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_allreduce_large(comm, algorithm, dtype, op):
    check_allreduce(comm, algorithm, dtype, op, [(LARGE,)], seed=100)


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_allreduce_low_precision_sum_rounds_once(comm, algorithm):
    """float16/bfloat16 sums are accumulated in float32 and rounded once: rank 0 holds 1.0, the others a
    value just over half an ulp of 1.0. Accumulating in the low precision would round up at every step."""
    dtypes = (np.dtype(np.float16), BFLOAT16)
    ulps = [float(ml_dtypes.finfo(d).eps) for d in dtypes]

    def run():
        bufs = [np.full(5, 1.0 if comm.rank == 0 else 0.625 * u, dtype=d) for d, u in zip(dtypes, ulps)]
        for buf in bufs:
            comm.allreduce(buf, op="sum", algorithm=algorithm)
        return bufs

    everyone = run_gathered(run)
    for i, (dtype, ulp) in enumerate(zip(dtypes, ulps)):
        results = [bufs[i] for bufs in everyone]
        assert_bitwise_equal(results)
        once = (np.float32(1.0) + np.float32(0.625 * ulp) * (comm.size - 1)).astype(dtype)  # exact in float32
        assert (results[0] == once).all(), f"{dtype}: got {results[0][0]!r}, want {once!r}"
        if comm.size >= 3:  # the test has teeth: rounding after every addition gives a different answer
            naive = dtype.type(1.0)
            for _ in range(comm.size - 1):
                naive = dtype.type(naive + dtype.type(0.625 * ulp))
            assert naive != once


@pytest.fixture(scope="module")
def comm_rpn2():
    """ranks_per_node=2: the node split is non-trivial for p >= 3 (hierarchical really runs both levels)."""
    sub = Communicator(WORLD, ranks_per_node=2)
    yield sub
    sub.free()


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_allreduce_two_ranks_per_node(comm_rpn2, algorithm):
    shapes = [(n,) for n in small_sizes(comm_rpn2.size)]
    for dtype, op in [(np.float32, "sum"), (BFLOAT16, "sum"), (np.int32, "prod"), (np.float64, "avg"), (np.uint8, "max")]:
        check_allreduce(comm_rpn2, algorithm, dtype, op, shapes)
    check_allreduce(comm_rpn2, algorithm, np.float32, "sum", [(LARGE,)], seed=100)


# ------------------------------------------------------------------------------------------ reduce_scatter
def check_reduce_scatter(comm: Communicator, algorithm: str, dtype, op: str, counts, seed: int = 0) -> None:
    p = comm.size

    def run():
        cases = []
        for i, count in enumerate(counts):
            x = make_input(dtype, op, (p * count,), comm.rank, seed + i)
            send, recv = x.copy(), np.zeros(count, dtype=x.dtype)
            returned = comm.reduce_scatter(send, recv, op=op, algorithm=algorithm)
            cases.append((x, recv, returned is recv and send.tobytes() == x.tobytes()))
        return cases

    everyone = run_gathered(run)
    for i, count in enumerate(counts):
        label = f"reduce_scatter[{algorithm}] {op} {np.dtype(dtype)} count={count}"
        assert all(c[i][2] for c in everyone), f"{label}: did not return recvbuf, or modified sendbuf"
        assert_reduced(np.concatenate([c[i][1] for c in everyone]), [c[i][0] for c in everyone], op, what=label)


@pytest.mark.parametrize("dtype,op", PAIRS, ids=map(pair_id, PAIRS))
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
def test_reduce_scatter(comm, algorithm, dtype, op):
    check_reduce_scatter(comm, algorithm, dtype, op, small_sizes(comm.size))


@pytest.mark.parametrize("dtype,op", LARGE_CASES, ids=map(pair_id, LARGE_CASES))
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
def test_reduce_scatter_large(comm, algorithm, dtype, op):
    check_reduce_scatter(comm, algorithm, dtype, op, [LARGE // comm.size + 1], seed=100)


# ------------------------------------------------------------------------------------------ all_gather
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("algorithm", ALGORITHMS["all_gather"])
def test_all_gather(comm, algorithm, dtype):
    counts = small_sizes(comm.size) + ([LARGE // comm.size + 1] if dtype in (np.float64, BFLOAT16, BOOL) else [])

    def run():
        cases = []
        for count in counts:
            x = make_input(dtype, "max", (count,), comm.rank, seed=count)
            recv = np.zeros(comm.size * count, dtype=x.dtype)
            returned = comm.all_gather(x, recv, algorithm=algorithm)
            cases.append((x, recv, returned is recv))
        return cases

    everyone = run_gathered(run)
    for i, count in enumerate(counts):
        label = f"all_gather[{algorithm}] {np.dtype(dtype)} count={count}"
        results = [c[i][1] for c in everyone]
        assert all(c[i][2] for c in everyone), label
        assert_bitwise_equal(results, label)
        assert_bitwise_equal([results[0], np.concatenate([c[i][0] for c in everyone])], label + " vs inputs")


# ------------------------------------------------------------------------------------------ broadcast
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("algorithm", ALGORITHMS["broadcast"])
def test_broadcast(comm, algorithm, dtype):
    sizes = small_sizes(comm.size) + ([LARGE] if dtype in (np.float32, BOOL) else [])
    cases = [(root, size) for root in range(comm.size) for size in sizes]

    def run():
        out = []
        for root, size in cases:
            x = make_input(dtype, "max", (size,), comm.rank, seed=root)
            buf = x.copy()
            returned = comm.broadcast(buf, root=root, algorithm=algorithm)
            out.append((x, buf, returned is buf))
        return out

    everyone = run_gathered(run)
    for i, (root, size) in enumerate(cases):
        label = f"broadcast[{algorithm}] {np.dtype(dtype)} root={root} size={size}"
        assert all(c[i][2] for c in everyone), label
        assert_bitwise_equal([everyone[root][i][0]] + [c[i][1] for c in everyone], label)


# ------------------------------------------------------------------------------------------ layouts
STRIDED_DTYPES = [np.dtype(np.float64), BFLOAT16, np.dtype(np.int32), BOOL]


def strided_views(base: np.ndarray) -> dict[str, np.ndarray]:
    """Non-contiguous views of a (12, 10) array: 2-D strided, 1-D reversed step, transposed (F-ordered)."""
    return {"2d-step": base[::3, 1::2], "column": base[:, 3], "transposed": base.T[2:7]}


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_allreduce_noncontiguous_in_place(comm, algorithm):
    names = list(strided_views(np.empty((12, 10))))
    cases = [(dtype, name) for dtype in STRIDED_DTYPES for name in names]

    def run():
        out = []
        for dtype, name in cases:
            base = make_input(dtype, "max" if dtype == BOOL else "sum", (12, 10), comm.rank, seed=3)
            original = base.copy()
            view = strided_views(base)[name]
            x = view.copy()
            returned = comm.allreduce(view, op="max" if dtype == BOOL else "sum", algorithm=algorithm)
            out.append((x, view.copy(), returned is view, base, original))
        return out

    everyone = run_gathered(run)
    for i, (dtype, name) in enumerate(cases):
        label = f"allreduce[{algorithm}] {dtype} {name} view"
        results = [c[i][1] for c in everyone]
        assert all(c[i][2] for c in everyone), label
        assert_bitwise_equal(results, label)
        assert_reduced(results[0], [c[i][0] for c in everyone], "max" if dtype == BOOL else "sum", what=label)
        untouched = np.ones((12, 10), dtype=bool)
        strided_views(untouched)[name][...] = False
        for _, _, _, base, original in (c[i] for c in everyone):
            assert np.array_equal(base[untouched], original[untouched]), f"{label}: elements outside the view changed"


@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
def test_reduce_scatter_noncontiguous(comm, algorithm):
    p, count = comm.size, 5

    def run():
        out = []
        for dtype in STRIDED_DTYPES:
            op = "min" if dtype == BOOL else "sum"
            send = make_input(dtype, op, (2 * p * count,), comm.rank, seed=4)[::2]  # strided input
            out_base = np.zeros((count, 3), dtype=dtype)
            recv = out_base[:, 1]  # strided output
            comm.reduce_scatter(send, recv, op=op, algorithm=algorithm)
            out.append((send.copy(), out_base))
        return out

    everyone = run_gathered(run)
    for i, dtype in enumerate(STRIDED_DTYPES):
        label = f"reduce_scatter[{algorithm}] {dtype} strided"
        result = np.concatenate([c[i][1][:, 1] for c in everyone])
        assert_reduced(result, [c[i][0] for c in everyone], "min" if dtype == BOOL else "sum", what=label)
        assert not any(c[i][1][:, [0, 2]].any() for c in everyone), f"{label}: elements outside the view changed"


@pytest.mark.parametrize("algorithm", ALGORITHMS["all_gather"])
def test_all_gather_noncontiguous(comm, algorithm):
    p, count = comm.size, 6

    def run():
        out = []
        for dtype in STRIDED_DTYPES:
            send = make_input(dtype, "max", (count, 2), comm.rank, seed=5)[:, 1]
            out_base = np.zeros((p * count, 2), dtype=dtype)
            comm.all_gather(send, out_base[:, 0], algorithm=algorithm)
            out.append((send.copy(), out_base))
        return out

    everyone = run_gathered(run)
    for i, dtype in enumerate(STRIDED_DTYPES):
        label = f"all_gather[{algorithm}] {dtype} strided"
        expected = np.concatenate([c[i][0] for c in everyone])
        assert_bitwise_equal([expected] + [c[i][1][:, 0] for c in everyone], label)
        assert not any(c[i][1][:, 1].any() for c in everyone), f"{label}: elements outside the view changed"


@pytest.mark.parametrize("algorithm", ALGORITHMS["broadcast"])
def test_broadcast_noncontiguous(comm, algorithm):
    root = comm.size - 1

    def run():
        base = make_input(np.float32, "sum", (9, 8), comm.rank, seed=6)
        original = base.copy()
        comm.broadcast(base[1::2, ::3], root=root, algorithm=algorithm)
        return original, base

    everyone = run_gathered(run)
    untouched = np.ones((9, 8), dtype=bool)
    untouched[1::2, ::3] = False
    for original, base in everyone:
        assert np.array_equal(base[1::2, ::3], everyone[root][0][1::2, ::3])
        assert np.array_equal(base[untouched], original[untouched])


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_allreduce_multidimensional(comm, algorithm):
    cases = [(shape, order) for shape in [(3, 4, 5), (2, 1, 7), (0, 3), ()] for order in "CF"]

    def run():
        out = []
        for shape, order in cases:
            x = np.asarray(make_input(np.float32, "sum", shape, comm.rank, seed=7), order=order)
            buf = x.copy(order=order)
            comm.allreduce(buf, op="sum", algorithm=algorithm)
            out.append((x, buf))
        return out

    everyone = run_gathered(run)
    for i, (shape, order) in enumerate(cases):
        label = f"allreduce[{algorithm}] shape {shape} {order}-order"
        results = [c[i][1] for c in everyone]
        assert results[0].shape == shape, label
        assert_bitwise_equal(results, label)
        assert_reduced(results[0], [c[i][0] for c in everyone], "sum", what=label)


def test_reduce_scatter_and_all_gather_multidimensional(comm):
    """Rank-major layout: reduce_scatter of (p, 3, 5) gives rank r the reduced slab r; all_gather stacks slabs."""
    p = comm.size
    x = make_input(np.int64, "sum", (p, 3, 5), comm.rank)
    slab = np.zeros((3, 5), dtype=np.int64)
    stacked = np.zeros((p, 3, 5), dtype=np.int64)
    in_step(lambda: comm.reduce_scatter(x, slab, op="sum"))
    in_step(lambda: comm.all_gather(slab, stacked))
    inputs = gather(x)
    assert_identical_across_ranks(stacked)
    assert np.array_equal(slab, sum(inputs)[comm.rank])
    assert np.array_equal(stacked, sum(inputs))


# ------------------------------------------------------------------------------------------ other buffers
def test_buffer_protocol_objects(comm):
    """bytearray, array.array and memoryview (non-numpy buffer protocol) are reduced in place."""
    p, r = comm.size, comm.rank
    raw = bytearray(bytes([r + 1, 10 * r, 3]))
    doubles = array.array("d", [0.5 * r, -1.0, 2.0 + r])
    ints = array.array("i", [r, -r, 7])
    backing = np.arange(4, dtype=np.int16) * (r + 1)
    view = memoryview(backing)
    in_step(lambda: comm.allreduce(raw, op="max"))
    in_step(lambda: comm.allreduce(doubles, op="avg"))
    in_step(lambda: comm.allreduce(ints, op="sum"))
    in_step(lambda: comm.allreduce(view, op="sum"))
    gathered = np.zeros(3 * p, dtype=np.uint8)
    in_step(lambda: comm.all_gather(memoryview(bytes([r, r, r])), gathered))  # read-only input is fine
    assert list(raw) == [p, 10 * (p - 1), 3]
    assert np.allclose(doubles, [0.5 * (p - 1) / 2, -1.0, 2.0 + (p - 1) / 2])
    assert list(ints) == [p * (p - 1) // 2, -p * (p - 1) // 2, 7 * p]
    assert list(backing) == [i * p * (p + 1) // 2 for i in range(4)]
    assert list(gathered) == [q for q in range(p) for _ in range(3)]


# ------------------------------------------------------------------------------------------ stats
def test_stats_count_calls_and_bytes():
    c = Communicator(WORLD)
    try:
        for _ in range(3):
            in_step(lambda: c.allreduce(np.ones(10, np.float32), algorithm="ring"))
        in_step(lambda: c.allreduce(np.ones(4, np.float16), algorithm="tree"))
        in_step(lambda: c.broadcast(np.ones(6, np.float64), algorithm="native"))
        in_step(lambda: c.reduce_scatter(np.ones(2 * c.size), np.ones(2), algorithm="ring"))
        in_step(lambda: c.all_gather(np.ones(2), np.ones(2 * c.size), algorithm="rhd"))
        stats = c.stats()
        c.reset_stats()
        assert c.stats() == {}
    finally:
        c.free()
    assert stats["allreduce"]["ring"]["calls"] == 3 and stats["allreduce"]["ring"]["bytes"] == 3 * 40
    assert stats["allreduce"]["tree"]["calls"] == 1 and stats["allreduce"]["tree"]["bytes"] == 8
    assert stats["broadcast"]["native"]["calls"] == 1 and stats["broadcast"]["native"]["bytes"] == 48
    assert stats["reduce_scatter"]["ring"]["bytes"] == 16 * c.size
    assert stats["all_gather"]["rhd"]["bytes"] == 16 * c.size
    for by_algorithm in stats.values():
        for record in by_algorithm.values():
            assert set(record) >= {"calls", "bytes", "seconds"} and record["seconds"] > 0.0


LATE = 0.5  # seconds rank 0 starts late in test_stats_seconds_are_measured
STATS_CALLS = {  # (operation, algorithm) -> the call on a Communicator
    ("allreduce", "ring"): lambda c: c.allreduce(np.ones(1000), algorithm="ring"),
    ("reduce_scatter", "rhd"): lambda c: c.reduce_scatter(np.ones(1000 * c.size), np.empty(1000), algorithm="rhd"),
    ("all_gather", "native"): lambda c: c.all_gather(np.ones(1000), np.empty(1000 * c.size), algorithm="native"),
    ("broadcast", "tree"): lambda c: c.broadcast(np.ones(1000), root=0, algorithm="tree"),
    ("allreduce", "tree"): lambda c: c.iallreduce(np.ones(1000), algorithm="tree").wait(),  # on the progress thread
}


@pytest.mark.parametrize("key", list(STATS_CALLS), ids=["-".join(k) for k in STATS_CALLS])
def test_stats_seconds_are_measured(key):
    """stats()["seconds"] is the time measured inside the call: above 0, at most the wall time around the call, and
    where rank 0 starts LATE s after the others, on every other rank at least the time it waited for rank 0 (it
    cannot finish before rank 0 has started), less 0.25 s for the bookkeeping before the clock starts. Zero, or
    an estimate from the byte count, fails."""
    c = Communicator(WORLD)
    try:
        WORLD.Barrier()
        if c.rank == 0 and c.size > 1:
            time.sleep(LATE)  # the others wait for rank 0 inside the call

        def timed():
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this host
            STATS_CALLS[key](c)
            return start, time.monotonic() - start

        everyone = run_gathered(timed)
        recorded = WORLD.allgather(c.stats().get(key[0], {}).get(key[1]))
    finally:
        c.free()
    rank0_start = everyone[0][0]
    for r, ((start, wall), record) in enumerate(zip(everyone, recorded)):
        assert record is not None and record["calls"] == 1, f"rank {r}: stats() has no {key}: {record}"
        assert 0.0 < record["seconds"] <= wall, f"rank {r}: recorded {record['seconds']} s, wall {wall} s"
        if r > 0:
            waited = rank0_start - start
            assert record["seconds"] >= waited - 0.25, f"rank {r}: recorded {record['seconds']} s, waited {waited} s"


@pytest.mark.parametrize("operation", ["reduce_scatter", "all_gather"])
def test_aliased_buffers_give_the_right_answer(comm, operation):
    """recvbuf inside sendbuf (the MPI_IN_PLACE layout) works on every algorithm, native included."""
    n = 5
    results = {}
    for algorithm in sorted(REGISTRY[operation]) + ["auto"]:

        def run():
            buf = np.arange(P * n, dtype=np.float64) * (comm.rank + 1)
            original = buf.copy()
            mine = buf[comm.rank * n : (comm.rank + 1) * n]
            if operation == "reduce_scatter":
                comm.reduce_scatter(buf, buf[:n], algorithm=algorithm)
                return original, buf[:n].copy()
            comm.all_gather(mine, buf, algorithm=algorithm)
            return original, buf.copy()

        results[algorithm] = run_gathered(run)
    for algorithm, everyone in results.items():
        inputs = [o for o, _ in everyone]
        for r, (_, got) in enumerate(everyone):
            if operation == "reduce_scatter":
                want = sum(inputs)[r * n : (r + 1) * n]
            else:
                want = np.concatenate([x[q * n : (q + 1) * n] for q, x in enumerate(inputs)])
            np.testing.assert_array_equal(got, want, err_msg=f"{operation}[{algorithm}] rank {r}")
