"""The coordinator of one operation of one group: rendezvous, reduce, route.

A plain class with ``async`` methods. The cluster's coordinator host
(:mod:`raydcp.runtime.coordinator_host`, one async Ray actor) runs one per
running operation; tests drive it directly from an asyncio loop. It never
touches tensor data: exchanges pass ObjectRefs (opaque values here) from
senders to receivers.

Protocol, per operation (see ``raydcp.transport`` for the rank's side):

1. Each rank calls :meth:`reduce_scatter` or :meth:`exchange` with a sequence
   number ``seq`` (1, 2, ... per rank; all ranks make the same calls in the same
   order, so a round is identified by ``seq``) and the step name. A rank's first
   call here must be its call 1: a later one means that the coordinator that saw
   its earlier calls is gone (its host died and a new one took over), so the
   operation fails on every rank with a ``CoordinatorLostError``.
2. The round completes when all ``world_size`` ranks arrived: the coordinator
   runs ``run_reduce`` once, in a worker thread (a long planning never holds up
   the host's other operations), or routes the exchange, and wakes every rank
   with its own element. A rank waits at most ``timeout_s`` from its own
   arrival for the others (not for the reduction, once all arrived); past it the
   operation *fails*: every waiting rank, and every rank that comes later, gets
   one ``CheckpointError`` naming the missing ranks.
3. Each rank calls :meth:`close` once, at the end (also after a failure). A rank
   that closed while others still expect it in a round fails the operation at
   once ("rank r left"), instead of letting them wait for the timeout.
4. :meth:`close` returns True to the rank whose close finishes the coordinator
   (every rank closed, or the operation failed and every rank that took part
   closed). A finished or failed coordinator calls :meth:`_on_end`, which
   its host overrides to drop it (keeping a small record of how it ended).

Replies are ``(creator_rank, value)``: ``value`` is the rank's result or a
``CheckpointError`` for the rank to raise (``creator_rank`` is what the
coordinator was made with, for callers that name an owner; the host passes None).
"""
from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointError, CoordinatorLostError, RankFailure, RanksTimedOutError, raise_failures
from ..planner import PlanCache
from ..transport import run_reduce

__all__ = ["Coordinator", "keep_planning_memory", "planning_pages"]

_REDUCE = "reduce_scatter"
_EXCHANGE = "exchange"


