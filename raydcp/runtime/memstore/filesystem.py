"""``raymem://NAME/...``: an fsspec filesystem whose files live in the Ray cluster's object stores.

raydcp's storage layer (fsspec only) uses it like any other backend; this module maps the
primitives it calls onto the holders of :mod:`raydcp.runtime.memstore.holder`:

- ``writer_site`` / ``reserve_save`` / ``release_save`` (:mod:`raydcp.storage.capacity`): at a
  save's plan step the room for all of its files is reserved on every node they will reach, and a
  save that does not fit fails every rank before any byte moves (:mod:`.capacity`);
- ``open(path, "wb")`` / ``pipe_file``: the bytes go, when the file is closed, to the holder of
  the writer's node and to ``replicas`` holders of other nodes (ring order), and the call returns
  only once every copy is held; a copy takes its bytes from its save's reservation, and one
  beyond it that does not fit under a node's byte cap is refused before any byte moves. A write
  that fails half-way leaves no partial file.
- ``pipe_file(".../raydcp.meta")`` is the commit: it first checks that every file the metadata
  names still has all its copies (a node lost after the data writes fails the commit, nothing is
  published), then publishes the metadata on every alive node (one atomic replace per holder),
  then releases the checkpoints of the same NAME beyond ``keep_last`` (never before).
- ``cat_ranges`` / ``cat_file``: each file is read from the reader's own node's holder (zero-copy
  from the object store) where it has one, else from a live replica on another node: a data file
  is pulled whole into this node's object store once (then read like a local copy), other files
  by range; a file with no live copy is a FileNotFoundError naming it.
- ``info`` / ``ls`` / ``find`` / ``rm``: over the union of the alive nodes' holders.

Options (``storage_options``, docs/memory.md): ``replicas`` (default 1 with several alive nodes),
``keep_last`` (default 1; 0 keeps all), ``node_cap_bytes`` (default ``RAYDCP_MEMSTORE_NODE_CAP_BYTES``
or none), ``timeout_s`` (a holder that does not answer in time fails the call, default 300).
"""
from __future__ import annotations

import io
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import ray
from fsspec.spec import AbstractFileSystem

from ...errors import CheckpointError
from ...storage import METADATA_NAME
from . import capacity, placement
from .capacity import NODE_CAP_ENV, cap_error
from .layout import is_data_file
from .writer import MemWriter

__all__ = ["RayMemFileSystem", "NODE_CAP_ENV"]

_PULL_MAX = 1 << 30  # a data file held elsewhere up to this size is pulled whole (_pull), larger ones by range


def _positive_int(name: str, value: Any, *, allow_none: bool, minimum: int = 0) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"raymem:// storage_options[{name!r}] must be an integer >= {minimum}, got {value!r}")
    return value


