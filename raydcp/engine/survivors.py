"""The survivors save: a collective save that commits without ranks that die before or during it.

``raydcp.save(..., options=SaveOptions(survivors=True))`` on a Ray group runs this instead of the
plain save (:func:`raydcp.engine.save.save_with`). It is the same three steps of the save protocol
(:mod:`raydcp.engine.protocol`: plan, write, commit) over a transport whose coordinator goes on
without ranks found lost (their process, actor or node gone): a lost rank's value reaches the
reductions below as a :class:`~raydcp.errors.RankLost`. Per attempt, every surviving rank:

1. **plan** -- sends its local plan, and what an earlier attempt had planned to save (``required``).
   :func:`reduce_plan_survivors` plans with an empty local plan in place of each lost rank, so the
   global plan is built from the survivors' plans alone: replicas of the lost ranks' pieces get a
   surviving writer. Before planning it checks that the survivors hold every piece: every key of
   ``required`` and every element of every tensor they name; if not, nothing is written and every
   survivor raises one :class:`~raydcp.errors.StateNotCoveredError` naming the keys and the lost
   ranks. Every survivor gets the save's header back (not only rank 0: rank 0 may be the one lost)
   and the ranks the plan gives files to write.
2. **write** -- each survivor writes its files, as in the plain save.
3. **commit** -- :func:`reduce_commit_survivors`: where no rank with files to write was lost, the
   metadata is built from the survivors' records and committed, recording the lost ranks
   (``Metadata.extra["lost_ranks"]``). Where a writer was lost after the plan, nothing is committed:
   every survivor raises :class:`~raydcp.errors.RanksLostError`, removes its files, and
   :func:`save_survivors_with` runs the steps again as a new operation of the group, whose
   coordinator knows the lost ranks from the start (``required`` carries what the first plan held,
   so keys only the lost writer held are named, not silently dropped).

Ranks announced to go (``SaveOptions.leaving``, a preemption notice's ranks) are planned around
from the start, so that their death at any moment changes nothing: where the other ranks hold every
piece a leaving rank holds (checked on its local plan, as above; leaving ranks one by one, so
that of two leaving ranks holding the same piece alone one is kept), the plan gives it nothing to
write (step 1), and the commit does not wait for it (step 3 completes
once every other rank arrived; one that comes later gets the metadata all the same). A leaving rank
that alone holds some piece is planned as any rank: the save needs it, and commits without it only
by a new attempt, as above.

A rank that fails (raises) still fails every rank, as in every save: survivors commits are for
lost ranks, not for errors. A rank lost before it sent its local plan cannot be checked against
(what it held is unknown): only pieces of tensors the survivors name are checked then.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Collection, Protocol, Sequence

from ..errors import CheckpointError, RankFailure, RankLost, RanksLostError, StateNotCoveredError
from ..metadata import Metadata
from ..options import SaveOptions
from ..planner import LocalSavePlan, SavePlanOptions
from ..state import flatten_state
from ..storage import CheckpointStorage, capacity
from .protocol import COMMIT_STEP, PLAN_STEP, commit_checkpoint, commit_metadata, name_storage_error, reduce_plan
from .save import discard_after_failure, local_save_plan, plan_options, rank_file_names, write_rank_files

__all__ = ["save_survivors_with", "reduce_plan_survivors", "reduce_commit_survivors", "uncovered_keys",
           "leaving_ranks", "SurvivorsTransport", "LOST_RANKS_KEY", "lost_ranks"]

LOST_RANKS_KEY = "lost_ranks"  # Metadata.extra[LOST_RANKS_KEY]: the ranks a survivors save committed without


class SurvivorsTransport(Protocol):
    """A survivors operation's transport (``open_transport(survivors=True)`` of a Ray group): a
    :class:`~raydcp.transport.Transport` whose rounds go on without ranks found lost, and whose
    ``reduce_scatter`` may be told the ranks a round need not wait for (``optional``)."""

    rank: int
    world_size: int

    def reduce_scatter(self, step: str, local: Any, reduce_fn: Callable, *, optional: Collection[int] = ()) -> Any:
        ...

    def close(self) -> None:
        ...


def save_survivors_with(open_transport: Callable[[], Any], state_dict: dict, checkpoint_id: str,
                        storage_options: dict | None, options: SaveOptions) -> Metadata:
    """The survivors save of one rank (every rank of the group calls it together; module doc).

    ``open_transport()`` opens a :class:`SurvivorsTransport` of the group's next operation; it is
    called once per attempt (an attempt after a writer was lost is a new operation)."""
    transport: SurvivorsTransport = open_transport()
    rank, world = transport.rank, transport.world_size
    try:
        local: Any = local_save_plan(rank, flatten_state(state_dict), compare_replicas=world > 1)
    except Exception as exc:
        local = RankFailure.from_exception(rank, exc)
    required: tuple = ()
    for attempt in range(world):
        if attempt:
            transport = open_transport()
        try:
            return _attempt(transport, local, required, checkpoint_id, storage_options, options)
        except StateNotCoveredError:
            raise
        except RanksLostError as exc:  # a writer was lost after the plan: plan again without it
            if attempt + 1 == world:
                raise
            required = exc.required
        finally:
            transport.close()
    raise AssertionError("unreachable")  # pragma: no cover


def leaving_ranks(options: SaveOptions) -> frozenset[int]:
    """The ranks ``options.leaving`` names (announced to go), whatever their node."""
    return frozenset(r for ranks in (options.leaving or {}).values() for r in ranks)


def _attempt(transport: SurvivorsTransport, local: Any, required: tuple, checkpoint_id: str,
             storage_options: dict | None, options: SaveOptions) -> Metadata:
    rank = transport.rank
    leaving = leaving_ranks(options)
    destination = (str(checkpoint_id), storage_options)
    value: Any = local
    staged = None if isinstance(local, RankFailure) else local
    if staged is not None:
        try:
            storage = CheckpointStorage(*destination)
            value = (storage.url, staged.plan, capacity.writer_site(storage), required)
        except Exception as exc:
            value = RankFailure.from_exception(rank, exc)
    plan, header, writers, lost = transport.reduce_scatter(
        PLAN_STEP, value, partial(reduce_plan_survivors, plan_options(options), destination, leaving=leaving))
    storage = CheckpointStorage(checkpoint_id, storage_options)
    try:
        written: Any = (write_rank_files(storage, plan, staged, io=options.io, compression=options.compression),
                        header, writers, lost)
    except Exception as exc:
        written = RankFailure.from_exception(rank, name_storage_error(exc, checkpoint_id))
    try:
        # the leaving ranks the plan gave nothing to write: the commit does not wait for them
        return transport.reduce_scatter(COMMIT_STEP, written,
                                        partial(reduce_commit_survivors, checkpoint_id, storage_options),
                                        optional=sorted(leaving - writers))
    except CheckpointError as exc:
        discard_after_failure(storage, [plan], exc)
        raise


def _lost(values: Sequence[Any]) -> list[RankLost]:
    return [v for v in values if isinstance(v, RankLost)]


def reduce_plan_survivors(options: SavePlanOptions, destination: tuple[str, dict | None],
                          values: Sequence[Any], leaving: Collection[int] = ()) -> list:
    """On the coordinator: step 1 (module doc). ``values[r]`` is ``(url, LocalSavePlan, writer site,
    required)`` or a RankLost; per rank ``(RankWritePlan, SaveHeader, writers, lost ranks)``.
    ``leaving``: ranks announced to go, given nothing to write where the others hold all they hold."""
    lost = _lost(values)
    live = [v for v in values if not isinstance(v, RankLost)]
    if not live:
        raise RanksLostError("save: plan: every rank of the group was lost; nothing was written",
                             lost_ranks=[v.rank for v in lost])
    lost_ranks = sorted(v.rank for v in lost)
    if lost:
        required = {k for v in live for k in v[3]}
        missing = uncovered_keys([v[1] for v in live], required)
        if missing:
            raise StateNotCoveredError(_not_covered_message(missing, lost), keys=sorted(missing),
                                       lost_ranks=lost_ranks, failures={v.rank: v.reason for v in lost})
    url, site = live[0][0], live[0][2]
    stand_in = {v.rank: (url, LocalSavePlan(v.rank, {}, (), {}), site) for v in lost}
    for r in _excused_writers(values, stand_in, leaving):  # the others hold all it holds: it writes nothing
        stand_in[r] = (values[r][0], LocalSavePlan(r, {}, (), {}), values[r][2])
    plans = [stand_in[r] if r in stand_in else v[:3] for r, v in enumerate(values)]
    out = reduce_plan(options, plans, destination)
    header = out[0][1]
    writers = frozenset(r for r, (plan, _) in enumerate(out) if rank_file_names(plan))
    return [(plan, header, writers, tuple(lost_ranks)) for plan, _ in out]


def _excused_writers(values: Sequence[Any], lost: Collection[int], leaving: Collection[int]) -> list[int]:
    """The leaving ranks the plan can leave without anything to write: one by one, each whose pieces
    the ranks still writing (the staying ones and the leaving ones not excused) hold whole."""
    going = [r for r in sorted(set(leaving)) if 0 <= r < len(values) and r not in lost]
    if not going or len(going) + len(lost) == len(values):
        return []
    held = {k for r in going for k in (*values[r][1].tensors, *values[r][1].values)}
    excused: list[int] = []
    for r in going:
        writing = [v[1] for q, v in enumerate(values) if q not in lost and q != r and q not in excused]
        if not uncovered_keys(writing, held):
            excused.append(r)
    return excused


def uncovered_keys(local_plans: Sequence[LocalSavePlan], required=()) -> dict[str, str]:
    """Key -> why, for every key of ``required`` no plan holds and every tensor the plans' pieces do
    not cover whole (their distinct pieces hold fewer elements than the tensor). Pure."""
    held: dict[str, set] = {}
    specs: dict[str, Any] = {}
    values: set[str] = set()
    for lp in local_plans:
        specs.update(lp.tensors)
        values.update(lp.values)
        for item in lp.items:
            held.setdefault(item.key, set()).add((tuple(item.offsets), tuple(item.sizes)))
    out: dict[str, str] = {}
    for key in sorted(set(required) - specs.keys() - values):
        out[key] = "held by no surviving rank"
    for key, spec in specs.items():
        total = math.prod(spec.shape)
        have = sum(math.prod(sizes) for _, sizes in held.get(key, ()))
        if have < total:
            out[key] = f"the surviving ranks hold {have} of its {total} elements"
    return out


def _not_covered_message(missing: dict[str, str], lost: Sequence[RankLost]) -> str:
    keys = sorted(missing)
    shown = "; ".join(f"{k}: {missing[k]}" for k in keys[:10]) + (f"; and {len(keys) - 10} more" if len(keys) > 10 else "")
    ranks = ", ".join(f"rank {v.rank} ({v.reason})" for v in sorted(lost, key=lambda v: v.rank))
    return (f"save: plan: the survivors cannot commit without the lost ranks: {len(keys)} keys were held only by "
            f"them ({shown}); lost: {ranks}. Nothing was committed; the previous checkpoint is still the newest. "
            "A survivors save needs every piece of the state on a surviving rank: replicate it (DDP, HSDP's "
            "replicate groups) or save more often")


def reduce_commit_survivors(checkpoint_id: str, storage_options: dict | None, values: Sequence[Any]) -> list:
    """On the coordinator: step 3 (module doc). ``values[r]`` is ``(StorageRecord, SaveHeader, writers,
    ranks lost at the plan)`` or a RankLost; the Metadata for every rank."""
    lost_now = _lost(values)
    live = [v for v in values if not isinstance(v, RankLost)]
    if not live:
        raise RanksLostError("save: commit: every rank of the group was lost; nothing was committed",
                             lost_ranks=[v.rank for v in lost_now])
    _, header, writers, lost_at_plan = live[0]
    gone_writers = sorted(v.rank for v in lost_now if v.rank in writers)
    if gone_writers:
        required = tuple(header.tensors) + tuple(header.values)
        raise RanksLostError(
            f"save: commit: ranks {gone_writers} were lost after the plan gave them files to write; nothing was "
            "committed and the surviving ranks plan the save again without them",
            lost_ranks=sorted({*lost_at_plan, *(v.rank for v in lost_now)}), required=required,
            failures={v.rank: v.reason for v in lost_now})
    md = commit_metadata([(record, header) for record, *_ in live])
    lost = sorted({*lost_at_plan, *(v.rank for v in lost_now)})
    if lost:
        md = replace(md, extra={**md.extra, LOST_RANKS_KEY: lost})
    commit_checkpoint(CheckpointStorage(checkpoint_id, storage_options), md)
    return [md] * len(values)


def lost_ranks(md: Metadata) -> list[int]:
    """The ranks a checkpoint was committed without (a survivors save; empty for any other)."""
    lost = md.extra.get(LOST_RANKS_KEY) if isinstance(md.extra, dict) else None
    return [int(r) for r in lost] if isinstance(lost, (list, tuple)) else []
