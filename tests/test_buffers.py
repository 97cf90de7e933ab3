"""mpcomm.buffers in one process: the dtype/op table, wire dtypes, ops, how objects become arrays (buffer
protocol, then __dlpack__, then __cuda_array_interface__), and non-contiguous handling.

Run: ``python -m pytest -q tests/test_buffers.py`` (no MPI launcher needed).
"""
from __future__ import annotations

import array

import numpy as np
import pytest
from conftest import ALL_DTYPES, BFLOAT16, BOOL, LOW_PRECISION, OPS, dtype_id, ops_for
from mpi4py import MPI

from mpcomm import AVG, MAX, MIN, PROD, SUM, Communicator, buffers
from mpcomm.work_array import WorkArray, flat
from mpcomm.buffers import (
    as_array,
    as_input,
    as_output,
    check_dtype_op,
    reduce_op,
    wire_dtype,
)


# ------------------------------------------------------------------------------------------ tables
def test_supported_dtypes_are_the_contract():
    assert set(buffers.SUPPORTED_DTYPES) == set(ALL_DTYPES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_dtype_op_table(dtype, op):
    """Supported pairs pass; the others raise TypeError naming the operation, the dtype and the op."""
    if op in ops_for(dtype):
        check_dtype_op(dtype, op, "allreduce")
    else:
        with pytest.raises(TypeError, match="allreduce") as info:
            check_dtype_op(dtype, op, "allreduce")
        assert op in str(info.value) and str(np.dtype(dtype)) in str(info.value)


@pytest.mark.parametrize("dtype", [np.longdouble, np.dtype("i4,f4"), np.dtype("U3"), np.dtype("S4"), object,
                                   np.dtype("datetime64[s]")], ids=str)
def test_unsupported_dtypes(dtype):
    if np.dtype(dtype) == np.float64:  # platforms where long double is double
        pytest.skip("long double is float64 here")
    for op in (None, SUM, MAX):
        with pytest.raises(TypeError, match="unsupported dtype"):
            check_dtype_op(dtype, op, "reduce_scatter")


def test_data_movement_accepts_every_supported_dtype():
    for dtype in ALL_DTYPES:
        check_dtype_op(dtype, None, "broadcast")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_wire_dtype(dtype):
    expected = np.float32 if dtype in LOW_PRECISION else np.uint8 if dtype == BOOL else dtype
    assert wire_dtype(dtype) == np.dtype(expected)


def test_op_constants_and_lookup():
    assert (SUM, PROD, MIN, MAX, AVG) == ("sum", "prod", "min", "max", "avg")
    assert {name: reduce_op(name).mpi for name in OPS} == {
        "sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX, "avg": MPI.SUM}
    assert reduce_op("SUM").name == "sum"
    with pytest.raises(TypeError, match="allreduce: unknown reduction op 'xor'"):
        reduce_op("xor", "allreduce")


@pytest.mark.parametrize("op", OPS)
def test_reduce_op_applies_in_place(op):
    a, b = np.array([1.0, 5.0, -2.0]), np.array([3.0, 2.0, -4.0])
    expected = {"sum": a + b, "avg": a + b, "prod": a * b, "min": np.minimum(a, b), "max": np.maximum(a, b)}[op]
    out = reduce_op(op)(a, b)
    assert out is a and np.array_equal(a, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.complex64])
@pytest.mark.parametrize("size", [2, 3, 4, 8, 1024, 6])
def test_avg_finish_is_the_division_bit_for_bit(dtype, size):
    """avg's last step multiplies by 1/p where p is a power of two: the bits must be those of the division."""
    info = np.finfo(dtype)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 3,
               info.smallest_subnormal, 1.0, -3.0, 1 / 3]
    rng = np.random.default_rng(size)
    exponents = rng.integers(info.minexp - info.nmant, info.maxexp, 4096)  # subnormals to the largest
    with np.errstate(all="ignore"):
        values = np.concatenate([np.array(special, dtype=dtype),
                                 np.ldexp(rng.uniform(-1, 1, 4096), exponents).astype(dtype)])
    finished = values.copy()
    with np.errstate(all="ignore"):
        expected = np.divide(values, size, dtype=dtype)  # (numpy 1.x would widen float16 for a size of 1024)
        buffers.OPS[AVG].averaged(size).finish(finished)
    np.testing.assert_array_equal(finished.view(f"u{finished.itemsize}"), expected.view(f"u{expected.itemsize}"))


