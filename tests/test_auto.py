"""The pipelined ring, the auto selector (cost model and tuned table) and tune()/save/load.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_auto.py`` (any N >= 1);
the tests without the mpi mark (the selector's pure logic) also run serially.
"""
from __future__ import annotations

import itertools
import json
import math
import pathlib
import shutil
import tempfile
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    WORLD,
    assert_identical_across_ranks,
    assert_reduced,
    gather,
    in_step,
    make_input,
    without_rank,
)

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY, pipelined
from mpcomm.algorithms.auto import (FRESH_PAGES_FROM, STEADY, STEADY_MARGIN, STEPWISE, TABLE_FORMAT, CostModel,
                                   Layout, Selector, crossovers)
from mpcomm.buffers import BFLOAT16, wire_dtype

P = WORLD.Get_size()


# ------------------------------------------------------------------------------------------ pipelined ring
# (n, segment bytes): tiny segments only on the smaller vectors (on a large one they only cost time)
PIPELINED_CASES = [(n, seg) for n in (0, 1, 7, P + 1, 10_007, 2**20 + 5) for seg in (8, 100, None)
                   if seg is None or n <= 20_000]


@pytest.mark.mpi
@pytest.mark.parametrize("n, segment_bytes", PIPELINED_CASES,
                         ids=[f"{n}-{'default' if seg is None else f'seg{seg}B'}" for n, seg in PIPELINED_CASES])
@pytest.mark.parametrize("op", ["sum", "avg"])  # (avg: each segment is finished as it is reduced)
def test_pipelined_allreduce(comm, monkeypatch, n, segment_bytes, op):
    if segment_bytes is not None:
        monkeypatch.setattr(pipelined, "SEGMENT_BYTES", segment_bytes)
    x = make_input(np.float32, op, (n,), comm.rank, seed=n)
    y = x.copy()
    in_step(lambda: comm.allreduce(y, op=op, algorithm="ring_pipelined"))
    assert_identical_across_ranks(y, "ring_pipelined")
    assert_reduced(y, gather(x), op, what=f"ring_pipelined {op}:")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype, op", [(np.float64, "prod"), (np.int16, "max"), (np.float16, "avg")])
@pytest.mark.parametrize("count", [1, 13, 4097])
def test_pipelined_reduce_scatter(comm, monkeypatch, dtype, op, count):
    monkeypatch.setattr(pipelined, "SEGMENT_BYTES", 24)  # many segments, not a multiple of the itemsize
    send = make_input(dtype, op, (comm.size * count,), comm.rank, seed=count)
    recv = np.empty(count, dtype)
    in_step(lambda: comm.reduce_scatter(send, recv, op=op, algorithm="ring_pipelined"))
    everyone = gather(send)
    mine = slice(comm.rank * count, (comm.rank + 1) * count)
    assert_reduced(recv, [x[mine] for x in everyone], op, what="ring_pipelined reduce_scatter:")


