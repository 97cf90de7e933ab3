"""Tuning ``auto`` for the rooted and all-to-all collectives: ``Communicator.tune(operations=...)`` and
``python -m mpcomm.tuning --operations ...`` over reduce, gather, scatter, all_to_all and all_to_all_v.

The table must be measured at the byte counts the Communicator asks ``auto`` about (else its entries steer
other calls than the ones measured), and ``auto`` must then run what the table says and give numpy's result.
Which algorithm wins is a measurement, so it is never asserted; only that ``auto`` follows the table.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_tuning_ops.py`` (any N >= 1).
"""
from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

import numpy as np
import pytest
from conftest import WORLD, make_input, run_gathered

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY
from mpcomm.tuning.cli import main as tuning_main

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
ROOT = P - 1
OPERATIONS = ("reduce", "gather", "scatter", "all_to_all", "all_to_all_v")
SIZES = (8, 1000, 4096)  # requested bytes
F32 = np.dtype(np.float32)


def selector_bytes(operation: str, requested: int) -> int:
    """What Communicator asks auto about for a float32 call of about ``requested`` bytes: the whole vector for
    reduce; for the others one block per rank of max(1, requested / 4 / p) elements (gather's and scatter's
    whole buffer, one rank's all-to-all send buffer)."""
    if operation == "reduce":
        return max(1, requested // 4) * 4
    return max(1, requested // 4 // P) * 4 * P


def _ints(n: int, rank: int, seed: int) -> np.ndarray:
    """Integer-valued float32 inputs: every sum over 4 ranks is exact, so results compare bitwise."""
    return make_input(np.int32, "sum", (n,), rank, seed).astype(F32)


def run_auto(comm, operation: str, nbytes: int, seed: int):
    """One ``algorithm="auto"`` call of ``operation`` whose selector bytes are ``nbytes``: (result, expected, the
    stats it recorded). The expected result comes from numpy on every rank's regenerated input."""
    elements = nbytes // 4
    block = elements if operation == "reduce" else elements // P
    comm.reset_stats()
    if operation == "reduce":
        inputs = [_ints(block, r, seed) for r in range(P)]
        recv = np.full(block, np.nan, F32) if RANK == ROOT else None
        comm.reduce(inputs[RANK].copy(), recv, op="sum", root=ROOT, algorithm="auto")
        expected = np.sum(np.stack(inputs).astype(np.float64), axis=0).astype(F32) if RANK == ROOT else None
    elif operation == "gather":
        inputs = [_ints(block, r, seed) for r in range(P)]
        recv = np.full(block * P, np.nan, F32) if RANK == ROOT else None
        comm.gather(inputs[RANK].copy(), recv, root=ROOT, algorithm="auto")
        expected = np.concatenate(inputs) if RANK == ROOT else None
    elif operation == "scatter":
        whole = _ints(block * P, ROOT, seed)
        recv = np.full(block, np.nan, F32)
        comm.scatter(whole.copy() if RANK == ROOT else None, recv, root=ROOT, algorithm="auto")
        expected = whole[RANK * block:(RANK + 1) * block]
    else:  # all_to_all, all_to_all_v (equal counts): block j of rank i's send goes to rank j
        sends = [_ints(block * P, r, seed) for r in range(P)]
        recv = np.full(block * P, np.nan, F32)
        if operation == "all_to_all":
            comm.all_to_all(sends[RANK].copy(), recv, algorithm="auto")
        else:
            comm.all_to_all_v(sends[RANK].copy(), [block] * P, recv, [block] * P, algorithm="auto")
        expected = np.concatenate([s[RANK * block:(RANK + 1) * block] for s in sends])
    return recv, expected, comm.stats()


@pytest.fixture
def own():
    """A Communicator of the test's own, so tuning never changes the session communicator's choices."""
    comm = Communicator(WORLD)
    yield comm
    comm.free()


@pytest.fixture
def shared_dir():
    """One temporary directory for all ranks, made and removed by rank 0."""
    made = tempfile.mkdtemp(prefix="mpcomm-tune-ops-") if RANK == 0 else None
    path = WORLD.bcast(made, root=0)
    yield pathlib.Path(path)
    WORLD.Barrier()
    if made:
        shutil.rmtree(made, ignore_errors=True)


def check_table_entries(table: dict, operations) -> None:
    """Every operation measured every registered algorithm at the selector's byte counts; ``best`` is the
    fastest measured at each size; the table is the same on every rank."""
    assert WORLD.allgather(json.dumps(table, sort_keys=True)) == [json.dumps(table, sort_keys=True)] * P
    assert set(table["operations"]) == set(operations)
    for operation in operations:
        entry = table["operations"][operation]["float32"]
        assert entry["sizes"] == sorted({selector_bytes(operation, s) for s in SIZES}), operation
        assert set(entry["seconds"]) == set(REGISTRY[operation]), operation
        for i, best in enumerate(entry["best"]):
            assert entry["seconds"][best][i] == min(times[i] for times in entry["seconds"].values()), operation


def check_auto_follows(comm, table: dict, operations) -> None:
    """At every measured size ``auto`` chooses and runs the table's best (stats name what ran, on the same bytes
    as the table), and returns numpy's result."""
    cases = [(op, i, n) for op in operations for i, n in enumerate(table["operations"][op]["float32"]["sizes"])]
    outcomes = run_gathered(lambda: [(comm.selector.choose(op, n, F32),) + run_auto(comm, op, n, seed=i)
                                     for op, i, n in cases])
    for (operation, i, nbytes), (chosen, result, expected, stats) in zip(cases, outcomes[RANK]):
        best = table["operations"][operation]["float32"]["best"][i]
        label = f"{operation} at {nbytes} B"
        assert chosen == best, label
        assert set(stats) == {operation} and set(stats[operation]) == {best}, (label, stats)
        assert stats[operation][best]["calls"] == 1 and stats[operation][best]["bytes"] == nbytes, (label, stats)
        if expected is None:
            assert result is None, label  # off the root nothing is received
        else:
            assert result.tobytes() == expected.tobytes(), label


@pytest.mark.mpi
def test_tune_rooted_and_all_to_all_then_auto_uses_the_table(own, shared_dir):
    table = own.tune(sizes=SIZES, repeats=1, operations=OPERATIONS, verbose=False)
    assert own.selector.table is table
    assert own.stats() == {}  # the measurement runs are not counted
    check_table_entries(table, OPERATIONS)
    check_auto_follows(own, table, OPERATIONS)
    # The same measurements with the slowest algorithm as "best" (saved and loaded like any table): the model
    # cannot agree with both this and the real table, so auto following both shows it reads the table.
    slowest = json.loads(json.dumps(table))
    for operation in OPERATIONS:
        entry = slowest["operations"][operation]["float32"]
        entry["best"] = [max(entry["seconds"], key=lambda a: entry["seconds"][a][i]) for i in range(len(entry["sizes"]))]
        assert entry["best"] != table["operations"][operation]["float32"]["best"], operation
    path = str(shared_dir / "slowest.json")
    if RANK == 0:
        pathlib.Path(path).write_text(json.dumps(slowest))
    WORLD.Barrier()
    assert own.load_tuning(path)
    check_auto_follows(own, slowest, OPERATIONS)


@pytest.mark.mpi
def test_python_m_tuning_takes_the_new_operations(shared_dir, capsys):
    """``python -m mpcomm.tuning --operations ... --out`` (its main, in this job) writes a table that a new
    Communicator loads and then follows."""
    path = str(shared_dir / "tuned.json")
    operations = ("reduce", "gather", "scatter", "all_to_all")
    tuning_main(["--operations", ",".join(operations), "--max-bytes", "4096", "--repeats", "1", "--out", path])
    printed = capsys.readouterr().out
    fresh = Communicator(WORLD)
    try:
        assert fresh.load_tuning(path)
        table = fresh.selector.table
        if RANK == 0:
            for operation in operations:
                assert f"{operation} float32: median time" in printed, printed
        assert set(table["operations"]) == set(operations)
        check_auto_follows(fresh, table, operations)
    finally:
        fresh.free()


@pytest.mark.parametrize("argv, message", [
    (["--operations", "reduce,alltoall"], "unknown 'alltoall'"),
    (["--operations", ","], "none given"),
    (["--max-bytes", "4"], "below the smallest size"),
])
def test_python_m_tuning_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        tuning_main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
