"""DistributedDataParallel == one process training on the whole batch.

    timeout 600 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_ddp.py     (also -n 1, 3, 4)
    python -m pytest -q tests/test_ddp.py                                                (pure tests only)

Every multi-rank test works at any world size 1..4: the global batch (24) divides by 1, 2, 3, 4 and by twice that.
"""
from __future__ import annotations

import numpy as np
import pytest

import mpcomm.nn as nn
from mpcomm.errors import ConfigError
from mpcomm.parallel.ddp import (Bucket, DistributedDataParallel, UnusedParameterError, describe_mismatch,
                                 plan_buckets)
from mpcomm.workload import Workload

TINY_MB = 600 / 2**20  # ~600 bytes: one or two parameters per bucket
COMM_TIMEOUT = 60  # seconds, for conftest's comm fixture: DDP's steps on a loaded machine

def workload(dtype="float64", batch=24):
    return Workload(num_layers=3, d_model=8, d_hidden=16, global_batch=batch, seed=3, dtype=dtype)


def make_opt(name, params):
    return nn.SGD(params, lr=0.05, momentum=0.9) if name == "sgd" else nn.Adam(params, lr=0.01)


def reference(wl, steps, opt_name):
    """One process, whole global batch."""
    model = wl.model()
    opt = make_opt(opt_name, model.parameters())
    for step in range(steps):
        x, y = wl.batch(step)
        pred, ctx = model.forward(x)
        _, g = nn.mse_loss(pred, y)
        model.backward(g, ctx)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def perturb_off_root(model, rank):
    """Make non-root replicas start different, so the test sees the construction broadcast work."""
    for p in model.parameters():
        p.data += 0.1 * rank


def ddp_step(ddp, wl, step, opt):
    """One training step of ``ddp`` on this rank's shard of batch ``step``; returns the local loss."""
    xs, ys = wl.local_batch(step, ddp.comm.rank, ddp.comm.size)
    pred, ctx = ddp.forward(xs)
    loss, g = nn.mse_loss(pred, ys)
    ddp.backward(g, ctx)
    opt.step()
    ddp.zero_grad()
    return loss


def train_ddp(comm, wl, steps, opt_name, **kwargs):
    model = wl.model()
    perturb_off_root(model, comm.rank)
    ddp = DistributedDataParallel(model, comm, **kwargs)
    opt = make_opt(opt_name, ddp.parameters())
    for step in range(steps):
        ddp_step(ddp, wl, step, opt)
    return ddp


def assert_same_on_all_ranks(comm, state):
    flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in state.values()])
    everyone = np.empty((comm.size, flat.size))
    comm.all_gather(flat, everyone)
    for r in range(comm.size):
        assert np.array_equal(everyone[r], flat), f"rank {r} holds different parameters than rank {comm.rank}"


def assert_matches(got, want, rtol, atol=0.0):
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


# ------------------------------------------------------------------------------------------------ pure

def test_plan_buckets_first_small_reverse_order_and_dtype_split():
    nbytes = [100, 100, 100, 100, 100]
    dtypes = ["float64"] * 5
    plan = plan_buckets(nbytes, dtypes, [4, 3, 2, 1, 0], cap_bytes=250, first_cap_bytes=100)
    assert plan == [[4], [3, 2, 1], [0]]
    assert sorted(i for b in plan for i in b) == list(range(5))
    mixed = plan_buckets(nbytes, ["float64", "float64", "float32", "float32", "float64"], [4, 3, 2, 1, 0],
                         cap_bytes=10**6, first_cap_bytes=10**6)
    assert mixed == [[4], [3, 2], [1, 0]]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(nbytes, dtypes, [0], 0, 1)


def test_bucket_views_are_slots_of_one_buffer():
    params = [(0, nn.Parameter(np.ones((2, 3)))), (1, nn.Parameter(np.ones(4)))]
    b = Bucket(0, params, tail=2)
    assert b.buffer.shape == (12,) and b.numel == 10 and b.tail.shape == (2,)
    b.views[1][...] = 7
    assert (b.buffer[6:10] == 7).all() and b.views[0].shape == (2, 3)


