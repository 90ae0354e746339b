"""The metadata file's encoding: ``raydcp.meta`` to and from :class:`raydcp.metadata.Metadata`.

On storage (docs/FORMAT.md is the spec) the metadata file ``raydcp.meta`` is::

    magic   8 bytes  b"RAYDCPM\\n"
    major   u32 LE   format major version (a reader refuses a major it does not know)
    minor   u32 LE   format minor version (additions only; older readers ignore them)
    length  u64 LE   payload length in bytes
    crc     u32 LE   CRC32C of the payload
    payload          an Arrow IPC stream: one record batch, one row per stored chunk,
                     with the JSON header in the schema metadata under b"raydcp"

Version 1.0 when every chunk is stored raw (so a raydcp that reads only 1.x reads it); 2.0,
1.0 plus the columns ``codec`` and ``stored_nbytes`` and the header's ``codecs``, when some
chunk is compressed (a 1.x reader refuses it, saying to upgrade); 3.0, 2.0 whose files include
files of other checkpoints (``../<checkpoint>/data/...``, a delta checkpoint's references).
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
from .storage.references import check_reference
from .metadata import (BLOCK_BYTES, COMPRESSED_FORMAT_VERSION, COMPRESSIONS, FORMAT_VERSION, READ_MAJORS,
                       REFERENCE_FORMAT_VERSION,
                       ChunkColumns, ChunkMeta, ChunkTable, Metadata, TensorMeta, TensorMetas, first_use, codec_id)

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
# version 2: each chunk's codec (0: raw, i: the header's codecs[i - 1]) and its length in the file
_COMPRESSION_FIELDS = [pa.field("codec", pa.uint8()), pa.field("stored_nbytes", pa.int64())]


class _Unsupported(CheckpointError):
    """Metadata this raydcp cannot read, though not damaged (a newer writer's): reported as is."""


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
    used = first_use(cols.file) if n else np.zeros(0, np.int64)
    index = np.zeros(len(cols.files), np.int32)
    index[used] = np.arange(len(used), dtype=np.int32)
    files = [cols.files[f] for f in used.tolist()]
    header = _header(md, names, files, (dtypes, shapes))
    extra = []
    if n and cols.compressed:  # version 2: the codecs used, named in the header, and each chunk's
        used_codecs = sorted(set(np.unique(cols.codec).tolist()) - {0})
        position = np.zeros(len(COMPRESSIONS) + 1, np.uint8)
        position[used_codecs] = np.arange(1, len(used_codecs) + 1)
        header["codecs"] = [COMPRESSIONS[c - 1] for c in used_codecs]
        extra = [pa.array(position[cols.codec]), pa.array(np.asarray(cols.stored, np.int64))]
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
    return _envelope(arrays + extra, header)


def _encode_rows(md: Metadata) -> bytes:
    names = list(md.tensors)
    files: dict[str, int] = {}
    codecs: dict[str, int] = {}
    fields = _SCHEMA_FIELDS + _COMPRESSION_FIELDS
    cols: dict[str, list] = {f.name: [] for f in fields}
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
            cols["codec"].append(0 if c.compression is None else codecs.setdefault(c.compression, len(codecs) + 1))
            cols["stored_nbytes"].append(c.stored_length)
    header = _header(md, names, list(files))
    if codecs:
        header["codecs"] = list(codecs)
    else:
        fields = _SCHEMA_FIELDS
    return _envelope([pa.array(cols[f.name], type=f.type) for f in fields], header)


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
    compressed = len(arrays) > len(_SCHEMA_FIELDS)
    version = COMPRESSED_FORMAT_VERSION if compressed else FORMAT_VERSION
    if any(str(f).startswith("../") for f in header["files"]):
        # version 3: files of other checkpoints referenced (a delta checkpoint); the 2.0 columns always
        version = REFERENCE_FORMAT_VERSION
        if not compressed:
            nbytes = arrays[5]
            arrays = arrays + [pa.array(np.zeros(len(nbytes), np.uint8)), nbytes]
            compressed = True
    fields = _SCHEMA_FIELDS + _COMPRESSION_FIELDS if compressed else _SCHEMA_FIELDS
    schema = pa.schema(fields, metadata={b"raydcp": json.dumps(header, separators=(",", ":"))})
    batch = pa.record_batch(arrays, schema=schema)
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd") if pa.Codec.is_available("zstd") else None
    with pa.ipc.new_stream(sink, schema, options=opts) as w:
        w.write_batch(batch)
    payload = sink.getvalue().to_pybytes()
    return _PREAMBLE.pack(MAGIC, *version, len(payload), checksum(payload)) + payload


def decode_metadata(data: bytes, source: str = "metadata") -> Metadata:
    """Decode ``raydcp.meta`` bytes; any damage is a CheckpointError naming ``source``."""
    if len(data) < _PREAMBLE.size:
        raise CheckpointDamagedError(f"{source}: too short to be raydcp metadata ({len(data)} bytes); the file is truncated", file=source)
    magic, major, minor, length, crc = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointDamagedError(f"{source}: not raydcp metadata (bad magic); is this a raydcp checkpoint?", file=source)
    if major not in READ_MAJORS:
        raise CheckpointError(
            f"{source}: format version {major}.{minor} is not supported by this raydcp (reads "
            f"{' and '.join(f'{m}.x' for m in READ_MAJORS)}); upgrade raydcp to read it"
        )
    payload = memoryview(data)[_PREAMBLE.size:]
    if len(payload) != length:
        raise CheckpointDamagedError(f"{source}: payload is {len(payload)} bytes, header says {length}; the file is "
                                     "truncated or damaged", file=source)
    if checksum(payload) != crc:
        raise CheckpointDamagedError(f"{source}: checksum mismatch; the metadata file is damaged", file=source)
    try:
        md = _decode_payload(payload, major)
        return Metadata(**{**md.__dict__, "version": (major, minor)})
    except _Unsupported as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    except CheckpointError as exc:
        raise CheckpointDamagedError(f"{source}: {exc}", file=source) from None
    except Exception as exc:  # a well-formed envelope around a malformed table
        raise CheckpointDamagedError(f"{source}: malformed metadata ({type(exc).__name__}: {exc})", file=source) from None


def _decode_payload(payload: memoryview, major: int = FORMAT_VERSION[0]) -> Metadata:
    reader = pa.ipc.open_stream(pa.py_buffer(payload))
    batches = list(reader)
    schema = reader.schema
    fields = _SCHEMA_FIELDS + (_COMPRESSION_FIELDS if major >= COMPRESSED_FORMAT_VERSION[0] else [])
    if [f.name for f in schema] != [f.name for f in fields]:
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
    if major < REFERENCE_FORMAT_VERSION[0] and any(f.startswith("../") for f in files):
        raise CheckpointError(f"a file of another checkpoint is named in a version {major} header")
    for f in files:
        if f.startswith("../"):  # a delta's reference: '../<checkpoint>/data/<save id>/<file>', nothing else
            check_reference(f, "this checkpoint")
    codecs = None
    if len(fields) > len(_SCHEMA_FIELDS):  # header position -> this raydcp's codec id (0: raw)
        names = [str(c) for c in header.get("codecs", [])]
        unknown = [c for c in names if c not in COMPRESSIONS]
        if unknown:
            raise _Unsupported(f"pieces are compressed with {', '.join(map(repr, unknown))}, which this raydcp "
                               f"does not know (it reads {', '.join(COMPRESSIONS)}); upgrade raydcp to read it")
        codecs = np.array([0] + [codec_id(c) for c in names], np.uint8)
    tensors = _decode_chunks(table, specs, files, codecs)
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


def _numpy(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A column's values as numpy: a zero-copy view of the data buffer of an integer or float
    column without nulls. pyarrow's ``to_numpy`` converts through its pandas layer, which imports
    pandas (about a second) in every process that reads metadata; other columns still go there."""
    if isinstance(arr, pa.ChunkedArray):
        arr = _one(arr)
    t = arr.type
    if arr.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)) and t.bit_width % 8 == 0:
        kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
        dtype = np.dtype(f"<{kind}{t.bit_width // 8}")
        if len(arr) == 0:
            return np.empty(0, dtype)
        return np.frombuffer(arr.buffers()[1], dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
    return arr.to_numpy(zero_copy_only=False)


def _column(table: pa.Table, name: str, dtype) -> np.ndarray:
    arr = _one(table.column(name))
    if arr.null_count:
        raise CheckpointError(f"column {name!r} has null entries")
    return np.asarray(_numpy(arr), dtype=dtype)


def _list(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (values, bounds): row i is values[bounds[i] - bounds[0]:bounds[i + 1] - bounds[0]]."""
    arr = _one(table.column(name))
    if arr.null_count or arr.values.null_count:
        raise CheckpointError(f"column {name!r} has null entries")
    bounds = _numpy(arr.offsets).astype(np.int64)
    values = np.asarray(_numpy(arr.values), dtype=dtype)
    return values[bounds[0]:bounds[-1]] if len(bounds) else values[:0], bounds - (bounds[0] if len(bounds) else 0)


def _decode_chunks(table: pa.Table, specs: list, files: list[str], codecs: np.ndarray | None = None
                   ) -> Mapping[str, TensorMeta]:
    """Validate every chunk against its tensor with array operations and return the tensors as a
    :class:`TensorMetas` over the decoded columns (no per-chunk or per-tensor objects).
    ``codecs`` (version 2): the codec id of each position of the header's codecs, 0 first."""
    n, k = table.num_rows, len(specs)
    tcol = _column(table, "tensor", np.int64)
    if n and (tcol.min() < 0 or tcol.max() >= k):
        raise CheckpointError("a chunk names a tensor that is not in the header")
    if n and np.any(tcol[1:] < tcol[:-1]):
        tensors = _decode_rows(table, specs, files, codecs)  # rows not grouped by tensor: the general path
        return tensors
    fcol = _column(table, "file", np.int64)
    if n and (fcol.min() < 0 or fcol.max() >= len(files)):
        raise CheckpointError("a chunk names a file that is not in the header")
    byte_off = _column(table, "byte_offset", np.int64)
    nbytes = _column(table, "nbytes", np.int64)
    crcs = _column(table, "checksum", np.uint32)
    codec = stored = None
    if codecs is not None:
        position = _column(table, "codec", np.int64)
        if n and position.max() >= len(codecs):
            raise CheckpointError("a chunk names a codec that is not in the header")
        codec, stored = codecs[position], _column(table, "stored_nbytes", np.int64)
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
            return _decode_rows(table, specs, files, codecs)
    shape_flat = np.fromiter(chain.from_iterable(shapes), np.int64, int(ndim.sum()))
    shape_start = np.zeros(k + 1, np.int64)
    np.cumsum(ndim, out=shape_start[1:])

    rows = np.searchsorted(tcol, np.arange(k + 1))  # the rows are grouped by tensor (checked above)
    per_tensor = np.diff(rows)
    nd0 = int(ndim[0]) if k else 0
    b1 = np.empty(n, bool)
    bad = np.less(byte_off, 0)
    uniform = bool(k and n and nd0 > 0 and (ndim == nd0).all())  # every tensor of nd0 dimensions
    if uniform and not ((np.diff(ob) != nd0).any() or (np.diff(sb) != nd0).any()):
        # (n, nd) views of the boxes, each tensor's extents spread over its rows: no index per element
        o2, s2 = ov.reshape(n, nd0), sv.reshape(n, nd0)
        shape2 = shape_flat.reshape(k, nd0)
        numel = np.repeat(isz, per_tensor)
        e, t = np.empty(n, np.int64), np.empty(n, np.int64)
        for d in range(nd0):
            o, z = o2[:, d], s2[:, d]
            e[:] = np.repeat(shape2[:, d], per_tensor)
            bad |= np.less(o, 0, out=b1)
            bad |= np.less(z, 0, out=b1)
            bad |= np.greater(o, e, out=b1)
            bad |= np.greater(z, np.subtract(e, o, out=t), out=b1)  # e - o: no int64 overflow, unlike o + z
            numel *= z
        del e, t
        bad |= np.not_equal(numel, nbytes, out=b1)  # elements times the item size
        bad |= _blocks_wrong(nbytes, bb, codec)
    else:
        uniform = False
        nd_row = ndim[tcol]
        bad |= (np.diff(ob) != nd_row) | (np.diff(sb) != nd_row)
        if not bad.any():
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
        bad |= (numel * isz[tcol] != nbytes) | _blocks_wrong(nbytes, bb, codec)
    # the chunk's bytes inside int64 (the product above cannot wrap: a chunk inside its tensor is
    # no larger than the tensor, whose size _check_shapes bounded)
    bad |= np.less(nbytes, 0, out=b1)
    bad |= np.greater(byte_off, _INT64_MAX - np.maximum(nbytes, 0), out=b1)
    if codec is not None:  # a raw chunk's stored length is its length; a compressed one's fits in a file
        bad |= (stored < 0) | ((codec == 0) & (stored != nbytes)) | (byte_off > _INT64_MAX - np.maximum(stored, 0))
    if bad.any():
        i = int(np.argmax(bad))
        name, dtype, shape = specs[int(tcol[i])]
        _chunk_error(name, dtype, shape, tuple(ov[ob[i]:ob[i + 1]].tolist()), tuple(sv[sb[i]:sb[i + 1]].tolist()),
                     int(byte_off[i]), int(nbytes[i]), *((int(codec[i]), int(stored[i])) if codec is not None else ()))

    if uniform:
        off2, size2 = o2, s2
    else:  # pad the boxes of tensors of fewer dimensions (offset 0, size 1)
        width = max(1, int(ndim.max()) if k else 1)
        off2, size2 = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        off2[row_of, dim_of], size2[row_of, dim_of] = ov, sv
    cols = ChunkColumns(rows, ndim, off2, size2, files, fcol, byte_off, nbytes, crcs, bv, bb, codec, stored)
    return TensorMetas(names, dtypes, shapes, cols)


def _blocks_wrong(nbytes: np.ndarray, bb: np.ndarray, codec: np.ndarray | None = None) -> np.ndarray:
    """Per chunk: whether it does not list one checksum per BLOCK_BYTES block of a raw chunk larger
    than one block (none for a smaller or a compressed chunk, which is always read whole); ``bb``
    bounds each chunk's block checksums, from 0, and ``codec`` (None: all raw) is each chunk's codec."""
    large = nbytes > BLOCK_BYTES
    if codec is not None:
        large &= codec == 0
    if not bb[-1]:  # no block checksums at all (every chunk small, as at a million pieces): one comparison
        return large
    return np.diff(bb) != np.where(large, -(-nbytes // BLOCK_BYTES), 0)


def _decode_rows(table: pa.Table, specs: list, files: list[str], codecs: np.ndarray | None = None
                 ) -> dict[str, TensorMeta]:
    """The general path: one ChunkMeta per row, rows in any order."""
    tensor_col = _numpy(table.column("tensor"))
    offs = _list_column(table.column("offsets"))
    sizes = _list_column(table.column("sizes"))
    file_col = _numpy(table.column("file"))
    byte_off = _numpy(table.column("byte_offset"))
    nbytes = _numpy(table.column("nbytes"))
    crcs = _numpy(table.column("checksum"))
    blocks = _list_column(table.column("block_checksums"))
    if codecs is not None:
        positions = _numpy(table.column("codec"))
        if len(positions) and int(positions.max()) >= len(codecs):
            raise CheckpointError("a chunk names a codec that is not in the header")
        codec_col, stored_col = codecs[positions].tolist(), _numpy(table.column("stored_nbytes")).tolist()
    chunks: list[list[ChunkMeta]] = [[] for _ in specs]
    for i in range(table.num_rows):
        ti, fi = int(tensor_col[i]), int(file_col[i])
        packed: tuple = ()
        # a compressed chunk, or a raw one that lists another stored length (reported below)
        if codecs is not None and (codec_col[i] or stored_col[i] != int(nbytes[i])):
            packed = (COMPRESSIONS[codec_col[i] - 1] if codec_col[i] else None, stored_col[i])
        chunks[ti].append(ChunkMeta(offs[i], sizes[i], files[fi], int(byte_off[i]), int(nbytes[i]), int(crcs[i]),
                                    blocks[i], *packed))
    tensors = {}
    for (name, dtype, shape), cs in zip(specs, chunks):
        isz = itemsize(dtype)
        for c in cs:
            packed = c.compression is not None
            if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, shape)
            ) or c.nbytes != _numel(c.sizes) * isz or c.byte_offset < 0 or c.byte_offset + c.nbytes > _INT64_MAX \
                    or c.stored_length < 0 or c.byte_offset + c.stored_length > _INT64_MAX \
                    or (not packed and c.stored_length != c.nbytes) \
                    or len(c.block_checksums) != (-(-c.nbytes // BLOCK_BYTES) if c.nbytes > BLOCK_BYTES and not packed
                                                  else 0):
                _chunk_error(name, dtype, shape, c.offsets, c.sizes, c.byte_offset, c.nbytes,
                             codec_id(c.compression), c.stored_length)
        tensors[name] = TensorMeta(dtype, shape, tuple(cs))
    return tensors


def _chunk_error(name: str, dtype: str, shape: tuple, offsets: tuple, sizes: tuple, byte_offset: int,
                 nbytes: int, codec: int = 0, stored: int | None = None):
    """Raise the CheckpointError that says what is wrong with one chunk of tensor ``name``."""
    where = f"chunk of {name!r} at {offsets}"
    stored = nbytes if stored is None else stored
    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
        raise CheckpointDamagedError(f"{where} does not fit the tensor's shape {shape}")
    want = _numel(sizes) * itemsize(dtype)
    if nbytes != want:
        raise CheckpointDamagedError(f"{where} records {nbytes} bytes, but its sizes {list(sizes)} of {dtype} take {want}")
    if not codec and stored != nbytes:
        raise CheckpointDamagedError(f"{where} is stored raw but records a stored length of {stored} bytes, not {nbytes}")
    if byte_offset < 0 or max(nbytes, stored) < 0 or byte_offset + max(nbytes, stored) > _INT64_MAX:
        raise CheckpointDamagedError(f"{where} has a byte range {byte_offset}+{stored} outside any file")
    if codec:
        raise CheckpointDamagedError(f"{where} is compressed but lists block checksums (a compressed chunk has none)")
    raise CheckpointDamagedError(f"{where} does not list one checksum per {BLOCK_BYTES}-byte block")


def _list_column(col: pa.ChunkedArray) -> list[tuple[int, ...]]:
    arr = col.combine_chunks()
    values = _numpy(arr.values).tolist()
    bounds = _numpy(arr.offsets).tolist()
    return [tuple(values[bounds[i]:bounds[i + 1]]) for i in range(len(arr))]


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
