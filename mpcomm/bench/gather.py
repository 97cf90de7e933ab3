"""Gather to ``--root``: size is the root's full (receive) buffer, count the elements each rank sends, as
nccl-tests' gather_perf. busbw = algbw * (p-1)/p. Raw: ``MPI.Comm.Gather`` of the bytes."""
from __future__ import annotations

from functools import partial

import numpy as np

from .base import RAW, DataMovement


class Gather(DataMovement):
    name = "gather"
    raw_call = "Gather"
    rooted = True
    per_rank_count = True
    replicated = False  # only the root receives
    busbw_formula = "(p-1)/p"

    def setup(self) -> None:
        self.send = self.input_of(self.rank)
        self.recv = np.zeros(self.count * self.p, self.dtype) if self.rank == self.root else None

    def call(self, algorithm: str):
        if algorithm == RAW:
            recv = None if self.recv is None else self.recv.view(np.uint8)
            return partial(self.raw_comm.Gather, self.send.view(np.uint8), recv, self.root)
        return partial(self.comm.gather, self.send, self.recv, self.root, algorithm)

    def compute_expected(self):
        if self.rank != self.root:
            return self.nothing()
        return np.concatenate([self.input_of(r) for r in range(self.p)])
