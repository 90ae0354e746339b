"""The array path of :func:`raydcp.planner.plan_load`: every chunk and request as columns.

The chunks a request overlaps are found by a binary search where a tensor's chunks are split
along one dimension, box by box otherwise; readers are assigned on arrays, and a rank's reads
come out as a :class:`ReadTable`. Joint reads (a large chunk read part by part by the ranks
that need the parts) are :mod:`.joint_reads`; the box-by-box search is :mod:`.chunk_index`.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..errors import CheckpointDamagedError
from ..metadata import ChunkTable
from .arrays import dim_range, rows_all, rows_prod, stack_items, take_cells, take_rows
from .boxes import byte_runs, merge_runs
from .chunk_index import general_pairs
from .joint_reads import split_large_chunks
from .line_search import even_search, line_search
from .load_tiling import check_line_tiling
from .read_tables import read_tables, stored_plans
from .sources import StoredSources, columns_arrays, shared_columns, table_arrays
from .types import RankLoadPlan, StoredChunks


def shown_keys(keys: list[str], limit: int = 20) -> str:
    """``keys`` for an error message: the first ``limit`` of them, and how many more there are."""
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def plan_load_columns(sources, local_plans, values, itemsizes, joint_reads: bool = True,
                       tiles=None, cache=None) -> list[RankLoadPlan] | None:
    """The array path of :func:`raydcp.planner.plan_load`, or None where the general path must decide.

    Phases, each a function over the shared columns (:class:`_Arrays`): the source chunks
    (:func:`_source_arrays`) and the requests (:func:`_request_arrays`) as arrays; the pairs of
    request and chunk that overlap (:func:`_overlapping_pairs`) and the part each delivers
    (:func:`_needed_parts`, which checks the parts cover every request exactly); one reader per
    needed chunk (:func:`_assign_readers`); each rank's reads in order (:func:`_order_reads`);
    and the per-rank plans (:func:`.read_tables.read_tables`). ``tiles``: the ``TensorMetas`` of a decoded
    checkpoint whose chunks ``sources`` are (a ``StoredSources`` over it), checked to tile their
    tensors on the line the overlap search lays out (:mod:`.load_tiling`). ``cache``: a
    :class:`~raydcp.planner.PlanCache`; where ``sources`` are a decoded checkpoint's chunks, the
    plan is kept in it, and a plan of the same requests over chunks in the same places reuses it.
    """
    world = len(local_plans)
    lcols = [getattr(lp, "columns", None) for lp in local_plans]
    if any(c is None for c in lcols):
        return None
    key = None
    if cache is not None and isinstance(sources, StoredSources) and tiles is not None \
            and not sources.tensors.columns.compressed:  # compressed pieces are read whole, apart
        key = cache.load_key(local_plans, joint_reads)
        layout = None if key is None else cache.loaded(key, sources.tensors)
        if layout is not None:
            return _reused_plans(layout, sources, local_plans, values)
    keys = list(sources)
    nkeys = len(keys)
    kid = {key: i for i, key in enumerate(keys)}

    a = _Arrays(sources=sources, local_plans=local_plans, values=values, itemsizes=itemsizes, world=world,
                lcols=lcols, keys=keys, nkeys=nkeys, kid=kid, joint_reads=joint_reads)
    if not (_source_arrays(a) and _request_arrays(a)):
        return None
    _overlapping_pairs(a)
    if tiles is not None:
        check_line_tiling(a, tiles)
    _needed_parts(a)
    _assign_readers(a)
    _order_reads(a)
    plans = read_tables(a)
    if key is not None:
        cache.keep_load(key, sources.tensors, a.read_layout)
    return plans


def _reused_plans(layout, sources: StoredSources, local_plans, values) -> list[RankLoadPlan]:
    """The plans of a load whose requests and chunk places are those ``layout`` was made for:
    the files, byte offsets and checksums taken from ``sources`` (the reads' other columns and
    the deliveries as they were; the previous plans' rows are left as they are)."""
    cols = sources.tensors.columns
    counts = np.diff(cols.rows)
    cstart = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=cstart[1:])
    width = (layout.reads[0].shape[1] - 7) // 2
    *_, files, s_file, s_boff, s_crc, s_bstart, _, block_arrays = columns_arrays(cols, counts, cstart, width)
    return stored_plans(layout, [b.copy() for b in layout.reads], s_file, s_boff, s_crc, s_bstart, block_arrays,
                        files, local_plans, values)


