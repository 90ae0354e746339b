"""Checkpoint metadata: the versioned, pickle-free description of a committed checkpoint.

On storage (docs/FORMAT.md is the spec) the metadata file ``raydcp.meta`` is::

    magic   8 bytes  b"RAYDCPM\\n"
    major   u32 LE   format major version (a reader refuses a major it does not know)
    minor   u32 LE   format minor version (additions only; older readers ignore them)
    length  u64 LE   payload length in bytes
    crc     u32 LE   CRC32C of the payload
    payload          an Arrow IPC stream: one record batch, one row per stored chunk,
                     with the JSON header in the schema metadata under b"raydcp"
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .codec import checksum, decode_value, encode_value, itemsize
from .errors import CheckpointError
from .lazy import LazyMapping

__all__ = ["FORMAT_VERSION", "BLOCK_BYTES", "ChunkMeta", "ChunkTable", "ChunkColumns", "TensorMeta", "TensorMetas",
           "Metadata", "encode_metadata", "decode_metadata"]

FORMAT_VERSION = (1, 0)
MAGIC = b"RAYDCPM\n"
_PREAMBLE = struct.Struct("<8sIIQI")


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One stored piece of a tensor: the box [offsets, offsets+sizes) at file[byte_offset:+nbytes]."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    nbytes: int
    checksum: int
    # CRC32C of each BLOCK_BYTES block of a chunk larger than one block (else empty), so a
    # reader that needs only part of a chunk can verify what it reads
    block_checksums: tuple[int, ...] = ()


BLOCK_BYTES = 1 << 20


class ChunkTable(Sequence):
    """The chunks of one tensor as columns: a read-only sequence of :class:`ChunkMeta`.

    ``offsets`` and ``sizes`` are (n, ndim) int64 arrays, ``file`` indexes ``files``,
    ``block_values[block_bounds[i]:block_bounds[i + 1]]`` are chunk i's block checksums.
    Decoded metadata holds its chunks this way (views of the Arrow columns); a
    :class:`ChunkMeta` is built only for the chunks a caller indexes or iterates.
    """

    __slots__ = ("offsets", "sizes", "files", "file", "byte_offset", "nbytes", "checksum",
                 "block_values", "block_bounds", "_objs", "origin")

    def __init__(self, offsets, sizes, files, file, byte_offset, nbytes, checksum, block_values, block_bounds,
                 origin=None):
        self.offsets, self.sizes, self.files, self.file = offsets, sizes, files, file
        self.byte_offset, self.nbytes, self.checksum = byte_offset, nbytes, checksum
        self.block_values, self.block_bounds = block_values, block_bounds
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
        t = cls(np.array([c.offsets for c in chunks], np.int64).reshape(n, ndim),
                np.array([c.sizes for c in chunks], np.int64).reshape(n, ndim),
                None, np.array([files.setdefault(c.file, len(files)) for c in chunks], np.int64),
                np.array([c.byte_offset for c in chunks], np.int64), np.array([c.nbytes for c in chunks], np.int64),
                np.array([c.checksum for c in chunks], np.int64), np.array(blocks, np.uint32), bounds)
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
            self._objs = tuple(
                ChunkMeta(o, s, files[f], b, n, c, tuple(bv[lo - base:hi - base]))
                for o, s, f, b, n, c, lo, hi in zip(map(tuple, self.offsets.tolist()), map(tuple, self.sizes.tolist()),
                                                   self.file.tolist(), self.byte_offset.tolist(), self.nbytes.tolist(),
                                                   self.checksum.tolist(), bb[:-1], bb[1:]))
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
        return ChunkMeta(tuple(self.offsets[i].tolist()), tuple(self.sizes[i].tolist()), self.files[int(self.file[i])],
                         int(self.byte_offset[i]), int(self.nbytes[i]), int(self.checksum[i]),
                         tuple(self.block_values[lo:hi].tolist()))

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
                             self.checksum, self.block_values[lo:hi], self.block_bounds - lo))


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
    ``block_values[block_bounds[i]:block_bounds[i + 1]]`` are row i's block checksums. This is
    what the commit step builds and the decoder returns: the encoder writes it with array
    operations in one go, and a :class:`ChunkTable` is made for a tensor only when asked for.
    """

    __slots__ = ("rows", "ndim", "offsets", "sizes", "files", "file", "byte_offset", "nbytes", "checksum",
                 "block_values", "block_bounds")

    def __init__(self, rows, ndim, offsets, sizes, files, file, byte_offset, nbytes, checksum, block_values,
                 block_bounds):
        self.rows, self.ndim, self.offsets, self.sizes, self.files = rows, ndim, offsets, sizes, files
        self.file, self.byte_offset, self.nbytes, self.checksum = file, byte_offset, nbytes, checksum
        self.block_values, self.block_bounds = block_values, block_bounds

    def __len__(self) -> int:
        """The number of tensors."""
        return len(self.ndim)

    def tables(self) -> list[ChunkTable]:
        """One :class:`ChunkTable` per tensor, each a view of these columns."""
        rows, nds = self.rows.tolist(), self.ndim.tolist()
        width = self.offsets.shape[1]
        off, size, files, file, boff = self.offsets, self.sizes, self.files, self.file, self.byte_offset
        nbytes, crc, bv, bb = self.nbytes, self.checksum, self.block_values, self.block_bounds
        out = []
        for t, nd in enumerate(nds):
            a, b = rows[t], rows[t + 1]
            if nd == width:
                o, s = off[a:b], size[a:b]
            else:
                o, s = off[a:b, :nd], size[a:b, :nd]
            out.append(ChunkTable(o, s, files, file[a:b], boff[a:b], nbytes[a:b], crc[a:b], bv, bb[a:b + 1], (self, t)))
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
        return ChunkColumns(rows, self.ndim[ids], self.offsets[sel], self.sizes[sel], self.files, self.file[sel],
                            self.byte_offset[sel], self.nbytes[sel], self.checksum[sel], self.block_values[bsel],
                            bounds)

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
        return cls(rows, ndim, off, size, list(files), cat(file_parts, np.int64),
                   cat([ct.byte_offset for _, ct in used], np.int64), cat([ct.nbytes for _, ct in used], np.int64),
                   cat([ct.checksum for _, ct in used], np.int64), cat(block_parts, np.uint32), bounds)


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

    @property
    def total_bytes(self) -> int:
        if isinstance(self.tensors, TensorMetas):
            return int(self.tensors.columns.nbytes.sum())
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def files(self) -> dict[str, int]:
        """Data file name -> bytes of tensor data it holds."""
        out: dict[str, int] = {}
        if isinstance(self.tensors, TensorMetas):
            cols = self.tensors.columns
            if len(cols.file):
                sums = np.bincount(cols.file, weights=cols.nbytes, minlength=len(cols.files))
                for f in _first_use(cols.file).tolist():
                    out[cols.files[f]] = int(sums[f])
            return out
        for t in self.tensors.values():
            if isinstance(t.chunks, ChunkTable):
                ct = t.chunks
                if len(ct):
                    used = np.unique(ct.file)
                    sums = np.bincount(ct.file, weights=ct.nbytes, minlength=int(used[-1]) + 1)
                    for f in used.tolist():
                        name = ct.files[f]
                        out[name] = out.get(name, 0) + int(sums[f])
                continue
            for c in t.chunks:
                out[c.file] = out.get(c.file, 0) + c.nbytes
        return out

    def keys(self) -> list[str]:
        return sorted([*self.tensors, *self.values])


