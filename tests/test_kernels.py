"""The compiled reduction kernels (``mpcomm.kernels``) and their numpy forms against numpy's own arithmetic:
float16/bfloat16 combined in float32 and rounded once, float min/max keys; and mutants of the C source that these
checks must catch (so they have teeth). One process; the collectives built on them: test_low_precision.py."""
from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Sequence

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


def compiled_through_ctypes():
    return kernels.Kernels(compiled().library)  # (without the extension module: the ctypes calls)


IMPLEMENTATIONS = {"compiled": compiled, "ctypes": compiled_through_ctypes, "numpy": lambda: None}


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


def subnormal_inputs(dtype, count: int, n: int, seed: int) -> list[np.ndarray]:
    """``count`` vectors of subnormals of both signs: their float32 sums stay subnormal (the bfloat16 instruction
    would flush them to zero), and their averages over 2 or 4 chunks are rounding ties half the time."""
    rng = np.random.default_rng([seed, count, n, 1])
    mantissa = (1 << ml_dtypes.finfo(dtype).nmant) - 1
    bits = rng.integers(1, mantissa + 1, (count, n), dtype=np.uint16) | (rng.integers(0, 2, (count, n),
                                                                                     dtype=np.uint16) << 15)
    return [row.view(dtype) for row in bits]


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


def reduce16_mismatches(implementation, dtype, name: str, count: int, n: int, seed: int = 0,
                        inputs=low_precision_inputs) -> int:
    chunks = inputs(dtype, count, n, seed)
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


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("name", OPS_16)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_reduce16_keeps_subnormals(implementation, dtype, name, count):
    """Results in the subnormal range, and their ties, round as numpy's do (not flushed to zero)."""
    assert reduce16_mismatches(IMPLEMENTATIONS[implementation](), dtype, name, count, 1001,
                               inputs=subnormal_inputs) == 0


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
    assert key_mismatches(IMPLEMENTATIONS[implementation](), dtype, name) == 0


def key_mismatches(implementation, dtype, name: str) -> int:
    """Elements where the keys' integer min/max of 3 vectors, mapped back, differs in bits from numpy's."""
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
    want = UFUNC[name].reduce(inputs)
    result = reduced.view(dtype)
    nans = np.isnan(want)
    canonical = np.array(np.nan, dtype=dtype).view(reduced.dtype)  # every NaN numpy's nan, bit for bit
    return int((result[~nans] != want[~nans]).sum() + (reduced[nans] != canonical).sum())  # (-0.0 == 0.0)


def test_the_key_passes_are_an_extension_where_pythons_headers_are():
    """Built with Python's headers, the library is imported as ``mpcomm._kernels`` too, and it refuses what it
    cannot take with a TypeError instead of reading past a buffer."""
    if not kernels._python_flags():
        pytest.skip("Python's headers are not installed here: the key passes go through ctypes")
    module = compiled().module
    assert module is not None and module.__name__ == "mpcomm._kernels"
    with pytest.raises(TypeError, match="got 2-byte items"):
        module.float_keys(np.zeros(3, np.float16), 3)
    with pytest.raises(TypeError, match="expected 1 arguments, got 2"):
        module.from_keys(np.zeros(3, np.int32), 3)
    with pytest.raises(TypeError):
        module.float_keys(np.zeros(3, np.float32), "max")
    with pytest.raises((TypeError, ValueError, BufferError)):
        module.from_keys(np.zeros(6, np.int32)[::2])  # not contiguous
    half = np.zeros(3, np.float16)
    with pytest.raises(ValueError, match="chunk 1 has 4 bytes"):
        module.reduce16([half, np.zeros(2, np.float16)], half, 0, 0, 1.0)
    with pytest.raises(ValueError, match="4-byte items"):
        module.reduce16([np.zeros(3, np.float32)], np.zeros(3, np.float32), 0, 0, 1.0)
    with pytest.raises(ValueError, match="65 chunks"):
        module.reduce16([half] * 65, half, 0, 0, 1.0)
    with pytest.raises(ValueError, match="kind 7"):
        module.reduce16([half], half, 7, 0, 1.0)
    with pytest.raises((TypeError, ValueError, BufferError)):
        module.reduce16([half], np.zeros(6, np.float16)[::2], 0, 0, 1.0)  # not contiguous