# ------------------------------------------------------------------------------------------ auto: agreement
def _choices(selector: Selector) -> list[str]:
    sizes = [0, 1, 8, 1000, 4096, 65536, 2**20, 2**26, 2**34]
    return [selector.choose(op, n, np.dtype(d)) for op in REGISTRY for n in sizes for d in (np.float32, np.float16)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks_per_node", [None, 1, 2])
def test_auto_agrees_across_ranks_model(ranks_per_node):
    comm = Communicator(WORLD, ranks_per_node=ranks_per_node)
    choices = _choices(comm.selector)
    assert WORLD.allgather(choices) == [choices] * P
    x = make_input(np.float64, "sum", (5000,), comm.rank)
    y = x.copy()
    in_step(lambda: comm.allreduce(y))
    used = list(comm.stats()["allreduce"])
    assert WORLD.allgather(used) == [used] * P and used[0] in REGISTRY["allreduce"]
    assert_reduced(y, gather(x), "sum")
    comm.free()


@pytest.fixture
def tmp_path():
    """One temporary directory for all ranks, made and removed by rank 0 (pytest's own tmp_path races when
    several ranks clean up its base directory at once)."""
    made = tempfile.mkdtemp(prefix="mpcomm-tune-") if WORLD.Get_rank() == 0 else None
    path = WORLD.bcast(made, root=0)
    yield pathlib.Path(path)
    WORLD.Barrier()
    if made:
        shutil.rmtree(made, ignore_errors=True)


def _shared_path(tmp_path, name: str) -> str:
    return str(tmp_path / name)


@pytest.fixture
def own():
    """A Communicator of the test's own, so tuning never changes the session communicator's choices."""
    comm = Communicator(WORLD)
    yield comm
    comm.free()


@pytest.mark.mpi
def test_tune_save_load_round_trip(own, tmp_path, monkeypatch, capsys):
    comm = own
    table = comm.tune(sizes=(8, 1024), repeats=1, operations=("allreduce", "reduce_scatter"))
    assert WORLD.allgather(json.dumps(table, sort_keys=True)) == [json.dumps(table, sort_keys=True)] * P
    assert comm.selector.table is table
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert "fit" in out and "alpha" in out
    entry = table["operations"]["allreduce"]["float32"]
    assert entry["sizes"] == [8, 1024] and set(entry["seconds"]) == set(REGISTRY["allreduce"])
    for i, best in enumerate(entry["best"]):
        assert entry["seconds"][best][i] == min(t[i] for t in entry["seconds"].values())
    assert comm.stats() == {}  # the measurement runs are not counted
    tuned = _choices(comm.selector)
    assert WORLD.allgather(tuned) == [tuned] * P
    # between/after the measured sizes: the nearest measured size on a log scale
    assert comm.selector.choose("allreduce", 10, np.float32) == entry["best"][0]
    assert comm.selector.choose("allreduce", 2**30, np.float32) == entry["best"][1]

    path = _shared_path(tmp_path, "tuning.json")
    comm.save_tuning(path)
    fresh = Communicator(WORLD)
    assert fresh.load_tuning(path)
    assert json.dumps(fresh.selector.table, sort_keys=True) == json.dumps(table, sort_keys=True)
    assert _choices(fresh.selector) == tuned
    monkeypatch.setenv("MPCOMM_TUNING_FILE", path)
    from_env = Communicator(WORLD)
    assert _choices(from_env.selector) == tuned
    x = make_input(np.float32, "sum", (300,), comm.rank)
    y = x.copy()
    in_step(lambda: from_env.allreduce(y))
    assert_reduced(y, gather(x), "sum")
    for c in (fresh, from_env):
        c.free()


@pytest.mark.mpi
def test_table_for_another_layout_is_ignored(own, tmp_path):
    comm = own
    table = comm.tune(sizes=(64,), repeats=1, verbose=False)
    other = dict(table, layout={"size": P + 1, "node_sizes": [P + 1]})
    path = _shared_path(tmp_path, "other.json")
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(other, f)
    WORLD.Barrier()
    fresh = Communicator(WORLD)
    with pytest.warns(RuntimeWarning, match="layout"):
        assert fresh.load_tuning(path) is False
    assert fresh.selector.table is None
    fresh.free()


@pytest.mark.mpi
def test_tuning_errors(comm, tmp_path):
    fresh = Communicator(WORLD)
    with pytest.raises(ValueError, match="no tuning table"):
        fresh.save_tuning(_shared_path(tmp_path, "never.json"))
    with pytest.raises(FileNotFoundError):
        fresh.load_tuning(_shared_path(tmp_path, "missing.json"))
    with pytest.warns(RuntimeWarning, match="does not exist"):
        assert fresh.load_tuning(_shared_path(tmp_path, "missing.json"), missing_ok=True) is False
    bad = _shared_path(tmp_path, "bad.json")
    if comm.rank == 0:
        with open(bad, "w") as f:
            f.write("{not json")
    WORLD.Barrier()
    with pytest.raises(ValueError, match="cannot read"):
        fresh.load_tuning(bad)
    for kwargs in ({"repeats": 0}, {"operations": ("bogus",)}, {"operations": "allreduce"}, {"sizes": ()},
                   {"algorithms": ("warp",)}):
        with pytest.raises(ValueError):
            fresh.tune(verbose=False, **kwargs)
    fresh.free()


@pytest.mark.mpi(min_size=2)
def test_load_tuning_with_a_silent_root_times_out(tmp_path):
    """Rank 0 never calls load_tuning: the others raise CommTimeoutError naming it, within timeout + 5 s."""
    c = Communicator(WORLD, timeout=1.0)
    everyone = without_rank(0, lambda: c.load_tuning(_shared_path(tmp_path, "never-read.json"), missing_ok=True))
    for result in everyone[1:]:
        assert result != "completed without rank 0"
        message, wall = result
        assert "load_tuning" in message and wall < 1.0 + 5.0, result


# ------------------------------------------------------------------------------------------ selector logic (serial)
def _table(layout: Layout, sizes, best) -> dict:
    return {"format": TABLE_FORMAT, "layout": layout.to_json(),
            "operations": {"allreduce": {"float32": {"sizes": sizes, "best": best, "seconds": {}, "fit": {}}}}}


def test_nearest_measured_size_on_log_scale():
    layout = Layout.blocks(4, 2)
    selector = Selector(layout, {op: tuple(algs) for op, algs in REGISTRY.items()})
    assert selector.load(_table(layout, [8, 1024, 2**20], ["tree", "rhd", "ring"]))
    pick = lambda n, dtype=np.float32: selector.choose("allreduce", n, dtype)  # noqa: E731
    assert [pick(0), pick(8), pick(90), pick(100), pick(1024), pick(30_000), pick(40_000), pick(2**40)] == [
        "tree", "tree", "tree", "rhd", "rhd", "rhd", "ring", "ring"]
    assert pick(2**20, np.float64) == "ring"  # unmeasured dtype: the measured one nearest in itemsize
    assert selector.choose("broadcast", 8, np.float32) in REGISTRY["broadcast"]  # unmeasured op: the model


def test_selector_rejects_foreign_tables():
    selector = Selector(Layout.blocks(4, 2), {op: tuple(algs) for op, algs in REGISTRY.items()})
    with pytest.warns(RuntimeWarning, match="layout"):
        assert not selector.load(_table(Layout.blocks(4, 4), [8], ["ring"]))
    with pytest.warns(RuntimeWarning, match="does not have"):
        assert not selector.load(_table(Layout.blocks(4, 2), [8], ["warp_drive"]))
    with pytest.warns(RuntimeWarning, match="format"):
        assert not selector.load({"layout": {}})
    assert selector.table is None


def test_cost_model_shapes():
    """The model's qualitative claims: latency-bound small messages avoid the 2(p-1)-step ring, bandwidth-
    bound large ones avoid the tree; across nodes hierarchical beats the flat ring at medium sizes."""
    model = CostModel()
    flat, nodes = Layout.blocks(64, 64), Layout.blocks(1024, 8)
    assert model.allreduce("ring", 8, flat) > model.allreduce("rhd", 8, flat)
    assert model.allreduce("tree", 2**28, flat) > model.allreduce("ring", 2**28, flat)
    assert model.allreduce("hierarchical", 2**20, nodes) < model.allreduce("ring", 2**20, nodes)
    assert model.allreduce("ring", 2**20, Layout(1, (1,))) == 0.0
    assert math.isinf(model.allreduce("warp", 8, flat))
    table = crossovers(ranks=(64, 4096))
    assert set(table) == {64, 4096}
    for regions in table.values():
        starts = [b for b, _ in regions]
        assert starts == sorted(starts) and regions[0][0] == 8
        assert all(a != b for (_, a), (_, b) in zip(regions, regions[1:]))



MODEL_LAYOUTS = [Layout(1, (1,)), Layout(2, (2,)), Layout(3, (3,)), Layout(4, (4,)), Layout.blocks(3, 2),
                 Layout.blocks(4, 2), Layout.blocks(64, 8), Layout(4, (4,), ranks_per_core=2.0),
                 Layout(8, (4, 4), ranks_per_core=1.5)]
MODEL_SIZES = [0, 1, 8, 1000, 4096, 65536, 2**20, 2**26]


@pytest.mark.parametrize("layout", MODEL_LAYOUTS, ids=lambda lay: f"{lay.node_sizes}-rpc{lay.ranks_per_core:g}")
def test_model_choice_is_its_cheapest_candidate(layout):
    """Without a table, auto takes the candidate the model prices lowest on this layout (ranks sharing cores
    included; across nodes a ring within STEADY_MARGIN of it), and only ever one of the candidates it was
    given — whatever the model's constants are."""
    everything = {op: tuple(sorted(algs)) for op, algs in REGISTRY.items()}
    for candidates in (everything, {op: algs[:1] for op, algs in everything.items()},
                       {op: algs[::-2] for op, algs in everything.items()}):
        selector = Selector(layout, candidates)
        model = selector.model.for_layout(layout)
        for operation, names in candidates.items():
            for n in MODEL_SIZES:
                costs = {a: model.collective(operation, a, n, layout) for a in names}
                pick, cheapest = selector.choose(operation, n, np.float32), min(costs.values())
                steady = layout.num_nodes > 1 and pick in STEADY and costs[pick] <= cheapest * (1 + STEADY_MARGIN)
                assert pick in names and (costs[pick] == cheapest or steady), (operation, n, pick, costs)
                assert selector.predict(operation, n, candidates=names[-1:]) == names[-1]


def test_ranks_sharing_cores_only_slow_the_model():
    """More ranks than cores can only make a predicted time longer, never shorter, but for a block reduced out of
    cache, which they price at nothing beside the scheduler's waits (measured: at p = 4 on 2 cores rhd's 16 MiB
    halves kept up with the ring's 8 MiB chunks); with a core each the model is unchanged (on one node: without the
    pipelined ring's overlap), and the layout (what a tuning table is matched on) does not depend on it."""
    model = replace(CostModel(), cold_byte=0.0)
    for layout in MODEL_LAYOUTS:
        own = Layout(layout.size, layout.node_sizes)
        shared = Layout(layout.size, layout.node_sizes, ranks_per_core=2.0)
        assert model.for_layout(own) == (model if own.num_nodes > 1 else replace(model, overlap=False))
        assert CostModel().for_layout(own).cold_byte == CostModel().cold_byte > 0
        assert CostModel().for_layout(shared).cold_byte == 0.0
        assert shared == own
        for operation, algorithms in REGISTRY.items():
            for algorithm in algorithms:
                for n in MODEL_SIZES:
                    alone = model.for_layout(own).collective(operation, algorithm, n, own)
                    crowded = model.for_layout(shared).collective(operation, algorithm, n, shared)
                    assert crowded >= alone, (operation, algorithm, n, layout)


def test_ranks_sharing_cores_make_a_whole_call_r_times_as_long_on_one_node():
    """On one node (MPICH's model) r ranks per core make every step and every byte of a call r times as long (each
    rank has 1/r of a core; at p = 4 on 2 cores the bytes took 3-4.5x what the alphas alone left them), but for
    the step-by-step algorithms' bytes (``stepwise_shared``, checked apart)."""
    model = replace(CostModel(), cold_byte=0.0, stepwise_shared=1.0)
    dtypes = [np.dtype(np.float32), np.dtype(np.int8), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]
    for layout in (lay for lay in MODEL_LAYOUTS if lay.num_nodes == 1):
        own = Layout(layout.size, layout.node_sizes)
        shared = Layout(layout.size, layout.node_sizes, ranks_per_core=2.0)
        alone, crowded = model.for_layout(own), model.for_layout(shared)
        for algorithm, n, dtype, op in itertools.product(REGISTRY["allreduce"], MODEL_SIZES, dtypes,
                                                         ("sum", "max", "avg")):
            assert crowded.call("allreduce", algorithm, n, shared, dtype, op) == pytest.approx(
                2 * alone.call("allreduce", algorithm, n, own, dtype, op), rel=1e-12), (algorithm, n, dtype, op)


@pytest.mark.parametrize("p,r,rounds", [(4, 2.0, 2.0), (8, 4.0, 4.0)], ids=["p4-rpc2", "p8-rpc4"])
def test_where_the_receiver_copies_a_trees_pairs_need_a_core_each_not_two(p, r, rounds):
    """Where the library copies a message once, by the receiver (``single_copy``: Open MPI's profile, not MPICH's),
    a binomial tree's round of p / (2 mask) sending pairs needs a core per pair: with ranks sharing cores its rounds
    take what they take with a core per rank once each pair has a core (at p = 4 on 2 cores every round; at p = 8 on
    2 cores the first round's 4 pairs share 2 cores: twice as long). Every other algorithm, and the tree where both
    sides copy (MPICH), take r times as long."""
    from mpcomm.mpi_library import PROFILES

    assert CostModel.of_library(PROFILES["openmpi"]).single_copy
    assert not CostModel.of_library(PROFILES["mpich"]).single_copy
    once = replace(CostModel(), cold_byte=0.0, single_copy=True, stepwise_shared=1.0)
    twice = replace(CostModel(), cold_byte=0.0, stepwise_shared=1.0)
    own, shared = Layout(p, (p,)), Layout(p, (p,), ranks_per_core=r)
    for n in MODEL_SIZES:
        alone = once.for_layout(own).tree(n, own)
        log_p = math.log2(p)
        assert once.for_layout(shared).tree(n, shared) == pytest.approx(alone * rounds / log_p, rel=1e-12), n
        assert twice.for_layout(shared).tree(n, shared) == pytest.approx(r * alone, rel=1e-12), n
        for algorithm in ("rhd", "ring", "direct"):
            assert once.for_layout(shared).allreduce(algorithm, n, shared) == pytest.approx(
                r * once.for_layout(own).allreduce(algorithm, n, own), rel=1e-12), (algorithm, n)


def test_tuned_table_wins_over_the_model():
    """A table measured on the same layout decides where it has entries, even for the algorithm the model
    prices highest and on a host where ranks share cores; operations it does not cover fall back to the model."""
    layout = Layout(4, (4,), ranks_per_core=2.0)
    candidates = {op: tuple(sorted(algs)) for op, algs in REGISTRY.items()}
    selector = Selector(layout, candidates)
    model = selector.model.for_layout(layout)
    sizes = [8, 4096, 2**20]
    worst = [max(candidates["allreduce"], key=lambda a: model.collective("allreduce", a, n, layout)) for n in sizes]
    assert any(w != selector.predict("allreduce", n) for w, n in zip(worst, sizes))
    assert selector.load(_table(Layout(4, (4,)), sizes, worst))
    assert [selector.choose("allreduce", n, np.float32) for n in sizes] == worst
    assert selector.choose("broadcast", 4096, np.float32) == selector.predict("broadcast", 4096)


@pytest.mark.mpi
def test_ranks_per_core_is_measured_and_agreed(comm):
    """At least the ranks of this host over its CPUs (the union of affinities is at most the host's CPUs),
    identical on every rank, and carried into the selector's layout."""
    import os

    ratio = comm.ranks_per_core
    assert comm.ranks_per_node is None  # so comm.node_size counts this host's ranks
    assert ratio >= comm.node_size / (os.cpu_count() or 1) - 1e-12
    assert_identical_across_ranks(np.array([ratio]), "ranks_per_core")
    assert comm.selector.layout.ranks_per_core == max(1.0, ratio)


# The model's per-byte slope, algorithm by algorithm, on one node, against the published alpha-beta-gamma costs
# (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009 for the ring), n = the vector's bytes, lg = ceil(log2 p)
# (a wrong per-byte term, e.g. the broadcast tree's bytes x 100, passed every other test of this file).
def _textbook_slope(operation: str, algorithm: str, p: int, beta: float, gamma: float) -> float | None:
    lg = math.ceil(math.log2(p))
    share = (p - 1) / p
    power_of_two = p & (p - 1) == 0
    table = {
        ("allreduce", "ring"): 2 * share * beta + share * gamma,
        ("allreduce", "tree"): lg * (2 * beta + gamma),  # binomial reduce + broadcast of the whole vector
        ("allreduce", "rhd"): share * (2 * beta + gamma) if power_of_two else None,
        ("reduce_scatter", "ring"): share * (beta + gamma),
        ("all_gather", "ring"): share * beta,
        ("all_gather", "rhd"): share * beta,
        ("broadcast", "tree"): lg * beta,
        ("reduce", "tree"): lg * (beta + gamma),
        ("reduce", "rhd"): share * (2 * beta + gamma),
        ("all_to_all", "pairwise"): share * beta,
    }
    return table.get((operation, algorithm))


@pytest.mark.parametrize("p", [2, 3, 4, 8, 64])
def test_model_per_byte_costs_are_the_textbook_ones(p):
    model, layout = replace(CostModel(), cold_byte=0.0), Layout(p, (p,))  # (blocks in cache: the textbook's)
    n = float(2**30)
    checked = 0
    for operation, algorithms in REGISTRY.items():
        for algorithm in algorithms:
            want = _textbook_slope(operation, algorithm, p, model.beta, model.gamma)
            if want is None:
                continue
            slope = (model.collective(operation, algorithm, 2 * n, layout)
                     - model.collective(operation, algorithm, n, layout)) / n
            assert slope == pytest.approx(want, rel=1e-9), (operation, algorithm, p, slope, want)
            checked += 1
    assert checked >= 9


# ------------------------------------------------------------------------------------------ pricing (algorithm, op, dtype)
PRICED_LAYOUTS = [Layout(2, (2,)), Layout(4, (4,), ranks_per_core=2.0), Layout(4, (2, 2)), Layout(3, (3,))]


@pytest.mark.parametrize("layout", PRICED_LAYOUTS, ids=lambda lay: f"{lay.node_sizes}-rpc{lay.ranks_per_core:g}")
def test_model_prices_each_op_and_dtype(layout):
    """float16/bfloat16 reductions of 1 MiB and more go through direct (the others get them widened to float32:
    twice the bytes and numpy's casts); native's float min/max cost what its sum does on one node (mpcomm's own MPI
    ops, no key passes) and a key pass each way more across nodes or without the ops (MPI's), its int8 more per
    byte than its int32, its int32 less than float32 on one node (MPICH's; Open MPI's integers go at its floats'
    rate); direct's all-reduce never displaces another algorithm for any other dtype where it is priced as the
    ring (p = 2, or across nodes; float32 sum unchanged); its reduce-scatter, one exchange, does from 3 ranks on one
    node (at p = 4 it was the fastest from 128 KiB: bench/results/dtype_op.md, "Stop 33")."""
    from mpcomm.mpi_library import PROFILES

    everything = {op: tuple(algs) for op, algs in REGISTRY.items()}
    without_direct = {op: tuple(a for a in algs if a != "direct") for op, algs in REGISTRY.items()}
    selector, before = Selector(layout, everything), Selector(layout, without_direct)
    for dtype in (np.dtype(np.float16), BFLOAT16):
        for op in ("sum", "prod", "min", "max", "avg"):
            for operation in ("allreduce", "reduce_scatter"):
                assert selector.choose(operation, 1 << 20, dtype, op) == "direct", (operation, dtype, op)
    f32 = np.dtype(np.float32)
    model = selector.model.for_layout(layout)
    for own_ops in (True, False):
        priced = replace(model, native_min_max_op=own_ops)
        keys = 0.0 if own_ops and layout.num_nodes == 1 else 2 * (model.alpha_kernel + (1 << 16) * model.pass_byte)
        assert priced.call("allreduce", "native", 1 << 16, layout, f32, "max") == pytest.approx(
            priced.call("allreduce", "native", 1 << 16, layout, f32, "sum") + keys, rel=1e-12)
    assert model.call("allreduce", "native", 1 << 20, layout, np.dtype(np.int8), "sum") > \
        model.call("allreduce", "native", 1 << 20, layout, np.dtype(np.int32), "sum")  # MPICH's byte loops
    int32_over_f32 = (model.call("allreduce", "native", 1 << 20, layout, np.dtype(np.int32), "sum")
                      / model.call("allreduce", "native", 1 << 20, layout, f32, "sum"))
    assert int32_over_f32 < 1 if layout.num_nodes == 1 else int32_over_f32 == 1  # (MPICH's shared memory only)
    openmpi = CostModel.of_library(PROFILES["openmpi"]).for_layout(layout)  # (its integers go at its floats' rate)
    assert {openmpi.call("allreduce", "native", 1 << 20, layout, np.dtype(d), "sum")
            for d in (np.int8, np.int16, np.int32, np.int64, np.float32)} == \
        {openmpi.call("allreduce", "native", 1 << 20, layout, f32, "sum")}
    as_the_ring = layout.size == 2 or layout.num_nodes > 1
    for dtype in (f32, np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int8)):
        for op in ("sum", "max", "min", "prod"):
            for n in (8, 4096, 1 << 16, 1 << 20, 1 << 26):
                if as_the_ring:
                    assert selector.choose("allreduce", n, dtype, op) == before.choose("allreduce", n, dtype, op)
    one_node_of_3_or_more = layout.num_nodes == 1 and layout.size > 2
    assert (selector.choose("reduce_scatter", 2 << 20, f32, "sum") == "direct") == one_node_of_3_or_more


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_direct_all_reduces_in_p_steps_on_one_node(p):
    """direct's all-reduce is one exchange and the ring's p - 1 all-gather steps: on one node p steps' latency, the
    ring's 2(p - 1) less p - 2, and the ring's bytes; across nodes it is priced as the ring."""
    model, one_node = CostModel(), Layout(p, (p,))
    for n in MODEL_SIZES:
        assert model.allreduce("ring", n, one_node) - model.allreduce("direct", n, one_node) == pytest.approx(
            (p - 2) * model.alpha_py, rel=1e-9, abs=1e-15), n
    nodes = Layout.blocks(2 * p, p)
    for n in MODEL_SIZES:
        assert model.allreduce("direct", n, nodes) == model.allreduce("ring", n, nodes), n


