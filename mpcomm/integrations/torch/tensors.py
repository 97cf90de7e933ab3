"""CPU torch tensors as numpy arrays for mpcomm, torch's reduce ops as mpcomm's, mpcomm's errors as torch's.

Also the checks and unpacking the group's calls share (:func:`same_dtype`, :func:`same_layout`, :func:`unpack`).
Tensors reach mpcomm zero-copy through ``Tensor.numpy()`` (bfloat16 through an int16 view as
``ml_dtypes.bfloat16``). Data movement (broadcast, gathers, all-to-all, send/recv) takes any dtype: one numpy
cannot hold (float8, ...) moves as its bytes. Reductions follow gloo: bool SUM/MAX/BOR are "or", PRODUCT/MIN/BAND
"and", BXOR "xor"; BAND/BOR/BXOR need an integral or bool tensor; AVG a floating one.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ...buffers import BFLOAT16
from ...errors import CommTimeoutError, MpcommError

_RED = dist.ReduceOp.RedOpType
_ARITHMETIC = {_RED.SUM: "sum", _RED.PRODUCT: "prod", _RED.MIN: "min", _RED.MAX: "max", _RED.AVG: "avg"}
_BITWISE = {_RED.BAND: np.bitwise_and, _RED.BOR: np.bitwise_or, _RED.BXOR: np.bitwise_xor}
# bool reduces as "and"/"or" (mpcomm's min/max of bool), as gloo does; xor has no such twin (see Reduction).
_BOOL = {_RED.SUM: "max", _RED.MAX: "max", _RED.BOR: "max", _RED.PRODUCT: "min", _RED.MIN: "min",
         _RED.BAND: "min"}
_NAMES = {value: name for name, value in _RED.__members__.items()}
_BYTES_ONLY = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def as_numpy(tensor: torch.Tensor, what: str = "tensor") -> np.ndarray:
    """A numpy array sharing memory with the CPU ``tensor`` (bfloat16 as ``ml_dtypes.bfloat16``)."""
    if type(tensor) is torch.Tensor and tensor.dtype is not torch.bfloat16:
        try:  # the common case: Tensor.numpy() itself refuses what needs a look below
            return tensor.numpy()
        except (TypeError, RuntimeError):
            pass
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"mpcomm backend: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:
        raise ValueError(f"mpcomm backend: {what} is on {tensor.device}; this backend handles CPU tensors "
                         "(move it with .cpu(), or pass CuPy arrays to mpcomm.Communicator directly)")
    if tensor.layout is not torch.strided:
        raise NotImplementedError(f"mpcomm backend: {what} is a {tensor.layout} tensor; only dense (strided) tensors "
                                  "are supported (e.g. sparse all_reduce is not)")
    if tensor.requires_grad:
        tensor = tensor.detach()
    dtype = tensor.dtype
    if dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    if dtype in _BYTES_ONLY:
        return tensor.view(torch.uint8).numpy()
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"mpcomm backend: {what} has its conjugate/negative bit set; call .resolve_conj() / "
                         ".resolve_neg() first")
    return tensor.numpy()


def as_reducible(tensor: torch.Tensor, what: str) -> np.ndarray:
    """``as_numpy`` for a reduction: refuses the dtypes that move only as bytes."""
    if type(tensor) is torch.Tensor:
        dtype = tensor.dtype
        if dtype in _BYTES_ONLY:
            raise TypeError(f"mpcomm backend: {what} is {dtype}, which cannot be reduced (it can be moved: "
                            "broadcast, gathers, all-to-all, send/recv)")
        if dtype is not torch.bfloat16:
            try:  # the common case, as in as_numpy
                return tensor.numpy()
            except (TypeError, RuntimeError):
                pass
    return as_numpy(tensor, what)


# ---------------------------------------------------------------------------------------------- reductions
class Reduction:
    """A torch reduce op for one dtype: mpcomm's op name, or (``local`` set) a numpy ufunc to apply to data
    gathered from every rank, for what mpcomm's collectives do not reduce themselves (bitwise ops)."""

    __slots__ = ("name", "local", "torch_name")

    def __init__(self, name: str | None, local, torch_name: str):
        self.name, self.local, self.torch_name = name, local, torch_name

    def over(self, stacked: np.ndarray) -> np.ndarray:
        """The reduction of ``stacked[r]`` over r (rank order, as gloo)."""
        return self.local.reduce(stacked, axis=0)


