"""async_save: stage on the caller, persist elsewhere, surface the outcome at result().

Without a group, pieces are staged into one reused arena of this process
(:mod:`raydcp.engine.staging`: private memory the helper reads with ``process_vm_readv``,
or shared memory, per ``RAYDCP_STAGING``) and a helper process
(:class:`HelperPersister`) writes and commits them. Saves are ordered: a save waits
until the previous one has finished before it stages, so the arena is never
overwritten while the helper still reads it.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import os
import threading
from typing import Any

from ..errors import CheckpointError
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
    fut.set_exception(exc if isinstance(exc, CheckpointError) else CheckpointError(f"{type(exc).__name__}: {exc}"))
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
        opts = SavePlanOptions() if cap is None else SavePlanOptions(max_file_bytes=min(cap, SavePlanOptions().max_file_bytes))
        gp = plan_save([staged.plan], opts)
    except Exception as exc:  # errors surface at result(), as for the background part
        return _failed(exc)
    try:
        private = staging_mode() == "private"
    except CheckpointError as exc:
        return _failed(exc)
    if _persister is None:
        _persister = HelperPersister()
        atexit.register(_shutdown)
    if _arena is None or _arena.shared == private:  # first save, or RAYDCP_STAGING changed
        if _arena is not None:
            _arena.close()
        _arena = StagingArena(shared=not private, huge_pages=private)
    header = (gp.save_id, 1, dict(gp.tensors), dict(gp.values))
    batches = _batches(gp.ranks[0], staged.plan, cap)
    records: list = []
    for k, batch in enumerate(batches):
        last = k == len(batches) - 1
        indices = [slot.item for _, slots in batch for slot in slots]
        # the arena is free to overwrite: the previous save (or batch) has finished with it
        layout = _arena.stage(staged, indices, limit=cap)
        where = ({"source": {"pid": os.getpid(), "address": _arena.address, "size": _arena.buffer.numel()}}
                 if private else {"arena": _arena.shm_name, "arena_size": _arena.buffer.numel()})
        fut = _persister.submit({
            **where, "layout": layout,
            "local_plan": staged.plan, "write_plan": RankWritePlan(0, gp.save_id, tuple(batch)),
            "checkpoint_id": checkpoint_id, "storage_options": storage_options,
            "header": header if last else None, "records": records if last else [],
        }, reads_memory=private)
        if last:
            return SaveFuture(fut)
        try:
            records = records + fut.result()  # over the cap: the stall grows, the memory does not
        except Exception as exc:
            return _failed(exc)
    raise AssertionError("unreachable: there is always a last batch")


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
