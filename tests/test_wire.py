"""``comm.allreduce(buf, op, wire=...)``: the compressed all-reduce against numpy on the gathered inputs.

The reference is the contract's (``mpcomm/algorithms/compressed.py``): the ranks fall into groups — the nodes
when all hold the same number of ranks, else one rank each — and each group's float32 sum (rank order) is put
through the wire (bf16 / fp16: the ml_dtypes / numpy cast; int8: the codec, whose error bound
``test_compression.py`` checks), the groups' results summed in float32 in order, divided by p for avg, put through
the wire once more. Nodes are simulated with ``ranks_per_node`` (None: the one host is one node; 1: one rank per
node, so every rank's input is compressed; 2: two per node, or at p = 3 nodes of 2 and 1, one rank per group).
The comparison is exact (bitwise): the algorithm adds in these orders too, and cuts chunks at the codec's block
edges. Bad input raises one clear error on every rank.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_wire.py`` (N = 1..4).
"""
from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import pytest
from conftest import WORLD, assert_bitwise_equal, run_gathered

from mpcomm import CollectiveMismatchError, Communicator
from mpcomm.algorithms import compressed
from mpcomm.compression import INT8_BLOCK, WIRES, codec

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
SIZES = [0, 1, 2, 5, 1009, INT8_BLOCK * P, INT8_BLOCK * P + 3, INT8_BLOCK * (P + 1) - 1, 100_003]


def on_the_wire(wire: str, x: np.ndarray) -> np.ndarray:
    """What ``x`` becomes on the wire, stated independently where a library states it."""
    if wire == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if wire == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    return codec(wire).roundtrip(x)


def groups(ranks_per_node: int | None) -> list[list[int]]:
    """The ranks whose float32 sum is compressed together (see the module docstring)."""
    q = P if ranks_per_node is None else ranks_per_node
    if P % q:
        return [[r] for r in range(P)]
    return [list(range(start, start + q)) for start in range(0, P, q)]


def reference(inputs: list[np.ndarray], op: str, wire: str, ranks_per_node: int | None) -> np.ndarray:
    flat = [x.reshape(-1) for x in inputs]
    total = None
    for group in groups(ranks_per_node):
        partial = flat[group[0]].copy()
        for r in group[1:]:
            partial += flat[r]
        sent = on_the_wire(wire, partial)
        total = sent if total is None else total + sent
    if op == "avg":
        np.divide(total, len(inputs), out=total)
    return on_the_wire(wire, total).reshape(inputs[0].shape)


@pytest.fixture(scope="module", params=[None, 1, 2], ids=lambda q: f"ranks_per_node={q}")
def comm(request):
    c = Communicator(WORLD, ranks_per_node=request.param)
    yield c
    c.free()


def make(n: int, seed: int = 0, shape=None) -> np.ndarray:
    rng = np.random.default_rng([seed, n, RANK])
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(np.float32)
    return x if shape is None else x.reshape(shape)


def check(comm: Communicator, x: np.ndarray, op: str, wire: str, blocking: bool = True) -> None:
    def run():
        out = x.copy()
        if blocking:
            assert comm.allreduce(out, op=op, wire=wire) is out
        else:
            comm.iallreduce(out, op=op, wire=wire).wait()
        return x, out

    everyone = run_gathered(run)
    outputs = [out for _, out in everyone]
    assert_bitwise_equal(outputs)
    expected = reference([x for x, _ in everyone], op, wire, comm.ranks_per_node)
    np.testing.assert_array_equal(outputs[0], expected)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("wire", WIRES)
def test_wired_allreduce_equals_the_reference(comm, wire, op, n):
    check(comm, make(n), op, wire)


@pytest.mark.parametrize("wire", WIRES)
def test_wired_allreduce_of_a_large_vector(comm, wire):
    check(comm, make(2**20 + 7, seed=1), "avg", wire)


# The pipeline's segment (compressed.SEGMENT_BYTES) made small, so that these sizes cross several segments, end
# inside one, or fit in less than one: one int8 block, a prime number of elements, and a few blocks and a bit.
SEGMENTS = [4 * INT8_BLOCK, 4 * 1009, 4 * (3 * INT8_BLOCK + 5)]
SEGMENTED_SIZES = [0, 1, 7, INT8_BLOCK - 1, INT8_BLOCK + 1, 2003, 7919, 3 * INT8_BLOCK * P + 11]


@pytest.mark.parametrize("n", SEGMENTED_SIZES)
@pytest.mark.parametrize("segment_bytes", SEGMENTS)
@pytest.mark.parametrize("wire", WIRES)
def test_wired_allreduce_in_segments_equals_the_reference(comm, wire, segment_bytes, n, monkeypatch):
    monkeypatch.setattr(compressed, "SEGMENT_BYTES", segment_bytes)
    check(comm, make(n, seed=4), "avg" if n % 2 else "sum", wire)


@pytest.mark.parametrize("wire", WIRES)
def test_wired_allreduce_multidimensional_and_strided(comm, wire):
    check(comm, make(6 * 37, shape=(6, 37)), "sum", wire)
    strided = make(2 * 501, seed=2)[::2]
    check(comm, strided, "sum", wire)


