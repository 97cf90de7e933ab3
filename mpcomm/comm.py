"""Communicator: validates arguments, dispatches to an algorithm, records what it measured.

It holds no algorithm bodies (those live in ``mpcomm.algorithms``). Three private duplicates of the user's
communicator keep traffic apart: blocking collectives, point-to-point, and the non-blocking collectives
that run on the progress thread, so messages of one kind can never match another.
"""
from __future__ import annotations

import json
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from mpi4py import MPI

from . import p2p, staging
from .algorithms import REGISTRY
from .algorithms.auto import Selector
from .buffers import (
    AVG,
    SUM,
    as_input,
    as_output,
    check_dtype_op,
    dtype_name,
    flat,
    reduce_op,
    same_device,
    wire_dtype,
)
from .errors import CollectiveMismatchError, MpcommError
from .transport import Transport, ranks_per_core, split_node
from .work import FutureWork, Work

_SIGNATURE_BYTES = 256


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


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
        self.mpi: MPI.Comm = MPI.COMM_WORLD if comm is None else comm
        self.timeout = float(timeout) if timeout is not None else _env_float("MPCOMM_TIMEOUT", 30.0)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        self.validate = _env_flag("MPCOMM_VALIDATE") if validate is None else bool(validate)
        env_rpn = os.environ.get("MPCOMM_RANKS_PER_NODE")
        self.ranks_per_node = ranks_per_node if ranks_per_node is not None else (int(env_rpn) if env_rpn else None)
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        node = split_node(self.mpi, self.ranks_per_node)
        self.node_rank, self.node_size = node.Get_rank(), node.Get_size()
        self.num_nodes = self.mpi.allreduce(1 if self.node_rank == 0 else 0)
        node.Free()
        self.ranks_per_core = ranks_per_core(self.mpi)  # > 1: ranks share cores (the auto model accounts for it)
        self._sync = Transport(self.mpi.Dup(), self.timeout, self.ranks_per_node)
        self._p2p = Transport(self.mpi.Dup(), self.timeout)
        # Made here, not on first use: Dup is collective, and starting a non-blocking collective must not block.
        self._async = Transport(self.mpi.Dup(), self.timeout, self.ranks_per_node)
        self._executor: ThreadPoolExecutor | None = None
        self._stats: dict[tuple[str, str], dict[str, float]] = {}
        self._stats_lock = threading.Lock()
        self.selector = Selector.default(self)
        self._broken: str | None = None  # why collectives are refused: an earlier one stopped midway
        self._inline: _InlineProgress | None = None
        tuning_file = os.environ.get("MPCOMM_TUNING_FILE")
        if tuning_file:
            self.load_tuning(tuning_file, missing_ok=True)

    # ------------------------------------------------------------------ basics
    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, node {self.node_rank}/{self.node_size})"

    def split(self, color: int, key: int | None = None) -> "Communicator":
        """A Communicator over ``MPI.Comm.Split(color, key)``, with this one's settings."""
        sub = self.mpi.Split(color, self.rank if key is None else key)
        return Communicator(sub, timeout=self.timeout, validate=self.validate, ranks_per_node=self.ranks_per_node)

    def barrier(self) -> None:
        """Block until every rank has arrived (bounded by the timeout)."""
        self._drain_deferred()
        with self._sync.running("barrier"):
            self._sync.wait([self._sync.mpi.Ibarrier()], peers=self._others())

    def stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Measured totals: ``{operation: {algorithm: {"calls", "bytes", "seconds"}}}``."""
        with self._stats_lock:
            out: dict[str, dict[str, dict[str, float]]] = {}
            for (operation, algorithm), record in self._stats.items():
                out.setdefault(operation, {})[algorithm] = dict(record)
            return out

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats.clear()

    # ------------------------------------------------------------------ calibration of algorithm="auto"
    def tune(self, sizes=None, repeats: int = 5, operations=("allreduce",), dtype="float32",
             algorithms=None, verbose: bool = True) -> dict:
        """Time every algorithm at ``sizes`` (bytes) on this communicator and make ``auto`` use the fastest.

        Collective. Rank 0 decides and broadcasts, so all ranks hold the same table; it is also returned
        (see ``mpcomm.tuning``) and can be saved with ``save_tuning``. The measurement runs are not counted
        in ``stats()``. With ``verbose`` rank 0 prints the times and per-algorithm alpha/beta fits.
        """
        from . import tuning

        with self._stats_lock:
            saved = {key: dict(record) for key, record in self._stats.items()}
        try:
            table = tuning.tune(self, tuning.DEFAULT_SIZES if sizes is None else sizes, repeats, operations,
                                dtype, algorithms, verbose)
        finally:
            with self._stats_lock:
                self._stats = saved
        self.selector.load(table, source="the table just measured")
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
        return self.selector.load(table, source=f"tuning file {path!r}")

    def free(self) -> None:
        """Release the private MPI communicators and the progress thread (the wrapped comm stays)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._drain_deferred()
        for transport in (self._sync, self._p2p, self._async):
            if transport is not None:
                transport.free()

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buf: Any, op: str = SUM, algorithm: str = "auto") -> Any:
        """Reduce ``buf`` over all ranks, in place; returns ``buf``."""
        self._allreduce(self._sync, buf, op, algorithm)
        return buf

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: str = SUM, algorithm: str = "auto") -> Any:
        """``recvbuf`` <- chunk ``rank`` of the reduction of ``sendbuf`` (``sendbuf.size == size * recvbuf.size``)."""
        self._reduce_scatter(self._sync, sendbuf, recvbuf, op, algorithm)
        return recvbuf

    def all_gather(self, sendbuf: Any, recvbuf: Any, algorithm: str = "auto") -> Any:
        """``recvbuf`` <- every rank's ``sendbuf`` in rank order (``recvbuf.size == size * sendbuf.size``)."""
        self._all_gather(self._sync, sendbuf, recvbuf, algorithm)
        return recvbuf

    def broadcast(self, buf: Any, root: int = 0, algorithm: str = "auto") -> Any:
        """Copy ``buf`` from ``root`` to every rank, in place; returns ``buf``."""
        array = as_output(buf, "broadcast")
        check_dtype_op(array.dtype, None, "broadcast")
        self._check_rank(root, "root", "broadcast")
        algorithm = self._resolve("broadcast", algorithm, array.nbytes, array.dtype)
        signature = self._signature("broadcast", array, None, algorithm, root=root)
        with self._collective(self._sync, signature, array.nbytes) as t, _Flat(array, array.dtype) as work:
            if work.size:
                staging.run(t, "broadcast", algorithm, work, root)
        return buf

    # ------------------------------------------------------------------ non-blocking collectives
    def iallreduce(self, buf: Any, op: str = SUM, algorithm: str = "auto") -> Work:
        """Start an all-reduce on the progress thread; ``wait()`` returns ``buf``."""
        return self._submit("allreduce", lambda t: self._allreduce(t, buf, op, algorithm) or buf)

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, op: str = SUM, algorithm: str = "auto") -> Work:
        return self._submit("reduce_scatter", lambda t: self._reduce_scatter(t, sendbuf, recvbuf, op, algorithm) or recvbuf)

    def iall_gather(self, sendbuf: Any, recvbuf: Any, algorithm: str = "auto") -> Work:
        return self._submit("all_gather", lambda t: self._all_gather(t, sendbuf, recvbuf, algorithm) or recvbuf)

    # ------------------------------------------------------------------ point to point
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        p2p.isend(staging.for_buffers(self._p2p, "send", buf), buf, dst, tag).wait()

    def recv(self, buf: Any, src: int, tag: int = 0) -> Any:
        return p2p.irecv(staging.for_buffers(self._p2p, "recv", buf), buf, src, tag).wait()

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work:
        return p2p.isend(staging.for_buffers(self._p2p, "send", buf), buf, dst, tag)

    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        return p2p.irecv(staging.for_buffers(self._p2p, "recv", buf), buf, src, tag)

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any, src: int, tag: int = 0) -> Any:
        t = staging.for_buffers(self._p2p, "sendrecv", sendbuf, recvbuf)  # host or device transport
        receiving = p2p.irecv(t, recvbuf, src, tag)
        sending = p2p.isend(t, sendbuf, dst, tag)
        sending.wait()
        return receiving.wait()

    # ------------------------------------------------------------------ bodies shared by blocking and non-blocking forms
    def _allreduce(self, t: Transport, buf, op, algorithm) -> None:
        array = as_output(buf, "allreduce")
        rop = reduce_op(op, "allreduce")
        check_dtype_op(array.dtype, rop.name, "allreduce")
        if rop.name == AVG:
            rop = rop.averaged(self.size)  # each algorithm divides where it finishes a sum, before sharing it
        algorithm = self._resolve("allreduce", algorithm, array.nbytes, array.dtype)
        signature = self._signature("allreduce", array, rop.name, algorithm)
        with self._collective(t, signature, array.nbytes) as t, _Flat(array, wire_dtype(array.dtype)) as work:
            if work.size:
                staging.run(t, "allreduce", algorithm, work, rop)

    def _reduce_scatter(self, t: Transport, sendbuf, recvbuf, op, algorithm) -> None:
        send, recv = as_input(sendbuf, "reduce_scatter"), as_output(recvbuf, "reduce_scatter")
        self._check_pair("reduce_scatter", send, recv, send.size, recv.size * self.size, "sendbuf", "size * recvbuf")
        rop = reduce_op(op, "reduce_scatter")
        check_dtype_op(recv.dtype, rop.name, "reduce_scatter")
        algorithm = self._resolve("reduce_scatter", algorithm, send.nbytes, send.dtype)
        signature = self._signature("reduce_scatter", recv, rop.name, algorithm)
        wire = wire_dtype(recv.dtype)
        with self._collective(t, signature, send.nbytes) as t, _Flat(recv, wire) as out:
            if out.size:
                staging.run(t, "reduce_scatter", algorithm, _Flat.read(send, wire), out, rop)
                if rop.name == AVG:
                    out /= self.size

    def _all_gather(self, t: Transport, sendbuf, recvbuf, algorithm) -> None:
        send, recv = as_input(sendbuf, "all_gather"), as_output(recvbuf, "all_gather")
        self._check_pair("all_gather", send, recv, recv.size, send.size * self.size, "recvbuf", "size * sendbuf")
        check_dtype_op(recv.dtype, None, "all_gather")
        algorithm = self._resolve("all_gather", algorithm, recv.nbytes, recv.dtype)
        signature = self._signature("all_gather", send, None, algorithm)
        with self._collective(t, signature, recv.nbytes) as t, _Flat(recv, recv.dtype) as out:
            if out.size:
                staging.run(t, "all_gather", algorithm, _Flat.read(send, send.dtype), out)

    # ------------------------------------------------------------------ helpers
    def _resolve(self, operation: str, algorithm: str, nbytes: int, dtype) -> str:
        if algorithm == "auto":
            return self.selector.choose(operation, nbytes, np.dtype(dtype))
        if algorithm not in REGISTRY[operation]:
            raise ValueError(
                f"{operation}: unknown algorithm {algorithm!r}; choose one of {sorted(REGISTRY[operation]) + ['auto']}"
            )
        return algorithm

    def _signature(self, operation: str, array, op: str | None, algorithm: str, root: int | None = None) -> dict:
        return {
            "operation": operation,
            "dtype": dtype_name(array.dtype),
            "shape": list(array.shape),
            "op": op,
            "algorithm": algorithm,
            "root": root,
        }

    def _collective(self, t: Transport, signature: dict, nbytes: int) -> "_Collective":
        """Agree on the arguments (validate=True), run the body, add its measured time to the stats."""
        return _Collective(self, t, signature, nbytes)

    def _share_from_root(self, obj, operation: str):
        """Rank 0's ``obj`` on every rank (pickled; waits bounded by the timeout, like every collective)."""
        with self._sync.running(operation):
            return self._sync.bcast_object(obj, root=0)

    def _agree(self, t: Transport, signature: dict) -> None:
        mine = np.zeros(_SIGNATURE_BYTES, dtype=np.uint8)
        encoded = json.dumps(signature, sort_keys=True).encode()[:_SIGNATURE_BYTES]
        mine[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        everyone = np.empty((self.size, _SIGNATURE_BYTES), dtype=np.uint8)
        t.wait([t.mpi.Iallgather(mine, everyone)], peers=self._others())
        if (everyone == mine).all():
            return
        described = "; ".join(f"rank {r}: {_decode(row)}" for r, row in enumerate(everyone))
        raise CollectiveMismatchError(f"rank {self.rank}: {signature['operation']}: ranks disagree — {described}")

    def _submit(self, operation: str, body) -> Work:
        """Queue a non-blocking collective: on the progress thread (one worker, so operations run in issue
        order), or, when MPI cannot be called from two threads, to run inside ``wait()`` (progress on wait).
        The body runs on the caller's current CUDA stream (device buffers: see ``mpcomm.staging``)."""
        body = staging.on_stream(staging.caller_stream(), body)
        if self._executor is None and self._inline is None:
            if _progress_thread_allowed():
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mpcomm-progress-{self.rank}")
            else:
                self._inline = _InlineProgress()
        if self._inline is not None:
            return self._inline.submit(body, self._async)
        return FutureWork(self._executor.submit(body, self._async), operation, self._others(), self.rank)

    def _drain_deferred(self) -> None:
        """Progress on wait: run the queued non-blocking collectives before a blocking one, so every rank
        runs all its collectives in issue order whatever it waits on first."""
        if self._inline is not None:
            self._inline.run_until(None)

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def _check_rank(self, rank: int, role: str, operation: str) -> None:
        if not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < self.size:
            raise ValueError(f"{operation}: {role} {rank!r} is out of range for a communicator of size {self.size}")

    def _check_pair(self, operation, send, recv, got, want, got_name, want_name) -> None:
        same_device(operation, send, recv)
        if send.dtype != recv.dtype:
            raise TypeError(f"{operation}: sendbuf is {send.dtype} but recvbuf is {recv.dtype}; they must match")
        if got != want:
            raise ValueError(
                f"{operation}: {got_name} has {got} elements but {want_name} = {want} "
                f"(communicator size {self.size}, sendbuf {send.size}, recvbuf {recv.size})"
            )


class _Collective:
    """Context of :meth:`Communicator._collective` (a class, not a generator: it runs on every call)."""

    __slots__ = ("comm", "t", "signature", "nbytes", "running", "start")

    def __init__(self, comm: Communicator, t: Transport, signature: dict, nbytes: int):
        self.comm, self.t, self.signature, self.nbytes = comm, t, signature, nbytes

    def __enter__(self) -> Transport:
        comm, t = self.comm, self.t
        if comm._broken is not None:
            raise MpcommError(f"rank {comm.rank}: {_Label(self.signature, self.nbytes)}: this communicator is unusable: "
                              f"{comm._broken}; its messages may still be in flight, so later collectives could "
                              f"match them and return wrong data. Create a new Communicator.")
        if t is comm._sync:
            comm._drain_deferred()
        self.running = t.running(_Label(self.signature, self.nbytes))
        self.running.__enter__()
        try:
            if comm.validate:
                comm._agree(t, self.signature)
        except BaseException:
            self.running.__exit__(None, None, None)
            raise
        self.start = time.perf_counter()
        return t

    def __exit__(self, exc_type, exc, tb) -> bool:
        elapsed = time.perf_counter() - self.start
        self.running.__exit__(exc_type, exc, tb)
        if exc_type is not None and issubclass(exc_type, MpcommError) and self.comm._broken is None:
            self.comm._broken = f"{_Label(self.signature, self.nbytes)} stopped midway ({exc_type.__name__}: {exc})"
        if exc_type is None:
            key = (self.signature["operation"], self.signature["algorithm"])
            with self.comm._stats_lock:
                record = self.comm._stats.setdefault(key, {"calls": 0, "bytes": 0, "seconds": 0.0})
                record["calls"] += 1
                record["bytes"] += self.nbytes
                record["seconds"] += elapsed
        return False


class _Label:
    """Names a collective call in error messages; formatted only when an error needs it (hot path)."""

    __slots__ = ("signature", "nbytes")

    def __init__(self, signature: dict, nbytes: int):
        self.signature, self.nbytes = signature, nbytes

    def __str__(self) -> str:
        s = self.signature
        return f"{s['operation']}[{s['algorithm']}] of shape {tuple(s['shape'])} {s['dtype']} ({self.nbytes} B)"


def _decode(row: np.ndarray) -> str:
    return bytes(row).rstrip(b"\0").decode(errors="replace")


_warned_thread_level = False


def _progress_thread_allowed() -> bool:
    """A progress thread needs MPI_THREAD_MULTIPLE (the main thread keeps calling MPI); env
    ``MPCOMM_PROGRESS=wait`` asks for progress-on-wait explicitly."""
    global _warned_thread_level
    if os.environ.get("MPCOMM_PROGRESS", "thread").strip().lower() == "wait":
        return False
    level = MPI.Query_thread()
    if level >= MPI.THREAD_MULTIPLE:
        return True
    if not _warned_thread_level:
        _warned_thread_level = True
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        warnings.warn(
            f"mpcomm: MPI was initialized with MPI_THREAD_{names.get(level, level)}, not MPI_THREAD_MULTIPLE, so "
            "iallreduce/ireduce_scatter/iall_gather cannot run on a progress thread; they run inside wait() "
            "(or is_completed(), or the next blocking collective) instead, in issue order, and do not overlap "
            "with computation. Initialize MPI with THREAD_MULTIPLE (mpi4py's default) to overlap.",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


class _InlineProgress:
    """Non-blocking collectives that run on the calling thread when waited on, oldest first."""

    def __init__(self):
        self._queue: list[_DeferredWork] = []

    def submit(self, body, transport: Transport) -> "_DeferredWork":
        work = _DeferredWork(self, body, transport)
        self._queue.append(work)
        return work

    def run_until(self, work: "_DeferredWork | None") -> None:
        """Run queued operations in issue order up to and including ``work`` (all of them for None)."""
        while self._queue and (work is None or not work.done):
            self._queue.pop(0).run()


class _DeferredWork(Work):
    """A collective queued for progress on wait; its errors are raised by ``wait()``."""

    def __init__(self, progress: _InlineProgress, body, transport: Transport):
        self._progress, self._body, self._transport = progress, body, transport
        self.done, self._result, self._error = False, None, None

    def run(self) -> None:
        try:
            self._result = self._body(self._transport)
        except Exception as exc:  # kept for wait(), like a Future
            self._error = exc
        self.done = True

    def wait(self, timeout: float | None = None) -> Any:
        """Run this operation (and those issued before it); bounded by the communicator's timeout."""
        self._progress.run_until(self)
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        self._progress.run_until(self)
        return True


class _Flat:
    """A contiguous 1-D work array in the wire dtype for ``array``, written back on exit if it is a copy."""

    def __init__(self, array, dtype):
        self.array, self.dtype = array, np.dtype(dtype)

    @staticmethod
    def read(array, dtype):
        """Contiguous 1-D ``array`` in ``dtype``: a view when the bytes allow it, else a copy."""
        return _Flat._convert(array, dtype)[0]

    @staticmethod
    def _convert(array, dtype):
        view = flat(array)
        if view is not None and view.dtype == dtype:
            return view, False
        if view is not None and view.dtype == np.bool_ and dtype == np.uint8:  # bool reduces as uint8
            return view.view(dtype), False
        # A fresh C-ordered copy: reshape(-1) alone may return a strided view (e.g. of a[::2]), not a copy.
        return array.astype(dtype, order="C").reshape(-1), True

    def __enter__(self):
        self.work, self.copied = self._convert(self.array, self.dtype)
        return self.work

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.copied:
            self.array[...] = self.work.reshape(self.array.shape).astype(self.array.dtype, copy=False)
        return False
