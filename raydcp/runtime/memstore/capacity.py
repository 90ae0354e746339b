"""Room for a whole ``raymem://`` save under the per-node byte caps, reserved at its plan step.

raydcp's save protocol asks for it through the optional filesystem methods of
:mod:`raydcp.storage.capacity`; :class:`~raydcp.runtime.memstore.filesystem.RayMemFileSystem`
implements them with the functions here. Protocol (who calls what):

1. every writing rank reports its *site*: its node and the ``node_cap_bytes`` it sees
   (``writer_site``);
2. the coordinator, once the global plan is known, calls :func:`reserve` with the bytes of each
   site's files. Each file goes to its writer's node and ``replicas`` ring neighbours, so each
   node's share is the sum over the sites whose ring reaches it. Every such node's holder
   reserves its share atomically against the cap (:meth:`MemHolder.reserve_save`): what it
   holds counts, the checkpoints that ``keep_last`` will release only after this save commits
   included, and so do the reservations of saves in flight. One refusal gives back what the
   others granted and fails every rank with a :class:`NodeCapacityError` naming the node, the
   bytes needed and free, and the knob -- before any byte is staged or written. Two saves racing
   for the same room cannot both get it;
3. each data file written later takes its bytes out of its save's reservation on every holder
   that keeps a copy (:meth:`MemHolder.reserve`), so it is not checked twice;
4. the reservation goes when the save commits (:func:`release_after_commit`, from the commit,
   which also releases the reservations of saves to the same path that can no longer commit,
   and of saves under the same NAME that left nothing behind), or when it fails (every rank's
   ``release_save``).
"""
from __future__ import annotations

import time

from ...errors import StorageError
from ...storage import METADATA_NAME
from ...storage.commits import save_generation
from . import placement

__all__ = ["NodeCapacityError", "NODE_CAP_ENV", "save_key", "node_shares", "reserve", "release",
           "release_after_commit", "cap_error"]

NODE_CAP_ENV = "RAYDCP_MEMSTORE_NODE_CAP_BYTES"


class NodeCapacityError(StorageError):
    """A ``raymem://`` save (or file) does not fit under a node's byte cap: ``node``, ``needed``
    (bytes), ``free`` (bytes left under ``cap``). Nothing of it was written."""

    def __init__(self, message: str, *, node: str, needed: int, free: int, cap: int, path: str | None = None):
        super().__init__(message, retriable=False, path=path)
        self.node, self.needed, self.free, self.cap = node, int(needed), int(free), int(cap)


def save_key(path: str, save_id: str) -> str:
    """The name of a save's reservation: the directory of its data files."""
    return f"{path}/data/{save_id}" if path else f"data/{save_id}"


def _knob() -> str:
    return (f"raise storage_options['node_cap_bytes'] (or {NODE_CAP_ENV}), lower storage_options['replicas'] or "
            "'keep_last', or save fewer bytes per node")


def cap_error(url: str, refusal: dict, *, what: str, detail: str = "") -> NodeCapacityError:
    """The error for a holder's refusal (``{"node", "used", "held", "cap", "need"}``)."""
    node, cap, need = refusal["node"], refusal["cap"], refusal["need"]
    free = max(cap - refusal["used"], 0)
    reserved = refusal["used"] - refusal["held"]
    return NodeCapacityError(
        f"{url}: no room for {what} on node {node}: it needs {need} bytes there{detail}, and the node has {free} "
        f"of its {cap}-byte cap free ({refusal['held']} held, {reserved} reserved by saves in flight); nothing "
        f"was staged or written. To make it fit, {_knob()}",
        node=node, needed=need, free=free, cap=cap, path=url)


