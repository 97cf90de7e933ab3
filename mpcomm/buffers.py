"""What is this buffer: one place that turns user objects into arrays and knows the dtype and op tables.

Objects are taken in a fixed order (as mpi4py does): the buffer protocol (numpy, memoryview, bytearray),
then ``__dlpack__`` (torch, JAX, CuPy), then ``__cuda_array_interface__`` (CuPy, Numba). Host data becomes a
numpy array and device data a CuPy array, both sharing memory with the caller's object.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

SUM, PROD, MIN, MAX, AVG = "sum", "prod", "min", "max", "avg"

BFLOAT16: np.dtype = np.dtype(ml_dtypes.bfloat16)
_FLOATS: set[np.dtype] = {np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)}
_INTS: set[np.dtype] = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)}
_COMPLEX: set[np.dtype] = {np.dtype(np.complex64), np.dtype(np.complex128)}
_BOOL: np.dtype = np.dtype(np.bool_)
LOW_PRECISION = frozenset({np.dtype(np.float16), BFLOAT16})

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(sorted(_FLOATS | _INTS | _COMPLEX | {_BOOL}, key=str))

# DLPack device types (dlpack.h): 1 = CPU, 2 = CUDA, 3 = CUDA host (pinned), 13 = CUDA managed.
_DLPACK_HOST = (1, 3)
_DLPACK_CUDA = (2, 13)


_EXACT_HALVING = (np.dtype(np.float32), np.dtype(np.float64))  # where ``avg`` may multiply by 1/p when p is 2**k


@dataclass(frozen=True)
class ReduceOp:
    """A reduction: numpy ufunc applied in place (``ufunc(a, b, out=a)``) and the matching MPI op.

    ``divisor`` (set by :meth:`averaged`) is what ``avg`` divides a finished sum by: an all-reduce calls
    :meth:`finish` on the part it reduced last, where the sum is complete, before distributing it, so the
    division is one pass over 1/p of the data and every element is divided in one place.
    """

    name: str
    ufunc: np.ufunc
    mpi: MPI.Op
    divisor: int = 1

    def __call__(self, a, b, out=None):
        return self.ufunc(a, b, out=a if out is None else out)

    def averaged(self, size: int) -> "ReduceOp":
        """This op with its finished sums divided by ``size`` (for ``avg``)."""
        return ReduceOp(self.name, self.ufunc, self.mpi, int(size))  # (dataclasses.replace costs twice this)

    def finish(self, array) -> None:
        """In place: the last step of a reduction on a finished result (the division of ``avg``)."""
        if self.divisor == 1 or not array.size:
            return
        if self.divisor & (self.divisor - 1) == 0 and array.dtype in _EXACT_HALVING:
            # x * 2**-k is x / 2**k bit for bit (both are that real number, correctly rounded); a multiply is cheaper
            np.multiply(array, 1.0 / self.divisor, out=array)
        else:
            np.divide(array, self.divisor, out=array)


OPS: dict[str, ReduceOp] = {
    SUM: ReduceOp(SUM, np.add, MPI.SUM),
    PROD: ReduceOp(PROD, np.multiply, MPI.PROD),
    MIN: ReduceOp(MIN, np.minimum, MPI.MIN),
    MAX: ReduceOp(MAX, np.maximum, MPI.MAX),
    AVG: ReduceOp(AVG, np.add, MPI.SUM),  # summed on the wire, divided by the size once at the end
}


def reduce_op(op: object, operation: str = "reduction") -> ReduceOp:
    """The ReduceOp called ``op``; TypeError for an unknown name."""
    try:
        return OPS[str(op).lower()]
    except KeyError:
        raise TypeError(f"{operation}: unknown reduction op {op!r}; expected one of {sorted(OPS)}") from None


def check_dtype_op(dtype: np.dtype, op: str | None, operation: str) -> None:
    """Raise TypeError, before any communication, for a dtype/op pair the contract does not support
    (``op=None``: data movement only, e.g. broadcast / all_gather, where only the dtype is checked)."""
    dtype = np.dtype(dtype)
    check_plain(dtype, operation)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{operation}: unsupported dtype {dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    if op is None:
        return
    if op == AVG and dtype not in _FLOATS | _COMPLEX:
        raise TypeError(f"{operation}: op 'avg' needs a floating or complex dtype, got {dtype}")
    if dtype == _BOOL and op not in (MIN, MAX):
        raise TypeError(f"{operation}: bool supports only 'min' and 'max', got {op!r}")
    if dtype in _COMPLEX and op in (MIN, MAX):
        raise TypeError(f"{operation}: complex dtype {dtype} supports 'sum', 'prod' and 'avg', not {op!r}")


def check_plain(dtype: np.dtype, operation: str) -> None:
    """TypeError for a dtype holding Python objects (object, or a structured dtype with an object field): its
    bytes are addresses in this process, garbage (and a crash when used) anywhere else. Every entry point that
    sends or receives checks it, before any communication."""
    if dtype.hasobject:
        raise TypeError(f"{operation}: unsupported dtype {dtype}: its elements are Python objects, whose bytes are "
                        "addresses in this process and mean nothing in another; use a numeric dtype")


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, memoised: numpy computes it anew on every call, which shows on the small-message path."""
    return str(dtype)


