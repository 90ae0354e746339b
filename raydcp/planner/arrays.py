"""Array helpers shared by the save and load planners (numpy only; every one linear, or a sort)."""
from __future__ import annotations

import numpy as np


def dim_range(key: np.ndarray, piece_dim: np.ndarray, k: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key (0 .. k-1), the least and the greatest ``piece_dim`` below ``width`` of its pieces
    (``width`` and -1 where none). ``piece_dim`` takes few values (-1 .. width): one count of the
    (key, value) pairs does it, where ``np.minimum.at`` would take ten times as long."""
    m = width + 2
    code = key * m
    code += piece_dim
    code += 1
    seen = (np.bincount(code, minlength=k * m) > 0).reshape(k, m)[:, :m - 1]  # value ``width``: not split
    some = seen.any(axis=1)
    values = np.arange(-1, width, dtype=np.int64)
    dmin = np.where(some, values[np.argmax(seen, axis=1)], width)
    dmax = np.where(some, values[m - 2 - np.argmax(seen[:, ::-1], axis=1)], -1)
    return dmin, dmax


def rank_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per rank, the sum of ``values`` over its pieces ``starts[r]:starts[r + 1]`` (summed in place)."""
    np.cumsum(values, out=values)
    ends = np.zeros(len(starts), np.int64)
    some = starts > 0
    ends[some] = values[starts[some] - 1]
    return np.diff(ends)


def rows_all(m: np.ndarray) -> np.ndarray:
    out = m[:, 0].copy()
    for j in range(1, m.shape[1]):
        out &= m[:, j]
    return out


def rows_prod(m: np.ndarray) -> np.ndarray:
    out = m[:, 0].copy()
    for j in range(1, m.shape[1]):
        out *= m[:, j]
    return out


def stable_order(cols: list[np.ndarray]) -> np.ndarray:
    """Stable order by ``cols`` (the first the most significant) of integer arrays: one sort of a
    packed key where they are non-negative and fit in 63 bits together, ``np.lexsort`` otherwise.
    Pieces arrive rank after rank, each rank's in order, so the packed key is a few sorted runs
    for the stable sort to merge."""
    if not len(cols[0]):
        return np.zeros(0, np.int64)
    bits = [max(1, int(x.max()).bit_length()) for x in cols]
    if sum(bits) <= 63 and all(int(x.min()) >= 0 for x in cols):
        packed = cols[0].astype(np.int64)
        for x, nb in zip(cols[1:], bits[1:]):
            packed <<= nb
            packed |= x
        return np.argsort(packed, kind="stable")
    return np.lexsort(cols[::-1])


def sorted_runs(cols: list[np.ndarray], runs: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``order = stable_order(cols)`` and ``[c[order] for c in cols]``, where the rows may come as
    ``runs`` runs of one length that list the same distinct keys (``cols[0]``) in the same order:
    every rank's pieces of every tensor, rank after rank. The order by key is then the runs read
    column by column, with no sort; it is the order by all ``cols`` where each key's rows, so
    read, are already sorted by the other columns (checked; ``stable_order`` otherwise). Ties keep the
    runs' order, as the stable sort does: a key's rows are in one column, run after run."""
    key, n = cols[0], len(cols[0])
    if runs > 1 and n and n % runs == 0:
        m = n // runs
        grid = key.reshape(runs, m)
        row = grid[0]
        js = np.argsort(row, kind="stable")
        if (row[js][1:] > row[js][:-1]).all() and (grid == row).all():
            order = np.add.outer(js, np.arange(0, n, m)).reshape(-1)
            out = [np.repeat(row[js], runs)] + [np.take(c, order) for c in cols[1:]]
            tied = np.ones(n - 1, bool)  # rows i and i + 1 of one key, equal in the columns so far
            tied[runs - 1::runs] = False
            for c in out[1:]:
                if (tied & (c[1:] < c[:-1])).any():
                    break
                tied &= c[1:] == c[:-1]
            else:
                return order, out
    order = stable_order(cols)
    if n and (order[1:] - order[:-1] == 1).all():  # in order already (one rank's pieces): no copies
        return order, list(cols)
    return order, [np.take(c, order) for c in cols]


def take_rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]`` for a 2-D array (np.take copies whole rows, many times faster than fancy indexing)."""
    return np.take(a, rows, axis=0)


def take_cells(a: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``a[rows, cols]`` of a C-contiguous 2-D array, through its flat view."""
    return np.take(a.reshape(-1), rows * a.shape[1] + cols)


def stack_items(cols: list, kid: dict[str, int], width: int) -> tuple[np.ndarray, ...]:
    """Every rank's items (``ItemColumns``) in one set of arrays, allocated once: ``(key, offsets,
    sizes, ndim, starts)``. ``key`` is the global key id (-1 for a key not in ``kid``); boxes of
    fewer than ``width`` dimensions are padded with offset 0, size 1; rank r's items are rows
    ``starts[r]:starts[r + 1]``. Ranks that describe the same keys share one key map (by digest)."""
    counts = np.array([len(c.key) for c in cols], np.int64)
    n = int(counts.sum())
    starts = np.zeros(len(cols) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    digests = {c.keys_digest for c in cols}
    if n and len(digests) == 1 and all(c.offsets.shape[1] == width for c in cols):
        # the usual plans: every rank's keys one list, its boxes as wide as the widest: concatenated
        m = np.array([kid.get(k, -1) for k in cols[0].keys] or [0], np.int64)
        key = np.concatenate([c.key for c in cols]).astype(np.int64, copy=False)
        if not ((m == np.arange(len(m))).all() and 0 <= key.min() and key.max() < len(m)):
            key = np.take(m, key)  # the ranks' list is not the keys' order (or an index is wrong: raises)
        off = np.concatenate([c.offsets for c in cols]).astype(np.int64, copy=False)
        size = np.concatenate([c.sizes for c in cols]).astype(np.int64, copy=False)
        return key, off, size, np.concatenate([c.ndim for c in cols]), starts
    key = np.empty(n, np.int64)
    off = np.zeros((n, width), np.int64)
    size = np.ones((n, width), np.int64)
    maps: dict[bytes, np.ndarray] = {}
    for r, c in enumerate(cols):
        m = maps.get(c.keys_digest)
        if m is None:
            m = maps[c.keys_digest] = np.array([kid.get(k, -1) for k in c.keys] or [0], np.int64)
        a, b = starts[r], starts[r + 1]
        np.take(m, c.key, out=key[a:b])
        w = c.offsets.shape[1]
        off[a:b, :w] = c.offsets
        size[a:b, :w] = c.sizes
    ndim = np.concatenate([c.ndim for c in cols]) if n else np.zeros(0, np.int64)
    return key, off, size, ndim, starts
