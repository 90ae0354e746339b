"""The metadata file's encoding: ``raydcp.meta`` to and from :class:`raydcp.metadata.Metadata`.

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
from itertools import chain
from typing import Mapping

import numpy as np
import pyarrow as pa

from .codec import checksum, decode_value, encode_value, itemsize
from .errors import CheckpointDamagedError, CheckpointError
from .metadata import (BLOCK_BYTES, FORMAT_VERSION, ChunkColumns, ChunkMeta, ChunkTable, Metadata, TensorMeta,
                       TensorMetas, _first_use)

MAGIC = b"RAYDCPM\n"
_INT64_MAX = (1 << 63) - 1
_PREAMBLE = struct.Struct("<8sIIQI")

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
        raise CheckpointDamagedError(f"{source}: too short to be raydcp metadata ({len(data)} bytes); the file is truncated", file=source)
    magic, major, minor, length, crc = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointDamagedError(f"{source}: not raydcp metadata (bad magic); is this a raydcp checkpoint?", file=source)
    if major != FORMAT_VERSION[0]:
        raise CheckpointError(
            f"{source}: format version {major}.{minor} is not supported by this raydcp (reads {FORMAT_VERSION[0]}.x); "
            f"upgrade raydcp to read it"
        )
    payload = memoryview(data)[_PREAMBLE.size:]
    if len(payload) != length:
        raise CheckpointDamagedError(f"{source}: payload is {len(payload)} bytes, header says {length}; the file is "
                                     "truncated or damaged", file=source)
    if checksum(payload) != crc:
        raise CheckpointDamagedError(f"{source}: checksum mismatch; the metadata file is damaged", file=source)
    try:
        md = _decode_payload(payload)
        return Metadata(**{**md.__dict__, "version": (major, minor)})
    except CheckpointError as exc:
        raise CheckpointDamagedError(f"{source}: {exc}", file=source) from None
    except Exception as exc:  # a well-formed envelope around a malformed table
        raise CheckpointDamagedError(f"{source}: malformed metadata ({type(exc).__name__}: {exc})", file=source) from None


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
    _check_shapes(specs)
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


def _check_shapes(specs: list) -> None:
    """Every tensor's dimensions are non-negative and its size in bytes fits in an int64, so that
    no later size computation (elements, bytes, offsets) can overflow. Array operations, with an
    exact check in Python only for the tensors whose size comes near the limit."""
    k = len(specs)
    if not k:
        return
    ndim = np.fromiter((len(s[2]) for s in specs), np.int64, k)
    try:
        flat = np.fromiter(chain.from_iterable(s[2] for s in specs), np.int64, int(ndim.sum()))
    except OverflowError:
        flat = None
    if flat is not None:
        row = np.repeat(np.arange(k), ndim)
        negative = np.flatnonzero(np.bincount(row[flat < 0], minlength=k))
        # a float estimate of each tensor's bytes: exact enough to clear every tensor far from 2**63
        est = np.ones(k)
        np.multiply.at(est, row, flat.astype(np.float64))
        est *= np.fromiter((itemsize(s[1]) for s in specs), np.float64, k)
        suspect = np.flatnonzero(est >= 2.0 ** 61).tolist()
    else:
        negative, suspect = np.zeros(0, np.int64), list(range(k))
    for t in [*negative.tolist(), *suspect]:
        name, dtype, shape = specs[t]
        if any(d < 0 for d in shape):
            raise CheckpointDamagedError(f"tensor {name!r} has a negative dimension in its shape {list(shape)}")
        nbytes = _numel(shape) * itemsize(dtype)
        if nbytes >= 1 << 63 or any(d >= 1 << 63 for d in shape):
            raise CheckpointDamagedError(f"tensor {name!r} of shape {list(shape)} and dtype {dtype} would take {nbytes} "
                                  f"bytes, more than a 64-bit size can hold")


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
            bad |= (o < 0) | (s < 0) | (o > e) | (s > e - o)  # e - o: no int64 overflow, unlike o + s
            numel *= s
        bad |= (numel * isz[tcol] != nbytes) | _blocks_wrong(nbytes, bb)
    elif not bad.any():
        # per element of the flat offsets/sizes: its row, its dimension, the tensor's extent there
        row_of = np.repeat(np.arange(n), nd_row)
        dim_of = np.arange(len(ov)) - ob[:-1][row_of]
        extent = shape_flat[shape_start[tcol][row_of] + dim_of]
        bad_elem = (ov < 0) | (sv < 0) | (ov > extent) | (sv > extent - ov)
        bad |= np.bincount(row_of[bad_elem], minlength=n).astype(bool)
    if not uniform and not bad.any():
        dmax = int(ndim.max()) if k else 0
        padded = np.ones((n, max(dmax, 1)), np.int64)
        padded[row_of, dim_of] = sv
        numel = padded.prod(axis=1)
        bad |= (numel * isz[tcol] != nbytes) | _blocks_wrong(nbytes, bb)
    # the chunk's bytes inside int64 (the product above cannot wrap: a chunk inside its tensor is
    # no larger than the tensor, whose size _check_shapes bounded)
    bad |= (nbytes < 0) | (byte_off > _INT64_MAX - np.maximum(nbytes, 0))
    if bad.any():
        i = int(np.argmax(bad))
        name, dtype, shape = specs[int(tcol[i])]
        _chunk_error(name, dtype, shape, tuple(ov[ob[i]:ob[i + 1]].tolist()), tuple(sv[sb[i]:sb[i + 1]].tolist()),
                     int(byte_off[i]), int(nbytes[i]))

    rows = np.searchsorted(tcol, np.arange(k + 1))
    if uniform:
        off2, size2 = o2, s2
    else:  # pad the boxes of tensors of fewer dimensions (offset 0, size 1)
        width = max(1, int(ndim.max()) if k else 1)
        off2, size2 = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        off2[row_of, dim_of], size2[row_of, dim_of] = ov, sv
    cols = ChunkColumns(rows, ndim, off2, size2, files, fcol, byte_off, nbytes, crcs, bv, bb)
    return TensorMetas(names, dtypes, shapes, cols)


def _blocks_wrong(nbytes: np.ndarray, bb: np.ndarray) -> np.ndarray:
    """Per chunk: whether it does not list one checksum per BLOCK_BYTES block (none for a chunk of at
    most one block); ``bb`` bounds each chunk's block checksums, from 0."""
    if not bb[-1]:  # no block checksums at all (every chunk small, as at a million pieces): one comparison
        return nbytes > BLOCK_BYTES
    return np.diff(bb) != np.where(nbytes > BLOCK_BYTES, -(-nbytes // BLOCK_BYTES), 0)


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
            ) or c.nbytes != _numel(c.sizes) * isz or c.byte_offset < 0 or c.byte_offset + c.nbytes > _INT64_MAX \
                    or len(c.block_checksums) != (-(-c.nbytes // BLOCK_BYTES) if c.nbytes > BLOCK_BYTES else 0):
                _chunk_error(name, dtype, shape, c.offsets, c.sizes, c.byte_offset, c.nbytes)
        tensors[name] = TensorMeta(dtype, shape, tuple(cs))
    return tensors


def _chunk_error(name: str, dtype: str, shape: tuple, offsets: tuple, sizes: tuple, byte_offset: int,
                 nbytes: int):
    """Raise the CheckpointError that says what is wrong with one chunk of tensor ``name``."""
    where = f"chunk of {name!r} at {offsets}"
    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
        raise CheckpointDamagedError(f"{where} does not fit the tensor's shape {shape}")
    want = _numel(sizes) * itemsize(dtype)
    if nbytes != want:
        raise CheckpointDamagedError(f"{where} records {nbytes} bytes, but its sizes {list(sizes)} of {dtype} take {want}")
    if byte_offset < 0 or byte_offset + nbytes > _INT64_MAX:
        raise CheckpointDamagedError(f"{where} has a byte range {byte_offset}+{nbytes} outside any file")
    raise CheckpointDamagedError(f"{where} does not list one checksum per {BLOCK_BYTES}-byte block")


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
