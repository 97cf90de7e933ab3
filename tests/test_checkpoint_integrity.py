"""FSDP sharded checkpoints: damaged files are found on load and reported on every rank at once.

Every shard file and ``metadata.json`` carry a CRC-32 and a byte count (shards in ``metadata.json``, the metadata in
``LATEST``). A flipped bit, a truncated, empty or missing file, or an unreadable ``metadata.json``/``LATEST`` makes
``load_sharded`` raise ``CheckpointError`` naming the file on EVERY rank — not only on the rank that reads it (the
others would otherwise wait in the next collective until the timeout) — and leaves the engine's state untouched.

    python -m pytest -q --with-mpi tests/test_checkpoint_integrity.py
    timeout 600 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_checkpoint_integrity.py   (also 3, 4)
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpcomm.nn import Adam, TransformerMLPBlock, mse_loss
from mpcomm.parallel.fsdp import FullyShardedDataParallel
from mpcomm.workload import Workload

WORLD = MPI.COMM_WORLD
WL = Workload(num_layers=3, d_model=8, d_hidden=12, global_batch=12, seed=3)
POLICY = {TransformerMLPBlock}
COMM_TIMEOUT = 30.0  # conftest's comm fixture: a rank left waiting raises CommTimeoutError after this (the tests reject it)


# ---------------------------------------------------------------------------------------- helpers
@pytest.fixture
def saved(comm):
    """A trained engine with its Adam optimizer, saved to a fresh shared directory: (engine, optimizer, path)."""
    path = _shared_tmpdir()
    engine = FullyShardedDataParallel(WL.model(), comm, auto_wrap_policy=POLICY)
    opt = Adam(engine.parameters(), lr=0.01)
    for step in range(2):
        xs, ys = WL.local_batch(step, comm.rank, comm.size)
        engine.zero_grad()
        out, ctx = engine.forward(xs)
        engine.backward(mse_loss(out, ys)[1], ctx)
        opt.step()
    engine.save_sharded(path, opt)
    yield engine, opt, path
    WORLD.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _shared_tmpdir() -> str:
    return WORLD.bcast(tempfile.mkdtemp(prefix="mpcomm-ckpt-") if WORLD.Get_rank() == 0 else None)


def _version_dir(path: str) -> str:
    with open(os.path.join(path, "LATEST")) as f:
        return os.path.join(path, json.load(f)["version"])


def _fresh(comm):
    engine = FullyShardedDataParallel(Workload(num_layers=3, d_model=8, d_hidden=12, seed=99).model(), comm,
                                      auto_wrap_policy=POLICY)
    return engine, Adam(engine.parameters(), lr=0.01)


def _on_rank0(damage) -> None:
    """Apply ``damage()`` on rank 0 only (the files are shared), while no other rank is reading them."""
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        damage()
    WORLD.Barrier()


def _outcomes(fn, mpi_comm=WORLD) -> list[tuple[str, str]]:
    """(exception type name, message) of ``fn()`` on every rank of ``mpi_comm``, ("ok", "") where it returned."""
    try:
        fn()
        mine = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - gathered and judged below
        mine = (type(exc).__name__, str(exc))
    return mpi_comm.allgather(mine)


def assert_every_rank_raises(outcomes, exc_name: str, *fragments: str) -> None:
    for rank, (name, message) in enumerate(outcomes):
        assert name == exc_name, f"rank {rank}: expected {exc_name}, got {name}: {message}"
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"


def flip_bit(file: str, offset: int, bit: int = 0) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def truncate(file: str, size: int | None = None) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2 if size is None else size)


def state_of(engine, opt) -> dict:
    """Every parameter and optimizer value of this rank's shards (copies)."""
    out = {f"param{i}": np.array(u.shard.data, copy=True) for i, u in enumerate(engine.units)}
    for i, st in opt.state.items():
        for key, value in st.items():
            out[f"opt{i}.{key}"] = np.array(value, copy=True)
    return out


def assert_unchanged(before: dict, after: dict) -> None:
    assert sorted(before) == sorted(after)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


# ---------------------------------------------------------------------------------------- shard files
SHARD_DAMAGE = {
    "bit flipped in the data": lambda f: flip_bit(f, os.path.getsize(f) - 3, bit=2),
    "bit flipped in the header": lambda f: flip_bit(f, 12, bit=0),
    "truncated": truncate,
    "empty": lambda f: truncate(f, 0),
    "missing": os.unlink,
}


