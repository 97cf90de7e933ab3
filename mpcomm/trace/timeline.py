"""The timeline: every rank's collectives, their algorithm's phases and the engines' spans, merged into one
Chrome-trace / Perfetto JSON file with the ranks' clocks aligned.

A :class:`Timeline` is started collectively (``comm.timeline(path)``, or ``MPCOMM_TIMELINE=path`` at the first
Communicator over the whole world) and, while it runs, follows every lane of this process's flight recorder: it
stands in for the lane's ``ends`` list, so the store that marks a call completed also appends its span. Recording
therefore adds nothing to a call when no timeline runs — the hot path is the flight recorder's, unchanged. The
algorithms mark their phases with ``Transport.phase`` and the engines theirs with :meth:`Timeline.span`. At
:meth:`Timeline.stop` (collective) the clocks are measured again (:mod:`mpcomm.trace.clocks`), every rank sends its
spans to rank 0 and rank 0 writes the file (:mod:`mpcomm.trace.chrome`). Format and use: ``docs/trace.md``.
"""
from __future__ import annotations

import json
import os
import socket
import time
import warnings
from typing import Iterable

from mpi4py import MPI

from ..errors import MpcommError
from ..transport import Transport, duplicate
from . import chrome, clocks
from .recorder import FlightRecorder, GroupTrace, describe

_clock = time.perf_counter
_TAG = 2


class Timeline:
    """Spans of this process's calls between a collective start (the constructor) and :meth:`stop`.

    ``mpi_comm``: the ranks that write one file together (rank 0 of it writes ``path``); ``recorder``: this
    process's flight recorder, whose lanes (the Communicators' call streams) it follows. One at a time per
    process. A context manager: leaving the ``with`` block stops it."""

    def __init__(self, mpi_comm: MPI.Comm, timeout: float, path: str, recorder: FlightRecorder):
        if recorder.timeline is not None:
            raise MpcommError(f"rank {mpi_comm.Get_rank()}: timeline({path!r}): a timeline is already recording "
                              f"in this process (into {recorder.timeline.path!r}); stop it first")
        self.path, self.recorder = os.fspath(path), recorder
        self.transport = Transport(duplicate(mpi_comm, timeout), timeout)
        self.calls: list[tuple] = []  # (lane, plan or point-to-point description, start, end, lane's calls so far)
        self.spans: list[tuple] = []  # (lane, track suffix, name, start, end, args): phases and engine spans
        self.instants: list[tuple] = []  # (lane, name, time, args)
        self.written: str | None = None
        with self.transport.running(f"timeline({self.path!r}): measuring the clock offsets"):
            self.offsets = clocks.measure(self.transport)
            problem = self.transport.bcast_object(_unwritable(self.path) if self.transport.rank == 0 else None)
        if problem:  # (told to every rank now, rather than found by rank 0 alone at the stop)
            self.transport.mpi.Free()
            raise MpcommError(f"rank {self.transport.rank}: timeline({self.path!r}): {problem} (rank 0 writes it)")
        self.started = _clock()
        self.running = True
        recorder.follow(self)

    # ------------------------------------------------------------------ recording
    def ends_of(self, lane: GroupTrace) -> "_Ends":
        """What stands for ``lane``'s ``ends`` while this timeline runs."""
        return _Ends(self.recorder.ends, lane, self.calls)

    def phase(self, lane: GroupTrace, name: str) -> "Span":
        """A phase of the algorithm running on ``lane`` (a ``with`` block), drawn inside the call's span."""
        return Span(self.spans, lane, "", name, {})

    def span(self, lane: GroupTrace, name: str, args: dict | None = None) -> "Span":
        """An engine's span (a bucket's all-reduce, a unit's gather), on the lane's ``engine`` track; started
        now, ended by :meth:`Span.end` or the end of a ``with`` block."""
        return Span(self.spans, lane, " engine", name, args or {})

    def instant(self, lane: GroupTrace, name: str, args: dict) -> None:
        """A moment on the lane's track (a straggler report), now."""
        self.instants.append((lane, name, _clock(), args))

    def add_spans(self, lane: GroupTrace, spans: Iterable[tuple[str, float, float]]) -> None:
        """Engine spans measured already: ``(name, start, end)`` with ``time.perf_counter()`` readings."""
        self.spans.extend((lane, " engine", name, start, end, {}) for name, start, end in spans)

    # ------------------------------------------------------------------ the file
    def stop(self) -> str | None:
        """Collective over the timeline's ranks: stop recording, measure the clocks again, send every rank's
        spans to rank 0, which writes the file; returns its path on rank 0, None elsewhere. Waits are bounded by
        the timeout."""
        if not self.running:
            return self.written
        self.running = False
        self.recorder.follow(None)
        t = self.transport
        try:
            with t.running(f"timeline({self.path!r}): measuring the clock offsets again"):
                offsets = clocks.measure(t)
            with t.running(f"timeline({self.path!r}): sending the spans to rank 0"):
                everyone = t.gather_object(self._records(), 0, _TAG)
            if everyone is not None:
                assert self.offsets is not None and offsets is not None  # rank 0 measured both
                events = chrome.trace_events(everyone, self.offsets, offsets, self.started)
                self.written = _write(self.path, events)
        finally:
            if not t.failed:
                t.mpi.Free()
        return self.written

    def stop_at_exit(self) -> None:
        """:meth:`stop` at the interpreter's exit (``MPCOMM_TIMELINE``): a failure is a warning, not a crash."""
        if MPI.Is_finalized():
            warnings.warn(f"MPCOMM_TIMELINE: the timeline {self.path!r} was not written: MPI was finalized before "
                          "the interpreter's exit", RuntimeWarning)
            return
        try:
            self.stop()
        except (MpcommError, OSError, MPI.Exception) as exc:
            warnings.warn(f"MPCOMM_TIMELINE: the timeline {self.path!r} was not written: {exc}", RuntimeWarning)

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.stop()
        else:  # the block failed: the ranks may not all come to a stop; only stop recording here
            self.running = False
            self.recorder.follow(None)

    def _records(self) -> dict:
        """This rank's spans as plain data: ``(track, name, category, start, end, args)``."""
        rows = []
        for lane, call, start, end, count in self.calls:
            operation, algorithm, nbytes, inputs, outputs, dtype, extra, peer = describe(call, lane)
            if type(call) is tuple:  # point to point
                rows.append((f"{lane.name} p2p", f"{operation} {'to' if operation == 'send' else 'from'} {peer}",
                             "p2p", start, end, {"bytes": nbytes, "shape": (inputs or outputs)[0], "dtype": dtype}))
                continue
            args = {"seq": count, "algorithm": algorithm, "bytes": nbytes, "dtype": dtype,
                    "input": inputs, "output": outputs, **extra}
            rows.append((lane.name, operation, "collective", start, end, args))
        for lane, track, name, start, end, args in self.spans:
            rows.append((lane.name + track, name, "engine" if track else "phase", start, end, args))
        for lane, name, moment, args in self.instants:  # (a moment: a span that ends where it starts)
            rows.append((lane.name, name, "straggler", moment, None, args))
        return {"world_rank": self.recorder.world_rank, "host": socket.gethostname(), "pid": os.getpid(),
                "rows": rows}


