"""Checkpoint metadata: the versioned, pickle-free description of a committed checkpoint.

This module holds the model (Metadata, per-tensor chunk tables, their shared columns);
``raydcp.metadata_format`` encodes it to the metadata file ``raydcp.meta`` and back.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from .lazy import LazyMapping

__all__ = ["first_use", "FORMAT_VERSION", "COMPRESSED_FORMAT_VERSION", "REFERENCE_FORMAT_VERSION", "READ_MAJORS", "BLOCK_BYTES", "COMPRESSIONS", "ChunkMeta",
           "ChunkTable", "ChunkColumns", "TensorMeta", "TensorMetas", "Metadata"]

FORMAT_VERSION = (1, 0)              # a checkpoint without compressed pieces (raydcp before compression reads it)
COMPRESSED_FORMAT_VERSION = (2, 0)   # one with compressed pieces: 1.0 plus each piece's codec and stored length
REFERENCE_FORMAT_VERSION = (3, 0)   # one naming files of other checkpoints (a delta checkpoint): 2.0 plus ../ names
READ_MAJORS = (1, 2, 3)              # the major versions this raydcp reads

# The codecs a piece may be stored with (raydcp.codec.compress). In memory a piece's codec is its
# 1-based position here, 0 for a raw piece; the metadata file names the codecs (docs/FORMAT.md).
COMPRESSIONS = ("zstd", "lz4")


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One stored piece of a tensor: the box [offsets, offsets+sizes) of ``nbytes`` bytes, stored at
    file[byte_offset:+stored_length] -- raw, or compressed with codec ``compression``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    nbytes: int
    checksum: int  # CRC32C of the stored bytes (compressed ones where the piece is compressed)
    # CRC32C of each BLOCK_BYTES block of a raw chunk larger than one block (else empty), so a
    # reader that needs only part of a chunk can verify what it reads
    block_checksums: tuple[int, ...] = ()
    compression: str | None = None    # a codec of COMPRESSIONS, None: raw
    stored_nbytes: int | None = None  # the compressed length (None: raw, ``nbytes``)

    @property
    def stored_length(self) -> int:
        """The bytes the piece takes in its file."""
        return self.nbytes if self.stored_nbytes is None else self.stored_nbytes


BLOCK_BYTES = 1 << 20


class ChunkTable(Sequence):
    """The chunks of one tensor as columns: a read-only sequence of :class:`ChunkMeta`.

    ``offsets`` and ``sizes`` are (n, ndim) int64 arrays, ``file`` indexes ``files``,
    ``block_values[block_bounds[i]:block_bounds[i + 1]]`` are chunk i's block checksums;
    ``codec`` (uint8: 0 raw, else the 1-based position in :data:`COMPRESSIONS`) and ``stored``
    (int64: the length in the file) are None where every chunk is raw.
    Decoded metadata holds its chunks this way (views of the Arrow columns); a
    :class:`ChunkMeta` is built only for the chunks a caller indexes or iterates.
    """

    __slots__ = ("offsets", "sizes", "files", "file", "byte_offset", "nbytes", "checksum",
                 "block_values", "block_bounds", "_objs", "origin", "codec", "stored")

    def __init__(self, offsets, sizes, files, file, byte_offset, nbytes, checksum, block_values, block_bounds,
                 origin=None, codec=None, stored=None):
        self.offsets, self.sizes, self.files, self.file = offsets, sizes, files, file
        self.byte_offset, self.nbytes, self.checksum = byte_offset, nbytes, checksum
        self.block_values, self.block_bounds = block_values, block_bounds
        self.codec, self.stored = codec, stored
        self._objs = None
        # (ChunkColumns, tensor index) when this table is one tensor's rows of a ChunkColumns:
        # the encoder then takes the shared columns instead of concatenating the tables
        self.origin = origin

    @classmethod
    def from_chunks(cls, chunks: Sequence[ChunkMeta], ndim: int) -> "ChunkTable":
        if isinstance(chunks, ChunkTable):
            return chunks
        n = len(chunks)
        if any(len(c.offsets) != ndim or len(c.sizes) != ndim for c in chunks):
            raise ValueError("chunk boxes of the wrong dimension")
        files: dict[str, int] = {}
        blocks = [b for c in chunks for b in c.block_checksums]
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum([len(c.block_checksums) for c in chunks], out=bounds[1:])
        codec = stored = None
        if any(c.compression is not None for c in chunks):
            codec = np.array([codec_id(c.compression) for c in chunks], np.uint8)
            stored = np.array([c.stored_length for c in chunks], np.int64)
        t = cls(np.array([c.offsets for c in chunks], np.int64).reshape(n, ndim),
                np.array([c.sizes for c in chunks], np.int64).reshape(n, ndim),
                None, np.array([files.setdefault(c.file, len(files)) for c in chunks], np.int64),
                np.array([c.byte_offset for c in chunks], np.int64), np.array([c.nbytes for c in chunks], np.int64),
                np.array([c.checksum for c in chunks], np.int64), np.array(blocks, np.uint32), bounds,
                codec=codec, stored=stored)
        t.files = list(files)
        t._objs = tuple(chunks)
        return t

    def __len__(self) -> int:
        return len(self.nbytes)

    def _all(self) -> tuple[ChunkMeta, ...]:
        if self._objs is None:
            files = self.files
            bb = self.block_bounds.tolist()
            bv = self.block_values[bb[0]:bb[-1]].tolist() if len(bb) > 1 else []
            base = bb[0] if bb else 0
            objs = tuple(
                ChunkMeta(o, s, files[f], b, n, c, tuple(bv[lo - base:hi - base]))
                for o, s, f, b, n, c, lo, hi in zip(map(tuple, self.offsets.tolist()), map(tuple, self.sizes.tolist()),
                                                   self.file.tolist(), self.byte_offset.tolist(), self.nbytes.tolist(),
                                                   self.checksum.tolist(), bb[:-1], bb[1:]))
            if self.codec is not None:
                objs = tuple(_packed(c, k, s) if k else c
                             for c, k, s in zip(objs, self.codec.tolist(), self.stored.tolist()))
            self._objs = objs
        return self._objs

    def __getitem__(self, i):
        if self._objs is not None or isinstance(i, slice):
            return self._all()[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        lo, hi = int(self.block_bounds[i]), int(self.block_bounds[i + 1])
        c = ChunkMeta(tuple(self.offsets[i].tolist()), tuple(self.sizes[i].tolist()), self.files[int(self.file[i])],
                      int(self.byte_offset[i]), int(self.nbytes[i]), int(self.checksum[i]),
                      tuple(self.block_values[lo:hi].tolist()))
        if self.codec is not None and self.codec[i]:
            c = _packed(c, int(self.codec[i]), int(self.stored[i]))
        return c

    def __iter__(self):
        return iter(self._all())

    def __eq__(self, other):
        if isinstance(other, (ChunkTable, tuple, list)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks)"

    def __reduce__(self):
        lo, hi = int(self.block_bounds[0]), int(self.block_bounds[-1])
        return (ChunkTable, (self.offsets, self.sizes, self.files, self.file, self.byte_offset, self.nbytes,
                             self.checksum, self.block_values[lo:hi], self.block_bounds - lo, None, self.codec,
                             self.stored))


def codec_id(compression: str | None) -> int:
    """A piece's codec in memory: 0 for raw, else the 1-based position in :data:`COMPRESSIONS`."""
    return 0 if compression is None else COMPRESSIONS.index(compression) + 1