@pytest.mark.mpi
@pytest.mark.parametrize("damage", list(SHARD_DAMAGE))
@pytest.mark.parametrize("key", ["param", "exp_avg"])
@pytest.mark.parametrize("which", ["first", "last"])
def test_damaged_shard_raises_on_every_rank(comm, saved, damage, key, which):
    engine, opt, path = saved
    shard = 0 if which == "first" else comm.size - 1  # read by rank 0 / by the last rank only
    target = os.path.join(_version_dir(path), f"u0001.{key}.s{shard:05d}.npy")
    _on_rank0(lambda: SHARD_DAMAGE[damage](target))
    fresh, fresh_opt = _fresh(comm)
    before = state_of(fresh, fresh_opt)
    outcomes = _outcomes(lambda: fresh.load_sharded(path, fresh_opt))
    assert_every_rank_raises(outcomes, "CheckpointError", os.path.basename(target), f"rank {shard}")
    assert_unchanged(before, state_of(fresh, fresh_opt))  # a failed load changes nothing


@pytest.mark.mpi
def test_damaged_shard_raises_on_every_rank_when_resharding(comm, saved):
    """Loaded on fewer ranks than saved: the ranks reading the damaged file are not the rank that wrote it."""
    engine, opt, path = saved
    if comm.size < 2:
        pytest.skip("needs 2 ranks to reshard to fewer")
    target = os.path.join(_version_dir(path), f"u0000.param.s{comm.size - 1:05d}.npy")
    _on_rank0(lambda: flip_bit(target, os.path.getsize(target) - 1))
    sub = comm.split(0 if comm.rank < comm.size - 1 else 1)
    if comm.rank < comm.size - 1:
        fresh, fresh_opt = _fresh(sub)
        outcomes = _outcomes(lambda: fresh.load_sharded(path, fresh_opt), sub.mpi)
        assert_every_rank_raises(outcomes, "CheckpointError", os.path.basename(target))
    sub.free()
    WORLD.Barrier()


# ---------------------------------------------------------------------------------------- metadata and LATEST
def _flip_step_scalar(path: str) -> None:
    """Adam's step count 2 -> 3 in metadata.json: valid JSON, loads silently wrong without a checksum."""
    meta = os.path.join(_version_dir(path), "metadata.json")
    text = open(meta, "rb").read()
    offset = text.index(b'"step": 2') + len(b'"step": ')
    flip_bit(meta, offset, bit=0)


