"""Whether a pipeline stage must keep calling MPI after a send for the message to move: measured once.

The executor sends a stage's output with ``Isend`` and goes straight on computing. Some MPI configurations move a
message that size only while the sender calls MPI: MPICH's shared memory without CMA pushes one 8 KiB cell per
progress call, and MPICH 5 turns CMA off at start-up where yama's ``ptrace_scope`` is not 0 (Ubuntu's default;
``MPIR_CVAR_CH4_CMA_ENABLE=0`` does the same). There the receiving stage, already waiting, waits for the sender's
whole next compute, which multiplies the bubble; testing each send after it brings it back near the bubble with
CMA (bench/results/pipeline_bubble.md, the ``spin_after_send`` tables). So at
its first step the executor measures, between every pair of neighbouring pipeline ranks, how long a hand-off takes
while the sender keeps testing it, and whether it arrives while the sender makes no MPI call at all. If it does
not, every send is then tested until it completes, for at most a bounded time (long enough for the transfer when
its receiver is waiting, the case on the critical path); if it does, no time is spent.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from mpcomm.transport import Transport, completed

if TYPE_CHECKING:
    from mpi4py import MPI

    from mpcomm.comm import Communicator

# The receiver's window for the message to arrive while the sender makes no MPI call: this long at least, and
# _WINDOW_TRANSFERS transfers (as measured with the sender testing) so that a slow link is not mistaken for a stall.
_MIN_WINDOW, _WINDOW_TRANSFERS = 5e-3, 4
# Testing after a send, where needed, lasts _SPIN_TRANSFERS transfers, within [_MIN_SPIN, _MAX_SPIN] seconds. At
# least 2 ms: a receiver often starts waiting shortly after the send, not before it (in GPipe's forward phase the
# next stage finishes the previous micro-batch about one hand-off later); shorter spins left gpipe's bubble larger,
# longer ones did not shrink it (bench/results/pipeline_bubble.md).
_SPIN_TRANSFERS, _MIN_SPIN, _MAX_SPIN = 4, 2e-3, 10e-3
# Transfers timed with the sender testing; the fastest counts: MPICH sets the channel up on the first
# (bench/results/observations.md, "The pipeline's test-after-send window").
_TIMED = 3
_OPERATION = "pipeline: measuring whether hand-offs move without the sender's MPI calls"


def measure_spin_after_send(comm: Communicator, wire: Transport, nbytes: int, tag: int) -> float:
    """Seconds each rank of the pp Communicator ``comm`` should test a hand-off after sending it: 0 when a
    message of ``nbytes`` (the largest of any rank's) reaches rank r + 1 from every rank r while r makes no MPI
    call, else ``_SPIN_TRANSFERS`` transfers of the slowest pair as measured with the sender testing (within
    [_MIN_SPIN, _MAX_SPIN]). The probes travel on ``wire`` (the executor's private channel) with ``tag``.
    Collective over ``comm``."""
    size = np.array([nbytes], dtype=np.int64)
    comm.allreduce(size, op="max")
    probe = np.zeros(int(size[0]), dtype=np.uint8)
    spin = 0.0
    for parity in (0, 1):  # pairs (r, r + 1) with r even, then with r odd: a rank is in at most one pair at a time
        if comm.rank % 2 == parity and comm.rank + 1 < comm.size:
            _send_probes(wire, probe, comm.rank + 1, tag)
        elif comm.rank % 2 != parity and comm.rank >= 1:
            spin = max(spin, _receive_probes(wire, probe, comm.rank - 1, tag))
    agreed = np.array([spin])
    comm.allreduce(agreed, op="max")
    return float(agreed[0])


def test_until(request: MPI.Request, deadline: float) -> bool:
    """Drive MPI for ``request`` until it completes (True) or ``time.perf_counter()`` passes ``deadline`` (False),
    leaving it for a later wait: how a sender keeps its message moving where MPI needs its calls for that, and how
    the probe's receiver watches for one."""
    while not completed(request):
        if time.perf_counter() >= deadline:
            return False
    return True


def _send_probes(wire: Transport, probe: np.ndarray, peer: int, tag: int) -> None:
    """The sending side: each time the receiver says it waits, send ``probe``; ``_TIMED`` times test it to
    completion, then make no MPI call for twice the window the receiver names."""
    window = np.zeros(1)
    for _ in range(_TIMED):
        wire.recv(window, peer, tag)
        wire.wait([wire.isend(probe, peer, tag)], (peer,), operation=_OPERATION)
    wire.recv(window, peer, tag)
    request = wire.isend(probe, peer, tag)
    time.sleep(2 * float(window[0]))  # no MPI call on purpose: the experiment is whether the message moves anyway
    wire.wait([request], (peer,), operation=_OPERATION)


def _receive_probes(wire: Transport, probe: np.ndarray, peer: int, tag: int) -> float:
    """The receiving side; returns the time to test a send for (0 when the message came without the sender)."""
    window = np.zeros(1)
    transfer = float("inf")
    for _ in range(_TIMED):
        request = wire.irecv(probe, peer, tag)
        start = time.perf_counter()
        wire.send(window, peer, tag)
        wire.wait([request], (peer,), (probe.nbytes,), operation=_OPERATION)
        transfer = min(transfer, time.perf_counter() - start)
    window[0] = max(_MIN_WINDOW, _WINDOW_TRANSFERS * transfer)
    request = wire.irecv(probe, peer, tag)
    deadline = time.perf_counter() + window[0]
    wire.send(window, peer, tag)
    arrived = test_until(request, deadline)
    wire.wait([request], (peer,), (probe.nbytes,), operation=_OPERATION)
    return 0.0 if arrived else min(_MAX_SPIN, max(_MIN_SPIN, _SPIN_TRANSFERS * transfer))
