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
from typing import Any, Mapping

import pyarrow as pa

from .codec import checksum, decode_value, encode_value, itemsize
from .errors import CheckpointError

__all__ = ["FORMAT_VERSION", "BLOCK_BYTES", "ChunkMeta", "TensorMeta", "Metadata", "encode_metadata", "decode_metadata"]

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


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]

    @property
    def nbytes(self) -> int:
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
    header = {
        "format": "raydcp",
        "save_id": md.save_id,
        "world_size": md.world_size,
        "created_at": md.created_at,
        "block_bytes": BLOCK_BYTES,
        "tensors": [[n, md.tensors[n].dtype, list(md.tensors[n].shape)] for n in names],
        "files": list(files),
        "values": {k: encode_value(v) for k, v in md.values.items()},
        "extra": {k: encode_value(v) for k, v in md.extra.items()},
    }
    schema = pa.schema(_SCHEMA_FIELDS, metadata={b"raydcp": json.dumps(header, separators=(",", ":"))})
    batch = pa.record_batch([pa.array(cols[f.name], type=f.type) for f in _SCHEMA_FIELDS], schema=schema)
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
    specs = header["tensors"]
    files = header["files"]
    tensor_col = table.column("tensor").to_numpy()
    offs = _list_column(table.column("offsets"))
    sizes = _list_column(table.column("sizes"))
    file_col = table.column("file").to_numpy()
    byte_off = table.column("byte_offset").to_numpy()
    nbytes = table.column("nbytes").to_numpy()
    crcs = table.column("checksum").to_numpy()
    blocks = _list_column(table.column("block_checksums"))
    if int(header.get("block_bytes", BLOCK_BYTES)) != BLOCK_BYTES:
        raise CheckpointError(f"checksum block size {header.get('block_bytes')} is not {BLOCK_BYTES}")
    chunks: list[list[ChunkMeta]] = [[] for _ in specs]
    for i in range(table.num_rows):
        ti, fi = int(tensor_col[i]), int(file_col[i])
        chunks[ti].append(ChunkMeta(offs[i], sizes[i], files[fi], int(byte_off[i]), int(nbytes[i]), int(crcs[i]),
                                    blocks[i]))
    tensors = {}
    for (name, dtype, shape), cs in zip(specs, chunks):
        shape = tuple(int(s) for s in shape)
        isz = itemsize(dtype)
        for c in cs:
            if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, shape)
            ) or c.nbytes != _numel(c.sizes) * isz or c.byte_offset < 0 or len(c.block_checksums) != (
                -(-c.nbytes // BLOCK_BYTES) if c.nbytes > BLOCK_BYTES else 0
            ):
                raise CheckpointError(f"chunk of {name!r} at {c.offsets} does not fit the tensor's shape {shape}")
        tensors[name] = TensorMeta(dtype, shape, tuple(cs))
    return Metadata(
        save_id=str(header["save_id"]),
        world_size=int(header["world_size"]),
        created_at=float(header["created_at"]),
        tensors=tensors,
        values={k: decode_value(v) for k, v in header["values"].items()},
        extra={k: decode_value(v) for k, v in header.get("extra", {}).items()},
    )


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
