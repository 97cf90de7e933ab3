"""How a vector of n elements is cut into p contiguous chunks (the first n % p chunks one element longer), and
how the ranks learn each other's per-peer counts."""
from __future__ import annotations

import numpy as np


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``p`` (start, stop) pairs covering range(n) in order, sizes differing by at most one."""
    base, extra = divmod(n, p)
    bounds, start = [], 0
    for i in range(p):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def equal_bounds(count: int, p: int) -> list[tuple[int, int]]:
    """``p`` chunks of exactly ``count`` elements: the layout of reduce_scatter / all_gather buffers."""
    return [(i * count, (i + 1) * count) for i in range(p)]


def span(bounds: list[tuple[int, int]], first: int, last: int) -> slice:
    """The slice covering chunks first..last-1."""
    return slice(bounds[first][0], bounds[last - 1][1])


def count_matrix(t, send_counts, recv_counts) -> tuple[np.ndarray, str | None]:
    """Row i: what rank i sends each rank (one all-gather of 2p integers over transport ``t``), and the first
    inconsistency — rank i sending rank j another count than j expects from i — described, or None."""
    mine = np.array(list(send_counts) + list(recv_counts), dtype=np.int64)
    everyone = np.empty((t.size, mine.size), dtype=np.int64)
    t.wait([t.mpi.Iallgather(mine, everyone)], t.others)
    sends, recvs = everyone[:, : t.size], everyone[:, t.size :]
    if (sends == recvs.T).all():
        return sends, None
    i, j = (int(x[0]) for x in np.nonzero(sends != recvs.T))
    return sends, f"rank {i} sends {sends[i, j]} elements to rank {j}, which expects {recvs[j, i]}"


def aligned_bounds(n: int, p: int, block: int) -> list[tuple[int, int]]:
    """``chunk_bounds`` over whole blocks of ``block`` elements (the last block may be short): a codec that
    encodes per block encodes each chunk as it would the whole vector."""
    blocks = -(-n // block)
    return [(min(lo * block, n), min(hi * block, n)) for lo, hi in chunk_bounds(blocks, p)]
