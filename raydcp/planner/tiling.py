"""Whether pieces tile their tensors exactly: every element held by exactly one piece.

One check, used wherever pieces meet a tensor: save planning (the pieces the ranks hold), load and
reshard (the chunks a checkpoint's metadata lists), in-memory transfer (a live group's pieces) and
``raydcp verify``.

- :func:`tiling_problems` checks every tensor of a mapping key -> tensor with ``shape`` and
  ``chunks`` (a checkpoint's ``Metadata.tensors``) and names what is wrong with each untiled one;
- :func:`require_tiling` does the same and raises a CheckpointError saying the checkpoint is damaged;
- :func:`untiled` is the array core: which of many tensors, given as columns, are not tiled;
- :func:`piece_problems` checks one tensor's distinct boxes one by one and names each problem.

Why the array core is exact (pieces of any shape, in any number of dimensions): the indicator
function of a box ``[a, b)`` has a mixed difference that is +-1 at the box's 2**d corners and 0
elsewhere, and the difference operator is invertible on functions of finite support. So the
corners that occur an odd number of times among all pieces' corners determine, modulo 2, how
often every element is covered. If those odd corners are exactly the tensor's own corners,
every element is covered an odd number of times (at least once); if moreover the pieces'
element counts add up to the tensor's, every element is covered exactly once. Dimensions that
every piece spans whole are left out of the corners, and pieces that split their tensor along one
dimension only (rows of a matrix, the usual case) are checked as intervals instead: sorted along
that dimension (they usually come sorted), each must start where the one before ended. One sort
of the corners checks every other tensor at once.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import CheckpointDamagedError
from .boxes import numel

__all__ = ["tiling_problems", "require_tiling", "untiled", "piece_problems", "shape_extents"]

_BIG = 1 << 62  # tensors of more elements (or a longer dimension) are checked box by box, exactly


def tiling_problems(tensors: Mapping[str, Any]) -> dict[str, list[str]]:
    """key -> what is wrong, for every tensor whose chunks do not cover it exactly once.

    ``tensors`` maps a key to an object with ``shape`` and ``chunks`` (each with ``offsets`` and
    ``sizes``), as :attr:`raydcp.Metadata.tensors`; decoded metadata is checked on its columns,
    without a Python object per chunk. Empty chunks are ignored. An empty dict: all tiled.
    """
    names, shapes, rows, off, size = _columns(tensors)
    bad = untiled(shapes, rows, off, size)
    out: dict[str, list[str]] = {}
    for t in np.flatnonzero(bad).tolist():
        a, b = int(rows[t]), int(rows[t + 1])
        nd = len(shapes[t])
        every = [(o, s) for o, s in zip(map(tuple, off[a:b, :nd].tolist()), map(tuple, size[a:b, :nd].tolist()))
                 if numel(s) > 0]
        boxes = list(dict.fromkeys(every))
        dup = len(every) - len(boxes)
        problems = piece_problems(names[t], shapes[t], boxes)
        if dup and not any("outside" in p for p in problems):
            problems.insert(0, f"{names[t]}: {dup} piece(s) listed more than once")
        out[names[t]] = problems or [f"{names[t]}: the pieces do not cover the tensor exactly once"]
    return out


def require_tiling(tensors: Mapping[str, Any], what: str = "the checkpoint") -> None:
    """Raise a CheckpointDamagedError naming every tensor whose chunks do not cover it exactly once."""
    problems = tiling_problems(tensors)
    if not problems:
        return
    lines = [p for ps in problems.values() for p in ps]
    more = f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else ""
    raise CheckpointDamagedError(
        f"{what} is damaged: the stored pieces of {', '.join(list(problems)[:20])} do not cover the tensor "
        f"exactly once (a gap or an overlap):\n  " + "\n  ".join(lines[:20]) + more
        + "\nrun `raydcp verify` on it and restore it from another copy", key=next(iter(problems)))


def untiled(shapes: Sequence[tuple[int, ...]], rows: np.ndarray, offsets: np.ndarray,
            sizes: np.ndarray) -> np.ndarray:
    """Per tensor, True where its pieces do not cover it exactly once (array operations only).

    Tensor ``t`` has shape ``shapes[t]`` and the pieces ``rows[t]:rows[t + 1]`` of ``offsets`` and
    ``sizes``, (n, width) int64 arrays; dimensions past a tensor's own are padding (offset 0,
    size 1). Pieces with no element are ignored; a piece outside its tensor makes it untiled.
    """
    k = len(shapes)
    rows = np.asarray(rows, np.int64)
    n = int(rows[-1]) if k else 0
    if n == 0:
        return np.array([numel(s) != 0 for s in shapes], bool)
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    if offsets.ndim != 2 or offsets.shape != sizes.shape or len(offsets) != n:
        raise ValueError("offsets and sizes must be (n, width) arrays of the same shape, a row per piece")
    width = offsets.shape[1]
    ext, expect, big = shape_extents(shapes, width)
    key = np.repeat(np.arange(k), np.diff(rows))
    live = np.ones(n, bool)
    inside = np.ones(n, bool)
    vol = np.ones(n, np.int64)
    e = np.empty(n, np.int64)
    with np.errstate(over="ignore"):  # products of pieces outside their tensor may wrap: they are not used
        for d in range(width):
            o, z = offsets[:, d], sizes[:, d]
            np.take(ext[:, d], key, out=e)
            live &= z > 0
            inside &= (o >= 0) & (o <= e) & (z >= 0) & (z <= e - o)
            vol *= z
    good = live & inside
    bad = np.bincount(key[live & ~inside], minlength=k) > 0
    # element counts: exact modulo 2**64 (int64 sums wrap) and within a quarter in float64; both
    # together rule out a true sum that differs from the tensor's by a multiple of 2**64
    vol[~good] = 0
    csum = np.zeros(n + 1, np.int64)
    with np.errstate(over="ignore"):
        np.cumsum(vol, out=csum[1:])
        total = csum[rows[1:]] - csum[rows[:-1]]
    approx = np.bincount(key, weights=vol.astype(np.float64), minlength=k)
    bad |= (total != expect) | (np.abs(approx - expect) > 0.25 * expect + 1)
    bad |= big  # decided box by box below
    todo = good & ~bad[key]
    if todo.any():
        every = bool(todo.all())
        bad |= _pieces_wrong(k, key if every else key[todo], offsets if every else offsets[todo],
                                  sizes if every else sizes[todo], ext)
    for t in np.flatnonzero(big).tolist():
        a, b = int(rows[t]), int(rows[t + 1])
        nd = len(shapes[t])
        boxes = [(o, s) for o, s in zip(map(tuple, offsets[a:b, :nd].tolist()), map(tuple, sizes[a:b, :nd].tolist()))
                 if numel(s) > 0]
        bad[t] = nd > width or len(boxes) != len(set(boxes)) or bool(piece_problems("", shapes[t], boxes))
    return bad


def shape_extents(shapes: Sequence[tuple[int, ...]], width: int):
    """(k, width) extents (padding 1), element counts, and which tensors are too large for int64
    arithmetic (left to the exact box-by-box check)."""
    k = len(shapes)
    nd = np.fromiter(map(len, shapes), np.int64, k)
    ext = np.ones((k, width), np.int64)
    try:
        flat = np.fromiter(chain.from_iterable(shapes), np.int64, int(nd.sum()))
    except OverflowError:
        flat = None
    if flat is None or (k and nd.max() > width):
        big = np.array([len(s) > width or max(s, default=0) >= _BIG or numel(s) >= _BIG for s in shapes], bool)
        for t, s in enumerate(shapes):
            if not big[t]:
                ext[t, :len(s)] = s
    else:
        row_of = np.repeat(np.arange(k), nd)
        ext[row_of, np.arange(len(flat)) - np.repeat(np.cumsum(nd) - nd, nd)] = flat
        big = (ext >= _BIG).any(axis=1) | (ext.astype(np.float64).prod(axis=1) >= _BIG / 2)
        ext[big] = 1
    expect = ext.prod(axis=1)
    expect[big] = 0
    return ext, expect, big


def _pieces_wrong(k: int, key: np.ndarray, off: np.ndarray, size: np.ndarray, ext: np.ndarray) -> np.ndarray:
    """Per tensor: whether its (live, inside) pieces fail to cover it exactly once, given that
    their element counts add up: as intervals where they split it along one dimension (the
    usual case), by their odd corners (module doc) where along several."""
    n, width = off.shape
    split = np.zeros((k, width), bool)  # dimensions some piece of the tensor does not span
    e = np.empty(n, np.int64)
    for d in range(width):
        np.take(ext[:, d], key, out=e)
        split[:, d] = np.bincount(key[(off[:, d] != 0) | (size[:, d] != e)], minlength=k) > 0
    nsplit = split.sum(axis=1)
    one = nsplit[key] <= 1
    if one.all():
        return _intervals_wrong(k, key, off, size, ext, split)
    bad = np.zeros(k, bool)
    if one.any():
        bad |= _intervals_wrong(k, key[one], off[one], size[one], ext, split)
        key, off, size = key[~one], off[~one], size[~one]
    return bad | _corners_wrong(k, key, off, size, ext, split)


def _intervals_wrong(k: int, key: np.ndarray, off: np.ndarray, size: np.ndarray, ext: np.ndarray,
                     split: np.ndarray) -> np.ndarray:
    """The pieces of tensors split along at most one dimension are intervals along it: sorted on
    one line (key after key), each must start where the one before ended, the first at 0 and the
    last at the tensor's end. No sort where they come sorted (as stored chunks usually do)."""
    dim = np.argmax(split, axis=1)  # the split dimension (0 where none: every piece is whole)
    d_of = dim[key]
    if (d_of == d_of[0]).all():
        d = int(d_of[0])
        start, length, end_t = off[:, d], size[:, d], ext[:, d]
    else:
        at = np.arange(len(key)) * off.shape[1] + d_of
        start, length = off.reshape(-1)[at], size.reshape(-1)[at]
        end_t = ext[np.arange(k), dim]
    if float(end_t.astype(np.float64).sum()) + k < _BIG:
        base = np.zeros(k, np.int64)
        np.cumsum(end_t[:-1] + 1, out=base[1:])
        line = base[key] + start
        order = np.argsort(line, kind="stable") if len(line) > 1 and (line[1:] < line[:-1]).any() else None
    else:  # the line would not fit in int64: sort by key, then start
        order = np.lexsort((start, key))
    if order is not None:
        key, start, length = key[order], start[order], length[order]
    stop = start + length
    head = np.r_[True, key[1:] != key[:-1]]
    last = np.r_[key[1:] != key[:-1], True]
    bad = np.zeros(k, bool)
    bad[key[head & (start != 0)]] = True
    bad[key[last & (stop != end_t[key])]] = True
    gap = ~head[1:] & (start[1:] != stop[:-1])
    bad[key[1:][gap]] = True
    return bad


