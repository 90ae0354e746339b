"""Background persisting for Ray groups: a persister actor beside each rank.

``raydcp.async_save(..., group=g)`` on a rank:

1. stages: every piece is copied into Ray's object store as one object (one
   ``ray.put`` of the pieces' host byte views: one memcpy each; device pieces
   are first copied into a pinned host arena kept between saves, with
   non-blocking copies on a side stream) -- the call returns after this;
2. hands the object and the rank's local plan to its persister actor, a Ray
   actor pinned to the same node (created on first use, reused, calls run in
   order), which reads the pieces zero-copy and runs the ordinary save protocol
   as rank ``g.rank`` of the group's next operation: plan, write, commit last.

The trainer's process never runs the writes, so they never hold its GIL.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..engine.save import StagedState, local_save_plan, save_with
from ..engine.staging import StagingArena
from ..errors import CheckpointError
from ..group import Group
from ..state import flatten_state
from .ray_transport import RayTransport

__all__ = ["RayAsyncPersister", "persister_for_this_process"]


class _Persister:
    """Runs one rank's save protocol from pieces staged in the object store."""

    def ready(self) -> bool:
        import raydcp.engine  # noqa: F401  (the save path's imports, ahead of the first persist)

        return True

    def persist(self, name: str, rank: int, world: int, timeout_s: float, op: int,
                checkpoint_id: str, storage_options, plan, pieces: list[np.ndarray]):
        data = [torch.from_numpy(np.asarray(p)) if p.size else torch.empty(0, dtype=torch.uint8) for p in pieces]
        transport = RayTransport(Group(name, rank, world, timeout_s=timeout_s), op)
        try:
            return save_with(transport, {}, checkpoint_id, storage_options, staged=StagedState(plan, data))
        finally:
            transport.close()


_PersisterRemote = ray.remote(num_cpus=0, max_restarts=0)(_Persister)


class _RayFuture:
    def __init__(self, ref: ray.ObjectRef):
        self._ref = ref

    def done(self) -> bool:
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self, timeout: float | None = None):
        try:
            return ray.get(self._ref, timeout=timeout)
        except rex.GetTimeoutError:
            raise TimeoutError from None
        except rex.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause), cause.failures) from None
            raise CheckpointError(f"async save failed: {cause!r}") from None
        except rex.RayActorError as exc:
            raise CheckpointError(
                f"the persister actor died before the save committed ({exc.__class__.__name__}); "
                f"nothing was committed and the previous checkpoint at that path is intact: save again") from None


class RayAsyncPersister:
    """The persister actor of this process (one per process, on this node)."""

    def __init__(self) -> None:
        # ray.put copies out of the arena before submit returns, so the next save may reuse it
        self.device_arena = StagingArena()
        node = ray.get_runtime_context().get_node_id()
        self.actor = _PersisterRemote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote()

    def prepare(self) -> None:
        """Have the actor start and import the save path now, without waiting for it."""
        self.actor.ready.remote()

    def submit(self, group: Group, state_dict: dict, checkpoint_id: str, storage_options) -> Any:
        from ..engine.background import SaveFuture

        staged = local_save_plan(group.rank, flatten_state(state_dict), compare_replicas=group.world_size > 1)
        on_device = [i for i, d in enumerate(staged.data) if d.device.type != "cpu"]
        if on_device:  # device pieces: pinned host arena, non-blocking copies on a side stream, reused
            self.device_arena.stage(staged, on_device)
        views = [d.numpy() for d in staged.data]
        pieces = ray.put(views)  # the snapshot: one copy of every piece into shared memory
        op = group.next_operation()
        ref = self.actor.persist.remote(group.name, group.rank, group.world_size, group.timeout_s, op,
                                        checkpoint_id, storage_options, staged.plan, pieces)
        return SaveFuture(_RayFuture(ref))


_PROCESS_PERSISTER: RayAsyncPersister | None = None


def persister_for_this_process() -> RayAsyncPersister:
    global _PROCESS_PERSISTER
    if _PROCESS_PERSISTER is None:
        _PROCESS_PERSISTER = RayAsyncPersister()
    return _PROCESS_PERSISTER
