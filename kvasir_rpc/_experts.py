"""Which experts of one layer a session holds, stored compactly; and the shape of a model.

A hub keeps every session's announced slices for the session's life and a stranger chooses
them, so they are kept as bytes, not as Python ints (a tuple of ints costs ~36 bytes an
expert), in the smallest of three forms: runs of consecutive ids (8 bytes a run), a bitset
(one bit per id up to the largest), or the ids themselves (4 bytes an id). So a set never
takes more than 4 bytes an id, and a model's whole layer of E experts at most E/8 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

__all__ = ["ExpertSet", "ModelShape", "read_model_shape"]

_RUNS = 0  # (first, last) uint32 pairs: 8 bytes a run
_BITS = 1  # bit i set for id i: (largest id + 1) / 8 bytes
_IDS = 2  # the ids as uint32: 4 bytes an id


class ExpertSet(Sequence[int]):
    """An immutable, sorted set of expert ids (uint32), stored as runs, a bitset or the ids,
    whichever is smallest.

    ``ExpertSet.from_sorted(ids)`` takes ids that must be strictly ascending (else
    ValueError); ``ExpertSet.of(ids)`` sorts and deduplicates any iterable. ``in``, ``len``
    are O(log runs) or O(1); iteration yields the ids ascending; indexing builds
    the ids once (O(n)), for the rare caller that needs positions.
    """

    __slots__ = ("_kind", "_data", "_len", "_hash")

    _kind: int
    _data: bytes
    _len: int
    _hash: int | None

    def __init__(self) -> None:
        self._kind, self._data, self._len, self._hash = _RUNS, b"", 0, None

    @classmethod
    def of(cls, ids: Iterable[int]) -> ExpertSet:
        """Any ids, in any order, repeats allowed."""
        arr = np.unique(np.fromiter((int(i) for i in ids), dtype=np.int64))
        if arr.size and (arr[0] < 0 or arr[-1] > 0xFFFFFFFF):
            raise ValueError("expert ids are uint32")
        return cls._from_array(arr.astype(np.uint32))

    @classmethod
    def from_sorted(cls, ids: Sequence[int]) -> ExpertSet:
        """Ids already strictly ascending (a proto's repeated uint32 as announced): one pass,
        no Python int kept. Raises ValueError when they are not strictly ascending."""
        arr = np.fromiter(ids, dtype=np.uint32, count=len(ids))
        if arr.size > 1 and not bool(np.all(arr[1:] > arr[:-1])):
            raise ValueError("experts must be sorted and unique")
        return cls._from_array(arr)

    @classmethod
    def _from_array(cls, arr: np.ndarray) -> ExpertSet:  # sorted, unique uint32
        self = cls()
        self._len = int(arr.size)
        if arr.size == 0:
            return self
        breaks = np.flatnonzero(arr[1:] != arr[:-1] + 1)
        starts = np.concatenate((arr[:1], arr[breaks + 1]))
        lasts = np.concatenate((arr[breaks], arr[-1:]))
        runs_bytes, ids_bytes, bits_bytes = 8 * starts.size, 4 * arr.size, (int(arr[-1]) >> 3) + 1
        if bits_bytes < min(runs_bytes, ids_bytes):
            mask = np.zeros(bits_bytes * 8, dtype=np.bool_)
            mask[arr] = True
            self._kind, self._data = _BITS, np.packbits(mask, bitorder="little").tobytes()
        elif ids_bytes < runs_bytes:
            self._kind, self._data = _IDS, arr.astype("<u4").tobytes()
        else:
            # Interleaved (start, last) pairs, little-endian uint32.
            pairs = np.empty(2 * starts.size, dtype="<u4")
            pairs[0::2], pairs[1::2] = starts, lasts
            self._kind, self._data = _RUNS, pairs.tobytes()
        return self

    def to_array(self) -> np.ndarray:
        """The ids ascending, as a new uint32 array."""
        if self._kind == _BITS:
            bits = np.unpackbits(np.frombuffer(self._data, dtype=np.uint8), bitorder="little")
            return np.flatnonzero(bits).astype(np.uint32)
        if self._kind == _IDS:
            return np.frombuffer(self._data, dtype="<u4").astype(np.uint32)
        pairs = np.frombuffer(self._data, dtype="<u4").astype(np.int64)
        starts, lasts = pairs[0::2], pairs[1::2]
        if starts.size == 0:
            return np.empty(0, dtype=np.uint32)
        lengths = lasts - starts + 1
        # Each id is its run's start plus its offset in the run.
        offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return (np.repeat(starts, lengths) + offsets).astype(np.uint32)

    def to_list(self) -> list[int]:
        return self.to_array().tolist()  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored form (what a hub keeps per layer, besides a fixed overhead)."""
        return len(self._data)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, (int, np.integer)) or isinstance(item, bool):
            return False
        e = int(item)
        if e < 0:
            return False
        if self._kind == _BITS:
            return (e >> 3) < len(self._data) and bool(self._data[e >> 3] >> (e & 7) & 1)
        if e > 0xFFFFFFFF:
            return False
        view = np.frombuffer(self._data, dtype="<u4")  # no copy
        if self._kind == _IDS:
            i = int(np.searchsorted(view, e))
            return i < view.size and int(view[i]) == e
        i = int(np.searchsorted(view[0::2], e, side="right")) - 1  # the last run starting at or before e
        return i >= 0 and e <= int(view[2 * i + 1])

    def __iter__(self) -> Iterator[int]:
        if self._kind != _RUNS:
            yield from self.to_list()
            return
        pairs = array("I", self._data)
        for k in range(0, len(pairs), 2):
            yield from range(pairs[k], pairs[k + 1] + 1)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        ids = self.to_list()
        if isinstance(index, slice):
            return tuple(ids[index])
        return ids[index]

    def __eq__(self, other: object) -> bool:
        # Equal to another ExpertSet of the same ids (one set has one stored form), and to a
        # tuple or list of the same ids ascending, as the tuples it replaces were.
        if isinstance(other, ExpertSet):
            return self._kind == other._kind and self._data == other._data
        if isinstance(other, (tuple, list)):
            return len(other) == self._len and list(other) == self.to_list()
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:  # as the tuple of the ids hashes, since it compares equal to it
            self._hash = hash(tuple(self))
        return self._hash

    def __repr__(self) -> str:
        ids = self.to_list() if self._len <= 8 else [*self[:4], "...", *self[-2:]]
        return f"ExpertSet({ids}, n={self._len})"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The expert grid of a model: layers 0..layers-1, experts 0..experts-1 in each."""

    layers: int
    experts: int

    def __post_init__(self) -> None:
        if self.layers < 1 or self.experts < 1:
            raise ValueError(f"a model has at least one layer and one expert (got {self.layers} x {self.experts})")


def read_model_shape(model_dir: str | os.PathLike[str]) -> ModelShape:
    """The layers and experts per layer from a Hugging Face checkpoint's config.json alone
    (no torch, no weights). Raises ValueError naming the file and what is missing."""
    path = pathlib.Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} not found: --model must be a Hugging Face checkpoint folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    experts = text.get("num_experts") or text.get("num_local_experts")
    layers = text.get("num_hidden_layers")
    if not experts and isinstance(layers, int):
        # As read_model_info: a config that names the count otherwise, its expert tensors say it.
        from kvasir_rpc._checkpoint import _experts_in_tensors

        experts = _experts_in_tensors(path.parent)[0] or None
    if not isinstance(experts, int) or not isinstance(layers, int):
        raise ValueError(f"{path}: not a Mixture-of-Experts config (needs num_hidden_layers, and num_experts "
                         "or num_local_experts or expert tensors in the safetensors files)")
    return ModelShape(layers=layers, experts=experts)
