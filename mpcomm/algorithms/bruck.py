"""Bruck's all-to-all (Bruck et al. 1997): ceil(log2 p) rounds instead of p-1, for small blocks.

Position i of a rank's table holds a block whose destination is i ranks ahead of its source. Start with
position i = the block for rank + i; in round k every rank sends the blocks at the positions with bit 2^k
set to rank + 2^k, and receives the same positions from rank - 2^k. After the last round position i holds
the block from rank - i to this rank. Each block travels up to log p hops, so the bytes moved grow by
log(p)/2: it wins where latency dominates (small blocks, many ranks).

With per-peer counts (all_to_all_v) a block's size depends on its source and destination, which a rank
forwarding it does not know from its own counts: the ranks first exchange their counts (one all-gather of 2p
integers), check that every rank receives what its peers send, and then size every message from that matrix.
"""
from __future__ import annotations

import numpy as np

from ..transport import Transport
from .chunks import count_matrix


def _exchange(t: Transport, sendbuf, send_displs, recvbuf, recv_displs, count) -> None:
    """The rounds; ``count(source, dest)`` is the number of elements rank ``source`` sends to ``dest``."""
    p, r = t.size, t.rank
    table = [sendbuf[send_displs[(r + i) % p] :][: count(r, (r + i) % p)] for i in range(p)]
    step = 1
    while step < p:
        positions = [i for i in range(p) if i & step]
        dst, src = (r + step) % p, (r - step) % p
        outgoing = np.concatenate([table[i] for i in positions]) if positions else sendbuf[:0]
        # the block at position i on rank src came from src - (i mod step) and goes i ranks further on
        sizes = [count((src - (i & (step - 1))) % p, (src - (i & (step - 1)) + i) % p) for i in positions]
        incoming = t.scratch(f"bruck.recv{step}", sum(sizes), sendbuf.dtype, like=sendbuf)
        t.sendrecv(outgoing, dst, incoming, src)
        start = 0
        for i, size in zip(positions, sizes):
            table[i] = incoming[start : start + size]
            start += size
        step <<= 1
    for i in range(p):
        source = (r - i) % p
        recvbuf[recv_displs[source] :][: table[i].size] = table[i]


def all_to_all(t: Transport, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs) -> None:
    """Equal blocks: every block has ``send_counts[0]`` elements, known to every rank without asking."""
    block = send_counts[0] if send_counts else 0
    _exchange(t, sendbuf, send_displs, recvbuf, recv_displs, lambda source, dest: block)


def all_to_all_v(t: Transport, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs) -> None:
    """Per-peer counts: agree on the count matrix first (ValueError on every rank if sends and receives differ)."""
    sends, problem = count_matrix(t, send_counts, recv_counts)
    if problem:
        raise ValueError(f"all_to_all_v: {problem} (send_counts on each rank must equal the matching recv_counts "
                         "on its peers)")
    _exchange(t, sendbuf, send_displs, recvbuf, recv_displs, lambda source, dest: int(sends[source, dest]))
