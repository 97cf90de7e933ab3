"""A Plan: what one kind of collective call was decided to be, worked out once and reused.

Everything that depends only on (operation, dtype, shape, op, algorithm, root) — the algorithm function,
the reduction, the byte count, the label of its error messages, its signature for ``validate=True`` — lives
here, so a Communicator's repeated calls pay for the decisions once (see ``Communicator.plan`` in ``mpcomm.dispatch``).
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import staging
from .algorithms import REGISTRY
from .buffers import ReduceOp, dtype_name


class Plan:
    """One kind of call: ``fn(transport, *buffers...)`` runs it; ``key`` is its (operation, algorithm) in stats()."""

    __slots__ = ("operation", "algorithm", "fn", "rop", "nbytes", "wire", "direct", "key", "label", "signature",
                 "express", "totals", "_digest")

    def __init__(self, operation: str, algorithm: str, array: Any, rop: ReduceOp | None, root: int | None, nbytes: int,
                 host: bool, wire: np.dtype):
        self.operation, self.algorithm, self.rop, self.nbytes = operation, algorithm, rop, nbytes
        self.wire: np.dtype | None = wire  # None: a bare plan (no buffer)
        self.direct = host and wire == array.dtype  # the buffer itself is the work array (no conversion)
        if array.size == 0 and operation != "all_to_all_v":  # nothing to move (all_to_all_v: others may send)
            self.fn = _nothing
        elif host:
            self.fn = REGISTRY[operation][algorithm]
        else:  # device (or other) arrays: through the staging layer, which picks the transport per device
            fn = REGISTRY[operation][algorithm]
            self.fn = lambda t, *args: staging.run(t, operation, algorithm, fn, *args)
        self.key = (operation, algorithm)
        shape = None if operation == "all_to_all_v" else list(array.shape)  # v: sizes differ, counts are checked
        self.signature: dict[str, Any] = {"operation": operation, "dtype": dtype_name(array.dtype), "shape": shape,
                          "op": None if rop is None else rop.name, "algorithm": algorithm, "root": root}
        self.label: _Label | str = _Label(self)
        # The blocking call's whole algorithm as one C call on the Communicator's transport, where it has one
        # (Dispatcher.plan, from algorithms.EXPRESS; run by Dispatcher.run_express)
        self.express: Any = None  # (native_calls.ExpressCall: called on the buffer; started, ended)
        self.totals: Any = None  # with express: the stats entry it counts into (array('d'): calls, bytes, seconds)
        self._digest: np.ndarray | None = None

    @classmethod
    def barrier(cls) -> "Plan":
        return cls.meeting("barrier")

    @classmethod
    def meeting(cls, operation: str) -> "Plan":
        """A barrier standing for ``operation`` (e.g. the meeting before a blocking ``MPI_Comm_split``)."""
        return cls._bare(operation, {"operation": operation}, _barrier)

    @classmethod
    def sum_of_int64(cls, operation: str) -> "Plan":
        """An all-reduce (sum) of one int64 standing for ``operation``: ``fn(t, mine, total)``."""
        return cls._bare(operation, {"operation": operation}, _sum_of_int64)

    @classmethod
    def rejected(cls, operation: str, error: Exception) -> "Plan":
        """What a rank whose arguments failed its own checks shows the others when they validate (it runs
        nothing): they learn at once why it will not join, instead of waiting for it until the timeout."""
        problem = f"{type(error).__name__}: {error}"
        return cls._bare(operation, {"operation": operation, "rejected its arguments": problem}, _nothing)

    @classmethod
    def _bare(cls, operation: str, signature: dict, fn) -> "Plan":
        plan = cls.__new__(cls)
        plan.operation = plan.algorithm = operation
        plan.fn, plan.rop, plan.nbytes, plan.wire, plan.direct = fn, None, 0, None, True
        plan.key = (operation, "native")
        plan.signature, plan.label, plan.express, plan.totals, plan._digest = signature, operation, None, None, None
        return plan

    def running(self, fn: Callable[..., Any]) -> "Plan":
        """This plan with ``fn(transport, *buffers)`` in place of its algorithm (e.g. the torch backend's C++ form
        of the same ``native`` all-reduce): same operation, stats key, label and signature."""
        plan = copy.copy(self)
        plan.fn, plan.express, plan.totals = fn, None, None
        return plan

    def compressed(self, wire: str, fn: Callable[..., Any]) -> "Plan":
        """This all-reduce (or reduce-scatter) plan sent through the codec ``wire`` by ``fn`` (the compressed
        algorithm, called as the plain one): algorithm
        ``compressed:WIRE`` in stats and labels, and the wire in the signature (``validate=True`` compares it)."""
        plan = copy.copy(self)
        plan.algorithm, plan.express, plan.totals = f"compressed:{wire}", None, None
        if self.fn is not _nothing:
            plan.fn = fn
        plan.key = (self.operation, plan.algorithm)
        plan.signature = {**self.signature, "algorithm": plan.algorithm, "wire": wire}
        plan.label, plan._digest = _Label(plan), None
        return plan

    @property
    def digest(self) -> np.ndarray:
        """16 bytes that stand for the whole signature (compared between ranks when validate=True)."""
        if self._digest is None:
            encoded = json.dumps(self.signature, sort_keys=True).encode()
            self._digest = np.frombuffer(hashlib.blake2b(encoded, digest_size=16).digest(), dtype=np.uint8)
        return self._digest


class _Label:
    """Names a call in error messages; formatted only when an error needs it (hot path)."""

    __slots__ = ("plan",)

    def __init__(self, plan: Plan):
        self.plan = plan

    def __str__(self) -> str:
        plan, s = self.plan, self.plan.signature
        root = "" if s["root"] is None else f" (root {s['root']})"
        shape = "" if s["shape"] is None else f" of shape {tuple(s['shape'])}"
        return f"{plan.operation}[{plan.algorithm}]{shape} {s['dtype']} ({plan.nbytes} B){root}"


def _nothing(t, *args) -> None:
    """The algorithm of a call with no data: all ranks still agree and count it."""


def _sum_of_int64(t, mine, total) -> None:
    t.wait_one(t.mpi.Iallreduce(mine, total, MPI.SUM))


def _barrier(t) -> None:
    t.wait([t.mpi.Ibarrier()], t.others)
