"""raymem:// without a cluster: options checked at construction, the replica ring, URL handling."""
from __future__ import annotations

import fsspec
import pytest

import raydcp  # noqa: F401  (registers raymem:// with fsspec)
from raydcp.errors import CheckpointError
from raydcp.runtime.memstore.capacity import node_shares
from raydcp.runtime.memstore.commit import checkpoint_dir
from raydcp.runtime.memstore.placement import ring_targets


@pytest.mark.parametrize("options, key", [
    ({"replicas": -1}, "replicas"), ({"replicas": 1.5}, "replicas"), ({"keep_last": -2}, "keep_last"),
    ({"node_cap_bytes": 0}, "node_cap_bytes"), ({"node_cap_bytes": "lots"}, "node_cap_bytes"),
    ({"timeout_s": 0}, "timeout_s"),
])
def test_bad_options_are_refused_naming_the_option(options, key):
    with pytest.raises(CheckpointError, match=key):
        fsspec.filesystem("raymem", skip_instance_cache=True, **options)


def test_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAYDCP_MEMSTORE_NODE_CAP_BYTES", "4096")
    assert fsspec.filesystem("raymem", skip_instance_cache=True).node_cap_bytes == 4096
    assert fsspec.filesystem("raymem", skip_instance_cache=True, node_cap_bytes=10).node_cap_bytes == 10


def test_urls_resolve_to_the_memory_filesystem():
    fs, path = fsspec.core.url_to_fs("raymem://run-7/step-3/", replicas=2)
    assert type(fs).__name__ == "RayMemFileSystem" and path == "run-7/step-3" and fs.replicas == 2
    assert fs.unstrip_protocol(path) == "raymem://run-7/step-3"


def test_ring_places_each_copy_on_a_different_node():
    nodes = ["a", "b", "c", "d"]
    assert ring_targets("c", nodes, 2, "raymem://x") == ["c", "d", "a"]
    for local in nodes:
        for k in range(4):
            got = ring_targets(local, nodes, k, "raymem://x")
            assert got[0] == local and len(set(got)) == k + 1
    # every node holds the same number of replicas: the ring spreads them evenly
    held = [n for local in nodes for n in ring_targets(local, nodes, 1, "raymem://x")[1:]]
    assert sorted(held) == nodes
    with pytest.raises(CheckpointError, match="replicas=4 needs 5 alive nodes"):
        ring_targets("a", nodes, 4, "raymem://x")


def test_checkpoint_dir_of_data_files():
    assert checkpoint_dir("run/step-1/data/g0-0123456789ab/r00000-f000.bin") == "run/step-1"
    assert checkpoint_dir("run/step-1/data/g0-0123456789ab/journal/00000.json") == "run/step-1"
    assert checkpoint_dir("run/step-1/status.json") == "run/step-1"
    # by the checkpoint's own layout: a data component of the checkpoint's name is not its data
    assert checkpoint_dir("exp/data/step-1/data/g2-0123456789ab/r00001-f000.bin") == "exp/data/step-1"
    assert checkpoint_dir("exp/data/step-1/_raydcp/gen-000000000001.meta") == "exp/data/step-1/_raydcp"


def test_a_saves_share_of_each_node_counts_its_ranks_and_the_replicas_it_keeps():
    nodes = ["a", "b", "c"]
    sites = {("a", 1000): 100, ("b", 1000): 50}  # the ranks of a write 100 bytes, those of b 50
    share, own = node_shares(sites, nodes, 1, "raymem://x")
    assert own == {"a": 100, "b": 50}
    assert share == {"a": 100, "b": 50 + 100, "c": 50}  # ring: a's replica on b, b's on c
    assert node_shares(sites, nodes, 0, "raymem://x")[0] == {"a": 100, "b": 50}
    assert node_shares(sites, nodes, 2, "raymem://x")[0] == {"a": 150, "b": 150, "c": 150}
    assert node_shares({None: 10}, nodes, 1, "raymem://x") == ({}, {})  # a rank that did not say where
    with pytest.raises(CheckpointError, match="replicas=3 needs 4 alive nodes"):
        node_shares(sites, nodes, 3, "raymem://x")
