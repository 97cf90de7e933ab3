"""FSDP's compressed gradient reduce-scatter with error feedback, against numpy on the gathered local gradients.

    timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_fsdp_compression.py   (N = 1..4)

The reference of a compressed step (``mpcomm/parallel/fsdp_compression.py``): every rank's own unsharded gradient
g_k of each unit (a one-process model at the engine's parameters on that rank's part of the batch, flattened in the
unit's layout) plus its kept error e_k is sent; shard j of the result is the float32 sum in rank order of each
rank's chunk j put through the wire (bf16/fp16: the ml_dtypes/numpy cast; int8: the codec on the chunk), / p; each
rank keeps e_k = sent_k - wire(sent_k), chunk by chunk. One rank sends nothing: its gradient stays exact.

PowerSGD's (restated from torch's powerSGD_hook as tests/test_grad_compression.py does): per unit holding a matrix
rank R compresses, M_k = g_k + e_k; per matrix P = Gram-Schmidt(sum_k M_k Q), Q = mean_k M_k^T P, result P Q^T; every
other parameter the mean of the M_k; each rank's gradient is its shard of that, its error M_k - result; units with
no such matrix are reduce-scattered exactly and keep no error. FSDP's PowerSGD also equals DDP's on the same batch.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from conftest import WORLD, run_gathered
from test_checkpoint_integrity import SHARD_DAMAGE, _on_rank0, _outcomes, _version_dir, assert_every_rank_raises
from test_fsdp import _sub, adam, assert_close, reference, sgd, shared_tmpdir, train
from test_grad_compression import compressed_dims, gram_schmidt
from test_wire import on_the_wire

from mpcomm import ConfigError
from mpcomm.nn import SGD, TransformerMLPBlock, mse_loss
from mpcomm.parallel.ddp import DistributedDataParallel
from mpcomm.parallel.fsdp import FullyShardedDataParallel, MixedPrecision
from mpcomm.parallel.fsdp_checkpoint import CheckpointError
from mpcomm.workload import Workload

pytestmark = pytest.mark.mpi
COMM_TIMEOUT = 60
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
WL32 = Workload(num_layers=3, d_model=8, d_hidden=12, global_batch=12, seed=3, dtype="float32")
BIG = Workload(num_layers=2, d_model=40, d_hidden=300, global_batch=12, seed=5, dtype="float32")  # int8 blocks
# PowerSGD: prime sizes (a unit of 822 elements shards unevenly over 3 and 4 ranks); rank 4 compresses the 29 x 13
# and 13 x 29 matrices, rank 5 none of them (the bytes would not halve)
ODD64 = Workload(num_layers=2, d_model=13, d_hidden=29, global_batch=12, seed=7, dtype="float64")
POLICY = {TransformerMLPBlock}


def engine_of(comm, compression, warmup=0, error_feedback=True, workload=WL32, **kwargs):
    return FullyShardedDataParallel(workload.model(), comm, auto_wrap_policy=POLICY, compression=compression,
                                    compression_warmup_steps=warmup, error_feedback=error_feedback, **kwargs)


def local_flat_grads(engine, workload, step):
    """This rank's own unsharded gradient of every unit at the engine's parameters (one process, no FSDP)."""
    model = workload.model()
    model.load_state_dict(engine.full_state_dict())
    x, y = workload.local_batch(step, RANK, P)
    out, ctx = model.forward(x)
    _, g = mse_loss(out, y)
    model.backward(g, ctx)
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    return {u.name: u.layout.flatten([grads[i.name] for i in u.layout.params], np, np.dtype(workload.dtype))
            for u in engine.units}


def engine_step(engine, workload, step):
    x, y = workload.local_batch(step, RANK, P)
    engine.zero_grad()
    out, ctx = engine.forward(x)
    _, g = mse_loss(out, y)
    engine.backward(g, ctx)


# -------------------------------------------------------------------------------------- the wire's statement
@pytest.mark.parametrize("wire", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize("workload", [WL32, BIG], ids=["small", "big"])
def test_compressed_steps_match_numpy_on_the_gathered_gradients(comm, wire, error_feedback, workload):
    engine = engine_of(comm, wire, error_feedback=error_feedback, workload=workload)
    opt = SGD(engine.parameters(), lr=0.1)
    errors = {u.name: np.zeros(u.layout.padded_numel, np.float32) for u in engine.units}  # numpy's, this rank's
    for step in range(3):
        grads = local_flat_grads(engine, workload, step)
        engine_step(engine, workload, step)
        for u in engine.units:
            sent = grads[u.name] + errors[u.name] if error_feedback else grads[u.name]
            everyone = WORLD.allgather(sent)
            n = u.layout.shard_numel
            lo, hi = RANK * n, (RANK + 1) * n
            if P == 1:
                expected = sent[lo:hi]
            else:
                expected = on_the_wire(wire, everyone[0][lo:hi].copy())
                for other in everyone[1:]:
                    expected = expected + on_the_wire(wire, other[lo:hi].copy())
                expected = expected / np.float32(P)
            got = u.shard.grad
            assert got.dtype == expected.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=f"{u.name} {step}")
            if error_feedback and P > 1:
                kept = np.concatenate([sent[j * n:(j + 1) * n] - on_the_wire(wire, sent[j * n:(j + 1) * n].copy())
                                       for j in range(P)])
                np.testing.assert_array_equal(engine.compressor.errors[u.name], kept, err_msg=f"{u.name} {step}")
                errors[u.name] = kept
                # the identity: what the ranks sent = p x the average they got + the errors they keep (float64)
                got_all = np.concatenate(WORLD.allgather(got)).astype(np.float64)
                kept_all = np.sum(WORLD.allgather(kept.astype(np.float64)), axis=0)
                sent_all = np.sum([e.astype(np.float64) for e in everyone], axis=0)
                np.testing.assert_allclose(P * got_all + kept_all, sent_all, rtol=0,
                                           atol=4 * P * np.abs(sent_all).max() * 2**-23)
            else:
                assert engine.compressor.errors == {}
        opt.step()
    expected_choice = wire if P > 1 else "exact"
    assert set(engine.compression_choices()) <= {wire}
    if P > 1:
        assert set(engine.compression_choices()) == {expected_choice}
        held = sum(u.layout.padded_numel * 4 for u in engine.units) if error_feedback else 0
        assert engine.memory_stats()["compression_error_bytes"] == held


# -------------------------------------------------------------------------------------- PowerSGD
def powersgd_reference(unit, sent, q, rank):
    """The averaged result of PowerSGD at ``rank`` on every rank's ``sent`` flat gradient of ``unit`` (float64; Qs
    in ``q`` updated), or None if the unit has no matrix to compress."""
    if not any(compressed_dims(i.shape, rank) for i in unit.layout.params):
        return None
    want = np.zeros(unit.layout.padded_numel)
    for info in unit.layout.params:
        ms = [s[info.offset: info.offset + info.numel].reshape(info.shape) for s in sent]
        if compressed_dims(info.shape, rank):
            mats = [m.reshape(info.shape[0], -1) for m in ms]
            p = gram_schmidt(sum(m @ q[info.name] for m in mats))
            q[info.name] = sum(m.T @ p for m in mats) / len(mats)
            result = p @ q[info.name].T
        else:
            result = sum(ms) / len(ms)
        want[info.offset: info.offset + info.numel] = result.reshape(-1)
    return want


@pytest.mark.parametrize("rank", [1, 2, 4, 5])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_powersgd_steps_match_numpy_on_the_gathered_gradients(comm, rank, error_feedback):
    engine = engine_of(comm, f"powersgd:{rank}", error_feedback=error_feedback, workload=ODD64)
    opt = SGD(engine.parameters(), lr=0.1)
    params = {i.name: i.shape for u in engine.units for i in u.layout.params}
    rng = np.random.default_rng(11)  # a Q of our own: the engine's seeded first Q is not what is tested here
    q = {n: rng.standard_normal(compressed_dims(s, rank)) for n, s in params.items() if compressed_dims(s, rank)}
    engine.load_compression_state_dict({"mode": f"powersgd:{rank}", "steps": 0, "error": {}, "powersgd_q": q})
    errors = {u.name: np.zeros(u.layout.padded_numel) for u in engine.units}  # numpy's, this rank's
    for step in range(3):
        grads = local_flat_grads(engine, ODD64, step)
        engine_step(engine, ODD64, step)
        for u in engine.units:
            sent = grads[u.name] + errors[u.name]
            want = powersgd_reference(u, WORLD.allgather(sent), q, rank) if P > 1 else None
            lo, hi = u.layout.shard_range(RANK)
            got = u.shard.grad
            if want is None:  # the exact reduce-scatter (or one rank: nothing sent)
                np.testing.assert_allclose(got, np.mean(WORLD.allgather(sent), axis=0)[lo:hi], rtol=1e-12,
                                           atol=1e-15, err_msg=f"{u.name} {step}")
                assert u.name not in engine.compressor.errors
                continue
            np.testing.assert_allclose(got, want[lo:hi], rtol=1e-9, atol=1e-12, err_msg=f"{u.name} {step}")
            if error_feedback:
                errors[u.name] = sent - want
                np.testing.assert_allclose(engine.compressor.errors[u.name], errors[u.name], rtol=1e-8, atol=1e-12,
                                           err_msg=f"error {u.name} {step}")
            else:
                assert u.name not in engine.compressor.errors
        state = engine.compression_state_dict()
        assert sorted(state["powersgd_q"]) == sorted(q)  # (one rank: the loaded Qs, unused)
        for n, mine in state["powersgd_q"].items():
            np.testing.assert_allclose(mine, q[n], rtol=1e-9, atol=1e-12, err_msg=n)
            for other in WORLD.allgather(mine):  # the same Q on every rank, bit for bit
                np.testing.assert_array_equal(other, mine, err_msg=n)
        opt.step()
    compressed = P > 1 and bool(q)
    assert set(engine.compression_choices()) == ({"powersgd"} if compressed else {"exact"} if P > 1 else set())
    stats = engine.memory_stats()
    assert stats["compression_q_bytes"] == 8 * sum(v.size for v in q.values())
    held = sum(u.layout.padded_numel * 8 for u in engine.units) if compressed and error_feedback else 0
    assert stats["compression_error_bytes"] == held


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_powersgd_equals_ddp_powersgd(comm, dtype):
    """The same model, batches and seeded first Q: FSDP's shards of the parameters are DDP's, to rounding (the
    all-reduces add their elements in an order that depends on the buffer's size)."""
    if P == 1:
        pytest.skip("one FSDP rank sends nothing and so compresses nothing; DDP still compresses")
    workload = Workload(num_layers=2, d_model=13, d_hidden=29, global_batch=12, seed=7, dtype=dtype)
    fsdp = engine_of(comm, "powersgd:3", warmup=1, workload=workload)
    ddp = DistributedDataParallel(workload.model(), comm, compression="powersgd:3", compression_warmup_steps=1)
    for engine in (fsdp, ddp):
        train(engine, sgd(engine.parameters()), comm, steps=4, workload=workload)
    got, want = fsdp.full_state_dict(), ddp.full_state_dict()
    tight = 1e-12 if dtype == "float64" else 1e-5
    assert_close(got, want, rtol=tight, atol=tight)
    plain = engine_of(comm, None, workload=workload)  # (and PowerSGD did change the result: the test can fail)
    train(plain, sgd(plain.parameters()), comm, steps=4, workload=workload)
    assert any(not np.allclose(got[k], v, rtol=1e-4, atol=1e-6) for k, v in plain.full_state_dict().items())
    fsdp_q, ddp_q = fsdp.compression_state_dict()["powersgd_q"], ddp.compression_state_dict()["powersgd_q"]
    assert sorted(fsdp_q) == sorted(ddp_q) and fsdp_q
    for n in fsdp_q:
        np.testing.assert_allclose(fsdp_q[n], ddp_q[n], rtol=tight * 100, atol=tight, err_msg=n)


# -------------------------------------------------------------------------------------- warm-up and auto
@pytest.mark.parametrize("compression", ["bf16", "int8", "auto", "powersgd:2"])
def test_warm_up_is_plain_fsdp_and_one_process(comm, compression):
    steps = 3
    engine = engine_of(comm, compression, warmup=steps)
    train(engine, adam(engine.parameters()), comm, steps=steps, workload=WL32)
    plain = engine_of(comm, None)
    train(plain, adam(plain.parameters()), comm, steps=steps, workload=WL32)
    state, plain_state = engine.full_state_dict(), plain.full_state_dict()
    for k in plain_state:
        np.testing.assert_array_equal(state[k], plain_state[k], err_msg=k)
    assert_close(state, reference(adam, steps=steps, workload=WL32), rtol=1e-5, atol=1e-6)
    assert engine.compressor.errors == {} and engine.memory_stats()["compression_error_bytes"] == 0
    assert engine.compressor.q == {} and engine.memory_stats()["compression_q_bytes"] == 0
    assert engine.compressor.steps == steps


@pytest.mark.parametrize("compression, atol", [("int8", 1e-3), ("powersgd:1", 0.03)])  # (rank 1: one step loses more)
def test_a_compressed_run_differs_from_the_plain_one(comm, compression, atol):
    """The counterpart of the warm-up test: after warm-up compression does change the result (so it can fail)."""
    if P == 1:
        pytest.skip("one rank sends nothing: nothing is compressed")
    engine, plain = engine_of(comm, compression, warmup=1), engine_of(comm, None)
    for e in (engine, plain):
        train(e, sgd(e.parameters()), comm, steps=2, workload=WL32)
    state, plain_state = engine.full_state_dict(), plain.full_state_dict()
    assert any(not np.array_equal(state[k], plain_state[k]) for k in state)
    assert_close(state, plain_state, rtol=0.05, atol=atol)


def test_auto_is_off_on_one_host(comm):
    assert comm.num_nodes == 1
    engine, plain = engine_of(comm, "auto"), engine_of(comm, None)
    for e in (engine, plain):
        train(e, sgd(e.parameters()), comm, steps=3, workload=WL32)
    state, plain_state = engine.full_state_dict(), plain.full_state_dict()
    for k in plain_state:
        np.testing.assert_array_equal(state[k], plain_state[k], err_msg=k)
    if P > 1:
        assert set(engine.compression_choices()) == {"exact"}


# -------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("compression", ["int8", "bf16", "powersgd:2"])
def test_resumed_run_equals_the_uninterrupted_one_bitwise(comm, compression):
    path = shared_tmpdir(comm)
    engine = engine_of(comm, compression, warmup=1)
    opt = adam(engine.parameters())
    train(engine, opt, comm, steps=2, workload=WL32)
    engine.save_sharded(path, opt)
    train(engine, opt, comm, steps=2, first=2, workload=WL32)
    uninterrupted = engine.full_state_dict()

    def resumed(drop: str | None):
        fresh = FullyShardedDataParallel(Workload(num_layers=3, d_model=8, d_hidden=12, seed=99,
                                                  dtype="float32").model(), comm, auto_wrap_policy=POLICY,
                                         compression=compression, compression_warmup_steps=1)
        fresh_opt = adam(fresh.parameters())
        fresh.load_sharded(path, fresh_opt)
        assert fresh.compressor.steps == 2
        if drop == "error":
            fresh.compressor.errors.clear()
        elif drop == "q":
            assert fresh.compressor.q  # (seeded afresh at the next step: another Q than the saved one)
            fresh.compressor.q.clear()
        train(fresh, fresh_opt, comm, steps=2, first=2, workload=WL32)
        return fresh.full_state_dict()

    state = resumed(None)
    for k in uninterrupted:
        np.testing.assert_array_equal(state[k], uninterrupted[k], err_msg=k)
    if P > 1:  # the state matters: without it the resumed run is another run
        for drop in ["error", "q"] if compression.startswith("powersgd") else ["error"]:
            dropped = resumed(drop)
            assert any(not np.array_equal(dropped[k], uninterrupted[k]) for k in uninterrupted), drop
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


@pytest.mark.parametrize("compression", ["int8", "powersgd:2"])
def test_checkpoint_at_another_world_size_takes_the_mean_error(comm, compression):
    """(And PowerSGD's Q as it is: the same on every rank.)"""
    if P == 1:
        pytest.skip("needs errors of more than one rank")
    path = shared_tmpdir(comm)
    engine = engine_of(comm, compression)
    opt = sgd(engine.parameters())
    train(engine, opt, comm, steps=2, workload=WL32)
    engine.save_sharded(path, opt)
    saved = {u.name: np.mean(WORLD.allgather(engine.compressor.errors[u.name][: u.layout.numel].astype(np.float64)),
                             axis=0).astype(np.float32) for u in engine.units}
    saved_q = engine.compression_state_dict()["powersgd_q"]
    assert bool(saved_q) == compression.startswith("powersgd")
    sub, member = _sub(comm, 1)
    if member:
        fresh = engine_of(sub, compression)
        fresh.load_sharded(path, sgd(fresh.parameters()))
        state = fresh.compression_state_dict()
        assert state["steps"] == 2 and set(state["error"]) == set(saved)
        for name, e in saved.items():
            np.testing.assert_array_equal(state["error"][name], e, err_msg=name)
        assert sorted(state["powersgd_q"]) == sorted(saved_q)
        for name, q in saved_q.items():
            np.testing.assert_array_equal(state["powersgd_q"][name], q, err_msg=name)
    sub.free()
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


@pytest.mark.parametrize("damage", ["bit flipped in the data", "truncated", "missing"])
def test_damaged_powersgd_q_file_raises_on_every_rank(comm, damage):
    """The Qs are written once (rank 0) and read by every rank: damage is one CheckpointError everywhere, nothing
    changed."""
    if P == 1:
        pytest.skip("one rank compresses nothing: no Q is saved")
    path = shared_tmpdir(comm)
    engine = engine_of(comm, "powersgd:2")
    train(engine, sgd(engine.parameters()), comm, steps=1, workload=WL32)
    engine.save_sharded(path)
    target = os.path.join(_version_dir(path), "u0001.powersgd_q.npy")
    _on_rank0(lambda: SHARD_DAMAGE[damage](target))
    fresh = engine_of(comm, "powersgd:2")
    outcomes = _outcomes(lambda: fresh.load_sharded(path))
    assert_every_rank_raises(outcomes, "CheckpointError", "u0001.powersgd_q.npy")
    assert fresh.compressor.q == {} and fresh.compressor.steps == 0
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


def test_checkpoint_of_another_mode_is_refused_and_one_without_starts_afresh(comm):
    path = shared_tmpdir(comm)
    engine = engine_of(comm, "int8")
    train(engine, sgd(engine.parameters()), comm, steps=1, workload=WL32)
    engine.save_sharded(path)

    def run():
        other = engine_of(comm, "bf16")
        with pytest.raises(CheckpointError, match="saved with compression='int8', this engine uses 'bf16'"):
            other.load_sharded(path)

    run_gathered(run)
    plain = engine_of(comm, None)
    plain.save_sharded(path)
    engine.load_sharded(path)
    assert engine.compressor.steps == 0 and engine.compressor.errors == {}
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


# -------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, error, match", [
    ({"compression": "powersgd:2", "sharding_strategy": "hybrid_shard"}, NotImplementedError, "'hybrid_shard'"),
    ({"compression": "powersgd:2", "mixed_precision": MixedPrecision(param_dtype="float32", reduce_dtype="float16")},
     ConfigError, r"compresses float32 or float64 gradients .* unit\(s\) 0 \(float16"),
    ({"compression": "int8", "sharding_strategy": "no_shard"}, NotImplementedError, "sharding_strategy 'no_shard'"),
    ({"compression": "bf16", "sharding_strategy": "hybrid_shard"}, NotImplementedError, "'hybrid_shard'"),
    ({"compression": "int4"}, ConfigError, "compression must be None"),
    ({"compression": "int8", "compression_warmup_steps": -1}, ConfigError, "whole number of steps >= 0"),
    ({"compression": "int8", "workload": Workload(num_layers=1, d_model=4, d_hidden=4, seed=1)}, ConfigError,
     r"compresses float32 gradients .* unit\(s\) 0 \(float64"),
    ({"compression": "auto", "mixed_precision": MixedPrecision(param_dtype="float32", reduce_dtype="float16")},
     ConfigError, "float16"),
])
def test_bad_input_one_clear_error_on_every_rank(comm, kwargs, error, match):
    kwargs = dict(kwargs)
    workload = kwargs.pop("workload", WL32)

    def run():
        with pytest.raises(error, match=match):
            FullyShardedDataParallel(workload.model(), comm, auto_wrap_policy=POLICY, **kwargs)

    run_gathered(run)


