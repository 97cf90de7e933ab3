"""Tensor (intra-layer) model parallelism, Megatron-LM style, over a tensor-parallel :class:`Communicator`.

* :class:`ColumnParallelLinear` — ``W`` (out, in) split by *output* features: rank ``j`` holds rows
  ``[j*out/t, (j+1)*out/t)`` of ``W`` and of the bias.  Forward is local (Megatron's *f* operator: identity
  forward); ``gather_output=True`` all-gathers the output slices into the full output.  Backward all-reduces the
  partial input gradients over the group (*f*'s backward).
* :class:`RowParallelLinear` — ``W`` split by *input* features: rank ``j`` holds columns ``[j*in/t, ...)``.
  The input is the matching slice (``input_is_parallel=True``) or the full input, sliced locally.  Forward
  all-reduces the partial outputs (Megatron's *g* operator) and adds the (replicated) bias once, after the
  reduction.  Backward is local (plus an all-gather of the input gradient when the input was not parallel).
* :class:`TensorParallelMLPBlock` — ``x + fc2(gelu(fc1(ln(x))))`` with a replicated LayerNorm, column-parallel
  ``fc1`` and row-parallel ``fc2``: exactly one all-reduce in forward (fc2) and one in backward (fc1).
* :class:`VocabParallelEmbedding` — the table split by vocabulary rows; out-of-range ids give zeros locally and
  the all-reduce assembles the lookup.

Every layer is constructible from the corresponding full ``mpcomm.nn`` layer (its weights are sliced, so the
initialisation equals the single-process one) and :func:`gather_full_state` reassembles full arrays.

Uneven splits are **rejected**: a split dimension that is not divisible by the tensor-parallel size raises
:class:`~mpcomm.errors.ConfigError` naming the constraint (``out_features % tp == 0`` etc.).

Replicated parameters (LayerNorm, row-parallel bias) receive bitwise-identical gradients on every tensor-parallel
rank, because everything upstream of them is computed from all-reduced (bitwise identical) values; so no extra
synchronisation is needed for them (tests check this).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from mpcomm.errors import ConfigError
from mpcomm.nn import GELU, Embedding, LayerNorm, Linear, Module, Parameter, Sequential, TransformerMLPBlock
from mpcomm.nn.backend import array_module
from mpcomm.nn.layers import finish_embedding_grad, finish_linear_grads

if TYPE_CHECKING:
    from mpcomm.comm import Communicator

__all__ = [
    "CommTimer", "ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLPBlock", "VocabParallelEmbedding",
    "parallelize_mlp_blocks", "gather_full_state",
]


class CommTimer:
    """Seconds spent in (and number of) tensor-parallel collectives; shared by the layers of one model."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _tp_comm(comm):
    """Accept a Communicator or a ParallelMesh (its ``tp`` communicator)."""
    if hasattr(comm, "tp") and hasattr(comm, "coords"):
        return comm.tp
    if not (hasattr(comm, "allreduce") and hasattr(comm, "size") and hasattr(comm, "rank")):
        raise TypeError(f"expected an mpcomm Communicator or ParallelMesh for tensor parallelism, got {type(comm)!r}")
    return comm


def _check_split(what: str, n: int, tp: int) -> int:
    if n % tp:
        raise ConfigError(f"{what} % tp == 0 is required for tensor parallelism (uneven splits are not supported), "
                          f"but {what} = {n} and tp = {tp} ({n} % {tp} = {n % tp})")
    return n // tp


class _TPModule(Module):
    """Shared plumbing: the group, this rank's index in it, and timed collectives."""

    def _setup(self, comm, timer: CommTimer | None) -> None:
        self.tp_comm = _tp_comm(comm)  # not a Module/Parameter: a plain attribute
        self.tp_size, self.tp_rank = self.tp_comm.size, self.tp_comm.rank
        self.timer = timer if timer is not None else CommTimer()

    def _allreduce(self, buf):
        if self.tp_size == 1:
            return buf
        t0 = time.perf_counter()
        self.tp_comm.allreduce(buf, op="sum")
        self.timer.seconds += time.perf_counter() - t0
        self.timer.calls += 1
        return buf

    def _gather_last(self, local):
        """All-gather slices along the last axis: (..., n) on each rank -> (..., t*n) in rank order."""
        if self.tp_size == 1:
            return local
        xp = array_module(local)
        local = xp.ascontiguousarray(local)
        out = xp.empty((self.tp_size,) + local.shape, dtype=local.dtype)
        t0 = time.perf_counter()
        self.tp_comm.all_gather(local, out)
        self.timer.seconds += time.perf_counter() - t0
        self.timer.calls += 1
        return xp.moveaxis(out, 0, -2).reshape(local.shape[:-1] + (self.tp_size * local.shape[-1],))

    def _gather_rows(self, local):
        """All-gather along the first axis (row blocks in rank order); used for full state dicts."""
        if self.tp_size == 1:
            return array_module(local).array(local, copy=True)
        xp = array_module(local)
        local = xp.ascontiguousarray(local)
        out = xp.empty((self.tp_size * local.shape[0],) + local.shape[1:], dtype=local.dtype)
        self.tp_comm.all_gather(local, out)
        return out


