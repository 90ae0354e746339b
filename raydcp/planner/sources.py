"""The source chunks of a load as the arrays the load planner works on.

A decoded checkpoint's chunks are rows of one :class:`~raydcp.metadata.ChunkColumns`, taken whole
(:func:`columns_arrays`); other sources (tables of several metadata, live pieces as
:class:`~raydcp.planner.SourceChunk` objects) are copied table by table (:func:`table_arrays`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..metadata import ChunkTable
from .types import StoredChunks


class StoredSources(Mapping):
    """key -> :class:`StoredChunks` over a :class:`raydcp.metadata.TensorMetas`, built on the
    first lookup; iteration and ``len`` work on the names."""

    __slots__ = ("tensors", "_dict")

    def __init__(self, tensors):
        self.tensors = tensors
        self._dict = None

    def _all(self) -> dict[str, StoredChunks]:
        if self._dict is None:
            self._dict = {key: StoredChunks(key, t.dtype, ChunkTable.from_chunks(t.chunks, len(t.shape)))
                          for key, t in self.tensors.items()}
        return self._dict

    def __getitem__(self, key: str) -> StoredChunks:
        return self._all()[key]

    def __iter__(self):
        return iter(self.tensors.names)

    def __len__(self) -> int:
        return len(self.tensors.names)

    def __contains__(self, key) -> bool:
        return key in self.tensors


def shared_columns(tables, nd_key):
    """The ChunkColumns that every table is one tensor's rows of, as columns of the keys' tensors in
    key order (a gather where the keys are not its tensors in order), or None."""
    origins = [getattr(t, "origin", None) for t in tables]
    if any(o is None for o in origins):
        return None
    cols = origins[0][0]
    if any(o[0] is not cols for o in origins):
        return None
    ids = np.fromiter((o[1] for o in origins), np.int64, len(origins))
    if (cols.ndim[ids] != nd_key).any():
        return None
    cols = cols.take(ids)
    if (np.diff(cols.rows) != np.fromiter(map(len, tables), np.int64, len(tables))).any():
        return None
    return cols


def columns_arrays(cols, counts, cstart, width):
    """The chunk arrays of the load planner, taken from one ChunkColumns (rows in key order)."""
    nchunks = int(cstart[-1])
    w = cols.offsets.shape[1]
    if w == width:
        s_off, s_size = cols.offsets, cols.sizes
    else:
        s_off, s_size = np.zeros((nchunks, width), np.int64), np.ones((nchunks, width), np.int64)
        s_off[:, :w], s_size[:, :w] = cols.offsets, cols.sizes
    nkeys = len(counts)
    ext = np.ones((nkeys, width), np.int64)  # per key, the box its chunks span
    used = np.flatnonzero(counts > 0)
    if len(used):
        ext[used] = np.maximum.reduceat(s_off + s_size, cstart[used], axis=0)
    files = list(cols.files) if nchunks else []
    bb = cols.block_bounds
    return (s_off, s_size, np.asarray(cols.nbytes, np.int64), ext, files, np.asarray(cols.file, np.int64),
            np.asarray(cols.byte_offset, np.int64), np.asarray(cols.checksum, np.int64), bb[:-1],
            np.diff(bb), [cols.block_values] if nchunks else [])


def table_arrays(tables, stored, counts, cstart, nd_key, width):
    """The chunk arrays of the load planner, copied table by table (or object by object);
    ``s_off`` None where the chunks cannot be represented."""
    nkeys = len(counts)
    nchunks = int(cstart[-1])
    s_off = np.zeros((nchunks, width), np.int64)
    s_size = np.ones((nchunks, width), np.int64)
    s_nbytes = np.zeros(nchunks, np.int64)
    ext = np.ones((nkeys, width), np.int64)  # per key, the box its chunks span
    s_file = s_boff = s_crc = s_bstart = s_blen = None
    if stored:  # where each stored chunk lies: file, byte offset, checksum, block checksums
        s_file, s_boff, s_crc = np.zeros(nchunks, np.int64), np.zeros(nchunks, np.int64), np.zeros(nchunks, np.int64)
        s_bstart, s_blen = np.zeros(nchunks, np.int64), np.zeros(nchunks, np.int64)
        file_index: dict[str, int] = {}
        remap: dict[int, tuple] = {}
        block_arrays: dict[int, tuple] = {}
        nblock_values = 0
    for i, t in enumerate(tables):
        a, b, nd = cstart[i], cstart[i + 1], nd_key[i]
        if a == b:
            continue
        if isinstance(t, ChunkTable):
            s_off[a:b, :nd] = t.offsets
            s_size[a:b, :nd] = t.sizes
            s_nbytes[a:b] = t.nbytes
            m = remap.get(id(t.files))
            if m is None or m[0] is not t.files:
                m = remap[id(t.files)] = (t.files, np.array([file_index.setdefault(f, len(file_index))
                                                             for f in t.files] or [0]))
            s_file[a:b] = m[1][t.file]
            s_boff[a:b] = t.byte_offset
            s_crc[a:b] = t.checksum
            v = block_arrays.get(id(t.block_values))
            if v is None or v[0] is not t.block_values:
                v = block_arrays[id(t.block_values)] = (t.block_values, nblock_values)
                nblock_values += len(t.block_values)
            s_bstart[a:b] = t.block_bounds[:-1] + v[1]
            s_blen[a:b] = np.diff(t.block_bounds)
        else:
            try:
                s_off[a:b, :nd] = [c.offsets for c in t]
                s_size[a:b, :nd] = [c.sizes for c in t]
                s_nbytes[a:b] = [c.nbytes for c in t]
            except (ValueError, TypeError, OverflowError):
                return (None,) * 11
        if nd > 0:
            ext[i, :nd] = (s_off[a:b, :nd] + s_size[a:b, :nd]).max(axis=0)
    files = list(file_index) if stored else []
    blocks = [v[0] for v in block_arrays.values()] if stored else []
    return s_off, s_size, s_nbytes, ext, files, s_file, s_boff, s_crc, s_bstart, s_blen, blocks
