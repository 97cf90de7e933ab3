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
from typing import Any

from mpi4py import MPI

_clock = time.perf_counter
_thread_id = threading.get_ident
DEFAULT_BUFFER = 2000  # entries kept per process (MPCOMM_TRACE_BUFFER); its cost: docs/trace.md
FILE_PREFIX = "mpcomm_trace_rank_"
TORCH_FORMAT_VERSION = "2.10"  # the flight-recorder dump version of torch 2.14 (fr_trace checks it is "M.m")
FRAMES_KEPT = 32  # innermost frames of a stack written per entry / thread
# torch's names for the operations (its fr_trace matches collectives by them); the prefix names the library
_TORCH_NAMES = {"allreduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
                "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
                "all_to_all": "all_to_all", "all_to_all_v": "all_to_all_v_single", "barrier": "barrier",
                "split": "split", "send": "send", "recv": "recv"}
_PER_RANK_BLOCK = ("reduce_scatter", "all_gather", "gather", "scatter")  # the plan holds one rank's block


def default_dir() -> str:
    """``MPCOMM_TRACE_DIR``, else ``<temp dir>/mpcomm_trace`` (e.g. /tmp/mpcomm_trace): node-local, so a dump
    never waits on a shared file system."""
    return os.environ.get("MPCOMM_TRACE_DIR") or os.path.join(tempfile.gettempdir(), "mpcomm_trace")


