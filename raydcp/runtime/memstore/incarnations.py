"""A node's record of the checkpoints its memory holder holds, on the node's disk.

A ``raymem://`` holder keeps its copies in objects its own process owns: a holder that is killed
(or crashes) takes them with it, though the node stays alive. Its successor on the node starts
empty, and without a record nobody could tell a checkpoint lost that way from one never saved.
So every memory holder keeps, in a small file of its node (``<tmp>/raydcp-memstore/<node id>.json``,
one per node id, which Ray never reuses), the checkpoint directories whose metadata it holds
and when each committed. Protocol:

1. a holder starting on a node reads the file: every directory its predecessor held is *lost*
   (with its commit time, and when the loss was found); losses found earlier stay listed;
2. it rewrites the file with no held directory and those losses;
3. on every metadata it stores (a commit) or removes, it rewrites the file: a directory committed
   again is no longer lost.

Readers ask the holders (:meth:`MemHolder.lost <raydcp.runtime.memstore.holder.MemHolder.lost>`)
when a path has no copy left. Nothing here is ever needed to read a checkpoint: a file that cannot
be read or written only makes the explanation of a loss less precise.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

__all__ = ["Incarnation"]

_MAX_LOST = 1000  # losses remembered per node (the newest)


class Incarnation:
    """The record of one memory holder's process on its node (see the module doc)."""

    def __init__(self, node_id: str, directory: str | None = None):
        self.path = os.path.join(directory or os.path.join(tempfile.gettempdir(), "raydcp-memstore"),
                                 f"{node_id}.json")
        self.started_ns = time.time_ns()
        self.held: dict[str, int] = {}   # checkpoint directory -> commit time (ns)
        self.lost: dict[str, tuple[int, int]] = {}  # directory -> (commit time, when found lost)
        before = self._read()
        for d, committed in before.get("held", {}).items():
            self.lost[d] = (int(committed), self.started_ns)
        for d, (committed, found) in before.get("lost", {}).items():
            self.lost.setdefault(d, (int(committed), int(found)))
        self._write()

    def committed(self, directory: str, created_ns: int) -> None:
        self.held[directory] = created_ns
        self.lost.pop(directory, None)
        self._write()

    def released(self, directories: list[str]) -> None:
        if any(self.held.pop(d, None) is not None for d in list(directories)):
            self._write()

    def lost_under(self, path: str) -> dict[str, tuple[int, int]]:
        """The lost directories that are ``path``, lie under it, or hold it."""
        return {d: v for d, v in self.lost.items()
                if d == path or d.startswith(path + "/") or path.startswith(d + "/") or not path}

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self) -> None:
        lost = dict(sorted(self.lost.items(), key=lambda kv: kv[1][1])[-_MAX_LOST:])
        self.lost = lost
        doc = {"started_ns": self.started_ns, "held": self.held, "lost": {d: list(v) for d, v in lost.items()}}
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
