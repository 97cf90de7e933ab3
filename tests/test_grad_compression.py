"""DDP's gradient compression with error feedback against numpy on the gathered gradients.

    timeout 600 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_grad_compression.py   (also -n 1, 3, 4)
    python -m pytest -q tests/test_grad_compression.py                                           (pure tests only)

The reference for PowerSGD is torch's powerSGD_hook restated here in numpy, on every rank's local gradient:
P = sum_r M_r Q, orthonormalized (Gram-Schmidt); Q = mean_r M_r^T P; each rank's new gradient P Q^T; error_r =
M_r - P Q^T, added to the next step's M_r. Vectors (and matrices rank R would not halve) are averaged exactly and
their error is the rank's own value minus the average.
"""
from __future__ import annotations

import numpy as np
import pytest

import mpcomm.nn as nn
from mpcomm.buffers import BFLOAT16
from mpcomm.compression import codec
from mpcomm.errors import ConfigError
from mpcomm.parallel.ddp import DistributedDataParallel
from mpcomm.parallel.grad_compression import merge_states, orthogonalize, parse_compression
from mpcomm.workload import Workload
from test_ddp import ddp_step

COMM_TIMEOUT = 60
TINY_MB = 600 / 2**20  # one or two parameters per bucket


def workload(dtype="float64"):
    return Workload(num_layers=2, d_model=16, d_hidden=32, global_batch=24, seed=3, dtype=dtype)


def compressed_dims(shape, rank):
    """(m, r) if torch's rule compresses a gradient of ``shape`` at ``rank`` (>= 2 dims, halves the bytes)."""
    if len(shape) < 2:
        return None
    n, m = shape[0], int(np.prod(shape[1:]))
    r = min(n, m, rank)
    return (m, r) if n * m > 2 * (n + m) * r else None


def gram_schmidt(p):
    q = np.array(p, dtype=np.float64)
    for k in range(q.shape[1]):
        for j in range(k):
            q[:, k] -= (q[:, j] @ q[:, k]) * q[:, j]
        q[:, k] /= np.linalg.norm(q[:, k])
    return q


def local_grads(wl, state, step, rank, size):
    """This rank's own gradients at parameters ``state`` on its shard of batch ``step`` (one process, no DDP)."""
    model = wl.model()
    model.load_state_dict(state)
    x, y = wl.local_batch(step, rank, size)
    pred, ctx = model.forward(x)
    _, g = nn.mse_loss(pred, y)
    model.backward(g, ctx)
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def gather_dicts(comm, d):
    """Every rank's dict of arrays (same keys and shapes everywhere), in rank order."""
    flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in d.values()])
    everyone = np.empty((comm.size, flat.size))
    comm.all_gather(flat, everyone)
    out = []
    for row in everyone:
        item, at = {}, 0
        for n, v in d.items():
            item[n] = row[at: at + v.size].reshape(v.shape)
            at += v.size
        out.append(item)
    return out


# ------------------------------------------------------------------------------------------------ pure

@pytest.mark.parametrize("value", ["int4", "powersgd", "powersgd:0", "powersgd:-1", "powersgd:x", "POWERSGD:2",
                                   "bf16 ", "", 3, ("int8",)])
def test_unknown_compression_names_the_value_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"compression must be None, 'bf16', 'fp16', 'int8', 'powersgd:RANK'"):
        parse_compression(value)


@pytest.mark.parametrize("warmup", [-1, 1.5, True, "3"])
def test_bad_warmup(warmup):
    with pytest.raises(ConfigError, match="warm-up must be a whole number of steps >= 0"):
        parse_compression("powersgd:2", warmup)


def test_parse():
    assert parse_compression(None) is None
    spec = parse_compression("powersgd:12", 0, False)
    assert (spec.mode, spec.rank, spec.warmup_steps, spec.error_feedback, spec.name) == \
        ("powersgd", 12, 0, False, "powersgd:12")
    assert parse_compression("int8").name == "int8" and parse_compression("auto").mode == "auto"


