"""PipelineParallel against one process training on the full batch.

Serial:  python -m pytest -q tests/test_pipeline.py
MPI:     timeout 600 mpiexec -n 4 python -m pytest -q --with-mpi -m mpi tests/test_pipeline.py   (any size 1..4)
The MPI tests use pp = world size.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_matches_single_process, mpiexec_path, serial_only

from mpcomm.errors import ConfigError
from mpcomm.nn import make_optimizer, mlp, mse_loss
from mpcomm.parallel.pipeline import PipelineParallel, partition_layers
from mpcomm.workload import Workload

RTOL = 1e-10
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]


def self_comm():
    from mpi4py import MPI

    from mpcomm import Communicator
    return Communicator(MPI.COMM_SELF)


def workload_for(pp, v, dp=1, mb_rows=2):
    m = 2 * pp
    return Workload(num_layers=2 * pp * v, d_model=12, d_hidden=24, global_batch=dp * m * mb_rows, seed=3), m


def train_pipeline(pipe, wl, steps, optimizer="sgd", lr=0.1):
    opt = make_optimizer(optimizer, pipe.parameters(), lr)
    losses = []
    for step in range(steps):
        x, y = wl.batch(step)
        losses.append(pipe.train_step(x, y))
        opt.step()
        opt.zero_grad()
    return losses


# ------------------------------------------------------------------------------------------ pure / serial

def test_partition_layers_by_count_params_and_explicit():
    model = mlp([4, 8, 8, 8, 4], activation="gelu")  # 7 children: L, a, L, a, L, a, L
    with pytest.raises(ConfigError, match=r"num_layers % \(pp\*virtual_stages\) == 0"):
        partition_layers(model, 2, "layers")
    assert partition_layers(mlp([4] * 5, activation=None), 2, "layers") == [(0, 2), (2, 4)]
    b = partition_layers(model, 3, "params")
    assert b[0][0] == 0 and b[-1][1] == 7 and all(a < c for a, c in b)
    weights = [m.num_parameters() for m in model]
    worst = max(sum(weights[a:c]) for a, c in b)
    import itertools
    best = min(max(sum(weights[a:c]) for a, c in zip((0,) + cuts, cuts + (7,)))
               for cuts in itertools.combinations(range(1, 7), 2))
    assert worst == best == 108  # linears of 40, 72, 72, 36 params: [40 | 72 | 72+36] is optimal
    assert partition_layers(model, 2, [3, 4]) == [(0, 3), (3, 7)]
    with pytest.raises(ConfigError, match="positive layer counts summing to num_layers"):
        partition_layers(model, 2, [3, 3])
    with pytest.raises(ConfigError, match="num_layers >= pp"):
        partition_layers(model, 8, "params")


def test_bad_configurations_raise_config_error_naming_the_constraint():
    wl = Workload(num_layers=4, d_model=12, d_hidden=24, global_batch=8)
    one = self_comm()
    with pytest.raises(ConfigError, match=r"num_layers % \(pp\*virtual_stages\) == 0"):
        PipelineParallel(wl.model(), one, 4, schedule="interleaved-1f1b", virtual_stages=3)
    with pytest.raises(ConfigError, match="requires schedule 'interleaved-1f1b'"):
        PipelineParallel(wl.model(), one, 4, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ConfigError, match="unknown pipeline schedule"):
        PipelineParallel(wl.model(), one, 4, schedule="zigzag")
    with pytest.raises(ConfigError, match="num_micro_batches must be a positive integer"):
        PipelineParallel(wl.model(), one, 0)
    for bad in (-1e-3, "fast", True, None, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="spin_after_send must be 'auto' or a number of seconds >= 0"):
            PipelineParallel(wl.model(), one, 4, spin_after_send=bad)
    pipe = PipelineParallel(wl.model(), one, 3)
    x, y = wl.batch(0)
    with pytest.raises(ConfigError, match="batch size % num_micro_batches == 0"):
        pipe.train_step(x, y)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_single_rank_micro_batches_and_local_virtual_stages_match_reference(schedule, v):
    wl, m = workload_for(1, v)
    pipe = PipelineParallel(wl.model(), self_comm(), m, schedule=schedule, virtual_stages=v)
    losses = train_pipeline(pipe, wl, 2)
    assert_matches_single_process(pipe, losses, wl)
    assert pipe.spin_after_send == 0.0  # one rank: no hand-offs, nothing measured


# ------------------------------------------------------------------------------------------ MPI

@pytest.mark.mpi
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "mpi"])
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_pipeline_matches_single_process(schedule, v, shared_memory, world_comm):
    """Hand-offs through the node's shared memory (the default on one host) or as MPI messages alike."""
    comm = world_comm
    pp = comm.size
    wl, m = workload_for(pp, v)
    pipe = PipelineParallel(wl.model(), comm, m, schedule=schedule, virtual_stages=v, shared_memory=shared_memory)
    assert pipe.stages == [c * pp + comm.rank for c in range(v)]
    losses = train_pipeline(pipe, wl, 3)
    assert_matches_single_process(pipe, losses, wl)
    if pp > 1:  # every rank is on this host: all hand-offs take the path asked for
        assert bool(pipe._shared.outgoing and pipe._shared.incoming) == shared_memory == pipe._shared.all_shared
    t = pipe.timing
    assert t["steps"] == 3 and t["total"] >= t["compute"] >= 0 and t["comm_wait"] >= 0
    assert abs(t["bubble"] - (t["total"] - t["compute"])) < 1e-9