def _corners_wrong(k: int, key: np.ndarray, off: np.ndarray, size: np.ndarray, ext: np.ndarray,
                   split: np.ndarray) -> np.ndarray:
    """The odd-corner check (module doc) of tensors split along several dimensions."""
    n, width = off.shape
    bits = (split.astype(np.int64) << np.arange(width)).sum(axis=1)  # per tensor, its split dimensions
    used = int(np.bitwise_or.reduce(bits))
    lattice_f = np.where(split, ext + 1, 1).astype(np.float64).prod(axis=1)
    linear = float(lattice_f.sum()) < _BIG / 2
    if linear:  # one int64 per corner: the tensor's base plus the corner's index in its lattice, times
        # two, plus one where the corner is not one of the tensor's own (a property of the corner)
        lattice = np.where(split, ext + 1, 1).prod(axis=1)
        base = np.zeros(k, np.int64)
        np.cumsum(lattice[:-1], out=base[1:])
        stride = np.ones((k, width), np.int64)
        for d in range(width - 2, -1, -1):
            stride[:, d] = stride[:, d + 1] * np.where(split[:, d + 1], ext[:, d + 1] + 1, 1)
    masks, m = [], used
    while True:  # every subset of the split dimensions: which end of the piece each corner takes
        masks.append(m)
        if m == 0:
            break
        m = (m - 1) & used
    box_bits = bits[key]
    parts = []
    for m in masks:
        sel = None if m == 0 else np.flatnonzero((box_bits & m) == m)
        if sel is not None and not len(sel):
            continue
        t = key if sel is None else key[sel]
        pos = np.take(base, t) if linear else None
        cols = [t]
        away = np.zeros(len(t), bool)
        for d in range(width):
            c = off[:, d] if sel is None else off[sel, d]
            if (m >> d) & 1:
                c = c + (size[:, d] if sel is None else size[sel, d])
            away |= (c != 0) & (c != np.take(ext[:, d], t))
            if linear:
                pos += c * np.take(stride[:, d], t)
            else:
                cols.append(c)
        if linear:
            pos *= 2
            pos += away
            parts.append(pos)
        else:
            parts.append(np.column_stack([*cols, away]))
    corners = np.concatenate(parts)
    if linear:
        corners.sort()
        heads = np.flatnonzero(np.r_[True, corners[1:] != corners[:-1]])
    else:
        corners = corners[np.lexsort(corners.T[::-1])]
        heads = np.flatnonzero(np.r_[True, (corners[1:] != corners[:-1]).any(axis=1)])
    odd = heads[np.diff(np.append(heads, len(corners))) % 2 == 1]
    if linear:
        c = corners[odd]
        t, away = np.searchsorted(base, c >> 1, side="right") - 1, (c & 1).astype(bool)
    else:
        t, away = corners[odd, 0], corners[odd, -1].astype(bool)
    wrong = np.bincount(t[away], minlength=k) > 0
    nodd = np.bincount(t, minlength=k)
    want = 1 << split.sum(axis=1)
    has = np.bincount(key, minlength=k) > 0
    return has & (wrong | (nodd != want))


