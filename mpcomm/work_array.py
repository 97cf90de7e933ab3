"""A collective's buffer as the contiguous 1-D array its algorithm works on, in the dtype it reduces (the wire
dtype, ``buffers.wire_dtype``): a view where the bytes allow it, else a copy written back on exit. float16/bfloat16
widened to float32 and narrowed back take one pass of the extension (``kernels.cast16``: numpy's float16 casts run
at ~2 ns per element here, ~20x its pass); numpy's casts the rest."""
from __future__ import annotations

import numpy as np

from .kernels import CAST16_FROM, cast16


def flat(array):
    """A contiguous 1-D view of ``array`` when possible, else None (the caller copies)."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
    return None


class NoBuffer:
    """``with`` stand-in for :class:`WorkArray` where a rank has no buffer (the non-roots of a rooted collective)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class WorkArray:
    """A contiguous 1-D work array in the wire dtype for ``array``, written back on exit if it is a copy."""

    def __init__(self, array, dtype):
        self.array, self.dtype = array, np.dtype(dtype)

    @staticmethod
    def read(array, dtype):
        """Contiguous 1-D ``array`` in ``dtype``: a view when the bytes allow it, else a copy."""
        return WorkArray._convert(array, dtype)[0]

    @staticmethod
    def _convert(array, dtype):
        view = flat(array)
        if view is not None and view.dtype == dtype:
            return view, False
        if view is not None and view.dtype == np.bool_ and dtype == np.uint8:  # bool reduces as uint8
            return view.view(dtype), False
        if view is not None and view.size >= CAST16_FROM and type(view) is np.ndarray:
            copy = np.empty(view.size, dtype)
            if not cast16(view, copy):
                np.copyto(copy, view, casting="unsafe")  # (astype's cast)
            return copy, True
        # A fresh C-ordered copy: reshape(-1) alone may return a strided view (e.g. of a[::2]), not a copy.
        return array.astype(dtype, order="C").reshape(-1), True

    def __enter__(self):
        self.work, self.copied = self._convert(self.array, self.dtype)
        return self.work

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.copied:
            target = flat(self.array) if self.work.size >= CAST16_FROM else None
            if target is None or not cast16(self.work, target):
                self.array[...] = self.work.reshape(self.array.shape)  # (casts in the one copy: no temporary)
        return False