METADATA_DAMAGE = {
    "bit flipped in a value": (_flip_step_scalar, "metadata.json"),
    "not JSON": (lambda p: open(os.path.join(_version_dir(p), "metadata.json"), "w").write("{not json"),
                 "metadata.json"),
    "truncated": (lambda p: truncate(os.path.join(_version_dir(p), "metadata.json")), "metadata.json"),
    "missing": (lambda p: os.unlink(os.path.join(_version_dir(p), "metadata.json")), "metadata.json"),
    "LATEST not JSON": (lambda p: open(os.path.join(p, "LATEST"), "w").write('{"vers'), "LATEST"),
    "LATEST names a missing version": (lambda p: open(os.path.join(p, "LATEST"), "w").write('{"version": "v000042"}'),
                                       "v000042"),
    "LATEST without a version": (lambda p: open(os.path.join(p, "LATEST"), "w").write('{"versoin": "v000001"}'),
                                 "LATEST"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("damage", list(METADATA_DAMAGE))
def test_damaged_metadata_or_latest_names_the_path(comm, saved, damage):
    engine, opt, path = saved
    spoil, fragment = METADATA_DAMAGE[damage]
    _on_rank0(lambda: spoil(path))
    fresh, fresh_opt = _fresh(comm)
    before = state_of(fresh, fresh_opt)
    outcomes = _outcomes(lambda: fresh.load_sharded(path, fresh_opt))
    assert_every_rank_raises(outcomes, "CheckpointError", path, fragment)
    assert_unchanged(before, state_of(fresh, fresh_opt))


@pytest.mark.mpi
def test_no_checkpoint_is_file_not_found_on_every_rank(comm, saved):
    engine, opt, path = saved
    _on_rank0(lambda: os.unlink(os.path.join(path, "LATEST")))
    outcomes = _outcomes(lambda: engine.load_sharded(path, opt))
    assert_every_rank_raises(outcomes, "CheckpointNotFoundError", "no FSDP sharded checkpoint", path)
    with pytest.raises(FileNotFoundError):  # still a FileNotFoundError, as before
        engine.load_sharded(path, opt)


# ---------------------------------------------------------------------------------------- intact and old checkpoints
@pytest.mark.mpi
def test_intact_checkpoint_round_trips_and_records_checksums(comm, saved):
    engine, opt, path = saved
    directory = _version_dir(path)
    with open(os.path.join(path, "LATEST")) as f:
        latest = json.load(f)
    assert latest["metadata"]["bytes"] == os.path.getsize(os.path.join(directory, "metadata.json"))
    with open(os.path.join(directory, "metadata.json")) as f:
        files = json.load(f)["files"]
    shards = sorted(n for n in os.listdir(directory) if n.endswith(".npy"))
    assert sorted(files) == shards and len(shards) == len(engine.units) * 3 * comm.size  # param, exp_avg, exp_avg_sq
    for name, record in files.items():
        assert record["bytes"] == os.path.getsize(os.path.join(directory, name))
    fresh, fresh_opt = _fresh(comm)
    fresh.load_sharded(path, fresh_opt)
    assert_unchanged(state_of(engine, opt), state_of(fresh, fresh_opt))


def _strip_checksums(path: str) -> None:
    """Make the checkpoint look like one saved before checksums existed."""
    directory = _version_dir(path)
    meta_file = os.path.join(directory, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    del meta["files"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    with open(os.path.join(path, "LATEST"), "w") as f:
        json.dump({"version": os.path.basename(directory)}, f)


@pytest.mark.mpi
def test_checkpoint_without_checksums_loads_with_a_warning(comm, saved):
    engine, opt, path = saved
    _on_rank0(lambda: _strip_checksums(path))
    fresh, fresh_opt = _fresh(comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_sharded(path, fresh_opt)
    assert any("no checksums" in str(w.message) and path in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert_unchanged(state_of(engine, opt), state_of(fresh, fresh_opt))


@pytest.mark.mpi
@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_checkpoint_without_checksums_still_catches_damaged_files(comm, saved, damage):
    engine, opt, path = saved
    target = os.path.join(_version_dir(path), f"u0002.exp_avg_sq.s{comm.size - 1:05d}.npy")
    _on_rank0(lambda: (_strip_checksums(path), SHARD_DAMAGE[damage](target)))
    fresh, fresh_opt = _fresh(comm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcomes = _outcomes(lambda: fresh.load_sharded(path, fresh_opt))
    assert_every_rank_raises(outcomes, "CheckpointError", os.path.basename(target))


# ---------------------------------------------------------------------------------------- save errors
@pytest.mark.mpi
def test_save_into_unusable_path_raises_on_every_rank(comm, saved):
    engine, opt, path = saved
    blocker = os.path.join(path, "a-file")
    _on_rank0(lambda: open(blocker, "w").close())
    outcomes = _outcomes(lambda: engine.save_sharded(blocker, opt))  # a regular file where a directory must be
    assert_every_rank_raises(outcomes, "CheckpointError", blocker)
    engine.save_sharded(path, opt)  # the communicator is still usable afterwards


# ---------------------------------------------------------------------------------------- resharding stays intact
@pytest.mark.mpi
def test_checksummed_checkpoint_reshards_between_all_sizes(comm):
    """Saved on s ranks, loaded on t ranks, for every s, t <= world (3 -> 1, 2, 4 at p = 4): the loaded
    parameters equal the saved ones exactly, and every file read is verified on the way."""
    expected = {k: np.array(v.data, copy=True) for k, v in WL.model().named_parameters()}
    path = _shared_tmpdir()
    for saved_on in range(1, comm.size + 1):
        sub = comm.split(0 if comm.rank < saved_on else 1)
        if comm.rank < saved_on:
            FullyShardedDataParallel(WL.model(), sub, auto_wrap_policy=POLICY).save_sharded(path)
        sub.free()
        for loaded_on in range(1, comm.size + 1):
            sub = comm.split(0 if comm.rank < loaded_on else 1)
            if comm.rank < loaded_on:
                fresh, _ = _fresh(sub)
                fresh.load_sharded(path)
                for name, value in fresh.full_state_dict().items():
                    np.testing.assert_array_equal(value, expected[name], err_msg=f"{saved_on} -> {loaded_on}: {name}")
            sub.free()
            WORLD.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path)
