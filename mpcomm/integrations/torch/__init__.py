"""A ``torch.distributed`` backend named ``"mpcomm"``: PyTorch programs (DDP, FSDP2, DeviceMesh, DTensor) on mpcomm.

Usage, under ``mpiexec -n P python train.py`` (rank and world size come from MPI; no MASTER_ADDR/PORT)::

    import torch.distributed as dist
    import mpcomm.integrations.torch            # registers the backend (collective: import it on every rank)
    dist.init_process_group("mpcomm")           # or init_method="mpcomm://", or mpcomm.integrations.torch.init_process_group()

Importing this package registers the backend (``Backend.register_backend``, extended API, device ``cpu``: so
``"mpcomm"``, ``"cpu:mpcomm"`` and ``"cpu:mpcomm,cuda:nccl"`` all work, and torch binds it to the CPU device as it
does gloo) and a rendezvous scheme ``mpcomm://`` that takes rank and size from ``MPI.COMM_WORLD`` and gives torch
an in-process ``HashStore`` (the backend never uses the store). With neither ``store`` nor ``init_method``, PyTorch always
rendezvouses through ``env://``, which reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; so that a bare
``dist.init_process_group("mpcomm")`` works under ``mpiexec`` too, the import fills in those that are unset
(:func:`set_env_rendezvous_defaults`: rank and size from MPI, rank 0's address and a free port broadcast over
``MPI.COMM_WORLD``; loopback when every rank is on one host). Variables already set are never changed, so
torchrun-style launches keep theirs.

torch builds each process group and registers with it, for ``cpu``, a :class:`~.group.BackendMpcomm` over a private
:class:`mpcomm.Communicator` (``new_group`` and DeviceMesh sub-groups over ``MPI.Comm.Create_group``); the class it
derives from is torch's or ours by torch version (``base.py``); how its calls run is in ``lane.py``,
how tensors and reduce ops map to mpcomm's in ``tensors.py``. ``python -m mpcomm.integrations.torch`` times
DDP steps on mpcomm against gloo, whose group :func:`gloo_init_args` puts over the same ranks (on one host or
several).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

from ...comm import Communicator
from ..ports import free_port
from .group import BACKEND, BackendMpcomm
from .tensors import as_numpy, reduce_op_name, reduction

SCHEME = "mpcomm"
_CREATE_GROUP_TAG = 0x6D70  # MPI.Comm.Create_group's tag for the groups of torch's new_group

__all__ = ["BACKEND", "SCHEME", "BackendMpcomm", "as_numpy", "gloo_init_args", "init_process_group",
           "monitored_barrier", "reduce_op_name", "reduction", "register", "set_env_rendezvous_defaults"]


# ---------------------------------------------------------------------------------------------- registration
def _create(backend_opts, options=None) -> BackendMpcomm:
    """Backend creator (extended API): the group's ranks come from ``global_ranks_in_group``."""
    world = MPI.COMM_WORLD
    ranks = list(backend_opts.global_ranks_in_group or [])
    size, rank = backend_opts.group_size, backend_opts.group_rank
    timeout = backend_opts.timeout.total_seconds() if backend_opts.timeout else None
    owned = None
    if not ranks or ranks == list(range(world.Get_size())):
        if (rank, size) != (world.Get_rank(), world.Get_size()):
            raise ValueError(
                f"mpcomm backend: torch says rank {rank} of {size} but MPI.COMM_WORLD says rank "
                f"{world.Get_rank()} of {world.Get_size()}; launch with mpiexec and take rank/size from MPI "
                "(init_method='mpcomm://')"
            )
        owned = world.Dup()
    else:  # collective over the group's ranks only: torch calls the creator on members alone
        group = world.Get_group().Incl(ranks)
        owned = world.Create_group(group, tag=_CREATE_GROUP_TAG)
        group.Free()
    return BackendMpcomm(Communicator(owned, timeout=timeout), name=str(backend_opts.group_id or ""),
                              owned=owned)


