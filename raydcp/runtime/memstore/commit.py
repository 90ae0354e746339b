"""The commit of a ``raymem://`` checkpoint, and the release of what ``keep_last`` no longer keeps.

Called by :class:`raydcp.runtime.memstore.filesystem.RayMemFileSystem` when the storage layer
publishes a checkpoint's metadata (``raydcp.meta``): the one step where a memory checkpoint
becomes visible, and the only one that releases older ones (and the room the save reserved,
:mod:`raydcp.runtime.memstore.capacity`).

Retention's scope (``keep_last``): the checkpoint directories directly beside the one just
committed (``raymem://run-7/step-*``: those of ``run-7``; ``raynode:///nvme/{node}/run-7/step-*``:
those of ``/nvme/{node}/run-7``), never a deeper or a sibling directory, and nothing at all for
a checkpoint directly at the root (``raymem://ckpt``); among them only those committed with
``keep_last`` (a save with ``keep_last=0`` keeps its checkpoint out of every later save's
retention: the commit records ``_raydcp/retention``, :data:`RETENTION_RECORD`); in them only the
files that follow raydcp's own naming (:func:`raydcp.storage.commits.raydcp_file`). A node-local
tier's holder indexes every file of its disk directory, a user's too; retention never removes one.
"""
from __future__ import annotations

import json
import posixpath
import time

import numpy as np

from ...errors import CheckpointError
from ...metadata_format import decode_metadata  # raydcp's own codec, no pickle
from ...storage import METADATA_NAME, references
from ...storage.commits import RETENTION_RECORD, raydcp_file
from . import placement
from .capacity import release_after_commit
from .layout import checkpoint_dir

__all__ = ["publish", "retain", "retention_scope", "checkpoint_dir", "RETENTION_RECORD"]


def publish(fs, path: str, data: bytes) -> None:
    """Publish the metadata ``path`` once every copy of every file it names is held."""
    fs.connect(path)
    url = fs.url(path)
    directory = path.rsplit("/", 1)[0] if "/" in path else ""
    md = decode_metadata(data, url)
    names = list(md.files)
    entries = fs.entries(f"{directory}/" if directory else "")
    for owner in {_full(directory, references.owner_of(n)) for n in names if references.is_reference(n)}:
        entries.update(fs.entries(f"{owner}/"))  # a delta's bases: where its references lie
    problems, started = [], None
    for name in names:
        full = _full(directory, name)
        got = entries.get(full)
        if got is None:
            problems.append(f"{fs.url(full)} is held on no alive node")
            continue
        missing = set(got[2]) - got[3]
        if missing:
            problems.append(f"the copy of {fs.url(full)} on node(s) {sorted(missing)} was lost")
        started = got[1] if started is None else min(started, got[1])
    if problems:
        raise CheckpointError(f"{url}: not committed, the previous checkpoint (if any) is unchanged: "
                              + "; ".join(problems[:10]) + "; save again")
    where = {_full(directory, n): entries[_full(directory, n)][2] for n in names}
    created = time.time_ns()
    fs.publish_copies(placement.alive_nodes(), path, data, created, where)
    started = started if started is not None else created
    record = f"{directory}/{RETENTION_RECORD}" if directory else RETENTION_RECORD
    if fs.keep_last:
        # after the metadata: a commit interrupted here leaves the checkpoint out of retention
        fs.hold(record, np.frombuffer(b"", dtype=np.uint8), time.time_ns())
        retain(fs, path, started)
    else:  # saved without keep_last: out of every later save's retention, whatever an earlier save said
        fs.ask_all("remove", [record])
    release_after_commit(fs, path, md.save_id, started)


def _full(directory: str, name: str) -> str:
    """The path of file ``name`` of the checkpoint at ``directory`` (a delta's references resolved)."""
    return references.resolve(directory, name) if directory else name