class ColumnParallelLinear(_TPModule):
    """``y_j = x @ W_j.T + b_j`` with ``W_j`` = rows ``j*out/t ... (j+1)*out/t`` of the full weight.

    ``gather_output=False`` returns the local slice (feed it to a :class:`RowParallelLinear` with
    ``input_is_parallel=True``); ``True`` returns the full output (all-gather).  Backward all-reduces the input
    gradient over the group.  ``async_grad_allreduce`` starts that all-reduce (``iallreduce``) before computing
    the weight gradient, so the two overlap (Megatron's async tensor-parallel all-reduce).
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 gather_output: bool = False, seed: int = 0, dtype: Any = np.float64,
                 timer: CommTimer | None = None, async_grad_allreduce: bool = True, _full: Linear | None = None):
        super().__init__()
        self._setup(comm, timer)
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _check_split("out_features", out_features, self.tp_size)
        self.gather_output, self.async_grad_allreduce = gather_output, async_grad_allreduce
        full = _full if _full is not None else Linear(in_features, out_features, bias=bias, seed=seed, dtype=dtype)
        lo, hi = self.tp_rank * self.local_out, (self.tp_rank + 1) * self.local_out
        xp = array_module(full.weight.data)
        self.weight = Parameter(xp.array(full.weight.data[lo:hi], copy=True))
        self.bias = Parameter(xp.array(full.bias.data[lo:hi], copy=True)) if full.bias is not None else None

    @classmethod
    def from_linear(cls, linear: Linear, comm: Communicator, gather_output: bool = False,
                    timer: CommTimer | None = None, async_grad_allreduce: bool = True) -> "ColumnParallelLinear":
        """Slice a full :class:`~mpcomm.nn.Linear` (same init as the single-process model)."""
        return cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                   gather_output=gather_output, timer=timer, async_grad_allreduce=async_grad_allreduce, _full=linear)

    def _forward(self, x):
        y = x @ self.weight.data.T
        if self.bias is not None:
            y = y + self.bias.data
        if self.gather_output:
            y = self._gather_last(y)
        return y, x

    def _backward(self, grad, x):
        if self.gather_output and self.tp_size > 1:
            lo = self.tp_rank * self.local_out
            grad = grad[..., lo:lo + self.local_out]
        gx = grad @ self.weight.data
        work = None
        if self.tp_size > 1:
            gx = array_module(gx).ascontiguousarray(gx)
            if self.async_grad_allreduce:
                t0 = time.perf_counter()
                work = self.tp_comm.iallreduce(gx, op="sum")
                self.timer.seconds += time.perf_counter() - t0
                self.timer.calls += 1
            else:
                self._allreduce(gx)
        finish_linear_grads(self.weight, self.bias, grad, x)
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            self.timer.seconds += time.perf_counter() - t0
        return gx

    def tp_full_state_dict(self) -> "OrderedDict[str, Any]":
        """Full (unsplit) arrays, gathered over the group (collective on the tp communicator)."""
        out = OrderedDict(weight=self._gather_rows(self.weight.data))
        if self.bias is not None:
            out["bias"] = self._gather_rows(self.bias.data)
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out}, tp {self.tp_rank}/"
                f"{self.tp_size}), bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(_TPModule):
    """``y = allreduce_j(x_j @ W_j.T) + b`` with ``W_j`` = columns ``j*in/t ... (j+1)*in/t`` of the full weight.

    ``input_is_parallel=True``: ``x`` is already this rank's slice of the features (output of a
    :class:`ColumnParallelLinear`); ``False``: ``x`` is the full input and is sliced here (backward then
    all-gathers the input gradient).  The bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 input_is_parallel: bool = True, seed: int = 0, dtype: Any = np.float64,
                 timer: CommTimer | None = None, _full: Linear | None = None):
        super().__init__()
        self._setup(comm, timer)
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _check_split("in_features", in_features, self.tp_size)
        self.input_is_parallel = input_is_parallel
        full = _full if _full is not None else Linear(in_features, out_features, bias=bias, seed=seed, dtype=dtype)
        lo, hi = self.tp_rank * self.local_in, (self.tp_rank + 1) * self.local_in
        xp = array_module(full.weight.data)
        self.weight = Parameter(xp.ascontiguousarray(full.weight.data[:, lo:hi]))
        self.bias = Parameter(xp.array(full.bias.data, copy=True)) if full.bias is not None else None

    @classmethod
    def from_linear(cls, linear: Linear, comm: Communicator, input_is_parallel: bool = True,
                    timer: CommTimer | None = None) -> "RowParallelLinear":
        return cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                   input_is_parallel=input_is_parallel, timer=timer, _full=linear)

    def _forward(self, x):
        if not self.input_is_parallel:
            lo = self.tp_rank * self.local_in
            x = x[..., lo:lo + self.local_in]
        elif x.shape[-1] != self.local_in:
            raise ValueError(f"RowParallelLinear: input_is_parallel=True expects the last axis to be this rank's "
                             f"{self.local_in} features, got shape {tuple(x.shape)}")
        y = x @ self.weight.data.T
        y = self._allreduce(array_module(y).ascontiguousarray(y))
        if self.bias is not None:
            y = y + self.bias.data
        return y, x

    def _backward(self, grad, x):
        finish_linear_grads(self.weight, self.bias, grad, x)
        gx = grad @ self.weight.data
        if not self.input_is_parallel:
            gx = self._gather_last(gx)
        return gx

    def tp_full_state_dict(self) -> "OrderedDict[str, Any]":
        xp = array_module(self.weight.data)
        w = self.weight.data
        if self.tp_size > 1:
            # gather (out, in/t) blocks -> (t, out, in/t) -> (out, in)
            g = xp.empty((self.tp_size,) + w.shape, dtype=w.dtype)
            self.tp_comm.all_gather(xp.ascontiguousarray(w), g)
            w = xp.ascontiguousarray(xp.moveaxis(g, 0, 1).reshape(self.out_features, self.in_features))
        else:
            w = xp.array(w, copy=True)
        out = OrderedDict(weight=w)
        if self.bias is not None:
            out["bias"] = xp.array(self.bias.data, copy=True)
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.local_in}, tp {self.tp_rank}/{self.tp_size}), "
                f"out={self.out_features}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class TensorParallelMLPBlock(_TPModule):
    """``y = x + fc2(gelu(fc1(ln(x))))``: LayerNorm replicated, fc1 column-parallel, fc2 row-parallel.

    Children are named ``ln``, ``fc1``, ``act``, ``fc2`` like :class:`~mpcomm.nn.TransformerMLPBlock`, so
    parameter names (and :func:`gather_full_state`) match the full block.
    """

    def __init__(self, d_model: int, d_hidden: int, comm: Communicator, seed: int = 0, dtype: Any = np.float64,
                 timer: CommTimer | None = None, _full: TransformerMLPBlock | None = None):
        super().__init__()
        self._setup(comm, timer)
        _check_split("d_hidden", d_hidden, self.tp_size)
        full = _full if _full is not None else TransformerMLPBlock(d_model, d_hidden, seed=seed, dtype=dtype)
        self.d_model, self.d_hidden = full.d_model, full.d_hidden
        ln = LayerNorm(full.ln.dim, eps=full.ln.eps, dtype=full.ln.weight.dtype)
        xp = array_module(full.ln.weight.data)
        ln.weight.data = xp.array(full.ln.weight.data, copy=True)
        ln.bias.data = xp.array(full.ln.bias.data, copy=True)
        self.ln = ln
        self.fc1 = ColumnParallelLinear.from_linear(full.fc1, self.tp_comm, gather_output=False, timer=self.timer)
        self.act = GELU()
        self.fc2 = RowParallelLinear.from_linear(full.fc2, self.tp_comm, input_is_parallel=True, timer=self.timer)

    @classmethod
    def from_block(cls, block: TransformerMLPBlock, comm: Communicator,
                   timer: CommTimer | None = None) -> "TensorParallelMLPBlock":
        return cls(block.d_model, block.d_hidden, comm, timer=timer, _full=block)

    def _forward(self, x):
        h, c_ln = self.ln.forward(x)
        h, c1 = self.fc1.forward(h)
        h, c_act = self.act.forward(h)
        h, c2 = self.fc2.forward(h)  # the one forward all-reduce
        return x + h, (c_ln, c1, c_act, c2)

    def _backward(self, grad, ctx):
        c_ln, c1, c_act, c2 = ctx
        g = self.fc2.backward(grad, c2)
        g = self.act.backward(g, c_act)
        g = self.fc1.backward(g, c1)  # the one backward all-reduce
        g = self.ln.backward(g, c_ln)
        return grad + g

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_hidden={self.d_hidden} (local {self.d_hidden // self.tp_size})"


class VocabParallelEmbedding(_TPModule):
    """Embedding table split by vocabulary rows; ids outside this rank's range contribute zeros; all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator, seed: int = 0,
                 dtype: Any = np.float64, timer: CommTimer | None = None, _full: Embedding | None = None):
        super().__init__()
        self._setup(comm, timer)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_vocab = _check_split("num_embeddings", num_embeddings, self.tp_size)
        self.start = self.tp_rank * self.local_vocab
        full = _full if _full is not None else Embedding(num_embeddings, embedding_dim, seed=seed, dtype=dtype)
        xp = array_module(full.weight.data)
        self.weight = Parameter(xp.array(full.weight.data[self.start:self.start + self.local_vocab], copy=True))

    @classmethod
    def from_embedding(cls, emb: Embedding, comm: Communicator,
                       timer: CommTimer | None = None) -> "VocabParallelEmbedding":
        return cls(emb.num_embeddings, emb.embedding_dim, comm, timer=timer, _full=emb)

    def _forward(self, idx):
        xp = array_module(self.weight.data)
        mask = (idx >= self.start) & (idx < self.start + self.local_vocab)
        local = xp.where(mask, idx - self.start, 0)
        y = self.weight.data[local]
        y[~mask] = 0
        return self._allreduce(xp.ascontiguousarray(y)), (local, mask)

    def _backward(self, grad, ctx):
        local, mask = ctx
        m = mask.reshape(-1)
        finish_embedding_grad(self.weight, local.reshape(-1)[m], grad.reshape(-1, self.embedding_dim)[m])
        return None

    def tp_full_state_dict(self) -> "OrderedDict[str, Any]":
        return OrderedDict(weight=self._gather_rows(self.weight.data))


def parallelize_mlp_blocks(model: Sequential, comm: Communicator, indices: Sequence[int] | None = None,
                           timer: CommTimer | None = None) -> Sequential:
    """A new Sequential (same child names) whose TransformerMLPBlocks at ``indices`` (all when None) are replaced
    by :class:`TensorParallelMLPBlock` s over ``comm``; other children are shared unchanged."""
    items = list(model.named_children())
    chosen = set(range(len(items))) if indices is None else set(indices)
    out = []
    for i, (name, child) in enumerate(items):
        if i in chosen and isinstance(child, TransformerMLPBlock):
            child = TensorParallelMLPBlock.from_block(child, comm, timer=timer)
        out.append((name, child))
    return Sequential._from_named(out)


def gather_full_state(module: Module, prefix: str = "") -> "OrderedDict[str, Any]":
    """Full (unsplit) parameter arrays of ``module`` by dotted name, tensor-parallel layers gathered.

    Collective over each tensor-parallel layer's group: every rank of the group must call it.
    Names equal those of the corresponding single-process model.
    """
    out: "OrderedDict[str, Any]" = OrderedDict()
    if hasattr(module, "tp_full_state_dict"):
        for n, a in module.tp_full_state_dict().items():
            out[f"{prefix}.{n}" if prefix else n] = a
        return out
    for n, p in module._params.items():
        if p is not None:
            out[f"{prefix}.{n}" if prefix else n] = array_module(p.data).array(p.data, copy=True)
    for n, child in module.named_children():
        out.update(gather_full_state(child, f"{prefix}.{n}" if prefix else n))
    return out
