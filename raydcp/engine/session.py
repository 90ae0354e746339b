"""One rank's save run where its writes run: the persisting side of an asynchronous save.

Both asynchronous persisters -- the helper process (:mod:`raydcp.engine.persist_worker`) and
the Ray persister actor (``raydcp.runtime.persister``) -- run a :class:`PersistSession` per
save, over the transport of the save's operation (in-process for one rank, Ray for a group),
driven by the three calls of :class:`raydcp.engine.background.AsyncPersister`:

1. ``begin`` -> :meth:`PersistSession.begin`: the plan step of the save protocol
   (:func:`raydcp.engine.protocol.plan_round`); returns the plan items of each *batch* of
   this rank's files (whole files, at most ``cap`` staged bytes each; one batch without a cap);
2. ``write`` -> :meth:`PersistSession.write`, once per batch, in order: the write step for
   that batch's files, from the pieces the caller staged for it; records accumulate;
3. ``commit`` -> :meth:`PersistSession.commit`: the commit step, with every batch's records.

A failure while writing is kept and sent as this rank's failure at the commit, so every rank
fails together; a failed plan step already failed every rank, so ``commit`` raises it again
without another round.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import CheckpointError, RankFailure
from ..metadata import Metadata
from ..options import DEFAULT_SAVE, SaveOptions
from ..planner import LocalSavePlan, RankWritePlan
from ..planner.save import ALIGN
from ..storage import CheckpointStorage
from ..transport import Transport
from .protocol import commit_round, name_storage_error, plan_round
from .save_records import SaveHeader, StorageRecord
from .delta import DeltaSave, remember_commit
from .save import StagedState, delta_save, discard_after_failure, plan_options, write_rank_files

__all__ = ["PersistSession", "batches"]


def batches(plan: RankWritePlan, local_plan: LocalSavePlan, cap: int | None) -> list[list]:
    """Group a rank's files into batches whose staged bytes stay under the cap (one batch without a cap)."""
    if cap is None or not plan.files:
        return [list(plan.files)]
    out: list[list] = [[]]
    used = 0
    items = local_plan.items
    for name, slots in plan.files:
        size = sum(-(-items[s.item].nbytes // ALIGN) * ALIGN for s in slots)
        if out[-1] and used + size > cap:
            out.append([])
            used = 0
        out[-1].append((name, slots))
        used += size
    return out


class PersistSession:
    """One rank's save between its plan step and its commit (see the module doc); ``options``
    are the save's (file size cap, write path's IOOptions), ``cap`` its staging cap per rank."""

    def __init__(self, transport: Transport, checkpoint_id: str, storage_options: dict | None,
                 local_plan: LocalSavePlan, cap: int | None = None, options: SaveOptions = DEFAULT_SAVE):
        self.transport = transport
        self.options = options
        self.checkpoint_id = checkpoint_id
        self.storage_options = storage_options
        self.local_plan = local_plan
        self.cap = cap
        self.plan: RankWritePlan | None = None
        self.header: SaveHeader | None = None
        self.batches: list[list] = []
        self.records: list[StorageRecord] = []
        self.failure: RankFailure | None = None   # this rank failed writing: sent at the commit
        self.plan_error: BaseException | None = None  # the plan step failed (on every rank)
        self.delta: DeltaSave | None = None  # a save with a base (SaveOptions.base)

    def begin(self) -> list[list[int]]:
        """Step 1: the plan round; returns the plan items of each batch (in staging order)."""
        local: Any = self.local_plan
        try:
            self.delta = delta_save(self.transport, self.checkpoint_id, self.storage_options, self.options)
        except Exception as exc:  # a bad base: every rank fails at the plan step
            local = RankFailure.from_exception(self.transport.rank, exc)
        try:
            self.plan, self.header = plan_round(self.transport, local,
                                                plan_options(self.options, cap=self.cap),
                                                checkpoint_id=self.checkpoint_id,
                                                storage_options=self.storage_options)
        except BaseException as exc:
            self.plan_error = exc
            raise
        self.batches = batches(self.plan, self.local_plan, self.cap)
        return [[slot.item for _, slots in batch for slot in slots] for batch in self.batches]

    def write(self, index: int, staged: StagedState,
              read: Callable[[str, int, int, int, int], None] | None = None) -> bool:
        """Step 2 for batch ``index`` from ``staged`` (or ``read``, see ``write_rank_files``);
        False once this save failed."""
        if self.plan_error is not None:
            return False
        if self.failure is None:
            try:
                part = RankWritePlan(self.plan.rank, self.plan.save_id, tuple(self.batches[index]))
                storage = CheckpointStorage(self.checkpoint_id, self.storage_options)
                self.records.append(write_rank_files(storage, part, staged, read, io=self.options.io,
                                                     compression=self.options.compression, delta=self.delta))
            except Exception as exc:
                self.failure = RankFailure.from_exception(
                    self.transport.rank, name_storage_error(exc, self.checkpoint_id))
        return self.failure is None

    def fail(self, error: RankFailure | str) -> None:
        """This rank failed outside the session (e.g. while staging a batch): the commit says so,
        with the failure's type and origin where it is a :class:`RankFailure`."""
        if self.failure is None and self.plan_error is None:
            self.failure = (error if isinstance(error, RankFailure)
                            else RankFailure.from_exception(self.transport.rank, CheckpointError(error)))

    def commit(self) -> Metadata:
        """Step 3: the commit round, with this rank's records (or its failure)."""
        if self.plan_error is not None:
            raise self.plan_error
        value: Any = self.failure if self.failure is not None else (StorageRecord.concat(self.records), self.header)
        try:
            md = commit_round(self.transport, value, self.checkpoint_id, self.storage_options)
        except CheckpointError as exc:
            discard_after_failure(CheckpointStorage(self.checkpoint_id, self.storage_options), [self.plan], exc)
            raise
        if self.delta is not None:
            remember_commit(CheckpointStorage(self.checkpoint_id, self.storage_options), self.delta.writer)
        return md
