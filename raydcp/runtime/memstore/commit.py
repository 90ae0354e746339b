"""The commit of a ``raymem://`` checkpoint, and the release of what ``keep_last`` no longer keeps.

Called by :class:`raydcp.runtime.memstore.filesystem.RayMemFileSystem` when the storage layer
publishes a checkpoint's metadata (``raydcp.meta``): the one step where a memory checkpoint
becomes visible, and the only one that releases older ones (and the room the save reserved,
:mod:`raydcp.runtime.memstore.capacity`).
"""
from __future__ import annotations

import time

from ...errors import CheckpointError
from ...metadata_format import decode_metadata  # raydcp's own codec, no pickle
from ...storage import METADATA_NAME
from . import placement
from .capacity import release_after_commit
from .layout import checkpoint_dir

__all__ = ["publish", "retain", "checkpoint_dir", "lost_reason"]


def publish(fs, path: str, data: bytes) -> None:
    """Publish the metadata ``path`` once every copy of every file it names is held."""
    fs._connect(path)
    url = fs._url(path)
    directory = path.rsplit("/", 1)[0] if "/" in path else ""
    md = decode_metadata(data, url)
    names = list(md.files)
    entries = fs._entries(f"{directory}/" if directory else "")
    problems, started = [], None
    for name in names:
        full = f"{directory}/{name}" if directory else name
        got = entries.get(full)
        if got is None:
            problems.append(f"{fs._url(full)} is held on no alive node")
            continue
        missing = set(got[2]) - got[3]
        if missing:
            problems.append(f"the copy of {fs._url(full)} on node(s) {sorted(missing)} was lost")
        started = got[1] if started is None else min(started, got[1])
    if problems:
        raise CheckpointError(f"{url}: not committed, the previous checkpoint (if any) is unchanged: "
                              + "; ".join(problems[:10]) + "; save again")
    where = {f"{directory}/{n}" if directory else n: entries[f"{directory}/{n}" if directory else n][2]
             for n in names}
    created = time.time_ns()
    fs._publish_copies(placement.alive_nodes(), path, data, created, where)
    started = started if started is not None else created
    if fs.keep_last:
        retain(fs, path, started)
    release_after_commit(fs, path, md.save_id, started)


def retain(fs, meta_path: str, started_ns: int) -> None:
    """Release what keep_last no longer keeps under this NAME, once the new metadata is out.

    Every file belongs to the deepest committed checkpoint directory above it. Files of the
    ``keep_last`` newest committed checkpoints stay; those of older ones go (their metadata
    first, so an interrupted release leaves an uncommitted directory, never a damaged
    checkpoint). Files under no committed checkpoint are leftovers of a save that failed, and
    go when they were all written before the save that just committed started.
    """
    name = meta_path.split("/", 1)[0]
    entries = fs._entries(name + "/")
    committed = {p.rsplit("/", 1)[0]: e[1] for p, e in entries.items()
                 if "/" in p and p.rsplit("/", 1)[1] == METADATA_NAME}
    newest = sorted(committed, key=lambda d: committed[d], reverse=True)
    kept = set(newest[:fs.keep_last]) | {meta_path.rsplit("/", 1)[0]}
    by_depth = sorted(committed, key=len, reverse=True)
    metas, rest = [], []
    leftovers: dict[str, list[tuple[str, int]]] = {}
    for path, (_, created, _, _) in entries.items():
        owner = next((d for d in by_depth if path.startswith(d + "/")), None)
        if owner is None:
            leftovers.setdefault(checkpoint_dir(path), []).append((path, created))
        elif owner not in kept:
            (metas if path == f"{owner}/{METADATA_NAME}" else rest).append(path)
    for files in leftovers.values():
        if max(c for _, c in files) < started_ns:
            rest.extend(p for p, _ in files)
    if metas:
        fs._call_all("remove", metas)
    if rest:
        fs._call_all("remove", rest)


def lost_reason(fs, path: str) -> str | None:
    """Why a file that a committed checkpoint names has no copy left (the placement its metadata
    recorded), if one does name it."""
    meta = f"{checkpoint_dir(path)}/{METADATA_NAME}"
    for nodes in fs._call_all("placement_of", meta, path).values():
        if nodes:
            return (f"{fs._url(path)} has no live copy: the node(s) that held it ({', '.join(nodes)}) left the "
                    "cluster. Load a checkpoint held elsewhere (a storage tier), or save with more "
                    "storage_options['replicas']")
    return None
