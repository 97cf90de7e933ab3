"""How a vector of n elements is cut into p contiguous chunks (the first n % p chunks one element longer)."""
from __future__ import annotations


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
