"""Tuning tables are checked when loaded: a broken entry is a ValueError naming the file and the entry.

(Before: a table with the right format but broken entries loaded without complaint, then every ``auto`` call raised
a bare KeyError/IndexError, or warned about log2 of a size <= 0.)

    python -m pytest -q --with-mpi tests/test_tuning_table.py
    timeout 600 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_tuning_table.py   (also 3)
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY
from mpcomm.algorithms.auto import TABLE_FORMAT, Layout, Selector

LAYOUT = Layout.blocks(4, 2)


def good_table(layout: Layout = LAYOUT) -> dict:
    entry = {"sizes": [8, 4096, 1 << 20], "best": ["native", "rhd", "ring"],
             "seconds": {"native": [1e-6, 9e-6, 4e-4], "rhd": [5e-6, 8e-6, 3e-4], "ring": [9e-6, 9e-6, 2e-4]},
             "fit": {a: {"alpha": 1e-6, "beta": 1e-10} for a in ("native", "rhd", "ring")}}
    gather = dict(copy.deepcopy(entry), best=["native"] * 3)
    return {"format": TABLE_FORMAT, "layout": layout.to_json(), "mpi": "MPICH",
            "operations": {"allreduce": {"float32": entry}, "all_gather": {"float64": gather}}}


def selector(layout: Layout = LAYOUT) -> Selector:
    return Selector(layout, {op: tuple(algs) for op, algs in REGISTRY.items()})


def broken(edit):
    table = good_table()
    edit(table)
    return table


def set_entry(key, value):
    def edit(table):
        entry = table["operations"]["allreduce"]["float32"]
        if value is DELETE:
            del entry[key]
        else:
            entry[key] = value
    return edit


DELETE = object()

# (table edit, the entry the message must name, what it must say)
CASES = {
    "sizes missing": (set_entry("sizes", DELETE), "operations.allreduce.float32", "missing 'sizes'"),
    "best missing": (set_entry("best", DELETE), "operations.allreduce.float32", "missing 'best'"),
    "best shorter than sizes": (set_entry("best", ["native", "rhd"]), "operations.allreduce.float32.best",
                                "has 2 entries, sizes has 3"),
    "size zero": (set_entry("sizes", [0, 4096, 1 << 20]), "sizes[0]", "positive integer"),
    "size negative": (set_entry("sizes", [8, -4096, 1 << 20]), "sizes[1]", "positive integer"),
    "size a string": (set_entry("sizes", [8, "4096", 1 << 20]), "sizes[1]", "positive integer"),
    "size a float": (set_entry("sizes", [8, 4096, 1048576.5]), "sizes[2]", "positive integer"),
    "sizes empty": (set_entry("sizes", []), "operations.allreduce.float32.sizes", "is empty"),
    "best not a list": (set_entry("best", "native"), "operations.allreduce.float32.best", "must be a list"),
    "best entry not a name": (set_entry("best", ["native", 3, "ring"]), "best[1]", "algorithm name"),
    "seconds too short": (set_entry("seconds", {"ring": [1e-6]}), "seconds.ring", "has 1 entries"),
    "seconds negative": (set_entry("seconds", {"ring": [1e-6, -1.0, 2e-6]}), "seconds.ring[1]", ">= 0"),
    "seconds NaN": (set_entry("seconds", {"ring": [1e-6, float("nan"), 2e-6]}), "seconds.ring[1]", "finite"),
    "fit without beta": (set_entry("fit", {"ring": {"alpha": 1e-6}}), "fit.ring", "missing 'beta'"),
    "fit a string": (set_entry("fit", {"ring": {"alpha": "1e-6", "beta": 0.0}}), "fit.ring.alpha", "finite number"),
    "entry a list": (lambda t: t["operations"]["allreduce"].update(float32=[8, 16]),
                     "operations.allreduce.float32", "must be an object"),
    "dtype not a dtype": (lambda t: t["operations"]["allreduce"].update(float33={"sizes": [8], "best": ["ring"]}),
                          "operations.allreduce.float33", "not a dtype name"),
    "operations missing": (lambda t: t.pop("operations"), "operations", "must be an object"),
    "operations a list": (lambda t: t.update(operations=[]), "operations", "must be an object"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_entry_is_named(case):
    edit, where, what = CASES[case]
    sel = selector()
    with pytest.raises(ValueError) as info:
        sel.load(broken(edit), source="tuning file '/x/t.json'")
    message = str(info.value)
    assert "tuning file '/x/t.json'" in message and where in message and what in message, message
    assert sel.table is None  # nothing of the broken table is used


def test_good_table_loads_and_is_used():
    sel = selector()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no log2 or other warnings either
        assert sel.load(good_table(), source="tuning file 'good.json'")
        assert [sel.choose("allreduce", n, np.float32) for n in (8, 4096, 1 << 20, 1 << 26)] == \
            ["native", "rhd", "ring", "ring"]
        assert sel.choose("all_gather", 1 << 20, np.float64) == "native"


def test_other_layout_or_format_still_warns_and_is_ignored():
    sel = selector()
    with pytest.warns(RuntimeWarning, match="measured on layout"):
        assert sel.load(good_table(Layout.blocks(4, 4))) is False
    with pytest.warns(RuntimeWarning, match="not a tuning table"):
        assert sel.load(dict(good_table(), format="something-else")) is False
    assert sel.table is None


# ---------------------------------------------------------------------------------------- through load_tuning
@pytest.mark.mpi
@pytest.mark.parametrize("case", ["best shorter than sizes", "size zero", "sizes missing", "seconds NaN"])
def test_load_tuning_of_a_broken_file_raises_on_every_rank(case):
    world = MPI.COMM_WORLD
    comm = Communicator(world, timeout=10.0)
    path = world.bcast(tempfile.mkdtemp(prefix="mpcomm-tuning-") if world.Get_rank() == 0 else None)
    path = os.path.join(path, "table.json")
    table = good_table(comm.selector.layout)
    CASES[case][0](table)
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(table, f)
    comm.barrier()
    try:
        comm.load_tuning(path)
        mine = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - gathered and judged below
        mine = (type(exc).__name__, str(exc))
    for rank, (name, message) in enumerate(world.allgather(mine)):
        assert name == "ValueError" and path in message and CASES[case][1] in message, (rank, name, message)
    np.testing.assert_array_equal(comm.allreduce(np.ones(3, np.float32)), np.full(3, comm.size, np.float32))
    comm.free()
    world.Barrier()
    if world.Get_rank() == 0:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
