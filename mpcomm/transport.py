"""Point-to-point messages on one MPI communicator, every wait bounded by a deadline.

Algorithms are written against this small surface (``sendrecv``, ``send``, ``recv``, ``isend``/``irecv`` +
``wait``, ``scratch``). Waiting polls the requests with ``MPI.Request.Testall`` until they complete or the
deadline passes, so a peer that never arrives becomes a ``CommTimeoutError`` instead of a hang.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Sequence

import numpy as np
from mpi4py import MPI

from .buffers import byte_view
from .errors import CommTimeoutError, MpcommError

# Spins of Testall before each poll also yields the core: ranks are often oversubscribed on small machines.
_SPINS_BEFORE_YIELD = 32


class Transport:
    """Messages between the ranks of ``mpi_comm`` (a communicator private to mpcomm)."""

    def __init__(self, mpi_comm: MPI.Comm, timeout: float, ranks_per_node: int | None = None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.timeout = float(timeout)
        self.operation = "communication"
        self._ranks_per_node = ranks_per_node
        self._scratch: dict[str, np.ndarray] = {}
        self._node: Transport | None = None
        self._cross: Transport | None = None
        self._uniform: bool | None = None
        self.others = tuple(r for r in range(self.size) if r != self.rank)  # every peer (error messages)

    # ------------------------------------------------------------------ context for error messages
    def running(self, operation: str) -> "_Running":
        """Name the operation in progress (a ``with`` block), so that errors raised underneath can say what ran."""
        return _Running(self, operation)

    # ------------------------------------------------------------------ scratch memory
    def scratch(self, slot: str, count: int, dtype, like=None):
        """A reusable 1-D scratch array of ``count`` elements; ``slot`` names independent buffers."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        xp = _array_module(like)
        key = f"{slot}:{xp.__name__}"
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = xp.empty(max(nbytes, 64), dtype=np.uint8)
            self._scratch[key] = buf
        return buf[:nbytes].view(dtype)

    # ------------------------------------------------------------------ messages
    def isend(self, buf, dst: int, tag: int = 0) -> MPI.Request:
        return self.mpi.Isend(self._wire(buf), dst, tag)

    def irecv(self, buf, src: int, tag: int = 0) -> MPI.Request:
        return self.mpi.Irecv(self._wire(buf), src, tag)

    def wait(
        self,
        requests: Sequence[MPI.Request],
        peers: Sequence[int],
        expected: Sequence[int | None] = (),
        timeout: float | None = None,
    ) -> None:
        """Wait for all ``requests`` within the timeout; ``expected[i]`` is the byte count request i must receive."""
        statuses = [MPI.Status() for _ in requests]
        try:
            done = MPI.Request.Testall(requests, statuses)
            if not done:
                self._poll(requests, statuses, peers, self.timeout if timeout is None else timeout)
        except MPI.Exception as exc:
            # MPI_ERR_IN_STATUS only says "see the statuses": name the failed requests' own errors instead
            failed = [f"with rank {peer}: {_error_text(status.Get_error())}"
                      for status, peer in zip(statuses, peers)
                      if status.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
            raise MpcommError(
                f"rank {self.rank}: {self.operation}: MPI error while exchanging with rank(s) {list(peers)}: "
                f"{'; '.join(failed) or exc.Get_error_string()} (do all ranks pass the same sizes and dtypes?)"
            ) from None
        for status, nbytes, peer in zip(statuses, expected, peers):
            if nbytes is not None and status.Get_count(MPI.BYTE) != nbytes:
                raise MpcommError(
                    f"rank {self.rank}: {self.operation}: received {status.Get_count(MPI.BYTE)} bytes from rank "
                    f"{peer}, expected {nbytes} (do all ranks pass the same sizes and dtypes?)"
                )

    def bcast_object(self, obj, root: int = 0):
        """Rank ``root``'s ``obj`` (pickled) on every rank; both broadcasts (length, bytes) wait with the deadline."""
        data = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8) if self.rank == root else None
        length = np.array([0 if data is None else data.size], dtype=np.int64)
        self.wait([self.mpi.Ibcast(length, root)], self.others)
        if data is None:
            data = np.empty(int(length[0]), dtype=np.uint8)
        self.wait([self.mpi.Ibcast(data, root)], self.others)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src``."""
        if dst == self.rank and src == self.rank:
            recvbuf[...] = sendbuf
            return
        requests = [self.irecv(recvbuf, src, tag), self.isend(sendbuf, dst, tag)]
        self.wait(requests, (src, dst), (recvbuf.nbytes, None))

    def send(self, buf, dst: int, tag: int = 0) -> None:
        self.wait([self.isend(buf, dst, tag)], (dst,), (None,))

    def recv(self, buf, src: int, tag: int = 0) -> None:
        self.wait([self.irecv(buf, src, tag)], (src,), (buf.nbytes,))

    # ------------------------------------------------------------------ node topology (for hierarchical)
    @property
    def node(self) -> "Transport":
        """Transport among the ranks of this node (collective on first use)."""
        if self._node is None:
            self._split_topology()
        return self._node

    @property
    def cross(self) -> "Transport":
        """Transport among the ranks with this rank's node-local index, one per node (collective on first use)."""
        if self._cross is None:
            self._split_topology()
        return self._cross

    @property
    def nodes_are_uniform(self) -> bool:
        """Whether every node has the same number of ranks (collective on first use, then remembered)."""
        if self._uniform is None:
            mine = np.array([self.node.size, -self.node.size], dtype=np.int64)
            extremes = np.empty_like(mine)
            self.wait([self.mpi.Iallreduce(mine, extremes, MPI.MAX)], peers=[r for r in range(self.size) if r != self.rank])
            self._uniform = bool(extremes[0] == -extremes[1])
        return self._uniform

    def _split_topology(self) -> None:
        node_comm = split_node(self.mpi, self._ranks_per_node)
        cross_comm = self.mpi.Split(node_comm.Get_rank(), self.rank)
        self._node = type(self)(node_comm, self.timeout)
        self._cross = type(self)(cross_comm, self.timeout)

    def free(self) -> None:
        """Release the MPI communicators this transport owns."""
        for sub in (self._node, self._cross):
            if sub is not None:
                sub.free()
        if self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    # ------------------------------------------------------------------ internals
    def _wire(self, buf):
        return byte_view(buf)

    def _poll(self, requests, statuses, peers, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        spins = 0
        while not MPI.Request.Testall(requests, statuses):
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            if now > deadline:
                for request in requests:
                    if request != MPI.REQUEST_NULL:
                        try:
                            request.Cancel()
                        except MPI.Exception:
                            pass
                raise CommTimeoutError(self.operation, peers, now - start, timeout, self.rank)


class _Running:
    """Context manager of :meth:`Transport.running` (a class: it is entered on every message)."""

    __slots__ = ("transport", "operation", "previous")

    def __init__(self, transport: Transport, operation: str):
        self.transport, self.operation = transport, operation

    def __enter__(self) -> Transport:
        self.previous, self.transport.operation = self.transport.operation, self.operation
        return self.transport

    def __exit__(self, *exc) -> None:
        self.transport.operation = self.previous


def _error_text(code: int) -> str:
    """An MPI error string on one line: its class, plus the innermost detail of MPICH-style error stacks."""
    lines = [line.strip() for line in MPI.Get_error_string(code).splitlines() if line.strip()]
    head = lines[0].removesuffix(", error stack:") if lines else f"MPI error {code}"
    return f"{head} ({lines[-1]})" if len(lines) > 1 else head


def split_node(mpi_comm: MPI.Comm, ranks_per_node: int | None) -> MPI.Comm:
    """The communicator of this rank's node: shared-memory split, or consecutive blocks of ``ranks_per_node``."""
    if ranks_per_node:
        rank = mpi_comm.Get_rank()
        return mpi_comm.Split(rank // int(ranks_per_node), rank)
    return mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())


def ranks_per_core(mpi_comm: MPI.Comm) -> float:
    """The largest ratio, over the hosts of ``mpi_comm``, of its ranks on the host to the CPUs they may run on
    (the union of their affinity masks); above 1 the ranks share cores (collective)."""
    host = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        cpus = set().union(*map(set, host.allgather(mine)))
        ratio = host.Get_size() / max(1, len(cpus))
    finally:
        host.Free()
    return float(mpi_comm.allreduce(ratio, op=MPI.MAX))


def _array_module(like):
    if like is not None and type(like).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np
