"""PyTorch's own backend test class, ``DistributedTest._DistTestBase`` (``torch.testing._internal.distributed.
distributed_test``), run under ``mpiexec`` the way PyTorch ran it for its MPI backend: every rank is one process
of the job, ``BACKEND``/``WORLD_SIZE``/``TEMP_DIR`` (with ``barrier/`` and ``test_dir/``)/``INIT_METHOD=env://`` in
the environment, and a ``TestCase`` subclass that provides ``rank``/``world_size``. As ``TestDistBackend._run``
does, every test gets a fresh default process group (``init_process_group`` in ``setUp``, destroyed in
``tearDown``).

    timeout 900 mpiexec -n 3 python tests/torch_backend/distributed_suite.py --backend mpcomm [--tests FILE]
        [--gated NAME FILE ...] [--json OUT] [--expect-pass]

Many tests are gated on the backend's name (``BACKEND != "gloo"``: skip; ``BACKEND == "mpi"``: run the all-to-all
tests), in their decorators and in their bodies. ``--gated NAME FILE`` runs the tests named in FILE from a copy of
the test module imported as if ``BACKEND`` were NAME (decorators and bodies see NAME), while the process group is
still created on ``--backend``: the way to run gloo's (or PyTorch's MPI backend's) own tests on another backend.
``--gated`` may name one NAME with several FILEs (their tests are run together). ``--tests FILE`` runs the tests
named in FILE under the backend's true name (FILE: one name per line, ``#``
comments); with neither, every test runs under the true name, or under ``--gates-as NAME`` for all. ``--expect-pass`` makes the exit status non-zero unless every test run passed
on every rank. A test passes when it passed on every rank; a test skipped on every rank is a skip; anything else is
a failure. Ranks are kept in step with ``MPI.COMM_WORLD`` barriers around each test, so one rank's failure cannot
shift the next test's collectives.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import unittest

from mpi4py import MPI

from mpcomm.integrations.ports import free_port

WORLD = MPI.COMM_WORLD


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=os.environ.get("BACKEND", "mpcomm"), help="mpcomm or gloo")
    parser.add_argument("--gates-as", default=None, metavar="NAME",
                        help="run every test with the test module's BACKEND set to NAME (exploration)")
    parser.add_argument("--tests", default=None, metavar="FILE", help="run the tests named in FILE")
    parser.add_argument("--gated", nargs=2, action="append", default=[], metavar=("NAME", "FILE"),
                        help="also run the tests named in FILE with the test module's BACKEND set to NAME")
    parser.add_argument("-k", dest="pattern", default=None, help="run only tests whose name contains this")
    parser.add_argument("--json", default=None, metavar="OUT", help="write every test's outcome to OUT (rank 0)")
    parser.add_argument("--expect-pass", action="store_true", help="exit 1 unless every test run passed")
    parser.add_argument("--test-timeout", type=float, default=300.0,
                        help="seconds after which a test that has not finished dumps the stacks and ends the job")
    return parser.parse_args(argv)


def prepare_environment(args: argparse.Namespace) -> str:
    """The variables PyTorch's MPI run set, before the test module reads them; returns TEMP_DIR (shared)."""
    temp_dir = None
    if WORLD.Get_rank() == 0:
        temp_dir = tempfile.mkdtemp(prefix="mpcomm-disttest-")
        for sub in ("barrier", "test_dir"):
            os.mkdir(os.path.join(temp_dir, sub))
    temp_dir = WORLD.bcast(temp_dir, root=0)
    os.environ.update(WORLD_SIZE=str(WORLD.Get_size()),
                      RANK=str(WORLD.Get_rank()), TEMP_DIR=temp_dir, INIT_METHOD="env://",
                      MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return temp_dir


def load_test_module(name_as: str):
    """A fresh copy of PyTorch's distributed_test module whose ``BACKEND`` is ``name_as`` (it is read from the
    environment at import, by the skip decorators, and at run time, by test bodies and some decorators)."""
    os.environ["BACKEND"] = name_as
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    copy = importlib.util.spec_from_file_location(f"distributed_test_as_{name_as}", spec.origin)
    module = importlib.util.module_from_spec(copy)
    sys.modules[copy.name] = module
    copy.loader.exec_module(module)
    return module


def build_case_class(dt, backend: str):
    """The TestCase over ``dt._DistTestBase`` (``dt`` from load_test_module): rank/world_size from MPI, a fresh
    default group of ``backend`` per test."""
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase

    skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}

    class DistributedSuiteUnderMPI(TestCase, dt.DistributedTest._DistTestBase):
        rank = WORLD.Get_rank()

        @property
        def world_size(self):  # as TestDistBackend: the environment's string
            return os.environ["WORLD_SIZE"]

        def setUp(self):
            super().setUp()
            os.environ["BACKEND"] = dt.BACKEND
            WORLD.Barrier()
            if self.rank == 0:
                dt.Barrier.init()
            dt.Barrier.barrier_id = 0
            os.environ["MASTER_PORT"] = str(WORLD.bcast(free_port() if self.rank == 0 else None, root=0))
            WORLD.Barrier()
            seconds = dt.CUSTOM_PG_TIMEOUT.get(self._testMethodName, dt.default_pg_timeout)
            dist.init_process_group(init_method=os.environ["INIT_METHOD"], backend=backend,
                                    world_size=int(self.world_size), rank=self.rank,
                                    timeout=dt.timedelta(seconds=seconds))
            self._barrier()

        def tearDown(self):
            WORLD.Barrier()  # every rank has left the test, whatever happened in it
            if dist.is_initialized():
                dist.destroy_process_group()
            super().tearDown()

        def _callTestMethod(self, method):
            """The decorators that skip by exiting the process (``sys.exit(TEST_SKIPS[...].exit_code)``, made for
            PyTorch's process-per-test runner) skip here instead."""
            try:
                return super()._callTestMethod(method)
            except SystemExit as exc:
                if exc.code in skip_codes:
                    raise unittest.SkipTest(skip_codes[exc.code]) from None
                raise

    DistributedSuiteUnderMPI.__name__ = f"DistributedSuite_{backend}_as_{dt.BACKEND}"
    return DistributedSuiteUnderMPI