class _Arrays(SimpleNamespace):
    """The columns the phases of :func:`plan_load_columns` share: each phase reads the names it
    needs and adds those it makes (``s_*``: source chunks, ``q_*``: requests, ``p_*``: pairs of
    request and chunk, ``sp_*``: the chunks several ranks need, grouped)."""


def _source_arrays(a: _Arrays) -> bool:
    """The source chunks, every key's in one set of arrays: decoded metadata's columns taken
    whole, other sources (tables of several metadata, live pieces) copied table by table. Also
    the common width of the boxes, each chunk's key and each key's item size. False where the
    general path must decide (live pieces of mixed dimensions, tables it cannot take)."""
    itemsizes, keys, lcols, nkeys, sources = a.itemsizes, a.keys, a.lcols, a.nkeys, a.sources
    tables: list | None = None  # per key: a ChunkTable (stored) or a list of SourceChunk
    stored = True
    if isinstance(sources, StoredSources):  # decoded metadata: its columns, as they are
        shared = sources.tensors.columns
        counts = np.diff(shared.rows)
        nd_key = np.array(shared.ndim, np.int64)
        dtypes = list(sources.tensors.dtypes)
    else:
        counts = np.array([len(sources[key]) for key in keys], np.int64)
        nd_key = np.full(nkeys, -1, np.int64)
        dtypes = []
        tables = []
        for i, key in enumerate(keys):
            src = sources[key]
            if isinstance(src, StoredChunks):
                tables.append(src.table)
                dtypes.append(src.dtype)
                nd_key[i] = src.table.offsets.shape[1]
            else:
                objs = list(src)
                stored = False
                tables.append(objs)
                dtypes.append(objs[0].dtype if objs else "")
                nds = {len(c.offsets) for c in objs} | {len(c.sizes) for c in objs}
                if len(nds) > 1:
                    return False
                if objs:
                    nd_key[i] = nds.pop()
        shared = shared_columns(tables, nd_key) if stored and nkeys else None
    nchunks = int(counts.sum())
    cstart = np.zeros(nkeys + 1, np.int64)
    np.cumsum(counts, out=cstart[1:])
    width = max([1, int(nd_key.max()) if nkeys else 1, *(c.offsets.shape[1] for c in lcols)])
    if shared is not None:  # every key's chunks are rows of one ChunkColumns: take its arrays whole
        s_off, s_size, s_nbytes, ext, files, s_file, s_boff, s_crc, s_bstart, s_blen, block_arrays = \
            columns_arrays(shared, counts, cstart, width)
    else:
        s_off, s_size, s_nbytes, ext, files, s_file, s_boff, s_crc, s_bstart, s_blen, block_arrays = \
            table_arrays(tables, stored, counts, cstart, nd_key, width)
        if s_off is None:
            return False
    s_key = np.repeat(np.arange(nkeys), counts)
    isz = np.array([itemsizes[key] for key in keys], np.int64)
    a.block_arrays, a.cstart, a.dtypes, a.ext, a.files, a.isz = block_arrays, cstart, dtypes, ext, files, isz
    a.nchunks, a.nd_key, a.s_blen, a.s_boff, a.s_bstart, a.s_crc = nchunks, nd_key, s_blen, s_boff, s_bstart, s_crc
    a.s_file, a.s_key, a.s_nbytes, a.s_off, a.s_size, a.stored = s_file, s_key, s_nbytes, s_off, s_size, stored
    a.tables, a.width = tables, width
    return True


