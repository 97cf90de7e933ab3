"""The flight recorder: this process's last N collectives and point-to-point calls, kept in a ring, written to a
file when something went wrong.

One recorder per process (as there is one set of signal handlers and one dump file per rank): every Communicator of
the process writes into it through its :class:`GroupTrace`, which carries the communicator's name and sequence
numbers. Recording a call is a few stores into preallocated lists (the hot path of an 8-byte all-reduce pays for
it); everything else — sizes, dtypes, names, stacks — is worked out from the recorded plan only when a dump is
written. The dump is the dictionary torch's flight recorder writes (version "2.10": ``entries``, ``pg_config``,
``version``), pickled, one file per rank named ``mpcomm_trace_rank_<world rank>``; mpcomm's additions live in
the entries' extra keys (``algorithm``, ``bytes``) and under ``"mpcomm"`` (reason, world size, every thread's
stack). Writing a dump is local: it never waits for another rank.
"""
from __future__ import annotations

import itertools
from collections import deque
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Sequence

from mpi4py import MPI

_clock = time.perf_counter
DEFAULT_BUFFER = 2000  # calls kept per process (MPCOMM_TRACE_BUFFER): ~80 KB; its cost: docs/trace.md
FILE_PREFIX = "mpcomm_trace_rank_"
TORCH_FORMAT_VERSION = "2.10"  # the flight-recorder dump version of torch 2.14 (fr_trace checks it is "M.m")
LATE_KEPT = 100  # straggler reports kept per lane for the dump
FRAMES_KEPT = 32  # innermost frames of a stack written per entry / thread
# torch's names for the operations (its fr_trace matches collectives by them); the prefix names the library
_TORCH_NAMES = {"allreduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
                "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
                "all_to_all": "all_to_all", "all_to_all_v": "all_to_all_v_single", "barrier": "barrier",
                "split": "split", "send": "send", "recv": "recv"}


def default_dir() -> str:
    """``MPCOMM_TRACE_DIR``, else ``<temp dir>/mpcomm_trace`` (e.g. /tmp/mpcomm_trace): node-local, so a dump
    never waits on a shared file system."""
    return os.environ.get("MPCOMM_TRACE_DIR") or os.path.join(tempfile.gettempdir(), "mpcomm_trace")