class FlightRecorder:
    """A ring of the last ``capacity`` calls of every Communicator of this process."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: list[Any] = [None] * capacity  # (record id, group, collective seq, p2p seq, what, start, thread)
        self.ends: list[float] = [0.0] * capacity  # when the entry's call completed (0.0: it has not)
        self.ids = itertools.count()  # next() is atomic under the GIL: threads never share a slot by a race
        self.groups: list[GroupTrace] = []
        self._names: dict[tuple[int, ...], int] = {}  # communicators made so far over each set of world ranks
        self._lock = threading.Lock()
        self._epoch_ns = time.time_ns() - int(_clock() * 1e9)  # perf_counter -> wall clock, for the dump
        self.world_rank, self.world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

    def group(self, mpi_comm: MPI.Comm, timeout: float) -> "GroupTrace":
        """The trace of a new Communicator over ``mpi_comm``. Its name is the same on every member: the world
        ranks it spans and how many communicators over those ranks this process made before (MPI requires the
        members to make them in the same order)."""
        world = MPI.COMM_WORLD.Get_group()
        try:
            ranks = tuple(mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.Get_size())), world))
        finally:
            world.Free()
        with self._lock:
            made = self._names.get(ranks, 0)
            self._names[ranks] = made + 1
            group = GroupTrace(self, len(self.groups), f"{_describe_ranks(ranks)}#{made}", ranks,
                               mpi_comm.Get_rank(), timeout)
            self.groups.append(group)
        return group

    # ------------------------------------------------------------------ dumps
    def snapshot(self, reason: str, frame=None) -> dict:
        """The dump's dictionary (torch's flight-recorder layout plus ``"mpcomm"``); ``frame``: the innermost
        frame of the calling thread to report (a signal handler's interrupted frame), else the caller's."""
        stacks = _stacks(frame if frame is not None else sys._getframe(1))
        names = {t.ident: t.name for t in threading.enumerate()}
        records = [(entry, self.ends[i]) for i, entry in enumerate(list(self.entries)) if entry is not None]
        records.sort(key=lambda record: record[0][0])
        return {
            "version": TORCH_FORMAT_VERSION,
            "comm_lib_version": f"mpcomm / {MPI.Get_library_version().splitlines()[0].strip()}",
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))} for g in self.groups},
            "pg_status": {str(g.pg_id): g.status() for g in self.groups},
            "entries": [self._entry(entry, end, stacks, names) for entry, end in records],
            "mpcomm": {"reason": reason, "world_rank": self.world_rank, "world_size": self.world_size,
                       "host": socket.gethostname(), "pid": os.getpid(), "time_ns": time.time_ns(),
                       "capacity": self.capacity, "recorded": self.recorded(),
                       "stacks": {names.get(ident, str(ident)): frames for ident, frames in stacks.items()}},
        }

    def recorded(self) -> int:
        """How many calls were recorded since the start (the oldest are gone once more than ``capacity``)."""
        return max((entry[0] + 1 for entry in list(self.entries) if entry is not None), default=0)

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

    def _entry(self, entry: tuple, end: float, stacks: dict, names: dict) -> dict:
        record_id, group, seq, p2p_seq, what, start, thread = entry
        operation, algorithm, nbytes, inputs, outputs, dtype, extra, peer = _describe(what, group)
        seen_done = type(what) is tuple and getattr(what[-1], "_done", False)  # a Work whose wait saw it done
        is_p2p = operation in ("send", "recv")
        name = _TORCH_NAMES.get(operation) or _bare_name(what)
        if is_p2p:  # torch's "send 0->1" / "recv 1<-0", in the communicator's ranks
            name = f"{name} {group.rank}->{peer}" if operation == "send" else f"{name} {group.rank}<-{peer}"
        started_ns = self._epoch_ns + int(start * 1e9)
        done = end > 0.0 or seen_done  # (a Work's: when it completed is not known, only that it did)
        return {
            "record_id": record_id, "pg_id": group.pg_id, "process_group": (group.name, group.desc),
            "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": record_id,
            "profiling_name": f"mpcomm:{name}", "time_created_ns": started_ns,
            "time_discovered_started_ns": started_ns,
            "time_discovered_completed_ns": self._epoch_ns + int(end * 1e9) if end > 0.0 else 0,
            **({"duration_ms": (end - start) * 1e3} if end > 0.0 else {}),
            "input_sizes": inputs, "input_dtypes": [dtype] * len(inputs),
            "output_sizes": outputs, "output_dtypes": [dtype] * len(outputs),
            "state": "completed" if done else "started", "retired": done,
            "timeout_ms": int(group.timeout * 1e3), "is_p2p": is_p2p,
            "frames": [] if done else stacks.get(thread, []),  # (only a call in flight: its stack is the thread's)
            "thread_id": str(thread), "thread_name": names.get(thread, ""),
            "operation": operation, "algorithm": algorithm, "bytes": nbytes, **extra,
        }


class GroupTrace:
    """One Communicator's side of the recorder: its name, members, sequence numbers, and the two calls that
    record (:meth:`started`, :meth:`completed`)."""

    __slots__ = ("recorder", "pg_id", "name", "desc", "ranks", "rank", "timeout", "collectives", "p2p",
                 "_entries", "_ends", "_ids", "_capacity")

    def __init__(self, recorder: FlightRecorder, pg_id: int, name: str, ranks: tuple[int, ...], rank: int,
                 timeout: float):
        self.recorder, self.pg_id, self.name, self.ranks, self.rank = recorder, pg_id, name, ranks, rank
        self.desc = "world" if len(ranks) == recorder.world_size and ranks == tuple(sorted(ranks)) else "split"
        self.timeout = timeout
        self.collectives = self.p2p = 0  # calls started so far (torch's collective_seq_id / p2p_seq_id)
        self._entries, self._ends, self._ids, self._capacity = (recorder.entries, recorder.ends, recorder.ids,
                                                                recorder.capacity)

    def started(self, plan, start: float) -> int:
        """Record that a collective run by ``plan`` started at ``start`` (``time.perf_counter()``, the caller's
        own reading: one clock call less); returns the slot for :meth:`completed`."""
        seq = self.collectives = self.collectives + 1
        record_id = next(self._ids)
        slot = record_id % self._capacity
        self._ends[slot] = 0.0
        self._entries[slot] = (record_id, self, seq, self.p2p, plan, start, _thread_id())
        return slot

    def started_p2p(self, operation: str, peer, array, work=None) -> int:
        """Record the start of a ``send`` / ``recv`` of ``array`` with ``peer``; ``work``: the Work of a
        non-blocking one, completed in the dump once a wait saw it done."""
        seq = self.p2p = self.p2p + 1
        record_id = next(self._ids)
        slot = record_id % self._capacity
        self._ends[slot] = 0.0
        what = (operation, peer if type(peer) is int else -1, tuple(getattr(array, "shape", ())), str(getattr(array, "dtype", "")),
                int(getattr(array, "nbytes", 0)), work)
        self._entries[slot] = (record_id, self, self.collectives, seq, what, _clock(), _thread_id())
        return slot

    def completed(self, slot: int, end: float) -> None:
        """Record that the call of :meth:`started`'s ``slot`` completed at ``end`` (``time.perf_counter()``)."""
        self._ends[slot] = end

    def status(self) -> dict:
        return {"last_enqueued_collective": self.collectives, "last_started_collective": self.collectives,
                "last_completed_collective": self.collectives}


def _describe(what, group: GroupTrace):
    """(operation, algorithm, bytes, input sizes, output sizes, dtype, extra keys, peer) of a recorded call."""
    if type(what) is tuple:  # point to point: (operation, peer, shape, dtype, bytes, Work or None)
        operation, peer, shape, dtype, nbytes, _ = what
        sizes = [list(shape)]
        return operation, "p2p", nbytes, sizes if operation == "send" else [], \
            sizes if operation == "recv" else [], dtype, {}, peer
    signature = what.signature
    operation, shape = what.operation, signature.get("shape")
    dtype = signature.get("dtype") or ""
    block = [] if shape is None else list(shape)
    whole = [_numel(block) * len(group.ranks)]
    inputs, outputs = {"reduce_scatter": ([whole], [block]), "all_gather": ([block], [whole]),
                       "gather": ([block], [whole]), "scatter": ([whole], [block])}.get(
        operation, ([block], [block]) if shape is not None else ([], []))
    extra = {key: signature[key] for key in ("op", "root") if signature.get(key) is not None}
    return operation, what.algorithm, what.nbytes, inputs, outputs, dtype, extra, None


def _bare_name(plan) -> str:
    """torch's name for mpcomm's own meetings and agreements (a barrier, or an all-reduce of one int64)."""
    return "all_reduce" if getattr(plan.fn, "__name__", "") == "_sum_of_int64" else "barrier"


def _numel(shape: list) -> int:
    count = 1
    for extent in shape:
        count *= extent
    return count


def _stacks(current) -> dict[int, list[dict]]:
    """Every thread's stack as torch writes frames ({"name", "filename", "line"}), innermost first; the calling
    thread's from ``current``."""
    frames = sys._current_frames()
    frames[threading.get_ident()] = current
    return {ident: _frames(frame) for ident, frame in frames.items()}


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


def recorder(capacity: int) -> FlightRecorder | None:
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


def _install_signal_handler(made: FlightRecorder) -> None:
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(usr1) is not signal.SIG_DFL:
        return

    def on_signal(signum, frame):
        made.dump_quietly("SIGUSR1", frame)

    signal.signal(usr1, on_signal)
