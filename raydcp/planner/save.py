"""Global save planning: validate local plans, write each replica once, balance bytes, coalesce."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import CheckpointError, StateMismatchError
from .arrays import dim_range, rank_sums, sorted_runs, stack_items
from .boxes import numel
from .reuse import PlanCache, SaveReuse
from .tiling import piece_problems
from .types import FileSlot, FileTable, GlobalSavePlan, LocalSavePlan, RankWritePlan, TensorSpec

__all__ = ["SavePlanOptions", "plan_save", "agree_on_tensors", "agree_on_values"]

ALIGN = 64  # every piece starts at a multiple of this in its file (mmap- and SIMD-friendly)


@dataclass(frozen=True, kw_only=True)
class SavePlanOptions:
    max_file_bytes: int = 256 << 20   # a rank's pieces are coalesced into files up to this size
    save_id: str | None = None        # fixed id for reproducible plans (tests); random otherwise

    def __post_init__(self) -> None:
        if self.max_file_bytes < ALIGN:
            raise CheckpointError(f"max_file_bytes must be >= {ALIGN}, got {self.max_file_bytes}")


def plan_save(local_plans: Sequence[LocalSavePlan], options: SavePlanOptions = SavePlanOptions(),
              cache: PlanCache | None = None) -> GlobalSavePlan:
    """Build the global save plan from every rank's local plan (raises CheckpointError).

    The common case runs on the plans' columns (:class:`ItemColumns`) with array operations:
    tensors split along one dimension (row or column blocks, whole replicas) are validated by a
    sort and a sweep. Tensors split otherwise (grids) are checked box by box, and any plan the
    array path finds wrong is planned again box by box, which names every problem.

    ``cache``: a :class:`~raydcp.planner.PlanCache` the caller keeps between saves; where every
    rank's layout is that of the plan it holds, that plan's layout decisions are reused and only
    the checksums, the plain values and the file names are redone (the same plan results).
    """
    for i, lp in enumerate(local_plans):
        if lp.rank != i:
            raise CheckpointError(f"local plans out of order: position {i} holds rank {lp.rank}")
    tensors = _agree_fast(local_plans)
    values = agree_on_values(local_plans, tensors)
    save_id = options.save_id or uuid.uuid4().hex[:16]
    planned = _plan_columns(local_plans, tensors, values, options, save_id, cache)
    if planned is not None:
        return planned
    return _plan_objects(local_plans, tensors, values, options, save_id)


def _agree_fast(local_plans: Sequence[LocalSavePlan]) -> dict[str, TensorSpec]:
    """``agree_on_tensors``, comparing whole signatures where every rank describes the same tensors."""
    cols = [getattr(lp, "columns", None) for lp in local_plans]
    if cols and all(c is not None for c in cols):
        first = cols[0].signature
        if all(c.signature == first for c in cols):
            lp0 = local_plans[0]
            return {key: lp0.tensors[key] for key in sorted(lp0.tensors)}
    return agree_on_tensors(local_plans)


def _plan_objects(local_plans: Sequence[LocalSavePlan], tensors: dict[str, TensorSpec], values: dict[str, Any],
                  options: SavePlanOptions, save_id: str) -> GlobalSavePlan:
    """The general path: a Python object per box (any layout; names every problem)."""
    world = len(local_plans)
    # group identical boxes (replicas) and check each tensor is tiled exactly
    boxes: dict[str, dict[tuple, list[tuple[int, int]]]] = {}
    for lp in local_plans:
        for idx, it in enumerate(lp.items):
            boxes.setdefault(it.key, {}).setdefault((it.offsets, it.sizes), []).append((lp.rank, idx))
    problems: list[str] = []
    for key, spec in tensors.items():
        problems.extend(piece_problems(key, spec.shape, list(boxes.get(key, {}))))
        for holders in boxes.get(key, {}).values():
            sums = {local_plans[r].items[i].checksum for r, i in holders} - {None}
            if len(sums) > 1:
                ranks = sorted(r for r, _ in holders)
                off = local_plans[holders[0][0]].items[holders[0][1]].offsets
                problems.append(f"{key}: replicas on ranks {ranks} differ (piece at {off}); "
                                f"the ranks' values diverged before saving")
    if problems:
        raise StateMismatchError("inconsistent state across ranks:\n  " + "\n  ".join(problems[:50])
                              + (f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""))

    # assign writers: single-holder pieces first, then replicas largest first to the least loaded holder
    load = [0] * world
    assigned: list[list[int]] = [[] for _ in range(world)]
    replicated: list[tuple[int, list[tuple[int, int]]]] = []
    for key in tensors:
        for holders in boxes.get(key, {}).values():
            r, i = holders[0]
            nbytes = local_plans[r].items[i].nbytes
            if nbytes == 0:
                continue
            if len(holders) == 1:
                load[r] += nbytes
                assigned[r].append(i)
            else:
                replicated.append((nbytes, holders))
    replicated.sort(key=lambda x: -x[0])
    for nbytes, holders in replicated:
        r, i = min(holders, key=lambda h: (load[h[0]], h[0]))
        load[r] += nbytes
        assigned[r].append(i)

    ranks = tuple(
        RankWritePlan(r, save_id, _pack_files(save_id, r, local_plans[r], sorted(assigned[r]), options.max_file_bytes))
        for r in range(world)
    )
    return GlobalSavePlan(save_id, world, tensors, values, ranks, tuple(load))


def _plan_columns(local_plans: Sequence[LocalSavePlan], tensors: dict[str, TensorSpec], values: dict[str, Any],
                  options: SavePlanOptions, save_id: str, cache: PlanCache | None = None) -> GlobalSavePlan | None:
    """The array path of :func:`plan_save`; None where the general path must decide."""
    world = len(local_plans)
    cols = [getattr(lp, "columns", None) for lp in local_plans]
    if any(c is None or c.nbytes is None for c in cols):
        return None
    layout = None if cache is None else PlanCache.save_key(cols, options.max_file_bytes)
    if layout is not None:
        kept = cache.saved(layout)
        if kept is not None:
            return _reuse(kept, cols, tensors, values, save_id)
    keys = list(tensors)
    k = len(keys)
    nds = np.array([len(tensors[key].shape) for key in keys], np.int64)
    width = max([1, *(len(tensors[key].shape) for key in keys), *(c.offsets.shape[1] for c in cols)])
    shape = np.ones((k, width), np.int64)
    spec_numel = np.zeros(k, np.int64)
    for i, key in enumerate(keys):
        s = tuple(tensors[key].shape)
        if numel(s) >= 1 << 62 or any(x < 0 for x in s):
            return None
        shape[i, :len(s)] = s
        spec_numel[i] = numel(s)

    # every rank's items, concatenated: global key id, rank, index in its plan, box, bytes, checksum
    kid = {key: i for i, key in enumerate(keys)}
    g, off, size, ndim, starts = stack_items(cols, kid, width)
    n = len(g)
    counts = np.diff(starts)
    if (g < 0).any():
        return None  # an item of a tensor no rank describes
    if not np.array_equal(ndim, nds[g]):
        return None
    nbytes = np.concatenate([c.nbytes for c in cols]) if n else np.zeros(0, np.int64)
    crc = np.concatenate([c.checksum for c in cols]) if n else np.zeros(0, np.int64)
    if n and int(size.min()) < 0:
        return None

    # bounds: every non-empty piece inside its tensor (a dimension at a time: few, small temporaries)
    # also, per piece, how many dimensions it spans whole and the first one it does not
    nonempty = np.ones(n, bool)
    inside = np.ones(n, bool)
    nfull = np.zeros(n, np.int8)
    not_full = np.full(n, -1, np.int8)  # the first dimension a piece does not span
    e = np.empty(n, np.int64)
    t = np.empty(n, np.int64)
    b1, b2 = np.empty(n, bool), np.empty(n, bool)
    for j in range(width):
        o, z = off[:, j], size[:, j]
        np.take(shape[:, j], g, out=e)
        nonempty &= np.greater(z, 0, out=b1)
        inside &= np.greater_equal(o, 0, out=b1)
        inside &= np.less_equal(z, e, out=b1)
        inside &= np.less_equal(np.add(o, z, out=t), e, out=b1)  # o <= e follows from o + z <= e, z >= 0
        np.equal(o, 0, out=b1)
        b1 &= np.equal(z, e, out=b2)  # spans dimension j
        nfull += b1
        np.less(not_full, 0, out=b2)
        b2 &= ~b1
        not_full[b2] = j
    del e, b2
    if not (inside | ~nonempty).all():
        return None
    del inside
    count = np.multiply(size[:, 0], nonempty, out=t)
    for j in range(1, width):
        count *= size[:, j]
    if not np.array_equal(np.equal(count, 0, out=b1), nbytes == 0):
        return None

    empty = np.flatnonzero(~nonempty & (crc >= 0))
    if len(empty):  # replicas of an empty piece must agree too (they do, unless a checksum is wrong)
        seen: dict[tuple, int] = {}
        for p, t, o, s, c in zip(empty.tolist(), g[empty].tolist(), off[empty].tolist(), size[empty].tolist(),
                                 crc[empty].tolist()):
            if seen.setdefault((t, tuple(o), tuple(s)), c) != c:
                return None
    # per tensor, the dimension its pieces are split along: a piece spans its tensor in every other one
    all_live = bool(nonempty.all())
    idx = np.arange(n) if all_live else np.flatnonzero(nonempty)
    gi = g if all_live else g[idx]
    if not all_live:
        nfull, not_full = nfull[idx], not_full[idx]
    piece_dim = np.where(nfull == width, width, np.where(nfull == width - 1, not_full, -1))
    del nfull, not_full
    dmin, dmax = dim_range(gi, piece_dim, k, width)
    general = (dmin < 0) | ((dmax >= 0) & (dmax != dmin))
    key_dim = np.where(dmin >= width, 0, np.maximum(dmin, 0))

    # one-dimensional tensors: sort pieces by (tensor, start, length); equal neighbours are replicas
    one = ~general[gi]
    all_one = bool(one.all())
    rows = idx if all_one else idx[one]
    g1 = gi if all_one else gi[one]
    dims = np.unique(key_dim[~general])
    if len(dims) == 1:  # split along the same dimension everywhere (rows, say): columns of the boxes
        s1, z1 = off[:, dims[0]], size[:, dims[0]]
        if not (all_one and all_live):
            s1, z1 = s1[rows], z1[rows]
    else:
        at = rows * width + key_dim[g1]
        s1, z1 = np.take(off.reshape(-1), at), np.take(size.reshape(-1), at)
        del at
    order, (g1, s1, z1) = sorted_runs([g1, s1, z1], world if all_one and all_live else 1)
    rows = order if all_one and all_live else rows[order]
    del order
    first = np.ones(len(rows), bool)
    first[1:] = (g1[1:] != g1[:-1]) | (s1[1:] != s1[:-1]) | (z1[1:] != z1[:-1])
    heads = np.flatnonzero(first)
    unique = len(heads) == len(rows)  # no replicas (the usual case): each piece is its own group
    ug, us, uz = (g1, s1, z1) if unique else (g1[heads], s1[heads], z1[heads])
    if ((ug[1:] == ug[:-1]) & (us[1:] < us[:-1] + uz[:-1])).any():
        return None  # overlap
    covered = np.bincount(ug, weights=count[rows if unique else rows[heads]], minlength=k).astype(np.int64) \
        if len(ug) else np.zeros(k, np.int64)  # exact: a tensor has fewer than 2**53 elements
    if (covered[~general] != spec_numel[~general]).any():
        return None  # a gap
    del ug, us, uz
    sizes_of = np.diff(np.append(heads, len(rows)))
    if not unique and (crc[rows] >= 0).any():
        c = crc[rows]
        lo = np.minimum.reduceat(np.where(c >= 0, c, 1 << 40), heads)
        hi = np.maximum.reduceat(c, heads)
        if ((hi >= 0) & (lo != hi)).any():
            return None  # diverged replicas

    # writers: a piece held once is written by its holder; replicas go largest first to the least loaded
    writers = [rows if unique else rows[heads[sizes_of == 1]]]
    is_writer = np.zeros(n, bool)
    is_writer[writers[0]] = True
    load = rank_sums(np.multiply(nbytes, is_writer), starts)
    groups: list[tuple[int, int, int, list[int]]] = []  # (nbytes, tensor, first position, holders)
    multi = np.flatnonzero(sizes_of > 1)
    if len(multi):
        rl = rows.tolist()
        hs, ls = heads[multi].tolist(), (heads[multi] + sizes_of[multi]).tolist()
        for h, e in zip(hs, ls):
            groups.append((int(nbytes[rl[h]]), int(g1[h]), rl[h], rl[h:e]))
    gen_keys = np.flatnonzero(general)
    if len(gen_keys):
        more = _general_groups(keys, tensors, gen_keys, idx[general[gi]], g, off, size, crc, nbytes, nds)
        if more is None:
            return None
        for grp in more:
            if len(grp[3]) == 1:
                writers.append(np.array(grp[3], np.int64))
                load[int(np.searchsorted(starts, grp[3][0], side="right")) - 1] += grp[0]
            else:
                groups.append(grp)
    if groups:
        groups.sort(key=lambda x: (-x[0], x[1], x[2]))
        lload = load.tolist()
        rk = np.repeat(np.arange(world), counts).tolist()
        chosen = []
        for nb, _, _, holders in groups:
            w = min(holders, key=lambda p: (lload[rk[p]], rk[p]))
            lload[rk[w]] += nb
            chosen.append(w)
        load = np.array(lload, np.int64)
        writers.append(np.array(chosen, np.int64))
    for w in writers[1:]:
        is_writer[w] = True
    files = _pack_ranks(save_id, np.flatnonzero(is_writer), starts, nbytes, world, options.max_file_bytes)
    ranks = tuple(RankWritePlan(r, save_id, files[r]) for r in range(world))
    if layout is not None and not len(gen_keys):  # grids are checked box by box, checksums with them
        empty = np.flatnonzero(~nonempty)  # whether a checksum comes with them is the next save's to say
        boxes = [(t, tuple(o), tuple(z)) for t, o, z in zip(g[empty].tolist(), off[empty].tolist(),
                                                             size[empty].tolist())]
        cache.keep_save(layout, SaveReuse(tuple((f.items, f.byte_offsets, f.bounds) for f in files),
                                          tuple(load.tolist()), None if unique else rows, None if unique else heads,
                                          empty, boxes))
    return GlobalSavePlan(save_id, world, tensors, values, ranks, tuple(load.tolist()))


def _reuse(kept: SaveReuse, cols: list, tensors: dict[str, TensorSpec], values: dict[str, Any],
           save_id: str) -> GlobalSavePlan | None:
    """The plan ``kept`` describes, for a save whose layouts are those it was made for: the
    checksums compared again (replicas must agree; None, so the plan is made anew and names
    what differs, where they do not) and the files named for ``save_id``."""
    n = sum(len(c.key) for c in cols)
    crc = np.concatenate([c.checksum for c in cols]) if n else np.zeros(0, np.int64)
    if len(kept.empty):  # replicas of an empty piece must agree too
        seen: dict[tuple, int] = {}
        for box, c in zip(kept.empty_boxes, crc[kept.empty].tolist()):
            if c >= 0 and seen.setdefault(box, c) != c:
                return None
    if kept.replica_rows is not None:
        c = crc[kept.replica_rows]
        if (c >= 0).any():
            lo = np.minimum.reduceat(np.where(c >= 0, c, 1 << 40), kept.replica_heads)
            hi = np.maximum.reduceat(c, kept.replica_heads)
            if ((hi >= 0) & (lo != hi)).any():
                return None  # diverged replicas
    ranks = tuple(RankWritePlan(r, save_id, FileTable([_file_name(save_id, r, f) for f in range(len(bounds) - 1)],
                                                      items, offsets, bounds))
                  for r, (items, offsets, bounds) in enumerate(kept.files))
    return GlobalSavePlan(save_id, len(cols), tensors, values, ranks, kept.load)


def _file_name(save_id: str, rank: int, f: int) -> str:
    return f"data/{save_id}/r{rank:05d}-f{f:03d}.bin"


def _pack_ranks(save_id: str, written: np.ndarray, starts: np.ndarray, nbytes: np.ndarray, world: int,
                max_bytes: int) -> list[FileTable]:
    """Every rank's :func:`_pack_columns` of the pieces ``written`` (positions in the concatenated
    items; rank r's items are ``starts[r]:starts[r + 1]``), the layout of all ranks at once: where a
    rank's pieces fit in one file (the usual case) its table is a slice of shared arrays."""
    every = len(written) == len(nbytes)  # every piece written by its holder (no replicas): no gathers
    bounds = starts if every else np.searchsorted(written, starts)  # rank r writes written[bounds[r]:bounds[r + 1]]
    nb = nbytes if every else nbytes[written]
    before = nb + (ALIGN - 1)
    before &= -ALIGN  # each piece's length rounded up to ALIGN (a power of two)
    np.cumsum(before, out=before)
    before -= nb  # where each piece starts in one long file of all ranks (its aligned length back off)
    before &= -ALIGN
    counts = np.diff(bounds)
    has = counts > 0
    rank_start = np.zeros(world, np.int64)
    rank_start[has] = before[bounds[:-1][has]]
    before -= np.repeat(rank_start, counts)  # now where each piece starts in its rank's one long file
    items = written - np.repeat(starts[:-1], counts)
    last_end = np.zeros(world, np.int64)
    last_end[has] = (before + nb)[bounds[1:][has] - 1]
    one_file = (counts <= 1) | (last_end <= max_bytes)
    out = []
    bl, one = bounds.tolist(), one_file.tolist()
    for r in range(world):
        a, b = bl[r], bl[r + 1]
        if not one[r]:
            out.append(_pack_columns(save_id, r, items[a:b], nb[a:b], max_bytes))
        elif a == b:
            out.append(FileTable([], items[a:b], before[a:b], [0]))
        else:
            out.append(FileTable([_file_name(save_id, r, 0)], items[a:b], before[a:b], [0, b - a]))
    return out