def _request_arrays(a: _Arrays) -> bool:
    """The requests of every rank, concatenated: key, box, rank, index in the rank's plan and
    element count. False where a request disagrees with its key's dimensions or is malformed."""
    kid, lcols, nd_key, width, world = a.kid, a.lcols, a.nd_key, a.width, a.world
    q_key, q_off, q_size, q_nd, qstart = stack_items(lcols, kid, width)
    nq = len(q_key)
    qcount = np.diff(qstart)
    q_rank = np.repeat(np.arange(world), qcount)
    q_item = np.arange(nq) - qstart[:-1][q_rank]
    known = q_key >= 0
    kk = q_key[known]
    if ((q_nd[known] != nd_key[kk]) & (nd_key[kk] >= 0)).any() or (q_nd < 0).any() or (q_size < 0).any():
        return False
    q_numel = rows_prod(q_size)
    a.kk, a.known, a.nq, a.q_item, a.q_key, a.q_numel = kk, known, nq, q_item, q_key, q_numel
    a.q_off, a.q_rank, a.q_size = q_off, q_rank, q_size
    return True


def _overlapping_pairs(a: _Arrays) -> None:
    """Which chunks each request overlaps, as (request, chunk) pairs ``p_q``, ``p_c``.

    Keys whose chunks are split along one dimension (the usual case) are laid on one line, key
    after key, and found by two binary searches per request; the others ("general": chunks split
    along several dimensions, or overlapping on the line) box by box (:func:`general_pairs`)."""
    cstart, ext, kk, known, nchunks, nkeys = a.cstart, a.ext, a.kk, a.known, a.nchunks, a.nkeys
    nq, q_key, q_off, q_size, s_key, s_off = a.nq, a.q_key, a.q_off, a.q_size, a.s_key, a.s_off
    s_size, width = a.s_size, a.width
    c_live = np.ones(nchunks, bool)
    nfull = np.zeros(nchunks, np.int8)
    not_full = np.full(nchunks, -1, np.int8)
    e, b1, b2 = np.empty(nchunks, np.int64), np.empty(nchunks, bool), np.empty(nchunks, bool)
    counts = np.diff(cstart)  # the chunks come key after key: per-key values spread by repeating
    for j in range(width):
        e[:] = np.repeat(ext[:, j], counts)
        c_live &= np.greater(s_size[:, j], 0, out=b1)
        np.equal(s_off[:, j], 0, out=b1)
        b1 &= np.equal(s_size[:, j], e, out=b2)
        nfull += b1
        np.less(not_full, 0, out=b2)
        b2 &= ~b1
        not_full[b2] = j
    del e, b1, b2
    piece_dim = np.where(nfull == width, width, np.where(nfull == width - 1, not_full, -1))
    piece_dim[~c_live] = width
    dmin, dmax = dim_range(s_key, piece_dim, nkeys, width)
    general = (dmin < 0) | ((dmax >= 0) & (dmax != dmin))
    key_dim = np.where(dmin >= width, 0, np.maximum(dmin, 0))
    span = ext[np.arange(nkeys), key_dim]
    base = np.zeros(nkeys, np.int64)
    np.cumsum(span[:-1] + 1, out=base[1:])
    # chunks of one-dimensional keys on one line, key after key; they must not overlap
    on_key = c_live & ~general[s_key]
    line_all = bool(on_key.all())  # every chunk on the line, in chunk order (so far)
    d_one = int(key_dim[0]) if nkeys and (key_dim == key_dim[0]).all() else None
    if line_all and d_one is not None:  # the usual case: columns, no gathers
        on_line = np.arange(nchunks)
        line_start = np.repeat(base, counts)
        line_start += s_off[:, d_one]
        line_len = s_size[:, d_one]
    else:
        on_line = np.flatnonzero(on_key)
        d_of = key_dim[s_key[on_line]]
        line_start = base[s_key[on_line]] + take_cells(s_off, on_line, d_of)
        line_len = take_cells(s_size, on_line, d_of)
        del d_of
    del on_key
    if len(line_start) and (line_start[1:] < line_start[:-1]).any():  # stored chunks usually come sorted
        order = np.argsort(line_start, kind="stable")
        on_line, line_start, line_len = on_line[order], line_start[order], line_len[order]
        line_all = False
    line_end = line_start + line_len
    del line_len
    clash = np.flatnonzero(line_end[:-1] > line_start[1:])
    if len(clash):
        general[s_key[on_line[clash]]] = True
        keep = ~general[s_key[on_line]]
        on_line, line_start, line_end = on_line[keep], line_start[keep], line_end[keep]
        line_all = False

    a.base, a.c_live, a.general, a.key_dim = base, c_live, general, key_dim
    a.line_all, a.line_end, a.line_start, a.on_line = line_all, line_end, line_start, on_line
    q_live = known & rows_all(q_size > 0)
    q_general = np.zeros(nq, bool)
    q_general[known] = general[kk]
    q1 = np.flatnonzero(q_live & ~q_general)
    k1 = q_key[q1]
    d1 = key_dim[k1]
    all_q1 = len(q1) == nq  # every request on the line: its columns are views, not gathers
    d0 = int(d1[0]) if len(d1) and d1.min() == d1.max() else None  # the one split dimension, if one
    if d0 is not None:  # split along the same dimension everywhere (rows, say)
        q1_off, q1_size = q_off[:, d0], q_size[:, d0]
        if not all_q1:
            q1_off, q1_size = q1_off[q1], q1_size[q1]
    else:
        q1_off, q1_size = take_cells(q_off, q1, d1), take_cells(q_size, q1, d1)
    sk, bk = span[k1], base[k1]
    lo = np.clip(q1_off, 0, sk)
    lo += bk
    hi = np.add(q1_off, q1_size)
    np.clip(hi, 0, sk, out=hi)
    hi += bk
    del sk, bk
    found = even_search(a, on_line, line_start, line_end, base, span, k1, lo, hi)
    if found is not None:
        first, n_c = found
    else:
        first, n_c = line_search(line_start, line_end, lo, hi, int(base[-1] + span[-1]) if nkeys else 0)
    del lo, hi
    n_c -= first
    np.maximum(n_c, 0, out=n_c)
    p_q = np.repeat(q1, n_c)
    # pair j of request i is chunk first[i] + j on the line
    shift = np.cumsum(n_c)
    shift -= n_c
    np.subtract(first, shift, out=shift)
    del first
    p_c = np.repeat(shift, n_c)
    del shift
    p_c += np.arange(len(p_c))
    if not line_all:
        p_c = on_line[p_c]
    gen_q = np.flatnonzero(q_live & q_general)
    if len(gen_q):
        gq, gc = general_pairs(gen_q, q_key, q_off, q_size, s_off, s_size, cstart, c_live)
        p_q, p_c = np.concatenate([p_q, gq]), np.concatenate([p_c, gc])
    a.all_q1, a.d0, a.d1, a.gen_q, a.k1, a.n_c = all_q1, d0, d1, gen_q, k1, n_c
    a.p_c, a.p_q, a.q1, a.q1_off, a.q1_size = p_c, p_q, q1, q1_off, q1_size


