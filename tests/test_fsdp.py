"""FullyShardedDataParallel: pure layout/wrap tests, and MPI tests against one process on the full batch.

Pure part:  python -m pytest -q tests/test_fsdp.py
MPI part:   timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_fsdp.py   (N = 1..4)
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from mpcomm import Communicator, ConfigError
from mpcomm.nn import SGD, Adam, Linear, Sequential, TransformerMLPBlock, mse_loss
from mpcomm.parallel import fsdp_checkpoint
from mpcomm.parallel.flat_param import FlatLayout, reshard_plan
from mpcomm.parallel.fsdp import FullyShardedDataParallel, MixedPrecision
from mpcomm.parallel.wrap import as_policy, plan_units
from mpcomm.workload import Workload

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]
WL = Workload(num_layers=3, d_model=8, d_hidden=12, global_batch=12, seed=3)  # 12 rows: divisible by 1..4
STEPS = 3


# ---------------------------------------------------------------------------------------- pure
def test_layout_offsets_and_padding():
    layout = FlatLayout.build([("a", (2, 3)), ("b", (5,)), ("c", ())], shard_count=4)
    assert [(p.offset, p.numel) for p in layout.params] == [(0, 6), (6, 5), (11, 1)]
    assert (layout.numel, layout.shard_numel, layout.padded_numel, layout.padding) == (12, 3, 12, 0)
    layout3 = layout.reshard(5)
    assert (layout3.shard_numel, layout3.padded_numel, layout3.padding) == (3, 15, 3)
    arrays = [np.arange(6.0).reshape(2, 3), np.arange(5.0) + 10, np.array(99.0)]
    flat = layout3.flatten(arrays, np, np.float64)
    assert flat.shape == (15,) and (flat[12:] == 0).all()
    for a, v in zip(arrays, layout3.views(flat)):
        np.testing.assert_array_equal(a, v)
        assert np.shares_memory(v, flat)
    assert layout3.shard_range(4) == (12, 15)
    assert FlatLayout.from_json(layout3.to_json()) == layout3
    with pytest.raises(ValueError, match="shape"):
        layout.flatten([np.zeros((3, 2)), arrays[1], arrays[2]], np, np.float64)
    with pytest.raises(ValueError, match="twice"):
        FlatLayout.build([("a", (1,)), ("a", (2,))], 2)


@pytest.mark.parametrize("old_count", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("new_count", [1, 2, 3, 4, 7])
def test_reshard_plan_rebuilds_every_shard(old_count, new_count):
    base = FlatLayout.build([("w", (7, 3)), ("b", (4,))], 1)
    old, new = base.reshard(old_count), base.reshard(new_count)
    data = np.arange(base.numel, dtype=np.float64) + 1
    padded = np.zeros(old.padded_numel)
    padded[: base.numel] = data
    old_shards = [padded[slice(*old.shard_range(k))] for k in range(old_count)]
    rebuilt = []
    for r in range(new_count):
        out = np.zeros(new.shard_numel)
        for piece in reshard_plan(old, new, r):
            out[piece.dst_lo : piece.dst_hi] = old_shards[piece.old_index][piece.src_lo : piece.src_hi]
        rebuilt.append(out)
    np.testing.assert_array_equal(np.concatenate(rebuilt)[: base.numel], data)
    assert (np.concatenate(rebuilt)[base.numel :] == 0).all()


def test_wrap_policies_partition_parameters():
    model = WL.model()
    all_names = [n for n, _ in model.named_parameters()]
    cases = {
        None: [""],
        TransformerMLPBlock: ["0", "1", "2"],
        90: ["0.fc1", "0.fc2", "1.fc1", "1.fc2", "2.fc1", "2.fc2", ""],  # ln (16 params) left to the root
        (lambda m: isinstance(m, Linear)): ["0.fc1", "0.fc2", "1.fc1", "1.fc2", "2.fc1", "2.fc2", ""],
    }
    for policy, expected in cases.items():
        units = plan_units(model, as_policy(policy))
        assert [u.name for u in units] == expected
        names = [n for u in units for n, _ in u.params]
        assert sorted(names) == sorted(all_names)
    with pytest.raises(TypeError):
        as_policy("blocks")
    with pytest.raises(TypeError):
        as_policy(lambda m, n: True)


def test_tied_weights_across_units_are_rejected():
    a, b = Linear(3, 3), Linear(3, 3)
    b.weight = a.weight
    with pytest.raises(ValueError, match="shared by modules of different FSDP units"):
        plan_units(Sequential(a, b), as_policy(Linear))


def test_mixed_precision_validation():
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecision(param_dtype=np.int32)
    assert MixedPrecision(param_dtype="float32").param_dtype == np.float32


# ---------------------------------------------------------------------------------------- helpers
def hybrid_comm():
    """World with ranks_per_node=2 when it divides the world (shard in pairs), else 1 (pure replication)."""
    size = MPI.COMM_WORLD.Get_size()
    return Communicator(MPI.COMM_WORLD, ranks_per_node=2 if size % 2 == 0 else 1)


def reference(opt_factory, steps=STEPS, workload=WL):
    """One process, full batch."""
    model = workload.model()
    opt = opt_factory(model.parameters())
    for s in range(steps):
        x, y = workload.batch(s)
        model.zero_grad()
        out, ctx = model.forward(x)
        _, g = mse_loss(out, y)
        model.backward(g, ctx)
        opt.step()
    return model.state_dict()


def train(engine, opt, comm, steps=STEPS, first=0, workload=WL):
    for s in range(first, first + steps):
        xs, ys = workload.local_batch(s, comm.rank, comm.size)
        engine.zero_grad()
        out, ctx = engine.forward(xs)
        _, g = mse_loss(out, ys)
        engine.backward(g, ctx)
        opt.step()


def assert_same_on_all_ranks(comm, state):
    flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in state.values()])
    everyone = np.empty(comm.size * flat.size)
    comm.all_gather(flat, everyone)
    for r in range(comm.size):
        np.testing.assert_array_equal(everyone[r * flat.size : (r + 1) * flat.size], flat)


def assert_close(state, ref, rtol, atol=0.0):
    assert list(state) == list(ref)
    for k in ref:
        np.testing.assert_allclose(state[k], ref[k], rtol=rtol, atol=atol, err_msg=k)


def sgd(params):
    return SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return Adam(params, lr=0.01)


def shared_tmpdir(comm):
    buf = np.zeros(1024, dtype=np.uint8)
    if comm.rank == 0:
        path = tempfile.mkdtemp(prefix="mpcomm-fsdp-").encode()
        buf[: len(path)] = np.frombuffer(path, dtype=np.uint8)
    comm.broadcast(buf, root=0)
    return bytes(buf).rstrip(b"\0").decode()


# ---------------------------------------------------------------------------------------- training
@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_strategy_matches_single_process(comm, strategy, opt_name):
    c = hybrid_comm() if strategy == "hybrid_shard" else comm
    factory = {"sgd": sgd, "adam": adam}[opt_name]
    engine = FullyShardedDataParallel(WL.model(), c, sharding_strategy=strategy,
                                      auto_wrap_policy={TransformerMLPBlock})
    train(engine, factory(engine.parameters()), c)
    state = engine.full_state_dict()
    assert_close(state, reference(factory), rtol=1e-10, atol=1e-13)
    assert_same_on_all_ranks(c, state)
    if c is not comm:
        c.free()


@pytest.mark.mpi
@pytest.mark.parametrize("policy", [None, 90, "callable"])
@pytest.mark.parametrize("prefetch", ["pre", "post", None])
def test_wrap_policy_and_prefetch_match(comm, policy, prefetch):
    policy = (lambda m: isinstance(m, Linear)) if policy == "callable" else policy
    engine = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy=policy, backward_prefetch=prefetch,
                                      forward_prefetch=prefetch == "pre")
    train(engine, adam(engine.parameters()), comm)
    assert_close(engine.full_state_dict(), reference(adam), rtol=1e-10, atol=1e-13)
    stats = engine.schedule_stats()
    assert stats["max_inflight_all_gathers"] <= 2
    if comm.size > 1 and prefetch is not None and len(engine.units) > 1:
        assert stats["prefetched"] > 0 and stats["prefetch_hits"] > 0


@pytest.mark.mpi
def test_float32_model(comm):
    wl = Workload(num_layers=3, d_model=8, d_hidden=12, global_batch=12, seed=3, dtype="float32")
    engine = FullyShardedDataParallel(wl.model(), comm, auto_wrap_policy={TransformerMLPBlock})
    train(engine, adam(engine.parameters()), comm, workload=wl)
    state = engine.full_state_dict()
    assert all(v.dtype == np.float32 for v in state.values())
    assert_close(state, reference(adam, workload=wl), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_mixed_precision_float32_params_float64_master(comm, strategy):
    model = WL.model()
    seen = []
    model[0].fc1.register_forward_post_hook(lambda m: seen.append(m.weight.data.dtype))
    engine = FullyShardedDataParallel(model, comm, sharding_strategy=strategy, auto_wrap_policy={TransformerMLPBlock},
                                      mixed_precision=MixedPrecision(param_dtype=np.float32, reduce_dtype=np.float32))
    opt = sgd(engine.parameters())
    train(engine, opt, comm)
    assert seen and all(d == np.float32 for d in seen)
    assert all(p.data.dtype == np.float64 and p.grad.dtype == np.float64 for p in engine.parameters())
    assert_close(engine.full_state_dict(), reference(sgd), rtol=1e-4, atol=1e-6)


@pytest.mark.mpi
def test_mixed_precision_bfloat16(comm):
    engine = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy={TransformerMLPBlock},
                                      mixed_precision=MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32"))
    train(engine, sgd(engine.parameters()), comm)
    state, ref = engine.full_state_dict(), reference(sgd)
    for k in ref:
        assert np.isfinite(state[k]).all()
        np.testing.assert_allclose(state[k], ref[k], rtol=0.05, atol=0.02, err_msg=k)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_gradient_accumulation_over_micro_batches(comm, strategy):
    """Two micro-batches per step (losses weighted by their share of rows); grads accumulate in the shards."""
    engine = FullyShardedDataParallel(WL.model(), comm, sharding_strategy=strategy,
                                      auto_wrap_policy={TransformerMLPBlock})
    opt = sgd(engine.parameters())
    for s in range(STEPS):
        xs, ys = WL.local_batch(s, comm.rank, comm.size)
        engine.zero_grad()
        for half in (slice(0, len(xs) // 2), slice(len(xs) // 2, None)):
            out, ctx = engine.forward(xs[half])
            _, g = mse_loss(out, ys[half])
            engine.backward(g * (len(xs[half]) / len(xs)), ctx)
        opt.step()
    assert_close(engine.full_state_dict(), reference(sgd), rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------------------- memory
@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_parameter_storage_is_one_over_p(comm, strategy):
    model = WL.model()
    full_bytes = sum(p.data.nbytes for p in model.parameters())
    gathered = []  # weak references to every gathered buffer, to prove they are really released
    engine = FullyShardedDataParallel(model, comm, sharding_strategy=strategy, auto_wrap_policy={TransformerMLPBlock})
    for u in engine.units:
        u.module.register_forward_pre_hook(  # runs after the engine's pre hook: the unit is gathered
            lambda m, u=u: u.full is not None and u.owns_full and gathered.append(weakref.ref(u.full)))
    opt = adam(engine.parameters())
    train(engine, opt, comm, steps=2)
    stats = engine.memory_stats(opt)
    p = comm.size
    assert stats["full_model_bytes"] == full_bytes
    padding_bytes = stats["padding_elements"] * 8
    assert stats["sharded_param_bytes"] * p == full_bytes + padding_bytes
    assert stats["sharded_param_bytes"] <= full_bytes / p + len(engine.units) * 8
    assert stats["gathered_param_bytes"] == 0 and stats["unsharded_grad_bytes"] == 0
    assert stats["optimizer_state_bytes"] == 2 * stats["sharded_param_bytes"]
    assert stats["sharded_grad_bytes"] == stats["sharded_param_bytes"]
    if p > 1:
        assert gathered and all(ref() is None for ref in gathered)
        for prm in model.parameters():  # the originals hold no storage between steps
            assert prm.data.strides == (0,) * prm.data.ndim
        unit = stats["largest_unit_bytes"]
        if strategy == "full_shard":  # the current unit plus at most one prefetched
            assert unit <= stats["peak_gathered_param_bytes"] <= 2 * unit
        else:  # shard_grad_op keeps every unit gathered from forward to backward
            assert stats["peak_gathered_param_bytes"] == full_bytes + padding_bytes


# ---------------------------------------------------------------------------------------- checkpoints
def _sub(comm, n):
    """A size-``n`` sub-communicator of ranks 0..n-1 (other ranks get one they never use)."""
    return comm.split(0 if comm.rank < n else 1), comm.rank < n


@pytest.mark.mpi
def test_sharded_checkpoint_reshards_across_world_sizes(comm):
    p = comm.size
    chain = [p] + [s for s in (2, 3, 1) if s <= p and s != p][:2]  # p=4: 4 -> 2 -> 3
    path = shared_tmpdir(comm)
    policy = {TransformerMLPBlock}
    engine = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy=policy)
    opt = adam(engine.parameters())
    train(engine, opt, comm, steps=2)
    expected, expected_opt = engine.full_state_dict(), engine.full_optim_state_dict(opt)
    engine.save_sharded(path, opt)
    for n in chain[1:]:
        sub, member = _sub(comm, n)
        if member:
            fresh = FullyShardedDataParallel(Workload(num_layers=3, d_model=8, d_hidden=12, seed=99).model(), sub,
                                             auto_wrap_policy=policy)
            fresh_opt = adam(fresh.parameters())
            fresh.load_sharded(path, fresh_opt)
            got, got_opt = fresh.full_state_dict(), fresh.full_optim_state_dict(fresh_opt)
            for k in expected:
                np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    np.testing.assert_array_equal(got_opt[k][key], expected_opt[k][key], err_msg=f"{k} {key}")
            fresh.save_sharded(path, fresh_opt)  # the next size in the chain reads what this size wrote
        sub.free()
        comm.barrier()
    # continue training from the last load: same as one process doing STEPS steps in a row
    n = chain[-1]
    sub, member = _sub(comm, n)
    if member:
        last = FullyShardedDataParallel(WL.model(), sub, auto_wrap_policy=policy)
        last_opt = adam(last.parameters())
        last.load_sharded(path, last_opt)
        train(last, last_opt, sub, steps=STEPS - 2, first=2)
        assert_close(last.full_state_dict(), reference(adam), rtol=1e-10, atol=1e-13)
    sub.free()
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


@pytest.mark.mpi
def test_crash_mid_save_keeps_previous_checkpoint(comm, monkeypatch):
    path = shared_tmpdir(comm)
    engine = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy={TransformerMLPBlock})
    opt = sgd(engine.parameters())
    train(engine, opt, comm, steps=1)
    good = engine.full_state_dict()
    engine.save_sharded(path)
    train(engine, opt, comm, steps=1, first=1)

    real = fsdp_checkpoint._atomic_write

    def crashing(target, write):  # the process "dies" half-way through its first shard file
        directory, base = os.path.split(target)
        with open(os.path.join(directory, f".{base}.tmp-crash{comm.rank}"), "wb") as f:
            f.write(b"\x93NUMPY partial")
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(fsdp_checkpoint, "_atomic_write", crashing)
    with pytest.raises(KeyboardInterrupt):
        engine.save_sharded(path)
    monkeypatch.setattr(fsdp_checkpoint, "_atomic_write", real)
    comm.barrier()
    if comm.rank == 0:  # also a torn LATEST temp file next to the real one
        with open(os.path.join(path, ".LATEST.tmp-crash"), "w") as f:
            f.write('{"vers')
    comm.barrier()

    fresh = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy={TransformerMLPBlock})
    fresh.load_sharded(path)
    for k, v in fresh.full_state_dict().items():
        np.testing.assert_array_equal(v, good[k], err_msg=k)
    engine.save_sharded(path)  # a later save succeeds and cleans up the crashed attempt
    fresh.load_sharded(path)
    assert_close(fresh.full_state_dict(), engine.full_state_dict(), rtol=0)
    if comm.rank == 0:
        assert sorted(os.listdir(path)) == ["LATEST", "v000002"]
        shutil.rmtree(path)


@pytest.mark.mpi
def test_save_full_and_load_full_state_dict(comm):
    path = shared_tmpdir(comm)
    engine = FullyShardedDataParallel(WL.model(), comm, sharding_strategy="shard_grad_op",
                                      auto_wrap_policy={TransformerMLPBlock})
    train(engine, sgd(engine.parameters()), comm, steps=1)
    state = engine.full_state_dict()
    engine.save_full(os.path.join(path, "full.npz"))
    with np.load(os.path.join(path, "full.npz")) as z:
        for k in state:
            np.testing.assert_array_equal(z[k], state[k])
    other = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy=None)
    other.load_full_state_dict(state)
    for k, v in other.full_state_dict().items():
        np.testing.assert_array_equal(v, state[k])
    with pytest.raises(KeyError, match="missing"):
        other.load_full_state_dict({})
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


@pytest.mark.mpi
def test_load_with_other_wrapping_is_a_clear_error(comm):
    path = shared_tmpdir(comm)
    FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy={TransformerMLPBlock}).save_sharded(path)
    with pytest.raises(ValueError, match="units"):
        FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy=None).load_sharded(path)
    with pytest.raises(FileNotFoundError, match="no FSDP sharded checkpoint"):
        FullyShardedDataParallel(WL.model(), comm).load_sharded(os.path.join(path, "nothing"))
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.mpi
def test_parameter_shapes_differing_across_ranks_fail_everywhere(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks to differ")
    width = 8 + (comm.rank == comm.size - 1)
    model = Sequential(Linear(4, width), Linear(width, 2))
    with pytest.raises(ConfigError, match=rf"differs across ranks.*rank {comm.size - 1}: parameter '0.weight'"):
        FullyShardedDataParallel(model, comm)
    comm.barrier()


@pytest.mark.mpi
def test_bad_arguments(comm):
    with pytest.raises(ValueError, match="sharding_strategy"):
        FullyShardedDataParallel(WL.model(), comm, sharding_strategy="zero3")
    with pytest.raises(ValueError, match="backward_prefetch"):
        FullyShardedDataParallel(WL.model(), comm, backward_prefetch="sideways")
    with pytest.raises(TypeError, match="Communicator"):
        FullyShardedDataParallel(WL.model(), MPI.COMM_WORLD)
    with pytest.raises(ValueError, match="no parameters"):
        FullyShardedDataParallel(Sequential(), comm)
    with pytest.raises(TypeError, match="mixed_precision"):
        FullyShardedDataParallel(WL.model(), comm, mixed_precision="fp16")
    engine = FullyShardedDataParallel(WL.model(), comm)
    with pytest.raises(ValueError, match="engine.parameters"):
        engine.memory_stats(Adam(WL.model().parameters()))


@pytest.mark.mpi
def test_hybrid_needs_equal_nodes(comm):
    if comm.size < 3 or comm.size % 2 == 0:
        pytest.skip("needs an odd world size >= 3 to make unequal nodes of 2 ranks")
    c = Communicator(MPI.COMM_WORLD, ranks_per_node=2)
    with pytest.raises(ConfigError, match="same number of ranks on every node"):
        FullyShardedDataParallel(WL.model(), c, sharding_strategy="hybrid_shard")
    c.free()


@pytest.mark.mpi
def test_cpu_offload_without_device_is_a_noop(comm):
    engine = FullyShardedDataParallel(WL.model(), comm, cpu_offload=True, auto_wrap_policy={TransformerMLPBlock})
    assert engine.cpu_offload_active is False
    train(engine, sgd(engine.parameters()), comm, steps=1)
    assert_close(engine.full_state_dict(), reference(sgd, steps=1), rtol=1e-10, atol=1e-13)