class RayMemFileSystem(AbstractFileSystem):
    """fsspec filesystem ``raymem://``: files held in the object stores of a Ray cluster's nodes."""

    protocol = "raymem"
    root_marker = ""
    #: Which holders keep this filesystem's files (the ``kind`` of :func:`.placement.holder`): the
    #: protocol modules (:mod:`.capacity`, :mod:`.commit`, :mod:`.losses`) address the same ones.
    holder_kind = "mem"
    # One instance per CheckpointStorage (no fsspec instance cache): the views of data files an
    # instance keeps for its reads (below) are released with it, or by close_reads().
    cachable = False
    _pulls = True  # a data file held on another node is pulled whole (see _pull)
    #: Reads give zero-copy views of the object store's copies (a copy held elsewhere is pulled
    #: whole first): CheckpointStorage.memory_reads, so a load verifies them before copying.
    memory_views = True

    def __init__(self, replicas: int | None = None, keep_last: int = 1, node_cap_bytes: int | None = None,
                 timeout_s: float = 300.0, **kwargs):
        super().__init__(**kwargs)
        self.replicas = _positive_int("replicas", replicas, allow_none=True)
        self.keep_last = _positive_int("keep_last", keep_last, allow_none=False)
        if node_cap_bytes is None and os.environ.get(NODE_CAP_ENV):
            node_cap_bytes = os.environ[NODE_CAP_ENV]
        self.node_cap_bytes = _positive_int("node_cap_bytes", node_cap_bytes, allow_none=True, minimum=1)
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise CheckpointError(f"raymem:// storage_options['timeout_s'] must be a number > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        # Zero-copy views of this node's copies of data files read so far: a load reads a file in
        # many ranges, and one holder lookup per file (not per range) is enough, as data files
        # (``DIR/data/<save id>/...``, :mod:`.layout`) are never rewritten under the same name.
        # Views pin their objects, so they go with this instance (one per CheckpointStorage) or
        # close_reads().
        self._views: dict[str, np.ndarray] = {}
        self._sources: dict[str, tuple[list[str], int]] = {}  # data files held elsewhere: (nodes, size)
        self._views_lock = threading.Lock()

    def close_reads(self) -> None:
        """Drop the views kept for reads (the objects can then be freed once released)."""
        with self._views_lock:
            self._views, self._sources = {}, {}

    # --------------------------------------------- helpers (also the protocol modules' interface)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return str(path).removeprefix("raymem://").strip("/")

    def url(self, path: str) -> str:
        """The URL of ``path`` (a path without the protocol) as a user writes it: what messages name."""
        return f"raymem://{path}"

    def connect(self, path: str) -> None:
        """Make sure this process is connected to the Ray cluster (within ``timeout_s``) before
        the holders are asked about ``path``; a failure names ``path``'s URL."""
        placement.ensure_ray(self.url(path), self.timeout_s)

    def _holders(self, nodes: list[str]) -> dict[str, Any]:
        """The holders to ask about ``nodes``' files: those that run (copies die with their holder)."""
        return placement.existing_holders(nodes, self.holder_kind)

    def ask_all(self, method: str, *args) -> dict[str, Any]:
        """Ask every alive node's holder: ``{node: result}`` of the holder method ``method`` called
        with ``args`` on the holder of every alive node (:meth:`_holders`) that answered; a dead one
        is replaced and asked again where :meth:`_holders` starts one."""
        return self.ask_holders(self._holders(placement.alive_nodes()), method, *args)

    def ask_holders(self, holders: dict[str, Any], method: str, *args) -> dict[str, Any]:
        """Ask the given holders: ``{node: result}`` of the holder method ``method`` called with
        ``args`` on those of ``holders`` (``{node: holder handle}``) that answered (see :meth:`ask_all`)."""
        refs = {node: getattr(h, method).remote(*args) for node, h in holders.items()}
        out = {}
        for node, ref in refs.items():
            for attempt in range(2):
                try:
                    out[node] = ray.get(ref, timeout=self.timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    placement.forget(node, self.holder_kind)
                    again = self._holders([node]).get(node) if attempt == 0 else None
                    if again is None:
                        break
                    ref = getattr(again, method).remote(*args)
                    continue
                except ray.exceptions.GetTimeoutError:
                    pass
                break
        return out

    def entries(self, prefix: str) -> dict[str, tuple[int, int, tuple, set]]:
        """What the alive holders hold under ``prefix``: ``{path: (size, created_ns, nodes, held_on)}``,
        the newest copy of each path; ``nodes`` are those its writer placed it on, ``held_on`` those
        whose holder has that copy now."""
        merged: dict[str, tuple[int, int, tuple, set]] = {}
        for node, listing in self.ask_all("listing", prefix).items():
            for path, (size, created, nodes) in listing.items():
                got = merged.get(path)
                if got is None or created > got[1]:
                    merged[path] = (size, created, nodes, {node} | (got[3] if got and got[1] == created else set()))
                elif created == got[1]:
                    got[3].add(node)
        return merged

    # ----------------------------------------------------------------- writes

    def replica_count(self, nodes: list[str]) -> int:
        """How many copies beside the writer's a file gets when ``nodes`` are alive (``replicas``,
        by default 1 with several nodes)."""
        return self.replicas if self.replicas is not None else (1 if len(nodes) > 1 else 0)

    def hold(self, path: str, data: np.ndarray, created_ns: int) -> list[str]:
        """Hold ``data`` as the file ``path`` (created at ``created_ns``) on the writer's node and on
        the replica nodes, each copy under the node's byte cap; return those nodes."""
        self.connect(path)
        url = self.url(path)
        alive = placement.alive_nodes()
        targets = placement.ring_targets(placement.local_node(), alive, self.replica_count(alive), url)
        holders = [placement.holder(n) for n in targets]
        token = uuid.uuid4().hex
        size = int(data.nbytes)
        # the cap is for data files: the commit log and status records (a few KB) are not refused
        cap = self.node_cap_bytes if is_data_file(path) else None
        try:
            refused = self.gather(targets, [h.reserve.remote(token, size, cap, path) for h in holders],
                                  f"reserve memory for {url}")
            refused = [r for r in refused if r is not None]
            if refused:
                raise cap_error(url, refused[0], what=f"this file of {size} bytes")
            obj = ray.put(data)
            self.gather(targets, [h.store.remote(path, [obj], size, created_ns, tuple(targets), token)
                                  for h in holders], f"hold {url}")
            del obj
        except BaseException:
            for h in holders:
                try:
                    h.release.remote(token)
                    h.remove.remote([path])
                except Exception:
                    pass
            raise
        return targets

    def gather(self, nodes: list[str], refs: list, what: str, again=None) -> list:
        """Wait for calls on the holders of ``nodes``: the results of ``refs``, or a CheckpointError
        saying which nodes did not answer in time or died, and that nothing was committed (``what``
        names the step: "could not {what}"). ``again()`` makes the calls anew, once, where a holder
        died on a live node (a disk tier's: its successor finds its files)."""
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise CheckpointError(f"could not {what}: the holders on nodes {nodes} did not answer within "
                                  f"{self.timeout_s:.0f}s (storage_options['timeout_s'])") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError) as exc:
            for n in nodes:
                placement.forget(n, self.holder_kind)
            alive = set(placement.alive_nodes())
            if again is not None and set(nodes) <= alive:
                return self.gather(nodes, again(), what)
            left = [n for n in nodes if n not in alive]
            happened = (f"node(s) {left} left the cluster" if left else
                        f"a holder on node(s) {nodes} died (killed or crashed) though its node is alive")
            raise CheckpointError(f"could not {what}: {happened} ({type(exc).__name__}); nothing was "
                                  "committed, save again") from None

    # the optional capacity protocol of raydcp.storage.capacity (raydcp.runtime.memstore.capacity)
    def writer_site(self) -> tuple[str, int | None]:
        """This process's node and the byte cap it sees: where its writes land (first copy)."""
        placement.ensure_ray("raymem://", self.timeout_s)
        return placement.local_node(), self.node_cap_bytes

    def reserve_save(self, path: str, save_id: str, bytes_by_site: dict) -> None:
        capacity.reserve(self, self._strip_protocol(path), save_id, bytes_by_site)

    def release_save(self, path: str, save_id: str) -> None:
        capacity.release(self, self._strip_protocol(path), save_id)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        data = bytes(value)
        if mode == "create":
            self._create(path, data)
        elif path.rsplit("/", 1)[-1] == METADATA_NAME:
            self.commit_metadata(path, data)
        else:
            self.hold(path, np.frombuffer(data, dtype=np.uint8), time.time_ns())

    def _create(self, path: str, data: bytes) -> None:
        """Exclusive creation (a commit log's generation file, :mod:`raydcp.storage.commits`): held
        on every alive node, or FileExistsError and nothing of this call held anywhere.

        Each holder's :meth:`~raydcp.runtime.memstore.holder.MemHolder.create` is a compare-and-set.
        The first node in ring order is asked first, alone: creators racing for one name meet there
        and exactly one passes it; the winner then asks the other nodes at once. A creator refused
        anywhere (a stale copy, a node list that changed meanwhile, so that racers met first on
        different nodes: then they meet again on the others, and at most one passes them all)
        takes back only the copies marked with its own token. A copy on every alive node makes a
        later creator meet it wherever it starts."""
        self.connect(path)
        url = self.url(path)
        nodes = placement.alive_nodes()
        token, created = uuid.uuid4().hex, time.time_ns()
        made: list[str] = []

        def create(batch: list[str]) -> None:
            holders = [placement.holder(n, self.holder_kind) for n in batch]
            refs = [h.create.remote(path, data, created, tuple(nodes), token, self._create_at(path, n))
                    for n, h in zip(batch, holders)]
            made.extend(batch)  # taken back on failure: uncreate leaves another creator's file alone
            if not all(self.gather(batch, refs, f"create {url}")):
                raise FileExistsError(url)

        try:
            create(nodes[:1])
            if nodes[1:]:
                create(nodes[1:])
        except BaseException:
            if made:
                refs = [placement.holder(n, self.holder_kind).uncreate.remote(path, token) for n in made]
                try:
                    ray.get(refs, timeout=self.timeout_s)
                except Exception:
                    pass  # a holder lost meanwhile took its copy with it
            raise

    def _create_at(self, path: str, node: str) -> str | None:
        """Where a node's holder writes a created file (None: in its object store)."""
        return None

    def commit_metadata(self, path: str, data: bytes) -> None:
        """Commit a checkpoint: publish its metadata ``data`` as ``path`` once every file it names
        is held, then release what ``keep_last`` no longer keeps (:func:`.commit.publish`)."""
        from .commit import publish

        publish(self, path, data)

    def publish_copies(self, nodes: list[str], path: str, data: bytes, created_ns: int, where: dict) -> None:
        """Hold the metadata ``path`` on every node of ``nodes`` (one atomic replace each), with
        ``where`` (``{file: nodes}``, the placement of the files it names) beside it."""
        holders = [placement.holder(n, self.holder_kind) for n in nodes]
        self.gather(nodes, [h.store_bytes.remote(path, data, created_ns, tuple(nodes), where) for h in holders],
                    f"publish {self.url(path)}")

    def node_of(self, path) -> str | None:
        """The node that holds ``path`` (its writer's node where it still does): where work on
        the file runs best (a pipeline replicates each file from there)."""
        path = self._strip_protocol(path)
        self.connect(path)
        entry = self.entries(path).get(path)
        if entry is None:
            return None
        _, _, nodes, held_on = entry
        return next((n for n in nodes if n in held_on), None)

    # ----------------------------------------------------------------- reads

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """One buffer per ``(path, start, end)``: read-only views of the local node's copy where it
        holds the file (no copy), else the ranges fetched from a live replica's holder."""
        paths = [self._strip_protocol(p) for p in paths]
        if not isinstance(starts, list):
            starts = [starts] * len(paths)
        if not isinstance(ends, list):
            ends = [ends] * len(paths)
        if not (len(paths) == len(starts) == len(ends)):
            raise ValueError("cat_ranges: paths, starts and ends must have the same length")
        if not paths:
            return []
        self.connect(paths[0])
        unique = sorted(set(paths))
        local = self._local_arrays(unique)
        wanted: dict[str, list[int]] = {}
        for i, p in enumerate(paths):
            if p not in local:
                wanted.setdefault(p, []).append(i)
        out: list[Any] = [None] * len(paths)
        for i, p in enumerate(paths):
            if p in local:
                arr = local[p]
                s, e = self._bounds(starts[i], ends[i], arr.nbytes)
                out[i] = memoryview(arr[s:e])
        if wanted:
            self._read_remote(wanted, paths, starts, ends, out)
        for i, value in enumerate(out):
            if isinstance(value, BaseException) and on_error == "raise":
                raise value
        return out

    def read_into_many(self, path: str, requests: list[tuple[int, memoryview]]) -> int:
        """Fill each writable byte view of ``requests`` with the bytes of ``path`` from its start
        on; the bytes copied. From this node's copy, one copy straight from the object store
        into ``out`` (numpy's, without the GIL); else through :meth:`cat_ranges`. Used by the
        storage layer's ``read_into_many`` in place of ``cat_ranges`` plus a copy."""
        path = self._strip_protocol(path)
        self.connect(path)
        arr = self._local_arrays([path]).get(path)
        if arr is None:
            datas = self.cat_ranges([path] * len(requests), [s for s, _ in requests],
                                    [s + len(v) for s, v in requests], on_error="raise")
        else:
            datas = [arr[s:s + len(v)] for s, v in requests]
        total = 0
        for (start, view), data in zip(requests, datas):
            if len(data) != len(view):
                raise ValueError(f"{self.url(path)}: bytes {start}..{start + len(view)} asked, "
                                 f"{len(data)} there")
            np.copyto(np.frombuffer(view, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))
            total += len(view)
        return total

    @staticmethod
    def _bounds(start, end, size: int) -> tuple[int, int]:
        start = 0 if start is None else (size + start if start < 0 else start)
        end = size if end is None else (size + end if end < 0 else end)
        return max(0, min(start, size)), max(0, min(end, size))

    def _local_arrays(self, paths: list[str]) -> dict[str, np.ndarray]:
        """The files of ``paths`` that this node's holder has, as zero-copy arrays."""
        with self._views_lock:
            arrays = {p: self._views[p] for p in paths if p in self._views}
        todo = [p for p in paths if p not in arrays]
        if not todo:
            return arrays
        local = placement.local_node()
        holder = placement.existing_holders([local], self.holder_kind).get(local)
        if holder is None:
            return arrays
        try:
            boxed = ray.get(holder.lookup.remote(todo), timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            placement.forget(local, self.holder_kind)
            return arrays
        paths = list(boxed)
        refs = [boxed[p][0] for p in paths]
        try:  # one get for every file: a load reads several files of this node
            got = ray.get(refs, timeout=self.timeout_s)
        except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError):
            got = []  # one of them is lost: get each alone, the lost ones then read from a replica
            for ref in refs:
                try:
                    got.append(ray.get(ref, timeout=self.timeout_s))
                except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError):
                    got.append(None)
        for path, arr in zip(paths, got):
            if arr is None:
                continue
            arrays[path] = arr
            if is_data_file(path):
                with self._views_lock:
                    self._views[path] = arr
        return arrays

    def _read_remote(self, wanted: dict[str, list[int]], paths, starts, ends, out: list) -> None:
        """Fill ``out`` for files this node does not hold, from the nearest live copy elsewhere."""
        with self._views_lock:
            known = {p: self._sources[p] for p in wanted if p in self._sources}
        if len(known) < len(wanted):
            local = placement.local_node()
            ring = placement.alive_nodes()
            if local in ring:  # nearest first: the ring order from this node on
                i = ring.index(local)
                ring = ring[i + 1:] + ring[:i]
            held = self.ask_all("sizes", sorted(p for p in wanted if p not in known))
            for path in wanted:
                if path not in known:
                    sources = [n for n in ring if path in held.get(n, {})]
                    known[path] = (sources, next((held[n][path] for n in sources), 0))
                    if sources and is_data_file(path):  # data files are immutable: remember where they are
                        with self._views_lock:
                            self._sources[path] = known[path]
        for path, idxs in wanted.items():
            sources, size = known[path]
            error: BaseException | None = None
            for node in sources:
                bounds = [self._bounds(starts[i], ends[i], size) for i in idxs]
                holder = placement.existing_holders([node], self.holder_kind).get(node)
                try:
                    whole = self._pull(holder, path) if self._pulls and is_data_file(path) and size <= _PULL_MAX \
                        else None
                    if whole is not None:
                        got = [whole[s:e] for s, e in bounds]
                    else:
                        got = ray.get(holder.read_ranges.remote(path, [b[0] for b in bounds], [b[1] for b in bounds]),
                                      timeout=self.timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                        ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError, AttributeError) as exc:
                    placement.forget(node, self.holder_kind)
                    with self._views_lock:
                        self._sources.pop(path, None)
                    error = exc
                    continue
                if got is None:
                    continue
                for i, arr in zip(idxs, got):
                    out[i] = memoryview(arr)
                break
            else:
                missing = self._missing(path) if error is None else None
                if missing is None:
                    why = f"{self.url(path)}: no copy on the cluster's alive nodes"
                    if error is not None:
                        why += f" (the holders that had one did not answer: {type(error).__name__})"
                    missing = FileNotFoundError(why)
                for i in idxs:
                    out[i] = missing

    def _pull(self, holder, path: str) -> np.ndarray | None:
        """Data file ``path`` pulled whole from ``holder``'s node into this node's object store (one
        object transfer, shared by the node's readers), kept like a local copy; None if not held
        there. A load reads a file in many ranges, and a call to another node per range costs far
        more than moving the file (at most ``max_file_bytes``, 256 MiB by default)."""
        boxed = ray.get(holder.lookup.remote([path]), timeout=self.timeout_s).get(path)
        if not boxed:
            return None
        arr = ray.get(boxed[0], timeout=self.timeout_s)
        with self._views_lock:
            self._views[path] = arr
        return arr

    def _missing(self, path: str) -> CheckpointError | None:
        """Why ``path`` has no copy left, where that is known (released, lost: :mod:`.losses`)."""
        from .losses import missing_error

        return missing_error(self, path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        return bytes(self.cat_ranges([path], [start], [end], on_error="raise")[0])

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        path = self._strip_protocol(path)
        if mode == "rb":
            return io.BytesIO(self.cat_file(path))
        if mode in ("wb", "xb"):
            return MemWriter(self, path)
        raise ValueError(f"raymem:// files open in 'rb' or 'wb' mode, not {mode!r}")

    # ----------------------------------------------------------------- listing

    def _info(self, path: str, entry: tuple) -> dict:
        size, created, nodes, held_on = entry
        return {"name": path, "size": size, "type": "file", "created": created / 1e9,
                "nodes": list(nodes), "held_on": sorted(held_on)}

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        self.connect(path)
        entries = self.entries(path)
        if path in entries:
            return self._info(path, entries[path])
        if not path or any(p.startswith(path + "/") for p in entries):
            return {"name": path, "size": 0, "type": "directory"}
        missing = self._missing(path) if is_data_file(path) else None
        if missing is not None:  # not just "missing": released, or a committed checkpoint's copies lost
            raise missing
        raise FileNotFoundError(self.url(path))

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        self.connect(path)
        prefix = f"{path}/" if path else ""
        entries = self.entries(path)
        if path in entries and not any(p.startswith(prefix) for p in entries):
            return [self._info(path, entries[path])] if detail else [path]
        children: dict[str, dict] = {}
        for p, e in entries.items():
            if not p.startswith(prefix):
                continue
            head, sep, _ = p[len(prefix):].partition("/")
            name = prefix + head
            if sep:
                children.setdefault(name, {"name": name, "size": 0, "type": "directory"})
            else:
                children[name] = self._info(p, e)
        if not children and path:
            raise FileNotFoundError(self.url(path))
        items = [children[k] for k in sorted(children)]
        return items if detail else [i["name"] for i in items]

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        path = self._strip_protocol(path)
        self.connect(path)
        prefix = f"{path}/" if path else ""
        found = {p: self._info(p, e) for p, e in self.entries(path).items() if p == path or p.startswith(prefix)}
        if maxdepth is not None:
            found = {p: i for p, i in found.items() if p[len(prefix):].count("/") < maxdepth}
        names = sorted(found)
        return {n: found[n] for n in names} if detail else names

    def makedirs(self, path, exist_ok=False):
        pass  # no directories: a write creates every parent

    def mkdir(self, path, create_parents=True, **kwargs):
        pass

    # ----------------------------------------------------------------- removal

    def rm_file(self, path):
        self.rm([path])

    def _rm(self, path):
        self.rm([path])

    def rm(self, path, recursive=False, maxdepth=None):
        paths = [self._strip_protocol(p) for p in (path if isinstance(path, (list, tuple)) else [path])]
        if not paths:
            return
        self.connect(paths[0])
        metas = [p for p in paths if p.rsplit("/", 1)[-1] == METADATA_NAME]
        if metas:  # the metadata first: an interrupted removal leaves nothing that looks committed
            self.ask_all("remove", metas)
        prefixes = [f"{p}/" if p else "" for p in paths] if recursive else []
        self.close_reads()
        self.ask_all("remove", [p for p in paths if p not in metas], prefixes)

    def usage(self) -> dict[str, dict]:
        """``{node: {"held": bytes, "reserved": bytes, "files": n}}`` of every alive holder."""
        placement.ensure_ray("raymem://", self.timeout_s)
        return self.ask_all("usage")