class _Outcomes(unittest.TestResult):
    """This rank's outcome per test: pass / skip (reason) / fail (first lines of the error)."""

    def __init__(self, log):
        super().__init__()
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.seconds: dict[str, float] = {}
        self._log = log

    @staticmethod
    def label(test) -> str:
        return test._testMethodName + getattr(test, "label_suffix", "")

    def startTest(self, test):
        super().startTest(test)
        self._start = time.perf_counter()
        self._log(f"start {self.label(test)}")

    def stopTest(self, test):
        super().stopTest(test)
        name = self.label(test)
        self.outcomes.setdefault(name, ("pass", ""))
        self.seconds[name] = time.perf_counter() - self._start

    def addSkip(self, test, reason):
        self.outcomes[self.label(test)] = ("skip", str(reason))

    def _fail(self, test, err):
        text = "".join(traceback.format_exception(*err))
        self.outcomes[self.label(test)] = ("fail", text[-3000:])

    addError = addFailure = _fail

    def addExpectedFailure(self, test, err):
        self.outcomes[self.label(test)] = ("fail", "expected failure (marked by PyTorch)")

    def addUnexpectedSuccess(self, test):
        self.outcomes[self.label(test)] = ("pass", "unexpected success")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._fail(test, err)


def combine(per_rank: list[dict[str, tuple[str, str]]]) -> dict[str, dict]:
    """One outcome per test from every rank's: pass on all = pass, skip on all = skip, else fail."""
    combined = {}
    for name in per_rank[0]:
        states = [outcomes[name] for outcomes in per_rank]
        kinds = {kind for kind, _ in states}
        if kinds == {"pass"}:
            combined[name] = {"outcome": "pass"}
        elif kinds == {"skip"}:
            combined[name] = {"outcome": "skip", "reason": states[0][1]}
        else:
            details = {r: text for r, (kind, text) in enumerate(states) if kind != "pass"}
            combined[name] = {"outcome": "fail", "ranks": details}
    return combined