def test_bool_min_max_on_the_wire_are_and_or():
    x, y = np.array([0, 0, 1, 1], np.uint8), np.array([0, 1, 0, 1], np.uint8)
    assert list(reduce_op(MIN)(x.copy(), y)) == [0, 0, 0, 1]
    assert list(reduce_op(MAX)(x.copy(), y)) == [0, 1, 1, 1]


# ------------------------------------------------------------------------------------------ as_array
class BufferAndMore(bytearray):
    """Exposes the buffer protocol AND __dlpack__ AND __cuda_array_interface__: the buffer protocol must win."""

    def __dlpack__(self, **kwargs):
        raise AssertionError("__dlpack__ used although the buffer protocol is available")

    def __dlpack_device__(self):
        return (1, 0)

    @property
    def __cuda_array_interface__(self):
        raise AssertionError("__cuda_array_interface__ used although the buffer protocol is available")


class DLPackOnly:
    """A CPU tensor seen only through DLPack (like a CPU torch tensor); CAI present but must not be used."""

    def __init__(self, data: np.ndarray, device=(1, 0)):
        self.data, self.device = data, device

    def __dlpack__(self, **kwargs):
        return self.data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device

    @property
    def __cuda_array_interface__(self):
        raise AssertionError("__cuda_array_interface__ used although __dlpack__ is available")


class CudaOnly:
    @property
    def __cuda_array_interface__(self):
        return {"shape": (3,), "typestr": "<f4", "data": (0, False), "version": 3}


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def test_numpy_passes_through():
    a = np.arange(5.0)
    assert as_array(a) is a


def test_buffer_protocol_first():
    obj = BufferAndMore(b"\x01\x02\x03")
    view = as_output(obj, "allreduce")
    assert isinstance(view, np.ndarray) and view.dtype == np.uint8
    view[:] = 5  # shares memory with the object
    assert bytes(obj) == b"\x05\x05\x05"


@pytest.mark.parametrize(
    "obj,dtype,values",
    [
        (bytearray(b"\x01\x02\x03"), np.uint8, [1, 2, 3]),
        (b"\x04\x05", np.uint8, [4, 5]),
        (array.array("d", [1.5, -2.0]), np.float64, [1.5, -2.0]),
        (array.array("h", [7, -8, 9]), np.int16, [7, -8, 9]),
        (memoryview(np.arange(3, dtype=np.uint32)), np.uint32, [0, 1, 2]),
    ],
    ids=["bytearray", "bytes", "array-d", "array-h", "memoryview"],
)
def test_buffer_protocol_objects_become_typed_arrays(obj, dtype, values):
    view = as_array(obj)
    assert view.dtype == np.dtype(dtype) and view.tolist() == values


def test_buffer_protocol_shares_memory_and_respects_readonly():
    raw = bytearray(3)
    as_output(raw, "allreduce")[:] = [9, 8, 7]
    assert list(raw) == [9, 8, 7]
    with pytest.raises(ValueError, match="allreduce: output buffer is read-only"):
        as_output(b"abc", "allreduce")
    assert as_input(b"abc", "all_gather").tolist() == [97, 98, 99]  # read-only input is fine


def test_dlpack_host_shares_memory():
    data = np.arange(4.0)
    view = as_array(DLPackOnly(data))
    assert isinstance(view, np.ndarray) and np.shares_memory(view, data)


@pytest.mark.parametrize("device", [(4, 0), (14, 0)], ids=["opencl", "metal"])
def test_dlpack_unsupported_device(device):
    with pytest.raises(TypeError, match="DLPack device type"):
        as_array(DLPackOnly(np.zeros(2), device), "allreduce")


@pytest.mark.skipif(_has_cupy(), reason="CuPy installed: the CUDA path is tested in the GPU tests")
def test_dlpack_cuda_without_cupy():
    with pytest.raises(TypeError, match="CuPy"):
        as_array(DLPackOnly(np.zeros(2), (2, 0)), "allreduce")


@pytest.mark.skipif(_has_cupy(), reason="CuPy installed: the CUDA path is tested in the GPU tests")
def test_cuda_array_interface_without_cupy():
    with pytest.raises(TypeError, match="CuPy is not installed"):
        as_array(CudaOnly(), "allreduce")


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3.0, "text", None, {"a": 1}], ids=["list", "float", "str", "none", "dict"])
def test_not_a_buffer(obj):
    with pytest.raises(TypeError, match="allreduce: .* is not a buffer"):
        as_array(obj, "allreduce")


