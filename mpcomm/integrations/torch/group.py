"""``BackendMpcomm``: the c10d Backend torch binds to the CPU device for the ``"mpcomm"`` backend.

torch builds each process group itself and registers this Backend with it for ``cpu``
(``_new_process_group_helper``), as it does gloo: ``group._get_backend(cpu)``, ``group._device_types``,
``"cpu:mpcomm,cuda:nccl"`` and the dispatcher's CPU kernels (``dist.all_reduce``, DDP's reducer, functional
collectives, DTensor) all reach these methods, and ``dist.split_group`` its :meth:`~BackendMpcomm.split`. The class
derives from ``backend_base.cpp``'s c10d Backend (``base.py``), whose methods take torch 2.14's Python names.
Collectives go through the Backend's :class:`~.lane.Lane` (issue order, synchronous calls inline); sends and
receives use mpcomm's point-to-point directly.

The class is assembled from what it does: this module holds the group (running calls in issue order, the
gathers, reduce-scatters and all-to-alls, barriers, point-to-point, teardown); the all-reduce paths are
:class:`~.allreduce.AllreducePaths` and the rooted calls :class:`~.rooted.RootedCalls`.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch.distributed as dist
from mpi4py import MPI

from ...comm import Communicator
from ...p2p import ANY_SOURCE
from .allreduce import AllreducePaths
from .base import backend_base, keep_alive
from .lane import Job, Lane, done_work, p2p_work, queued_work
from .pages import HugePages
from .rooted import RootedCalls
from .tensors import Reduction, as_numpy, as_reducible, reduction, same_dtype, same_layout, torch_error, unpack

BACKEND = "mpcomm"
# monitored_barrier's tags: the top of the MPI library's tag range (see _next_monitor_tags).
_TAG_UB = cast(int, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))  # (every MPI library sets it)
_MONITOR_TAGS = min(0x10000, (_TAG_UB + 1) // 2)
_MONITOR_TAG = _TAG_UB + 1 - _MONITOR_TAGS


class BackendMpcomm(AllreducePaths, RootedCalls, backend_base()):  # type: ignore[misc]  # (a base made at runtime)
    """``torch.distributed`` over an :class:`mpcomm.Communicator` (CPU tensors)."""

    def __init__(self, comm: Communicator, algorithm: str = "auto", name: str = "", owned: MPI.Comm | None = None):
        super().__init__(comm.rank, comm.size)
        keep_alive(self)
        self.comm, self.algorithm = comm, algorithm
        # Its C++ all-reduce (an Iallreduce, the small synchronous call's fastest path) never pairs with a persistent
        # one, which native would start for the same call issued asynchronously (the lane's Python path); set before
        # any call (the Communicator is the group's own, new)
        comm.transport.starts_persistent = False
        comm.unwatch()  # nor with a blocking one under the watchdog (Open MPI with --with-ft ulfm)
        # nor does auto send its small calls to rhd's exchange, which would take them off that C++ path
        comm.selector.model = replace(comm.selector.model, alpha_exchange=None)
        self._name = name or f"rank{comm.rank}"
        self._lane = Lane(self._name, threaded=MPI.Query_thread() >= MPI.THREAD_MULTIPLE,
                          on_failure=self._note_failure)
        self._failed = False  # some communication of this group failed on this rank (see shutdown)
        self._owned = owned  # the MPI communicator made for this group, freed at shutdown
        self._coalescing: list | None = None  # p2p Works between start_coalescing and end_coalescing
        self._monitor_calls = 0
        self._sequence = 0  # collectives issued on this group (torch's sequence number; gloo counts the same)
        self._pages = HugePages()  # large tensors reduced again and again: onto 2 MiB pages (pages.py)
        self._native = self._native_allreduce()
        self._native_plan: Callable[..., Any] | None
        self._native_run: Callable[..., Any] | None
        self._native_plan, self._native_run = self._native.functions() if self._native is not None else (None, None)

    def getBackendName(self) -> str:
        return BACKEND

    def _set_sequence_number_for_group(self) -> None:
        self._sequence = 0

    def _get_sequence_number_for_group(self) -> int:
        """The number of collectives issued on this group so far (the same on every rank)."""
        return self._sequence

    def __repr__(self) -> str:
        size = self.comm.size if self.comm is not None else "-"
        return f"BackendMpcomm(name={self._name!r}, rank={self.rank()}, size={size})"

    # ------------------------------------------------------------------ running
    def _issue(self, operation: str, body: Callable[[], None], result, opts) -> dist.Work:
        """Run the collective ``body`` in issue order: inline when torch waits at once (``opts.asyncOp`` false) and
        nothing is pending, else queued for the lane's worker. A synchronous call raises its error itself."""
        self._sequence += 1
        return self._in_order(operation, body, result, synchronous=opts is not None and not opts.asyncOp)

    def _in_order(self, operation: str, body: Callable[[], None], result, synchronous: bool) -> dist.Work:
        """``body`` after every call issued before it: inline where ``synchronous`` and nothing is pending, else
        queued for the lane's worker (and then waited for, where ``synchronous``)."""
        if synchronous and self._lane.enter():
            self._run_here(operation, body)
            return done_work(result)
        job = Job(body, result, operation)
        self._lane.submit(job)
        work = queued_work(self._lane, job)
        if synchronous:
            work.wait()
        return work

    def _run_here(self, operation: str, fn, *args) -> None:
        """``fn(*args)`` on the caller's thread, the lane already entered (and left here); raises torch's error."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001
            error = self._translated(exc, operation)
            if error is exc:
                raise
            raise error from exc
        finally:
            self._lane.leave()

    def _translated(self, exc: BaseException, operation: str) -> BaseException:
        """torch's error for ``exc`` (see ``torch_error``), noting a communication failure."""
        error = torch_error(exc, operation)
        if isinstance(error, dist.DistBackendError):
            self._note_failure()
        return error

    def _note_failure(self) -> None:
        self._failed = True

    def _check_size(self, operation: str, what: str, got: int, want: int) -> None:
        if got != want:
            raise ValueError(f"mpcomm backend: {operation}: {what} has {got} entries, the group has {want} ranks")

    # ------------------------------------------------------------------ all-gather
    def allgather(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i][r]`` <- rank r's ``input_tensors[i]`` (sizes may differ between ranks)."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"mpcomm backend: allgather: {len(output_tensors)} output lists for "
                             f"{len(input_tensors)} input tensors")
        steps = []
        for outputs, tensor in zip(output_tensors, input_tensors):
            self._check_size("allgather", "an output list", len(outputs), self.comm.size)
            send = as_numpy(tensor, "allgather input")
            recvs = [as_numpy(o, "allgather output") for o in outputs]
            same_dtype("allgather", [tensor, *outputs])
            if recvs[self.comm.rank].size != send.size:
                raise ValueError(f"mpcomm backend: allgather: this rank's output tensor has {recvs[self.comm.rank].size} "
                                 f"elements, its input {send.size}")
            steps.append((send, recvs))

        def body():
            for send, recvs in steps:
                if all(r.size == send.size for r in recvs):
                    gathered = np.empty(self.comm.size * send.size, dtype=send.dtype)
                    self.comm.all_gather(send, gathered, algorithm=self.algorithm)
                else:  # uneven: every rank sends its whole input to every rank
                    counts = [r.size for r in recvs]
                    gathered = np.empty(sum(counts), dtype=send.dtype)
                    self.comm.all_to_all_v(np.tile(send.reshape(-1), self.comm.size), [send.size] * self.comm.size,
                                           gathered, counts, algorithm=self.algorithm)
                unpack(gathered, recvs)

        return self._issue("allgather", body, output_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        """``output`` <- every rank's ``input`` in rank order (``output.numel() == size * input.numel()``)."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue("all_gather_into_tensor", self._all_gather_step(output, input), [output], opts)

    _allgather_base = all_gather_single

    def _all_gather_step(self, output, input) -> Callable[[], None]:
        out, send = as_numpy(output, "all_gather output"), as_numpy(input, "all_gather input")
        same_dtype("all_gather_into_tensor", [input, output])
        if out.size != self.comm.size * send.size:
            raise ValueError(f"mpcomm backend: all_gather_into_tensor: output has {out.size} elements, needs group "
                             f"size {self.comm.size} x input {send.size}")
        return partial(self.comm.all_gather, send, out, self.algorithm)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        steps = [self._all_gather_step(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._issue("all_gather_into_tensor_coalesced", partial(_run_all, steps), outputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][i]`` <- rank r's ``input_list[i]``; all inputs travel as one buffer of bytes."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        self._check_size("allgather_coalesced", "output_tensor_lists", len(output_lists), self.comm.size)
        sends = [as_numpy(t, "allgather_coalesced input") for t in input_list]
        recvs = [[as_numpy(t, "allgather_coalesced output") for t in outputs] for outputs in output_lists]
        for r, outputs in enumerate(recvs):
            if [(a.dtype, a.size) for a in outputs] != [(a.dtype, a.size) for a in sends]:
                raise ValueError(f"mpcomm backend: allgather_coalesced: output list {r} does not match the input "
                                 "list in length, dtypes and sizes")

        def body():
            mine = _pack_bytes(sends)
            everyone = np.empty((self.comm.size, mine.size), dtype=np.uint8)
            self.comm.all_gather(mine, everyone, algorithm=self.algorithm)
            for r, outputs in enumerate(recvs):
                _unpack_bytes(everyone[r], outputs)

        return self._issue("allgather_coalesced", body, output_lists, opts)

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]`` <- the reduction over ranks of ``input_tensors[i][rank]``."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        steps = []
        for out, inputs in zip(output_tensors, input_tensors, strict=True):
            self._check_size("reduce_scatter", "an input list", len(inputs), self.comm.size)
            same_layout("reduce_scatter", [out, *inputs])
            recv = as_reducible(out, "reduce_scatter output")
            sends = [as_reducible(t, "reduce_scatter input") for t in inputs]
            red = reduction(opts.reduceOp, out.dtype, "reduce_scatter")
            steps.append(partial(self._reduce_scatter, sends, recv, red))
        return self._issue("reduce_scatter", partial(_run_all, steps), output_tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        """``output`` <- block ``rank`` of the reduction over ranks of ``input`` (``size`` equal blocks)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue("reduce_scatter_tensor", self._reduce_scatter_step(output, input, opts.reduceOp),
                           [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_step(self, output, input, op) -> Callable[[], None]:
        recv, send = as_reducible(output, "reduce_scatter output"), as_reducible(input, "reduce_scatter input")
        same_dtype("reduce_scatter_tensor", [input, output])
        if send.size != self.comm.size * recv.size:
            raise ValueError(f"mpcomm backend: reduce_scatter_tensor: input has {send.size} elements, needs group "
                             f"size {self.comm.size} x output {recv.size}")
        return partial(self._reduce_scatter, [send], recv, reduction(op, output.dtype, "reduce_scatter_tensor"))

    def _reduce_scatter(self, sends: list[np.ndarray], recv: np.ndarray, red: Reduction) -> None:
        send = sends[0] if len(sends) == 1 else np.concatenate([a.reshape(-1) for a in sends])
        if red.local is None:
            assert red.name is not None  # a reduction mpcomm runs itself
            self.comm.reduce_scatter(send, recv, red.name, self.algorithm)
            return
        blocks = np.empty((self.comm.size,) + recv.shape, dtype=recv.dtype)
        self.comm.all_to_all(send, blocks, algorithm=self.algorithm)
        recv[...] = red.over(blocks)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        steps = [self._reduce_scatter_step(o, i, opts.reduceOp) for o, i in zip(outputs, inputs, strict=True)]
        return self._issue("reduce_scatter_tensor_coalesced", partial(_run_all, steps), outputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ all-to-all
    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[r]`` <- rank r's ``input_tensors[rank]`` (sizes may differ per pair)."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        self._check_size("alltoall", "input_tensor_list", len(input_tensors), self.comm.size)
        self._check_size("alltoall", "output_tensor_list", len(output_tensors), self.comm.size)
        same_dtype("alltoall", [*input_tensors, *output_tensors])
        sends = [as_numpy(t, "alltoall input") for t in input_tensors]
        recvs = [as_numpy(t, "alltoall output") for t in output_tensors]

        def body():
            send = np.concatenate([s.reshape(-1) for s in sends])
            recv = np.empty(sum(r.size for r in recvs), dtype=send.dtype)
            self.comm.all_to_all_v(send, [s.size for s in sends], recv, [r.size for r in recvs],
                                   algorithm=self.algorithm)
            unpack(recv, recvs)

        return self._issue("alltoall", body, output_tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: rows of ``input`` split by ``input_split_sizes`` (equal when empty) go to
        the ranks in order; ``output`` takes rank r's rows in its ``output_split_sizes[r]`` rows."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        same_dtype("all_to_all_single", [input, output])
        send, recv = as_numpy(input, "all_to_all_single input"), as_numpy(output, "all_to_all_single output")
        if not input_split_sizes and not output_split_sizes:
            if send.size % self.comm.size or send.size != recv.size:
                raise ValueError(f"mpcomm backend: all_to_all_single: input ({send.size} elements) and output "
                                 f"({recv.size}) must be equal and divisible by the group size {self.comm.size}")
            body = partial(self.comm.all_to_all, send, recv, self.algorithm)
        else:
            send_counts = self._split_counts("input", input, input_split_sizes)
            recv_counts = self._split_counts("output", output, output_split_sizes)
            body = partial(self.comm.all_to_all_v, send, send_counts, recv, recv_counts, self.algorithm)
        return self._issue("all_to_all_single", body, [output], opts)

    alltoall_base = all_to_all_single

    def _split_counts(self, which: str, tensor, splits: Sequence[int]) -> list[int]:
        """Element counts per rank from row split sizes (rows of dim 0; equal splits when none are given)."""
        rows = tensor.shape[0] if tensor.dim() else 1
        row = tensor.numel() // rows if rows else 0
        if not splits:
            if rows % self.comm.size:
                raise ValueError(f"mpcomm backend: all_to_all_single: {which} has {rows} rows, not divisible by "
                                 f"the group size {self.comm.size}; pass {which}_split_sizes")
            return [rows // self.comm.size * row] * self.comm.size
        self._check_size("all_to_all_single", f"{which}_split_sizes", len(splits), self.comm.size)
        if any(int(s) < 0 for s in splits) or sum(int(s) for s in splits) != rows:
            raise ValueError(f"mpcomm backend: all_to_all_single: {which}_split_sizes {list(splits)} must be >= 0 "
                             f"and add up to the {rows} rows of the {which}")
        return [int(s) * row for s in splits]

    # ------------------------------------------------------------------ barriers
    def barrier(self, opts=None):
        """All ranks of the group arrive; ``opts.timeout`` (if set) bounds this call, else the group's timeout."""
        opts = opts if opts is not None else dist.BarrierOptions()
        seconds = opts.timeout.total_seconds()
        if seconds <= 0:
            return self._issue("barrier", self.comm.barrier, [], opts)
        self._sequence += 1
        job = Job(self.comm.barrier, [], "barrier")
        self._lane.submit(job)
        work = queued_work(self._lane, job)
        if not opts.asyncOp:
            work.wait(seconds)
        return work

    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier (same messages): every rank checks in with rank 0, which waits up to
        ``opts.timeout`` (unset: the group's) and then releases them; a rank that did not arrive is named in rank
        0's error (every such rank with ``wait_all_ranks``). ``dist.monitored_barrier`` reaches it on torch 2.14
        on; torch 2.13's refuses every backend not named "gloo", so there call ``group.monitored_barrier`` (or
        ``mpcomm.integrations.torch.monitored_barrier``)."""
        limit = _seconds_or(getattr(opts, "timeout", opts), self.comm.timeout)
        millis = int(round(limit * 1000))
        check_in, release = self._next_monitor_tags()
        token = np.full(1, self.comm.rank, dtype=np.int64)
        if self.comm.rank != 0:
            try:  # bounded as on gloo; the release may come up to ``limit`` after rank 0 took the last check-in
                self.comm.isend(token, 0, check_in).wait(limit)
                self.comm.irecv(np.empty(1, dtype=np.int64), 0, release).wait(2 * limit)
            except BaseException as exc:  # noqa: BLE001
                self._note_failure()
                raise dist.DistBackendError(
                    f"Rank {self.comm.rank} successfully reached monitoredBarrier, but received errors while waiting "
                    f"for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: "
                    f"\n{exc}") from exc
            return
        start = time.monotonic()
        processed: list[int] = []
        failed: list[int] = []
        for peer in range(1, self.comm.size):
            remaining = limit if wait_all_ranks else limit - (time.monotonic() - start)
            if remaining <= 0 and not wait_all_ranks:
                self._note_failure()
                done = (f"Successfully processed ranks: {', '.join(map(str, processed))}" if processed
                        else "No ranks successfully processed in monitoredBarrier.")
                raise dist.DistBackendError(f"Rank 0 timed out in monitoredBarrier after {millis} ms.\n{done}")
            try:
                self.comm.irecv(np.empty(1, dtype=np.int64), peer, check_in).wait(remaining)
            except BaseException as exc:  # noqa: BLE001 - this rank did not check in in time
                self._note_failure()
                if not wait_all_ranks:
                    raise dist.DistBackendError(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {millis} ms"
                                                f"\n Original exception: \n{exc}") from exc
                failed.append(peer)
            else:
                processed.append(peer)
        if failed:
            raise dist.DistBackendError(f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
                                        f"monitoredBarrier in {millis} ms")
        for work in [self.comm.isend(token, peer, release) for peer in range(1, self.comm.size)]:
            work.wait(None)

    def _next_monitor_tags(self) -> tuple[int, int]:
        """Two tags of monitored_barrier's own range, new for each call (a late check-in from an earlier call can
        never be taken for this one's)."""
        first = _MONITOR_TAG + (2 * self._monitor_calls) % (_MONITOR_TAGS - 1)
        self._monitor_calls += 1
        return first, first + 1

    # ------------------------------------------------------------------ dist.split_group
    def timeout_seconds(self) -> float:
        """This group's deadline in seconds: the timeout of the options ``dist.split_group`` starts a child from."""
        return self.comm.timeout

    def split(self, ranks: list[int], timeout: float, name: str) -> "BackendMpcomm | None":
        """The backend of the child group of ``dist.split_group`` that holds this rank (torch 2.15 on, for a CPU
        group; gloo's ``split``): ``ranks`` are this group's ranks in the child's order, ``timeout`` the child's
        deadline in seconds; None where this rank is not in ``ranks``. torch calls it on every rank of this group;
        it runs after the calls issued before it."""
        made: list[Communicator | None] = []
        self._in_order("split_group", lambda: made.append(self._split_communicator(ranks, timeout)), None,
                       synchronous=True)
        return None if made[0] is None else BackendMpcomm(made[0], self.algorithm, name=name)

    def _split_communicator(self, ranks: list[int], timeout: float) -> Communicator | None:
        """This group's ``ranks``, in that order, as a Communicator of their own (``Communicator.split`` over this
        group, under the deadline); its members then check that each was given the same ranks (a ValueError on
        every member where not: the split ranks of one call must not overlap). None where this rank is not in
        ``ranks``."""
        rank = self.comm.rank
        member = rank in ranks
        child = self.comm.split(min(ranks) if member else MPI.UNDEFINED, ranks.index(rank) if member else 0,
                                timeout=timeout if timeout > 0 else None)
        if child is None:
            return None
        given = child.allgather_object(list(ranks), "split_group")
        if len(given) != len(ranks) or any(other != given[0] for other in given):
            child.free()
            raise ValueError(f"mpcomm backend: split_group: rank {rank} was given ranks {list(ranks)}, but the "
                             f"child group it joined has the {len(given)} ranks given {given} (in the child's "
                             "order): the split ranks must not overlap")
        return child

    # ------------------------------------------------------------------ point to point
    def send(self, tensors, dstRank: int, tag: int = 0):
        (tensor,) = tensors
        return self._p2p(self.comm.isend, as_numpy(tensor, "send tensor"), dstRank, tag, tensors, "send")

    def recv(self, tensors, srcRank: int, tag: int = 0):
        (tensor,) = tensors
        return self._p2p(self.comm.irecv, as_numpy(tensor, "recv tensor"), srcRank, tag, tensors, "recv")

    def recv_anysource(self, tensors, tag: int = 0):
        """A receive from whichever rank sends first; ``work._source_rank()`` says which."""
        (tensor,) = tensors
        return self._p2p(self.comm.irecv, as_numpy(tensor, "recv tensor"), ANY_SOURCE, tag, tensors, "recv")

    def _p2p(self, start, array, peer, tag, tensors, operation):
        try:
            request = start(array, peer, tag)
        except BaseException as exc:  # noqa: BLE001
            error = self._translated(exc, operation)
            if error is exc:
                raise
            raise error from exc
        work = p2p_work(request, tensors, operation, self._note_failure)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def start_coalescing(self) -> None:
        """``_coalescing_manager(group, device)``: the sends and receives issued until ``end_coalescing``
        complete together (collectives inside it are coalesced by torch itself). ``supports_coalescing`` stays
        False, as on gloo, so ``batch_isend_irecv`` issues its operations one by one and returns their Works."""
        if self._coalescing is not None:
            raise RuntimeError("mpcomm backend: start_coalescing called twice without end_coalescing")
        self._coalescing = []

    def end_coalescing(self):
        works, self._coalescing = self._coalescing or [], None
        for work in works:
            work.wait()
        return done_work([])

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Finish what is queued, stop the worker, and free the group's MPI communicators if every rank of the
        group agrees that none of its communication failed (idempotent).

        A failure leaves messages behind: a barrier that timed out on one rank has sent to peers that never
        received. The MPI library recycles a freed communicator's context id, so a communicator made later could
        match those messages and return wrong data. So if any rank saw a failure, or the ranks do not all arrive
        here in time (``Communicator.free``), the communicators are left allocated (with a warning)."""
        self._lane.close()
        if self._native is not None:
            self._native.clear()  # (its plans refer back to it)
            self._native = self._native_plan = self._native_run = None
        if self.comm is None:
            return
        comm, owned, self._owned = self.comm, self._owned, None
        self.comm = None  # type: ignore[assignment]  # (shut down: no communicator, every later call refused)
        if comm.free(failed=self._failed):  # the ranks agree that nothing failed
            if owned is not None:
                owned.Free()
            return
        warnings.warn(f"mpcomm backend: process group {self._name!r} is shut down without freeing its MPI "
                      "communicators: some of its communication failed, or not every rank of the group shut it "
                      "down in time, and a later communicator could otherwise match messages left behind",
                      RuntimeWarning, stacklevel=2)

    def abort(self) -> None:
        self.shutdown()


# ---------------------------------------------------------------------------------------------- helpers
def _seconds_or(timeout, default: float) -> float:
    """A timedelta (or seconds) argument in seconds; ``default`` for None or a negative one (torch's "unset")."""
    seconds = None if timeout is None else (
        timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout))
    return float(default) if seconds is None or seconds < 0 else seconds


def _run_all(steps) -> None:
    for step in steps:
        step()


def _pack_bytes(arrays: list[np.ndarray]) -> np.ndarray:
    """The bytes of ``arrays`` one after another (any dtypes)."""
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)


def _unpack_bytes(flat: np.ndarray, arrays: list[np.ndarray]) -> None:
    offset = 0
    for a in arrays:
        a[...] = flat[offset: offset + a.nbytes].view(a.dtype).reshape(a.shape)
        offset += a.nbytes