@pytest.mark.parametrize("library_name, upto", [("mpich", 4 << 10), ("openmpi", 16 << 10)])
def test_two_ranks_take_rhds_exchange_in_c_where_native_would_reduce_in_its_one_call(library_name, upto):
    """On two ranks rhd's small all-reduce is one exchange in one C call (rhd.express), which timed call by call
    took 0.7-0.9x native's time up to the library's ``exchange_upto`` (floats: 32 KiB, their min/max 16 KiB;
    openmpi.md, "Stop 59"; dtype_op.md, "Stop 63"): auto picks it there, on one node or two, for every (dtype, op)
    that native's one C call takes on the wire (float16/bfloat16 on their float32 work array: up to half those
    bytes; not a complex avg, nor float max across nodes, where native reduces keys), and not above it, nor on
    three ranks, nor where the model has no such call (the torch backend's groups: ``alpha_exchange`` None)."""
    f16, f32, c64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.complex64)
    for layout in (Layout(2, (2,)), Layout.blocks(2, 1)):
        selector = library_selector(library_name, layout)
        without = Selector(layout, selector.candidates, replace(selector.model, alpha_exchange=None))
        maxima = [(f32, "max")] if layout.num_nodes == 1 else []  # (across nodes native keeps MPI's, and keys)
        for dtype, op in [(f32, "sum"), *maxima, (f32, "avg"), (np.dtype(np.int8), "prod"), (c64, "sum"),
                          (f16, "sum"), (BFLOAT16, "avg")]:
            if wire_dtype(dtype).kind != "f":
                most = upto
            else:  # (a float sum's bound is on the float32 work array a 16-bit buffer widens to; min/max's not)
                most = 16 << 10 if op == "max" else (32 << 10) // (2 if dtype.itemsize == 2 else 1)
            assert [selector.predict("allreduce", n, dtype=dtype, op=op) for n in (8, most)] == ["rhd", "rhd"]
            assert selector.predict("allreduce", 2 * most, dtype=dtype, op=op) != "rhd", (dtype, op)
            assert without.predict("allreduce", 8, dtype=dtype, op=op) == "native", (dtype, op)
        for dtype, op in [(c64, "avg"), *([(f32, "max"), (f16, "max")] if layout.num_nodes > 1 else [])]:
            assert selector.predict("allreduce", 8, dtype=dtype, op=op) != "rhd", (dtype, op)
    assert library_selector(library_name, Layout(3, (3,))).predict("allreduce", 8, dtype=f32, op="sum") == "native"
    crowded = Layout(4, (4,), ranks_per_core=2.0)  # (a model without the call, on ranks sharing cores: its terms x r)
    assert replace(CostModel(), alpha_exchange=None).for_layout(crowded).alpha_exchange is None
    assert CostModel().for_layout(crowded).alpha_exchange == 2 * CostModel().alpha_exchange


