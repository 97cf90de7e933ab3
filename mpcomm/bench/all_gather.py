"""All-gather: size is the full (receive) buffer, count the elements each rank sends. busbw = algbw * (p-1)/p.
Raw: ``MPI.Comm.Allgather`` of the bytes."""
from __future__ import annotations

from functools import partial

import numpy as np

from .base import RAW, DataMovement


class AllGather(DataMovement):
    name = "all_gather"
    raw_call = "Allgather"
    per_rank_count = True
    busbw_formula = "(p-1)/p"
    recv: np.ndarray  # on every rank

    def setup(self) -> None:
        self.send = self.input_of(self.rank)
        self.recv = np.zeros(self.count * self.p, self.dtype)

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Allgather, self.send.view(np.uint8), self.recv.view(np.uint8))
        return partial(self.comm.all_gather, self.send, self.recv, algorithm)

    def compute_expected(self):
        return np.concatenate([self.input_of(r) for r in range(self.p)])