def piece_problems(key: str, shape: tuple[int, ...], boxes: list[tuple]) -> list[str]:
    """What is wrong with one tensor's distinct ``(offsets, sizes)`` boxes: a box outside the
    tensor, two boxes that overlap, or elements no box holds. Box by box, exact at any size."""
    out = []
    boxes = [b for b in boxes if numel(b[1]) > 0]
    for off, size in boxes:
        if len(off) != len(shape) or any(o < 0 or o + n > s for o, n, s in zip(off, size, shape)):
            out.append(f"{key}: piece at {list(off)} of size {list(size)} lies outside the shape {list(shape)}")
    if out:
        return out
    if not shape:  # a 0-d tensor is one element: exactly one distinct box
        return [] if len(boxes) == 1 else [f"{key}: 0-d tensor saved by no rank"]
    # sweep along the dimension the pieces are split most along: only boxes starting before this one ends
    d = max(range(len(shape)), key=lambda k: len({o[k] for o, _ in boxes}))
    boxes.sort(key=lambda b: (b[0][d], b[0]))
    for i, (ao, asz) in enumerate(boxes):
        end = ao[d] + asz[d]
        for j in range(i + 1, len(boxes)):
            bo, bsz = boxes[j]
            if bo[d] >= end:
                break
            if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(ao, asz, bo, bsz)):
                return [f"{key}: pieces at {list(ao)} (size {list(asz)}) and {list(bo)} (size {list(bsz)}) overlap"]
    covered = sum(numel(s) for _, s in boxes)
    if covered != numel(shape):
        return [f"{key}: pieces cover {covered} of {numel(shape)} elements; some part of the tensor is held by no rank"]
    return []