@pytest.mark.mpi
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_recompute_gives_identical_results(schedule, v, world_comm):
    comm = world_comm
    wl, m = workload_for(comm.size, v)
    plain = PipelineParallel(wl.model(), comm, m, schedule=schedule, virtual_stages=v)
    redo = PipelineParallel(wl.model(), comm, m, schedule=schedule, virtual_stages=v, recompute=True)
    a, b = train_pipeline(plain, wl, 2, "adam", 0.01), train_pipeline(redo, wl, 2, "adam", 0.01)
    assert a == b
    for (n, p), (n2, q) in zip(plain.named_parameters(), redo.named_parameters()):
        assert n == n2 and np.array_equal(p.data, q.data)


@pytest.mark.mpi
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "mpi"])
def test_adam_and_small_receive_window_match_reference(shared_memory, world_comm):
    comm = world_comm
    wl, m = workload_for(comm.size, 1)
    pipe = PipelineParallel(wl.model(), comm, m, schedule="1f1b", max_posted_recvs=1, shared_memory=shared_memory)
    losses = train_pipeline(pipe, wl, 3, "adam", 0.01)
    assert_matches_single_process(pipe, losses, wl, "adam", 0.01)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_testing_each_send_after_it_changes_nothing_but_time(schedule, v, world_comm):
    """spin_after_send (test each send for a while after it, for MPI libraries that move a message only while its
    sender calls them) trains exactly as not testing does, and as the setting measured at the first step ('auto'),
    which every rank agrees on. (MPI's hand-offs: through shared memory nothing is tested.)"""
    comm = world_comm
    wl, m = workload_for(comm.size, v)
    runs = {}
    for setting in (0, 1e-3, "auto"):
        pipe = PipelineParallel(wl.model(), comm, m, schedule=schedule, virtual_stages=v, spin_after_send=setting,
                                shared_memory=False)
        runs[setting] = (train_pipeline(pipe, wl, 2), pipe)
    assert runs[0][0] == runs[1e-3][0] == runs["auto"][0]
    for (n, p), (_, q) in zip(runs[0][1].named_parameters(), runs["auto"][1].named_parameters()):
        assert np.array_equal(p.data, q.data), n
    losses, pipe = runs["auto"]
    assert pipe.spin_after_send >= 0 and comm.mpi.allgather(pipe.spin_after_send) == [pipe.spin_after_send] * comm.size
    assert_matches_single_process(pipe, losses, wl)


_STALLING_HANDOFF = """
import json
import numpy as np
from mpcomm import Communicator
from mpcomm.nn import mlp
from mpcomm.parallel.pipeline import PipelineParallel
comm = Communicator()
pipes = [PipelineParallel(mlp([256, 256, 256], activation=None, seed=0), comm, 2, shared_memory=shared)
         for shared in (False, True)]
x = np.ones((2 * 64, 256))  # 64 x 256 float64 per micro-batch: 128 KiB hand-offs
results = comm.mpi.gather([(pipe.train_step(x, x), pipe.spin_after_send) for pipe in pipes])
if comm.rank == 0:
    print(json.dumps(results))
"""


@serial_only
def test_a_library_that_moves_hand_offs_only_with_the_senders_calls_is_measured_as_such():
    """MPICH without CMA (as where yama's ptrace_scope is not 0) moves a 128 KiB message only while its sender
    calls MPI; the first step finds that, and every rank then tests each send for 2-10 ms after it. Through the
    node's shared memory no MPI message carries data, and nothing is measured (0)."""
    from mpi4py import MPI

    if not MPI.Get_library_version().startswith("MPICH"):
        pytest.skip("MPIR_CVAR_CH4_CMA_ENABLE is MPICH's")
    env = dict(os.environ, MPIR_CVAR_CH4_CMA_ENABLE="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-c", _STALLING_HANDOFF], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ranks = json.loads(proc.stdout.splitlines()[-1])  # per rank: [(loss, spin_after_send) by MPI, by shared memory]
    (loss, spin), (shared_loss, shared_spin) = ranks[0]
    assert ranks[1] == ranks[0] and 2e-3 <= spin <= 10e-3 and shared_spin == 0 and shared_loss == loss, proc.stdout


