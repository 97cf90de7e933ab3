"""Wire codecs: how a float32 vector travels in fewer bytes (``comm.allreduce(..., wire=NAME)``, error feedback).

``codec(name)`` for name in ``WIRES`` returns a :class:`Codec`. A payload is a 1-D ``uint8`` array of
``wire_nbytes(n)`` bytes, so any transport sends it as it is. Every codec maps element ``i`` from block
``i // block`` alone, so encoding a vector whole or in block-aligned pieces gives the same bytes: that is what
lets an all-reduce cut the vector at block edges and still equal ``roundtrip`` of the whole.

* ``bf16``: round to nearest even (ml_dtypes); NaN stays NaN, ±inf stays ±inf, finite values past bfloat16's
  range (~3.39e38) become ±inf. Relative error ≤ 2^-8 (8 significant bits).
* ``fp16``: round to nearest even (numpy); NaN and ±inf kept; |x| ≥ 65520 becomes ±inf, |x| < 2^-24 rounds to
  0 (subnormals below 2^-14 lose relative precision). Relative error ≤ 2^-11 in the normal range (11 bits).
* ``int8``: blocks of ``INT8_BLOCK`` elements; each block sends ``scale = absmax / 127`` (float32) and
  ``q = rint(x * (127 / absmax))`` as int8, decoded as ``q * scale``: absolute error ≤ absmax / 254 (plus
  float32 rounding). A block holding any NaN or ±inf is sent with a NaN scale and decodes to NaN throughout, so a
  non-finite gradient is never silently lost (it shows as NaN in the sum).
"""
from __future__ import annotations

from typing import Protocol

import ml_dtypes
import numpy as np

from .kernels import LOADED, Kernels, _Loaded, address, load

WIRES = ("bf16", "fp16", "int8")
INT8_BLOCK = 256  # elements per int8 scale: 1.6 % of the int8 bytes, and a block's absmax tracks local magnitude
_FLOAT32 = np.dtype(np.float32)


class Codec(Protocol):
    """What every wire codec offers (see the module docstring for each one's rounding and non-finite rules)."""

    name: str
    block: int  # elements that share encoding state; cut vectors only at multiples of it

    def wire_nbytes(self, n: int) -> int: ...

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...

    def decode(self, payload: np.ndarray, out: np.ndarray) -> np.ndarray: ...

    def accumulate(self, payload: np.ndarray, acc: np.ndarray) -> np.ndarray: ...

    def roundtrip(self, x: np.ndarray) -> np.ndarray: ...

    def using(self, kernels: Kernels | None) -> "Codec": ...


