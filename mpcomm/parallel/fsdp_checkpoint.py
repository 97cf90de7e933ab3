"""FSDP checkpoints: sharded (resharding-capable, checksummed) and full.

Sharded layout under ``path``::

    LATEST                          {"version": "v000003", "metadata": {"bytes": 2210, "crc32": 912874}}
                                    — replaced atomically, last step of a save
    v000003/metadata.json           flat layouts (names, shapes, offsets, padding), shard count, world size,
                                    dtypes, optimizer keys and scalars, and {"files": {name: {"bytes", "crc32"}}}
    v000003/u0000.param.s00001.npy  unit 0's flat parameter shard 1 of shard_count
    v000003/u0000.exp_avg.s00001.npy  (optimizer moments are flat and sharded like the parameter)
    v000003/u0000.error.r00001.npy  with compression: world rank 1's error feedback of unit 0 (unpadded, the
                                    unit's whole gradient), and ``metadata["compression"]`` its mode and step count
    v000003/u0000.powersgd_q.npy    with PowerSGD: unit 0's Qs (the same on every rank), flat in layout order

Every file is written to a temporary name in its own directory, fsync'ed and ``os.replace``d. A save
writes a new version directory and only then swaps ``LATEST``, so a crash at any point before that swap
leaves the previous checkpoint complete and loadable; old versions are removed after the swap.
Loading at a different world size reads, for each new shard, the ranges of the old shard files that
cover it (:func:`flat_param.reshard_plan`). Replicas (hybrid_shard, no_shard) hold identical shards, so only
replica 0 writes. Compression errors (``fsdp_compression``) are per rank, not shards: at the same world size each
rank loads its own (a resumed run continues bitwise), at another each loads the mean of the saved ranks' errors
(what the average still owes) and PowerSGD's shared Qs as they are; a checkpoint without them starts the engine's
compression afresh (warm-up first).

Integrity: the byte count and CRC-32 of every shard file are recorded in ``metadata.json``, and those of
``metadata.json`` in ``LATEST``. A load verifies every file it reads in full before it changes anything, then the
ranks agree: a damaged (one flipped bit), truncated, empty or missing file, or an unreadable ``metadata.json`` or
``LATEST``, raises :class:`CheckpointError` naming the file on every rank at once — not only on the rank that read
it — and leaves the engine and optimizer as they were. (CRC-32 finds accidental damage: every 1-bit flip and
burst of up to 32 bits; it is no defence against deliberate tampering.) Checkpoints saved before checksums were
recorded still load, with a ``RuntimeWarning``; their files are checked for header, shape, dtype and length only.
Save errors (an unwritable path, a full disk) are likewise raised on every rank.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
import warnings
import zlib
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import numpy as np

from ..errors import MpcommError
from ..nn import Optimizer
from ..nn.backend import array_module, to_numpy
from .flat_param import FlatLayout, reshard_plan
from .fsdp_compression import pack_q, q_numel, unpack_q

if TYPE_CHECKING:  # pragma: no cover
    from .fsdp import FullyShardedDataParallel

FORMAT = "mpcomm-fsdp-sharded-v1"
_VERSION = re.compile(r"v\d{6}")
T = TypeVar("T")


class CheckpointError(MpcommError, ValueError):
    """A checkpoint cannot be saved or loaded: the message names the file and the ranks that saw the problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the path (no ``LATEST`` file)."""


# ---- agreeing on errors (collective) -------------------------------------------------------------
def _allgather_text(comm, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (two all-gathers over the mpcomm ``comm``, bounded by its timeout)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = np.zeros(comm.size, dtype=np.int64)
    comm.all_gather(np.array([data.size], dtype=np.int64), lengths)
    width = int(lengths.max())
    if width == 0:
        return [""] * comm.size
    mine = np.zeros(width, dtype=np.uint8)
    mine[: data.size] = data
    everyone = np.empty(width * comm.size, dtype=np.uint8)
    comm.all_gather(mine, everyone)
    return [everyone[r * width : r * width + int(n)].tobytes().decode() for r, n in enumerate(lengths)]


def _agree(comm, error: Exception | None, what: str) -> None:
    """Collective: if ``error`` is set on any rank, raise on every rank one error saying what each rank saw."""
    kind = "" if error is None else "missing" if isinstance(error, CheckpointNotFoundError) else "error"
    text = "" if error is None else f"{kind}:{error if isinstance(error, CheckpointError) else _describe(error)}"
    seen = [(rank, t.split(":", 1)) for rank, t in enumerate(_allgather_text(comm, text)) if t]
    if not seen:
        return
    by_message: dict[str, list[int]] = {}
    for rank, (_, message) in seen:
        by_message.setdefault(message, []).append(rank)
    described = "; ".join(f"{_ranks(ranks)}: {message}" for message, ranks in by_message.items())
    cls = CheckpointNotFoundError if all(k == "missing" for _, (k, _) in seen) else CheckpointError
    raise cls(f"{what}: {described}") from error


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _on_every_rank(comm, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` on this rank; if it raised on any rank, :class:`CheckpointError` on every rank (collective)."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - every rank learns about it in _agree
        result, error = None, exc
    _agree(comm, error, what)
    return cast(T, result)  # no rank raised: fn() returned


# ---- atomic, checksummed file writes -------------------------------------------------------------
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


class _Checksummed:
    """A binary sink that counts and CRC-32s the bytes written through it to ``file``."""

    def __init__(self, file):
        self.file, self.nbytes, self.crc32 = file, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.nbytes += view.nbytes
        self.crc32 = zlib.crc32(view, self.crc32)
        return self.file.write(view)

    def record(self) -> dict:
        return {"bytes": self.nbytes, "crc32": self.crc32}


def _write_bytes(path: str, data: bytes) -> dict:
    _atomic_write(path, lambda f: f.write(data))
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _write_json(path: str, obj: Any) -> dict:
    return _write_bytes(path, json.dumps(obj, indent=1).encode())


def _write_npy(path: str, array: np.ndarray) -> dict:
    """Save ``array`` as ``.npy`` at ``path``; returns the byte count and CRC-32 of the file."""
    sinks = []

    def write(f) -> None:
        sinks.append(_Checksummed(f))
        np.save(sinks[-1], array, allow_pickle=False)

    _atomic_write(path, write)
    return sinks[-1].record()


def _shard_name(unit: int, key: str, index: int) -> str:
    return f"u{unit:04d}.{key}.s{index:05d}.npy"


def _q_name(unit: int) -> str:
    """The file of unit ``unit``'s PowerSGD Qs."""
    return f"u{unit:04d}.powersgd_q.npy"


