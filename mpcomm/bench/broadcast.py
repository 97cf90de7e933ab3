"""Broadcast from ``--root``, in place. busbw = algbw."""
from __future__ import annotations

from .base import Collective, sentinel_like


class Broadcast(Collective):
    name = "broadcast"
    reduces = False

    @staticmethod
    def busbw_factor(p: int) -> float:
        return 1.0

    def setup(self) -> None:
        self.input = self.input_of(self.root)
        self.buf = self.input.copy()

    def step(self, algorithm: str) -> None:
        self.comm.broadcast(self.buf, root=self.root, algorithm=algorithm)

    def reset(self) -> None:
        self.buf[...] = self.input if self.rank == self.root else sentinel_like(self.input)

    def result(self):
        return self.buf

    def compute_expected(self):
        return self.input
