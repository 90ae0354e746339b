"""The commit log of one checkpoint path: generations, a compare-and-swap commit, and what a path owns.

Why: several processes may save to one path at once, and a checkpoint directory may hold files
that are not raydcp's (``data/labels.csv``), or a ``data/`` shared with another checkpoint. A
save must never delete what it did not write, and of two saves racing to one path exactly one
may commit. The log lives beside the metadata, in ``_raydcp/``, and uses three fsspec calls
only: ``pipe_file(mode="create")`` (exclusive creation), ``find`` (listing) and ``rm``.

Files (relative to the checkpoint directory):

- ``_raydcp/gen-<n>.meta``: commit ``n`` (1, 2, ...), holding the metadata it committed. It is
  created exclusively: of two saves based on the same generation, one creates ``n`` and the
  other fails with :class:`~raydcp.errors.ConcurrentSaveError`.
- ``_raydcp/begun-<save_id>``: written (empty) when a save starts, before any data file: a
  record of the saves in flight, removed once their commit can no longer happen.

What a path owns: the directories ``data/<save_id>/`` found in its own ``data/`` (never through
a symbolic link: a checkpoint whose ``data/`` links to another's owns none of it) that it began
(a ``begun`` record) or committed (named by one of its generation records, or by the metadata a
commit replaces), and in them only the files that follow raydcp's own naming. Cleanup lists
``data/`` and reads the replaced generation's record where a ``begun`` record is gone, so the
replaced save goes without its record; a crashed save whose record was deleted is not provably
this path's (a ``data/`` may be shared through a link from another checkpoint) and stays.

A damaged log never wedges a path: names that are not the writer's own (``gen-7.meta``,
``gen-x.meta``) are ignored; a forged high generation only moves the count on (the writer's names
have no upper bound) and is pruned two commits later; a log that lost its generation files is
rebuilt when the next save begins, from what is committed: the metadata file's bytes become the
generation this path's evidence shows was reached (:func:`_rebuild`), so no save begun on the
lost log can commit over a newer one.

Protocol (who calls what):

1. at the plan step, the coordinator calls :func:`begin_save`: the current generation ``g`` is
   part of the new save id (``g<g>-<hex>``) and the ``begun`` record is written;
2. ranks write ``data/<save_id>/...``;
3. the coordinator calls :func:`commit_generation`: checks that the current generation is still
   ``g``, creates ``gen-<g+1>.meta`` exclusively, then publishes the same bytes as the metadata
   file (re-publishing the newest generation if a later commit raced the publish), so the
   metadata file always ends as the newest commit's;
4. :func:`prune` removes what can no longer be committed or read: the data of this path's saves
   begun on another generation than the new one (the replaced save, crashed, failed or lost
   saves), the replaced save's files, older generation files. A failed save removes its own files before it returns
   (:func:`remove_save_files`).

Guarantee per backend: local disks (``O_EXCL``), s3 (conditional put) and raydcp's ``raymem://``
and ``raynode://`` tiers (a compare-and-set in each node's holder) serialise commits exactly.
fsspec's memory filesystem does within one process. On other filesystems the creation is a
check then a write, verified by reading it back: a race inside that window can let both saves
believe they won, and the metadata then ends as one of them, complete.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
from typing import Iterable

from ..errors import CheckpointError, ConcurrentSaveError
from . import references
from ._common import METADATA_NAME, forget, is_local, translating

__all__ = ["LOG_DIR", "begin_save", "save_generation", "current_generation", "commit_generation", "prune",
           "remove_save_files", "owned_file", "raydcp_data_file", "raydcp_file", "begun_saves", "linked", "RETENTION_RECORD"]

LOG_DIR = "_raydcp"
# written by a backend's own retention at a commit (raymem://, raynode:// with keep_last): this
# checkpoint is in the retention scope of later saves beside it
RETENTION_RECORD = f"{LOG_DIR}/retention"
# the writer's names: at least 12 digits, no leading zero beyond them (gen-1000000000000.meta follows 999999999999)
_GEN = re.compile(r"^_raydcp/gen-(\d{12}|[1-9]\d{12,})\.meta$")
_BEGUN = re.compile(r"^_raydcp/begun-(g\d+-[0-9a-f]{12})$")
_SAVE_ID = re.compile(r"^g(\d+)-[0-9a-f]{12}$")
_LEGACY_SAVE_ID = re.compile(r"^[0-9a-f]{16}$")  # save ids before the commit log
# the files raydcp writes in data/<save_id>/: rank files (and a delta save's digest files), round files,
# the round journal
_OWN_FILE = re.compile(r"^(?:\d{5}/)?r\d{5}-f\d{3}\.(?:bin|xxh3)$|^journal/(?:job|\d{5})\.json$")
# the other files raydcp writes in a checkpoint directory: the metadata (and the temporary file of
# its atomic publish on a local disk), the commit log's records, a delta base's pins and tombstone
_OWN_TOP = re.compile(rf"^{re.escape(METADATA_NAME)}(?:\.tmp-[0-9a-f]{{16}})?$"
                      r"|^_raydcp/gen-\d{12,}\.meta$|^_raydcp/begun-[^/]+$|^_raydcp/retention$"
                      r"|^_raydcp/refs/[^/]+$|^_raydcp/removing$")
_KEEP_GENERATIONS = 2


def _gen_name(n: int) -> str:
    return f"{LOG_DIR}/gen-{n:012d}.meta"


def save_generation(save_id: str) -> int | None:
    """The generation a save was begun on, from its id (None for ids not made by :func:`begin_save`)."""
    m = _SAVE_ID.match(save_id.split("/", 1)[0])
    return int(m.group(1)) if m else None


def _log(storage) -> list[str]:
    return storage.list_files(LOG_DIR + "/")


def _generations(names: Iterable[str]) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_GEN.match, names) if m)


def current_generation(storage) -> int:
    """The newest commit's generation at this path (0: none under the commit log yet)."""
    gens = _generations(_log(storage))
    return gens[-1] if gens else 0