def _general_groups(keys, tensors, gen_keys, pieces, g, off, size, crc, nbytes, nds):
    """Tensors split along several dimensions: group identical boxes and check the tiling box by box.
    Returns (nbytes, tensor, first position, holders) per distinct box, or None on any problem."""
    boxes: dict[int, dict[tuple, list[int]]] = {int(t): {} for t in gen_keys}
    gl, ol, sl = g[pieces].tolist(), off[pieces].tolist(), size[pieces].tolist()
    for p, t, o, s in zip(pieces.tolist(), gl, ol, sl):
        nd = int(nds[t])
        boxes[t].setdefault((tuple(o[:nd]), tuple(s[:nd])), []).append(p)
    out = []
    for t, bx in boxes.items():
        if piece_problems(keys[t], tuple(tensors[keys[t]].shape), list(bx)):
            return None
        for (o, s), holders in bx.items():
            sums = {int(crc[p]) for p in holders} - {-1}
            if len(sums) > 1:
                return None
            out.append((int(nbytes[holders[0]]), t, holders[0], holders))
    return out


def _pack_columns(save_id: str, rank: int, items: np.ndarray, nbytes: np.ndarray, max_bytes: int) -> FileTable:
    """``_pack_files`` on arrays: the next file starts at the first piece that would end past max_bytes."""
    n = len(items)
    aligned = -(-nbytes // ALIGN) * ALIGN
    before = np.cumsum(aligned) - aligned  # where each piece would start in one long file
    ends = before + nbytes                 # non-decreasing, as aligned >= nbytes
    heads = [0] if n else []
    while heads:
        s = heads[-1]
        nxt = max(int(np.searchsorted(ends, before[s] + max_bytes, side="right")), s + 1)
        if nxt >= n:
            break
        heads.append(nxt)
    bounds = heads + [n]
    file_of = np.repeat(np.arange(len(heads)), np.diff(bounds)) if n else np.zeros(0, np.int64)
    offsets = before - before[np.array(heads, np.int64)][file_of] if n else before
    names = [_file_name(save_id, rank, f) for f in range(len(heads))]
    return FileTable(names, items, offsets, bounds)


def agree_on_tensors(local_plans: Sequence[LocalSavePlan]) -> dict[str, TensorSpec]:
    seen: dict[str, dict[TensorSpec, list[int]]] = {}
    for lp in local_plans:
        for key, spec in lp.tensors.items():
            seen.setdefault(key, {}).setdefault(spec, []).append(lp.rank)
    bad = []
    for key, variants in seen.items():
        if len(variants) > 1:
            desc = "; ".join(f"{s.dtype}{list(s.shape)} on ranks {rs}" for s, rs in variants.items())
            bad.append(f"{key}: {desc}")
    if bad:
        raise StateMismatchError("ranks disagree on global shape or dtype:\n  " + "\n  ".join(bad),
                                 shapes={k: tuple(dict.fromkeys(s.shape for s in v)) for k, v in seen.items()
                                         if len({s.shape for s in v}) > 1},
                                 dtypes={k: tuple(dict.fromkeys(s.dtype for s in v)) for k, v in seen.items()
                                         if len({s.dtype for s in v}) > 1})
    return {key: next(iter(v)) for key, v in sorted(seen.items())}


def agree_on_values(local_plans: Sequence[LocalSavePlan], tensors: dict[str, TensorSpec]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    first: dict[str, int] = {}
    bad = []
    for lp in local_plans:
        for key, v in lp.values.items():
            if key in tensors:
                bad.append(f"{key}: a tensor on some ranks, a plain value on rank {lp.rank}")
            elif key in values and not _same_value(values[key], v):
                bad.append(f"{key}: rank {first[key]} has {values[key]!r:.60}, rank {lp.rank} has {v!r:.60}")
            elif key not in values:
                values[key], first[key] = v, lp.rank
    if bad:
        raise StateMismatchError("plain values must be equal on every rank that holds them:\n  " + "\n  ".join(bad))
    return dict(sorted(values.items()))


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def _pack_files(save_id: str, rank: int, lp: LocalSavePlan, items: list[int], max_bytes: int):
    """Coalesce a rank's pieces into few files written sequentially, each piece aligned."""
    files: list[tuple[str, tuple[FileSlot, ...]]] = []
    slots: list[FileSlot] = []
    pos = 0

    def flush() -> None:
        nonlocal slots, pos
        if slots:
            files.append((slots[0].file, tuple(slots)))
        slots, pos = [], 0

    for idx in items:
        nbytes = lp.items[idx].nbytes
        if slots and pos + nbytes > max_bytes:
            flush()
        name = _file_name(save_id, rank, len(files))
        slots.append(FileSlot(idx, name, pos))
        pos += -(-nbytes // ALIGN) * ALIGN
    flush()
    return tuple(files)