def _packed(c: ChunkMeta, codec: int, stored: int) -> ChunkMeta:
    return ChunkMeta(c.offsets, c.sizes, c.file, c.byte_offset, c.nbytes, c.checksum, c.block_checksums,
                     COMPRESSIONS[codec - 1], stored)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[ChunkMeta]  # a tuple of ChunkMeta, or a ChunkTable (decoded metadata)

    @property
    def nbytes(self) -> int:
        if isinstance(self.chunks, ChunkTable):
            return int(self.chunks.nbytes.sum())
        return sum(c.nbytes for c in self.chunks)


class ChunkColumns:
    """The chunks of every tensor of a checkpoint as one set of columns, grouped by tensor:
    tensor t's chunks are rows ``rows[t]:rows[t + 1]``.

    ``offsets`` and ``sizes`` are (n, width) int64 arrays; a tensor of ``ndim[t] < width``
    dimensions has its boxes padded with offset 0 and size 1. ``file`` indexes ``files``;
    ``block_values[block_bounds[i]:block_bounds[i + 1]]`` are row i's block checksums; ``codec``
    and ``stored`` (None where every row is raw) each row's codec and stored length, as in
    :class:`ChunkTable`. This is what the commit step builds and the decoder returns: the encoder
    writes it with array operations in one go, and a :class:`ChunkTable` is made for a tensor
    only when asked for.
    """

    __slots__ = ("rows", "ndim", "offsets", "sizes", "files", "file", "byte_offset", "nbytes", "checksum",
                 "block_values", "block_bounds", "codec", "stored")

    def __init__(self, rows, ndim, offsets, sizes, files, file, byte_offset, nbytes, checksum, block_values,
                 block_bounds, codec=None, stored=None):
        self.rows, self.ndim, self.offsets, self.sizes, self.files = rows, ndim, offsets, sizes, files
        self.file, self.byte_offset, self.nbytes, self.checksum = file, byte_offset, nbytes, checksum
        self.block_values, self.block_bounds = block_values, block_bounds
        self.codec, self.stored = codec, stored

    @property
    def compressed(self) -> bool:
        """Whether any row is stored compressed."""
        return self.codec is not None and bool(self.codec.any())

    def __len__(self) -> int:
        """The number of tensors."""
        return len(self.ndim)

    def tables(self) -> list[ChunkTable]:
        """One :class:`ChunkTable` per tensor, each a view of these columns."""
        rows, nds = self.rows.tolist(), self.ndim.tolist()
        width = self.offsets.shape[1]
        off, size, files, file, boff = self.offsets, self.sizes, self.files, self.file, self.byte_offset
        nbytes, crc, bv, bb = self.nbytes, self.checksum, self.block_values, self.block_bounds
        codec, stored = (self.codec, self.stored) if self.compressed else (None, None)
        out = []
        for t, nd in enumerate(nds):
            a, b = rows[t], rows[t + 1]
            if nd == width:
                o, s = off[a:b], size[a:b]
            else:
                o, s = off[a:b, :nd], size[a:b, :nd]
            out.append(ChunkTable(o, s, files, file[a:b], boff[a:b], nbytes[a:b], crc[a:b], bv, bb[a:b + 1], (self, t),
                                  None if codec is None else codec[a:b], None if stored is None else stored[a:b]))
        return out

    def take(self, ids: np.ndarray) -> "ChunkColumns":
        """The columns of tensors ``ids`` (in that order)."""
        ids = np.asarray(ids, np.int64)
        if len(ids) == len(self) and (ids == np.arange(len(ids))).all():
            return self
        start, counts = self.rows[:-1][ids], np.diff(self.rows)[ids]
        rows = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(counts, out=rows[1:])
        sel = np.repeat(start - rows[:-1], counts) + np.arange(int(rows[-1]))
        blen = np.diff(self.block_bounds)[sel]
        bounds = np.zeros(len(sel) + 1, np.int64)
        np.cumsum(blen, out=bounds[1:])
        bsel = np.repeat(self.block_bounds[:-1][sel] - bounds[:-1], blen) + np.arange(int(bounds[-1]))
        packed = self.compressed
        return ChunkColumns(rows, self.ndim[ids], self.offsets[sel], self.sizes[sel], self.files, self.file[sel],
                            self.byte_offset[sel], self.nbytes[sel], self.checksum[sel], self.block_values[bsel],
                            bounds, self.codec[sel] if packed else None, self.stored[sel] if packed else None)

    @classmethod
    def concat(cls, tables: Sequence[ChunkTable], ndims: Sequence[int]) -> "ChunkColumns":
        """Columns holding ``tables`` (tensor t's chunks, of ``ndims[t]`` dimensions) in order."""
        k = len(tables)
        counts = np.fromiter(map(len, tables), np.int64, k)
        ndim = np.fromiter(ndims, np.int64, k)
        rows = np.zeros(k + 1, np.int64)
        np.cumsum(counts, out=rows[1:])
        n = int(rows[-1])
        width = max(1, int(ndim.max()) if k else 1)
        used = [(t, ct) for t, ct in enumerate(tables) if len(ct)]
        for t, ct in used:
            nd = int(ndim[t])
            if ct.offsets.shape != (len(ct), nd) or ct.sizes.shape != (len(ct), nd):
                raise ValueError(f"tensor {t}: chunk boxes do not have {nd} dimensions")
        files: dict[str, int] = {}
        remap: dict[int, tuple[list, np.ndarray]] = {}  # id(file list) -> index in `files` of each of its files
        file_parts, block_parts, block_lengths = [], [], []
        for _, ct in used:
            m = remap.get(id(ct.files))
            if m is None or m[0] is not ct.files:
                m = remap[id(ct.files)] = (ct.files, np.array([files.setdefault(f, len(files)) for f in ct.files],
                                                              np.int64))
            file_parts.append(m[1][ct.file])
            lo, hi = int(ct.block_bounds[0]), int(ct.block_bounds[-1])
            block_parts.append(ct.block_values[lo:hi])
            block_lengths.append(np.diff(ct.block_bounds))

        def cat(parts, dtype) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        if (ndim[counts > 0] == width).all():
            off = cat([ct.offsets.reshape(-1) for _, ct in used], np.int64).reshape(n, width)
            size = cat([ct.sizes.reshape(-1) for _, ct in used], np.int64).reshape(n, width)
        else:
            off, size = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
            for t, ct in used:
                nd = int(ndim[t])
                off[rows[t]:rows[t + 1], :nd], size[rows[t]:rows[t + 1], :nd] = ct.offsets, ct.sizes
        bounds = np.zeros(n + 1, np.int64)
        if block_lengths:
            np.cumsum(np.concatenate(block_lengths), out=bounds[1:])
        nbytes = cat([ct.nbytes for _, ct in used], np.int64)
        codec = stored = None
        if any(getattr(ct, "codec", None) is not None for _, ct in used):  # raw tables' rows: codec 0, stored nbytes
            codec = cat([np.zeros(len(ct), np.uint8) if ct.codec is None else ct.codec for _, ct in used], np.uint8)
            stored = cat([np.asarray(ct.nbytes, np.int64) if ct.stored is None else ct.stored for _, ct in used],
                         np.int64)
        return cls(rows, ndim, off, size, list(files), cat(file_parts, np.int64),
                   cat([ct.byte_offset for _, ct in used], np.int64), nbytes,
                   cat([ct.checksum for _, ct in used], np.int64), cat(block_parts, np.uint32), bounds, codec, stored)


