"""The torch backend's C++ parts, built on first use by torch's own extension builder.

* ``native_allreduce.cpp`` (:func:`load`): the synchronous all-reduce of a small tensor straight into the MPI
  library, compiled against the MPI library mpi4py has loaded (its ``mpi.h`` beside it, as the MPICH wheel installs
  them). Without a C++ compiler, ``mpi.h`` or a matching library, or with ``MPCOMM_TORCH_NATIVE=0``, ``load()``
  returns None and the backend runs every call through mpcomm's Python (correct, slower for small all-reduces); a
  failed build warns once, naming why.
* ``backend_base.cpp`` (:func:`backend_base_module`): the c10d Backend that the backend's Python class derives
  from (see ``base.py``). The backend cannot work without it, so a failed build raises, naming why.

Each is built into ``<sys.prefix>/mpcomm-torch-extension/<name>`` (the environment's own: another environment's
build, or a build killed there, cannot get in the way), or where torch caches extensions (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) if that is not writable; ~30 s the first time, the ranks of a job waiting on
torch's lock for one build (on torch 2.13 a lock file left by a build that was killed is removed once it is 10
minutes old: torch would wait on it forever; 2.14's lock is released by the kernel).

    python -m mpcomm.integrations.torch.extension    # build now (exit 1, with the reason, if it cannot)
"""
from __future__ import annotations

import functools
import os
import sys
import time
import warnings

from ...mpi_library import check_built_for, include_directory, link_flags, loaded_path

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "native_allreduce.cpp")
NAME = "mpcomm_native_allreduce"
BASE_SOURCE = os.path.join(HERE, "backend_base.cpp")
BASE_NAME = "mpcomm_backend_base"
SWITCH = "MPCOMM_TORCH_NATIVE"
STALE_LOCK_SECONDS = 600  # a build lock older than this was left by a build that died


@functools.cache
def load():
    """The built extension module, or None (switched off, or it cannot be built here: warned once)."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 (a compiler's or linker's failure has no common type)
        warnings.warn(f"mpcomm torch backend: small synchronous all-reduces run through Python: the C++ extension "
                      f"could not be built ({type(exc).__name__}: {_first_line(exc)}); set {SWITCH}=0 to skip it",
                      RuntimeWarning, stacklevel=2)
        return None


def build():
    """Compile (or take torch's cached build of) the all-reduce extension; raises with the reason when it cannot."""
    library = loaded_path()
    module = _compile(NAME, SOURCE, extra_include_paths=[include_directory(library)],
                      extra_ldflags=link_flags(library))
    check_built_for(module.library_version())
    return module


@functools.cache
def backend_base_module():
    """The built ``backend_base.cpp`` module (its ``BackendBase``); raises RuntimeError naming why it cannot be
    built."""
    try:
        return _compile(BASE_NAME, BASE_SOURCE)
    except Exception as exc:  # noqa: BLE001 (a compiler's or linker's failure has no common type)
        import torch

        raise RuntimeError(f"mpcomm torch backend: {BASE_SOURCE}, the c10d Backend it derives from, could not be "
                           f"built against torch {torch.__version__} ({type(exc).__name__}: {_first_line(exc)}); "
                           "it needs a C++ compiler") from exc


def _compile(name: str, source: str, **options):
    from torch.utils.cpp_extension import load as load_extension

    target = build_directory(name)
    _clear_stale_lock(target)
    return load_extension(name, [source], extra_cflags=["-O2"], build_directory=target, **options)


def build_directory(name: str) -> str | None:
    """``<sys.prefix>/mpcomm-torch-extension/<name>`` (made if need be), or None (torch's default) if it cannot be
    written."""
    path = os.path.join(sys.prefix, "mpcomm-torch-extension", name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def lock_file_blocks() -> bool:
    """Whether torch's extension builder waits while its lock file exists (``FileBaton``, torch 2.13); torch 2.14
    holds an OS lock on the file instead (the kernel drops it when the holder dies), and leaves the file."""
    import torch.utils.cpp_extension as cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def _clear_stale_lock(directory: str | None, older_than: float = STALE_LOCK_SECONDS) -> None:
    """Remove torch's build lock if a build that took it died (a build takes ~30 s; torch would wait forever).
    Only where the file's existence is the lock: removing a file another process holds an OS lock on would let a
    second build start beside it."""
    if directory is None or not lock_file_blocks():
        return
    lock = os.path.join(directory, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:  # no lock: nobody is building
        return
    if age > older_than:
        warnings.warn(f"mpcomm torch backend: removing {lock}, left {age:.0f} s ago by a build that did not finish",
                      RuntimeWarning, stacklevel=3)
        try:
            os.remove(lock)
        except FileNotFoundError:  # another rank removed it first
            pass


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def main() -> int:
    """Build both extensions now (what ``python -m mpcomm.integrations.torch.extension`` runs): 0, or 1 naming
    why one cannot be built."""
    try:
        print(f"mpcomm torch backend base: {backend_base_module().__file__}")
        print(f"mpcomm torch extension: {build().__file__}")
    except Exception as exc:  # noqa: BLE001
        print(f"mpcomm torch extension: cannot build: {type(exc).__name__}: {_first_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