_SCHEMA_FIELDS = [
    pa.field("tensor", pa.int32()),
    pa.field("offsets", pa.list_(pa.int64())),
    pa.field("sizes", pa.list_(pa.int64())),
    pa.field("file", pa.int32()),
    pa.field("byte_offset", pa.int64()),
    pa.field("nbytes", pa.int64()),
    pa.field("checksum", pa.uint32()),
    pa.field("block_checksums", pa.list_(pa.uint32())),
]


def encode_metadata(md: Metadata) -> bytes:
    """The ``raydcp.meta`` bytes of ``md``.

    The chunk columns are written with array operations in one go: taken as they are from a
    :class:`TensorMetas` (what the commit step and the decoder build) or from tables that are
    views of one :class:`ChunkColumns`, else concatenated from the tensors' chunk tables.
    """
    tensors = md.tensors
    if isinstance(tensors, TensorMetas):
        names, dtypes, shapes, cols = tensors.names, tensors.dtypes, tensors.shapes, tensors.columns
    else:
        names = list(tensors)
        metas = list(tensors.values())
        dtypes = [tm.dtype for tm in metas]
        shapes = [tm.shape for tm in metas]
        cols = _shared_columns(metas)
        if cols is None:
            try:
                cols = ChunkColumns.concat([ChunkTable.from_chunks(tm.chunks, len(tm.shape)) for tm in metas],
                                           [len(shape) for shape in shapes])
            except ValueError:  # a chunk of the wrong dimension (written only to test readers): row by row
                return _encode_rows(md)
    return _encode_columns(md, names, dtypes, shapes, cols)