def _error_name(unit: int, rank: int) -> str:
    """The file of world rank ``rank``'s compression error of unit ``unit``."""
    return f"u{unit:04d}.error.r{rank:05d}.npy"


# ---- reading and verifying ---------------------------------------------------------------------
def _read_file(path: str, record: dict | None, recorded_in: str) -> bytes:
    """The bytes of ``path``, checked against its ``record`` ({"bytes", "crc32"}, kept in ``recorded_in``)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror}") from None
    if record is None:
        return raw
    if len(raw) != record["bytes"]:
        what = "empty" if not raw else "truncated" if len(raw) < record["bytes"] else "longer than saved"
        raise CheckpointError(f"{path} is {what}: {len(raw)} bytes, {record['bytes']} were saved "
                              f"(recorded in {recorded_in})")
    crc = zlib.crc32(raw)
    if crc != record["crc32"]:
        raise CheckpointError(f"{path} is damaged: its CRC-32 is {crc:08x}, {record['crc32']:08x} was saved "
                              f"(recorded in {recorded_in})")
    return raw


def _parse_npy(path: str, raw: bytes) -> np.ndarray:
    """The array of a ``.npy`` file's bytes (a view, no copy), or CheckpointError naming ``path``."""
    stream = io.BytesIO(raw)
    try:
        major, _ = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(stream)
        count = int(np.prod(shape))
        if dtype.hasobject or fortran and len(shape) > 1:
            raise ValueError(f"unsupported array {dtype} (fortran order {fortran})")
        data_bytes = len(raw) - stream.tell()
        if data_bytes != count * dtype.itemsize:
            raise ValueError(f"the header says {shape} {dtype} ({count * dtype.itemsize} bytes), the file holds "
                             f"{data_bytes} bytes of data")
        return np.frombuffer(raw, dtype=dtype, count=count, offset=stream.tell()).reshape(shape)
    except (ValueError, EOFError, SyntaxError, TypeError) as exc:
        what = "empty" if not raw else "not a readable .npy file"
        raise CheckpointError(f"{path} is {what} ({exc})") from None


def _read_json(path: str, record: dict | None, recorded_in: str) -> Any:
    raw = _read_file(path, record, recorded_in)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is damaged: not JSON ({exc})") from None


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"bytes", "crc32"} and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values())


