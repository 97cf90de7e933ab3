"""``python -m mpcomm.tuning``: tune COMM_WORLD under mpiexec and save the table (``--out FILE``), or print the
cost model's choices for 64..4096 ranks (``--crossovers``)."""
from __future__ import annotations

import argparse

from ..algorithms import REGISTRY
from ..algorithms.auto import print_crossovers
from .measure import DEFAULT_SIZES


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mpcomm.tuning",
                                     description="Time every algorithm on COMM_WORLD; save the table auto uses.")
    parser.add_argument("--out", help="save the measured table to this JSON file (MPCOMM_TUNING_FILE reads it)")
    parser.add_argument("--operations", default="allreduce",
                        help=f"comma-separated, from: {', '.join(REGISTRY)} (default allreduce)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_SIZES[-1])
    parser.add_argument("--crossovers", action="store_true", help="print the cost model's choices for 64..4096 ranks")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="for --crossovers")
    args = parser.parse_args(argv)
    operations = tuple(name.strip() for name in args.operations.split(",") if name.strip())
    unknown = [name for name in operations if name not in REGISTRY]
    if unknown or not operations:
        parser.error(f"--operations: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'none given'}; "
                     f"choose from {', '.join(REGISTRY)}")
    if args.crossovers:
        print_crossovers(ranks_per_node=args.ranks_per_node)
        return
    sizes = [s for s in DEFAULT_SIZES if s <= args.max_bytes]
    if not sizes:
        parser.error(f"--max-bytes {args.max_bytes} is below the smallest size measured ({DEFAULT_SIZES[0]})")
    from ..comm import Communicator  # (here: the Communicator itself imports the measurement)

    comm = Communicator()
    try:
        comm.tune(sizes=sizes, repeats=args.repeats, operations=operations)
        if args.out:
            comm.save_tuning(args.out)
    finally:
        comm.free()

