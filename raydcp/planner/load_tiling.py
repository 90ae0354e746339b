"""The tiling check of a load, on the line the load planner lays its chunks on.

A load of a checkpoint first checks that its chunks tile their tensors exactly
(:func:`raydcp.planner.require_tiling`). The array path of the load planner
(:mod:`.load_arrays`) has by then laid the chunks of every tensor split along one dimension on
one line, key after key, sorted, and checked that no two overlap. On that line the tiling check
is short: a tensor split along one dimension is tiled where its chunks span the tensor's own
shape, its first chunk starts at the tensor's start, each next one where the one before ended
and its last one at the tensor's end. The other tensors (split along several dimensions, or
whose chunks overlap) are checked by :func:`raydcp.planner.untiled` on their own rows; a
tensor found untiled is named by :func:`require_tiling`, as before.
"""
from __future__ import annotations

import numpy as np

from ..errors import CheckpointDamagedError
from .tiling import require_tiling, shape_extents, untiled


def check_line_tiling(a, tensors) -> None:
    """Raise what :func:`require_tiling` raises for ``tensors`` (a decoded checkpoint's
    ``TensorMetas``, whose chunks are the planner's sources in key order), from the line arrays
    of :func:`.load_arrays._overlapping_pairs` (``a``): ``c_live``, ``general``, ``key_dim``,
    ``base``, ``on_line``, ``line_start``, ``line_end``, with ``ext`` and ``s_key``."""
    k, width = a.nkeys, a.width
    shapes = [tuple(s) for s in tensors.shapes]
    if not k or any(len(s) > width for s in shapes):
        require_tiling(tensors)
        return
    shape_ext, expect, big = shape_extents(shapes, width)
    slow = big | a.general | (a.nd_key != np.fromiter(map(len, shapes), np.int64, k))
    has_live = np.bincount(a.s_key[a.c_live], minlength=k) > 0
    slow |= has_live & (a.ext != shape_ext).any(axis=1)  # some chunk lies past the tensor's end
    bad = ~has_live & (expect != 0)  # a tensor with elements and no chunk holding any
    start, end = a.line_start, a.line_end
    if len(start):
        lk = a.s_key if a.line_all else a.s_key[a.on_line]
        heads = np.flatnonzero(np.r_[True, lk[1:] != lk[:-1]])
        lasts = np.r_[heads[1:] - 1, len(lk) - 1]
        hk = lk[heads]
        bad[hk[start[heads] != a.base[hk]]] = True  # the first chunk starts past (or before) the start
        bad[hk[end[lasts] != a.base[hk] + shape_ext[hk, a.key_dim[hk]]]] = True  # the last stops short
        # within a tensor each chunk starts where the one before ended: the line's only steps are
        # between tensors (the line leaves a gap after each)
        steps = np.flatnonzero(start[1:] != end[:-1])
        bad[lk[steps[lk[steps] == lk[steps + 1]]]] = True
    todo = np.flatnonzero(slow)
    if len(todo):  # box by box (odd corners, intervals) on their own rows
        cstart = a.cstart
        rows = np.zeros(len(todo) + 1, np.int64)
        np.cumsum(cstart[todo + 1] - cstart[todo], out=rows[1:])
        sel = np.concatenate([np.arange(cstart[t], cstart[t + 1]) for t in todo.tolist()])
        bad[todo] = untiled([shapes[t] for t in todo.tolist()], rows, a.s_off[sel], a.s_size[sel])
    if bad.any():
        names = [tensors.names[t] for t in np.flatnonzero(bad).tolist()]
        require_tiling({n: tensors[n] for n in names})
        raise CheckpointDamagedError(  # the array check and the box-by-box one disagree: refuse anyway
            f"the checkpoint is damaged: the stored pieces of {', '.join(names[:20])} do not cover the tensor "
            f"exactly once; run `raydcp verify` on it and restore it from another copy", key=names[0])
