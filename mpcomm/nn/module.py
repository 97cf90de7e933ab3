"""Parameter and Module base classes with functional (caller-owned) backward caches and hooks.

``y, ctx = m.forward(x)`` then ``gx = m.backward(gy, ctx)``: a module stores no per-call
state, so several micro-batches can be in flight through the same module (pipeline parallel).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Callable, Iterator

import numpy as np

from .backend import array_module, to_numpy


class RemovableHandle:
    """Handle returned by every ``register_*_hook``; ``remove()`` unregisters the hook."""

    _ids = itertools.count()

    def __init__(self, registry: "OrderedDict[int, Callable]", fn: Callable):
        self._registry = registry
        self.id = next(RemovableHandle._ids)
        registry[self.id] = fn

    def remove(self) -> None:
        self._registry.pop(self.id, None)


class Parameter:
    """A trainable array. ``.data`` may be reassigned (FSDP swaps in views); ``.grad`` accumulates."""

    def __init__(self, data: Any, name: str = ""):
        self.data = data
        self.grad: Any = None
        self.name = name
        self._grad_hooks: "OrderedDict[int, Callable]" = OrderedDict()

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    def accumulate_grad(self, g: Any) -> None:
        """Add ``g`` into ``.grad`` (allocating on first use) so micro-batches accumulate."""
        if self.grad is None:
            xp = array_module(self.data)
            self.grad = xp.array(g, dtype=self.data.dtype, copy=True).reshape(self.data.shape)
        else:
            self.grad += g

    def finish_grad(self, g: Any) -> None:
        """Accumulate ``g``, the last contribution of this backward, and tell the grad hooks it is final."""
        self.accumulate_grad(g)
        self._grad_ready()

    def register_grad_hook(self, fn: Callable[["Parameter"], None]) -> RemovableHandle:
        """Call ``fn(param)`` each time this parameter's gradient for a backward is complete."""
        return RemovableHandle(self._grad_hooks, fn)

    @property
    def awaited(self) -> bool:
        """Whether a grad hook waits for this gradient (DDP's buckets): layers then finish it before their input's."""
        return bool(self._grad_hooks)

    def _grad_ready(self) -> None:
        for fn in list(self._grad_hooks.values()):
            fn(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none or self.grad is None:
            self.grad = None
        else:
            self.grad[...] = 0

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"


class Module:
    """Base layer. Subclasses implement ``_forward(x) -> (y, ctx)`` and ``_backward(gy, ctx) -> gx``."""

    # set by __init__ through object.__setattr__ (bypassing the registration below)
    _params: "OrderedDict[str, Parameter]"
    _modules: "OrderedDict[str, Module]"
    training: bool
    _fwd_pre_hooks: "OrderedDict[int, Callable]"
    _fwd_post_hooks: "OrderedDict[int, Callable]"
    _bwd_pre_hooks: "OrderedDict[int, Callable]"
    _bwd_post_hooks: "OrderedDict[int, Callable]"

    def __init__(self) -> None:
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)
        for kind in ("fwd_pre", "fwd_post", "bwd_pre", "bwd_post"):
            object.__setattr__(self, f"_{kind}_hooks", OrderedDict())

    # ---- registration -------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_params" not in self.__dict__:
            raise AttributeError("call Module.__init__() before assigning attributes")
        self._params.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._params[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)
        if isinstance(value, (Parameter, Module)):
            self._rename()

    def add_module(self, name: str, module: "Module") -> None:
        setattr(self, name, module)

    def _rename(self, prefix: str = "") -> None:
        """Set every owned Parameter's ``.name`` to its dotted path from this module."""
        for n, p in self.named_parameters(prefix):
            p.name = n

    # ---- traversal ----------------------------------------------------------------------
    def named_parameters(self, prefix: str = "") -> list[tuple[str, Parameter]]:
        """(dotted name, Parameter) pairs in registration order, recursive, deduplicated."""
        out, seen = [], set()
        for name, mod in self.named_modules(prefix):
            for pname, p in mod._params.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{name}.{pname}" if name else pname, p))
        return out

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_modules(self, prefix: str = "") -> list[tuple[str, "Module"]]:
        """(dotted name, Module) pairs, pre-order, this module first (name ``prefix``)."""
        out = [(prefix, self)]
        for name, child in self._modules.items():
            out.extend(child.named_modules(f"{prefix}.{name}" if prefix else name))
        return out

    def modules(self) -> list["Module"]:
        return [m for _, m in self.named_modules()]

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        return iter(list(self._modules.items()))

    def children(self) -> list["Module"]:
        return list(self._modules.values())

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # ---- mode / grads / state -----------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def to(self, xp: Any) -> "Module":
        """Move parameter data and grads to backend ``xp`` (the numpy or cupy module), in place."""
        conv = (lambda a: to_numpy(a)) if xp is np else xp.asarray
        for p in self.parameters():
            p.data = conv(p.data)
            if p.grad is not None:
                p.grad = conv(p.grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            p.zero_grad(set_to_none)

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Name -> copy of the parameter array (same backend as the data)."""
        return OrderedDict((n, array_module(p.data).array(p.data, copy=True)) for n, p in self.named_parameters())

    def load_state_dict(self, state: dict) -> None:
        """Copy arrays into parameters in place; names and shapes must match exactly."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in state]
        unexpected = [n for n in state if n not in params]
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for n, p in params.items():
            shape = tuple(state[n].shape)
            if shape != p.shape:
                raise ValueError(f"load_state_dict: shape mismatch for {n!r}: checkpoint {shape}, model {p.shape}")
        for n, p in params.items():
            xp = array_module(p.data)
            src = state[n]
            if xp is not np and isinstance(src, np.ndarray):
                src = xp.asarray(src)
            elif xp is np:
                src = to_numpy(src)
            p.data[...] = src

    # ---- hooks --------------------------------------------------------------------------
    def register_forward_pre_hook(self, fn: Callable[["Module"], None]) -> RemovableHandle:
        return RemovableHandle(self._fwd_pre_hooks, fn)

    def register_forward_post_hook(self, fn: Callable[["Module"], None]) -> RemovableHandle:
        return RemovableHandle(self._fwd_post_hooks, fn)

    def register_backward_pre_hook(self, fn: Callable[["Module"], None]) -> RemovableHandle:
        return RemovableHandle(self._bwd_pre_hooks, fn)

    def register_backward_post_hook(self, fn: Callable[["Module"], None]) -> RemovableHandle:
        return RemovableHandle(self._bwd_post_hooks, fn)

    @staticmethod
    def _run(hooks: "OrderedDict[int, Callable]", module: "Module") -> None:
        for fn in list(hooks.values()):
            fn(module)

    # ---- compute ------------------------------------------------------------------------
    def forward(self, x: Any) -> tuple[Any, Any]:
        """Run forward pre hooks, ``_forward``, post hooks; return ``(y, ctx)``."""
        self._run(self._fwd_pre_hooks, self)
        out = self._forward(x)
        self._run(self._fwd_post_hooks, self)
        return out

    def backward(self, grad: Any, ctx: Any) -> Any:
        """Run backward pre hooks, ``_backward`` (accumulates param grads), post hooks; return grad_x."""
        self._run(self._bwd_pre_hooks, self)
        gx = self._backward(grad, ctx)
        self._run(self._bwd_post_hooks, self)
        return gx

    def __call__(self, x: Any) -> Any:
        """Convenience inference call: forward and drop the cache."""
        return self.forward(x)[0]

    def _forward(self, x: Any) -> tuple[Any, Any]:
        raise TypeError(f"{type(self).__name__} defines no _forward; every layer must implement it")

    def _backward(self, grad: Any, ctx: Any) -> Any:
        raise TypeError(f"{type(self).__name__} defines no _backward; every layer must implement it")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        name, extra = type(self).__name__, self.extra_repr()
        if not self._modules:
            return f"{name}({extra})"
        lines = [f"{name}("] + ([f"  {extra}"] if extra else [])
        for child_name, child in self._modules.items():
            lines.append(f"  ({child_name}): " + repr(child).replace("\n", "\n  "))
        return "\n".join(lines) + "\n)"
