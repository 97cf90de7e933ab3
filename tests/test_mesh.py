"""Rank layout (pure), ParallelConfig, and ParallelMesh (pure with a fake communicator; MPI with pytest-mpi).

MPI part:  mpiexec -n 4 python -m pytest -q --with-mpi tests/test_mesh.py
"""
import itertools

import pytest

from mpcomm.errors import ConfigError
from mpcomm.mesh import ParallelConfig, ParallelMesh, coords_of, format_groups, rank_groups, rank_of

ORDERS = ["-".join(p) for p in itertools.permutations(("dp", "tp", "pp"))]


def sizes(dp, tp, pp):
    return {"dp": dp, "tp": tp, "pp": pp}


def factorizations(n):
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) for tp in range(1, n + 1)
            if n % (dp * tp) == 0]


# ------------------------------------------------------------------------------------------ pure layout

def test_default_order_world_16_megatron_figure():
    # Megatron's example: 16 ranks, tp=2, pp=4, dp=2 with tp fastest
    g = rank_groups(16, sizes(2, 2, 4))  # default "tp-dp-pp"
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_world_4_groups_several_orders():
    assert rank_groups(4, sizes(2, 2, 1), "tp-dp-pp") == {
        "dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]]}
    assert rank_groups(4, sizes(2, 2, 1), "dp-tp-pp") == {
        "dp": [[0, 1], [2, 3]], "tp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]]}
    assert rank_groups(4, sizes(1, 2, 2), "pp-tp-dp") == {
        "dp": [[0], [1], [2], [3]], "tp": [[0, 2], [1, 3]], "pp": [[0, 1], [2, 3]]}
    assert rank_groups(4, sizes(4, 1, 1), "tp-dp-pp")["dp"] == [[0, 1, 2, 3]]
    assert rank_groups(4, sizes(1, 1, 4), "pp-dp-tp")["pp"] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("world", [1, 4, 8, 12, 16])
@pytest.mark.parametrize("order", ORDERS)
def test_groups_partition_the_world(world, order):
    for dp, tp, pp in factorizations(world):
        sz = sizes(dp, tp, pp)
        g = rank_groups(world, sz, order)
        for d in ("dp", "tp", "pp"):
            assert len(g[d]) == world // sz[d]
            assert sorted(r for grp in g[d] for r in grp) == list(range(world))
            for grp in g[d]:
                cs = [coords_of(r, sz, order) for r in grp]
                assert [c[d] for c in cs] == list(range(sz[d]))  # sorted by this dimension's coordinate
                others = {tuple(c[o] for o in ("dp", "tp", "pp") if o != d) for c in cs}
                assert len(others) == 1  # all other coordinates shared


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (3, 2, 4), (1, 4, 2), (2, 3, 1)])
def test_pp_tp_dp_reproduces_reference_layout(dp, tp, pp):
    sz = sizes(dp, tp, pp)
    for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
        g = d * (tp * pp) + t * pp + p
        assert rank_of({"dp": d, "tp": t, "pp": p}, sz, "pp-tp-dp") == g
        assert coords_of(g, sz, "pp-tp-dp") == {"dp": d, "tp": t, "pp": p}


@pytest.mark.parametrize("order", ORDERS)
def test_rank_of_coords_of_round_trip(order):
    sz = sizes(2, 3, 4)
    assert [rank_of(coords_of(r, sz, order), sz, order) for r in range(24)] == list(range(24))
    # leftmost varies fastest
    first = order.split("-")[0]
    assert coords_of(1, sz, order)[first] == 1


def test_layout_errors_name_the_constraint():
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world_size .* 2\*2\*2 = 8 != 6"):
        rank_groups(6, sizes(2, 2, 2), "dp-tp-pp")
    with pytest.raises(ConfigError, match="permutation"):
        rank_groups(8, sizes(2, 2, 2), "tp-dp")
    with pytest.raises(ConfigError, match="permutation"):
        rank_groups(8, sizes(2, 2, 2), "tp-tp-pp")
    with pytest.raises(ConfigError, match="permutation"):
        rank_groups(8, sizes(2, 2, 2), "tp-cp-pp")
    with pytest.raises(ConfigError, match="positive"):
        rank_groups(0, sizes(0, 2, 2))
    with pytest.raises(ValueError, match="out of range"):
        coords_of(8, sizes(2, 2, 2))
    with pytest.raises(ValueError, match="out of range"):
        rank_of({"dp": 2, "tp": 0, "pp": 0}, sizes(2, 2, 2))


def test_format_groups():
    text = format_groups(8, sizes(2, 2, 2), "tp-dp-pp")
    assert "tp groups (4): [0, 1] [2, 3] [4, 5] [6, 7]" in text
    assert "pp groups (4): [0, 4] [1, 5] [2, 6] [3, 7]" in text


# -------------------------------------------------------------------------------------- ParallelConfig