def finish_mismatches(finish, dtype, divisor: int) -> int:
    """Elements where ``finish(x, divisor)`` differs in bits from numpy's division, plus 1 if its NaN answer is
    wrong; over subnormals to the largest values, infinities, NaN, signed zeros."""
    info = np.finfo(dtype)
    rng = np.random.default_rng(divisor)
    exponents = rng.integers(info.minexp - info.nmant, info.maxexp, 4096)
    with np.errstate(all="ignore"):
        values = np.concatenate([np.array([0.0, -0.0, np.inf, -np.inf, info.max, info.smallest_subnormal, 1 / 3],
                                          dtype=dtype), np.ldexp(rng.uniform(-1, 1, 4096), exponents).astype(dtype)])
    wrong = 0
    for with_nan in (False, True):
        x = values.copy()
        x[100] = np.nan if with_nan else x[100]
        with np.errstate(all="ignore"):
            expected = np.divide(x, divisor)
        found = finish(x, divisor)
        wrong += int((x.view(f"u{x.itemsize}") != expected.view(f"u{x.itemsize}")).sum()) + (found != with_nan)
    return wrong


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 6, 8, 1024])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_finish_divides_as_numpy_and_finds_nan(dtype, divisor):
    """avg's finish and the NaN check in one pass: numpy's division bit for bit, and whether a NaN is there."""
    if compiled().module is None:
        pytest.skip("Python's headers are not installed here: the numpy forms run (test_buffers.py)")
    assert finish_mismatches(kernels.finish_floats, dtype, divisor) == 0


def test_finish_leaves_what_it_does_not_take():
    """None, with the array untouched, where the numpy forms must run instead."""
    compiled()
    strided = np.arange(8, dtype=np.float32)[::2]
    for array in (np.ones(3, np.float16), np.ones(3, np.complex64), strided, np.ones(3, np.int32)):
        before = array.copy()
        assert kernels.finish_floats(array, 3) is None
        np.testing.assert_array_equal(array, before)


def mutated_library(tmp_path, original: str, broken: str, flags: Sequence[str] = (), count: int = 1) -> str:
    """The path of the kernels built from kernels.c with ``original`` (which must be there) replaced by ``broken``
    (``count`` times; -1: everywhere)."""
    compiled()
    source = open(kernels.SOURCE).read()
    assert original in source, f"the mutant {broken!r} no longer applies to kernels.c"
    return kernels.build(source.replace(original, broken, count), str(tmp_path), flags)


def mutated_extension(tmp_path, original: str, broken: str):
    """:func:`mutated_library` imported as the extension (skips where Python's headers are not installed)."""
    if compiled().module is None:
        pytest.skip("Python's headers are not installed here: no extension to break")
    return kernels.extension(mutated_library(tmp_path, original, broken))


def test_finish_check_catches_a_broken_finish(tmp_path):
    """A finish that multiplies by 1/p for every p (not the division's bits for p = 3, 6) fails the check."""
    module = mutated_extension(tmp_path, "} else if ((divisor & (divisor - 1)) == 0) {", "} else if (1) {")
    assert finish_mismatches(module.finish, np.float32, 3) > 0, "the check missed a finish that multiplies"


def combine_mismatches(combine, dtype, divisor: int) -> int:
    """Elements where ``combine(a, b, out, op)`` (out = a; op: avg over ``divisor`` ranks, 1: sum) differs in bits
    from numpy's add, then division; over subnormals to the largest values (sums that overflow), infinities and
    NaN (two NaN of other payloads: the first one's, as numpy's add keeps)."""
    info = np.finfo(dtype)
    rng = np.random.default_rng(divisor + 7)
    with np.errstate(all="ignore"):
        a, b = (np.ldexp(rng.uniform(-1, 1, 4099), rng.integers(info.minexp - info.nmant, info.maxexp, 4099))
                .astype(dtype) for _ in range(2))
        a[:6] = [np.nan, np.inf, -np.inf, info.max, 0.0, -0.0]
        b[:6] = [1.0, -np.inf, 1.0, info.max, -0.0, -0.0]
        bits = a.view(f"u{a.itemsize}")
        a[6], b[6] = -np.nan, np.nan
        bits[6] |= bits.dtype.type(1)  # (another payload than b's; numpy 1.x has no uint64 | int)
        expected = np.add(a, b)
        if divisor > 1:
            expected = np.divide(expected, divisor)
        if np.lib.NumpyVersion(np.__version__) < "2.0.0":  # (its add keeps either NaN's payload, run to run)
            expected[6] = a[6]  # (the first one's, as numpy 2's add keeps)
        combine(a, b, a, OPS["avg"].averaged(divisor) if divisor > 1 else OPS["sum"])
    return int((a.view(f"u{a.itemsize}") != expected.view(f"u{a.itemsize}")).sum())


