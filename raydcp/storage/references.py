"""Files one checkpoint reads from another: the references of delta checkpoints, and what keeps
them from dangling.

A delta checkpoint (``SaveOptions(base=...)``) lists, beside its own data files, files of earlier
checkpoints that hold pieces it did not write again. Such a name is relative to the delta
checkpoint's directory and starts with ``../`` (``../step-9/data/<save_id>/r00000-f000.bin``); it
is always *direct*: a delta of a delta names the file where the bytes lie, never a chain. The
directory that holds a referenced file is its *owner* (``../step-9``).

What keeps a referenced file (files relative to the owner's directory, under ``_raydcp/``):

- ``refs/<save_id>-r<rank>``: a *pin*, written by each rank of a delta save that reuses a file
  here, before it writes anything (JSON: the referring checkpoint relative to the owner, its save
  id, the files it may reference, when). While the referrer holds that save, the files stay
  (:func:`referenced_files`).
- ``removing``: a *tombstone*, present while a removal (retention, a prune) decides what to keep.

The race of a removal and a delta save: the remover writes the tombstone, then reads the pins,
then removes what no pin keeps, then removes the tombstone; the delta save writes its pin, then
checks that no tombstone is there and that every file it will reference still exists, and reuses
nothing of this owner otherwise. Whatever the interleaving, either the remover sees the pin, or
the delta save sees the tombstone or the removal: nothing a committed checkpoint references is
removed. Removing a checkpoint (:func:`raydcp.storage.remove_checkpoint`) removes its metadata
first, then every file of it that no live referrer needs; the owners it referenced are swept
after it, so their files go once no checkpoint references them.
"""
from __future__ import annotations

import json
import posixpath
import time
from typing import Iterable

from ..errors import CheckpointDamagedError, CheckpointError
from ._common import METADATA_NAME, check_name

__all__ = ["PIN_DIR", "TOMBSTONE", "PIN_GRACE_S", "is_reference", "check_reference", "reference_to",
           "owner_of", "resolve", "pin_name", "write_pin", "tombstoned", "referenced_files", "referenced_owners",
           "missing_base_error"]

PIN_DIR = "_raydcp/refs"
TOMBSTONE = "_raydcp/removing"
# a pin whose save has not committed keeps the owner's files this long (a save in progress)
PIN_GRACE_S = 24 * 3600.0


def is_reference(name: str) -> bool:
    """True if the file name ``name`` of a checkpoint lies in another checkpoint (``../...``)."""
    return name.startswith("../")


def check_reference(name: str, url: str) -> str:
    """Validate a reference name: ``../`` repeated, then a checkpoint-relative path whose part
    before the last ``/data/`` names the owner (no ``.`` or ``..`` after the leading ones)."""
    rest = name
    ups = 0
    while rest.startswith("../"):
        rest, ups = rest[3:], ups + 1
    if ups and "/data/" in f"/{rest}":
        check_name(rest, url)  # no empty parts, "." or ".." after the leading ones
        return name
    raise CheckpointDamagedError(
        f"invalid reference {name!r} in checkpoint {url}: a file of another checkpoint is named "
        "'../<checkpoint>/data/<save_id>/<file>'", file=f"{url}/{name}"
    )


def resolve(directory: str, name: str) -> str:
    """The path of file ``name`` (own or a reference) of the checkpoint at ``directory``."""
    return posixpath.normpath(f"{directory}/{name}") if is_reference(name) else f"{directory}/{name}"


def owner_of(name: str) -> str:
    """The owner, relative to the referring checkpoint, of reference ``name`` (``../step-9``)."""
    return name.rsplit("/data/", 1)[0]


def reference_to(directory: str, owner_dir: str, name: str) -> str:
    """Name, relative to the checkpoint at ``directory``, of the file ``name`` of the checkpoint at
    ``owner_dir`` (``name`` may itself be a reference of that checkpoint). Paths are a filesystem's
    paths (no protocol): a reference never leaves the filesystem."""
    target = resolve(owner_dir, name)
    rel = posixpath.relpath(target, directory)
    if not rel.startswith("../"):
        raise CheckpointError(
            f"{target} lies inside the checkpoint {directory}: a delta checkpoint's base must be another "
            "checkpoint directory, not the path being saved or one below it")
    return rel


def pin_name(save_id: str, rank: int) -> str:
    return f"{PIN_DIR}/{save_id.split('/', 1)[0]}-r{rank:05d}"


