"""The chunk tables a commit records, built from a global save plan's arrays (no object per piece)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..metadata import BLOCK_BYTES, ChunkColumns, ChunkTable
from .arrays import stable_order
from .types import FileTable, GlobalSavePlan, LocalSavePlan

__all__ = ["chunk_tables"]


def chunk_tables(gp: GlobalSavePlan, local_plans: Sequence[LocalSavePlan],
                 checksums: Sequence[np.ndarray] | None = None,
                 block_checksums: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> dict[str, ChunkTable]:
    """The chunk table of every tensor once each rank has written its part of ``gp``, built from
    the plans' columns: what the commit step records, with no object per piece.

    ``checksums[r]`` holds the CRC32C of rank r's slots in the order of its ``files`` (zeros
    when None); ``block_checksums[r]`` is ``(values, bounds)`` for them, in the same order
    (needed only where a piece is larger than one checksum block). Chunks are sorted by offsets.
    The tables are views of one :class:`~raydcp.metadata.ChunkColumns`, which the metadata
    encoder then writes whole.
    """
    keys = list(gp.tensors)
    kid = {key: i for i, key in enumerate(keys)}
    width = max([1, *(len(s.shape) for s in gp.tensors.values())])
    fts = [_file_table(rp.files) for rp in gp.ranks]
    n = sum(len(ft.items) for ft in fts)
    # every rank's slots, written into arrays allocated once (fresh memory costs page faults)
    key, file, boff, nbytes = (np.empty(n, np.int64) for _ in range(4))
    crc, blen = np.zeros(n, np.int64), np.zeros(n, np.int64)
    off, size = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
    files: list[str] = []
    bvals: list[np.ndarray] = []
    maps: dict[bytes, np.ndarray] = {}
    a = 0
    for rp, ft in zip(gp.ranks, fts):
        cols = local_plans[rp.rank].columns
        items = ft.items
        b = a + len(items)
        m = maps.get(cols.keys_digest)
        if m is None:
            m = maps[cols.keys_digest] = np.array([kid[k] for k in cols.keys] or [0], np.int64)
        key[a:b] = m[cols.key[items]]
        w = min(width, cols.offsets.shape[1])
        off[a:b, :w] = cols.offsets[items, :w]
        size[a:b, :w] = cols.sizes[items, :w]
        file[a:b] = np.repeat(np.arange(len(files), len(files) + len(ft.names)), np.diff(ft.bounds))
        files.extend(ft.names)
        boff[a:b] = ft.byte_offsets
        nbytes[a:b] = cols.nbytes[items]
        if checksums is not None:
            crc[a:b] = np.asarray(checksums[rp.rank], np.int64)[:b - a]  # one per slot, in file order
        if block_checksums is not None:
            values, bounds = block_checksums[rp.rank]
            blen[a:b] = np.diff(np.asarray(bounds, np.int64))
            bvals.append(np.asarray(values, np.uint32))
        a = b
    if block_checksums is None and n and (nbytes > BLOCK_BYTES).any():
        raise ValueError(f"pieces larger than {BLOCK_BYTES} bytes need their block checksums")
    order = stable_order([key, *(off[:, d] for d in range(width))])
    rows = np.zeros(len(keys) + 1, np.int64)  # sorted by tensor first: tensor t's chunks are rows[t]:rows[t + 1]
    np.cumsum(np.bincount(key, minlength=len(keys)), out=rows[1:])
    bval = np.concatenate(bvals) if bvals else np.zeros(0, np.uint32)
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(blen, out=bounds[1:])
    blen = blen[order]
    if len(bval):
        bval = bval[np.repeat(bounds[:-1][order] - (np.cumsum(blen) - blen), blen) + np.arange(int(blen.sum()))]
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(blen, out=bounds[1:])
    off, size = np.take(off, order, axis=0), np.take(size, order, axis=0)
    file, boff, nbytes, crc = (np.take(x, order) for x in (file, boff, nbytes, crc))
    ndim = np.fromiter((len(s.shape) for s in gp.tensors.values()), np.int64, len(keys))
    cols = ChunkColumns(rows, ndim, off, size, files, file, boff, nbytes, crc, bval, bounds)
    return dict(zip(keys, cols.tables()))


def _file_table(files) -> FileTable:
    """A rank's ``RankWritePlan.files`` as a FileTable (plans built by the object path hold tuples)."""
    if isinstance(files, FileTable):
        return files
    return FileTable([name for name, _ in files],
                     np.array([s.item for _, slots in files for s in slots], np.int64),
                     np.array([s.byte_offset for _, slots in files for s in slots], np.int64),
                     np.cumsum([0] + [len(slots) for _, slots in files]).tolist())