def combine_finishing(a, b, out, op):
    kernels.combine(a, b, out, op, finish=True)


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 6, 1024])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_combine_is_numpys_add_then_division(dtype, divisor):
    """A sum's addition, and avg's last addition with its finish, in one pass: numpy's passes, bit for bit."""
    compiled()
    assert combine_mismatches(combine_finishing, dtype, divisor) == 0


def test_combine_without_finish_leaves_avg_undivided():
    """avg's additions before the last one are plain sums."""
    compiled()
    a, b = np.arange(5, dtype=np.float32), np.full(5, 0.5, np.float32)
    kernels.combine(a, b, a, OPS["avg"].averaged(4))
    np.testing.assert_array_equal(a, np.arange(5, dtype=np.float32) + 0.5, strict=True)


@pytest.mark.parametrize("entry", ["float_keys", "from_keys", "finish", "add_finish", "reduce16"])
def test_a_long_pass_lets_other_threads_run(entry):
    """The extension lets go of the GIL during a long pass, as ctypes did. With a switch interval far longer than
    the test, a thread waiting for the GIL gets it only when the main thread lets go, and this one gives it back
    at once; so it counts during a call (of up to 20) only if the call lets go."""
    module = compiled().module
    if module is None:
        pytest.skip("Python's headers are not installed here: the passes go through ctypes (which lets go)")
    x, y = np.ones(1 << 22, np.float32), np.ones(1 << 22, np.float32)
    halves = x.view(np.float16), y.view(np.float16)
    call = {"float_keys": lambda: module.float_keys(x, 3), "from_keys": lambda: module.from_keys(x.view(np.int32)),
            "finish": lambda: module.finish(x, 3), "add_finish": lambda: module.add_finish(x, y, x, 3),
            "reduce16": lambda: module.reduce16(halves, halves[0], 0, 0, 1.0)}[entry]
    counter, go, stop = [0], threading.Event(), threading.Event()

    def count():
        go.wait()
        while not stop.is_set():
            counter[0] += 1
            time.sleep(1e-6)  # (gives the GIL back)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    thread = threading.Thread(target=count)
    try:
        thread.start()
        go.set()
        moved = False
        for _ in range(20):
            before = counter[0]
            call()
            if counter[0] > before:
                moved = True
                break
    finally:
        stop.set()
        go.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert moved, f"{entry} kept the GIL for its whole pass over 16 MiB, 20 times"


def test_combine_falls_back_where_the_extension_cannot():
    """Strided operands, or dtypes the extension does not take, go through numpy (the same result)."""
    op = OPS["avg"].averaged(3)
    for a, b in ((np.arange(12, dtype=np.float32)[::2], np.full(6, 0.1, np.float32)),
                 (np.arange(6, dtype=np.float16), np.full(6, 0.1, np.float16))):
        out = np.empty(6, a.dtype)
        kernels.combine(a, b, out, op, finish=True)
        np.testing.assert_array_equal(out, np.divide(a + b, 3), strict=True)


def test_combine_check_catches_a_fused_division_that_rounds_otherwise(tmp_path):
    """(a + b) / 3 computed as a / 3 + b / 3 (other roundings) fails the check."""
    module = mutated_extension(tmp_path, "out[i] = (a[i] + b[i]) / d;", "out[i] = a[i] / d + b[i] / d;")

    def broken(a, b, out, op):
        module.add_finish(a, b, out, op.divisor)
    assert combine_mismatches(broken, np.float32, 3) > 0, "the check missed a division that rounds otherwise"


def test_combine_check_catches_a_sum_that_keeps_the_other_nan(tmp_path):
    """b + a for a + b: the same sums, but of two NaN the second one's payload (numpy keeps the first's)."""
    module = mutated_extension(tmp_path, "out[i] = (a[i] + b[i]) * factor;", "out[i] = (b[i] + a[i]) * factor;")

    def broken(a, b, out, op):
        module.add_finish(a, b, out, op.divisor)
    assert combine_mismatches(broken, np.float32, 1) > 0, "the check missed a sum that keeps the other NaN"


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
    "sum rounds every step": ("for (; i < m; i++) acc[i] += from_bf16(src[i]);",
                              "for (; i < m; i++) acc[i] = from_bf16(to_bf16(acc[i] + from_bf16(src[i])));"),
    "avg divides after rounding": ("acc[i] /= divisor", "acc[i] /= 1.0f"),
}
CAUGHT_BY = {  # the check that must fail for each mutant: (dtype, op)
    "bfloat16 rounds half up": (BFLOAT16, "sum"),
    "float16 truncates": (np.dtype(np.float16), "sum"),
    "max drops NaN": (np.dtype(np.float16), "max"),
    "sum rounds every step": (BFLOAT16, "sum"),
    "avg divides after rounding": (BFLOAT16, "avg"),
}