# what the coordinator's process keeps of the memory its plans free (glibc's mallopt parameters)
_MMAP_THRESHOLD = 64 << 20  # blocks up to this come from the heap and are reused, not mapped anew
_TRIM_THRESHOLD = 1 << 30  # free memory at the top of a heap kept for the next plan, up to this
_ARENA_MAX = 2  # heaps shared by the process's threads (bounds what is kept, at most this many times)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def keep_planning_memory() -> bool:
    """Keep the memory a plan frees for the next one: True where the C library took the settings.

    A plan or a load plan at a million pieces allocates and frees arrays of 8-16 MiB by the
    hundred. glibc maps each such block afresh and unmaps it when freed (or trims it off its
    heap), so every plan faults all of its memory in again, page by page: in a VM that cost a
    fifth of the plan. Raised thresholds keep those blocks in the heap, where the next array
    reuses them (a few arenas for the coordinator's threads, each keeping at most
    ``_TRIM_THRESHOLD`` free). Only in the coordinator's process (``planning_pages``); elsewhere,
    and where the C library is not glibc, nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, _ARENA_MAX), (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)))


def planning_pages() -> bool:
    """Give this process's planning memory ordinary pages, and keep what plans free for the next
    (:func:`keep_planning_memory`); True where numpy has the huge-page switch.

    Called once where the coordinator's actor starts (``raydcp.runtime.actors``), and by
    ``bench/planning.py`` so that it measures what the coordinator runs; never on import, and
    never in a user's process. Why: planning at scale allocates many short-lived arrays of a few
    MiB. numpy advises the kernel to back arrays from 4 MiB on with transparent huge pages, and
    Arrow's default allocator (mimalloc) backs its arenas with them too; where THP ``defrag`` is
    ``madvise`` such a fault may compact memory synchronously and zeroes 2 MiB at once, so past
    the size where arrays cross 4 MiB the kernel's share of planning grew faster than the pieces.
    So: numpy's huge-page advice off, and Arrow's default pool the system allocator (the
    metadata's columns, decoded here, are its only large Arrow buffers). Ordinary pages fault
    at the same cost per byte at every scale.
    """
    keep_planning_memory()
    try:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        pass
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core import multiarray
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        return False
    switch(False)
    return True


@dataclass
class _Round:
    seq: int
    kind: str
    step: str
    reduce_fn: Any = None
    values: dict[int, Any] = field(default_factory=dict)
    calls: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (kind, step)
    results: list[Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def finish(self, results: list[Any]) -> None:
        if self.results is None:
            self.results = results
            self.done.set()


class Coordinator:
    """Rendezvous point of the ranks of one operation of one group (see module doc).

    Reductions get the :class:`~raydcp.planner.PlanCache` of their group (kept in the process,
    from one operation to the next, for the ``max_cached_groups`` groups that planned last): a
    training run's saves of one layout reuse the previous plan's layout decisions. What one
    group's cache holds is linear in pieces: a save plan's files (16 bytes a piece), a load
    plan's reads and deliveries (about 150 bytes a piece)."""

    _executor = None  # where reductions run: the loop's default executor, or the host's own
    max_cached_groups = 4
    _plan_caches: "OrderedDict[str, PlanCache]" = OrderedDict()
    _caches_lock = threading.Lock()

    def __init__(self, group_name: str, op: int, world_size: int, timeout_s: float, creator_rank: int | None = None):
        self.group_name = group_name
        self.op = op
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.creator_rank = creator_rank
        self._rounds: dict[int, _Round] = {}
        self._seen: set[int] = set()  # ranks that made at least one call
        self._closed: dict[int, str] = {}  # rank -> last step it took part in
        self._last_step: dict[int, str] = {}
        self._last_seq: dict[int, int] = {}  # rank -> the last call it made (calls are numbered 1, 2, ...)
        self._failed: CheckpointError | None = None
        self._finished = False

    # -- the ranks' calls ---------------------------------------------------
    async def reduce_scatter(self, rank: int, world_size: int, seq: int, step: str, local: Any, reduce_fn: Callable):
        """Step 1-2 for the control plane: returns ``(creator_rank, value_for_rank)``."""
        return await self._rendezvous(rank, world_size, seq, _REDUCE, step, local, reduce_fn)

    async def exchange(self, rank: int, world_size: int, seq: int, step: str, outgoing: dict[int, list]):
        """Step 1-2 for the data plane.

        ``outgoing`` maps destination rank -> ``[(tag, ref), ...]``; each rank
        gets back ``(creator_rank, [(src, tag, ref), ...])`` in source-rank order.
        """
        return await self._rendezvous(rank, world_size, seq, _EXCHANGE, step, outgoing, None)

    async def close(self, rank: int) -> bool:
        """Step 3-4: ``rank`` is done with this operation. True: this close finished the coordinator."""
        if not self._valid_rank(rank) or rank in self._closed:
            return False
        self._closed[rank] = self._last_step.get(rank, "")
        self._seen.add(rank)
        for rnd in self._rounds.values():
            if rnd.results is None and rank not in rnd.values:
                self._fail(self._left_error(rank, rnd.step))
                break
        done = len(self._closed) == self.world_size or (
            self._failed is not None and self._seen <= set(self._closed)
        )
        if done and not self._finished:
            self._finished = True
            self._on_end()
            return True
        return False

    def active_ranks(self) -> set[int]:
        """The ranks in the operation now: they made a call and have not closed (none once it ended)."""
        if self._finished or self._failed is not None:
            return set()
        return self._seen - self._closed.keys()

    def fail(self, err: CheckpointError) -> None:
        """Fail the operation from outside (its host found that it cannot complete, or must not):
        every waiting rank, and every later call, gets ``err``."""
        self._fail(err)

    async def status(self) -> dict:
        """A snapshot for tests and debugging."""
        return {
            "group": self.group_name,
            "op": self.op,
            "world_size": self.world_size,
            "creator_rank": self.creator_rank,
            "open_rounds": sorted(s for s, r in self._rounds.items() if r.results is None),
            "closed": sorted(self._closed),
            "failed": None if self._failed is None else str(self._failed),
        }

    # -- rendezvous ---------------------------------------------------------
    async def _rendezvous(self, rank, world_size, seq, kind, step, value, reduce_fn):
        arrived_at = time.monotonic()
        err = self._check_call(rank, world_size, step)
        if err is not None:  # a misconfigured rank fails the whole operation, not just itself
            self._fail(err)
            return self.creator_rank, self._failed
        self._seen.add(rank)
        self._last_step[rank] = step
        if self._failed is not None:
            return self.creator_rank, self._failed

        if rank not in self._last_seq and seq != 1:
            # this rank made calls 1..seq-1 to a coordinator of this operation that is gone
            self._fail(self._lost_error(rank, seq, step))
            return self.creator_rank, self._failed
        if seq <= self._last_seq.get(rank, 0):
            # this rank already took part in call ``seq`` (a round that may have completed): a
            # second caller uses the rank. Fail the operation on every rank, never mix the two.
            self._fail(CheckpointError(
                f"{step}: rank {rank} of group '{self.group_name}' (operation {self.op}) arrived twice at call "
                f"{seq}; two callers use the same rank (two unrelated saves or loads sharing one Group name?), "
                f"so the operation fails on every rank; give each operation its own Group name"
            ))
            return self.creator_rank, self._failed
        self._last_seq[rank] = seq
        rnd = self._rounds.get(seq)
        if rnd is None:
            rnd = self._rounds[seq] = _Round(seq, kind, step, reduce_fn)
        if rank in rnd.values:
            self._fail(CheckpointError(
                f"{step}: rank {rank} of group '{self.group_name}' arrived twice at call {seq}; "
                f"two processes use the same rank, or one rank reused a Group for a concurrent operation"
            ))
            return self.creator_rank, self._failed
        rnd.values[rank] = value
        rnd.calls[rank] = (kind, step)
        if rnd.reduce_fn is None:
            rnd.reduce_fn = reduce_fn
        for gone in self._closed:
            if gone not in rnd.values:
                self._fail(self._left_error(gone, step))
                return self.creator_rank, self._failed
        if len(rnd.values) == self.world_size:
            results = await self._complete(rnd)
            rnd.finish(results)  # a no-op where the operation failed meanwhile
            self._rounds.pop(seq, None)

        if rnd.results is None:
            left = self.timeout_s - (time.monotonic() - arrived_at)
            try:
                await asyncio.wait_for(rnd.done.wait(), timeout=max(left, 0.0))
            except asyncio.TimeoutError:
                if rnd.results is None:  # the round may have completed as the timer fired
                    if len(rnd.values) == self.world_size:  # every rank came: the reduction ends on its own
                        await rnd.done.wait()
                    else:
                        self._fail(self._timeout_error(rnd, rank))
        return self.creator_rank, rnd.results[rank]

    async def _complete(self, rnd: _Round) -> list[Any]:
        n = self.world_size
        calls = [rnd.calls[r] for r in range(n)]
        if len(set(calls)) > 1:
            detail = ", ".join(f"rank {r}: {k} '{s}'" for r, (k, s) in enumerate(calls))
            err = CheckpointError(
                f"ranks of group '{self.group_name}' are out of step at call {rnd.seq} ({detail}); "
                f"every rank must make the same raydcp calls in the same order"
            )
            return [err] * n
        values = [rnd.values[r] for r in range(n)]
        if rnd.kind == _REDUCE:
            # in a worker thread: the host's event loop goes on serving the other operations
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, run_reduce, rnd.step, values, rnd.reduce_fn,
                                              self._plan_cache())
        return self._route(rnd.step, values)

    def _plan_cache(self) -> PlanCache:
        """The group's PlanCache (a new one for a group not among the last ``max_cached_groups``)."""
        caches = Coordinator._plan_caches
        with Coordinator._caches_lock:
            cache = caches.pop(self.group_name, None) or PlanCache()
            caches[self.group_name] = cache
            while len(caches) > self.max_cached_groups:
                caches.popitem(last=False)
        return cache

    def _route(self, step: str, outgoing_by_rank: list[Any]) -> list[Any]:
        n = self.world_size
        failures = [v for v in outgoing_by_rank if isinstance(v, RankFailure)]
        if failures:  # a sender could not stage its buffers: everyone fails with its message
            try:
                raise_failures(step, failures)
            except CheckpointError as err:
                return [err] * n
        inbox: list[list] = [[] for _ in range(n)]
        for src, outgoing in enumerate(outgoing_by_rank):
            for dest, items in outgoing.items():
                if not isinstance(dest, int) or not 0 <= dest < n:
                    err = CheckpointError(
                        f"{step}: rank {src} addressed buffers to rank {dest!r}, outside group "
                        f"'{self.group_name}' of {n} ranks"
                    )
                    return [err] * n
                inbox[dest].extend((src, tag, ref) for tag, ref in items)
        return inbox

    # -- failure ------------------------------------------------------------
    def _fail(self, err: CheckpointError) -> None:
        """Fail the operation: every waiting rank, and every later call, gets ``err``."""
        if self._failed is not None:
            return
        self._failed = err
        for rnd in self._rounds.values():
            rnd.finish([err] * self.world_size)
        self._rounds.clear()
        self._on_end()

    def _on_end(self) -> None:
        """The operation finished or failed (its host overrides this to drop the coordinator)."""

    def _valid_rank(self, rank: Any) -> bool:
        return isinstance(rank, int) and 0 <= rank < self.world_size

    def _check_call(self, rank, world_size, step) -> CheckpointError | None:
        where = f"group '{self.group_name}' (operation {self.op})"
        if world_size != self.world_size:
            return CheckpointError(
                f"{step}: rank {rank} uses world_size {world_size} but {where} has world_size "
                f"{self.world_size}; every rank must create its Group with the same world_size"
            )
        if not self._valid_rank(rank):
            return CheckpointError(f"{step}: rank {rank!r} is outside {where} of {self.world_size} ranks")
        if rank in self._closed:
            return CheckpointError(f"{step}: rank {rank} already closed its transport for {where}")
        return None

    def _timeout_error(self, rnd: _Round, rank: int) -> CheckpointError:
        missing = sorted(set(range(self.world_size)) - set(rnd.values))
        msg = (
            f"{rnd.step}: ranks {missing} of group '{self.group_name}' (operation {self.op}) did not arrive "
            f"within {self.timeout_s:g}s (rank {rank} waited); check that those ranks are alive and call "
            f"raydcp with the same group, or raise Group(timeout_s=...)"
        )
        return RanksTimedOutError(msg, missing_ranks=missing, timeout_s=self.timeout_s,
                                  failures={r: RanksTimedOutError(f"did not arrive at step '{rnd.step}' within "
                                                                  f"{self.timeout_s:g}s", missing_ranks=[r],
                                                                  timeout_s=self.timeout_s) for r in missing})

    def _lost_error(self, rank: int, seq: int, step: str) -> CoordinatorLostError:
        return CoordinatorLostError(
            f"{step}: the coordinator of group '{self.group_name}' (operation {self.op}) lost the operation's "
            f"earlier steps: rank {rank}'s first call to it is its call {seq} (its coordinator host died during "
            f"the operation and a new one took over); the operation fails on every rank, run it again"
        )

    def _left_error(self, gone: int, step: str) -> CheckpointError:
        after = self._closed.get(gone) or "its first step"
        msg = (
            f"{step}: rank {gone} of group '{self.group_name}' (operation {self.op}) left the operation "
            f"after '{after}' (it closed its transport; see rank {gone}'s error), so '{step}' cannot complete"
        )
        return CheckpointError(msg, {gone: f"left after '{after}'"})
