"""Handles of non-blocking operations: the ``Work`` interface (see ``mpcomm.p2p`` for isend/irecv) and the
collectives running on a progress thread (iallreduce/ireduce_scatter/iall_gather)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from abc import ABC, abstractmethod
from typing import Any

from .errors import CommTimeoutError


class Work(ABC):
    """A pending operation: ``wait(timeout)`` blocks until done (or raises), ``is_completed()`` polls."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation is done (or raise its error); return its result."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation is done; never blocks."""


# What a wait(timeout) that gave up leaves behind: the operation goes on (its own deadline still bounds it).
STILL_RUNNING = ("the operation is still running and the communicator stays usable; wait() again, or let the "
                 "communicator's own timeout end it")


class FutureWork(Work):
    """A collective running on the communicator's progress thread."""

    def __init__(self, future: Future, operation: str, peers, rank: int):
        self._future, self._operation, self._peers, self._rank = future, operation, tuple(peers), rank
        self._start = time.monotonic()

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            if self._future.done():  # the operation itself raised (CommTimeoutError is a TimeoutError too)
                raise
            elapsed = time.monotonic() - self._start
            raise CommTimeoutError(self._operation, self._peers, elapsed, timeout, self._rank,
                                   consequence=STILL_RUNNING) from None

    def is_completed(self) -> bool:
        return self._future.done()
