"""Communicator: validates arguments, describes the buffers, and hands each call to the dispatch seam.

It holds no algorithm bodies (those live in ``mpcomm.algorithms``) and does not run calls itself: planning,
running under the deadline, agreement and stats are :class:`~mpcomm.dispatch.Dispatcher`'s (its base class),
the one place every collective starts and ends. Private duplicates of the user's
communicator keep traffic apart: blocking collectives, point-to-point envelopes and payloads, and the
non-blocking collectives that run on the progress thread, so messages of one kind can never match another.

What a call needs that depends only on (dtype, shape, op, algorithm) — the algorithm chosen, the reduction,
the labels of its error messages, its validation signature — is decided once into a :class:`~mpcomm.plan.Plan`
and cached, so a training loop's repeated calls go straight from the argument checks to MPI.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

from . import p2p, staging
from .algorithms import native
from .algorithms.auto import Selector
from .buffers import SUM, as_input, as_output, same_device
from .dispatch import FREED, Dispatcher, new_totals
from .errors import CommTimeoutError, ConfigError, MpcommError
from .native_calls import load as load_calls
from .p2p import ANY_SOURCE, Status, Wildcard
from .plan import Plan
from .settings import DEFAULT_TIMEOUT, Settings, agree
from .topology import node_topology
from .transport import Transport, created, duplicate
from .tuning import measure, table as tuning_table
from .work import Work
from .work_array import NoBuffer, WorkArray

_BARRIER = Plan.barrier()
_SPLIT = Plan.meeting("split")
FREE_AGREEMENT_SECONDS = 10.0  # at most this long free() waits for the other ranks (see Communicator.free)


class Communicator(Dispatcher):
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
        assert settings is not None  # agree() raised on every rank otherwise
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
            for t in (self._sync, self._async):  # spin elsewhere; bench/results/observations.md)
                t.share_cores()
        self._sync.spans_nodes = self._async.spans_nodes = self.num_nodes > 1
        self._sync.reduction_ops = self._async.reduction_ops = native.agree_on_ops(self._sync)
        native.watch(self._sync, self._async)
        self._start_dispatch()
        calls = load_calls()
        if calls is not None and type(self).allreduce is Communicator.allreduce:  # (not past a subclass's own)
            # A call like the last one runs its plan's express call from the user's in C (see _planned_allreduce):
            # the Python call, its frame and the plan's lookup cost as much as a small all-reduce on Open MPI.
            self._shortcut = calls.Shortcut(Communicator.allreduce.__get__(self), self, np.ndarray, SUM, "auto")
            self.__dict__["allreduce"] = self._shortcut
        self._start_trace(settings.trace_buffer, base, settings.timeline)
        self._start_stragglers(settings.straggler)
        self.selector = Selector.default(self, probe=settings.network_probe)
        if settings.tuning_file:
            self.load_tuning(settings.tuning_file, missing_ok=True)

    # ------------------------------------------------------------------ basics
    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, node {self.node_rank}/{self.node_size})"

    def split(self, color: int, key: int | None = None, timeout: float | None = None) -> "Communicator | None":
        """A Communicator over ``MPI.Comm.Split(color, key)``, with this one's settings (``timeout``: its own
        deadline in seconds, if given), or None on a rank whose ``color`` is ``MPI.UNDEFINED`` (it joins no group).
        Collective; the ranks first meet with the deadline (MPI_Comm_split has no non-blocking form), so a rank that
        never comes is a CommTimeoutError, not a hang inside the split. Its ``free()`` frees the MPI communicator
        made here too."""
        _check_split(color, key)
        self.run(_SPLIT)
        sub = created(lambda: self._base.Split(color, self.rank if key is None else key), "split", self.rank)
        if sub == MPI.COMM_NULL:
            return None
        try:
            made = Communicator(sub, timeout=self.timeout if timeout is None else timeout, validate=self.validate,
                                ranks_per_node=self.ranks_per_node)
        except MpcommError as exc:
            if not isinstance(exc, CommTimeoutError):
                sub.Free()
            raise
        made._owned = sub
        return made

    def barrier(self) -> None:
        """Block until every rank has arrived (bounded by the timeout; validated like every collective)."""
        self.run(_BARRIER)

    # ------------------------------------------------------------------ calibration of algorithm="auto"
    def tune(self, sizes: Sequence[int] | None = None, repeats: int = 5, operations: Sequence[str] = ("allreduce",),
             dtype: DTypeLike = "float32", algorithms: Sequence[str] | None = None, verbose: bool = True) -> dict:
        """Time every algorithm at ``sizes`` (bytes) on this communicator and make ``auto`` use the fastest.

        Collective. Rank 0 decides and broadcasts, so all ranks hold the same table; it is also returned
        (see ``mpcomm.tuning``) and can be saved with ``save_tuning``. The measurement runs are not counted
        in ``stats()``. With ``verbose`` rank 0 prints the times and per-algorithm alpha/beta fits.
        """
        saved = {key: record[:] for key, record in self._sync.records.items()}
        try:
            table = measure.tune(self, measure.DEFAULT_SIZES if sizes is None else sizes, repeats, operations,
                                 dtype, algorithms, verbose)
        finally:
            for key, record in self._sync.records.items():  # (in place, as reset_stats)
                record[:] = saved.get(key, new_totals())
        self._use_table(table, "the table just measured")
        return table

    def save_tuning(self, path: str) -> None:
        """Write the table ``auto`` uses to ``path`` as JSON (rank 0 writes; collective)."""
        tuning_table.save(self, self.selector.table, path)

    def load_tuning(self, path: str, missing_ok: bool = False) -> bool:
        """Make ``auto`` use the table saved at ``path`` (read on rank 0, broadcast; collective).

        Returns False, with a warning, when the table was measured on a different layout (size or ranks
        per node) or, with ``missing_ok``, when the file does not exist.
        """
        table = tuning_table.load(self, path, missing_ok)
        if table is None:
            return False
        return self._use_table(table, f"tuning file {path!r}")

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
        if self._unusable == FREED:
            return False
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._drain_deferred()
        transports = (self._sync, self._async, self._p2p.envelopes, self._p2p.payloads, *self._protocols.values())
        failed_here = failed or self._unusable is not None or any(t.failed for t in transports)
        self._unusable = FREED
        mine, anyone = np.array([int(failed_here)], dtype=np.int8), np.ones(1, dtype=np.int8)
        agreement = Transport(self._base, min(self.timeout, FREE_AGREEMENT_SECONDS))
        try:
            with agreement.running("free"):
                agreement.wait([self._base.Iallreduce(mine, anyone, MPI.MAX)], agreement.others)
        except (MpcommError, MPI.Exception):
            return False  # a rank that did not come may be one that saw a failure
        if anyone[0]:
            return False
        owned: tuple[Transport | p2p.Channels, ...] = (self._sync, self._p2p, self._async, *self._protocols.values())
        for transport in owned:
            transport.free()  # (the duplicate with the payloads' transport)
        if self._owned is not None:
            self._owned.Free()
        return True

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buf: Any, op: str = SUM, algorithm: str = "auto", wire: str | None = None) -> Any:
        """Reduce ``buf`` over all ranks, in place; returns ``buf``. ``wire`` ("bf16", "fp16", "int8"; float32
        buffers, op sum or avg) sends it compressed and accumulates in float32 (``mpcomm.compression``)."""
        plan = self._planned_allreduce(buf, op, algorithm) if wire is None else None
        if plan is not None and plan.express is not None and self.run_express(plan, buf):
            return buf
        if plan is not None and _as_it_is(buf):
            self.run(plan, buf if buf.ndim == 1 else buf.reshape(-1), plan.rop)
            return buf
        try:
            self._allreduce(self._sync, buf, op, algorithm, wire)
        except (TypeError, ValueError) as exc:
            self._rejected(self._sync, "allreduce", exc)
        return buf

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: str = SUM, algorithm: str = "auto",
                       wire: str | None = None) -> Any:
        """``recvbuf`` <- chunk ``rank`` of the reduction of ``sendbuf`` (``sendbuf.size == size * recvbuf.size``).
        ``wire`` ("bf16", "fp16", "int8"; float32 buffers, op sum or avg) sends every chunk compressed and adds the
        decoded chunks in float32 (``algorithms/compressed.py``)."""
        return self._checked(self._reduce_scatter, "reduce_scatter", sendbuf, recvbuf, op, algorithm, wire)

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
    def iallreduce(self, buf: Any, op: str = SUM, algorithm: str = "auto", wire: str | None = None) -> Work:
        """Start an all-reduce on the progress thread; ``wait()`` returns ``buf``."""
        return self._submit("allreduce", self._allreduce_returning, buf, op, algorithm, wire)

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, op: str = SUM, algorithm: str = "auto",
                        wire: str | None = None) -> Work:
        return self._submit("reduce_scatter", self._reduce_scatter, sendbuf, recvbuf, op, algorithm, wire)

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
        return self._submit("barrier", self._barrier_on)

    # ------------------------------------------------------------------ point to point
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        self._traced("send", dst, buf, p2p.send, self._channels("send"), buf, dst, tag, self._payload_transport)

    def recv(self, buf: Any, src: int | Wildcard = ANY_SOURCE, tag: int | Wildcard = 0,
             status: Status | None = None) -> Any:
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

    def irecv(self, buf: Any, src: int | Wildcard = ANY_SOURCE, tag: int | Wildcard = 0,
              status: Status | None = None) -> Work:
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
        finally:
            trace.completed(slot, time.perf_counter())  # (a timeout too: the call gave up, it is not in flight)
        return result

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any, src: int, tag: int = 0) -> Any:
        receiving = self.irecv(recvbuf, src, tag)
        sending = self.isend(sendbuf, dst, tag)
        sending.wait()
        return receiving.wait()

    def _channels(self, operation: str) -> p2p.Channels:
        if self._unusable == FREED:
            raise MpcommError(f"rank {self.rank}: {operation}: this Communicator was freed (free() was called)")
        return self._p2p

    @staticmethod
    def _payload_transport(channels: p2p.Channels, operation: str, buf):
        if type(buf) is np.ndarray:
            return channels.payloads
        return staging.for_buffers(channels.payloads, operation, buf)

    # ------------------------------------------------------------------ bodies shared by blocking and non-blocking forms
    def _planned_allreduce(self, buf, op, algorithm) -> Plan | None:
        """The common call — a host array reduced as it is (no conversion), a plan already made — gets its cached
        plan here, with nothing else looked at (the array may be used as it is if :func:`_as_it_is`); None for
        anything else (the general path). A call like the last one (the same dtype, op and algorithm objects, an
        equal shape) takes the last plan without building the cache's key, the costliest part of a small call."""
        if type(buf) is not np.ndarray:
            return None
        dtype, shape = buf.dtype, buf.shape
        last_dtype, last_shape, last_op, last_algorithm, last_plan = self._last_allreduce
        if dtype is last_dtype and op is last_op and algorithm is last_algorithm and shape == last_shape:
            return last_plan
        if type(op) is str and type(algorithm) is str:
            plan = self._plans.get(("allreduce", dtype, shape, op, algorithm, None))
            if plan is not None and plan.direct:
                self._last_allreduce = (dtype, shape, op, algorithm, plan)
                if plan.express is not None and self._shortcut is not None:
                    self._shortcut.remember(buf, op, algorithm, plan, plan.express, self._sync.trace)
                return plan
        return None

    def _allreduce(self, t: Transport, buf, op, algorithm, wire=None) -> None:
        plan = self._planned_allreduce(buf, op, algorithm) if wire is None else None
        if plan is not None and _as_it_is(buf):
            self.run(plan, buf if buf.ndim == 1 else buf.reshape(-1), plan.rop, transport=t)
            return
        array = as_output(buf, "allreduce")
        if wire is None:
            plan = self.plan("allreduce", array, op, algorithm)
        else:
            plan = self.compressed_plan(array, op, algorithm, wire)
        with WorkArray(array, plan.wire) as work:  # (a widened buffer's: the plan's one C call on it, where it has one)
            if plan.direct or plan.express is None or t is not self._sync or not self.run_express(plan, work):
                self.run(plan, work, plan.rop, transport=t)

    def _reduce_scatter(self, t: Transport, sendbuf, recvbuf, op, algorithm, wire=None):
        send, recv = as_input(sendbuf, "reduce_scatter"), as_output(recvbuf, "reduce_scatter")
        self._check_pair("reduce_scatter", send, recv, send.size, recv.size * self.size, "sendbuf", "size * recvbuf")
        if wire is None:
            plan = self.plan("reduce_scatter", recv, op, algorithm)
        else:
            plan = self.compressed_plan(recv, op, algorithm, wire, "reduce_scatter")
        with WorkArray(recv, plan.wire) as out:
            self.run(plan, self._input(send, plan.wire, out), out, plan.rop, transport=t)
        return recvbuf

    def _all_gather(self, t: Transport, sendbuf, recvbuf, algorithm):
        send, recv = as_input(sendbuf, "all_gather"), as_output(recvbuf, "all_gather")
        self._check_pair("all_gather", send, recv, recv.size, send.size * self.size, "recvbuf", "size * sendbuf")
        plan = self.plan("all_gather", send, None, algorithm)
        with WorkArray(recv, recv.dtype) as out:
            self.run(plan, self._input(send, send.dtype, out), out, transport=t)
        return recvbuf

    def _broadcast(self, t: Transport, buf, root, algorithm):
        array = as_output(buf, "broadcast")
        plan = self.plan("broadcast", array, None, algorithm, root=root)
        with WorkArray(array, array.dtype) as work:
            self.run(plan, work, root, transport=t)
        return buf

    def _reduce(self, t: Transport, sendbuf, recvbuf, op, root, algorithm):
        send = as_input(sendbuf, "reduce")
        plan = self.plan("reduce", send, op, algorithm, root=root)
        recv = self._root_buffer("reduce", recvbuf, "recvbuf", root, send, send.size)
        with WorkArray(recv, plan.wire) if recv is not None else NoBuffer() as out:
            self.run(plan, self._input(send, plan.wire, out), out, plan.rop, root, transport=t)
        return recvbuf

    def _gather(self, t: Transport, sendbuf, recvbuf, root, algorithm):
        send = as_input(sendbuf, "gather")
        plan = self.plan("gather", send, None, algorithm, root=root)
        recv = self._root_buffer("gather", recvbuf, "recvbuf", root, send, send.size * self.size)
        with WorkArray(recv, send.dtype) if recv is not None else NoBuffer() as out:
            self.run(plan, self._input(send, send.dtype, out), out, root, transport=t)
        return recvbuf

    def _scatter(self, t: Transport, sendbuf, recvbuf, root, algorithm):
        recv = as_output(recvbuf, "scatter")
        plan = self.plan("scatter", recv, None, algorithm, root=root)
        send = self._root_buffer("scatter", sendbuf, "sendbuf", root, recv, recv.size * self.size, output=False)
        with WorkArray(recv, recv.dtype) as out:
            self.run(plan, None if send is None else self._input(send, recv.dtype, out), out, root, transport=t)
        return recvbuf

    def _all_to_all(self, t: Transport, sendbuf, recvbuf, algorithm):
        send, recv = as_input(sendbuf, "all_to_all"), as_output(recvbuf, "all_to_all")
        self._check_pair("all_to_all", send, recv, recv.size, send.size, "recvbuf", "sendbuf")
        if send.size % self.size:
            raise ValueError(f"all_to_all: sendbuf has {send.size} elements, not a multiple of the communicator "
                             f"size {self.size} (use all_to_all_v for uneven blocks)")
        block = send.size // self.size
        counts, displs = (block,) * self.size, tuple(range(0, block * self.size, block)) if block else (0,) * self.size
        plan = self.plan("all_to_all", send, None, algorithm)
        with WorkArray(recv, recv.dtype) as out:
            self.run(plan, self._input(send, send.dtype, out), counts, displs, out, counts, displs, transport=t)
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
        plan = self.plan("all_to_all_v", send, None, algorithm)
        with WorkArray(recv, recv.dtype) as out:
            self.run(plan, self._input(send, send.dtype, out), send_counts, _displs(send_counts), out,
                      recv_counts, _displs(recv_counts), transport=t, counts=(send_counts, recv_counts))
        return recvbuf

    # ------------------------------------------------------------------ helpers
    def _barrier_on(self, t: Transport) -> None:
        self.run(_BARRIER, transport=t)

    def _allreduce_returning(self, t: Transport, buf, op, algorithm, wire=None):
        self._allreduce(t, buf, op, algorithm, wire)
        return buf

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


def _as_it_is(array: np.ndarray) -> bool:
    """Whether an algorithm may work on ``array`` itself: C-contiguous and writable (else through a work array)."""
    flags = array.flags
    return flags.c_contiguous and flags.writeable