def _referenced(fs, entries: dict, staying: list[str], committed: set[str]) -> set[str]:
    """The files that must stay in a release: those the ``staying`` committed checkpoints name
    (a delta's references into released ones), and those pinned by a delta save in flight
    (:mod:`raydcp.storage.references`: no metadata yet, its ``begun`` record held, the pin younger
    than a day)."""
    keep: set[str] = set()
    for d in staying:
        try:
            md = decode_metadata(fs.cat_file(f"{d}/{METADATA_NAME}"), fs.url(f"{d}/{METADATA_NAME}"))
        except Exception:
            continue  # unreadable now: its own files are not released here (it stays)
        keep.update(_full(d, n) for n in md.files if references.is_reference(n))
    now = time.time()
    for path in entries:
        head, sep, rest = path.partition(f"/{references.PIN_DIR}/")
        if not sep:
            continue
        try:
            pin = json.loads(bytes(fs.cat_file(path)))
            referrer = posixpath.normpath(f"{head}/{pin['referrer']}")
            if (referrer not in committed and f"{referrer}/_raydcp/begun-{pin['save_id']}" in entries
                    and now - float(pin.get("created_at", 0)) < references.PIN_GRACE_S):
                keep.update(f"{head}/{f}" for f in pin["files"])
        except Exception:
            continue
    return keep


def retention_scope(meta_path: str) -> str | None:
    """The directory whose checkpoints ``keep_last`` counts for the metadata ``meta_path``: the
    parent of its checkpoint directory; None for a checkpoint directly at the root."""
    directory = meta_path.rsplit("/", 1)[0] if "/" in meta_path else ""
    scope = directory.rsplit("/", 1)[0] if "/" in directory else ""
    return scope if scope.strip("/") else None


def retain(fs, meta_path: str, started_ns: int) -> None:
    """Release what keep_last no longer keeps in this checkpoint's scope, once the new metadata is out.

    The scope (:func:`retention_scope`) holds checkpoint directories ``<scope>/<name>``. Of those
    committed with ``keep_last`` (their :data:`RETENTION_RECORD`), the ``keep_last`` newest stay;
    the older ones lose their own files (their metadata first, so an interrupted release leaves an
    uncommitted directory, never a damaged checkpoint). Directories not committed hold leftovers
    of a save that failed: their own files go when all were written before the save that just
    committed started. Files that do not follow raydcp's naming stay, always.
    """
    scope = retention_scope(meta_path)
    if scope is None:
        return
    entries = fs.entries(scope + "/")
    dirs: dict[str, list[tuple[str, str, int]]] = {}  # checkpoint dir -> [(path, name in it, created)]
    for path, (_, created, _, _) in entries.items():
        head, sep, rest = path[len(scope) + 1:].partition("/")
        if sep:
            dirs.setdefault(f"{scope}/{head}", []).append((path, rest, created))
    committed = {d: next(c for _, n, c in files if n == METADATA_NAME) for d, files in dirs.items()
                 if any(n == METADATA_NAME for _, n, _ in files)}
    retained = [d for d in committed if any(n == RETENTION_RECORD for _, n, _ in dirs[d])]
    newest = sorted(retained, key=lambda d: (committed[d], d), reverse=True)
    kept = set(newest[:fs.keep_last]) | {meta_path.rsplit("/", 1)[0]}
    released = {d for d in committed if d in retained and d not in kept}
    # what a staying delta checkpoint (or a delta save in flight) references stays, with the digest
    # files of its save and the pins that keep it, until nothing references it
    needed = _referenced(fs, entries, [d for d in committed if d not in released], set(committed))
    needed_dirs = {p.rsplit("/", 1)[0] for p in needed}
    metas, rest, leftovers = [], [], []
    for d, files in dirs.items():
        own = [(p, n, c) for p, n, c in files if raydcp_file(n) and p not in needed
               and not (n.endswith(".xxh3") and p.rsplit("/", 1)[0] in needed_dirs)
               and not (needed and n.startswith(f"{references.PIN_DIR}/"))]
        if d in committed:
            if d in released:
                metas += [p for p, n, _ in own if n == METADATA_NAME]
                rest += [p for p, n, _ in own if n != METADATA_NAME]
        elif own and max(c for _, _, c in own) < started_ns:
            leftovers += [p for p, _, _ in own]
    why = f"released by keep_last={fs.keep_last} when {fs.url(meta_path.rsplit('/', 1)[0])} committed"
    if metas:  # the holders keep why, for a load still reading them (raydcp.runtime.memstore.losses)
        fs.ask_all("remove", metas, [], why)
    if rest:
        fs.ask_all("remove", rest, [], why)
    if leftovers:
        fs.ask_all("remove", leftovers)