class FlightRecorder:
    """A ring of the last ``capacity`` calls of every Communicator of this process, kept in parallel lists (one
    slot per call: no object is made per call, and the one a slot held before is only a float or a plan)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.groups: list[Any] = [None] * capacity  # the GroupTrace (communicator lane) that ran the slot's call
        self.calls: list[Any] = [None] * capacity  # its Plan, or a point-to-point call's description
        self.starts: list[float] = [0.0] * capacity  # time.perf_counter() when it started
        self.ends: list[float] = [-1.0] * capacity  # ... when it completed (before its start: it has not)
        # The next slot to write, round and round: next() is atomic under the GIL, so two threads never share one
        self.slots = itertools.cycle(range(capacity))
        self.lanes: list[GroupTrace] = []
        self._names: dict[tuple[int, ...], int] = {}  # communicators made so far over each set of world ranks
        self._lock = threading.Lock()
        self._epoch_ns = time.time_ns() - int(_clock() * 1e9)  # perf_counter -> wall clock, for the dump
        self.world_rank, self.world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        self.timeline: Any = None  # the Timeline (mpcomm.trace.timeline) the lanes record spans for, if one runs
        self.timelines = 0  # timelines started so far in this process

    def communicator(self, mpi_comm: MPI.Comm, timeout: float, lanes: Sequence[str]) -> list["GroupTrace"]:
        """The traces of a new Communicator over ``mpi_comm``, one per lane (``""``: its blocking collectives and
        point-to-point; e.g. ``"async"``: the non-blocking collectives, which run on their own communicator in
        their own order). A lane's name is the same on every member: the world ranks it spans, how many
        Communicators over those ranks this process made before (MPI requires the members to make them in the
        same order), and the lane."""
        world, group = MPI.COMM_WORLD.Get_group(), mpi_comm.Get_group()
        try:
            ranks = tuple(group.Translate_ranks(list(range(mpi_comm.Get_size())), world))
        finally:
            world.Free()
            group.Free()
        with self._lock:
            made = self._names.get(ranks, 0)
            self._names[ranks] = made + 1
            name = f"{_describe_ranks(ranks)}#{made}"
            traces = [GroupTrace(self, len(self.lanes) + i, f"{name}.{lane}" if lane else name, ranks,
                                 mpi_comm.Get_rank(), timeout) for i, lane in enumerate(lanes)]
            self.lanes += traces
            for lane in traces:
                lane.follow(self.timeline)
        return traces

    def follow(self, timeline) -> None:
        """Make every lane, and every lane made later, record its calls' spans for ``timeline`` too (None:
        stop)."""
        with self._lock:
            self.timeline = timeline
            self.timelines += timeline is not None
            for lane in self.lanes:
                lane.follow(timeline)

    # ------------------------------------------------------------------ dumps
    def snapshot(self, reason: str, frame=None) -> dict:
        """The dump's dictionary (torch's flight-recorder layout plus ``"mpcomm"``); ``frame``: the innermost
        frame of the calling thread to report (a signal handler's interrupted frame), else the caller's."""
        current = frame if frame is not None else sys._getframe(1)
        threads = sys._current_frames()
        threads[threading.get_ident()] = current
        names = {t.ident: t.name for t in threading.enumerate()}
        held = sorted((slot for slot in range(self.capacity) if self.groups[slot] is not None),
                      key=self.starts.__getitem__, reverse=True)  # newest first (one clock: starts increase)
        # A call's number: how many calls came before it (in all, in its lane and of its kind), counted back
        # from the totals, as the ring keeps the newest calls
        total = sum(lane.collectives + lane.p2p for lane in self.lanes)
        newer: dict[tuple, int] = {}
        entries = []
        for back, slot in enumerate(held):
            group = self.groups[slot]
            kind = (group, type(self.calls[slot]) is tuple)
            collectives = group.collectives - newer.get((group, False), 0)  # started up to this call, as torch
            p2p = group.p2p - newer.get((group, True), 0)  # numbers them (each its own kind's count)
            newer[kind] = newer.get(kind, 0) + 1
            entries.append(self._entry(total - 1 - back, slot, collectives, p2p, threads, names))
        entries.reverse()
        return {
            "version": TORCH_FORMAT_VERSION,
            "comm_lib_version": f"mpcomm / {MPI.Get_library_version().splitlines()[0].strip()}",
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))} for g in self.lanes},
            "pg_status": {str(g.pg_id): g.status() for g in self.lanes},
            "entries": entries,
            "mpcomm": {"reason": reason, "world_rank": self.world_rank, "world_size": self.world_size,
                       "host": socket.gethostname(), "pid": os.getpid(), "time_ns": time.time_ns(),
                       "capacity": self.capacity, "recorded": total,
                       "stragglers": {g.name: list(g.late) for g in self.lanes if g.late},
                       "stacks": {names.get(ident, str(ident)): _frames(f) for ident, f in threads.items()}},
        }

    def dump(self, reason: str, directory: str | None = None, frame=None) -> str:
        """Write this rank's dump into ``directory`` (default :func:`default_dir`); returns the file's path.
        Atomic (a reader never sees half a file); raises OSError naming the path if it cannot be written."""
        directory = directory or default_dir()
        path = os.path.join(directory, f"{FILE_PREFIX}{self.world_rank}")
        data = pickle.dumps(self.snapshot(reason, frame if frame is not None else sys._getframe(1)))
        try:
            os.makedirs(directory, exist_ok=True)
            partial = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, path)
        except OSError as exc:
            raise OSError(f"mpcomm trace: cannot write the flight-recorder dump {path!r}: {exc}") from None
        return path

    def dump_quietly(self, reason: str, frame=None) -> str | None:
        """:meth:`dump` from an error path or a signal handler: a failure to write is a warning, never an
        exception that would hide the error being raised."""
        try:
            return self.dump(reason, frame=frame if frame is not None else sys._getframe(1))
        except OSError as exc:
            warnings.warn(str(exc), RuntimeWarning)
            return None

    def _entry(self, record_id: int, slot: int, collectives: int, p2p: int, threads: dict, names: dict) -> dict:
        group, what, start, end = self.groups[slot], self.calls[slot], self.starts[slot], self.ends[slot]
        operation, algorithm, nbytes, inputs, outputs, dtype, extra, peer = describe(what, group)
        is_p2p = type(what) is tuple
        name = _TORCH_NAMES.get(operation) or _bare_name(what)
        if is_p2p:  # torch's "send 0->1" / "recv 1<-0", in the communicator's ranks
            name = f"{name} {group.rank}->{peer}" if operation == "send" else f"{name} {group.rank}<-{peer}"
        started_ns = self._epoch_ns + int(start * 1e9)
        ended = end >= start  # (an older end is the slot's previous call's)
        done = ended or (is_p2p and getattr(what[-1], "_done", False))  # (a Work's: seen done by a wait)
        thread = None if done else _running(threads, group, slot)
        return {
            "record_id": record_id, "pg_id": group.pg_id, "process_group": (group.name, group.desc),
            "collective_seq_id": collectives, "p2p_seq_id": p2p,
            "op_id": record_id, "profiling_name": f"mpcomm:{name}", "time_created_ns": started_ns,
            "time_discovered_started_ns": started_ns,
            "time_discovered_completed_ns": self._epoch_ns + int(end * 1e9) if ended else 0,
            **({"duration_ms": (end - start) * 1e3} if ended else {}),
            "input_sizes": inputs, "input_dtypes": [dtype] * len(inputs),
            "output_sizes": outputs, "output_dtypes": [dtype] * len(outputs),
            "state": "completed" if done else "started", "retired": done,
            "timeout_ms": int(group.timeout * 1e3), "is_p2p": is_p2p,
            "frames": [] if thread is None else _frames(threads[thread]),
            "thread_id": "" if thread is None else str(thread), "thread_name": names.get(thread, ""),
            "operation": operation, "algorithm": algorithm, "bytes": nbytes, **extra,
        }


class GroupTrace:
    """One lane of a Communicator in the recorder: its name, members, sequence numbers, and the calls that
    record (:meth:`started`, :meth:`started_p2p`, :meth:`completed`)."""

    __slots__ = ("recorder", "pg_id", "name", "desc", "ranks", "rank", "timeout", "collectives", "p2p",
                 "groups", "calls", "starts", "ends", "slots", "timeline", "late")

    def __init__(self, recorder: FlightRecorder, pg_id: int, name: str, ranks: tuple[int, ...], rank: int,
                 timeout: float):
        self.recorder, self.pg_id, self.name, self.ranks, self.rank = recorder, pg_id, name, ranks, rank
        self.desc = "world" if len(ranks) == recorder.world_size and ranks == tuple(sorted(ranks)) else "split"
        self.timeout = timeout
        self.collectives = self.p2p = 0  # calls started so far (torch's collective_seq_id / p2p_seq_id)
        # the recorder's ring, for the Communicator's hot path to write into without a call
        self.groups, self.calls, self.starts = recorder.groups, recorder.calls, recorder.starts
        self.ends, self.slots = recorder.ends, recorder.slots
        self.timeline: Any = None  # the Timeline recording this lane's spans, if one runs (see follow)
        self.late: deque[dict] = deque(maxlen=LATE_KEPT)  # straggler reports (mpcomm.trace.stragglers)

    def follow(self, timeline) -> None:
        """Record this lane's spans for ``timeline`` (None: stop): its ``ends`` becomes the timeline's
        stand-in, which stores into the ring and keeps the span."""
        self.timeline = timeline
        self.ends = self.recorder.ends if timeline is None else timeline.ends_of(self)

    def started(self, plan, start: float) -> int:
        """Record that a collective run by ``plan`` started at ``start`` (``time.perf_counter()``, the caller's
        own reading: one clock call less); returns the slot, whose ``ends[slot]`` the caller sets to the time
        it completed (:meth:`completed`; on the hot path the store is made without the call)."""
        self.collectives += 1  # (the dump derives each call's sequence number from it)
        slot = next(self.slots)
        self.groups[slot] = self
        self.calls[slot] = plan
        self.starts[slot] = start  # (in flight while ends[slot] < start: the slot's last end is older)
        return slot

    def started_p2p(self, operation: str, peer, array, work=None) -> int:
        """Record the start of a ``send`` / ``recv`` of ``array`` with ``peer``; ``work``: the Work of a
        non-blocking one, completed in the dump once a wait saw it done."""
        self.p2p += 1
        slot = next(self.slots)
        # the array's own shape and dtype objects: made into text at dump time (str(dtype) costs ~2 us a call)
        what = (operation, peer if type(peer) is int else -1, getattr(array, "shape", ()),
                getattr(array, "dtype", ""), getattr(array, "nbytes", 0), work)
        self.groups[slot], self.calls[slot], self.starts[slot] = self, what, _clock()
        return slot

    def completed(self, slot: int, end: float) -> None:
        """Record that the call of ``slot`` completed at ``end`` (``time.perf_counter()``)."""
        self.ends[slot] = end

    def status(self) -> dict:
        return {"last_enqueued_collective": self.collectives, "last_started_collective": self.collectives,
                "last_completed_collective": self.collectives}


def describe(what, group: GroupTrace):
    """(operation, algorithm, bytes, input sizes, output sizes, dtype, extra keys, peer) of a recorded call."""
    if type(what) is tuple:  # point to point: (operation, peer, shape, dtype, bytes, Work or None)
        operation, peer, shape, dtype, nbytes, _ = what
        sizes = [list(shape)]
        return operation, "p2p", int(nbytes), sizes if operation == "send" else [], \
            sizes if operation == "recv" else [], str(dtype), {}, peer
    signature = what.signature
    operation, shape = what.operation, signature.get("shape")
    dtype = signature.get("dtype") or ""
    block = [] if shape is None else list(shape)
    whole = [math.prod(block) * len(group.ranks)]
    inputs, outputs = {"reduce_scatter": ([whole], [block]), "all_gather": ([block], [whole]),
                       "gather": ([block], [whole]), "scatter": ([whole], [block])}.get(
        operation, ([block], [block]) if shape is not None else ([], []))
    extra = {key: signature[key] for key in ("op", "root", "wire") if signature.get(key) is not None}
    return operation, what.algorithm, what.nbytes, inputs, outputs, dtype, extra, None


def _bare_name(plan) -> str:
    """torch's name for mpcomm's own meetings and agreements (a barrier, or an all-reduce of one int64)."""
    return "all_reduce" if getattr(plan.fn, "__name__", "") == "_sum_of_int64" else "barrier"


def _running(threads: dict, group: GroupTrace, slot: int) -> int | None:
    """The thread whose stack holds the call of ``slot`` in flight: the frame that recorded it keeps ``trace``
    (the lane) and ``slot`` as locals (Dispatcher.run, Communicator._traced). Found at dump time, so that
    recording a call stores no thread."""
    for ident, frame in threads.items():
        while frame is not None:
            local = frame.f_locals
            if local.get("slot") == slot and local.get("trace") is group:
                return ident
            frame = frame.f_back
    return None


def _frames(frame) -> list[dict]:
    summary = traceback.extract_stack(frame, limit=FRAMES_KEPT)
    return [{"name": f.name, "filename": f.filename, "line": str(f.lineno)} for f in reversed(summary)]


def _describe_ranks(ranks: tuple[int, ...]) -> str:
    """"0-3" for a contiguous run, else "0,2,4" (shortened past eight ranks with a count)."""
    if ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    shown = ",".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown},...({len(ranks)} ranks, hash {hash(ranks) & 0xffff:04x})"


# ---------------------------------------------------------------------------------------------- the process's recorder
_process: dict[str, FlightRecorder] = {}  # the one recorder of this process, made by the first Communicator


def process_recorder(capacity: int) -> FlightRecorder | None:
    """This process's recorder (made on the first call, with ``capacity`` entries; later calls share it), or None
    when ``capacity`` is 0 (recording off for that Communicator). Installs the SIGUSR1 dump handler if the
    signal has its default action (a handler the program installed is never replaced)."""
    if capacity <= 0:
        return None
    made = _process.get("recorder")
    if made is None:
        made = _process.setdefault("recorder", FlightRecorder(capacity))
        _install_signal_handler(made)
    return made


def dump_trace(path: str | None = None) -> str:
    """Write this rank's dump of the process's recorder into the directory ``path`` (default
    ``MPCOMM_TRACE_DIR``) and return the file's path — what ``Communicator.dump_trace`` does, for code that holds
    no Communicator (a torch program on the ``mpcomm`` backend). Local; RuntimeError if nothing was recorded
    (no Communicator made yet, or ``MPCOMM_TRACE_BUFFER=0``)."""
    made = _process.get("recorder")
    if made is None:
        raise RuntimeError("mpcomm.trace.dump_trace: no flight recorder in this process (no Communicator was made "
                           "with MPCOMM_TRACE_BUFFER > 0)")
    return made.dump("dump_trace()", path, frame=sys._getframe(1))


def _install_signal_handler(made: FlightRecorder) -> None:
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(usr1) is not signal.SIG_DFL:
        return

    def on_signal(signum, frame):
        made.dump_quietly("SIGUSR1", frame)

    signal.signal(usr1, on_signal)
