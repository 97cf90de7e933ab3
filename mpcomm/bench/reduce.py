"""Reduce to ``--root``: size and count are the whole vector, as nccl-tests' reduce_perf. busbw = algbw.
Raw: ``MPI.Comm.Reduce(send, recv, op, root)`` (no receive buffer off the root)."""
from __future__ import annotations

from functools import partial

import numpy as np

from ..buffers import reduce_op
from .base import RAW, Collective, from_the_wire, reference_reduce, sentinel_like, wire_buffer


class Reduce(Collective):
    name = "reduce"
    raw_call = "Reduce"
    rooted = True
    replicated = False  # only the root receives
    busbw_formula = "1"

    def setup(self) -> None:
        # the send buffer is only read, so the check inputs are steady timing data too
        self.send = self.input_of(self.rank)
        self.wire_send = wire_buffer(self.send)
        self.recv = np.zeros(self.count, self.dtype) if self.rank == self.root else None  # None: the API allows it
        self.wire_recv = None if self.recv is None else wire_buffer(self.recv)

    def fill(self, check: bool) -> None:
        if check and self.recv is not None and self.wire_recv is not None:
            self.recv[...] = sentinel_like(self.expected())
            self.wire_recv[...] = self.recv

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Reduce, self.wire_send, self.wire_recv, reduce_op(self.redop).mpi, self.root)
        return partial(self.comm.reduce, self.send, self.recv, self.redop, self.root, algorithm)

    def result(self, algorithm: str):
        if self.recv is None or self.wire_recv is None:
            return self.nothing()
        return from_the_wire(self.wire_recv, self.dtype, self.redop, self.p) if algorithm == RAW else self.recv

    def compute_expected(self):
        if self.rank != self.root:
            return self.nothing()
        return reference_reduce((self.input_of(r) for r in range(self.p)), self.dtype, self.redop)
