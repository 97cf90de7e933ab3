"""``mpcomm-bench`` / ``python -m mpcomm.bench``: argument parsing, header, table, JSON and plot.

    mpiexec -n 4 mpcomm-bench --op allreduce --algorithms ring,tree,rhd,native,auto -b 8 -e 64M -f 4 --check

``run(argv)`` is the whole benchmark as a function (tests call it in-process); ``main()`` wraps it in
``mpcomm.launch.run_main`` so that an exception on one rank aborts the job instead of hanging the others.
"""
from __future__ import annotations

import argparse
import re
import sys
from contextlib import nullcontext
from typing import Sequence, TextIO

import numpy as np
from mpi4py import MPI

from ..buffers import SUPPORTED_DTYPES, check_dtype_op
from ..compression import WIRES
from ..errors import ConfigError
from ..launch import ArgumentParser, root_outputs_problem, run_main
from .allreduce import WIRE_ROW
from .driver import (BLOCK_SECONDS, COLLECTIVES, SweepSpec, memcpy_bandwidth, sizes, sweep, timed_algorithms,
                     tty_progress)
from .report import footer_lines, format_row, header_lines, plot, write_json

REDOPS = ("sum", "prod", "min", "max", "avg")
DTYPES = {str(d): d for d in SUPPORTED_DTYPES}
_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32",
            "double": "float64", "fp64": "float64", "int": "int32", "bool_": "bool"}
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    """'8', '64K', '64M', '1G' (binary units, an optional trailing B) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[bB]?\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected an integer with an optional K/M/G suffix")
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be at least 1 byte")
    return value


def _positive_int(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _names(text: str) -> list[str]:
    return [n.strip() for n in str(text).split(",") if n.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mpcomm-bench",
        description="nccl-tests style benchmark of mpcomm's collectives, one row per size and algorithm.",
        epilog="Run under mpiexec -n P (P=1 also works without mpiexec). Sizes take K/M/G suffixes (binary).",
    )
    parser.add_argument("--op", default="allreduce", choices=sorted(COLLECTIVES), help="collective (default allreduce)")
    parser.add_argument("--algorithms", type=_names, default=None,
                        help="comma list of algorithms registered for --op, or 'auto' "
                             "(default: all registered + auto; native is always timed as the baseline)")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=64 * 2**20, help="largest size (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=_positive_int(2), default=4, help="size multiplier (default 4)")
    parser.add_argument("-w", "--warmup", type=_positive_int(0), default=5,
                        help="untimed calls before the first block, at least (they calibrate its length; default 5; "
                             "0: no warm-up and blocks of exactly -n calls)")
    parser.add_argument("-n", "--iters", type=_positive_int(1), default=1000,
                        help=f"calls per timed block, at most: a block lasts {BLOCK_SECONDS * 1e3:g} ms or -n calls, "
                             "whichever comes first (default 1000)")
    parser.add_argument("--budget", type=_positive_float, default=1.0,
                        help="seconds of timed calls per algorithm and point, split over the rounds: caps each "
                             "block at budget/rounds seconds, at least one call (default 1.0)")
    parser.add_argument("--dtype", type=_names, default=["float32"],
                        help=f"comma list or 'all' of: {', '.join(DTYPES)} (default float32)")
    parser.add_argument("--redop", type=_names, default=["sum"],
                        help=f"comma list or 'all' of: {', '.join(REDOPS)} (default sum; ignored by non-reducing ops)")
    parser.add_argument("--rounds", type=_positive_int(1), default=3,
                        help="round-robin blocks per algorithm and point; each reports its median block (default 3; "
                             "1 = one nccl-tests block)")
    parser.add_argument("--check", action="store_true",
                        help="verify every result bitwise against a numpy reference and across ranks; count #wrong")
    parser.add_argument("--json", metavar="FILE", help="write the rows as a JSON list of objects")
    parser.add_argument("--plot", metavar="FILE", help="write busbw vs size (PNG/SVG/PDF by extension; needs matplotlib)")
    parser.add_argument("--timeline", metavar="FILE",
                        help="write a Chrome-trace / Perfetto JSON of every rank's calls (docs/trace.md)")
    parser.add_argument("--tune", action="store_true", help="call comm.tune() first (when this build has it)")
    parser.add_argument("--root", type=_positive_int(0), default=0,
                        help="root of " + ", ".join(sorted(n for n, c in COLLECTIVES.items() if c.rooted))
                             + " (default 0)")
    parser.add_argument("--ranks-per-node", type=_positive_int(1), default=None,
                        help="simulate nodes of this many consecutive ranks (Communicator(ranks_per_node=...))")
    parser.add_argument("--timeout", type=_positive_float, default=None,
                        help="Communicator timeout in seconds (default: MPCOMM_TIMEOUT or 30)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the check inputs (default 1234)")
    parser.add_argument("--wire", type=_names, default=[],
                        help=f"comma list of {', '.join(WIRES)}: allreduce only (float32, sum/avg); also time "
                             "allreduce(wire=W) as rows named 'wire:W', beside the float32 rows")
    return parser


def make_sweep_spec(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> SweepSpec:
    """Validate the arguments against the registry and the world; parser.error (exit 2) on a bad value."""
    cls = COLLECTIVES[args.op]
    available = cls.algorithms()
    algorithms = args.algorithms if args.algorithms is not None else available
    if not algorithms:
        parser.error("--algorithms: give at least one algorithm")
    for name in algorithms:
        if name not in available:
            parser.error(f"--algorithms: {name!r} is not registered for {args.op}; "
                         f"available: {', '.join(available)}")
    algorithms = list(dict.fromkeys(algorithms)) + _wire_rows(parser, args)
    if args.minbytes > args.maxbytes:
        parser.error(f"-b/--minbytes ({args.minbytes}) is larger than -e/--maxbytes ({args.maxbytes})")
    if not 0 <= args.root < world_size:
        parser.error(f"--root {args.root} is out of range for {world_size} rank(s)")

    dtypes = list(DTYPES) if args.dtype == ["all"] else args.dtype
    resolved = []
    for name in dtypes:
        key = _ALIASES.get(name.lower(), name.lower())
        if key not in DTYPES:
            parser.error(f"--dtype: unknown dtype {name!r}; choose from {', '.join(DTYPES)} or 'all'")
        resolved.append(np.dtype(DTYPES[key]))
    redops = list(REDOPS) if args.redop == ["all"] else [r.lower() for r in args.redop]
    for name in redops:
        if name not in REDOPS:
            parser.error(f"--redop: unknown op {name!r}; choose from {', '.join(REDOPS)} or 'all'")
    if not cls.reduces:
        redops = ["none"]

    combos, skipped, reasons = [], [], []
    for dtype in resolved:
        for redop in redops:
            if redop != "none":
                try:
                    check_dtype_op(dtype, redop, cls.operation_name())
                except TypeError as exc:
                    skipped.append(f"{dtype}/{redop}")
                    reasons.append(str(exc))
                    continue
            combos.append((dtype, redop))
    if not combos:
        parser.error("no supported dtype/redop combination: " + "; ".join(reasons))
    for opt in ("json", "plot"):
        if getattr(args, opt) == "":
            parser.error(f"--{opt} needs a file name")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install mpcomm[plot])")
    return SweepSpec(
        operation=args.op, algorithms=algorithms, sizes=sizes(args.minbytes, args.maxbytes, args.stepfactor),
        combos=combos, warmup=args.warmup, iters=args.iters, budget=args.budget, rounds=args.rounds, check=args.check,
        root=args.root, seed=args.seed, skipped=skipped,
    )


def _wire_rows(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The rows ``--wire`` adds (``WIRE_ROW`` + name), after checking it applies to --op, --dtype and --redop."""
    if not args.wire:
        return []
    unknown = [w for w in args.wire if w not in WIRES]
    if unknown:
        parser.error(f"--wire: unknown wire(s) {unknown}; choose from {', '.join(WIRES)}")
    if args.op != "allreduce":
        parser.error(f"--wire applies to --op allreduce, not {args.op}")
    others = [d for d in args.dtype if _ALIASES.get(d.lower(), d.lower()) != "float32"]
    wrong_ops = [r for r in args.redop if r.lower() not in ("sum", "avg")]
    if others or wrong_ops:
        parser.error(f"--wire compresses float32 sum/avg only; drop --dtype {others} / --redop {wrong_ops}")
    return [WIRE_ROW + w for w in dict.fromkeys(args.wire)]


