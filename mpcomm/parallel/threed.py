"""3D parallel training (data x tensor x pipeline) of the shared workload, and the ``mpcomm-train`` entry for
``--engine pipeline|tp|3d``.

:class:`ThreeDParallel` builds ``ParallelMesh(comm, dp, tp, pp)``; converts the stage's TransformerMLPBlocks into
:class:`~mpcomm.parallel.tensor.TensorParallelMLPBlock` over ``mesh.tp`` (tp > 1; only the blocks this rank
runs); wraps the model in :class:`~mpcomm.parallel.pipeline.PipelineParallel` over ``mesh.pp`` (with ``pp == 1``
it simply runs the whole model micro-batch by micro-batch); and averages gradients over ``mesh.dp`` with one
``allreduce(op="avg")`` of a flat buffer after the pipeline step.  (``DistributedDataParallel`` is not used: it
synchronises inside every ``backward`` call, while a pipeline calls backward once per micro-batch and chunk;
one flat all-reduce per step is simple and correct.)  The optimizer steps locally on each rank's parameters.

Data: every dp replica takes ``workload.shard(batch, dp_index, dp)`` of the global batch and the pipeline
splits it into micro-batches; the loss reported is the mean over the global batch, identical on every rank.
"""
from __future__ import annotations

import argparse
import os
from collections import OrderedDict
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from mpcomm.errors import ConfigError
from mpcomm.mesh import ParallelMesh
from mpcomm.nn import Sequential, make_optimizer, mse_loss
from mpcomm.nn.backend import array_module
from mpcomm.workload import Workload, param_checksum

from .pipeline import PipelineParallel, partition_layers
from ..schedules import bubble_fraction_theory
from .tensor import CommTimer, parallelize_mlp_blocks

if TYPE_CHECKING:
    from mpcomm.comm import Communicator

__all__ = ["ThreeDParallel", "reference_train", "train_model_parallel"]


def reference_train(workload: Workload, steps: int, optimizer: str = "sgd", lr: float = 0.1) -> tuple[list[float],
                    Sequential]:
    """One process, full global batch: ``(losses, model)`` - what every layout must reproduce."""
    model = workload.model()
    opt = make_optimizer(optimizer, model.parameters(), lr)
    losses = []
    for step in range(steps):
        x, y = workload.batch(step)
        out, ctx = model.forward(x)
        loss, g = mse_loss(out, y)
        model.backward(g, ctx)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, model


