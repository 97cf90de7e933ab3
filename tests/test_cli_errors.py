"""User errors of the command lines reach the terminal every time, as ONE line and a non-zero exit; an mpcomm error
escaping a plain ``mpiexec -n P python script.py`` ends the job.

Real ``mpiexec`` runs (subprocesses), so these run in the serial pytest pass only:

    python -m pytest -q tests/test_cli_errors.py
    MPCOMM_TEST_REPEAT=20 python -m pytest -q tests/test_cli_errors.py -k repeated    (the 20-run check)

Before: ``mpcomm-bench`` printed argument errors on rank 0 and then called MPI_Abort, which lost the message in 11
of 24 runs at p = 2; ``mpcomm-train`` printed a full traceback per rank for a bad configuration; ``--json`` into a
missing directory failed after the whole run; an uncaught ``CommTimeoutError`` left the job alive until killed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import mpiexec_path, serial_only

ROOT = Path(__file__).resolve().parent.parent
REPEAT = int(os.environ.get("MPCOMM_TEST_REPEAT", "4"))
MISSING_DIR = "/nonexistent-mpcomm-dir/sub"

pytestmark = serial_only


def launch(ranks: int, argv: list[str], timeout: float = 120, prefix: tuple = ()) -> subprocess.CompletedProcess:
    """``argv`` (after ``python``) on ``ranks`` processes: under mpiexec, or directly for one process (``prefix``:
    a command that runs the launcher)."""
    command = [sys.executable, *argv]
    if ranks > 1:
        command = [mpiexec_path(), "-n", str(ranks), *command]
    command = [*prefix, *command]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, prog: str, *fragments: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    detail = f"rc={proc.returncode}\n--- stderr\n{proc.stderr}--- stdout\n{proc.stdout}"
    assert proc.returncode == 2, detail
    assert len(lines) == 1, detail
    assert lines[0].startswith(f"{prog}: error: "), detail
    for fragment in fragments:
        assert fragment in lines[0], detail
    assert proc.stdout == "", detail  # nothing ran


USER_ERRORS = {
    "bench: unknown --op": (["-m", "mpcomm.bench", "--op", "bogus"], "mpcomm-bench", ["invalid choice: 'bogus'"]),
    "bench: --root out of range": (["-m", "mpcomm.bench", "--root", "99"], "mpcomm-bench", ["--root 99"]),
    "bench: --json into a missing directory": (
        ["-m", "mpcomm.bench", "-e", "64", "--json", f"{MISSING_DIR}/rows.json"], "mpcomm-bench",
        ["--json", MISSING_DIR]),
    "train: unknown --engine": (["-m", "mpcomm.train", "--engine", "bogus"], "mpcomm-train",
                                ["invalid choice: 'bogus'"]),
    "train: layout does not fit the world": (["-m", "mpcomm.train", "--engine", "ddp", "--dp", "99"], "mpcomm-train",
                                             ["dp*tp*pp == world"]),
    "train: --json into a missing directory": (
        ["-m", "mpcomm.train", "--engine", "ddp", "--steps", "1", "--global-batch", "12",
         "--json", f"{MISSING_DIR}/out.json"], "mpcomm-train", ["--json", MISSING_DIR]),
}
# Configuration errors found deep inside the engines: still one line, from one rank, exit 2.
TRAIN_CONFIG_ERRORS = {
    "global batch not divisible by dp": (["--engine", "ddp", "--global-batch", "7"], "must be divisible by dp"),
    "layers do not split into stages": (["--engine", "pipeline", "--layers", "1"], "num_layers % (pp*virtual_stages)"),
    "micro-batches do not divide the batch": (["--engine", "pipeline", "--micro-batches", "5"], "% micro_batches"),
    "d_hidden not divisible by tp": (["--engine", "tp", "--d-hidden", "31"], "d_hidden % tp"),
    "steps zero": (["--steps", "0"], "--steps must be >= 1"),
    "lr nan": (["--lr", "nan"], "--lr must be positive"),
    "bucket cap negative": (["--engine", "ddp", "--bucket-cap-mb", "-5"], "--bucket-cap-mb must be a positive"),
    "bucket cap zero": (["--engine", "ddp", "--bucket-cap-mb", "0"], "--bucket-cap-mb must be a positive"),
    "unknown compression": (["--engine", "ddp", "--compression", "int4"], "compression must be None, 'bf16'"),
    "powersgd rank zero": (["--engine", "ddp", "--compression", "powersgd:0"], "got 'powersgd:0'"),
    "compression warm-up negative": (["--engine", "ddp", "--compression", "powersgd:1", "--compression-warmup", "-1"],
                                     "warm-up must be a whole number of steps >= 0"),
    "compression outside ddp/fsdp": (["--engine", "tp", "--compression", "int8", "--dtype", "float32"],
                                     "is for --engine ddp or fsdp"),
    "powersgd with fsdp, bad rank": (["--engine", "fsdp", "--compression", "powersgd:x"], "got 'powersgd:x'"),
    "powersgd with fsdp hybrid_shard": (["--engine", "fsdp", "--fsdp-strategy", "hybrid_shard", "--compression",
                                         "powersgd:2"], "full_shard or shard_grad_op (got hybrid_shard)"),
    "compression with fsdp no_shard": (["--engine", "fsdp", "--fsdp-strategy", "no_shard", "--compression", "int8",
                                        "--dtype", "float32"], "full_shard or shard_grad_op (got no_shard)"),
    "wire compression of float64": (["--engine", "ddp", "--compression", "int8"],
                                    "--compression int8 compresses float32 gradients: add --dtype float32"),
}


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_error_is_one_line_and_exit_2(case, ranks):
    argv, prog, fragments = USER_ERRORS[case]
    assert_one_line_error(launch(ranks, argv), prog, *fragments)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", list(TRAIN_CONFIG_ERRORS))
def test_train_configuration_error_is_one_line(case, ranks):
    argv, fragment = TRAIN_CONFIG_ERRORS[case]
    assert_one_line_error(launch(ranks, ["-m", "mpcomm.train", *argv]), "mpcomm-train", fragment)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("prog", ["mpcomm-bench", "mpcomm-train"])
@pytest.mark.parametrize("value", ["abc", "1e-9"])
def test_bad_mpcomm_timeout_is_one_line(monkeypatch, prog, value, ranks):
    """A bad MPCOMM_TIMEOUT is a ConfigError on every rank: one line, exit 2 (mpcomm-bench printed two tracebacks and
    called MPI_Abort)."""
    monkeypatch.setenv("MPCOMM_TIMEOUT", value)
    module = "mpcomm.bench" if prog == "mpcomm-bench" else "mpcomm.train"
    argv = ["-m", module, "-e", "64"] if prog == "mpcomm-bench" else ["-m", module, "--engine", "ddp", "--steps", "1"]
    assert_one_line_error(launch(ranks, argv), prog, f"MPCOMM_TIMEOUT={value!r}")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", ["bench: unknown --op"])
def test_user_error_arrives_every_time_repeated(case, ranks):
    """The message used to be lost to MPI_Abort in about half of the runs: it must arrive in every one."""
    argv, prog, fragments = USER_ERRORS[case]
    for _ in range(REPEAT):
        assert_one_line_error(launch(ranks, argv), prog, *fragments)


@pytest.mark.parametrize("blocked", ["a regular file as the directory", "a read-only directory"])
def test_json_into_unusable_directory_is_refused_before_the_run(tmp_path, blocked):
    prefix = ()
    if blocked == "a regular file as the directory":
        parent, reason = tmp_path / "plain-file", "is not a directory"
        parent.write_text("")
    else:
        parent, reason = tmp_path / "locked", "is not writable"
        parent.mkdir(mode=0o500)
        if os.geteuid() == 0:  # root (CI) may write anywhere but on a read-only mount: a private one here
            unshare = shutil.which("unshare")
            if unshare is None or subprocess.run([unshare, "--mount", "true"], capture_output=True).returncode:
                pytest.skip("root without mount namespaces cannot make a directory it may not write")
            prefix = (unshare, "--mount", "--propagation", "private", "sh", "-c",
                      'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"', str(parent))
    proc = launch(2, ["-m", "mpcomm.bench", "-e", "64", "--json", str(parent / "rows.json")], prefix=prefix)
    assert_one_line_error(proc, "mpcomm-bench", str(parent), reason)


# ---------------------------------------------------------------------------------------- uncaught mpcomm errors
STUCK = textwrap.dedent("""
    import time
    import numpy as np
    from mpcomm import Communicator

    comm = Communicator(timeout=2.0)
    if comm.rank == 0:
        comm.allreduce(np.ones(4))  # the other ranks never join
    else:
        time.sleep(300)  # busy elsewhere: only an abort ends this process early
