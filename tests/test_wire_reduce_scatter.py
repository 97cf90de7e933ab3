"""``comm.reduce_scatter(send, recv, op, wire=...)``: the compressed reduce-scatter against numpy on the gathered inputs.

The reference is the contract's (``mpcomm/algorithms/compressed.py``): rank j's result is every rank's chunk j put
through the wire on its own (bf16 / fp16: the ml_dtypes / numpy cast; int8: the codec on the chunk, blocks from
the chunk's start), added in float32 in rank order, divided by p for avg — and nothing rounded after that. Bitwise,
on every layout of nodes (every rank sends compressed, one node or many). Bad input raises one clear error on every
rank (ranks passing different wires: tests/test_wire.py).

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_wire_reduce_scatter.py`` (N = 1..4).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import WORLD, run_gathered
from test_wire import make, on_the_wire

from mpcomm import Communicator
from mpcomm.compression import INT8_BLOCK, WIRES

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
CHUNKS = [0, 1, 2, 5, 1009, INT8_BLOCK, INT8_BLOCK + 3, 3 * INT8_BLOCK - 1, 20_011]  # elements per rank's chunk


@pytest.fixture(scope="module", params=[None, 1], ids=lambda q: f"ranks_per_node={q}")
def comm(request):
    c = Communicator(WORLD, ranks_per_node=request.param)
    yield c
    c.free()


def reference(inputs: list[np.ndarray], j: int, n: int, op: str, wire: str) -> np.ndarray:
    """Rank j's chunk: each rank's chunk j through the wire, summed in float32 in rank order, / p for avg."""
    total = on_the_wire(wire, inputs[0][j * n:(j + 1) * n].copy())
    for x in inputs[1:]:
        total = total + on_the_wire(wire, x[j * n:(j + 1) * n].copy())
    if op == "avg":
        np.divide(total, np.float32(len(inputs)), out=total)
    return total


def check(comm: Communicator, n: int, op: str, wire: str, blocking: bool = True, seed: int = 0) -> None:
    x = make(n * P, seed=seed)

    def run():
        out = np.full(n, np.nan, np.float32)
        if blocking:
            assert comm.reduce_scatter(x, out, op=op, wire=wire) is out
        else:
            assert comm.ireduce_scatter(x, out, op=op, wire=wire).wait() is out
        return x, out

    everyone = run_gathered(run)
    inputs = [x for x, _ in everyone]
    for j, (_, out) in enumerate(everyone):
        expected = reference(inputs, j, n, op, wire)
        assert out.dtype == expected.dtype == np.float32
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32), err_msg=f"rank {j}")


@pytest.mark.parametrize("n", CHUNKS)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("wire", WIRES)
def test_wired_reduce_scatter_equals_the_reference(comm, wire, op, n):
    check(comm, n, op, wire)


@pytest.mark.parametrize("wire", WIRES)
def test_wired_ireduce_scatter(comm, wire):
    check(comm, 4099, "avg", wire, blocking=False, seed=3)


def test_wired_reduce_scatter_of_a_large_vector(comm):
    check(comm, 2**18 + 7, "avg", "int8", seed=1)


def test_each_ranks_loss_is_what_it_kept(comm):
    """What the wire took from each rank is exactly ``x - roundtrip`` chunk by chunk (what FSDP's error feedback
    keeps): sum result + sum of the losses = the exact sum (float64, up to the float32 additions)."""
    n = 3 * INT8_BLOCK + 5
    x = make(n * P, seed=5)
    out = np.empty(n, np.float32)
    comm.reduce_scatter(x, out, op="sum", wire="int8")
    kept = np.concatenate([x[j * n:(j + 1) * n] - on_the_wire("int8", x[j * n:(j + 1) * n].copy()) for j in range(P)])
    inputs, losses = np.stack(WORLD.allgather(x)), np.stack(WORLD.allgather(kept))
    exact = inputs.astype(np.float64).sum(axis=0)[RANK * n:(RANK + 1) * n]
    lost = losses.astype(np.float64).sum(axis=0)[RANK * n:(RANK + 1) * n]
    scale = np.abs(inputs).max() * P
    np.testing.assert_allclose(out.astype(np.float64) + lost, exact, rtol=0, atol=scale * P * 2**-23)
    assert np.abs(lost).max() > scale * 2**-20  # int8 loses far more than float32 rounding: the test can fail


# ------------------------------------------------------------------------------------------ bad input
BAD = {  # name -> (dtype, op, wire, error type, text the message must hold)
    "int32 buffers": (np.int32, "sum", "bf16", TypeError, "int32"),
    "float64 buffers": (np.float64, "avg", "int8", TypeError, "float64"),
    "float16 buffers": (np.float16, "sum", "fp16", TypeError, "float16"),
    "unknown wire": (np.float32, "sum", "fp8", ValueError, "unknown wire 'fp8'"),
    "max": (np.float32, "max", "bf16", TypeError, "'max'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_on_every_rank(comm, case):
    dtype, op, wire, error, text = BAD[case]

    def run():
        with pytest.raises(error, match=text) as info:
            comm.reduce_scatter(np.ones(4 * P, dtype), np.empty(4, dtype), op=op, wire=wire)
        assert "reduce_scatter" in str(info.value)
        with pytest.raises(error, match=text):
            comm.ireduce_scatter(np.ones(4 * P, dtype), np.empty(4, dtype), op=op, wire=wire).wait()
        out = np.empty(3, np.float32)
        return comm.reduce_scatter(np.ones(3 * P, np.float32), out, wire="bf16")  # still usable

    for ok in run_gathered(run):
        assert (ok == P).all()


def test_wrong_sizes_and_algorithm_are_refused(comm):
    def run():
        with pytest.raises(ValueError, match="reduce_scatter: sendbuf has"):
            comm.reduce_scatter(np.ones(4 * P + 1, np.float32), np.empty(4, np.float32), wire="int8")
        with pytest.raises(ValueError, match="wire.*algorithm 'ring'"):
            comm.reduce_scatter(np.ones(4 * P, np.float32), np.empty(4, np.float32), wire="bf16", algorithm="ring")

    run_gathered(run)


def test_wire_in_stats(comm):
    comm.reduce_scatter(np.ones(100 * P, np.float32), np.empty(100, np.float32), wire="int8")
    assert comm.stats()["reduce_scatter"]["compressed:int8"]["calls"] >= 1
