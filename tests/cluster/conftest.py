"""A multi-node Ray cluster on this machine for the ``cluster`` tests (one for the package).

Each node is its own raylet and object store (``ray.cluster_utils.Cluster``), tagged with a
custom resource (``node0`` for the head, ``n1``.. for the others) so tests place rank actors
on a chosen node. One process cannot be connected to this cluster and to the session's local
Ray instance at once: these tests run in a pytest process of their own (``make test`` runs
``pytest -m "not cluster"`` and then ``pytest -m cluster``).
"""
from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[2])
NODE_ARGS = dict(num_cpus=2, object_store_memory=100 * 1024 * 1024)


class NodeSet:
    """The cluster and its nodes by resource tag; ``add`` / ``remove`` change it."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.nodes: dict[str, object] = {}
        self._names = itertools.count(1)

    def add(self) -> str:
        tag = f"n{next(self._names)}"
        self.nodes[tag] = self.cluster.add_node(resources={tag: 100}, **NODE_ARGS)
        self.cluster.wait_for_nodes()
        return tag

    def remove(self, tag: str) -> None:
        self.cluster.remove_node(self.nodes.pop(tag))

    def node_id(self, tag: str) -> str:
        return self.nodes[tag].node_id


@pytest.fixture(scope="package")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("the cluster tests need a process of their own: run `pytest -m cluster tests/cluster`")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = pythonpath  # the raylets' workers (and detached holders) import this checkout
    c = Cluster(initialize_head=True, head_node_args=dict(resources={"node0": 100}, include_dashboard=False,
                                                          **NODE_ARGS))
    nodes = NodeSet(c)
    nodes.nodes["node0"] = c.head_node
    for _ in range(3):
        nodes.add()
    ray.init(address=c.address, namespace="raydcp-cluster-tests", log_to_driver=False,
             logging_level=logging.ERROR, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()
