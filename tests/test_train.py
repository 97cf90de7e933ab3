"""``mpcomm-train`` in-process: every data-parallel engine reproduces ``--engine single``; bad layouts raise.

    timeout 600 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_train.py     (also -n 1, 3, 4)
    python -m pytest -q tests/test_train.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import WORLD, mpiexec_path, serial_only

from mpcomm.errors import ConfigError
from mpcomm.train import build_parser, resolve_layout

COMMON = ["--steps", "3", "--global-batch", "12", "--layers", "3", "--d-model", "8", "--d-hidden", "16"]
# model parallel: 24 layers split into 1..4 stages (x2 interleaved), d_hidden 24 into 1..4 tensor-parallel shards
MODEL_PARALLEL = ["--steps", "3", "--global-batch", "24", "--layers", "24", "--d-model", "8", "--d-hidden", "24"]


def layout(argv, world):
    return resolve_layout(build_parser().parse_args(argv), world)


# ------------------------------------------------------------------------------------------------ pure

def test_layout_defaults_and_constraints():
    assert layout(["--engine", "single"], 4) == (1, 1, 1)
    assert layout(["--engine", "ddp", "--global-batch", "12"], 3) == (3, 1, 1)
    assert layout(["--engine", "fsdp", "--dp", "2"], 2) == (2, 1, 1)
    assert layout(["--engine", "pipeline"], 4) == (1, 1, 4)
    assert layout(["--engine", "tp"], 2) == (1, 2, 1)
    assert layout(["--engine", "3d", "--dp", "2", "--tp", "2"], 4) == (2, 2, 1)
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world.*dp=2 \* tp=1 \* pp=1 = 2 != world 4"):
        layout(["--engine", "ddp", "--dp", "2"], 4)
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world.*= 8 != world 4"):
        layout(["--engine", "3d", "--dp", "2", "--tp", "2", "--pp", "2"], 4)
    with pytest.raises(ConfigError, match="tp and pp must be 1"):
        layout(["--engine", "ddp", "--tp", "2"], 2)
    with pytest.raises(ConfigError, match="--engine 3d needs"):
        layout(["--engine", "3d"], 4)
    with pytest.raises(ConfigError, match="divisible by dp=3"):
        layout(["--engine", "ddp", "--global-batch", "16"], 3)
    with pytest.raises(ConfigError, match="--steps must be >= 1"):
        layout(["--engine", "single", "--steps", "0"], 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engine", "zero"])


def test_recompute_wrapper_keeps_names_and_gradients():
    from mpcomm.train import with_recompute
    from mpcomm.workload import Workload
    import mpcomm.nn as nn
    wl = Workload(num_layers=2, d_model=4, d_hidden=8, global_batch=6)
    plain, wrapped = wl.model(), with_recompute(wl.model())
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]
    x, y = wl.batch(0)
    for m in (plain, wrapped):
        pred, ctx = m.forward(x)
        m.backward(nn.mse_loss(pred, y)[1], ctx)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)


def _cli() -> list[str]:
    """The installed ``mpcomm-train`` console script, or ``python -m mpcomm.train`` (the same ``main``) when mpcomm
    runs from a source tree that was not installed."""
    script = shutil.which("mpcomm-train", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "mpcomm.train"]


@serial_only
def test_cli_3d_under_mpiexec_equals_single(tmp_path):
    """``mpiexec -n 4 mpcomm-train --engine 3d --tp 2 --pp 2 --json`` (4 processes, the real command line) writes
    the losses and checksum of ``mpcomm-train --engine single --json``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    runs = {"single": _cli() + ["--engine", "single"],
            "3d": [mpiexec_path(), "-n", "4", *_cli(), "--engine", "3d", "--dp", "1", "--tp", "2", "--pp", "2"]}
    out = {}
    for name, argv in runs.items():
        path = tmp_path / f"{name}.json"
        proc = subprocess.run([*argv, "--json", str(path), *MODEL_PARALLEL], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[name] = json.loads(path.read_text())
    ref, got = out["single"], out["3d"]
    assert (got["engine"], got["world"], got["dp"], got["tp"], got["pp"]) == ("3d", 4, 1, 2, 2)
    assert len(got["losses"]) == 3
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-10)
    np.testing.assert_allclose(got["param_checksum"], ref["param_checksum"], rtol=1e-10)


def test_module_entry_point_runs_single(tmp_path):
    out = tmp_path / "single.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "mpcomm.train", "--engine", "single", "--json", str(out), *COMMON],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "where the time went" in proc.stdout and "step    2" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["losses"]) == 3 and data["engine"] == "single" and data["world"] == 1


# ------------------------------------------------------------------------------------------------ MPI

@pytest.fixture(scope="module")
def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def shared_path(world, tmp_path, name):
    """One path for every rank (rank 0's tmp dir), so rank 0 writes the JSON and everyone reads it."""
    return world.bcast(str(tmp_path / name) if world.Get_rank() == 0 else None, root=0)


