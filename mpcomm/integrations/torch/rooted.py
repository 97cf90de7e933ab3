"""The rooted calls of :class:`~.group.BackendMpcomm`: broadcast, reduce, gather and scatter.

The root's list of a tensor per rank (``gather_list``, ``scatter_list``) is checked in one place,
:meth:`RootedCalls._root_list`.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
import torch.distributed as dist

from ...comm import Communicator
from .tensors import as_numpy, as_reducible, reduction, same_dtype, same_layout, unpack


class RootedCalls:
    """The rooted methods of the Backend (a base class of it); they use the group's ``comm``, ``algorithm``,
    ``_issue`` and ``_check_size``."""

    comm: Communicator
    algorithm: str
    _issue: Callable[..., Any]
    _check_size: Callable[[str, str, int, int], None]

    def broadcast(self, tensors, opts=None):
        """Every tensor <- the root's ``tensors[opts.rootTensor]``."""
        opts = opts if opts is not None else dist.BroadcastOptions()
        root, index = opts.rootRank, opts.rootTensor
        same_layout("broadcast", tensors)
        arrays = [as_numpy(t, "broadcast tensor") for t in tensors]
        source = arrays[index]

        def body():
            self.comm.broadcast(source, root=root, algorithm=self.algorithm)
            for i, array in enumerate(arrays):
                if i != index:
                    array[...] = source

        return self._issue("broadcast", body, tensors, opts)

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
        send, recvs = self._root_list("gather", opts.rootRank, input_tensors, output_tensors, ("input", "output"))
        return self._issue("gather", partial(self._gather, send, recvs, opts.rootRank), output_tensors, opts)

    def _gather(self, send: np.ndarray, recvs: list[np.ndarray] | None, root: int) -> None:
        if recvs is None:
            self.comm.gather(send, None, root, self.algorithm)
            return
        gathered = np.empty(self.comm.size * send.size, dtype=send.dtype)
        self.comm.gather(send, gathered, root, self.algorithm)
        unpack(gathered, recvs)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[0]`` <- the root's ``input_tensors[0][rank]`` (equal sizes)."""
        opts = opts if opts is not None else dist.ScatterOptions()
        recv, sends = self._root_list("scatter", opts.rootRank, output_tensors, input_tensors, ("output", "input"))
        return self._issue("scatter", partial(self._scatter, sends, recv, opts.rootRank), output_tensors, opts)

    def _scatter(self, sends: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
        flat = np.concatenate([s.reshape(-1) for s in sends]) if sends is not None else None
        self.comm.scatter(flat, recv, root, self.algorithm)

    def _root_list(self, operation: str, root: int, tensors, lists, roles: tuple[str, str]):
        """This rank's one tensor of ``tensors`` as an array, and the root's one list of a tensor per rank
        (``gather_list`` / ``scatter_list``) as arrays, each of that tensor's dtype and size (None elsewhere, where
        the list must be empty). ``roles``: what the tensor and the list are (("input", "output") for gather)."""
        (tensor,), name, (mine, role) = tensors, f"{operation}_list", roles
        array = as_numpy(tensor, f"{operation} {mine}")
        if self.comm.rank != root:
            if lists and any(len(entries) for entries in lists):
                raise ValueError(f"mpcomm backend: {operation}: {name} must be empty on non-root rank {self.comm.rank}")
            return array, None
        if len(lists) != 1:
            raise ValueError(f"mpcomm backend: {operation}: the root needs one {role} list ({name})")
        self._check_size(operation, name, len(lists[0]), self.comm.size)
        same_dtype(operation, [tensor, *lists[0]])
        arrays = [as_numpy(t, f"{operation} {role}") for t in lists[0]]
        if any(a.size != array.size for a in arrays):
            raise ValueError(f"mpcomm backend: {operation}: every tensor of {name} needs {array.size} elements "
                             f"(the {mine}'s), got {[a.size for a in arrays]}")
        return array, arrays
