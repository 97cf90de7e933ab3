"""Large tensors reduced again and again moved onto 2 MiB pages, once each.

MPICH moves a large message between two processes of a host in one copy (CMA), pinning and walking the sender's
pages; on the 4 KiB pages torch allocates by default that makes large all-reduces markedly slower
(bench/results/page_size.md). So the second time a group reduces the same tensor storage of at least ``MIN_BYTES`` —
a DDP bucket, a gradient buffer: memory a training loop reuses — the backend asks the kernel to back it with huge
pages (``madvise(MADV_COLLAPSE)``, Linux >= 6.1; the contents stay as they are). That costs tens of milliseconds per
64 MiB, once (bench/results/torch_allreduce_p2.md); a storage seen only once (a temporary) is never touched.
``MPCOMM_TORCH_HUGEPAGES=0`` switches it off; where the kernel refuses (older kernels, THP disabled) nothing is
tried again.
"""
from __future__ import annotations

import ctypes
import errno
import os
import weakref

import torch

SWITCH = "MPCOMM_TORCH_HUGEPAGES"
MIN_BYTES = 8 << 20  # smaller buffers hold few whole 2 MiB pages and gain little (bench/results/page_size.md)
_HUGE = 2 << 20
_MADV_COLLAPSE = 25  # linux/mman.h
MAX_TRIES = 3  # the kernel may have no free 2 MiB page for a while (EAGAIN): tried again at the next reductions


class HugePages:
    """Which large storages this group has reduced, and the ones already moved onto huge pages."""

    def __init__(self):
        self.enabled = os.environ.get(SWITCH, "1") != "0"
        self._seen: weakref.WeakSet = weakref.WeakSet()  # a storage leaves both sets when torch frees it
        self._collapsed: weakref.WeakSet = weakref.WeakSet()  # done, or not to be tried again
        self._tries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> collapses refused so far
        self.refused = 0  # collapses the kernel could not complete for want of free huge pages
        self._madvise = None

    def reused(self, tensor: torch.Tensor) -> None:
        """Note a reduction of ``tensor`` (a dense CPU tensor of at least ``MIN_BYTES``, which the caller checks:
        small calls stay as cheap as they were); the second one of its storage collapses the storage."""
        if not self.enabled:
            return
        storage = tensor.untyped_storage()
        if storage in self._collapsed:
            return
        if storage not in self._seen:
            self._seen.add(storage)
            return
        tries = self._tries.get(storage, 0) + 1
        if self._collapse(storage.data_ptr(), storage.nbytes()) or tries >= MAX_TRIES:
            self._collapsed.add(storage)
            self._tries.pop(storage, None)
        else:
            self._tries[storage] = tries

    def _collapse(self, address: int, nbytes: int) -> bool:
        """Collapse the whole 2 MiB pages of ``[address, address + nbytes)``; False when the kernel found no free
        huge page for them now (worth another try), True otherwise."""
        start = -(-address // _HUGE) * _HUGE  # the whole 2 MiB pages inside the storage
        end = (address + nbytes) // _HUGE * _HUGE
        if end <= start:
            return True
        if self._madvise is None:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if self._madvise(start, end - start, _MADV_COLLAPSE) == 0:
            return True
        error = ctypes.get_errno()
        if error == errno.EINVAL:
            self.enabled = False  # the kernel has no MADV_COLLAPSE (or no THP): not tried again
        if error in (errno.EAGAIN, errno.ENOMEM):
            self.refused += 1
            return False
        return True
