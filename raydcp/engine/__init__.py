"""The engine: one rank's save / load / async_save over the transport and persister it is handed.

The engine never imports Ray, nor :mod:`raydcp.runtime`: the API layer (:mod:`raydcp.api`)
resolves a call's group to a transport and a persister (:func:`raydcp.api.resolve_group`)
and calls the functions here:

- :func:`save_with` / :func:`load_with` / :func:`transfer_with`: a synchronous save, load or
  in-memory reshard over a :class:`~raydcp.transport.Transport`;
- :func:`start_async_save`: an asynchronous save through an
  :class:`~raydcp.engine.background.AsyncPersister`;
- the save protocol: its steps in :mod:`raydcp.engine.protocol`, the records they pass in
  :mod:`raydcp.engine.save_records`.
"""
from __future__ import annotations

from .background import AsyncPersister, SaveFuture, start_async_save
from .load import LoadStats, load_with, read_metadata, transfer_with
from .save_records import SaveHeader, StorageRecord
from .save import save_with

__all__ = ["save_with", "load_with", "transfer_with", "start_async_save", "read_metadata", "LoadStats",
           "SaveFuture", "AsyncPersister", "SaveHeader", "StorageRecord"]
