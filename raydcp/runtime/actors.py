"""The one place where raydcp's plain classes become Ray actors.

The classes themselves (``CoordinatorHost``, the shard actor) know nothing of
``ray.remote``; tests build them directly. This module applies the decorator
and the placement options, and finds (or starts) the cluster's coordinator host:

1. :func:`coordinator_host` returns this process's handle of the host, a detached
   actor named :func:`host_name` in namespace ``raydcp``: looked up by name on
   first use, and created where none runs (``get_if_exists``: when several
   processes race, one creates it and the others get it). Detached: it belongs to
   no job or rank, so it outlives the process that started it and every job reuses
   it; only the first operation in a fresh cluster waits for it to start. It runs
   on the head node where the cluster names one (worker nodes come and go).
2. :func:`prepare_host` starts it ahead of the first operation (``raydcp.prepare_group``,
   ``ShardGroup``), without waiting.
3. :func:`forget_host` drops a handle whose actor died (the transport calls it), so
   that the next operation gets, or starts, a live host. A handle belongs to the Ray session
   that made it: after ``ray.shutdown()`` and ``ray.init()`` in this process the host is looked
   up by name again (:func:`raydcp.runtime.connection.session`).
4. :func:`release_owner` drops an owner's state in the host (a ShardGroup that shut down).
"""
from __future__ import annotations

import functools
import hashlib
import threading
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import connection
from .coordinator_host import CoordinatorHost

NAMESPACE = "raydcp"

# Where the head node says it is one (Ray gives it this resource); a detached actor is best there.
_HEAD_RESOURCE = "node:__internal_head__"
# Calls the host serves at once: every waiting rank of every running operation is one (an
# awaiting coroutine, not a thread), so the bound is far above any cluster's rank count.
_MAX_CALLS = 100_000

_lock = threading.Lock()
_HOST = None  # this process's handle of the host
_HOST_SESSION = None  # the Ray session _HOST was made in


@functools.lru_cache(maxsize=1)
def host_name() -> str:
    """The host's actor name: one per version of raydcp's code.

    The host outlives the job that started it and runs the reductions (planning, commit) of
    every job, so a job whose raydcp differs (another release, a changed checkout) must get a
    host of its own code rather than another job's: the name carries a digest of the code.
    """
    root = Path(__file__).resolve().parents[1]  # the raydcp package
    digest = hashlib.blake2b(digest_size=5)
    try:
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    except OSError:  # not a readable source tree: the installed version stands for the code
        from importlib import metadata

        try:
            digest.update(metadata.version("raydcp").encode())
        except metadata.PackageNotFoundError:
            pass
    return f"raydcp-coordinator-{digest.hexdigest()}"


def host_options() -> dict:
    """The options the host is created with (get-or-create, detached, on the head node)."""
    opts = dict(name=host_name(), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
                max_restarts=0, max_concurrency=_MAX_CALLS)
    if ray.cluster_resources().get(_HEAD_RESOURCE):
        opts["resources"] = {_HEAD_RESOURCE: 0.001}
    return opts


_HostRemote = ray.remote(CoordinatorHost)


def coordinator_host():
    """This process's handle of the cluster's coordinator host, which the first caller creates."""
    global _HOST, _HOST_SESSION
    now = connection.session()
    handle = _HOST
    if handle is not None and _HOST_SESSION == now:
        return handle
    with _lock:
        if _HOST_SESSION != now:
            _HOST, _HOST_SESSION = None, now
        if _HOST is None:
            try:
                _HOST = ray.get_actor(host_name(), namespace=NAMESPACE)
            except ValueError:  # none runs: start it (or get the one another process just started)
                _HOST = _HostRemote.options(**host_options()).remote()
        return _HOST


def forget_host(handle) -> None:
    """``handle``'s actor died: the next :func:`coordinator_host` looks up (or starts) a live one."""
    global _HOST
    with _lock:
        if _HOST is not None and handle is not None and _HOST._actor_id == handle._actor_id:
            _HOST = None


def prepare_host() -> None:
    """Start the coordinator host now (if none runs), without waiting for it."""
    coordinator_host().ready.remote()


def stop_hosts(*, every_version: bool = False) -> list[str]:
    """Stop the cluster's coordinator host (detached, it otherwise stays up with the cluster), and
    with ``every_version`` the hosts that other versions of raydcp's code started too. An operation
    running through a stopped host fails on every rank with ``CoordinatorLostError``; the next
    operation starts a new host. Returns the names of the hosts stopped."""
    global _HOST
    names = [host_name()]
    if every_version:
        names += sorted({a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a.get("namespace") == NAMESPACE and a["name"].startswith("raydcp-coordinator-")}
                        - {host_name()})
    stopped = []
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # not running
            continue
        ray.kill(handle, no_restart=True)
        stopped.append(name)
    with _lock:
        _HOST = None
    return stopped


def release_owner(owner: str) -> None:
    """Drop the state ``owner`` (a ShardGroup's name) holds in the host, without waiting."""
    handle = _HOST if _HOST_SESSION == connection.session() else None
    if handle is None:
        try:
            handle = ray.get_actor(host_name(), namespace=NAMESPACE)
        except ValueError:  # no host: nothing held
            return
    try:
        handle.release.remote(owner)
    except Exception:  # unreachable: it holds nothing any more
        pass


@functools.lru_cache(maxsize=None)
def _remote_class(cls):
    # tensor transport on: a ShardGroup reshard may send through Ray Direct Transport (runtime/shard_group/rdt.py)
    return ray.remote(enable_tensor_transport=True)(cls)


def start_shard_actor(cls, rank: int, world_size: int, pg, *, num_gpus: float, num_cpus: float,
                      bundle: int | None = None):
    """Start member ``rank`` of a ShardGroup in bundle ``bundle`` (default ``rank``) of placement group ``pg``.

    ``cls`` is ShardActor or a subclass. One extra concurrency slot lets probes
    (``info``, ``apply``) answer while a collective step runs.
    """
    return _remote_class(cls).options(
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        max_concurrency=2,
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank if bundle is None else bundle),
    ).remote(rank, world_size)