def begun_saves(storage) -> list[str]:
    """The ids of the saves begun at this path whose records remain."""
    return _begun_ids(_log(storage))


def begin_save(storage) -> str:
    """Step 1: a new save id on the current generation, recorded as this path's before any write.

    Where ``data/`` shows a save begun on a later generation than the log's newest (the log lost
    its generation files), the log is rebuilt first (:func:`_rebuild`)."""
    save_id = f"g{_rebuild(storage)}-{secrets.token_hex(6)}"
    storage.write_file(f"{LOG_DIR}/begun-{save_id}", b"")
    return save_id


def _rebuild(storage) -> int:
    """The current generation, after rebuilding a log that lost its newest generation files.

    Generations only grow and a save begins on one that exists, so this path's own evidence tells
    the generation it reached: a ``begun`` record of a save begun on ``b`` proves ``b``, and the
    committed metadata naming ``data/<g<b>-...>/`` files proves ``b + 1``. When that is above the
    log's newest and a checkpoint is committed here, ``gen-<reached>.meta`` is made again from the
    committed metadata: new saves begin on it, and a save begun on the lost log can commit only as
    one of them (one winner, by the exclusive creation of the next). Save directories in a
    ``data/`` shared with another path are no evidence unless this path's metadata names them.
    """
    log = _log(storage)
    now = max(_generations(log), default=0)
    begun = [b for b in (save_generation(sid) for sid in _begun_ids(log)) if b is not None]
    dirs = [(sid, save_generation(sid)) for sid in _save_dirs(storage) if _SAVE_ID.match(sid)]
    if max(begun + [b for _, b in dirs], default=0) <= now:
        return now  # the common case: nothing here began past the log's newest
    try:
        metadata = storage.read_file(METADATA_NAME)
    except CheckpointError:
        return now  # nothing committed to rebuild from
    reached = max(begun + [b + 1 for sid, b in dirs if _names(metadata, sid)], default=0)
    if reached <= now:
        return now
    with contextlib.suppress(FileExistsError):
        storage.create_exclusive(_gen_name(reached), metadata)
    return current_generation(storage)


