"""Which chunks on the load planner's line each request overlaps (:mod:`.load_arrays`).

The chunks of every tensor split along one dimension lie on one line, key after key, sorted and
disjoint; a request is a range [lo, hi) on it. Its chunks are those from the first that ends past
lo to the last that starts before hi: two binary searches over the line (:func:`line_search`),
or, where every key's chunks are even (``torch.chunk``'s and DTensor's row shards), a division
(:func:`even_search`).
"""
from __future__ import annotations

import numpy as np


def line_search(line_start, line_end, lo, hi, end: int):
    """Per request [lo, hi) on the line: the first chunk that ends past lo, and the number of
    chunks that start before hi (two binary searches over the line)."""
    if end < 1 << 31:  # the binary searches on half the memory
        line_end, line_start, lo, hi = (x.astype(np.int32) for x in (line_end, line_start, lo, hi))
    # searched in the order of the line: requests come rank after rank, each rank's key after key,
    # so in that order each search starts near the last one (in cache) instead of anywhere
    qorder = np.argsort(lo, kind="stable") if len(lo) > 1 and (lo[1:] < lo[:-1]).any() else None
    if qorder is not None:
        lo, hi = lo[qorder], hi[qorder]
    first = np.searchsorted(line_end, lo, side="right")
    n_c = np.searchsorted(line_start, hi, side="left")
    if qorder is not None:  # back in request order
        found, first, n_c = (first, n_c), np.empty_like(first), np.empty_like(n_c)
        first[qorder], n_c[qorder] = found
    return first, n_c


def even_search(a, on_line, line_start, line_end, base, span, k1, lo, hi):
    """What :func:`line_search` finds, by arithmetic, where every key's chunks on the line are even:
    chunk j of a key starts at j times the first one's length and is that long, the last one
    maybe shorter (``torch.chunk``'s and DTensor's row shards). None where some key's are not."""
    nkeys, n = a.nkeys, len(line_start)
    if not n or not nkeys:
        return None
    if a.line_all:  # the line is the chunks in key order: key k's are line[cstart[k]:cstart[k + 1]]
        at = a.cstart
        per_key = np.diff(at)
    else:
        per_key = np.bincount(a.s_key[on_line], minlength=nkeys)
        at = np.zeros(nkeys + 1, np.int64)  # key k's chunks are line[at[k]:at[k + 1]]
        np.cumsum(per_key, out=at[1:])
    has = per_key > 0
    width = np.ones(nkeys, np.int64)
    width[has] = line_end[at[:-1][has]] - line_start[at[:-1][has]]
    # chunk i of key k must start at base + (i - at[k]) * width and end at min(that + width, base + span)
    expect = np.arange(n, dtype=np.int64)
    expect -= np.repeat(at[:-1], per_key)
    expect *= np.repeat(width, per_key)
    expect += np.repeat(base, per_key)
    if not np.array_equal(expect, line_start):
        return None
    expect += np.repeat(width, per_key)
    np.minimum(expect, np.repeat(base + span, per_key), out=expect)
    if not np.array_equal(expect, line_end):
        return None
    if (line_end[at[1:][has] - 1] != (base + span)[has]).any():  # the last chunk ends at the key's end
        return None
    b, w, cnt = base[k1], width[k1], per_key[k1]
    first = lo - b
    first //= w  # chunks that end at or before lo: all of them where lo is the key's end
    np.minimum(first, cnt, out=first)
    past = np.flatnonzero(lo >= b + span[k1])
    first[past] = cnt[past]
    n_c = hi - b
    n_c += w
    n_c -= 1
    n_c //= w  # chunks that start before hi
    np.minimum(n_c, cnt, out=n_c)
    start = at[:-1][k1]
    first += start
    n_c += start
    return first, n_c
