"""FSDP checkpoints: sharded (resharding-capable) and full.

Sharded layout under ``path``::

    LATEST                          {"version": "v000003"}  — replaced atomically, last step of a save
    v000003/metadata.json           flat layouts (names, shapes, offsets, padding), shard count, world size,
                                    dtypes, optimizer keys and scalars
    v000003/u0000.param.s00001.npy  unit 0's flat parameter shard 1 of shard_count
    v000003/u0000.exp_avg.s00001.npy  (optimizer moments are flat and sharded like the parameter)

Every file is written to a temporary name in its own directory, fsync'ed and ``os.replace``d. A save
writes a new version directory and only then swaps ``LATEST``, so a crash at any point before that swap
leaves the previous checkpoint complete and loadable; old versions are removed after the swap.
Loading at a different world size reads, for each new shard, only the ranges of the old shard files that
cover it (memory-mapped ``.npy``; :func:`flat_param.reshard_plan`). Replicas (hybrid_shard, no_shard) hold
identical shards, so only replica 0 writes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..nn.backend import array_module, to_numpy
from .flat_param import FlatLayout, reshard_plan

if TYPE_CHECKING:  # pragma: no cover
    from .fsdp import FullyShardedDataParallel

FORMAT = "mpcomm-fsdp-sharded-v1"
_VERSION = re.compile(r"v\d{6}")


# ---- atomic file writes -------------------------------------------------------------------------
def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Write via ``write(fileobj)`` into a temp file next to ``path``, fsync, then rename over ``path``."""
    directory, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-", dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory or ".")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def _write_npy(path: str, array: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


def _shard_file(directory: str, unit: int, key: str, index: int) -> str:
    return os.path.join(directory, f"u{unit:04d}.{key}.s{index:05d}.npy")


def read_latest(path: str) -> str:
    """The version directory ``LATEST`` points at (FileNotFoundError with a clear message if none)."""
    latest = os.path.join(path, "LATEST")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"no FSDP sharded checkpoint in {path!r} (no LATEST file)")
    with open(latest) as f:
        return os.path.join(path, json.load(f)["version"])


def _optimizer_parts(engine, optimizer, i: int) -> tuple[dict, dict]:
    """(flat arrays shaped like the shard, scalars) of unit ``i``'s optimizer state."""
    arrays, scalars = {}, {}
    for key, value in (optimizer.state.get(i, {}) if optimizer is not None else {}).items():
        if hasattr(value, "shape") and tuple(value.shape) == engine.units[i].shard.shape:
            arrays[key] = value
        elif hasattr(value, "shape"):
            raise ValueError(f"optimizer state {key!r} of unit {i} has shape {tuple(value.shape)}; only flat "
                             f"arrays shaped like the shard {engine.units[i].shard.shape} and scalars are saved")
        else:
            scalars[key] = value.item() if hasattr(value, "item") else value
    return arrays, scalars