def test_load_state_of_another_model_or_mode_is_refused(comm):
    engine = engine_of(comm, "int8")
    good = {"mode": "int8", "steps": 1, "error": {}}

    def run():
        with pytest.raises(ConfigError, match="saved with compression='bf16', this engine uses 'int8'"):
            engine.load_compression_state_dict({**good, "mode": "bf16"})
        with pytest.raises(ConfigError, match=r"unit 'nope', which this engine lacks \(its units: \['0', '1', '2'\]"):
            engine.load_compression_state_dict({**good, "error": {"nope": np.zeros(3, np.float32)}})
        with pytest.raises(ConfigError, match=r"error of unit '1' has shape \(3,\), the unit's gradient \(228,\)"):
            engine.load_compression_state_dict({**good, "error": {"1": np.zeros(3, np.float32)}})
        with pytest.raises(ConfigError, match="this FullyShardedDataParallel has no compression"):
            engine_of(comm, None).load_compression_state_dict(good)
        with pytest.raises(ConfigError, match=r"PowerSGD Q of '1.fc1.weight' has shape \(3, 2\), this engine "
                                              r"expects none"):
            engine.load_compression_state_dict({**good, "powersgd_q": {"1.fc1.weight": np.zeros((3, 2))}})
        psgd = engine_of(comm, "powersgd:2")
        with pytest.raises(ConfigError, match=r"PowerSGD Q of '1.fc1.weight' has shape \(3, 2\), this engine "
                                              r"expects \(8, 2\)"):
            psgd.load_compression_state_dict({"mode": "powersgd:2", "steps": 1, "error": {},
                                              "powersgd_q": {"1.fc1.weight": np.zeros((3, 2))}})
        engine.load_compression_state_dict({**good, "error": {"1": np.ones(228, np.float32)}})
        return engine.compression_state_dict()

    for state in run_gathered(run):
        assert state["steps"] == 1 and list(state["error"]) == ["1"] and (state["error"]["1"] == 1).all()
