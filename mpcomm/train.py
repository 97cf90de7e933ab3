"""``mpcomm-train``: train the deterministic demo workload with one engine and report losses and timing.

    mpiexec -n 4 mpcomm-train --engine ddp --steps 5 --json out.json
    mpiexec -n 4 python -m mpcomm.train --engine 3d --dp 1 --tp 2 --pp 2 --schedule interleaved-1f1b

Engines: ``single`` (one process on the whole global batch; under mpiexec every rank runs it identically),
``ddp`` (:class:`~mpcomm.parallel.DistributedDataParallel`, dp = world), ``fsdp``
(:class:`~mpcomm.parallel.fsdp.FullyShardedDataParallel`, dp = world) and ``pipeline|tp|3d``
(:func:`mpcomm.parallel.threed.train_model_parallel`).  The same seed and global batch give the same losses for
every engine and layout.  A bad configuration (or an unwritable ``--json``) is found before training starts and
reported as one line, exit status 2 on every rank; any other exception on one rank aborts the whole job
(:func:`mpcomm.launch.run_main`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError
from .launch import ArgumentParser, UsageError, root_outputs_problem, run_main
from .nn import Module, make_optimizer, mse_loss
from .parallel.grad_compression import DEFAULT_WARMUP_STEPS, parse_compression
from .workload import Workload, param_checksum

ENGINES = ("single", "ddp", "fsdp", "pipeline", "tp", "3d")
DATA_PARALLEL = ("single", "ddp", "fsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="mpcomm-train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--engine", choices=ENGINES, default="single")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel size (single/ddp/fsdp: the world size)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=None, help="pipeline-parallel size")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="model chunks per pipeline rank (default 1, or 2 with interleaved-1f1b)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=16)
    ap.add_argument("--d-hidden", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--recompute", action="store_true",
                    help="activation recomputation: keep only each block's input, redo its forward in backward")
    ap.add_argument("--fsdp-strategy", choices=FSDP_STRATEGIES, default="full_shard")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP gradient bucket cap")
    ap.add_argument("--compression", default=None, metavar="MODE",
                    help="gradient compression with error feedback: bf16, fp16, int8 (float32 models), "
                         "powersgd:RANK or auto (the cost model's choice per bucket or FSDP unit; off on "
                         "one host); ddp, and fsdp with --fsdp-strategy full_shard or shard_grad_op")
    ap.add_argument("--compression-warmup", type=int, default=DEFAULT_WARMUP_STEPS, metavar="STEPS",
                    help="exact (uncompressed) steps before compression starts")
    ap.add_argument("--no-error-feedback", action="store_true",
                    help="drop each step's compression error instead of adding it to the next step's gradient")
    ap.add_argument("--json", metavar="FILE", default=None, help="write losses, checksum and timing (rank 0)")
    ap.add_argument("--timeline", metavar="FILE", default=None,
                    help="write a Chrome-trace / Perfetto JSON of every rank's calls and the engine's spans (rank 0)")
    return ap


def resolve_layout(args: argparse.Namespace, world: int) -> tuple[int, int, int]:
    """(dp, tp, pp) for ``args.engine`` on ``world`` ranks; raises ConfigError naming the broken constraint."""
    for name in ("dp", "tp", "pp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be a positive integer, got {value}")
    for name in ("steps", "micro_batches", "virtual_stages", "layers", "d_model", "d_hidden", "global_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if not 0 < args.bucket_cap_mb < float("inf"):
        raise ConfigError(f"--bucket-cap-mb must be a positive number of MiB, got {args.bucket_cap_mb}")
    spec = parse_compression(args.compression, args.compression_warmup)
    if spec is not None and args.engine not in ("ddp", "fsdp"):
        raise ConfigError(f"--compression {args.compression} is for --engine ddp or fsdp (got --engine {args.engine})")
    if spec is not None and args.engine == "fsdp" and args.fsdp_strategy not in ("full_shard", "shard_grad_op"):
        raise ConfigError(f"--compression {args.compression} with --engine fsdp compresses the reduce-scatter of "
                          f"--fsdp-strategy full_shard or shard_grad_op (got {args.fsdp_strategy})")
    if spec is not None and spec.mode != "powersgd" and args.dtype != "float32":
        raise ConfigError(f"--compression {args.compression} compresses float32 gradients: add --dtype float32 "
                          f"(got --dtype {args.dtype}), or use powersgd:RANK")
    given = {n: getattr(args, n) for n in ("dp", "tp", "pp")}
    if args.engine == "single":
        if any(v not in (None, 1) for v in given.values()):
            raise ConfigError(f"--engine single runs one process's full model: dp, tp, pp must be 1, got {given}")
        return 1, 1, 1
    if args.engine in ("ddp", "fsdp"):
        if given["tp"] not in (None, 1) or given["pp"] not in (None, 1):
            raise ConfigError(f"--engine {args.engine} is data parallel only: tp and pp must be 1, got "
                              f"tp={given['tp']} pp={given['pp']} (use --engine 3d)")
        dp = world if given["dp"] is None else given["dp"]
        if dp != world:
            raise ConfigError(f"dp*tp*pp == world is required, but dp={dp} * tp=1 * pp=1 = {dp} != world {world}")
        if args.global_batch % dp:
            raise ConfigError(f"--global-batch {args.global_batch} must be divisible by dp={dp}")
        return dp, 1, 1
    if all(v is None for v in given.values()):
        if args.engine == "3d" and world > 1:
            raise ConfigError(f"--engine 3d needs --dp/--tp/--pp with dp*tp*pp == world ({world})")
        given = {"dp": 1, "tp": world if args.engine == "tp" else 1, "pp": world if args.engine == "pipeline" else 1}
    dp, tp, pp = (1 if given[n] is None else given[n] for n in ("dp", "tp", "pp"))
    if dp * tp * pp != world:
        raise ConfigError(f"dp*tp*pp == world is required, but dp={dp} * tp={tp} * pp={pp} = {dp * tp * pp} "
                          f"!= world {world}")
    return dp, tp, pp


# ------------------------------------------------------------------------------------------------ recompute

class Recompute(Module):
    """Wrap a block so forward keeps only its input and backward reruns the forward to rebuild the cache.

    It shares the wrapped module's parameter and child tables, so parameter names, hooks on the parameters and
    ``state_dict`` keys are unchanged.  (Deterministic blocks only: a Dropout inside would draw a new mask.)
    """

    inner: Module  # set through object.__setattr__: it is not a registered child

    def __init__(self, inner: Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "_params", inner._params)
        object.__setattr__(self, "_modules", inner._modules)

    def _forward(self, x):
        y, _ = self.inner.forward(x)
        return y, x

    def _backward(self, grad, x):
        _, ctx = self.inner.forward(x)
        return self.inner.backward(grad, ctx)

    def extra_repr(self) -> str:
        return f"recompute {type(self.inner).__name__}"


def with_recompute(model: Module) -> Module:
    """Replace each top-level child of a Sequential by a :class:`Recompute` wrapper (in place)."""
    for name, child in list(model._modules.items()):
        wrapped = Recompute(child)
        model._modules[name] = wrapped
        object.__setattr__(model, name, wrapped)
    return model


# ------------------------------------------------------------------------------------------------ engines

def _comm_seconds(comm) -> float:
    return sum(r["seconds"] for algos in comm.stats().values() for r in algos.values())


def _build_engine(args, comm, model):
    if args.engine == "single":
        return None
    if args.engine == "ddp":
        from .parallel.ddp import DistributedDataParallel
        return DistributedDataParallel(model, comm, bucket_cap_mb=args.bucket_cap_mb, compression=args.compression,
                                       compression_warmup_steps=args.compression_warmup,
                                       error_feedback=not args.no_error_feedback)
    try:
        from .parallel.fsdp import FullyShardedDataParallel
    except ImportError as exc:
        raise ConfigError(f"--engine fsdp is not available: mpcomm.parallel.fsdp could not be imported ({exc})") \
            from exc
    return FullyShardedDataParallel(model, comm, sharding_strategy=args.fsdp_strategy, compression=args.compression,
                                    compression_warmup_steps=args.compression_warmup,
                                    error_feedback=not args.no_error_feedback)


def train_data_parallel(comm, args, workload: Workload, dp: int) -> dict:
    """``--engine single|ddp|fsdp``: every rank trains its shard (single: the whole batch) for ``args.steps``."""
    model = workload.model()
    if args.recompute:
        with_recompute(model)
    engine = _build_engine(args, comm, model)
    params = model.parameters() if engine is None else engine.parameters()
    opt = make_optimizer(args.optimizer, params, args.lr)
    index = 0 if engine is None else comm.rank
    losses: list[float] = []
    step_seconds: list[float] = []
    timing = {"compute": 0.0, "communication": 0.0, "exposed_wait": 0.0, "other": 0.0, "total": 0.0}
    comm_before = _comm_seconds(comm)
    wait_before = 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = workload.local_batch(step, index, dp)
        t1 = time.perf_counter()
        if engine is None:
            pred, ctx = model.forward(x)
            loss, g = mse_loss(pred, y)
            model.backward(g, ctx)
        else:
            pred, ctx = engine.forward(x)
            loss, g = mse_loss(pred, y)
            engine.backward(g, ctx)
        opt.step()
        t2 = time.perf_counter()
        if engine is None:
            opt.zero_grad()
        else:
            engine.zero_grad()
            loss = float(comm.allreduce(np.array([loss]), op="avg")[0])  # equal shards: mean of shard means
        t3 = time.perf_counter()
        wait = getattr(engine, "timing", {}).get("wait_seconds", 0.0)
        exposed, wait_before = wait - wait_before, wait
        timing["compute"] += (t2 - t1) - exposed
        timing["exposed_wait"] += exposed
        timing["other"] += (t1 - t0) + (t3 - t2)
        timing["total"] += t3 - t0
        losses.append(loss)
        step_seconds.append(t3 - t0)
        if comm.rank == 0:
            print(f"step {step:4d}  loss {loss:.12f}  time {1e3 * (t3 - t0):8.3f} ms", flush=True)
    timing["communication"] = _comm_seconds(comm) - comm_before
    state = model.state_dict() if engine is None else engine.full_state_dict()
    checksum = param_checksum(state.items())
    if comm.rank == 0:
        print(f"param_checksum {checksum:.12f}")
        print(where_the_time_went(args.engine, args.steps, timing), flush=True)
    choices = engine.compression_choices() if hasattr(engine, "compression_choices") else []
    return {"losses": losses, "param_checksum": checksum, "timing": timing, "step_seconds": step_seconds,
            "compression_choices": choices}


def where_the_time_went(engine: str, steps: int, t: dict) -> str:
    head = f"where the time went ({steps} steps, {t['total']:.4f} s on rank 0): "
    if engine == "single":
        return head + f"compute {t['compute']:.4f} s; communication 0 s; other {t['other']:.4f} s (data)"
    if engine == "ddp":
        comm = (f"communication {t['communication']:.4f} s inside collectives (comm.stats()), of which "
                f"{t['exposed_wait']:.4f} s was waited for after backward and the rest overlapped with backward")
        compute = f"compute {t['compute']:.4f} s (forward/backward/optimizer, excluding that wait)"
    else:
        comm = (f"communication {t['communication']:.4f} s inside collectives (comm.stats(); the engine's "
                f"blocking waits are counted in compute, its overlapped transfers are not exposed)")
        compute = f"compute {t['compute']:.4f} s (forward/backward/optimizer)"
    return head + f"{compute}; {comm}; other {t['other']:.4f} s (data, loss all-reduce, zero_grad)"


# ------------------------------------------------------------------------------------------------ entry points

def run(argv: Sequence[str] | None = None, comm: Any = None) -> dict:
    """Parse ``argv``, train, write ``--json`` on rank 0, return the result (raises on bad input)."""
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    from .comm import Communicator
    own = comm is None
    comm = Communicator(MPI.COMM_WORLD) if own else comm
    try:
        dp, tp, pp = resolve_layout(args, comm.size)
        problem = root_outputs_problem(comm, {"--json": args.json, "--timeline": args.timeline})  # before the run
        if problem:
            raise ConfigError(problem)
        workload = Workload(num_layers=args.layers, d_model=args.d_model, d_hidden=args.d_hidden,
                            global_batch=args.global_batch, seed=args.seed, dtype=args.dtype)
        with comm.timeline(args.timeline) if args.timeline else nullcontext():
            result = _train(comm, args, workload, dp, tp, pp)
        out = {"losses": [float(v) for v in result["losses"]], "param_checksum": float(result["param_checksum"]),
               "engine": args.engine, "world": comm.size, "dp": dp, "tp": tp, "pp": pp,
               "timing": result.get("timing", {}), "step_seconds": result.get("step_seconds", []),
               "compression_choices": result.get("compression_choices", []),
               "config": {k: v for k, v in vars(args).items() if k != "json"}}
        if args.json and comm.rank == 0:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return out
    finally:
        if own:
            comm.free()


def _train(comm: Any, args: argparse.Namespace, workload: Workload, dp: int, tp: int, pp: int) -> dict:
    """The training run of :func:`run` with the chosen engine."""
    if args.engine in DATA_PARALLEL:
        if comm.rank == 0:  # the model-parallel engines print their own header, with the schedule
            print(f"[{args.engine}] world {comm.size}: dp={dp} tp={tp} pp={pp} optimizer={args.optimizer} "
                  f"lr={args.lr} dtype={args.dtype} layers={args.layers} d_model={args.d_model} "
                  f"d_hidden={args.d_hidden} global_batch={args.global_batch} recompute={args.recompute}",
                  flush=True)
        return train_data_parallel(comm, args, workload, dp)
    from .parallel.threed import train_model_parallel
    args.dp, args.tp, args.pp = dp, tp, pp
    return train_model_parallel(comm, args, workload)


def _main(argv: Sequence[str] | None) -> int:
    try:
        run(argv)
    except ConfigError as exc:  # the same on every rank: one line, no traceback (run_main)
        raise UsageError(f"mpcomm-train: error: {exc}") from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: like :func:`run`, but a configuration error is one line and exit status 2 on every rank,
    and any other exception on any rank aborts the whole MPI job."""
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
