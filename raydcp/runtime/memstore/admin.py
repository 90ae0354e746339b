"""Operating the memory tier: list, remove and measure what ``raymem://`` holds, and stop its actors.

The functions behind ``raydcp mem ls|rm|usage|stop`` (public as :mod:`raydcp.memory`). Each works
on the Ray cluster this process is connected to; :func:`connect` connects it first, within a
bound, so that an unreachable address is one error naming it rather than minutes of retries.

1. :func:`connect` (``address``, else ``RAY_ADDRESS``, else the local cluster): a TCP probe of
   the address first (:func:`raydcp.runtime.connection.unreachable`: nothing listening is refused
   at once, an address that does not answer within ``timeout_s`` fails then), then ``ray.init``
   bounded by what is left of ``timeout_s``;
2. :func:`checkpoints` lists what the holders of the alive nodes hold, one row per checkpoint
   directory: the committed ones (a ``raydcp.meta`` there), and the files of saves that have not
   committed (in flight, or failed and not yet released by a later commit);
3. :func:`remove` drops a whole ``NAME``, one checkpoint, or anything that is not inside a
   committed checkpoint: the metadata files first (an interrupted removal leaves nothing that
   looks committed), then every other file, then the room reserved by saves under it;
4. :func:`usage` says, per alive node, the bytes its holder holds and has reserved for saves in
   flight, beside the node's object store;
5. :func:`stop` stops the holders (the detached actors that own the bytes: every in-memory
   checkpoint goes with them, so it refuses while they hold any, unless ``force``) and the
   coordinator hosts of every version of raydcp's code. The next operation that needs them
   starts new ones.

Holder calls are bounded by ``timeout_s`` too; a holder that does not answer is reported, never
silently counted as empty.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field

import ray

from ...errors import CheckpointDamagedError, CheckpointError, CheckpointNotFoundError
from ...metadata_format import decode_metadata  # raydcp's own codec, no pickle
from ...storage import METADATA_NAME
from .. import actors, connection
from . import placement
from .commit import checkpoint_dir
from .filesystem import RayMemFileSystem

__all__ = ["DEFAULT_TIMEOUT_S", "ClusterUnreachableError", "MemoryInUseError", "MemCheckpoint", "NodeUsage",
           "Removal", "Stopped", "connect", "checkpoints", "remove", "usage", "stop"]

DEFAULT_TIMEOUT_S = 15.0
_PROTOCOL = "raymem://"
_KIND_OF_PREFIX = {f"{prefix}-": kind for kind, prefix in (("mem", "holder"), ("disk", "disk-holder"))}


class ClusterUnreachableError(CheckpointError):
    """No Ray cluster answered at ``address`` within ``timeout_s`` seconds."""

    def __init__(self, message: str, *, address: str, timeout_s: float, pending: bool = False):
        super().__init__(message)
        self.address, self.timeout_s = address, float(timeout_s)
        # Ray's connection attempt still runs in this process (it cannot be cancelled): a command
        # line tool leaves at once (os._exit) rather than wait for it at interpreter exit
        self.pending = pending


class MemoryInUseError(CheckpointError):
    """A removal or a stop refused because it would damage or drop checkpoints: ``held`` names them."""

    def __init__(self, message: str, *, held: list[str]):
        super().__init__(message)
        self.held = list(held)


@dataclass(frozen=True)
class MemCheckpoint:
    """One checkpoint directory held in memory (``committed_at`` None: a save not committed)."""

    name: str                    # the NAME of raymem://NAME/...
    url: str                     # raymem://NAME/PATH of the directory
    files: int
    bytes: int                   # one copy of each file
    held_bytes: int              # every copy on every node
    nodes: tuple[str, ...]       # the nodes holding any of its files
    committed_at: float | None   # seconds since the epoch (the metadata's publication)
    step: int | None = None      # the step it saved (plain value ``step`` or a TrainState's progress.step)
    world_size: int | None = None
    error: str | None = None     # the metadata could not be read

    def to_dict(self) -> dict:
        return {**asdict(self), "nodes": list(self.nodes)}


@dataclass(frozen=True)
class NodeUsage:
    """What one alive node's holder holds: ``state`` is "running", "none" (no holder started
    there yet: it holds nothing) or "no answer" (held and reserved unknown)."""

    node: str
    address: str
    state: str
    held: int | None = None
    reserved: int | None = None
    files: int | None = None
    object_store_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Removal:
    url: str
    files: int
    bytes: int                   # one copy of each file removed
    checkpoints: list[str] = field(default_factory=list)   # committed checkpoints removed
    reservations: int = 0        # saves in flight whose reserved room was released

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Stopped:
    holders: list[str]           # actor names (namespace placement.NAMESPACE)
    hosts: list[str]             # coordinator hosts (namespace actors.NAMESPACE)
    dropped: list[str] = field(default_factory=list)  # in-memory checkpoints that went with the holders

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- connecting


def connect(address: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Connect this process to the Ray cluster at ``address`` (else ``RAY_ADDRESS``, else the
    local one), or raise :class:`ClusterUnreachableError` within about ``timeout_s`` seconds.
    A process already connected stays on its cluster."""
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise CheckpointError(f"timeout must be a number of seconds > 0, got {timeout_s!r}")
    if not ray.is_initialized():
        target = connection.cluster_address(address)
        deadline = time.monotonic() + timeout_s
        why = connection.unreachable(target, timeout_s)
        if why is not None:
            raise _unreachable(target, timeout_s, why)
        _init(target, deadline, timeout_s)


