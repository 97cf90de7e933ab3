"""All-reduce, in place. busbw = algbw * 2(p-1)/p."""
from __future__ import annotations

from .base import Collective, reference_reduce


class AllReduce(Collective):
    name = "allreduce"

    @staticmethod
    def busbw_factor(p: int) -> float:
        return 2 * (p - 1) / p

    def setup(self) -> None:
        self.input = self.input_of(self.rank)
        self.buf = self.input.copy()

    def step(self, algorithm: str) -> None:
        self.comm.allreduce(self.buf, op=self.redop, algorithm=algorithm)

    def reset(self) -> None:
        self.buf[...] = self.input

    def result(self):
        return self.buf

    def compute_expected(self):
        return reference_reduce((self.input_of(r) for r in range(self.p)), self.dtype, self.redop)
