"""async_save on the caller: stage, hand over to a persister, surface the outcome at result().

The persisting side runs the save protocol (:mod:`raydcp.engine.protocol`) in a
:class:`~raydcp.engine.session.PersistSession`, wherever the writes run. The caller talks to
it through an :class:`AsyncPersister`, chosen by the API layer for the call
(:func:`raydcp.api.resolve_group`): the helper process of a process saving alone
(:class:`raydcp.engine.persist.LocalPersister`) or the persister actor beside a Ray rank
(``raydcp.runtime.persister.RayPersister``). One loop (:func:`start_async_save`) drives both.

Saves are ordered: a save waits until the previous one has finished before it stages, so the
staging memory is never overwritten while a persister still reads it.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, Protocol

from ..errors import CheckpointError, RankFailure, as_checkpoint_error
from ..metadata import Metadata
from ..options import DEFAULT_SAVE, AsyncOptions, SaveOptions
from ..planner import LocalSavePlan
from ..state import flatten_state
from ..storage import CheckpointStorage
from ..storage.capacity import reserves_capacity
from .save import StagedState, local_save_plan

__all__ = ["SaveFuture", "AsyncPersister", "start_async_save", "failed_save", "wait_for_last_save"]


class Future(Protocol):
    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...


class AsyncPersister(Protocol):
    """Where one rank's asynchronous saves are written. Protocol, for each save, from the caller:

    1. ``begin(plan, checkpoint_id, storage_options, options, save_options)``: hand over the
       rank's local plan (or its :class:`~raydcp.errors.RankFailure`) and the save's
       :class:`~raydcp.options.SaveOptions`; the persister runs the plan step and writes with
       them. The future gives the plan items of each batch of this rank's files (one batch
       without ``options.max_staging_bytes``; the caller then does not wait for it, unless the
       destination reserves room at the plan step, :mod:`raydcp.storage.capacity`).
    2. ``write(index, staged, items)``, once per batch, in order: stage the pieces ``items`` now
       (the only part the caller waits for; later in-place updates do not leak in) and have the
       persister write that batch. The future says whether this rank's writes succeeded so far;
       the caller waits for it before staging the next batch (so no more than the cap is staged).
    3. ``commit(error)``: the commit step, with ``error`` if staging failed on this rank. The
       future gives the Metadata, or raises the save's CheckpointError.
    """

    rank: int
    world_size: int

    def begin(self, plan: LocalSavePlan | RankFailure, checkpoint_id: str, storage_options: dict | None,
              options: AsyncOptions, save_options: SaveOptions) -> Future: ...

    def write(self, index: int, staged: StagedState, items: list[int]) -> Future: ...

    def commit(self, error: "RankFailure | str | None") -> Future: ...


class SaveFuture:
    """The result of ``raydcp.async_save``: ``result(timeout)`` -> Metadata, or raises the save's error."""

    def __init__(self, future: Any, stall_s: float = 0.0):
        self._future = future  # concurrent.futures.Future or anything with done()/result(timeout)
        self.stall_s = stall_s  # how long the call blocked the caller (staging)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Metadata:
        try:
            return self._future.result(timeout)
        except (cf.TimeoutError, TimeoutError):
            raise CheckpointError(f"async save not finished within {timeout}s; call result() again to keep waiting") from None

    def wait(self) -> None:
        """Block until finished, whatever the outcome (errors stay for result())."""
        try:
            self._future.result()
        except BaseException:
            pass


_lock = threading.Lock()
_last: SaveFuture | None = None


def failed_save(exc: BaseException) -> SaveFuture:
    """A SaveFuture whose result() raises ``exc`` (as a CheckpointError)."""
    fut: cf.Future = cf.Future()
    fut.set_exception(as_checkpoint_error(exc, "async save"))
    return SaveFuture(fut)


def wait_for_last_save() -> None:
    """Block until this process's last async save finished (at exit, before the persister stops)."""
    if _last is not None:
        _last.wait()


def start_async_save(persister: AsyncPersister, state_dict: dict, checkpoint_id: str, storage_options,
                     options: AsyncOptions, save_options: SaveOptions = DEFAULT_SAVE) -> SaveFuture:
    """Stage ``state_dict`` and have ``persister`` save it with ``save_options`` (every rank of the
    group calls it together)."""
    global _last
    with _lock:
        if _last is not None:
            _last.wait()  # saves stay ordered, and the staging memory is free again
        t0 = time.perf_counter()
        fut = _run(persister, state_dict, checkpoint_id, storage_options, options, save_options)
        fut.stall_s = time.perf_counter() - t0
        _last = fut
        return fut


def _run(persister: AsyncPersister, state_dict: dict, checkpoint_id: str, storage_options,
         options: AsyncOptions, save_options: SaveOptions) -> SaveFuture:
    rank = persister.rank
    staged: StagedState | None = None
    try:
        staged = local_save_plan(rank, flatten_state(state_dict), compare_replicas=persister.world_size > 1)
        local: Any = staged.plan
    except Exception as exc:
        if persister.world_size == 1:
            return failed_save(exc)
        local = RankFailure.from_exception(rank, exc)  # the plan step fails every rank, naming this one
    try:
        begun = persister.begin(local, checkpoint_id, storage_options, options, save_options)
    except Exception as exc:  # errors surface at result(), as for the background part
        return failed_save(exc)
    if staged is None:
        return SaveFuture(begun)
    try:
        if options.max_staging_bytes is None and not _reserves_room(checkpoint_id, storage_options):
            batches = [list(range(len(staged.plan.items)))]
        else:  # staged in batches, or a destination that may refuse the save at its plan: plan first
            batches = begun.result()
    except (CheckpointError, TimeoutError) as exc:
        return failed_save(exc)
    error = None
    try:
        for index, items in enumerate(batches):
            written = persister.write(index, staged, items)
            if index < len(batches) - 1 and not written.result():
                break  # over the cap: the stall grows, the memory does not; the commit reports the failure
    except Exception as exc:
        error = RankFailure.from_exception(rank, exc)  # its type and origin travel to every rank
    return SaveFuture(persister.commit(error))


def _reserves_room(checkpoint_id: str, storage_options) -> bool:
    """Whether the destination reserves room for a save at its plan step (``raymem://``): the
    caller then waits for the plan before it stages, so a save that does not fit stages nothing."""
    try:
        return reserves_capacity(CheckpointStorage(checkpoint_id, storage_options))
    except Exception:
        return False  # a bad path or option: the persister's plan step reports it