@pytest.fixture(scope="module")
def single(world, tmp_path_factory):
    from mpcomm.train import main
    path = world.bcast(str(tmp_path_factory.mktemp("single") / "s.json") if world.Get_rank() == 0 else None)
    assert main(["--engine", "single", "--json", path, *COMMON]) == 0
    world.Barrier()
    return path


def load(world, path):
    world.Barrier()
    with open(path) as fh:
        return json.load(fh)


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [[], ["--bucket-cap-mb", "0.0005"], ["--optimizer", "adam"], ["--recompute"],
                                   ["--dtype", "float32"]], ids=["default", "tiny-buckets", "adam", "recompute",
                                                                  "float32"])
def test_ddp_cli_equals_single(world, tmp_path, extra):
    from mpcomm.train import main
    ref_path = shared_path(world, tmp_path, "ref.json")
    path = shared_path(world, tmp_path, "ddp.json")
    assert main(["--engine", "single", "--json", ref_path, *COMMON, *extra]) == 0
    assert main(["--engine", "ddp", "--json", path, *COMMON, *extra]) == 0
    ref, got = load(world, ref_path), load(world, path)
    rtol = 1e-5 if "float32" in extra else 1e-10
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=rtol)
    np.testing.assert_allclose(got["param_checksum"], ref["param_checksum"], rtol=rtol)
    assert (got["engine"], got["world"], got["dp"], got["tp"], got["pp"]) == ("ddp", world.Get_size(),
                                                                              world.Get_size(), 1, 1)
    assert {"compute", "communication", "other", "total"} <= set(got["timing"])


@pytest.mark.mpi
def test_ddp_cli_compression(world, tmp_path):
    """--compression powersgd:1: the warm-up steps are exactly --engine ddp's, then the losses part (and stay close)."""
    from mpcomm.train import main
    ref_path = shared_path(world, tmp_path, "ref.json")
    path = shared_path(world, tmp_path, "psgd.json")
    argv = [*COMMON, "--steps", "6", "--layers", "2", "--d-model", "16", "--d-hidden", "32"]
    assert main(["--engine", "ddp", "--json", ref_path, *argv]) == 0
    assert main(["--engine", "ddp", "--compression", "powersgd:1", "--compression-warmup", "3", "--json", path,
                 *argv]) == 0
    ref, got = load(world, ref_path), load(world, path)
    assert got["losses"][:4] == ref["losses"][:4]  # the 4th loss is computed before the first compressed step
    assert got["losses"][4:] != ref["losses"][4:]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0.05)
    assert got["config"]["compression"] == "powersgd:1" and got["config"]["compression_warmup"] == 3


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["int8", "auto"])
def test_ddp_cli_wire_compression(world, tmp_path, mode):
    """--compression int8|auto (float32): int8 compresses from step 1 (losses part after it); auto stays off here,
    one host (the losses are --engine ddp's)."""
    from mpcomm.train import main
    ref_path = shared_path(world, tmp_path, "ref.json")
    path = shared_path(world, tmp_path, "wire.json")
    argv = [*COMMON, "--steps", "4", "--dtype", "float32"]
    assert main(["--engine", "ddp", "--json", ref_path, *argv]) == 0
    assert main(["--engine", "ddp", "--compression", mode, "--compression-warmup", "1", "--json", path, *argv]) == 0
    ref, got = load(world, ref_path), load(world, path)
    assert got["losses"][:2] == ref["losses"][:2]
    if mode == "auto":
        assert got["losses"] == ref["losses"] and set(got["compression_choices"]) == {"exact"}
    else:
        assert got["losses"][2:] != ref["losses"][2:] and set(got["compression_choices"]) == {"int8"}
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0.01)


