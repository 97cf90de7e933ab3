"""The class the mpcomm Backend derives from: ``BackendBase``, compiled from ``backend_base.cpp`` against the
installed torch, on every supported torch.

torch binds a backend to a device only if it is a ``c10d::Backend`` (a Python ``ProcessGroup`` subclass never was):
torch 2.13 gives Python no Backend to subclass, and 2.14's (``torch._C._distributed_c10d.Backend(rank, size)``)
loses the source rank of a receive from any source and recurses on ``supports_coalescing``; the reasons are in
``backend_base.cpp``. Its Python method names are torch 2.14's, so the mpcomm class reads the same either way."""
from __future__ import annotations


def backend_base() -> type:
    """The c10d Backend class to subclass (built on first use; RuntimeError naming why if it cannot be)."""
    from .extension import backend_base_module

    return backend_base_module().BackendBase


def keep_alive(backend) -> None:
    """Have the C++ object keep ``backend``'s Python object alive until ``shutdown`` (torch holds only C++)."""
    backend._keep_alive()