def reserve(fs, path: str, save_id: str, bytes_by_site: dict) -> None:
    """Step 2 on the coordinator: reserve the room of save ``save_id`` on every node it reaches."""
    fs.connect(path)
    url = fs.url(path)
    alive = placement.alive_nodes()
    replicas = fs.replica_count(alive)
    caps = [site[1] for site in bytes_by_site if isinstance(site, tuple) and site[1] is not None]
    cap = min(caps) if caps else fs.node_cap_bytes
    share, own = node_shares(bytes_by_site, alive, replicas, url)
    if cap is None or not share:
        return  # no cap: nothing to refuse
    key = save_key(path, save_id)
    nodes = sorted(share)
    holders = [placement.holder(n, fs.holder_kind) for n in nodes]
    now = time.time_ns()
    answers = fs.gather(nodes, [h.reserve_save.remote(key, share[n], cap, now) for n, h in zip(nodes, holders)],
                        f"reserve memory for {url}")
    refused = [a for a in answers if a is not None]
    if not refused:
        return
    fs.gather(nodes, [h.release_saves.remote([key]) for h in holders], f"release the reservation of {url}")
    r = refused[0]
    mine = own.get(r["node"], 0)
    # the checkpoints keep_last counts: those beside this one (raydcp.runtime.memstore.commit.retention_scope)
    name = path.strip("/").rsplit("/", 1)[0] if "/" in path.strip("/") else path.strip("/")
    older = _held_under(fs, name, r["node"])
    detail = (f" ({mine} of its own ranks' files, {r['need'] - mine} of replicas of other nodes' files, "
              f"replicas={replicas}; {older} of the bytes it holds are checkpoints under raymem://{name}/, "
              f"which keep_last={fs.keep_last} releases only after this save commits)")
    others = [a["node"] for a in refused[1:]]
    if others:
        detail += f"; nodes {others} cannot take their share either"
    raise cap_error(url, r, what="this save", detail=detail)


def node_shares(bytes_by_site: dict, alive: list[str], replicas: int, url: str) -> tuple[dict, dict]:
    """``(share, own)``: per node, the bytes it will hold (its own ranks' files and the replicas
    the ring places on it) and those of its own ranks. Sites are ``(node, cap)``; a rank that did
    not say where it writes is left out (its files are checked one by one as they are written)."""
    share: dict[str, int] = {}
    own: dict[str, int] = {}
    for site, nbytes in bytes_by_site.items():
        if not isinstance(site, tuple):
            continue
        node = site[0]
        own[node] = own.get(node, 0) + nbytes
        for target in placement.ring_targets(node, alive, replicas, url):  # refuses too many replicas
            share[target] = share.get(target, 0) + nbytes
    return share, own


def _held_under(fs, prefix: str, node: str) -> int:
    return sum(size for size, _, _, held_on in fs.entries(prefix + "/").values() if node in held_on)


def release(fs, path: str, save_id: str) -> None:
    """Step 4 for a save that failed: give back what it reserved (idempotent)."""
    fs.connect(path)
    fs.ask_all("release_saves", [save_key(path, save_id)])


def release_after_commit(fs, meta_path: str, save_id: str, started_ns: int) -> None:
    """Step 4 at the commit of ``save_id`` (metadata ``meta_path``, files written from ``started_ns``).

    Released: this save's reservation; those of other saves to the same path begun on the same
    commit or an older one (the commit log refuses their commit now); and those under the same
    NAME, at an uncommitted path, made before this save started, of saves that wrote no file
    since (saves whose processes died: their files go at retention, as leftovers).
    """
    directory = meta_path.rsplit("/", 1)[0] if "/" in meta_path else ""
    name = meta_path.split("/", 1)[0]
    base = save_generation(save_id)
    held: dict[str, tuple[int, int]] = {}
    for found in fs.ask_all("reservations", name + "/").values():
        held.update(found)
    if not held:
        return
    entries = fs.entries(name + "/")
    committed = {p.rsplit("/", 1)[0] for p in entries if p.endswith("/" + METADATA_NAME)}
    doomed = []
    for key, (_, created) in held.items():
        head, _, sid = f"/{key}".rpartition("/data/")  # save_key's layout; "" for a save at the root
        head = head[1:]
        if head == directory:
            gen = save_generation(sid)
            if sid == save_id or (gen is not None and base is not None and gen <= base):
                doomed.append(key)
        elif head not in committed and created < started_ns and not any(
                p.startswith(head + "/") and e[1] >= started_ns for p, e in entries.items()):
            doomed.append(key)
    if doomed:
        fs.ask_all("release_saves", doomed)
