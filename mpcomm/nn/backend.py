"""Array-backend selection: layers run unchanged on numpy or CuPy arrays."""
from __future__ import annotations

from typing import Any

import numpy as np

from mpcomm.buffers import array_module, is_device_array

__all__ = ["array_module", "to_numpy"]


def to_numpy(a: Any) -> np.ndarray:
    """Copy an array (numpy or CuPy) to a host numpy array."""
    if is_device_array(a):
        return array_module(a).asnumpy(a)
    return np.array(a, copy=True)
