"""``raynode:///DIR/...``: a node-local disk tier. Each rank writes its files on its own node's disk.

The path may hold a ``{node}`` placeholder (``raynode:///nvme/ckpt/{node}/run-7``), replaced by the
id of the node that holds a file: on a real cluster ``/nvme/ckpt`` is a different disk on each
machine anyway; on one machine (tests, several simulated nodes) the placeholder gives each node
its own directory. A pipeline tier ``Tier("/nvme/ckpt/{node}", node_local=True)`` is this URL.

Same protocol as ``raymem://`` (:mod:`raydcp.runtime.memstore.filesystem`), with the node's disk
in place of its object store and no replicas (the next tier of a pipeline is the copy):

- a write goes to ``DIR`` (placeholder filled with the writer's node) durably (fsync), and is
  recorded by that node's disk holder (``disk-holder-<node>``, detached, pinned to the node);
- the commit checks that every file the metadata names is held on an alive node, then publishes
  the metadata atomically (write, fsync, rename) on every alive node's disk;
- a read takes the local file where this node holds it (only the byte ranges asked for), else
  asks the holder of the node that has it for exactly those ranges; a file whose node is gone has
  no copy here (a pipeline then loads from its next tier);
- listings and removal go through the alive nodes' disk holders, started where none runs: a
  holder restarted on a live node finds the files of its node's disk again (it indexes the
  directory of the first path it is asked about, :class:`~raydcp.runtime.memstore.holder.MemHolder`).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...storage import write_durably
from . import placement
from .filesystem import RayMemFileSystem
from .holder import NODE_PLACEHOLDER

__all__ = ["RayNodeFileSystem", "NODE_PLACEHOLDER"]


class RayNodeFileSystem(RayMemFileSystem):
    """fsspec filesystem ``raynode://``: files on the local disk of the node that wrote them."""

    protocol = "raynode"
    holder_kind = "disk"
    # no byte cap on a disk (a full disk fails the write): no room to reserve at the plan step
    writer_site = reserve_save = release_save = None
    _pulls = False  # no objects: a peer's file is read by range from its holder
    memory_views = False  # reads come from disks

    def __init__(self, keep_last: int = 0, timeout_s: float = 300.0, **kwargs):
        super().__init__(replicas=0, keep_last=keep_last, timeout_s=timeout_s, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path).removeprefix("raynode://").rstrip("/")
        return path if path.startswith("/") else "/" + path

    def url(self, path: str) -> str:
        return f"raynode://{path}"

    @staticmethod
    def local_path(path: str, node: str) -> str:
        """Where ``path`` lives on the disk of ``node``."""
        return path.replace(NODE_PLACEHOLDER, node)

    def replica_count(self, nodes: list[str]) -> int:
        return 0

    def _holders(self, nodes: list[str]) -> dict[str, Any]:
        """Every alive node's disk holder, started where none runs: the files on a node's disk
        outlive its holder, and a new one finds them again (:meth:`MemHolder._discover`)."""
        return {n: placement.holder(n, self.holder_kind) for n in nodes}

    def hold(self, path: str, data: np.ndarray, created_ns: int) -> list[str]:
        self.connect(path)
        node = placement.local_node()
        local = self.local_path(path, node)
        try:
            write_durably(local, [memoryview(data).cast("B")])
        except OSError as exc:
            raise OSError(f"could not write {self.url(path)} at {local} on node {node}: {exc}") from exc
        def record():
            return [placement.holder(node, self.holder_kind).register.remote(path, local, int(data.nbytes), created_ns,
                                                                       (node,))]

        self.gather([node], record(), f"record {self.url(path)}", again=record)
        return [node]

    def _create_at(self, path: str, node: str) -> str | None:
        return self.local_path(path, node)

    def publish_copies(self, nodes: list[str], path: str, data: bytes, created_ns: int, where: dict) -> None:
        def publish():
            return [placement.holder(n, self.holder_kind).store_file.remote(path, self.local_path(path, n), data, created_ns,
                                                                      tuple(nodes), where) for n in nodes]

        self.gather(nodes, publish(), f"publish {self.url(path)}", again=publish)

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Byte ranges: from this node's own files where it holds them (positional reads of exactly
        those ranges), else from the disk holder of the node that does."""
        paths = [self._strip_protocol(p) for p in paths]
        if not isinstance(starts, list):
            starts = [starts] * len(paths)
        if not isinstance(ends, list):
            ends = [ends] * len(paths)
        if not paths:
            return []
        self.connect(paths[0])
        node = placement.local_node()
        out: list[Any] = [None] * len(paths)
        wanted: dict[str, list[int]] = {}
        fds: dict[str, int | None] = {}
        try:
            for i, p in enumerate(paths):
                if p not in fds:
                    try:
                        fds[p] = os.open(self.local_path(p, node), os.O_RDONLY)
                    except FileNotFoundError:
                        fds[p] = None
                fd = fds[p]
                if fd is None:
                    wanted.setdefault(p, []).append(i)
                    continue
                s, e = self._bounds(starts[i], ends[i], os.fstat(fd).st_size)
                out[i] = memoryview(os.pread(fd, e - s, s))
        finally:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)
        if wanted:
            self._read_remote(wanted, paths, starts, ends, out)
        for value in out:
            if isinstance(value, BaseException) and on_error == "raise":
                raise value
        return out

    def _local_arrays(self, paths: list[str]) -> dict[str, np.ndarray]:
        return {}  # cat_ranges reads local files itself