def _unreachable(target: str, timeout_s: float, why: str, pending: bool = False) -> ClusterUnreachableError:
    where = "the local Ray cluster (address auto)" if target == "auto" else f"{target}"
    return ClusterUnreachableError(
        f"no Ray cluster reachable at {where} within {timeout_s:g}s ({why}); start one (`ray start --head`), "
        "or give the address of a running one's head node (host:port) in RAY_ADDRESS or --address (address=)",
        address=target, timeout_s=timeout_s, pending=pending)


def _init(target: str, deadline: float, timeout_s: float) -> None:
    """``ray.init`` bounded by ``deadline``: where it does not return in time (something answers
    at the address but no Ray cluster serves there), its thread is left behind and the error
    raised; the process is then not connected."""
    failure: list[BaseException] = []
    done = threading.Event()

    def init() -> None:
        try:
            ray.init(address=target, log_to_driver=False, logging_level=logging.ERROR)
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=init, name="raydcp-connect", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.001)):
        raise _unreachable(target, timeout_s, "something listens there, but no Ray cluster answered", pending=True)
    if failure:
        exc = failure[0]
        first = (str(exc).strip().splitlines() or [""])[0]
        raise _unreachable(target, timeout_s, f"{type(exc).__name__}: {first}") from None


# ----------------------------------------------------------------------------- reading what is held


def _fs(timeout_s: float) -> RayMemFileSystem:
    return RayMemFileSystem(timeout_s=timeout_s)