@pytest.mark.mpi
def test_fsdp_cli_powersgd(world, tmp_path):
    """--engine fsdp --compression powersgd:4 (the default float64): the warm-up steps are plain --engine fsdp's,
    then the losses part (one rank sends nothing: nothing is compressed) and stay close."""
    from mpcomm.train import main
    ref_path = shared_path(world, tmp_path, "ref.json")
    path = shared_path(world, tmp_path, "psgd.json")
    argv = [*COMMON, "--steps", "5", "--layers", "2", "--d-model", "16", "--d-hidden", "40", "--engine", "fsdp"]
    assert main(["--json", ref_path, *argv]) == 0
    assert main(["--compression", "powersgd:4", "--compression-warmup", "2", "--json", path, *argv]) == 0
    ref, got = load(world, ref_path), load(world, path)
    assert got["losses"][:3] == ref["losses"][:3]  # the 3rd loss is computed before the first compressed step
    if world.Get_size() == 1:
        assert got["losses"] == ref["losses"] and got["compression_choices"] == []
    else:
        assert got["losses"][3:] != ref["losses"][3:] and set(got["compression_choices"]) == {"powersgd"}
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0.05)
    assert got["config"]["compression"] == "powersgd:4"


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["int8", "auto"])
def test_fsdp_cli_wire_compression(world, tmp_path, mode):
    """--engine fsdp --compression int8|auto (float32): int8 compresses the reduce-scatter from step 1 (one rank
    sends nothing: no compression); auto stays off on one host (the losses are plain --engine fsdp's)."""
    from mpcomm.train import main
    ref_path = shared_path(world, tmp_path, "ref.json")
    path = shared_path(world, tmp_path, "wire.json")
    argv = [*COMMON, "--steps", "4", "--dtype", "float32", "--engine", "fsdp"]
    assert main(["--json", ref_path, *argv]) == 0
    assert main(["--compression", mode, "--compression-warmup", "1", "--json", path, *argv]) == 0
    ref, got = load(world, ref_path), load(world, path)
    assert got["losses"][:2] == ref["losses"][:2]
    if mode == "auto" or world.Get_size() == 1:
        assert got["losses"] == ref["losses"]
        assert set(got["compression_choices"]) == ({"exact"} if world.Get_size() > 1 else set())
    else:
        assert got["losses"][2:] != ref["losses"][2:] and set(got["compression_choices"]) == {"int8"}
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0.01)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_fsdp_cli_equals_single(world, tmp_path, single, strategy):
    pytest.importorskip("mpcomm.parallel.fsdp")
    from mpcomm.train import main
    path = shared_path(world, tmp_path, "fsdp.json")
    assert main(["--engine", "fsdp", "--fsdp-strategy", strategy, "--json", path, *COMMON]) == 0
    ref, got = load(world, single), load(world, path)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-10)
    np.testing.assert_allclose(got["param_checksum"], ref["param_checksum"], rtol=1e-10)


@pytest.mark.mpi
def test_bad_layout_raises_config_error_on_every_rank(world):
    from mpcomm.train import run
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world"):
        run(["--engine", "ddp", "--dp", str(world.Get_size() + 1), *COMMON])
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp == world"):
        run(["--engine", "3d", "--dp", "1", "--tp", "1", "--pp", str(world.Get_size() + 1), *COMMON])
    world.Barrier()


def model_parallel_runs(p: int) -> list[tuple[str, str, list[str]]]:
    """(id, engine, its arguments) for every model-parallel way ``mpcomm-train`` can use ``p`` ranks: the pipeline
    with each schedule, tensor parallel, and --engine 3d with every dp x tp x pp = p other than those two."""
    runs = [(f"pipeline-{s}", "pipeline", ["--schedule", s, "--micro-batches", str(2 * p)])
            for s in ("gpipe", "1f1b", "interleaved-1f1b")]
    runs.append(("tp", "tp", []))
    layouts = sorted({(dp, tp, p // (dp * tp)) for dp in range(1, p + 1) for tp in range(1, p + 1)
                      if p % (dp * tp) == 0})
    for dp, tp, pp in layouts:
        if p == 1 or (dp, tp, pp) not in ((1, p, 1), (1, 1, p)):
            runs.append((f"3d-dp{dp}-tp{tp}-pp{pp}", "3d",
                         ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--micro-batches", "2"]))
    return runs


@pytest.fixture(scope="module")
def single_model_parallel(world, tmp_path_factory):
    from mpcomm.train import main
    path = world.bcast(str(tmp_path_factory.mktemp("single") / "mp.json") if world.Get_rank() == 0 else None)
    assert main(["--engine", "single", "--json", path, *MODEL_PARALLEL]) == 0
    return load(world, path)


RUNS = model_parallel_runs(WORLD.Get_size())


@pytest.mark.mpi
@pytest.mark.parametrize("engine, extra", [run[1:] for run in RUNS], ids=[run[0] for run in RUNS])
def test_model_parallel_cli_equals_single(world, tmp_path, single_model_parallel, engine, extra):
    """``mpcomm-train --engine pipeline|tp|3d ... --json`` (its command-line entry point, in every rank's process)
    writes the losses and parameter checksum of ``--engine single`` on the same workload, and its layout."""
    from mpcomm.train import main
    path = shared_path(world, tmp_path, f"{engine}.json")
    assert main(["--engine", engine, "--json", path, *MODEL_PARALLEL, *extra]) == 0
    got, ref = load(world, path), single_model_parallel
    p = world.Get_size()
    layout = {"pipeline": (1, 1, p), "tp": (1, p, 1)}.get(engine) or tuple(int(v) for v in extra[1:6:2])
    assert (got["engine"], got["world"], (got["dp"], got["tp"], got["pp"])) == (engine, p, layout)
    assert len(got["losses"]) == 3 and {"compute", "communication", "total"} <= set(got["timing"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-10)
    np.testing.assert_allclose(got["param_checksum"], ref["param_checksum"], rtol=1e-10)
