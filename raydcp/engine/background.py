"""async_save: stage on the caller, persist elsewhere, surface the outcome at result().

Without a group, pieces are staged into one reused arena of this process
(:mod:`raydcp.engine.staging`: private memory the helper reads with ``process_vm_readv``,
or shared memory, per ``RAYDCP_STAGING``) and a helper process
(:class:`HelperPersister`) writes and commits them. The caller waits only for the
flattening and the copies: without a staging cap, planning the files and sending the
job to the helper run on one hand-over thread, after the call has returned (with a
cap, the batches are planned first). Saves are ordered: a save waits until the
previous one has finished before it stages, so the arena is never overwritten while
the helper still reads it.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import os
import threading
from typing import Any

from ..errors import CheckpointError, as_checkpoint_error
from ..metadata import Metadata
from ..planner import RankWritePlan, SavePlanOptions, plan_save
from ..planner.save import ALIGN
from ..state import flatten_state
from .persist import HelperPersister
from .save import local_save_plan
from .staging import StagingArena, staging_mode

__all__ = ["SaveFuture", "start_async_save"]


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
_persister: HelperPersister | None = None
_arena: StagingArena | None = None


def _failed(exc: BaseException) -> SaveFuture:
    fut: cf.Future = cf.Future()
    fut.set_exception(as_checkpoint_error(exc, "async save"))
    return SaveFuture(fut)


def _staging_cap(max_staging_bytes: int | None) -> int | None:
    cap = max_staging_bytes if max_staging_bytes is not None else os.environ.get("RAYDCP_MAX_STAGING_BYTES")
    if cap is None:
        return None
    cap = int(cap)
    if cap < 1 << 10:
        raise CheckpointError(f"max_staging_bytes must be at least 1 KiB, got {cap}")
    return cap


def start_async_save(state_dict: dict, checkpoint_id: str, group, storage_options, max_staging_bytes) -> SaveFuture:
    global _last
    import time

    with _lock:
        if _last is not None:
            _last.wait()  # saves stay ordered, and the staging memory is free again
        t0 = time.perf_counter()
        if group is not None:
            try:
                cap = _staging_cap(max_staging_bytes)
            except CheckpointError as exc:
                return _failed(exc)
            fut = group.open_async_persister().submit(state_dict, checkpoint_id, storage_options, cap)
        else:
            fut = _start_local(state_dict, checkpoint_id, storage_options, max_staging_bytes)
        fut.stall_s = time.perf_counter() - t0
        _last = fut
        return fut


def _start_local(state_dict: dict, checkpoint_id: str, storage_options, max_staging_bytes) -> SaveFuture:
    global _persister, _arena
    try:
        cap = _staging_cap(max_staging_bytes)
        staged = local_save_plan(0, flatten_state(state_dict), compare_replicas=False)
        private = staging_mode() == "private"
    except Exception as exc:  # errors surface at result(), as for the background part
        return _failed(exc)
    if _persister is None:
        _persister = HelperPersister()
        atexit.register(_shutdown)
    if _arena is None or _arena.shared == private:  # first save, or RAYDCP_STAGING changed
        if _arena is not None:
            _arena.close()
        _arena = StagingArena(shared=not private, huge_pages=private)
    # The arena is free to overwrite: the previous save (and batch) has finished with it.
    if cap is None:
        # One batch: stage every piece now; planning the files and handing the job to the helper
        # happen on the hand-over thread, after this call has returned.
        layout = _arena.stage(staged, list(range(len(staged.plan.items))))
        outer: cf.Future = cf.Future()
        _handover().submit(_plan_and_submit, outer, staged, layout, _where(private), private,
                           checkpoint_id, storage_options)
        return SaveFuture(outer)
    try:
        opts = SavePlanOptions(max_file_bytes=min(cap, SavePlanOptions().max_file_bytes))
        gp = plan_save([staged.plan], opts)
    except Exception as exc:
        return _failed(exc)
    header = (gp.save_id, 1, dict(gp.tensors), dict(gp.values))
    batches = _batches(gp.ranks[0], staged.plan, cap)
    records: list = []
    for k, batch in enumerate(batches):
        last = k == len(batches) - 1
        indices = [slot.item for _, slots in batch for slot in slots]
        layout = _arena.stage(staged, indices, limit=cap)
        fut = _persister.submit(_job(_where(private), layout, staged, RankWritePlan(0, gp.save_id, tuple(batch)),
                                     checkpoint_id, storage_options, header if last else None,
                                     records if last else []), reads_memory=private)
        if last:
            return SaveFuture(fut)
        try:
            records = records + fut.result()  # over the cap: the stall grows, the memory does not
        except Exception as exc:
            return _failed(exc)
    raise AssertionError("unreachable: there is always a last batch")


def _where(private: bool) -> dict:
    """Where the helper finds the staged bytes: this process's private arena, or the shared one."""
    if private:
        return {"source": {"pid": os.getpid(), "address": _arena.address, "size": _arena.buffer.numel()}}
    return {"arena": _arena.shm_name, "arena_size": _arena.buffer.numel()}


def _job(where: dict, layout: dict, staged, write_plan: RankWritePlan, checkpoint_id: str, storage_options,
         header, records: list) -> dict:
    return {**where, "layout": layout, "local_plan": staged.plan, "write_plan": write_plan,
            "checkpoint_id": checkpoint_id, "storage_options": storage_options, "header": header,
            "records": records}


_handover_pool: cf.ThreadPoolExecutor | None = None


def _handover() -> cf.ThreadPoolExecutor:
    """One thread, so jobs reach the helper in the order of the saves."""
    global _handover_pool
    if _handover_pool is None:
        _handover_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="raydcp-handover")
    return _handover_pool


def _plan_and_submit(outer: cf.Future, staged, layout: dict, where: dict, private: bool, checkpoint_id: str,
                     storage_options) -> None:
    """On the hand-over thread: plan the files of a staged save, send the job to the helper, and
    resolve ``outer`` with the helper's answer (or this step's error)."""
    try:
        gp = plan_save([staged.plan], SavePlanOptions())
        header = (gp.save_id, 1, dict(gp.tensors), dict(gp.values))
        inner = _persister.submit(_job(where, layout, staged, gp.ranks[0], checkpoint_id, storage_options,
                                       header, []), reads_memory=private)
    except BaseException as exc:
        outer.set_exception(as_checkpoint_error(exc, "async save"))
        return

    def resolve(done: cf.Future) -> None:
        exc = done.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(done.result())
    inner.add_done_callback(resolve)


def _shutdown() -> None:
    """At exit: let the last save finish, stop the helper, free the shared staging memory."""
    if _last is not None:
        _last.wait()
    if _persister is not None:
        _persister.close()
    if _arena is not None:
        _arena.close()


def _batches(plan: RankWritePlan, local_plan, cap: int | None) -> list[list]:
    """Group a rank's files into batches whose staged bytes stay under the cap (one batch without a cap)."""
    if cap is None or not plan.files:
        return [list(plan.files)]
    out: list[list] = [[]]
    used = 0
    for name, slots in plan.files:
        size = sum(-(-local_plan.items[s.item].nbytes // ALIGN) * ALIGN for s in slots)
        if out[-1] and used + size > cap:
            out.append([])
            used = 0
        out[-1].append((name, slots))
        used += size
    return out
