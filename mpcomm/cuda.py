"""Is the MPI library CUDA-aware?  mpi4py has no such query, so mpcomm asks the library itself.

A non-CUDA-aware MPI must never be handed a device pointer (it dereferences it on the host and the process
dies), so anything short of a positive answer from the library means "not aware" and device buffers are
staged through pinned host memory (``mpcomm.staging``).

Sources, strongest first (the decision is the pure function :func:`decide_cuda_aware`):

1. ``MPCOMM_CUDA_AWARE=1/0`` in the environment overrides everything.
2. ``MPIX_Query_cuda_support()``: the library's own run-time answer (Open MPI with its cuda extension,
   MPICH >= 4). Looked up with ctypes in the libmpi that mpi4py loaded.
3. Open MPI's read-only MPI_T control variable ``mpi_built_with_cuda_support`` (what ``ompi_info`` prints).
4. MPICH's MPI_T control variable ``MPIR_CVAR_ENABLE_GPU`` (or the same name in the environment). It can
   only say "no": a value of 1 is MPICH's default even in builds without CUDA, so on its own it does not
   prove awareness (every MPICH that has the cvar also has ``MPIX_Query_cuda_support``, which decides).
5. Nothing known: not aware.

:func:`cuda_aware` runs the detection once per process and caches the answer in this module: it is a
read-only fact about the loaded library, the same for every communicator, and the look-up initialises MPI_T.
``cuda_aware(refresh=True)`` detects again (after changing the environment variable, say).
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
from dataclasses import dataclass

ENV = "MPCOMM_CUDA_AWARE"
OMPI_CVAR = "mpi_built_with_cuda_support"
MPICH_CVAR = "MPIR_CVAR_ENABLE_GPU"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_flag(value: str | None, name: str = ENV) -> bool | None:
    """``None`` for unset/empty; True/False for the usual spellings; ValueError otherwise (a typo must be loud)."""
    if value is None or not str(value).strip():
        return None
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    try:
        return int(text) != 0
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected one of 0/1, true/false, yes/no, on/off") from None


def vendor(library_version: str | None) -> str:
    """``"openmpi"``, ``"mpich"`` (MPICH and its derivatives: Intel MPI, MVAPICH, Cray MPICH) or ``"unknown"``."""
    text = (library_version or "").lower()
    if "open mpi" in text or "openmpi" in text:
        return "openmpi"
    if re.search(r"mpich|intel\(r\) mpi|mvapich|cray", text):
        return "mpich"
    return "unknown"


def decide_cuda_aware(
    env_value: str | None,
    mpix_query: int | None,
    library_version: str | None,
    ompi_info_value: int | bool | None,
    mpich_cvar: int | bool | str | None,
) -> tuple[bool, str]:
    """Decide CUDA-awareness from what the library reported; returns ``(aware, reason)``.

    ``env_value``: the ``MPCOMM_CUDA_AWARE`` string or None; ``mpix_query``: the int returned by
    ``MPIX_Query_cuda_support()`` or None when the library has no such function; ``library_version``:
    ``MPI.Get_library_version()``; ``ompi_info_value``: Open MPI's ``mpi_built_with_cuda_support`` or None;
    ``mpich_cvar``: MPICH's ``MPIR_CVAR_ENABLE_GPU`` (int, bool or the environment's string) or None.
    """
    forced = parse_flag(env_value)
    if forced is not None:
        return forced, f"{ENV}={(env_value or '').strip()} overrides detection"
    lib = vendor(library_version)
    name = (library_version or "unknown MPI").strip().splitlines()[0].strip() if library_version else "unknown MPI"
    if mpix_query is not None:
        aware = int(mpix_query) != 0
        return aware, f"MPIX_Query_cuda_support() returned {int(mpix_query)} ({name})"
    if lib == "openmpi" and ompi_info_value is not None:
        aware = bool(int(ompi_info_value))
        return aware, f"Open MPI control variable {OMPI_CVAR}={int(aware)} ({name})"
    if lib == "mpich" and mpich_cvar is not None:
        enabled = parse_flag(str(mpich_cvar), MPICH_CVAR) if isinstance(mpich_cvar, str) else bool(int(mpich_cvar))
        if enabled is False:
            return False, f"{MPICH_CVAR}=0 disables GPU support ({name})"
        if enabled:
            return False, (
                f"{MPICH_CVAR}=1 but the library offers no MPIX_Query_cuda_support() to confirm a CUDA build, "
                f"so not assumed ({name}); set {ENV}=1 if it is CUDA-aware"
            )
    return False, f"no CUDA-awareness query answered ({name}); assuming not CUDA-aware (set {ENV}=1 to override)"


# ---------------------------------------------------------------------------------------------- the library


@dataclass(frozen=True)
class Detection:
    """What was read from the process and the library, and the decision taken on it."""

    aware: bool
    reason: str
    env_value: str | None
    mpix_query: int | None
    library_version: str
    ompi_info_value: int | None
    mpich_cvar: int | str | None
    libraries: tuple[str, ...]


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI extension module mpi4py loaded and the libmpi* it pulled in (from /proc/self/maps)."""
    paths: list[str] = []
    try:
        from mpi4py import MPI

        paths.append(MPI.__file__)
    except Exception:  # pragma: no cover - mpi4py is a dependency
        pass
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                base = os.path.basename(path)
                if path.startswith("/") and re.match(r"lib(p?mpi|mpich|mpi_abi)[^/]*\.so", base) and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux: the extension module's own symbol lookup still finds its dependencies
        pass
    return paths