def test_describe_mismatch_names_parameter_and_ranks():
    a = [["w", [2, 3], "float64"], ["b", [3], "float64"]]
    b = [["w", [2, 4], "float64"], ["b", [3], "float64"]]
    text = describe_mismatch([a, a, b])
    assert "'w'" in text and "rank 2" in text and "(2, 4)" in text and "rank 1" not in text


def test_bad_arguments():
    from mpcomm.parallel.ddp import _resolve_hook
    with pytest.raises(ValueError, match="comm_hook"):
        _resolve_hook("int8")
    with pytest.raises(TypeError, match="mpcomm.nn.Module"):
        DistributedDataParallel(object(), None)


# ------------------------------------------------------------------------------------------------ equivalence

@pytest.mark.mpi
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
def test_ddp_equals_single_process_float64(comm, opt_name, cap_mb):
    wl = workload()
    ddp = train_ddp(comm, wl, 3, opt_name, bucket_cap_mb=cap_mb)
    if cap_mb == TINY_MB:
        assert len(ddp.buckets) > 4
    else:
        assert len(ddp.buckets) == 1
    state = ddp.full_state_dict()
    assert_matches(state, reference(wl, 3, opt_name), rtol=1e-10, atol=1e-13)
    assert_same_on_all_ranks(comm, state)


@pytest.mark.mpi
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_ddp_equals_single_process_float32(comm, opt_name):
    wl = workload("float32")
    state = train_ddp(comm, wl, 3, opt_name, bucket_cap_mb=TINY_MB).full_state_dict()
    assert all(v.dtype == np.float32 for v in state.values())
    assert_matches(state, reference(wl, 3, opt_name), rtol=1e-5, atol=1e-6)
    assert_same_on_all_ranks(comm, state)


@pytest.mark.mpi
@pytest.mark.parametrize("option", ["gradient_as_bucket_view", "delay_all_reduce", "static_graph"])
def test_ddp_options_same_result(comm, option):
    wl = workload()
    ddp = train_ddp(comm, wl, 3, "adam", bucket_cap_mb=TINY_MB, **{option: True})
    state = ddp.full_state_dict()
    assert_matches(state, reference(wl, 3, "adam"), rtol=1e-10, atol=1e-13)
    assert_same_on_all_ranks(comm, state)
    if option == "gradient_as_bucket_view":
        for p in ddp.parameters():  # grads are views into the buckets, not copies
            assert any(np.shares_memory(p.grad, b.buffer) for b in ddp.buckets), p.name


@pytest.mark.mpi
def test_gradient_as_bucket_view_grads_are_averaged_views(comm):
    wl = workload()
    model = wl.model()
    ddp = DistributedDataParallel(model, comm, gradient_as_bucket_view=True, bucket_cap_mb=TINY_MB)
    ref = wl.model()
    x, y = wl.batch(0)
    pred, ctx = ref.forward(x)
    ref.backward(nn.mse_loss(pred, y)[1], ctx)
    for _ in range(2):  # the second round starts from zero_grad()'s in-place zeroed views
        ddp.zero_grad()
        pred, ctx = ddp.forward(wl.shard(x, comm.rank, comm.size))
        ddp.backward(nn.mse_loss(pred, wl.shard(y, comm.rank, comm.size))[1], ctx)
        for p, q in zip(ddp.parameters(), ref.parameters()):
            assert p.grad.base is not None and np.shares_memory(p.grad, ddp._bucket_of[ddp._index[id(p)]].buffer)
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14, err_msg=p.name)