@pytest.mark.parametrize("shape", [(5, 1), (7, 3), (64, 4), (9, 9)])
def test_orthogonalize_spans_the_same_columns(shape):
    p = np.random.default_rng(1).standard_normal(shape)
    q = orthogonalize(p)
    np.testing.assert_allclose(q.T @ q, np.eye(shape[1]), atol=1e-12)
    np.testing.assert_allclose(q, gram_schmidt(p), atol=1e-10)  # the same basis as Gram-Schmidt (signs fixed)


def test_merge_states_keeps_the_mean_error():
    rng = np.random.default_rng(2)
    q = {"w": rng.standard_normal((3, 2))}
    states = [{"mode": "powersgd:2", "steps": 5, "error": {"w": rng.standard_normal((4, 3)),
                                                           "b": rng.standard_normal(4)}, "powersgd_q": q}
              for _ in range(3)]
    merged = merge_states(states)
    for n in ("w", "b"):
        np.testing.assert_allclose(merged["error"][n], sum(s["error"][n] for s in states) / 3, rtol=1e-15)
    assert merged["steps"] == 5 and merged["powersgd_q"]["w"] is q["w"]
    states[1]["steps"] = 4
    with pytest.raises(ValueError, match="disagree"):
        merge_states(states)


# ------------------------------------------------------------------------------------------------ multi-rank

@pytest.mark.mpi
@pytest.mark.parametrize("compression", ["powersgd:1", "powersgd:4"])
@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
def test_warm_up_is_exact_ddp(comm, compression, cap_mb):
    """During the warm-up the engine is plain DDP: bitwise the uncompressed engine, and one process's result."""
    wl, steps = workload(), 4
    results = []
    for kwargs in ({}, {"compression": compression, "compression_warmup_steps": steps}):
        model = wl.model()
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=cap_mb, **kwargs)
        opt = nn.Adam(ddp.parameters(), lr=0.01)
        for s in range(steps):
            ddp_step(ddp, wl, s, opt)
        results.append(ddp.full_state_dict())
        if kwargs:
            state = ddp.compression_state_dict()
            assert state["steps"] == steps and state["error"] == {} and state["powersgd_q"] == {}
    for n in results[0]:
        assert np.array_equal(results[0][n], results[1][n]), n
    single = wl.model()
    opt = nn.Adam(single.parameters(), lr=0.01)
    for s in range(steps):
        x, y = wl.batch(s)
        pred, ctx = single.forward(x)
        single.backward(nn.mse_loss(pred, y)[1], ctx)
        opt.step()
        opt.zero_grad()
    for n, v in single.state_dict().items():
        np.testing.assert_allclose(results[1][n], v, rtol=1e-10, atol=1e-13, err_msg=n)


@pytest.mark.mpi
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_powersgd_steps_match_numpy_on_the_gathered_gradients(comm, rank, cap_mb, error_feedback):
    wl = workload()
    model = wl.model()
    name = f"powersgd:{rank}"
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=cap_mb, compression=name, compression_warmup_steps=0,
                                  error_feedback=error_feedback)
    opt = nn.SGD(ddp.parameters(), lr=0.05)
    shapes = {n: p.shape for n, p in ddp.named_parameters()}
    rng = np.random.default_rng(11)
    q = {n: rng.standard_normal(compressed_dims(s, rank)) for n, s in shapes.items() if compressed_dims(s, rank)}
    assert q, "the test model must have matrices this rank compresses"
    ddp.load_compression_state_dict({"mode": name, "steps": 0, "error": {}, "powersgd_q": q})
    errors = [{n: np.zeros(s) for n, s in shapes.items()} for _ in range(comm.size)]
    for s in range(3):
        everyone = gather_dicts(comm, local_grads(wl, ddp.full_state_dict(), s, comm.rank, comm.size))
        x, y = wl.local_batch(s, comm.rank, comm.size)
        pred, ctx = ddp.forward(x)
        ddp.backward(nn.mse_loss(pred, y)[1], ctx)
        for n, shape in shapes.items():
            ms = [everyone[r][n] + (errors[r][n] if error_feedback else 0) for r in range(comm.size)]
            if n in q:
                mats = [m.reshape(shape[0], -1) for m in ms]
                p = gram_schmidt(sum(m @ q[n] for m in mats))
                q[n] = sum(m.T @ p for m in mats) / comm.size
                want = (p @ q[n].T).reshape(shape)
            else:
                want = sum(ms) / comm.size
            got = dict(ddp.named_parameters())[n].grad
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=f"step {s} {n}")
            errors = [{**e, n: m - want} for e, m in zip(errors, ms)]
        state = ddp.compression_state_dict()
        assert state["steps"] == s + 1
        for n in q:
            np.testing.assert_allclose(state["powersgd_q"][n], q[n], rtol=1e-9, atol=1e-12, err_msg=n)
        if error_feedback:
            assert set(state["error"]) == set(shapes)
            for n in shapes:
                np.testing.assert_allclose(state["error"][n], errors[comm.rank][n], rtol=1e-8, atol=1e-12,
                                           err_msg=f"step {s} error of {n}")
        else:
            assert state["error"] == {}
        opt.step()
        ddp.zero_grad()
    assert_same_on_all_ranks(comm, ddp.full_state_dict())