class _Ends:
    """Stands for a lane's ``ends`` while a timeline runs: storing a call's end writes the recorder's ring and
    appends the call's span (so the hot path, written for the ring, records the timeline unchanged)."""

    __slots__ = ("ring", "lane", "calls", "starts", "out")

    def __init__(self, ring: list, lane: GroupTrace, out: list):
        self.ring, self.lane, self.out = ring, lane, out
        self.calls, self.starts = lane.recorder.calls, lane.recorder.starts

    def __setitem__(self, slot: int, end: float) -> None:
        self.ring[slot] = end
        lane = self.lane
        self.out.append((lane, self.calls[slot], self.starts[slot], end, lane.collectives))

    def __getitem__(self, slot: int) -> float:
        return self.ring[slot]


class Span:
    """A span being measured: started when made, recorded once by :meth:`end` (or leaving a ``with`` block)."""

    __slots__ = ("out", "lane", "track", "name", "args", "start")

    def __init__(self, out: list, lane: GroupTrace, track: str, name: str, args: dict):
        self.out: list | None = out  # None once recorded
        self.lane, self.track, self.name, self.args = lane, track, name, args
        self.start = _clock()

    def end(self) -> None:
        if self.out is not None:
            self.out.append((self.lane, self.track, self.name, self.start, _clock(), self.args))
            self.out = None

    def __enter__(self) -> "Span":
        return self

    def __exit__(self, *exc) -> None:
        self.end()


class NoSpan:
    """What :meth:`Timeline.span`'s callers get when no timeline runs: does nothing."""

    __slots__ = ()

    def end(self) -> None:
        pass

    def __enter__(self) -> "NoSpan":
        return self

    def __exit__(self, *exc) -> None:
        pass


NO_SPAN = NoSpan()


def _unwritable(path: str) -> str | None:
    """Why rank 0 could not write ``path``, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"there is no directory {folder!r}"
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        return f"{path!r} is a directory" if os.path.isdir(path) else f"the directory {folder!r} is not writable"
    return None


def _write(path: str, events: dict) -> str:
    """Write ``events`` as JSON to ``path`` atomically; OSError naming the path if it cannot be written."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(events, f, allow_nan=False, separators=(",", ":"))
        os.replace(partial, path)
    except OSError as exc:
        raise OSError(f"mpcomm timeline: cannot write {path!r}: {exc}") from None
    return path