def _rendezvous(url: str, timeout: timedelta | None = None, **kwargs):
    """``mpcomm://``: rank and size from MPI.COMM_WORLD, and an in-process store (the backend needs none)."""
    from urllib.parse import parse_qs, urlparse

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for key, actual in (("rank", rank), ("world_size", size)):
        if key in query and int(query[key]) not in (-1, actual):
            raise ValueError(f"mpcomm:// rendezvous: {key}={query[key]} was passed but MPI says {actual}")
    yield dist.HashStore(), rank, size
    raise RuntimeError("mpcomm:// rendezvous cannot re-rendezvous (the MPI job is fixed)")


def register() -> None:
    """Register the ``"mpcomm"`` backend and the ``mpcomm://`` rendezvous (idempotent; done on import)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(SCHEME, _rendezvous)
    except RuntimeError:  # already registered (this module also imported as __main__)
        pass


def set_env_rendezvous_defaults() -> dict[str, str]:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT where unset, from MPI (collective over
    ``MPI.COMM_WORLD``); returns what it set. MASTER_ADDR and MASTER_PORT as :func:`_store_address` gives them."""
    import os

    world = MPI.COMM_WORLD
    local_rank, one_host = _placement(world)
    missing = int(not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ))
    values = {"RANK": str(world.Get_rank()), "WORLD_SIZE": str(world.Get_size()), "LOCAL_RANK": str(local_rank)}
    if world.allreduce(missing, op=MPI.MAX):  # every rank takes the same branch
        host, port = _store_address(world, one_host, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        values.update(MASTER_ADDR=host, MASTER_PORT=port)
    set_here = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(set_here)
    return set_here


def gloo_init_args() -> dict:
    """The arguments of ``dist.init_process_group`` that put a gloo group over the ranks of this MPI job, to run the
    same program on gloo beside mpcomm (collective over ``MPI.COMM_WORLD``): a TCP store at
    :func:`_store_address`, rank and size from MPI. Where every rank shares one host gloo is put on loopback
    (GLOO_SOCKET_IFNAME=lo, unless set); across hosts it takes the interface of the host's name, its default."""
    import os

    world = MPI.COMM_WORLD
    one_host = _placement(world)[1]
    host, port = _store_address(world, one_host)
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return {"init_method": f"tcp://{host}:{port}", "rank": world.Get_rank(), "world_size": world.Get_size()}


def _placement(world: MPI.Comm) -> tuple[int, bool]:
    """This rank's rank on its host, and whether every rank of ``world`` shares that host (collective)."""
    host = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    placement = host.Get_rank(), host.Get_size() == world.Get_size()
    host.Free()
    return placement


def _store_address(world: MPI.Comm, one_host: bool, host: str | None = None, port: str | None = None
                   ) -> tuple[str, str]:
    """Rank 0's (host, port) for a TCP store, the same on every rank (collective): ``host``, else loopback where
    every rank shares one host, else rank 0's host name; ``port``, else one free there (rank 0's values count)."""
    import socket

    address = None
    if world.Get_rank() == 0:
        host = host or ("127.0.0.1" if one_host else socket.gethostname())
        address = (host, port or str(free_port(host)))
    return world.bcast(address, root=0)


def init_process_group(**kwargs) -> None:
    """``dist.init_process_group("mpcomm", init_method="mpcomm://", **kwargs)`` (rank and size from MPI)."""
    register()
    if "store" not in kwargs:
        kwargs.setdefault("init_method", f"{SCHEME}://")
    dist.init_process_group(BACKEND, **kwargs)


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for mpcomm groups on every torch (torch 2.13's refuses every backend not named
    "gloo" before it reaches the group; 2.14's takes any group with a CPU backend): rank 0 waits up to ``timeout``
    (default: the group's) for every rank and names those that did not arrive."""
    group = dist.group.WORLD if group is None else group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):  # not a group, or one with no backend for cpu
        backend = None
    if not isinstance(backend, BackendMpcomm):
        raise ValueError(f"monitored_barrier: {group!r} has no mpcomm backend for cpu (for gloo groups use "
                         "dist.monitored_barrier)")
    backend.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


register()
set_env_rendezvous_defaults()