# The two-chunk sum's 16-lane pass (built where the CPU has AVX-512BW), run by count 2: its own mutants.
LANES_MUTANTS = {
    "bfloat16 rounds half up": ("_mm512_and_si512(_mm512_srli_epi32(u, 16), one)", "one"),
    "float16 truncates": ("_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT)", "_mm512_cvtps_ph(f, _MM_FROUND_TO_ZERO)"),
    "avg multiplies by the divisor": ("_mm512_div_ps(", "_mm512_mul_ps("),
}
LANES_CAUGHT_BY = {"bfloat16 rounds half up": (BFLOAT16, "sum"), "float16 truncates": (np.dtype(np.float16), "sum"),
                   "avg multiplies by the divisor": (BFLOAT16, "avg")}
# Where the CPU has AVX512-BF16, the 16-lane pass rounds to bfloat16 in one instruction (which flushes subnormals:
# those lanes take the integer rounding). The mutants above are built without the instruction, so that the integer
# rounding they break runs on every lane.
WITHOUT_BF16_INSTRUCTION = ["-mno-avx512bf16"] if "avx512_bf16" in kernels._cpu_flags().split() else []
BF16_MUTANTS = {
    "bfloat16 instruction truncates": ("(__m256i)_mm512_cvtneps_pbh(f)",
                                       "_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16))"),
    "subnormals flush to zero": ("_mm512_fpclass_ps_mask(f, 0x20)", "0"),
}
BF16_CAUGHT_BY = {"bfloat16 instruction truncates": (BFLOAT16, "sum"),
                  "subnormals flush to zero": (BFLOAT16, "sum", subnormal_inputs)}


@pytest.mark.parametrize("mutant", list(LANES_MUTANTS))
def test_checks_catch_a_broken_two_chunk_pass(mutant, tmp_path):
    """A broken 16-lane pass (what direct's reduction runs at p = 2) fails the check the real one passes."""
    if "avx512bw" not in kernels._cpu_flags().split():
        pytest.skip("this CPU has no AVX-512BW: the 16-lane pass is not built here")
    path = mutated_library(tmp_path, *LANES_MUTANTS[mutant], WITHOUT_BF16_INSTRUCTION)
    assert_caught(path, LANES_CAUGHT_BY[mutant], 2, mutant)


@pytest.mark.parametrize("mutant", list(BF16_MUTANTS))
def test_checks_catch_a_broken_bfloat16_instruction_pass(mutant, tmp_path):
    """The one-instruction bfloat16 rounding: a truncating one, or one that lets subnormals flush, is caught."""
    if "avx512_bf16" not in kernels._cpu_flags().split():
        pytest.skip("this CPU has no AVX512-BF16: the one-instruction rounding is not built here")
    assert_caught(mutated_library(tmp_path, *BF16_MUTANTS[mutant]), BF16_CAUGHT_BY[mutant], 2, mutant)


def assert_caught(path: str, check: tuple, count: int, mutant: str) -> None:
    """``check`` ((dtype, op[, inputs]), ``count`` chunks of 1001 elements) passes with the real kernels and fails
    with the mutated ones at ``path``."""
    mutated = kernels.Kernels(ctypes.CDLL(path))
    dtype, name, *rest = check
    inputs = rest[0] if rest else low_precision_inputs
    assert reduce16_mismatches(compiled(), dtype, name, count, 1001, inputs=inputs) == 0
    assert reduce16_mismatches(mutated, dtype, name, count, 1001, inputs=inputs) > 0, \
        f"the check missed the mutant {mutant!r}"


@pytest.mark.parametrize("through", ["extension", "ctypes"])
def test_key_checks_catch_a_broken_key_pass(through, tmp_path):
    """A key pass that lets NaN sort as a number, through either entry, fails the check the real one passes."""
    path = mutated_library(tmp_path, "(b & INT32_MAX) > 0x7f800000 ? nan_key : key", "key")
    module = kernels.extension(path) if through == "extension" else None
    if through == "extension" and module is None:
        pytest.skip("Python's headers are not installed here: no extension to break")
    mutated = kernels.Kernels(ctypes.CDLL(path), module)
    assert key_mismatches(compiled(), np.float32, "max") == 0
    assert key_mismatches(mutated, np.float32, "max") > 0, f"the check missed a broken key pass ({through})"


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_checks_catch_a_broken_kernel(mutant, tmp_path):
    """A kernel with one deliberate bug, built from a mutated kernels.c, fails the same check the real one passes."""
    path = mutated_library(tmp_path, *MUTANTS[mutant], WITHOUT_BF16_INSTRUCTION, count=-1)
    assert_caught(path, CAUGHT_BY[mutant], 3, mutant)


