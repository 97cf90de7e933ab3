"""Sendrecv around a ring: each rank sends to rank+1 while receiving from rank-1. busbw = algbw.

Algorithms: "p2p" is mpcomm's ``Communicator.sendrecv`` (header + payload, deadline-bounded waits);
"native" is the MPI library's blocking ``Sendrecv`` of the raw bytes on a private duplicate communicator.
"""
from __future__ import annotations

import numpy as np

from .base import Collective, sentinel_like


class SendRecv(Collective):
    name = "sendrecv"
    reduces = False
    replicated = False

    @staticmethod
    def busbw_factor(p: int) -> float:
        return 1.0

    @classmethod
    def algorithms(cls) -> list[str]:
        return ["p2p", "native"]

    def setup(self) -> None:
        self.dst, self.src = (self.rank + 1) % self.p, (self.rank - 1) % self.p
        self.send = self.input_of(self.rank)
        self.recv = np.zeros(self.count, self.dtype)
        self.native_comm = self.comm.mpi.Dup()

    def step(self, algorithm: str) -> None:
        if algorithm == "native":
            self.native_comm.Sendrecv(self.send.view(np.uint8), self.dst, 0, self.recv.view(np.uint8), self.src, 0)
        else:
            self.comm.sendrecv(self.send, self.dst, self.recv, self.src)

    def reset(self) -> None:
        self.recv[...] = sentinel_like(self.expected())

    def result(self):
        return self.recv

    def compute_expected(self):
        return self.input_of(self.src)

    def close(self) -> None:
        self.native_comm.Free()
