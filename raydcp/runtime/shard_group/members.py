"""The actors of ShardGroups and how long they live.

An actor can be a member of several ShardGroups at once (``ShardGroup.reshard``
keeps the source group's actors in the new group), so an actor ends when the
last group using it shuts down, and a placement group is removed when the last
actor placed in it has ended (removing it earlier would kill the actors still
in it). Nothing here waits for an actor to start.
"""
from __future__ import annotations

import ray
from ray import exceptions as rex
from ray.util.placement_group import placement_group, remove_placement_group

from ...errors import CheckpointError
from .. import actors
from ..actors import start_shard_actor

__all__ = ["Host", "Member", "start_members"]


class Host:
    """The operations of a ShardGroup and of the groups its reshards make, in the coordinator host.

    The cluster's coordinator host (:mod:`raydcp.runtime.actors`) runs them, its state for them
    held under the first group's name; the first group starts the host if none runs (in the
    background), and the state is released with the last group of them.
    """

    def __init__(self, name: str, world_size: int):
        self.name = name
        self.groups: set[str] = set()
        actors.prepare_host()

    def join(self, group_name: str) -> "Host":
        self.groups.add(group_name)
        return self

    def leave(self, group_name: str) -> None:
        if group_name in self.groups:
            self.groups.discard(group_name)
            if not self.groups:
                actors.release_owner(self.name)


class _Placement:
    """A placement group and the number of its actors still alive."""

    def __init__(self, pg, live: int):
        self.pg = pg
        self.live = live

    def release_one(self) -> None:
        self.live -= 1
        if self.live <= 0 and self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


class Member:
    """One actor and the names of the ShardGroups it is a member of."""

    def __init__(self, handle, placement: _Placement, resources: tuple[float, float]):
        self.handle = handle
        self.placement = placement
        self.resources = resources  # (GPUs, CPUs) it was started with
        self.groups: set[str] = set()

    def join(self, group_name: str) -> "Member":
        self.groups.add(group_name)
        return self

    def leave(self, group_name: str) -> None:
        """``group_name`` is done with this actor: drop its state there, or end the actor if it was the last."""
        self.groups.discard(group_name)
        if self.handle is None:
            return
        if self.groups:
            self.handle.drop.remote(group_name)
            return
        self.end()

    def end(self) -> None:
        if self.handle is None:
            return
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:
            pass
        self.handle = None
        self.placement.release_one()


def start_members(cls, count: int, bundles: list[dict], *, num_gpus: float, num_cpus: float,
                  timeout_s: float, first_rank: int = 0, world_size: int | None = None) -> list[Member]:
    """Reserve ``bundles`` in a new placement group and start one ``cls`` actor in each (in the background).

    Fails with a CheckpointError when the cluster cannot give the bundles within ``timeout_s``.
    """
    if count == 0:
        return []
    pg = placement_group(bundles[:count], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except rex.GetTimeoutError:
        try:
            remove_placement_group(pg)
        except Exception:
            pass
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise CheckpointError(
            f"ShardGroup: could not reserve {count} x {bundles[0]} within {timeout_s:g}s; the cluster "
            f"has {free} free; free resources or raise timeout_s"
        ) from None
    placement = _Placement(pg, count)
    world = world_size or count
    return [Member(start_shard_actor(cls, first_rank + i, world, pg, num_gpus=num_gpus, num_cpus=num_cpus,
                                     bundle=i), placement, (num_gpus, num_cpus))
            for i in range(count)]