def write_pin(owner, referrer_rel: str, save_id: str, rank: int, files: Iterable[str]) -> None:
    """Record in ``owner`` (a CheckpointStorage) that save ``save_id`` at ``referrer_rel``
    (relative to the owner) may reference its ``files`` (names relative to the owner)."""
    body = {"referrer": referrer_rel, "save_id": save_id.split("/", 1)[0], "created_at": time.time(),
            "files": sorted(files)}
    owner.write_file(pin_name(save_id, rank), [json.dumps(body).encode()])


def tombstoned(owner) -> bool:
    return owner.exists(TOMBSTONE)


def _pins(owner) -> list[dict]:
    out = []
    for name in owner.list_files(f"{PIN_DIR}/"):
        try:
            body = json.loads(owner.read_file(name))
            if (isinstance(body.get("referrer"), str) and isinstance(body.get("save_id"), str)
                    and isinstance(body.get("files"), list)):
                out.append({**body, "name": name})
        except (CheckpointError, ValueError, AttributeError):
            continue  # unreadable: ignored (a pin is only ever written whole by raydcp)
    return out


def referenced_files(owner) -> tuple[set[str] | None, list[str]]:
    """What the live referrers of ``owner`` need of it: ``(names, stale pins)``.

    A pin is live while its referrer's committed metadata is the pinning save's, and, for a save
    in flight (no metadata there yet, its ``begun`` record there), for :data:`PIN_GRACE_S` after it
    was written. A referrer whose metadata cannot be read is kept live (never guess towards deleting).
    ``names`` are file names relative to the owner. The other pins are returned as stale: their
    referrer was removed (retention removes its metadata and records), or never committed.
    """
    keep: set[str] = set()
    stale: list[str] = []
    now = time.time()
    for pin in _pins(owner):
        referrer = owner.at(posixpath.normpath(f"{owner.path}/{pin['referrer']}"))
        try:
            header = _header(referrer)
            committed = header is not None and str(header.get("save_id", "")).split("/", 1)[0] == pin["save_id"]
            begun = header is None and referrer.exists(f"_raydcp/begun-{pin['save_id']}")
        except CheckpointError:
            committed = begun = True  # cannot tell: keep (a removal never guesses towards deleting)
        young = now - float(pin.get("created_at", 0) or 0) < PIN_GRACE_S
        if committed or (begun and young):
            keep.update(str(f) for f in pin["files"])
        else:
            stale.append(pin["name"])
    return keep, stale


def _header(storage) -> dict | None:
    """The JSON header of the committed metadata of ``storage`` (None: not committed). The
    envelope of docs/FORMAT.md: magic, major, minor, length, CRC, then the Arrow stream whose
    schema holds the header; a damaged one raises CheckpointError."""
    if not storage.exists(METADATA_NAME):
        return None
    data = storage.read_file(METADATA_NAME)
    try:
        import pyarrow as pa

        if len(data) < 28 or data[:8] != b"RAYDCPM\n":
            raise ValueError("not raydcp metadata")
        header = json.loads(pa.ipc.open_stream(pa.py_buffer(data[28:])).schema.metadata[b"raydcp"])
        if not isinstance(header, dict):
            raise ValueError("a header that is not an object")
        return header
    except Exception as exc:
        raise CheckpointDamagedError(f"{storage.file_url(METADATA_NAME)}: unreadable header ({exc})",
                                     file=storage.file_url(METADATA_NAME)) from None


def referenced_owners(storage) -> list[str]:
    """The paths of the checkpoints whose files the committed checkpoint ``storage`` references
    (read from its metadata's header: the file list; [] where it has none or cannot be read)."""
    try:
        header = _header(storage)
        files = [str(f) for f in (header or {}).get("files", [])]
    except CheckpointError:
        return []
    return sorted({posixpath.normpath(f"{storage.path}/{owner_of(n)}") for n in files if is_reference(n)})


def missing_base_error(file_url: str, checkpoint_url: str, name: str) -> CheckpointError:
    return CheckpointDamagedError(
        f"file {file_url} of the base checkpoint {owner_of(name)} (relative to {checkpoint_url}), which the "
        f"delta checkpoint {checkpoint_url} references, is missing: the base was deleted or moved by hand. "
        "Put the base checkpoint back where it was, or load another checkpoint", file=file_url)