@pytest.mark.parametrize("wire", WIRES)
def test_wired_iallreduce(comm, wire):
    check(comm, make(4099, seed=3), "avg", wire, blocking=False)


def test_wire_none_is_the_plain_allreduce(comm):
    x = np.full(7, RANK + 1.0, np.float32)
    out = comm.allreduce(x.copy(), wire=None)
    assert (out == P * (P + 1) / 2).all()


def test_wired_error_is_within_the_codec_bound(comm):
    """A sanity check on the magnitude (the exact check is above): each of the p inputs and the sum are rounded
    once; bf16 by 2^-8 relative each, fp16 by 2^-11 above its subnormals (2^-25 absolute below 2^-14), int8 by
    half a step (1/254) of its block's absmax, M (the largest input's in that block) for the inputs, p M for the sum."""
    x = make(10_000, seed=4)
    inputs = np.stack(WORLD.allgather(x))
    exact = np.sum(inputs.astype(np.float64), axis=0)
    largest = np.max(np.abs(inputs), axis=0) * P
    blocks = np.abs(np.pad(inputs, ((0, 0), (0, -x.size % INT8_BLOCK)))).reshape(P, -1, INT8_BLOCK)
    block_largest = np.repeat(blocks.max(axis=(0, 2)), INT8_BLOCK)[: x.size] * P
    for wire, bound in (("bf16", 2 * 2**-8 * largest), ("fp16", 2 * 2**-11 * largest + 2**-23),
                        ("int8", 2 / 254 * block_largest * 1.001)):
        out = comm.allreduce(x.copy(), wire=wire)
        assert (np.abs(out - exact) <= bound).all(), wire


# ------------------------------------------------------------------------------------------ bad input
BAD = {  # name -> (buffer, op, wire, error type, text the message must hold)
    "int32 buffer": (lambda: np.ones(8, np.int32), "sum", "bf16", TypeError, "int32"),
    "float64 buffer": (lambda: np.ones(8, np.float64), "sum", "int8", TypeError, "float64"),
    "float16 buffer": (lambda: np.ones(8, np.float16), "sum", "fp16", TypeError, "float16"),
    "unknown wire": (lambda: np.ones(8, np.float32), "sum", "fp8", ValueError, "unknown wire 'fp8'"),
    "max": (lambda: np.ones(8, np.float32), "max", "bf16", TypeError, "'max'"),
    "prod": (lambda: np.ones(8, np.float32), "prod", "int8", TypeError, "'prod'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_on_every_rank(comm, case):
    make_buffer, op, wire, error, text = BAD[case]

    def run():
        with pytest.raises(error, match=text) as info:
            comm.allreduce(make_buffer(), op=op, wire=wire)
        assert "allreduce" in str(info.value)
        return comm.allreduce(np.ones(3, np.float32), wire="bf16")  # still usable

    for ok in run_gathered(run):
        assert (ok == P).all()


def test_algorithm_other_than_auto_is_refused(comm):
    def run():
        with pytest.raises(ValueError, match="wire.*algorithm 'tree'"):
            comm.allreduce(np.ones(8, np.float32), wire="bf16", algorithm="tree")

    run_gathered(run)


def wired(c: Communicator, operation: str, n: int, wire: str | None) -> np.ndarray:
    """``operation`` (allreduce, or reduce_scatter of n elements per rank) of ones, sent as ``wire``."""
    if operation == "allreduce":
        return c.allreduce(np.ones(n, np.float32), wire=wire)
    return c.reduce_scatter(np.ones(n * P, np.float32), np.empty(n, np.float32), wire=wire)


@pytest.mark.parametrize("operation", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("theirs", [None, "fp16", "int8"])
def test_mismatched_wire_caught_by_validate(theirs, operation):
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    c = Communicator(WORLD, timeout=10.0, validate=True)

    def run():
        with pytest.raises(CollectiveMismatchError, match="ranks disagree") as info:
            wired(c, operation, 1000, theirs if RANK == P - 1 else "bf16")
        assert f"rank {P - 1}:" in str(info.value)
        return wired(c, operation, 4, "int8")

    try:
        outcomes = run_gathered(run)
    finally:
        c.free()
    for ok in outcomes:
        assert (ok == P).all()


def test_bench_wire_rows_check_zero_wrong(comm):
    from mpcomm.bench import run

    rows = run(["-b", "4", "-e", "64K", "-f", "64", "-w", "1", "-n", "2", "--budget", "0.05", "--algorithms", "ring",
                "--redop", "sum,avg", "--wire", ",".join(WIRES), "--check"], comm=comm, out=io.StringIO())
    wired = [row for row in rows if row["algorithm"].startswith("wire:")]
    assert len(wired) == 4 * 2 * 3  # sizes (4 B .. 64 KiB by 64) x ops x wires
    assert all(row["wrong"] == 0 and row["identical"] for row in rows)


def test_wire_in_stats(comm):
    comm.allreduce(np.ones(100, np.float32), wire="int8")
    assert comm.stats()["allreduce"]["compressed:int8"]["calls"] >= 1
