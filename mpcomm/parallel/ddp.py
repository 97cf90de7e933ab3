"""DistributedDataParallel: replicate a model on every rank, all-reduce gradients in buckets during backward.

Like ``torch.nn.parallel.DistributedDataParallel``, over :class:`mpcomm.Communicator` only.  Four small pieces:

* :func:`plan_buckets` - pure bookkeeping: which parameters share a bucket (reverse registration order, first
  bucket small, a new bucket on a dtype change or when the cap is reached).
* :class:`Bucket` - one flat buffer, each parameter's slot in it (and, for the last bucket, a short per-parameter
  "unused on this rank" tail, so that every rank learns about unused parameters without an extra message).
* comm hooks (:func:`allreduce_hook`, :func:`compress_hook`) - how one bucket is reduced: ``(comm, buffer) ->
  (Work, finish)``; ``finish()`` runs after the Work completes (e.g. cast the low-precision result back).
* :class:`_Reducer` - the per-backward state machine: grad hooks mark parameters ready, buckets are launched with
  ``comm.iallreduce(..., op="avg")`` strictly in bucket order (so every rank issues the same sequence of
  collectives whatever order its gradients arrive in), and ``finalize()`` launches what is left, waits, unpacks.

:class:`DistributedDataParallel` ties them together and follows the engine protocol shared with FSDP:
``forward(x) -> (y, ctx)``, ``backward(grad_y, ctx) -> grad_x`` (gradients are synchronized when it returns),
``parameters()``, ``zero_grad()``, ``full_state_dict()``, ``module``.

Averaging: each rank's loss is the mean over its local shard (equal shard sizes), gradients are averaged over
ranks, so the result equals one process training on the whole batch up to float rounding.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..buffers import BFLOAT16
from ..comm import Communicator
from ..errors import ConfigError, MpcommError
from ..nn.backend import array_module, to_numpy
from ..nn.module import Module, Parameter
from ..trace.timeline import NO_SPAN, NoSpan, Span
from ..work import Work
from .same_model import check_same_model

__all__ = [
    "DistributedDataParallel", "UnusedParameterError", "plan_buckets", "Bucket",
    "allreduce_hook", "compress_hook", "COMM_HOOKS",
]

MiB = 1024 * 1024
DEFAULT_FIRST_BUCKET_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


class UnusedParameterError(MpcommError):
    """A parameter got no gradient in a synchronizing backward and ``find_unused_parameters`` was not set."""


# ------------------------------------------------------------------------------------------------ bookkeeping

def plan_buckets(nbytes: Sequence[int], dtypes: Sequence[Any], order: Sequence[int],
                 cap_bytes: float, first_cap_bytes: float) -> list[list[int]]:
    """Group parameter indices (taken in ``order``) into buckets.

    A bucket closes once it holds at least its cap (the first bucket's cap is ``first_cap_bytes``, the others
    ``cap_bytes``) or when the next parameter has another dtype.  Every index appears exactly once.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got {cap_bytes} and {first_cap_bytes} bytes")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in order:
        if current and np.dtype(dtypes[i]) != np.dtype(dtypes[current[0]]):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """A flat buffer holding the gradients of ``params`` (indices into the engine's list) back to back."""

    def __init__(self, index: int, params: Sequence[tuple[int, Parameter]], tail: int = 0):
        first = params[0][1].data
        xp = array_module(first)
        self.index = index
        self.dtype = first.dtype
        self.members = [i for i, _ in params]
        self.offsets: dict[int, tuple[int, int]] = {}
        offset = 0
        for i, p in params:
            self.offsets[i] = (offset, p.size)
            offset += p.size
        self.numel = offset
        self.buffer = xp.zeros(offset + tail, dtype=self.dtype)
        self.tail = self.buffer[offset:]  # per-parameter "unused on this rank" flags (last bucket only)
        self.views = {i: self.buffer[o:o + n].reshape(p.shape) for (i, p), (o, n) in
                      zip(params, self.offsets.values())}
        self.pending = len(self.members)
        self.work: Work | None = None
        self.finish: Callable[[], None] | None = None
        self.span: Span | NoSpan = NO_SPAN  # its all-reduce, from launch to unpacked, for the timeline

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {len(self.members)} params, {self.numel} x {self.dtype})"


