"""``python -m mpcomm.trace DIR`` (or ``mpcomm-trace DIR``): what every rank's flight-recorder dump says."""
from __future__ import annotations

import argparse
import sys

from .analyze import TraceError, analyze, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcomm-trace", description=(
        "Read the flight-recorder dumps (mpcomm_trace_rank_<rank>) in DIR and name the ranks behind or diverging."))
    parser.add_argument("directory", metavar="DIR", help="where the dumps are (the job's MPCOMM_TRACE_DIR)")
    args = parser.parse_args(argv)
    try:
        report = analyze(load(args.directory))
    except TraceError as exc:
        print(f"mpcomm-trace: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
