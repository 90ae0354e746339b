"""Global save planning: validate local plans, write each replica once, balance bytes, coalesce."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import CheckpointError
from .boxes import numel
from .types import FileSlot, GlobalSavePlan, LocalSavePlan, RankWritePlan, TensorSpec

__all__ = ["SavePlanOptions", "plan_save"]

ALIGN = 64  # every piece starts at a multiple of this in its file (mmap- and SIMD-friendly)


@dataclass(frozen=True, kw_only=True)
class SavePlanOptions:
    max_file_bytes: int = 256 << 20   # a rank's pieces are coalesced into files up to this size
    save_id: str | None = None        # fixed id for reproducible plans (tests); random otherwise

    def __post_init__(self) -> None:
        if self.max_file_bytes < ALIGN:
            raise CheckpointError(f"max_file_bytes must be >= {ALIGN}, got {self.max_file_bytes}")


def plan_save(local_plans: Sequence[LocalSavePlan], options: SavePlanOptions = SavePlanOptions()) -> GlobalSavePlan:
    """Build the global save plan from every rank's local plan (pure; raises CheckpointError)."""
    world = len(local_plans)
    for i, lp in enumerate(local_plans):
        if lp.rank != i:
            raise CheckpointError(f"local plans out of order: position {i} holds rank {lp.rank}")
    tensors = _agree_on_tensors(local_plans)
    values = _agree_on_values(local_plans, tensors)

    # group identical boxes (replicas) and check each tensor is tiled exactly
    boxes: dict[str, dict[tuple, list[tuple[int, int]]]] = {}
    for lp in local_plans:
        for idx, it in enumerate(lp.items):
            boxes.setdefault(it.key, {}).setdefault((it.offsets, it.sizes), []).append((lp.rank, idx))
    problems: list[str] = []
    for key, spec in tensors.items():
        problems.extend(_tiling_problems(key, spec.shape, list(boxes.get(key, {}))))
        for holders in boxes.get(key, {}).values():
            sums = {local_plans[r].items[i].checksum for r, i in holders} - {None}
            if len(sums) > 1:
                ranks = sorted(r for r, _ in holders)
                off = local_plans[holders[0][0]].items[holders[0][1]].offsets
                problems.append(f"{key}: replicas on ranks {ranks} differ (piece at {off}); "
                                f"the ranks' values diverged before saving")
    if problems:
        raise CheckpointError("inconsistent state across ranks:\n  " + "\n  ".join(problems[:50])
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

    save_id = options.save_id or uuid.uuid4().hex[:16]
    ranks = tuple(
        RankWritePlan(r, save_id, _pack_files(save_id, r, local_plans[r], sorted(assigned[r]), options.max_file_bytes))
        for r in range(world)
    )
    return GlobalSavePlan(save_id, world, tensors, values, ranks, tuple(load))


def _agree_on_tensors(local_plans: Sequence[LocalSavePlan]) -> dict[str, TensorSpec]:
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
        raise CheckpointError("ranks disagree on global shape or dtype:\n  " + "\n  ".join(bad))
    return {key: next(iter(v)) for key, v in sorted(seen.items())}


def _agree_on_values(local_plans: Sequence[LocalSavePlan], tensors: dict[str, TensorSpec]) -> dict[str, Any]:
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
        raise CheckpointError("plain values must be equal on every rank that holds them:\n  " + "\n  ".join(bad))
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


def _tiling_problems(key: str, shape: tuple[int, ...], boxes: list[tuple]) -> list[str]:
    """Distinct boxes must lie inside the tensor, not overlap, and cover it exactly."""
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
        name = f"data/{save_id}/r{rank:05d}-f{len(files):03d}.bin"
        slots.append(FileSlot(idx, name, pos))
        pos += -(-nbytes // ALIGN) * ALIGN
    flush()
    return tuple(files)