def codec(name: str) -> Codec:
    """The codec called ``name`` (one of ``WIRES``); ValueError naming the choices otherwise."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown wire {name!r}; choose one of {list(WIRES)} (or None for float32)") from None


class _Base:
    """Argument checks and the operations every codec derives from its passes. ``kernels``: the compiled passes
    (``mpcomm.kernels``; the default loads them) or None for the numpy forms, which give the same bytes."""

    name: str
    block: int

    def __init__(self, kernels: Kernels | _Loaded | None = LOADED):
        self._kernels = kernels

    @property
    def kernels(self) -> Kernels | None:
        if self._kernels is LOADED:
            self._kernels = load()
        return self._kernels

    def using(self, kernels: Kernels | None) -> "Codec":
        """This codec with the compiled passes ``kernels`` (None: the numpy forms)."""
        return type(self)(kernels)

    def wire_nbytes(self, n: int) -> int:
        raise NotImplementedError

    def _encode(self, x: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def _decode(self, payload: np.ndarray, out: np.ndarray, accumulate: bool) -> None:
        raise NotImplementedError

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x`` (contiguous 1-D float32) as a payload; written into ``out`` (uint8, ``wire_nbytes(x.size)``) if
        given. Returns the payload."""
        _check_float32(f"{self.name}.encode", x, "x")
        want = self.wire_nbytes(x.size)
        if out is None:
            out = np.empty(want, np.uint8)
        else:
            _check_payload(f"{self.name}.encode", out, want, x.size)
        if x.size:
            self._encode(x, out)
        return out

    def decode(self, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` (contiguous 1-D float32) <- the values ``payload`` stands for; returns ``out``."""
        return self._decoded(payload, out, False)

    def accumulate(self, payload: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """``acc`` += the values ``payload`` stands for, in float32 (one rounding per element, as ``decode``
        then ``+`` gives); returns ``acc``."""
        return self._decoded(payload, acc, True)

    def _decoded(self, payload, out, accumulate: bool):
        what = f"{self.name}.{'accumulate' if accumulate else 'decode'}"
        _check_float32(what, out, "acc" if accumulate else "out")
        _check_payload(what, payload, self.wire_nbytes(out.size), out.size)
        if out.size:
            self._decode(payload, out, accumulate)
        return out

    def roundtrip(self, x: np.ndarray) -> np.ndarray:
        """``decode(encode(x))``: what ``x`` becomes on the wire (error feedback keeps ``x - roundtrip(x)``)."""
        return self.decode(self.encode(x), np.empty(x.size, _FLOAT32))

    def __repr__(self) -> str:
        return f"codec({self.name!r})"


class _Cast(_Base):
    """A 16-bit float wire: each element cast (round to nearest even) and cast back."""

    block = 1
    dtype: np.dtype
    kind: int  # kernels.c's FLOAT16 / BFLOAT16

    def wire_nbytes(self, n: int) -> int:
        return 2 * n

    def _encode(self, x, out) -> None:
        k = self.kernels
        if k is not None:
            k.encode16(self.kind, address(x), address(out), x.size)
            return
        with np.errstate(over="ignore"):  # (past the range is ±inf, as documented)
            out.view(self.dtype)[...] = x

    def _decode(self, payload, out, accumulate: bool) -> None:
        k = self.kernels
        if k is not None:
            k.decode16(self.kind, address(payload), address(out), out.size, int(accumulate))
        elif accumulate:
            np.add(out, payload.view(self.dtype).astype(_FLOAT32), out=out)
        else:
            out[...] = payload.view(self.dtype)


class _BFloat16(_Cast):
    name, dtype, kind = "bf16", np.dtype(ml_dtypes.bfloat16), 1


class _Float16(_Cast):
    name, dtype, kind = "fp16", np.dtype(np.float16), 0


class _Int8(_Base):
    """Per-block absmax int8: ``[scales: float32 x blocks][q: int8 x n]`` (scales first, so they are aligned)."""

    name, block = "int8", INT8_BLOCK

    def blocks(self, n: int) -> int:
        return -(-n // self.block)

    def wire_nbytes(self, n: int) -> int:
        return 4 * self.blocks(n) + n

    def _split(self, payload, n):
        nblocks = self.blocks(n)
        return payload[: 4 * nblocks].view(_FLOAT32), payload[4 * nblocks :].view(np.int8)

    def _encode(self, x, out) -> None:
        scales, q = self._split(out, x.size)
        k = self.kernels
        if k is not None:
            k.encode_int8(address(x), x.size, self.block, address(scales), address(q))
            return
        full = x.size // self.block * self.block
        blocks = [x[:full].reshape(-1, self.block)] + ([x[full:].reshape(1, -1)] if full < x.size else [])
        absmax = np.concatenate([np.abs(b).max(axis=1) for b in blocks])
        finite = np.isfinite(absmax)
        np.divide(absmax, np.float32(127), out=scales)
        scales[~finite] = np.nan
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(absmax > 0, np.float32(127) / absmax, np.float32(0)).astype(_FLOAT32)
        inverse[~finite] = 0  # (their scale is NaN: q is never read)
        with np.errstate(invalid="ignore"):  # (inf * 0 in a non-finite block: NaN, zeroed below)
            scaled = x * np.repeat(inverse, self.block)[: x.size]
        np.rint(scaled, out=scaled)
        np.clip(scaled, -127, 127, out=scaled)
        if not finite.all():  # (their q is never read; 0 keeps the bytes defined)
            scaled[~np.repeat(finite, self.block)[: x.size]] = 0
        q[...] = scaled

    def _decode(self, payload, out, accumulate: bool) -> None:
        scales, q = self._split(payload, out.size)
        k = self.kernels
        if k is not None:
            k.decode_int8(address(scales), address(q), out.size, self.block, address(out), int(accumulate))
            return
        values = np.multiply(q, np.repeat(scales, self.block)[: out.size], dtype=_FLOAT32)
        if accumulate:
            np.add(out, values, out=out)
        else:
            out[...] = values


_CODECS: dict[str, Codec] = {"bf16": _BFloat16(), "fp16": _Float16(), "int8": _Int8()}


def _check_float32(operation: str, array, name: str) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != _FLOAT32 or array.ndim != 1 \
            or not array.flags.c_contiguous:
        described = f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
        raise TypeError(f"{operation}: {name} must be a contiguous 1-D float32 numpy array, got {described}")


def _check_payload(operation: str, payload, want: int, n: int) -> None:
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1 \
            or not payload.flags.c_contiguous or payload.size != want:
        described = f"{payload.dtype} {payload.shape}" if isinstance(payload, np.ndarray) else type(payload).__name__
        raise ValueError(f"{operation}: the payload of {n} elements must be a contiguous 1-D uint8 array of "
                         f"{want} bytes, got {described}")
