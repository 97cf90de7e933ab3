"""A ``torch.distributed`` backend named ``"mpcomm"``: PyTorch collectives (and so DDP) over mpcomm.

Usage, under ``mpiexec -n P python train.py`` (rank and world size come from MPI; no MASTER_ADDR/PORT)::

    import torch.distributed as dist
    import mpcomm.integrations.torch            # registers the backend (collective: import it on every rank)
    dist.init_process_group("mpcomm")           # or init_method="mpcomm://", or mpcomm.integrations.torch.init_process_group()
    model = torch.nn.parallel.DistributedDataParallel(model)

Importing this module registers the backend (``Backend.register_backend``, extended API, device ``cpu``) and
a rendezvous scheme ``mpcomm://`` that takes rank and size from ``MPI.COMM_WORLD`` and gives torch an
in-process ``HashStore`` (the backend never uses the store). With neither ``store`` nor ``init_method``,
PyTorch always rendezvouses through ``env://``, which reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; so
that a bare ``dist.init_process_group("mpcomm")`` works under ``mpiexec`` too, the import fills in those that
are unset (:func:`set_env_rendezvous_defaults`: rank and size from MPI, rank 0's address and a free port
broadcast over ``MPI.COMM_WORLD``; loopback when every rank is on one host). Variables already set are never
changed, so torchrun-style launches keep theirs.

The process group is a Python ``dist.ProcessGroup`` subclass (as PyTorch's own Python process groups are)
over a private :class:`mpcomm.Communicator` per group (``new_group`` builds one over ``MPI.Comm.Create_group``).
CPU tensors are handed to mpcomm zero-copy through ``Tensor.numpy()`` (bfloat16 through an int16 view as
``ml_dtypes.bfloat16``). Collectives run in issue order on one worker thread, so the caller (DDP's backward
hooks) is not blocked; each returns a ``Work`` built from a ``torch.futures.Future`` completed by that
thread. Point-to-point sends and receives use mpcomm's non-blocking ``isend``/``irecv`` directly. With an
MPI below ``THREAD_MULTIPLE`` the collectives run synchronously in the calling thread instead.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from ..comm import Communicator

try:  # PyTorch >= 2.1
    from torch._C._distributed_c10d import _create_work_from_future
except ImportError:  # pragma: no cover - older torch: a Work subclass carrying the future
    _create_work_from_future = None

BACKEND = "mpcomm"
SCHEME = "mpcomm"

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
}


# ---------------------------------------------------------------------------------------------- tensors
def as_numpy(tensor: torch.Tensor, what: str = "tensor") -> np.ndarray:
    """A numpy array sharing memory with CPU ``tensor`` (bfloat16 as ``ml_dtypes.bfloat16``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"mpcomm backend: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"mpcomm backend: {what} is on {tensor.device}; this backend handles CPU tensors "
            "(move it with .cpu(), or pass CuPy arrays to mpcomm.Communicator directly)"
        )
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def reduce_op_name(op) -> str:
    """The mpcomm op for a ``dist.ReduceOp`` (ValueError for the bitwise and premul-sum ops)."""
    for torch_op, name in _OPS.items():
        if op == torch_op:
            return name
    raise ValueError(f"mpcomm backend: reduce op {op} is not supported (SUM, PRODUCT, MIN, MAX, AVG are)")


def _done_work(result) -> Any:
    future = Future()
    future.set_result(result)
    return _work_from_future(future)


def _work_from_future(future: Future):
    if _create_work_from_future is not None:
        return _create_work_from_future(future)
    return _FutureWork(future)  # pragma: no cover


