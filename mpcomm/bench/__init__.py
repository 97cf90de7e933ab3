"""nccl-tests style benchmarks of mpcomm's collectives: ``mpcomm-bench`` or ``python -m mpcomm.bench``.

One shared driver (``driver.py``: sweep, warm-up, timing, check; ``report.py``: table, JSON, plot;
``cli.py``: arguments) and one small file per collective (``allreduce.py``, ``reduce_scatter.py``,
``all_gather.py``, ``broadcast.py``, ``reduce.py``, ``gather.py``, ``scatter.py``, ``alltoall.py``, ``sendrecv.py``).
"""
from __future__ import annotations

from .cli import main, run
from .driver import COLLECTIVES, busbw_factor

__all__ = ["main", "run", "COLLECTIVES", "busbw_factor"]
