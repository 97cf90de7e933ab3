"""Exceptions raised by mpcomm. Every message carries the facts needed to act on it."""
from __future__ import annotations


class MpcommError(Exception):
    """Base class of every mpcomm error."""


class CommTimeoutError(MpcommError, TimeoutError):
    """A blocking operation did not complete within the communicator's timeout.

    ``consequence`` says what the failure leaves behind: a collective that stopped midway makes its
    communicator unusable; a cancelled point-to-point message or a ``Work.wait(timeout)`` that gave up waiting
    on an operation still running does not.
    """

    UNUSABLE = "the communicator is no longer usable"

    def __init__(self, operation: str, peers, elapsed: float, timeout: float, rank: int | None = None,
                 consequence: str = UNUSABLE):
        self.operation, self.peers, self.elapsed, self.timeout, self.rank = (str(operation), tuple(dict.fromkeys(peers)),
                                                                              elapsed, timeout, rank)
        self.consequence = consequence
        who = f"rank {rank}: " if rank is not None else ""
        super().__init__(
            f"{who}{operation} timed out after {elapsed:.2f} s (timeout {timeout:g} s) "
            f"waiting for peer rank(s) {list(self.peers)}; {consequence}"
        )

    def __reduce__(self):
        return (type(self), (self.operation, self.peers, self.elapsed, self.timeout, self.rank, self.consequence))


class CollectiveMismatchError(MpcommError):
    """Ranks called a collective with different arguments (validate=True)."""


class ConfigError(MpcommError, ValueError):
    """A parallel configuration violates a constraint; the message names it."""
