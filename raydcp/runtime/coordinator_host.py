"""The cluster's coordinator host: one actor running the :class:`Coordinator` of every operation of
every group (``raydcp.Group``, ShardGroups, Ray Train's worker groups, reshard jobs).

Why one for the cluster: an operation needs its coordinator at once, and starting an actor (a
worker process, its imports) costs seconds. The host is a detached, named actor
(:mod:`raydcp.runtime.actors` starts it, get-or-create), so only the first operation in a fresh
cluster, or the first after the host died, waits for it; a new group is a small state in it.

Protocol, as the host sees it (the rank's side is :mod:`raydcp.runtime.ray_transport`):

1. Every call names its operation by ``(owner, group name, number)``: the group's name and the
   rank-side number of the operation (:mod:`raydcp.runtime.operations`), and the *owner* whose state
   holds it (the group's own name, or the ShardGroup whose operations run under names of their
   own, so that ``release(owner)`` drops them together); and its *caller*
   (:class:`raydcp.runtime.operations.Caller`), the process that numbered it.
2. A Group name belongs to one *incarnation* of its ranks at a time: the processes that run its
   ranks. A rank's first call binds the rank to its caller in the current incarnation; an
   operation number means an operation of that incarnation. A call for a bound rank from
   another process is a restart or a second caller:

   - if a running operation of the incarnation has ranks (made a call, not closed) whose
     processes live, it is a second caller: refused, and the running operations fail on every
     rank (two callers of one rank are never mixed). Whether a process lives the host learns
     from Ray: waiting on an object the process owns fails once it is gone;
   - else (every rank of the incarnation finished its operations, or its process is gone) the
     rank restarted: a new incarnation begins with it, the earlier one's running operations fail,
     and the ranks of the earlier one that call again are refused. A rank that never took part
     in the new incarnation joins it on its first call (a Group of another ``world_size`` is a
     new incarnation too). So a worker group restarted with the same code and Group name (every
     rank a new process) saves and loads again, from operation 0.
   - where only some ranks restarted, the first old rank to call and the new incarnation's
     running operations fail at once, saying so: a Group's ranks restart together.
3. The first call of an operation makes its coordinator. A rank's first call must be its call 1
   (the Coordinator checks): a later one means the host that saw its earlier calls died, and the
   operation fails on every rank with a ``CoordinatorLostError`` rather than waiting.
4. When an operation ends (every rank closed it, or it failed), its coordinator is dropped at once
   and a record of how it ended is kept for the operation's ``timeout_s``: a rank that comes late
   to a failed operation gets the failure at once, and a second caller of the same incarnation for a
   rank of a completed one is refused instead of starting it again.
5. Bounded state: at most :attr:`CoordinatorHost.max_records` records per owner, the oldest
   forgotten first; a group's incarnations are forgotten with its last operation and record, and
   an owner's state once it has no operation and no record left (or by ``release``); of owners
   without a running operation at most :attr:`CoordinatorHost.max_idle_owners` are kept, least
   recently used dropped first.

6. A *survivors* operation (a rank's call says so: ``SaveOptions(survivors=True)``) goes on without
   ranks whose process is gone: while it runs, the host looks every :attr:`CoordinatorHost.watch_every_s`
   whether the process of each rank an open round waits for lives (as in step 2), and a rank found
   gone (its actor killed, its worker or node lost) is *lost*: it stands in every open and later
   round as a :class:`~raydcp.errors.RankLost`, which the operation's reductions handle (a survivors
   save plans and commits without it, :mod:`raydcp.engine.survivors`); the operation ends once every
   surviving rank closed it. A rank found gone stays gone for the incarnation's later operations. A
   rank that has not called in the incarnation yet cannot be watched by its process: the survivors
   wait for it as for any rank, unless its node is known.
7. Ranks announced to go (a survivors call's ``leaving``: ``{node id: ranks}``, a preemption
   notice's) are also found lost once their node is gone (Ray's node table says so), whether or
   not they called. And a round of a survivors operation may be told (a call's ``optional``) which
   ranks it need not wait for: it completes once every other rank arrived, each optional rank still
   missing standing in as a :class:`~raydcp.errors.RankLost` (*excused*); an excused rank that
   comes later gets its reply of that round at once. The operation then ends once every rank
   closed it or was found gone (an excused rank that neither calls nor dies is let go after the
   operation's ``timeout_s``).

Concurrency: an asyncio actor. A waiting rank is an awaiting coroutine, and every reduction
(decoding the ranks' plans, planning, encoding the replies) runs in a worker thread, so a stalled
rank or a long planning of one group never holds up another group's calls.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

from ..errors import CheckpointError, CoordinatorLostError, RankFailure, RankLost, RanksLostError, raise_failures
from ..transport import decode, encode
from .coordinator import Coordinator, _Round, planning_pages
from .operations import Caller

__all__ = ["CoordinatorHost", "OpKey"]

OpKey = tuple  # (owner, group name, operation number)

_UNNAMED = Caller(None)  # the caller of calls that name none (tests, tools): one process for all of them


class _Ended(NamedTuple):
    error: CheckpointError | None  # None: the operation completed
    seen: frozenset  # the ranks that took part in it
    until: float  # monotonic time until which the record is kept


class _Lineage:
    """One group's incarnations in the host: which process runs each rank now (module doc, step 2)."""

    __slots__ = ("gen", "world_size", "callers", "retired", "gone")

    def __init__(self) -> None:
        self.gen = 0  # the current incarnation's number; its operations are (group, gen, number)
        self.world_size: int | None = None
        self.callers: dict[int, Caller] = {}  # rank -> its caller in the current incarnation
        self.retired: OrderedDict[str, int] = OrderedDict()  # caller id of an earlier incarnation -> its gen
        self.gone: set[str] = set()  # callers of the current incarnation whose process is gone