# ---- sharded ------------------------------------------------------------------------------------
def save_sharded(engine: "FullyShardedDataParallel", path: str, optimizer=None) -> None:
    from .fsdp import check_optimizer

    comm, groups = engine.comm, engine.groups
    if optimizer is not None:
        check_optimizer(engine, optimizer)
    version = np.zeros(1, dtype=np.int64)
    if comm.rank == 0:
        os.makedirs(path, exist_ok=True)
        try:
            version[0] = int(os.path.basename(read_latest(path))[1:]) + 1
        except FileNotFoundError:
            version[0] = 1
        stale = os.path.join(path, f"v{int(version[0]):06d}")
        if os.path.isdir(stale):  # a crashed earlier attempt at this version: never mix its files in
            shutil.rmtree(stale)
        os.makedirs(stale)
    comm.broadcast(version, root=0)
    directory = os.path.join(path, f"v{int(version[0]):06d}")
    writer = groups.replica_index == 0
    units_meta = []
    for i, u in enumerate(engine.units):
        arrays, scalars = _optimizer_parts(engine, optimizer, i)
        if writer:
            _write_npy(_shard_file(directory, i, "param", groups.shard_index), to_numpy(u.shard.data))
            for key, value in arrays.items():
                _write_npy(_shard_file(directory, i, key, groups.shard_index), to_numpy(value))
        units_meta.append({"name": u.name, "dtype": str(u.master_dtype), "layout": u.layout.to_json(),
                           "optimizer": {"arrays": sorted(arrays), "scalars": scalars}})
    comm.barrier()  # every shard file is in place before the version can become LATEST
    if comm.rank == 0:
        meta = {"format": FORMAT, "world_size": comm.size, "shard_count": groups.shard_count,
                "strategy": engine.strategy.value, "units": units_meta,
                "optimizer": type(optimizer).__name__ if optimizer is not None else None}
        _write_json(os.path.join(directory, "metadata.json"), meta)
        _write_json(os.path.join(path, "LATEST"), {"version": os.path.basename(directory)})
        for name in os.listdir(path):  # older versions and leftovers of crashed saves (only our own names)
            full = os.path.join(path, name)
            if _VERSION.fullmatch(name) and name != os.path.basename(directory):
                shutil.rmtree(full, ignore_errors=True)
            elif name.startswith(".LATEST.tmp-"):
                os.unlink(full)
    comm.barrier()


def load_sharded(engine: "FullyShardedDataParallel", path: str, optimizer=None) -> None:
    from .fsdp import check_optimizer

    if optimizer is not None:
        check_optimizer(engine, optimizer)
    directory = read_latest(path)
    with open(os.path.join(directory, "metadata.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory}: not an mpcomm FSDP sharded checkpoint (format {meta.get('format')!r})")
    if len(meta["units"]) != len(engine.units):
        raise ValueError(f"checkpoint has {len(meta['units'])} FSDP units, this engine has {len(engine.units)} "
                         "(use the same auto_wrap_policy as when saving)")
    groups = engine.groups
    new_state = {}
    for i, (u, um) in enumerate(zip(engine.units, meta["units"])):
        old = FlatLayout.from_json(um["layout"])
        diff = u.layout.same_params(old)
        if diff is not None or um["name"] != u.name:
            raise ValueError(f"checkpoint unit {i} ({um['name']!r}) does not match this model's unit {u.name!r}: {diff}")
        if np.dtype(um["dtype"]) != u.master_dtype:
            raise ValueError(f"checkpoint unit {u.name!r} is {um['dtype']}, the model is {u.master_dtype}")
        pieces = reshard_plan(old, u.layout, groups.shard_index)

        def read(key: str) -> np.ndarray:
            out = np.zeros(u.layout.shard_numel, dtype=u.master_dtype)  # padding stays zero
            for piece in pieces:
                src = np.load(_shard_file(directory, i, key, piece.old_index), mmap_mode="r")
                if src.shape != (old.shard_numel,) or src.dtype != u.master_dtype:
                    raise ValueError(f"{directory}: shard file of unit {i} {key!r} has {src.shape} {src.dtype}")
                out[piece.dst_lo : piece.dst_hi] = src[piece.src_lo : piece.src_hi]
            return out

        param = read("param")
        u.shard.data[...] = param if array_module(u.shard.data) is np else engine.xp.asarray(param)
        if optimizer is not None:
            st = dict(um["optimizer"]["scalars"])
            like = u.shard.data
            for key in um["optimizer"]["arrays"]:
                arr = read(key)
                st[key] = arr if array_module(like) is np else engine.xp.asarray(arr)
            if st:
                new_state[i] = st
    if optimizer is not None:
        optimizer.state = new_state
    engine.comm.barrier()  # nobody starts a new save (which deletes this version) while others still read


# ---- full -----------------------------------------------------------------------------------------
def save_full(engine: "FullyShardedDataParallel", path: str) -> None:
    state = engine.full_state_dict()
    if engine.comm.rank == 0:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        _atomic_write(path, lambda f: np.savez(f, **state))
    engine.comm.barrier()