@pytest.mark.parametrize("library_name", ["mpich", "openmpi"])
def test_with_ranks_sharing_cores_direct_leads_the_step_by_step_algorithms_from_4_mib(library_name):
    """p = 4 on 2 cores: a rank of the ring, rhd or the tree that waits for its partner's step holds a core the
    others need; direct's one exchange does not: rhd took a median 1.06-1.16x its time at 2-64 MiB, and direct was
    within 10 % of the best in 90 of 96 cells at 8-32 MiB (bench/results/dtype_op.md, "Stop 54"). The step-by-step
    algorithms' bytes cost ``stepwise_shared`` more there, and nowhere else."""
    selector = library_selector(library_name, Layout(4, (4,), ranks_per_core=2.0))
    for dtype in (np.float32, np.float64, np.int32, np.int8):
        for op in ("sum", "max", "prod"):
            for n in (4 << 20, 8 << 20, 16 << 20, 32 << 20):
                assert selector.predict("allreduce", n, dtype=np.dtype(dtype), op=op) == "direct", (dtype, op, n)
    model = CostModel()
    even = replace(model, stepwise_shared=1.0)
    for layout in (Layout(4, (4,), ranks_per_core=2.0), Layout(3, (3,), ranks_per_core=1.5)):
        crowded, flat = model.for_layout(layout), even.for_layout(layout)
        for algorithm in REGISTRY["allreduce"]:
            latency = flat.allreduce(algorithm, 0, layout)
            scale = model.stepwise_shared if algorithm in STEPWISE else 1.0
            assert crowded.allreduce(algorithm, 1 << 24, layout) - latency == pytest.approx(
                scale * (flat.allreduce(algorithm, 1 << 24, layout) - latency), rel=1e-12), algorithm
    for layout in (Layout(4, (4,)), Layout(4, (2, 2), ranks_per_core=2.0)):
        for algorithm in REGISTRY["allreduce"]:
            assert model.for_layout(layout).allreduce(algorithm, 1 << 24, layout) == \
                even.for_layout(layout).allreduce(algorithm, 1 << 24, layout), (layout, algorithm)


