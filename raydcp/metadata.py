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
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .codec import checksum, decode_value, encode_value, itemsize
from .errors import CheckpointError

__all__ = ["FORMAT_VERSION", "BLOCK_BYTES", "ChunkMeta", "ChunkTable", "TensorMeta", "Metadata", "encode_metadata",
           "decode_metadata"]

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
                 "block_values", "block_bounds", "_objs")

    def __init__(self, offsets, sizes, files, file, byte_offset, nbytes, checksum, block_values, block_bounds):
        self.offsets, self.sizes, self.files, self.file = offsets, sizes, files, file
        self.byte_offset, self.nbytes, self.checksum = byte_offset, nbytes, checksum
        self.block_values, self.block_bounds = block_values, block_bounds
        self._objs = None

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
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def files(self) -> dict[str, int]:
        """Data file name -> bytes of tensor data it holds."""
        out: dict[str, int] = {}
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
    try:
        tables = {name: ChunkTable.from_chunks(tm.chunks, len(tm.shape)) for name, tm in md.tensors.items()}
    except ValueError:  # a chunk of the wrong dimension (written only to test readers): row by row
        return _encode_rows(md)
    names = list(md.tensors)
    files: dict[str, int] = {}
    remap: dict[int, tuple[list, np.ndarray]] = {}  # id(file table) -> global index of each of its files
    parts: dict[str, list] = {f.name: [] for f in _SCHEMA_FIELDS}
    counts, ndims, block_lengths = [], [], []
    for ti, name in enumerate(names):
        tm = md.tensors[name]
        ct = tables[name]
        n = len(ct)
        counts.append(n)
        ndims.append(len(tm.shape))
        if not n:
            continue
        if ct.offsets.shape != (n, len(tm.shape)) or ct.sizes.shape != (n, len(tm.shape)):
            raise CheckpointError(f"{name}: chunk boxes do not have {len(tm.shape)} dimensions")
        table = remap.get(id(ct.files))
        if table is None or table[0] is not ct.files:
            table = (ct.files, np.array([files.setdefault(f, len(files)) for f in ct.files], np.int32))
            remap[id(ct.files)] = table
        parts["tensor"].append(np.full(n, ti, np.int32))
        parts["offsets"].append(ct.offsets.reshape(-1))
        parts["sizes"].append(ct.sizes.reshape(-1))
        parts["file"].append(table[1][ct.file])
        parts["byte_offset"].append(ct.byte_offset)
        parts["nbytes"].append(ct.nbytes)
        parts["checksum"].append(ct.checksum)
        lo, hi = int(ct.block_bounds[0]), int(ct.block_bounds[-1])
        parts["block_checksums"].append(ct.block_values[lo:hi])
        block_lengths.append(np.diff(ct.block_bounds))
    header = _header(md, names, list(files))

    def cat(name: str, dtype) -> np.ndarray:
        return np.concatenate(parts[name]).astype(dtype, copy=False) if parts[name] else np.zeros(0, dtype)

    rows_nd = np.repeat(np.array(ndims, np.int64), np.array(counts, np.int64))
    box_bounds = np.zeros(len(rows_nd) + 1, np.int64)
    np.cumsum(rows_nd, out=box_bounds[1:])
    block_bounds = np.zeros(len(rows_nd) + 1, np.int64)
    if block_lengths:
        np.cumsum(np.concatenate(block_lengths), out=block_bounds[1:])
    for b in (box_bounds, block_bounds):
        if b[-1] >= 1 << 31:
            raise CheckpointError("metadata too large: more than 2**31 list entries in one column")
    crcs = cat("checksum", np.int64)
    if len(crcs) and (crcs.min() < 0 or crcs.max() > 0xFFFFFFFF):
        raise CheckpointError("a chunk checksum is not a 32-bit unsigned integer")
    offsets32, blocks32 = pa.array(box_bounds.astype(np.int32)), pa.array(block_bounds.astype(np.int32))
    arrays = [
        pa.array(cat("tensor", np.int32)),
        pa.ListArray.from_arrays(offsets32, pa.array(cat("offsets", np.int64))),
        pa.ListArray.from_arrays(offsets32, pa.array(cat("sizes", np.int64))),
        pa.array(cat("file", np.int32)),
        pa.array(cat("byte_offset", np.int64)),
        pa.array(cat("nbytes", np.int64)),
        pa.array(crcs.astype(np.uint32)),
        pa.ListArray.from_arrays(blocks32, pa.array(cat("block_checksums", np.uint32))),
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


def _header(md: Metadata, names: list[str], files: list[str]) -> dict:
    return {
        "format": "raydcp",
        "save_id": md.save_id,
        "world_size": md.world_size,
        "created_at": md.created_at,
        "block_bytes": BLOCK_BYTES,
        "tensors": [[n, md.tensors[n].dtype, list(md.tensors[n].shape)] for n in names],
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
    specs = [(str(name), str(dtype), tuple(int(s) for s in shape)) for name, dtype, shape in header["tensors"]]
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


def _decode_chunks(table: pa.Table, specs: list, files: list[str]) -> dict[str, TensorMeta]:
    """Validate every chunk against its tensor with array operations and return one TensorMeta per
    tensor whose chunks are a ChunkTable over the decoded columns (no per-chunk objects)."""
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

    ndim = np.array([len(s[2]) for s in specs], np.int64)
    isz = np.array([itemsize(s[1]) for s in specs], np.int64)
    numels = [_numel(s[2]) for s in specs]
    if any(x >= 1 << 62 for x in numels):
        return _decode_rows(table, specs, files)
    shape_flat = np.array([d for s in specs for d in s[2]], np.int64)
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
    tensors = {}
    for t, (name, dtype, shape) in enumerate(specs):
        a, b = int(rows[t]), int(rows[t + 1])
        nd = len(shape)
        ct = ChunkTable(ov[ob[a]:ob[b]].reshape(b - a, nd), sv[sb[a]:sb[b]].reshape(b - a, nd), files,
                        fcol[a:b], byte_off[a:b], nbytes[a:b], crcs[a:b], bv, bb[a:b + 1])
        tensors[name] = TensorMeta(dtype, shape, ct)
    return tensors


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
