"""Broadcast from ``--root``, in place. busbw = algbw. Raw: ``MPI.Comm.Bcast`` of the bytes."""
from __future__ import annotations

from functools import partial

import numpy as np

from .base import RAW, Collective, sentinel_like


class Broadcast(Collective):
    name = "broadcast"
    raw_call = "Bcast"
    reduces = False
    rooted = True
    busbw_formula = "1"

    def setup(self) -> None:
        self.input = self.input_of(self.root)
        self.buf = self.input.copy()

    def fill(self, check: bool) -> None:
        # timing: every call copies root's input over equal data (steady); check: the others start poisoned
        self.buf[...] = self.input if self.rank == self.root or not check else sentinel_like(self.input)

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Bcast, self.buf.view(np.uint8), self.root)
        return partial(self.comm.broadcast, self.buf, self.root, algorithm)

    def result(self, algorithm: str):
        return self.buf

    def compute_expected(self):
        return self.input
