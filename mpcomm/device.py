"""Device (CuPy) buffers handed to a CUDA-aware MPI as they are.

:class:`DeviceTransport` wraps a :class:`~mpcomm.transport.Transport` with the same surface, so every algorithm
runs unchanged on device buffers; :class:`DirectTransport` (``mpcomm.cuda_aware()`` is True) passes device
pointers to MPI after synchronizing the caller's current CUDA stream (MPI knows nothing of streams). When MPI is
not CUDA-aware, ``mpcomm.staging`` stages through pinned host memory instead and chooses between the two.
"""
from __future__ import annotations

from .buffers import is_device_array


def cupy_module():
    import cupy

    return cupy


class DeviceTransport:
    """Delegates the Transport surface to ``inner``; subclasses change how device buffers reach MPI."""

    def __init__(self, inner):
        self.inner = inner
        self._subs: dict[str, DeviceTransport] = {}

    # attributes of the wrapped transport
    mpi = property(lambda self: self.inner.mpi)
    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    others = property(lambda self: self.inner.others)
    timeout = property(lambda self: self.inner.timeout)
    nodes_are_uniform = property(lambda self: self.inner.nodes_are_uniform)
    spans_nodes = property(lambda self: self.inner.spans_nodes)

    @property
    def operation(self) -> str:
        return self.inner.operation

    @operation.setter
    def operation(self, value: str) -> None:
        self.inner.operation = value

    @property
    def progress_hook(self):
        return self.inner.progress_hook

    @progress_hook.setter
    def progress_hook(self, hook) -> None:
        self.inner.progress_hook = hook

    def running(self, operation: str):
        return self.inner.running(operation)

    def phase(self, name: str):
        return self.inner.phase(name)

    def scratch(self, slot: str, count: int, dtype, like=None):
        return self.inner.scratch(slot, count, dtype, like=like)

    @property
    def node(self):
        return self._sub("node")

    @property
    def cross(self):
        return self._sub("cross")

    def _sub(self, which: str):
        if which not in self._subs:
            self._subs[which] = type(self)(getattr(self.inner, which))
        return self._subs[which]

    def free(self) -> None:
        """Nothing to release: the wrapped transport owns the communicator."""

    def synchronize_caller(self) -> None:
        """Wait until the caller's current stream has finished (its kernels wrote the data MPI will read)."""
        cupy_module().cuda.get_current_stream().synchronize()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class DirectTransport(DeviceTransport):
    """CUDA-aware MPI: device buffers are passed to MPI directly, after the current stream is synchronized."""

    def isend(self, buf, dst: int, tag: int = 0):
        if is_device_array(buf):
            self.synchronize_caller()
        return self.inner.isend(buf, dst, tag)

    def irecv(self, buf, src: int, tag: int = 0):
        if is_device_array(buf):
            self.synchronize_caller()  # earlier kernels may still read the buffer MPI is about to write
        return self.inner.irecv(buf, src, tag)

    def wait(self, requests, peers, expected=(), timeout=None, **names) -> None:
        self.inner.wait(requests, peers, expected, timeout, **names)

    def wait_one(self, request, peers=None, status=None, operation=None) -> None:
        self.inner.wait_one(request, peers, status, operation)

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0) -> None:
        self.synchronize_caller()
        self.inner.sendrecv(sendbuf, dst, recvbuf, src, tag)

    def send(self, buf, dst: int, tag: int = 0) -> None:
        self.synchronize_caller()
        self.inner.send(buf, dst, tag)

    def recv(self, buf, src: int, tag: int = 0) -> None:
        self.synchronize_caller()
        self.inner.recv(buf, src, tag)

    def _wire(self, buf):
        return self.inner._wire(buf)
