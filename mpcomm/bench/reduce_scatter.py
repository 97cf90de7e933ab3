"""Reduce-scatter: size is the full (send) buffer, count the elements each rank receives. busbw = algbw * (p-1)/p."""
from __future__ import annotations

import numpy as np

from .base import Collective, reference_reduce, sentinel_like


class ReduceScatter(Collective):
    name = "reduce_scatter"
    per_rank_count = True
    replicated = False

    @staticmethod
    def busbw_factor(p: int) -> float:
        return (p - 1) / p

    def setup(self) -> None:
        self.send = self.input_of(self.rank, self.count * self.p)
        self.recv = np.zeros(self.count, self.dtype)

    def step(self, algorithm: str) -> None:
        self.comm.reduce_scatter(self.send, self.recv, op=self.redop, algorithm=algorithm)

    def reset(self) -> None:
        self.recv[...] = sentinel_like(self.expected())

    def result(self):
        return self.recv

    def compute_expected(self):
        mine = slice(self.rank * self.count, (self.rank + 1) * self.count)
        inputs = (self.input_of(r, self.count * self.p)[mine] for r in range(self.p))
        return reference_reduce(inputs, self.dtype, self.redop)
