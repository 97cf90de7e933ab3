"""Reduction kernels off float32 ``sum``'s path: float16/bfloat16 combined in float32 and rounded once, floats
as integer keys that sort like them (for the MPI library's MIN/MAX), and the wire codecs' passes
(``mpcomm.compression`` calls ``load()`` and the functions of :class:`Kernels` itself).

numpy has no fused form of either: its float16 casts run at ~1 ns per element on x86 without F16C loops, and
each step of a key mapping is a pass over the data. ``kernels.c`` does each in one pass; it is compiled on first
use with the C compiler (``CC``, else Python's, else ``cc``) for this CPU into ``<sys.prefix>/mpcomm-kernels``
(or ``~/.cache/mpcomm`` if that is not writable), named by a hash of its source, flags and CPU, and loaded with
ctypes. Where Python's headers are installed the same library is also imported as an extension module, whose
key passes and avg's finishing passes skip ctypes' per-call cost (most of a small min/max's or avg's extra time).
Without a compiler, or with ``MPCOMM_KERNELS=0``, the numpy forms below run instead: the same results, bit for bit,
slower (a failed build warns once, naming why).

    python -c "from mpcomm import kernels; print(kernels.build())"     # build now (raises, saying why, if it cannot)
"""
from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from typing import Sequence

import numpy as np

from .buffers import AVG, BFLOAT16, MAX, MIN, PROD, SUM, ReduceOp

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
SWITCH = "MPCOMM_KERNELS"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")  # (no fused multiply-add: numpy has none)
_FLOAT16 = np.dtype(np.float16)
_KINDS = {_FLOAT16: 0, BFLOAT16: 1}  # kernels.c: FLOAT16, BFLOAT16
_OPS = {SUM: 0, PROD: 1, MIN: 2, MAX: 3, AVG: 0}  # kernels.c: SUM, PROD, MIN, MAX (avg: a sum, then divided)
KEY_DTYPES = {np.dtype(np.float32): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.int64)}
_FLOAT32 = np.dtype(np.float32)
_UINT16 = np.dtype(np.uint16)
REDUCE16_MOST = 64  # chunks the extension module's reduce16 takes (kernels.c); more go through ctypes
CAST16_FROM = 1024  # elements from which cast16 converts (below it numpy's cast costs less than the call)
_CANONICAL_NAN = {np.dtype(np.int32): 0x7FC00000, np.dtype(np.int64): 0x7FF8000000000000}  # numpy's nan's bits


class _Loaded(enum.Enum):
    """The ``kernels`` argument that means load()'s (None: numpy's forms)."""

    LOADED = "loaded"


LOADED = _Loaded.LOADED


class Kernels:
    """The compiled library's functions, typed for ctypes; ``module``: the same library imported as an extension
    (None where it was built without Python's headers): its ``float_keys``/``from_keys`` are used if present, and
    its ``finish``/``add_finish`` only through it (:func:`finish_floats`, :func:`combine`)."""

    def __init__(self, library: ctypes.CDLL, module=None):
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.library = library  # (kept: the functions live as long as it does)
        self.module = module
        self.reduce16 = library.reduce16
        self.reduce16.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(pointer), ctypes.c_int, size,
                                  ctypes.c_float, pointer]
        self.keys = {np.dtype(np.int32): library.float_keys32, np.dtype(np.int64): library.float_keys64}
        self.unkeys = {np.dtype(np.int32): library.from_keys32, np.dtype(np.int64): library.from_keys64}
        for fn in self.keys.values():
            fn.argtypes = [pointer, size, ctypes.c_int]
        for fn in self.unkeys.values():
            fn.argtypes = [pointer, size]
        self.encode16, self.decode16 = library.encode16, library.decode16
        self.encode16.argtypes = [ctypes.c_int, pointer, pointer, size]
        self.decode16.argtypes = [ctypes.c_int, pointer, pointer, size, ctypes.c_int]
        self.cast16 = library.cast16
        self.cast16.argtypes = [ctypes.c_int, ctypes.c_int, pointer, pointer, size]
        self.cast16.restype = ctypes.c_int
        self.encode_int8, self.decode_int8 = library.encode_int8, library.decode_int8
        self.encode_int8.argtypes = [pointer, size, size, pointer, pointer]
        self.decode_int8.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_int]
        for fn in (self.reduce16, *self.keys.values(), *self.unkeys.values(), self.encode16, self.decode16,
                   self.encode_int8, self.decode_int8):
            fn.restype = None


