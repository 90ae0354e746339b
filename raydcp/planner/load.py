"""Load planning for any N -> M: which source bytes each rank reads, and where each part goes.

Every needed byte of a source chunk is read by exactly one rank; a chunk is read by a
rank that needs part of it where possible (the one needing most of it, ties to the
least loaded), so read amplification is at most 1.0 and the reads are spread.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any, Mapping, Sequence

from ..errors import CheckpointError
from .boxes import byte_runs, intersect, merge_runs, numel
from .types import ChunkRead, Delivery, LocalLoadPlan, RankLoadPlan, SourceChunk, TensorSpec

__all__ = ["plan_load", "check_requests"]


def check_requests(
    available: Mapping[str, TensorSpec], values: Mapping[str, Any], local_plans: Sequence[LocalLoadPlan]
) -> None:
    """One CheckpointError naming every missing, unexpected or mismatched key (strict plans)."""
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
        parts.append(f"missing from the checkpoint ({len(missing)}): {_names(sorted(missing))}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the state dict ({len(unexpected)}): {_names(unexpected)}")
    if mismatched:
        parts.append("mismatched:\n    " + "\n    ".join(mismatched[k] for k in sorted(mismatched)))
    hint = " (pass strict=False to load only the keys both have)" if (missing or unexpected) and not mismatched else ""
    raise CheckpointError("cannot load: " + "; ".join(parts) + hint)


def _names(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


class _ChunkIndex:
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


def plan_load(
    sources: Mapping[str, Sequence[SourceChunk]],
    local_plans: Sequence[LocalLoadPlan],
    values: Mapping[str, Any],
    itemsizes: Mapping[str, int],
) -> list[RankLoadPlan]:
    """Assign every needed source chunk to one reader and list its deliveries (pure)."""
    world = len(local_plans)
    # deliveries per source chunk
    wanted: dict[tuple[str, int], list[Delivery]] = defaultdict(list)
    chunk_of: dict[tuple[str, int], SourceChunk] = {}
    needed = [0] * world
    index = {key: _ChunkIndex(chunks) for key, chunks in sources.items()}
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
        raise CheckpointError(
            f"the stored pieces of {_names(gaps)} do not cover the tensor exactly (a gap or an overlap); "
            f"the checkpoint is damaged: run `raydcp verify` on it and restore it from another copy")

    load = [0] * world
    reads: list[list[ChunkRead]] = [[] for _ in range(world)]
    incoming = [0] * world
    bytes_read = [0] * world
    order = sorted(wanted, key=lambda k: -chunk_of[k].nbytes)
    for k in order:
        ch, dels = chunk_of[k], wanted[k]
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
        reads[reader].append(ChunkRead(ch, tuple(dels)))
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
