"""Communicator: validates arguments, dispatches to an algorithm, records what it measured.

It holds no algorithm bodies (those live in ``mpcomm.algorithms``). Private duplicates of the user's
communicator keep traffic apart: blocking collectives, point-to-point envelopes and payloads, and the
non-blocking collectives that run on the progress thread, so messages of one kind can never match another.

What a call needs that depends only on (dtype, shape, op, algorithm) — the algorithm chosen, the reduction,
the labels of its error messages, its validation signature — is decided once into a :class:`~mpcomm.plan.Plan`
and cached, so a training loop's repeated calls go straight from the argument checks to MPI.
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import p2p, staging, trace
from .algorithms import KEEP_LOW_PRECISION
from .algorithms.auto import Selector
from .algorithms.chunks import count_matrix
from .buffers import (
    AVG,
    SUM,
    NoBuffer,
    WorkArray,
    as_input,
    as_output,
    check_dtype_op,
    reduce_op,
    same_device,
    wire_dtype,
)
from .errors import CollectiveMismatchError, CommTimeoutError, ConfigError, MpcommError
from .p2p import ANY_SOURCE, Status
from .plan import Plan
from .settings import DEFAULT_TIMEOUT, Settings, agree
from .transport import Transport, created, duplicate, node_topology
from .work import FutureWork, InlineProgress, Work, progress_thread_allowed

_clock = time.perf_counter  # (a module-level name: one lookup less on every call)
_BARRIER = Plan.barrier()
_SPLIT = Plan.meeting("split")
_PROTOCOL = Plan.meeting("protocol channel")
_SIZE_FOR_AUTO = Plan.sum_of_int64("all_to_all_v: the ranks agree on the bytes auto decides from")
PLAN_CACHE_SIZE = 1024  # plans kept (one per dtype, shape, op, algorithm and root)
FREE_AGREEMENT_SECONDS = 10.0  # at most this long free() waits for the other ranks (see Communicator.free)


class Communicator:
    """A group of MPI processes and the collectives mpcomm runs over it."""

    def __init__(
        self,
        comm: MPI.Comm | "Communicator" | None = None,
        timeout: float | None = None,
        validate: bool | None = None,
        ranks_per_node: int | None = None,
    ):
        if isinstance(comm, Communicator):
            comm = comm.mpi
        mpi = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(mpi, MPI.Intracomm) or mpi == MPI.COMM_NULL:
            raise TypeError(f"Communicator: expected an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {mpi!r}")
        self.mpi: MPI.Comm = mpi
        self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
        self._owned: MPI.Comm | None = None  # the wrapped communicator, when this object made it (split) and frees it
        try:
            settings, problem = Settings.resolve(timeout, validate, ranks_per_node), None
        except ConfigError as exc:
            settings, problem = None, str(exc)
        # The one thing mpcomm starts on the user's communicator is its own duplicate (MPI_Comm_idup, with the
        # deadline): all else, the settings' agreement first, runs on communicators it made, so a late or absent
        # rank can never leave a message or a half-done collective where the user's own calls would match it.
        base = duplicate(mpi, settings.timeout if settings else DEFAULT_TIMEOUT)
        made = [base]
        try:
            self._build(base, settings, problem, made)
        except CommTimeoutError:
            raise  # something may be in flight on them: left allocated (see free())
        except MpcommError:  # the settings refused, or MPI out of communicators: they are idle, give them back
            for mpi_comm in made:
                mpi_comm.Free()
            raise

    def _build(self, base: MPI.Comm, settings: Settings | None, problem: str | None, made: list) -> None:
        """The constructor's collective part, on ``base`` (mpcomm's duplicate); ``made`` collects the MPI
        communicators made, for the constructor to free if this fails."""
        agree(Transport(base, settings.timeout if settings else DEFAULT_TIMEOUT), settings, problem)
        self._base = base  # its collectives: those that complete or fail the constructor, split() and free()
        self.timeout, self.validate = settings.timeout, settings.validate
        self.ranks_per_node, self._progress = settings.ranks_per_node, settings.progress
        topology = created(lambda: node_topology(Transport(base, self.timeout), self.ranks_per_node),
                           "Communicator", self.rank)
        self.node_rank, self.node_size = topology.node_rank, topology.node_size
        self.num_nodes, self.node_sizes = len(topology.node_sizes), topology.node_sizes
        self.ranks_per_core = topology.ranks_per_core  # > 1: ranks share cores (the auto model accounts for it)

        def private() -> MPI.Comm:
            made.append(created(base.Dup, "Communicator", self.rank))
            return made[-1]

        self._sync = Transport(private(), self.timeout, self.ranks_per_node)
        # The payloads reuse the duplicate: only point-to-point runs there besides the agreements, and MPI never
        # matches a collective with a point-to-point message.
        self._p2p = p2p.Channels(envelopes=Transport(private(), self.timeout, on_timeout=p2p.ON_TIMEOUT),
                                 payloads=Transport(base, self.timeout, on_timeout=p2p.ON_TIMEOUT))
        # Made here, not on first use: Dup is collective, and starting a non-blocking collective must not block.
        self._async = Transport(private(), self.timeout, self.ranks_per_node)
        self._sync.progress_hook = self._async.progress_hook = self._p2p.progress  # (see mpcomm.p2p.Channels)
        if self.ranks_per_core > 1:  # (collectives only: a receive yielding sooner lost its core to ranks that
            for t in (self._sync, self._async):  # spin elsewhere: p = 4 ping-pong 12.6 -> 50 us on 2 cores)
                t.share_cores()
        self._protocols: dict[str, Transport] = {}  # see _protocol_transport
        self._executor: ThreadPoolExecutor | None = None
        self._inline: InlineProgress | None = None
        self._unusable: str | None = None  # why calls are refused: freed, or a collective stopped midway
        self._plans: dict = {}
        self._plans_generation = 0  # counts the times auto's choices changed (a table loaded): plans made again
        recorder = trace.process_recorder(settings.trace_buffer)
        # The flight recorder's lanes (None: off): blocking collectives and point-to-point, non-blocking collectives
        self._sync.trace, self._async.trace = (recorder.communicator(base, self.timeout, ("", "async"))
                                               if recorder is not None else (None, None))
        self._trace = self._sync.trace
        self.selector = Selector.default(self, probe=settings.network_probe)
        if settings.tuning_file:
            self.load_tuning(settings.tuning_file, missing_ok=True)

    # ------------------------------------------------------------------ basics
    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, node {self.node_rank}/{self.node_size})"

    def split(self, color: int, key: int | None = None) -> "Communicator | None":
        """A Communicator over ``MPI.Comm.Split(color, key)``, with this one's settings, or None on a rank whose
        ``color`` is ``MPI.UNDEFINED`` (it joins no group). Collective; the ranks first meet with the deadline
        (MPI_Comm_split has no non-blocking form), so a rank that never comes is a CommTimeoutError, not a hang
        inside the split. Its ``free()`` frees the MPI communicator made here too."""
        _check_split(color, key)
        self._run(self._sync, _SPLIT)
        sub = created(lambda: self._base.Split(color, self.rank if key is None else key), "split", self.rank)
        if sub == MPI.COMM_NULL:
            return None
        try:
            made = Communicator(sub, timeout=self.timeout, validate=self.validate, ranks_per_node=self.ranks_per_node)
        except MpcommError as exc:
            if not isinstance(exc, CommTimeoutError):
                sub.Free()
            raise
        made._owned = sub
        return made

    def barrier(self) -> None:
        """Block until every rank has arrived (bounded by the timeout; validated like every collective)."""
        self._run(self._sync, _BARRIER)

    def stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Measured totals: ``{operation: {algorithm: {"calls", "bytes", "seconds"}}}``."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for t in (self._sync, self._async):
            for (operation, algorithm), (calls, nbytes, seconds) in list(t.records.items()):
                record = out.setdefault(operation, {}).setdefault(algorithm, {"calls": 0, "bytes": 0, "seconds": 0.0})
                record["calls"] += calls
                record["bytes"] += nbytes
                record["seconds"] += seconds
        return out

    def dump_trace(self, path: str | None = None) -> str:
        """Write this rank's flight-recorder dump (its last ``MPCOMM_TRACE_BUFFER`` calls on every Communicator of
        the process) into the directory ``path`` (default ``MPCOMM_TRACE_DIR``, see ``mpcomm.trace``); returns
        the file written. Local: it never waits for another rank. ``python -m mpcomm.trace DIR`` reads them."""
        if self._trace is None:
            raise MpcommError(f"rank {self.rank}: dump_trace: the flight recorder is off (MPCOMM_TRACE_BUFFER=0)")
        return self._trace.recorder.dump("dump_trace()", path, frame=sys._getframe(1))

    def reset_stats(self) -> None:
        for t in (self._sync, self._async):
            t.records.clear()

    # ------------------------------------------------------------------ calibration of algorithm="auto"
    def tune(self, sizes=None, repeats: int = 5, operations=("allreduce",), dtype="float32",
             algorithms=None, verbose: bool = True) -> dict:
        """Time every algorithm at ``sizes`` (bytes) on this communicator and make ``auto`` use the fastest.

        Collective. Rank 0 decides and broadcasts, so all ranks hold the same table; it is also returned
        (see ``mpcomm.tuning``) and can be saved with ``save_tuning``. The measurement runs are not counted
        in ``stats()``. With ``verbose`` rank 0 prints the times and per-algorithm alpha/beta fits.
        """
        from . import tuning

        saved = {key: list(record) for key, record in self._sync.records.items()}
        try:
            table = tuning.tune(self, tuning.DEFAULT_SIZES if sizes is None else sizes, repeats, operations,
                                dtype, algorithms, verbose)
        finally:
            self._sync.records.clear()
            self._sync.records.update(saved)
        self._use_table(table, "the table just measured")
        return table

    def save_tuning(self, path: str) -> None:
        """Write the table ``auto`` uses to ``path`` as JSON (rank 0 writes; collective)."""
        if self.selector.table is None:
            raise ValueError("save_tuning: there is no tuning table; run comm.tune() or comm.load_tuning() first")
        error = None
        if self.rank == 0:
            try:
                with open(path, "w") as f:
                    json.dump(self.selector.table, f, indent=1)
            except OSError as exc:
                error = f"save_tuning: cannot write {path!r}: {exc}"
        error = self._share_from_root(error, "save_tuning")
        if error:
            raise OSError(error)

    def load_tuning(self, path: str, missing_ok: bool = False) -> bool:
        """Make ``auto`` use the table saved at ``path`` (read on rank 0, broadcast; collective).

        Returns False, with a warning, when the table was measured on a different layout (size or ranks
        per node) or, with ``missing_ok``, when the file does not exist.
        """
        table, error = None, None
        if self.rank == 0:
            try:
                with open(path) as f:
                    table = json.load(f)
            except FileNotFoundError:
                error = "missing"
            except (OSError, ValueError) as exc:
                error = f"load_tuning: cannot read tuning table {path!r}: {exc}"
        table, error = self._share_from_root((table, error), "load_tuning")
        if error == "missing":
            if not missing_ok:
                raise FileNotFoundError(f"load_tuning: no tuning table at {path!r}")
            warnings.warn(f"mpcomm: tuning file {path!r} does not exist; auto uses the cost model", RuntimeWarning)
            return False
        if error:
            raise ValueError(error)
        return self._use_table(table, f"tuning file {path!r}")

    def _use_table(self, table: dict, source: str) -> bool:
        loaded = self.selector.load(table, source=source)
        self._plans.clear()  # plans remember auto's choices
        self._plans_generation += 1
        return loaded

    def free(self, failed: bool = False) -> bool:
        """Release the private MPI communicators and the progress thread (the wrapped comm stays); every later
        call raises ``MpcommError``. Collective, like ``MPI_Comm_free``: returns whether they were freed.

        If a collective stopped midway or a message timed out on any rank, messages may still be in flight on
        them, and MPI gives a freed communicator's context to the next one created, which could then match
        them. So the ranks first agree (over mpcomm's own duplicate, within the timeout, at most
        ``FREE_AGREEMENT_SECONDS``) that none of them saw a failure; otherwise — or if a rank does not come —
        the MPI communicators are left allocated. ``failed=True`` adds a failure this rank saw that the
        Communicator could not (e.g. a protocol built on its point-to-point that gave up waiting).
        """
        if self._unusable == _FREED:
            return False
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._drain_deferred()
        transports = (self._sync, self._async, self._p2p.envelopes, self._p2p.payloads, *self._protocols.values())
        failed_here = failed or self._unusable is not None or any(t.failed for t in transports)
        self._unusable = _FREED
        mine, anyone = np.array([int(failed_here)], dtype=np.int8), np.ones(1, dtype=np.int8)
        agreement = Transport(self._base, min(self.timeout, FREE_AGREEMENT_SECONDS))
        try:
            with agreement.running("free"):
                agreement.wait([self._base.Iallreduce(mine, anyone, MPI.MAX)], agreement.others)
        except (MpcommError, MPI.Exception):
            return False  # a rank that did not come may be one that saw a failure
        if anyone[0]:
            return False
        for transport in (self._sync, self._p2p, self._async, *self._protocols.values()):
            transport.free()  # (the duplicate with the payloads' transport)
        if self._owned is not None:
            self._owned.Free()
        return True

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buf: Any, op: str = SUM, algorithm: str = "auto") -> Any:
        """Reduce ``buf`` over all ranks, in place; returns ``buf``."""
        plan = self._ready_allreduce(buf, op, algorithm)
        if plan is not None:
            self._run(self._sync, plan, buf if buf.ndim == 1 else buf.reshape(-1), plan.rop)
            return buf
        try:
            self._allreduce(self._sync, buf, op, algorithm)
        except (TypeError, ValueError) as exc:
            self._rejected(self._sync, "allreduce", exc)
        return buf

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: str = SUM, algorithm: str = "auto") -> Any:
        """``recvbuf`` <- chunk ``rank`` of the reduction of ``sendbuf`` (``sendbuf.size == size * recvbuf.size``)."""
        return self._checked(self._reduce_scatter, "reduce_scatter", sendbuf, recvbuf, op, algorithm)

    def all_gather(self, sendbuf: Any, recvbuf: Any, algorithm: str = "auto") -> Any:
        """``recvbuf`` <- every rank's ``sendbuf`` in rank order (``recvbuf.size == size * sendbuf.size``)."""
        return self._checked(self._all_gather, "all_gather", sendbuf, recvbuf, algorithm)

    def broadcast(self, buf: Any, root: int = 0, algorithm: str = "auto") -> Any:
        """Copy ``buf`` from ``root`` to every rank, in place; returns ``buf``."""
        return self._checked(self._broadcast, "broadcast", buf, root, algorithm)

    def reduce(self, sendbuf: Any, recvbuf: Any = None, op: str = SUM, root: int = 0, algorithm: str = "auto") -> Any:
        """``recvbuf`` on ``root`` <- the reduction of every rank's ``sendbuf`` (``recvbuf`` may be None elsewhere;
        ``recvbuf`` may be ``sendbuf`` itself for an in-place reduce); returns ``recvbuf``."""
        return self._checked(self._reduce, "reduce", sendbuf, recvbuf, op, root, algorithm)

    def gather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, algorithm: str = "auto") -> Any:
        """``recvbuf`` on ``root`` <- every rank's ``sendbuf`` in rank order (``recvbuf.size == size * sendbuf.size``
        on the root; may be None elsewhere); returns ``recvbuf``."""
        return self._checked(self._gather, "gather", sendbuf, recvbuf, root, algorithm)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, algorithm: str = "auto") -> Any:
        """``recvbuf`` <- block ``rank`` of ``sendbuf`` on ``root`` (``sendbuf.size == size * recvbuf.size`` on the
        root; may be None elsewhere); returns ``recvbuf``."""
        return self._checked(self._scatter, "scatter", sendbuf, recvbuf, root, algorithm)

    def all_to_all(self, sendbuf: Any, recvbuf: Any, algorithm: str = "auto") -> Any:
        """Block j of ``sendbuf`` goes to rank j; block i of ``recvbuf`` comes from rank i (equal blocks:
        ``sendbuf.size == recvbuf.size``, a multiple of the communicator size); returns ``recvbuf``."""
        return self._checked(self._all_to_all, "all_to_all", sendbuf, recvbuf, algorithm)

    def all_to_all_v(self, sendbuf: Any, send_counts: Sequence[int], recvbuf: Any, recv_counts: Sequence[int],
                     algorithm: str = "auto") -> Any:
        """Rank j gets ``send_counts[j]`` elements of ``sendbuf`` (consecutive blocks in rank order); block i of
        ``recvbuf`` holds ``recv_counts[i]`` elements from rank i. Zeros are allowed; returns ``recvbuf``."""
        return self._checked(self._all_to_all_v, "all_to_all_v", sendbuf, send_counts, recvbuf, recv_counts,
                             algorithm)

    # ------------------------------------------------------------------ non-blocking collectives
    # Each starts the blocking form's body on the progress thread; ``wait()`` returns what the blocking form
    # returns, and raises what it raises (argument errors included).
    def iallreduce(self, buf: Any, op: str = SUM, algorithm: str = "auto") -> Work:
        """Start an all-reduce on the progress thread; ``wait()`` returns ``buf``."""
        return self._submit("allreduce", self._allreduce_returning, buf, op, algorithm)

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, op: str = SUM, algorithm: str = "auto") -> Work:
        return self._submit("reduce_scatter", self._reduce_scatter, sendbuf, recvbuf, op, algorithm)

    def iall_gather(self, sendbuf: Any, recvbuf: Any, algorithm: str = "auto") -> Work:
        return self._submit("all_gather", self._all_gather, sendbuf, recvbuf, algorithm)

    def ibroadcast(self, buf: Any, root: int = 0, algorithm: str = "auto") -> Work:
        return self._submit("broadcast", self._broadcast, buf, root, algorithm)

    def ireduce(self, sendbuf: Any, recvbuf: Any = None, op: str = SUM, root: int = 0, algorithm: str = "auto") -> Work:
        return self._submit("reduce", self._reduce, sendbuf, recvbuf, op, root, algorithm)

    def igather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, algorithm: str = "auto") -> Work:
        return self._submit("gather", self._gather, sendbuf, recvbuf, root, algorithm)

    def iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, algorithm: str = "auto") -> Work:
        return self._submit("scatter", self._scatter, sendbuf, recvbuf, root, algorithm)

    def iall_to_all(self, sendbuf: Any, recvbuf: Any, algorithm: str = "auto") -> Work:
        return self._submit("all_to_all", self._all_to_all, sendbuf, recvbuf, algorithm)

    def iall_to_all_v(self, sendbuf: Any, send_counts: Sequence[int], recvbuf: Any, recv_counts: Sequence[int],
                      algorithm: str = "auto") -> Work:
        return self._submit("all_to_all_v", self._all_to_all_v, sendbuf, send_counts, recvbuf, recv_counts,
                            algorithm)

    def ibarrier(self) -> Work:
        return self._submit("barrier", self._run, _BARRIER)

    # ------------------------------------------------------------------ point to point
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        self._traced("send", dst, buf, p2p.send, self._channels("send"), buf, dst, tag, self._payload_transport)

    def recv(self, buf: Any, src: int = ANY_SOURCE, tag: int = 0, status: Status | None = None) -> Any:
        """Receive into ``buf`` from ``src`` (``ANY_SOURCE``: whoever sends) with ``tag`` (or ``ANY_TAG``);
        returns ``buf``. ``status``, if given, is filled with the matched source, tag and element count."""
        return self._traced("recv", src, buf, p2p.recv, self._channels("recv"), buf, src, tag, status,
                            self._payload_transport)

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work:
        channels = self._channels("send")
        work = p2p.isend(channels, self._payload_transport(channels, "send", buf), buf, dst, tag)
        if self._trace is not None:  # (completed once a wait of the program saw it complete)
            self._trace.started_p2p("send", dst, buf, work)
        return work

    def irecv(self, buf: Any, src: int = ANY_SOURCE, tag: int = 0, status: Status | None = None) -> Work:
        """Start a receive; the Work's ``source`` and ``tag`` say what it matched once it has completed."""
        channels = self._channels("recv")
        work = p2p.irecv(channels, self._payload_transport(channels, "recv", buf), buf, src, tag, status)
        if self._trace is not None:
            self._trace.started_p2p("recv", src, buf, work)
        return work

    def _traced(self, operation: str, peer, buf, call, *args):
        """``call(*args)``, a blocking point-to-point call, recorded in the flight recorder (dumped if it times
        out)."""
        trace = self._trace
        if trace is None:
            return call(*args)
        slot = trace.started_p2p(operation, peer, buf)
        try:
            result = call(*args)
        except CommTimeoutError:
            trace.recorder.dump_quietly(f"CommTimeoutError in {operation} with rank {peer} (rank {self.rank})")
            raise
        except BaseException:
            trace.completed(slot, _clock())  # refused or failed: no longer in flight
            raise
        trace.completed(slot, _clock())
        return result

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any, src: int, tag: int = 0) -> Any:
        receiving = self.irecv(recvbuf, src, tag)
        sending = self.isend(sendbuf, dst, tag)
        sending.wait()
        return receiving.wait()

    def _channels(self, operation: str) -> p2p.Channels:
        if self._unusable == _FREED:
            raise MpcommError(f"rank {self.rank}: {operation}: this Communicator was freed (free() was called)")
        return self._p2p

    def _protocol_transport(self, name: str) -> Transport:
        """A private MPI communicator for messages whose sizes both sides agreed beforehand (so no envelope), of
        a protocol built on this Communicator (e.g. the pipeline executor's hand-offs): made on the first call
        for ``name`` — collective then, after a meeting with the deadline — reused after, freed with it."""
        t = self._protocols.get(name)
        if t is None:
            self._run(self._sync, _PROTOCOL)
            t = Transport(created(self._base.Dup, name, self.rank), self.timeout, on_timeout=p2p.ON_TIMEOUT)
            t.operation = name
            t.progress_hook = self._p2p.progress
            self._protocols[name] = t
        return t

    @staticmethod
    def _payload_transport(channels: p2p.Channels, operation: str, buf):
        if type(buf) is np.ndarray:
            return channels.payloads
        return staging.for_buffers(channels.payloads, operation, buf)

    # ------------------------------------------------------------------ bodies shared by blocking and non-blocking forms
    def _ready_allreduce(self, buf, op, algorithm) -> Plan | None:
        """The common call — a host array used as it is, a plan already made — gets its cached plan here, with
        nothing else looked at; None for anything else (the general path)."""
        if type(buf) is np.ndarray and type(op) is str and type(algorithm) is str:
            plan = self._plans.get(("allreduce", buf.dtype, buf.shape, op, algorithm, None))
            if plan is not None and plan.direct:
                flags = buf.flags
                if flags.c_contiguous and flags.writeable:
                    return plan
        return None

    def _allreduce(self, t: Transport, buf, op, algorithm) -> None:
        plan = self._ready_allreduce(buf, op, algorithm)
        if plan is not None:
            self._run(t, plan, buf if buf.ndim == 1 else buf.reshape(-1), plan.rop)
            return
        array = as_output(buf, "allreduce")
        plan = self._plan("allreduce", array, op, algorithm)
        with WorkArray(array, plan.wire) as work:
            self._run(t, plan, work, plan.rop)

    def _reduce_scatter(self, t: Transport, sendbuf, recvbuf, op, algorithm):
        send, recv = as_input(sendbuf, "reduce_scatter"), as_output(recvbuf, "reduce_scatter")
        self._check_pair("reduce_scatter", send, recv, send.size, recv.size * self.size, "sendbuf", "size * recvbuf")
        plan = self._plan("reduce_scatter", recv, op, algorithm)
        with WorkArray(recv, plan.wire) as out:
            self._run(t, plan, self._input(send, plan.wire, out), out, plan.rop)
        return recvbuf

    def _all_gather(self, t: Transport, sendbuf, recvbuf, algorithm):
        send, recv = as_input(sendbuf, "all_gather"), as_output(recvbuf, "all_gather")
        self._check_pair("all_gather", send, recv, recv.size, send.size * self.size, "recvbuf", "size * sendbuf")
        plan = self._plan("all_gather", send, None, algorithm)
        with WorkArray(recv, recv.dtype) as out:
            self._run(t, plan, self._input(send, send.dtype, out), out)
        return recvbuf

    def _broadcast(self, t: Transport, buf, root, algorithm):
        array = as_output(buf, "broadcast")
        plan = self._plan("broadcast", array, None, algorithm, root=root)
        with WorkArray(array, array.dtype) as work:
            self._run(t, plan, work, root)
        return buf

    def _reduce(self, t: Transport, sendbuf, recvbuf, op, root, algorithm):
        send = as_input(sendbuf, "reduce")
        plan = self._plan("reduce", send, op, algorithm, root=root)
        recv = self._root_buffer("reduce", recvbuf, "recvbuf", root, send, send.size)
        with WorkArray(recv, plan.wire) if recv is not None else NoBuffer() as out:
            self._run(t, plan, self._input(send, plan.wire, out), out, plan.rop, root)
        return recvbuf

    def _gather(self, t: Transport, sendbuf, recvbuf, root, algorithm):
        send = as_input(sendbuf, "gather")
        plan = self._plan("gather", send, None, algorithm, root=root)
        recv = self._root_buffer("gather", recvbuf, "recvbuf", root, send, send.size * self.size)
        with WorkArray(recv, send.dtype) if recv is not None else NoBuffer() as out:
            self._run(t, plan, self._input(send, send.dtype, out), out, root)
        return recvbuf

    def _scatter(self, t: Transport, sendbuf, recvbuf, root, algorithm):
        recv = as_output(recvbuf, "scatter")
        plan = self._plan("scatter", recv, None, algorithm, root=root)
        send = self._root_buffer("scatter", sendbuf, "sendbuf", root, recv, recv.size * self.size, output=False)
        with WorkArray(recv, recv.dtype) as out:
            self._run(t, plan, None if send is None else self._input(send, recv.dtype, out), out, root)
        return recvbuf

    def _all_to_all(self, t: Transport, sendbuf, recvbuf, algorithm):
        send, recv = as_input(sendbuf, "all_to_all"), as_output(recvbuf, "all_to_all")
        self._check_pair("all_to_all", send, recv, recv.size, send.size, "recvbuf", "sendbuf")
        if send.size % self.size:
            raise ValueError(f"all_to_all: sendbuf has {send.size} elements, not a multiple of the communicator "
                             f"size {self.size} (use all_to_all_v for uneven blocks)")
        block = send.size // self.size
        counts, displs = (block,) * self.size, tuple(range(0, block * self.size, block)) if block else (0,) * self.size
        plan = self._plan("all_to_all", send, None, algorithm)
        with WorkArray(recv, recv.dtype) as out:
            self._run(t, plan, self._input(send, send.dtype, out), counts, displs, out, counts, displs)
        return recvbuf

    def _all_to_all_v(self, t: Transport, sendbuf, send_counts, recvbuf, recv_counts, algorithm):
        send, recv = as_input(sendbuf, "all_to_all_v"), as_output(recvbuf, "all_to_all_v")
        same_device("all_to_all_v", send, recv)
        if send.dtype != recv.dtype:
            raise TypeError(f"all_to_all_v: sendbuf is {send.dtype} but recvbuf is {recv.dtype}; they must match")
        send_counts = _check_counts("all_to_all_v", "send_counts", send_counts, self.size, send.size, "sendbuf")
        recv_counts = _check_counts("all_to_all_v", "recv_counts", recv_counts, self.size, recv.size, "recvbuf")
        if send_counts[self.rank] != recv_counts[self.rank]:
            raise ValueError(f"all_to_all_v: rank {self.rank} sends itself {send_counts[self.rank]} elements but "
                             f"expects {recv_counts[self.rank]}")
        if algorithm == "auto":
            algorithm = self._agreed_choice(t, "all_to_all_v", send.nbytes, send.dtype)
        plan = self._plan("all_to_all_v", send, None, algorithm)
        with WorkArray(recv, recv.dtype) as out:
            self._run(t, plan, self._input(send, send.dtype, out), send_counts, _displs(send_counts), out,
                      recv_counts, _displs(recv_counts), counts=(send_counts, recv_counts))
        return recvbuf

    # ------------------------------------------------------------------ running a call
    def _run(self, t: Transport, plan: Plan, *args, counts: tuple | None = None, record: bool = True) -> None:
        """Run ``plan`` on ``t``: refuse on an unusable communicator or a second thread, agree (validate=True),
        time the algorithm, record it in ``stats()`` (unless ``record`` is false); a failure midway makes the
        communicator unusable."""
        if self._unusable is not None or not t.in_use.acquire(False):
            self._refuse(plan)
        try:
            if self._inline is not None and t is self._sync:
                self._inline.run_until(None)
            t.operation = plan.label
            start, trace = _clock(), t.trace  # the flight recorder's lane (mpcomm.trace): None when off
            if trace is not None:  # (GroupTrace.started, without the call)
                trace.collectives += 1
                slot = next(trace.slots)
                trace.groups[slot] = trace
                trace.calls[slot] = plan
                trace.starts[slot] = start
            if self.validate:
                self._agree(t, plan, counts)
                start = _clock()  # (stats time the algorithm alone)
            plan.fn(t, *args)
            end = _clock()
            elapsed = end - start
            if trace is not None:
                trace.ends[slot] = end  # (GroupTrace.completed, without the call)
            if self._unusable is not None:  # made unusable while this ran (another thread joined in)
                raise MpcommError(f"rank {self.rank}: {plan.label}: {self._unusable}; this result may be wrong")
        except CollectiveMismatchError:  # the ranks compared their calls and stopped cleanly: nothing in flight
            raise
        except MpcommError as exc:
            self._stopped_midway(plan, exc)
            raise
        except MPI.Exception as exc:  # the MPI library itself refused (e.g. aliased buffers): mpcomm's error
            error = t._mpi_error(exc, [], t.others)
            self._stopped_midway(plan, error)
            raise error from None
        finally:
            t.in_use.release()
        if not record:
            return
        totals = t.records.get(plan.key)  # per (operation, algorithm): bounded whatever the shapes
        if totals is None:
            totals = t.records[plan.key] = [0, 0, 0.0]
        totals[0] += 1
        totals[1] += plan.nbytes
        totals[2] += elapsed

    def _refuse(self, plan: Plan) -> None:
        """Raise: the communicator is unusable, or another thread is running a collective on it."""
        if self._unusable is not None:
            raise MpcommError(f"rank {self.rank}: {plan.label}: this communicator is unusable: {self._unusable}"
                              + ("" if self._unusable == _FREED else _STALE))
        self._concurrent_use(plan)

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

    def _agree(self, t: Transport, plan: Plan, counts: tuple | None) -> None:
        """validate=True: the ranks compare their calls' digests (the whole signature, any length); on a
        difference every rank raises, listing what each passed. ``counts`` (all_to_all_v: send and receive
        counts) are checked for consistency (what rank i sends rank j is what j expects from i)."""
        everyone = np.empty((self.size, plan.digest.size), dtype=np.uint8)
        t.wait([t.mpi.Iallgather(plan.digest, everyone)], t.others)
        if not (everyone == plan.digest).all():
            calls = t.allgather_object(plan.signature)
            described = "; ".join(f"rank {r}: {json.dumps(call, sort_keys=True)}" for r, call in enumerate(calls))
            raise CollectiveMismatchError(f"rank {self.rank}: {plan.signature['operation']}: ranks disagree — "
                                          f"{described}")
        if counts is not None:
            _, problem = count_matrix(t, *counts)
            if problem:
                raise CollectiveMismatchError(f"rank {self.rank}: {plan.signature['operation']}: {problem}")

    def _agreed_choice(self, t: Transport, operation: str, nbytes: int, dtype) -> str:
        """auto's algorithm for a call whose bytes differ between ranks by nature (all_to_all_v): the one for the
        ranks' mean bytes, agreed with one 8-byte all-reduce, so every rank runs the same algorithm."""
        total = np.zeros(1, dtype=np.int64)
        self._run(t, _SIZE_FOR_AUTO, np.array([nbytes], dtype=np.int64), total, record=False)
        return self.selector.choose(operation, int(total[0]) // self.size, np.dtype(dtype))

    # ------------------------------------------------------------------ plans
    def _plan(self, operation: str, array, op, algorithm: str, root: int | None = None) -> Plan:
        """The cached plan for a call on ``array`` (its dtype and shape), or a new one after the local checks
        that do not depend on other ranks: dtype/op, algorithm name, root."""
        if operation in _ROOTED:  # before the cache: True == 1 and 0.0 == 0 as dict keys
            self._check_root(root, operation)
        cacheable = type(array) is np.ndarray and type(op) in (str, type(None)) and type(algorithm) is str
        key = (operation, array.dtype, array.shape, op, algorithm, root) if cacheable else None
        plan = self._plans.get(key) if cacheable else None
        if plan is not None:
            return plan
        rop = None
        if operation in _REDUCING:
            rop = reduce_op(op, operation)
            check_dtype_op(array.dtype, rop.name, operation)
            if rop.name == AVG:
                rop = rop.averaged(self.size)  # each algorithm divides where it finishes a sum, before sharing it
        else:
            check_dtype_op(array.dtype, None, operation)
        nbytes = array.nbytes * (self.size if operation in _PER_RANK_BLOCK else 1)  # stats: the whole buffer
        chosen = self._resolve(operation, algorithm, nbytes, array.dtype, None if rop is None else rop.name)
        host = type(array) is np.ndarray
        plan = Plan(operation, chosen, array, rop, root, nbytes, host=host,
                    wire=wire_dtype(array.dtype, widen=not (host and chosen in KEEP_LOW_PRECISION))
                    if rop is not None else array.dtype)
        if cacheable:
            if len(self._plans) >= PLAN_CACHE_SIZE:  # shapes that vary (MoE, dynamic batches): the oldest goes
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def _resolve(self, operation: str, algorithm: str, nbytes: int, dtype, op: str | None = None) -> str:
        from .algorithms import REGISTRY

        if algorithm == "auto":
            return self.selector.choose(operation, nbytes, np.dtype(dtype), op)
        if not isinstance(algorithm, str) or algorithm not in REGISTRY[operation]:
            raise ValueError(
                f"{operation}: unknown algorithm {algorithm!r}; choose one of {sorted(REGISTRY[operation]) + ['auto']}"
            )
        return algorithm

    # ------------------------------------------------------------------ helpers
    def _share_from_root(self, obj, operation: str):
        """Rank 0's ``obj`` on every rank (pickled; waits bounded by the timeout, like every collective)."""
        self._refuse_if_freed(operation)
        with self._sync.running(operation):
            return self._sync.bcast_object(obj, root=0)

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
        return FutureWork(self._executor.submit(run, self._async), operation, self._others(), self.rank,
                          self._async.waiters)

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
        if self.validate and self._unusable is None and not isinstance(exc, MpcommError):
            try:
                self._agree(t, Plan.rejected(operation, exc), None)
            except MpcommError:
                pass  # the others were told; this rank's own error is the one to raise
        raise exc

    def _allreduce_returning(self, t: Transport, buf, op, algorithm):
        self._allreduce(t, buf, op, algorithm)
        return buf

    def _drain_deferred(self) -> None:
        """Progress on wait: run the queued non-blocking collectives before a blocking one, so every rank
        runs all its collectives in issue order whatever it waits on first."""
        if self._inline is not None:
            self._inline.run_until(None)

    def _refuse_if_freed(self, operation: str) -> None:
        if self._unusable == _FREED:
            raise MpcommError(f"rank {self.rank}: {operation}: this Communicator was freed (free() was called)")

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
            if self.validate or self._unusable is not None:
                raise  # validate=True: _rejected tells every rank at once, and nothing is left in flight
            self._unusable = (f"{operation} was called with root {root!r} on this rank, and other ranks may have run it "
                              "with another root, leaving messages for this rank that a later call would take")
            raise ValueError(f"{exc}; this Communicator is now unusable on rank {self.rank} (with validate=True every "
                             "rank raises at once instead)") from None

    def _check_pair(self, operation, send, recv, got, want, got_name, want_name) -> None:
        same_device(operation, send, recv)
        if send.dtype != recv.dtype:
            raise TypeError(f"{operation}: sendbuf is {send.dtype} but recvbuf is {recv.dtype}; they must match")
        if got != want:
            raise ValueError(
                f"{operation}: {got_name} has {got} elements but {want_name} = {want} "
                f"(communicator size {self.size}, sendbuf {send.size}, recvbuf {recv.size})"
            )

    def _root_buffer(self, operation, buf, name, root, other, want, output=True):
        """The root's buffer of a rooted collective (checked), or None on the other ranks."""
        if self.rank != root:
            return None
        if buf is None:
            raise ValueError(f"{operation}: {name} is None on the root (rank {root}); it needs {want} elements")
        array = as_output(buf, operation) if output else as_input(buf, operation)
        same_device(operation, array, other)
        if array.dtype != other.dtype:
            raise TypeError(f"{operation}: {name} is {array.dtype} but the other buffer is {other.dtype}; "
                            "they must match")
        if array.size != want:
            raise ValueError(f"{operation}: {name} on the root has {array.size} elements, needs {want} "
                             f"(communicator size {self.size}, other buffer {other.size})")
        return array

    def _input(self, array, dtype, output):
        """``array`` as a contiguous 1-D input in ``dtype``, copied when it is not already or when it shares
        memory with ``output`` (the algorithms, and MPI, need distinct input and output buffers)."""
        data = WorkArray.read(array, dtype)
        if output is not None and data.size and np.may_share_memory(data, output):
            data = data.copy()
        return data


_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce", "gather", "scatter")
_PER_RANK_BLOCK = ("reduce_scatter", "all_gather", "gather", "scatter")  # planned on the buffer of one rank's block
_FREED = "it was freed (free() was called)"
_STALE = ("; its messages may still be in flight, so later collectives could match them and return wrong data. "
          "Create a new Communicator.")


def _check_split(color, key) -> None:
    """ValueError unless ``color`` is an int >= 0 or ``MPI.UNDEFINED`` and ``key`` None or an int."""
    def integral(value) -> bool:
        return type(value) is int or isinstance(value, np.integer)

    if not integral(color) or color < 0 and color != MPI.UNDEFINED:
        raise ValueError(f"split: color {color!r} must be an int >= 0, or MPI.UNDEFINED to join no group")
    if key is not None and not integral(key):
        raise ValueError(f"split: key {key!r} must be an int (or None: this rank's rank)")


def _check_counts(operation: str, name: str, counts, size: int, available: int, buffer: str) -> tuple[int, ...]:
    """``counts`` as a tuple of ``size`` ints >= 0 that fit in ``available`` elements of ``buffer``."""
    try:
        values = tuple(int(c) for c in counts)
        integral = all(float(c) == int(c) and not isinstance(c, bool) for c in counts)
    except (TypeError, ValueError):
        raise TypeError(f"{operation}: {name} must be a sequence of {size} ints, got {counts!r}") from None
    if len(values) != size or not integral or min(values, default=0) < 0:
        raise ValueError(f"{operation}: {name} must be {size} ints >= 0 (one per rank), got {counts!r}")
    if sum(values) != available:
        raise ValueError(f"{operation}: {name} add up to {sum(values)} elements but {buffer} has {available}")
    return values


def _displs(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Where each block starts when the blocks are laid out one after another."""
    return tuple(itertools.accumulate(counts[:-1], initial=0))
