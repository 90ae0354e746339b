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


# the matrices are held in blocks of whole ranks' rows of about this size: memory the allocator
# keeps and hands to the next plan (a larger array is mapped afresh, and every page of it faults)
BLOCK_BYTES = 16 << 20


class ReadLayout:
    """The part of a load plan over stored chunks that the chunks' places and the requests decide:
    the matrices of :meth:`ReadTable.of_rows` but for the columns of files, byte offsets and
    checksums (``reads``; ``dels`` whole), in blocks of the ranks ``cuts[k]:cuts[k + 1]``; which
    chunk each read is (``rchunk``), the reads' and deliveries' bounds per rank, the block
    checksums' bounds per read, and the per-rank counts."""

    __slots__ = ("reads", "dels", "cuts", "rchunk", "r_of", "rb", "pb", "bounds", "joint", "keys", "dtypes",
                 "ndims", "incoming", "bytes_read", "needed")


def read_layout(a) -> ReadLayout:
    boxes, p_q, p_rank, pairs, pb, rb = a.boxes, a.p_q, a.p_rank, a.pairs, a.pb, a.rb
    rchunk, rjoint, s_blen = a.rchunk, a.rjoint, a.s_blen
    width = a.s_off.shape[1]
    own_boxes = not a.whole
    nr, nd = packed_rows(width, own_boxes)
    r_of = np.repeat(np.arange(a.world), np.diff(rb))  # each read's rank
    bounds = np.zeros(a.nreads + 1, np.int64)
    if s_blen.any():  # some chunk has block checksums (none has where every chunk is small)
        np.cumsum(s_blen[rchunk], out=bounds[1:])
    cuts = _rank_cuts(rb, nr)
    reads_blocks, dels_blocks = [], []
    for r0, r1 in zip(cuts[:-1], cuts[1:]):
        lo, hi = int(rb[r0]), int(rb[r1])
        reads = np.empty((hi - lo, nr), np.int64)
        rows = rchunk[lo:hi]
        # gathers assigned into the block's columns (np.take into a strided out is buffered: slower)
        reads[:, 0] = a.s_key[rows]
        reads[:, 7:7 + width] = a.s_off[rows]
        reads[:, 7 + width:] = a.s_size[rows]
        reads[:, 3] = a.s_nbytes[rows]
        mine = r_of[lo:hi]
        np.subtract(pb[lo:hi], pb[rb[:-1]][mine], out=reads[:, 5])  # counted from the rank's first
        np.subtract(bounds[lo:hi], bounds[rb[:-1]][mine], out=reads[:, 6])
        d0, d1 = int(pb[lo]), int(pb[hi])
        dels = np.empty((d1 - d0, nd), np.int64)
        sel = np.arange(d0, d1) if pairs is None else pairs[d0:d1]
        dels[:, 0] = p_rank[sel]
        dels[:, 1] = a.q_item[p_q[sel]]
        if own_boxes:
            boxes(sel, out=(dels[:, 2:2 + width], dels[:, 2 + width:]))
        reads_blocks.append(reads)
        dels_blocks.append(dels)
    out = ReadLayout()
    out.reads, out.dels, out.cuts = reads_blocks, dels_blocks, cuts
    out.rchunk, out.r_of, out.rb, out.pb, out.bounds = rchunk, r_of, rb, pb, bounds
    out.joint = rjoint if len(a.sp_heads) and rjoint.any() else None
    out.keys, out.dtypes, out.ndims = PackedNames.of(a.keys), PackedNames.of(a.dtypes), tuple(a.nd_key.tolist())
    out.incoming, out.bytes_read, out.needed = a.incoming.tolist(), a.bytes_read.tolist(), a.needed.tolist()
    return out


def _rank_cuts(rb: np.ndarray, ncols: int) -> list[int]:
    """Ranks at which a new block of rows starts (and the number of ranks last): whole ranks'
    rows, about BLOCK_BYTES of them per block (a rank with more rows has a block of its own)."""
    per = max(1, BLOCK_BYTES // (8 * ncols))
    block = rb[:-1] // per
    return [0, *(np.flatnonzero(block[1:] != block[:-1]) + 1).tolist(), len(rb) - 1]


def stored_plans(layout: ReadLayout, reads: list, s_file, s_boff, s_crc, s_bstart, block_arrays, files,
                 local_plans, values) -> list[RankLoadPlan]:
    """Every rank's plan from ``layout`` and the stored chunks' files, byte offsets and checksums
    (written into the blocks ``reads``: ``layout.reads`` or copies of them) and plain ``values``."""
    rchunk, rb, pb, bounds, cuts = layout.rchunk, layout.rb, layout.pb, layout.bounds, layout.cuts
    local, rank_files = _rank_files(np.take(s_file, rchunk), layout.r_of, rb, files)
    for block, r0, r1 in zip(reads, cuts[:-1], cuts[1:]):
        lo, hi = int(rb[r0]), int(rb[r1])
        rows = rchunk[lo:hi]
        block[:, 1], block[:, 2], block[:, 4] = local[lo:hi], s_boff[rows], s_crc[rows]
    del local
    values_all = np.zeros(0, np.uint32)
    total = int(bounds[-1])
    if total:
        bl = np.diff(bounds)
        everything = np.concatenate(block_arrays).astype(np.uint32, copy=False)
        values_all = everything[np.repeat(s_bstart[rchunk] - bounds[:-1], bl) + np.arange(total)]
    joint, keys, dtypes, ndims = layout.joint, layout.keys, layout.dtypes, layout.ndims
    rbl = rb.tolist()
    pbl = pb[rb].tolist()  # each rank's first and last delivery
    bbl = bounds[rb].tolist()  # and block checksum
    incoming, bytes_read, needed = layout.incoming, layout.bytes_read, layout.needed
    plans = []
    for rows, dels, r0, r1 in zip(reads, layout.dels, cuts[:-1], cuts[1:]):
        at, dat = rbl[r0], pbl[r0]  # the block's first read and delivery
        for r in range(r0, r1):
            lp = local_plans[r]
            lo, hi = rbl[r], rbl[r + 1]
            blocks = values_all[bbl[r]:bbl[r + 1]] if bbl[r + 1] > bbl[r] else None
            table = ReadTable.of_rows(rows[lo - at:hi - at], dels[pbl[r] - dat:pbl[r + 1] - dat], blocks,
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
