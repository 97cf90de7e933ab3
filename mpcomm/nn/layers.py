"""Layers with explicit backward. ``forward(x) -> (y, ctx)``; ``backward(gy, ctx) -> gx``.

Layers read ``param.data`` at call time (never cached), accumulate into ``param.grad`` and call
``param._grad_ready()`` once each parameter's gradient for this backward is final.
Parameters are reported ready in reverse registration order (bias before weight).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, overload

import numpy as np

from .backend import array_module
from .module import Module, Parameter

_GELU_C = math.sqrt(2.0 / math.pi)


def _sum_leading(a: Any) -> Any:
    """Sum over every axis but the last (for bias-like gradients)."""
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def finish_linear_grads(weight: Parameter, bias: Parameter | None, grad: Any, x: Any) -> None:
    """Gradients of ``y = x @ weight.T + bias`` (any leading axes): bias first, then weight, each final."""
    if bias is not None:
        bias.finish_grad(_sum_leading(grad))
    out_features, in_features = weight.data.shape
    weight.finish_grad(grad.reshape(-1, out_features).T @ x.reshape(-1, in_features))


def finish_embedding_grad(weight: Parameter, rows: Any, grads: Any) -> None:
    """Gradient of a row lookup ``weight[rows]``: ``grads`` scatter-added into the rows (repeats accumulate)."""
    w = weight.data
    xp = array_module(w)
    gw = xp.zeros_like(w)
    rows, grads = rows.reshape(-1), grads.reshape(-1, w.shape[-1])
    if xp is np:
        np.add.at(gw, rows, grads)
    else:  # pragma: no cover - CuPy only
        import cupyx
        cupyx.scatter_add(gw, rows, grads)
    weight.finish_grad(gw)


class Identity(Module):
    """y = x."""

    def _forward(self, x):
        return x, None

    def _backward(self, grad, ctx):
        return grad


class Linear(Module):
    """y = x @ W.T + b with W of shape (out, in); PyTorch's default U(-1/sqrt(in), 1/sqrt(in)) init."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, seed: int = 0,
                 dtype: Any = np.float64):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)).astype(dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, (out_features,)).astype(dtype)) if bias else None

    def _forward(self, x):
        y = x @ self.weight.data.T
        if self.bias is not None:
            y = y + self.bias.data
        return y, x

    def _backward(self, grad, x):
        # Whichever gradient is awaited first. A hooked weight's (DDP launches its bucket from the hook): the
        # all-reduce of the first layer's, which no later backward can hide, then overlaps the input gradient's
        # matmul. Otherwise the input's: the next backward (or pipeline stage) needs it, the weight's only the step.
        if self.weight.awaited:
            finish_linear_grads(self.weight, self.bias, grad, x)
            return grad @ self.weight.data
        gx = grad @ self.weight.data
        finish_linear_grads(self.weight, self.bias, grad, x)
        return gx

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Lookup table y = W[idx], W ~ N(0, 1); gradient w.r.t. integer input is None."""

    def __init__(self, num_embeddings: int, embedding_dim: int, seed: int = 0, dtype: Any = np.float64):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        rng = np.random.default_rng(seed)
        self.weight = Parameter(rng.standard_normal((num_embeddings, embedding_dim)).astype(dtype))

    def _forward(self, idx):
        return self.weight.data[idx], idx

    def _backward(self, grad, idx):
        finish_embedding_grad(self.weight, idx, grad)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Normalise over the last axis, then scale (ones) and shift (zeros)."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: Any = np.float64):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = Parameter(np.ones(dim, dtype=dtype))
        self.bias = Parameter(np.zeros(dim, dtype=dtype))

    def _forward(self, x):
        xp = array_module(x)
        mu = x.mean(axis=-1, keepdims=True)
        xc = x - mu
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)
        xhat = xc * rstd
        return xhat * self.weight.data + self.bias.data, (xhat, rstd)

    def _backward(self, grad, ctx):
        xhat, rstd = ctx
        self.bias.finish_grad(_sum_leading(grad))
        self.weight.finish_grad(_sum_leading(grad * xhat))
        gxhat = grad * self.weight.data
        return rstd * (gxhat - gxhat.mean(axis=-1, keepdims=True)
                       - xhat * (gxhat * xhat).mean(axis=-1, keepdims=True))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class GELU(Module):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

    def _forward(self, x):
        xp = array_module(x)
        t = xp.tanh(_GELU_C * (x + 0.044715 * x * x * x))
        return 0.5 * x * (1.0 + t), (x, t)

    def _backward(self, grad, ctx):
        x, t = ctx
        du = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return grad * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)


class ReLU(Module):
    """y = max(x, 0)."""

    def _forward(self, x):
        mask = x > 0
        return array_module(x).where(mask, x, 0), mask

    def _backward(self, grad, mask):
        return array_module(grad).where(mask, grad, 0)


class Dropout(Module):
    """Inverted dropout with its own seeded generator (host-side, so masks match on every backend).

    Every training-mode forward draws the next mask; the mask lives in ``ctx``. p=0 or eval: identity.
    """

    def __init__(self, p: float = 0.5, seed: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p, self.seed = p, seed
        self.rng = np.random.default_rng(seed)

    def _forward(self, x):
        if not self.training or self.p == 0.0:
            return x, None
        xp = array_module(x)
        keep = self.rng.random(x.shape) >= self.p
        mask = xp.asarray(keep.astype(x.dtype) / (1.0 - self.p))
        return x * mask, mask

    def _backward(self, grad, mask):
        return grad if mask is None else grad * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Sequential(Module):
    """Chain of modules named "0", "1", ...; ``seq[a:b]`` is a Sequential sharing the same modules.

    A slice keeps the original child names (``model[2:4]`` has children "2", "3"), so a pipeline
    stage's ``state_dict`` keys are the full model's keys, and does not rename parameters.
    """

    def __init__(self, *modules: Module):
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    @classmethod
    def _from_named(cls, items: Iterable[tuple[str, Module]]) -> "Sequential":
        seq = cls()
        for name, m in items:
            seq._modules[name] = m
            object.__setattr__(seq, name, m)
        return seq

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    @overload
    def __getitem__(self, idx: int) -> Module: ...

    @overload
    def __getitem__(self, idx: slice) -> "Sequential": ...

    def __getitem__(self, idx: int | slice) -> "Module | Sequential":
        items = list(self._modules.items())
        if isinstance(idx, slice):
            return Sequential._from_named(items[idx])
        return items[idx][1]

    def _forward(self, x):
        ctxs = []
        for m in self._modules.values():
            x, c = m.forward(x)
            ctxs.append(c)
        return x, ctxs

    def _backward(self, grad, ctxs):
        for m, c in zip(reversed(list(self._modules.values())), reversed(ctxs)):
            grad = m.backward(grad, c)
        return grad


class Residual(Module):
    """y = x + module(x)."""

    def __init__(self, module: Module):
        super().__init__()
        self.module = module

    def _forward(self, x):
        y, ctx = self.module.forward(x)
        return x + y, ctx

    def _backward(self, grad, ctx):
        gx = self.module.backward(grad, ctx)
        return grad if gx is None else grad + gx


class TransformerMLPBlock(Module):
    """Pre-norm transformer feed-forward block: y = x + fc2(gelu(fc1(ln(x)))).

    Children ``ln``, ``fc1``, ``act``, ``fc2`` (fc1 is the column-, fc2 the row-parallel candidate).
    """

    def __init__(self, d_model: int, d_hidden: int, seed: int = 0, dtype: Any = np.float64):
        super().__init__()
        self.d_model, self.d_hidden = d_model, d_hidden
        self.ln = LayerNorm(d_model, dtype=dtype)
        self.fc1 = Linear(d_model, d_hidden, seed=seed * 2 + 0, dtype=dtype)
        self.act = GELU()
        self.fc2 = Linear(d_hidden, d_model, seed=seed * 2 + 1, dtype=dtype)

    def _forward(self, x):
        h, c_ln = self.ln.forward(x)
        h, c1 = self.fc1.forward(h)
        h, c_act = self.act.forward(h)
        h, c2 = self.fc2.forward(h)
        return x + h, (c_ln, c1, c_act, c2)

    def _backward(self, grad, ctx):
        c_ln, c1, c_act, c2 = ctx
        g = self.fc2.backward(grad, c2)
        g = self.act.backward(g, c_act)
        g = self.fc1.backward(g, c1)
        g = self.ln.backward(g, c_ln)
        return grad + g

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_hidden={self.d_hidden}"
