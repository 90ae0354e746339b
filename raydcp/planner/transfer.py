"""Transfer planning (pure): a live group's pieces to another layout, with no storage round trip.

The in-memory reshard (``raydcp.ShardGroup.reshard``, ``raydcp.engine.transfer``) is a load whose
source chunks are the pieces the source ranks hold: :func:`plan_transfer` turns every rank's
(source plan, destination plan) into the chunks each source rank can serve, checks that they form
whole tensors and that the destination asks for what they hold, and plans which rank sends which
part to which (:func:`raydcp.planner.plan_load`: each needed piece served by one of its holders,
the least loaded).

A ShardGroup's own reshard knows both layouts (``raydcp.planner.layouts``), so it needs no gathered
plans: :func:`plan_layout_transfer` computes from the specs alone which box of each tensor every
old rank sends to every new rank, and which boxes stay in an actor that takes part on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..codec import itemsize
from ..errors import CheckpointError
from .layouts import Specs, check_layout, piece_box, shard_dim
from .load import check_requests, plan_load
from .save import agree_on_tensors, agree_on_values
from .tiling import piece_problems
from .types import LocalLoadPlan, LocalSavePlan, RankLoadPlan, SourceChunk

__all__ = ["plan_transfer", "plan_layout_transfer", "LayoutTransfer", "Move"]


def plan_transfer(pairs: Sequence[tuple[LocalSavePlan | None, LocalLoadPlan | None]]) -> list[RankLoadPlan]:
    """Per rank, what it sends and receives; ``pairs[r]`` is rank r's (source plan or None, plan of
    the pieces it wants or None). A CheckpointError names source pieces that do not form whole
    tensors, tensors or values the ranks disagree on, and every key the destination cannot get."""
    sources = [p[0] for p in pairs if p[0] is not None]
    tensors = agree_on_tensors(sources)
    values = agree_on_values(sources, tensors)
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


# ----------------------------------------------------------------------------- between two layouts

class Move(NamedTuple):
    """One box of one tensor that a layout transfer moves (global offsets and sizes)."""

    key: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class LayoutTransfer:
    """Who moves what in a transfer between two layouts of one state (:func:`plan_layout_transfer`).

    ``local[j]``: the moves new rank ``j`` copies inside its own actor, from the piece old rank
    ``reuse[j]`` holds there; ``remote[(i, j)]``: the moves old rank ``i`` sends to new rank
    ``j`` (one message per pair, its moves in this order on both sides). Together they cover
    every byte of every new piece exactly once.
    """

    old_world: int
    new_world: int
    reuse: tuple[int | None, ...]
    local: tuple[tuple[Move, ...], ...]
    remote: dict[tuple[int, int], tuple[Move, ...]]

    def incoming(self, j: int) -> list[tuple[int, tuple[Move, ...]]]:
        """``(old rank, moves)`` of every message new rank ``j`` receives, by old rank."""
        return [(i, mv) for (i, jj), mv in sorted(self.remote.items()) if jj == j]

    @property
    def local_bytes(self) -> int:
        return sum(mv.nbytes for moves in self.local for mv in moves)

    @property
    def remote_bytes(self) -> int:
        return sum(mv.nbytes for moves in self.remote.values() for mv in moves)


def plan_layout_transfer(specs: Specs, old_layout: str, n: int, new_layout: str, m: int,
                         reuse: Sequence[int | None] | None = None) -> LayoutTransfer:
    """Plan moving a state held in ``old_layout`` by ``n`` ranks to ``new_layout`` on ``m`` ranks.

    ``specs``: key -> (global shape, dtype name). ``reuse[j]``: the old rank whose actor also
    holds new rank ``j`` (``raydcp.planner.layouts.reuse_ranks``), or None; the bytes both of
    its pieces cover are copied inside that actor. Every other byte of a new piece comes from
    the one old rank holding it; a tensor every old rank holds whole comes from the actor
    itself where reused, else from the old rank sending the fewest bytes so far.
    """
    check_layout(old_layout)
    check_layout(new_layout)
    if n < 1 or m < 1:
        raise CheckpointError(f"a layout transfer needs ranks on both sides, got {n} -> {m}")
    reuse = tuple(reuse) if reuse is not None else (None,) * m
    taken = [i for i in reuse if i is not None]
    if len(reuse) != m or any(not 0 <= i < n for i in taken) or len(set(taken)) != len(taken):
        raise CheckpointError(f"reuse {list(reuse)} must name, for each of {m} new ranks, a distinct old rank "
                              f"of {n} or None")
    local: list[list[Move]] = [[] for _ in range(m)]
    remote: dict[tuple[int, int], list[Move]] = {}
    sent = [0] * n
    geometry: dict[tuple, list] = {}  # the boxes depend on the shape only: worked out once per shape
    for key, (shape, dtype) in specs.items():
        shape = tuple(shape)
        geo = geometry.get(shape)
        if geo is None:
            geo = geometry[shape] = _geometry(shape, old_layout, n, new_layout, m)
        isz = itemsize(dtype)
        for j, holders, box in geo:
            if holders is None:  # every old rank holds it whole
                i = reuse[j] if reuse[j] is not None else min(range(n), key=lambda r: (sent[r], abs(r * m - j * n), r))
                holders = ((i, box),)
            for i, (off, sz, count) in holders:
                mv = Move(key, dtype, off, sz, count * isz)
                if reuse[j] == i:
                    local[j].append(mv)
                else:
                    remote.setdefault((i, j), []).append(mv)
                    sent[i] += mv.nbytes
    return LayoutTransfer(n, m, reuse, tuple(tuple(x) for x in local), {k: tuple(v) for k, v in remote.items()})


def _geometry(shape: tuple[int, ...], old_layout: str, n: int, new_layout: str, m: int) -> list:
    """For each new rank with a non-empty piece of a tensor of ``shape``: ``(rank, holders, its box)``,
    boxes as ``(offsets, sizes, element count)``; holders as :func:`_holders`."""
    out = []
    for j in range(m):
        off, sz = piece_box(shape, new_layout, j, m) or ((0,) * len(shape), shape)
        count = _count(sz)
        if count:
            out.append((j, _holders(shape, old_layout, n, off, sz), (off, sz, count)))
    return out


def _holders(shape: tuple[int, ...], layout: str, n: int, offsets, sizes) -> list | None:
    """``(old rank, its part of the box)`` for every old rank holding part of the box ``offsets, sizes``,
    parts as ``(offsets, sizes, element count)``; None if every old rank holds the tensor whole."""
    d = shard_dim(shape, layout)
    if d is None:
        return None
    lo, hi = offsets[d], offsets[d] + sizes[d]
    step = -(-shape[d] // n)
    out = []
    for i in range(lo // step, min(n, -(-hi // step))):
        a, b = max(lo, i * step), min(hi, (i + 1) * step, shape[d])
        if a < b:
            part = sizes[:d] + (b - a,) + sizes[d + 1:]
            out.append((i, (offsets[:d] + (a,) + offsets[d + 1:], part, _count(part))))
    return out


def _count(sizes) -> int:
    total = 1
    for s in sizes:
        total *= s
    return total