def test_config_valid_and_derived():
    cfg = ParallelConfig(dp=2, tp=2, pp=2, num_layers=8, micro_batch_size=4, num_micro_batches=8,
                         schedule="1f1b")
    assert cfg.validate(8) is cfg
    assert cfg.layers_per_stage() == 4 and cfg.world_size == 8 and cfg.global_batch_size == 64
    cfg = ParallelConfig(pp=4, num_layers=16, num_micro_batches=8, schedule="interleaved-1f1b", virtual_stages=2)
    cfg.validate(4)
    assert cfg.layers_per_chunk() == 2 and len(cfg.pipeline_schedule()) == 4


@pytest.mark.parametrize("kwargs,world,pattern", [
    (dict(dp=0), None, r"dp must be a positive integer"),
    (dict(micro_batch_size=0), None, r"micro_batch_size must be a positive integer"),
    (dict(dp=2, tp=2, pp=2, num_layers=8), 4, r"dp\*tp\*pp == world_size .* 2\*2\*2 = 8 != 4"),
    (dict(pp=3, num_layers=8), 3, r"num_layers % pp == 0 .* 8 % 3 = 2"),
    (dict(schedule="zigzag"), None, r"unknown schedule 'zigzag'"),
    (dict(pp=2, num_layers=6, num_micro_batches=4, schedule="interleaved-1f1b", virtual_stages=2), 2,
     r"num_layers % \(pp\*virtual_stages\) == 0"),
    (dict(pp=4, num_layers=16, num_micro_batches=2, schedule="interleaved-1f1b", virtual_stages=2), 4,
     r"num_micro_batches >= pp and num_micro_batches % pp == 0"),
    (dict(pp=4, num_layers=16, num_micro_batches=6, schedule="interleaved-1f1b", virtual_stages=2), 4,
     r"num_micro_batches % pp == 0"),
    (dict(virtual_stages=2, num_layers=2), None, r"requires schedule 'interleaved-1f1b'"),
    (dict(memory_strategy="magic"), None, r"unknown memory_strategy"),
    (dict(mixed_precision="fp8"), None, r"mixed_precision"),
    (dict(comm_timeout=0), None, r"comm_timeout must be > 0"),
    (dict(hidden_size=1024, num_layers=4, max_memory_per_device=2**20), None,
     r"memory_estimate total .* exceeds max_memory_per_device"),
])
def test_config_errors_name_the_constraint(kwargs, world, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ParallelConfig(**kwargs).validate(world)
    with pytest.raises(ValueError):
        ParallelConfig(**kwargs).validate(world)


def test_memory_limit_met_passes():
    ParallelConfig(hidden_size=64, num_layers=2, max_memory_per_device=2**30).validate(1)


def _cfg(**kw):
    base = dict(dp=8, tp=2, pp=2, num_layers=24, micro_batch_size=2, num_micro_batches=8,
                mixed_precision="bf16", hidden_size=2048, seq_len=1024, vocab_size=32000)
    base.update(kw)
    return ParallelConfig(**base)


def test_memory_estimate_parts_sum_to_total():
    est = _cfg().memory_estimate()
    assert set(est) == {"params", "grads", "optimizer_state", "activations", "communication_buffers", "total"}
    assert est["total"] == sum(v for k, v in est.items() if k != "total")
    assert all(v >= 0 for v in est.values())
    # mixed precision: 2 + 2 + 12 bytes per parameter (ZeRO paper K=12)
    assert est["optimizer_state"] == pytest.approx(6 * est["params"], rel=1e-6)
    fp32 = _cfg(mixed_precision=None).memory_estimate()
    assert fp32["optimizer_state"] == pytest.approx(2 * fp32["params"], rel=1e-6)


def test_memory_estimate_zero_strategies_shrink_with_dp():
    none = _cfg().memory_estimate()
    z1, z2, z3 = (_cfg(memory_strategy=s).memory_estimate() for s in ("zero1", "zero2", "zero3"))
    assert z1["optimizer_state"] == pytest.approx(none["optimizer_state"] / 8, rel=1e-6)
    assert z1["grads"] == none["grads"] and z2["grads"] == pytest.approx(none["grads"] / 8, rel=1e-6)
    assert z3["params"] == pytest.approx(none["params"] / 8, rel=1e-6)
    assert none["total"] > z1["total"] > z2["total"] > z3["total"]
    totals = [_cfg(dp=d, memory_strategy="zero3").memory_estimate()["total"] for d in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


def test_memory_estimate_activations_follow_schedule_and_checkpointing():
    g = _cfg(schedule="gpipe").memory_estimate()["activations"]
    f = _cfg(schedule="1f1b").memory_estimate()["activations"]
    assert g == pytest.approx(f * 8 / 2, rel=1e-6)  # m=8 alive for GPipe vs pp=2 for 1F1B
    ck = _cfg(gradient_checkpointing=True).memory_estimate()["activations"]
    assert ck < f / 5
    assert _cfg(memory_strategy="activation_checkpointing").memory_estimate()["activations"] == ck
    # more tensor parallelism, fewer bytes per rank
    assert _cfg(tp=4, dp=4).memory_estimate()["params"] < _cfg().memory_estimate()["params"]


def test_memory_estimate_needs_hidden():
    with pytest.raises(ConfigError, match="hidden"):
        ParallelConfig().memory_estimate()


# ------------------------------------------------------------------------------ ParallelMesh, no MPI

class FakeComm:
    """Stands in for one rank of a Communicator; records every split call."""

    def __init__(self, rank, size, log=None):
        self.rank, self.size = rank, size
        self.log = [] if log is None else log

    def split(self, color, key=0):
        self.log.append((color, key))
        return FakeComm(key, None)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 4), (4, 2, 2), (1, 16, 1), (16, 1, 1), (1, 1, 16), (2, 4, 2)])