def _names(metadata: bytes | None, save_id: str) -> bool:
    """True if the committed ``metadata`` names files of ``data/<save_id>/``: its header lists every
    file by name, as plain UTF-8 JSON (docs/FORMAT.md), so no decoding is needed to tell."""
    return metadata is not None and f"data/{save_id}/".encode() in metadata


def _begun_ids(names: Iterable[str]) -> list[str]:
    return [m.group(1) for m in map(_BEGUN.match, names) if m]


def _lost(storage, save_id: str, base: int, now: int) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"another save committed to {storage.url} while save {save_id} was running (it began on commit "
        f"{base}, the path is now at commit {now}): this save committed nothing and its files are removed; "
        "the checkpoint there is the other save's, complete. Save again, or give concurrent writers "
        "different paths", path=storage.url, save_id=save_id, generation=base)


def commit_generation(storage, save_id: str, metadata: bytes) -> int:
    """Step 3: commit ``metadata`` as the next generation after the one ``save_id`` began on.

    Raises ConcurrentSaveError (nothing committed) if another save committed since. Returns the
    new generation. A failure to publish the metadata file after the generation file was created
    removes the generation file again, so the commit did not happen.
    """
    base = save_generation(save_id)
    now = current_generation(storage)
    if base is None:  # a save id chosen by the caller: no begin step, commit on whatever is current
        base = now
    if now != base:
        raise _lost(storage, save_id, base, now)
    n = base + 1
    name = _gen_name(n)
    try:
        exclusive = storage.create_exclusive(name, metadata)
    except FileExistsError:
        raise _lost(storage, save_id, base, n) from None
    if not exclusive and storage.read_file(name) != bytes(metadata):
        raise _lost(storage, save_id, base, n)
    try:
        storage.commit(metadata)
    except BaseException:
        with contextlib.suppress(Exception):
            storage.remove_files([name])
        raise
    _settle(storage, n)
    return n


def _settle(storage, published: int) -> None:
    """Make the metadata file the newest generation's: a later commit may have published before us.

    Best effort: this save has committed, and a generation file that cannot be read (removed by
    the later commit's prune, or damaged) leaves the metadata to that commit's own publish."""
    for _ in range(100):
        newest = current_generation(storage)
        if newest <= published:
            return
        try:
            storage.commit(storage.read_file(_gen_name(newest)))
        except CheckpointError:
            return
        published = newest


def owned_file(save_id: str, name: str) -> bool:
    """True if ``name`` is a file raydcp writes for save ``save_id`` (``data/<save_id>/r00000-f000.bin`` ...)."""
    prefix = f"data/{save_id}/"
    return name.startswith(prefix) and bool(_OWN_FILE.match(name[len(prefix):]))


def raydcp_data_file(name: str) -> bool:
    """True if ``name`` (relative to a checkpoint) is a data file raydcp writes, of any save:
    ``data/<a save id raydcp makes>/<a file name raydcp writes>``. Nothing else is ever removed."""
    parts = name.split("/", 2)
    if len(parts) < 3 or parts[0] != "data":
        return False
    sid = parts[1]
    return bool(_SAVE_ID.match(sid) or _LEGACY_SAVE_ID.match(sid)) and owned_file(sid, name)


def raydcp_file(name: str) -> bool:
    """True if ``name`` (relative to a checkpoint directory) follows raydcp's own naming: the
    metadata, the commit log's records, and the files of ``data/<save id>/`` (a save id of any
    spelling: a caller may choose its own) named as raydcp names them. Retention removes these
    and nothing else (:func:`raydcp.storage.remove_checkpoint`)."""
    if _OWN_TOP.match(name):
        return True
    parts = name.split("/", 2)
    return len(parts) == 3 and parts[0] == "data" and bool(parts[1]) and owned_file(parts[1], name)


def linked(storage, name: str) -> bool:
    """True if the file or directory ``name`` of ``storage`` is reached through a symbolic link
    below the checkpoint directory (``data/`` linked to another checkpoint's, or ``name`` itself
    a link). Removal never goes through one: what a link reaches belongs to another place."""
    if not is_local(storage.fs):
        return False  # object stores and raydcp's tiers have no links
    path = storage.path
    for part in name.strip("/").split("/"):
        path = f"{path}/{part}"
        if os.path.islink(path):
            return True
    return False


