"""The all-reduce paths of :class:`~.group.BackendMpcomm`, fastest first.

* the C++ path: a synchronous all-reduce of one tensor, where the Communicator plans its ``native`` algorithm,
  runs the extension's all-reduce (``native_allreduce.cpp``) through ``Communicator.run``;
* the fast path: ``dist.all_reduce(t)`` on a tensor ``Tensor.numpy()`` takes, with a reduction mpcomm runs
  itself, goes straight to ``Communicator.allreduce`` on the caller's thread;
* the general path: any other tensor (bfloat16, sparse, a list of several, bitwise ops, coalesced) is queued on
  the group's lane.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ...algorithms import REGISTRY, native
from ...buffers import AVG, OPS
from ...comm import Communicator
from ...mpi_library import library
from .lane import Lane
from .pages import MIN_BYTES as HUGE_PAGES_FROM, HugePages
from .tensors import Reduction, as_numpy, as_reducible, direct_reduction, reduction, same_layout, unpack

class AllreducePaths:
    """The all-reduce methods of the Backend (a base class of it). They use the group's ``comm``, ``algorithm``,
    lane (``_lane``, ``_issue``, ``_run_here``), ``_sequence``, ``_pages`` and the C++ extension's
    ``_native_plan`` / ``_native_run``, which the Backend's constructor sets up with :meth:`_native_allreduce`."""

    comm: Communicator
    algorithm: str
    _lane: Lane
    _pages: HugePages
    _sequence: int
    _native_plan: Callable[..., Any] | None
    _native_run: Callable[..., Any] | None
    _issue: Callable[..., Any]
    _run_here: Callable[..., None]

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
        t = self.comm.transport
        profile = library()
        if native.meets_then_blocks(t, profile, array.nbytes) or native.polled_from_copy(t, profile, array.nbytes):
            return None  # (the C++ call only polls the all-reduce in place: every rank must run the same)
        if native.own_op(t, array, plan.rop) is not None:  # (its MPI op: every rank must reduce with the same)
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
        same_layout("allreduce", tensors)
        arrays = [as_reducible(t, "allreduce tensor") for t in tensors]
        red = reduction(op, tensors[0].dtype, "allreduce")
        # the list is combined here first, then across ranks: avg has no such two-step form
        local = red.local or (None if red.name == AVG else OPS[red.name].ufunc)
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
                unpack(flat, arrays)

        return self._issue("allreduce_coalesced", body, tensors, opts)

    def allreduce_compressed(self, tensor: torch.Tensor, wire: str | None) -> dist.Work:
        """``tensor`` (float32) <- the average over ranks, sent as ``wire`` (``Communicator.allreduce(wire=...)``;
        None: float32), queued on the group's lane like an asynchronous ``all_reduce``; the Work's result is
        ``[tensor]``."""
        array = as_numpy(tensor, "allreduce_compressed tensor")
        algorithm = "auto" if wire is not None else self.algorithm
        return self._issue(f"allreduce(wire={wire})", partial(self.comm.allreduce, array, AVG, algorithm, wire),
                           [tensor], None)
