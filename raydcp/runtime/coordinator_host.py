"""The cluster's coordinator host: one actor running the :class:`Coordinator` of every operation of
every group (``raydcp.Group``, ShardGroups, Ray Train's worker groups, reshard jobs).

Why one for the cluster: an operation needs its coordinator at once, and starting an actor (a
worker process, its imports) costs seconds. The host is a detached, named actor
(:mod:`raydcp.runtime.actors` starts it, get-or-create), so only the first operation in a fresh
cluster, or the first after the host died, waits for it; a new group is a small state in it.

Protocol, as the host sees it (the rank's side is :mod:`raydcp.runtime.ray_transport`):

1. Every call names its operation by ``(owner, group name, number)``: the group's name and the
   rank-side number of the operation (:mod:`raydcp.runtime.groups`), and the *owner* whose state
   holds it (the group's own name, or the ShardGroup whose operations run under names of their
   own, so that ``release(owner)`` drops them together).
2. The first call of an operation makes its coordinator. A rank's first call must be its call 1
   (the Coordinator checks): a later one means the host that saw its earlier calls died, and the
   operation fails on every rank with a ``CoordinatorLostError`` rather than waiting.
3. When an operation ends (every rank closed it, or it failed), its coordinator is dropped at once
   and a record of how it ended is kept for the operation's ``timeout_s``: a rank that comes late
   to a failed operation gets the failure at once, and a second caller for a rank of a completed
   one is refused instead of starting it again.
4. Bounded state: at most :attr:`CoordinatorHost.max_records` records per owner, the oldest
   forgotten first; an owner's state is dropped once it has no operation and no record left (or
   by ``release``); of owners without a running operation at most
   :attr:`CoordinatorHost.max_idle_owners` are kept, least recently used dropped first.

Concurrency: an asyncio actor. A waiting rank is an awaiting coroutine, and every reduction
(decoding the ranks' plans, planning, encoding the replies) runs in a worker thread, so a stalled
rank or a long planning of one group never holds up another group's calls.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

from ..errors import CheckpointError, CoordinatorLostError, RankFailure, raise_failures
from ..transport import decode, encode
from .coordinator import Coordinator, planning_pages

__all__ = ["CoordinatorHost", "OpKey"]

OpKey = tuple  # (owner, group name, operation number)


class _Ended(NamedTuple):
    error: CheckpointError | None  # None: the operation completed
    seen: frozenset  # the ranks that took part in it
    until: float  # monotonic time until which the record is kept


class _Owner:
    """The state of one owner in the host: its running operations and the records of ended ones."""

    __slots__ = ("ops", "ended", "released")

    def __init__(self) -> None:
        self.ops: dict[tuple[str, int], _HostedCoordinator] = {}
        self.ended: OrderedDict[tuple[str, int], _Ended] = OrderedDict()
        self.released = False  # release() came while operations ran: drop the state with the last one


class _HostedCoordinator(Coordinator):
    """A Coordinator whose end drops it from its host."""

    def __init__(self, host: "CoordinatorHost", owner: str, *args):
        super().__init__(*args)
        self._host, self._owner = host, owner
        self._executor = host.executor

    def _on_end(self) -> None:
        self._host._drop(self._owner, self)


class _OnWire:
    """A rank's reduction as the host runs it (in a worker thread): decode every rank's value (a
    ``raydcp.transport.Wire``, or the value itself), reduce, and encode each distinct reply once
    (the commit's metadata is one object for every rank)."""

    __slots__ = ("step", "reduce_fn")

    def __init__(self, step: str, reduce_fn: Callable):
        self.step, self.reduce_fn = step, reduce_fn

    def __call__(self, values: list[Any]) -> list[Any]:
        decoded = []
        for rank, value in enumerate(values):
            try:
                decoded.append(decode(value))
            except Exception as exc:  # the rank takes part as a failure, so that no rank waits for it
                decoded.append(RankFailure(rank, f"its value could not be decoded by the coordinator: "
                                                 f"{type(exc).__name__}: {exc}"))
        raise_failures(self.step, [v for v in decoded if isinstance(v, RankFailure)])
        out = self.reduce_fn(decoded)
        wires: dict[int, Any] = {}
        replies = []
        for value in out:
            if value is None or isinstance(value, BaseException):
                replies.append(value)
                continue
            wire = wires.get(id(value))
            if wire is None:
                try:
                    wire = encode(value)
                except Exception:  # Ray's own pickling then
                    wire = value
                wires[id(value)] = wire
            replies.append(wire)
        return replies


class CoordinatorHost:
    """The coordinators of every running operation in the cluster (see the module doc).

    ``clock``: the monotonic clock the records' lifetimes are measured with (tests pass their own).
    """

    max_records = 256  # records of ended operations kept per owner
    max_idle_owners = 4096  # owners without a running operation whose records are kept
    sweep_every_s = 1.0  # how often expired records are looked for
    reduction_threads = 32  # reductions of this many operations run at once (more wait for a thread)

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        planning_pages()  # this process plans: ordinary pages for its short-lived arrays
        import raydcp.engine  # noqa: F401  (what unpickling the ranks' reductions needs, once, at start)

        self._now = clock
        self.executor = ThreadPoolExecutor(self.reduction_threads, thread_name_prefix="raydcp-reduce")
        self.owners: OrderedDict[str, _Owner] = OrderedDict()  # least recently used first
        self._live = 0  # running operations, all owners together
        self._last_sweep = clock()

    # -- the ranks' calls -----------------------------------------------------------------------
    async def reduce_scatter(self, key: OpKey, timeout_s, rank, world_size, seq, step, local, reduce_fn):
        """``local`` and the reply travel as ``raydcp.transport.Wire`` where the rank could encode them."""
        coord, ended = self._coordinator(key, world_size, timeout_s, rank, step)
        if coord is None:
            return ended
        _, value = await coord.reduce_scatter(rank, world_size, seq, step, local, self._reduction(step, reduce_fn))
        return value

    def _reduction(self, step: str, reduce_fn: Callable) -> Callable[[list], list]:
        """What a worker thread runs once the round is complete (a subclass may wrap it, e.g. to profile it)."""
        return _OnWire(step, reduce_fn)

    async def exchange(self, key: OpKey, timeout_s, rank, world_size, seq, step, outgoing):
        coord, ended = self._coordinator(key, world_size, timeout_s, rank, step)
        if coord is None:
            return ended
        _, value = await coord.exchange(rank, world_size, seq, step, outgoing)
        return value

    async def close(self, key: OpKey, rank: int) -> bool:
        owner = self.owners.get(key[0])
        coord = None if owner is None else owner.ops.get(tuple(key[1:]))
        return False if coord is None else await coord.close(rank)

    # -- for prepare(), release, tests and tools ------------------------------------------------
    async def ready(self) -> bool:
        """True once the host is up (its imports done)."""
        return True

    async def release(self, owner: str) -> bool:
        """``owner`` runs no more operations (a ShardGroup shut down): drop its state now."""
        state = self.owners.get(owner)
        if state is None:
            return False
        state.ended.clear()
        if state.ops:
            state.released = True
        else:
            del self.owners[owner]
        return True

    async def status(self, key: OpKey | None = None):
        """The host's totals, or one operation's status (``{"ended": ...}`` once it ended, None if unknown)."""
        if key is None:
            return {"owners": len(self.owners), "live": self._live,
                    "records": sum(len(s.ended) for s in self.owners.values()),
                    "ops": sorted((o, *k) for o, s in self.owners.items() for k in s.ops)}
        state = self.owners.get(key[0])
        op = tuple(key[1:])
        if state is None:
            return None
        coord = state.ops.get(op)
        if coord is not None:
            return await coord.status()
        rec = state.ended.get(op)
        if rec is None:
            return None
        return {"group": op[0], "op": op[1], "ended": True, "failed": None if rec.error is None else str(rec.error)}

    async def owner_status(self, owner: str) -> dict | None:
        """One owner's state: its running operations and records (None once released)."""
        state = self.owners.get(owner)
        if state is None:
            return None
        return {"ops": sorted(state.ops), "records": len(state.ended), "released": state.released}

    # -- operations -----------------------------------------------------------------------------
    def _coordinator(self, key: OpKey, world_size: int, timeout_s: float, rank: int, step: str):
        """``(coordinator, None)`` of a running or new operation, or ``(None, error)`` of one that ended."""
        owner_name, group_name, number = key
        op = (group_name, number)
        state = self.owners.get(owner_name)
        if state is None:
            if len(self.owners) >= self.max_idle_owners + self._live:
                self._sweep()
            state = self.owners[owner_name] = _Owner()
        else:
            self.owners.move_to_end(owner_name)
            coord = state.ops.get(op)
            if coord is not None:
                return coord, None
            ended = self._ended(state, op, rank, step)
            if ended is not None:
                return None, ended
        coord = state.ops[op] = _HostedCoordinator(self, owner_name, group_name, number, world_size, timeout_s)
        self._live += 1
        return coord, None

    def _ended(self, state: _Owner, op: tuple[str, int], rank: int, step: str) -> CheckpointError | None:
        rec = state.ended.get(op)
        if rec is None:
            return None
        if self._now() > rec.until:
            del state.ended[op]
            return None
        name, number = op
        if rec.error is None:
            return CheckpointError(
                f"{step}: operation {number} of group '{name}' already completed, with another caller for "
                f"rank {rank}: two callers use the same rank (two unrelated saves or loads sharing one Group "
                "name?); give each operation its own Group name")
        if rank in rec.seen:  # a rank of the operation: the error every rank of it raises
            return rec.error
        return CoordinatorLostError(
            f"{step}: the coordinator of group '{name}' (operation {number}) is gone: the other ranks "
            f"already ended the operation (it failed while rank {rank} was late: {str(rec.error).splitlines()[0]})")

    def _drop(self, owner_name: str, coord: _HostedCoordinator) -> None:
        """An operation ended: drop its coordinator, keep a record of how."""
        state = self.owners.get(owner_name)
        op = (coord.group_name, coord.op)
        if state is None or state.ops.get(op) is not coord:
            return
        del state.ops[op]
        self._live -= 1
        now = self._now()
        if state.released:
            if not state.ops:
                del self.owners[owner_name]
        else:
            state.ended[op] = _Ended(coord._failed, frozenset(coord._seen), now + coord.timeout_s)
            state.ended.move_to_end(op)
            while len(state.ended) > self.max_records:
                state.ended.popitem(last=False)
        if now - self._last_sweep >= self.sweep_every_s:
            self._sweep()

    def _sweep(self) -> None:
        """Forget expired records, owners with nothing left, and the least recently used idle owners
        beyond :attr:`max_idle_owners`."""
        now = self._last_sweep = self._now()
        idle = []
        for name, state in list(self.owners.items()):
            for op in [op for op, rec in state.ended.items() if rec.until < now]:
                del state.ended[op]
            if state.ops:
                continue
            if state.ended:
                idle.append(name)
            else:
                del self.owners[name]
        for name in idle[:max(0, len(idle) - self.max_idle_owners)]:
            del self.owners[name]
