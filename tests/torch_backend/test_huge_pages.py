"""Large tensors the backend reduces again and again go onto 2 MiB pages (``mpcomm/integrations/torch/pages.py``):
the second reduction of a storage of at least ``MIN_BYTES`` collapses it, once; a storage reduced once, a small
one, or any with ``MPCOMM_TORCH_HUGEPAGES=0`` is left as it is; the contents never change, and the all-reduce
still gives the exact sum of the inputs on every rank.

Whether memory is on huge pages is read from the kernel (``AnonHugePages`` of the tensor's mapping in
``/proc/self/smaps``). The tensors are 40 MiB, above glibc's largest mmap threshold, so each is a fresh mapping of
its own, on 4 KiB pages until collapsed where transparent huge pages are used only on request ("madvise", the
default of most distributions, this machine's included); elsewhere (off, or "always": torch's memory is on huge
pages already) these tests skip.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_huge_pages.py``.
"""
from __future__ import annotations

import ctypes
import errno
import gc
from pathlib import Path

import numpy as np
import pytest
from conftest import WORLD, in_step

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from mpcomm.integrations.torch import pages  # noqa: E402
from torch_backend.groups import backend_of  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                                 reason="transparent huge pages are not in 'madvise' mode on this machine")]
ELEMENTS = 10 << 20  # float32: 40 MiB, at least 19 whole 2 MiB pages wherever it starts
WHOLE_PAGES_KIB = 19 * 2048


def huge_kib(tensor) -> int:
    """kB of the mapping holding ``tensor``'s first byte that the kernel backs with transparent huge pages."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_a_storage_reduced_a_second_time_moves_onto_huge_pages_once():
    reducing = pages.HugePages()
    tensor = torch.arange(ELEMENTS, dtype=torch.float32)
    before, contents = huge_kib(tensor), tensor.clone()
    reducing.reused(tensor)
    assert huge_kib(tensor) == before, "a storage reduced once is left alone"
    reducing.reused(tensor[1:])  # a view of the same storage: the same storage seen again
    assert huge_kib(tensor) >= before + WHOLE_PAGES_KIB
    assert torch.equal(tensor, contents)
    other = torch.ones(ELEMENTS)
    other_before = huge_kib(other)
    reducing.reused(other)
    assert huge_kib(other) == other_before
    del tensor, other
    gc.collect()
    assert len(reducing._seen) == 0 and len(reducing._collapsed) == 0, "freed storages are forgotten"


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(pages.SWITCH, "0")
    reducing = pages.HugePages()
    tensor = torch.ones(ELEMENTS)
    before = huge_kib(tensor)
    for _ in range(3):
        reducing.reused(tensor)
    assert huge_kib(tensor) == before


def test_a_collapse_the_kernel_could_not_do_yet_is_tried_again():
    """EAGAIN (no free 2 MiB page at that moment) leaves the storage to be tried at the next reduction, up to
    MAX_TRIES; the first answer is made EAGAIN here, the second is the kernel's own."""
    reducing = pages.HugePages()
    tensor = torch.arange(ELEMENTS, dtype=torch.float32)
    before, answers = huge_kib(tensor), []
    reducing.reused(tensor)
    kernel = ctypes.CDLL(None, use_errno=True).madvise
    kernel.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def busy_once(address, length, advice):
        if not answers:
            answers.append("EAGAIN")
            ctypes.set_errno(errno.EAGAIN)
            return -1
        answers.append("kernel")
        return kernel(address, length, advice)

    reducing._madvise = busy_once
    reducing.reused(tensor)
    assert reducing.refused == 1 and huge_kib(tensor) == before, "refused: left as it was, to be tried again"
    reducing.reused(tensor)
    assert answers == ["EAGAIN", "kernel"] and huge_kib(tensor) >= before + WHOLE_PAGES_KIB
    reducing.reused(tensor)
    assert answers == ["EAGAIN", "kernel"], "collapsed once: not tried again"


@pytest.mark.mpi
def test_dist_all_reduce_of_a_reused_large_tensor_is_right_and_on_huge_pages(pg):
    """Three synchronous and one asynchronous all-reduce of the same 40 MiB tensor: each equals the exact sum of
    every rank's input (small integers, so any order of addition gives it), and after the second the tensor is on
    huge pages. (The sum is computed here, not from gathered inputs: gathering 40 MiB from every rank four times
    took minutes across the simulated cluster's nodes.)"""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    tensor = torch.empty(ELEMENTS, dtype=torch.float32)
    before, refused_before = huge_kib(tensor), backend_of(pg)._pages.refused
    for call in range(4):
        pattern = np.arange(ELEMENTS) % 1000 + call
        tensor.copy_(torch.from_numpy((pattern + 3 * rank).astype(np.float32)))
        expected = (size * pattern + 3 * sum(range(size))).astype(np.float32)
        if call < 3:
            in_step(lambda: dist.all_reduce(tensor))
        else:
            in_step(lambda: dist.all_reduce(tensor, async_op=True).wait())
        assert np.array_equal(tensor.numpy(), expected)
        if call == 0:
            assert huge_kib(tensor) == before
    refused = backend_of(pg)._pages.refused - refused_before  # (this tensor's: the group may have reduced others)
    if refused == pages.MAX_TRIES:  # (the kernel's answer each time: no free 2 MiB page; a loaded machine's state)
        pytest.skip(f"the kernel found no free huge pages in {refused} tries")
    assert huge_kib(tensor) >= before + WHOLE_PAGES_KIB, f"the kernel refused {refused} of the collapses"