def assert_same_on_all_ranks(comm, state):
    for r, other in enumerate(gather_dicts(comm, state)):
        for n in state:
            assert np.array_equal(other[n], state[n]), f"rank {r} holds another {n} than rank {comm.rank}"


def train(comm, wl, compression, steps, *, start=None, cap_mb=TINY_MB, warmup=2, save_at=None, path=None):
    """Train ``steps`` steps (from ``start``: a saved checkpoint); save this rank's checkpoint at ``save_at``."""
    model = wl.model()
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=cap_mb, compression=compression,
                                  compression_warmup_steps=warmup)
    opt = nn.Adam(ddp.parameters(), lr=0.01)
    first = 0
    if start is not None:
        with np.load(start, allow_pickle=True) as f:
            saved = f["checkpoint"].item()
        ddp.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        ddp.load_compression_state_dict(saved["compression"])
        first = saved["compression"]["steps"]
    losses = []
    for s in range(first, steps):
        losses.append(ddp_step(ddp, wl, s, opt))
        if save_at == s + 1:
            np.savez(path, checkpoint=np.array({"model": ddp.state_dict(), "optimizer": opt.state_dict(),
                                                "compression": ddp.compression_state_dict()}, dtype=object))
    return ddp, losses


@pytest.mark.mpi
@pytest.mark.parametrize("compression, dtype", [("powersgd:2", "float64"), ("int8", "float32"), ("bf16", "float32")])
@pytest.mark.parametrize("save_at", [1, 3])
def test_resumed_run_equals_the_uninterrupted_one_bitwise(comm, tmp_path, compression, dtype, save_at):
    wl, steps = workload(dtype), 6
    path = str(tmp_path / f"rank{comm.rank}.npz")
    whole, _ = train(comm, wl, compression, steps, save_at=save_at, path=path)
    resumed, _ = train(comm, wl, compression, steps, start=path)
    want, got = whole.full_state_dict(), resumed.full_state_dict()
    for n in want:
        assert np.array_equal(want[n], got[n]), n
    for key in ("error", "powersgd_q"):
        a, b = whole.compression_state_dict()[key], resumed.compression_state_dict()[key]
        assert sorted(a) == sorted(b)
        for n in a:
            assert np.array_equal(a[n], b[n]), f"{key} {n}"