def wire_dtype(dtype: np.dtype, widen: bool = True) -> np.dtype:
    """The dtype a reduction runs in: float16/bfloat16 accumulate in float32 (rounded once at the end; with
    ``widen=False`` the algorithm does that itself and gets them as they are), bool runs as uint8 (min/max of 0/1
    are and/or), everything else as itself."""
    dtype = np.dtype(dtype)
    if dtype in LOW_PRECISION and widen:
        return np.dtype(np.float32)
    if dtype == _BOOL:
        return np.dtype(np.uint8)
    return dtype


def is_device_array(array: Any) -> bool:
    """True for a CuPy array (device memory): the library's one test of "is this CuPy"."""
    return type(array).__module__.split(".")[0] == "cupy"


def array_module(*arrays: Any) -> ModuleType:
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    for a in arrays:
        if type(a) is not np.ndarray and is_device_array(a):
            return _cupy()
    return np


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - only without CuPy
        raise TypeError("a CUDA buffer was passed but CuPy is not installed (pip install mpcomm[cuda])") from exc
    return cupy


def as_array(obj: Any, operation: str = "buffer") -> Any:
    """The numpy (host) or CuPy (device) array sharing memory with ``obj``; TypeError if it is no buffer."""
    if isinstance(obj, np.ndarray) or is_device_array(obj):
        return obj
    try:
        view = memoryview(obj)
    except TypeError:
        pass
    else:
        return np.asarray(view)  # not np.asarray(obj): numpy reads bytes as one string scalar (dtype S<n>)
    if hasattr(obj, "__dlpack__"):
        device_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else 1
        if device_type in _DLPACK_HOST:
            return np.from_dlpack(obj)
        if device_type in _DLPACK_CUDA:
            return _cupy().from_dlpack(obj)
        raise TypeError(f"{operation}: DLPack device type {device_type} is not supported (CPU and CUDA are)")
    if hasattr(obj, "__cuda_array_interface__"):
        return _cupy().asarray(obj)
    raise TypeError(
        f"{operation}: {type(obj).__name__} is not a buffer; pass a numpy/CuPy array or an object exposing "
        "the buffer protocol, __dlpack__ or __cuda_array_interface__"
    )


def as_input(obj: Any, operation: str):
    """Array view of an input buffer (read-only is fine)."""
    return as_array(obj, operation)


def as_output(obj: Any, operation: str):
    """Array view of an output buffer; ValueError if it cannot be written."""
    array = as_array(obj, operation)
    if not getattr(array.flags, "writeable", True):  # CuPy arrays are always writeable
        imported = " (numpy before 2.2.5 imports every DLPack array read-only, later releases those of exporters of " \
            "the unversioned protocol: pass it by the buffer protocol)" \
            if not isinstance(obj, np.ndarray) and hasattr(obj, "__dlpack__") else ""
        raise ValueError(f"{operation}: output buffer is read-only (shape {array.shape}, dtype {array.dtype})"
                         f"{imported}")
    return array


def same_device(operation: str, *arrays) -> None:
    """ValueError when host and device buffers, or buffers on different GPUs, are mixed in one call."""
    for array in arrays:
        if type(array) is not np.ndarray:
            break
    else:
        return  # all on the host (the common case, decided without looking at modules)
    kinds = {("cuda", a.device.id) if is_device_array(a) else ("host", 0) for a in arrays}
    if len(kinds) > 1:
        where = ", ".join(f"{k}:{i}" if k == "cuda" else k for k, i in sorted(kinds))
        raise ValueError(f"{operation}: buffers live on different devices ({where}); pass all on one device")
