"""Where ``raymem://`` copies live: the alive nodes, their holder actors, and the replica ring.

Holders are named ``holder-<node id>`` in the namespace :data:`NAMESPACE`, detached (they outlive
the job that started them), pinned to their node (``NodeAffinitySchedulingStrategy(soft=False)``)
and use no CPU. Any process that reaches the cluster finds or starts them by name.

Replica placement is a ring over the alive nodes sorted by id: a file written on node ``i`` is
also held on nodes ``i+1 .. i+replicas`` (mod n), so no node holds two copies of one file and
the copies spread evenly.
"""
from __future__ import annotations

import logging
import os
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...errors import CheckpointError
from .holder import MemHolder

__all__ = ["NAMESPACE", "ensure_ray", "local_node", "alive_nodes", "holder", "existing_holders",
           "ring_targets"]

NAMESPACE = "raydcp-memstore"
_ADDRESS_ENV = "RAY_ADDRESS"

_RemoteHolder = ray.remote(MemHolder)
_handles: dict[tuple[str, str], object] = {}
# holders of the memory tier ("mem") and of node-local disk tiers ("disk"): one of each per node
_PREFIX = {"mem": "holder", "disk": "disk-holder"}
_lock = threading.Lock()


def ensure_ray(url: str) -> None:
    """Connect this process to the Ray cluster (``RAY_ADDRESS`` or the running local one).

    Once connected, ``RAY_ADDRESS`` is set for this process's children (when unset), so a helper
    process that writes for it (an async save's persister) reaches the same cluster."""
    if ray.is_initialized():
        if _ADDRESS_ENV not in os.environ:
            try:
                os.environ[_ADDRESS_ENV] = ray.get_runtime_context().gcs_address
            except Exception:
                pass
        return
    try:
        ray.init(address=os.environ.get(_ADDRESS_ENV, "auto"), log_to_driver=False,
                 logging_level=logging.ERROR)
    except Exception as exc:
        raise CheckpointError(
            f"{url}: raymem:// checkpoints live in a Ray cluster's memory, and no cluster is reachable "
            f"from this process ({type(exc).__name__}: {exc}); run where the cluster is (a Ray job, a "
            "Ray worker, or a machine with `ray start` running), or set RAY_ADDRESS") from exc


def local_node() -> str:
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> list[str]:
    """Ids of the alive nodes, sorted (the ring order)."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def holder(node_id: str, kind: str = "mem"):
    """The holder of ``node_id`` (of tier ``kind``), started there if it does not run yet."""
    with _lock:
        handle = _handles.get((kind, node_id))
    if handle is not None:
        return handle
    handle = _RemoteHolder.options(
        name=f"{_PREFIX[kind]}-{node_id}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=32, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, kind)
    with _lock:
        _handles[kind, node_id] = handle
    return handle


def existing_holders(nodes: list[str], kind: str = "mem") -> dict[str, object]:
    """``{node: holder}`` of the given nodes that already run a holder of ``kind`` (none is started)."""
    out = {}
    for node in nodes:
        with _lock:
            handle = _handles.get((kind, node))
        if handle is None:
            try:
                handle = ray.get_actor(f"{_PREFIX[kind]}-{node}", namespace=NAMESPACE)
            except ValueError:
                continue
            with _lock:
                _handles[kind, node] = handle
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
