"""Handles of non-blocking operations: the ``Work`` interface (see ``mpcomm.p2p`` for isend/irecv), the
collectives running on a progress thread (iallreduce, ireduce_scatter, …), and progress on wait for an MPI that
cannot take calls from two threads."""
from __future__ import annotations

import math
import numbers
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Sequence

from mpi4py import MPI

from .errors import CommTimeoutError


class Work(ABC):
    """A pending operation: ``wait(timeout)`` blocks until done (or raises), ``is_completed()`` polls."""

    __slots__ = ()  # (subclasses on the small-message path use slots: cheaper to make than a __dict__)

    @abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation is done (or raise its error); return its result."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation is done; never blocks."""


def wait_timeout(timeout: Any, operation: str = "wait") -> float | None:
    """``timeout`` of a ``wait()``: None (the communicator's own timeout bounds it) or a number of seconds >= 0;
    anything else (NaN, negative, not a number) is a ValueError, never a wait that no deadline ends."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not float(timeout) >= 0
            or math.isinf(timeout)):
        raise ValueError(f"{operation}: timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
    return min(float(timeout), threading.TIMEOUT_MAX)  # (longer than any run: the operation's own deadline ends it)


# What a wait(timeout) that gave up leaves behind: the operation goes on (its own deadline still bounds it).
STILL_RUNNING = ("the operation is still running and the communicator stays usable; wait() again, or let the "
                 "communicator's own timeout end it")
# wait(timeout=0) in progress-on-wait mode: a poll, which must not run the operation against a zero deadline.
STILL_PENDING = ("the operation is still pending (MPCOMM_PROGRESS=wait: it runs inside a wait() with a timeout "
                 "above 0, is_completed() or the next blocking collective) and the communicator stays usable")


class FutureWork(Work):
    """A collective running on the communicator's progress thread."""

    def __init__(self, future: Future, operation: str, peers: Sequence[int], rank: int, waiters: ContextManager[Any]):
        self._future, self._operation, self._peers, self._rank = future, operation, tuple(peers), rank
        self._waiters = waiters  # the progress thread's transport.Waiters: counts this thread while it waits
        self._start = time.monotonic()

    def wait(self, timeout: float | None = None) -> Any:
        timeout = wait_timeout(timeout, f"{self._operation}: wait")
        try:
            with self._waiters:  # meanwhile the progress thread polls without sleeping
                return self._future.result(timeout)
        except FutureTimeout:
            if self._future.done():  # the operation itself raised (CommTimeoutError is a TimeoutError too)
                raise
            elapsed = time.monotonic() - self._start
            assert timeout is not None  # result(None) does not time out
            raise CommTimeoutError(self._operation, self._peers, elapsed, timeout, self._rank,
                                   consequence=STILL_RUNNING) from None

    def is_completed(self) -> bool:
        return self._future.done()


_warned_thread_level = False


def progress_thread_allowed() -> bool:
    """A progress thread needs MPI_THREAD_MULTIPLE (the main thread keeps calling MPI); otherwise warn (once)
    and run non-blocking collectives inside ``wait()``."""
    global _warned_thread_level
    level = MPI.Query_thread()
    if level >= MPI.THREAD_MULTIPLE:
        return True
    if not _warned_thread_level:
        _warned_thread_level = True
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        warnings.warn(
            f"mpcomm: MPI was initialized with MPI_THREAD_{names.get(level, level)}, not MPI_THREAD_MULTIPLE, so "
            "iallreduce/ireduce_scatter/iall_gather cannot run on a progress thread; they run inside wait() "
            "(or is_completed(), or the next blocking collective) instead, in issue order, and do not overlap "
            "with computation. Initialize MPI with THREAD_MULTIPLE (mpi4py's default) to overlap.",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


class InlineProgress:
    """Non-blocking collectives that run on the calling thread when waited on, oldest first."""

    def __init__(self):
        self.queue: list[DeferredWork] = []  # issued, not run yet

    def submit(self, body: Callable[[Any], Any], transport: Any, operation: str = "collective") -> "DeferredWork":
        work = DeferredWork(self, body, transport, operation)
        self.queue.append(work)
        return work

    def run_until(self, work: "DeferredWork | None") -> None:
        """Run queued operations in issue order up to and including ``work`` (all of them for None)."""
        while self.queue and (work is None or not work.done):
            self.queue.pop(0).run()


class DeferredWork(Work):
    """A collective queued for progress on wait; its errors are raised by ``wait()``."""

    def __init__(self, progress: InlineProgress, body: Callable[[Any], Any], transport: Any,
                 operation: str = "collective"):
        self._progress, self._body, self._transport, self._operation = progress, body, transport, operation
        self.done, self._result = False, None
        self._error: Exception | None = None

    def run(self) -> None:
        try:
            self._result = self._body(self._transport)
        except Exception as exc:  # kept for wait(), like a Future
            self._error = exc
        self.done = True

    def wait(self, timeout: float | None = None) -> Any:
        """Run this operation (and those issued before it) here; each of their waits is bounded by ``timeout``
        when given (it runs in this thread, so giving up stops it midway: the communicator becomes unusable).
        ``timeout=0`` only polls: it raises CommTimeoutError if the operation has not run, and runs nothing."""
        timeout = wait_timeout(timeout)
        if timeout == 0 and not self.done:
            t = self._transport
            raise CommTimeoutError(f"{self._operation}: wait", t.others, 0.0, 0.0, t.rank, consequence=STILL_PENDING)
        if timeout is None or self.done:
            self._progress.run_until(self)
        else:
            with self._transport.limited(timeout):
                self._progress.run_until(self)
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        self._progress.run_until(self)
        return True
