"""The engine: save / load / async_save for one rank, over whatever transport its Group gives.

The engine never imports Ray: ``group=None`` uses the in-process transport, a
:class:`raydcp.Group` opens the Ray transport of :mod:`raydcp.runtime`.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any

from ..errors import CheckpointError, RankFailure
from ..group import Group
from ..metadata import Metadata
from ..planner import SavePlanOptions
from ..state import flatten_state
from ..transport import LocalTransport, Transport
from .load import LoadStats, load_with, read_metadata, transfer_with
from .save import local_save_plan, save_with

__all__ = ["save", "load", "async_save", "read_metadata", "transfer", "LoadStats", "SaveFuture"]


def _checkpoint_id(checkpoint_id: Any) -> str:
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise CheckpointError(f"checkpoint_id must be a path or fsspec URL, got {checkpoint_id!r}")
    return checkpoint_id


def _open(group: Group | None) -> Transport:
    if group is None:
        return LocalTransport()
    if not isinstance(group, Group):
        raise CheckpointError(f"group must be a raydcp.Group or None, got {type(group).__name__}")
    return group.open_transport()


def save(state_dict: dict, checkpoint_id, *, group: Group | None = None,
         storage_options: dict | None = None) -> Metadata:
    """Save ``state_dict`` (this rank's part of it) as one checkpoint; returns its metadata."""
    ckpt = _checkpoint_id(checkpoint_id)
    transport = _open(group)
    try:
        return save_with(transport, state_dict, ckpt, storage_options)
    finally:
        transport.close()


def load(state_dict: dict, checkpoint_id, *, group: Group | None = None, strict: bool = True,
         storage_options: dict | None = None) -> LoadStats:
    """Fill the tensors of ``state_dict`` in place (and replace its plain values) from a checkpoint."""
    ckpt = _checkpoint_id(checkpoint_id)
    transport = _open(group)
    try:
        return load_with(transport, state_dict, ckpt, strict=strict, storage_options=storage_options)
    finally:
        transport.close()


def transfer(source_state: dict | None, dest_state: dict | None, *, group: Group, strict: bool = True) -> LoadStats:
    """In-memory reshard between live ranks of ``group`` (see :func:`raydcp.engine.load.transfer_with`)."""
    transport = _open(group)
    try:
        return transfer_with(transport, source_state, dest_state, strict=strict)
    finally:
        transport.close()


class SaveFuture:
    """The result of :func:`async_save`: ``result(timeout)`` -> Metadata or the save's error."""

    def __init__(self, future: cf.Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Metadata:
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise CheckpointError(f"async save not finished within {timeout}s; call result() again to keep waiting") from None


_persist_lock = threading.Lock()
_persister: cf.ThreadPoolExecutor | None = None
_last: cf.Future | None = None


def async_save(state_dict: dict, checkpoint_id, *, group: Group | None = None,
               storage_options: dict | None = None) -> SaveFuture:
    """Stage ``state_dict`` to host memory, return, and persist it in the background.

    Returns once every tensor is copied, so later in-place updates do not leak
    in. Saves stay ordered: a second call waits until the previous one finished.
    """
    global _persister, _last
    ckpt = _checkpoint_id(checkpoint_id)
    with _persist_lock:
        if _last is not None:
            cf.wait([_last])
        if _persister is None:
            _persister = cf.ThreadPoolExecutor(1, thread_name_prefix="raydcp-persist")
        transport = _open(group)
        try:
            staged = local_save_plan(transport.rank, flatten_state(state_dict),
                                     compare_replicas=transport.world_size > 1, copy=True)
        except Exception as exc:
            staged = None
            failure = RankFailure.from_exception(transport.rank, exc)

        def persist() -> Metadata:
            try:
                if staged is None:  # still take part, so the other ranks fail instead of waiting
                    transport.reduce_scatter("save: plan", failure, lambda v: v)
                return save_with(transport, state_dict, ckpt, storage_options, SavePlanOptions(), staged)
            finally:
                transport.close()

        _last = _persister.submit(persist)
        return SaveFuture(_last)
