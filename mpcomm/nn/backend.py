"""Array-backend selection: layers run unchanged on numpy or CuPy arrays."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

try:  # pragma: no cover - depends on the machine
    import cupy as _cupy
except Exception:  # ImportError, or a CUDA runtime failure at import
    _cupy = None


def array_module(*arrays: Any) -> ModuleType:
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def to_numpy(a: Any) -> np.ndarray:
    """Copy an array (numpy or CuPy) to a host numpy array."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)
    return np.array(a, copy=True)