def _shared_columns(metas: list) -> ChunkColumns | None:
    """The columns every tensor's chunk table is a view of (its rows, in order), or None."""
    origins = [getattr(tm.chunks, "origin", None) for tm in metas]
    if not origins or any(o is None for o in origins):
        return None
    cols = origins[0][0]
    if any(o[0] is not cols for o in origins):
        return None
    ids = np.fromiter((o[1] for o in origins), np.int64, len(origins))
    if (cols.ndim[ids] != np.fromiter((len(tm.shape) for tm in metas), np.int64, len(metas))).any():
        return None
    return cols.take(ids)


def _first_use(file: np.ndarray) -> np.ndarray:
    """The distinct values of ``file`` in the order of their first occurrence."""
    used, first = np.unique(file, return_index=True)
    return used[np.argsort(first, kind="stable")]


def _encode_columns(md: Metadata, names: list[str], dtypes: list[str], shapes: list, cols: ChunkColumns) -> bytes:
    n, k = len(cols.nbytes), len(names)
    counts = np.diff(cols.rows)
    nd_row = np.repeat(cols.ndim, counts)
    width = cols.offsets.shape[1]
    if (nd_row == width).all():
        offs, sizes = cols.offsets.reshape(-1), cols.sizes.reshape(-1)
    else:  # tensors of fewer dimensions than the widest: drop their padding
        keep = np.arange(width) < nd_row[:, None]
        offs, sizes = cols.offsets[keep], cols.sizes[keep]
    box_bounds = np.zeros(n + 1, np.int64)
    np.cumsum(nd_row, out=box_bounds[1:])
    lo, hi = (int(cols.block_bounds[0]), int(cols.block_bounds[-1])) if n else (0, 0)
    block_bounds = cols.block_bounds - lo if n else np.zeros(1, np.int64)
    for b in (box_bounds, block_bounds):
        if b[-1] >= 1 << 31:
            raise CheckpointError("metadata too large: more than 2**31 list entries in one column")
    crcs = np.asarray(cols.checksum)
    if n and (crcs.min() < 0 or crcs.max() > 0xFFFFFFFF):
        raise CheckpointError("a chunk checksum is not a 32-bit unsigned integer")
    # the header lists the files in the order of their first use, each once
    used = _first_use(cols.file) if n else np.zeros(0, np.int64)
    index = np.zeros(len(cols.files), np.int32)
    index[used] = np.arange(len(used), dtype=np.int32)
    files = [cols.files[f] for f in used.tolist()]
    header = _header(md, names, files, (dtypes, shapes))
    offsets32, blocks32 = pa.array(box_bounds.astype(np.int32)), pa.array(block_bounds.astype(np.int32))
    arrays = [
        pa.array(np.repeat(np.arange(k, dtype=np.int32), counts)),
        pa.ListArray.from_arrays(offsets32, pa.array(offs.astype(np.int64, copy=False))),
        pa.ListArray.from_arrays(offsets32, pa.array(sizes.astype(np.int64, copy=False))),
        pa.array(index[cols.file] if n else np.zeros(0, np.int32)),
        pa.array(np.asarray(cols.byte_offset, np.int64)),
        pa.array(np.asarray(cols.nbytes, np.int64)),
        pa.array(crcs.astype(np.uint32)),
        pa.ListArray.from_arrays(blocks32, pa.array(np.asarray(cols.block_values[lo:hi], np.uint32))),
    ]
    return _envelope(arrays, header)


