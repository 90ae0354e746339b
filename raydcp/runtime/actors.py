"""The one place where raydcp's plain classes become Ray actors.

The classes themselves (``Coordinator``, the shard actor) know nothing of
``ray.remote``; tests build them directly. This module applies the decorator
and the placement options.
"""
from __future__ import annotations

import asyncio
import collections

import ray

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
