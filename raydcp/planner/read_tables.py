"""The last phase of the load planner's array path (:mod:`.load_arrays`): every rank's
:class:`RankLoadPlan`, its reads as one :class:`ReadTable` of columns sliced from the reads of all
ranks."""
from __future__ import annotations

import numpy as np

from ..metadata import ChunkTable
from .arrays import take_rows
from .types import PackedNames, RankLoadPlan, ReadTable, StoredChunks, packed_rows


def read_tables(a) -> list[RankLoadPlan]:
    """Every rank's :class:`RankLoadPlan`: its reads as one :class:`ReadTable`, what it receives,
    its plain values and byte counts. ``a``: the columns of the planner's earlier phases
    (:class:`.load_arrays._Arrays`). Stored chunks: the reads of all ranks are laid out once, as
    the two matrices of :meth:`ReadTable.of_rows`, one row per read and per delivery, rank after
    rank; each rank's table is its rows of them (views: no copy, no array per column). What the
    chunks' places decide (:func:`read_layout`) is apart from what their files, byte offsets and
    checksums add (:func:`stored_plans`): a later load of the same layout reuses the first."""
    if not a.stored:
        return _object_tables(a)
    layout = read_layout(a)
    a.read_layout = layout
    return stored_plans(layout, layout.reads, a.s_file, a.s_boff, a.s_crc, a.s_bstart, a.block_arrays, a.files,
                        a.local_plans, a.values)


class ReadLayout:
    """The part of a load plan over stored chunks that the chunks' places and the requests decide:
    the matrices of :meth:`ReadTable.of_rows` but for the columns of files, byte offsets and
    checksums (``reads``; ``dels`` whole), which chunk each read is (``rchunk``), the reads' and
    deliveries' bounds per rank, the block checksums' bounds per read, and the per-rank counts."""

    __slots__ = ("reads", "dels", "rchunk", "r_of", "rb", "pb", "bounds", "joint", "keys", "dtypes", "ndims",
                 "incoming", "bytes_read", "needed")


def read_layout(a) -> ReadLayout:
    boxes, nreads, p_q, p_rank, pairs, pb, rb = a.boxes, a.nreads, a.p_q, a.p_rank, a.pairs, a.pb, a.rb
    rchunk, rjoint, s_blen = a.rchunk, a.rjoint, a.s_blen
    width = a.s_off.shape[1]
    own_boxes = not a.whole
    nr, nd = packed_rows(width, own_boxes)
    r_of = np.repeat(np.arange(a.world), np.diff(rb))  # each read's rank
    reads = np.empty((nreads, nr), np.int64)
    if a.whole and pairs is None and a.p_key is not None:  # read i is pair i, its part the whole chunk:
        off, size = boxes(None)  # key and box from the requests' columns, in order
        reads[:, 0], reads[:, 7:7 + width], reads[:, 7 + width:] = a.p_key, off, size
        del off, size
    else:
        np.take(a.s_key, rchunk, out=reads[:, 0])
        np.take(a.s_off, rchunk, axis=0, out=reads[:, 7:7 + width])
        np.take(a.s_size, rchunk, axis=0, out=reads[:, 7 + width:])
    np.take(a.s_nbytes, rchunk, out=reads[:, 3])
    np.subtract(pb[:-1], pb[rb[:-1]][r_of], out=reads[:, 5])  # counted from the rank's first
    bounds = np.zeros(nreads + 1, np.int64)
    if s_blen.any():  # some chunk has block checksums (none has where every chunk is small)
        np.cumsum(s_blen[rchunk], out=bounds[1:])
    np.subtract(bounds[:-1], bounds[rb[:-1]][r_of], out=reads[:, 6])
    dels = np.empty((int(pb[-1]), nd), np.int64)
    if pairs is None:
        dels[:, 0], dels[:, 1] = p_rank, a.q_item[p_q]
    else:
        dels[:, 0], dels[:, 1] = p_rank[pairs], a.q_item[p_q[pairs]]
    if own_boxes:
        dels[:, 2:2 + width], dels[:, 2 + width:] = boxes(pairs)
    out = ReadLayout()
    out.reads, out.dels, out.rchunk, out.r_of, out.rb, out.pb, out.bounds = reads, dels, rchunk, r_of, rb, pb, bounds
    out.joint = rjoint if len(a.sp_heads) and rjoint.any() else None
    out.keys, out.dtypes, out.ndims = PackedNames.of(a.keys), PackedNames.of(a.dtypes), tuple(a.nd_key.tolist())
    out.incoming, out.bytes_read, out.needed = a.incoming.tolist(), a.bytes_read.tolist(), a.needed.tolist()
    return out


