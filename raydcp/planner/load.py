"""Load planning for any N -> M: which source bytes each rank reads, and where each part goes.

Every needed byte of a source chunk is read by exactly one rank; a chunk is read by a
rank that needs part of it where possible (the one needing most of it, ties to the
least loaded), so read amplification is at most 1.0 and the reads are spread.

A stored chunk of at least ``SPLIT_MIN_BYTES`` that several ranks need in
disjoint parts which together cover it -- the usual case when a row-sharded
checkpoint is loaded onto a different number of ranks -- is not read by one rank
and forwarded: each rank reads exactly its own part (``ChunkRead.joint``), so
those bytes never go through the exchange. A checksum block that straddles two
parts is verified jointly: each reader checksums its share of the block and the
load's last step combines the shares and compares them with the stored
checksum, so nothing is read twice and every byte is still verified.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

from ..errors import CheckpointDamagedError, CheckpointError, StateMismatchError
from ..metadata import ChunkColumns, ChunkTable
from .boxes import byte_runs, intersect, merge_runs, numel
from .chunk_index import ChunkIndex
from .joint_reads import SPLIT_MIN_BYTES, splits_jointly
from .load_arrays import plan_load_columns, shown_keys
from .sources import StoredSources
from .tiling import require_tiling
from .types import ChunkRead, Delivery, LocalLoadPlan, RankLoadPlan, SourceChunk, StoredChunks, TensorSpec

__all__ = ["plan_load", "check_requests", "stored_sources", "untiled_sources", "SPLIT_MIN_BYTES"]


def check_requests(
    available: Mapping[str, TensorSpec], values: Mapping[str, Any], local_plans: Sequence[LocalLoadPlan]
) -> None:
    """One CheckpointError naming every missing, unexpected or mismatched key (strict plans).

    Ranks whose plans want the same tensors (equal signatures), the same plain values and the same
    strictness are checked once; where that finds a problem, every rank is checked to name it.
    """
    distinct: dict[tuple, LocalLoadPlan] = {}
    for lp in local_plans:
        cols = getattr(lp, "columns", None)
        group = (cols.signature, lp.strict, tuple(lp.values)) if cols is not None else (lp.rank,)
        distinct.setdefault(group, lp)
    if len(distinct) < len(local_plans):
        try:
            _check_requests(available, values, list(distinct.values()))
            return
        except CheckpointError:
            pass
    _check_requests(available, values, local_plans)


def _check_requests(
    available: Mapping[str, TensorSpec], values: Mapping[str, Any], local_plans: Sequence[LocalLoadPlan]
) -> None:
    strict = any(lp.strict for lp in local_plans)
    missing: set[str] = set()
    mismatched: dict[str, str] = {}
    requested: set[str] = set()
    for lp in local_plans:
        for key, spec in lp.tensors.items():
            requested.add(key)
            have = available.get(key)
            if have is None:
                if key in values:
                    mismatched[key] = f"{key}: wanted a tensor {spec.dtype}{list(spec.shape)}, checkpoint holds a plain value"
                elif lp.strict:
                    missing.add(key)
            elif have.shape != spec.shape:
                mismatched[key] = f"{key}: checkpoint has shape {list(have.shape)}, rank {lp.rank} wants {list(spec.shape)}"
            elif have.dtype != spec.dtype:
                mismatched[key] = f"{key}: checkpoint has dtype {have.dtype}, rank {lp.rank} wants {spec.dtype}"
        for key in lp.values:
            requested.add(key)
            if key not in values:
                if key in available:
                    mismatched[key] = f"{key}: wanted a plain value, checkpoint holds a tensor"
                elif lp.strict:
                    missing.add(key)
    unexpected = sorted((set(available) | set(values)) - requested) if strict else []
    if not (missing or mismatched or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint ({len(missing)}): {shown_keys(sorted(missing))}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the state dict ({len(unexpected)}): {shown_keys(unexpected)}")
    if mismatched:
        parts.append("mismatched:\n    " + "\n    ".join(mismatched[k] for k in sorted(mismatched)))
    hint = " (pass strict=False to load only the keys both have)" if (missing or unexpected) and not mismatched else ""
    raise StateMismatchError("cannot load: " + "; ".join(parts) + hint, missing_keys=sorted(missing),
                             unexpected_keys=unexpected, **_spec_mismatches(available, local_plans, mismatched))


def _spec_mismatches(available: Mapping[str, TensorSpec], local_plans: Sequence[LocalLoadPlan],
                     keys) -> dict[str, dict[str, tuple]]:
    """``shapes`` and ``dtypes`` of a StateMismatchError: key -> (in the checkpoint, wanted by a rank)."""
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, tuple] = {}
    for lp in local_plans:
        for key, spec in lp.tensors.items():
            have = available.get(key)
            if key not in keys or have is None:
                continue
            if have.shape != spec.shape:
                shapes.setdefault(key, (tuple(have.shape), tuple(spec.shape)))
            elif have.dtype != spec.dtype:
                dtypes.setdefault(key, (have.dtype, spec.dtype))
    return {"shapes": shapes, "dtypes": dtypes}


def stored_sources(md) -> Mapping[str, StoredChunks]:
    """The source chunks of a checkpoint's metadata, as columns (no per-chunk objects). Decoded
    metadata gives a mapping over its shared chunk columns: the planner takes them whole, and
    the per-tensor StoredChunks are built only if a caller looks one up.

    The chunks must tile their tensors exactly (CheckpointError otherwise): a load fills only what
    the chunks cover, so a gap left by an overlap would keep the destination's old values.
    """
    require_tiling(md.tensors)
    return untiled_sources(md)


def untiled_sources(md) -> Mapping[str, StoredChunks]:
    """:func:`stored_sources` without the tiling check."""
    if isinstance(getattr(md.tensors, "columns", None), ChunkColumns):
        return StoredSources(md.tensors)
    return {key: StoredChunks(key, t.dtype, ChunkTable.from_chunks(t.chunks, len(t.shape)))
            for key, t in md.tensors.items()}


def plan_load(
    sources: Mapping[str, Sequence[SourceChunk]],
    local_plans: Sequence[LocalLoadPlan],
    values: Mapping[str, Any],
    itemsizes: Mapping[str, int],
    *,
    joint_reads: bool = True,
    tiles=None,
    cache=None,
) -> list[RankLoadPlan]:
    """Assign every needed source chunk to one reader and list its deliveries (pure).

    The work is done on arrays: the chunks a request overlaps are found by a binary search where
    a tensor's chunks are split along one dimension, box by box otherwise. A chunk needed by one
    rank is read by that rank; a chunk needed by several is read, largest first, by the needing
    rank for which (bytes already assigned - bytes of the chunk it needs) is least; a live chunk
    (``holders`` set) by its least loaded holder. ``joint_reads=False``: no chunk is split into
    joint reads (stored chunks that are read whole, compressed ones).

    ``tiles``: a checkpoint's ``Metadata.tensors`` whose chunks ``sources`` are; the plan then also
    checks that they tile their tensors exactly (:func:`require_tiling`, the CheckpointError it
    raises): on the arrays the plan lays out anyway where ``sources`` are ``stored_sources``'s
    columns of a decoded checkpoint, on its own otherwise.

    ``cache``: a :class:`~raydcp.planner.PlanCache` the caller keeps between loads; a load with
    the requests of the last one (every rank's layout digest) from chunks in the same places
    (compared array by array) reuses its reads and takes the files and checksums anew.
    """
    on_line = tiles is not None and isinstance(sources, StoredSources) and sources.tensors is tiles \
        and hasattr(tiles, "shapes")
    if tiles is not None and not on_line:
        require_tiling(tiles)
    planned = plan_load_columns(sources, local_plans, values, itemsizes, joint_reads, tiles if on_line else None,
                                cache if on_line else None)
    if planned is not None:
        return planned
    if on_line:  # the array path stopped before its check
        require_tiling(tiles)
    return _plan_load_objects(sources, local_plans, values, itemsizes, joint_reads)


def _plan_load_objects(
    sources: Mapping[str, Sequence[SourceChunk]],
    local_plans: Sequence[LocalLoadPlan],
    values: Mapping[str, Any],
    itemsizes: Mapping[str, int],
    joint_reads: bool = True,
) -> list[RankLoadPlan]:
    """The general path of :func:`plan_load`: a Python object per chunk and delivery."""
    world = len(local_plans)
    # deliveries per source chunk
    wanted: dict[tuple[str, int], list[Delivery]] = defaultdict(list)
    chunk_of: dict[tuple[str, int], SourceChunk] = {}
    needed = [0] * world
    index = {key: ChunkIndex(chunks) for key, chunks in sources.items()}
    for lp in local_plans:
        for idx, it in enumerate(lp.items):
            ix = index.get(it.key)
            if ix is None:
                continue
            for ci in ix.candidates(it.offsets, it.sizes):
                ch = ix.chunks[ci]
                box = intersect(ch.offsets, ch.sizes, it.offsets, it.sizes)
                if box is None:
                    continue
                wanted[(it.key, ci)].append(Delivery(lp.rank, idx, box[0], box[1]))
                chunk_of[(it.key, ci)] = ch
                needed[lp.rank] += numel(box[1]) * itemsizes[it.key]

    covered: dict[tuple[int, int], int] = defaultdict(int)
    for dels in wanted.values():
        for d in dels:
            covered[(d.rank, d.item)] += numel(d.sizes)
    gaps = sorted({it.key for lp in local_plans for idx, it in enumerate(lp.items)
                   if it.key in sources and covered[(lp.rank, idx)] != numel(it.sizes)})
    if gaps:
        raise CheckpointDamagedError(
            f"the stored pieces of {shown_keys(gaps)} do not cover the tensor exactly (a gap or an overlap); "
            f"the checkpoint is damaged: run `raydcp verify` on it and restore it from another copy")

    load = [0] * world
    reads: list[list[ChunkRead]] = [[] for _ in range(world)]
    incoming = [0] * world
    bytes_read = [0] * world
    order = sorted(wanted, key=lambda k: -chunk_of[k].nbytes)
    parts = []  # (chunk, deliveries read together): a large chunk needed in disjoint parts, per rank
    for k in order:
        ch, dels = chunk_of[k], wanted[k]
        by_rank: dict[int, list[Delivery]] = {}
        for d in dels:
            by_rank.setdefault(d.rank, []).append(d)
        if joint_reads and ch.holders is None and ch.nbytes >= SPLIT_MIN_BYTES and len(by_rank) > 1 and splits_jointly(
                {r: [x for d in ds for x in byte_runs(ch.offsets, ch.sizes, d.offsets, d.sizes, itemsizes[ch.key])]
                 for r, ds in by_rank.items()}, ch.nbytes):
            parts += [(ch, ds, True) for ds in by_rank.values()]
        else:
            parts.append((ch, dels, False))
    for ch, dels, joint in parts:
        isz = itemsizes[ch.key]
        runs = merge_runs([r for d in dels for r in byte_runs(ch.offsets, ch.sizes, d.offsets, d.sizes, isz)])
        nread = sum(e - s for s, e in runs)
        if ch.holders is None:
            share: dict[int, int] = defaultdict(int)
            for d in dels:
                share[d.rank] += numel(d.sizes)
            reader = min(share, key=lambda r: (-share[r], load[r], r)) if len(share) == 1 else \
                min(share, key=lambda r: (load[r] - share[r] * isz, r))
        else:
            reader = min(ch.holders, key=lambda r: (load[r], r))
        load[reader] += nread
        bytes_read[reader] += nread
        reads[reader].append(ChunkRead(ch, tuple(dels), joint))
        for d in dels:
            if d.rank != reader:
                incoming[d.rank] += 1

    plans = []
    for lp in local_plans:
        plans.append(RankLoadPlan(
            rank=lp.rank,
            reads=tuple(reads[lp.rank]),
            incoming=incoming[lp.rank],
            values={k: values[k] for k in lp.values if k in values},
            bytes_read=bytes_read[lp.rank],
            bytes_needed=needed[lp.rank],
        ))
    return plans
