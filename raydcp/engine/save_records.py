"""The records the save protocol's steps pass (:mod:`raydcp.engine.protocol`).

- :class:`SaveHeader` -- what the plan step gives rank 0 for the commit: the checkpoint's
  save id, world size, tensors and values.
- :class:`StorageRecord` -- what a rank wrote in the write step: one row per piece (file,
  byte range, checksums), held as columns; the commit builds the metadata from the ranks'
  records. Records travel to the coordinator as a plain pickle of their columns between
  processes of one running job; a journal keeps them as rows (:meth:`StorageRecord.rows`),
  never as a pickle.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..planner import LocalSavePlan, PackedNames, TensorSpec
from ..planner.types import digest

__all__ = ["SaveHeader", "StorageRecord"]


@dataclass(frozen=True)
class SaveHeader:
    """What the commit needs beyond the ranks' records: the checkpoint's id, size and contents."""

    save_id: str
    world_size: int
    tensors: Mapping[str, TensorSpec]
    values: Mapping[str, Any]


class StorageRecord:
    """Where one rank wrote its pieces: one row per piece, held as arrays (no object per piece).

    Row ``i``: the box ``offsets[i, :ndim[i]]``, ``sizes[i, :ndim[i]]`` of tensor ``keys[key[i]]``
    (boxes padded to the record's width with offset 0 and size 1) is bytes
    ``[byte_offsets[i], byte_offsets[i] + nbytes[i])`` of file ``files[file[i]]``, with CRC32C
    ``crcs[i]`` and, for a piece over one checksum block, the blocks' CRCs
    ``block_values[block_bounds[i]:block_bounds[i + 1]]``. ``keys_digest`` identifies the list
    ``keys`` (equal lists, equal digests): the commit maps each distinct list to the checkpoint's
    tensors once, and ``keys`` travels packed (:class:`~raydcp.planner.PackedNames`), so the
    coordinator makes no string per key of a list it has already seen.

    Where a piece was compressed, ``codec[i]`` (uint8: 0 raw, else the 1-based position in
    :data:`raydcp.metadata.COMPRESSIONS`) and ``stored[i]`` (int64: the bytes in the file, which
    ``crcs[i]`` covers; ``byte_offsets[i] + stored[i]`` ends the piece) are given for every row;
    both are None where every piece is raw, so a raw record carries no extra column.
    """

    __slots__ = ("keys", "keys_digest", "key", "ndim", "offsets", "sizes", "files", "file", "byte_offsets",
                 "nbytes", "crcs", "block_values", "block_bounds", "codec", "stored")

    def __init__(self, keys: Sequence[str] = (), key=None, ndim=None, offsets=None, sizes=None,
                 files: Sequence[str] = (), file=None, byte_offsets=None, nbytes=None, crcs=None,
                 block_values=None, block_bounds=None, codec=None, stored=None, keys_digest: bytes | None = None):
        n = 0 if key is None else len(key)

        def col(a, dtype=np.int64):
            return np.zeros(n, dtype) if a is None else np.asarray(a, dtype)

        self.keys = keys if isinstance(keys, PackedNames) else tuple(keys)
        self.keys_digest = keys_digest if keys_digest is not None else digest(tuple(self.keys))
        self.key, self.ndim, self.file = col(key), col(ndim), col(file)
        self.offsets = np.zeros((n, 1), np.int64) if offsets is None else np.asarray(offsets, np.int64)
        self.sizes = np.ones(self.offsets.shape, np.int64) if sizes is None else np.asarray(sizes, np.int64)
        self.files = tuple(files)
        self.byte_offsets, self.nbytes, self.crcs = col(byte_offsets), col(nbytes), col(crcs)
        self.block_values = np.zeros(0, np.uint32) if block_values is None else np.asarray(block_values, np.uint32)
        self.block_bounds = np.zeros(n + 1, np.int64) if block_bounds is None else np.asarray(block_bounds, np.int64)
        if (codec is None) != (stored is None):
            raise ValueError("a storage record's codec and stored columns come together")
        self.codec = self.stored = None
        if codec is not None:
            codec = np.asarray(codec, np.uint8)
            if codec.any():  # else every piece is raw: no columns
                self.codec, self.stored = codec, np.asarray(stored, np.int64)
        if (any(len(c) != n for c in (self.ndim, self.file, self.byte_offsets, self.nbytes, self.crcs))
                or self.offsets.ndim != 2 or len(self.offsets) != n or self.sizes.shape != self.offsets.shape
                or len(self.block_bounds) != n + 1
                or (self.codec is not None and (len(self.codec) != n or len(self.stored) != n))):
            raise ValueError("the columns of a storage record differ in length")

    def __len__(self) -> int:
        return len(self.key)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @property
    def width(self) -> int:
        return self.offsets.shape[1]

    @property
    def stored_lengths(self) -> np.ndarray:
        """The bytes each piece takes in its file: ``stored`` where pieces were compressed, else ``nbytes``."""
        return self.nbytes if self.stored is None else self.stored

    def rows(self) -> Iterator[tuple]:
        """``(key, offsets, sizes, file, byte offset, nbytes, crc, blocks)`` per piece (journals, tools)."""
        keys, files = self.keys, self.files
        bv, bb = self.block_values.tolist(), self.block_bounds.tolist()
        for i, (k, nd, o, s, f, b, n, c) in enumerate(zip(
                self.key.tolist(), self.ndim.tolist(), self.offsets.tolist(), self.sizes.tolist(),
                self.file.tolist(), self.byte_offsets.tolist(), self.nbytes.tolist(), self.crcs.tolist())):
            yield keys[k], tuple(o[:nd]), tuple(s[:nd]), files[f], b, n, c, tuple(bv[bb[i]:bb[i + 1]])

    @classmethod
    def from_rows(cls, rows: Sequence[tuple], codec: Sequence[int] | None = None,
                  stored: Sequence[int] | None = None) -> "StorageRecord":
        """A record from ``(key, offsets, sizes, file, byte offset, nbytes, crc, blocks)`` tuples and,
        where pieces were compressed, each row's codec id and stored length."""
        n = len(rows)
        if not n:
            if codec or stored:
                raise ValueError("the columns of a storage record differ in length")
            return cls()
        cols = list(zip(*rows))
        keys = {k: i for i, k in enumerate(dict.fromkeys(cols[0]))}
        files = {f: i for i, f in enumerate(dict.fromkeys(cols[3]))}
        ndim = np.fromiter(map(len, cols[1]), np.int64, n)
        if (np.fromiter(map(len, cols[2]), np.int64, n) != ndim).any():
            raise ValueError("a piece's offsets and sizes differ in length")
        width = max(1, int(ndim.max()))
        offsets, sizes = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        for i, (o, s) in enumerate(zip(cols[1], cols[2])):
            offsets[i, :len(o)], sizes[i, :len(s)] = o, s
        blen = np.fromiter(map(len, cols[7]), np.int64, n)
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(blen, out=bounds[1:])
        return cls(tuple(keys), [keys[k] for k in cols[0]], ndim, offsets, sizes, tuple(files),
                   [files[f] for f in cols[3]], cols[4], cols[5], cols[6],
                   np.fromiter(chain.from_iterable(cols[7]), np.uint32, int(bounds[-1])), bounds, codec, stored)

    @classmethod
    def written(cls, plan: LocalSavePlan, layouts: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                crcs: Sequence[int], blocks: Sequence[tuple[int, ...]], codec: Sequence[int] | None = None,
                stored: Sequence[int] | None = None) -> "StorageRecord":
        """What a rank wrote (step 2): ``layouts`` lists ``(file name, item indices, byte offsets)``
        per file, ``crcs[i]`` and ``blocks[i]`` are item i's checksum and block checksums and, where
        pieces were compressed, ``codec[i]`` and ``stored[i]`` its codec id and stored length. Rows in
        file order, taken from the plan's columns (:class:`~raydcp.planner.ItemColumns`); from its
        items where the columns cannot stand for them."""
        if codec is not None and not any(codec):
            codec = stored = None  # every piece raw
        cols = getattr(plan, "columns", None)
        if cols is not None and len(cols.key) == len(plan.items) and (not len(cols.key) or int(cols.ndim.min()) >= 0):
            return cls._of_columns(cols, layouts, crcs, blocks, codec, stored)
        items = plan.items
        ids = [i for _, file_ids, _ in layouts for i in file_ids]
        return cls.from_rows([(items[i].key, items[i].offsets, items[i].sizes, name, off, items[i].nbytes, crcs[i],
                               blocks[i]) for name, file_ids, offs in layouts for i, off in zip(file_ids, offs)],
                             None if codec is None else [codec[i] for i in ids],
                             None if stored is None else [stored[i] for i in ids])

    @classmethod
    def _of_columns(cls, columns, layouts, crcs, blocks, codec=None, stored=None) -> "StorageRecord":
        counts = [len(ids) for _, ids, _ in layouts]
        n = sum(counts)
        ids = np.fromiter(chain.from_iterable(ids for _, ids, _ in layouts), np.int64, n)
        idl = ids.tolist()
        if codec is not None:
            codec, stored = np.asarray(codec, np.uint8)[ids], np.asarray(stored, np.int64)[ids]
        blen = np.fromiter((len(blocks[i]) for i in idl), np.int64, n)
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(blen, out=bounds[1:])
        return cls(PackedNames.of(columns.keys), columns.key[ids], columns.ndim[ids], np.take(columns.offsets, ids, 0),
                   np.take(columns.sizes, ids, 0), [name for name, _, _ in layouts],
                   np.repeat(np.arange(len(layouts)), counts),
                   np.fromiter(chain.from_iterable(offs for _, _, offs in layouts), np.int64, n), columns.nbytes[ids],
                   np.fromiter((crcs[i] for i in idl), np.int64, n),
                   np.fromiter(chain.from_iterable(blocks[i] for i in idl), np.uint32, int(bounds[-1])), bounds,
                   codec, stored, keys_digest=columns.keys_digest)

    @classmethod
    def concat(cls, records: Sequence["StorageRecord"]) -> "StorageRecord":
        """One record holding the rows of ``records`` in order (batches of a rank, rounds of a save)."""
        records = [r for r in records if len(r)]
        if len(records) == 1:
            return records[0]
        if not records:
            return cls()
        keys: dict[str, int] = {}
        key_maps: dict[bytes, np.ndarray] = {}
        files: dict[str, int] = {}
        for r in records:
            if r.keys_digest not in key_maps:
                key_maps[r.keys_digest] = np.array([keys.setdefault(k, len(keys)) for k in r.keys] or [0], np.int64)
        width = max(r.width for r in records)
        parts = [_pad(r.offsets, width, 0) for r in records], [_pad(r.sizes, width, 1) for r in records]
        fmaps = [np.array([files.setdefault(f, len(files)) for f in r.files] or [0], np.int64) for r in records]
        bounds = np.zeros(sum(map(len, records)) + 1, np.int64)
        np.cumsum(np.concatenate([np.diff(r.block_bounds) for r in records]), out=bounds[1:])
        codec = stored = None
        if any(r.codec is not None for r in records):  # raw records' rows: codec 0, stored length nbytes
            codec = np.concatenate([np.zeros(len(r), np.uint8) if r.codec is None else r.codec for r in records])
            stored = np.concatenate([r.stored_lengths for r in records])
        same_keys = len(key_maps) == 1
        return cls(records[0].keys if same_keys else tuple(keys),
                   np.concatenate([key_maps[r.keys_digest][r.key] for r in records]),
                   np.concatenate([r.ndim for r in records]), np.concatenate(parts[0]), np.concatenate(parts[1]),
                   tuple(files), np.concatenate([m[r.file] for m, r in zip(fmaps, records)]),
                   *(np.concatenate([getattr(r, c) for r in records]) for c in ("byte_offsets", "nbytes", "crcs")),
                   np.concatenate([r.block_values[r.block_bounds[0]:r.block_bounds[-1]] for r in records]), bounds,
                   codec, stored, keys_digest=records[0].keys_digest if same_keys else None)

    def __eq__(self, other) -> bool:
        if not isinstance(other, StorageRecord):
            return NotImplemented
        return (len(self) == len(other) and list(self.rows()) == list(other.rows())
                and (self.codec is None) == (other.codec is None)
                and (self.codec is None or (np.array_equal(self.codec, other.codec)
                                            and np.array_equal(self.stored, other.stored))))

    __hash__ = None

    def __repr__(self) -> str:
        return f"StorageRecord({len(self)} pieces in {len(self.files)} files, {self.total_bytes} bytes)"

    def __reduce__(self):
        keys = PackedNames.of(self.keys)
        return (_storage_record, (keys, self.key, self.ndim, self.offsets, self.sizes, self.files, self.file,
                                  self.byte_offsets, self.nbytes, self.crcs, self.block_values, self.block_bounds,
                                  self.codec, self.stored, self.keys_digest))


def _storage_record(*args) -> StorageRecord:
    return StorageRecord(*args[:-1], keys_digest=args[-1])


def _pad(boxes: np.ndarray, width: int, fill: int) -> np.ndarray:
    if boxes.shape[1] == width:
        return boxes
    out = np.full((len(boxes), width), fill, np.int64)
    out[:, :boxes.shape[1]] = boxes
    return out
