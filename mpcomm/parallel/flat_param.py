"""Flat-parameter bookkeeping for FSDP: pure layout arithmetic, no communication, no module state.

A unit's parameters are concatenated in a fixed order into one flat buffer, padded at the end to a multiple
of the shard count and split into equal contiguous shards. Each original keeps ``(name, shape, offset,
numel)``; the offsets do not depend on the shard count (only the padding does), so a checkpoint written
with one shard count can be read back with another by slicing global flat ranges (:func:`reshard_plan`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives in the unpadded flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "offset": self.offset, "numel": self.numel}

    @staticmethod
    def from_json(d: dict) -> "ParamInfo":
        return ParamInfo(d["name"], tuple(int(s) for s in d["shape"]), int(d["offset"]), int(d["numel"]))


@dataclass(frozen=True)
class FlatLayout:
    """Concatenation order and sharding of one unit's parameters over ``shard_count`` shards."""

    params: tuple[ParamInfo, ...]
    shard_count: int

    @staticmethod
    def build(named_shapes: Sequence[tuple[str, Sequence[int]]], shard_count: int) -> "FlatLayout":
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {shard_count}")
        infos, offset, seen = [], 0, set()
        for name, shape in named_shapes:
            if name in seen:
                raise ValueError(f"parameter name {name!r} appears twice in one flat parameter")
            seen.add(name)
            shape = tuple(int(s) for s in shape)
            numel = math.prod(shape)
            infos.append(ParamInfo(name, shape, offset, numel))
            offset += numel
        return FlatLayout(tuple(infos), int(shard_count))

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements of all originals together (no padding)."""
        last = self.params[-1] if self.params else None
        return last.offset + last.numel if last else 0

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shard_count)  # ceil

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shard_count

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, index: int) -> tuple[int, int]:
        """Global flat range ``[lo, hi)`` of shard ``index`` (it may reach into the padding)."""
        if not 0 <= index < self.shard_count:
            raise ValueError(f"shard index {index} out of range for {self.shard_count} shards")
        return index * self.shard_numel, (index + 1) * self.shard_numel

    def reshard(self, shard_count: int) -> "FlatLayout":
        """The same parameters split over another number of shards."""
        return FlatLayout(self.params, int(shard_count))

    # ---- buffers --------------------------------------------------------------------------
    def flatten(self, arrays: Sequence[Any], xp: Any, dtype: Any) -> Any:
        """A new padded flat buffer (zeros in the padding) holding ``arrays`` in layout order."""
        if len(arrays) != len(self.params):
            raise ValueError(f"flatten: got {len(arrays)} arrays for {len(self.params)} parameters")
        out = xp.zeros(self.padded_numel, dtype=dtype)
        for info, a in zip(self.params, arrays):
            if tuple(a.shape) != info.shape:
                raise ValueError(f"flatten: {info.name!r} has shape {tuple(a.shape)}, layout says {info.shape}")
            out[info.offset : info.offset + info.numel] = a.reshape(-1)
        return out

    def views(self, flat: Any) -> list[Any]:
        """Views into ``flat`` (padded or not) shaped like each original, in layout order."""
        if flat.shape[0] < self.numel:
            raise ValueError(f"views: flat buffer has {flat.shape[0]} elements, layout needs {self.numel}")
        return [flat[i.offset : i.offset + i.numel].reshape(i.shape) for i in self.params]

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_json(self) -> dict:
        return {"numel": self.numel, "shard_count": self.shard_count, "shard_numel": self.shard_numel,
                "padded_numel": self.padded_numel, "padding": self.padding,
                "params": [p.to_json() for p in self.params]}

    @staticmethod
    def from_json(d: dict) -> "FlatLayout":
        layout = FlatLayout(tuple(ParamInfo.from_json(p) for p in d["params"]), int(d["shard_count"]))
        if layout.numel != int(d["numel"]) or layout.shard_numel != int(d["shard_numel"]):
            raise ValueError(f"inconsistent flat layout metadata: {d}")
        return layout

    def same_params(self, other: "FlatLayout") -> str | None:
        """None when both hold the same names/shapes/offsets, else a description of the first difference."""
        if len(self.params) != len(other.params):
            return f"{len(self.params)} parameters vs {len(other.params)}"
        for a, b in zip(self.params, other.params):
            if a != b:
                return f"{a.name} {a.shape}@{a.offset} vs {b.name} {b.shape}@{b.offset}"
        return None


@dataclass(frozen=True)
class Piece:
    """Copy ``old[src_lo:src_hi]`` of old shard ``old_index`` into ``new[dst_lo:dst_hi]``."""

    old_index: int
    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int


def reshard_plan(old: FlatLayout, new: FlatLayout, new_index: int) -> list[Piece]:
    """Which slices of which old shards fill new shard ``new_index`` (padding is not read; it stays zero)."""
    if old.numel != new.numel:
        raise ValueError(f"reshard: old layout has {old.numel} elements, new has {new.numel}")
    lo, hi = new.shard_range(new_index)
    hi = min(hi, new.numel)
    pieces: list[Piece] = []
    if lo >= hi:
        return pieces
    for k in range(lo // old.shard_numel, (hi - 1) // old.shard_numel + 1):
        olo, ohi = old.shard_range(k)
        a, b = max(lo, olo), min(hi, ohi)
        if a < b:
            pieces.append(Piece(k, a - olo, b - olo, a - lo, b - lo))
    return pieces
