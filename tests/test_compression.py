"""The wire codecs (``mpcomm.compression``) against independent statements of their rounding: ml_dtypes / numpy
casts for bf16 / fp16, and the per-block absmax error bound for int8; sizes 0, 1, prime, block edges; NaN / inf."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpcomm.compression import INT8_BLOCK, WIRES, codec

SIZES = [0, 1, 2, 7, 1009, INT8_BLOCK - 1, INT8_BLOCK, INT8_BLOCK + 1, 3 * INT8_BLOCK, 100_003]


def data(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + n)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))).astype(np.float32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", WIRES)
def test_wire_nbytes_is_the_payload_size(name, n):
    c = codec(name)
    payload = c.encode(data(n))
    assert payload.dtype == np.uint8 and payload.size == c.wire_nbytes(n)
    expected = {"bf16": 2 * n, "fp16": 2 * n, "int8": n + 4 * -(-n // INT8_BLOCK)}[name]
    assert c.wire_nbytes(n) == expected


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name,dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_16bit_roundtrip_is_the_cast(name, dtype, n):
    x = data(n)
    with np.errstate(over="ignore"):
        expected = x.astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(codec(name).roundtrip(x), expected)


@pytest.mark.parametrize("n", SIZES)
def test_int8_error_within_half_a_step_of_each_blocks_absmax(n):
    x = data(n)
    y = codec("int8").roundtrip(x)
    for start in range(0, n, INT8_BLOCK):
        block, decoded = x[start : start + INT8_BLOCK], y[start : start + INT8_BLOCK]
        absmax = np.abs(block).max()
        bound = absmax / 254 * (1 + 1e-5) + 1e-30  # half a quantisation step, plus float32 rounding
        assert np.abs(decoded - block).max() <= bound, (start, absmax)
        assert np.abs(decoded).max() == pytest.approx(absmax, rel=1e-6)  # the block's extreme is exact


def test_int8_blocks_are_independent_so_block_aligned_pieces_encode_alike():
    x = data(5 * INT8_BLOCK + 17)
    c = codec("int8")
    cut = 2 * INT8_BLOCK
    whole = c.roundtrip(x)
    np.testing.assert_array_equal(whole, np.concatenate([c.roundtrip(x[:cut]), c.roundtrip(x[cut:])]))
    x[INT8_BLOCK + 3] = 1e6  # one outlier changes its own block's scale only
    after = c.roundtrip(x)
    np.testing.assert_array_equal(after[: INT8_BLOCK], whole[: INT8_BLOCK])
    np.testing.assert_array_equal(after[2 * INT8_BLOCK :], whole[2 * INT8_BLOCK :])
    assert not np.array_equal(after[INT8_BLOCK : 2 * INT8_BLOCK], whole[INT8_BLOCK : 2 * INT8_BLOCK])


def test_int8_zero_block_and_exact_values():
    x = np.zeros(INT8_BLOCK + 5, np.float32)
    x[-5:] = [127, -127, 1, 0, -3]
    np.testing.assert_array_equal(codec("int8").roundtrip(x), x)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_16bit_nonfinite_kept(name):
    x = np.array([np.nan, np.inf, -np.inf, 1.5, -0.0], np.float32)
    y = codec(name).roundtrip(x)
    assert np.isnan(y[0]) and y[1] == np.inf and y[2] == -np.inf and y[3] == 1.5
    assert y[4] == 0 and np.signbit(y[4])


def test_fp16_overflow_becomes_inf():
    y = codec("fp16").roundtrip(np.array([65504, 65520, -1e6], np.float32))
    assert y[0] == 65504 and y[1] == np.inf and y[2] == -np.inf


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_nonfinite_poisons_its_block_only(bad):
    x = data(3 * INT8_BLOCK)
    x[INT8_BLOCK + 7] = bad
    y = codec("int8").roundtrip(x)
    assert np.isnan(y[INT8_BLOCK : 2 * INT8_BLOCK]).all()
    assert np.isfinite(y[: INT8_BLOCK]).all() and np.isfinite(y[2 * INT8_BLOCK :]).all()


@pytest.mark.parametrize("name", WIRES)
def test_encode_into_out_and_accumulate(name):
    c = codec(name)
    x, acc = data(1009), data(1009, seed=1)
    out = np.empty(c.wire_nbytes(x.size), np.uint8)
    assert c.encode(x, out) is out
    expected = acc + c.roundtrip(x)
    np.testing.assert_array_equal(c.accumulate(out, acc), expected)


@pytest.mark.parametrize("name", WIRES)
def test_bad_arguments_name_the_problem(name):
    c = codec(name)
    with pytest.raises(TypeError, match="float32"):
        c.encode(np.ones(4, np.float64))
    with pytest.raises(TypeError, match="1-D"):
        c.encode(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=f"{c.wire_nbytes(4)} bytes"):
        c.decode(np.zeros(3, np.uint8), np.empty(4, np.float32))


def test_unknown_wire():
    with pytest.raises(ValueError, match="unknown wire 'fp8'.*bf16"):
        codec("fp8")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", WIRES)
def test_compiled_and_numpy_passes_give_the_same_bytes(name, n):
    """The compiled passes (``mpcomm.kernels``) and the numpy forms agree bit for bit (ranks may run either)."""
    from mpcomm import kernels

    if kernels.load() is None:
        pytest.skip("no C compiler here: the kernels cannot be built (numpy's forms are tested)")
    compiled, numpy_form = codec(name).using(kernels.load()), codec(name).using(None)
    x = data(n)
    if n > 2 * INT8_BLOCK:
        x[3] = np.nan
        x[INT8_BLOCK + 1] = -np.inf
        x[2 * INT8_BLOCK :][:INT8_BLOCK] = 0
    x[-1:] = 1e5  # (past float16's range: inf)
    payload = compiled.encode(x)
    np.testing.assert_array_equal(payload, numpy_form.encode(x))
    decoded = [c.decode(payload, np.empty(n, np.float32)) for c in (compiled, numpy_form)]
    assert decoded[0].tobytes() == decoded[1].tobytes()
    acc = data(n, seed=5)
    summed = [c.accumulate(payload, acc.copy()) for c in (compiled, numpy_form)]
    assert summed[0].tobytes() == summed[1].tobytes()
