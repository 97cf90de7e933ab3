"""The deterministic model and synthetic data every engine of ``mpcomm-train`` trains, so runs compare.

The model is a stack of transformer MLP blocks; the data is a fixed random "teacher" mapping, drawn from
the seed, so the same seed and global batch give the same losses for every engine and layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .nn import Sequential, transformer_mlp_stack


@dataclass(frozen=True)
class Workload:
    """Shape of the demo problem: ``num_layers`` blocks of width ``d_model`` (hidden ``d_hidden``)."""

    num_layers: int = 4
    d_model: int = 16
    d_hidden: int = 32
    global_batch: int = 16
    seed: int = 0
    dtype: str = "float64"

    def model(self) -> Sequential:
        """The full model, identical on every rank (engines shard or split it)."""
        return transformer_mlp_stack(self.num_layers, self.d_model, self.d_hidden, seed=self.seed, dtype=self.dtype)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Global batch ``(x, y)`` of step ``step``: shape (global_batch, d_model) each."""
        rng = np.random.default_rng([self.seed, step])
        x = rng.standard_normal((self.global_batch, self.d_model)).astype(self.dtype)
        teacher = np.random.default_rng([self.seed, 10**6]).standard_normal((self.d_model, self.d_model))
        y = np.tanh(x @ teacher.astype(self.dtype)) / 2
        return x, y

    def local_batch(self, step: int, index: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
        """Replica ``index`` of ``parts``'s rows of global batch ``step``: what one data-parallel rank trains on."""
        x, y = self.batch(step)
        return self.shard(x, index, parts), self.shard(y, index, parts)

    @staticmethod
    def shard(array: np.ndarray, index: int, parts: int) -> np.ndarray:
        """Rows of ``array`` belonging to data-parallel replica ``index`` of ``parts`` (equal, contiguous)."""
        if array.shape[0] % parts:
            raise ValueError(f"global batch {array.shape[0]} is not divisible by {parts} data-parallel replicas")
        rows = array.shape[0] // parts
        return array[index * rows : (index + 1) * rows]


def param_checksum(named_arrays) -> float:
    """Order-independent checksum of parameters: the sum of |w| over every array."""
    total = 0.0
    for name, array in sorted(named_arrays):
        total += float(np.abs(np.asarray(array, dtype=np.float64)).sum())
    return total
