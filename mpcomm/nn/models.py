"""Deterministic model builders whose top-level children are layers/blocks (so pipeline splits work)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .layers import GELU, Identity, Linear, ReLU, Sequential, TransformerMLPBlock
from .module import Module

_ACTIVATIONS = {"gelu": GELU, "relu": ReLU, "identity": Identity, None: None}


def mlp(sizes: Sequence[int], activation: str | None = "gelu", seed: int = 0, dtype: Any = np.float64) -> Sequential:
    """Linear(sizes[0], sizes[1]), act, ..., Linear(sizes[-2], sizes[-1]) (no activation after the last).

    Linear i uses seed ``seed * 1000 + i``.
    """
    if len(sizes) < 2:
        raise ValueError(f"mlp needs at least two sizes, got {list(sizes)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose from {sorted(k for k in _ACTIVATIONS if k)}")
    act = _ACTIVATIONS[activation]
    layers: list[Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(a, b, seed=seed * 1000 + i, dtype=dtype))
        if act is not None and i < len(sizes) - 2:
            layers.append(act())
    return Sequential(*layers)


def transformer_mlp_stack(num_layers: int, d_model: int, d_hidden: int, seed: int = 0,
                          dtype: Any = np.float64) -> Sequential:
    """Sequential of ``num_layers`` TransformerMLPBlocks; block i uses seed ``seed * 1000 + i``."""
    return Sequential(*[TransformerMLPBlock(d_model, d_hidden, seed=seed * 1000 + i, dtype=dtype)
                        for i in range(num_layers)])
