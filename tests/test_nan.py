"""NaN, infinities and signed zeros through every all-reduce algorithm: NaN propagates as numpy's minimum/maximum
(MPI's own MIN/MAX alone drop it, so ``native`` reduces integer keys), the bits agree on every rank, and the checks
around ``native`` add no numpy warnings about the user's data.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_nan.py`` (any N >= 1).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import BFLOAT16, FLOATS, WORLD, assert_bitwise_equal, run_gathered

from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
ALLREDUCE = sorted(REGISTRY["allreduce"]) + ["auto"]


def special_values(dtype, rank: int, n: int = 64) -> np.ndarray:
    """Rank-specific floats full of NaNs (both signs, other payloads), infinities and signed zeros."""
    rng = np.random.default_rng([rank, 17])
    pool = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.25, 3.0], dtype=np.float64)
    values = pool[rng.integers(0, pool.size, n)].astype(dtype)
    if dtype == np.float32:  # a NaN with another payload
        values.view(np.uint32)[rng.integers(0, n, 4)] = 0x7FA00001 if rank % 2 else 0xFFB00002
    return values


def numpy_reduce(inputs, op):
    """The reduction numpy computes (float32 for the 16-bit types, rounded once)."""
    wide = [x.astype(np.float32) if x.dtype in (np.float16, BFLOAT16) else x for x in inputs]
    ufunc = {"min": np.minimum, "max": np.maximum, "sum": np.add, "prod": np.multiply}[op]
    out = wide[0].copy()
    for x in wide[1:]:
        out = ufunc(out, x)
    return out.astype(inputs[0].dtype)


@pytest.mark.parametrize("op", ["min", "max", "sum", "prod"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_special_values_match_numpy_and_agree_bitwise(comm, algorithm, dtype, op):
    """NaN wherever numpy has NaN (MPI's MIN/MAX alone drop it), the same bits on every rank (the library's
    operand order differs between ranks), equal to numpy elsewhere (signed zeros compare equal)."""

    def run():
        x = special_values(dtype, comm.rank)
        buf = x.copy()
        comm.allreduce(buf, op=op, algorithm=algorithm)
        return x, buf

    everyone = run_gathered(run)
    results = [b for _, b in everyone]
    label = f"allreduce[{algorithm}] {op} {dtype}"
    assert_bitwise_equal(results, label)
    expected = numpy_reduce([x for x, _ in everyone], op)
    # NaN == NaN here (compared as float32: numpy's testing does not know bfloat16's NaN)
    np.testing.assert_array_equal(results[0].astype(np.float32), expected.astype(np.float32), err_msg=label)


@pytest.mark.parametrize("op", ["min", "max", "sum"])
@pytest.mark.parametrize("count", [4, 1000])
def test_native_adds_no_numpy_warnings_for_large_values(comm, count, op):
    """The NaN checks around native must not warn about the user's data (squares of 1e20 overflow float32)."""

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return comm.allreduce(np.full(count, 1e20 * (RANK + 1), np.float32), op=op, algorithm="native")

    results = run_gathered(run)
    assert_bitwise_equal(results)


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("operation", ["reduce_scatter", "reduce"])
@pytest.mark.parametrize("algorithm", ["native", "auto"])
def test_native_min_max_propagate_nan_in_reduce_scatter_and_reduce(comm, operation, algorithm, op):
    if operation == "reduce" and algorithm == "auto":
        algorithm = "native"

    def run():
        x = special_values(np.float64, comm.rank, 16 * P)
        if operation == "reduce":
            out = np.empty_like(x) if comm.rank == 0 else None
            comm.reduce(x, out, op=op, root=0, algorithm=algorithm)
        else:
            out = np.empty(16, x.dtype)
            comm.reduce_scatter(x, out, op=op, algorithm=algorithm)
        return x, out

    everyone = run_gathered(run)
    expected = numpy_reduce([x for x, _ in everyone], op)
    got = everyone[0][1] if operation == "reduce" else np.concatenate([o for _, o in everyone])
    np.testing.assert_array_equal(got, expected)
