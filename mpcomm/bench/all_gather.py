"""All-gather: size is the full (receive) buffer, count the elements each rank sends. busbw = algbw * (p-1)/p."""
from __future__ import annotations

import numpy as np

from .base import Collective, sentinel_like


class AllGather(Collective):
    name = "all_gather"
    reduces = False
    per_rank_count = True

    @staticmethod
    def busbw_factor(p: int) -> float:
        return (p - 1) / p

    def setup(self) -> None:
        self.send = self.input_of(self.rank)
        self.recv = np.zeros(self.count * self.p, self.dtype)

    def step(self, algorithm: str) -> None:
        self.comm.all_gather(self.send, self.recv, algorithm=algorithm)

    def reset(self) -> None:
        self.recv[...] = sentinel_like(self.expected())

    def result(self):
        return self.recv

    def compute_expected(self):
        return np.concatenate([self.input_of(r) for r in range(self.p)])