@pytest.mark.mpi
@pytest.mark.parametrize("bucket_view", [False, True])
def test_no_sync_accumulation_equals_double_batch(comm, bucket_view):
    wl = workload(batch=24)  # 2 micro-steps of 24 / (2 * size) rows per rank
    want = reference(wl, 2, "sgd")
    model = wl.model()
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=TINY_MB, gradient_as_bucket_view=bucket_view)
    opt = make_opt("sgd", ddp.parameters())
    syncs = ddp.timing["syncs"]
    for step in range(2):
        xs, ys = wl.local_batch(step, comm.rank, comm.size)
        for micro in range(2):
            xm, ym = wl.shard(xs, micro, 2), wl.shard(ys, micro, 2)
            pred, ctx = ddp.forward(xm)
            _, g = nn.mse_loss(pred, ym)
            if micro == 0:
                with ddp.no_sync():
                    ddp.backward(g / 2, ctx)
            else:
                ddp.backward(g / 2, ctx)
        opt.step()
        ddp.zero_grad()
    assert ddp.timing["syncs"] - syncs == 2
    state = ddp.full_state_dict()
    assert_matches(state, want, rtol=1e-10, atol=1e-13)
    assert_same_on_all_ranks(comm, state)


@pytest.mark.mpi
@pytest.mark.parametrize("hook,rtol", [("fp16", 2e-3), ("bf16", 1e-2)])
def test_compression_hooks_close(comm, hook, rtol):
    wl = workload()
    state = train_ddp(comm, wl, 3, "sgd", bucket_cap_mb=TINY_MB, comm_hook=hook).full_state_dict()
    assert_matches(state, reference(wl, 3, "sgd"), rtol=rtol, atol=rtol)
    assert_same_on_all_ranks(comm, state)


# ------------------------------------------------------------------------------------------------ errors

@pytest.mark.mpi
def test_shape_mismatch_raises_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks to disagree")
    last = comm.size - 1
    model = nn.mlp([4, 5 + (comm.rank == last), 3], seed=1)
    with pytest.raises(ConfigError) as err:
        DistributedDataParallel(model, comm)
    text = str(err.value)
    assert "'0.weight'" in text and f"rank {last}" in text and "rank 0" in text
    comm.barrier()  # the communicator is still usable afterwards


class TwoHeads(nn.Module):
    """y = a(x), plus b(x) when ``use_b``: b's parameters are unused in backwards that skip it."""

    def __init__(self, use_b):
        super().__init__()
        self.a = nn.Linear(4, 3, seed=1)
        self.b = nn.Linear(4, 3, seed=2)
        self.c = nn.Linear(3, 3, seed=3)
        self.use_b = use_b

    def _forward(self, x):
        h, ca = self.a.forward(x)
        cb = None
        if self.use_b:
            hb, cb = self.b.forward(x)
            h = h + hb
        y, cc = self.c.forward(h)
        return y, (ca, cb, cc)

    def _backward(self, g, ctx):
        ca, cb, cc = ctx
        g = self.c.backward(g, cc)
        gx = self.a.backward(g, ca)
        if cb is not None:
            gx = gx + self.b.backward(g, cb)
        return gx


def two_heads_data(rank, rows=3):
    rng = np.random.default_rng(rank)
    return rng.standard_normal((rows, 4)), rng.standard_normal((rows, 3))


def two_heads_reference(size, uses_b, steps):
    """One process: the average over the ranks' shards of their gradients (b only where used)."""
    model = TwoHeads(True)
    opt = nn.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        for r in range(size):
            model.use_b = uses_b(r)
            x, y = two_heads_data(r)
            pred, ctx = model.forward(x)
            _, g = nn.mse_loss(pred, y)
            model.backward(g / size, ctx)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["nobody", "odd-ranks"])
