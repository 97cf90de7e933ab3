"""Keep freed memory in the process (glibc), for benchmarks whose steps allocate the same arrays every time.

glibc returns freed memory to the OS (heap trim; blocks over 128 KiB are mmapped and unmapped), so every step
page-faults its arrays back in: for a model with 32 MiB of gradients set to None between steps that is ~6 ms a
step on the dev VM, more on some ranks than others. PyTorch avoids it with its caching allocator (and its CPU
performance guides recommend jemalloc/tcmalloc for the same reason); numpy has none, so the benchmarks ask glibc
to keep what it frees. Not glibc: nothing is changed.
"""
from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Raise glibc's trim threshold to 1 GiB and its mmap threshold to its 32 MiB maximum; False if not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 2**30) and mallopt(_M_MMAP_THRESHOLD, 2**25))