# ------------------------------------------------------------------------------------------------ comm hooks

def allreduce_hook(comm: Communicator, buffer: Any) -> tuple[Work, Callable[[], None] | None]:
    """Average ``buffer`` over the ranks in place (non-blocking)."""
    return comm.iallreduce(buffer, op="avg"), None


def compress_hook(dtype: Any) -> Callable[[Communicator, Any], tuple[Work, Callable[[], None]]]:
    """Cast the bucket to ``dtype`` (float16 / bfloat16), average that (the Communicator accumulates low-precision
    sums in float32 and rounds once), cast the result back into the bucket."""
    low_dtype = np.dtype(dtype)

    def hook(comm: Communicator, buffer: Any):
        low = buffer.astype(low_dtype)
        work = comm.iallreduce(low, op="avg")

        def finish() -> None:
            buffer[...] = low.astype(buffer.dtype)

        return work, finish

    hook.__name__ = f"compress_{low_dtype.name}_hook"
    return hook


COMM_HOOKS: dict[str, Callable] = {
    "allreduce": allreduce_hook,
    "fp16": compress_hook(np.float16),
    "bf16": compress_hook(BFLOAT16),
}


def _resolve_hook(comm_hook) -> Callable:
    if comm_hook is None:
        return allreduce_hook
    if callable(comm_hook):
        return comm_hook
    if isinstance(comm_hook, str) and comm_hook in COMM_HOOKS:
        return COMM_HOOKS[comm_hook]
    raise ValueError(f"comm_hook must be None, a callable (comm, buffer) -> (Work, finish), or one of "
                     f"{sorted(COMM_HOOKS)}; got {comm_hook!r}")


# ------------------------------------------------------------------------------------------------ reducer

