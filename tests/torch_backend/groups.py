"""Fresh default process groups for the torch tests: on mpcomm, or on gloo over the same ranks in the same job
(``on_backend``), and the default mpcomm group behind conftest's ``pg`` fixture. Every function here is collective
over ``MPI.COMM_WORLD``."""
from __future__ import annotations

import warnings
from datetime import timedelta

import torch.distributed as dist
from conftest import WORLD, in_step

import mpcomm.integrations.torch as mpt


def init_default(backend: str, seconds: float = 60) -> None:
    """A fresh default group of ``backend`` ("mpcomm" or "gloo") over every rank (destroying any current one)."""
    if dist.is_initialized():
        in_step(dist.destroy_process_group)
    timeout = timedelta(seconds=seconds)
    if backend == "gloo":
        init = mpt.gloo_init_args()
        in_step(lambda: dist.init_process_group("gloo", timeout=timeout, **init))
    else:
        in_step(lambda: mpt.init_process_group(timeout=timeout))


# torch's gloo group joins its worker threads in its destructor. Where the last reference to it is held by a future's
# callback (PowerSGD's hook state holds its group), that destructor runs on the worker thread, whose join of itself
# throws inside a destructor and aborts the process (std::system_error in ~ProcessGroupGloo: 3 in 16 runs of the
# PowerSGD tests on Open MPI). So the test processes keep every gloo group they made until they exit.
_GLOO_GROUPS: list = []


def on_backend(backend: str, program, seconds: float = 60):
    """``program()`` on a fresh default group of ``backend``, raising on every rank if it raised on one."""
    init_default(backend, seconds)
    try:
        return in_step(program)
    finally:
        if backend == "gloo":
            _GLOO_GROUPS.append(dist.group.WORLD)
        in_step(dist.destroy_process_group)


def backend_of(group):
    """The mpcomm Backend torch bound to ``group``'s CPU device (what runs its calls)."""
    import torch

    backend = group._get_backend(torch.device("cpu"))
    assert isinstance(backend, mpt.BackendMpcomm), backend
    return backend


def default_group_on_mpcomm():
    """Yields the default process group on the mpcomm backend, then destroys it (conftest's ``pg`` fixture)."""
    init_default("mpcomm")
    yield dist.group.WORLD
    in_step(dist.destroy_process_group)


def fail_on_rank0_then_destroy(group, rank0) -> None:
    """``rank0()`` on rank 0 alone (it calls what no other rank calls, so it fails there), then ``group`` destroyed
    on every rank: each must warn that the group's MPI communicators stay allocated (messages were left behind)."""
    in_step(rank0 if WORLD.Get_rank() == 0 else lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        in_step(lambda: dist.destroy_process_group(group))
    assert any("without freeing its MPI communicators" in str(w.message) for w in caught)
