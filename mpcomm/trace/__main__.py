"""``python -m mpcomm.trace DIR`` (or ``mpcomm-trace DIR``): what every rank's flight-recorder dump says."""
from __future__ import annotations

import argparse
import sys

from .analyze import TraceError, analyze, load, write_for_torch


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A command-line mistake is one line and exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="mpcomm-trace", description=(
        "Read the flight-recorder dumps (mpcomm_trace_rank_<rank>) in DIR and name the ranks behind or diverging."))
    parser.add_argument("directory", metavar="DIR", help="where the dumps are (the job's MPCOMM_TRACE_DIR)")
    parser.add_argument("--for-torch", metavar="OUT", help=(
        "also write copies of the dumps into OUT that torch's own analyzer reads "
        "(python -m torch.distributed.flight_recorder.fr_trace OUT)"))
    args = parser.parse_args(argv)
    try:
        dumps = load(args.directory)
        report = analyze(dumps)
        if args.for_torch:
            write_for_torch(dumps, args.for_torch)
    except TraceError as exc:
        print(f"mpcomm-trace: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
