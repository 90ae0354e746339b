"""The engine: save / load / async_save for one rank, over whatever transport its Group gives.

The engine never imports Ray: ``group=None`` uses the in-process transport, a
:class:`raydcp.Group` opens the Ray transport of :mod:`raydcp.runtime`.
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

from ..errors import CheckpointError
from ..group import Group
from ..metadata import Metadata
from ..transport import LocalTransport, Transport
from .background import SaveFuture, start_async_save
from .load import LoadStats, load_with, read_metadata, transfer_with
from .save import save_with

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


def save(state_dict: dict, checkpoint_id, *, group: Group | None = None,
         storage_options: dict | None = None) -> Metadata:
    """Save ``state_dict`` (this rank's part of it) as one checkpoint; returns its metadata."""
    ckpt = _checkpoint_id(checkpoint_id)
    transport = _open(group)
    try:
        with _gc_paused():
            return save_with(transport, state_dict, ckpt, storage_options)
    finally:
        transport.close()


def load(state_dict: dict, checkpoint_id, *, group: Group | None = None, strict: bool = True,
         storage_options: dict | None = None) -> LoadStats:
    """Fill the tensors of ``state_dict`` in place (and replace its plain values) from a checkpoint."""
    ckpt = _checkpoint_id(checkpoint_id)
    transport = _open(group)
    try:
        with _gc_paused():
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


def async_save(state_dict: dict, checkpoint_id, *, group: Group | None = None,
               storage_options: dict | None = None, max_staging_bytes: int | None = None) -> SaveFuture:
    """Stage ``state_dict`` to host memory, return, and persist it in the background.

    Returns once every piece is copied (later in-place updates do not leak in);
    the writing runs in a helper process (``group=None``) or a persister actor
    beside this rank (a Ray group), never on this process's GIL. Saves stay
    ordered: a call waits until the previous one finished. ``max_staging_bytes``
    (default: ``RAYDCP_MAX_STAGING_BYTES`` or unlimited) caps this rank's staging
    memory (give every rank of a group the same cap); above it the state is
    staged and written in pieces, and the call returns when the last piece is
    staged.
    """
    return start_async_save(state_dict, _checkpoint_id(checkpoint_id), group, storage_options, max_staging_bytes)