class _Reducer:
    """Per-backward state: which parameters are ready, which buckets are launched, and the final unpacking."""

    def __init__(self, engine: "DistributedDataParallel"):
        self.engine = engine
        n = len(engine._params)
        self.touched = [False] * n  # got a gradient (hook fired) since the last synchronizing backward
        self.ready = [False] * n     # slot filled in the current synchronizing backward
        self.syncing = False
        self.next_bucket = 0
        self.order: list[int] = []   # ready order, recorded for static_graph
        self.problems: list[str] = []
        self.wait_seconds = 0.0

    # -- called from the grad hooks -------------------------------------------------------------
    def on_grad(self, i: int) -> None:
        self.touched[i] = True
        if not self.syncing:
            return
        if self.ready[i]:
            self.problems.append(self.engine._names[i])
            return
        self.mark_ready(i)

    # -- pieces ---------------------------------------------------------------------------------
    def start(self, premark: Sequence[int]) -> None:
        self.syncing = True
        self.next_bucket = 0
        self.order = []
        self.problems = []
        self.ready = [False] * len(self.ready)
        for b in self.engine._buckets:
            b.pending, b.work, b.finish = len(b.members), None, None
        for i in premark:
            self.mark_ready(i)

    def mark_ready(self, i: int) -> None:
        engine = self.engine
        p, bucket = engine._params[i], engine._bucket_of[i]
        view = bucket.views[i]
        if not self.touched[i]:
            view[...] = 0
        elif p.grad is not view:
            view[...] = p.grad
            if engine.gradient_as_bucket_view:
                p.grad = view
        self.ready[i] = True
        self.order.append(i)
        bucket.pending -= 1
        if bucket.pending == 0 and not engine.delay_all_reduce:
            self.launch_in_order()

    def launch_in_order(self) -> None:
        buckets = self.engine._buckets
        while self.next_bucket < len(buckets) and buckets[self.next_bucket].pending == 0:
            self.launch(buckets[self.next_bucket])
            self.next_bucket += 1

    def launch(self, bucket: Bucket) -> None:
        if bucket.tail.size:  # the last bucket: by now every parameter is ready, so "unused" is known
            bucket.tail[...] = array_module(bucket.tail).asarray([0 if t else 1 for t in self.touched])
        engine = self.engine
        bucket.span = engine.comm.span(f"ddp bucket {bucket.index}", bytes=bucket.nbytes)
        bucket.work, bucket.finish = engine._hook(engine.comm, bucket.buffer)

    def finalize(self) -> None:
        """Mark what is left ready (as zero), launch the rest in order, wait, unpack, check for unused params."""
        engine = self.engine
        for i in range(len(self.ready)):
            if not self.ready[i]:
                self.mark_ready(i)
        self.launch_in_order()
        start = time.perf_counter()
        for b in engine._buckets:
            assert b.work is not None  # every bucket was launched above
            b.work.wait()
            if b.finish is not None:
                b.finish()
            b.span.end()
        self.wait_seconds = time.perf_counter() - start
        size = engine.comm.size
        flags = to_numpy(engine._buckets[-1].tail).astype(np.float64)
        unused_somewhere = flags > 0.5 / size
        unused_everywhere = flags > 1.0 - 0.5 / size
        for i, p in enumerate(engine._params):
            if unused_everywhere[i]:
                if not self.touched[i] and engine.gradient_as_bucket_view and p.grad is engine._bucket_of[i].views[i]:
                    p.grad = None  # like one process: a parameter nobody used has no gradient
                continue
            self._unpack(i, p)
        self.syncing = False
        self.touched = [False] * len(self.touched)
        if self.problems:
            raise MpcommError(
                f"rank {engine.comm.rank}: DistributedDataParallel: the gradient of parameter(s) "
                f"{sorted(set(self.problems))} became ready more than once in one backward (a parameter shared "
                f"by several layers, or one predicted unused by find_unused_parameters/static_graph that then "
                f"got a gradient); its bucket had already been reduced, so the result would be wrong")
        if unused_somewhere.any() and not engine._tolerate_unused:
            names = [f"{engine._names[i]!r} (on {round(flags[i] * size)} of {size} ranks)"
                     for i in np.flatnonzero(unused_somewhere)]
            raise UnusedParameterError(
                f"rank {engine.comm.rank}: DistributedDataParallel: parameter(s) {', '.join(names)} received no "
                f"gradient in this backward. Pass find_unused_parameters=True (unused gradients count as zero) "
                f"or static_graph=True if the same parameters are unused every iteration")

    def _unpack(self, i: int, p: Parameter) -> None:
        bucket = self.engine._bucket_of[i]
        view = bucket.views[i]
        if p.grad is view:
            return
        if self.engine.gradient_as_bucket_view:
            p.grad = view
        elif p.grad is not None and p.grad.shape == view.shape and p.grad.dtype == view.dtype:
            p.grad[...] = view
        else:
            p.grad = view.copy()

    def abandon(self) -> None:
        """Forget an interrupted backward (its launched collectives are dropped with the Works)."""
        self.syncing = False
        self.touched = [False] * len(self.touched)


# ------------------------------------------------------------------------------------------------ the engine