def _encode_rows(md: Metadata) -> bytes:
    names = list(md.tensors)
    files: dict[str, int] = {}
    cols: dict[str, list] = {f.name: [] for f in _SCHEMA_FIELDS}
    for ti, name in enumerate(names):
        for c in md.tensors[name].chunks:
            cols["tensor"].append(ti)
            cols["offsets"].append(c.offsets)
            cols["sizes"].append(c.sizes)
            cols["file"].append(files.setdefault(c.file, len(files)))
            cols["byte_offset"].append(c.byte_offset)
            cols["nbytes"].append(c.nbytes)
            cols["checksum"].append(c.checksum)
            cols["block_checksums"].append(c.block_checksums)
    header = _header(md, names, list(files))
    return _envelope([pa.array(cols[f.name], type=f.type) for f in _SCHEMA_FIELDS], header)


def _header(md: Metadata, names: list[str], files: list[str], specs: tuple[list, list] | None = None) -> dict:
    dtypes, shapes = specs if specs is not None else ([md.tensors[n].dtype for n in names],
                                                      [md.tensors[n].shape for n in names])
    return {
        "format": "raydcp",
        "save_id": md.save_id,
        "world_size": md.world_size,
        "created_at": md.created_at,
        "block_bytes": BLOCK_BYTES,
        "tensors": [[n, d, list(s)] for n, d, s in zip(names, dtypes, shapes)],
        "files": files,
        "values": {k: encode_value(v) for k, v in md.values.items()},
        "extra": {k: encode_value(v) for k, v in md.extra.items()},
    }


def _envelope(arrays: list, header: dict) -> bytes:
    schema = pa.schema(_SCHEMA_FIELDS, metadata={b"raydcp": json.dumps(header, separators=(",", ":"))})
    batch = pa.record_batch(arrays, schema=schema)
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd") if pa.Codec.is_available("zstd") else None
    with pa.ipc.new_stream(sink, schema, options=opts) as w:
        w.write_batch(batch)
    payload = sink.getvalue().to_pybytes()
    return _PREAMBLE.pack(MAGIC, *FORMAT_VERSION, len(payload), checksum(payload)) + payload


def decode_metadata(data: bytes, source: str = "metadata") -> Metadata:
    """Decode ``raydcp.meta`` bytes; any damage is a CheckpointError naming ``source``."""
    if len(data) < _PREAMBLE.size:
        raise CheckpointError(f"{source}: too short to be raydcp metadata ({len(data)} bytes); the file is truncated")
    magic, major, minor, length, crc = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"{source}: not raydcp metadata (bad magic); is this a raydcp checkpoint?")
    if major != FORMAT_VERSION[0]:
        raise CheckpointError(
            f"{source}: format version {major}.{minor} is not supported by this raydcp (reads {FORMAT_VERSION[0]}.x); "
            f"upgrade raydcp to read it"
        )
    payload = memoryview(data)[_PREAMBLE.size:]
    if len(payload) != length:
        raise CheckpointError(f"{source}: payload is {len(payload)} bytes, header says {length}; the file is truncated or damaged")
    if checksum(payload) != crc:
        raise CheckpointError(f"{source}: checksum mismatch; the metadata file is damaged")
    try:
        md = _decode_payload(payload)
        return Metadata(**{**md.__dict__, "version": (major, minor)})
    except CheckpointError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    except Exception as exc:  # a well-formed envelope around a malformed table
        raise CheckpointError(f"{source}: malformed metadata ({type(exc).__name__}: {exc})") from None


