"""Pieces stored compressed: how a file of them is written, and how one is read back.

A save with ``SaveOptions(compression="zstd" | "lz4")`` compresses every piece on its own
(:func:`raydcp.codec.compress`, one self-contained frame), so that each stays addressable by
its byte range, small packed pieces included. A piece that does not shrink, or is smaller than
:data:`MIN_COMPRESSED_BYTES` (a frame's overhead outweighs what it would save), is stored raw.
The pieces are laid out as they come, each at a multiple of 64 bytes: the file's layout is the
writer's, not the save plan's (which sized the files by the pieces' raw bytes).

Every stored piece is checksummed over its stored bytes; a raw piece over one checksum block
also per block, as in an uncompressed checkpoint. A compressed piece has no block checksums: it
is always read whole (:func:`read_compressed`), verified, then decompressed, and a load that
needs only part of it reads all of it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import crc32c
import numpy as np

from ..codec import combine_block_checksums, decompress, tensor_from_bytes
from ..codec import compress as compress_bytes
from ..errors import CheckpointDamagedError, CheckpointError
from ..metadata import BLOCK_BYTES, COMPRESSIONS, codec_id
from ..options import IOOptions
from ..planner.save import ALIGN

__all__ = ["MIN_COMPRESSED_BYTES", "PieceRows", "compressed_file_buffers", "CompressedPieces", "read_compressed"]

MIN_COMPRESSED_BYTES = 4096  # smaller pieces are stored raw
_ZEROS = bytes(ALIGN)


class PieceRows:
    """Per item of a rank's plan, what the writer records: CRC32C and block CRCs of the stored
    bytes, codec id (0: raw), stored length and offset in its file."""

    def __init__(self, n: int):
        self.crcs: list[Any] = [None] * n
        self.blocks: list[tuple[int, ...]] = [()] * n
        self.codecs: list[int] = [0] * n
        self.stored: list[int] = [0] * n
        self.offsets: list[int] = [0] * n


def compressed_file_buffers(ids: Sequence[int], sizes: Sequence[int], piece: Callable[[int], memoryview],
                            rows: PieceRows, io: IOOptions, compression: str) -> Iterator[Any]:
    """The buffers of one data file holding the items ``ids`` in order, each compressed with
    ``compression`` where that makes it smaller; runs in the file's writing thread.

    ``piece(item)`` gives the item's raw bytes. Stored pieces of up to ``io.pack_max`` bytes are
    copied into shared buffers of up to ``io.pack_bytes`` (one write, no per-piece buffer),
    larger ones are written ``io.write_bytes`` at a time from their own memory.
    """
    crc = crc32c.crc32c
    cid = codec_id(compression)
    pack: np.ndarray | None = None
    pack_start = pos = 0
    for item in ids:
        nbytes = sizes[item]
        raw = piece(item)
        stored, codec = raw, 0
        if nbytes >= MIN_COMPRESSED_BYTES:
            packed = compress_bytes(compression, raw)
            if packed.nbytes < nbytes:
                stored, codec = packed, cid
        n = stored.nbytes
        off = -(-pos // ALIGN) * ALIGN
        rows.codecs[item], rows.stored[item], rows.offsets[item] = codec, n, off
        if codec == 0 and n > BLOCK_BYTES:  # a raw piece keeps its block checksums (partial reads)
            bl = [crc(stored[b:b + BLOCK_BYTES]) for b in range(0, n, BLOCK_BYTES)]
            rows.crcs[item], rows.blocks[item] = combine_block_checksums(bl, n, BLOCK_BYTES), tuple(bl)
        else:
            rows.crcs[item] = crc(stored)
        if n <= io.pack_max:
            if pack is not None and off + n - pack_start > io.pack_bytes:
                yield memoryview(pack)[:pos - pack_start]
                pack = None
            if pack is None:  # zeros: the alignment gaps are zero bytes
                pack, pack_start = np.zeros(io.pack_bytes + ALIGN, np.uint8), pos
            pack[off - pack_start:off - pack_start + n] = np.frombuffer(stored, np.uint8)
        else:
            if pack is not None:
                yield memoryview(pack)[:pos - pack_start]
                pack = None
            if off > pos:
                yield _ZEROS[:off - pos]
            for s in range(0, n, io.write_bytes):
                yield stored[s:s + io.write_bytes]
        pos = off + n
    if pack is not None:
        yield memoryview(pack)[:pos - pack_start]


class CompressedPieces:
    """Where a rank's load reads compressed pieces: file -> byte offset -> (codec id, stored
    length), for the files of the rank's plan. Built by the coordinator from the metadata's
    columns (:meth:`of_columns`) and sent with the plan."""

    def __init__(self, by_file: dict[str, dict[int, tuple[int, int]]]):
        self.by_file = by_file

    def __bool__(self) -> bool:
        return bool(self.by_file)

    def get(self, file: str, byte_offset: int) -> tuple[int, int] | None:
        pieces = self.by_file.get(file)
        return None if pieces is None else pieces.get(byte_offset)

    @classmethod
    def of_metadata(cls, md) -> "CompressedPieces":
        """Every compressed piece of a checkpoint's metadata."""
        cols = getattr(md.tensors, "columns", None)
        if cols is not None:
            return cls.of_columns(cols)
        by_file: dict[str, dict[int, tuple[int, int]]] = {}
        for t in md.tensors.values():
            for c in t.chunks:
                if c.compression is not None:
                    by_file.setdefault(c.file, {})[c.byte_offset] = (codec_id(c.compression), c.stored_length)
        return cls(by_file)

    @classmethod
    def of_columns(cls, cols) -> "CompressedPieces":
        """Every compressed piece of a :class:`~raydcp.metadata.ChunkColumns`."""
        by_file: dict[str, dict[int, tuple[int, int]]] = {}
        if cols.codec is None:
            return cls(by_file)
        rows = np.flatnonzero(cols.codec)
        for f, off, k, n in zip(np.asarray(cols.file)[rows].tolist(), np.asarray(cols.byte_offset)[rows].tolist(),
                                cols.codec[rows].tolist(), np.asarray(cols.stored)[rows].tolist()):
            by_file.setdefault(cols.files[f], {})[off] = (k, n)
        return cls(by_file)

    def only(self, files) -> "CompressedPieces":
        """The pieces of ``files`` (what one rank's plan reads)."""
        return CompressedPieces({f: self.by_file[f] for f in files if f in self.by_file})

    def for_plan(self, plan) -> "CompressedPieces":
        """The pieces of the files a rank's load plan reads (its reads as columns or as ChunkReads)."""
        reads = plan.reads
        if getattr(reads, "sources", True) is None and getattr(reads, "file", None) is not None:
            files = {reads.files[f] for f in np.unique(np.asarray(reads.file)).tolist()}
        else:
            files = {cr.source.file for cr in reads if cr.source.file is not None}
        return self.only(files)