class TensorMetas(LazyMapping):
    """A read-only mapping name -> :class:`TensorMeta` over one :class:`ChunkColumns`.

    The per-tensor objects are built on the first lookup, all at once; iteration over the names,
    ``len``, :attr:`Metadata.total_bytes`, :attr:`Metadata.files` and :func:`encode_metadata`
    work on the columns without building them.
    """

    __slots__ = ("names", "dtypes", "shapes", "columns")

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], columns: ChunkColumns):
        if not len(names) == len(dtypes) == len(shapes) == len(columns):
            raise ValueError("names, dtypes, shapes and columns differ in length")
        self.names, self.dtypes, self.shapes, self.columns = names, dtypes, shapes, columns
        self._dict: dict[str, TensorMeta] | None = None

    def _build(self) -> dict[str, TensorMeta]:
        out = dict(zip(self.names, map(TensorMeta, self.dtypes, self.shapes, self.columns.tables())))
        if len(out) != len(self.names):
            raise ValueError("duplicate tensor names")
        return out

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"TensorMetas({len(self)} tensors, {len(self.columns.nbytes)} chunks)"

    def __reduce__(self):
        return (TensorMetas, (self.names, self.dtypes, self.shapes, self.columns))


@dataclass(frozen=True)
class Metadata:
    """What a committed checkpoint holds (``raydcp.read_metadata`` returns it)."""

    save_id: str
    world_size: int
    created_at: float
    tensors: Mapping[str, TensorMeta]
    values: Mapping[str, Any]
    version: tuple[int, int] = FORMAT_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the version it is (or will be) written as: 2.0 where a piece is compressed
        if self.version == FORMAT_VERSION and isinstance(self.tensors, TensorMetas) and self.tensors.columns.compressed:
            object.__setattr__(self, "version", COMPRESSED_FORMAT_VERSION)

    @property
    def total_bytes(self) -> int:
        if isinstance(self.tensors, TensorMetas):
            return int(self.tensors.columns.nbytes.sum())
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """The bytes the pieces take in their files (``total_bytes`` less what compression saved)."""
        return sum(self.files.values())

    @property
    def compressions(self) -> dict[str, int]:
        """Codec -> the number of pieces stored with it (empty for a checkpoint of raw pieces)."""
        out: dict[str, int] = {}
        if isinstance(self.tensors, TensorMetas):
            codec = self.tensors.columns.codec
            if codec is not None:
                for k, n in enumerate(np.bincount(codec, minlength=len(COMPRESSIONS) + 1).tolist()[1:]):
                    if n:
                        out[COMPRESSIONS[k]] = n
            return out
        for t in self.tensors.values():
            for c in t.chunks:
                if c.compression is not None:
                    out[c.compression] = out.get(c.compression, 0) + 1
        return out

    @property
    def files(self) -> dict[str, int]:
        """Data file name -> bytes of (stored) tensor data it holds."""
        out: dict[str, int] = {}
        if isinstance(self.tensors, TensorMetas):
            cols = self.tensors.columns
            if len(cols.file):
                length = cols.nbytes if cols.stored is None else cols.stored
                sums = np.bincount(cols.file, weights=length, minlength=len(cols.files))
                for f in first_use(cols.file).tolist():
                    out[cols.files[f]] = int(sums[f])
            return out
        for t in self.tensors.values():
            if isinstance(t.chunks, ChunkTable):
                ct = t.chunks
                if len(ct):
                    used = np.unique(ct.file)
                    length = ct.nbytes if ct.stored is None else ct.stored
                    sums = np.bincount(ct.file, weights=length, minlength=int(used[-1]) + 1)
                    for f in used.tolist():
                        name = ct.files[f]
                        out[name] = out.get(name, 0) + int(sums[f])
                continue
            for c in t.chunks:
                out[c.file] = out.get(c.file, 0) + c.stored_length
        return out

    @property
    def references(self) -> dict[str, int]:
        """A delta checkpoint's bases: each checkpoint whose files it reads, relative to it
        (``../step-1``) -> the stored bytes it reads from there. Empty for a full checkpoint."""
        out: dict[str, int] = {}
        for name, n in self.files.items():
            if name.startswith("../"):
                owner = name.rsplit("/data/", 1)[0]
                out[owner] = out.get(owner, 0) + n
        return out

    def with_files(self, rename) -> "Metadata":
        """The same checkpoint with every data file name ``n`` replaced by ``rename(n)`` (the bytes,
        byte ranges and checksums unchanged): a checkpoint that reads its data from elsewhere."""
        tensors = self.tensors
        if not isinstance(tensors, TensorMetas):
            cols = ChunkColumns.concat([ChunkTable.from_chunks(tm.chunks, len(tm.shape)) for tm in tensors.values()],
                                       [len(tm.shape) for tm in tensors.values()])
            tensors = TensorMetas(list(tensors), [tm.dtype for tm in tensors.values()],
                                  [tuple(tm.shape) for tm in tensors.values()], cols)
        c = tensors.columns
        cols = ChunkColumns(c.rows, c.ndim, c.offsets, c.sizes, [rename(f) for f in c.files], c.file, c.byte_offset,
                            c.nbytes, c.checksum, c.block_values, c.block_bounds, c.codec, c.stored)
        return replace(self, tensors=TensorMetas(tensors.names, tensors.dtypes, tensors.shapes, cols))

    @property
    def owned_bytes(self) -> int:
        """The stored bytes in this checkpoint's own files (``stored_bytes`` less what it references)."""
        return sum(n for name, n in self.files.items() if not name.startswith("../"))

    def keys(self) -> list[str]:
        return sorted([*self.tensors, *self.values])


def first_use(file: np.ndarray) -> np.ndarray:
    """The distinct values of ``file`` in the order of their first occurrence.

    File ids are few and small: the first row of each comes from one pass (``np.minimum.at``),
    where ``np.unique`` would sort every row.
    """
    n = len(file)
    if not n:
        return np.zeros(0, np.int64)
    lo, hi = int(file.min()), int(file.max())
    if lo < 0 or hi >= 4 * n + 1024:  # not small ids: sort
        used, first = np.unique(file, return_index=True)
        return used[np.argsort(first, kind="stable")]
    first = np.full(hi + 1, n, np.int64)
    np.minimum.at(first, file, np.arange(n, dtype=np.int64))
    used = np.flatnonzero(first < n)
    return used[np.argsort(first[used], kind="stable")]