@pytest.mark.mpi
def test_shape_changing_stages_balanced_by_params(world_comm):
    """Stages whose activations change width (shapes inferred by the handshake), split by parameter count."""
    comm = world_comm
    pp = comm.size
    sizes = [6, 9, 15, 7, 12, 8, 5, 10, 6][: 2 * pp + 1]
    model_fn = lambda: mlp(sizes, activation="gelu", seed=4)  # noqa: E731
    m = 2 * pp
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2 * m, sizes[0])), rng.standard_normal((2 * m, sizes[-1]))
    pipe = PipelineParallel(model_fn(), comm, m, schedule="1f1b", balance="params")
    opt = make_optimizer("sgd", pipe.parameters(), 0.05)
    ref = model_fn()
    ref_opt = make_optimizer("sgd", ref.parameters(), 0.05)
    for _ in range(2):
        loss = pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
        out, ctx = ref.forward(x)
        ref_loss, g = mse_loss(out, y)
        ref.backward(g, ctx)
        ref_opt.step()
        ref_opt.zero_grad()
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    full = pipe.full_state_dict()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(full[n], p.data, rtol=RTOL, atol=1e-14)


@pytest.mark.mpi(min_size=2)
def test_interleaved_with_fewer_micro_batches_than_stages_is_rejected(world_comm):
    comm = world_comm
    wl = Workload(num_layers=4 * comm.size, d_model=12, d_hidden=24, global_batch=8)
    with pytest.raises(ConfigError, match="num_micro_batches >= pp"):
        PipelineParallel(wl.model(), comm, comm.size - 1, schedule="interleaved-1f1b", virtual_stages=2)
    with pytest.raises(ConfigError, match=r"num_layers % \(pp\*virtual_stages\) == 0"):
        PipelineParallel(Workload(num_layers=2 * comm.size + 1).model(), comm, comm.size)


# ------------------------------------------------------------------------------------------ failures of a hand-off
def step_with_sgd(pipe, opt, x, y):
    loss = pipe.train_step(x, y)
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.mpi(min_size=2)
def test_a_changed_micro_batch_shape_is_an_error_on_every_rank_and_the_next_step_is_right():
    """Stage 0 refuses a new micro-batch shape; the stages waiting for its activations time out (no hang), and the
    receives they left posted are cancelled, so the step run again afterwards gets its own messages: the training
    still equals one process on the full batch."""
    from mpcomm import Communicator, CommTimeoutError

    comm = Communicator(timeout=1.0)
    wl, m = workload_for(comm.size, 1)
    pipe = PipelineParallel(wl.model(), comm, m, schedule="1f1b")
    opt = make_optimizer("sgd", pipe.parameters(), 0.1)
    losses = [step_with_sgd(pipe, opt, *wl.batch(0))]
    x, y = wl.batch(1)
    expected = ConfigError if comm.rank == 0 else CommTimeoutError
    with pytest.raises(expected, match="micro-batch shape changed" if comm.rank == 0 else "pipeline: receive of"):
        pipe.train_step(x[:m] if comm.rank == 0 else x, y)
    comm.mpi.Barrier()  # every rank is past its error before anyone sends again (rank 0 waits for the timeouts)
    losses.append(step_with_sgd(pipe, opt, x, y))
    assert_matches_single_process(pipe, losses, wl)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("extra_rows", [1, -1])
def test_a_receive_of_another_size_raises_on_the_receiver(extra_rows):
    """A hand-off whose size differs from what the receiver expects (here: the last stage's expectation altered)
    raises there — a short message by its byte count, a long one by MPI's truncation — never a partly filled
    buffer; every other rank gets an error too, within the timeout."""
    from mpcomm import Communicator, MpcommError

    comm = Communicator(timeout=1.0)
    wl, m = workload_for(comm.size, 1)
    pipe = PipelineParallel(wl.model(), comm, m, schedule="1f1b", shared_memory=False)
    pipe.train_step(*wl.batch(0))
    last = comm.rank == comm.size - 1
    if last:
        shape, dtype, *rest = pipe._receive_plan()[0]
        pipe._recvs[0] = ((shape[0] + extra_rows,) + shape[1:], dtype, *rest)
    with pytest.raises(MpcommError) as error:
        pipe.train_step(*wl.batch(1))
    if last:
        assert "pipeline: receive of the activation into stage" in str(error.value)
        if extra_rows > 0:
            assert re.search(r"received \d+ bytes from rank \d+, expected \d+", str(error.value))
        else:
            assert "MPI error" in str(error.value)
    comm.mpi.Barrier()  # the ranks leave together (the others' errors are timeouts)