def stored_plans(layout: ReadLayout, reads: np.ndarray, s_file, s_boff, s_crc, s_bstart, block_arrays, files,
                 local_plans, values) -> list[RankLoadPlan]:
    """Every rank's plan from ``layout`` and the stored chunks' files, byte offsets and checksums
    (written into ``reads``, ``layout.reads`` or a copy of it) and plain ``values``."""
    rchunk, rb, pb, bounds = layout.rchunk, layout.rb, layout.pb, layout.bounds
    reads[:, 1], rank_files = _rank_files(np.take(s_file, rchunk), layout.r_of, rb, files)
    np.take(s_boff, rchunk, out=reads[:, 2])
    np.take(s_crc, rchunk, out=reads[:, 4])
    values_all = np.zeros(0, np.uint32)
    total = int(bounds[-1])
    if total:
        bl = np.diff(bounds)
        everything = np.concatenate(block_arrays).astype(np.uint32, copy=False)
        values_all = everything[np.repeat(s_bstart[rchunk] - bounds[:-1], bl) + np.arange(total)]
    dels, joint, keys, dtypes, ndims = layout.dels, layout.joint, layout.keys, layout.dtypes, layout.ndims
    rbl = rb.tolist()
    pbl = pb[rb].tolist()  # each rank's first and last delivery
    bbl = bounds[rb].tolist()  # and block checksum
    incoming, bytes_read, needed = layout.incoming, layout.bytes_read, layout.needed
    plans = []
    for r, lp in enumerate(local_plans):
        lo, hi = rbl[r], rbl[r + 1]
        blocks = values_all[bbl[r]:bbl[r + 1]] if bbl[r + 1] > bbl[r] else None
        table = ReadTable.of_rows(reads[lo:hi], dels[pbl[r]:pbl[r + 1]], blocks,
                                  None if joint is None else joint[lo:hi], keys, dtypes, ndims, rank_files[r])
        plans.append(RankLoadPlan(rank=lp.rank, reads=table, incoming=incoming[r],
                                  values={k: values[k] for k in lp.values if k in values} if lp.values else {},
                                  bytes_read=bytes_read[r], bytes_needed=needed[r]))
    return plans


def _rank_files(file: np.ndarray, r_of: np.ndarray, rb: np.ndarray, files) -> tuple[np.ndarray, list]:
    """Each read's file as an index into its rank's own list of files, and those lists (packed):
    a rank's plan names the files it reads, not every file of the checkpoint (which made every
    reply as long as the checkpoint has files: a cost in the square of the ranks)."""
    nfiles = max(len(files), 1)
    code = r_of * nfiles
    code += file
    pairs = np.sort(code)
    pairs = pairs[np.r_[True, pairs[1:] != pairs[:-1]]] if len(pairs) else pairs  # each (rank, file) once
    local = np.searchsorted(pairs, code)
    pair_rank = pairs // nfiles
    first = np.searchsorted(pair_rank, np.arange(len(rb)))  # each rank's first pair (and the end)
    local -= first[:-1][r_of]
    names = [files[f] for f in (pairs % nfiles).tolist()]
    bounds = first.tolist()
    return local, [PackedNames.of(names[bounds[r]:bounds[r + 1]]) for r in range(len(rb) - 1)]


def _object_tables(a) -> list[RankLoadPlan]:
    """The plans of a load whose sources are live pieces or objects (a transfer): each rank's
    table of columns sliced from all ranks', its chunks the SourceChunk objects themselves."""
    boxes, pairs, p_q, p_rank, rchunk, s_key = a.boxes, a.pairs, a.p_q, a.p_rank, a.rchunk, a.s_key
    d_lo, d_sz = (None, None) if a.whole else boxes(pairs)
    cols = {"key": s_key[rchunk], "offsets": take_rows(a.s_off, rchunk), "sizes": take_rows(a.s_size, rchunk),
            "nbytes": a.s_nbytes[rchunk], "d_rank": p_rank if pairs is None else p_rank[pairs],
            "d_item": a.q_item[p_q if pairs is None else p_q[pairs]], "d_offsets": d_lo, "d_sizes": d_sz,
            "joint": a.rjoint if len(a.sp_heads) and a.rjoint.any() else None}
    tables, cstart, keys, dtypes = a.tables, a.cstart, a.keys, a.dtypes
    objs = [tables[k][c - cstart[k]] if not isinstance(tables[k], ChunkTable) else
            StoredChunks(keys[k], dtypes[k], tables[k])[c - cstart[k]]
            for c, k in zip(rchunk.tolist(), s_key[rchunk].tolist())]
    incoming, bytes_read, needed = a.incoming.tolist(), a.bytes_read.tolist(), a.needed.tolist()
    keys, dtypes, files = PackedNames.of(keys), PackedNames.of(dtypes), PackedNames.of(a.files)
    per_read = [(n, x) for n, x in cols.items() if not n.startswith("d_") and x is not None]
    per_delivery = [(n, x) for n, x in cols.items() if n.startswith("d_") and x is not None]
    rb, pb = a.rb, a.pb
    rbl = rb.tolist()
    pbl = pb[rb].tolist()
    plans = []
    for r, lp in enumerate(a.local_plans):
        lo, hi = rbl[r], rbl[r + 1]
        pa, pz = pbl[r], pbl[r + 1]
        fields = {name: x[lo:hi] for name, x in per_read}
        for name, x in per_delivery:
            fields[name] = x[pa:pz]
        fields["sources"] = objs[lo:hi]
        reads = ReadTable(keys=keys, dtypes=dtypes, ndims=a.nd_key, files=files, delivery_bounds=pb[lo:hi + 1] - pa,
                          **fields)
        plans.append(RankLoadPlan(rank=lp.rank, reads=reads, incoming=incoming[r],
                                  values={k: a.values[k] for k in lp.values if k in a.values},
                                  bytes_read=bytes_read[r], bytes_needed=needed[r]))
    return plans
