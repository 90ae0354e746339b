"""The last phase of the load planner's array path (:mod:`.load_arrays`): every rank's
:class:`RankLoadPlan`, its reads as one :class:`ReadTable` of columns sliced from the reads of all
ranks."""
from __future__ import annotations

import numpy as np

from ..metadata import ChunkTable
from .arrays import take_rows
from .types import PackedNames, RankLoadPlan, ReadTable, StoredChunks


def read_tables(a) -> list[RankLoadPlan]:
    """Every rank's :class:`RankLoadPlan`: its reads as one :class:`ReadTable` (columns sliced
    from the reads of all ranks), what it receives, its plain values and byte counts. ``a``: the
    columns of the planner's earlier phases (:class:`.load_arrays._Arrays`)."""
    block_arrays, boxes, bytes_read, cstart, dtypes = a.block_arrays, a.boxes, a.bytes_read, a.cstart, a.dtypes
    files, = a.files,
    incoming, keys, local_plans, nd_key, needed = a.incoming, a.keys, a.local_plans, a.nd_key, a.needed
    nreads, = a.nreads,
    p_q, p_rank, pairs, pb, q_item, rb = a.p_q, a.p_rank, a.pairs, a.pb, a.q_item, a.rb
    rchunk, rjoint, s_blen, s_boff, s_bstart, s_crc = a.rchunk, a.rjoint, a.s_blen, a.s_boff, a.s_bstart, a.s_crc
    s_file, s_key, s_nbytes, s_off, s_size, sp_heads = a.s_file, a.s_key, a.s_nbytes, a.s_off, a.s_size, a.sp_heads
    stored, tables, values, whole = a.stored, a.tables, a.values, a.whole
    d_lo, d_sz = (None, None) if whole else boxes(pairs)
    if whole and pairs is None and a.p_key is not None:  # read i is pair i, its part the whole chunk:
        key, (off, size) = a.p_key, boxes(None)  # key and box from the requests' columns, in order
    else:
        key, off, size = s_key[rchunk], take_rows(s_off, rchunk), take_rows(s_size, rchunk)
    cols = {"key": key, "offsets": off, "sizes": size,
            "nbytes": s_nbytes[rchunk], "d_rank": p_rank if pairs is None else p_rank[pairs],
            "d_item": q_item[p_q if pairs is None else p_q[pairs]], "d_offsets": d_lo, "d_sizes": d_sz,
            "joint": rjoint if len(sp_heads) and rjoint.any() else None}
    if stored:
        bounds = np.zeros(nreads + 1, np.int64)
        total = 0
        if s_blen.any():  # some chunk has block checksums (none has where every chunk is small)
            bl = s_blen[rchunk]
            np.cumsum(bl, out=bounds[1:])
            total = int(bounds[-1])
        values_all = np.zeros(0, np.uint32)
        if total:
            everything = np.concatenate(block_arrays).astype(np.uint32, copy=False)
            values_all = everything[np.repeat(s_bstart[rchunk] - bounds[:-1], bl) + np.arange(total)]
        cols.update({"file": s_file[rchunk], "byte_offset": s_boff[rchunk], "checksum": s_crc[rchunk],
                     "block_values": values_all, "block_bounds": bounds})
    else:
        objs = [tables[k][c - cstart[k]] if not isinstance(tables[k], ChunkTable) else
                StoredChunks(keys[k], dtypes[k], tables[k])[c - cstart[k]]
                for c, k in zip(rchunk.tolist(), s_key[rchunk].tolist())]
    # every rank's table names all the keys and files: one packed copy shared by them, so that a
    # rank's plan travels with a bytes object for each list, not a string per key and per file
    keys, dtypes, files = PackedNames.of(keys), PackedNames.of(dtypes), PackedNames.of(files)
    per_read = [(n, x) for n, x in cols.items() if not n.startswith(("d_", "block_")) and x is not None]
    per_delivery = [(n, x) for n, x in cols.items() if n.startswith("d_") and x is not None]
    rbl = rb.tolist()
    pbl = pb[rb].tolist()  # each rank's first and last delivery
    bbl = cols["block_bounds"][rb].tolist() if stored else None  # and block checksum
    incoming, bytes_read, needed = incoming.tolist(), bytes_read.tolist(), needed.tolist()
    plans = []
    for r, lp in enumerate(local_plans):
        a, b = rbl[r], rbl[r + 1]
        pa, pz = pbl[r], pbl[r + 1]
        fields = {name: x[a:b] for name, x in per_read}
        for name, x in per_delivery:
            fields[name] = x[pa:pz]
        if stored:
            fields["block_values"] = cols["block_values"][bbl[r]:bbl[r + 1]]
            fields["block_bounds"] = cols["block_bounds"][a:b + 1] - bbl[r]
        else:
            fields["sources"] = objs[a:b]
        reads = ReadTable(keys=keys, dtypes=dtypes, ndims=nd_key, files=files, delivery_bounds=pb[a:b + 1] - pa,
                          **fields)
        plans.append(RankLoadPlan(rank=lp.rank, reads=reads, incoming=incoming[r],
                                  values={k: values[k] for k in lp.values if k in values},
                                  bytes_read=bytes_read[r], bytes_needed=needed[r]))
    return plans
