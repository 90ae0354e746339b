"""Reading and writing status records in the copies of a checkpoint (storage I/O, no Ray)."""
from __future__ import annotations

import logging
from typing import Sequence

from ..errors import CheckpointError, StorageError
from ..storage import CheckpointStorage, is_local, is_transient, list_committed, publish_atomically
from .policy import Tier
from .status import STATUS_NAME, StatusRecord, decode_status, encode_status, freshest

__all__ = ["write_record", "read_record", "read_freshest", "records_under"]

log = logging.getLogger("raydcp.pipeline")


def write_record(storage: CheckpointStorage, record: StatusRecord) -> None:
    """Replace the copy's status record atomically (rename on local disks, one put elsewhere)."""
    data = encode_status(record)
    if is_local(storage.fs):
        try:
            publish_atomically(f"{storage.path}/{STATUS_NAME}", memoryview(data))
        except OSError as exc:
            raise StorageError(f"could not write {storage.file_url(STATUS_NAME)}: {exc}", retriable=is_transient(exc),
                               path=storage.file_url(STATUS_NAME)) from exc
    else:
        storage.write_file(STATUS_NAME, [data])


def read_record(storage: CheckpointStorage) -> StatusRecord | None:
    """The copy's status record; None if it has none. A damaged record is a CheckpointError."""
    if not storage.exists(STATUS_NAME):
        return None
    return decode_status(storage.read_file(STATUS_NAME), storage.file_url(STATUS_NAME))


def read_freshest(tiers: Sequence[Tier], name: str) -> tuple[StatusRecord | None, dict[int, str]]:
    """The freshest record of ``name`` over every tier, and a problem per tier that could not be read."""
    found, problems = [], {}
    for i, tier in enumerate(tiers):
        try:
            found.append(read_record(CheckpointStorage(tier.copy_url(name), tier.options())))
        except CheckpointError as exc:
            problems[i] = str(exc)
    return freshest(found), problems


def records_under(tier: Tier, *, committed_only: bool = True) -> dict[str, StatusRecord]:
    """The records of the checkpoints directly under a tier's root (committed ones by default).

    A checkpoint with a damaged or missing record is left out (with a log line).
    """
    out: dict[str, StatusRecord] = {}
    if committed_only:
        names = [c.name for c in list_committed(tier.url, tier.options())]
    else:
        names = _directories(tier)
    for name in names:
        try:
            record = read_record(CheckpointStorage(tier.copy_url(name), tier.options()))
        except CheckpointError as exc:
            log.warning("skipping %s: %s", tier.copy_url(name), exc)
            continue
        if record is not None:
            out[name] = record
    return out


def _directories(tier: Tier) -> list[str]:
    root = CheckpointStorage(tier.url, tier.options())
    try:
        entries = root.fs.ls(root.path, detail=True)
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise StorageError(f"could not list {tier.url}: {type(exc).__name__}: {exc}", retriable=is_transient(exc),
                           path=tier.url) from exc
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
