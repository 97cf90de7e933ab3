"""The dispatch seam: where every collective of a Communicator is planned, started, checked, run and counted.

:class:`Dispatcher` is the part of :class:`~mpcomm.comm.Communicator` that turns a call into work on a transport.
Every collective — blocking, non-blocking, the meetings before a split or a protocol channel, and the calls the
torch backend plans itself — goes through :meth:`Dispatcher.run`: that is the one place a call starts and ends,
but for the blocking all-reduces whose plan makes them in one C call (:meth:`Dispatcher.run_express`).

* :meth:`~Dispatcher.plan` decides, once per (operation, dtype, shape, op, algorithm, root), what a call is
  (a cached :class:`~mpcomm.plan.Plan`: the algorithm, the reduction, the route for host or device buffers);
* :meth:`~Dispatcher.run` runs a plan under the deadline: it refuses on an unusable communicator or a second
  thread, makes the ranks agree on the call (``validate=True``), times it into ``stats()``, and makes the
  communicator unusable when a call stopped midway;
* :meth:`~Dispatcher.allgather_object` / :meth:`~Dispatcher.bcast_object` share Python objects (e.g. a tuning
  table, a model description) with the deadline;
* :meth:`~Dispatcher.protocol_transport` gives a protocol built on the Communicator (the pipeline's hand-offs)
  its own MPI communicator.

Public here means: what integrations (the torch backend, the engines, tuning, benchmarks) may use. The
collectives' argument checks and buffer handling stay in ``mpcomm.comm``. See ``docs/dispatch.md``.
"""
from __future__ import annotations

import atexit
import functools
import json
import sys
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, Sequence, cast

import numpy as np
from mpi4py import MPI

from . import p2p, staging, trace
from .algorithms import KEEP_LOW_PRECISION, EXPRESS, REGISTRY, compressed
from .algorithms.auto import Selector
from .algorithms.chunks import count_matrix
from .buffers import AVG, SUM, check_dtype_op, reduce_op, wire_dtype
from .compression import codec
from .errors import CollectiveMismatchError, MpcommError
from .plan import Plan
from .trace.stragglers import Stragglers
from .trace.timeline import NO_SPAN, NoSpan, Span, Timeline
from .transport import Transport, created
from .work import FutureWork, InlineProgress, Work, progress_thread_allowed

_clock = time.perf_counter  # (a module-level name: one lookup less on every call)
_PROTOCOL = Plan.meeting("protocol channel")
_SIZE_FOR_AUTO = Plan.sum_of_int64("all_to_all_v: the ranks agree on the bytes auto decides from")
PLAN_CACHE_SIZE = 1024  # plans kept (one per dtype, shape, op, algorithm and root)
NO_LAST_PLAN = (None, None, None, None, None)  # Communicator._planned_allreduce before its first cached plan

