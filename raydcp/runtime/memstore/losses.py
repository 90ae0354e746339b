"""Why a ``raymem://`` (or ``raynode://``) file has no copy left: what a reader is told.

Called by :class:`~raydcp.runtime.memstore.filesystem.RayMemFileSystem` when a file it is asked
to read (or describe) is held by no alive holder. The answer, in this order:

1. the holders removed it with a reason (:meth:`MemHolder.gone
   <raydcp.runtime.memstore.holder.MemHolder.gone>`: a retention's release) -> the checkpoint was
   released, nothing is damaged (:class:`~raydcp.errors.CheckpointNotFoundError`);
2. a committed checkpoint names it (the placement its metadata recorded) and the nodes that held
   it left the cluster, or are alive but their holders are gone or started after the commit (a
   holder killed or crashed takes its copies with it) -> :class:`~raydcp.errors.CheckpointDamagedError`
   saying which;
3. the checkpoint's metadata went too, with a killed memory holder that held it (the node's
   record, :mod:`.incarnations`) -> the checkpoint is lost with that holder;
4. otherwise None: the file is simply not there (the caller's "missing" stands).
"""
from __future__ import annotations

import time

from ...errors import CheckpointDamagedError, CheckpointError, CheckpointNotFoundError
from ...storage import METADATA_NAME
from . import placement
from .layout import checkpoint_dir, is_data_file

__all__ = ["missing_error"]

_NEXT = ("load a checkpoint held elsewhere (a storage tier), or save with more storage_options['replicas'] "
         "(copies on other nodes)")


def _ago(ns: int) -> str:
    return f"{max(time.time_ns() - ns, 0) / 1e9:.0f}s ago"


def missing_error(fs, path: str) -> CheckpointError | None:
    """The error that says why ``path`` has no copy left, or None where nothing is known (see the
    module doc)."""
    url = fs.url(path)
    directory = checkpoint_dir(path)
    is_meta = path.rsplit("/", 1)[-1] == METADATA_NAME
    released = _released(fs, path)
    if released is not None:
        reason, when = released
        return CheckpointNotFoundError(
            f"{fs.url(directory)} was {reason} ({_ago(when)}), and {url} with it: nothing is damaged, that "
            "checkpoint is no longer kept; load a newer one, or keep more with storage_options['keep_last']",
            path=fs.url(directory))
    if is_data_file(path):
        error = _lost_copies(fs, path, url, directory)
        if error is not None:
            return error
    if fs.holder_kind != "mem":
        return None  # a disk tier's files outlive their holder: a new one finds them again
    lost = [entry for entry in _lost_with_holder(fs, directory)
            if directory == entry[1] or directory.startswith(entry[1] + "/")]
    if not lost:
        return None
    checkpoint = fs.url(lost[0][1])
    where = "; ".join(f"node {node}: committed {_ago(committed)}, its holder lost before {_ago(found)}"
                      for node, _, committed, found in lost)
    text = (f"{checkpoint} was committed, but the holder that held {'it' if is_meta else url} is gone "
            f"though its node is alive ({where}): a holder killed or crashed takes its copies with it, and no "
            f"other node holds one; {_NEXT}")
    if is_meta:
        return CheckpointNotFoundError(text, path=checkpoint)
    return CheckpointDamagedError(text, file=url)


def _released(fs, path: str) -> tuple[str, int] | None:
    found = [g[path] for g in fs.ask_all("gone", [path]).values() if path in g]
    return max(found, key=lambda g: g[1]) if found else None


def _lost_copies(fs, path: str, url: str, directory: str) -> CheckpointError | None:
    """Step 2: the nodes the committed metadata placed ``path`` on, and what became of them."""
    meta = f"{directory}/{METADATA_NAME}" if directory else METADATA_NAME
    nodes = next((n for n in fs.ask_all("placement_of", meta, path).values() if n), None)
    if not nodes:
        return None
    committed = fs.entries(meta).get(meta)
    committed_ns = committed[1] if committed else None
    alive = set(placement.alive_nodes())
    left = [n for n in nodes if n not in alive]
    running = placement.existing_holders([n for n in nodes if n in alive], fs.holder_kind)
    started = {n: s for n, (_, s) in fs.ask_holders(running, "ping_started").items()}
    replaced = [n for n in nodes if n in alive and (n not in started or (committed_ns is not None
                                                                        and started[n] > committed_ns))]
    parts = []
    if left:
        parts.append(f"the node(s) that held it ({', '.join(left)}) left the cluster")
    if replaced:
        parts.append(f"the holder(s) that held it on node(s) {', '.join(replaced)}, which are alive, are gone "
                     "(killed or crashed: a holder's copies go with it)")
    if not parts:
        return None  # every holder that held it still runs: it was removed, not lost
    return CheckpointDamagedError(f"{url} has no live copy: " + "; ".join(parts) + f"; {_NEXT}", file=url)


def _lost_with_holder(fs, directory: str) -> list[tuple[str, str, int, int]]:
    """Step 3: ``(node, checkpoint directory, committed, found lost)`` for the alive nodes whose
    earlier memory holder held a checkpoint at or around ``directory`` (a holder is started where
    none runs: its record says)."""
    holders = {n: placement.holder(n, fs.holder_kind) for n in placement.alive_nodes()}
    out = []
    for node, answer in fs.ask_holders(holders, "lost", directory).items():
        for d, (committed, found) in sorted(answer["dirs"].items()):
            out.append((node, d, committed, found))
    return out
