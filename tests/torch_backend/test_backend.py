"""The ``torch.distributed`` backend ``"mpcomm"``: collectives through ``dist.*`` and DDP training that
matches DDP on gloo (same job, same seed) and single-process full-batch training.

Skips when PyTorch is not installed (``pip install torch==2.13.0`` / ``make test-torch``).
Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_backend.py`` (any N >= 1).
"""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from conftest import WORLD, in_step, run_gathered

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

import ml_dtypes  # noqa: E402

import mpcomm.integrations.torch as mpt  # noqa: E402
from torch_backend.groups import on_backend  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.torch


# ================================================================================== single process
def test_as_numpy_is_zero_copy():
    t = torch.arange(6, dtype=torch.float32)
    a = mpt.as_numpy(t)
    a[2] = 40
    assert t[2].item() == 40
    b = torch.ones(3, dtype=torch.bfloat16)
    view = mpt.as_numpy(b)
    assert view.dtype == np.dtype(ml_dtypes.bfloat16)
    view[0] = 3
    assert b[0].item() == 3.0


def test_as_numpy_rejects_non_tensors():
    with pytest.raises(TypeError, match="torch.Tensor"):
        mpt.as_numpy(np.zeros(3))


@pytest.mark.parametrize("op, name", [("SUM", "sum"), ("PRODUCT", "prod"), ("MIN", "min"), ("MAX", "max"),
                                      ("AVG", "avg")])
def test_reduce_ops(op, name):
    assert mpt.reduce_op_name(getattr(dist.ReduceOp, op)) == name


def test_bitwise_ops_are_not_arithmetic():
    with pytest.raises(ValueError, match="not an arithmetic op"):
        mpt.reduce_op_name(dist.ReduceOp.BAND)


def test_backend_registered():
    assert "mpcomm" in dist.Backend.backend_list
    assert dist.Backend("mpcomm") == "mpcomm"


def test_rendezvous_takes_rank_from_mpi():
    store, rank, size = next(mpt._rendezvous("mpcomm://"))
    assert (rank, size) == (RANK, SIZE)
    with pytest.raises(ValueError, match="MPI says"):
        next(mpt._rendezvous(f"mpcomm://?rank={RANK + 1}&world_size={SIZE}"))


# ================================================================================== collectives through dist.*
@pytest.mark.mpi
def test_bare_init_process_group_needs_no_master_addr():
    """``dist.init_process_group("mpcomm")`` with no init_method/store: torch goes through env://, whose
    variables the import filled in from MPI (never overriding ones the launcher set)."""
    import os

    if dist.is_initialized():
        dist.destroy_process_group()
    assert os.environ["RANK"] == str(RANK) and os.environ["WORLD_SIZE"] == str(SIZE)
    assert WORLD.allgather((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])) == \
        [(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])] * SIZE
    in_step(lambda: dist.init_process_group("mpcomm", timeout=timedelta(seconds=60)))
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (RANK, SIZE, "mpcomm")
        t = torch.full((3,), float(RANK + 1))
        dist.all_reduce(t)
        assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 3
    finally:
        in_step(dist.destroy_process_group)


def test_env_defaults_never_override(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("RANK", str(RANK))
    set_here = mpt.set_env_rendezvous_defaults()
    assert "MASTER_ADDR" not in set_here and "MASTER_PORT" not in set_here and "RANK" not in set_here
    import os

    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.1.2.3", "1234")


@pytest.mark.mpi
def test_init_without_master_addr(pg, monkeypatch):
    assert dist.get_rank() == RANK and dist.get_world_size() == SIZE
    assert dist.get_backend() == "mpcomm"


ALL_REDUCE_CASES = [(dtype, op) for op in ("SUM", "MAX", "AVG")
                    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
                    if op != "AVG" or dtype.is_floating_point]  # avg needs a floating dtype


@pytest.mark.mpi
@pytest.mark.parametrize("dtype, op", ALL_REDUCE_CASES,
                         ids=[f"{op}-{d}".replace("torch.", "") for d, op in ALL_REDUCE_CASES])
def test_all_reduce(pg, dtype, op):
    t = torch.arange(10, dtype=torch.float64).add(RANK).to(dtype)
    in_step(lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, op)))
    ranks = torch.arange(SIZE, dtype=torch.float64)
    base = torch.arange(10, dtype=torch.float64)[:, None] + ranks[None, :]
    expected = {"SUM": base.sum(1), "MAX": base.max(1).values, "AVG": base.mean(1)}[op]
    torch.testing.assert_close(t.double(), expected.to(dtype).double(), rtol=0, atol=0)