class _Owner:
    """The state of one owner in the host: its running operations, the records of ended ones, and
    the incarnations of its groups."""

    __slots__ = ("ops", "ended", "released", "lineages")

    def __init__(self) -> None:
        self.ops: dict[tuple[str, int, int], _HostedCoordinator] = {}  # (group, gen, number) -> coordinator
        self.ended: OrderedDict[tuple[str, int, int], _Ended] = OrderedDict()
        self.released = False  # release() came while operations ran: drop the state with the last one
        self.lineages: dict[str, _Lineage] = {}

    def running(self, group: str, gen: int) -> list["_HostedCoordinator"]:
        return [c for (g, n, _), c in self.ops.items() if g == group and n == gen]

    def gen_of(self, group: str, rank: int, caller_id) -> int | None:
        """The incarnation ``caller_id``'s calls for ``rank`` belong to (None: none)."""
        lin = self.lineages.get(group)
        if lin is None:
            return None
        bound = lin.callers.get(rank)
        if bound is not None and bound.id == caller_id:
            return lin.gen
        return lin.retired.get(caller_id)


class _HostedCoordinator(Coordinator):
    """A Coordinator whose end drops it from its host; in a survivors operation it goes on without
    the ranks its host found lost (module doc, step 6)."""

    def __init__(self, host: "CoordinatorHost", owner: str, gen: int, *args):
        super().__init__(*args)
        self._host, self._owner, self.gen = host, owner, gen
        self._executor = host.executor
        self.survivors = False  # a survivors operation: lost ranks are stood in for, not waited for
        self.lost: dict[int, str] = {}  # rank -> how it was found lost
        self.leaving: dict[int, str] = {}  # rank -> its node: ranks announced to go (module doc, step 7)
        self.optional: dict[int, frozenset] = {}  # seq -> ranks that round need not wait for
        self.excused: dict[int, _Round] = {}  # rank -> the round that completed without it
        self.excused_at: float | None = None  # when the first rank was excused (time.monotonic)
        self.watcher: asyncio.Task | None = None

    def ended(self) -> bool:
        return self._finished or self._failed is not None

    def lose(self, rank: int, reason: str) -> None:
        """Go on without ``rank``: it stands in every open and later round of the operation as a
        :class:`~raydcp.errors.RankLost` (an empty list of buffers in an exchange), so the rounds
        the survivors wait in complete without it."""
        if self.ended() or rank in self.lost or rank in self._closed or not self._valid_rank(rank):
            return
        self.lost[rank] = reason
        for rnd in list(self._rounds.values()):
            if rnd.results is None and rank not in rnd.values:
                self._stand_in(rnd, rank)
                self.excuse_missing(rnd)
                if len(rnd.values) == self.world_size:
                    asyncio.ensure_future(self._finish_round(rnd))
        self._finish_if_closed()

    def _finish_if_closed(self) -> bool:
        """End the operation where every rank not lost closed it (True: it ended now)."""
        if self.ended() or not self.lost:
            return False
        if set(range(self.world_size)) - self.lost.keys() <= self._closed.keys():
            self._finished = True
            self._on_end()
            return True
        return False

    def excuse_missing(self, rnd: _Round, arriving: int | None = None) -> None:
        """Where every rank of ``rnd`` but its optional ones is there (with ``arriving``), stand those
        in (module doc, step 7): the round completes without them."""
        optional = self.optional.get(rnd.seq, frozenset())
        missing = set(range(self.world_size)) - rnd.values.keys() - {arriving}
        if not missing or not missing <= optional:
            return
        for r in sorted(missing):
            rnd.values[r] = {} if rnd.kind == "exchange" else RankLost(
                r, "announced to go and given nothing to write: the survivors did not wait for it")
            rnd.calls[r] = (rnd.kind, rnd.step)
            self.excused[r] = rnd
        if self.excused_at is None:
            self.excused_at = time.monotonic()

    def unclosed_excused(self) -> list[int]:
        return [r for r in self.excused if r not in self._closed and r not in self.lost]

    def _stand_in(self, rnd: _Round, rank: int) -> None:
        rnd.values[rank] = {} if rnd.kind == "exchange" else RankLost(rank, self.lost[rank])
        rnd.calls[rank] = (rnd.kind, rnd.step)

    async def _finish_round(self, rnd: _Round) -> None:
        """A round the last lost rank completed (as ``_rendezvous`` completes one its last rank did)."""
        results = await self._complete(rnd)
        rnd.finish(results)
        self._rounds.pop(rnd.seq, None)

    async def _rendezvous(self, rank, world_size, seq, kind, step, value, reduce_fn):
        rnd = self.excused.get(rank)
        if rnd is not None and rnd.seq == seq and rank not in self._closed:  # late to a round that went on
            self._seen.add(rank)
            self._last_step[rank] = step
            self._last_seq[rank] = seq
            await rnd.done.wait()
            return self.creator_rank, rnd.results[rank]
        if rank in self.lost:  # found gone, yet it calls: the survivors went on without it
            return self.creator_rank, RanksLostError(
                f"{step}: rank {rank} of group '{self.group_name}' (operation {self.op}) was found lost "
                f"({self.lost[rank]}) and the other ranks went on without it; this process can no longer take "
                "part in the operation", lost_ranks=[rank])
        usable = (not self.ended() and self._valid_rank(rank) and world_size == self.world_size
                  and rank not in self._closed)
        if (self.lost or seq in self.optional) and usable and seq not in self._rounds:
            rnd = self._rounds[seq] = _Round(seq, kind, step, reduce_fn)
            for r in self.lost:
                self._stand_in(rnd, r)
        if seq in self.optional and usable and seq > self._last_seq.get(rank, 0):
            rnd = self._rounds.get(seq)
            if rnd is not None and rnd.results is None and rank not in rnd.values:
                self.excuse_missing(rnd, rank)
        return await super()._rendezvous(rank, world_size, seq, kind, step, value, reduce_fn)

    async def close(self, rank: int) -> bool:
        done = await super().close(rank)
        if done or self._finished:
            return done
        return self._finish_if_closed()  # every survivor closed

    def _on_end(self) -> None:
        if self.watcher is not None and self.watcher is not asyncio.current_task():
            self.watcher.cancel()
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
    max_retired = 4096  # callers of a group's earlier incarnations remembered (to refuse them)
    sweep_every_s = 1.0  # how often expired records are looked for
    reduction_threads = 32  # reductions of this many operations run at once (more wait for a thread)
    watch_every_s = 0.2  # how often a survivors operation looks whether its ranks' processes live

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        planning_pages()  # this process plans: ordinary pages for its short-lived arrays
        import raydcp.engine  # noqa: F401  (what unpickling the ranks' reductions needs, once, at start)

        self._now = clock
        self.executor = ThreadPoolExecutor(self.reduction_threads, thread_name_prefix="raydcp-reduce")
        self.owners: OrderedDict[str, _Owner] = OrderedDict()  # least recently used first
        self._live = 0  # running operations, all owners together
        self._last_sweep = clock()

    # -- the ranks' calls -----------------------------------------------------------------------
    async def reduce_scatter(self, key: OpKey, timeout_s, rank, world_size, seq, step, local, reduce_fn,
                             caller: Caller | None = None, survivors: bool = False, leaving: dict | None = None,
                             optional: tuple = ()):
        """``local`` and the reply travel as ``raydcp.transport.Wire`` where the rank could encode them.
        ``caller``: the process that numbered the operation (None: one unnamed process). ``survivors``:
        the operation goes on without ranks found lost (module doc, step 6); ``leaving`` (node id ->
        ranks) and ``optional`` (ranks this round need not wait for): step 7."""
        coord, ended = await self._coordinator(key, world_size, timeout_s, rank, step, caller)
        if coord is None:
            return ended
        if survivors:
            self._survivors(key, coord, leaving)
            if optional and not coord.ended():
                coord.optional.setdefault(seq, frozenset(int(r) for r in optional))
        _, value = await coord.reduce_scatter(rank, world_size, seq, step, local, self._reduction(step, reduce_fn))
        return value

    def _reduction(self, step: str, reduce_fn: Callable) -> Callable[[list], list]:
        """What a worker thread runs once the round is complete (a subclass may wrap it, e.g. to profile it)."""
        return _OnWire(step, reduce_fn)

    async def exchange(self, key: OpKey, timeout_s, rank, world_size, seq, step, outgoing,
                       caller: Caller | None = None, survivors: bool = False, leaving: dict | None = None):
        coord, ended = await self._coordinator(key, world_size, timeout_s, rank, step, caller)
        if coord is None:
            return ended
        if survivors:
            self._survivors(key, coord, leaving)
        _, value = await coord.exchange(rank, world_size, seq, step, outgoing)
        return value

    async def close(self, key: OpKey, rank: int, caller: Caller | None = None) -> bool:
        owner = self.owners.get(key[0])
        if owner is None:
            return False
        gen = owner.gen_of(key[1], rank, (caller or _UNNAMED).id)
        coord = None if gen is None else owner.ops.get((key[1], gen, key[2]))
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
                    "ops": sorted((o, g, n) for o, s in self.owners.items() for g, _, n in s.ops)}
        state = self.owners.get(key[0])
        if state is None:
            return None
        lin = state.lineages.get(key[1])
        op = (key[1], 0 if lin is None else lin.gen, key[2])  # the current incarnation's
        coord = state.ops.get(op)
        if coord is not None:
            return await coord.status()
        rec = state.ended.get(op)
        if rec is None:
            return None
        return {"group": op[0], "op": op[2], "ended": True, "failed": None if rec.error is None else str(rec.error)}

    async def owner_status(self, owner: str) -> dict | None:
        """One owner's state: its running operations and records (None once released)."""
        state = self.owners.get(owner)
        if state is None:
            return None
        return {"ops": sorted((g, n) for g, _, n in state.ops), "records": len(state.ended), "released": state.released}

    async def incarnation(self, owner: str, group: str) -> dict | None:
        """A group's current incarnation: its number and the ranks bound to it (None: unknown group)."""
        state = self.owners.get(owner)
        lin = None if state is None else state.lineages.get(group)
        if lin is None:
            return None
        return {"gen": lin.gen, "ranks": sorted(lin.callers), "retired": len(lin.retired)}

    # -- operations -----------------------------------------------------------------------------
    async def _coordinator(self, key: OpKey, world_size: int, timeout_s: float, rank: int, step: str,
                           caller: Caller | None):
        """``(coordinator, None)`` of a running or new operation, or ``(None, error)`` of one that ended
        or that this caller may not take part in (module doc, step 2)."""
        owner_name, group_name, number = key
        caller = caller or _UNNAMED
        alive: set = set()  # callers found alive during this call
        while True:
            state = self.owners.get(owner_name)
            if state is None:
                if len(self.owners) >= self.max_idle_owners + self._live:
                    self._sweep()
                state = self.owners[owner_name] = _Owner()
            else:
                self.owners.move_to_end(owner_name)
            lin = state.lineages.get(group_name)
            if lin is None:
                lin = state.lineages[group_name] = _Lineage()
            placed = self._place(state, lin, group_name, rank, world_size, caller, number, step)
            if isinstance(placed, CheckpointError):
                return None, placed
            if isinstance(placed, list):  # whether these callers' processes live decides
                unknown = [c for c in placed if c.id not in alive]
                if unknown:
                    for c, gone in zip(unknown, await self._gone(unknown, timeout_s)):
                        (lin.gone.add if gone else alive.add)(c.id)
                    continue  # the state may have changed meanwhile: place the call again
                if rank in lin.callers:
                    return None, self._second_caller(state, lin, group_name, rank, number, step, placed)
                # a rank of another world_size beside live ranks: no restart, a misconfigured
                # rank, which the operation's coordinator names (and fails the operation with)
                placed = lin.gen
            if self.owners.get(owner_name) is not state or state.lineages.get(group_name) is not lin:
                continue  # failing operations on the way dropped the state: place the call again
            op = (group_name, placed, number)
            coord = state.ops.get(op)
            if coord is not None:
                return coord, None
            ended = self._ended(state, op, rank, step)
            if ended is not None:
                return None, ended
            coord = state.ops[op] = _HostedCoordinator(self, owner_name, placed, group_name, number, world_size,
                                                       timeout_s)
            self._live += 1
            return coord, None

    # -- survivors operations (module doc, step 6) ----------------------------------------------
    def _survivors(self, key: OpKey, coord: _HostedCoordinator, leaving: dict | None = None) -> None:
        """Make ``coord`` a survivors operation (on its first call that says so) and watch its ranks;
        ``leaving``: the ranks announced to go, by node (module doc, step 7)."""
        for node, ranks in (leaving or {}).items():
            for r in ranks:
                if coord._valid_rank(r):
                    coord.leaving.setdefault(r, str(node))
        if coord.survivors or coord.ended():
            return
        state = self.owners.get(key[0])
        lin = None if state is None else state.lineages.get(key[1])
        if lin is None:
            return
        coord.survivors = True
        for rank, caller in lin.callers.items():  # found gone in an earlier operation of the incarnation
            if caller.id in lin.gone:
                coord.lose(rank, "its process died")
        coord.watcher = asyncio.ensure_future(self._watch(lin, coord))

    async def _watch(self, lin: _Lineage, coord: _HostedCoordinator) -> None:
        """Until ``coord`` ends, look every :attr:`watch_every_s` whether the process of each rank an
        open round waits for still lives (:meth:`_gone`: Ray fails the wait on an object a dead process
        owned, whether the process, its actor or its node went); a gone one is lost from the operation.
        Only the ranks a round waits for: a rank that dies after it arrived is waited for, and found
        gone, in the next round (the last round completes without needing it); and the excused ranks
        until they close. A waited-for rank announced to go is also lost once its node is gone, bound
        or not (module doc, step 7)."""
        while not coord.ended():
            waiting: set[int] = set(coord.unclosed_excused())  # an excused rank: until it closes or is gone
            for rnd in list(coord._rounds.values()):
                if rnd.results is None:
                    waiting.update(r for r in range(coord.world_size) if r not in rnd.values)
            if coord.excused_at is not None and waiting == set(coord.unclosed_excused()) and waiting \
                    and time.monotonic() - coord.excused_at > coord.timeout_s:
                for rank in waiting:  # neither called nor died: let it go
                    coord.lose(rank, "announced to go; it neither came nor was found gone")
                continue
            leaving = [r for r in sorted(waiting) if r in coord.leaving and r not in coord.lost]
            if leaving:  # a leaving rank whose node is gone is lost, whether or not it called
                gone_nodes = await self._dead_nodes({coord.leaving[r] for r in leaving})
                for rank in leaving:
                    if coord.leaving[rank] in gone_nodes and not coord.ended():
                        caller = lin.callers.get(rank)
                        if caller is not None:
                            lin.gone.add(caller.id)
                        coord.lose(rank, f"its node {coord.leaving[rank]} is gone (it was announced to go)")
            watched = []
            for rank in sorted(waiting):
                if rank in coord.lost or rank in coord._closed:
                    continue
                caller = lin.callers.get(rank)
                if caller is None:  # not bound yet: it has not called in this incarnation
                    continue
                if caller.id in lin.gone:
                    coord.lose(rank, "its process died")
                elif caller.alive is not None:
                    watched.append((rank, caller))
            if watched:
                found = await self._gone([c for _, c in watched], self.watch_every_s * 4)
                for (rank, caller), gone in zip(watched, found):
                    if gone and not coord.ended():
                        lin.gone.add(caller.id)
                        coord.lose(rank, "its process died (its actor, worker or node is gone)")
            if not coord.ended():
                await asyncio.sleep(self.watch_every_s)

    # -- incarnations (module doc, step 2) ------------------------------------------------------
    def _place(self, state: _Owner, lin: _Lineage, group: str, rank: int, world_size: int, caller: Caller,
               number: int, step: str):
        """The incarnation (its gen) the call belongs to; or an error for the caller; or the callers
        whose processes must be found gone (or alive) before the call can be placed."""
        bound = lin.callers.get(rank)
        if bound is not None and bound.id == caller.id:
            if bound.alive is None and caller.alive is not None:
                lin.callers[rank] = caller
            return lin.gen
        if caller.id in lin.retired:
            return self._superseded(state, lin, group, rank, number, step)
        if bound is None and lin.world_size in (None, world_size):  # the incarnation's first caller of the rank
            lin.callers[rank] = caller
            lin.world_size = world_size
            return lin.gen
        # the rank from another process: a restart, or a second caller of the rank
        busy = {}
        for coord in state.running(group, lin.gen):
            for r in coord.active_ranks():
                c = lin.callers.get(r)
                if c is not None and c.id not in lin.gone:
                    busy[c.id] = c
        if busy:
            return list(busy.values())
        self._new_incarnation(state, lin, group, rank, world_size, caller)
        return lin.gen

    def _new_incarnation(self, state: _Owner, lin: _Lineage, group: str, rank: int, world_size: int,
                         caller: Caller) -> None:
        """``caller`` restarted ``rank``: every rank of the current incarnation finished, or its process
        is gone. Its running operations (of gone ranks) fail; its callers are refused from now on."""
        old = lin.gen
        for c in lin.callers.values():
            lin.retired[c.id] = old
            lin.retired.move_to_end(c.id)
        while len(lin.retired) > self.max_retired:
            lin.retired.popitem(last=False)
        lin.gen, lin.world_size, lin.callers = old + 1, world_size, {rank: caller}
        lin.gone = set()
        for coord in state.running(group, old):
            coord.fail(CoordinatorLostError(
                f"operation {coord.op} of group '{group}' cannot complete: the processes of its ranks "
                f"{sorted(coord.active_ranks())} are gone and rank {rank} restarted in a new process, which "
                "begins a new incarnation of the group (its operations count from 0 again)"))

    def _superseded(self, state: _Owner, lin: _Lineage, group: str, rank: int, number: int,
                    step: str) -> CheckpointError:
        """A caller of an earlier incarnation calls again."""
        if rank in lin.callers:  # a new process runs the rank now
            return CheckpointError(
                f"{step}: rank {rank} of group '{group}' (operation {number}) runs in another process now: the "
                f"group's ranks restarted in new processes after this one last took part, so this process "
                f"can no longer take part in the group; end it (the new processes do its work), or give it a "
                f"Group name of its own")
        new = sorted(lin.callers)
        err = CheckpointError(
            f"group '{group}': rank {rank} still runs in a live process of the group's earlier incarnation "
            f"(it called its operation {number}) while ranks {new} restarted in new processes: only some of "
            f"the group's ranks restarted, and a Group's ranks restart together; end every process of the "
            f"earlier ranks and start all {lin.world_size} anew (or give the new ones a Group name of their "
            f"own)")
        for coord in state.running(group, lin.gen):
            coord.fail(err)
        return CheckpointError(f"{step}: {err}")

    def _second_caller(self, state: _Owner, lin: _Lineage, group: str, rank: int, number: int, step: str,
                       live: list[Caller]) -> CheckpointError:
        """A new process for ``rank`` while ranks of a running operation live (``live``): refused, and
        the running operations fail on every rank (the two callers are never mixed)."""
        live_ids = {c.id for c in live}
        running = state.running(group, lin.gen)
        ops = sorted(c.op for c in running) or ["(ended meanwhile)"]
        ranks = sorted(r for coord in running for r in coord.active_ranks()
                       if lin.callers.get(r) is not None and lin.callers[r].id in live_ids)
        why = ("two callers for one rank: two jobs use one Group name (give each its own), or only some "
               "of the group's ranks restarted (a Group's ranks restart together: end every earlier "
               "process before the new ones save or load)")
        for coord in running:
            coord.fail(CheckpointError(
                f"group '{group}' (operation {coord.op}): rank {rank} arrived from another process (its "
                f"operation {number}) while this operation ran with ranks {ranks} in live processes; {why}; "
                f"the operation fails on every rank", {rank: "a second caller"}))
        return CheckpointError(
            f"{step}: rank {rank} of group '{group}' (operation {number} of this process) is refused: the "
            f"group's operation {', '.join(map(str, ops))} runs with ranks {ranks} in live processes of "
            f"another incarnation; {why}; that operation fails on every rank", {rank: "a second caller"})

    async def _dead_nodes(self, nodes: set[str]) -> set[str]:
        """Which of ``nodes`` Ray's node table says are dead (a node it does not know counts as alive)."""
        import ray

        try:
            table = await asyncio.get_running_loop().run_in_executor(self.executor, ray.nodes)
        except Exception:  # the table could not be read this time: the next look tries again
            return set()
        return {n["NodeID"] for n in table if n.get("NodeID") in nodes and not n.get("Alive", True)}

    async def _gone(self, callers: list[Caller], timeout_s: float) -> list[bool]:
        """Whether each caller's process is gone: waiting on an object it owns fails once it is (a live
        one answers at once; one that does not answer within ``timeout_s`` counts as alive)."""
        async def gone(caller: Caller) -> bool:
            if caller.alive is None:  # nothing to tell by: taken as alive
                return False
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(caller.alive)), timeout_s)
            except asyncio.TimeoutError:
                return False
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. Ray's OwnerDiedError
                return True
            return False

        return list(await asyncio.gather(*(gone(c) for c in callers)))

    def _ended(self, state: _Owner, op: tuple[str, int, int], rank: int, step: str) -> CheckpointError | None:
        rec = state.ended.get(op)
        if rec is None:
            return None
        if self._now() > rec.until:
            del state.ended[op]
            return None
        name, _, number = op
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
        op = (coord.group_name, coord.gen, coord.op)
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
            if state.lineages:  # a group's incarnations go with its last operation and record
                used = {op[0] for op in state.ops}
                used.update(op[0] for op in state.ended)
                for group in [g for g in state.lineages if g not in used]:
                    del state.lineages[group]
            if state.ops:
                continue
            if state.ended:
                idle.append(name)
            else:
                del self.owners[name]
        for name in idle[:max(0, len(idle) - self.max_idle_owners)]:
            del self.owners[name]
