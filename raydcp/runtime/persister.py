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

With a staging cap (``max_staging_bytes``, per rank) the save is staged in
batches of whole files instead: the persister first runs the plan round (the
call waits for it, so that the rank knows its files), then for each batch the
rank stages the batch's pieces and the persister writes them; the rank waits
for every batch but the last to be written before staging the next, so no more
than the cap is staged at a time. The commit follows the last batch in the
background. The stall grows; the staging memory does not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import ray
import torch
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..engine.background import SaveFuture, _batches, _failed
from ..engine.persist import lower_priority
from ..engine.save import (StagedState, _name_storage_error, _reduce_commit, _reduce_save_plan, local_save_plan,
                           save_with, write_rank_files)
from ..engine.staging import StagingArena
from ..errors import CheckpointError, CoordinatorLostError, RankFailure
from ..planner import RankWritePlan, SavePlanOptions
from ..storage import CheckpointStorage
from ..group import Group
from ..state import flatten_state
from .ray_transport import RayTransport

__all__ = ["RayAsyncPersister", "persister_for_this_process"]


def _tensors(pieces) -> list[torch.Tensor]:
    return [torch.from_numpy(np.asarray(p)) if p.size else torch.empty(0, dtype=torch.uint8) for p in pieces]


@dataclass
class _BatchedSave:
    """A save staged in batches, between its plan round and its commit."""

    transport: RayTransport
    checkpoint_id: str
    storage_options: Any
    local_plan: Any
    plan: RankWritePlan
    header: Any
    batches: list  # per batch: [(file name, slots), ...]
    records: list = field(default_factory=list)
    failure: RankFailure | None = None


class _Persister:
    """Runs one rank's save protocol from pieces staged in the object store."""

    def __init__(self) -> None:
        lower_priority()  # persisting yields the CPU to the training processes
        self._batched: _BatchedSave | None = None

    def nice(self) -> int:
        return os.nice(0)

    def ready(self) -> bool:
        import raydcp.engine  # noqa: F401  (the save path's imports, ahead of the first persist)

        return True

    def persist(self, name: str, rank: int, world: int, timeout_s: float, op: int,
                checkpoint_id: str, storage_options, plan, pieces: list[np.ndarray]):
        transport = RayTransport(Group(name, rank, world, timeout_s=timeout_s), op)
        try:
            return save_with(transport, {}, checkpoint_id, storage_options, staged=StagedState(plan, _tensors(pieces)))
        finally:
            transport.close()

    # -- a save staged in batches under a cap: begin, write each batch, commit ----------------------
    def begin(self, name: str, rank: int, world: int, timeout_s: float, op: int, checkpoint_id: str,
              storage_options, local_plan, cap: int) -> list[list[int]]:
        """The plan round; returns the plan items of each batch of this rank's files (in staging order)."""
        transport = RayTransport(Group(name, rank, world, timeout_s=timeout_s), op)
        try:
            options = SavePlanOptions(max_file_bytes=min(cap, SavePlanOptions().max_file_bytes))
            plan, header = transport.reduce_scatter("save: plan", local_plan, partial(_reduce_save_plan, options))
        except BaseException:
            transport.close()
            raise
        batches = _batches(plan, local_plan, cap)
        self._batched = _BatchedSave(transport, checkpoint_id, storage_options, local_plan, plan, header, batches)
        return [[slot.item for _, slots in batch for slot in slots] for batch in batches]

    def write(self, index: int, items: list[int], pieces: list[np.ndarray]) -> bool:
        """Write batch ``index`` (the pieces of ``items``); False once any batch failed."""
        save = self._batched
        if save.failure is None:
            data: list = [None] * len(save.local_plan.items)
            for i, t in zip(items, _tensors(pieces)):
                data[i] = t
            try:
                part = RankWritePlan(save.plan.rank, save.plan.save_id, tuple(save.batches[index]))
                storage = CheckpointStorage(save.checkpoint_id, save.storage_options)
                save.records += write_rank_files(storage, part, StagedState(save.local_plan, data))
            except Exception as exc:
                save.failure = RankFailure.from_exception(save.plan.rank, _name_storage_error(exc, save.checkpoint_id))
        return save.failure is None

    def commit(self, error: RankFailure | str | None = None):
        """The commit round (every rank's, together); ``error``: the rank failed while staging."""
        save, self._batched = self._batched, None
        if error is not None and save.failure is None:
            save.failure = error if isinstance(error, RankFailure) else RankFailure.from_exception(save.plan.rank, CheckpointError(error))
        value = save.failure if save.failure is not None else (save.records, save.header)
        try:
            return save.transport.reduce_scatter("save: commit", value,
                                                 partial(_reduce_commit, save.checkpoint_id, save.storage_options))
        finally:
            save.transport.close()


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
                raise cause.copy() from None
            raise CheckpointError(f"async save failed: {cause!r}") from None
        except rex.RayActorError as exc:
            raise CoordinatorLostError(
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

    def _put(self, staged: StagedState, items: list[int], cap: int | None = None) -> ray.ObjectRef:
        """The snapshot of pieces ``items``: one copy of each into shared memory (device pieces
        through the pinned host arena, non-blocking copies on a side stream, reused across saves)."""
        on_device = [i for i in items if staged.data[i].device.type != "cpu"]
        if on_device:
            self.device_arena.stage(staged, on_device, limit=cap)
        return ray.put([staged.data[i].numpy() for i in items])

    def submit(self, group: Group, state_dict: dict, checkpoint_id: str, storage_options,
               cap: int | None = None) -> SaveFuture:
        staged = local_save_plan(group.rank, flatten_state(state_dict), compare_replicas=group.world_size > 1)
        op = group.next_operation()
        args = (group.name, group.rank, group.world_size, group.timeout_s, op, checkpoint_id, storage_options)
        if cap is None:
            pieces = self._put(staged, list(range(len(staged.plan.items))))
            return SaveFuture(_RayFuture(self.actor.persist.remote(*args, staged.plan, pieces)))
        try:
            batches = _RayFuture(self.actor.begin.remote(*args, staged.plan, cap)).result()
        except CheckpointError as exc:
            return _failed(exc)
        error = None
        try:
            for index, items in enumerate(batches):
                written = self.actor.write.remote(index, items, self._put(staged, items, cap))
                if index < len(batches) - 1 and not ray.get(written):
                    break  # the commit round reports the failure to every rank
        except Exception as exc:
            error = RankFailure.from_exception(group.rank, exc)  # its type and origin travel to every rank
        return SaveFuture(_RayFuture(self.actor.commit.remote(error)))


_PROCESS_PERSISTER: RayAsyncPersister | None = None


def persister_for_this_process() -> RayAsyncPersister:
    global _PROCESS_PERSISTER
    if _PROCESS_PERSISTER is None:
        _PROCESS_PERSISTER = RayAsyncPersister()
    return _PROCESS_PERSISTER
