"""One FSDP unit at run time: its shard, its gathered buffer, its unsharded gradient, and the collectives
that move between them. The schedule (when to gather, free, reduce) lives in ``fsdp_schedule``.

States: ``sharded`` (only the shard exists; the originals' ``.data`` are placeholders), ``gathering`` (an
``iall_gather`` is in flight), ``gathered`` (the originals' ``.data`` are views into the full flat buffer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..comm import Communicator
from ..nn import Parameter
from ..nn.backend import to_numpy
from ..trace.timeline import NO_SPAN, NoSpan, Span
from ..work import Work
from .flat_param import FlatLayout


class MemoryTracker:
    """Bytes of transient buffers (``gathered`` params, unsharded ``grad``) alive now, and their peaks."""

    KINDS = ("gathered", "grad")

    def __init__(self):
        self.current = {k: 0 for k in self.KINDS}
        self.peak = {k: 0 for k in self.KINDS}
        self.peak_total = 0

    def alloc(self, kind: str, nbytes: int) -> None:
        self.current[kind] += int(nbytes)
        self.peak[kind] = max(self.peak[kind], self.current[kind])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    def free(self, kind: str, nbytes: int) -> None:
        self.current[kind] -= int(nbytes)
        if self.current[kind] < 0:  # a bookkeeping bug must not go unnoticed
            raise RuntimeError(f"FSDP memory tracker: freed more {kind} bytes than allocated")

    def reset_peaks(self) -> None:
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())


@dataclass
class Groups:
    """``shard``: the group a unit is sharded over (None: one shard, no communication);
    ``replicate``: the group whose gradients are averaged by all-reduce after the reduce-scatter (or None)."""

    shard: Communicator | None
    replicate: Communicator | None

    @property
    def shard_count(self) -> int:
        return 1 if self.shard is None else self.shard.size

    @property
    def shard_index(self) -> int:
        return 0 if self.shard is None else self.shard.rank

    @property
    def replica_index(self) -> int:
        return 0 if self.replicate is None else self.replicate.rank


def placeholder(shape: tuple, dtype: Any, xp: Any) -> Any:
    """What an original parameter's ``.data`` is while sharded: right shape, one NaN of storage, read-only
    (numpy), so accidental use outside the engine poisons results visibly instead of reading stale data."""
    return xp.broadcast_to(xp.full((), np.nan, dtype=dtype), shape)


@dataclass
class _PendingReduce:
    work: Work | None
    out: Any
    nbytes: int
    span: Span | NoSpan = NO_SPAN  # its reduction, from start to finish_reduce, for the timeline
    finish: Callable[[], None] | None = None  # completes ``out`` once ``work`` is done (PowerSGD's second half)


@dataclass
class FlatUnit:
    name: str
    module: Any
    layout: FlatLayout
    originals: list[Parameter]
    shard: Parameter                  # master dtype; host numpy when offloaded
    groups: Groups
    xp: Any                           # compute array module (numpy or cupy)
    param_dtype: np.dtype
    reduce_dtype: np.dtype
    offload: bool
    tracker: MemoryTracker
    state: str = "sharded"
    full: Any = None
    owns_full: bool = False
    work: Work | None = None
    send: Any = None
    gather_span: Span | NoSpan = NO_SPAN  # the gather in flight, for the timeline
    grad_flat: Any = None
    pending: list = field(default_factory=list)
    compressor: Any = None            # a fsdp_compression.ShardedCompressor: compresses the reduce-scatter

    @property
    def master_dtype(self) -> np.dtype:
        return self.shard.data.dtype

    @property
    def aliases_shard(self) -> bool:
        """One shard in the compute dtype on the compute device: the views can point into the shard itself."""
        return self.layout.shard_count == 1 and self.param_dtype == self.master_dtype and not self.offload

    # ---- parameters ------------------------------------------------------------------------
    def start_gather(self, blocking: bool) -> None:
        if self.state != "sharded":
            raise RuntimeError(f"FSDP unit {self.name!r}: gather while {self.state}")
        if self.aliases_shard:
            self.full, self.owns_full, self.state = self.shard.data, False, "gathering"
            return
        send = self.shard.data
        if self.offload:
            send = self.xp.asarray(send)
        send = send.astype(self.param_dtype, copy=False)
        recv = self.xp.empty(self.layout.padded_numel, dtype=self.param_dtype)
        self.tracker.alloc("gathered", recv.nbytes)
        self.full, self.owns_full, self.state = recv, True, "gathering"
        comm = self.groups.shard
        if comm is None or comm.size == 1:
            recv[...] = send
        elif blocking:
            with comm.span(f"fsdp gather {self.name}", bytes=recv.nbytes):
                comm.all_gather(send, recv)
        else:
            self.gather_span = comm.span(f"fsdp gather {self.name}", bytes=recv.nbytes)
            self.send, self.work = send, comm.iall_gather(send, recv)

    def finish_gather(self) -> None:
        if self.state != "gathering":
            raise RuntimeError(f"FSDP unit {self.name!r}: finish_gather while {self.state}")
        if self.work is not None:
            self.work.wait()
            self.work, self.send = None, None
            self.gather_span.end()
            self.gather_span = NO_SPAN
        for p, view in zip(self.originals, self.layout.views(self.full)):
            p.data = view
        self.state = "gathered"

    def free(self) -> None:
        """Drop the gathered buffer; the originals go back to placeholders (no-op while aliasing the shard)."""
        if self.state == "gathering":
            self.finish_gather()
        if self.state != "gathered" or self.aliases_shard:
            return
        self.tracker.free("gathered", self.full.nbytes)
        self.full = None
        for p, info in zip(self.originals, self.layout.params):
            p.data = placeholder(info.shape, self.param_dtype, self.xp)
        self.state = "sharded"

    # ---- gradients -------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Point each original's ``.grad`` at a zeroed view of one flat gradient, so layers accumulate in place."""
        if self.grad_flat is None:
            self.grad_flat = self.xp.zeros(self.layout.padded_numel, dtype=self.param_dtype)
            self.tracker.alloc("grad", self.grad_flat.nbytes)
        for p, view in zip(self.originals, self.layout.views(self.grad_flat)):
            p.grad = view

    def start_reduce(self) -> None:
        """Start averaging this unit's flat gradient over the data-parallel ranks; detach the originals."""
        for p in self.originals:
            p.grad = None
        g = self.grad_flat.astype(self.reduce_dtype, copy=False)
        nbytes = self.grad_flat.nbytes + (0 if g is self.grad_flat else g.nbytes)
        if g is not self.grad_flat:
            self.tracker.alloc("grad", g.nbytes)
        self.grad_flat = None
        shard = self.groups.shard
        if shard is not None and shard.size > 1:
            out = self.xp.empty(self.layout.shard_numel, dtype=self.reduce_dtype)
            self.tracker.alloc("grad", out.nbytes)
            nbytes += out.nbytes
            span = shard.span(f"fsdp reduce-scatter {self.name}", bytes=g.nbytes)
            if self.compressor is None:
                work, finish = shard.ireduce_scatter(g, out, op="avg"), None
            else:
                work, finish = self.compressor.reduce_scatter(self, g, out)
            self.pending.append(_PendingReduce(work, out, nbytes, span, finish))
        elif self.groups.replicate is not None and self.groups.replicate.size > 1 and self.layout.shard_count == 1:
            span = self.groups.replicate.span(f"fsdp all-reduce {self.name}", bytes=g.nbytes)
            self.pending.append(_PendingReduce(self.groups.replicate.iallreduce(g, op="avg"), g, nbytes, span))
        else:
            self.pending.append(_PendingReduce(None, g, nbytes))

    def finish_reduce(self) -> None:
        for item in self.pending:
            if item.work is not None:
                item.work.wait()
            if item.finish is not None:
                item.finish()
            item.span.end()
            out = item.out
            replicate = self.groups.replicate
            if replicate is not None and replicate.size > 1 and self.layout.shard_count > 1:
                replicate.allreduce(out, op="avg")
            if self.offload:
                out = to_numpy(out)
            out = out.astype(self.master_dtype, copy=False)
            if self.shard.grad is None:
                self.shard.grad = out  # a buffer of our own (a reduce output or the detached flat grad)
            else:
                self.shard.grad += out
            self.tracker.free("grad", item.nbytes)
        self.pending.clear()
