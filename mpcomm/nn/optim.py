"""SGD and Adam with PyTorch's exact update formulas, updating ``p.data`` in place (views stay valid)."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable

from .backend import array_module, to_numpy
from .module import Parameter


def _like(v: Any, ref: Any) -> Any:
    """Copy array ``v`` onto ``ref``'s backend and dtype; pass scalars through."""
    if not hasattr(v, "shape"):
        return v
    xp = array_module(ref)
    return xp.array(to_numpy(v) if xp.__name__ == "numpy" else v, dtype=ref.dtype)


class Optimizer(ABC):
    """Single param-group optimizer; per-parameter state is keyed by position in ``params``."""

    _hyper: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Parameter]):
        self.params: list[Parameter] = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("optimizer got the same Parameter more than once")
        self.state: dict[int, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.zero_grad(set_to_none)

    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._update(p, self.state.setdefault(i, {}))

    @abstractmethod
    def _update(self, p: Parameter, state: dict) -> None:
        """Apply one step to ``p.data`` in place, keeping per-parameter ``state``."""

    def state_dict(self) -> dict:
        """{"hyperparams": {...}, "state": {index: {key: copy}}} (arrays keep their backend)."""
        def cp(v):
            return array_module(v).array(v, copy=True) if hasattr(v, "shape") else v
        return {"hyperparams": {k: getattr(self, k) for k in self._hyper},
                "state": {i: {k: cp(v) for k, v in s.items()} for i, s in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore hyperparameters and state; array shapes must match the parameters."""
        for i, s in sd["state"].items():
            i = int(i)
            if not 0 <= i < len(self.params):
                raise ValueError(f"optimizer state for parameter index {i}, but only {len(self.params)} params")
            p = self.params[i]
            for k, v in s.items():
                if hasattr(v, "shape") and tuple(v.shape) != p.shape:
                    raise ValueError(f"optimizer state {k!r} of param {i} ({p.name!r}) has shape "
                                     f"{tuple(v.shape)}, parameter has {p.shape}")
        for k, v in sd.get("hyperparams", {}).items():
            setattr(self, k, v)
        self.state = {int(i): {k: _like(v, self.params[int(i)].data) for k, v in s.items()}
                      for i, s in sd["state"].items()}

class SGD(Optimizer):
    """torch.optim.SGD: g += wd*p; buf = m*buf + (1-dampening)*g (buf=g first); nesterov: g += m*buf."""

    _hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0")
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov

    def _update(self, p: Parameter, state: dict) -> None:
        g = p.grad
        if self.weight_decay != 0:
            g = g + self.weight_decay * p.data
        if self.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = array_module(g).array(g, copy=True)
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        p.data -= self.lr * g


class Adam(Optimizer):
    """torch.optim.Adam (amsgrad=False): L2 weight decay into the gradient, bias-corrected moments."""

    _hyper = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay

    def _update(self, p: Parameter, state: dict) -> None:
        xp = array_module(p.data)
        b1, b2 = self.betas
        if not state:
            state.update(step=0, exp_avg=xp.zeros_like(p.data), exp_avg_sq=xp.zeros_like(p.data))
        state["step"] += 1
        t = state["step"]
        g = p.grad
        if self.weight_decay != 0:
            g = g + self.weight_decay * p.data
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * (g * g)
        step_size = self.lr / (1.0 - b1 ** t)
        denom = xp.sqrt(v) / math.sqrt(1.0 - b2 ** t) + self.eps
        p.data -= step_size * (m / denom)


def clip_grad_norm_(params: Iterable[Parameter], max_norm: float,
                    reduce_sq: Callable[[float], float] | None = None) -> float:
    """Scale grads so their global L2 norm is <= max_norm (torch's clip_coef); returns the norm.

    ``reduce_sq`` maps the local sum of squares to the global one (e.g. an allreduce over shards).
    """
    grads = [p.grad for p in params if p.grad is not None]
    sq = sum(float((g * g).sum()) for g in grads)
    if reduce_sq is not None:
        sq = float(reduce_sq(sq))
    total = math.sqrt(sq)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g *= coef
    return total


def make_optimizer(name: str, params: Iterable[Parameter], lr: float) -> Optimizer:
    """``"sgd"`` -> SGD(lr), ``"adam"`` -> Adam(lr), other settings at their defaults (as mpcomm-train uses them)."""
    if name == "sgd":
        return SGD(params, lr=lr)
    if name == "adam":
        return Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")