@functools.cache
def load() -> Kernels | None:
    """The compiled kernels, or None (switched off, or they cannot be built here: warned once)."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        path = build()
        return Kernels(ctypes.CDLL(path), extension(path))
    except Exception as exc:  # noqa: BLE001 (a compiler's or loader's failure has no common type)
        warnings.warn(f"mpcomm: float16/bfloat16 reductions and float min/max keys run through numpy (slower): the "
                      f"C kernels could not be built ({type(exc).__name__}: {str(exc).strip()[:300]}); set "
                      f"{SWITCH}=0 to skip them", RuntimeWarning, stacklevel=2)
        return None


def extension(path: str, name: str = "mpcomm._kernels"):
    """The library at ``path`` imported as the extension module ``name``; None if it was built without Python's
    headers (it then has no ``PyInit_<name's last part>``)."""
    library = ctypes.CDLL(path)
    if not hasattr(library, "PyInit_" + name.rpartition(".")[2]):
        return None
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, loader, origin=path))
    loader.exec_module(module)
    return module


def read_source(path: str) -> str:
    """The C text of ``path`` (a source installed beside this module)."""
    with open(path, encoding="utf-8") as file:
        return file.read()


def build(source: str | None = None, directory: str | None = None, flags: Sequence[str] = (),
          name: str = "kernels") -> str:
    """Compile ``source`` (C text; default ``kernels.c``) unless a build of it is cached (``<name>-<hash>.so``);
    the library's path. ``flags`` come after the source (libraries to link: the linker may drop those before it)."""
    text = read_source(SOURCE) if source is None else source
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    options = [*FLAGS, *_vector_flags(), *_python_flags()]
    key = hashlib.sha256("\0".join([text, *compiler, *options, *flags, platform.machine(), _cpu_flags()]).encode())
    directory = directory or cache_directory()
    path = os.path.join(directory, f"{name}-{key.hexdigest()[:20]}.so")
    if os.path.exists(path):
        return path
    fd, scratch = tempfile.mkstemp(dir=directory, suffix=".c")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    built = scratch[:-2] + ".so"
    try:
        done = subprocess.run([*compiler, *options, "-o", built, scratch, *flags], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(compiler)} failed: {done.stderr.strip()}")
        os.replace(built, path)  # atomic: ranks building at once each rename a complete library
    finally:
        for leftover in (scratch, built):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


def cache_directory() -> str:
    """``<sys.prefix>/mpcomm-kernels`` if it can be written, else ``~/.cache/mpcomm``."""
    for path in (os.path.join(sys.prefix, "mpcomm-kernels"), os.path.join(os.path.expanduser("~"), ".cache", "mpcomm")):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    return tempfile.gettempdir()


def _vector_flags() -> list[str]:
    """Full-width vectors where the CPU has AVX-512 (compilers default to half of it there): the 16-bit
    reductions of three or more chunks ran ~18 % faster (bench/results/dtype_op.md, "Stop 29")."""
    return ["-mprefer-vector-width=512"] if "avx512f" in _cpu_flags().split() else []


def _python_flags() -> list[str]:
    """The flags that also make the library an extension module, where Python's headers are installed."""
    include = sysconfig.get_paths().get("include")
    if include and os.path.exists(os.path.join(include, "Python.h")):
        return ["-DMPCOMM_PYTHON", f"-I{include}"]
    return []


def _cpu_flags() -> str:
    """The CPU's feature flags (a build for one CPU is not loaded on another that shares the directory)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------- the kernels
def address(array) -> int:
    """Where a host array's data starts (through the buffer protocol: a tenth of ``array.ctypes.data``'s cost,
    which shows on small messages; that for read-only or empty arrays, which it refuses). bfloat16, for which the
    buffer protocol has no format, through a view of its bits (a third of ``ctypes.data``'s cost)."""
    if array.dtype is BFLOAT16:
        array = array.view(_UINT16)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):
        return array.ctypes.data


def reduce_chunks(chunks: list, out, op: ReduceOp, kernels: Kernels | _Loaded | None = LOADED) -> None:
    """``out`` <- ``chunks[0] op chunks[1] op ...`` in that order, finished (avg: divided); float16/bfloat16 in
    float32, rounded once. ``out`` may be ``chunks[0]`` (host arrays; any dtype; chunks of ``out``'s size)."""
    if out.size == 0:
        return
    kind = _KINDS.get(out.dtype)
    if kernels is LOADED:
        kernels = load() if kind is not None and type(out) is np.ndarray else None
    if kind is not None and kernels is not None:
        if kernels.module is not None and len(chunks) <= REDUCE16_MOST:
            kernels.module.reduce16(chunks, out, kind, _OPS[op.name], float(op.divisor))
            return
        pointers = (ctypes.c_void_p * len(chunks))(*map(address, chunks))
        kernels.reduce16(kind, _OPS[op.name], pointers, len(chunks), out.size, float(op.divisor), address(out))
        return
    if kind is not None:  # numpy: float32 in between
        wide = chunks[0].astype(np.float32)
        for chunk in chunks[1:]:
            op(wide, chunk.astype(np.float32))
        op.finish(wide)
        out[...] = wide
        return
    if len(chunks) == 1:
        out[...] = chunks[0]
        op.finish(out)
        return
    if out is not chunks[0]:
        out[...] = chunks[0]
    for chunk in chunks[1:-1]:
        combine(out, chunk, out, op)
    combine(out, chunks[-1], out, op, finish=True)


