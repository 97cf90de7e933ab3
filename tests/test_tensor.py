"""Tensor-parallel layers against the unsplit layers.

Serial:  python -m pytest -q tests/test_tensor.py
MPI:     timeout 600 mpiexec -n 4 python -m pytest -q --with-mpi -m mpi tests/test_tensor.py   (any size 1..4)
"""
import numpy as np
import pytest

from mpcomm.errors import ConfigError
from mpcomm.nn import Embedding, Linear, TransformerMLPBlock
from mpcomm.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallelMLPBlock,
                                    VocabParallelEmbedding, gather_full_state, parallelize_mlp_blocks)

RTOL = 1e-10
D_MODEL, D_HIDDEN = 12, 24  # divisible by 1, 2, 3, 4


class FakeGroup:
    """Enough of a Communicator for constructors that must reject before communicating."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank

    def allreduce(self, buf, op="sum"):  # pragma: no cover - never reached
        raise AssertionError("no communication expected")


def tp_groups(comm):
    """(tp size, tp communicator) for every tp size dividing the world; groups of consecutive ranks."""
    out = []
    for tp in range(1, comm.size + 1):
        if comm.size % tp == 0:
            out.append((tp, comm.split(comm.rank // tp, key=comm.rank)))
    return out


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-13)


def identical_on_group(comm, a):
    """Exact equality of ``a`` across the ranks of ``comm``."""
    a = np.ascontiguousarray(a)
    everyone = np.empty((comm.size,) + a.shape, dtype=a.dtype)
    comm.all_gather(a, everyone)
    return all(np.array_equal(everyone[0], e) for e in everyone)


# ------------------------------------------------------------------------------------------ serial

def test_uneven_splits_are_rejected_with_config_error():
    with pytest.raises(ConfigError, match=r"out_features % tp == 0"):
        ColumnParallelLinear(4, 10, FakeGroup(3))
    with pytest.raises(ConfigError, match=r"in_features % tp == 0"):
        RowParallelLinear(10, 4, FakeGroup(4))
    with pytest.raises(ConfigError, match=r"d_hidden % tp == 0"):
        TensorParallelMLPBlock(8, 18, FakeGroup(4))
    with pytest.raises(ConfigError, match=r"num_embeddings % tp == 0"):
        VocabParallelEmbedding(10, 4, FakeGroup(3))


def test_single_rank_tp_layers_equal_full_layers():
    from mpi4py import MPI

    from mpcomm import Communicator
    one = Communicator(MPI.COMM_SELF)
    full = TransformerMLPBlock(D_MODEL, D_HIDDEN, seed=3)
    tp = TensorParallelMLPBlock.from_block(full, one)
    x = np.random.default_rng(0).standard_normal((5, D_MODEL))
    y, c = full.forward(x)
    yt, ct = tp.forward(x)
    assert np.array_equal(y, yt)
    gy = np.random.default_rng(1).standard_normal(y.shape)
    assert np.array_equal(full.backward(gy, c), tp.backward(gy, ct))
    for (n, p), (nt, pt) in zip(full.named_parameters(), tp.named_parameters()):
        assert n == nt and np.array_equal(p.grad, pt.grad)


# ------------------------------------------------------------------------------------------ MPI

@pytest.mark.mpi
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_matches_full(gather_output, world_comm):
    comm = world_comm
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, D_MODEL))
    full = Linear(D_MODEL, D_HIDDEN, seed=11)
    y, c = full.forward(x)
    gy = rng.standard_normal(y.shape)
    gx = full.backward(gy, c)
    for tp, group in tp_groups(comm):
        col = ColumnParallelLinear.from_linear(full, group, gather_output=gather_output)
        n = D_HIDDEN // tp
        sl = slice(group.rank * n, (group.rank + 1) * n)
        yt, ct = col.forward(x)
        close(yt, y if gather_output else y[:, sl])
        gxt = col.backward(gy if gather_output else np.ascontiguousarray(gy[:, sl]), ct)
        close(gxt, gx)
        assert identical_on_group(group, gxt)  # all-reduced: bitwise the same on every tp rank
        close(col.weight.grad, full.weight.grad[sl])
        close(col.bias.grad, full.bias.grad[sl])
        state = gather_full_state(col)
        assert np.array_equal(state["weight"], full.weight.data) and np.array_equal(state["bias"], full.bias.data)


@pytest.mark.mpi
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_full(input_is_parallel, world_comm):
    comm = world_comm
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, D_HIDDEN))
    full = Linear(D_HIDDEN, D_MODEL, seed=12)
    y, c = full.forward(x)
    gy = rng.standard_normal(y.shape)
    gx = full.backward(gy, c)
    for tp, group in tp_groups(comm):
        row = RowParallelLinear.from_linear(full, group, input_is_parallel=input_is_parallel)
        k = D_HIDDEN // tp
        sl = slice(group.rank * k, (group.rank + 1) * k)
        yt, ct = row.forward(np.ascontiguousarray(x[:, sl]) if input_is_parallel else x)
        close(yt, y)
        assert identical_on_group(group, yt)
        gxt = row.backward(gy, ct)
        close(gxt, gx[:, sl] if input_is_parallel else gx)
        close(row.weight.grad, full.weight.grad[:, sl])
        close(row.bias.grad, full.bias.grad)
        assert identical_on_group(group, row.bias.grad)  # replicated bias: identical grads
        state = gather_full_state(row)
        assert np.array_equal(state["weight"], full.weight.data) and np.array_equal(state["bias"], full.bias.data)


@pytest.mark.mpi
def test_tensor_parallel_mlp_block_matches_full_and_replicated_grads_agree(world_comm):
    comm = world_comm
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, D_MODEL))  # leading dims are kept
    full = TransformerMLPBlock(D_MODEL, D_HIDDEN, seed=5)
    y, c = full.forward(x)
    gy = rng.standard_normal(y.shape)
    gx = full.backward(gy, c)
    for tp, group in tp_groups(comm):
        block = TensorParallelMLPBlock.from_block(full, group)
        assert [n for n, _ in block.named_children()] == ["ln", "fc1", "act", "fc2"]
        calls0 = block.timer.calls
        yt, ct = block.forward(x)
        fwd_calls = block.timer.calls - calls0
        close(yt, y)
        gxt = block.backward(gy, ct)
        bwd_calls = block.timer.calls - calls0 - fwd_calls
        if tp > 1:
            assert (fwd_calls, bwd_calls) == (1, 1)  # one all-reduce forward (g), one backward (f)
        close(gxt, gx)
        n = D_HIDDEN // tp
        sl = slice(group.rank * n, (group.rank + 1) * n)
        close(block.fc1.weight.grad, full.fc1.weight.grad[sl])
        close(block.fc1.bias.grad, full.fc1.bias.grad[sl])
        close(block.fc2.weight.grad, full.fc2.weight.grad[:, sl])
        for name in ("ln.weight", "ln.bias", "fc2.bias"):  # replicated parameters
            p = dict(block.named_parameters())[name]
            close(p.grad, dict(full.named_parameters())[name].grad)
            assert identical_on_group(group, p.grad), name
        state = gather_full_state(block)
        assert list(state) == [n for n, _ in full.named_parameters()]
        for name, p in full.named_parameters():
            assert np.array_equal(state[name], p.data)


@pytest.mark.mpi
def test_tp_block_input_gradient_matches_finite_differences(world_comm):
    comm = world_comm
    rng = np.random.default_rng(10)
    full = TransformerMLPBlock(D_MODEL, D_HIDDEN, seed=6)
    x = rng.standard_normal((3, D_MODEL))
    w = rng.standard_normal((3, D_MODEL))  # loss = sum(w * y)
    for tp, group in tp_groups(comm):
        block = TensorParallelMLPBlock.from_block(full, group)
        _, ctx = block.forward(x)
        gx = block.backward(w, ctx)
        eps = 1e-6
        num = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            xp_, xm = x.copy(), x.copy()
            xp_[idx] += eps
            xm[idx] -= eps
            num[idx] = (np.sum(w * block.forward(xp_)[0]) - np.sum(w * block.forward(xm)[0])) / (2 * eps)
        np.testing.assert_allclose(gx, num, rtol=1e-6, atol=1e-8)


@pytest.mark.mpi
def test_vocab_parallel_embedding_matches_full(world_comm):
    comm = world_comm
    vocab, dim = 24, 5
    full = Embedding(vocab, dim, seed=2)
    idx = np.random.default_rng(4).integers(0, vocab, size=(4, 7))
    y, c = full.forward(idx)
    gy = np.random.default_rng(5).standard_normal(y.shape)
    full.backward(gy, c)
    for tp, group in tp_groups(comm):
        emb = VocabParallelEmbedding.from_embedding(full, group)
        yt, ct = emb.forward(idx)
        close(yt, y)
        assert emb.backward(gy, ct) is None
        k = vocab // tp
        close(emb.weight.grad, full.weight.grad[group.rank * k:(group.rank + 1) * k])
        assert np.array_equal(gather_full_state(emb)["weight"], full.weight.data)


@pytest.mark.mpi
def test_parallelize_mlp_blocks_keeps_names_and_outputs(world_comm):
    from mpcomm.nn import transformer_mlp_stack
    comm = world_comm
    model = transformer_mlp_stack(3, D_MODEL, D_HIDDEN, seed=1)
    x = np.random.default_rng(3).standard_normal((4, D_MODEL))
    y = model(x)
    for tp, group in tp_groups(comm):
        tpm = parallelize_mlp_blocks(model, group, indices=[0, 2])
        assert isinstance(tpm[0], TensorParallelMLPBlock) and tpm[1] is model[1]
        assert isinstance(tpm[2], TensorParallelMLPBlock)
        close(tpm(x), y)
        state = gather_full_state(tpm)
        assert sorted(state) == sorted(n for n, _ in model.named_parameters())
