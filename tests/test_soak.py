"""A short differential soak in the normal suite: a few hundred seeded random collectives across every collective,
algorithm, dtype and kind of communicator (``bench/soak.py``), each checked against numpy; mpcomm's tables stay
bounded, and the process's memory, file descriptors and threads stay flat after the warm-up.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_soak.py`` (any N >= 1); env
``MPCOMM_SOAK_CALLS`` / ``MPCOMM_SOAK_SEED`` change the length and the draw. The long soak is ``make soak``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import WORLD

from mpcomm.algorithms import REGISTRY
from mpcomm.dispatch import PLAN_CACHE_SIZE
from mpcomm.algorithms.auto import MEMO_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import soak  # noqa: E402  (bench/soak.py: the driver shared with the long soak)

pytestmark = pytest.mark.mpi

CALLS = int(os.environ.get("MPCOMM_SOAK_CALLS", "500"))
SEED = int(os.environ.get("MPCOMM_SOAK_SEED", "2028"))
# RSS may grow after the warm-up by what a larger message not yet seen brings (scratch buffers of the largest
# message, numpy's and MPI's pools): the largest draw is 262147 complex128 x p blocks, 16 MiB at p = 4.
RSS_GROWTH_BOUND = 48 * 2**20


def test_random_collectives_match_numpy_and_stay_bounded():
    summary = soak.run(CALLS, SEED, warmup=CALLS // 3)
    everyone = WORLD.allgather(summary)
    failures = [f"rank {r}: {f}" for r, s in enumerate(everyone) for f in s["failures"]]
    assert all(s["wrong"] == 0 for s in everyone), "\n".join(failures)
    assert summary["calls"] == CALLS and summary["combinations"] > CALLS // 3
    pairs = sum(len(algorithms) for algorithms in REGISTRY.values())
    for name, tables in summary["tables"].items():
        assert tables["records"] <= 2 * pairs, (name, tables)  # one per (operation, algorithm) and transport
        assert tables["plans"] <= PLAN_CACHE_SIZE and tables["choices"] <= MEMO_SIZE, (name, tables)
    before, end = summary["after_warmup"], summary["end"]
    assert summary["peak_rss_after_warmup"] - before["rss"] <= RSS_GROWTH_BOUND, summary
    assert end["fds"] == before["fds"], summary
    assert end["threads"] <= before["threads"] + len(summary["tables"]), summary  # a progress thread per comm
