"""A rank's load plan given as columns, sorted for :class:`~raydcp.engine.reads.FileChunkReader`
without building a :class:`~raydcp.planner.ChunkRead` per chunk: small whole chunks by file,
large whole chunks, and the rest (parts of chunks, chunks for other ranks, compressed pieces)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..options import DEFAULT_IO
from ..planner import ChunkRead, SourceChunk

__all__ = ["columnar_reads"]

_READ_COLUMNS = ("keys", "dtypes", "ndims", "files", "key", "offsets", "sizes", "file", "byte_offset", "nbytes",
                 "checksum", "block_values", "block_bounds", "delivery_bounds", "d_rank", "d_item", "d_sizes")


def columnar_reads(reads: Any, out, pool_min: int = DEFAULT_IO.read_pool_min, compressed=None):
    """:meth:`FileChunkReader._sort_reads` for a plan whose reads come as columns (arrays of
    keys, boxes, files, offsets, checksums and deliveries; checksum -1 for none); None if
    ``reads`` is a plain sequence of ChunkRead. Only chunks that are not read whole into this
    rank's tensors become ChunkRead objects; so do the pieces ``compressed``
    (:class:`~raydcp.engine.compressed.CompressedPieces`) names, which are read apart."""
    if getattr(reads, "sources", True) is not None or not all(hasattr(reads, c) for c in _READ_COLUMNS):
        return None
    n = len(reads.nbytes)
    db = np.asarray(reads.delivery_bounds)
    d_rank = np.asarray(reads.d_rank)
    sizes = np.asarray(reads.sizes)
    d_sizes = None if reads.d_sizes is None else np.asarray(reads.d_sizes)  # None: every delivery is whole
    if n == 0 or len(db) != n + 1 or sizes.ndim != 2 or d_sizes is not None and (
            d_sizes.ndim != 2 or sizes.shape[1] != d_sizes.shape[1]):
        return None
    first = np.minimum(db[:-1], max(len(d_rank) - 1, 0))
    nbytes = np.asarray(reads.nbytes)
    whole = ((db[1:] - db[:-1]) == 1) & (d_rank[first] == out.rank) & (nbytes > 0)
    if d_sizes is not None and len(d_sizes):
        whole &= (d_sizes[first] == sizes).all(axis=1)
    files, boff, crcs = reads.files, np.asarray(reads.byte_offset), np.asarray(reads.checksum)
    if compressed:  # compressed pieces go with the rest (read whole, then decompressed)
        fcol = np.asarray(reads.file)
        for f, name in enumerate(files):
            offsets = compressed.by_file.get(name)
            if offsets:
                sel = np.flatnonzero(fcol == f)
                whole[sel[np.isin(boff[sel], np.fromiter(offsets, np.int64, len(offsets)))]] = False
    bb = np.asarray(reads.block_bounds)
    nblocks = bb[1:] - bb[:-1]
    items = np.asarray(reads.d_item)[first]

    def chunk(i: int) -> SourceChunk:
        k = int(reads.key[i])
        nd = int(reads.ndims[k])
        crc = int(crcs[i])
        return SourceChunk(reads.keys[k], reads.dtypes[k], tuple(reads.offsets[i][:nd].tolist()),
                           tuple(sizes[i][:nd].tolist()), files[int(reads.file[i])], int(boff[i]), int(nbytes[i]),
                           None if crc < 0 else crc, tuple(reads.block_values[bb[i]:bb[i + 1]].tolist()))

    small: dict[str, list[tuple]] = {}
    large: list[tuple[Any, torch.Tensor]] = []
    rest_rows: list[int] = []
    whole_dest = out.whole
    rows = np.flatnonzero(whole & (nbytes < pool_min) & (nblocks == 0))
    for i, item, nb, f, off, crc in zip(rows.tolist(), items[rows].tolist(), nbytes[rows].tolist(),
                                          np.asarray(reads.file)[rows].tolist(), boff[rows].tolist(),
                                          crcs[rows].tolist()):
        dest = whole_dest(item, nb)
        if dest is None:
            rest_rows.append(i)
        else:
            small.setdefault(files[f], []).append((off, nb, None if crc < 0 else crc, dest, i))
    rows = np.flatnonzero(whole & ((nbytes >= pool_min) | (nblocks > 0)))
    for i, item, nb in zip(rows.tolist(), items[rows].tolist(), nbytes[rows].tolist()):
        dest = whole_dest(item, nb)
        if dest is None:
            rest_rows.append(i)
        else:
            large.append((chunk(i), dest))
    rest_rows.extend(np.flatnonzero(~whole & (nbytes > 0)).tolist())
    rest: list[ChunkRead] = []
    if rest_rows:
        objs = tuple(reads)
        rest = [objs[i] for i in sorted(rest_rows)]
    return small, large, rest, chunk
