"""The torch backend's calls in the flight recorder, under torch's own names, numbered alike on every rank.

Skips without PyTorch (``make test-torch``).
Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m "mpi and torch" tests/test_trace_torch.py``.
"""
from __future__ import annotations

import pickle
import tempfile

import pytest
from conftest import WORLD, in_step, run_gathered

import mpcomm.trace

pytest.importorskip("torch.distributed")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed here")]
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.mark.mpi
def test_torch_calls_are_recorded_with_torch_names(pg):
    group = dist.new_group(list(range(SIZE)))  # (a group of its own: its lane holds this test's calls only)
    t = torch.ones(6)
    in_step(lambda: dist.all_reduce(t, group=group))
    in_step(lambda: dist.broadcast(t, src=SIZE - 1, group=group))
    out = torch.empty(6 * SIZE)
    in_step(lambda: dist.all_gather_into_tensor(out, t, group=group))
    if SIZE > 1:
        right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        got = torch.empty(6)

        def ring():
            works = [dist.irecv(got, src=left, group=group), dist.isend(t, dst=right, group=group)]
            for w in works:
                w.wait()

        in_step(ring)
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="mpcomm-trace-") if RANK == 0 else None)
    with open(mpcomm.trace.dump_trace(directory), "rb") as f:
        entries = pickle.load(f)["entries"]
    lane = next(e["process_group"][0] for e in reversed(entries) if e["profiling_name"] == "mpcomm:all_gather")
    mine = [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["output_sizes"], e["state"])
            for e in entries if e["process_group"][0] == lane]
    collectives = [m for m in mine if " " not in m[1]]
    assert [m[1] for m in collectives] == ["mpcomm:all_reduce", "mpcomm:broadcast", "mpcomm:all_gather"], mine
    assert collectives[-1][2:] == ([[6]], [[6 * SIZE]], "completed"), mine
    everyone = run_gathered(lambda: collectives)
    assert all(c == everyone[0] for c in everyone), everyone  # the same numbers and names on every rank
    if SIZE > 1:
        p2p = [m[1] for m in mine if " " in m[1]]
        assert p2p == [f"mpcomm:recv {RANK}<-{left}", f"mpcomm:send {RANK}->{right}"], mine