def run(argv: Sequence[str] | None = None, comm=None, out: TextIO | None = None) -> list[dict]:
    """The benchmark. Returns the rows (the same on every rank); rank 0 prints and writes the files.

    ``comm``: a ``mpcomm.Communicator`` to benchmark on (default: a new one over ``MPI.COMM_WORLD``).
    """
    from ..comm import Communicator

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    world = comm.mpi if comm is not None else MPI.COMM_WORLD
    spec = make_sweep_spec(parser, args, world.Get_size())
    owned = comm is None
    if owned:
        try:
            comm = Communicator(world, timeout=args.timeout, ranks_per_node=args.ranks_per_node)
        except ConfigError as exc:  # every rank has it (the settings are agreed): one line, exit 2
            parser.error(str(exc))
    problem = root_outputs_problem(comm, {"--json": args.json, "--plot": args.plot, "--timeline": args.timeline})  # before the run, not after
    if problem:
        if owned:
            comm.free()
        parser.error(problem)
    leader = comm.rank == 0
    out = sys.stdout if out is None else out

    def emit(*lines: str) -> None:
        if leader:
            if progress is not None:
                sys.stderr.write("\r\033[K")
            for line in lines:
                print(line, file=out)
            out.flush()

    progress = tty_progress() if leader else None
    try:
        if args.tune:
            emit(tune(comm, spec))
        cls = COLLECTIVES[spec.operation]
        largest = max(cls.layout(s, d.itemsize, comm.size)[1] for s in spec.sizes for d, _ in spec.combos)
        meta = describe(comm, args, spec, memcpy_bandwidth(largest, comm.mpi), largest)
        emit(*header_lines(meta))
        with comm.timeline(args.timeline) if args.timeline else nullcontext():
            rows = sweep(comm, spec, on_rows=lambda block: emit(*map(format_row, block)), progress=progress)
        emit(*footer_lines(rows, spec.check))
        if args.timeline:
            emit(f"# wrote {args.timeline}")
        if leader and args.json:
            write_json(rows, args.json)
            emit(f"# wrote {args.json}")
        if leader and args.plot:
            plot(rows, args.plot, meta)
            emit(f"# wrote {args.plot}")
        comm.mpi.Barrier()
    finally:
        if owned:
            comm.free()
    return rows


