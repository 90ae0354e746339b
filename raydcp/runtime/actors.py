"""The one place where raydcp's plain classes become Ray actors.

The classes themselves (``Coordinator``, the shard actor) know nothing of
``ray.remote``; tests build them directly. This module applies the decorator
and the placement options, and hosts the coordinators of a group's operations
in one long-lived actor per group (``CoordinatorHost``).
"""
from __future__ import annotations

import asyncio
import functools
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import CheckpointError, CoordinatorLostError, RankFailure
from ..transport import decode, encode
from .coordinator import Coordinator, planning_pages

NAMESPACE = "raydcp"

# Handles of the coordinator hosts this process used. A non-detached actor lives only
# as long as its creator holds a handle (handles from get_if_exists/get_actor do not
# count), so the creating rank keeps its handle for as long as its process lives.
_HOSTS: dict[str, object] = {}


def coordinator_name(group_name: str) -> str:
    return f"raydcp:{group_name}"


class _HostedCoordinator(Coordinator):
    """A Coordinator whose end drops it from its host instead of ending an actor."""

    def __init__(self, host: "CoordinatorHost", key, *args):
        super().__init__(*args)
        self._host = host
        self._key = key  # its key in the host: the operation number, or (group name, number)

    def _schedule_exit(self, delay_s: float) -> None:
        if self._failed is not None:
            self._host.remember_failure(self._key, self._failed, self.timeout_s)
        if self._finished:
            self._host.drop(self._key, self)
        else:
            asyncio.get_running_loop().call_later(delay_s, self._host.drop, self._key, self)


class CoordinatorHost:
    """One actor per group name, hosting the :class:`Coordinator` of each of its operations.

    Operations are numbered by the ranks (:mod:`raydcp.runtime.groups`); the host
    creates an operation's coordinator on its first call and drops it when the
    operation ends, so an operation costs no actor or process start. A failed
    operation is remembered for ``timeout_s``: a rank that comes late to it
    learns at once that the others already ended it.
    """

    def __init__(self, group_name: str, creator_rank: int):
        planning_pages()  # this actor's process plans: ordinary pages for its short-lived arrays
        self.group_name = group_name
        self.creator_rank = creator_rank
        self.ops: dict[int, Coordinator] = {}
        self.failed: dict[int, tuple[str, float]] = {}
        # operations that completed -> until when a late call to them is refused (a second caller
        # for a rank must not start the operation again with the other callers)
        self.completed: dict[int, float] = {}
        self._memo: tuple | None = None  # (operation, last reply object, its Wire), until the operation ends

    def _get(self, op, world_size: int, timeout_s: float) -> Coordinator:
        coord = self.ops.get(op)
        if coord is None:
            name, number = self._named(op)
            coord = self.ops[op] = _HostedCoordinator(self, op, name, number, world_size, timeout_s, self.creator_rank)
        return coord

    def _named(self, op) -> tuple[str, int]:
        """``(group name, operation number)`` of an operation key: a number of this host's own group,
        or ``(name, number)`` of a group hosted here (``RayTransport(..., host=)``)."""
        return op if isinstance(op, tuple) else (self.group_name, op)

    def _ended(self, op: int, rank: int, step: str):
        if op in self.ops:
            return None
        done_until = self.completed.get(op)
        if done_until is not None:
            if time.monotonic() <= done_until:
                name, number = self._named(op)
                return self.creator_rank, CheckpointError(
                    f"{step}: operation {number} of group '{name}' already completed, with another caller for "
                    f"rank {rank}: two callers use the same rank (two unrelated saves or loads sharing one Group "
                    "name?); give each operation its own Group name")
            del self.completed[op]
        entry = self.failed.get(op)
        if entry is None:
            return None
        msg, until = entry
        if time.monotonic() > until:
            del self.failed[op]
            return None
        name, number = self._named(op)
        return self.creator_rank, CoordinatorLostError(
            f"{step}: the coordinator of group '{name}' (operation {number}) is gone: the other ranks "
            f"already ended the operation (it failed while rank {rank} was late: {msg.splitlines()[0]})")

    async def reduce_scatter(self, op, timeout_s, rank, world_size, seq, step, local, reduce_fn):
        """``local`` and the reply travel as ``raydcp.transport.Wire`` where the rank could encode it."""
        ended = self._ended(op, rank, step)
        if ended is not None:
            return ended
        try:
            local = decode(local)
        except Exception as exc:  # the rank takes part as a failure, so that no rank waits for it
            local = RankFailure(rank, f"its value could not be decoded by the coordinator: {type(exc).__name__}: {exc}")
        creator, value = await self._get(op, world_size, timeout_s).reduce_scatter(
            rank, world_size, seq, step, local, reduce_fn)
        return creator, self._encode(op, value)

    def _encode(self, op: int, value):
        """A reply as a Wire, encoded once for all ranks that get the same object (the commit's metadata)."""
        if value is None or isinstance(value, BaseException):
            return value
        memo = self._memo
        if memo is not None and memo[1] is value:
            return memo[2]
        try:
            wire = encode(value)
        except Exception:  # Ray's own pickling then
            return value
        self._memo = (op, value, wire)
        return wire

    async def exchange(self, op, timeout_s, rank, world_size, seq, step, outgoing):
        ended = self._ended(op, rank, step)
        if ended is not None:
            return ended
        return await self._get(op, world_size, timeout_s).exchange(rank, world_size, seq, step, outgoing)

    async def close(self, op: int, rank: int) -> bool:
        coord = self.ops.get(op)
        return False if coord is None else await coord.close(rank)

    async def status(self, op: int | None = None):
        """The host's open operations, or one operation's status (None once it ended)."""
        if op is None:
            return {"group": self.group_name, "creator_rank": self.creator_rank, "ops": sorted(self.ops, key=str)}
        coord = self.ops.get(op)
        if coord is not None:
            return await coord.status()
        if op in self.failed:
            return {"group": self.group_name, "op": op, "failed": self.failed[op][0], "ended": True}
        return None

    def warm(self) -> bool:
        """Import what unpickling the ranks' reduction functions needs (the engine, torch)."""
        import raydcp.engine  # noqa: F401

        return True

    def drop(self, op: int, coord: Coordinator) -> None:
        if self.ops.get(op) is coord:
            del self.ops[op]
            if coord._failed is None:
                now = time.monotonic()
                self.completed[op] = now + coord.timeout_s
                if len(self.completed) > 64:  # forget what expired
                    for k in [k for k, until in self.completed.items() if until < now]:
                        del self.completed[k]
        if self._memo is not None and self._memo[0] == op:
            self._memo = None

    def remember_failure(self, op: int, err: CheckpointError, for_s: float) -> None:
        self.failed[op] = (str(err), time.monotonic() + for_s)
        now = time.monotonic()
        for k in [k for k, (_, until) in self.failed.items() if until < now]:
            del self.failed[k]


