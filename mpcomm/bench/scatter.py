"""Scatter from ``--root``: size is the root's full (send) buffer, count the elements each rank receives, as
nccl-tests' scatter_perf. busbw = algbw * (p-1)/p. Raw: ``MPI.Comm.Scatter`` of the bytes."""
from __future__ import annotations

from functools import partial

import numpy as np

from .base import RAW, DataMovement


class Scatter(DataMovement):
    name = "scatter"
    raw_call = "Scatter"
    rooted = True
    per_rank_count = True
    replicated = False  # each rank receives its own block
    busbw_formula = "(p-1)/p"
    recv: np.ndarray  # on every rank

    def root_input(self) -> np.ndarray:
        return self.input_of(self.root, self.count * self.p)

    def setup(self) -> None:
        self.send = self.root_input() if self.rank == self.root else None  # None: the API allows it
        self.recv = np.zeros(self.count, self.dtype)

    def call(self, algorithm: str):
        if algorithm == RAW:
            send = None if self.send is None else self.send.view(np.uint8)
            return partial(self.raw_comm.Scatter, send, self.recv.view(np.uint8), self.root)
        return partial(self.comm.scatter, self.send, self.recv, self.root, algorithm)

    def compute_expected(self):
        return self.block(self.root_input(), self.rank)
