"""3D (dp x tp x pp) training against one process on the full batch, for every layout that fits the world.

Serial:  python -m pytest -q tests/test_threed.py
MPI:     timeout 600 mpiexec -n 4 python -m pytest -q --with-mpi -m mpi tests/test_threed.py   (any size 1..4)
World 4: pp=4, dp2xpp2, tp2xpp2, tp=4, dp2xtp2, dp=4; world 3: pp=3, tp=3, dp=3; world 2: pp=2, tp=2, dp=2.
"""
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import assert_matches_single_process

from mpcomm.errors import ConfigError
from mpcomm.parallel.schedules import bubble_fraction_theory
from mpcomm.parallel.threed import ThreeDParallel, reference_train, train_model_parallel
from mpcomm.workload import Workload, param_checksum

RTOL = 1e-10
STEPS = 2
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]


def layouts(n):
    """Every (dp, tp, pp) with dp*tp*pp == n."""
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) for tp in range(1, n + 1) if n % (dp * tp) == 0]


def workload_for(dp, pp, v):
    """Sizes divisible by 3 and 4 (d_hidden=24) and by pp*v; m = 2*pp micro-batches of 2 rows per replica."""
    return Workload(num_layers=2 * pp * v, d_model=12, d_hidden=24, global_batch=dp * 2 * pp * 2, seed=1)


def same_on_all_ranks(comm, values):
    a = np.asarray(values, dtype=np.float64)
    everyone = np.empty((comm.size,) + a.shape)
    comm.all_gather(a, everyone)
    return all(np.array_equal(everyone[0], e) for e in everyone)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_every_layout_matches_single_process(schedule, v, world_comm):
    comm = world_comm
    for dp, tp, pp in layouts(comm.size):
        wl = workload_for(dp, pp, v)
        engine = ThreeDParallel(comm, wl, dp=dp, tp=tp, pp=pp, num_micro_batches=2 * pp, schedule=schedule,
                                virtual_stages=v)
        losses = [engine.train_step(step) for step in range(STEPS)]
        assert same_on_all_ranks(comm, losses), (dp, tp, pp)
        assert_matches_single_process(engine, losses, wl)


@pytest.mark.mpi
def test_recompute_and_adam_every_layout(world_comm):
    comm = world_comm
    for dp, tp, pp in layouts(comm.size):
        wl = workload_for(dp, pp, 1)
        runs = []
        for recompute in (False, True):
            engine = ThreeDParallel(comm, wl, dp=dp, tp=tp, pp=pp, num_micro_batches=2 * pp, schedule="1f1b",
                                    recompute=recompute, optimizer="adam", lr=0.01)
            runs.append(([engine.train_step(s) for s in range(STEPS)], engine))
        (a, ea), (b, eb) = runs
        assert a == b, (dp, tp, pp)  # recomputation is bitwise identical
        for p, q in zip(ea.params, eb.params):
            assert np.array_equal(p.data, q.data)
        assert_matches_single_process(eb, b, wl, "adam", 0.01)


@pytest.mark.mpi
def test_train_model_parallel_entry_point(capsys, world_comm):
    comm = world_comm
    dp, tp, pp = layouts(comm.size)[len(layouts(comm.size)) // 2]
    wl = workload_for(dp, pp, 1)
    args = SimpleNamespace(engine="3d", dp=dp, tp=tp, pp=pp, steps=3, seed=1, schedule="1f1b", micro_batches=None,
                           virtual_stages=None, layers=wl.num_layers, d_model=12, d_hidden=24,
                           global_batch=wl.global_batch, optimizer="sgd", lr=0.1, dtype="float64", recompute=False)
    out = train_model_parallel(comm, args, wl)
    assert set(out) >= {"losses", "param_checksum", "timing"}
    assert set(out["timing"]) == {"compute", "communication", "bubble", "total"}
    assert all(v >= 0 for k, v in out["timing"].items() if k != "bubble")
    assert abs(sum(out["timing"][k] for k in ("compute", "communication", "bubble")) - out["timing"]["total"]) < 1e-9
    assert same_on_all_ranks(comm, out["losses"] + [out["param_checksum"]])
    ref_losses, ref = reference_train(wl, 3)
    np.testing.assert_allclose(out["losses"], ref_losses, rtol=RTOL)
    np.testing.assert_allclose(out["param_checksum"], param_checksum(ref.state_dict().items()), rtol=RTOL)
    printed = capsys.readouterr().out
    if comm.rank == 0:
        assert "step    2  loss" in printed and "where the time went" in printed
        m = out["layout"]["micro_batches"]
        assert f"{bubble_fraction_theory(pp, m, 1):.3f}" in printed


@pytest.mark.mpi(min_size=2)
def test_the_first_steps_handshake_is_not_taken_out_of_the_compute_time(world_comm, monkeypatch):
    """The first step's shapes handshake runs the model on empty batches, so tensor-parallel collectives, outside
    any compute action: their time must not be subtracted from the compute time (it went negative under load)."""
    comm = world_comm
    engine = ThreeDParallel(comm, workload_for(1, 1, 1), dp=1, tp=comm.size, pp=1)
    allreduce = engine.mesh.tp.allreduce

    def slow_when_empty(buf, *args, **kwargs):
        if buf.size == 0:
            time.sleep(0.2)  # the stimulus: this rank loses its core during the handshake's empty all-reduce
        return allreduce(buf, *args, **kwargs)

    monkeypatch.setattr(engine.mesh.tp, "allreduce", slow_when_empty)
    engine.train_step(0)
    assert all(engine.timing[k] >= 0 for k in ("compute", "communication", "total")), engine.timing


@pytest.mark.mpi
def test_mesh_not_matching_world_and_other_bad_input(world_comm):
    comm = world_comm
    wl = workload_for(1, 1, 1)
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world size"):
        ThreeDParallel(comm, wl, dp=comm.size + 1)
    if comm.size == 1:
        return
    with pytest.raises(ConfigError, match=r"d_hidden % tp == 0"):
        ThreeDParallel(comm, Workload(num_layers=4, d_model=12, d_hidden=25, global_batch=8), tp=comm.size)
    with pytest.raises(ConfigError, match=r"num_layers % \(pp\*virtual_stages\) == 0"):
        ThreeDParallel(comm, Workload(num_layers=2 * comm.size + 1, global_batch=4 * comm.size), pp=comm.size)
    with pytest.raises(ConfigError, match="num_micro_batches >= pp"):
        ThreeDParallel(comm, Workload(num_layers=2 * comm.size, global_batch=4 * comm.size), pp=comm.size,
                       num_micro_batches=1, schedule="interleaved-1f1b", virtual_stages=2)
    with pytest.raises(ConfigError, match=r"global_batch % dp == 0"):
        ThreeDParallel(comm, Workload(num_layers=4, global_batch=2 * comm.size + 1), dp=comm.size)


def test_bad_layout_serial():
    from mpi4py import MPI

    from mpcomm import Communicator
    one = Communicator(MPI.COMM_SELF)
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world size"):
        ThreeDParallel(one, Workload(), dp=2, tp=2, pp=2)
    with pytest.raises(ConfigError, match="micro_batches == 0"):
        ThreeDParallel(one, Workload(global_batch=10), num_micro_batches=4)
