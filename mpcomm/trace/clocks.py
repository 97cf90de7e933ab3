"""Clock offsets between ranks, measured by ping-pong, for the timeline to put every rank's times on rank 0's clock.

Rank 0 exchanges ``rounds`` ping-pongs with every other rank in turn: it reads its clock ``a``, sends, the rank
replies with its own reading ``b``, rank 0 reads ``c`` when the reply arrives. If the two one-way delays are equal,
``b`` was taken at rank 0's ``(a + c) / 2``, so the rank's clock is ahead by ``b - (a + c) / 2``; of the rounds the
one with the shortest round trip is kept, and half of that round trip bounds the error (as NTP does). Measured at
a timeline's start and stop, the two offsets give each rank's drift too (:func:`to_reference`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..transport import Transport

ROUNDS = 8  # ping-pongs per rank and measurement: the shortest round trip of 8 is steady even under load
_TAG = 1


@dataclass(frozen=True)
class Offset:
    """A rank's clock minus rank 0's (``seconds``), measured at the rank's clock reading ``at``, within ``error``
    (half the round trip)."""

    seconds: float
    error: float
    at: float


def measure(t: Transport, rounds: int = ROUNDS) -> list[Offset] | None:
    """Collective over ``t``: on rank 0, every rank's :class:`Offset` (rank 0's own is zero); None elsewhere.
    Every wait is bounded by ``t``'s deadline."""
    clock = np.zeros(1, dtype=np.float64)
    if t.rank != 0:
        for _ in range(rounds):
            t.recv(clock, 0, _TAG)
            clock[0] = time.perf_counter()
            t.send(clock, 0, _TAG)
        return None
    offsets = [Offset(0.0, 0.0, time.perf_counter())]
    for r in range(1, t.size):
        best = None
        for _ in range(rounds):
            a = time.perf_counter()
            t.send(clock, r, _TAG)
            t.recv(clock, r, _TAG)
            c = time.perf_counter()
            if best is None or c - a < best[1] - best[0]:
                best = (a, c, float(clock[0]))
        assert best is not None  # rounds >= 1
        a, c, b = best
        offsets.append(Offset(b - (a + c) / 2, (c - a) / 2, b))
    return offsets


def to_reference(start: Offset, stop: Offset | None):
    """A function from a rank's clock reading to rank 0's clock. The offset is interpolated linearly between the
    two measurements (the clocks' drift) only where they differ by more than their errors: otherwise the noise
    of the measurements would stretch every span (over a short timeline, by more than a microsecond), so the
    more precise of the two is used throughout."""
    if stop is None or abs(stop.seconds - start.seconds) <= start.error + stop.error or stop.at == start.at:
        offset = start.seconds if stop is None or start.error <= stop.error else stop.seconds
        return lambda x: x - offset
    slope = (stop.seconds - start.seconds) / (stop.at - start.at)
    return lambda x: x - (start.seconds + slope * (x - start.at))
