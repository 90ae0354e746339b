"""Box arithmetic: intersections of n-dimensional index boxes and their byte runs.

A box is ``(offsets, sizes)`` in global element coordinates. A stored chunk is the
row-major bytes of one box, so the part of it that another box needs is a set of
contiguous byte runs; trailing dimensions the sub-box covers fully merge into one run.
"""
from __future__ import annotations

__all__ = ["intersect", "numel", "byte_runs", "merge_runs"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def intersect(a_off, a_size, b_off, b_size) -> Box | None:
    """The intersection of two boxes, or None when it is empty."""
    offs, sizes = [], []
    for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def byte_runs(chunk_off, chunk_size, sub_off, sub_size, itemsize: int) -> list[tuple[int, int]]:
    """Byte runs ``(start, end)`` inside a row-major chunk that hold the sub-box, in order.

    ``sub_off`` is in global coordinates and lies inside the chunk.
    """
    nd = len(chunk_size)
    if nd == 0:
        return [(0, itemsize)]
    rel = [s - c for s, c in zip(sub_off, chunk_off)]
    # strides of the chunk in bytes
    strides = [0] * nd
    acc = itemsize
    for d in range(nd - 1, -1, -1):
        strides[d] = acc
        acc *= chunk_size[d]
    # the innermost dims fully covered merge with the first partial one into a run
    k = nd - 1
    while k > 0 and sub_size[k] == chunk_size[k] and rel[k] == 0:
        k -= 1
    run_len = sub_size[k] * strides[k]
    outer = list(range(k))
    starts = [rel[k] * strides[k]]
    for d in reversed(outer):
        base = rel[d] * strides[d]
        starts = [base + i * strides[d] + s for i in range(sub_size[d]) for s in starts]
    return [(s, s + run_len) for s in starts]


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of byte runs; runs that touch or overlap become one (no gap is ever read)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(runs):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