@pytest.mark.parametrize("library_name", ["mpich", "openmpi"])
def test_the_pipelined_ring_leads_on_one_node_where_a_chunk_leaves_the_cache(library_name):
    """At p = 2 with a core each, from 16 MiB (8 MiB chunks) the ring, rhd and direct reduce blocks that have left
    the cache and the pipelined ring, reducing each segment as it arrives, leads them (from 32 MiB in 38 of 44 cells
    on MPICH and Open MPI; at 16 MiB the model misses fewer cells with it in every set of runs recorded); at 4-8 MiB
    it stays priced behind the ring, and with ranks sharing cores nothing changes (bench/results/dtype_op.md, "Stop
    34" and "Stop 53"). Every other per-byte term is the textbook's."""
    selector = library_selector(library_name, Layout(2, (2,)))
    crowded = Selector(layout=Layout(4, (4,), ranks_per_core=2.0), candidates=selector.candidates,
                       model=selector.model)
    for dtype in (np.float32, np.float64, np.int32, np.int8):
        for op in ("sum", "max", "prod"):
            for n in (4 << 20, 8 << 20):
                assert selector.predict("allreduce", n, dtype=np.dtype(dtype), op=op) != "ring_pipelined", n
            for n in (16 << 20, 32 << 20, 64 << 20):
                assert selector.predict("allreduce", n, dtype=np.dtype(dtype), op=op) == "ring_pipelined", n
            assert crowded.predict("allreduce", 32 << 20, dtype=np.dtype(dtype), op=op) == \
                Selector(layout=crowded.layout, candidates=crowded.candidates,
                         model=replace(crowded.model, cold_byte=0.0)).predict("allreduce", 32 << 20,
                                                                              dtype=np.dtype(dtype), op=op)
    model, layout, n = CostModel(), Layout(2, (2,)), float(1 << 30)
    cold = model.cold_byte
    slope = (model.allreduce("ring", 2 * n, layout) - model.allreduce("ring", n, layout)) / n
    assert slope == pytest.approx(2 * 0.5 * model.beta + 0.5 * (model.gamma + cold), rel=1e-9)
    in_cache = model.cache_bytes * 2  # (chunks of exactly cache_bytes: no cold term)
    assert model.allreduce("rhd", in_cache, layout) == pytest.approx(
        replace(model, cold_byte=0.0).allreduce("rhd", in_cache, layout), rel=1e-12)
    assert model.allreduce("ring_pipelined", n, layout) == replace(model, cold_byte=0.0).allreduce(
        "ring_pipelined", n, layout)