def _strip(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(_PROTOCOL):
        raise CheckpointError(f"{url!r} is not a memory-tier URL: name one as raymem://NAME or raymem://NAME/PATH")
    return url[len(_PROTOCOL):].strip("/")


def _answering(fs: RayMemFileSystem, kind: str = "mem") -> tuple[list[str], list[str]]:
    """``(nodes whose holder answered, nodes whose holder did not)`` among the alive nodes that run one."""
    holders = placement.existing_holders(placement.alive_nodes(), kind)
    return _ask(holders, "ping", (), fs.timeout_s)


def _ask(holders: dict, method: str, args: tuple, timeout_s: float) -> tuple[dict, list[str]]:
    """``({node: answer}, [nodes without one])`` of ``method`` on every holder, within ``timeout_s``
    (a holder found dead is in neither: it holds nothing)."""
    refs = {}
    silent = []
    for node, h in holders.items():
        try:
            refs[node] = getattr(h, method).remote(*args)
        except Exception:
            silent.append(node)
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    ready = set(ready)
    out = {}
    for node, ref in refs.items():
        if ref not in ready:
            silent.append(node)
            continue
        try:
            out[node] = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            silent.append(node)
        except ray.exceptions.RayActorError:  # died (stopped elsewhere): it holds nothing any more
            placement.forget(node)
    return out, sorted(silent)


def _silent_note(silent: list[str]) -> str:
    return (f"the holders on nodes {silent} did not answer: what they hold is not counted; "
            "retry, or raise the timeout")


def _held(fs: RayMemFileSystem, path: str) -> dict[str, dict]:
    """``{path: info}`` of every file at or under ``path`` over the alive holders; raises where a
    running holder did not answer (its files would be missing from the answer)."""
    _, silent = _answering(fs)
    if silent:
        raise CheckpointError(f"{_PROTOCOL}{path}: {_silent_note(silent)}")
    return fs.find(path, detail=True)


def _committed_dirs(files: dict[str, dict]) -> list[str]:
    """The committed checkpoint directories among ``files``, deepest first."""
    dirs = {p.rsplit("/", 1)[0] for p in files if "/" in p and p.rsplit("/", 1)[1] == METADATA_NAME}
    return sorted(dirs, key=len, reverse=True)


def _step(values: dict | None) -> int | None:
    """The step the checkpoint saved, never digits of its name (as ``raydcp ls`` reads it): the
    plain value ``step``, else the shortest ``progress.step`` of a ``raydcp.train.TrainState``."""
    values = values or {}
    keys = ["step"] + sorted((k for k in values if k == "progress.step" or k.endswith(".progress.step")),
                             key=lambda k: (len(k), k))
    for key in keys:
        step = values.get(key)
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def checkpoints(name: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[MemCheckpoint]:
    """The checkpoint directories held in memory (under ``raymem://name`` where given), by NAME
    and path; committed ones first within a NAME, oldest first."""
    connect(timeout_s=timeout_s)
    fs = _fs(timeout_s)
    root = _strip(name if name.startswith(_PROTOCOL) else _PROTOCOL + name) if name else ""
    files = _held(fs, root)
    committed = _committed_dirs(files)
    groups: dict[str, list[tuple[str, dict]]] = {}
    for path, info in files.items():
        owner = next((d for d in committed if path.startswith(d + "/")), None)
        groups.setdefault(owner if owner is not None else checkpoint_dir(path), []).append((path, info))
    rows = []
    for directory, members in groups.items():
        meta = next((i for p, i in members if p == f"{directory}/{METADATA_NAME}"), None)
        url = f"{_PROTOCOL}{directory}"
        values = world = error = None
        if meta is not None:
            try:
                md = decode_metadata(fs.cat_file(meta["name"]), f"{url}/{METADATA_NAME}")
                values, world = dict(md.values), md.world_size
            except (CheckpointError, FileNotFoundError) as exc:
                error = str(exc)
        rows.append(MemCheckpoint(
            name=directory.split("/", 1)[0], url=url, files=len(members),
            bytes=sum(i["size"] for _, i in members),
            held_bytes=sum(i["size"] * len(i["held_on"]) for _, i in members),
            nodes=tuple(sorted({n for _, i in members for n in i["held_on"]})),
            committed_at=meta["created"] if meta is not None else None,
            step=_step(values),
            world_size=world, error=error))
    rows.sort(key=lambda r: (r.name, r.committed_at is None, r.committed_at or 0.0, r.url))
    return rows


def usage(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[NodeUsage]:
    """Per alive node: the bytes its memory holder holds and has reserved, its object store's size."""
    connect(timeout_s=timeout_s)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    holders = placement.existing_holders(sorted(n["NodeID"] for n in nodes))
    answers, silent = _ask(holders, "usage", (), timeout_s)
    rows = []
    for n in sorted(nodes, key=lambda n: n["NodeID"]):
        node = n["NodeID"]
        store = n.get("Resources", {}).get("object_store_memory")
        common = dict(node=node, address=str(n.get("NodeManagerAddress", "")),
                      object_store_bytes=int(store) if store is not None else None)
        if node in answers:
            a = answers[node]
            rows.append(NodeUsage(state="running", held=a["held"], reserved=a["reserved"], files=a["files"], **common))
        elif node in silent:
            rows.append(NodeUsage(state="no answer", **common))
        else:
            rows.append(NodeUsage(state="none", held=0, reserved=0, files=0, **common))
    return rows


# ----------------------------------------------------------------------------- removing


def _reservations(path: str, timeout_s: float) -> dict[str, list[str]]:
    """``{node: [save keys]}`` of the room reserved on each holder by saves under ``path``."""
    holders = placement.existing_holders(placement.alive_nodes())
    found, silent = _ask(holders, "reservations", (f"{path}/" if path else "",), timeout_s)
    if silent:
        raise CheckpointError(f"{_PROTOCOL}{path}: {_silent_note(silent)}")
    return {node: sorted(keys) for node, keys in found.items() if keys}


def remove(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Removal:
    """Remove ``raymem://NAME`` (everything under it) or ``raymem://NAME/PATH`` (a checkpoint, or
    files that are not part of a committed checkpoint), and release the room reserved by saves
    under it. Raises :class:`~raydcp.errors.CheckpointNotFoundError` where nothing is held there,
    and :class:`MemoryInUseError` for a path inside a committed checkpoint (which would damage it)."""
    path = _strip(url)
    url = f"{_PROTOCOL}{path}"
    if not path:
        raise CheckpointError("raymem://: name what to remove (raymem://NAME or raymem://NAME/PATH); "
                              "`raydcp mem stop --force` drops everything the memory tier holds")
    connect(timeout_s=timeout_s)
    fs = _fs(timeout_s)
    name = path.split("/", 1)[0]
    around = _held(fs, name)  # the whole NAME: a committed checkpoint above ``path`` must be seen
    inside = next((d for d in _committed_dirs(around) if path.startswith(d + "/")), None)
    if inside is not None:
        raise MemoryInUseError(
            f"{url} is part of the committed checkpoint {_PROTOCOL}{inside}: removing it alone would damage that "
            f"checkpoint; remove the whole checkpoint (`raydcp mem rm {_PROTOCOL}{inside}`)",
            held=[f"{_PROTOCOL}{inside}"])
    files = {p: i for p, i in around.items() if p == path or p.startswith(path + "/")}
    reserved = _reservations(path, timeout_s)
    if not files and not reserved:
        raise CheckpointNotFoundError(
            f"{url}: nothing is held there on the cluster's alive nodes (no file at or under it, no save in "
            "flight); `raydcp mem ls` lists what the memory tier holds", path=url)
    metas = sorted(p for p in files if p.rsplit("/", 1)[-1] == METADATA_NAME)
    if metas:  # first: an interrupted removal leaves files, never a checkpoint that looks whole and is not
        fs.rm(metas)
    if files:
        fs.rm(path, recursive=True)
    holders = placement.existing_holders(sorted(reserved))
    for node, keys in reserved.items():
        h = holders.get(node)
        if h is not None:
            _ask({node: h}, "release_saves", (keys,), timeout_s)
    left = {p for p in _held(fs, path) if p == path or p.startswith(path + "/")}
    if left:
        raise CheckpointDamagedError(
            f"{url}: {len(left)} file(s) are still held after the removal (e.g. {_PROTOCOL}{sorted(left)[0]}): "
            "a holder refused or was replaced meanwhile; run the removal again", file=url)
    return Removal(url=url, files=len(files), bytes=sum(i["size"] for i in files.values()),
                   checkpoints=[f"{_PROTOCOL}{m.rsplit('/', 1)[0]}" for m in metas],
                   reservations=sum(len(k) for k in reserved.values()))


# ----------------------------------------------------------------------------- stopping


def _named(namespace: str) -> list[str]:
    return sorted({a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == namespace})


def _wait_dead(handles: list, deadline: float) -> list:
    """The handles whose actor still answered at ``deadline`` (a killed actor's calls fail once it is gone)."""
    alive = []
    for h in handles:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                alive.append(h)
                break
            try:
                ray.get(h.__ray_ready__.remote(), timeout=left)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                break
            except ray.exceptions.GetTimeoutError:
                alive.append(h)
                break
    return alive


def stop(*, force: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> Stopped:
    """Stop every holder of the memory tier and of node-local disk tiers, and the coordinator
    hosts of every version of raydcp's code (the next operation starts new ones).

    Memory holders own the bytes of every ``raymem://`` checkpoint, which go with them: while they
    hold any file (or room reserved by a save in flight) this raises :class:`MemoryInUseError`
    naming the checkpoints, unless ``force``. Disk holders keep only an index: the files stay on
    the nodes' disks, and a new holder finds them again."""
    connect(timeout_s=timeout_s)
    names = [n for n in _named(placement.NAMESPACE) if any(n.startswith(p) for p in _KIND_OF_PREFIX)]
    mem = {n[len("holder-"):] for n in names if n.startswith("holder-")}
    dropped: list[str] = []
    if mem:
        try:
            held = checkpoints(timeout_s=timeout_s)
            reserved = _reservations("", timeout_s)
        except CheckpointError as exc:  # a holder that does not answer: what it holds is unknown
            if not force:
                raise exc.copy(f"{exc}; or stop with --force (force=True), which stops them without asking") from None
            held, reserved = [], {}
        dropped = [r.url for r in held]
        if (held or reserved) and not force:
            what = ", ".join(f"{r.url} ({'committed' if r.committed_at is not None else 'uncommitted'})"
                             for r in held[:10])
            if len(held) > 10:
                what += f" and {len(held) - 10} more"
            if reserved:
                what += ("; " if what else "") + f"room reserved by {sum(len(k) for k in reserved.values())} " \
                                                 "save(s) in flight"
            raise MemoryInUseError(
                f"the memory tier still holds {what}; stopping its holders drops them: remove them first "
                "(`raydcp mem rm raymem://NAME`), or stop with --force (force=True) to drop them",
                held=dropped)
    handles, stopped = [], []
    for n in names:
        try:
            h = ray.get_actor(n, namespace=placement.NAMESPACE)
        except ValueError:  # gone meanwhile
            continue
        ray.kill(h, no_restart=True)
        handles.append(h)
        stopped.append(n)
        prefix = next(p for p in _KIND_OF_PREFIX if n.startswith(p))
        placement.forget(n[len(prefix):], _KIND_OF_PREFIX[prefix])
    host_handles = []
    for n in _named(actors.NAMESPACE):
        if n.startswith("raydcp-coordinator-"):
            try:
                host_handles.append(ray.get_actor(n, namespace=actors.NAMESPACE))
            except ValueError:
                pass
    hosts = actors.stop_hosts(every_version=True)
    alive = _wait_dead(handles + host_handles, time.monotonic() + timeout_s)
    if alive:
        raise CheckpointError(f"stopped {len(stopped)} holder(s) and {len(hosts)} coordinator host(s), but "
                              f"{len(alive)} of them still answered after {timeout_s:g}s; run the stop again")
    return Stopped(holders=stopped, hosts=sorted(hosts), dropped=dropped if force else [])
