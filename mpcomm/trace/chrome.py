"""Every rank's spans as one Chrome-trace / Perfetto file (the Trace Event Format's JSON object form).

A rank is a process (``pid`` = its world rank); each of its tracks — a communicator lane's collectives with their
phases nested inside, its point-to-point calls, its engine spans — is a thread (``tid``), named with ``M``
events. Spans are complete (``X``) events, times in microseconds on rank 0's clock from the timeline's start.
Viewers draw a thread's spans as a stack, so spans that overlap without nesting (two buckets' all-reduces in
flight at once) are put on numbered extra rows of the track (``0-3#0 engine (2)``).
"""
from __future__ import annotations

from typing import Sequence

from .clocks import Offset, to_reference

CLOCK = ("time.perf_counter() of each rank, put on rank 0's clock by ping-pong offsets measured at the timeline's "
         "start and stop (interpolated between them); error: half the shortest round trip")


def trace_events(ranks: Sequence[dict], starts: Sequence[Offset], stops: Sequence[Offset], origin: float) -> dict:
    """The JSON object of the merged timeline. ``ranks[i]``: rank i's records (``world_rank``, ``host``, ``pid``,
    ``rows`` of ``(track, name, category, start, end, args)`` on its own clock); ``starts`` / ``stops``: the
    clock offsets measured at the timeline's start and stop; ``origin``: rank 0's clock at the start."""
    events: list[dict] = []
    for i, records in enumerate(ranks):
        pid, convert = records["world_rank"], to_reference(starts[i], stops[i])
        events.append(_meta("process_name", pid, 0, {"name": f"rank {pid} ({records['host']})"}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        by_track: dict[str, list] = {}
        moments = []
        for track, name, category, start, end, args in records["rows"]:
            if end is None:  # an instant (a straggler report): drawn on the track's first row
                moments.append((track, name, category, _us(convert(start) - origin), args))
                continue
            by_track.setdefault(track, []).append(
                (_us(convert(start) - origin), _us(convert(end) - origin), name, category, args))
        for track, _, _, _, _ in moments:
            by_track.setdefault(track, [])
        first_row = {}
        first = 1  # the tid of the track's first row
        for track in sorted(by_track):
            first_row[track] = first
            spans = sorted(by_track[track], key=lambda s: (s[0], -s[1]))
            rows = _rows([(s[0], s[1]) for s in spans])
            for row in range(max(rows) + 1):
                name = track if row == 0 else f"{track} ({row + 1})"
                events.append(_meta("thread_name", pid, first + row, {"name": name}))
                events.append(_meta("thread_sort_index", pid, first + row, {"sort_index": first + row}))
            for (start, end, name, category, args), row in zip(spans, rows):
                events.append({"name": name, "cat": category, "ph": "X", "ts": start, "dur": round(end - start, 3),
                               "pid": pid, "tid": first + row, "args": args})
            first += max(rows) + 1
        events.extend({"name": name, "cat": category, "ph": "i", "s": "t", "ts": moment, "pid": pid,
                       "tid": first_row[track], "args": args} for track, name, category, moment, args in moments)
    offsets = [{"rank": records["world_rank"], "start_us": _us(a.seconds), "stop_us": _us(b.seconds),
                "error_us": _us(max(a.error, b.error))} for records, a, b in zip(ranks, starts, stops)]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "mpcomm", "clock": CLOCK, "clock_offsets": offsets}}


def _rows(spans: Sequence[tuple[float, float]]) -> list[int]:
    """For spans sorted by (start, -end): the row of each, the first one where it nests inside or follows what
    is open there (a viewer stacks the spans of a row, so a row must hold no partial overlap)."""
    open_ends: list[list[float]] = []  # per row, the ends of the spans still open, innermost last
    rows = []
    for start, end in spans:
        for row, stack in enumerate(open_ends):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                rows.append(row)
                break
        else:
            open_ends.append([end])
            rows.append(len(open_ends) - 1)
    return rows or [0]


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)