def test_native_polled_is_priced_as_the_librarys_algorithm():
    """MPICH's all-reduce across nodes is node-aware (each node's link carries n at 2 x 2); Open MPI's in-place
    non-blocking one, which native polls there, is a binomial reduce and broadcast: mpcomm's tree, run in C. On one
    node both are priced alike, but where Open MPI's native, which makes the blocking call only with a core per
    rank, polls the binomial one: with ranks sharing cores (at p = 4 on 2 cores it took 0.9-1.1x mpcomm's tree
    from 1 MiB, 1.1-2x rhd; dtype_op.md, "Stop 36")."""
    from mpcomm.mpi_library import PROFILES

    model, n = replace(CostModel(), beta_net=1 / 125e6), 1 << 20  # (1 Gbit/s: what the link carries decides)
    binomial = replace(model, native_polled="binomial")
    nodes, node = Layout(4, (2, 2)), Layout(4, (4,))
    tree_in_c = model.tree(n, nodes, model.alpha_native)
    assert binomial.allreduce("native", n, nodes) == pytest.approx(tree_in_c, rel=1e-12)
    assert model.allreduce("native", n, nodes) < binomial.allreduce("native", n, nodes)
    assert binomial.allreduce("native", n, node) == model.allreduce("native", n, node)
    openmpi = CostModel.of_library(PROFILES["openmpi"])
    blocking_everywhere = CostModel.of_library(replace(PROFILES["openmpi"], blocking_on_shared_cores=True))
    assert (openmpi.native_polled, openmpi.native_polls_shared_cores) == ("binomial", True)
    assert blocking_everywhere.native_polls_shared_cores is False
    assert CostModel.of_library(PROFILES["mpich"]).native_polled == "node_aware"
    shared = Layout(4, (4,), ranks_per_core=2.0)
    for library in (openmpi, blocking_everywhere, CostModel.of_library(PROFILES["mpich"])):
        alone, crowded = library.for_layout(node), library.for_layout(shared)
        assert alone.allreduce("native", n, node) == alone._native_scaled(
            lambda m: alone.rhd(m, node, alone.alpha_native), n)
        polled = crowded.tree(n, shared, crowded.alpha_native) if library is openmpi else \
            crowded._native_scaled(lambda m: crowded.rhd(m, shared, crowded.alpha_native), n)
        assert crowded.allreduce("native", n, shared) == pytest.approx(polled, rel=1e-12)


