"""Point-to-point messages on one MPI communicator, every wait bounded by a deadline.

Algorithms are written against this small surface (``sendrecv``, ``send``, ``recv``, ``isend``/``irecv`` +
``wait``, ``scratch``). Waiting polls the requests with ``MPI.Request.Testall`` until they complete or the
deadline passes, so a peer that never arrives becomes a ``CommTimeoutError`` instead of a hang.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import numpy as np
from mpi4py import MPI

from . import native_calls
from .buffers import array_module, is_device_array
from .errors import CommTimeoutError, MpcommError

if TYPE_CHECKING:
    from .trace.recorder import GroupTrace

T = TypeVar("T")

# Spins of Testall before each poll also yields the core: ranks are often oversubscribed on small machines.
_SPINS_BEFORE_YIELD = 32
# Bare Tests of a single request before the bounded poll (wait_one): a small collective often completes within
# them, and they cost only MPI's own Test (no deadline, no progress hook). Few: they do not yield the core, and
# with more ranks than cores that costs (bench/results/observations.md, "Waiting with more ranks than cores").
_QUICK_TESTS = 8
# With more ranks than cores (Transport.share_cores) a waiting rank yields sooner: the peer it waits for may need
# its core (bench/results/observations.md, "Waiting with more ranks than cores").
_SHARED_SPINS_BEFORE_YIELD, _SHARED_QUICK_TESTS = 8, 2
# A wait in a thread other than the main one (a progress thread, a backend's worker) sleeps between polls once
# it has lasted _SPIN_SECONDS, for _SLEEP_SHARE of the time waited so far (at most _MAX_SLEEP): the main thread
# computes meanwhile, and a spinning background thread would take its core (and the GIL) for as long as the
# wire is busy. Waking late by a few percent of a wait that long is what it costs.
# Not while another thread waits for its result (Transport.waiters): then nobody computes, and where MPI moves a
# message only during its calls (MPICH without CMA) each sleep held the copy up (bench/results/progress_wait.md).
_SPIN_SECONDS, _SLEEP_SHARE, _MAX_SLEEP = 200e-6, 0.05, 1e-3
_BYTES = MPI.BYTE
COMMUNICATORS_HELD = 4  # MPI communicators each Communicator makes (see Communicator.__init__)
_NO_PHASE = nullcontext()  # what phase() gives when no timeline records (reusable: it holds nothing)
_LATE = ("no Communicator was made here; this rank's MPI_Comm_idup of the communicator stays pending and completes "
         "when those ranks make their Communicator too (every rank must, before its next collective on it)")


class Transport:
    """Messages between the ranks of ``mpi_comm`` (a communicator private to mpcomm)."""

    def __init__(self, mpi_comm: MPI.Comm, timeout: float, ranks_per_node: int | None = None,
                 on_timeout: str = CommTimeoutError.UNUSABLE):
        self.mpi = mpi_comm
        self.on_timeout = on_timeout  # what a timeout leaves behind, for its error message
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.watch = None  # native's watchdog entry where it blocks under it (algorithms.native.watch), else None
        self.timeout = float(timeout)
        self.operation: object = "communication"  # a str, or what str() names it by (formatted on an error)
        self._ranks_per_node = ranks_per_node
        self._scratch: dict = {}
        self._node: Transport | None = None
        self._cross: Transport | None = None
        self._uniform: bool | None = None
        self.others = tuple(r for r in range(self.size) if r != self.rank)  # every peer (error messages)
        self.fortran = mpi_comm.py2f()  # the communicator's Fortran handle (what code in C is given: native_calls)
        # Held while a collective runs on this transport: a second thread arriving meanwhile is an error.
        self.in_use = native_calls.lock()
        # Measured totals of the collectives run here: plan key -> array('d') of calls, bytes, seconds (stats()
        # sums them by operation and algorithm; express calls add to theirs in C). One table per transport, so
        # the thread that runs its collectives is the only writer.
        self.records: dict = {}
        # Called while this transport waits: progress of point-to-point receives (see ``mpcomm.p2p.Channels``).
        self.progress_hook: Callable[[], None] | None = None
        self.trace: GroupTrace | None = None  # the flight recorder's lane of the collectives run here
        # straggler detection (mpcomm.trace.stragglers): this rank's wait in the previous exchange before a
        # collective here, and that collective (its sequence number in the lane, its label)
        self.previous_wait = 0.0
        self.previous_call: tuple | None = None
        self.failed = False  # a wait here timed out or failed: messages may be left in flight (see free())
        self.spins_before_yield, self.quick_tests = _SPINS_BEFORE_YIELD, _QUICK_TESTS
        self.waiters = Waiters()  # threads blocked until an operation on this transport finishes
        # Whether native may start persistent all-reduces here (the torch backend's groups start none), and those
        # made on this communicator: kind -> [request, its buffer, its Fortran handle], emptied in place when freed
        # (plans' express calls hold the list), or None (algorithms/native)
        self.starts_persistent = True
        self.persistent_requests: dict = {}
        # mpcomm's reductions as MPI ops (native_calls) that every rank agreed it has, where the Communicator asked
        # when it made this transport (algorithms.native.agree_on_ops); none elsewhere
        self.reduction_ops: dict = {}
        self.spans_nodes = False  # its ranks are on several nodes (set on every rank alike by the Communicator)
        self.cores_shared = False  # set on every rank alike (the communicator's topology is agreed)

    @property
    def timeout(self) -> float:
        """Seconds every wait here may take (the watchdog's deadline for native's blocking calls too)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        if self.watch is not None:
            self.watch.timeout = seconds

    def unwatch(self) -> None:
        """Stop native's blocking calls under the watchdog here (it polls non-blocking calls again); collective:
        every rank must call it before the same call."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def share_cores(self) -> None:
        """This rank shares its core with other ranks: yield it sooner while waiting."""
        self.spins_before_yield, self.quick_tests = _SHARED_SPINS_BEFORE_YIELD, _SHARED_QUICK_TESTS
        self.cores_shared = True

    # ------------------------------------------------------------------ context for error messages
    def running(self, operation: object) -> "_Running":
        """Name the operation in progress (a ``with`` block), so that errors raised underneath can say what ran."""
        return _Running(self, operation)

    def phase(self, name: str) -> AbstractContextManager:
        """Mark a phase of the algorithm running here (a ``with`` block: ``"reduce-scatter"``, ``"all-gather"``)
        for the timeline (``mpcomm.trace.timeline``); nothing is measured when no timeline records."""
        trace = self.trace
        timeline = None if trace is None else trace.timeline
        return _NO_PHASE if timeline is None else timeline.phase(trace, name)

    def limited(self, seconds: float) -> "_Limited":
        """Bound every wait of a ``with`` block by ``seconds`` too (``Work.wait(timeout)`` of an operation that
        runs in the waiting thread)."""
        return _Limited(self, seconds)

    # ------------------------------------------------------------------ scratch memory
    def scratch(self, slot: str, count: int, dtype, like=None):
        """A reusable 1-D scratch array of ``count`` elements; ``slot`` names independent buffers."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        key = slot if like is None or type(like) is np.ndarray or not is_device_array(like) else (slot, "device")
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = array_module(like).empty(max(nbytes, 64), dtype=np.uint8)
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
        statuses: list[MPI.Status] | None = None,
        operation=None,
    ) -> None:
        """Wait for all ``requests`` within the timeout; ``expected[i]`` is the byte count request i must receive;
        ``statuses``, if given, receives the requests' statuses; ``operation`` names the wait in errors (default:
        the operation running on this transport)."""
        if not expected and statuses is None:  # nothing to read from the statuses: the common case, kept lean
            try:
                if not MPI.Request.Testall(requests):
                    self._poll(partial(MPI.Request.Testall, requests), requests, peers,
                               self.timeout if timeout is None else timeout, operation)
            except MPI.Exception as exc:
                raise self._mpi_error(exc, [], peers, operation) from None
            return
        if statuses is None:
            statuses = [MPI.Status() for _ in requests]
        try:
            if not MPI.Request.Testall(requests, statuses):
                self._poll(partial(MPI.Request.Testall, requests, statuses), requests, peers,
                           self.timeout if timeout is None else timeout, operation)
        except MPI.Exception as exc:
            raise self._mpi_error(exc, statuses, peers, operation) from None
        for status, nbytes, peer in zip(statuses, expected, peers):
            if nbytes is not None and status.Get_count(MPI.BYTE) != nbytes:
                raise MpcommError(
                    f"rank {self.rank}: {operation or self.operation}: received {status.Get_count(MPI.BYTE)} bytes "
                    f"from rank {peer}, expected {nbytes} (do all ranks pass the same sizes and dtypes?)"
                )

    def poll_until(self, test, peers: Sequence[int], operation=None) -> None:
        """Call ``test()`` until it is true, within the deadline, for a wait that is no MPI request (a flag in
        shared memory that ``peers`` raise); a timeout raises like :meth:`wait`."""
        if not test():
            self._poll(test, (), peers, self.timeout, operation)

    def wait_one(self, request: MPI.Request, peers: Sequence[int] | None = None, status: MPI.Status | None = None,
                 operation=None) -> None:
        """:meth:`wait` for the single ``request`` (by default a collective with every peer), polled with MPI's
        ``Test`` (cheaper than ``Testall`` of a list): a few bare Tests first, then with the deadline and the
        progress hook. ``status``, if given, receives the request's status. At the deadline a point-to-point
        request is cancelled, a collective's is not (MPI makes that erroneous: Open MPI's cancel of a pending
        ``MPI_Comm_idup`` hung)."""
        test = request.Test if status is None else partial(request.Test, status)
        collective = peers is None
        peers = self.others if collective else peers
        try:
            for _ in range(self.quick_tests):
                if test():
                    return
            self._poll(test, () if collective else (request,), peers, self.timeout, operation)
        except MPI.Exception as exc:
            raise self._mpi_error(exc, [] if status is None else [status], peers, operation) from None

    def _mpi_error(self, exc: MPI.Exception, statuses, peers, operation=None) -> MpcommError:
        """An MpcommError for an MPI failure, naming the failed requests' own errors (MPI_ERR_IN_STATUS only
        says "see the statuses")."""
        self.failed = True
        failed = [f"with rank {peer}: {_error_text(status.Get_error())}"
                  for status, peer in zip(statuses, peers)
                  if status.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
        codes = [exc.Get_error_class()] + [MPI.Get_error_class(status.Get_error()) for status in statuses]
        sizes = any(code in (MPI.ERR_TRUNCATE, MPI.ERR_COUNT, MPI.ERR_TYPE) for code in codes)
        peers = list(dict.fromkeys(peers))
        hint = ("do all ranks pass the same sizes and dtypes?" if sizes else
                f"rank(s) {peers} may have died or stalled; see their output")
        return MpcommError(
            f"rank {self.rank}: {operation or self.operation}: MPI error while exchanging with rank(s) "
            f"{peers}: {'; '.join(failed) or _error_text(exc.Get_error_code())} ({hint})"
        )

    def allgather_object(self, obj) -> list:
        """Every rank's ``obj`` (pickled), in rank order; both steps (lengths, bytes) wait with the deadline."""
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = np.empty(self.size, dtype=np.int64)
        self.wait([self.mpi.Iallgather(np.array([data.size], dtype=np.int64), lengths)], self.others)
        everything = np.empty(int(lengths.sum()), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.wait([self.mpi.Iallgatherv(data, [everything, (lengths.tolist(), offsets.tolist()), MPI.BYTE])],
                  self.others)
        return [pickle.loads(everything[o : o + n].tobytes()) for o, n in zip(offsets.tolist(), lengths.tolist())]

    def bcast_object(self, obj, root: int = 0):
        """Rank ``root``'s ``obj`` (pickled) on every rank; both broadcasts (length, bytes) wait with the deadline."""
        data = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8) if self.rank == root else None
        length = np.array([0 if data is None else data.size], dtype=np.int64)
        self.wait([self.mpi.Ibcast(length, root)], self.others)
        if data is None:
            data = np.empty(int(length[0]), dtype=np.uint8)
        self.wait([self.mpi.Ibcast(data, root)], self.others)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def gather_object(self, obj, root: int = 0, tag: int = 0) -> list | None:
        """Every rank's ``obj`` (pickled) on ``root``, in rank order, None elsewhere: a length then the bytes, sent
        point to point so that only ``root`` holds them all."""
        size = np.zeros(1, dtype=np.int64)
        if self.rank != root:
            data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
            size[0] = data.size
            self.send(size, root, tag)
            self.send(data, root, tag)
            return None
        everyone = []
        for r in range(self.size):
            if r == root:
                everyone.append(obj)
                continue
            self.recv(size, r, tag)
            data = np.empty(int(size[0]), dtype=np.uint8)
            self.recv(data, r, tag)
            everyone.append(pickle.loads(data.tobytes()))
        return everyone

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
        return self._node if self._node is not None else self._split_topology()[0]

    @property
    def cross(self) -> "Transport":
        """Transport among the ranks with this rank's node-local index, one per node (collective on first use)."""
        return self._cross if self._cross is not None else self._split_topology()[1]

    @property
    def nodes_are_uniform(self) -> bool:
        """Whether every node has the same number of ranks (collective on first use, then remembered)."""
        if self._uniform is None:
            mine = np.array([self.node.size, -self.node.size], dtype=np.int64)
            extremes = np.empty_like(mine)
            self.wait([self.mpi.Iallreduce(mine, extremes, MPI.MAX)], peers=[r for r in range(self.size) if r != self.rank])
            self._uniform = bool(extremes[0] == -extremes[1])
        return self._uniform

    def _split_topology(self) -> tuple["Transport", "Transport"]:
        # Comm_split has no non-blocking form: meet first with a deadline, so a missing rank is a CommTimeoutError
        # here rather than a hang inside the split.
        self.wait([self.mpi.Ibarrier()], self.others)
        node_comm = split_node(self.mpi, self._ranks_per_node)
        cross_comm = self.mpi.Split(node_comm.Get_rank(), self.rank)
        self._node = type(self)(node_comm, self.timeout)
        self._cross = type(self)(cross_comm, self.timeout)
        for sub in (self._node, self._cross):
            sub.progress_hook = self.progress_hook
            sub.spins_before_yield, sub.quick_tests = self.spins_before_yield, self.quick_tests
            sub.waiters = self.waiters
        return self._node, self._cross

    def scratch_bytes(self) -> int:
        """The bytes of the scratch buffers kept for reuse, those of the node and cross parts included."""
        return (sum(buf.nbytes for buf in self._scratch.values())
                + sum(sub.scratch_bytes() for sub in (self._node, self._cross) if sub is not None))

    def free(self) -> None:
        """Release the MPI communicators this transport owns."""
        for sub in (self._node, self._cross):
            if sub is not None:
                sub.free()
        self.free_persistent_requests()
        self.persistent_requests.clear()
        self.unwatch()
        if self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    def free_persistent_requests(self) -> None:
        """Free the persistent requests made on this transport (none may be active: every wait for one returned),
        emptying their entries in place: the express calls bound to one find it empty and go the general way, which
        makes it again."""
        for entry in self.persistent_requests.values():
            if entry:
                entry[0].Free()
                entry.clear()

    # ------------------------------------------------------------------ internals
    def _wire(self, buf) -> list:
        """The message of ``buf``'s bytes, the form every message takes on the wire (any dtype; mpi4py reads
        bfloat16 through DLPack). A list, not a ``uint8`` view: making the view was a large share of a small message's
        cost (bench/results/observations.md, "Messages as a list, not a view")."""
        return [buf, _BYTES]

    def _poll(self, test, requests, peers, timeout: float, operation=None) -> None:
        """Call ``test()`` until it is true (``requests`` done) or ``timeout`` seconds pass (then cancel them)."""
        start = time.monotonic()
        deadline = start + timeout
        spins = 0
        hook, spins_before_yield = self.progress_hook, self.spins_before_yield
        patient = None
        while not test():
            if hook is not None:
                hook()
            spins += 1
            if spins < spins_before_yield:
                continue
            spins = 0
            now = time.monotonic()
            if patient is None:
                patient = threading.current_thread() is not threading.main_thread()
            if patient and now - start > _SPIN_SECONDS and not self.waiters.count:
                time.sleep(min(_MAX_SLEEP, _SLEEP_SHARE * (now - start)))
            else:
                os.sched_yield()
            if now > deadline:
                for request in requests:
                    cancel(request)
                self.failed = True
                raise CommTimeoutError(str(operation or self.operation), peers, now - start, timeout, self.rank,
                                       self.on_timeout)


class Waiters:
    """How many threads are blocked until an operation on a transport finishes (``with waiters:`` around the
    block); while any is, that transport's background waits do not sleep."""

    __slots__ = ("count", "_lock")

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self.count += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.count -= 1


def completed(request: MPI.Request) -> bool:
    """Whether ``request`` has completed, without completing it (a later wait still does); one that failed has
    (its transport's wait raises mpcomm's error)."""
    try:
        return request.Get_status()
    except MPI.Exception:
        return True


def cancel(request: MPI.Request) -> None:
    """Cancel ``request`` if it is still active; one MPI cannot cancel (a collective's) is left as it is."""
    if request != MPI.REQUEST_NULL:
        try:
            request.Cancel()
        except MPI.Exception:
            pass


class _Limited:
    """Context manager of :meth:`Transport.limited`."""

    __slots__ = ("transport", "seconds", "previous")

    def __init__(self, transport: Transport, seconds: float):
        self.transport, self.seconds = transport, float(seconds)

    def __enter__(self) -> Transport:
        self.previous = self.transport.timeout
        self.transport.timeout = min(self.previous, self.seconds)
        return self.transport

    def __exit__(self, *exc) -> None:
        self.transport.timeout = self.previous


class _Running:
    """Context manager of :meth:`Transport.running` (a class: it is entered on every message)."""

    __slots__ = ("transport", "operation", "previous")

    def __init__(self, transport: Transport, operation: object):
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


def created(make: Callable[[], T], what: str, rank: int) -> T:
    """``make()`` (an MPI call that creates a communicator); an MpcommError saying what ran out if MPI cannot."""
    try:
        return make()
    except MPI.Exception as exc:
        raise _not_created(what, rank, _error_text(exc.Get_error_code())) from None


def _not_created(what: str, rank: int, mpi_says: str) -> MpcommError:
    return MpcommError(
        f"rank {rank}: {what}: the MPI library could not create a communicator ({mpi_says}); MPI allows each process "
        f"a limited number of communicators (MPICH: 2048) and each Communicator holds {COMMUNICATORS_HELD} of them "
        "until free() (one more if split() made it): free() the Communicators you no longer use")


def duplicate(mpi_comm: MPI.Comm, timeout: float) -> MPI.Comm:
    """mpcomm's own duplicate of a user's communicator: the only operation mpcomm starts on one it does not own,
    a non-blocking MPI_Comm_idup waited with the deadline. A rank that does not come within it leaves the others'
    idup pending (MPI cannot cancel a collective); it completes, in order with any later collective, once that rank
    calls it too, so the user's communicator stays in step as long as every rank makes the Communicator."""
    rank = mpi_comm.Get_rank()
    new, request = created(mpi_comm.Idup, "Communicator", rank)
    t = Transport(mpi_comm, timeout, on_timeout=_LATE)
    try:
        with t.running("Communicator: duplicating the communicator (MPI_Comm_idup)"):
            t.wait_one(request)
    except CommTimeoutError:
        raise
    except MpcommError as exc:  # MPICH finds out that it has no context id left while the idup progresses
        raise _not_created("Communicator", rank, str(exc).split(": ", 3)[-1]) from None
    return new


def split_node(mpi_comm: MPI.Comm, ranks_per_node: int | None) -> MPI.Comm:
    """The communicator of this rank's node: shared-memory split, or consecutive blocks of ``ranks_per_node``."""
    if ranks_per_node:
        rank = mpi_comm.Get_rank()
        return mpi_comm.Split(rank // int(ranks_per_node), rank)
    return mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