def _columns(tensors: Mapping[str, Any]):
    """(names, shapes, rows, offsets, sizes) of a mapping key -> tensor with chunks."""
    cols = getattr(tensors, "columns", None)
    if cols is not None and hasattr(tensors, "shapes"):  # decoded metadata: its columns as they are
        return list(tensors.names), [tuple(s) for s in tensors.shapes], cols.rows, cols.offsets, cols.sizes
    names = list(tensors)
    metas = [tensors[k] for k in names]
    shapes = [tuple(tm.shape) for tm in metas]
    width = max([1, *map(len, shapes)])
    chunks = [tm.chunks for tm in metas]
    if all(isinstance(getattr(cs, "offsets", None), np.ndarray) for cs in chunks):  # chunk tables: their arrays
        return (names, shapes, *_stack_tables(chunks, shapes, width))
    counts = np.fromiter(map(len, chunks), np.int64, len(names))
    rows = np.zeros(len(names) + 1, np.int64)
    np.cumsum(counts, out=rows[1:])
    n = int(rows[-1])
    off, size = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
    i = 0
    for t, cs in enumerate(chunks):
        nd = len(shapes[t])
        for c in cs:
            o, s = tuple(c.offsets), tuple(c.sizes)
            if len(o) != nd or len(s) != nd:  # a box of the wrong dimension: outside the tensor
                o, s = (-1,) * nd, (1,) * nd
                if nd == 0:
                    o, s = (-1,), (1,)
            off[i, :len(o)], size[i, :len(s)] = o, s
            i += 1
    return names, shapes, rows, off, size


def _stack_tables(tables: list, shapes: list[tuple[int, ...]], width: int):
    """(rows, offsets, sizes) of chunk tables (``offsets``/``sizes`` arrays of a row per chunk)."""
    counts = np.fromiter(map(len, tables), np.int64, len(tables))
    rows = np.zeros(len(tables) + 1, np.int64)
    np.cumsum(counts, out=rows[1:])
    off, size = np.zeros((int(rows[-1]), width), np.int64), np.ones((int(rows[-1]), width), np.int64)
    for t, ct in enumerate(tables):
        if counts[t]:
            o, z = np.asarray(ct.offsets, np.int64), np.asarray(ct.sizes, np.int64)
            nd = len(shapes[t])
            if o.shape != (counts[t], nd) or z.shape != (counts[t], nd):  # the wrong dimension: outside
                o, z = np.full((counts[t], max(nd, 1)), -1, np.int64), np.ones((counts[t], max(nd, 1)), np.int64)
            off[rows[t]:rows[t + 1], :o.shape[1]], size[rows[t]:rows[t + 1], :z.shape[1]] = o, z
    return rows, off, size
