"""``raydcp.train.save(..., incremental=True)``: delta checkpoints in a Ray Train run.

Ray Train removes the checkpoints ``CheckpointConfig(num_to_keep=...)`` no longer keeps by
deleting their whole directories, so a delta checkpoint cannot keep its data there: a later
delta would reference files Ray Train deletes. An incremental save therefore writes in two places
under the run's directory:

1. the *data*: a delta checkpoint ``raydcp-data/<name>`` saved with
   ``SaveOptions(base=<the run's newest one there>)`` (the first is a full one), which Ray Train
   never touches;
2. the *checkpoint Ray Train registers*: ``<name>``, whose metadata names only files of
   ``raydcp-data/`` (every file a reference, pinned in its owner, :mod:`raydcp.storage.references`).
   It loads, reshards and restores like any checkpoint of the run.

After the checkpoint commits, rank 0 sweeps ``raydcp-data/``: a data directory whose registered
checkpoint is gone (Ray Train removed it, or the save failed before it committed) is removed
(:func:`raydcp.storage.remove_checkpoint`), except the files a kept checkpoint references, which
go once nothing references them.
"""
from __future__ import annotations

import posixpath
from ..metadata import Metadata
from ..metadata_format import decode_metadata, encode_metadata
from ..storage import CheckpointStorage, list_committed, remove_checkpoint
from ..storage import references as refs
from ._context import is_raydcp_dir_name

__all__ = ["DATA_DIR", "latest_data", "commit_registered", "sweep"]

DATA_DIR = "raydcp-data"


def latest_data(run_url: str, storage_options: dict | None) -> str | None:
    """The URL of the run's newest committed data checkpoint (the next delta's base), or None."""
    found = [c for c in list_committed(f"{run_url.rstrip('/')}/{DATA_DIR}", storage_options, links=False)
             if is_raydcp_dir_name(c.name)]
    return found[-1].url if found else None


def commit_registered(data_url: str, url: str, storage_options: dict | None) -> Metadata:
    """Commit at ``url`` the checkpoint that reads every piece from the data checkpoint at
    ``data_url`` (its own files and its references, named from ``url``); returns its metadata."""
    data = CheckpointStorage(data_url, storage_options)
    target = CheckpointStorage(url, storage_options)
    md = decode_metadata(data.read_metadata_bytes(), data.file_url("raydcp.meta"))
    renamed = md.with_files(lambda n: refs.reference_to(target.path, data.path, n))
    owners: dict[str, list[str]] = {}
    for name in renamed.files:
        owner = refs.owner_of(name)
        owners.setdefault(owner, []).append(name[len(owner) + 1:])
    for owner_rel, files in owners.items():
        owner = target.at(posixpath.normpath(f"{target.path}/{owner_rel}"))
        refs.write_pin(owner, posixpath.relpath(target.path, owner.path), md.save_id, 0, files)
    target.commit(encode_metadata(renamed))
    return renamed


def sweep(run_url: str, keep: str, storage_options: dict | None) -> list[str]:
    """Remove the data checkpoints of the run whose registered checkpoint is gone, except ``keep``
    (a name); returns the names removed."""
    removed = []
    root = f"{run_url.rstrip('/')}/{DATA_DIR}"
    for c in list_committed(root, storage_options, links=False):
        if c.name == keep or not is_raydcp_dir_name(c.name):
            continue
        if CheckpointStorage(f"{run_url.rstrip('/')}/{c.name}", storage_options).is_committed():
            continue
        remove_checkpoint(c.url, storage_options)
        removed.append(c.name)
    return removed

