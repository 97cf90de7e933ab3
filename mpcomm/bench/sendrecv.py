"""Sendrecv around a ring: each rank sends to rank+1 while receiving from rank-1. busbw = algbw.

Algorithms: "p2p" is mpcomm's ``Communicator.sendrecv`` (header + payload, deadline-bounded waits);
"native" is the MPI library's blocking ``Sendrecv`` of the raw bytes, which is also what the raw row times:
for this operation the two rows are one call measured twice (their difference is the run's noise).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .base import RAW, DataMovement


class SendRecv(DataMovement):
    name = "sendrecv"
    raw_call = "Sendrecv"
    replicated = False
    busbw_formula = "1"
    recv: np.ndarray  # on every rank

    @classmethod
    def algorithms(cls) -> list[str]:
        return ["p2p", "native"]

    def setup(self) -> None:
        self.dst, self.src = (self.rank + 1) % self.p, (self.rank - 1) % self.p
        self.send = self.input_of(self.rank)
        self.recv = np.zeros(self.count, self.dtype)

    def call(self, algorithm: str):
        if algorithm in ("native", RAW):
            return partial(self.raw_comm.Sendrecv, self.send.view(np.uint8), self.dst, 0, self.recv.view(np.uint8),
                           self.src, 0)
        return partial(self.comm.sendrecv, self.send, self.dst, self.recv, self.src)

    def compute_expected(self):
        return self.input_of(self.src)
