"""``raydcp.train.save`` / ``restore``: collective checkpoints inside a Ray Train run.

Save, per report (every rank of the worker group calls it together):

1. rank 0 names the checkpoint directory (``raydcp-step<step>-<nonce>``) and
   broadcasts the name with ``ray.train.collective.broadcast_from_rank_zero``,
   together with the name of the worker group's raydcp Group;
2. every rank saves its part with ``raydcp.save`` straight into
   ``<run storage>/<name>``; the metadata commits last. The Group,
   ``Group("raydcp-train:<run>:<nonce>", world rank, world size)``, is made once
   per worker group (each attempt of the run gets a new one) and reused by every
   save and restore of that worker group: its operations are numbered in call
   order, which all ranks share since both calls are collectives;
3. every rank calls ``ray.train.report(metrics, checkpoint=<that directory>,
   checkpoint_upload_mode=NO_UPLOAD)``: nothing is copied, and Ray Train's
   checkpoint manager registers it (``CheckpointConfig.num_to_keep`` and
   ``checkpoint_score_attribute`` apply; ``ray.train.get_checkpoint()`` returns it).

A failure on any rank before step 3 fails the save on every rank (raydcp saves
are all-or-nothing) and nothing is reported, so Ray Train never registers a
partial checkpoint.

Restore: the run's newest committed checkpoint -- ``ray.train.get_checkpoint()`` (the
run's latest registered one, also for a new trainer with the same ``RunConfig(name,
storage_path)``), or a newer one raydcp committed that Ray Train never registered (an
emergency save of survivors, :mod:`raydcp.train.latest`) -- is loaded by every rank with
``raydcp.load``, resharded to the current world size.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import ray.train

from .. import api
from ..engine.background import SaveFuture
from ..errors import CheckpointError
from ..metadata import Metadata
from ..options import SaveOptions
from ..storage import CheckpointStorage
from ..runtime.train_group import group_named, new_nonce, proposed_group_name, train_context, worker_group
from ._context import checkpoint_dir_name, fsspec_location, is_raydcp_dir_name
from .train_state import TrainState

__all__ = ["save", "restore", "worker_group", "METRICS_KEY", "run_checkpoint_dirs", "remove_uncommitted"]

logger = logging.getLogger(__name__)

METRICS_KEY = "raydcp"  # raydcp.train.save adds its own numbers under this key of the reported metrics


def _context(api: str):
    ctx = train_context()
    if ctx is None:
        raise CheckpointError(f"raydcp.train.{api} must be called inside a Ray Train training function "
                              "(the function passed to TorchTrainer); outside Ray Train use raydcp.save/load")
    return ctx


def _as_state_dict(state: Any) -> dict:
    if isinstance(state, TrainState):
        return {"train": state}
    if not isinstance(state, dict):
        raise CheckpointError(f"state_dict must be a dict or a raydcp.train.TrainState, got {type(state).__name__}")
    return state


def _train_states(state: dict, prefix: str = ""):
    """(FQN prefix, TrainState) for every TrainState reachable through dicts."""
    for key, value in state.items():
        if isinstance(value, TrainState):
            yield f"{prefix}{key}.", value
        elif isinstance(value, dict):
            yield from _train_states(value, f"{prefix}{key}.")


def _step_of(state: dict, metrics: dict | None) -> int | None:
    for _, ts in _train_states(state):
        return ts.step
    step = (metrics or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def save(state_dict: Any, metrics: dict | None = None, *, step: int | None = None,
         storage_options: dict | None = None, timeout_s: float = 600.0, wait_registered: bool = False,
         async_save: bool = False, max_staging_bytes: int | None = None, memory: bool = False,
         persist_every: int = 1, persist: bool | None = None, memory_options: dict | None = None,
         incremental: bool = False, _emergency: dict | None = None) -> Metadata | SaveFuture:
    """Save this rank's part of ``state_dict`` as one checkpoint of the run, and report it.

    Every worker calls it at the same point (it is a collective, like
    ``ray.train.report``, which it calls). ``metrics`` are reported with the
    checkpoint (rank 0's count for ``checkpoint_score_attribute``); raydcp adds its
    own under ``metrics["raydcp"]`` (step, seconds, bytes, world_size, save_id).
    ``step`` names the directory; by default the step of a TrainState in the state
    dict, else ``metrics["step"]``. ``storage_options`` are fsspec options for the
    run's storage (credentials/endpoint of s3:// storage). Returns the metadata.

    The checkpoint counts (``get_checkpoint`` returns it after a restart) once Ray
    Train's controller has taken every rank's report, at its next poll of the
    workers; a worker that dies before that loses it, as with any Ray Train
    checkpoint. ``wait_registered=True`` returns only after that point (emergency
    saves do), at the cost of up to one poll interval.

    ``async_save=True`` stalls training only while the state is staged (copied
    to the object store); a persister actor beside each rank writes it and the
    group commits it in the background (see :func:`raydcp.async_save`), and the
    call returns a :class:`raydcp.SaveFuture` at once. The report is made with
    ``checkpoint_upload_mode=ASYNC``: Ray Train registers the checkpoint only
    after it has committed, in the order of the saves, and a persist that fails
    fails the run (on the next report or at the end of the training function),
    as Ray Train's own asynchronous uploads do. A later save waits for the
    previous one to commit first. ``metrics["raydcp"]`` then carries
    ``stall_seconds`` (staging) and ``persist_seconds`` (call to commit).
    ``max_staging_bytes`` caps the staging memory of an asynchronous save per
    node (shared evenly by the node's workers); above it the state is staged and
    written in batches and the stall grows instead.

    ``memory=True`` first saves the checkpoint into the memory of the run's nodes
    (``raymem://``, see :mod:`raydcp.train.memory_saves`; ``memory_options`` are its
    storage_options: replicas, node_cap_bytes), replacing the previous memory
    checkpoint once committed, and writes it to the run's storage (and reports it to
    Ray Train) only at the steps that are multiples of ``persist_every`` (the run's
    step, as above: a restart carries on counting where the run stopped), or when
    ``persist=True`` (pass it for the run's last checkpoint, which otherwise lives
    in memory only; ``persist=False`` keeps this one in memory whatever the step).
    The other saves report the metrics alone, with ``metrics["raydcp"]["tier"] ==
    "memory"`` (``"storage"`` for persisted ones). :func:`restore` loads from memory
    when the newest checkpoint is there. Returns the metadata of the memory
    checkpoint when it is not persisted.

    ``incremental=True`` saves a delta checkpoint (docs/delta.md): only the pieces
    that changed since the run's previous checkpoint are written. Its data lies
    under ``<run>/raydcp-data/`` (:mod:`raydcp.train.incremental`), which Ray
    Train's ``num_to_keep`` never deletes; the checkpoint Ray Train registers reads
    from there, and loads and restores like any other. ``metrics["raydcp"]`` then
    carries ``written_bytes`` and ``referenced_bytes``. Emergency saves are full.
    """
    ctx = _context("save")
    state = _as_state_dict(state_dict)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    storage = ctx.get_storage()
    if step is None:
        step = _step_of(state, metrics)
    if memory:
        from .memory_saves import should_persist

        persist_now = should_persist(step, persist_every, persist)  # checked before anything is written
    elif persist is not None and persist is not True:
        raise CheckpointError(f"raydcp.train.save(persist={persist!r}) without memory=True: every checkpoint goes to "
                              "storage; persist=False (keep it in the cluster's memory only) needs memory=True")
    save_options = None
    if _emergency is not None:
        # an emergency save (raydcp.train.preemption): no Ray Train collective, which would wait for
        # the preempted workers too; every rank names the directory from the preemption event, and
        # the save commits without the ranks that die meanwhile (a survivors save)
        if async_save:
            raise CheckpointError("an emergency save is synchronous (it commits before the deadline): "
                                  "drop async_save=True from save_on_preemption")
        name, group = checkpoint_dir_name(step, _emergency["nonce"]), worker_group(timeout_s)
        save_options = SaveOptions(survivors=True, leaving=_emergency.get("leaving") or None)
    else:
        proposal = None
        if rank == 0:
            proposal = (checkpoint_dir_name(step, new_nonce()), proposed_group_name(ctx, timeout_s),
                        _incremental_base(storage, storage_options) if incremental else None)
        from ray.train.collective import broadcast_from_rank_zero

        name, group_name, data_base = broadcast_from_rank_zero(proposal)
        group = group_named(ctx, group_name, timeout_s)
    fs_path = storage.build_checkpoint_path_from_name(name)
    url, options = fsspec_location(storage.storage_filesystem, fs_path, storage_options)
    data_url = None
    if incremental and _emergency is None:  # the delta's data under raydcp-data/, a base the run holds
        from .incremental import DATA_DIR

        run_url, _ = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
        data_url = f"{run_url.rstrip('/')}/{DATA_DIR}/{name}"
        save_options = SaveOptions(base=data_base or "previous")

    t0 = time.perf_counter()
    if memory:
        from .memory_saves import memory_root

        mem_url = f"{memory_root(ctx)}/{name}"
        mem_md = api.save(state, mem_url, group=group, storage_options=memory_options,
                          options=SaveOptions(base="previous") if data_url is not None else save_options)
        mem_s = time.perf_counter() - t0
        if _emergency is not None:  # the fastest tier first: the memory checkpoint is the first to hold
            _emergency = {**_emergency, "memory_committed_before_deadline_s": _before_deadline(_emergency)}
        if not persist_now:
            reported = dict(metrics or {})
            reported[METRICS_KEY] = {"step": step, "world_size": world, "checkpoint": name, "mode": "memory",
                                     "tier": "memory", "path": mem_url, "stall_seconds": mem_s,
                                     "memory_seconds": mem_s, "persisted": False,
                                     **_save_numbers(mem_md, mem_s, persist=0.0)}
            ray.train.report(reported)
            return mem_md
    if async_save:
        cap = None if max_staging_bytes is None else int(max_staging_bytes) // ctx.get_local_world_size()
        future = api.async_save(state, data_url or url, group=group, storage_options=options, max_staging_bytes=cap,
                                options=save_options)
        stall = time.perf_counter() - t0
    else:
        md = api.save(state, data_url or url, group=group, storage_options=options, options=save_options)
        stall = time.perf_counter() - t0
        if data_url is not None:
            _register_incremental(rank, data_url, url, name, storage, options, storage_options)

    reported = dict(metrics or {})
    ours = reported[METRICS_KEY] = {"step": step, "world_size": world, "checkpoint": name,
                                    "mode": "async" if async_save else "sync", "tier": "storage",
                                    "stall_seconds": stall}
    if _emergency is not None:
        ours["emergency"] = {k: v for k, v in _emergency.items() if k not in ("nonce", "leaving")}
        ours["emergency"]["committed_before_deadline_s"] = _before_deadline(_emergency)
        if not async_save:
            from ..engine.survivors import lost_ranks

            ours["emergency"]["lost_ranks"] = lost_ranks(md)
    if memory:
        ours.update(memory_seconds=mem_s, memory_path=mem_url, persisted=True)
    from ray.train import Checkpoint, CheckpointUploadMode

    checkpoint = Checkpoint(path=fs_path, filesystem=storage.storage_filesystem)
    if async_save:
        def wait_committed(ckpt, _dir_name):
            # Ray Train's upload thread: registers the checkpoint only once the group has committed it.
            # The report's metrics are this dict, so the numbers filled in here travel with it.
            done = future.result()
            if data_url is not None:
                _register_incremental(rank, data_url, url, name, storage, options, storage_options)
                ours.update(_incremental_numbers(done))
            ours.update(_save_numbers(done, time.perf_counter() - t0, persist=time.perf_counter() - t0 - stall))
            return ckpt

        ray.train.report(reported, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=False, checkpoint_upload_fn=wait_committed)
    else:
        ours.update(_save_numbers(md, stall, persist=stall))
        if data_url is not None:
            ours.update(_incremental_numbers(md))
        ray.train.report(reported, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    if wait_registered:  # every rank waits, so none can move on (and die) before the controller has it
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    return future if async_save else md


def _incremental_base(storage, storage_options: dict | None) -> str | None:
    """Rank 0: the base of the run's next incremental save (its newest data checkpoint), or None."""
    from .incremental import latest_data

    run_url, options = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
    return latest_data(run_url, options)


def _register_incremental(rank: int, data_url: str, url: str, name: str, storage, options: dict | None,
                          storage_options: dict | None) -> None:
    """Rank 0, once the data committed: commit the checkpoint Ray Train registers, then sweep the
    data whose checkpoints Ray Train removed (a failed sweep is retried at the next save)."""
    if rank != 0:
        return
    from .incremental import commit_registered, sweep

    commit_registered(data_url, url, options)
    run_url, _ = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
    try:
        removed = sweep(run_url, name, options)
        if removed:
            logger.info("raydcp: removed the data of checkpoints Ray Train no longer keeps: %s", removed)
    except CheckpointError as exc:
        logger.warning("raydcp: the data of removed checkpoints stays until the next save: %s", exc)


def _incremental_numbers(md: Metadata) -> dict:
    return {"written_bytes": int(md.owned_bytes), "referenced_bytes": int(sum(md.references.values()))}


def _before_deadline(emergency: dict) -> float | None:
    """Seconds from now to an emergency save's preemption deadline (negative: past it)."""
    deadline_ms = emergency.get("deadline_ms")
    return None if deadline_ms is None else deadline_ms / 1000.0 - time.time()


def _save_numbers(md: Metadata, seconds: float, persist: float) -> dict:
    """What metrics["raydcp"] says of a committed save: seconds from the call to the commit, and
    the persist (the whole save when synchronous; from the call's return to the commit when not)."""
    return {"seconds": seconds, "persist_seconds": persist, "bytes": md.total_bytes, "save_id": md.save_id}


def restore(state_dict: Any, *, strict: bool = True, storage_options: dict | None = None,
            timeout_s: float = 600.0, async_save: bool = False, memory: bool = True,
            memory_options: dict | None = None) -> bool:
    """Load the run's latest checkpoint into ``state_dict``, resharded to this world size.

    Every worker calls it (usually first thing in the training function). Returns
    False, loading nothing, when the run has no checkpoint yet. Tensors are filled
    in place; a :class:`TrainState` is handed its state and applies it (model and
    optimizer through ``set_state_dict``, scheduler, step, data position, RNG).
    Rank 0 first removes checkpoint directories that an earlier attempt left
    uncommitted (no save of this run is in flight while the workers start).
    It also starts the worker group's raydcp coordinator, so the first save does
    not wait for it; ``async_save=True`` (for runs that save with
    ``async_save=True``) starts this rank's persister actor too.

    With ``memory=True`` (the default) a checkpoint of the run held in the cluster's
    memory (``raydcp.train.save(memory=True)``) is loaded instead when it is at least
    as new as the run's latest checkpoint in storage (rank 0 decides for all).
    """
    ctx = _context("restore")
    state = _as_state_dict(state_dict)
    rank = ctx.get_world_rank()
    storage = ctx.get_storage()
    if rank == 0:
        removed = remove_uncommitted(storage, storage_options)
        if removed:
            logger.info("raydcp: removed uncommitted checkpoint directories %s", removed)
    from ray.train.collective import broadcast_from_rank_zero

    checkpoint = ray.train.get_checkpoint()
    choice = None
    if rank == 0:  # the newest committed checkpoint, whether or not Ray Train registered it (train/latest.py)
        from .latest import latest_committed

        stored = latest_committed(storage, checkpoint, run_checkpoint_dirs(storage, storage_options), storage_options)
        choice = (proposed_group_name(ctx, timeout_s), stored,
                  _memory_source(ctx, None if stored is None else stored[0], memory_options) if memory else None)
    group_name, stored, in_memory = broadcast_from_rank_zero(choice)  # also waits for the cleanup
    group = group_named(ctx, group_name, timeout_s)
    api.prepare_group(group, async_save=async_save)  # the first save (or this load) then finds them running
    if in_memory is not None:
        url, options = in_memory, memory_options
    elif stored is None:
        return False
    else:
        url = stored[1]
        _, options = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
    md = api.read_metadata(url, storage_options=options)
    for prefix, ts in _train_states(state):
        ts.prepare_restore(md, prefix)
    api.load(state, url, group=group, strict=strict, storage_options=options)
    return True


def _memory_source(ctx, stored: str | None, memory_options: dict | None) -> str | None:
    """The URL of the run's newest memory checkpoint when it is at least as new as the directory
    ``stored`` (the run's newest committed checkpoint in storage), else None."""
    from .memory_saves import latest_in_memory, memory_root, step_of_dir

    found = latest_in_memory(memory_root(ctx), memory_options)
    if found is None:
        return None
    url, step = found
    if stored is not None:
        stored_step = step_of_dir(stored)
        if step is None or (stored_step is not None and stored_step > step):
            return None
    logger.info("raydcp: restoring from the cluster's memory: %s", url)
    return url


def run_checkpoint_dirs(storage, storage_options: dict | None = None) -> list[tuple[str, str]]:
    """(name, URL) of every directory directly under the run that raydcp.train.save created."""
    from ..storage.paths import location_to_fs

    root, options = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
    fs, path = location_to_fs(root, options)  # a plain local path is literal ('::' included)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") == "directory" and is_raydcp_dir_name(name):
            out.append((name, f"{root.rstrip('/')}/{name}"))
    return sorted(out)


def remove_uncommitted(storage, storage_options: dict | None = None, keep: set[str] = frozenset()) -> list[str]:
    """Delete raydcp checkpoint directories of the run that never committed; returns their names."""
    _, options = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
    removed = []
    for name, url in run_checkpoint_dirs(storage, storage_options):
        ckpt = CheckpointStorage(url, options)
        if name not in keep and not ckpt.is_committed():
            ckpt.delete()
            removed.append(name)
    return removed