class ThreeDParallel:
    """dp x tp x pp training of ``workload.model()`` on ``comm`` (all ranks construct it together)."""

    def __init__(self, comm: Communicator, workload: Workload, dp: int = 1, tp: int = 1, pp: int = 1,
                 num_micro_batches: int | None = None, schedule: str = "1f1b", virtual_stages: int = 1,
                 recompute: bool = False, balance: Any = "layers", optimizer: str = "sgd", lr: float = 0.1,
                 order: str = "tp-dp-pp"):
        for name, val in (("dp", dp), ("tp", tp), ("pp", pp)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ConfigError(f"{name} must be a positive integer, got {val!r}")
        if dp * tp * pp != comm.size:
            raise ConfigError(f"dp*tp*pp == world size is required, but {dp}*{tp}*{pp} = {dp * tp * pp} != "
                              f"{comm.size}")
        if workload.global_batch % dp:
            raise ConfigError(f"global_batch % dp == 0 is required, but {workload.global_batch} % {dp} = "
                              f"{workload.global_batch % dp}")
        if tp > 1 and workload.d_hidden % tp:
            raise ConfigError(f"d_hidden % tp == 0 is required for tensor parallelism, but {workload.d_hidden} % "
                              f"{tp} = {workload.d_hidden % tp}")
        local_batch = workload.global_batch // dp
        if num_micro_batches is None:
            num_micro_batches = 2 * pp if local_batch % (2 * pp) == 0 else pp
        if local_batch % num_micro_batches:
            raise ConfigError(f"(global_batch / dp) % micro_batches == 0 is required, but {local_batch} % "
                              f"{num_micro_batches} = {local_batch % num_micro_batches}")
        self.workload, self.sizes = workload, {"dp": dp, "tp": tp, "pp": pp}
        self.mesh = ParallelMesh(comm, dp=dp, tp=tp, pp=pp, order=order)
        model = workload.model()
        v = virtual_stages
        bounds = partition_layers(model, pp * v, balance)  # on the full model: the same on every rank
        k = self.mesh.coords["pp"]
        mine = [i for c in range(v) for i in range(*bounds[c * pp + k])]
        self.tp_timer = CommTimer()
        if tp > 1:
            model = parallelize_mlp_blocks(model, self.mesh.tp, indices=mine, timer=self.tp_timer)
        self.pipeline = PipelineParallel(model, self.mesh.pp, num_micro_batches, schedule=schedule,
                                         virtual_stages=v, balance=[b - a for a, b in bounds],
                                         recompute=recompute)
        self.params = self.pipeline.parameters()
        self.optimizer = make_optimizer(optimizer, self.params, lr)
        self.timing = {"compute": 0.0, "communication": 0.0, "bubble": 0.0, "total": 0.0}

    @property
    def num_micro_batches(self) -> int:
        return self.pipeline.num_micro_batches

    def train_step(self, step: int) -> float:
        """One optimizer step on global batch ``step``; returns the global-batch mean loss (same on all ranks)."""
        t0 = time.perf_counter()
        dp = self.sizes["dp"]
        x, y = self.workload.local_batch(step, self.mesh.coords["dp"], dp)
        # the first step's shapes handshake runs the model, so tensor-parallel collectives, outside any compute
        # action: done first, they are not taken out of the compute time below
        self.pipeline.prepare(x)
        tp_before = self.tp_timer.seconds
        loss = self.pipeline.train_step(x, y)
        t1 = time.perf_counter()
        if dp > 1:
            self._average_grads()
            buf = np.array([loss], dtype=np.float64)
            self.mesh.dp.allreduce(buf, op="avg")
            loss = float(buf[0])
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        t3 = time.perf_counter()
        pt = self.pipeline.last_timing
        tp_comm = self.tp_timer.seconds - tp_before
        compute = pt["compute"] - tp_comm + (t3 - t2)
        communication = tp_comm + (t2 - t1)
        total = t3 - t0
        for k, val in (("compute", compute), ("communication", communication),
                       ("bubble", total - compute - communication), ("total", total)):
            self.timing[k] += val
        return loss

    def _average_grads(self) -> None:
        params = [p for p in self.params if p.grad is not None]
        if len(params) != len(self.params):
            raise RuntimeError("a parameter got no gradient in the pipeline step")
        xp = array_module(params[0].grad)
        for dtype in sorted({np.dtype(p.grad.dtype).str for p in params}):
            group = [p for p in params if np.dtype(p.grad.dtype).str == dtype]
            flat = xp.concatenate([p.grad.reshape(-1) for p in group])
            self.mesh.dp.allreduce(flat, op="avg")
            off = 0
            for p in group:
                p.grad[...] = flat[off:off + p.grad.size].reshape(p.grad.shape)
                off += p.grad.size

    def full_state_dict(self) -> "OrderedDict[str, Any]":
        """The full model's arrays on every rank (collective over tp and pp)."""
        return self.pipeline.full_state_dict()

    def param_checksum(self) -> float:
        return param_checksum(self.full_state_dict().items())


def _arg(args, name, default=None):
    val = getattr(args, name, None)
    return default if val is None else val


def train_model_parallel(comm: Communicator, args: argparse.Namespace, workload: Workload) -> dict:
    """Run ``args.steps`` steps of ``--engine pipeline|tp|3d``; print losses and timing on rank 0.

    For ``--engine pipeline`` / ``tp`` with all of dp, tp, pp left at 1 on a world > 1, the whole world goes to
    pp / tp respectively.  Returns ``{"losses", "param_checksum", "timing", "layout"}`` on every rank.
    """
    engine = _arg(args, "engine", "3d")
    dp, tp, pp = int(_arg(args, "dp", 1)), int(_arg(args, "tp", 1)), int(_arg(args, "pp", 1))
    if dp * tp * pp == 1 and comm.size > 1:
        if engine == "pipeline":
            pp = comm.size
        elif engine == "tp":
            tp = comm.size
    if engine == "pipeline" and tp != 1:
        raise ConfigError(f"--engine pipeline needs tp == 1 (use --engine 3d for tp x pp), got tp={tp}")
    if engine == "tp" and pp != 1:
        raise ConfigError(f"--engine tp needs pp == 1 (use --engine 3d for tp x pp), got pp={pp}")
    schedule = _arg(args, "schedule", "1f1b")
    v = _arg(args, "virtual_stages", None)
    if v is None:
        v = 2 if schedule == "interleaved-1f1b" else 1
    steps = int(_arg(args, "steps", 5))
    engine_obj = ThreeDParallel(comm, workload, dp=dp, tp=tp, pp=pp,
                                num_micro_batches=_arg(args, "micro_batches", None), schedule=schedule,
                                virtual_stages=int(v), recompute=bool(_arg(args, "recompute", False)),
                                optimizer=_arg(args, "optimizer", "sgd"), lr=float(_arg(args, "lr", 0.1)))
    m = engine_obj.num_micro_batches
    if comm.rank == 0:
        print(f"[{engine}] world {comm.size}: dp={dp} tp={tp} pp={pp} schedule={schedule} micro_batches={m} "
              f"virtual_stages={v} recompute={bool(_arg(args, 'recompute', False))} "
              f"optimizer={_arg(args, 'optimizer', 'sgd')} lr={_arg(args, 'lr', 0.1)} layers={workload.num_layers} "
              f"d_model={workload.d_model} d_hidden={workload.d_hidden} global_batch={workload.global_batch}",
              flush=True)
    losses = []
    for step in range(steps):
        loss = engine_obj.train_step(step)
        losses.append(loss)
        if comm.rank == 0:
            print(f"step {step:4d}  loss {loss:.12f}", flush=True)
    checksum = engine_obj.param_checksum()
    timing = dict(engine_obj.timing)
    row = np.array([timing["compute"], timing["communication"], timing["bubble"], timing["total"]])
    table = np.empty((comm.size, 4))
    comm.all_gather(row, table)
    if comm.rank == 0:
        print(f"param_checksum {checksum:.12f}")
        print("where the time went (seconds over all steps; communication = tp all-reduces + dp gradient "
              "all-reduce; bubble = the rest of the step, mostly waiting on pipeline neighbours):")
        print("  rank  (dp,tp,pp)   compute  communication    bubble     total")
        for r in range(comm.size):
            c = engine_obj.mesh.coords_of(r)
            print(f"  {r:4d}  ({c['dp']},{c['tp']},{c['pp']})    {table[r, 0]:8.4f}  {table[r, 1]:13.4f}  "
                  f"{table[r, 2]:8.4f}  {table[r, 3]:8.4f}")
        busy = table[:, 0].sum() / max(table[:, 3].max() * comm.size, 1e-300)
        print(f"  measured idle share 1 - sum(compute)/(P*max(total)) = {1 - busy:.3f}; pipeline bubble theory "
              f"(pp-1)/(v*m+pp-1) = {bubble_fraction_theory(pp, m, int(v)):.3f}"
              + (f" ({comm.size} ranks on {os.cpu_count()} cores: oversubscribed, timings distorted)"
                 if comm.size > (os.cpu_count() or 1) else ""), flush=True)
    return {"losses": losses, "param_checksum": checksum, "timing": timing,
            "layout": {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "micro_batches": m,
                       "virtual_stages": int(v)}}
