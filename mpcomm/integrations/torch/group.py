"""``BackendMpcomm``: the c10d Backend torch binds to the CPU device for the ``"mpcomm"`` backend.

torch builds each process group itself and registers this Backend with it for ``cpu``
(``_new_process_group_helper``), as it does gloo: ``group._get_backend(cpu)``, ``group._device_types``,
``"cpu:mpcomm,cuda:nccl"`` and the dispatcher's CPU kernels (``dist.all_reduce``, DDP's reducer, functional
collectives, DTensor) all reach these methods. The class derives from torch's Python-subclassable Backend where torch
has one (2.14 on) and from ``backend_base.cpp`` where it has not (``base.py`` chooses); the methods take torch's
Backend names either way. Collectives go through the Backend's :class:`~.lane.Lane` (issue order, synchronous calls
inline); sends and receives use mpcomm's point-to-point directly.
"""
from __future__ import annotations

import time
import warnings
from functools import partial
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ...algorithms import REGISTRY
from ...comm import Communicator
from ...p2p import ANY_SOURCE
from .base import backend_base, keep_alive
from .lane import Job, Lane, done_work, p2p_work, queued_work
from .pages import MIN_BYTES as HUGE_PAGES_FROM, HugePages
from .tensors import Reduction, as_numpy, as_reducible, direct_reduction, reduction, torch_error

