"""The public save / load / async_save / read_metadata, and where a call's machinery is chosen.

The engine (:mod:`raydcp.engine`) runs one rank's part of a save or load over whatever
:class:`~raydcp.transport.Transport` and :class:`~raydcp.engine.background.AsyncPersister` it is
handed, as DCP's ``_save_state_dict`` takes its ``_DistWrapper``; it never imports Ray. This
layer picks them, in one function, :func:`resolve_group`:

- ``group=None``: one participant; the in-process :class:`~raydcp.transport.LocalTransport`,
  and for ``async_save`` this process's helper-process persister
  (:class:`~raydcp.engine.persist.LocalPersister`);
- a :class:`~raydcp.Group`: the Ray transport of the group's next operation and the persister
  actor beside this rank (:mod:`raydcp.runtime`, imported on first use).

(:class:`~raydcp.transport.ThreadTransport`, N ranks as threads of one process, is handed to
the engine's ``*_with`` functions directly, by tests and tools.) The options of a call are read
here too, once (:class:`~raydcp.options.AsyncOptions`, with the ``RAYDCP_*`` overrides;
:class:`~raydcp.options.SaveOptions` and :class:`~raydcp.options.LoadOptions`, the defaults
where a call gives none) and handed to the engine as parameters, and so is the pipeline's
Ray driver (:func:`pipeline_driver`).
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .engine.background import AsyncPersister, SaveFuture, failed_save, start_async_save
from .convert.detect import with_format_hint
from .engine.load import LoadStats, load_with, transfer_with
from .engine.load import read_metadata as read_metadata_with
from .engine.save import save_with
from .errors import CheckpointError, CheckpointNotFoundError
from .group import Group
from .metadata import Metadata
from .options import DEFAULT_LOAD, DEFAULT_SAVE, AsyncOptions, LoadOptions, SaveOptions
from .transport import LocalTransport, Transport

__all__ = ["save", "load", "async_save", "read_metadata", "transfer", "resolve_group", "GroupBinding",
           "prepare_group", "pipeline_driver", "current_node_id"]


@dataclass(frozen=True)
class GroupBinding:
    """What one call of the public API runs over: made by :func:`resolve_group`.

    ``open_transport()`` opens the transport of the call's operation (for a Ray group this
    numbers the operation, so call it once per operation; ``open_transport(survivors=True)`` one
    that goes on without lost ranks, for a Ray group only); ``persister(options)`` is the
    asynchronous persister of this rank.
    """

    group: Group | None
    open_transport: Callable[..., Transport]  # keywords: survivors=True, leaving (a Ray group)
    persister: Callable[[AsyncOptions], AsyncPersister]


def implicit_group() -> Group | None:
    """What ``group=None`` means here: inside a Ray Train worker, the worker group's own Group
    (:func:`raydcp.runtime.train_group.worker_group`); else one participant (None). A process of a
    torch.distributed job of several ranks is refused: each rank would save alone."""
    if "ray.train" in sys.modules:  # a Ray Train worker has imported it already; elsewhere skip the import
        from .runtime.train_group import worker_group

        group = worker_group()
        if group is not None:
            return group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        raise CheckpointError(
            f"torch.distributed is initialized (rank {rank} of {world}) but no group was passed: pass "
            "group=raydcp.Group(NAME, dist.get_rank(), dist.get_world_size()) on every rank, with the same NAME; "
            "to save or load from this process alone, group=raydcp.Group(NAME, 0, 1)")
    return None


def resolve_group(group: Group | None) -> GroupBinding:
    """The transport and persister for a call with ``group``: the one place that picks them.

    ``group=None`` is first resolved by :func:`implicit_group` (a Ray Train worker's own Group)."""
    if group is None:
        group = implicit_group()
    if group is None:
        from .engine.persist import local_persister

        return GroupBinding(None, LocalTransport, lambda options: local_persister())
    if not isinstance(group, Group):
        raise CheckpointError(f"group must be a raydcp.Group or None, got {type(group).__name__}")
    from .runtime.persister import RayPersister, persister_for_this_process
    from .runtime.ray_transport import open_transport

    return GroupBinding(group, lambda **kw: open_transport(group, **kw),
                        lambda options: RayPersister(group, persister_for_this_process(options.persist_nice)))


def prepare_group(group: Group, *, async_save: bool = False, state_dict: dict | None = None) -> None:
    """Start the cluster's coordinator host in the background, if none runs (returns at once; optional).

    Every group's operations run in one coordinator host per Ray cluster; the first operation in a
    fresh cluster otherwise pays for starting it (a Ray actor, and the imports its reductions
    need); a rank that calls this at start-up, e.g. before its first training step, moves that
    cost off the first checkpoint. One rank is enough; every rank may call it.
    ``async_save=True`` also starts this rank's persister actor, which the first ``async_save``
    would otherwise start (its first persist then competes with training for as long as the actor
    takes to start); with ``state_dict`` (what this rank will pass to ``async_save``) it also
    allocates the shared memory the rank stages that state into, so that the first ``async_save``
    blocks only for a copy into memory already mapped, as later ones do.
    """
    if not isinstance(group, Group):
        raise CheckpointError(f"group must be a raydcp.Group, got {type(group).__name__}")
    if group.world_size > 1:
        from .runtime.actors import prepare_host

        prepare_host()
    if async_save:
        from .runtime.persister import persister_for_this_process

        options = AsyncOptions.from_env()
        persister = persister_for_this_process(options.persist_nice)
        if state_dict is None:
            persister.prepare()
        else:
            from .engine.staging import staging_bytes

            nbytes, pin = staging_bytes(state_dict)
            persister.prepare(min(nbytes, options.max_staging_bytes or nbytes), pin)


def _checkpoint_id(checkpoint_id: Any) -> str:
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise CheckpointError(f"checkpoint_id must be a path or fsspec URL, got {checkpoint_id!r}")
    return checkpoint_id


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector: planning allocates many small objects and none of
    them form cycles that need collecting mid-operation (halves the time for many small tensors)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _options(options: Any, kind: type, default: Any) -> Any:
    """A call's ``options=``: the defaults for None, else it must be a ``kind``."""
    if options is None:
        return default
    if not isinstance(options, kind):
        raise CheckpointError(f"options must be a raydcp.{kind.__name__} (or None), got {type(options).__name__}")
    return options


def save(state_dict: dict, checkpoint_id, *, group: Group | None = None,
         storage_options: dict | None = None, options: SaveOptions | None = None) -> Metadata:
    """Save ``state_dict`` (this rank's part of it) as one checkpoint; returns its metadata.

    ``options`` (:class:`~raydcp.options.SaveOptions`; every rank passes the same): the data
    files' size cap and the write path's IOOptions; ``survivors=True`` (a Ray group) commits
    without ranks that die during the save where the others hold all of the state
    (:mod:`raydcp.engine.survivors`)."""
    ckpt = _checkpoint_id(checkpoint_id)
    options = _options(options, SaveOptions, DEFAULT_SAVE)
    binding = resolve_group(group)
    if options.survivors and binding.group is not None and binding.group.world_size > 1:
        from .engine.survivors import save_survivors_with

        with _gc_paused():
            return save_survivors_with(lambda: binding.open_transport(survivors=True, leaving=options.leaving),
                                       state_dict, ckpt, storage_options, options)
    transport = binding.open_transport()
    try:
        with _gc_paused():
            return save_with(transport, state_dict, ckpt, storage_options, options)
    finally:
        transport.close()


def load(state_dict: dict, checkpoint_id, *, group: Group | None = None, strict: bool = True,
         storage_options: dict | None = None, options: LoadOptions | None = None) -> LoadStats:
    """Fill the tensors of ``state_dict`` in place (and replace its plain values) from a checkpoint.

    A load that raises leaves the state dict as it was, on every rank. ``options``
    (:class:`~raydcp.options.LoadOptions`): the read path's IOOptions, and ``atomic=False`` to
    load without the undo copy that promise takes (its error then names the keys written)."""
    ckpt = _checkpoint_id(checkpoint_id)
    options = _options(options, LoadOptions, DEFAULT_LOAD)
    transport = resolve_group(group).open_transport()
    try:
        with _gc_paused():
            return load_with(transport, state_dict, ckpt, strict=strict, storage_options=storage_options,
                             options=options)
    except CheckpointNotFoundError as exc:  # another format at the path: say which, and how to convert it
        raise with_format_hint(exc, storage_options) from None
    finally:
        transport.close()


def read_metadata(checkpoint_id, *, storage_options: dict | None = None) -> Metadata:
    """The metadata of the committed checkpoint at ``checkpoint_id``: keys, shapes, dtypes, pieces, files."""
    ckpt = _checkpoint_id(checkpoint_id)
    try:
        return read_metadata_with(ckpt, storage_options)
    except CheckpointNotFoundError as exc:
        raise with_format_hint(exc, storage_options) from None


def transfer(source_state: dict | None, dest_state: dict | None, *, group: Group, strict: bool = True) -> LoadStats:
    """In-memory reshard between live ranks of ``group`` (see :func:`raydcp.engine.load.transfer_with`)."""
    transport = resolve_group(group).open_transport()
    try:
        return transfer_with(transport, source_state, dest_state, strict=strict)
    finally:
        transport.close()


def async_save(state_dict: dict, checkpoint_id, *, group: Group | None = None,
               storage_options: dict | None = None, max_staging_bytes: int | None = None,
               options: SaveOptions | None = None) -> SaveFuture:
    """Stage ``state_dict`` to host memory, return, and persist it in the background.

    Returns once every piece is copied (later in-place updates do not leak in);
    the writing runs in a helper process (``group=None``) or a persister actor
    beside this rank (a Ray group), never on this process's GIL. Saves stay
    ordered: a call waits until the previous one finished. ``max_staging_bytes``
    (default: ``RAYDCP_MAX_STAGING_BYTES`` or unlimited) caps this rank's staging
    memory (give every rank of a group the same cap); above it the state is
    staged and written in pieces, and the call returns when the last piece is
    staged. ``options`` (:class:`~raydcp.options.SaveOptions`) as for :func:`save`.
    Errors, bad options included, surface at ``result()``.
    """
    ckpt = _checkpoint_id(checkpoint_id)
    binding = resolve_group(group)
    try:
        save_options = _options(options, SaveOptions, DEFAULT_SAVE)
        if save_options.survivors:
            raise CheckpointError("async_save does not take SaveOptions(survivors=True): a survivors save is "
                                  "synchronous (raydcp.save), so that it has committed before the lost ranks' "
                                  "node is reclaimed")
        async_options = AsyncOptions.from_env(max_staging_bytes=max_staging_bytes)
        persister = binding.persister(async_options)
    except CheckpointError as exc:
        return failed_save(exc)
    return start_async_save(persister, state_dict, ckpt, storage_options, async_options, save_options)


# -- the pipeline's driver -----------------------------------------------------------------------
def pipeline_driver(config, kind: str, *, local: Callable[[Any], Any], max_restarts: int = 3):
    """The driver of a :class:`raydcp.pipeline.CheckpointPipeline`: ``"ray"`` a named actor
    (:class:`raydcp.runtime.pipeline_actor.RemoteDriver`), ``"local"`` ``local(config)`` (the
    pipeline hands its in-process driver class), ``"auto"`` the former when Ray is initialized."""
    if kind == "auto":
        ray = sys.modules.get("ray")
        kind = "ray" if ray is not None and ray.is_initialized() else "local"
    if kind == "ray":
        from .runtime.pipeline_actor import RemoteDriver

        return RemoteDriver.start(config, max_restarts=max_restarts)
    return local(config)


def current_node_id() -> str | None:
    """The Ray node this process runs on, or None without Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from .runtime.pipeline_actor import current_node_id as node_id

    return node_id()
