"""Reduce-scatter: size is the full (send) buffer, count the elements each rank receives. busbw = algbw * (p-1)/p.
Raw: ``MPI.Comm.Reduce_scatter_block(send, recv, op)``."""
from __future__ import annotations

from functools import partial

import numpy as np

from ..buffers import reduce_op
from .base import RAW, Collective, from_the_wire, wire_buffer, reference_reduce, sentinel_like


class ReduceScatter(Collective):
    name = "reduce_scatter"
    raw_call = "Reduce_scatter_block"
    per_rank_count = True
    replicated = False
    busbw_formula = "(p-1)/p"

    def setup(self) -> None:
        # the send buffer is only read, so the check inputs are steady timing data too
        self.send = self.input_of(self.rank, self.count * self.p)
        self.recv = np.zeros(self.count, self.dtype)
        self.wire_send = wire_buffer(self.send)
        self.wire_recv = wire_buffer(self.recv)

    def fill(self, check: bool) -> None:
        if check:
            self.recv[...] = sentinel_like(self.expected())
            self.wire_recv[...] = self.recv

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Reduce_scatter_block, self.wire_send, self.wire_recv,
                           reduce_op(self.redop).mpi)
        return partial(self.comm.reduce_scatter, self.send, self.recv, self.redop, algorithm)

    def result(self, algorithm: str):
        return from_the_wire(self.wire_recv, self.dtype, self.redop, self.p) if algorithm == RAW else self.recv

    def compute_expected(self):
        mine = slice(self.rank * self.count, (self.rank + 1) * self.count)
        inputs = (self.input_of(r, self.count * self.p)[mine] for r in range(self.p))
        return reference_reduce(inputs, self.dtype, self.redop)
