"""Transfer planning (pure): a live group's pieces to another layout, with no storage round trip.

The in-memory reshard (``raydcp.ShardGroup.reshard``, ``raydcp.engine.transfer``) is a load whose
source chunks are the pieces the source ranks hold: :func:`plan_transfer` turns every rank's
(source plan, destination plan) into the chunks each source rank can serve, checks that they form
whole tensors and that the destination asks for what they hold, and plans which rank sends which
part to which (:func:`raydcp.planner.plan_load`: each needed piece served by one of its holders,
the least loaded).
"""
from __future__ import annotations

from typing import Sequence

from ..codec import itemsize
from ..errors import CheckpointError
from .load import check_requests, plan_load
from .save import _agree_on_tensors, _agree_on_values
from .tiling import piece_problems
from .types import LocalLoadPlan, LocalSavePlan, RankLoadPlan, SourceChunk

__all__ = ["plan_transfer"]


def plan_transfer(pairs: Sequence[tuple[LocalSavePlan | None, LocalLoadPlan | None]]) -> list[RankLoadPlan]:
    """Per rank, what it sends and receives; ``pairs[r]`` is rank r's (source plan or None, plan of
    the pieces it wants or None). A CheckpointError names source pieces that do not form whole
    tensors, tensors or values the ranks disagree on, and every key the destination cannot get."""
    sources = [p[0] for p in pairs if p[0] is not None]
    tensors = _agree_on_tensors(sources)
    values = _agree_on_values(sources, tensors)
    chunks: dict[str, dict[tuple, SourceChunk]] = {}
    for sp in sources:
        for it in sp.items:  # a rank holds at most one piece per key: holders serve it by key
            box = (it.offsets, it.sizes)
            prev = chunks.setdefault(it.key, {}).get(box)
            holders = (prev.holders if prev else ()) + (sp.rank,)
            chunks[it.key][box] = SourceChunk(it.key, tensors[it.key].dtype, it.offsets, it.sizes,
                                              nbytes=it.nbytes, holders=holders)
    problems = [p for k, s in tensors.items() for p in piece_problems(k, s.shape, list(chunks.get(k, {})))]
    if problems:
        raise CheckpointError("the source group's pieces do not form whole tensors:\n  " + "\n  ".join(problems))
    dests = [p[1] if p[1] is not None else LocalLoadPlan(r, {}, (), (), strict=False) for r, p in enumerate(pairs)]
    check_requests(tensors, values, dests)
    itemsizes = {k: itemsize(s.dtype) for k, s in tensors.items()}
    return plan_load({k: list(v.values()) for k, v in chunks.items()}, dests, values, itemsizes)
