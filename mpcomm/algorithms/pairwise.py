"""Pairwise-exchange all-to-all: p-1 rounds; in round s every rank sends to rank + s and receives from rank - s.

Each block crosses the network once, directly to its destination, so the bytes moved are the minimum;
the p-1 latencies make it the choice for large blocks (MPICH and Open MPI use it there too). Works for any p
and for per-peer counts (all_to_all_v), zeros included.
"""
from __future__ import annotations

from ..transport import Transport


def all_to_all(t: Transport, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs) -> None:
    """``recvbuf`` block j <- rank j's block for this rank; counts and displacements are in elements."""
    p, r = t.size, t.rank

    def sent(j):
        return sendbuf[send_displs[j] : send_displs[j] + send_counts[j]]

    def received(j):
        return recvbuf[recv_displs[j] : recv_displs[j] + recv_counts[j]]

    received(r)[...] = sent(r)
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        t.sendrecv(sent(dst), dst, received(src), src)

