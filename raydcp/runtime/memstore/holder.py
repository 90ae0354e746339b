"""The holder: one detached actor per node that owns the bytes of ``raymem://`` files there.

A holder keeps, for every file path it holds, an object in its node's object store that it
created itself (``ray.put`` in the holder's process), so the object's owner is the holder: the
bytes outlive the worker that saved them and die only with the holder (its node). Objects are
numpy ``uint8`` arrays, so a reader on the same node gets them zero-copy.

Protocol of a write (the caller is :class:`raydcp.runtime.memstore.filesystem.RayMemFileSystem`
in the writing process):

0. (at the save's plan step, once per save) :meth:`MemHolder.reserve_save` on every holder that
   the save's files will reach: the room for all of them, refused as a whole if it does not fit
   (:mod:`raydcp.runtime.memstore.capacity`);
1. :meth:`MemHolder.reserve` on every holder that is to hold a copy: the copy's bytes come out of
   its save's reservation, and a copy beyond it that would push a holder past the node's byte
   cap is refused *before* any byte moves;
2. the writer puts the bytes once into its own node's object store and calls :meth:`store` on
   each holder with that object: the local holder copies it within the node, a replica holder
   pulls it over the network and puts its own copy (so each replica lives on its own node);
3. :meth:`release` frees a reservation that was not used (a write that failed elsewhere).

An exclusive creation (``pipe_file(mode="create")``: a commit log's generation file) is a
compare-and-set instead: :meth:`create` holds the file only if this holder holds none of that
name, in one step under the holder's lock, and marks it with the creator's token; the creator
asks every alive node's holder in ring order and, refused by one, takes back with
:meth:`uncreate` only the copies that carry its own token.

Reads: :meth:`lookup` hands out the (borrowed) object of a file, for zero-copy reads on the node
(and for a reader on another node to pull a data file whole into its own node's object store);
:meth:`read_ranges` serves byte ranges to readers on other nodes (of other files, and of a
node-local disk tier's files).

A node-local disk tier's holder (``kind="disk"``, :mod:`raydcp.runtime.memstore.nodelocal`) keeps
no bytes, only its index of the files written on its node's disk, and that index is in memory. So
that a holder restarted on a live node (its process killed, or lost to an OOM) does not forget
them, it finds them again on the disk: the first time it is asked about a path (a listing, a
size, a read), it walks the directory of that path on its disk once and indexes every file there
(never a temporary file of an atomic publish), with the size on disk and the creation time that
the write recorded as the file's modification time. Files it finds in a checkpoint's ``data/`` (or
``data/<save id>/``) that is a symbolic link are another checkpoint's: listed and read, never
removed from the disk (``os.walk`` follows no link below the directory it walks).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from ...storage import METADATA_NAME, publish_atomically
from .incarnations import Incarnation

__all__ = ["MemHolder", "FileEntry", "NODE_PLACEHOLDER"]

NODE_PLACEHOLDER = "{node}"  # in a node-local tier's path: the id of the node that holds the file
_GONE_KEPT = 65536  # removal reasons kept per holder (the newest)
_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{16}$")  # publish_atomically's file before its rename


def _through_linked_data(local: str) -> bool:
    """True if the local directory ``local`` lies in a checkpoint's ``data/`` or ``data/<save id>/``
    that is a symbolic link (a copy of a checkpoint sharing the original's data): the files there
    are the original's. ``os.walk`` follows no link below its root; this guards the root itself."""
    path = local.rstrip("/")
    while path and path != "/":
        parent, name = os.path.split(path)
        if (name == "data" or os.path.basename(parent) == "data") and os.path.islink(path):
            return True
        path = parent
    return False


@dataclass
class FileEntry:
    ref: Any                 # ObjectRef owned by this holder
    size: int
    created_ns: int          # when the writer started the write (one clock: the writer's)
    nodes: tuple[str, ...]   # every node meant to hold a copy, the writer's first
    placement: dict | None = None  # metadata only: {file path: nodes} of the files it names
    local_path: str | None = None  # node-local disk tier: the bytes are in this file on the node (ref is None)
    token: str | None = None       # an exclusive creation's own mark (:meth:`MemHolder.create`)
    linked: bool = False           # found on the disk through a linked data/: readable, never removed from disk


class MemHolder:
    """The files of ``raymem://`` held on one node (a plain class; ``ray.remote`` is applied in
    :mod:`raydcp.runtime.memstore.placement`)."""

    def __init__(self, node_id: str, kind: str = "mem"):
        self.node_id = node_id
        self.kind = kind  # "mem": copies in the object store; "disk": files on this node's disk
        self._walked: set[str] = set()  # disk: local directories indexed from the disk already
        self._files: dict[str, FileEntry] = {}
        self._reserved: dict[str, int] = {}  # per file being written (a token): its bytes
        self._saves: dict[str, list[int]] = {}  # per save ("<dir>/data/<save id>"): [bytes left, reserved at]
        self._lock = threading.Lock()
        self.started_ns = time.time_ns()
        # why files went, for a reader that finds one gone: {path: (reason, when)}, the newest kept
        self._gone: OrderedDict[str, tuple[str, int]] = OrderedDict()
        # memory tier: the node's record of the checkpoints held, and of those a predecessor lost
        self._incarnation = Incarnation(node_id) if kind == "mem" else None

    # ----------------------------------------------------------------- accounting

    def _used(self) -> int:
        return (sum(e.size for e in self._files.values()) + sum(self._reserved.values())
                + sum(left for left, _ in self._saves.values()))

    def usage(self) -> dict:
        with self._lock:
            return {"node": self.node_id, "held": sum(e.size for e in self._files.values()),
                    "reserved": sum(self._reserved.values()) + sum(left for left, _ in self._saves.values()),
                    "files": len(self._files)}

    def _refusal(self, nbytes: int, cap: int) -> dict:
        held = sum(e.size for e in self._files.values())
        return {"node": self.node_id, "used": self._used(), "held": held, "cap": cap, "need": nbytes}

    def _save_of(self, path: str | None) -> str | None:
        """The reserved save whose files ``path`` is one of."""
        if path is None:
            return None
        return next((k for k in self._saves if path.startswith(k + "/")), None)

    def reserve_save(self, key: str, nbytes: int, cap: int | None, created_ns: int) -> dict | None:
        """Reserve ``nbytes`` for the files of a whole save (``key``: its ``<dir>/data/<save id>``),
        atomically against ``cap``: None when granted, else what this node holds against the cap."""
        with self._lock:
            if cap is not None and self._used() + nbytes > cap:
                return self._refusal(nbytes, cap)
            left = self._saves.get(key, [0, created_ns])[0]
            self._saves[key] = [left + nbytes, created_ns]
            return None

    def reservations(self, prefix: str) -> dict[str, tuple[int, int]]:
        """``{save key: (bytes left, reserved at)}`` of the saves reserved under ``prefix``."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self._saves.items() if k.startswith(prefix)}

    def release_saves(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._saves.pop(key, None)

    def reserve(self, token: str, nbytes: int, cap: int | None, path: str | None = None) -> dict | None:
        """Reserve ``nbytes`` for a copy of ``path`` about to be stored; None when granted, else a
        dict that says what this node holds against ``cap``. A file of a save that reserved room
        (:meth:`reserve_save`) takes its bytes from that reservation; only what exceeds it is
        checked against the cap."""
        with self._lock:
            key = self._save_of(path)
            take = min(self._saves[key][0], nbytes) if key is not None else 0
            if key is not None:
                self._saves[key][0] -= take
            if take < nbytes and cap is not None and self._used() + nbytes > cap:
                if key is not None:
                    self._saves[key][0] += take
                return self._refusal(nbytes, cap)
            self._reserved[token] = self._reserved.get(token, 0) + nbytes
            return None

    def release(self, token: str) -> None:
        with self._lock:
            self._reserved.pop(token, None)

    # ----------------------------------------------------------------- writes

    def store(self, path: str, boxed: list, size: int, created_ns: int, nodes: tuple, token: str | None) -> str:
        """Hold a copy of ``boxed[0]`` (an object anywhere in the cluster) as ``path``."""
        try:
            value = ray.get(boxed[0])
            arr = np.asarray(value, dtype=np.uint8).reshape(-1)
            if arr.nbytes != size:
                raise ValueError(f"{path}: expected {size} bytes, received {arr.nbytes}")
            own = ray.put(arr)  # this holder owns the copy now, in its own node's object store
            del value, arr
        finally:
            if token is not None:
                self.release(token)
        with self._lock:
            self._files[path] = FileEntry(own, size, created_ns, tuple(nodes))
        return self.node_id

    def store_bytes(self, path: str, data: bytes, created_ns: int, nodes: tuple,
                    placement: dict | None = None) -> str:
        """Hold a small file (the metadata, with where the files it names were placed) sent by value."""
        own = ray.put(np.frombuffer(data, dtype=np.uint8))
        with self._lock:
            self._files[path] = FileEntry(own, len(data), created_ns, tuple(nodes), placement)
            self._gone.pop(path, None)
            if self._incarnation is not None and path.rsplit("/", 1)[-1] == METADATA_NAME:
                self._incarnation.committed(path.rsplit("/", 1)[0] if "/" in path else "", created_ns)
        return self.node_id

    def register(self, path: str, local_path: str, size: int, created_ns: int, nodes: tuple) -> str:
        """Record a file of a node-local disk tier, written durably at ``local_path`` on this node
        (its modification time becomes ``created_ns``: what a restarted holder reads back)."""
        os.utime(local_path, ns=(created_ns, created_ns))
        with self._lock:
            self._files[path] = FileEntry(None, size, created_ns, tuple(nodes), None, local_path)
        return self.node_id

    def store_file(self, path: str, local_path: str, data: bytes, created_ns: int, nodes: tuple,
                   placement: dict | None = None) -> str:
        """Publish a small file (the metadata) at ``local_path`` on this node's disk, atomically."""
        publish_atomically(local_path, memoryview(data))
        os.utime(local_path, ns=(created_ns, created_ns))
        with self._lock:
            self._files[path] = FileEntry(None, len(data), created_ns, tuple(nodes), placement, local_path)
        return self.node_id

    def create(self, path: str, data: bytes, created_ns: int, nodes: tuple, token: str,
               local_path: str | None = None) -> bool:
        """Hold ``data`` as ``path`` only if this holder holds no file of that name: True if it
        now does, False if one was there (nothing changed). Check and write are one step under
        the lock, so of creators racing for one name exactly one gets True here. A disk tier's
        holder writes the file at ``local_path`` on its node (atomically)."""
        self._discover(path)
        with self._lock:
            if path in self._files:
                return False
            if local_path is not None:
                publish_atomically(local_path, memoryview(data))
                os.utime(local_path, ns=(created_ns, created_ns))
                own = None
            else:
                own = ray.put(np.frombuffer(data, dtype=np.uint8))
            self._files[path] = FileEntry(own, len(data), created_ns, tuple(nodes), None, local_path, token)
            return True

    def uncreate(self, path: str, token: str) -> bool:
        """Take back a copy made by :meth:`create` with ``token``; another creator's file stays."""
        with self._lock:
            entry = self._files.get(path)
            if entry is None or entry.token != token:
                return False
            del self._files[path]
        if entry.local_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(entry.local_path)
        return True

    def placement_of(self, meta_path: str, path: str) -> tuple | None:
        """The nodes that held ``path`` when the metadata ``meta_path`` committed, if it names it."""
        with self._lock:
            entry = self._files.get(meta_path)
            return None if entry is None or not entry.placement else entry.placement.get(path)

    def remove(self, paths: list[str], prefixes: list[str] = (), reason: str | None = None) -> int:
        """Drop ``paths`` and every file under each of ``prefixes`` (ending in "/"); the bytes
        freed. The objects go when their last reader drops them. ``reason`` (why they go, e.g.
        a retention's release) is kept for a reader that finds one of them gone (:meth:`gone`)."""
        with self._lock:
            gone = [p for p in paths if p in self._files]
            if prefixes:
                gone += [p for p in self._files if any(p.startswith(x) for x in prefixes)]
            gone = set(gone)
            entries = [self._files.pop(p) for p in gone]
            now = time.time_ns()
            for p in gone:
                self._gone.pop(p, None)
                if reason is not None:
                    self._gone[p] = (reason, now)
            while len(self._gone) > _GONE_KEPT:
                self._gone.popitem(last=False)
            metas = [p.rsplit("/", 1)[0] if "/" in p else "" for p in gone if p.rsplit("/", 1)[-1] == METADATA_NAME]
            if metas and self._incarnation is not None:
                self._incarnation.released(metas)
        for e in entries:
            if e.local_path is not None and not e.linked:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(e.local_path)
        return sum(e.size for e in entries)

    # ----------------------------------------------------------------- reads

    def listing(self, prefix: str) -> dict[str, tuple[int, int, tuple]]:
        """``{path: (size, created_ns, nodes)}`` of every file whose path starts with ``prefix``."""
        self._discover(prefix)
        with self._lock:
            return {p: (e.size, e.created_ns, e.nodes) for p, e in self._files.items() if p.startswith(prefix)}

    def sizes(self, paths: list[str]) -> dict[str, int]:
        """``{path: size}`` of the paths held here."""
        for path in paths:
            self._discover(path)
        with self._lock:
            return {p: self._files[p].size for p in paths if p in self._files}

    def lookup(self, paths: list[str]) -> dict[str, list]:
        """``{path: [object]}`` for the paths held here (boxed, so the caller borrows the object)."""
        with self._lock:
            return {p: [self._files[p].ref] for p in paths if p in self._files and self._files[p].ref is not None}

    def read_ranges(self, path: str, starts: list[int], ends: list[int]) -> list[np.ndarray] | None:
        """Byte ranges of ``path`` (clamped to its size), for a reader on another node."""
        self._discover(path)
        with self._lock:
            entry = self._files.get(path)
        if entry is None:
            return None
        if entry.local_path is not None:
            with open(entry.local_path, "rb") as f:
                return [np.frombuffer(os.pread(f.fileno(), max(e - s, 0), s), dtype=np.uint8)
                        for s, e in zip(starts, ends)]
        arr = ray.get(entry.ref)
        return [np.array(arr[s:e]) for s, e in zip(starts, ends)]

    def ping(self) -> tuple[str, float]:
        return self.node_id, time.time()

    def ping_started(self) -> tuple[str, int]:
        """This holder's node and when it started (a holder started after a commit holds none of it)."""
        return self.node_id, self.started_ns

    # ----------------------------------------------------------------- why a file is gone

    def gone(self, paths: list[str]) -> dict[str, tuple[str, int]]:
        """``{path: (reason, when)}`` of the paths removed here with a reason (:meth:`remove`)."""
        with self._lock:
            return {p: self._gone[p] for p in paths if p in self._gone}

    def lost(self, path: str) -> dict:
        """What this node lost under ``path`` with an earlier holder of its own (killed or crashed):
        ``{"node", "started_ns" (this holder's start), "dirs": {checkpoint directory: (commit
        time, when found lost)}}``; empty ``dirs`` where nothing was."""
        with self._lock:
            dirs = self._incarnation.lost_under(path) if self._incarnation is not None else {}
        return {"node": self.node_id, "started_ns": self.started_ns, "dirs": dirs}

    # ----------------------------------------------------------------- a disk tier's files, found again

    def _discover(self, path: str) -> None:
        """Index the files of this node's disk under the directory of ``path`` (a prefix, a file
        or a directory of a node-local tier), once per directory: a restarted holder finds again
        what its predecessor had."""
        if self.kind != "disk" or not path:
            return
        local = path.replace(NODE_PLACEHOLDER, self.node_id)
        if os.path.isdir(local):
            root, template = local.rstrip("/"), path.rstrip("/")
        else:
            root, template = os.path.dirname(local), path.rsplit("/", 1)[0]
            if NODE_PLACEHOLDER in path and NODE_PLACEHOLDER not in template:
                return  # the parent of every node's directory: not this node's to claim
        if not root or root == "/" or template.replace(NODE_PLACEHOLDER, self.node_id) != root:
            return
        linked = _through_linked_data(root)  # another checkpoint's files: listed and read, never removed
        with self._lock:
            if any(root == d or root.startswith(d + "/") for d in self._walked):
                return
        found: dict[str, FileEntry] = {}
        for directory, _, names in os.walk(root):
            for fname in names:
                if _TEMPORARY.search(fname):
                    continue
                full = os.path.join(directory, fname)
                try:
                    st = os.stat(full)
                except OSError:
                    continue  # removed meanwhile
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                found[f"{template}/{rel}"] = FileEntry(None, st.st_size, st.st_mtime_ns, (self.node_id,), None, full,
                                                       linked=linked)
        with self._lock:
            self._walked.add(root)
            for p, entry in found.items():
                self._files.setdefault(p, entry)  # what the protocol recorded meanwhile wins