def _save_dirs(storage) -> list[str]:
    """The names of the directories directly under this path's own ``data/`` (not a linked one)."""
    base = f"{storage.path}/data"
    with translating("list the saves of", storage.url):
        if is_local(storage.fs):
            if os.path.islink(base):
                return []
            try:
                return sorted(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
            except (FileNotFoundError, NotADirectoryError):
                return []
        forget(storage.fs, base)
        try:
            entries = storage.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")


def remove_save_files(storage, save_id: str, keep: Iterable[str] = ()) -> None:
    """Remove the files of ``data/<save_id>/`` that raydcp's naming says are its own, except
    ``keep``; nothing reached through a symbolic link (:func:`linked`)."""
    if not (_SAVE_ID.match(save_id) or _LEGACY_SAVE_ID.match(save_id)):
        return  # not a save id raydcp makes: never delete by it
    if linked(storage, f"data/{save_id}"):
        return
    keep = set(keep)
    names = [n for n in storage.list_files(f"data/{save_id}/")
             if owned_file(save_id, n) and n not in keep and not linked(storage, n.rsplit("/", 1)[0])]
    if names:
        storage.remove_files(names)


def prune(storage, generation: int, save_id: str, replaced_save_id: str | None = None) -> None:
    """Step 4, after commit ``generation`` of ``save_id``: remove the files no commit can reach.

    The saves in this path's own ``data/`` (listed there, never through a symbolic link) begun on
    another generation than the new one -- their commit can only fail now -- that are provably
    this path's: begun here (a ``begun`` record), or named by the metadata this commit replaced
    (the previous generation's record, read only when a save there has no ``begun`` record left).
    A save in a ``data/`` shared with another path is neither, and stays. Then:

    - ``replaced_save_id``: the save whose metadata this commit replaced (found in the old
      metadata by the caller; the only way to clean a save from before the commit log);
    - the ``begun`` records of saves begun on another generation, and generation files older
      than the last two.
    Saves begun on ``generation`` itself started after this commit and stay, and so do saves whose
    files a delta checkpoint references (:mod:`raydcp.storage.references`: decided under the
    tombstone, as a removal is). Best effort: a
    failure leaves garbage for the next commit, never an error.
    """
    own = save_id.split("/", 1)[0]
    pinned = False
    try:
        log = _log(storage)
        records = set(_begun_ids(log))
        previous: list[bytes | None] = []  # read once, when needed
        referenced: set[str] | None = set()  # saves here that delta checkpoints reference: they stay
        if storage.list_files(f"{references.PIN_DIR}/"):
            pinned = True
            storage.write_file(references.TOMBSTONE, [b""])
            needed, stale = references.referenced_files(storage)
            referenced = None if needed is None else {n.split("/", 2)[1] for n in needed if n.startswith("data/")}
            storage.remove_files(stale)
        for sid in _save_dirs(storage):
            if sid == own or not _SAVE_ID.match(sid) or save_generation(sid) == generation:
                continue
            if referenced is None or sid in referenced:
                continue
            if sid not in records:
                if not previous:
                    try:
                        previous.append(storage.read_file(_gen_name(generation - 1)))
                    except CheckpointError:
                        previous.append(None)
                if not _names(previous[0], sid):
                    continue  # not provably this path's (a shared data/): never removed
            remove_save_files(storage, sid)
        stale = [f"{LOG_DIR}/begun-{sid}" for sid in records if sid != own and save_generation(sid) != generation]
        if stale:
            storage.remove_files(stale)
        replaced = replaced_save_id.split("/", 1)[0] if replaced_save_id else None
        if replaced and replaced != own and referenced is not None and replaced not in referenced:
            remove_save_files(storage, replaced)
        old = [_gen_name(g) for g in _generations(log) if g <= generation - _KEEP_GENERATIONS]
        if old:
            storage.remove_files(old)
    except CheckpointError:
        pass
    finally:
        if pinned:
            with contextlib.suppress(CheckpointError):
                storage.remove_files([references.TOMBSTONE])
