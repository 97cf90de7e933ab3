"""All-reduce, in place. busbw = algbw * 2(p-1)/p. Raw: ``MPI.Comm.Allreduce(MPI.IN_PLACE, buf, op)``.

Rows named ``wire:W`` (``--wire W``) time ``allreduce(buf, wire=W)``: float32 compressed between nodes; their
algbw is the float32 buffer's bytes per second, so it compares with the float32 rows as it is."""
from __future__ import annotations

from functools import partial

import numpy as np
from mpi4py import MPI

from ..buffers import reduce_op
from ..compression import codec
from .base import RAW, Collective, from_the_wire, wire_buffer, reference_reduce, steady_input

WIRE_ROW = "wire:"  # the row name's prefix for --wire


class AllReduce(Collective):
    name = "allreduce"
    raw_call = "Allreduce(IN_PLACE)"
    busbw_formula = "2(p-1)/p"

    def setup(self) -> None:
        self.input = self.input_of(self.rank)
        self.buf = self.input.copy()
        self.wire = wire_buffer(self.buf)
        self._wired: dict[str, np.ndarray] = {}

    def fill(self, check: bool) -> None:
        self.buf[...] = self.input if check else steady_input(self.input, self.redop)
        self.wire[...] = self.buf  # exact: small integers, 0/1 and bools fit the wire dtype

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Allreduce, MPI.IN_PLACE, self.wire, reduce_op(self.redop).mpi)
        if algorithm.startswith(WIRE_ROW):
            return partial(self.comm.allreduce, self.buf, op=self.redop, wire=algorithm[len(WIRE_ROW):])
        return partial(self.comm.allreduce, self.buf, self.redop, algorithm)

    def result(self, algorithm: str):
        return from_the_wire(self.wire, self.dtype, self.redop, self.p) if algorithm == RAW else self.buf

    def compute_expected(self):
        return reference_reduce((self.input_of(r) for r in range(self.p)), self.dtype, self.redop)

    def expected_of(self, algorithm: str) -> np.ndarray:
        """A wire row's reference: each group's float32 sum (the nodes when all are the same size, else each
        rank) through the codec, summed in float32, /p for avg, through the codec again."""
        if not algorithm.startswith(WIRE_ROW):
            return self.expected()
        if algorithm not in self._wired:
            self._wired[algorithm] = self._wired_reference(codec(algorithm[len(WIRE_ROW):]))
        return self._wired[algorithm]

    def _wired_reference(self, wire_codec) -> np.ndarray:
        node = self.comm.transport.node  # (collective: every rank checks every row)
        leaders = self.comm.mpi.allgather(node.mpi.allreduce(self.rank, op=MPI.MIN))
        uniform = len({leaders.count(leader) for leader in leaders}) == 1
        groups: dict[int, list[int]] = {}
        for rank, leader in enumerate(leaders):
            groups.setdefault(leader if uniform else rank, []).append(rank)
        total = np.zeros(self.count, np.float32)
        for members in groups.values():  # (in order of their first rank: the order of the node communicators)
            partial_sum = self.input_of(members[0]).astype(np.float32)
            for rank in members[1:]:
                partial_sum += self.input_of(rank)
            total += wire_codec.roundtrip(partial_sum)
        if self.redop == "avg":
            np.divide(total, self.p, out=total)
        return wire_codec.roundtrip(total)