def test_readonly_numpy_output_rejected():
    a = np.zeros((2, 3), np.float32)
    a.setflags(write=False)
    with pytest.raises(ValueError, match=r"broadcast: output buffer is read-only \(shape \(2, 3\), dtype float32\)"):
        as_output(a, "broadcast")
    assert as_input(a, "broadcast") is a


# ------------------------------------------------------------------------------------------ layouts
def test_flat():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = flat(a)
    assert f.shape == (12,) and np.shares_memory(f, a)
    assert flat(a[:, ::2]) is None and flat(a.T) is None and flat(a[::-1]) is None
    assert flat(np.ones(())).shape == (1,)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("layout", ["contiguous", "2-D", "strided"])
@pytest.mark.parametrize("nans", [False, True])
def test_a_work_array_casts_as_numpy_and_writes_back(dtype, layout, nans):
    """float16/bfloat16 widened to float32 on entry and narrowed back on exit (the extension's pass where it takes
    them; numpy's where a NaN is there), bitwise numpy's casts, NaN payloads, infinities and values that overflow on
    the way back included."""
    rng = np.random.default_rng(3)
    n = 2**20 + 3
    base = (rng.standard_normal(2 * n) * 1e3).astype(dtype)
    if nans:
        base.view(np.uint16)[[6, 900_002]] = [0x7C01 if dtype == np.float16 else 0x7F81, 0xFE00 | 0x1F]
    array = {"contiguous": base[:n], "2-D": base[: n - 3].reshape(1024, -1), "strided": base[::2]}[layout]
    before = array.copy()
    with WorkArray(array, np.float32) as work:
        assert work.dtype == np.float32 and work.shape == (array.size,)
        np.testing.assert_array_equal(work.view(np.uint32), before.reshape(-1).astype(np.float32).view(np.uint32))
        work *= np.float32(70.0)  # (some overflow the 16-bit type)
        expected = work.copy()
    with np.errstate(over="ignore"):
        expected = expected.astype(dtype).reshape(array.shape)
    np.testing.assert_array_equal(array.view(np.uint16), expected.view(np.uint16))
    assert np.isnan(array.astype(np.float32)).any() == nans


@pytest.fixture(scope="module")
def self_comm():
    c = Communicator(MPI.COMM_SELF)
    yield c
    c.free()


@pytest.mark.parametrize("dtype", [np.float64, BFLOAT16, np.int8, BOOL, np.complex64], ids=dtype_id)
def test_noncontiguous_views_single_process(self_comm, dtype):
    """With one rank every collective is the identity: strided, reversed, transposed and F-ordered views come
    back unchanged, elements outside them untouched (they are copied to contiguous wire buffers and back)."""
    op = MAX if np.dtype(dtype) == BOOL else SUM
    base = (np.arange(60) % 7 > 2) if np.dtype(dtype) == BOOL else (np.arange(60) % 13 - 6)
    base = base.astype(dtype).reshape(6, 10)
    original = base.copy()
    algorithms = sorted(set(buffers_algorithms()))
    for view in (base[::2, 1::3], base[::-1, 4], base.T[1:4], np.asfortranarray(base)):
        before = view.copy()
        for algorithm in algorithms:
            self_comm.allreduce(view, op=op, algorithm=algorithm)
            self_comm.broadcast(view, algorithm="auto")
            assert np.array_equal(view, before), (algorithm, view.strides)
    assert np.array_equal(base, original)
    out = np.zeros((6, 3), dtype=dtype)
    self_comm.all_gather(base[:, 2], out[:, 1])
    assert np.array_equal(out[:, 1], base[:, 2]) and not out[:, [0, 2]].any()
    out = np.zeros((10, 3), dtype=dtype)
    self_comm.reduce_scatter(base[1, ::2], out[::2, 0], op=op)
    assert np.array_equal(out[::2, 0], base[1, ::2]) and not out[1::2].any() and not out[:, 1:].any()


def buffers_algorithms() -> list[str]:
    from mpcomm.algorithms import REGISTRY

    return list(REGISTRY["allreduce"]) + ["auto"]