def _decode_payload(payload: memoryview) -> Metadata:
    reader = pa.ipc.open_stream(pa.py_buffer(payload))
    batches = list(reader)
    schema = reader.schema
    if [f.name for f in schema] != [f.name for f in _SCHEMA_FIELDS]:
        raise CheckpointError("unexpected chunk table columns")
    table = pa.Table.from_batches(batches, schema=schema)
    table.validate(full=True)
    header = json.loads(schema.metadata[b"raydcp"])
    if header.get("format") != "raydcp":
        raise CheckpointError("header is not a raydcp header")
    if int(header.get("block_bytes", BLOCK_BYTES)) != BLOCK_BYTES:
        raise CheckpointError(f"checksum block size {header.get('block_bytes')} is not {BLOCK_BYTES}")
    specs = [(str(name), str(dtype), tuple(map(int, shape))) for name, dtype, shape in header["tensors"]]
    if len({s[0] for s in specs}) != len(specs):
        raise CheckpointError("a tensor is listed twice in the header")
    files = [str(f) for f in header["files"]]
    tensors = _decode_chunks(table, specs, files)
    return Metadata(
        save_id=str(header["save_id"]),
        world_size=int(header["world_size"]),
        created_at=float(header["created_at"]),
        tensors=tensors,
        values={k: decode_value(v) for k, v in header["values"].items()},
        extra={k: decode_value(v) for k, v in header.get("extra", {}).items()},
    )


def _one(col: pa.ChunkedArray):
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _column(table: pa.Table, name: str, dtype) -> np.ndarray:
    arr = _one(table.column(name))
    if arr.null_count:
        raise CheckpointError(f"column {name!r} has null entries")
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=dtype)