class DistributedDataParallel:
    """Data-parallel training of an ``mpcomm.nn.Module``: same parameters everywhere, gradients averaged.

    Parameters
    ----------
    module: the model (every rank builds the same architecture; values are broadcast from rank 0).
    comm: a :class:`mpcomm.Communicator` (an mpi4py communicator is wrapped in one).
    bucket_cap_mb: bucket size cap in MiB (default 25); the first bucket is capped at ``first_bucket_cap_mb``
        (default 1 MiB, or ``bucket_cap_mb`` if smaller) so communication starts early in backward.
    gradient_as_bucket_view: ``param.grad`` is a view into its bucket (no copies); ``zero_grad()`` then zeroes in
        place and keeps the views.
    find_unused_parameters: parameters without a gradient in a backward count as zero (their buckets still
        launch); parameters of modules that did not run forward are marked ready as soon as backward starts.
        Without it an unused parameter raises :class:`UnusedParameterError` on every rank at the end of backward.
    static_graph: the first synchronizing backward records the order gradients become ready and which
        parameters are unused; buckets are rebuilt in that order (rank 0's) and reused; unused parameters are
        marked ready at the start of every later backward.
    delay_all_reduce: launch every bucket only after backward (no overlap; for comparison).
    comm_hook: ``None`` / ``"allreduce"``, ``"fp16"``, ``"bf16"`` (compressed all-reduce), or a callable
        ``(comm, buffer) -> (Work, finish or None)``.
    broadcast_parameters: copy rank 0's parameter values to every rank at construction (default True).
    """

    def __init__(self, module: Module, comm: Any, *, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_MB, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False, static_graph: bool = False, delay_all_reduce: bool = False,
                 comm_hook: Any = None, broadcast_parameters: bool = True):
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an mpcomm.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is None or not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb and first_bucket_cap_mb must be positive, got {bucket_cap_mb} and "
                             f"{first_bucket_cap_mb}")
        self.module = module
        self.comm = comm if isinstance(comm, Communicator) else Communicator(comm)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_cap_mb = min(float(first_bucket_cap_mb), self.bucket_cap_mb)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.delay_all_reduce = bool(delay_all_reduce)
        self._hook = _resolve_hook(comm_hook)
        named = module.named_parameters()
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}

        check_same_model(self.comm, "DistributedDataParallel", self._signature(), describe_mismatch)
        self._build_buckets(list(reversed(range(len(self._params)))))
        if broadcast_parameters:
            self._broadcast_parameters()
        self._reducer = _Reducer(self)
        self._require_sync = True
        self._static_unused: list[int] | None = None  # set after the first synchronizing backward (static_graph)
        self._ran: set[int] = set()                     # ids of modules that ran forward (find_unused_parameters)
        self._owners = self._param_owners()
        self._handles = [p.register_grad_hook(self._grad_hook) for p in self._params]
        if self.find_unused_parameters:
            self._handles += [m.register_forward_pre_hook(self._forward_hook)
                              for m in module.modules() if m._params]
        self.timing = {"backward_seconds": 0.0, "wait_seconds": 0.0, "syncs": 0}

    @property
    def _tolerate_unused(self) -> bool:
        return self.find_unused_parameters or self.static_graph

    # -------------------------------------------------------------------------- construction pieces
    def _signature(self) -> list:
        return [[n, list(p.shape), str(p.dtype)] for n, p in zip(self._names, self._params)]

    def _build_buckets(self, order: Sequence[int]) -> None:
        params = self._params
        plan = plan_buckets([p.data.nbytes for p in params], [p.dtype for p in params], order,
                            self.bucket_cap_mb * MiB, self.first_bucket_cap_mb * MiB)
        self._buckets = [Bucket(b, [(i, params[i]) for i in members], tail=len(params) if b == len(plan) - 1 else 0)
                         for b, members in enumerate(plan)]
        self._bucket_of = {i: b for b in self._buckets for i in b.members}

    def _broadcast_parameters(self) -> None:
        """Copy rank 0's values into every rank's parameters, one broadcast per bucket."""
        for b in self._buckets:
            for i in b.members:
                b.views[i][...] = self._params[i].data
            self.comm.broadcast(b.buffer, root=0)
            for i in b.members:
                self._params[i].data[...] = b.views[i]
            b.buffer[...] = 0

    def _param_owners(self) -> dict[int, list[int]]:
        owners: dict[int, list[int]] = {}
        for m in self.module.modules():
            for p in m._params.values():
                if p is not None and id(p) in self._index:
                    owners.setdefault(id(m), []).append(self._index[id(p)])
        return owners

    # -------------------------------------------------------------------------- hooks
    def _grad_hook(self, p: Parameter) -> None:
        self._reducer.on_grad(self._index[id(p)])

    def _forward_hook(self, m: Module) -> None:
        self._ran.add(id(m))

    def remove_hooks(self) -> None:
        """Unregister every hook this engine put on the module (the engine stops synchronizing)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -------------------------------------------------------------------------- engine protocol
    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    def parameters(self) -> list[Parameter]:
        return list(self._params)

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return list(zip(self._names, self._params))

    def forward(self, x: Any) -> tuple[Any, Any]:
        return self.module.forward(x)

    def backward(self, grad_y: Any, ctx: Any) -> Any:
        """Backward through the module; buckets are reduced as their gradients become ready.

        Inside :meth:`no_sync` gradients only accumulate locally; the first backward outside it synchronizes
        the accumulated gradients.  When this returns, every gradient is averaged over the ranks.
        """
        start = time.perf_counter()
        sync = self._require_sync
        ran, self._ran = self._ran, set()
        if sync:
            self._reducer.start(self._premark(ran))
        try:
            grad_x = self.module.backward(grad_y, ctx)
            if sync:
                first_static = self.static_graph and self._static_unused is None
                self._reducer.finalize()
                self.timing["wait_seconds"] += self._reducer.wait_seconds
                self.timing["syncs"] += 1
                if first_static:
                    self._rebuild_static()
        except BaseException:
            self._reducer.abandon()
            raise
        finally:
            self.timing["backward_seconds"] += time.perf_counter() - start
        return grad_x

    def _premark(self, ran: set[int]) -> list[int]:
        """Parameters known to get no gradient in this backward, marked ready at once so buckets are not held."""
        if self._static_unused is not None:
            return list(self._static_unused)
        if self.find_unused_parameters and ran:
            return sorted(i for mid, members in self._owners.items() if mid not in ran for i in members)
        return []

    def _rebuild_static(self) -> None:
        """static_graph: rebuild buckets in rank 0's recorded ready order; remember the unused parameters."""
        reducer = self._reducer
        order = np.array(reducer.order, dtype=np.int64)
        self.comm.broadcast(order, root=0)  # every rank must bucket the same way: use rank 0's order
        flags = to_numpy(self._buckets[-1].tail).astype(np.float64)
        self._static_unused = [int(i) for i in np.flatnonzero(flags > 1.0 - 0.5 / self.comm.size)]
        grads = [p.grad for p in self._params]
        self._build_buckets([int(i) for i in order])
        if self.gradient_as_bucket_view:
            for i, (p, g) in enumerate(zip(self._params, grads)):
                if g is not None:
                    view = self._bucket_of[i].views[i]
                    view[...] = g
                    p.grad = view

    @contextmanager
    def no_sync(self) -> Iterator["DistributedDataParallel"]:
        """Gradients accumulate locally inside; the first backward after it synchronizes the accumulated sum."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield self
        finally:
            self._require_sync = previous

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients. With ``gradient_as_bucket_view`` (and ``set_to_none`` not True) the buckets are
        zeroed in place and every ``grad`` is its bucket view; otherwise grads are set to None (or zeroed)."""
        if self.gradient_as_bucket_view and not set_to_none:
            for b in self._buckets:
                b.buffer[: b.numel] = 0
                for i in b.members:
                    self._params[i].grad = b.views[i]
            return
        for p in self._params:
            p.zero_grad(True if set_to_none is None else set_to_none)

    def full_state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Name -> host copy of every parameter (the replicas are identical, so this is the same on all ranks)."""
        return OrderedDict((n, to_numpy(p.data)) for n, p in zip(self._names, self._params))

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        return self.full_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def reset_timing(self) -> None:
        self.timing = {"backward_seconds": 0.0, "wait_seconds": 0.0, "syncs": 0}

    def __repr__(self) -> str:
        return (f"DistributedDataParallel({len(self._params)} params in {len(self._buckets)} buckets, "
                f"world {self.comm.size}, hook {getattr(self._hook, '__name__', self._hook)})")


def describe_mismatch(sigs: list[list]) -> str:
    """Human-readable difference between per-rank [[name, shape, dtype], ...] lists (same text on every rank)."""
    ref = sigs[0]
    lines = []
    for r, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        if len(sig) != len(ref):
            lines.append(f"rank 0 has {len(ref)} parameters, rank {r} has {len(sig)}")
        for k, (a, b) in enumerate(zip(ref, sig)):
            if a != b:
                if a[0] != b[0]:
                    lines.append(f"parameter #{k} is {a[0]!r} on rank 0 but {b[0]!r} on rank {r}")
                else:
                    lines.append(f"parameter {a[0]!r}: rank 0 has shape {tuple(a[1])} {a[2]}, "
                                 f"rank {r} has shape {tuple(b[1])} {b[2]}")
                break
        else:
            extra = ref[len(sig):] or sig[len(ref):]
            if extra:
                lines.append(f"first unmatched parameter {extra[0][0]!r}")
    return "; ".join(lines)
