"""The compiled reduction kernels (``mpcomm.kernels``) and their numpy forms against numpy's own arithmetic:
float16/bfloat16 combined in float32 and rounded once, float min/max keys; and mutants of the C source that these
checks must catch (so they have teeth). One process; the collectives built on them: test_low_precision.py."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from mpcomm import kernels
from mpcomm.buffers import BFLOAT16, OPS

LOW = [np.dtype(np.float16), BFLOAT16]
OPS_16 = ["sum", "prod", "min", "max", "avg"]
SIZES = [0, 1, 1001, 2**20 + 3]
UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}


def compiled():
    k = kernels.load()
    if k is None:
        pytest.skip("no C compiler here: the kernels cannot be built (numpy's forms are tested)")
    return k


IMPLEMENTATIONS = {"compiled": compiled, "numpy": lambda: None}


def low_precision_inputs(dtype, count: int, n: int, seed: int) -> list[np.ndarray]:
    """``count`` vectors with NaNs of both signs, infinities, signed zeros, subnormals, values whose float32 sum
    overflows the 16-bit type and values whose sum is a rounding tie, among random ones."""
    rng = np.random.default_rng([seed, count, n])
    finfo = ml_dtypes.finfo(dtype)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, float(finfo.max), -float(finfo.max),
                         float(finfo.smallest_subnormal), 3 * float(finfo.smallest_subnormal), 1.0,
                         1.0 + float(finfo.eps) / 2, float(finfo.eps) / 4], dtype=np.float64)
    out = []
    for _ in range(count):
        values = rng.standard_normal(n) * np.exp2(rng.integers(-10, 10, n))
        mask = rng.random(n) < 0.05
        values[mask] = rng.choice(specials, int(mask.sum()))
        with np.errstate(over="ignore"):
            out.append(values.astype(np.float32).astype(dtype))
    return out


def reference16(chunks: list[np.ndarray], name: str) -> np.ndarray:
    """numpy: float32 in between, left to right, divided by the count for avg, rounded once."""
    acc = chunks[0].astype(np.float32)
    with np.errstate(all="ignore"):
        for chunk in chunks[1:]:
            acc = UFUNC[name](acc, chunk.astype(np.float32))
        if name == "avg":
            acc = acc / np.float32(len(chunks))
        return acc.astype(chunks[0].dtype)


def mismatches(got: np.ndarray, want: np.ndarray, zeros_equal: bool = False) -> int:
    """Elements that differ: bitwise, except that any NaN matches any NaN and, with ``zeros_equal``, -0.0 matches
    0.0 (min/max: numpy's own answer there depends on whether its SIMD loop or its scalar one ran)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(g) & np.isnan(w))
    if zeros_equal:
        same |= (g == 0) & (w == 0)
    return int((~same).sum())


def reduce16_mismatches(implementation, dtype, name: str, count: int, n: int, seed: int = 0) -> int:
    chunks = low_precision_inputs(dtype, count, n, seed)
    op = OPS[name].averaged(count) if name == "avg" else OPS[name]
    out = np.full(n, np.nan, dtype)
    with np.errstate(all="ignore"):
        kernels.reduce_chunks(chunks, out, op, kernels=implementation)
    return mismatches(out, reference16(chunks, name), zeros_equal=name in ("min", "max"))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("name", OPS_16)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_reduce16_matches_numpy(implementation, dtype, name, count, n):
    if n > 2**16 and (implementation == "numpy" or count in (1, 3)):
        n = 2**16 + 1  # numpy's float16 casts are slow; the large size runs on the compiled kernel
    assert reduce16_mismatches(IMPLEMENTATIONS[implementation](), dtype, name, count, n) == 0


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_reduce16_output_may_be_the_first_input(implementation):
    """The direct all-reduce reduces into its own part of the buffer (chunks[0])."""
    for dtype in LOW:
        chunks = low_precision_inputs(dtype, 3, 5000, 7)
        want = reference16(chunks, "sum")
        kernels.reduce_chunks(chunks, chunks[0], OPS["sum"], kernels=IMPLEMENTATIONS[implementation]())
        assert mismatches(chunks[0], want) == 0


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("name", ["min", "max"])
def test_keys_give_numpys_min_max(implementation, dtype, name):
    """Integer min/max of the keys of p vectors, mapped back, is numpy's minimum/maximum of the floats: NaN
    wherever any input has one (as numpy's canonical nan), equal elsewhere (signed zeros compare equal)."""
    implementation = IMPLEMENTATIONS[implementation]()
    rng = np.random.default_rng(3)
    pool = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.25, 5e-324, -1e300], dtype=np.float64)
    inputs = []
    for _ in range(3):
        values = rng.standard_normal(4099)
        mask = rng.random(values.size) < 0.2
        values[mask] = rng.choice(pool, int(mask.sum()))
        inputs.append(values.astype(dtype))
    if dtype == np.float32:
        inputs[1].view(np.uint32)[:8] = 0xFFB00002  # a negative NaN with another payload
    keys = [kernels.to_keys(x.copy(), name, kernels=implementation) for x in inputs]
    reduced = np.minimum.reduce(keys) if name == "min" else np.maximum.reduce(keys)
    kernels.from_keys(reduced, kernels=implementation)
    result = reduced.view(dtype)
    want = UFUNC[name].reduce(inputs)
    np.testing.assert_array_equal(result, want)
    nan = np.array(np.nan, dtype=dtype).view(reduced.dtype)
    assert (reduced[np.isnan(want)] == nan).all(), "every NaN must be numpy's nan, bit for bit"