""")


@pytest.mark.parametrize("ranks", [2, 3])
def test_uncaught_mpcomm_error_in_a_plain_script_ends_the_job(tmp_path, ranks):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    start = time.monotonic()
    proc = launch(ranks, [str(script)], timeout=90)  # TimeoutExpired (a failure) if the job is left alive
    elapsed = time.monotonic() - start
    detail = f"rc={proc.returncode} after {elapsed:.1f} s\n--- stderr\n{proc.stderr}"
    assert proc.returncode != 0, detail
    # The script's timeout is 2 s: the job ends within timeout + 5 s, plus the launch of Python and MPI (up to
    # ~4 s on a loaded 2-core machine).
    assert elapsed < 2.0 + 5 + 8, detail
    assert proc.stderr.count("CommTimeoutError: rank 0: allreduce") == 1, detail  # printed once
    assert f"[mpcomm] rank 0 of {ranks}: uncaught CommTimeoutError; aborting the job" in proc.stderr, detail


ONE_RANK_ONLY = textwrap.dedent("""
    from mpi4py import MPI
    from mpcomm import launch

    launch.AGREE_SECONDS = 2.0

    def main():
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise launch.UsageError("prog: error: only rank 1 sees this")
        MPI.COMM_WORLD.recv(source=1)  # would wait forever without the abort

    launch.run_main(main)
""")


def test_user_error_on_one_rank_only_is_printed_and_ends_the_job(tmp_path):
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK_ONLY)
    proc = launch(2, [str(script)], timeout=90)
    detail = f"rc={proc.returncode}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 2, detail
    assert proc.stderr.count("prog: error: only rank 1 sees this") == 1, detail
    assert "[mpcomm] rank 1 of 2 stopped (status 2), the other ranks did not within 2 s" in proc.stderr, detail
