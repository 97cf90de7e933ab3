"""Loss functions returning ``(loss_value, grad_wrt_input)`` so engines can start backward directly."""
from __future__ import annotations

from typing import Any

from .backend import array_module


def _reduce_scale(n: int, reduction: str) -> float:
    if reduction == "mean":
        return 1.0 / n
    if reduction == "sum":
        return 1.0
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def mse_loss(pred: Any, target: Any, reduction: str = "mean") -> tuple[float, Any]:
    """Squared error averaged (or summed) over all elements; returns (loss, dloss/dpred)."""
    if pred.shape != target.shape:
        raise ValueError(f"mse_loss: pred shape {pred.shape} != target shape {target.shape}")
    scale = _reduce_scale(pred.size, reduction)
    diff = pred - target
    loss = float((diff * diff).sum()) * scale
    return loss, diff * (2.0 * scale)


def cross_entropy(logits: Any, labels: Any, reduction: str = "mean") -> tuple[float, Any]:
    """Softmax cross entropy over the last axis, labels are integer class ids; numerically stable.

    ``mean`` averages over all label positions (the batch). Returns (loss, dloss/dlogits).
    """
    xp = array_module(logits)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"cross_entropy: logits {logits.shape} need labels of shape {logits.shape[:-1]}, got {labels.shape}")
    scale = _reduce_scale(max(labels.size, 1), reduction)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = xp.exp(shifted)
    sumexp = exp.sum(axis=-1, keepdims=True)
    lab = labels[..., None].astype(xp.int64)
    picked = xp.take_along_axis(shifted, lab, axis=-1)
    loss = float((xp.log(sumexp) - picked).sum()) * scale
    grad = exp / sumexp
    grad -= (xp.arange(logits.shape[-1]) == lab).astype(grad.dtype)
    return loss, grad * scale