def test_keys_sort_like_the_floats():
    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64):
        values = np.concatenate([rng.standard_normal(1000) * 1e3, [np.inf, -np.inf, 0.0, -0.0, 1e-45]]).astype(dtype)
        keys = kernels.to_keys(values.copy(), "max")
        in_key_order = values[np.argsort(keys, kind="stable")]
        assert (in_key_order[1:] >= in_key_order[:-1]).all()


# ---------------------------------------------------------------------------------------------- teeth
MUTANTS = {  # name -> (text in kernels.c, its broken replacement)
    "bfloat16 rounds half up": ("(u + 0x7fffu + ((u >> 16) & 1u)) >> 16", "(u + 0x8000u) >> 16"),
    "float16 truncates": ("_MM_FROUND_TO_NEAREST_INT", "_MM_FROUND_TO_ZERO"),
    "max drops NaN": ("(acc[i] >= x[i] || acc[i] != acc[i])", "(acc[i] >= x[i])"),
    "sum rounds every step": ("case SUM: for (i = 0; i < m; i++) acc[i] += x[i];",
                              "case SUM: for (i = 0; i < m; i++) acc[i] = from_bf16(to_bf16(acc[i] + x[i]));"),
    "avg divides after rounding": ("acc[i] /= divisor", "acc[i] /= 1.0f"),
}
CAUGHT_BY = {  # the check that must fail for each mutant: (dtype, op)
    "bfloat16 rounds half up": (BFLOAT16, "sum"),
    "float16 truncates": (np.dtype(np.float16), "sum"),
    "max drops NaN": (np.dtype(np.float16), "max"),
    "sum rounds every step": (BFLOAT16, "sum"),
    "avg divides after rounding": (BFLOAT16, "avg"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_checks_catch_a_broken_kernel(mutant, tmp_path):
    """A kernel with one deliberate bug, built from a mutated kernels.c, fails the same check the real one passes."""
    compiled()
    original, broken = MUTANTS[mutant]
    source = open(kernels.SOURCE).read()
    assert original in source, f"the mutant {mutant!r} no longer applies to kernels.c"
    mutated = kernels.Kernels(ctypes.CDLL(kernels.build(source.replace(original, broken), str(tmp_path))))
    dtype, name = CAUGHT_BY[mutant]
    assert reduce16_mismatches(compiled(), dtype, name, 3, 1001) == 0
    assert reduce16_mismatches(mutated, dtype, name, 3, 1001) > 0, f"the check missed the mutant {mutant!r}"