def test_mesh_splits_like_rank_groups_world_16(order, dp, tp, pp):
    world = 16
    groups = rank_groups(world, sizes(dp, tp, pp), order)
    members = {}
    for r in range(world):
        c = FakeComm(r, world)
        m = ParallelMesh(c, dp=dp, tp=tp, pp=pp, order=order)
        assert len(c.log) == 3  # same number of collective splits on every rank, dp/tp/pp order
        for dim, (color, key) in zip(("dp", "tp", "pp"), c.log):
            members.setdefault((dim, color), {})[key] = r
        assert m.coords == coords_of(r, sizes(dp, tp, pp), order)
        assert m.rank_of(**m.coords) == r
        assert m.pp.rank == m.coords["pp"] and m.dp.rank == m.coords["dp"] and m.tp.rank == m.coords["tp"]
        k = m.coords["pp"]
        assert m.is_first_stage == (k == 0) and m.is_last_stage == (k == pp - 1)
        assert m.prev_pp_rank == (None if k == 0 else m.rank_of(pp=k - 1))
        assert m.next_pp_rank == (None if k == pp - 1 else m.rank_of(pp=k + 1))
        assert m.is_dp_head == (m.coords["dp"] == 0)
        assert m.group_ranks("pp")[k] == r
        assert "ParallelMesh(" in repr(m)
    for dim in ("dp", "tp", "pp"):
        got = [[members[(dim, g)][i] for i in sorted(members[(dim, g)])] for g in range(len(groups[dim]))]
        assert got == groups[dim]


def test_two_meshes_coexist():
    a = ParallelMesh(FakeComm(3, 4), dp=2, tp=2)
    b = ParallelMesh(FakeComm(3, 4), pp=4, order="pp-tp-dp")
    assert a.coords == {"dp": 1, "tp": 1, "pp": 0} and b.coords == {"dp": 0, "tp": 0, "pp": 3}
    assert b.next_pp_rank is None and b.prev_pp_rank == 2 and a.next_pp_rank is None


def test_mesh_size_mismatch():
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world size .* != communicator size 4"):
        ParallelMesh(FakeComm(0, 4), dp=2, tp=2, pp=2)
    with pytest.raises(ConfigError, match="permutation"):
        ParallelMesh(FakeComm(0, 4), dp=4, order="dp-tp")


# ------------------------------------------------------------------------------- ParallelMesh over MPI

class MiniComm:
    """The smallest duck-typed Communicator (rank, size, mpi, split) so the mesh is testable on its own."""

    def __init__(self, mpi):
        self.mpi, self.rank, self.size = mpi, mpi.Get_rank(), mpi.Get_size()

    def split(self, color, key=0):
        return MiniComm(self.mpi.Split(color, key))


def _make_comm(kind):
    from mpi4py import MPI
    if kind == "mini":
        return MiniComm(MPI.COMM_WORLD)
    try:
        from mpcomm import Communicator
    except Exception as exc:  # the Communicator is written concurrently
        pytest.skip(f"mpcomm.Communicator not importable yet: {exc!r}")
    return Communicator(MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["communicator", "mini"])
@pytest.mark.parametrize("order", ORDERS)
def test_mesh_subcommunicators_match_rank_groups(kind, order):
    comm = _make_comm(kind)
    world = comm.size
    for dp, tp, pp in factorizations(world):  # world 4: (4,1,1) (1,4,1) (1,1,4) (2,2,1) (2,1,2) (1,2,2) ...
        mesh = ParallelMesh(comm, dp=dp, tp=tp, pp=pp, order=order)
        groups = rank_groups(world, sizes(dp, tp, pp), order)
        for dim in ("dp", "tp", "pp"):
            sub = getattr(mesh, dim)
            members = sub.mpi.allgather(comm.rank)
            assert members in groups[dim], (dim, dp, tp, pp, order, members)
            assert members == mesh.group_ranks(dim)
            assert sub.rank == mesh.coords[dim] and sub.size == mesh.sizes[dim]
        k = mesh.coords["pp"]
        grp = mesh.group_ranks("pp")
        assert mesh.prev_pp_rank == (grp[k - 1] if k > 0 else None)
        assert mesh.next_pp_rank == (grp[k + 1] if k < pp - 1 else None)
        # the pp neighbours agree: what I call next calls me prev
        nxt = mesh.pp.mpi.sendrecv(comm.rank, dest=(k + 1) % pp, source=(k - 1) % pp)
        if k > 0:
            assert nxt == mesh.prev_pp_rank
        assert comm.mpi.allreduce(1) == world
        mesh.free()