@pytest.mark.mpi
def test_async_all_reduce_and_non_contiguous(pg):
    m = torch.ones(6, 4)
    column = m[:, 1]  # strided view
    work = dist.all_reduce(column, async_op=True)
    in_step(work.wait)
    assert (m[:, 1] == SIZE).all() and (m[:, 0] == 1).all()
    assert work.is_completed()


@pytest.mark.mpi
def test_all_gather_and_into_tensor(pg):
    mine = torch.full((3,), float(RANK))
    outs = [torch.empty(3) for _ in range(SIZE)]
    in_step(lambda: dist.all_gather(outs, mine))
    assert [int(o[0]) for o in outs] == list(range(SIZE))
    flat = torch.empty(3 * SIZE)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    in_step(lambda: gather_single(flat, mine))
    assert torch.equal(flat, torch.arange(SIZE).float().repeat_interleave(3))


@pytest.mark.mpi
def test_reduce_scatter_list_and_tensor(pg):
    inputs = [torch.full((2,), float(RANK + r)) for r in range(SIZE)]
    out = torch.empty(2)
    in_step(lambda: dist.reduce_scatter(out, inputs))
    assert torch.equal(out, torch.full((2,), float(sum(q + RANK for q in range(SIZE)))))
    full = torch.arange(2 * SIZE, dtype=torch.float32)
    out2 = torch.empty(2)
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    in_step(lambda: scatter_single(out2, full))
    assert torch.equal(out2, full[2 * RANK : 2 * RANK + 2] * SIZE)


@pytest.mark.mpi
def test_broadcast_barrier_p2p(pg):
    t = torch.full((5,), float(RANK))
    in_step(lambda: dist.broadcast(t, src=SIZE - 1))
    assert (t == SIZE - 1).all()
    in_step(dist.barrier)
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty(4)

    def ring():
        works = [dist.irecv(got, src=left), dist.isend(torch.full((4,), float(RANK)), dst=right)]
        for w in works:
            w.wait()

    if SIZE > 1:
        in_step(ring)
        assert (got == left).all()


@pytest.mark.mpi
def test_new_group_of_even_ranks(pg):
    evens = list(range(0, SIZE, 2))
    group = dist.new_group(evens)
    t = torch.ones(3)
    if RANK in evens:
        in_step(lambda: dist.all_reduce(t, group=group))
        assert (t == len(evens)).all()
    else:
        in_step(lambda: None)


@pytest.mark.mpi
def test_cuda_tensor_rejected_clearly(pg):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(ValueError, match="CPU tensors"):
        dist.all_reduce(torch.ones(2, device="cuda"))


# ================================================================================== DDP: mpcomm vs gloo vs one process
STEPS, LOCAL_BATCH, SEED = 6, 8, 1234


def _model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _data(rank):
    g = torch.Generator().manual_seed(SEED + 7 * rank)
    return torch.randn(LOCAL_BATCH, 5, generator=g, dtype=torch.float64), torch.randn(
        LOCAL_BATCH, 1, generator=g, dtype=torch.float64
    )


def _train_ddp():
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(RANK)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, params


def _train_single_full_batch():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = zip(*(_data(r) for r in range(SIZE)))
    x, y = torch.cat(xs), torch.cat(ys)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # mean over the global batch = DDP's average
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi
def test_ddp_matches_gloo_and_single_process():
    if not dist.is_gloo_available():
        pytest.skip("this PyTorch has no gloo")
    on_mpcomm = on_backend("mpcomm", _train_ddp)
    on_gloo = on_backend("gloo", _train_ddp)

    reference = _train_single_full_batch()
    everyone = run_gathered(lambda: on_mpcomm[1].numpy())
    # DDP on mpcomm vs DDP on gloo: same seed, same shards. Two ranks sum in the same order on both, so
    # equality is exact; from three ranks on, gloo and mpcomm add the gradients in different orders, so
    # the float64 trajectories agree to rounding.
    if SIZE <= 2:
        assert on_mpcomm[0] == on_gloo[0], "loss trajectories differ"
        assert torch.equal(on_mpcomm[1], on_gloo[1])
    else:
        np.testing.assert_allclose(on_mpcomm[0], on_gloo[0], rtol=1e-12)
        torch.testing.assert_close(on_mpcomm[1], on_gloo[1], rtol=1e-12, atol=1e-14)
    assert all(np.array_equal(everyone[0], e) for e in everyone), "replicas diverged"
    torch.testing.assert_close(on_mpcomm[1], reference, rtol=1e-10, atol=1e-12)
    global_loss = np.mean(run_gathered(lambda: on_mpcomm[0]), axis=0)  # each rank's loss is of its shard
    assert global_loss[-1] < global_loss[0], "the model did not train"