def _needed_parts(a: _Arrays) -> None:
    """The part of its chunk each pair delivers (``boxes``), its element and byte counts; and
    the check that the parts cover every request exactly (a CheckpointError naming the keys).
    ``whole`` where every part is its whole chunk (deliveries then need no boxes of their own)."""
    all_q1, d0, d1, ext, gen_q, isz = a.all_q1, a.d0, a.d1, a.ext, a.gen_q, a.isz
    k1, keys, known, n_c, nq, p_c = a.k1, a.keys, a.known, a.n_c, a.nq, a.p_c
    p_q, q1, q1_off, q1_size, q_key, q_numel = a.p_q, a.q1, a.q1_off, a.q1_size, a.q_key, a.q_numel
    q_off, q_rank, q_size, s_key, s_off, s_size = a.q_off, a.q_rank, a.q_size, a.s_key, a.s_off, a.s_size
    width, = a.width,
    other_ok = np.ones(len(q1), bool)
    other_full = np.ones(len(q1), bool)
    ext_e, t = np.empty(len(q1), np.int64), np.empty(len(q1), np.int64)
    b1, b2, d_is_e = np.empty(len(q1), bool), np.empty(len(q1), bool), np.empty(len(q1), bool)
    for e in range(width):
        if e == d0:
            continue  # the split dimension of every request
        qe_lo, qe_n = (q_off[:, e], q_size[:, e]) if all_q1 else (q_off[:, e][q1], q_size[:, e][q1])
        np.take(ext[:, e], k1, out=ext_e)
        np.equal(d1, e, out=d_is_e)
        np.greater_equal(qe_lo, 0, out=b1)
        b1 &= np.less_equal(np.add(qe_lo, qe_n, out=t), ext_e, out=b2)
        b1 |= d_is_e
        other_ok &= b1
        np.equal(qe_lo, 0, out=b1)
        b1 &= np.equal(qe_n, ext_e, out=b2)
        b1 |= d_is_e
        other_full &= b1
    del ext_e, t, b1, b2, d_is_e
    whole = False  # every part is its whole chunk: deliveries then need no boxes of their own
    if not len(gen_q) and other_ok.all():
        p_d = np.repeat(d1, n_c)
        if a.line_all:  # the chunks' spans from the line (pair j's chunk p_c[j] is line[p_c[j]])
            bk = np.repeat(a.base[k1], n_c)
            c_lo, c_hi = np.take(a.line_start, p_c), np.take(a.line_end, p_c)
            c_lo -= bk
            c_hi -= bk
            del bk
        else:
            if d0 is not None:
                c_lo, c_hi = np.take(s_off[:, d0], p_c), np.take(s_size[:, d0], p_c)
            else:
                c_lo, c_hi = take_cells(s_off, p_c, p_d), take_cells(s_size, p_c, p_d)
            c_hi += c_lo
        q_lo = np.repeat(q1_off, n_c)
        q_hi = np.repeat(q1_size, n_c)
        q_hi += q_lo
        whole = bool(other_full.all() and (q_lo <= c_lo).all() and (q_hi >= c_hi).all())
        lo_d = np.maximum(q_lo, c_lo, out=q_lo)
        sz_d = np.minimum(q_hi, c_hi, out=q_hi)
        sz_d -= lo_d
        del c_lo, c_hi, q_lo, q_hi
        p_numel = np.repeat(q_numel[q1] // q1_size, n_c)
        p_numel *= sz_d
        # a part that spans its chunk in every other dimension is an interval of it on the line
        line_part = (lo_d, sz_d, np.repeat(other_full, n_c))
        p_key = np.repeat(k1, n_c)  # pair j's chunk is of its request's key
        p_bytes = isz[p_key]
        p_bytes *= p_numel

        def boxes(sel, out=None):
            rows = p_q if sel is None else p_q[sel]
            if out is None:
                lo, sz = take_rows(q_off, rows), take_rows(q_size, rows)
            else:  # into the caller's arrays (columns of a matrix, say)
                lo, sz = out
                lo[:], sz[:] = q_off[rows], q_size[rows]
            at = np.arange(len(rows))
            d = p_d if sel is None else p_d[sel]
            lo[at, d] = lo_d if sel is None else lo_d[sel]
            sz[at, d] = sz_d if sel is None else sz_d[sel]
            return lo, sz
    else:
        qo, co = take_rows(q_off, p_q), take_rows(s_off, p_c)
        box_lo = np.maximum(qo, co)
        box_sz = np.minimum(qo + take_rows(q_size, p_q), co + take_rows(s_size, p_c)) - box_lo
        del qo, co
        ok = rows_all(box_sz > 0)
        if not ok.all():
            keep = np.flatnonzero(ok)
            p_q, p_c, box_lo, box_sz = p_q[keep], p_c[keep], take_rows(box_lo, keep), take_rows(box_sz, keep)
        p_numel = rows_prod(box_sz)
        p_key = None
        line_part = None
        p_bytes = p_numel * isz[s_key[p_c]]

        def boxes(sel, out=None):
            lo, sz = (box_lo, box_sz) if sel is None else (take_rows(box_lo, sel), take_rows(box_sz, sel))
            if out is not None:
                out[0][:], out[1][:] = lo, sz
                return out
            return lo, sz
    covered = np.bincount(p_q, weights=p_numel, minlength=nq) if len(p_q) else np.zeros(nq)
    gaps = known & (covered != q_numel)
    if gaps.any():
        names = sorted({keys[k] for k in q_key[gaps].tolist()})
        raise CheckpointDamagedError(
            f"the stored pieces of {shown_keys(names)} do not cover the tensor exactly (a gap or an overlap); "
            f"the checkpoint is damaged: run `raydcp verify` on it and restore it from another copy")
    p_rank = q_rank[p_q]
    a.boxes, a.p_bytes, a.p_c, a.p_numel, a.p_q, a.p_rank = boxes, p_bytes, p_c, p_numel, p_q, p_rank
    a.p_key, a.whole, a.line_part = p_key, whole, line_part


def _assign_readers(a: _Arrays) -> None:
    """One reader per needed chunk, and the bytes each rank reads, needs and receives.

    A chunk one request needs (the common case) is read by the rank that needs it; the others
    ("special": several deliveries, or a live chunk) are grouped by chunk, large stored chunks
    needed in disjoint parts are split into joint reads (:func:`split_large_chunks`), a group
    whose deliveries are all one rank's is read by that rank, and the rest are assigned on
    arrays (:func:`_shared_readers`); a live chunk goes to its least loaded holder."""
    boxes, cstart, isz, nchunks, p_bytes = a.boxes, a.cstart, a.isz, a.nchunks, a.p_bytes
    p_c, p_rank, s_key, s_nbytes, s_off = a.p_c, a.p_rank, a.s_key, a.s_nbytes, a.s_off
    s_size, stored, tables, world = a.s_size, a.stored, a.tables, a.world
    npairs = len(p_c)
    ccount = np.bincount(p_c, minlength=nchunks) if npairs else np.zeros(nchunks, np.int64)
    special = ccount[p_c] > 1 if npairs and ccount.max() > 1 else np.zeros(npairs, bool)  # usually: each once
    live_chunk = np.zeros(nchunks, bool)
    holders_of: dict[int, tuple] = {}
    if not stored:
        for c in np.unique(p_c).tolist():
            k = int(s_key[c])
            t = tables[k]
            if not isinstance(t, ChunkTable) and t[c - cstart[k]].holders is not None:
                live_chunk[c] = True
                holders_of[c] = t[c - cstart[k]].holders
        special |= live_chunk[p_c]
    all_single = not special.any()  # the common case: no gathers of the pairs below
    single = None if all_single else np.flatnonzero(~special)
    needed = np.bincount(p_rank, weights=p_bytes, minlength=world).astype(np.int64) if npairs else \
        np.zeros(world, np.int64)
    load = needed.copy() if all_single else \
        np.bincount(p_rank[single], weights=p_bytes[single], minlength=world).astype(np.int64)
    incoming = np.zeros(world, np.int64)
    sp = np.flatnonzero(special)
    sp = sp[np.argsort(p_c[sp], kind="stable")]
    sp_heads = np.flatnonzero(np.r_[True, p_c[sp][1:] != p_c[sp][:-1]]) if len(sp) else np.zeros(0, np.int64)
    sp_chunk = p_c[sp][sp_heads]
    sp_count = np.diff(np.append(sp_heads, len(sp)))
    sp_joint = np.zeros(len(sp_heads), bool)
    if len(sp_heads) and a.joint_reads:
        sp, sp_heads, sp_chunk, sp_count, sp_joint = split_large_chunks(
            sp, sp_heads, sp_chunk, sp_count, p_rank, s_nbytes, live_chunk, boxes, s_off, s_size, s_key, a.nd_key,
            isz)
    sp_reader = np.full(len(sp_heads), -1, np.int64)
    if len(sp_heads):
        sp_nread = _group_bytes(a, sp, sp_heads, sp_count)
        ranks = p_rank[sp]
        one_rank = np.minimum.reduceat(ranks, sp_heads) == np.maximum.reduceat(ranks, sp_heads)
        live = live_chunk[sp_chunk]
        own = one_rank & ~live
        sp_reader[own] = ranks[sp_heads[own]]
        shared = np.flatnonzero(~own & ~live)
        if len(shared):  # frozen loads: the single-rank reads and the groups one rank needs
            base = load + np.bincount(sp_reader[own], weights=sp_nread[own], minlength=world).astype(np.int64)
            sp_reader[shared] = _shared_readers(a, sp, sp_heads, sp_count, shared, base)
        done = sp_reader >= 0
        load += np.bincount(sp_reader[done], weights=sp_nread[done], minlength=world).astype(np.int64)
        if live.any():  # live chunks (a transfer): largest first, each to its least loaded holder
            lload = load.tolist()
            todo = np.flatnonzero(live)
            for j in sorted(todo.tolist(), key=lambda j: (-int(s_nbytes[sp_chunk[j]]), int(sp[sp_heads[j]]))):
                r = min(holders_of[int(sp_chunk[j])], key=lambda x: (lload[x], x))
                sp_reader[j] = r
                lload[r] += int(sp_nread[j])
            load = np.array(lload, np.int64)
        sp_pair_reader = np.repeat(sp_reader, sp_count)
        np.add.at(incoming, p_rank[sp][p_rank[sp] != sp_pair_reader], 1)
    bytes_read = load
    a.all_single, a.bytes_read, a.incoming, a.needed, a.npairs = all_single, bytes_read, incoming, needed, npairs
    a.single, = single,
    a.sp, a.sp_chunk, a.sp_count, a.sp_heads, a.sp_joint = sp, sp_chunk, sp_count, sp_heads, sp_joint
    a.sp_reader, = sp_reader,


def _group_bytes(a: _Arrays, sp, sp_heads, sp_count) -> np.ndarray:
    """The bytes each group of pairs reads of its chunk: those of the union of its parts.

    Parts that span their chunk in every dimension but the split one (the usual case) are
    intervals on it: their union is measured on arrays (sorted by start, each part adding what
    it reaches past the ones before it). Other groups are measured part by part in byte runs."""
    isz, p_bytes, s_key, s_off, s_size = a.isz, a.p_bytes, a.s_key, a.s_off, a.s_size
    ngroups = len(sp_heads)
    out = np.zeros(ngroups, np.int64)
    fast = np.zeros(ngroups, bool)
    g_of = np.repeat(np.arange(ngroups), sp_count)
    if a.line_part is not None:
        lo_d, sz_d, full = a.line_part
        ok = full[sp] & (sz_d[sp] > 0)
        fast = np.logical_and.reduceat(ok, sp_heads)
        rows = np.flatnonzero(fast[g_of])
        if len(rows):
            lo = lo_d[sp[rows]]
            hi = lo + sz_d[sp[rows]]
            span = int(hi.max()) + 1
            if span * ngroups < (1 << 62):  # every group on its own stretch of one line, in group order
                g = g_of[rows]
                lo += g * span
                hi += g * span
                order = np.lexsort((lo, g))
                lo, hi, g = lo[order], hi[order], g[order]
                reach = np.maximum.accumulate(hi)
                before = np.empty_like(reach)
                before[0] = lo[0]
                before[1:] = reach[:-1]
                added = hi - np.maximum(lo, before)
                np.maximum(added, 0, out=added)
                unit = p_bytes[sp[rows]] // sz_d[sp[rows]]  # bytes per unit of the split dimension
                out[:] = np.bincount(g, weights=added * unit[order], minlength=ngroups).astype(np.int64)
            else:
                fast[:] = False
    boxes, nd_key = a.boxes, a.nd_key
    for j in np.flatnonzero(~fast).tolist():
        grp = sp[sp_heads[j]:sp_heads[j] + sp_count[j]]
        c = int(a.p_c[grp[0]])
        k = int(s_key[c])
        nd = max(int(nd_key[k]), 0)
        co, cs = tuple(s_off[c, :nd].tolist()), tuple(s_size[c, :nd].tolist())
        glo, gsz = boxes(grp)
        parts = {(tuple(o[:nd]), tuple(z[:nd])) for o, z in zip(glo.tolist(), gsz.tolist())}
        if len(parts) == 1:
            out[j] = int(p_bytes[grp[0]])
        else:
            runs = merge_runs([r for o, z in parts for r in byte_runs(co, cs, o, z, int(isz[k]))])
            out[j] = sum(e - s for s, e in runs)
    return out


def _shared_readers(a: _Arrays, sp, sp_heads, sp_count, shared, base) -> np.ndarray:
    """The reader of each group in ``shared`` (stored chunks several ranks need): the needing
    rank for which (bytes ``base`` gives it - bytes of the chunk it needs) is least; among ranks
    that tie, the groups take them in turn (a chunk every rank needs whole, a replicated tensor,
    is spread over the ranks rather than all read by one)."""
    p_bytes, p_rank = a.p_bytes, a.p_rank
    cnt = sp_count[shared]
    pos = np.repeat(sp_heads[shared] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
    rows = sp[pos]
    g = np.repeat(np.arange(len(shared)), cnt)
    r = p_rank[rows]
    order = np.lexsort((r, g))  # one row per (group, rank): the bytes of the chunk the rank needs
    g, r, b = g[order], r[order], p_bytes[rows][order]
    head = np.flatnonzero(np.r_[True, (g[1:] != g[:-1]) | (r[1:] != r[:-1])])
    g, r, share = g[head], r[head], np.add.reduceat(b, head)
    cost = base[r] - share
    order = np.lexsort((r, cost, g))
    g, r, cost = g[order], r[order], cost[order]
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    best = cost[first]
    tied = np.add.reduceat((cost == np.repeat(best, np.diff(np.append(first, len(g))))).astype(np.int64), first)
    return r[first + np.arange(len(first)) % tied]


def _order_reads(a: _Arrays) -> None:
    """Each rank's reads in order: the chunks only it needs (in the order of its requests), then
    the special ones it reads (in chunk order); placed by counting, without sorting all the
    pairs. ``rb`` bounds each rank's reads, ``pb`` each read's deliveries (``pairs``)."""
    all_single, npairs, p_c, p_rank, single, sp = a.all_single, a.npairs, a.p_c, a.p_rank, a.single, a.sp
    sp_chunk, sp_count, sp_heads, sp_joint, sp_reader = a.sp_chunk, a.sp_count, a.sp_heads, a.sp_joint, a.sp_reader
    world, = a.world,
    rjoint = None  # per read, whether it is a joint one: where some chunk is read in parts
    sr = p_rank if all_single else p_rank[single]
    unsorted = bool(len(sr)) and bool((sr[1:] < sr[:-1]).any())
    in_order = not len(sp) and not unsorted
    if not in_order and single is None:
        single = np.arange(npairs)
    if unsorted:
        single = single[np.argsort(sr, kind="stable")]
        sr = p_rank[single]
    n_single = np.bincount(sr, minlength=world) if len(sr) else np.zeros(world, np.int64)
    sp_order = np.lexsort((sp_chunk, sp_reader)) if len(sp_heads) else np.zeros(0, np.int64)
    n_special = np.bincount(sp_reader, minlength=world) if len(sp_heads) else np.zeros(world, np.int64)
    rb = np.zeros(world + 1, np.int64)
    np.cumsum(n_single + n_special, out=rb[1:])
    nreads = int(rb[-1])
    single_start = np.zeros(world + 1, np.int64)
    np.cumsum(n_single, out=single_start[1:])
    pos_single = None if in_order else rb[:-1][sr] + np.arange(len(single)) - single_start[:-1][sr]
    dcount = np.ones(nreads, np.int64)
    if in_order:
        rchunk = p_c
    else:
        rchunk = np.empty(nreads, np.int64)
        rchunk[pos_single] = p_c[single]
    if len(sp_heads):
        rdr = sp_reader[sp_order]
        sp_start = np.zeros(world + 1, np.int64)
        np.cumsum(n_special, out=sp_start[1:])
        pos_sp = rb[:-1][rdr] + n_single[rdr] + np.arange(len(sp_order)) - sp_start[:-1][rdr]
        rchunk[pos_sp] = sp_chunk[sp_order]
        dcount[pos_sp] = sp_count[sp_order]
        rjoint = np.zeros(nreads, bool)
        rjoint[pos_sp] = sp_joint[sp_order]
    pb = np.zeros(nreads + 1, np.int64)
    np.cumsum(dcount, out=pb[1:])
    pairs = None if in_order else np.empty(npairs, np.int64)  # None: the pairs as they are
    if pairs is not None:
        pairs[pb[:-1][pos_single]] = single
    if len(sp_heads):
        cnt = sp_count[sp_order]
        first = np.repeat(pb[:-1][pos_sp] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
        src = np.repeat(sp_heads[sp_order] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
        pairs[first] = sp[src]

    a.nreads, a.pairs, a.pb, a.rb, a.rchunk, a.rjoint = nreads, pairs, pb, rb, rchunk, rjoint
