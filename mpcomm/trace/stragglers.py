"""Online straggler detection: which rank came to a collective more than ``threshold`` seconds after the others.

Arrival is measured without clocks compared between ranks: before a collective the ranks exchange 8 bytes each
(the ``validate=True`` agreement's exchange, which carries them along, or — with ``MPCOMM_STRAGGLER`` and
``validate=False`` — an 8-byte all-gather of its own, the opt-in cost). Every rank times how long it waited in that
exchange; the exchange ends for everyone at about the moment the last rank arrives, so a rank that waited ``w_j``
arrived about ``w_j - w_r`` before rank ``r``. Each rank sends the wait of its *previous* exchange on the same
transport, so every rank learns, one collective later, the waits of all ranks at the one before, and the same
reports on every rank: rank ``r`` is reported when the least wait among the others exceeds its own by more than
the threshold. Reports go to ``comm.stragglers()``, the lane's flight-recorder dump and, while one records, the
timeline (an instant event on the lane's track).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

REPORTS_KEPT = 1000  # reports kept per communicator (the counts per rank cover all of them)


class Stragglers:
    """The straggler reports of one Communicator (every rank holds the same ones)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.reports: deque[dict] = deque(maxlen=REPORTS_KEPT)
        self.late_calls: dict[int, int] = {}  # rank -> collectives at which it was reported

    def arrived(self, waits: list[float], previous: tuple[Any, Any] | None, lane: Any) -> None:
        """``waits[r]``: rank r's wait in the previous exchange of a transport whose collective was ``previous``
        (its sequence number in ``lane``, or None without the flight recorder, and its Plan); record a report
        if one rank came more than the threshold after all the others."""
        if previous is None or len(waits) < 2:
            return
        least = min(waits)
        last = waits.index(least)
        late = min(w for r, w in enumerate(waits) if r != last) - least
        if late <= self.threshold:
            return
        seq, plan = previous
        report = {"rank": last, "late_s": late, "seq": seq, "operation": plan.operation, "call": str(plan.label),
                  "lane": None if lane is None else lane.name, "time_ns": time.time_ns()}
        self.reports.append(report)
        self.late_calls[last] = self.late_calls.get(last, 0) + 1
        if lane is not None:
            lane.late.append(report)
            if lane.timeline is not None:
                lane.timeline.instant(lane, f"late: rank {last}", {k: report[k] for k in ("rank", "late_s", "seq")})

    def summary(self) -> dict:
        return {"threshold_s": self.threshold, "late_calls": dict(self.late_calls), "reports": list(self.reports)}
