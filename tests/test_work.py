"""``Work.wait(timeout)``: a timeout on an operation still running leaves it running and the communicator usable;
a timeout that is not a finite number of seconds >= 0 is a ValueError on every kind of Work.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_work.py`` (any N >= 1).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm import CommTimeoutError, Communicator

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def test_work_wait_timeout_on_a_running_operation():
    """Work.wait(timeout=0) on an all-reduce still waiting for a late rank says the operation is still running and
    the communicator usable — and both are true: it then completes, and the communicator keeps working."""
    if P < 2:
        pytest.skip("needs a late rank")
    c = Communicator(WORLD, timeout=20.0)

    def run():
        if RANK == 0:
            work = c.iallreduce(np.ones(8))
            with pytest.raises(CommTimeoutError, match="still running") as info:
                work.wait(timeout=0)
            assert "no longer usable" not in str(info.value)
            WORLD.Barrier()
            result = work.wait()
        else:
            WORLD.Barrier()
            result = c.iallreduce(np.ones(8)).wait()
        again = c.allreduce(np.ones(2))
        return result, again

    try:
        for result, again in run_gathered(run):
            assert (result == P).all() and (again == P).all()
    finally:
        c.free()


@pytest.mark.parametrize("progress", ["thread", "wait"])
@pytest.mark.parametrize("timeout", [math.nan, -1.0, "1", math.inf], ids=["nan", "negative", "str", "inf"])
def test_work_wait_refuses_a_timeout_that_is_not_seconds(monkeypatch, progress, timeout):
    """``wait(timeout=nan)`` waited forever on point-to-point (its deadline, start + nan, never came): every Work
    refuses a timeout that is not a finite number of seconds >= 0 with a ValueError, and still completes after."""
    monkeypatch.setenv("MPCOMM_PROGRESS", progress)
    c = Communicator(WORLD, timeout=5.0)
    big = 1 << 17  # float64 elements: a payload after the envelope
    left, right = (RANK - 1) % P, (RANK + 1) % P
    try:
        works = {"irecv": c.irecv(np.empty(big), left), "isend": c.isend(np.ones(big), right),
                 "iallreduce": c.iallreduce(np.ones(3))}
        for name, work in works.items():
            with pytest.raises(ValueError, match="timeout must be None or a finite number of seconds"):
                work.wait(timeout=timeout)
        works["isend"].wait()
        assert (works["irecv"].wait() == 1).all() and (works["iallreduce"].wait() == P).all()
    finally:
        c.free()
