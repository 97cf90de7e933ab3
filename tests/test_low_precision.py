"""Reductions off float32 ``sum``'s path against numpy on the gathered inputs, at sizes up to 2^20 + 3: float16 and
bfloat16 (16-bit on the wire in ``direct``, accumulated in float32 and rounded once by the compiled kernel), and
float min/max through ``native`` (integer keys). Every other (algorithm, dtype, op) at small sizes, and the NaN /
signed-zero / rounding rules, are test_collectives.py's and test_nan.py's (they iterate the registry).

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_low_precision.py`` (N = 1..4).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    LOW_PRECISION,
    assert_bitwise_equal,
    assert_reduced,
    make_input,
    run_gathered,
)

from mpcomm.buffers import BFLOAT16, wire_dtype

pytestmark = pytest.mark.mpi

SIZES = [0, 1, 1001, 2**20 + 3]
OPS = ["sum", "prod", "min", "max", "avg"]


def check(comm, operation: str, algorithm: str, dtype, op: str, n: int) -> None:
    def run():
        x = make_input(dtype, op, (n * (comm.size if operation == "reduce_scatter" else 1),), comm.rank, seed=n)
        if operation == "allreduce":
            out = x.copy()
            comm.allreduce(out, op=op, algorithm=algorithm)
        else:
            out = np.empty(n, dtype)
            comm.reduce_scatter(x, out, op=op, algorithm=algorithm)
        return x, out

    everyone = run_gathered(run)
    inputs = [x for x, _ in everyone]
    label = f"{operation}[{algorithm}] {op} {np.dtype(dtype)} n={n}"
    if operation == "allreduce":
        results = [out for _, out in everyone]
        assert_bitwise_equal(results, label)
        assert_reduced(results[0], inputs, op, what=label)
    else:
        assert_reduced(np.concatenate([out for _, out in everyone]), inputs, op, what=label)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("operation", ["allreduce", "reduce_scatter"])
def test_direct_low_precision_matches_numpy(comm, operation, dtype, op, n):
    check(comm, operation, "direct", dtype, op, n)


@pytest.mark.parametrize("n", SIZES[:-1])  # (at 2^20 + 3 auto takes direct, tested above)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("operation", ["allreduce", "reduce_scatter"])
def test_auto_low_precision_matches_numpy(comm, operation, dtype, op, n):
    check(comm, operation, "auto", dtype, op, n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("operation", ["allreduce", "reduce_scatter"])
def test_native_float_min_max_matches_numpy(comm, operation, dtype, op, n):
    check(comm, operation, "native", dtype, op, n)


def test_direct_keeps_16_bit_on_the_wire():
    """The direct algorithm is handed float16/bfloat16 host buffers as they are; the others get float32."""
    for dtype in LOW_PRECISION:
        assert wire_dtype(dtype, widen=False) == dtype
        assert wire_dtype(dtype) == np.float32
    assert wire_dtype(BFLOAT16, widen=False) == BFLOAT16
