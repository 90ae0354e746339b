"""Where ``raymem://`` copies live: the alive nodes, their holder actors, and the replica ring.

Holders are named ``holder-<node id>`` in the namespace :data:`NAMESPACE`, detached (they outlive
the job that started them), pinned to their node (``NodeAffinitySchedulingStrategy(soft=False)``)
and use no CPU. Any process that reaches the cluster finds or starts them by name.

Replica placement is a ring over the alive nodes sorted by id: a file written on node ``i`` is
also held on nodes ``i+1 .. i+replicas`` (mod n), so no node holds two copies of one file and
the copies spread evenly.
"""
from __future__ import annotations

import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...errors import CheckpointError
from .. import connection
from .holder import MemHolder

__all__ = ["NAMESPACE", "ensure_ray", "local_node", "alive_nodes", "holder", "existing_holders",
           "ring_targets"]

NAMESPACE = "raydcp-memstore"

_RemoteHolder = ray.remote(MemHolder)
# Handles by (kind, node), of one Ray session: a handle made before a reconnect (ray.shutdown()
# and ray.init() in this process) is stale, and the holders are found again by name.
_handles: dict[tuple[str, str], object] = {}
_handles_session: tuple | None = None
# holders of the memory tier ("mem") and of node-local disk tiers ("disk"): one of each per node
_PREFIX = {"mem": "holder", "disk": "disk-holder"}
_lock = threading.Lock()


def ensure_ray(url: str, timeout_s: float = 300.0) -> None:
    """Connect this process to the Ray cluster (``RAY_ADDRESS`` or the running local one) if it is
    not connected; an address that does not answer fails within ``timeout_s``
    (:func:`raydcp.runtime.connection.connect`, which changes no process-wide setting)."""
    connection.connect(url, timeout_s)


def _cached(key: tuple[str, str]):
    """The cached handle of ``key`` made in this Ray session (the cache is dropped on a new one)."""
    global _handles_session
    now = connection.session()
    with _lock:
        if now != _handles_session:
            _handles.clear()
            _handles_session = now
        return _handles.get(key)


def _remember(key: tuple[str, str], handle) -> None:
    now = connection.session()
    with _lock:
        if now == _handles_session:
            _handles[key] = handle


def local_node() -> str:
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> list[str]:
    """Ids of the alive nodes, sorted (the ring order)."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def holder(node_id: str, kind: str = "mem"):
    """The holder of ``node_id`` (of tier ``kind``), started there if it does not run yet."""
    handle = _cached((kind, node_id))
    if handle is not None:
        return handle
    handle = _RemoteHolder.options(
        name=f"{_PREFIX[kind]}-{node_id}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=32, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, kind)
    _remember((kind, node_id), handle)
    return handle


def existing_holders(nodes: list[str], kind: str = "mem") -> dict[str, object]:
    """``{node: holder}`` of the given nodes that already run a holder of ``kind`` (none is started)."""
    out = {}
    for node in nodes:
        handle = _cached((kind, node))
        if handle is None:
            try:
                handle = ray.get_actor(f"{_PREFIX[kind]}-{node}", namespace=NAMESPACE)
            except ValueError:
                continue
            _remember((kind, node), handle)
        out[node] = handle
    return out


def forget(node_id: str, kind: str = "mem") -> None:
    """Drop a cached handle (its holder died)."""
    with _lock:
        _handles.pop((kind, node_id), None)


def ring_targets(local: str, nodes: list[str], replicas: int, url: str) -> list[str]:
    """The nodes that hold a file written on ``local``: ``local`` first, then ``replicas``
    others in ring order."""
    if local not in nodes:
        nodes = sorted([*nodes, local])
    if replicas > len(nodes) - 1:
        raise CheckpointError(
            f"{url}: replicas={replicas} needs {replicas + 1} alive nodes (no node holds two copies of a "
            f"file), but the cluster has {len(nodes)}; lower storage_options['replicas'] or add nodes")
    i = nodes.index(local)
    return [nodes[(i + k) % len(nodes)] for k in range(replicas + 1)]