@pytest.mark.mpi(min_size=2)
def test_a_hand_off_of_another_shape_through_shared_memory_raises_on_both_sides_at_once():
    """Through shared memory the sender checks its array against the slot agreed at the first step (here: rank
    0's slot altered) and raises; its flag tells the receiver, which raises at once instead of at its deadline;
    the other ranks time out."""
    import time

    from mpcomm import Communicator, MpcommError

    comm = Communicator(timeout=4.0)
    wl, m = workload_for(comm.size, 1)
    pipe = PipelineParallel(wl.model(), comm, m, schedule="1f1b")
    pipe.train_step(*wl.batch(0))
    if comm.rank == 0:
        tag = min(pipe._shared.outgoing)
        slot, flag = pipe._shared.outgoing[tag]
        pipe._shared.outgoing[tag] = (slot[1:], flag)
    start = time.perf_counter()
    with pytest.raises(MpcommError) as error:
        pipe.train_step(*wl.batch(1))
    if comm.rank == 0:
        assert re.search(r"the activation of stage 0 for micro-batch 0 is float64\[\d+, 12\] where the first step "
                         r"agreed float64\[\d+, 12\]", str(error.value)), error.value
    elif comm.rank == 1:
        assert "had a message of another shape or dtype than agreed" in str(error.value), error.value
        assert time.perf_counter() - start < 2.0  # not the 4 s deadline
    comm.mpi.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_node_whose_shared_memory_is_short_hands_off_by_mpi(monkeypatch, world_comm):
    """Where /dev/shm (MPICH maps a shared window there; a write past its end is a SIGBUS) has less than twice
    the node's window free — here as one rank sees it — the whole node hands off by MPI, and trains alike."""
    from mpcomm.parallel import shared_handoff

    comm = world_comm
    if comm.rank == 0:
        monkeypatch.setattr(shared_handoff, "_free_shared_memory", lambda: 64)
    wl, m = workload_for(comm.size, 1)
    pipe = PipelineParallel(wl.model(), comm, m, schedule="1f1b")
    losses = train_pipeline(pipe, wl, 2)
    assert_matches_single_process(pipe, losses, wl)
    assert pipe._shared.window is None and not pipe._shared.incoming and not pipe._shared.all_shared


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("hold_a_received_array", [False, True])
def test_reset_shapes_gives_new_shapes_a_new_window_and_unmaps_the_old_one_only_when_nothing_is_on_it(
        hold_a_received_array, world_comm):
    """After reset_shapes() a new micro-batch shape trains like one process (a pipeline of one rank, no
    hand-offs) on the same batches; the old window is freed at that step, unless an array on it is still held
    somewhere (here: by the test), which must stay readable."""
    comm = world_comm
    wl, m = workload_for(comm.size, 1)
    x, y = wl.batch(0)
    batches = [(x, y), (np.vstack([x, x[:m]]), np.vstack([y, y[:m]]))]  # then one more row per micro-batch
    pipes = [PipelineParallel(wl.model(), c, m) for c in (comm, self_comm())]
    opts = [make_optimizer("sgd", p.parameters(), 0.1) for p in pipes]
    losses = [[], []]
    for step, (xb, yb) in enumerate(batches):
        if step == 1:
            old = pipes[0]._shared
            held = next(iter(old.incoming.values()))[0] if hold_a_received_array else None
            expected = None if held is None else held.copy()
            for pipe in pipes:
                pipe.reset_shapes()
        for pipe, opt, out in zip(pipes, opts, losses):
            out.append(pipe.train_step(xb, yb))
            opt.step()
            opt.zero_grad()
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-12)
    ours, reference = pipes[0].full_state_dict(), pipes[1].full_state_dict()
    for name in reference:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-12, atol=1e-15, err_msg=name)
    new = pipes[0]._shared
    assert new is not old and new.incoming and old.incoming == {}
    if hold_a_received_array:
        assert new._kept is old and old.window is not None and np.array_equal(held, expected)
    else:
        assert new._kept is None and old.window is None


@pytest.mark.mpi(min_size=2)
def test_free_releases_the_pipeline_channel():
    from mpi4py import MPI

    from mpcomm import Communicator

    comm = Communicator()
    wl, m = workload_for(comm.size, 1)
    PipelineParallel(wl.model(), comm, m).train_step(*wl.batch(0))
    channel = comm._protocols["pipeline"]
    assert comm.free()
    assert channel.mpi == MPI.COMM_NULL