def _handles(paths: list[str]) -> list[ctypes.CDLL]:
    handles = []
    for path in paths:
        try:
            handles.append(ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL))
        except OSError:
            continue
    try:
        handles.append(ctypes.CDLL(None))
    except OSError:  # pragma: no cover
        pass
    return handles


def _symbol(handles, name: str):
    for handle in handles:
        try:
            return getattr(handle, name)
        except AttributeError:
            continue
    return None


def _mpix_query(handles) -> int | None:
    function = _symbol(handles, "MPIX_Query_cuda_support")
    if function is None:
        return None
    function.restype, function.argtypes = ctypes.c_int, []
    try:
        return int(function())
    except Exception:  # pragma: no cover - a library whose query cannot be called
        return None


def _read_cvar(handles, name: str) -> int | None:
    """The integer value of MPI_T control variable ``name``, or None (no MPI_T, unknown name, any failure)."""
    needed = ("MPI_T_init_thread", "MPI_T_cvar_get_index", "MPI_T_cvar_handle_alloc", "MPI_T_cvar_read",
              "MPI_T_cvar_handle_free", "MPI_T_finalize")
    f = {n: _symbol(handles, n) for n in needed}
    if any(v is None for v in f.values()):
        return None
    try:
        from mpi4py import MPI

        # The level MPI already provides: Open MPI's MPI_T_init_thread overwrites the process's thread level with
        # the one asked for, so asking for SINGLE left MPI_Query_thread saying SINGLE (no progress thread after).
        level = int(MPI.Query_thread()) if MPI.Is_initialized() else int(MPI.THREAD_SINGLE)
    except Exception:  # pragma: no cover
        level = 0
    provided = ctypes.c_int(0)
    if f["MPI_T_init_thread"](ctypes.c_int(level), ctypes.byref(provided)) != 0:
        return None
    try:
        index = ctypes.c_int(-1)
        if f["MPI_T_cvar_get_index"](ctypes.c_char_p(name.encode()), ctypes.byref(index)) != 0:
            return None
        handle = ctypes.c_void_p(0)  # MPI_T_cvar_handle is a pointer in MPICH and Open MPI
        count = ctypes.c_int(0)
        if f["MPI_T_cvar_handle_alloc"](index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
            return None
        try:
            if count.value != 1:
                return None
            value = (ctypes.c_char * 64)()  # room for any scalar type; both variables are int/bool
            if f["MPI_T_cvar_read"](handle, value) != 0:
                return None
            return int(ctypes.c_int.from_buffer(value).value)
        finally:
            f["MPI_T_cvar_handle_free"](ctypes.byref(handle))
    finally:
        f["MPI_T_finalize"]()


def detect() -> Detection:
    """Read every source from this process and its MPI library, and decide (no caching)."""
    env_value = os.environ.get(ENV)
    try:
        from mpi4py import MPI

        library_version = MPI.Get_library_version()
    except Exception:  # pragma: no cover
        library_version = ""
    paths = _loaded_mpi_libraries()
    handles = _handles(paths)
    lib = vendor(library_version)
    mpix = ompi = None
    mpich: int | str | None = None
    try:
        mpix = _mpix_query(handles)
        if lib == "openmpi":
            ompi = _read_cvar(handles, OMPI_CVAR)
        if lib == "mpich":
            mpich = _read_cvar(handles, MPICH_CVAR)
    except Exception:  # pragma: no cover - a library that misbehaves under ctypes: treat as unknown
        pass
    if mpich is None and lib == "mpich" and os.environ.get(MPICH_CVAR, "").strip():
        mpich = os.environ[MPICH_CVAR]
    aware, reason = decide_cuda_aware(env_value, mpix, library_version, ompi, mpich)
    return Detection(aware, reason, env_value, mpix, library_version, ompi, mpich, tuple(paths))


_lock = threading.Lock()
_cached: Detection | None = None


def detection(refresh: bool = False) -> Detection:
    """The cached :class:`Detection` of this process (detected on first use, or again with ``refresh``)."""
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = detect()
        return _cached


def cuda_aware(explain: bool = False, refresh: bool = False):
    """True if device pointers may be handed to MPI; ``explain=True`` returns ``(aware, reason)``."""
    found = detection(refresh)
    return (found.aware, found.reason) if explain else found.aware