def _is_unit(value: Any) -> bool:
    return (isinstance(value, dict) and {"name", "dtype", "layout", "optimizer"} <= set(value)
            and isinstance(value["optimizer"], dict) and isinstance(value["optimizer"].get("arrays"), list)
            and isinstance(value["optimizer"].get("scalars"), dict))


def _read_latest(path: str) -> tuple[str, dict | None]:
    """(the version directory ``LATEST`` names, the record of its metadata.json or None for old checkpoints)."""
    latest = os.path.join(path, "LATEST")
    if not os.path.exists(latest):
        raise CheckpointNotFoundError(f"no FSDP sharded checkpoint in {path!r} (no LATEST file)")
    record = _read_json(latest, None, "")
    if (not isinstance(record, dict) or set(record) - {"version", "metadata"}
            or not _VERSION.fullmatch(str(record.get("version")))
            or "metadata" in record and not _is_record(record["metadata"])):
        raise CheckpointError(f"{latest} is damaged: expected {{\"version\": \"v000001\", \"metadata\": "
                              f"{{\"bytes\": ..., \"crc32\": ...}}}}, got {json.dumps(record)[:200]}")
    directory = os.path.join(path, record["version"])
    if not os.path.isdir(directory):
        raise CheckpointError(f"{latest} names version {record['version']}, but {directory} does not exist")
    return directory, record.get("metadata")


def read_latest(path: str) -> str:
    """The version directory ``LATEST`` points at (CheckpointNotFoundError if none, CheckpointError if damaged)."""
    return _read_latest(path)[0]