def read_names(path: str) -> list[str]:
    with open(path) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def select(case, path: str | None, pattern: str | None) -> list[str]:
    """The test names of ``case`` listed in ``path`` (all without one) that contain ``pattern``."""
    names = sorted(n for n in dir(case) if n.startswith("test_"))
    if path:
        wanted = read_names(path)
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"{path}: no such tests in _DistTestBase: {', '.join(unknown)}")
        names = [n for n in names if n in set(wanted)]
    return [n for n in names if pattern is None or pattern in n]


def main(argv=None) -> int:
    args = parse_args(argv)
    temp_dir = prepare_environment(args)
    rank = WORLD.Get_rank()
    log_start = time.perf_counter()

    def log(message: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - log_start:7.1f}s] {message}", file=sys.stderr, flush=True)

    if args.backend == "mpcomm":
        import mpcomm.integrations.torch  # noqa: F401  (registers the backend)
    runs = []  # (case class, test names)
    if args.tests or not args.gated:
        case = build_case_class(load_test_module(args.gates_as or args.backend), args.backend)
        runs.append((case, select(case, args.tests, args.pattern)))
    gated_files: dict[str, list[str]] = {}  # one module copy per name: a second would shadow the first's classes
    for name_as, path in args.gated:
        gated_files.setdefault(name_as, []).append(path)
    for name_as, paths in gated_files.items():
        gated = build_case_class(load_test_module(name_as), args.backend)
        gated.label_suffix = f" [as {name_as}]"
        runs.append((gated, sorted({name for path in paths for name in select(gated, path, args.pattern)})))
    result = _Outcomes(log)
    faulthandler.enable()
    start = time.perf_counter()
    try:
        for case, names in runs:
            for name in names:
                faulthandler.dump_traceback_later(args.test_timeout, exit=True)
                case(name).run(result)
                faulthandler.cancel_dump_traceback_later()
    finally:
        WORLD.Barrier()
        if rank == 0:
            shutil.rmtree(temp_dir, ignore_errors=True)
    elapsed = time.perf_counter() - start
    everyone = WORLD.gather(result.outcomes, root=0)
    seconds = WORLD.gather(result.seconds, root=0)
    if rank != 0:
        return 0
    combined = combine(everyone)
    for name, record in combined.items():
        record["seconds"] = round(max(s[name] for s in seconds), 3)
    counts = {kind: sum(1 for r in combined.values() if r["outcome"] == kind) for kind in ("pass", "skip", "fail")}
    gates = f", BACKEND read as {args.gates_as}" if args.gates_as else ""
    print(f"DistributedTest._DistTestBase on {args.backend}{gates}, {WORLD.Get_size()} ranks, {elapsed:.0f} s: "
          f"{len(combined)} tests")
    for name, record in combined.items():
        if record["outcome"] == "skip" and args.expect_pass:
            print(f"  SKIP {name}: {record['reason']}")
    for name, record in combined.items():
        if record["outcome"] == "fail":
            lines = [line for line in next(iter(record["ranks"].values())).strip().splitlines()
                     if line.strip() and "PYTORCH_PRINT_REPRO" not in line and "To execute this test" not in line
                     and "distributed_suite.py Distributed" not in line]
            print(f"  FAIL {name}: {lines[-1].strip() if lines else ''}")
    print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "gates_as": args.gates_as, "world_size": WORLD.Get_size(),
                       "seconds": round(elapsed, 1), "counts": counts, "tests": combined}, f, indent=1)
    return 1 if args.expect_pass and (counts["fail"] or counts["skip"]) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    WORLD.Barrier()
    sys.exit(WORLD.bcast(code, root=0))