def test_native_polled_from_a_copy_is_priced_as_rhd_near_halves_first():
    """Open MPI runs a non-blocking all-reduce from a separate input, on 4 ranks or more and of more than 64 KiB, as
    Rabenseifner's, exchanging the near halves first, and in place as the binomial tree (nbc_iallreduce.c): native
    polls it from a copy across nodes (Library.polled_from_copy; on one node, ranks sharing cores, the binomial in
    place was faster), priced as the copy and that rhd run in C. At 2 x 2 its halves inside the nodes come first,
    so each node's link carries n, half what mpcomm's rhd (the far halves first) puts on it."""
    from mpcomm.mpi_library import PROFILES

    openmpi = replace(CostModel.of_library(PROFILES["openmpi"]), beta_net=1 / 125e6)
    assert openmpi.native_polled_from_copy == PROFILES["openmpi"].polled_from_copy == (2, 4, 64 << 10)
    assert CostModel.of_library(PROFILES["mpich"]).native_polled_from_copy is None
    nodes, big, small = Layout(4, (2, 2)), 1 << 20, 64 << 10
    copied = big * openmpi.beta + openmpi.rhd(big, nodes, openmpi.alpha_native, near_first=True)
    assert openmpi.allreduce("native", big, nodes) == pytest.approx(copied, rel=1e-12)
    shared = Layout(4, (4,), ranks_per_core=2.0)
    for n, layout in ((small, nodes), (big, Layout(2, (1, 1))), (big, Layout(3, (2, 1))), (big, shared)):  # in place
        model = openmpi.for_layout(layout)
        assert model.allreduce("native", n, layout) == pytest.approx(model.tree(n, layout, model.alpha_native),
                                                                     rel=1e-12)
    wire_only = replace(openmpi, alpha_native=0.0, alpha_net=0.0, beta=0.0, gamma=0.0, cold_byte=0.0)
    near = wire_only.rhd(big, nodes, 0.0, near_first=True)
    assert near == pytest.approx(big * wire_only.beta_net, rel=1e-12)
    assert wire_only.rhd(big, nodes, 0.0) == pytest.approx(2 * near, rel=1e-12)
    four_nodes = Layout(4, (1, 1, 1, 1))  # (every exchange crosses: the order moves no byte)
    assert wire_only.rhd(big, four_nodes, 0.0, near_first=True) == pytest.approx(wire_only.rhd(big, four_nodes, 0.0))


def library_selector(library_name: str, layout: Layout) -> Selector:
    """The selector Selector.default builds on that MPI library for ``layout`` (its profile's model)."""
    from mpcomm.mpi_library import PROFILES

    candidates = {op: tuple(algs) for op, algs in REGISTRY.items()}
    return Selector(layout=layout, candidates=candidates, model=CostModel.of_library(PROFILES[library_name]))


@pytest.mark.parametrize("library_name, below, direct_from", [("mpich", "native", 64 << 10),
                                                                ("openmpi", "rhd", 32 << 10)])