def _list(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (values, bounds): row i is values[bounds[i] - bounds[0]:bounds[i + 1] - bounds[0]]."""
    arr = _one(table.column(name))
    if arr.null_count or arr.values.null_count:
        raise CheckpointError(f"column {name!r} has null entries")
    bounds = arr.offsets.to_numpy().astype(np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=dtype)
    return values[bounds[0]:bounds[-1]] if len(bounds) else values[:0], bounds - (bounds[0] if len(bounds) else 0)


def _decode_chunks(table: pa.Table, specs: list, files: list[str]) -> Mapping[str, TensorMeta]:
    """Validate every chunk against its tensor with array operations and return the tensors as a
    :class:`TensorMetas` over the decoded columns (no per-chunk or per-tensor objects)."""
    n, k = table.num_rows, len(specs)
    tcol = _column(table, "tensor", np.int64)
    if n and (tcol.min() < 0 or tcol.max() >= k):
        raise CheckpointError("a chunk names a tensor that is not in the header")
    if n and np.any(tcol[1:] < tcol[:-1]):
        tensors = _decode_rows(table, specs, files)  # rows not grouped by tensor: the general path
        return tensors
    fcol = _column(table, "file", np.int64)
    if n and (fcol.min() < 0 or fcol.max() >= len(files)):
        raise CheckpointError("a chunk names a file that is not in the header")
    byte_off = _column(table, "byte_offset", np.int64)
    nbytes = _column(table, "nbytes", np.int64)
    crcs = _column(table, "checksum", np.uint32)
    ov, ob = _list(table, "offsets", np.int64)
    sv, sb = _list(table, "sizes", np.int64)
    bv, bb = _list(table, "block_checksums", np.uint32)

    names, dtypes, shapes = (list(c) for c in zip(*specs)) if specs else ([], [], [])
    ndim = np.fromiter(map(len, shapes), np.int64, k)
    sizes = {d: itemsize(d) for d in set(dtypes)}
    isz = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, k)
    if max(map(max, filter(None, shapes)), default=0) >= 1 << 15 or (k and ndim.max() > 4):
        # element counts might not fit in int64: check them exactly
        if any(_numel(shape) >= 1 << 62 for shape in shapes):
            return _decode_rows(table, specs, files)
    shape_flat = np.fromiter(chain.from_iterable(shapes), np.int64, int(ndim.sum()))
    shape_start = np.zeros(k + 1, np.int64)
    np.cumsum(ndim, out=shape_start[1:])

    nd_row = ndim[tcol]
    bad = (np.diff(ob) != nd_row) | (np.diff(sb) != nd_row) | (byte_off < 0)
    uniform = k and n and not bad.any() and (ndim == ndim[0]).all() and ndim[0] > 0
    if uniform:  # every tensor has the same number of dimensions: (n, nd) views, no per-element index
        nd = int(ndim[0])
        o2, s2 = ov.reshape(n, nd), sv.reshape(n, nd)
        extent = np.take(shape_flat.reshape(k, nd), tcol, axis=0)
        numel = np.ones(n, np.int64)
        for d in range(nd):
            o, s, e = o2[:, d], s2[:, d], extent[:, d]
            bad |= (o < 0) | (s < 0) | (o > e) | (s > e) | (o + s > e)
            numel *= s
        blocks = np.where(nbytes > BLOCK_BYTES, -(-nbytes // BLOCK_BYTES), 0)
        bad |= (numel * isz[tcol] != nbytes) | (np.diff(bb) != blocks)
    elif not bad.any():
        # per element of the flat offsets/sizes: its row, its dimension, the tensor's extent there
        row_of = np.repeat(np.arange(n), nd_row)
        dim_of = np.arange(len(ov)) - ob[:-1][row_of]
        extent = shape_flat[shape_start[tcol][row_of] + dim_of]
        bad_elem = (ov < 0) | (sv < 0) | (ov > extent) | (sv > extent) | (ov + sv > extent)
        bad |= np.bincount(row_of[bad_elem], minlength=n).astype(bool)
    if not uniform and not bad.any():
        dmax = int(ndim.max()) if k else 0
        padded = np.ones((n, max(dmax, 1)), np.int64)
        padded[row_of, dim_of] = sv
        numel = padded.prod(axis=1)
        blocks = np.where(nbytes > BLOCK_BYTES, -(-nbytes // BLOCK_BYTES), 0)
        bad |= (numel * isz[tcol] != nbytes) | (np.diff(bb) != blocks)
    if bad.any():
        i = int(np.argmax(bad))
        name, _, shape = specs[int(tcol[i])]
        offs = tuple(ov[ob[i]:ob[i + 1]].tolist())
        raise CheckpointError(f"chunk of {name!r} at {offs} does not fit the tensor's shape {shape}")

    rows = np.searchsorted(tcol, np.arange(k + 1))
    if uniform:
        off2, size2 = o2, s2
    else:  # pad the boxes of tensors of fewer dimensions (offset 0, size 1)
        width = max(1, int(ndim.max()) if k else 1)
        off2, size2 = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        off2[row_of, dim_of], size2[row_of, dim_of] = ov, sv
    cols = ChunkColumns(rows, ndim, off2, size2, files, fcol, byte_off, nbytes, crcs, bv, bb)
    return TensorMetas(names, dtypes, shapes, cols)


def _decode_rows(table: pa.Table, specs: list, files: list[str]) -> dict[str, TensorMeta]:
    """The general path: one ChunkMeta per row, rows in any order."""
    tensor_col = table.column("tensor").to_numpy()
    offs = _list_column(table.column("offsets"))
    sizes = _list_column(table.column("sizes"))
    file_col = table.column("file").to_numpy()
    byte_off = table.column("byte_offset").to_numpy()
    nbytes = table.column("nbytes").to_numpy()
    crcs = table.column("checksum").to_numpy()
    blocks = _list_column(table.column("block_checksums"))
    chunks: list[list[ChunkMeta]] = [[] for _ in specs]
    for i in range(table.num_rows):
        ti, fi = int(tensor_col[i]), int(file_col[i])
        chunks[ti].append(ChunkMeta(offs[i], sizes[i], files[fi], int(byte_off[i]), int(nbytes[i]), int(crcs[i]),
                                    blocks[i]))
    tensors = {}
    for (name, dtype, shape), cs in zip(specs, chunks):
        isz = itemsize(dtype)
        for c in cs:
            if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, shape)
            ) or c.nbytes != _numel(c.sizes) * isz or c.byte_offset < 0 or len(c.block_checksums) != (
                -(-c.nbytes // BLOCK_BYTES) if c.nbytes > BLOCK_BYTES else 0
            ):
                raise CheckpointError(f"chunk of {name!r} at {c.offsets} does not fit the tensor's shape {shape}")
        tensors[name] = TensorMeta(dtype, shape, tuple(cs))
    return tensors


def _list_column(col: pa.ChunkedArray) -> list[tuple[int, ...]]:
    arr = col.combine_chunks()
    values = arr.values.to_numpy().tolist()
    bounds = arr.offsets.to_numpy().tolist()
    return [tuple(values[bounds[i]:bounds[i + 1]]) for i in range(len(arr))]


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
