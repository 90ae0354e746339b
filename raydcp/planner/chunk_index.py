"""Which stored chunks a box overlaps, box by box: for tensors whose chunks are not split along
one dimension (grids), and for the object path of the load planner."""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from .boxes import intersect
from .types import SourceChunk


class ChunkIndex:
    """The chunks of one tensor sorted along the dimension they are split most along, so the
    chunks a box may overlap are found by bisection instead of a scan of every chunk."""

    def __init__(self, chunks: Sequence[SourceChunk]):
        self.chunks = chunks
        nd = len(chunks[0].offsets) if chunks else 0
        self.dim = max(range(nd), key=lambda d: len({c.offsets[d] for c in chunks})) if nd else -1
        if self.dim < 0:
            self.order, self.starts, self.span = list(range(len(chunks))), [], 0
            return
        d = self.dim
        self.order = sorted(range(len(chunks)), key=lambda i: chunks[i].offsets[d])
        self.starts = [chunks[i].offsets[d] for i in self.order]
        self.span = max((c.sizes[d] for c in chunks), default=0)

    def candidates(self, offsets, sizes):
        if self.dim < 0:
            return self.order
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        first = bisect.bisect_left(self.starts, lo - self.span + 1)
        last = bisect.bisect_left(self.starts, hi)
        return self.order[first:last]


def general_pairs(reqs, q_key, q_off, q_size, s_off, s_size, cstart, c_live):
    """(request, chunk) pairs that overlap, for keys whose chunks are not split along one dimension."""
    out_q, out_c = [], []
    indexes: dict[int, tuple] = {}
    for q in reqs.tolist():
        k = int(q_key[q])
        ix = indexes.get(k)
        if ix is None:
            a, b = int(cstart[k]), int(cstart[k + 1])
            live = [c for c in range(a, b) if c_live[c]]
            boxes = [(tuple(s_off[c].tolist()), tuple(s_size[c].tolist())) for c in live]
            ix = indexes[k] = (live, boxes, ChunkIndex([_Box(o, s) for o, s in boxes]))
        live, boxes, index = ix
        qo, qs = tuple(q_off[q].tolist()), tuple(q_size[q].tolist())
        for ci in index.candidates(qo, qs):
            if intersect(boxes[ci][0], boxes[ci][1], qo, qs) is not None:
                out_q.append(q)
                out_c.append(live[ci])
    return np.array(out_q, np.int64), np.array(out_c, np.int64)


class _Box:
    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets, sizes):
        self.offsets, self.sizes = offsets, sizes