def _read_metadata(directory: str, record: dict | None) -> dict:
    meta_file = os.path.join(directory, "metadata.json")
    meta = _read_json(meta_file, record, os.path.join(os.path.dirname(directory), "LATEST"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_file}: not an mpcomm FSDP sharded checkpoint (format {found!r})")
    units, files = meta.get("units"), meta.get("files", {})
    if not isinstance(units, list) or not all(_is_unit(u) for u in units):
        raise CheckpointError(f"{meta_file} is damaged: 'units' must list objects with name, dtype, layout and "
                              "optimizer {arrays, scalars}")
    if not isinstance(files, dict) or not all(_is_record(r) for r in files.values()):
        raise CheckpointError(f"{meta_file} is damaged: 'files' must map file names to {{bytes, crc32}}")
    return meta


# ---- sharded ------------------------------------------------------------------------------------
def _next_version(path: str) -> int:
    """Rank 0: create ``path`` and the next version's (empty) directory; returns its number."""
    os.makedirs(path, exist_ok=True)
    try:
        version = int(os.path.basename(read_latest(path))[1:]) + 1
    except CheckpointNotFoundError:
        version = 1
    except CheckpointError:  # a damaged LATEST: go past every version directory there is
        version = 1 + max((int(n[1:]) for n in os.listdir(path) if _VERSION.fullmatch(n)), default=0)
    stale = os.path.join(path, f"v{version:06d}")
    if os.path.isdir(stale):  # a crashed earlier attempt at this version: never mix its files in
        shutil.rmtree(stale)
    os.makedirs(stale)
    return version


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


def check_optimizer(engine: "FullyShardedDataParallel", optimizer: Optimizer) -> None:
    """ValueError unless ``optimizer`` was built over exactly ``engine.parameters()``, in that order (its state is
    saved and loaded per shard, by position)."""
    mine = [id(p) for p in engine.parameters()]
    if [id(p) for p in getattr(optimizer, "params", [])] != mine:
        raise ValueError("the optimizer must be built over exactly engine.parameters(), in that order")


def save_sharded(engine: "FullyShardedDataParallel", path: str, optimizer: Optimizer | None = None) -> None:
    comm, groups = engine.comm, engine.groups
    if optimizer is not None:
        check_optimizer(engine, optimizer)
    what = f"FSDP save_sharded({path!r})"
    version = np.array([_on_every_rank(comm, what, lambda: _next_version(path) if comm.rank == 0 else 0)])
    comm.broadcast(version, root=0)
    directory = os.path.join(path, f"v{int(version[0]):06d}")

    def write_shards() -> tuple[list, dict]:
        units_meta, files = [], {}
        for i, u in enumerate(engine.units):
            arrays, scalars = _optimizer_parts(engine, optimizer, i)
            if groups.replica_index == 0:
                for key, value in [("param", u.shard.data), *arrays.items()]:
                    name = _shard_name(i, key, groups.shard_index)
                    files[name] = _write_npy(os.path.join(directory, name), to_numpy(value))
            units_meta.append({"name": u.name, "dtype": str(u.master_dtype), "layout": u.layout.to_json(),
                               "optimizer": {"arrays": sorted(arrays), "scalars": scalars}})
            if compression is not None and u.name in compression["error"]:
                name = _error_name(i, comm.rank)
                files[name] = _write_npy(os.path.join(directory, name), compression["error"][u.name])
            q = None if compression is None else pack_q(u, compression["powersgd_q"])
            if q is not None and comm.rank == 0:
                files[_q_name(i)] = _write_npy(os.path.join(directory, _q_name(i)), q)
        return units_meta, files

    compression = engine.compression_state_dict()

    units_meta, files = _on_every_rank(comm, what, write_shards)
    every_file = {}  # every shard file is in place (this is collective) before the version can become LATEST
    for text in _allgather_text(comm, json.dumps(files)):
        every_file.update(json.loads(text))

    def publish() -> None:
        if comm.rank != 0:
            return
        meta = {"format": FORMAT, "world_size": comm.size, "shard_count": groups.shard_count,
                "strategy": engine.strategy.value, "units": units_meta,
                "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                "files": dict(sorted(every_file.items()))}
        if compression is not None:  # (every rank holds errors of the same units: the choices are collective)
            meta["compression"] = {"mode": compression["mode"], "steps": compression["steps"],
                                   "units": [i for i, u in enumerate(engine.units) if u.name in compression["error"]],
                                   "q_units": [i for i, u in enumerate(engine.units)
                                               if pack_q(u, compression["powersgd_q"]) is not None]}
        record = _write_json(os.path.join(directory, "metadata.json"), meta)
        _write_json(os.path.join(path, "LATEST"), {"version": os.path.basename(directory), "metadata": record})
        for name in os.listdir(path):  # older versions and leftovers of crashed saves (only our own names)
            full = os.path.join(path, name)
            if _VERSION.fullmatch(name) and name != os.path.basename(directory):
                shutil.rmtree(full, ignore_errors=True)
            elif name.startswith(".LATEST.tmp-"):
                os.unlink(full)

    _on_every_rank(comm, what, publish)


def load_sharded(engine: "FullyShardedDataParallel", path: str, optimizer: Optimizer | None = None) -> None:
    """Verify and read this rank's shards; only when every rank succeeded is anything changed (collective)."""
    if optimizer is not None:
        check_optimizer(engine, optimizer)
    staged, compression = _on_every_rank(engine.comm, f"FSDP load_sharded({path!r})",
                                         lambda: _read_sharded(engine, path, optimizer is not None))
    # Every rank has finished reading (the agreement is collective): a later save may delete this version.
    new_state = {}
    for i, (u, (param, state)) in enumerate(zip(engine.units, staged)):
        u.shard.data[...] = param if array_module(u.shard.data) is np else engine.xp.asarray(param)
        if state:
            like = u.shard.data
            new_state[i] = {k: v if not isinstance(v, np.ndarray) or array_module(like) is np else engine.xp.asarray(v)
                            for k, v in state.items()}
    if optimizer is not None:
        optimizer.state = new_state
    if compression is not None:
        engine.load_compression_state_dict(compression)


def _read_sharded(engine, path: str, with_optimizer: bool) -> tuple[list[tuple[np.ndarray, dict]], dict | None]:
    """This rank's (parameter shard, optimizer state) per unit, and its compression state (None: the engine does
    not compress), every file read verified; nothing is changed."""
    directory, meta_record = _read_latest(path)
    meta = _read_metadata(directory, meta_record)
    meta_file = os.path.join(directory, "metadata.json")
    files = meta.get("files")
    if files is None:
        warnings.warn(f"mpcomm: the FSDP checkpoint in {path!r} has no checksums (saved by an older mpcomm): its "
                      "files are checked for header, shape, dtype and length only; save it again to add them",
                      RuntimeWarning, stacklevel=6)  # the caller of engine.load_sharded
    if len(meta["units"]) != len(engine.units):
        raise CheckpointError(f"checkpoint has {len(meta['units'])} FSDP units, this engine has {len(engine.units)} "
                              "(use the same auto_wrap_policy as when saving)")
    groups = engine.groups
    staged = []
    for i, (u, um) in enumerate(zip(engine.units, meta["units"])):
        try:
            old = FlatLayout.from_json(um["layout"])
            dtype = np.dtype(um["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{meta_file} is damaged: unit {i}: {_describe(exc)}") from None
        diff = u.layout.same_params(old)
        if diff is not None or um["name"] != u.name:
            raise CheckpointError(f"checkpoint unit {i} ({um['name']!r}) does not match this model's unit "
                                  f"{u.name!r}: {diff}")
        if dtype != u.master_dtype:
            raise CheckpointError(f"checkpoint unit {u.name!r} is {um['dtype']}, the model is {u.master_dtype}")
        pieces = reshard_plan(old, u.layout, groups.shard_index)

        def read(key: str) -> np.ndarray:
            out = np.zeros(u.layout.shard_numel, dtype=u.master_dtype)  # padding stays zero
            for piece in pieces:
                name = _shard_name(i, key, piece.old_index)
                if files is not None and name not in files:
                    raise CheckpointError(f"{meta_file} is damaged: it records no checksum for {name}")
                file = os.path.join(directory, name)
                src = _parse_npy(file, _read_file(file, None if files is None else files[name], meta_file))
                if src.shape != (old.shard_numel,) or src.dtype != u.master_dtype:
                    raise CheckpointError(f"{file} holds {src.shape} {src.dtype}, the checkpoint's layout says "
                                          f"({old.shard_numel},) {u.master_dtype}")
                out[piece.dst_lo : piece.dst_hi] = src[piece.src_lo : piece.src_hi]
            return out

        state: dict[str, Any] = {}
        if with_optimizer:
            state = dict(um["optimizer"]["scalars"])
            state.update((key, read(key)) for key in um["optimizer"]["arrays"])
        staged.append((read("param"), state))
    return staged, _read_compression(engine, directory, meta, files)


def _read_compression(engine, directory: str, meta: dict, files: dict | None) -> dict | None:
    """This rank's compression state from the checkpoint (see the module docstring), or None without compression."""
    if engine.compressor is None:
        return None
    spec = engine.compressor.spec
    saved = meta.get("compression")
    if saved is None:
        return {"mode": spec.name, "steps": 0, "error": {}, "powersgd_q": {}}
    meta_file = os.path.join(directory, "metadata.json")
    if saved["mode"] != spec.name:
        raise CheckpointError(f"{meta_file}: saved with compression={saved['mode']!r}, this engine uses {spec.name!r}")

    def read(name: str, shape: tuple, dtype: np.dtype, what: str) -> np.ndarray:
        if files is not None and name not in files:
            raise CheckpointError(f"{meta_file} is damaged: it records no checksum for {name}")
        file = os.path.join(directory, name)
        src = _parse_npy(file, _read_file(file, None if files is None else files[name], meta_file))
        if src.shape != shape or src.dtype != dtype:
            raise CheckpointError(f"{file} holds {src.shape} {src.dtype}, {what} is {shape} {dtype}")
        return src

    old_world, world, rank = int(meta["world_size"]), engine.comm.size, engine.comm.rank
    error = {}
    for i in saved["units"]:
        u = engine.units[i]
        shape, what = (u.layout.numel,), f"unit {u.name!r}'s error"
        if old_world == world:
            error[u.name] = read(_error_name(i, rank), shape, u.reduce_dtype, what)
            continue
        total = np.zeros(u.layout.numel, dtype=np.float64)
        for old_rank in range(old_world):
            total += read(_error_name(i, old_rank), shape, u.reduce_dtype, what)
        error[u.name] = (total / old_world).astype(u.reduce_dtype)
    q: dict[str, np.ndarray] = {}
    for i in saved.get("q_units", []):
        u = engine.units[i]
        shape, what = (q_numel(u, spec.rank),), f"unit {u.name!r}'s PowerSGD Q"
        q.update(unpack_q(u, read(_q_name(i), shape, u.reduce_dtype, what), spec.rank))
    return {"mode": spec.name, "steps": int(saved["steps"]), "error": error, "powersgd_q": q}



# ---- full -----------------------------------------------------------------------------------------
def save_full(engine: "FullyShardedDataParallel", path: str) -> None:
    state: dict[str, Any] = engine.full_state_dict()  # (Any: numpy's savez types **arrays like its keywords)

    def write() -> None:
        if engine.comm.rank == 0:
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            _atomic_write(path, lambda f: np.savez(f, **state))

    _on_every_rank(engine.comm, f"FSDP save_full({path!r})", write)