def test_unused_parameter_without_flag_raises_naming_it(comm, pattern):
    uses_b = (lambda r: False) if pattern == "nobody" else (lambda r: r % 2 == 1)
    ddp = DistributedDataParallel(TwoHeads(uses_b(comm.rank)), comm, bucket_cap_mb=TINY_MB)
    x, y = two_heads_data(comm.rank)
    pred, ctx = ddp.forward(x)
    with pytest.raises(UnusedParameterError, match=r"'b\.weight'.*'b\.bias'|'b\.bias'.*'b\.weight'") as err:
        ddp.backward(nn.mse_loss(pred, y)[1], ctx)
    assert "find_unused_parameters=True" in str(err.value)
    assert "'a." not in str(err.value) and "'c." not in str(err.value)
    # every rank drained its buckets: the engine and communicator keep working with the flag's behaviour
    comm.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["nobody", "odd-ranks", "everybody"])
@pytest.mark.parametrize("mode", ["find_unused_parameters", "static_graph"])
def test_unused_parameters_with_flag_match_reference(comm, pattern, mode):
    uses_b = {"nobody": lambda r: False, "odd-ranks": lambda r: r % 2 == 1, "everybody": lambda r: True}[pattern]
    model = TwoHeads(uses_b(comm.rank))
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=TINY_MB, **{mode: True})
    opt = nn.Adam(ddp.parameters(), lr=0.01)
    for _ in range(3):
        x, y = two_heads_data(comm.rank)
        pred, ctx = ddp.forward(x)
        ddp.backward(nn.mse_loss(pred, y)[1], ctx)
        opt.step()
        ddp.zero_grad()
    want = two_heads_reference(comm.size, uses_b, 3)
    state = ddp.full_state_dict()
    assert_matches(state, want, rtol=1e-10, atol=1e-14)
    assert_same_on_all_ranks(comm, state)
    if not any(uses_b(r) for r in range(comm.size)):
        assert model.b.weight.grad is None  # nobody used it: no gradient, as in one process


@pytest.mark.mpi
def test_shared_parameter_used_twice_is_reported(comm):
    lin = nn.Linear(4, 4, seed=1)
    model = nn.Sequential(lin, nn.GELU(), lin)
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=TINY_MB)
    x, y = two_heads_data(comm.rank)[0], np.zeros((3, 4))
    pred, ctx = ddp.forward(x)
    with pytest.raises(Exception, match="more than once"):
        ddp.backward(nn.mse_loss(pred, y)[1], ctx)
    comm.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype, rtol, atol", [("float32", 1e-5, 1e-6), ("float64", 1e-10, 1e-14)])
def test_default_hook_grads_are_averaged_copies(comm, dtype, rtol, atol):
    """Without gradient_as_bucket_view, after backward each gradient is one process's gradient on the whole batch
    (the default hook averages the buckets), in the parameter's dtype, in memory of its own (not a view of a
    bucket), and the same on every rank; also in a second backward, after zero_grad()."""
    wl = workload(dtype)
    ddp = DistributedDataParallel(wl.model(), comm, bucket_cap_mb=TINY_MB)
    ref = wl.model()
    x, y = wl.batch(7)
    pred, ctx = ref.forward(x)
    ref.backward(nn.mse_loss(pred, y)[1], ctx)
    rounds = []
    for _ in range(2):
        ddp.zero_grad()
        pred, ctx = ddp.forward(wl.shard(x, comm.rank, comm.size))
        ddp.backward(nn.mse_loss(pred, wl.shard(y, comm.rank, comm.size))[1], ctx)
        assert_same_on_all_ranks(comm, {name: p.grad for name, p in ddp.named_parameters()})
        rounds.append([(p.name, p.grad.copy(), any(np.shares_memory(p.grad, b.buffer) for b in ddp.buckets))
                       for p in ddp.parameters()])
    for grads in rounds:  # the same on every rank (checked above), so every rank passes or fails together
        for (name, grad, shared), q in zip(grads, ref.parameters()):
            assert grad.dtype == np.dtype(dtype) and not shared, (name, grad.dtype, shared)
            np.testing.assert_allclose(grad, q.grad, rtol=rtol, atol=atol, err_msg=name)
