"""The one place where raydcp's plain classes become Ray actors.

The classes themselves (``Coordinator``, the shard actor) know nothing of
``ray.remote``; tests build them directly. This module applies the decorator
and the placement options.
"""
from __future__ import annotations

import asyncio
import collections
import functools

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .coordinator import Coordinator

NAMESPACE = "raydcp"

# Handles of coordinators this process used, kept for a while after close().
# A non-detached actor lives only as long as its creator holds a handle (handles
# from get_if_exists/get_actor do not count), so the creating rank must not drop
# its handle while peers may still be waiting for their last reply.
_RECENT_COORDINATORS: collections.deque = collections.deque(maxlen=64)


def coordinator_name(group_name: str, op: int) -> str:
    return f"raydcp:{group_name}:{op}"


class _CoordinatorActor(Coordinator):
    def _schedule_exit(self, delay_s: float) -> None:
        asyncio.get_running_loop().call_later(delay_s, self._exit)

    def _exit(self) -> None:
        try:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        except Exception:  # already on its way out
            pass


_CoordinatorRemote = ray.remote(_CoordinatorActor)


def get_or_create_coordinator(group_name: str, op: int, world_size: int, timeout_s: float, rank: int):
    """The coordinator actor of operation ``op`` of group ``group_name``; the first rank creates it."""
    handle = _CoordinatorRemote.options(
        name=coordinator_name(group_name, op),
        namespace=NAMESPACE,
        get_if_exists=True,
        num_cpus=0,
        max_restarts=0,
        # every rank has at most one call in flight, plus close() and status()
        max_concurrency=max(1000, 4 * world_size),
    ).remote(group_name, op, world_size, timeout_s, rank)
    return handle


def retain_coordinator(handle) -> None:
    """Keep ``handle`` (and so the actor, if this process created it) alive for peers still replying."""
    _RECENT_COORDINATORS.append(handle)


@functools.lru_cache(maxsize=None)
def _remote_class(cls):
    return ray.remote(cls)


def start_shard_actor(cls, rank: int, world_size: int, pg, *, num_gpus: float, num_cpus: float):
    """Start member ``rank`` of a ShardGroup in bundle ``rank`` of placement group ``pg``.

    ``cls`` is ShardActor or a subclass. One extra concurrency slot lets probes
    (``info``, ``apply``) answer while a collective step runs.
    """
    return _remote_class(cls).options(
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        max_concurrency=2,
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
    ).remote(rank, world_size)