# ------------------------------------------------------------------------------------------ cast16
def cast16_mismatches(k, dtype) -> int:
    """Elements where ``kernels.cast16`` through ``k`` differs in bits from numpy's (ml_dtypes') cast: widening
    every 16-bit pattern but the NaNs, narrowing float32 of every exponent (subnormals, rounding ties, values that
    overflow, infinities); a cast it refused counts as all of them."""
    patterns = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    patterns = patterns[~np.isnan(patterns.astype(np.float32))]
    rng = np.random.default_rng(16)
    wide = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        wide = np.concatenate([wide[~np.isnan(wide)], patterns.astype(np.float32) * np.float32(1.5),  # (ties)
                               np.float32([np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1e-45, 65520.0, 65519.0])])
    missed = 0
    for src, dst in ((patterns, np.empty(patterns.size, np.float32)), (wide, np.empty(wide.size, dtype))):
        with np.errstate(over="ignore"):
            expected = src.astype(dst.dtype)
        if not kernels.cast16(src, dst, k):
            missed += src.size
        missed += int((dst.view(np.uint8).reshape(dst.size, -1) != expected.view(np.uint8).reshape(dst.size, -1))
                      .any(axis=1).sum())
    return missed


@pytest.mark.parametrize("implementation", ["compiled", "ctypes"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_cast16_is_numpys_cast(implementation, dtype):
    assert cast16_mismatches(IMPLEMENTATIONS[implementation](), dtype) == 0


def refuses_nans(k, dtype) -> bool:
    """Whether ``kernels.cast16`` through ``k`` refuses to widen or narrow an array holding a NaN (numpy and
    ml_dtypes keep or quiet a NaN's payload their own ways)."""
    short = np.ones(4096, dtype)
    short.view(np.uint16)[4000] = 0x7C01 if dtype == np.float16 else 0x7F81  # (a signalling NaN)
    wide = np.ones(4096, np.float32)
    wide.view(np.uint32)[-1] = 0x7F800001
    return not kernels.cast16(short, np.empty(4096, np.float32), k) and not kernels.cast16(wide, np.empty(4096, dtype), k)


@pytest.mark.parametrize("implementation", ["compiled", "ctypes"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_cast16_leaves_nans_and_what_it_does_not_take_to_numpy(implementation, dtype):
    """It refuses a NaN, fewer than CAST16_FROM elements, other dtypes, arrays that are not contiguous, and a
    read-only destination."""
    k = IMPLEMENTATIONS[implementation]()
    assert refuses_nans(k, dtype)
    few = kernels.CAST16_FROM - 1
    assert not kernels.cast16(np.ones(few, dtype), np.empty(few, np.float32), k)
    assert not kernels.cast16(np.ones(4096, np.float64), np.empty(4096, np.float32), k)
    assert not kernels.cast16(np.ones(8192, dtype)[::2], np.empty(4096, np.float32), k)
    read_only = np.empty(4096, dtype)
    read_only.flags.writeable = False
    assert not kernels.cast16(np.ones(4096, np.float32), read_only, k)
    assert kernels.cast16(np.ones(4096, dtype), np.empty(4096, np.float32), k)


@pytest.mark.parametrize("mutant", ["float16 truncates", "NaN not looked for"])
def test_cast16_checks_catch_a_broken_cast(mutant, tmp_path):
    """A narrowing that truncates, or a cast that converts NaNs itself, fails the checks the real one passes."""
    if mutant == "float16 truncates":
        if "f16c" not in kernels._cpu_flags().split():
            pytest.skip("this CPU has no F16C: its vector narrowing is not built here")
        path = mutated_library(tmp_path, "_mm256_cvtps_ph(_mm256_loadu_ps(acc + i), _MM_FROUND_TO_NEAREST_INT)",
                               "_mm256_cvtps_ph(_mm256_loadu_ps(acc + i), _MM_FROUND_TO_ZERO)")
        assert cast16_mismatches(kernels.Kernels(ctypes.CDLL(path)), np.float16) > 0, "missed a truncating cast"
    else:
        path = mutated_library(tmp_path, "if (nan) return 1;", "(void)nan;")
        assert not refuses_nans(kernels.Kernels(ctypes.CDLL(path)), np.float16), "missed a cast that takes NaNs"
