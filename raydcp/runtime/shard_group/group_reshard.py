"""The driver's side of ``ShardGroup.reshard``: one plan, one message per (old rank, new rank) pair.

Both layouts are known to the driver, so it plans the whole transfer alone
(:func:`raydcp.planner.transfer.plan_layout_transfer`, no gathered plans, no coordinator) and
starts every task at once (:mod:`raydcp.runtime.shard_group.reshard_steps` says what each does):

1. one ``publish`` task on old rank ``i``'s actor per new rank ``j`` it sends boxes to, in order
   of ``i`` (a kept actor's publishes come before its own receive); the plain values ride on the
   message of one sender of each added actor (or on a message of old rank 0 alone);
2. one ``take`` task on every new rank's actor with the refs of its messages (object store), or
   ``take_direct`` with the messages as arguments (Ray Direct Transport, ``transport="rdt"``);
3. the driver gathers the new ranks' outcomes (``raydcp.runtime.outcomes``) and drops its refs to
   the messages, which frees them.

A failed rank fails the reshard with one CheckpointError naming it; a dead sender is named by the
receivers that waited for it, and the group whose actor died refuses further operations.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

import ray

from ...errors import CheckpointError
from ...planner.transfer import plan_layout_transfer
from . import rdt
from ..outcomes import gather_outcomes

__all__ = ["run_reshard", "participants", "ReshardingGroup"]


class ReshardingGroup(Protocol):
    """What a reshard needs of a :class:`~raydcp.runtime.shard_group.ShardGroup` (either side)."""

    name: str
    world_size: int
    layout: str
    timeout_s: float
    actors: list

    @property
    def devices(self) -> Sequence[str]: ...

    def note_stragglers(self, refs: list) -> None: ...

    def mark_broken(self, reason: str) -> None: ...

# How long the driver keeps waiting for the other ranks once one failed (on top of timeout_s).
_STRAGGLER_GRACE_S = 5.0


def participants(old: ReshardingGroup, new_handles: list) -> list:
    """Every actor of a reshard, once each, in rank order: the old group's, then the added ones."""
    seen = {h._actor_id.hex() for h in old.actors}
    return old.actors + [h for h in new_handles if h._actor_id.hex() not in seen]


def run_reshard(old: ReshardingGroup, new: ReshardingGroup, reuse: list, specs: dict, keys: list, transport: str,
                backend: str | None = None, pending: "rdt.Pending | None" = None) -> dict:
    """Move ``old``'s state into ``new``'s actors; returns where the time went (for the bench)."""
    t0, wall0 = time.perf_counter(), time.time()
    n, m = old.world_size, new.world_size
    plan = plan_layout_transfer(specs, old.layout, n, new.layout, m, reuse)
    # moves travel as plain tuples (a NamedTuple costs Ray's pickler a Python call each)
    messages = {pair: [tuple(mv) for mv in moves] for pair, moves in plan.remote.items()}
    values_from: list = [None] * m
    for j in range(m):
        if not keys:
            continue
        if reuse[j] is not None:
            values_from[j] = "local"
        else:
            senders = sorted(i for (i, jj) in messages if jj == j)
            if not senders:  # nothing to move there but the values: a message of them alone
                messages[0, j] = ()
                senders = [0]
            values_from[j] = senders[0]
    direct = transport == "rdt"
    if direct:
        pending.wait(f"ShardGroup '{old.name}' reshard({m})")
    t_plan = time.perf_counter()
    pubs = {}
    for (i, j), moves in sorted(messages.items()):
        method = old.actors[i].publish
        if direct:
            method = method.options(tensor_transport=backend)
        pubs[i, j] = method.remote(old.name, i, moves, keys if values_from[j] == i else None, direct)
    # outcomes are numbered as the ranks of the transfer: this group's ranks 0..n-1 (the actors it
    # keeps receive under their old rank), then the added actors n, n+1, ...
    added = [j for j, i in enumerate(reuse) if i is None]
    refs, groups = {}, {}
    for j, actor in enumerate(new.actors):
        local = (old.name, reuse[j], [tuple(mv) for mv in plan.local[j]]) if reuse[j] is not None else None
        incoming = [(i, moves) for (i, jj), moves in sorted(messages.items()) if jj == j]
        args = (new.name, j, m, specs, keys, new.layout, old.name, local)
        if direct:
            ref = actor.take_direct.remote(*args, incoming, values_from[j], *[pubs[i, j] for i, _ in incoming])
        else:
            ref = actor.take.remote(*args, [(i, mv, [pubs[i, j]]) for i, mv in incoming], values_from[j],
                                    old.timeout_s)
        r = reuse[j] if reuse[j] is not None else n + added.index(j)
        refs[r] = ref
        groups[r] = [old, new] if reuse[j] is not None else [new]
    t_submit = time.perf_counter()
    out = gather_outcomes(refs, grace_s=old.timeout_s + _STRAGGLER_GRACE_S)
    t_gather = time.perf_counter()
    if not out.ok:
        _fail(old, new, out, groups, pubs, added)
    return {"start": wall0, "plan_s": t_plan - t0, "submit_s": t_submit - t_plan, "gather_s": t_gather - t_submit,
            "local_bytes": plan.local_bytes, "remote_bytes": plan.remote_bytes, "messages": len(messages),
            "transport": transport if not direct else f"rdt ({backend})", "ranks": out.results}


def _fail(old: ReshardingGroup, new: ReshardingGroup, out, groups: dict, pubs: dict, added: list) -> None:
    """Record what a failed reshard left behind (stuck tasks, dead actors) and raise its one error."""
    n, m = old.world_size, new.world_size
    for ref, r in out.pending.items():
        for group in groups[r]:
            group.note_stragglers([ref])
    if out.pending:  # senders still running count as the old group's stragglers (waited for, never fetched)
        _, unfinished = ray.wait(list(pubs.values()), num_returns=len(pubs), timeout=0)
        old.note_stragglers(unfinished)
    # a sender's death is seen by the ranks that waited for its pieces
    for i in sorted({i for e in out.errors.values() for i in getattr(e, "dead_sources", ())}):
        if i not in out.dead:
            out.dead.append(i)
        groups.setdefault(i, [old])
    out.dead.sort()
    for r in out.dead:
        for group in groups[r]:
            group.mark_broken(f"the actors of ranks {out.dead} died during reshard({m})")
    note = f"ranks 0-{n - 1}: this group" + (
        f", {n}-{n + len(added) - 1}: actors added for new ranks {added}" if added else "")
    raise out.error(f"ShardGroup '{old.name}' reshard({m})", note=note)


def choose_transport(old: ReshardingGroup, transport: str | None) -> str:
    """The transport of a reshard: as asked, or (None) RDT over NCCL where the tensors are CUDA and
    Ray's NCCL groups are available, else the object store."""
    if transport is not None:
        return transport
    if old.devices and all(d.startswith("cuda") for d in old.devices) and rdt.nccl_usable():
        return "rdt"
    return "object_store"


def check_backend(old: ReshardingGroup, new_devices: list[str], what: str) -> str:
    """The RDT backend for a reshard from ``old`` to actors on ``new_devices``; a CheckpointError if none fits."""
    backend = rdt.backend_for(list(old.devices) + list(new_devices), what)
    if backend == "nccl" and not rdt.nccl_usable():
        raise CheckpointError(f"{what}: RDT over NCCL needs Ray's NCCL collective groups, which need cupy "
                              f"(`pip install cupy-cuda12x`); use transport='object_store'")
    return backend