class _FutureWork(dist._Work):
    """A Work over a torch Future (older PyTorch without ``_create_work_from_future``)."""

    def __init__(self, future: Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


class _P2PWork(dist._Work):
    """A point-to-point Work: waits on mpcomm's request (bounded by the communicator's timeout)."""

    def __init__(self, work, tensors):
        super().__init__()
        self._work, self._tensors = work, tensors
        self._future = Future()
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._lock:
            if not self._future.done():
                self._work.wait(None if timeout is None or timeout == timedelta(0) else timeout.total_seconds())
                self._future.set_result(self._tensors)
        return True

    def is_completed(self) -> bool:
        if self._future.done():
            return True
        if self._work.is_completed():
            self.wait()
            return True
        return False

    def get_future(self) -> Future:
        self.wait()
        return self._future


# ---------------------------------------------------------------------------------------------- process group
class ProcessGroupMpcomm(dist.ProcessGroup):
    """``torch.distributed`` collectives over an :class:`mpcomm.Communicator` (CPU tensors)."""

    def __init__(self, comm: Communicator, algorithm: str = "auto"):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.algorithm = algorithm
        threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mpcomm-torch-{comm.rank}") if threaded else None
        )

    # identity
    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupMpcomm(rank={self.comm.rank}, size={self.comm.size})"

    # ------------------------------------------------------------------ running
    def _enqueue(self, body: Callable[[], None], result) -> Any:
        """Run ``body`` after the collectives issued before it; the Work completes with ``result``."""
        if self._executor is None:
            body()
            return _done_work(result)
        future = Future()

        def run():
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the Work
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._executor.submit(run)
        return _work_from_future(future)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors, opts=None):
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        arrays = [as_numpy(t, "allreduce tensor") for t in tensors]

        def body():
            for array in arrays:
                self.comm.allreduce(array, op=op, algorithm=self.algorithm)

        return self._enqueue(body, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        arrays = [as_numpy(t, "broadcast tensor") for t in tensors]

        def body():
            for array in arrays:
                self.comm.broadcast(array, root=root)

        return self._enqueue(body, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i][r]`` <- rank r's ``input_tensors[i]``."""
        pairs = []
        for i, (outputs, tensor) in enumerate(zip(output_tensors, input_tensors)):
            if len(outputs) != self.comm.size:
                raise ValueError(f"allgather: output list {i} has {len(outputs)} tensors for {self.comm.size} ranks")
            pairs.append(([as_numpy(o, "allgather output") for o in outputs], as_numpy(tensor, "allgather input")))

        def body():
            for outputs, send in pairs:
                gathered = np.empty(self.comm.size * send.size, dtype=send.dtype)
                self.comm.all_gather(send, gathered)
                for r, out in enumerate(outputs):
                    out[...] = gathered[r * send.size : (r + 1) * send.size].reshape(out.shape)

        return self._enqueue(body, output_tensors)

    def _allgather_base(self, output, input, opts=None):
        out, send = as_numpy(output, "all_gather output"), as_numpy(input, "all_gather input")
        return self._enqueue(lambda: self.comm.all_gather(send, out), [output])

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]`` <- reduction over ranks of ``input_tensors[i][rank]``."""
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        pairs = []
        for out, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self.comm.size:
                raise ValueError(f"reduce_scatter: {len(inputs)} input tensors for {self.comm.size} ranks")
            pairs.append((as_numpy(out, "reduce_scatter output"), [as_numpy(t, "reduce_scatter input") for t in inputs]))

        def body():
            for out, inputs in pairs:
                send = np.concatenate([a.reshape(-1) for a in inputs])
                self.comm.reduce_scatter(send, out, op=op)

        return self._enqueue(body, output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        out, send = as_numpy(output, "reduce_scatter output"), as_numpy(input, "reduce_scatter input")
        return self._enqueue(lambda: self.comm.reduce_scatter(send, out, op=op), [output])

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def barrier(self, opts=None):
        return self._enqueue(self.comm.barrier, [])

    # ------------------------------------------------------------------ point to point
    def send(self, tensors, dst: int, tag: int = 0):
        (tensor,) = tensors
        return _P2PWork(self.comm.isend(as_numpy(tensor, "send tensor"), dst, tag), tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        (tensor,) = tensors
        return _P2PWork(self.comm.irecv(as_numpy(tensor, "recv tensor"), src, tag), tensors)

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def abort(self) -> None:
        self.shutdown()


# ---------------------------------------------------------------------------------------------- registration
def _create(backend_opts, options=None) -> ProcessGroupMpcomm:
    """Backend creator (extended API): the group's ranks come from ``global_ranks_in_group``."""
    world = MPI.COMM_WORLD
    ranks = list(backend_opts.global_ranks_in_group or [])
    size, rank = backend_opts.group_size, backend_opts.group_rank
    timeout = backend_opts.timeout.total_seconds() if backend_opts.timeout else None
    if not ranks or ranks == list(range(world.Get_size())):
        if (rank, size) != (world.Get_rank(), world.Get_size()):
            raise ValueError(
                f"mpcomm backend: torch says rank {rank} of {size} but MPI.COMM_WORLD says rank "
                f"{world.Get_rank()} of {world.Get_size()}; launch with mpiexec and take rank/size from MPI "
                "(init_method='mpcomm://')"
            )
        mpi_comm = world.Dup()
    else:
        group = world.Get_group().Incl(ranks)
        mpi_comm = world.Create_group(group, tag=0x6D70)
        group.Free()
    return ProcessGroupMpcomm(Communicator(mpi_comm, timeout=timeout))


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