def cast16(src, dst, kernels: Kernels | _Loaded | None = LOADED) -> bool:
    """``dst`` <- ``src`` in ``dst``'s dtype, one float32 and the other float16/bfloat16 (contiguous 1-D host arrays
    of one size, ``dst`` writable), in one pass of the extension, bitwise numpy's (ml_dtypes') cast; False, with
    ``dst`` undefined, where it did not: the extension not loaded, fewer than ``CAST16_FROM`` elements, or a NaN met
    (whose bits numpy sets its own way)."""
    if type(src) is not np.ndarray or type(dst) is not np.ndarray or src.size != dst.size or src.size < CAST16_FROM \
            or not (src.flags.c_contiguous and dst.flags.c_contiguous and dst.flags.writeable):
        return False
    narrowing = src.dtype == _FLOAT32
    wide, short = (src, dst) if narrowing else (dst, src)
    kind = _KINDS.get(short.dtype)
    if kind is None or wide.dtype != _FLOAT32:
        return False
    kernels = load() if kernels is LOADED else kernels
    if kernels is None:
        return False
    if kernels.module is not None:
        try:
            return kernels.module.cast16(src, dst, kind)
        except (BufferError, ValueError):  # (a buffer it cannot take: refused before any element is written)
            return False
    return kernels.cast16(kind, int(narrowing), address(src), address(dst), src.size) == 0


def finish_floats(floats, divisor: int) -> bool | None:
    """In place, in one pass of the extension: ``floats`` (a contiguous float32/float64 host array) divided by
    ``divisor`` as ``ReduceOp.finish`` does it (1: unchanged), and whether it then holds a NaN; None, having done
    nothing, where the extension is not loaded or the array is not one it takes."""
    kernels = load()
    if kernels is None or kernels.module is None or type(floats) is not np.ndarray or floats.dtype not in KEY_DTYPES:
        return None
    try:
        return kernels.module.finish(floats, divisor)
    except (BufferError, ValueError):  # (not contiguous, or read-only: refused before any element is touched)
        return None


def combine(a, b, out, op: ReduceOp, finish: bool = False) -> None:
    """``out`` <- ``a (op) b`` (``finish``: finished, avg divided). float32/float64 sums and averages take one pass
    of the extension: inside an all-reduce numpy's add took 1.4x its time at 256 KiB (bench/results/dtype_op.md,
    "Stop 32"); the rest numpy's op, then ``op.finish``. ``out`` may be ``a``."""
    summed = op.ufunc is np.add and out.dtype in KEY_DTYPES and type(out) is np.ndarray
    kernels = load() if summed else None
    if kernels is not None and kernels.module is not None:
        try:
            kernels.module.add_finish(a, b, out, op.divisor if finish else 1)
            return
        except (BufferError, ValueError):  # (not contiguous: refused before any element is written)
            pass
    op(a, b, out=out)
    if finish:
        op.finish(out)


def to_keys(floats, op: str, kernels: Kernels | _Loaded | None = LOADED):
    """In place: float32/float64 ``floats`` become integers that sort as they do, NaN the extreme ``op`` (min or
    max) picks; returns the integer view."""
    bits = floats.view(KEY_DTYPES[floats.dtype])
    kernels = load() if kernels is LOADED else kernels
    if kernels is not None:
        if kernels.module is not None:
            kernels.module.float_keys(bits, _OPS[op])
        else:
            kernels.keys[bits.dtype](address(bits), bits.size, _OPS[op])
        return bits
    magnitude = np.iinfo(bits.dtype).max  # every bit but the sign
    nans = np.isnan(floats)
    bits ^= (bits >> (8 * bits.itemsize - 1)) & magnitude  # negative floats count down (its own inverse)
    np.copyto(bits, magnitude if op == MAX else np.iinfo(bits.dtype).min, where=nans)
    return bits


def from_keys(bits, kernels: Kernels | _Loaded | None = LOADED) -> None:
    """In place: undo :func:`to_keys`; every NaN becomes numpy's ``nan`` (the same bits on every rank)."""
    kernels = load() if kernels is LOADED else kernels
    if kernels is not None:
        if kernels.module is not None:
            kernels.module.from_keys(bits)
        else:
            kernels.unkeys[bits.dtype](address(bits), bits.size)
        return
    bits ^= (bits >> (8 * bits.itemsize - 1)) & np.iinfo(bits.dtype).max
    floats = bits.view({4: np.float32, 8: np.float64}[bits.itemsize])
    np.copyto(bits, _CANONICAL_NAN[bits.dtype], where=np.isnan(floats))