_CACHE: dict = {}  # (op number, dtype) -> Reduction: what every call needs, decided once per pair
_DIRECT: dict = {}  # the same, for the reductions mpcomm's collectives run themselves (no local step)
direct_reduction = _DIRECT.get  # (op number, dtype) -> Reduction, or None when not (yet) known to be direct


def reduction(op, dtype: torch.dtype, operation: str) -> Reduction:
    """The Reduction for torch ``op`` (a ReduceOp or its RedOpType) on ``dtype``; a clear error for the pairs gloo
    refuses too, NotImplementedError for PREMUL_SUM."""
    found = _CACHE.get((hash(op), dtype))  # both hash to the op's number (reading op.op costs more)
    if found is not None:
        return found
    kind = op.op if type(op) is dist.ReduceOp else op
    key = (kind.value, dtype)
    name = _NAMES.get(kind, str(kind))
    if kind == _RED.PREMUL_SUM:
        raise NotImplementedError(f"mpcomm backend: {operation} with ReduceOp.PREMUL_SUM is not supported "
                                  "(gloo refuses it too); scale the tensor and use SUM")
    if dtype in _BYTES_ONLY:
        raise TypeError(f"mpcomm backend: {operation}: {dtype} tensors cannot be reduced")
    if dtype is torch.bool:
        if kind == _RED.AVG:
            raise TypeError(f"mpcomm backend: {operation}: ReduceOp.AVG needs a floating tensor, got torch.bool")
        found = Reduction(_BOOL.get(kind), np.bitwise_xor if kind == _RED.BXOR else None, name)
    elif kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise TypeError(f"mpcomm backend: {operation}: ReduceOp.{name} needs an integral or bool tensor, got "
                            f"{dtype}")
        found = Reduction(None, _BITWISE[kind], name)
    elif kind in _ARITHMETIC:
        found = Reduction(_ARITHMETIC[kind], None, name)
    else:
        raise NotImplementedError(f"mpcomm backend: {operation} with reduce op {name} is not supported")
    _CACHE[key] = found
    if found.local is None:
        _DIRECT[key] = found
    return found


def reduce_op_name(op) -> str:
    """mpcomm's name for an arithmetic torch ReduceOp (ValueError for the others)."""
    kind = getattr(op, "op", op)
    if kind not in _ARITHMETIC:
        raise ValueError(f"mpcomm backend: reduce op {_NAMES.get(kind, kind)} is not an arithmetic op "
                         "(SUM, PRODUCT, MIN, MAX, AVG)")
    return _ARITHMETIC[kind]


# ---------------------------------------------------------------------------------------------- errors
def torch_error(exc: BaseException, operation: str) -> BaseException:
    """What torch code expects for a failure inside the backend: mpcomm's communication errors become
    ``torch.distributed.DistBackendError`` (a RuntimeError) chained to the original; argument errors stay."""
    if isinstance(exc, CommTimeoutError):
        error = dist.DistBackendError(f"mpcomm backend: {operation} failed on a timeout ({exc})")
    elif isinstance(exc, MpcommError):
        error = dist.DistBackendError(f"mpcomm backend: {operation} failed ({type(exc).__name__}: {exc})")
    else:
        return exc
    error.__cause__ = exc
    return error


def same_dtype(operation: str, tensors) -> None:
    """TypeError naming ``operation`` unless ``tensors`` all have one dtype."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"mpcomm backend: {operation}: tensors of different dtypes {sorted(map(str, dtypes))}; "
                        "they must all have the same dtype")


def same_layout(operation: str, tensors) -> None:
    """:func:`same_dtype`, and ValueError unless ``tensors`` all have one number of elements."""
    same_dtype(operation, tensors)
    sizes = {t.numel() for t in tensors}
    if len(sizes) > 1:
        raise ValueError(f"mpcomm backend: {operation}: tensors of different sizes {sorted(sizes)}; they must match")


def unpack(flat: np.ndarray, arrays: list[np.ndarray]) -> None:
    """Consecutive pieces of ``flat`` into ``arrays`` (each keeps its shape)."""
    offset = 0
    for a in arrays:
        a[...] = flat[offset: offset + a.size].reshape(a.shape)
        offset += a.size