_registered = False


def register() -> None:
    """Register the ``"mpcomm"`` backend and the ``mpcomm://`` rendezvous (idempotent; done on import)."""
    global _registered
    if _registered:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(SCHEME, _rendezvous)
    except RuntimeError:  # already registered (this module also imported as __main__)
        pass
    _registered = True


def set_env_rendezvous_defaults() -> dict[str, str]:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT where unset, from MPI (collective over
    ``MPI.COMM_WORLD``); returns what it set. MASTER_ADDR is loopback when every rank shares one host, else rank
    0's host name; MASTER_PORT a port that was free on rank 0."""
    import os
    import socket

    world = MPI.COMM_WORLD
    host = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local_rank, one_host = host.Get_rank(), host.Get_size() == world.Get_size()
    host.Free()
    missing = int(not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ))
    address = None
    if world.allreduce(missing, op=MPI.MAX):  # every rank takes the same branch
        if world.Get_rank() == 0:
            name = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else socket.gethostname())
            address = (name, os.environ.get("MASTER_PORT") or str(_free_port(name)))
        address = world.bcast(address, root=0)
    values = {"RANK": str(world.Get_rank()), "WORLD_SIZE": str(world.Get_size()), "LOCAL_RANK": str(local_rank)}
    if address is not None:
        values.update(MASTER_ADDR=address[0], MASTER_PORT=address[1])
    set_here = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(set_here)
    return set_here


def init_process_group(**kwargs) -> None:
    """``dist.init_process_group("mpcomm", init_method="mpcomm://", **kwargs)`` (rank and size from MPI)."""
    register()
    if "store" not in kwargs:
        kwargs.setdefault("init_method", f"{SCHEME}://")
    dist.init_process_group(BACKEND, **kwargs)


def _free_port(address: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


register()
set_env_rendezvous_defaults()


# ---------------------------------------------------------------------------------------------- step-time comparison


def _time_ddp(steps: int, warmup: int, width: int, seed: int) -> tuple[float, list[float]]:
    """Median seconds per DDP training step of an MLP on the current default group, and the losses."""
    import time

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    x, y = torch.randn(64, width, generator=generator), torch.randn(64, 1, generator=generator)
    times, losses = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
        losses.append(float(loss.detach()))
    return float(np.median(times)), losses


def main(argv=None) -> int:
    """``mpiexec -n P python -m mpcomm.integrations.torch``: DDP step time on mpcomm vs gloo, same job."""
    import argparse
    import os

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="MLP width (3 layers, ~2*width^2 parameters)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    results = {}
    init_process_group()
    results["mpcomm"] = _time_ddp(args.steps, args.warmup, args.width, args.seed)
    dist.destroy_process_group()
    if dist.is_gloo_available():
        port = world.bcast(_free_port() if world.Get_rank() == 0 else None, root=0)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.Get_rank(),
                                world_size=world.Get_size())
        results["gloo"] = _time_ddp(args.steps, args.warmup, args.width, args.seed)
        dist.destroy_process_group()
    if world.Get_rank() == 0:
        params = 2 * args.width * args.width + 2 * args.width + args.width + 1
        print(f"DDP step time, {world.Get_size()} ranks, MLP width {args.width} ({params} parameters, "
              f"{params * 4 / 2**20:.1f} MiB of gradients), median of {args.steps} steps:")
        for name, (seconds, losses) in results.items():
            print(f"  {name:7s} {seconds * 1e3:8.2f} ms/step   final loss {losses[-1]:.6f}")
        if "gloo" in results:
            same = results["gloo"][1] == results["mpcomm"][1]
            print(f"  loss trajectories identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