def read_compressed(storage, ch, codec: int, stored: int) -> tuple[Any, int]:
    """Read the compressed piece ``ch`` (a SourceChunk) whole, verify its stored bytes and
    decompress it; returns (the tensor of its box, the bytes read). Damage is a
    CheckpointDamagedError naming the file, the key and the stored byte range."""
    name = COMPRESSIONS[codec - 1]
    lo, hi = ch.byte_offset, ch.byte_offset + stored
    try:
        (buf,) = storage.read_ranges(ch.file, [(lo, hi)])
    except CheckpointError as exc:
        raise (exc.copy(f"{ch.key}: {exc}", key=ch.key) if isinstance(exc, CheckpointDamagedError)
               else exc.copy(f"{ch.key}: {exc}")) from None
    if ch.checksum is not None and crc32c.crc32c(buf) != ch.checksum:
        raise CheckpointDamagedError(
            f"{ch.key}: checksum mismatch in {ch.file} at bytes {lo}..{hi} ({name}-compressed piece at "
            f"{list(ch.offsets)}); the checkpoint is damaged: restore it from another copy",
            file=ch.file, key=ch.key, byte_range=(lo, hi))
    try:
        raw = decompress(name, buf, ch.nbytes)
    except ValueError as exc:
        raise CheckpointDamagedError(
            f"{ch.key}: the {name}-compressed piece at {list(ch.offsets)} in {ch.file} (bytes {lo}..{hi}) does not "
            f"decompress to its {ch.nbytes} bytes ({exc}); the checkpoint is damaged: restore it from another copy",
            file=ch.file, key=ch.key, byte_range=(lo, hi)) from None
    return tensor_from_bytes(raw, ch.dtype, ch.sizes), stored