BACKEND = "mpcomm"
# monitored_barrier's tags: the top of the MPI library's tag range (see _next_monitor_tags).
_TAG_UB = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
_MONITOR_TAGS = min(0x10000, (_TAG_UB + 1) // 2)
_MONITOR_TAG = _TAG_UB + 1 - _MONITOR_TAGS


class BackendMpcomm(backend_base()):
    """``torch.distributed`` over an :class:`mpcomm.Communicator` (CPU tensors)."""

    def __init__(self, comm: Communicator, algorithm: str = "auto", name: str = "", owned: MPI.Comm | None = None):
        super().__init__(comm.rank, comm.size)
        keep_alive(self)
        self.comm, self.algorithm = comm, algorithm
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
        """Run ``body`` in issue order: inline when torch waits at once (``opts.asyncOp`` false) and nothing is
        pending, else queued for the lane's worker. A synchronous call raises its error itself."""
        self._sequence += 1
        synchronous = opts is not None and not opts.asyncOp
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

    # ------------------------------------------------------------------ all-reduce
    def allreduce(self, tensors, opts=None):
        """Each tensor <- the reduction over ranks (a list of several is reduced together first, as gloo does).

        A synchronous call (``opts.asyncOp`` false, as ``dist.all_reduce`` makes it) that could run at once returns
        None once done: ``dist.all_reduce`` then has nothing to wait for ("the backend has synced"), and the
        8-byte call is spared a Work it would only discard."""
        if opts is None:
            opts = dist.AllreduceOptions()
        native_plan = self._native_plan
        if native_plan is not None and len(tensors) == 1:
            # The C++ extension takes the synchronous call on a tensor as it is where the Communicator plans its
            # native all-reduce (native_allreduce.cpp); it runs under Communicator.run, as every call does.
            plan = native_plan(tensors[0], opts)
            if plan is not None and self._lane.enter():
                if plan.nbytes >= HUGE_PAGES_FROM:
                    self._pages.reused(tensors[0])
                comm = self.comm
                self._sequence += 1
                self._run_here("allreduce", comm.run, plan, tensors[0], plan.rop)
                return None
        if not opts.asyncOp and len(tensors) == 1 and self._allreduce_now(tensors, opts):
            return None
        if len(tensors) != 1:
            return self._issue("allreduce", self._allreduce_several(tensors, opts.reduceOp), tensors, opts)
        tensor = tensors[0]
        red = reduction(opts.reduceOp, tensor.dtype, "allreduce")
        if tensor.is_sparse:
            return self._issue("allreduce", self._allreduce_sparse(tensor, red), tensors, opts)
        array = as_reducible(tensor, "allreduce tensor")
        if array.nbytes >= HUGE_PAGES_FROM:
            self._pages.reused(tensor)
        if red.local is not None:
            return self._issue("allreduce", partial(self._allreduce_gathered, array, red), tensors, opts)
        return self._issue("allreduce", partial(self.comm.allreduce, array, red.name, self.algorithm), tensors, opts)

    def _allreduce_now(self, tensors, opts):
        """``dist.all_reduce(t)``: its per-call cost is what this backend is measured by, so the common case takes
        the fewest steps: a reduction mpcomm runs itself, already seen for this dtype; a tensor ``Tensor.numpy()``
        takes as it is; nothing pending on the lane. Then it runs here (True); else False (``allreduce`` goes on)."""
        tensor = tensors[0]
        red = direct_reduction((hash(opts.reduceOp), tensor.dtype))  # (a ReduceOp hashes to its op number)
        if red is None:
            return False
        try:
            array = tensor.numpy()
        except (TypeError, RuntimeError, AttributeError):  # bfloat16, requires_grad, sparse, ...: the long way
            return False
        if not self._lane.enter():
            return False
        if array.nbytes >= HUGE_PAGES_FROM:
            self._pages.reused(tensor)
        self._sequence += 1
        self._run_here("allreduce", self.comm.allreduce, array, red.name, self.algorithm)
        return True

    def _native_allreduce(self):
        """The C++ all-reduce for this group's communicator (extension.py), or None where it cannot be built."""
        from . import extension

        module = extension.load()
        if module is None:
            return None
        t = self.comm.transport
        return module.NativeAllreduce(t.mpi.py2f(), t.size, self.comm, self._planned_natively, MPI.Request.f2py,
                                      MPI.Exception, t.quick_tests)

    def _planned_natively(self, tensor, opts):
        """For the C++ all-reduce, on a call it has not seen since auto's choices last changed: a copy of the
        Communicator's plan that runs in C++, if that plan is its native all-reduce on the buffer as it is; else
        None."""
        red = reduction(opts.reduceOp, tensor.dtype, "allreduce")
        if red.local is not None:
            return None
        array = tensor.detach().numpy().reshape(-1)
        plan = self.comm.plan("allreduce", array, red.name, self.algorithm)
        if plan.fn is not REGISTRY["allreduce"]["native"] or not plan.direct or plan.rop.divisor != 1:
            return None
        return plan.running(self._native_run)

    def _allreduce_gathered(self, array: np.ndarray, red: Reduction) -> None:
        """A reduction mpcomm does not run itself (bitwise ops): gather every rank's array, reduce in rank order."""
        everyone = np.empty((self.comm.size,) + array.shape, dtype=array.dtype)
        self.comm.all_gather(array, everyone, algorithm=self.algorithm)
        array[...] = red.over(everyone)

    def _allreduce_sparse(self, tensor, red: Reduction) -> Callable[[], None]:
        """A sparse COO all-reduce (SUM, as gloo): every rank's indices and values gathered, summed by coalescing."""
        if red.name != "sum" or tensor.dtype is torch.bool:
            raise NotImplementedError(f"mpcomm backend: sparse allreduce supports ReduceOp.SUM only, got "
                                      f"ReduceOp.{red.torch_name} on {tensor.dtype}")
        if not tensor.is_cpu:
            raise ValueError(f"mpcomm backend: allreduce tensor is on {tensor.device}; this backend handles CPU "
                             "tensors")

        def body():
            local = tensor.detach().coalesce()
            indices = self._all_gather_v(as_numpy(local._indices().t().contiguous()))
            values = self._all_gather_v(as_numpy(local._values().contiguous()))
            summed = torch.sparse_coo_tensor(torch.from_numpy(indices).t(), torch.from_numpy(values),
                                             tensor.shape).coalesce()
            with torch.no_grad():
                tensor.copy_(summed)

        return body

    def _all_gather_v(self, rows: np.ndarray) -> np.ndarray:
        """Every rank's ``rows`` (any number of rows of one shape) stacked in rank order."""
        counts = np.empty(self.comm.size, dtype=np.int64)
        self.comm.all_gather(np.array([rows.shape[0]], dtype=np.int64), counts, algorithm=self.algorithm)
        row = int(np.prod(rows.shape[1:], dtype=np.int64))
        out = np.empty((int(counts.sum()),) + rows.shape[1:], dtype=rows.dtype)
        self.comm.all_to_all_v(np.tile(rows.reshape(-1), self.comm.size), [rows.size] * self.comm.size, out,
                               [int(c) * row for c in counts], algorithm=self.algorithm)
        return out

    def _allreduce_several(self, tensors, op):
        _same_layout("allreduce", tensors)
        arrays = [as_reducible(t, "allreduce tensor") for t in tensors]
        red = reduction(op, tensors[0].dtype, "allreduce")
        local = red.local or _UFUNCS.get(red.name)
        if local is None:
            raise NotImplementedError(f"mpcomm backend: allreduce of a list of {len(tensors)} tensors with "
                                      f"ReduceOp.{red.torch_name} is not supported (pass one tensor)")

        def body():
            combined = local.reduce(np.stack(arrays), axis=0)
            if red.local is None:
                self.comm.allreduce(combined, red.name, self.algorithm)
            else:
                self._allreduce_gathered(combined, red)
            for array in arrays:
                array[...] = combined

        return body

    def allreduce_coalesced(self, tensors, opts=None):
        """Every tensor all-reduced; those of one dtype travel as one flat buffer."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        groups: dict[torch.dtype, list] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        plans = [(reduction(opts.reduceOp, dtype, "allreduce_coalesced"),
                  [as_reducible(t, "allreduce_coalesced tensor") for t in group]) for dtype, group in groups.items()]

        def body():
            for red, arrays in plans:
                flat = np.concatenate([a.reshape(-1) for a in arrays])
                if red.local is None:
                    self.comm.allreduce(flat, red.name, self.algorithm)
                else:
                    self._allreduce_gathered(flat, red)
                _unpack(flat, arrays)

        return self._issue("allreduce_coalesced", body, tensors, opts)

    # ------------------------------------------------------------------ broadcast
    def broadcast(self, tensors, opts=None):
        """Every tensor <- the root's ``tensors[opts.rootTensor]``."""
        opts = opts if opts is not None else dist.BroadcastOptions()
        root, index = opts.rootRank, opts.rootTensor
        _same_layout("broadcast", tensors)
        arrays = [as_numpy(t, "broadcast tensor") for t in tensors]
        source = arrays[index]

        def body():
            self.comm.broadcast(source, root=root, algorithm=self.algorithm)
            for i, array in enumerate(arrays):
                if i != index:
                    array[...] = source

        return self._issue("broadcast", body, tensors, opts)

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
            _same_dtype("allgather", [tensor, *outputs])
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
                _unpack(gathered, recvs)

        return self._issue("allgather", body, output_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        """``output`` <- every rank's ``input`` in rank order (``output.numel() == size * input.numel()``)."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue("all_gather_into_tensor", self._all_gather_step(output, input), [output], opts)

    _allgather_base = all_gather_single

    def _all_gather_step(self, output, input) -> Callable[[], None]:
        out, send = as_numpy(output, "all_gather output"), as_numpy(input, "all_gather input")
        _same_dtype("all_gather_into_tensor", [input, output])
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
            _same_layout("reduce_scatter", [out, *inputs])
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
        _same_dtype("reduce_scatter_tensor", [input, output])
        if send.size != self.comm.size * recv.size:
            raise ValueError(f"mpcomm backend: reduce_scatter_tensor: input has {send.size} elements, needs group "
                             f"size {self.comm.size} x output {recv.size}")
        return partial(self._reduce_scatter, [send], recv, reduction(op, output.dtype, "reduce_scatter_tensor"))

    def _reduce_scatter(self, sends: list[np.ndarray], recv: np.ndarray, red: Reduction) -> None:
        send = sends[0] if len(sends) == 1 else np.concatenate([a.reshape(-1) for a in sends])
        if red.local is None:
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

    # ------------------------------------------------------------------ rooted
    def reduce(self, tensors, opts=None):
        """The root's ``tensors[rootTensor]`` <- the reduction over ranks (the others' tensors are left as they
        were; torch defines the result on the root only)."""
        opts = opts if opts is not None else dist.ReduceOptions()
        root = opts.rootRank
        tensor = tensors[opts.rootTensor]
        red = reduction(opts.reduceOp, tensor.dtype, "reduce")
        array = as_reducible(tensor, "reduce tensor")
        mine = self.comm.rank == root

        def body():
            if red.local is None:
                self.comm.reduce(array, array if mine else None, red.name, root, self.algorithm)
                return
            everyone = np.empty((self.comm.size,) + array.shape, dtype=array.dtype) if mine else None
            self.comm.gather(array, everyone, root, self.algorithm)
            if mine:
                array[...] = red.over(everyone)

        return self._issue("reduce", body, tensors, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        """On the root, ``output_tensors[0][r]`` <- rank r's ``input_tensors[0]`` (equal sizes)."""
        opts = opts if opts is not None else dist.GatherOptions()
        root, (tensor,) = opts.rootRank, input_tensors
        send = as_numpy(tensor, "gather input")
        recvs = None
        if self.comm.rank == root:
            if len(output_tensors) != 1:
                raise ValueError("mpcomm backend: gather: the root needs one output list (gather_list)")
            self._check_size("gather", "gather_list", len(output_tensors[0]), self.comm.size)
            _same_dtype("gather", [tensor, *output_tensors[0]])
            recvs = [as_numpy(o, "gather output") for o in output_tensors[0]]
            if any(r.size != send.size for r in recvs):
                raise ValueError(f"mpcomm backend: gather: every tensor of gather_list needs {send.size} elements "
                                 f"(the input's), got {[r.size for r in recvs]}")
        elif output_tensors and any(len(o) for o in output_tensors):
            raise ValueError(f"mpcomm backend: gather: gather_list must be empty on non-root rank {self.comm.rank}")

        def body():
            gathered = np.empty(self.comm.size * send.size, dtype=send.dtype) if recvs is not None else None
            self.comm.gather(send, gathered, root, self.algorithm)
            if recvs is not None:
                _unpack(gathered, recvs)

        return self._issue("gather", body, output_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[0]`` <- the root's ``input_tensors[0][rank]`` (equal sizes)."""
        opts = opts if opts is not None else dist.ScatterOptions()
        root, (tensor,) = opts.rootRank, output_tensors
        recv = as_numpy(tensor, "scatter output")
        sends = None
        if self.comm.rank == root:
            if len(input_tensors) != 1:
                raise ValueError("mpcomm backend: scatter: the root needs one input list (scatter_list)")
            self._check_size("scatter", "scatter_list", len(input_tensors[0]), self.comm.size)
            _same_dtype("scatter", [tensor, *input_tensors[0]])
            sends = [as_numpy(t, "scatter input") for t in input_tensors[0]]
            if any(s.size != recv.size for s in sends):
                raise ValueError(f"mpcomm backend: scatter: every tensor of scatter_list needs {recv.size} elements "
                                 f"(the output's), got {[s.size for s in sends]}")
        elif input_tensors and any(len(i) for i in input_tensors):
            raise ValueError(f"mpcomm backend: scatter: scatter_list must be empty on non-root rank {self.comm.rank}")

        def body():
            flat = np.concatenate([s.reshape(-1) for s in sends]) if sends is not None else None
            self.comm.scatter(flat, recv, root, self.algorithm)

        return self._issue("scatter", body, output_tensors, opts)

    # ------------------------------------------------------------------ all-to-all
    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[r]`` <- rank r's ``input_tensors[rank]`` (sizes may differ per pair)."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        self._check_size("alltoall", "input_tensor_list", len(input_tensors), self.comm.size)
        self._check_size("alltoall", "output_tensor_list", len(output_tensors), self.comm.size)
        _same_dtype("alltoall", [*input_tensors, *output_tensors])
        sends = [as_numpy(t, "alltoall input") for t in input_tensors]
        recvs = [as_numpy(t, "alltoall output") for t in output_tensors]

        def body():
            send = np.concatenate([s.reshape(-1) for s in sends])
            recv = np.empty(sum(r.size for r in recvs), dtype=send.dtype)
            self.comm.all_to_all_v(send, [s.size for s in sends], recv, [r.size for r in recvs],
                                   algorithm=self.algorithm)
            _unpack(recv, recvs)

        return self._issue("alltoall", body, output_tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: rows of ``input`` split by ``input_split_sizes`` (equal when empty) go to
        the ranks in order; ``output`` takes rank r's rows in its ``output_split_sizes[r]`` rows."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        _same_dtype("all_to_all_single", [input, output])
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
        start, processed, failed = time.monotonic(), [], []
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
        comm, owned, self.comm, self._owned = self.comm, self._owned, None, None
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
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _seconds_or(timeout, default: float) -> float:
    """A timedelta (or seconds) argument in seconds; ``default`` for None or a negative one (torch's "unset")."""
    seconds = None if timeout is None else (
        timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout))
    return float(default) if seconds is None or seconds < 0 else seconds


def _run_all(steps) -> None:
    for step in steps:
        step()


def _same_dtype(operation: str, tensors) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"mpcomm backend: {operation}: tensors of different dtypes {sorted(map(str, dtypes))}; "
                        "they must all have the same dtype")


def _same_layout(operation: str, tensors) -> None:
    _same_dtype(operation, tensors)
    sizes = {t.numel() for t in tensors}
    if len(sizes) > 1:
        raise ValueError(f"mpcomm backend: {operation}: tensors of different sizes {sorted(sizes)}; they must match")


def _unpack(flat: np.ndarray, arrays: list[np.ndarray]) -> None:
    """Consecutive pieces of ``flat`` into ``arrays`` (each keeps its shape)."""
    offset = 0
    for a in arrays:
        a[...] = flat[offset: offset + a.size].reshape(a.shape)
        offset += a.size


def _pack_bytes(arrays: list[np.ndarray]) -> np.ndarray:
    """The bytes of ``arrays`` one after another (any dtypes)."""
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)


def _unpack_bytes(flat: np.ndarray, arrays: list[np.ndarray]) -> None:
    offset = 0
    for a in arrays:
        a[...] = flat[offset: offset + a.nbytes].view(a.dtype).reshape(a.shape)
        offset += a.nbytes
