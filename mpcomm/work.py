"""Handles of non-blocking operations, returned by isend/irecv and iallreduce/ireduce_scatter/iall_gather."""
from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from abc import ABC, abstractmethod
from typing import Any, Callable

from .errors import CommTimeoutError


class Work(ABC):
    """A pending operation: ``wait(timeout)`` blocks until done (or raises), ``is_completed()`` polls."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation is done (or raise its error); return its result."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation is done; never blocks."""


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
            raise CommTimeoutError(self._operation, self._peers, elapsed, timeout, self._rank) from None

    def is_completed(self) -> bool:
        return self._future.done()


class RequestWork(Work):
    """MPI requests of a point-to-point operation; ``complete(timeout)`` waits and runs the checks."""

    def __init__(self, complete: Callable[[float | None], Any], test: Callable[[], bool]):
        self._complete, self._test = complete, test
        self._done, self._result = False, None

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._result = self._complete(timeout)
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        if not self._done and self._test():
            self.wait()
        return self._done