@pytest.mark.mpi
def test_merged_state_owes_the_same_average(comm):
    """Resharding: every rank loading the merged state of all ranks sends the same averaged gradient next step."""
    wl = workload()
    ddp, _ = train(comm, wl, "powersgd:1", 3, warmup=1)
    state = ddp.compression_state_dict()
    everyone = gather_dicts(comm, state["error"])
    merged = merge_states([{**state, "error": e} for e in everyone])
    ddp.load_compression_state_dict(merged)
    again = ddp.compression_state_dict()
    for n, e in state["error"].items():
        np.testing.assert_allclose(again["error"][n], sum(x[n] for x in everyone) / comm.size, rtol=1e-12,
                                   atol=1e-15)
    assert_same_on_all_ranks(comm, again["error"])


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs, match", [
    ({"compression": "int4"}, r"compression must be None, 'bf16', 'fp16', 'int8', 'powersgd:RANK' \(RANK >= 1\) "
                              r"or 'auto'; got 'int4'"),
    ({"compression": "powersgd:0"}, r"compression must be .*; got 'powersgd:0'"),
    ({"compression": "powersgd:2", "compression_warmup_steps": -3}, r"warm-up must be .* got -3"),
    ({"compression": "int8"}, r"compression='int8' compresses float32 gradients; parameter\(s\) 0\.fc1\.bias "
                              r"\(float64\)"),
    ({"compression": "powersgd:2", "comm_hook": "bf16"}, r"pass comm_hook='bf16' or compression='powersgd:2', not both"),
])
def test_bad_input_one_clear_error_on_every_rank(comm, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DistributedDataParallel(workload().model(), comm, **kwargs)
    ddp = DistributedDataParallel(workload().model(), comm)  # the communicator is still usable, in step
    with pytest.raises(ConfigError, match="has no compression"):
        ddp.load_compression_state_dict({})


@pytest.mark.mpi
def test_load_state_of_another_model_or_mode_is_refused(comm):
    ddp = DistributedDataParallel(workload().model(), comm, compression="powersgd:2", compression_warmup_steps=0)
    good = {"mode": "powersgd:2", "steps": 1, "error": {}, "powersgd_q": {}}
    with pytest.raises(ConfigError, match="saved with compression='powersgd:4', this engine uses 'powersgd:2'"):
        ddp.load_compression_state_dict({**good, "mode": "powersgd:4"})
    with pytest.raises(ConfigError, match=r"names parameters this model lacks: \['nope'\]"):
        ddp.load_compression_state_dict({**good, "error": {"nope": np.zeros(3)}})
    with pytest.raises(ConfigError, match=r"Q of '0.fc1.weight' has shape \(3, 2\), this model expects \(16, 2\)"):
        ddp.load_compression_state_dict({**good, "powersgd_q": {"0.fc1.weight": np.zeros((3, 2))}})
    with pytest.raises(ConfigError, match=r"error of '0.fc1.bias' has shape \(3,\), the parameter has \(32,\)"):
        ddp.load_compression_state_dict({**good, "error": {"0.fc1.bias": np.zeros(3)}})


# ------------------------------------------------------------------------------------------------ wires

def on_the_wire(wire, x):
    """What ``x`` becomes on the wire (bf16/fp16: round to nearest even; int8: the codec, per 256-block absmax)."""
    if wire == "bf16":
        return x.astype(BFLOAT16).astype(np.float32)
    if wire == "fp16":
        return x.astype(np.float16).astype(np.float32)
    return codec(wire).roundtrip(x)


def wired_average(inputs, wire, groups):
    """allreduce(op="avg", wire=...)'s contract: each group's float32 sum (rank order) rounded once on the wire, the
    groups' sums added in float32, divided by p, rounded once more."""
    total = None
    for group in groups:
        partial = inputs[group[0]].copy()
        for r in group[1:]:
            partial += inputs[r]
        sent = on_the_wire(wire, partial)
        total = sent if total is None else total + sent
    return on_the_wire(wire, total / np.float32(len(inputs)))


@pytest.fixture(scope="module", params=[None, 1], ids=lambda q: f"ranks_per_node={q}")
def wire_comm(request):
    from mpi4py import MPI
    from mpcomm import Communicator
    c = Communicator(MPI.COMM_WORLD, ranks_per_node=request.param, timeout=COMM_TIMEOUT)
    c.groups = [[r] for r in range(c.size)] if request.param == 1 else [list(range(c.size))]
    yield c
    c.free()


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_wire_steps_match_numpy_on_the_gathered_gradients(wire_comm, wire, cap_mb, error_feedback):
    comm, wl = wire_comm, workload("float32")
    ddp = DistributedDataParallel(wl.model(), comm, bucket_cap_mb=cap_mb, compression=wire,
                                  compression_warmup_steps=1, error_feedback=error_feedback)
    opt = nn.SGD(ddp.parameters(), lr=0.05)
    shapes = {n: p.shape for n, p in ddp.named_parameters()}
    errors = [{n: np.zeros(s, np.float32) for n, s in shapes.items()} for _ in range(comm.size)]
    for s in range(4):
        everyone = gather_dicts(comm, local_grads(wl, ddp.full_state_dict(), s, comm.rank, comm.size))
        x, y = wl.local_batch(s, comm.rank, comm.size)
        pred, ctx = ddp.forward(x)
        ddp.backward(nn.mse_loss(pred, y)[1], ctx)
        got = dict(ddp.named_parameters())
        names = list(shapes)
        for bucket in ddp.buckets:  # int8's blocks run over the bucket: build each bucket as the engine does
            members = [names[i] for i in bucket.members]
            ins = [np.concatenate([e[n].astype(np.float32).ravel() for n in members]) for e in everyone]
            if s == 0:  # the warm-up step: the exact average
                want = sum(ins) / comm.size
            else:
                if error_feedback:
                    ins = [x + np.concatenate([e[n].ravel() for n in members]) for x, e in zip(ins, errors)]
                want = wired_average(ins, wire, comm.groups)
            at = 0
            for n in members:
                size = int(np.prod(shapes[n]))
                if s == 0:
                    np.testing.assert_allclose(got[n].grad.ravel(), want[at: at + size], rtol=1e-6, atol=1e-8)
                else:
                    np.testing.assert_array_equal(got[n].grad.ravel(), want[at: at + size], err_msg=f"step {s} {n}")
                    errors = [{**e, n: (x[at: at + size] - want[at: at + size]).reshape(shapes[n])}
                              for e, x in zip(errors, ins)]
                at += size
        state = ddp.compression_state_dict()
        if error_feedback and s > 0:
            for n in shapes:
                np.testing.assert_array_equal(state["error"][n], errors[comm.rank][n], err_msg=f"step {s} {n}")
        else:
            assert state["error"] == {}
        opt.step()
        ddp.zero_grad()
    assert_same_on_all_ranks(comm, ddp.full_state_dict())


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_error_feedback_makes_up_what_the_wire_lost(wire_comm, wire):
    """Summed over the steps, the averaged gradients with EF are the exact ones' minus the mean of the ranks' last
    errors (all that is still owed); without EF the rounding piles up further (the same batch and parameters every
    step: the same rounding every step)."""
    comm, wl = wire_comm, workload("float32")
    sums, owed = {}, None
    for ef in (None, True, False):
        ddp = DistributedDataParallel(wl.model(), comm, compression=None if ef is None else wire,
                                      compression_warmup_steps=0, error_feedback=bool(ef))
        total = {n: np.zeros(p.shape) for n, p in ddp.named_parameters()}
        for s in range(12):
            x, y = wl.local_batch(0, comm.rank, comm.size)
            pred, ctx = ddp.forward(x)
            ddp.backward(nn.mse_loss(pred, y)[1], ctx)
            for n, p in ddp.named_parameters():
                total[n] += p.grad
            ddp.zero_grad()
        sums[ef] = np.concatenate([v.ravel() for v in total.values()])
        if ef:
            errors = ddp.compression_state_dict()["error"]
            owed = sum(np.concatenate([e[n].ravel() for n in total]) for e in gather_dicts(comm, errors)) / comm.size
    np.testing.assert_allclose(sums[True], sums[None] - owed, rtol=0, atol=2e-6 * np.abs(sums[None]).max())
    assert np.abs(sums[True] - sums[None]).max() < np.abs(sums[False] - sums[None]).max()


@pytest.mark.mpi
@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
def test_auto_is_off_on_one_host(comm, cap_mb):
    """One host: no wire pays, so ``auto`` is plain DDP, bitwise, and says so per bucket."""
    wl = workload("float32")
    results = []
    for compression in (None, "auto"):
        ddp = DistributedDataParallel(wl.model(), comm, bucket_cap_mb=cap_mb, compression=compression,
                                      compression_warmup_steps=0)
        opt = nn.Adam(ddp.parameters(), lr=0.01)
        for s in range(3):
            ddp_step(ddp, wl, s, opt)
        results.append(ddp.full_state_dict())
    assert ddp.compression_choices() == ["exact"] * len(ddp.buckets)
    assert ddp.compression_state_dict()["error"] == {}
    for n in results[0]:
        assert np.array_equal(results[0][n], results[1][n]), n