def tune(comm, spec: SweepSpec) -> str:
    """Call ``comm.tune()`` (for this operation and dtype where it takes them); returns a header line."""
    import inspect

    if not hasattr(comm, "tune"):
        return "# --tune: this build's Communicator has no tune(); auto uses its default selector"
    from ..algorithms import REGISTRY

    operation = COLLECTIVES[spec.operation].operation_name()
    if operation not in REGISTRY:
        return f"# --tune: {spec.operation} has no algorithm choice; nothing to tune"
    wanted = {"operations": (operation,), "dtype": str(spec.combos[0][0]), "sizes": spec.sizes}
    accepted = inspect.signature(comm.tune).parameters
    comm.tune(**{k: v for k, v in wanted.items() if k in accepted})
    return (f"# tuned: comm.tune() measured {spec.operation} ({wanted['dtype']}) at the sweep's sizes for the auto "
            "selector")


def describe(comm, args, spec: SweepSpec, memcpy_gbps: float, memcpy_bytes: int) -> dict:
    """The run's context: header lines and plot title."""
    import platform

    from mpi4py import __version__ as mpi4py_version

    cls = COLLECTIVES[spec.operation]
    return {
        "operation": spec.operation,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": mpi4py_version,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "ranks": comm.size,
        "nodes": getattr(comm, "num_nodes", 1),
        "ranks_per_node": comm.ranks_per_node,
        "dtypes": list(dict.fromkeys(str(d) for d, _ in spec.combos)),
        "redops": list(dict.fromkeys(r for _, r in spec.combos)),
        "root": spec.root,
        "rooted": cls.rooted,
        "per_rank_count": cls.per_rank_count,
        "algorithms": timed_algorithms(spec.operation, spec.algorithms),
        "native_added": "native" in cls.algorithms() and "native" not in spec.algorithms,
        "raw_call": cls.raw_call,
        "block_ms": BLOCK_SECONDS * 1e3,
        "minbytes": args.minbytes,
        "maxbytes": args.maxbytes,
        "stepfactor": args.stepfactor,
        "warmup": spec.warmup,
        "iters": spec.iters,
        "budget": spec.budget,
        "rounds": spec.rounds,
        "check": spec.check,
        "memcpy_GBps": memcpy_gbps,
        "memcpy_bytes": memcpy_bytes,
        "busbw_formula": cls.busbw_formula,
        "skipped": spec.skipped,
    }


def main() -> None:
    """Console entry point: ``run`` under mpi4py.run-like semantics (a failing rank aborts the job)."""
    run_main(run, sys.argv[1:])


if __name__ == "__main__":
    main()
