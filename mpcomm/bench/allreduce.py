"""All-reduce, in place. busbw = algbw * 2(p-1)/p. Raw: ``MPI.Comm.Allreduce(MPI.IN_PLACE, buf, op)``."""
from __future__ import annotations

from functools import partial

from mpi4py import MPI

from ..buffers import reduce_op
from .base import RAW, Collective, from_the_wire, wire_buffer, reference_reduce, steady_input


class AllReduce(Collective):
    name = "allreduce"
    raw_call = "Allreduce(IN_PLACE)"
    busbw_formula = "2(p-1)/p"

    def setup(self) -> None:
        self.input = self.input_of(self.rank)
        self.buf = self.input.copy()
        self.wire = wire_buffer(self.buf)

    def fill(self, check: bool) -> None:
        self.buf[...] = self.input if check else steady_input(self.input, self.redop)
        self.wire[...] = self.buf  # exact: small integers, 0/1 and bools fit the wire dtype

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Allreduce, MPI.IN_PLACE, self.wire, reduce_op(self.redop).mpi)
        return partial(self.comm.allreduce, self.buf, op=self.redop, algorithm=algorithm)

    def result(self, algorithm: str):
        return from_the_wire(self.wire, self.dtype, self.redop, self.p) if algorithm == RAW else self.buf

    def compute_expected(self):
        return reference_reduce((self.input_of(r) for r in range(self.p)), self.dtype, self.redop)