REDUCING = ("allreduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
PER_RANK_BLOCK = ("reduce_scatter", "all_gather", "gather", "scatter")  # planned on the buffer of one rank's block
FREED = "it was freed (free() was called)"
_STALE = ("; its messages may still be in flight, so later collectives could match them and return wrong data. "
          "Create a new Communicator.")


def new_totals() -> array:
    """A stats entry: calls, bytes, seconds, as doubles (an express call adds to its plan's in C)."""
    return array("d", (0.0, 0.0, 0.0))


def _record(t: Transport, plan: Plan, elapsed: float) -> None:
    """Count one call of ``plan`` that took ``elapsed`` seconds into ``t``'s stats."""
    totals = t.records.get(plan.key)  # per (operation, algorithm): bounded whatever the shapes
    if totals is None:
        totals = t.records[plan.key] = new_totals()
    _count(totals, plan.nbytes, elapsed)


def _count(totals: array, nbytes: int, elapsed: float) -> None:
    totals[0] += 1
    totals[1] += nbytes
    totals[2] += elapsed


class Dispatcher:
    """Plans, runs and counts the collectives of a Communicator (its base class; see the module docstring).

    The Communicator sets ``rank``, ``size``, ``timeout``, ``validate``, ``selector`` and its transports
    (``_sync`` for blocking collectives, ``_async`` for the progress thread, ``_p2p``, ``_base``) and then
    calls :meth:`_start_dispatch`.
    """

    rank: int
    size: int
    timeout: float
    selector: Selector
    _sync: Transport
    _async: Transport
    _p2p: p2p.Channels
    _base: MPI.Comm
    _progress: str
    _trace: "trace.GroupTrace | None"  # the flight recorder's lane of the blocking calls (see _start_trace)
    _stragglers: Stragglers | None = None  # MPCOMM_STRAGGLER: the reports of late ranks (see _agree)
    _meet = False  # whether the ranks exchange before every collective: validate, or straggler detection

    @property
    def validate(self) -> bool:
        """Whether the ranks compare every call before running it (``validate=True``)."""
        return self._validate

    @validate.setter
    def validate(self, value: bool) -> None:
        self._validate = value
        self._meet = value or self._stragglers is not None

    def _start_stragglers(self, threshold: float) -> None:
        """``threshold`` > 0 (MPCOMM_STRAGGLER, seconds): report ranks that come that much later than the others
        (``mpcomm.trace.stragglers``); the ranks then meet before every collective, as with validate=True."""
        self._stragglers = Stragglers(threshold) if threshold > 0 else None
        self._meet = self._validate or self._stragglers is not None

    def stragglers(self) -> dict:
        """The late ranks seen so far (``MPCOMM_STRAGGLER``; the same on every rank): ``threshold_s``,
        ``late_calls`` (rank -> collectives it came late to) and the last ``reports`` (rank, seconds late,
        sequence number, operation, lane). Empty when detection is off."""
        return {} if self._stragglers is None else self._stragglers.summary()

    def _start_dispatch(self) -> None:
        self._protocols: dict[str, Transport] = {}  # see protocol_transport
        self._executor: ThreadPoolExecutor | None = None
        self._inline: InlineProgress | None = None
        self._unusable: str | None = None  # why calls are refused: freed, or a collective stopped midway
        self._plans: dict = {}
        self._plans_generation = 0  # counts the times auto's choices changed (a table loaded): plans made again
        self._last_allreduce: tuple = NO_LAST_PLAN  # (dtype, shape, op, algorithm, plan) of the last cached all-reduce
        self._shortcut: Any = None  # native_calls.Shortcut: the Communicator's allreduce, where it is built

    # ------------------------------------------------------------------ public low-level API
    @property
    def transport(self) -> Transport:
        """The transport blocking collectives run on (mpcomm's private duplicate of the user's communicator):
        what :meth:`run` uses unless told otherwise, and what code that talks MPI beside the Communicator's own
        calls (the torch backend's C++ all-reduce, the network probe) is given."""
        return self._sync

    def unwatch(self) -> None:
        """native polls its non-blocking all-reduce again on this Communicator, not the blocking call under the
        watchdog (``algorithms.native.watch``); collective, before any all-reduce: code beside the Communicator that
        polls the same all-reduce (the torch backend's C++ call) must pair with it."""
        for t in (self._sync, self._async):
            t.unwatch()

    def plan(self, operation: str, array: Any, op: str | None = None, algorithm: str = "auto",
             root: int | None = None) -> Plan:
        """The :class:`~mpcomm.plan.Plan` of ``operation`` on ``array`` (a numpy or CuPy array: its dtype, shape
        and device decide), with reduction ``op`` (reducing operations), ``algorithm`` (``"auto"`` asks the
        selector) and ``root`` (rooted operations).

        Local: the checks that need no other rank (dtype and op, algorithm name, root) raise ``TypeError`` /
        ``ValueError`` here. Plans of host arrays are cached (up to ``PLAN_CACHE_SIZE``) until auto's choices
        change (a tuning table loaded). For rooted and per-rank-block operations plan on one rank's block, as
        the collectives do."""
        if operation in ROOTED:  # before the cache: True == 1 and 0.0 == 0 as dict keys
            self._check_root(root, operation)
        cacheable = type(array) is np.ndarray and type(op) in (str, type(None)) and type(algorithm) is str
        key = (operation, array.dtype, array.shape, op, algorithm, root) if cacheable else None
        plan = self._plans.get(key) if cacheable else None
        if plan is not None:
            return plan
        rop = None
        if operation in REDUCING:
            rop = reduce_op(cast(str, op), operation)  # (it names any value it cannot take, None included)
            check_dtype_op(array.dtype, rop.name, operation)
            if rop.name == AVG:
                rop = rop.averaged(self.size)  # each algorithm divides where it finishes a sum, before sharing it
        else:
            check_dtype_op(array.dtype, None, operation)
        nbytes = array.nbytes * (self.size if operation in PER_RANK_BLOCK else 1)  # stats: the whole buffer
        chosen = self._resolve(operation, algorithm, nbytes, array.dtype, None if rop is None else rop.name)
        host = type(array) is np.ndarray
        plan = Plan(operation, chosen, array, rop, root, nbytes, host=host,
                    wire=wire_dtype(array.dtype, widen=not (host and chosen in KEEP_LOW_PRECISION))
                    if rop is not None else array.dtype)
        if operation == "allreduce" and host and chosen in EXPRESS:  # (one C call on the buffer, or its work array)
            work = array if plan.direct else np.broadcast_to(np.empty((), plan.wire), array.shape)
            plan.totals = self._sync.records.setdefault(plan.key, new_totals())  # (its express call counts into it)
            plan.express = EXPRESS[chosen][0](self._sync, work, rop, plan.totals, nbytes)
        if cacheable:
            if len(self._plans) >= PLAN_CACHE_SIZE:  # shapes that vary (MoE, dynamic batches): the oldest goes
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def compressed_plan(self, array: Any, op: str, algorithm: str, wire: str, operation: str = "allreduce") -> Plan:
        """The plan of an all-reduce (or a reduce-scatter: ``array`` is then the receive buffer) of ``array`` sent
        as ``wire`` (a codec of ``mpcomm.compression``; see ``algorithms/compressed.py``). Local checks, before any
        communication: a known wire, a host float32 array (float64 too is refused rather than silently narrowed),
        op sum or avg, algorithm auto."""
        try:
            wire_codec = codec(wire)
        except ValueError as exc:
            raise ValueError(f"{operation}: {exc}") from None
        described = f"{operation} with wire={wire!r}"
        if algorithm != "auto":
            raise ValueError(f"{described} runs the compressed algorithm: pass algorithm='auto', not algorithm "
                             f"{algorithm!r}")
        if type(array) is not np.ndarray:
            raise TypeError(f"{described}: the codecs run on host numpy arrays; got a {type(array).__module__} "
                            f"{type(array).__name__}")
        if array.dtype != np.float32:
            raise TypeError(f"{described}: the buffer must be float32 (the codecs encode float32 and accumulate in "
                            f"float32), got {array.dtype} of shape {array.shape}; cast it, or pass wire=None")
        if reduce_op(op, operation).name not in (SUM, AVG):
            raise TypeError(f"{described}: op {op!r} is not supported with a lossy wire; use 'sum' or 'avg', or "
                            "wire=None")
        base = self.plan(operation, array, op, "direct")
        body = compressed.allreduce if operation == "allreduce" else compressed.reduce_scatter
        return base.compressed(wire, functools.partial(body, codec=wire_codec))

    def run(self, plan: Plan, *buffers: Any, transport: Transport | None = None, counts: tuple | None = None,
            record: bool = True) -> None:
        """Run ``plan`` on ``buffers`` (the arguments of its algorithm: ``plan.fn(transport, *buffers)``), on
        ``transport`` (default :attr:`transport`). Collective: every rank runs the same plan in the same order.

        Refuses (``MpcommError``) on an unusable communicator or while another thread runs a collective here;
        with ``validate=True`` the ranks first agree on the call (``counts``: all_to_all_v's send and receive
        counts, checked for consistency); the algorithm's time goes into ``stats()`` unless ``record`` is false;
        a failure midway makes the communicator unusable. This is the one place every collective starts and
        ends."""
        t = self._sync if transport is None else transport
        if self._unusable is not None or not t.in_use.acquire(False):
            self._refuse(plan)
        try:
            if self._inline is not None and t is self._sync:
                self._inline.run_until(None)
            t.operation = plan.label
            start, trace = _clock(), t.trace  # the flight recorder's lane (mpcomm.trace): None when off
            if trace is not None:  # (GroupTrace.started, inline: see bench/results/trace_cost.md)
                trace.collectives += 1
                slot = next(trace.slots)
                trace.groups[slot] = trace
                trace.calls[slot] = plan
                trace.starts[slot] = start
            if self._meet:  # (validate=True, or straggler detection: the ranks exchange first)
                self._agree(t, plan, counts)
                start = _clock()  # (stats time the algorithm alone)
            plan.fn(t, *buffers)
            end = _clock()
            elapsed = end - start
            if trace is not None:
                trace.ends[slot] = end  # (GroupTrace.completed, without the call)
            self._check_still_usable(plan)
        except Exception as exc:
            self._raise_midway(t, plan, exc)
        finally:
            t.in_use.release()
        if record:
            _record(t, plan, elapsed)

    def run_express(self, plan: Plan, buf) -> bool:
        """:meth:`run` of ``plan`` on ``buf`` (a host array of the plan's wire dtype and size: the user's buffer or
        its work array) in one C call, the plan's :attr:`~mpcomm.plan.Plan.express`, where run() has nothing else
        to do: no validation, nothing queued to run first. The call takes the transport's lock, reads the clock and
        counts itself into the stats (in C: as Python calls those would cost as much as the call). False, with
        nothing sent, where it does not take ``buf`` (not writable and C-contiguous) or the lock is held: the caller
        runs the plan (which refuses a second thread). Refusals, the flight recorder, errors midway and stats as
        run()'s."""
        t, inline, express = self._sync, self._inline, plan.express
        if self._meet or (inline is not None and inline.queue) or self._unusable is not None:
            return False
        try:
            outcome = express(buf)
        except Exception as exc:  # (the lock given back)
            outcome = exc
        if outcome is None:  # (done, and counted)
            trace = t.trace  # (recorded once the call is made: it returns within its tests, or has met every rank)
            if trace is not None:  # (GroupTrace.started, inline: as run()'s)
                trace.collectives += 1
                slot = next(trace.slots)
                trace.groups[slot] = trace
                trace.calls[slot] = plan
                trace.starts[slot] = express.started
                trace.ends[slot] = express.ended
            return True
        return self._express_outcome(plan, buf, outcome)

    def _express_outcome(self, plan: Plan, buf, outcome) -> bool:
        """The rest of :meth:`run_express` after its call returned ``outcome`` other than done: False for
        NotImplemented (nothing sent); an exception raised as run()'s would be; else the call still running, the
        lock still held: waited for within the deadline, finished, counted and recorded (True)."""
        t, express = self._sync, plan.express
        if outcome is NotImplemented:
            return False
        if isinstance(outcome, Exception):
            t.operation = plan.label
            self._raise_midway(t, plan, outcome)
        trace = t.trace
        slot = trace.started(plan, express.started) if trace is not None else 0
        try:
            t.operation = plan.label
            EXPRESS[plan.algorithm][1](t, buf, plan.rop, outcome)
            self._check_still_usable(plan)
            end = _clock()
            if trace is not None:
                trace.ends[slot] = end
        except Exception as exc:
            self._raise_midway(t, plan, exc)
        finally:
            t.in_use.release()
        _count(plan.totals, plan.nbytes, end - express.started)
        return True

    def allgather_object(self, obj: Any, operation: str = "allgather_object") -> list:
        """Every rank's ``obj`` (pickled), in rank order. Collective; waits are bounded by the timeout and a
        timeout names ``operation``."""
        self._refuse_if_freed(operation)
        with self._sync.running(operation):
            return self._sync.allgather_object(obj)

    def bcast_object(self, obj: Any, root: int = 0, operation: str = "bcast_object") -> Any:
        """``root``'s ``obj`` (pickled) on every rank. Collective; waits are bounded by the timeout and a timeout
        names ``operation``."""
        self._refuse_if_freed(operation)
        self._check_rank(root, "root", operation)
        with self._sync.running(operation):
            return self._sync.bcast_object(obj, root=root)

    def protocol_transport(self, name: str) -> Transport:
        """A private MPI communicator for messages whose sizes both sides agreed beforehand (so no envelope), of
        a protocol built on this Communicator (e.g. the pipeline executor's hand-offs): made on the first call
        for ``name`` — collective then, after a meeting with the deadline — reused after, freed with it."""
        t = self._protocols.get(name)
        if t is None:
            self.run(_PROTOCOL)
            t = Transport(created(self._base.Dup, name, self.rank), self.timeout, on_timeout=p2p.ON_TIMEOUT)
            t.operation = name
            t.progress_hook = self._p2p.progress
            self._protocols[name] = t
        return t

    def stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Measured totals: ``{operation: {algorithm: {"calls", "bytes", "seconds"}}}``."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for t in (self._sync, self._async):
            for (operation, algorithm), (calls, nbytes, seconds) in list(t.records.items()):
                if not calls:
                    continue  # (an entry made with a plan, or zeroed by reset_stats, with no call since)
                record = out.setdefault(operation, {}).setdefault(algorithm, {"calls": 0, "bytes": 0, "seconds": 0.0})
                record["calls"] += int(calls)
                record["bytes"] += int(nbytes)
                record["seconds"] += seconds
        return out

    def footprint(self) -> dict[str, int]:
        """What this Communicator keeps for reuse, each bounded whatever the calls: ``records`` (stats entries),
        ``plans`` (cached plans), ``choices`` (auto's remembered decisions), ``scratch_bytes`` (scratch buffers
        of its transports)."""
        transports = (self._sync, self._async, self._p2p.envelopes, self._p2p.payloads)
        return {"records": len(self._sync.records) + len(self._async.records), "plans": len(self._plans),
                "choices": self.selector.decisions_kept, "scratch_bytes": sum(t.scratch_bytes() for t in transports)}

    def reset_stats(self) -> None:
        for t in (self._sync, self._async):
            for totals in t.records.values():
                totals[:] = new_totals()  # in place: a plan with an express call counts into its entry

    # ------------------------------------------------------------------ the flight recorder
    def _start_trace(self, capacity: int, base: MPI.Comm, timeline: str = "") -> None:
        """Give the transports their lanes of this process's flight recorder (``capacity`` 0: none, recording
        off): blocking collectives and point-to-point, and the non-blocking collectives, each numbered in its
        own order (the same on every rank). ``timeline`` (MPCOMM_TIMELINE): the file of the timeline that the
        process's first Communicator over the whole world starts, written when the interpreter exits."""
        recorder = trace.process_recorder(capacity)
        lanes = recorder.communicator(base, self.timeout, ("", "async")) if recorder is not None else (None, None)
        self._sync.trace, self._async.trace = lanes
        self._trace = self._sync.trace
        if recorder is not None:  # a point-to-point wait that times out (blocking or a Work's) dumps too
            rank = self.rank
            self._p2p.timed_out = lambda exc: recorder.dump_quietly(f"CommTimeoutError in {exc.operation} "
                                                                    f"(rank {rank})")
        if timeline and recorder is not None and not recorder.timelines and self.size == recorder.world_size:
            atexit.register(Timeline(base, self.timeout, timeline, recorder).stop_at_exit)

    def timeline(self, path: str) -> Timeline:
        """Start recording a timeline of this process's calls (every Communicator's), to be written to ``path``
        as Chrome-trace / Perfetto JSON by rank 0 of this communicator when it stops (``with comm.timeline(path):``,
        or ``.stop()``). Collective: measures the clock offsets between the ranks (see ``docs/trace.md``)."""
        if self._trace is None:
            raise MpcommError(f"rank {self.rank}: timeline({path!r}): the flight recorder is off "
                              "(MPCOMM_TRACE_BUFFER=0), and the timeline follows its lanes")
        return Timeline(self._base, self.timeout, path, self._trace.recorder)

    def span(self, name: str, **args: Any) -> Span | NoSpan:
        """An engine's span of work on this communicator for the timeline (a ``with`` block, or ``.end()``):
        a DDP bucket's all-reduce, an FSDP unit's gather. Nothing is measured when no timeline records."""
        trace = self._trace
        timeline = None if trace is None else trace.timeline
        return NO_SPAN if timeline is None else timeline.span(trace, name, args)

    def add_spans(self, spans: Sequence[tuple[str, float, float]]) -> None:
        """Engine spans measured already, ``(name, start, end)`` in ``time.perf_counter()`` seconds (the
        pipeline's actions), for the timeline; dropped when none records."""
        trace = self._trace
        if trace is not None and trace.timeline is not None:
            trace.timeline.add_spans(trace, spans)

    @property
    def recording_timeline(self) -> bool:
        """Whether a timeline records this communicator's calls (engines skip measuring spans otherwise)."""
        return self._trace is not None and self._trace.timeline is not None

    def dump_trace(self, path: str | None = None) -> str:
        """Write this rank's flight-recorder dump (the last ``MPCOMM_TRACE_BUFFER`` calls of every Communicator of
        the process) into the directory ``path`` (default ``MPCOMM_TRACE_DIR``, see ``docs/trace.md``); returns
        the file written. Local: it never waits for another rank. ``python -m mpcomm.trace DIR`` reads them."""
        if self._trace is None:
            raise MpcommError(f"rank {self.rank}: dump_trace: the flight recorder is off (MPCOMM_TRACE_BUFFER=0)")
        return self._trace.recorder.dump("dump_trace()", path, frame=sys._getframe(1))

    # ------------------------------------------------------------------ non-blocking calls
    def _submit(self, operation: str, body, *args) -> Work:
        """Queue ``body(t, *args)`` (checked as the blocking form is: :meth:`_checked`): on the progress thread
        (one worker, so operations run in issue order), or, when MPI cannot be called from two threads, to run
        inside ``wait()`` (progress on wait). The body runs on the caller's current CUDA stream (device buffers:
        see ``mpcomm.staging``)."""
        self._refuse_if_freed(operation)

        def run(t):
            return self._checked(body, operation, *args, t=t)

        run = staging.on_stream(staging.caller_stream(), run)
        if self._executor is None and self._inline is None:
            if self._progress == "thread" and progress_thread_allowed():
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mpcomm-progress-{self.rank}")
            else:
                self._inline = InlineProgress()
        if self._inline is not None:
            return self._inline.submit(run, self._async, operation)
        assert self._executor is not None  # made above
        return FutureWork(self._executor.submit(run, self._async), operation, self._others(), self.rank,
                          self._async.waiters)

    def _drain_deferred(self) -> None:
        """Progress on wait: run the queued non-blocking collectives before a blocking one, so every rank
        runs all its collectives in issue order whatever it waits on first."""
        if self._inline is not None:
            self._inline.run_until(None)

    # ------------------------------------------------------------------ argument errors and refusals
    def _checked(self, body, operation: str, *args, t: Transport | None = None):
        """``body(t, *args)``; an argument error it raises first goes through :meth:`_rejected`."""
        t = self._sync if t is None else t
        try:
            return body(t, *args)
        except (TypeError, ValueError) as exc:
            self._rejected(t, operation, exc)

    def _rejected(self, t: Transport, operation: str, exc: Exception):
        """Re-raise the argument error ``exc`` of this rank; with validate=True first show the others, who are
        comparing calls, what was rejected (they raise CollectiveMismatchError naming it at once, rather than
        wait for this rank until the timeout). Ranks that all rejected the same arguments agree, and each
        raises its own error."""
        if self._validate and self._unusable is None and not isinstance(exc, MpcommError):
            try:
                self._agree(t, Plan.rejected(operation, exc), None)
            except MpcommError:
                pass  # the others were told; this rank's own error is the one to raise
        raise exc

    def _refuse(self, plan: Plan) -> None:
        """Raise: the communicator is unusable, or another thread is running a collective on it."""
        if self._unusable is not None:
            raise MpcommError(f"rank {self.rank}: {plan.label}: this communicator is unusable: {self._unusable}"
                              + ("" if self._unusable == FREED else _STALE))
        self._concurrent_use(plan)

    def _refuse_if_freed(self, operation: str) -> None:
        if self._unusable == FREED:
            raise MpcommError(f"rank {self.rank}: {operation}: this Communicator was freed (free() was called)")

    def _check_still_usable(self, plan: Plan) -> None:
        if self._unusable is not None:  # made unusable while this ran (another thread joined in)
            raise MpcommError(f"rank {self.rank}: {plan.label}: {self._unusable}; this result may be wrong")

    def _raise_midway(self, t: Transport, plan: Plan, exc: Exception) -> NoReturn:
        """Raise what a collective that raised ``exc`` raises: an MpcommError (the MPI library's error made one),
        the communicator made unusable, for it stopped midway; CollectiveMismatchError (the ranks compared their
        calls and stopped cleanly: nothing in flight) and any other error as they are."""
        if isinstance(exc, CollectiveMismatchError):
            raise exc
        if isinstance(exc, MPI.Exception):  # the MPI library itself refused (e.g. aliased buffers)
            error = t._mpi_error(exc, [], t.others)
            self._stopped_midway(plan, error)
            raise error from None
        if isinstance(exc, MpcommError):
            self._stopped_midway(plan, exc)
        raise exc

    def _stopped_midway(self, plan: Plan, exc: Exception) -> None:
        if self._unusable is None:
            self._unusable = f"{plan.label} stopped midway ({type(exc).__name__}: {exc})"
            if self._trace is not None:
                self._trace.recorder.dump_quietly(f"{type(exc).__name__} in {plan.label} (rank {self.rank})")

    def _concurrent_use(self, plan: Plan) -> None:
        """A second thread called a collective while one runs: the order of calls can differ between ranks,
        so messages could pair with the wrong call. Refuse, and poison the communicator so that the call
        already running reports it too."""
        message = (f"{plan.label} was called from thread {threading.current_thread().name!r} while another "
                   "collective of this communicator was running in another thread; collectives of one "
                   "Communicator must be called from one thread at a time, in the same order on every rank")
        if self._unusable is None:
            self._unusable = message
        raise MpcommError(f"rank {self.rank}: {message}")

    # ------------------------------------------------------------------ agreement between the ranks
    def _agree(self, t: Transport, plan: Plan, counts: tuple | None) -> None:
        """validate=True: the ranks compare their calls' digests (the whole signature, any length); on a
        difference every rank raises, listing what each passed. ``counts`` (all_to_all_v: send and receive
        counts) are checked for consistency (what rank i sends rank j is what j expects from i)."""
        stragglers = self._stragglers
        if stragglers is not None and not self._validate:  # this rank's wait at the previous exchange here
            self._exchange_waits(t, plan, np.array([t.previous_wait]), np.empty(self.size))
            return
        mine = plan.digest
        if stragglers is not None:  # the digest, then the wait's 8 bytes (mpcomm.trace.stragglers)
            mine = np.concatenate((mine, np.array([t.previous_wait]).view(np.uint8)))
        everyone = np.empty((self.size, mine.size), dtype=np.uint8)
        self._exchange_waits(t, plan, mine, everyone)
        if stragglers is not None:
            everyone = everyone[:, :-8]
        if not (everyone == plan.digest).all():
            calls = t.allgather_object(plan.signature)
            described = "; ".join(f"rank {r}: {json.dumps(call, sort_keys=True)}" for r, call in enumerate(calls))
            raise CollectiveMismatchError(f"rank {self.rank}: {plan.signature['operation']}: ranks disagree — "
                                          f"{described}")
        if counts is not None:
            _, problem = count_matrix(t, *counts)
            if problem:
                raise CollectiveMismatchError(f"rank {self.rank}: {plan.signature['operation']}: {problem}")

    def _exchange_waits(self, t: Transport, plan: Plan, mine: np.ndarray, everyone: np.ndarray) -> None:
        """All-gather ``mine`` into ``everyone`` (bounded by the deadline); with straggler detection, time this
        rank's wait in it and hand every rank's previous wait (the last 8 bytes of each row) to the reports."""
        stragglers = self._stragglers
        if stragglers is None:
            t.wait([t.mpi.Iallgather(mine, everyone)], t.others)
            return
        entered = _clock()
        t.wait([t.mpi.Iallgather(mine, everyone)], t.others)
        t.previous_wait = _clock() - entered
        waits = everyone if everyone.dtype == np.float64 else everyone[:, -8:].copy().view(np.float64).ravel()
        stragglers.arrived(waits.tolist(), t.previous_call, t.trace)
        t.previous_call = (None if t.trace is None else t.trace.collectives, plan)

    def _agreed_choice(self, t: Transport, operation: str, nbytes: int, dtype) -> str:
        """auto's algorithm for a call whose bytes differ between ranks by nature (all_to_all_v): the one for the
        ranks' mean bytes, agreed with one 8-byte all-reduce, so every rank runs the same algorithm."""
        total = np.zeros(1, dtype=np.int64)
        self.run(_SIZE_FOR_AUTO, np.array([nbytes], dtype=np.int64), total, transport=t, record=False)
        return self.selector.choose(operation, int(total[0]) // self.size, np.dtype(dtype))

    # ------------------------------------------------------------------ plans
    def _resolve(self, operation: str, algorithm: str, nbytes: int, dtype, op: str | None = None) -> str:
        if algorithm == "auto":
            return self.selector.choose(operation, nbytes, np.dtype(dtype), op)
        if not isinstance(algorithm, str) or algorithm not in REGISTRY[operation]:
            raise ValueError(
                f"{operation}: unknown algorithm {algorithm!r}; choose one of {sorted(REGISTRY[operation]) + ['auto']}"
            )
        return algorithm

    def _use_table(self, table: dict, source: str) -> bool:
        """Make auto choose from ``table``; the plans remember auto's choices, so they are made again."""
        loaded = self.selector.load(table, source=source)
        self._plans.clear()
        self._plans_generation += 1
        self._last_allreduce = NO_LAST_PLAN
        if self._shortcut is not None:
            self._shortcut.forget()
        return loaded

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def _check_rank(self, rank: int, role: str, operation: str) -> None:
        if type(rank) is int and 0 <= rank < self.size:
            return
        if type(rank) is not int and not isinstance(rank, np.integer) or not 0 <= rank < self.size:
            raise ValueError(f"{operation}: {role} {rank!r} is not a rank of a communicator of size {self.size} "
                             f"(an int in 0..{self.size - 1})")

    def _check_root(self, root, operation: str) -> None:
        """ValueError for a root that is no rank. Without validate=True the other ranks may be running the
        collective with their own root, and their messages to this rank would be taken for a later call's: so the
        communicator becomes unusable here (the others' next collective with this rank times out naming it)."""
        try:
            self._check_rank(root, "root", operation)
        except ValueError as exc:
            if self._validate or self._unusable is not None:
                raise  # validate=True: _rejected tells every rank at once, and nothing is left in flight
            self._unusable = (f"{operation} was called with root {root!r} on this rank, and other ranks may have run it "
                              "with another root, leaving messages for this rank that a later call would take")
            raise ValueError(f"{exc}; this Communicator is now unusable on rank {self.rank} (with validate=True every "
                             "rank raises at once instead)") from None