def test_16_bit_all_reduces_go_to_direct_where_widening_them_costs_more(library_name, below, direct_from):
    """float16/bfloat16 at p = 2 on one node: native and rhd's exchange widen them to float32 and back (a work
    array's round trip, as calls timed one at a time cost it), direct keeps the 16 bits; direct from 32 KiB on Open
    MPI (rhd's exchange below, its float32 wire to 32 KiB) and 64 KiB on MPICH (native below) (bench/results/
    dtype_op.md, "Stop 53" and "Stop 61")."""
    selector = library_selector(library_name, Layout(2, (2,)))
    for dtype in (np.dtype(np.float16), BFLOAT16):
        for op in ("sum", "prod", "min", "max"):
            assert [selector.predict("allreduce", n, dtype=dtype, op=op) for n in (direct_from // 2, direct_from)] \
                == [below, "direct"], (dtype, op)


@pytest.mark.parametrize("nodes", [(2,), (4,), (2, 2)], ids=str)
def test_native_pays_fresh_pages_for_its_temporary_from_32_mib(nodes):
    """From glibc's largest mmap threshold the library's message-sized temporary is faulted in every call: native
    costs that much more there and nothing more below it, on one node or several."""
    layout, model = Layout(sum(nodes), nodes), CostModel()
    below, at = FRESH_PAGES_FROM - 4096, FRESH_PAGES_FROM
    free = replace(model, fresh_page_byte=0.0)
    assert model.allreduce("native", below, layout) == free.allreduce("native", below, layout)
    assert model.allreduce("native", at, layout) - free.allreduce("native", at, layout) == pytest.approx(
        at * model.fresh_page_byte, rel=1e-12)


def test_auto_on_one_open_mpi_node_keeps_native_below_16_mib_and_leaves_it_from_there():
    """Open MPI at p = 2 on one node: native's sums and maxima are the fastest at 2-8 MiB (its blocking all-reduce),
    from 16 MiB the pipelined ring leads (its segments reduced in cache; at 16 MiB all were within ~10 % and it
    misses fewer cells), and from 32 MiB native takes ~2x mpcomm's ring and rhd (its temporary's fresh pages);
    avg at 256-512 KiB is the ring's (its division rides on the last addition; native's takes a pass of its
    own), at 64 KiB still native's: bench/results/openmpi.md, "Stop 32", dtype_op.md, "Stop 34" and "Stop 53"."""
    selector = library_selector("openmpi", Layout(2, (2,)))
    for op in ("sum", "max"):
        for dtype in (np.float32, np.float64):
            assert [selector.predict("allreduce", n, dtype=np.dtype(dtype), op=op) for n in (2 << 20, 8 << 20)] \
                == ["native", "native"]
            for n in (16 << 20, 32 << 20):
                assert selector.predict("allreduce", n, dtype=np.dtype(dtype), op=op) == "ring_pipelined"
        assert selector.predict("allreduce", 512 << 10, dtype=np.dtype(np.float32), op="avg") in ("ring", "rhd")
    for dtype in (np.float32, np.float64):
        assert [selector.predict("allreduce", n, dtype=np.dtype(dtype), op="avg") for n in (64 << 10, 256 << 10)] \
            == ["native", "ring"]
    in_node, across = selector.model.for_layout(selector.layout), selector.model.for_layout(Layout(4, (2, 2)))
    assert (in_node.overlap, in_node.alpha_py) == (False, selector.model.alpha_py_in_node)
    crowded = selector.model.for_layout(Layout(4, (4,), ranks_per_core=2.0))  # (a step waits for the scheduler)
    assert crowded.alpha_py == 2 * CostModel().alpha_py
    assert (across.overlap, across.alpha_py) == (True, CostModel().alpha_py)  # (the nodes' figures are MPICH's)
    assert CostModel().for_layout(Layout(2, (2,))).alpha_py == CostModel().alpha_py


@pytest.mark.parametrize("library_name", ["mpich", "openmpi"])
def test_a_large_reduce_scatter_on_one_node_leaves_native(library_name):
    """At p = 2 on one node the library's reduce-scatter took 1.4-1.6x (MPICH) and 5-9x (Open MPI) mpcomm's ring
    from 2 MiB, and Open MPI's reduce 2.8-4.1x mpcomm's tree, where auto had chosen them at every size; a small one
    stays native, and across nodes the pricing is half an all-reduce's as before (bench/results/dtype_op.md, "Stop
    33: reduce-scatter")."""
    selector = library_selector(library_name, Layout(2, (2,)))
    model = selector.model
    f32 = np.dtype(np.float32)
    assert selector.predict("reduce_scatter", 8 << 10, dtype=f32, op="sum") == "native"
    for n in (2 << 20, 8 << 20, 64 << 20):
        assert selector.predict("reduce_scatter", n, dtype=f32, op="sum") not in ("native", "rhd"), n
    if library_name == "openmpi":  # (its non-blocking reduce too: 2.8-4.1x mpcomm's tree at 512 KiB-4 MiB)
        assert all(selector.predict("reduce", n, dtype=f32, op="sum") != "native" for n in (512 << 10, 4 << 20))
    across = Layout(4, (2, 2))
    assert model.collective("reduce_scatter", "native", 8 << 20, across) == model.half_allreduce("native", 8 << 20, across)


@pytest.mark.parametrize("layout", PRICED_LAYOUTS, ids=lambda lay: f"{lay.node_sizes}-rpc{lay.ranks_per_core:g}")
def test_avg_is_priced_where_its_division_runs(layout):
    """avg's division costs what the code does: nothing beside the ring's, pipelined ring's, rhd's and direct's
    last addition (one pass of the extension, or direct's 16-bit reduction); native's is one extension call and a
    write-back; the tree makes a numpy pass of its own, a numpy call whatever the size."""
    model = CostModel()
    for dtype in (np.dtype(np.float32), np.dtype(np.float64), BFLOAT16, np.dtype(np.float16)):
        for n in (8, 1 << 16, 1 << 24):
            def extra(algorithm):
                return (model.call("allreduce", algorithm, n, layout, dtype, "avg")
                        - model.call("allreduce", algorithm, n, layout, dtype, "sum"))
            for algorithm in ("ring", "ring_pipelined", "rhd", "direct"):
                assert extra(algorithm) == 0.0, (algorithm, dtype, n)
            wire = model.wire_bytes("native", n, dtype, "avg")
            assert extra("native") == pytest.approx(model.alpha_kernel + wire * model.pass_byte), (dtype, n)
            assert extra("tree") > model.alpha_pass, (dtype, n)

