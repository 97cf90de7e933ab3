"""All-to-all with equal blocks (``Communicator.all_to_all``): size is one rank's full send (= receive) buffer,
count the elements of one block (what each rank sends each peer), as nccl-tests' alltoall_perf.
busbw = algbw * (p-1)/p. Raw: ``MPI.Comm.Alltoall`` of the bytes."""
from __future__ import annotations

from functools import partial

import numpy as np

from .base import RAW, DataMovement


class AllToAll(DataMovement):
    name = "alltoall"
    operation = "all_to_all"
    raw_call = "Alltoall"
    per_rank_count = True
    replicated = False  # each rank receives its own blocks
    busbw_formula = "(p-1)/p"
    recv: np.ndarray  # on every rank

    def send_of(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s send buffer: block j goes to rank j."""
        return self.input_of(rank, self.count * self.p)

    def setup(self) -> None:
        self.send = self.send_of(self.rank)
        self.recv = np.zeros(self.count * self.p, self.dtype)

    def call(self, algorithm: str):
        if algorithm == RAW:
            return partial(self.raw_comm.Alltoall, self.send.view(np.uint8), self.recv.view(np.uint8))
        return partial(self.comm.all_to_all, self.send, self.recv, algorithm)

    def compute_expected(self):
        # block i of what this rank receives is block `rank` of what rank i sends
        return np.concatenate([self.block(self.send_of(i), self.rank) for i in range(self.p)])