_HostRemote = ray.remote(CoordinatorHost)


def get_or_create_coordinator(group_name: str, world_size: int, rank: int):
    """The coordinator host of group ``group_name``; the first rank to ask creates it."""
    handle = _HOSTS.get(group_name)
    if handle is None:
        handle = _HostRemote.options(
            name=coordinator_name(group_name),
            namespace=NAMESPACE,
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            # every rank has at most one call in flight per operation, plus close() and status()
            max_concurrency=max(1000, 4 * world_size),
        ).remote(group_name, rank)
        _HOSTS[group_name] = handle
    return handle


def prepare_coordinator(group_name: str, world_size: int, rank: int) -> None:
    """Start the group's coordinator host and its imports now, without waiting for either."""
    get_or_create_coordinator(group_name, world_size, rank).warm.remote()


def end_group(group_name: str) -> None:
    """Stop the coordinator host of a group that runs no more operations (single-use group names)."""
    _HOSTS.pop(group_name, None)
    try:
        ray.kill(ray.get_actor(coordinator_name(group_name), namespace=NAMESPACE), no_restart=True)
    except ValueError:  # never created (one rank) or gone already
        pass


def forget_coordinator(group_name: str) -> None:
    """Drop a host handle that no longer answers, so the next operation gets or creates a live one."""
    _HOSTS.pop(group_name, None)


@functools.lru_cache(maxsize=None)
def _remote_class(cls):
    # tensor transport on: a ShardGroup reshard may send through Ray Direct Transport (runtime/rdt.py)
    return ray.remote(enable_tensor_transport=True)(cls)


def start_shard_actor(cls, rank: int, world_size: int, pg, *, num_gpus: float, num_cpus: float,
                      bundle: int | None = None):
    """Start member ``rank`` of a ShardGroup in bundle ``bundle`` (default ``rank``) of placement group ``pg``.

    ``cls`` is ShardActor or a subclass. One extra concurrency slot lets probes
    (``info``, ``apply``) answer while a collective step runs.
    """
    return _remote_class(cls).options(
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        max_concurrency=2,
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank if bundle is None else bundle),
    ).remote(rank, world_size)

